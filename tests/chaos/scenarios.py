"""The chaos scenarios: each lands one fault on a running deployment (``deploy``) at a
point where work is held (``gated``), then accounts for every request it accepted.

Each ``scenario_*(d)`` returns an ``Outcome`` and leaves the deployment whole again
(what it killed is restarted). ``SCENARIOS`` lists them in run order; the tests in
this folder and ``bench/chaos.py`` run the same functions.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deploy import WORKERS, Deployment

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.testing import close_wait_sockets, tcp_states

TERMINAL = ("completed", "failed", "cancelled")
#: what a finished request's payloads need to go (release follows completion closely)
SETTLE_S = 8.0
#: what fds and threads may need to go back to baseline: a store client retired by a
#: recycle closes once its last call returns, and a call retrying a store host that
#: went away runs until its own deadline (``MooncakeSettings.store_retry_s``, 10 s),
#: then Mooncake's destroy takes about 1 s. A bound, not a wait: a clean run goes on
#: as soon as its counts are back
LEFTOVER_S = 20.0


@dataclass
class Outcome:
    """One scenario's account. ``lost``: accepted but unknown or unfinished at the end;
    ``duplicates``: a stage reported done twice for one request (beyond the re-runs
    the orchestrator asked for after a lost output, counted in ``reruns``), or a
    request completed twice; ``detect_s``: fault to the orchestrator acting on it (None when
    the fault is not meant to be detected); ``leaked_*``: left over after the
    scenario against the baseline taken before it."""

    name: str
    accepted: int = 0
    completed: int = 0
    failed: int = 0
    reasons: list[str] = field(default_factory=list)
    lost: int = 0
    duplicates: int = 0
    detect_s: float | None = None
    reruns: int = 0
    leaked_keys: int = 0
    leaked_fds: int = 0
    leaked_threads: int = 0
    #: extra ESTABLISHED connections of our processes (pool members to live peers; not
    #: in ``leaked_fds``, see ``leftovers``)
    pool_connections: int = 0
    #: extra fds of ``mooncake_master`` (Mooncake's binary, not counted in ``leaked_fds``)
    leaked_fds_mooncake_master: int = 0
    #: extra threads of ``mooncake_master`` (not counted in ``leaked_threads``)
    leaked_threads_mooncake_master: int = 0
    #: extra threads of our processes the fault replaced (a new process against its
    #: predecessor's baseline; not counted in ``leaked_threads``, see ``leftovers``)
    replaced_threads: int = 0
    #: extra fds (not pool connections) of our processes the fault replaced, likewise
    #: apart; their sockets in CLOSE-WAIT are still asserted (``left_by_host``)
    replaced_fds: int = 0
    #: extra threads of our processes that lived through the fault, up to their extra
    #: pool connections: the Transfer Engine's thread per pool connection (shown in
    #: ``tests/integration/test_store_recycle.py``); reported, not in ``leaked_threads``
    pool_threads: int = 0
    #: left over, by host: [fds (not pool), threads, pool connections, sockets in CLOSE-WAIT]
    left_by_host: dict[str, list[int]] = field(default_factory=dict)
    #: TCP sockets by state of those hosts, before the scenario and after it
    sockets_by_host: dict[str, list[dict[str, int]]] = field(default_factory=dict)
    #: extra fds of kinds an event loop is made of, once per process (``leftovers``)
    lazy_fds: int = 0
    #: host: the kinds of its extra fds (``fd_kinds``) against the baseline's
    fds_by_host: dict[str, dict[str, int]] = field(default_factory=dict)
    wall_s: float = 0.0
    notes: str = ""

    def row(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ accounting
def _proc_counts(pid: int) -> tuple[int, int]:
    try:
        return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0, 0


def fd_kinds(pid: int) -> Counter[str]:
    """How many fds of each kind ``pid`` holds: ``tcp:STATE`` (the kernel's state
    number: 01 ESTABLISHED, 08 CLOSE-WAIT), ``socket`` (not TCP),
    ``pipe``, ``anon_inode:[eventfd]``... or a file's path, so that an extra fd says
    what it is."""
    tcp = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                tcp[cols[9]] = cols[3]
    out: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                state = tcp.get(link[8:-1])
                out["socket" if state is None else f"tcp:{state}"] += 1
            elif link.startswith("pipe:["):
                out["pipe"] += 1
            else:
                out[link] += 1
    return out


#: ``fd_kinds``' name for an ESTABLISHED TCP socket (the kernel's state number)
ESTABLISHED = "tcp:01"
#: samples a baseline takes (``baseline``), ``BASELINE_GAP_S`` apart
BASELINE_SAMPLES, BASELINE_GAP_S = 5, 0.1


def baseline(
    d: Deployment,
) -> tuple[dict[str, tuple[int, int]], dict[str, dict[str, int]], dict[str, Counter[str]]]:
    """Each live process's (fds, threads), TCP sockets by state and fds by kind, each
    the most seen over ``BASELINE_SAMPLES`` samples: an fd a process holds nearly
    always (a connection it re-opens, an etcd poll's socket) counts as there. A
    single sample taken while it was closed made it an extra fd at the end (CI,
    2026-12-04: etcd-kill, a denoise worker one fd more, no kind more)."""
    counts: dict[str, tuple[int, int]] = {}
    states: dict[str, Counter[str]] = {}
    kinds: dict[str, Counter[str]] = {}
    for i in range(BASELINE_SAMPLES):
        if i:
            time.sleep(BASELINE_GAP_S)
        for h, p in d.procs.items():
            if p.popen.poll() is not None:
                continue
            f, t = _proc_counts(p.pid)
            f0, t0 = counts.get(h, (0, 0))
            counts[h] = (max(f, f0), max(t, t0))
            states[h] = states.get(h, Counter()) | Counter(tcp_states(p.pid))
            kinds[h] = kinds.get(h, Counter()) | fd_kinds(p.pid)
    return counts, {h: dict(c) for h, c in states.items()}, kinds


def resources(d: Deployment) -> dict[str, tuple[int, int]]:
    """(open fds, threads) of each live process, by host."""
    return {h: _proc_counts(p.pid) for h, p in d.procs.items() if p.popen.poll() is None}


def _status(d: Deployment, rid: str) -> dict[str, Any] | None:
    assert d.client is not None
    try:
        return d.client.status(rid)
    except OrchestratorError as e:  # unknown request: lost
        if "unknown" in str(e):
            return None
        raise


def settle(d: Deployment, rids: list[str], timeout: float = 240.0) -> dict[str, dict | None]:
    """Wait until every request is finished (or ``timeout``); their last statuses."""
    out: dict[str, dict | None] = {}
    deadline = time.monotonic() + timeout
    for rid in rids:
        while True:
            try:
                st = _status(d, rid)
            except Exception:  # the orchestrator is restarting: ask again
                st = {"state": "unreachable"}
            if st is None or st["state"] in TERMINAL or time.monotonic() > deadline:
                out[rid] = st
                break
            time.sleep(0.1)
    return out


def account(
    o: Outcome,
    d: Deployment,
    rids: list[str],
    base: dict[str, tuple[int, int]],
    fault_t: float | None,
    expected: dict[str, str] | None = None,
    *,
    measure: bool = True,
    rewarm: bool = False,
    sockets: dict[str, dict[str, int]] | None = None,
    fd_base: dict[str, Counter[str]] | None = None,
    pids: dict[str, int] | None = None,
    keys_before: frozenset[str] = frozenset(),
) -> Outcome:
    """Fill ``o`` from the requests' final statuses and the leftovers against ``base``
    (``measure``; store keys other than ``keys_before``, which an earlier scenario left
    and reported). ``rewarm``: first run the warm-up again, so that every process
    has its connections to a restarted store host, as ``base`` had to the old one."""
    sts = settle(d, rids)
    o.accepted = len(rids)
    for rid, st in sts.items():
        if st is None or st["state"] not in TERMINAL:
            o.lost += 1
            o.reasons.append(f"{rid}: lost ({None if st is None else st['state']})")
            continue
        kinds = Counter((e["kind"], e.get("stage")) for e in st["events"])
        # a stage is done once, and once more per Rerun of it (its output was lost)
        twice = sum(
            max(0, n - 1 - kinds[("rerun", stage)])
            for (k, stage), n in kinds.items()
            if k == "done"
        )
        if twice:  # say which: the events of the request, in order
            seen = [(e["kind"], e.get("stage"), e.get("worker_id")) for e in st["events"]]
            o.reasons.append(f"{rid}: a stage done twice: {seen}")
        o.duplicates += twice
        o.reruns += sum(n for (k, _), n in kinds.items() if k == "rerun")
        o.duplicates += max(0, kinds[("completed", None)] - 1)
        if st["state"] == "completed":
            o.completed += 1
            if expected and rid in expected:
                got = _digest(st)
                if got != expected[rid]:
                    o.duplicates += 1  # a wrong result surfaced: count it as a bad completion
                    o.reasons.append(f"{rid}: output differs from the colocated run")
        else:
            o.failed += 1
            o.reasons.extend(f"{rid}: {r}" for r in st.get("reasons", [])[-1:])
        if fault_t is not None:
            acted = [
                e["t"]
                for e in st["events"]
                if e["kind"] in ("requeued", "rerun", "failed") and e["t"] >= fault_t
            ]
            if acted:
                dt = min(acted) - fault_t
                o.detect_s = dt if o.detect_s is None else min(o.detect_s, dt)
    if measure:
        if rewarm:
            _warm(d)
        leftovers(o, d, base, sockets or {}, pids, keys_before, fd_base)
    return o


#: hosts whose processes are not ours: their leftovers are reported apart
NOT_OURS = ("master",)


def leftovers(
    o: Outcome,
    d: Deployment,
    base: dict[str, tuple[int, int]],
    sockets: dict[str, dict[str, int]],
    pids: dict[str, int] | None = None,
    keys_before: frozenset[str] = frozenset(),
    kinds: dict[str, Counter[str]] | None = None,
) -> None:
    """Fill ``o.leaked_*`` once the deployment settles (up to ``LEFTOVER_S``): store keys,
    and fds and threads above ``base`` by host (a host missing from ``base`` has no
    baseline and is not compared).

    A host whose process is not the one of ``pids`` (the baseline's) was replaced by
    the fault: its threads go to ``replaced_threads`` and its fds (other than pool
    connections) to ``replaced_fds``, reported and not asserted. A leak is what a
    process that lived through the fault kept; a new process's counts against its
    predecessor's say nothing about that, and for the store host they vary with what
    Mooncake starts lazily (clean-clone runs on 2026-12-02 failed store_kill on one
    extra thread, and later on three extra fds, none in CLOSE-WAIT). Its sockets in
    CLOSE-WAIT, what a dead peer leaves, stay asserted.

    Extra fds that are ESTABLISHED TCP connections (more than the host had before,
    ``sockets``) are Transfer Engine pool members to live peers, whose number varies
    with how transfers overlapped: they are counted in ``pool_connections``, not in
    ``leaked_fds``. Every other extra fd (a CLOSE-WAIT socket, a pipe, an epoll...)
    of our processes is in ``leaked_fds``, every extra thread in ``leaked_threads``;
    the master's go to ``leaked_fds_mooncake_master`` and
    ``leaked_threads_mooncake_master`` (after master_kill the master is a new process
    compared with its predecessor's baseline).

    One exception, bounded (``LAZY_KINDS``): a process that lived through the fault
    may gain, once in its life, one fd of each kind an event loop is made of (an
    eventfd, an epoll, a timerfd), as Mooncake allocates its loop lazily; those go to
    ``lazy_fds``, reported and not asserted. A second one of a kind on the same
    process, in this scenario or a later one on the deployment, is in ``leaked_fds``:
    a fault that leaks such an fd each time it lands is caught the second time.

    Sockets in CLOSE-WAIT are read in the same pass and waited for too: a peer that
    closes a pool connection as the scenario ends leaves the other end in CLOSE-WAIT
    until that process reads the close and closes its own. CI's run of 2026-12-05
    failed den-partition on one such socket in the store host, read just after the
    pass that found its fds at baseline; the fds by kind read just after that showed
    no extra socket in CLOSE-WAIT, so it was closed meanwhile (inferred, not shown).
    One still there at ``LEFTOVER_S`` is what a dead peer leaves, and asserted."""
    deadline = time.monotonic() + LEFTOVER_S
    lazy: dict[str, Counter[str]] = {}
    while True:
        keys = [
            k for k in d.store_keys() if not k.startswith("mcd-cache/emb/") and k not in keys_before
        ]
        now = resources(d)
        states = {h: tcp_states(d.procs[h].pid) for h in now}
        extra: dict[str, list[int]] = {}
        for h in now:
            if h not in base:
                continue
            if kinds and h in kinds:  # by kind: an fd that moved kind is no extra fd
                got = fd_kinds(d.procs[h].pid) - kinds[h]
                fds, est = sum(got.values()), got[ESTABLISHED]
            else:
                fds = max(0, now[h][0] - base[h][0])
                est = states[h].get("ESTABLISHED", 0) - sockets.get(h, {}).get("ESTABLISHED", 0)
            pool = min(fds, max(0, est))
            thr = max(0, now[h][1] - base[h][1])
            # threads up to the extra pool connections go with them (pool_threads)
            extra[h] = [fds - pool, thr - min(thr, pool), pool, min(thr, pool)]
        replaced = {h for h in extra if pids is not None and d.procs[h].pid != pids.get(h)}
        lazy = {
            h: _lazy(d.procs[h].pid, fd_kinds(d.procs[h].pid) - kinds[h])
            for h in extra
            if kinds and h in kinds and h not in replaced and h not in NOT_OURS and extra[h][0]
        }
        for h, got in lazy.items():
            extra[h][0] -= min(extra[h][0], sum(got.values()))
        ours = sum(e[0] for h, e in extra.items() if h not in NOT_OURS and h not in replaced)
        thr = sum(e[1] for h, e in extra.items() if h not in NOT_OURS and h not in replaced)
        # sockets in CLOSE-WAIT of the hosts reported below, read in the same pass: one
        # the process closes on its own within the bound is no leak (CI, 2026-12-05)
        close_wait = {
            h: len(close_wait_sockets(d.procs[h].pid)) for h, e in extra.items() if any(e)
        }
        settled = not keys and not ours and not thr and not any(close_wait.values())
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    for h, got in lazy.items():
        _LAZY_SEEN[d.procs[h].pid].update(got)
    o.lazy_fds = sum(sum(got.values()) for got in lazy.values())
    if o.lazy_fds:
        granted = {h: dict(got) for h, got in lazy.items() if got}
        print(f"chaos: {o.name}: lazy fds (once per process): {granted}", file=sys.stderr)
    if keys:
        print(f"chaos: store keys left over: {keys[:5]}", file=sys.stderr)
    o.leaked_keys, o.leaked_fds, o.leaked_threads = len(keys), ours, thr
    o.pool_connections = sum(e[2] for h, e in extra.items() if h not in NOT_OURS)
    o.pool_threads = sum(e[3] for h, e in extra.items() if h not in NOT_OURS and h not in replaced)
    # every extra fd of a process not ours, pool connections included
    o.leaked_fds_mooncake_master = sum(extra[h][0] + extra[h][2] for h in NOT_OURS if h in extra)
    o.leaked_threads_mooncake_master = sum(
        extra[h][1] + extra[h][3] for h in NOT_OURS if h in extra
    )
    o.replaced_threads = sum(extra[h][1] + extra[h][3] for h in replaced if h not in NOT_OURS)
    o.replaced_fds = sum(extra[h][0] for h in replaced if h not in NOT_OURS)
    o.left_by_host = {
        h: [f, t + pt, p, close_wait.get(h, 0)]
        for h, (f, t, p, pt) in extra.items()
        if f or t or p or pt
    }
    o.sockets_by_host = {h: [sockets.get(h, {}), states.get(h, {})] for h in o.left_by_host}
    o.fds_by_host = {
        h: dict(fd_kinds(d.procs[h].pid) - kinds[h])
        for h in o.left_by_host
        if kinds and h in kinds and h in d.procs
    }
    if o.left_by_host:
        names = {h: _thread_names(d.procs[h].pid) for h in o.left_by_host if h in d.procs}
        print(
            f"chaos: {o.name}: left over by host {o.left_by_host}, sockets {o.sockets_by_host}, "
            f"extra fds by kind {o.fds_by_host}, "
            f"threads by name now {names}",
            file=sys.stderr,
        )


#: the fds an event loop is made of: a process may gain one of each once (``leftovers``)
LAZY_KINDS = ("anon_inode:[eventfd]", "anon_inode:[eventpoll]", "anon_inode:[timerfd]")
#: pid: the lazy fds already granted to that process
_LAZY_SEEN: defaultdict[int, Counter[str]] = defaultdict(Counter)


def _lazy(pid: int, extra: Counter[str]) -> Counter[str]:
    """Of ``pid``'s extra fds by kind, those granted as its once-only lazy allocation."""
    seen = _LAZY_SEEN[pid]
    return Counter({k: min(extra[k], 1 - seen[k]) for k in LAZY_KINDS if extra[k] and seen[k] < 1})


def _thread_names(pid: int) -> dict[str, int]:
    """How many threads of ``pid`` carry each name (``/proc/PID/task/*/comm``), so a
    report of extra threads says whose they are."""
    names: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
    return dict(names)


def _digest(st: dict) -> str:
    import base64
    import json

    return json.loads(base64.b64decode(st["output"]))["sha256"]


_COLOCATED: dict[str, str] = {}
_RUNS = itertools.count()


def colocated(params: dict[str, Any]) -> str:
    """The digest of the same request run colocated in this process (the ground truth)."""
    from mooncake_diffusion.orchestrator.worker.reference import frames_digest
    from mooncake_diffusion.pipeline.params import GenerationParams
    from mooncake_diffusion.pipeline.reference import ReferencePipeline

    key = repr(sorted(params.items()))
    if key not in _COLOCATED:
        fields = {k: v for k, v in params.items() if k not in ("chunks", "save")}
        _COLOCATED[key] = frames_digest(
            ReferencePipeline().run_colocated(GenerationParams(**fields))
        )
    return _COLOCATED[key]


class Run:
    """A scenario's requests: submit with a hold, remember the ground truth."""

    def __init__(self, d: Deployment, name: str) -> None:
        self.d, self.name = d, name
        self.prefix = f"{name}{next(_RUNS)}"  # request ids stay unique when a scenario repeats
        self.rids: list[str] = []
        self.expected: dict[str, str] = {}
        self.t0 = time.monotonic()
        self.pids = {h: p.pid for h, p in d.procs.items() if p.popen.poll() is None}
        self.base, self.sockets, self.kinds = baseline(d)
        #: keys an earlier scenario left (and reported): not this one's leak
        self.keys_before = frozenset(d.store_keys())

    def submit(self, tag: str, hold: dict[str, int] | None = None, **params: Any) -> str:
        rid = f"{self.prefix}-{tag}"
        p = {"prompt": f"chaos {rid}", "seed": len(self.rids) + 1, "steps": 4, "guidance": 1.0}
        p.update(params)
        self.expected[rid] = colocated(p)
        self.d.submit(rid, hold, **p)
        self.rids.append(rid)
        return rid

    def finish(
        self,
        fault_t: float | None,
        notes: str = "",
        *,
        measure: bool = True,
        rewarm: bool = False,
        outcome: Outcome | None = None,
    ) -> Outcome:
        """Account for the run's requests (``account``) into ``outcome`` (default: a
        new ``Outcome``)."""
        o = account(
            outcome or Outcome(self.name, notes=notes),
            self.d,
            self.rids,
            self.base,
            fault_t,
            self.expected,
            measure=measure,
            rewarm=rewarm,
            sockets=self.sockets,
            fd_base=self.kinds,
            pids=self.pids,
            keys_before=self.keys_before,
        )
        o.wall_s = round(time.monotonic() - self.t0, 2)
        return o


def _holder(d: Deployment, rid: str) -> str:
    """The worker (= host) running ``rid`` now."""
    assert d.client is not None
    wid = d.client.status(rid)["worker_id"]
    assert wid in WORKERS, wid
    return wid


@contextlib.contextmanager
def running(net: Any, d: Deployment) -> Iterator[Deployment]:
    """``net`` up (namespaces), ``d`` started and warmed up (``warm_up``); afterwards
    everything stopped, each of our processes asserted to have exited 0 after SIGTERM
    when the block ended cleanly, and the namespaces asserted gone."""
    with net:
        try:
            d.up()
            w = warm_up(d)
            assert w.completed == 2 and not w.lost, w
            yield d
            rcs = d.down()
            assert all(rc == 0 for rc in rcs.values()), rcs  # SIGTERM: each drains, exits 0
        finally:
            d.down()
    assert net.leftovers() == [], net.leftovers()


# ------------------------------------------------------------------ scenarios
def warm_up(d: Deployment, *, recycle: bool = True) -> Outcome:
    """Two requests held at every stage so that each worker runs one (credits are 1):
    every process has made its connections and threads before baselines are taken.
    They are chunked like the scenarios' decode jobs (5 frames, 2 chunks), so each
    worker's Transfer Engine has opened the connections such a transfer uses.

    ``recycle``: then restart the store host (nothing in flight), wait until every
    worker has recycled its store clients, and run the requests again against the
    new host. A process's first recycle allocates, once, an event loop of Mooncake's
    (an eventfd, an epoll, a timerfd and a thread) that later recycles reuse; the
    baselines are taken after it, as after every other warm-up (docs/chaos.md)."""
    r = Run(d, "warm")
    _warm(d, r)
    if recycle:
        settle(d, r.rids)  # nothing in flight when the store host goes
        restart_store_host(d)
        for h in WORKERS:
            d.procs[h].wait_for("store client recycled", timeout=120)
        _warm(d)
    return r.finish(None, measure=False)


def restart_store_host(d: Deployment) -> set[str]:
    """SIGKILL the store host and start a new one; the segments listed before."""
    old = set(d.segments())
    d.procs["store"].kill()
    d.start_store(avoid=old)
    return old


def _warm(d: Deployment, r: Run | None = None) -> None:
    """The warm-up's requests (in ``r``, else in a run of their own), until finished."""
    own = r is None
    r = r or Run(d, "warm")
    rids = [r.submit(f"w{i}", {"denoise": 1, "decode": 0}, frames=5, chunks=2) for i in range(2)]
    for stage in ("denoise", "decode"):
        holders = set()
        for rid in rids:
            d.reached(rid, stage)
            holders.add(_holder(d, rid))
        for rid in rids:
            d.release(rid, stage)
        assert len(holders) == 2, (stage, holders)
    if own:
        w = r.finish(None, measure=False)
        assert w.completed == len(rids), w


def scenario_denoise_partition(d: Deployment) -> Outcome:
    """A denoise host is cut off mid-job (held at step 1 of 3) and healed after the
    orchestrator re-queued its job: the job resumes on the other denoise host, the
    late result of the cut-off one is dropped."""
    r = Run(d, "den-partition")
    a = r.submit("a", {"denoise": 1}, steps=3)
    r.submit("b")
    d.reached(a, "denoise")
    victim = _holder(d, a)
    fault_t = time.time()
    d.net.partition(victim)
    d.release(a, "denoise")
    _wait_event(d, a, "requeued")
    d.net.heal(victim)
    return r.finish(fault_t, notes=f"partitioned {victim}")


def scenario_store_kill(d: Deployment) -> Outcome:
    """The store host is SIGKILLed while request ``a`` holds at denoise step 1 (its
    first checkpoint in the pool) and ``b`` holds before its denoise consumed its
    embeddings (they are in the pool), and restarted with an empty pool. Once the
    master lists only the new store host the held work goes on: ``a`` checkpoints into
    the new pool, ``b`` finds its embeddings gone and the orchestrator re-runs its
    encode (``Rerun``). Both complete. The time to detect is counted from that
    release: the orchestrator can only learn of a store fault through a store call."""
    r = Run(d, "store-kill")
    a = r.submit("a", {"denoise": 1}, steps=3)
    b = r.submit("b", {"denoise": 0})
    d.reached(a, "denoise")
    d.reached(b, "denoise")
    old = restart_store_host(d)
    return _resume(d, r, old, (a, b), "store host killed and restarted")


def scenario_master_kill(d: Deployment) -> Outcome:
    """The Mooncake master is SIGKILLed while ``a`` holds mid-denoise and ``b`` holds
    before its denoise consumed its embeddings, then restarted on its address
    (metadata is gone: the store host re-mounts an empty pool). Released, ``a`` goes
    on; ``b`` finds its embeddings gone and its encode is re-run. Both complete."""
    r = Run(d, "master-kill")
    a = r.submit("a", {"denoise": 1}, steps=3)
    b = r.submit("b", {"denoise": 0})
    d.reached(a, "denoise")
    d.reached(b, "denoise")
    old = set(d.segments())
    d.procs["master"].kill()
    d.start_master()
    d.procs["store"].stop()  # its segment died with the master's metadata
    d.start_store(avoid=old)
    return _resume(d, r, old, (a, b), "master killed and restarted; store host restarted")


def _resume(d: Deployment, r: Run, old: set[str], held: tuple[str, ...], notes: str) -> Outcome:
    """Once the master lists one store segment, not one of ``old`` (a killed store
    host's segment stays listed until its client TTL runs out), release the ``held``
    denoise jobs: the fault meets the work from then on (``fault_t``)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            now = d.segments()
        except OSError:  # the master is still coming up
            now = []
        if len(now) == 1 and now[0] not in old:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"store segments {now} (before the fault: {sorted(old)})")
        time.sleep(0.1)
    fault_t = time.time()
    for rid in held:
        d.release(rid, "denoise")
    # the baseline had warm connections to the old store host: compare after the same
    # warm-up against the new one (a fresh pool to a new peer is not a leak; a socket
    # left to the dead one is, and is counted)
    return r.finish(fault_t, notes=notes, rewarm=True)


def scenario_decode_stopped(d: Deployment) -> Outcome:
    """A decode worker is SIGSTOPped holding a job past its heartbeat deadline; the other
    decode worker finishes it; SIGCONT lets the stopped one finish its stale attempt,
    whose result is dropped."""
    r = Run(d, "dec-stop")
    a = r.submit("a", {"decode": 0}, frames=5, chunks=2)
    d.reached(a, "decode")
    victim = _holder(d, a)
    fault_t = time.time()
    d.procs[victim].signal(signal.SIGSTOP)
    _wait_event(d, a, "requeued")
    st = d.client.wait(a, timeout=180)  # type: ignore[union-attr]
    d.procs[victim].signal(signal.SIGCONT)
    d.release(a, "decode")
    _restart_if_gone(d, victim)
    o = r.finish(fault_t, notes=f"stopped {victim}; completed while stopped: {st['state']}")
    return o


def scenario_full_pool(d: Deployment) -> Outcome:
    """Another tenant fills the store pool; requests meanwhile fail with a reason (or
    wait); once the tenant leaves, new requests complete."""
    r = Run(d, "full-pool")
    filler = d.net.spawn(
        "orch", [sys.executable, str(Path(__file__).with_name("filler.py"))], d.env("orch")
    )
    filler.wait_for("full ", timeout=120)
    fault_t = time.time()
    for i in range(2):
        r.submit(f"during{i}")
    settle(d, list(r.rids))
    filler.stop()
    r.submit("after")
    said = [line for line in filler.output().splitlines() if line.startswith("full ")]
    return r.finish(fault_t, notes=(said or ["the tenant said nothing"])[0])


def scenario_orchestrator_restart(d: Deployment) -> Outcome:
    """The orchestrator is SIGKILLed with four requests in flight (one held mid-denoise)
    and restarted on its journal: every accepted request is still there and finishes."""
    r = Run(d, "orch-restart")
    a = r.submit("a", {"denoise": 1}, steps=3)
    for i in range(3):
        r.submit(f"b{i}")
    d.reached(a, "denoise")
    d.procs["orch"].kill()
    d.start_orchestrator()
    d.release(a, "denoise")
    return r.finish(None, notes="orchestrator killed and restarted on its journal")


def scenario_link_flap(d: Deployment) -> Outcome:
    """A decode host's link goes down and up again well inside the heartbeat timeout
    while it holds a job: nothing is re-queued and the job completes once."""
    r = Run(d, "link-flap")
    a = r.submit("a", {"decode": 0}, frames=5, chunks=2)
    d.reached(a, "decode")
    victim = _holder(d, a)
    d.net.partition(victim)
    time.sleep(min(0.5, d.heartbeat_timeout / 4))
    d.net.heal(victim)
    d.release(a, "decode")
    return r.finish(None, notes=f"flapped {victim}")


def scenario_p2p_partition(d: Deployment) -> Outcome:
    """Denoise workers publish peer to peer; the producer host of a latent is cut off
    after the decode worker received its first chunk (the producer holds before the
    second), and healed once the orchestrator acted: the decode worker gives the
    silent producer up (``peer_timeout_s`` = the heartbeat timeout), the latent is
    made again, and the request completes or fails with a reason, never vanishes."""
    for h in ("den0", "den1"):
        d.procs[h].stop()
    d.transfer_mode = "p2p"
    try:
        for h in ("den0", "den1"):
            d.start_worker(h, wait=False)
        for h in ("den0", "den1"):
            d.procs[h].wait_for("worker ready", timeout=120)
        # the restarted workers' baseline is their own, after the same warm-up as the
        # others' (now peer to peer: the p2p transport is made on first use)
        _warm(d)
        r = Run(d, "p2p-partition")
        a = r.submit("a", {"serve": 1}, frames=9, chunks=3)
        d.reached(a, "serve")
        st = d.client.status(a)  # type: ignore[union-attr]
        producer = next(
            e["worker_id"] for e in st["events"] if e["kind"] == "done" and e["stage"] == "denoise"
        )
        fault_t = time.time()
        d.net.partition(producer)
        d.release(a, "serve")
        _wait_event(d, a, ("requeued", "rerun", "failed", "completed"))
        d.net.heal(producer)
        return r.finish(fault_t, notes=f"partitioned producer {producer}")
    finally:
        d.transfer_mode = "store"


def _wait_event(
    d: Deployment, rid: str, kinds: str | tuple[str, ...], timeout: float = 120.0
) -> None:
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = d.client.status(rid)  # type: ignore[union-attr]
        if any(e["kind"] in kinds for e in st["events"]) or st["state"] in kinds:
            return
        time.sleep(0.05)
    raise AssertionError(f"{rid}: no {kinds} event within {timeout}s")


def _restart_if_gone(d: Deployment, host: str, grace: float = 5.0) -> None:
    p = d.procs[host]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and p.popen.poll() is None:
        time.sleep(0.1)
    if p.popen.poll() is not None:
        d.start_worker(host)


SCENARIOS = [
    scenario_denoise_partition,
    scenario_decode_stopped,
    scenario_link_flap,
    scenario_orchestrator_restart,
    scenario_full_pool,
    scenario_store_kill,
    scenario_master_kill,
    scenario_p2p_partition,
]
