"""Chaos: faults on network-namespace hosts, fuzzing, a service soak, mailbox races.

    python bench/chaos.py --quick --json /tmp/chaos.json

Runs, in one process and one report:
1. the chaos scenarios of ``tests/chaos/scenarios.py`` (the reference pipeline on
   namespaced hosts: partitions, SIGKILL/SIGSTOP of master, store host, orchestrator
   and workers, a full pool, a p2p producer cut off mid-transfer), one row each;
2. the Hypothesis fuzz targets of ``tests/chaos/fuzz.py`` (cases run, crashes);
3. the service soak of ``tests/chaos/soak.py`` (1,000 requests; 100 with --quick)
   with random cancels and worker SIGKILLs;
4. concurrent takers of one mailbox key across processes (keys taken twice);
5. the orchestrator group on etcd (``tests/chaos/ha_scenarios.py``: two
   orchestrators, a three-member etcd, each on namespaced hosts): the leader's host
   killed, cut off, cut off etcd alone, and the etcd member under it killed, with
   work in flight; ``failover_s`` is the fault to the new leader's first dispatch
   running on a worker;
6. in the same namespaced deployment, on its three-member etcd: the Mooncake master
   leader (two ``-enable_ha`` masters on different hosts) SIGKILLed with a store
   request held between its put and its get (``tests/chaos/master_scenario.py``:
   ``master_failover_s``, kill to a put and get working again), and a spill burst
   4x a 64 MiB spilling pool from another host (``tests/chaos/spill_scenario.py``:
   ``spill_burst_completed`` of ``spill_burst_objects``); ``master_failover_on`` and
   ``spill_burst_on`` say where the figures came from;
7. only where 6 could not run (no root, or the scenario broke): ``bench/ha.py``'s
   loopback rows (real etcd and masters, not namespaced hosts) as the fallback, said
   so in ``master_failover_on`` / ``spill_burst_on``.

``--quick`` runs the same scenarios (each once, as in the full run) and the same
fuzz targets, soak and race with fewer cases, requests and keys; fuzz cases go to
Hypothesis in batches (``fuzz.run(..., batch=)``: one example is a list of inputs,
each checked), which keeps 21,000 cases to a minute or so. Without root (``ip netns``) the scenarios
are reported as not run, with the reason; the rest still runs.
Summary: scenarios, lost_requests, duplicate_completions, leaked_keys, leaked_fds
(our processes: workers, orchestrator, store host; extra ESTABLISHED connections to
live peers are pool members, counted in pool_connections), leaked_threads (ours),
leaked_fds_mooncake_master and leaked_threads_mooncake_master (the master binary's,
reported apart: docs/chaos.md), replaced_threads and replaced_fds (processes the
fault replaced, against their predecessors' baselines: reported apart), lazy_fds (an
event loop's eventfd, epoll and timerfd, granted once per process: docs/chaos.md), fuzz_cases,
fuzz_crashes, max_detect_s (<= 2x heartbeat_timeout_s), mailbox_double_takes, soak_*,
orchestrator_failover_s (the slowest orchestrator scenario; per scenario in
orchestrator_failover_s_by_scenario) against orchestrator_lease_s, etcd_failover_s,
failover_within_2x_lease, fenced_actions, master_failover_s, spill_burst_completed
(of spill_burst_objects). lost_requests, duplicate_completions and leaked_keys count
every part.

Only the HA scenarios, cheap enough to run beside ``stress-ng --cpu 2``:
``bench/chaos.py --quick --skip scenarios --skip fuzz --skip soak --skip race
--skip ha_loopback --json F``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "chaos"), str(ROOT / "tests")]

import fuzz  # noqa: E402
import ha  # noqa: E402  (bench/ha.py: its master failover and spill rows)
import ha_scenarios  # noqa: E402
import mailbox_race  # noqa: E402
import master_scenario  # noqa: E402
import scenarios  # noqa: E402
import spill_scenario  # noqa: E402
from deploy import HEARTBEAT_S, HOSTS, Deployment  # noqa: E402
from ha_deploy import HA_HOSTS, LEASE_S, EtcdHosts, HaDeployment  # noqa: E402
from hosts import Hosts, available  # noqa: E402
from soak import soak  # noqa: E402

from mooncake_diffusion._mooncake.cluster import LocalCluster  # noqa: E402
from mooncake_diffusion.platform.etcd import EtcdCluster  # noqa: E402

#: the spill row's burst, in multiples of its 64 MiB pool (the same in --quick)
SPILL_X = spill_scenario.SPILL_X
#: the Store scenarios run in the HA deployment (their rows: part ``store_scenario``)
STORE_SCENARIOS = [master_scenario.scenario_master_leader_kill, spill_scenario.scenario_spill_burst]


def run_scenarios(work: Path, only: list[str]) -> tuple[list[dict[str, Any]], str | None]:
    why = available()
    if why is not None:
        return [], why
    net = Hosts(HOSTS, str(work))
    d = Deployment(net, work, heartbeat_timeout=HEARTBEAT_S)
    return _rows(net, d, scenarios.SCENARIOS, "scenario", only), None


def run_ha_scenarios(work: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """The orchestrator group's scenarios and the Store's master-kill and spill
    scenarios on namespaced hosts (one deployment): (orchestrator rows, Store
    rows, why not run)."""
    why = available()
    if why is not None:
        return [], [], why
    net = EtcdHosts(HA_HOSTS, str(work))
    d = HaDeployment(net, work, heartbeat_timeout=HEARTBEAT_S)
    fns = [*ha_scenarios.HA_SCENARIOS, *STORE_SCENARIOS]
    rows = _rows(net, d, fns, "ha scenario", [])  # one row per scenario, in order
    n = len(ha_scenarios.HA_SCENARIOS)
    store_rows = [{**r, "scenario": k} for r, k in zip(rows[n:], _STORE_KEYS, strict=True)]
    return rows[:n], store_rows, None


#: the Store scenarios' rows, in ``STORE_SCENARIOS``' order, say which they are thus
_STORE_KEYS = ("master", "spill")


def _rows(net: Hosts, d: Deployment, fns: list[Any], kind: str, only: list[str]) -> list[Any]:
    """Start ``d`` on ``net``, warm it up, run each of ``fns`` (those named in ``only``,
    when given) for its row; a scenario that breaks is a row with its error."""
    rows = []
    with net:
        try:
            d.up()
            scenarios.warm_up(d)
            for fn in fns:
                name = fn.__name__[9:]
                if only and name not in only:
                    continue
                print(f"[chaos] {kind} {name} ...", file=sys.stderr, flush=True)
                try:
                    rows.append(fn(d).row())
                except Exception as e:  # a scenario that breaks is a result, not a crash
                    traceback.print_exc()
                    rows.append({"name": name, "error": f"{type(e).__name__}: {e}"})
                    d.release_all()
        finally:
            d.down()
    after = net.leftovers()
    if after:
        print(f"[chaos] namespaces left behind: {after}", file=sys.stderr)
    return rows


def run_ha_loopback() -> list[dict[str, Any]]:
    """``bench/ha.py``'s master failover (OpLog on) and one spill burst, on loopback."""
    with EtcdCluster(1) as etcd:
        master = ha.failover_row(etcd, True, 8, 0)
    return [master, ha.spill_row(True, SPILL_X)]


#: inputs per Hypothesis example (the live HTTP API answers one request per case anyway)
FUZZ_BATCH = 25


def run_fuzz(total: int) -> list[dict[str, Any]]:
    per = math.ceil(total / len(fuzz.NAMES))
    rows = []
    for name in fuzz.NAMES:
        t = time.monotonic()
        try:
            n, crash = fuzz.run(name, per, batch=FUZZ_BATCH), None
        except Exception as e:
            n, crash = per, f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(
            {"target": name, "cases": n, "crash": crash, "wall_s": round(time.monotonic() - t, 2)}
        )
        print(f"[chaos] fuzz {name}: {n} cases, crash {crash}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer fuzz cases, soak requests, keys")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["scenarios", "fuzz", "soak", "race", "ha", "ha_loopback"],
    )
    ap.add_argument(
        "--scenario",
        action="append",
        default=[],
        choices=[f.__name__[9:] for f in scenarios.SCENARIOS],
        help="run only these scenarios (repeatable; a diagnosis aid: the summary then "
        "counts fewer than the Done-when asks)",
    )
    ap.add_argument("--table-from", metavar="PATH", help="only print the table of a JSON result")
    a = ap.parse_args(argv)
    if a.table_from:
        print(table(json.loads(Path(a.table_from).read_text())))
        return 0
    fuzz_total = 21_000 if a.quick else 80_000
    soak_n = 100 if a.quick else 1000
    race_keys = 30 if a.quick else 300
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="mcd-chaos-"))
    out: dict[str, Any] = {
        "bench": "chaos",
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_start": os.getloadavg(),
        },
        "config": {
            "quick": a.quick,
            "fuzz_cases": fuzz_total,
            "fuzz_batch": FUZZ_BATCH,
            "soak_requests": soak_n,
            "race_keys": race_keys,
            "heartbeat_timeout_s": HEARTBEAT_S,
        },
        "rows": [],
    }
    scen, not_run = (
        ([], "skipped") if "scenarios" in a.skip else run_scenarios(work / "net", a.scenario)
    )
    ha_rows, store_rows, ha_not_run = (
        ([], [], "skipped") if "ha" in a.skip else run_ha_scenarios(work / "ha")
    )
    ns = {r["scenario"]: r for r in store_rows if "error" not in r}
    loop = run_ha_loopback() if len(ns) < 2 and "ha_loopback" not in a.skip else []
    why_ns = {  # why a namespace Store scenario gave no figure (then the loopback one)
        k: ha_not_run
        or next((r["error"] for r in store_rows if r["scenario"] == k and "error" in r), "not run")
        for k in _STORE_KEYS
    }
    fz = [] if "fuzz" in a.skip else run_fuzz(fuzz_total)
    sk: dict[str, Any] = {}
    race: dict[str, Any] = {}
    if not {"soak", "race"} <= set(a.skip):
        with LocalCluster(pool_bytes=256 << 20) as cluster:
            if "soak" not in a.skip:
                print(f"[chaos] soak {soak_n} requests ...", file=sys.stderr, flush=True)
                (work / "soak").mkdir()
                sk = soak(cluster, work / "soak", soak_n, seed=1, kills=max(3, soak_n // 100))
            if "race" not in a.skip:
                race = mailbox_race.race(cluster.settings, 4, race_keys)
    out["rows"] = (
        [{"part": "scenario", **r} for r in scen]
        + [{"part": "fuzz", **r} for r in fz]
        + ([{"part": "soak", **sk}] if sk else [])
        + ([{"part": "mailbox_race", **race}] if race else [])
        + [{"part": "ha_scenario", **r} for r in ha_rows]
        + [{"part": "store_scenario", **r} for r in store_rows]
        + [{**r, "part": f"ha_loopback {r['part']}"} for r in loop]
    )
    ok = [r for r in scen if "error" not in r]
    ha_ok = [r for r in ha_rows if "error" not in r]
    orch = {r["name"]: r["failover_s"] for r in ha_ok if r["failover_of"] == "orchestrator"}
    etcd_s = [r["failover_s"] for r in ha_ok if r["failover_of"] == "etcd"]
    master_loop = next((r for r in loop if r["part"] == "master failover"), None)
    spill_loop = next((r for r in loop if r["part"] == "spill burst"), None)
    store_ok = [r for r in store_rows if "error" not in r]
    detect = [r["detect_s"] for r in ok if r.get("detect_s") is not None]
    out["summary"] = {
        "scenarios": len(ok),
        "scenarios_not_run": not_run,
        "scenario_errors": [r["name"] for r in scen if "error" in r],
        "requests_accepted": sum(r["accepted"] for r in ok),
        "requests_completed": sum(r["completed"] for r in ok),
        "requests_failed_with_reason": sum(r["failed"] for r in ok),
        "reruns": sum(r.get("reruns", 0) for r in ok),
        "lost_requests": sum(r["lost"] for r in ok + ha_ok) + sk.get("lost", 0),
        "duplicate_completions": sum(r["duplicates"] for r in ok + ha_ok) + sk.get("duplicates", 0),
        "leaked_keys": sum(r["leaked_keys"] for r in ok + ha_ok + store_ok + loop)
        + sk.get("leaked_keys", 0),
        "leaked_fds": sum(r["leaked_fds"] for r in ok) + sk.get("leaked_fds", 0),
        "leaked_fds_mooncake_master": sum(r.get("leaked_fds_mooncake_master", 0) for r in ok),
        "pool_connections": sum(r.get("pool_connections", 0) for r in ok),
        "lazy_fds": sum(r.get("lazy_fds", 0) for r in ok + ha_ok),
        "leaked_threads": sum(r["leaked_threads"] for r in ok) + sk.get("leaked_threads", 0),
        "leaked_threads_mooncake_master": sum(
            r.get("leaked_threads_mooncake_master", 0) for r in ok
        ),
        "replaced_threads": sum(r.get("replaced_threads", 0) for r in ok),
        "replaced_fds": sum(r.get("replaced_fds", 0) for r in ok),
        "pool_threads": sum(r.get("pool_threads", 0) for r in ok),
        "heartbeat_timeout_s": HEARTBEAT_S,
        "max_detect_s": round(max(detect), 3) if detect else None,
        "fuzz_cases": sum(r["cases"] for r in fz),
        "fuzz_crashes": sum(1 for r in fz if r["crash"]),
        "mailbox_double_takes": race.get("double_takes"),
        "mailbox_race_keys": race.get("keys"),
        "soak_requests": sk.get("accepted"),
        "soak_completed": sk.get("completed"),
        "soak_cancelled": sk.get("cancelled"),
        "soak_failed": sk.get("failed"),
        "soak_worker_kills": sk.get("worker_kills"),
        "soak_leaked_processes": sk.get("leaked_processes"),
        "ha_scenarios": len(ha_ok),
        "ha_scenarios_not_run": ha_not_run,
        "ha_scenario_errors": [r["name"] for r in ha_rows if "error" in r],
        "orchestrator_failover_s": max(orch.values()) if orch else None,
        "orchestrator_failover_s_by_scenario": orch,
        "orchestrator_lease_s": LEASE_S,
        "etcd_failover_s": max(etcd_s) if etcd_s else None,
        "failover_within_2x_lease": (
            all(v <= 2 * LEASE_S for v in [*orch.values(), *etcd_s]) if ha_ok else None
        ),
        "fenced_actions": sum(r["fenced_actions"] for r in ha_ok),
        "store_scenario_errors": [r["name"] for r in store_rows if "error" in r],
        **_master_summary(ns.get("master"), master_loop, why_ns["master"]),
        **_spill_summary(ns.get("spill"), spill_loop, why_ns["spill"]),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    out["machine"]["loadavg_end"] = os.getloadavg()  # with _start: how busy the run was
    print(table(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


def _master_summary(
    ns: dict[str, Any] | None, loop: dict[str, Any] | None, why: str
) -> dict[str, Any]:
    """``master_failover_*`` from the namespace scenario, else the loopback row."""
    if ns is not None:
        return {
            "master_failover_s": ns["failover_s"],
            "master_failover_on": "namespace hosts (two -enable_ha masters on the "
            "three-member etcd, OpLog on; tests/chaos/master_scenario.py)",
            "master_request_completed": ns["completed"],
            "master_input_kept": ns["kept"],
        }
    return {
        "master_failover_s": loop["failover_s"] if loop else None,
        "master_failover_on": (
            f"loopback (bench/ha.py failover_row, OpLog on): namespace scenario not run: {why}"
            if loop
            else None
        ),
    }


def _spill_summary(
    ns: dict[str, Any] | None, loop: dict[str, Any] | None, why: str
) -> dict[str, Any]:
    """``spill_burst_*`` from the namespace scenario, else the loopback row."""
    where = f"{SPILL_X}x a 64 MiB pool, 8 MiB objects"
    if ns is not None:
        return {
            "spill_burst_completed": ns["intact"],
            "spill_burst_objects": ns["objects"],
            "spill_burst_on": f"namespace hosts ({where}; tests/chaos/spill_scenario.py)",
        }
    return {
        "spill_burst_completed": loop["intact"] if loop else None,
        "spill_burst_objects": loop["objects"] if loop else None,
        "spill_burst_on": (
            f"loopback ({where}): namespace scenario not run: {why}" if loop else None
        ),
    }


def table(out: dict[str, Any]) -> str:
    lines = [
        "| scenario | accepted | completed | failed (reason) | lost | dup | detect s | "
        "keys | fds | threads | pool conns | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        if r["part"] not in ("scenario", "ha_scenario"):
            continue
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:80]} ||||||||||")
            continue
        det = "-" if r["detect_s"] is None else f"{r['detect_s']:.2f}"
        why = "; ".join(x.split(": ", 1)[-1][:60] for x in r["reasons"][:1])
        lines.append(
            f"| {r['name']} | {r['accepted']} | {r['completed']} | {r['failed']}"
            f"{' (' + why + ')' if why else ''} | {r['lost']} | {r['duplicates']} | {det} | "
            f"{r['leaked_keys']} | {r['leaked_fds']} | {r['leaked_threads']} | "
            f"{r.get('pool_connections', '-')} | {r['notes']}{_failover(r)} |"
        )
    lines.append("")
    lines.append("| summary | value |")
    lines.append("|---|---|")
    lines += [f"| {k} | {v} |" for k, v in out["summary"].items()]
    return "\n".join(lines)


def _failover(r: dict[str, Any]) -> str:
    if r.get("failover_s") is None:
        return ""
    return (
        f"; {r['failover_of']} failover {r['failover_s']:.2f} s (lease {r['lease_s']} s), "
        f"fenced actions {r['fenced_actions']}"
    )


if __name__ == "__main__":
    sys.exit(main())
