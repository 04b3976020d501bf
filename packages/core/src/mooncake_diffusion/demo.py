"""``mooncake-diffusion demo``: the whole system on one machine, with the reference pipeline.

Starts a real Mooncake master and store host, the orchestrator (in this process,
library mode, with its HTTP API), and Encode, Denoise and Decode worker
processes running ``mooncake_diffusion.orchestrator.worker.reference``; submits a batch whose
mix shifts (interactive images, then batch short videos, then images; one
negative prompt shared by most) under the reactive planner, which moves a worker
to the starved stage (each ``stage change`` is printed); shows live progress;
then prints a per-request table and a summary and leaves
the outputs (PNG, GIF) in a folder it names. Every output is checked bitwise
against the same request run colocated in this process (``--no-verify`` skips it).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_diffusion.platform import bindshim

__all__ = ["DemoStack", "demo_batch", "demo_stack", "run_demo", "serve_batch"]

NEGATIVE = "blurry, low quality, watermark"
PROMPTS = [
    "a red fox in fresh snow",
    "a lighthouse at dusk",
    "a bowl of ramen, top view",
    "a paper boat on a pond",
    "a city skyline at night",
    "a hummingbird near a flower",
]


def demo_batch(
    images: int, videos: int, steps: int, shift: bool = False
) -> list[tuple[str, str, dict[str, Any]]]:
    """Batch videos first (17 frames, four times the steps), then interactive images.
    ``shift``: the mix shifts instead: half the images first, then the videos, then
    the other half (submission order; ``serve_batch(shift=True)`` keeps the phases)."""
    out = []
    for i in range(videos):
        neg = NEGATIVE if i % 2 == 0 else "static, jpeg artifacts"
        p = {"prompt": PROMPTS[(i + 3) % len(PROMPTS)], "negative_prompt": neg, "seed": 100 + i}
        video = {**p, "steps": 4 * steps, "frames": 17, "height": 64, "width": 96, "chunks": 3}
        out.append((f"vid-{i}", "batch", video))
    for i in range(images):
        p = {"prompt": PROMPTS[i % len(PROMPTS)], "negative_prompt": NEGATIVE, "seed": i}
        out.append((f"img-{i}", "interactive", {**p, "steps": steps, "height": 64, "width": 64}))
    if shift:
        first = (images + 1) // 2
        return out[videos : videos + first] + out[:videos] + out[videos + first :]
    return out


def _until_denoising(svc: Any, rids: list[str], timeout: float) -> None:
    """Wait until every request of ``rids`` has done a denoise step (or is done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sts = [svc.status(r) for r in rids]
        far = [
            s.stage == "decode"
            or s.finished_at is not None
            or (s.stage == "denoise" and (s.step or 0) >= 2)
            for s in sts
        ]
        if all(far):
            return
        time.sleep(0.05)


def _live_view(view: dict[str, Any], sts: list[Any]) -> Any:
    """A rich table of the requests (state, stage, denoise step) over the queue depths."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    q, pools = view["queued"], view.get("pools", {})
    head = Text(
        f"queues  encode {len(q.get('encode', ()))}  denoise {len(q.get('denoise', ()))}  "
        f"decode {len(q.get('decode', ()))}   workers {len(view['workers'])} (serving: "
        f"encode {pools.get('encode', 0)} denoise {pools.get('denoise', 0)} "
        f"decode {pools.get('decode', 0)})",
        style="bold",
    )
    table = Table(box=None, pad_edge=False)
    for col in ("request", "class", "state", "stage", "denoise"):
        table.add_column(col)
    colors = {"completed": "green", "failed": "red", "cancelled": "red", "running": "cyan"}
    for st in sts:
        bar: Any = ""
        if st.step and st.total:
            bar = ProgressBar(total=st.total, completed=st.step, width=24)
        elif st.state == "completed":
            bar = ProgressBar(total=1, completed=1, width=24)
        stage = st.stage if st.state not in ("completed", "failed", "cancelled") else "-"
        state = Text(st.state, style=colors.get(st.state, "yellow"))
        table.add_row(st.request_id, st.slo_class, state, stage or "-", bar)
    return Group(head, table)


def _timings(st: Any) -> dict[str, float]:
    """Seconds in each stage's queue and run, from the request's events."""
    out: dict[str, float] = {}
    last = st.submitted_at
    for ev in st.events:
        if ev.kind == "dispatched":
            out[f"{ev.stage}_queue"] = ev.t - last
            last = ev.t
        elif ev.kind == "done":
            out[f"{ev.stage}_run"] = ev.t - last
            last = ev.t
    return out


def run_demo(
    images: int = 4,
    videos: int = 6,
    steps: int = 8,
    denoise_workers: int = 1,
    out_dir: str | None = None,
    verify: bool = True,
    serve: bool = False,
    encode_workers: int = 2,
    planner: str = "reactive",
) -> int:
    """The demo; 0 when every request completed (and matched colocated, with ``verify``).
    The mix shifts (images, then videos, then images again) under ``planner``
    (``DEMO_PLANNER`` options), which may move workers between stages as it goes."""
    from mooncake_diffusion.orchestrator.elastic.planners import create_planner

    out = Path(out_dir or tempfile.mkdtemp(prefix="mooncake-diffusion-demo-"))
    batch = demo_batch(images, videos, steps, shift=True)
    kw: dict[str, Any] = {
        "stagger": True,
        "shift": True,
        "encode_workers": encode_workers,
        "planner": create_planner(planner, **DEMO_PLANNER.get(planner, {})),
    }
    if not serve:
        sts, wall, stats = serve_batch(batch, denoise_workers, out, **kw)
        return _report(sts, batch, out, wall, stats, verify)
    # the report comes first, then the system keeps serving (dashboard, API) until Ctrl-C
    result: list[int] = []

    def report_then_serve(sts: list, wall: float, stats: dict) -> None:
        result.append(_report(sts, batch, out, wall, stats, verify))

    serve_batch(batch, denoise_workers, out, serve=report_then_serve, **kw)
    return result[0]


#: the demo's planner options: a short interval and window, so a minute shows a change
DEMO_PLANNER: dict[str, dict[str, Any]] = {
    "reactive": {"interval": 0.5, "hold": 1, "max_wait": 1.0, "cooldown": 30.0},
    "predictive": {"interval": 0.5, "hold": 2, "horizon": 5.0, "cooldown": 30.0},
}


def orchestrator_config() -> Any:
    """The ``OrchestratorConfig`` the demo's orchestrator runs (bench/e2e.py gives its
    colocated side the same one)."""
    from mooncake_diffusion.orchestrator.core.model import OrchestratorConfig

    return OrchestratorConfig(heartbeat_timeout=5.0, preemption=True)


@dataclass
class DemoStack:
    """A running demo system: the service (library mode), its HTTP API (serving the
    OpenAI-style routes from ``out``) and the worker processes (``provisioner``: a
    ``LocalProvisioner``, the planner's too)."""

    svc: Any
    api: Any
    provisioner: Any
    out: Path
    #: the Mooncake cluster's client settings (a store client of the stack's own)
    settings: Any = None

    def check_workers(self) -> None:
        """Raise ``RuntimeError`` when a worker process exited that nobody removed."""
        self.provisioner.check()


@contextmanager
def demo_stack(
    denoise_workers: int,
    out: Path,
    *,
    port: int = 0,
    encode_workers: int = 1,
    planner: Any = None,
    worker_fn: str | None = None,
    worker_env: Mapping[str, str] | None = None,
) -> Iterator[DemoStack]:
    """A fresh embedded system: a real Mooncake master and store host, the orchestrator
    with its API on ``127.0.0.1:port`` (0: a free port), ``encode_workers`` Encode, a
    Decode and ``denoise_workers`` Denoise worker processes, each warmed up (torch and
    the model loaded). ``planner``: a planner instance the orchestrator runs once the
    workers are warm (before, ``static``: a cold worker's first item would look like a
    starved queue); its ``AddWorker`` / ``Retire`` go to the stack's
    ``LocalProvisioner``. ``worker_fn``, ``worker_env``: the workers' stage module
    (default the reference pipeline's) and more of their environment, for a test
    that holds a stage where it must (``tests/gated.py``). On exit every process is
    stopped and waited for, and the service closed; outputs, journal and logs stay
    in ``out``."""
    from mooncake_diffusion._mooncake.cluster import LocalCluster
    from mooncake_diffusion.orchestrator.elastic.provision import REFERENCE_STAGES, LocalProvisioner
    from mooncake_diffusion.orchestrator.http.api import ApiServer
    from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig

    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    t0 = time.monotonic()
    with LocalCluster(pool_bytes=512 << 20) as cluster:
        assert cluster.settings is not None
        print(f"cluster up in {time.monotonic() - t0:.1f}s: master {cluster.settings.master}")
        cfg = ServiceConfig(
            orchestrator=orchestrator_config(),
            worker_bind="tcp://127.0.0.1:0",
            journal=str(out / "orchestrator.db"),
        )
        # the decode worker writes outputs into its configured folder (never a
        # request's choice), the one the API serves them from
        settings = cluster.settings
        env = {
            **settings.as_env(),
            **bindshim.env(settings.local_hostname),
            "MCD_OUTPUTS": str(out),
            **(worker_env or {}),
        }
        svc = OrchestratorService(cfg)
        try:  # the driver turns on the API server's loop, as under the command
            api = ApiServer(svc, "127.0.0.1", port, outputs=out, drive=True)
        except BaseException:
            svc.close()
            raise
        print(f"orchestrator: api {api.url} (dashboard {api.url}/dashboard, docs {api.url}/docs)")
        # decode credits are latent receive slots: a denoise job is admitted only
        # when one can be reserved, so give every denoise worker one, and a spare
        prov = LocalProvisioner(
            svc.worker_address,
            env,
            logs,
            fn=worker_fn or REFERENCE_STAGES,
            credits={"decode": denoise_workers + 1},
        )
        try:
            plan = [("encode", f"enc-{i}") for i in range(encode_workers)]
            plan += [("decode", "dec-0")] + [
                ("denoise", f"den-{i}") for i in range(denoise_workers)
            ]
            for stage, wid in plan:
                prov.add((stage,), wid)
            stack = DemoStack(svc, api, prov, out, cluster.settings)
            deadline = time.monotonic() + 120
            while len(svc.cluster()["workers"]) < len(plan):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers did not come up; see {logs}")
                stack.check_workers()
                time.sleep(0.1)
            print(f"workers up: {', '.join(w for _, w in plan)} (logs in {logs})")
            # the first item a worker runs imports torch and builds the model: warm each
            # up (every encode and denoise worker gets one; they run side by side)
            warm = [
                svc.submit({"prompt": "warm up", "steps": 1}, request_id=f"warmup-{i}")
                for i in range(max(denoise_workers, encode_workers))
            ]
            t_warm = time.monotonic()
            for w in warm:
                svc.wait(w, timeout=300)
            print(f"workers warm in {time.monotonic() - t_warm:.1f}s (torch + model per process)")
            if planner is not None:
                svc.use_planner(planner, prov)
            yield stack
        finally:
            prov.close()
            svc.close()
            api.close()


def serve_batch(
    batch: list[tuple[str, str, dict[str, Any]]],
    denoise_workers: int,
    out: Path,
    *,
    stagger: bool = False,
    shift: bool = False,
    serve: Callable[[list[Any], float, dict[str, int]], None] | None = None,
    encode_workers: int = 1,
    planner: Any = None,
) -> tuple[list[Any], float, dict[str, int]]:
    """Run ``batch`` ((request id, class, params) each) on a fresh ``demo_stack``; the
    final statuses, seconds from first submit to last outcome, service counters.
    ``stagger``: submit the interactive requests only once the batch ones are
    denoising (so they arrive at a busy pool, as in production, and preempt).
    ``shift``: interactive requests ahead of the first batch one finish before it is
    submitted (the mix shifts from images to videos). ``encode_workers``,
    ``planner``: as ``demo_stack``; each stage change it makes is printed as it lands.
    ``serve``: once the batch is done, call it with (statuses, seconds, counters), then
    keep the system (API, dashboard) up until Ctrl-C."""
    images = sum(cls == "interactive" for _, cls, _ in batch)
    videos = len(batch) - images
    changes = _Changes()
    with demo_stack(denoise_workers, out, encode_workers=encode_workers, planner=planner) as stack:
        svc = stack.svc
        t_submit = time.time()
        rids: list[str] = []
        batch_rids: list[str] = []
        for rid, cls, params in batch:
            if shift and cls == "batch" and rids and not batch_rids:
                _until_done(stack, rids, changes)
                print(f"mix shift: {len(rids)} images done, now {videos} videos", flush=True)
            if stagger and cls == "interactive" and batch_rids:
                _until_denoising(svc, batch_rids, timeout=30)
                stagger = False
            rids.append(svc.submit({**params, "save": True}, request_id=rid, slo_class=cls))
            if cls == "batch":
                batch_rids.append(rid)
        kinds = f"{images} interactive images, {videos} batch videos"
        print(f"submitted {len(rids)} requests: {kinds}")
        from rich.live import Live

        with Live(_live_view(svc.cluster(), []), refresh_per_second=4) as live:
            while True:
                sts = [svc.status(r) for r in rids]
                view = svc.cluster()
                changes.show(view, lambda line: live.console.print(line, soft_wrap=True))
                live.update(_live_view(view, sts))
                if all(s.state in ("completed", "failed", "cancelled") for s in sts):
                    break
                stack.check_workers()
                time.sleep(0.25)
        print(flush=True)  # the live view ends without a newline when not on a terminal
        wall = time.time() - t_submit
        _until_changed(stack, changes)
        stats = svc.cluster()["counters"]
        if serve is not None:
            serve(sts, wall, stats)
            _serve_until_interrupted(stack)
    return sts, wall, stats


class _Changes:
    """Prints each stage change of the cluster view once when the planner asks for it
    and once as it lands."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def show(self, view: dict[str, Any], say: Callable[[str], None]) -> None:
        lines = [f"planner: {line}: under way" for line in view.get("changing", [])]
        lines += [f"stage change: {c['line']}" for c in view.get("stage_changes", [])]
        for line in lines:
            if line not in self.said:
                self.said.add(line)
                say(line)


def _until_done(stack: DemoStack, rids: list[str], changes: _Changes) -> None:
    """Wait until every request of ``rids`` has an outcome, showing stage changes."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        changes.show(stack.svc.cluster(), lambda line: print(line, flush=True))
        if all(stack.svc.status(r).finished_at is not None for r in rids):
            return
        stack.check_workers()
        time.sleep(0.25)
    raise RuntimeError(f"requests {rids} did not finish in 300 s; see {stack.out / 'logs'}")


def _until_changed(stack: DemoStack, changes: _Changes, timeout: float = 30.0) -> None:
    """Wait for the stage changes under way to land (a worker loading its new stage
    when the last request finished), showing each."""
    deadline = time.monotonic() + timeout
    while True:
        view = stack.svc.cluster()
        changes.show(view, lambda line: print(line, flush=True))
        if not view.get("changing") or time.monotonic() > deadline:
            return
        stack.check_workers()
        time.sleep(0.25)


def _serve_until_interrupted(stack: DemoStack) -> None:
    """Block until SIGINT (Ctrl-C) or SIGTERM, or a worker exits; then return so the
    caller stops everything. Handlers are installed here (a shell's background job
    starts with SIGINT ignored) and restored after."""
    import signal
    import threading

    url = stack.api.url
    print(f"\nserving: dashboard {url}/dashboard  API docs {url}/docs  (Ctrl-C stops)")
    stop = threading.Event()
    old = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        while not stop.wait(0.5):
            stack.check_workers()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    print("stopping")


def _report(sts: list[Any], batch: list, out: Path, wall: float, stats: dict, verify: bool) -> int:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    cols = ["request", "class", "state", "TTFF_s", "E_queue/run_s", "D_queue/run_s"]
    cols += ["V_queue/run_s", "latent_bytes", "paths", "neg_cache", "resumed", "output", "bitwise"]
    table = Table(box=box.MARKDOWN, show_edge=True)
    for col in cols:
        right = col.endswith("_s") or col in ("latent_bytes", "resumed")
        name = col.replace("_", " ")
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    ok = True
    pipe = None
    ttffs = []
    hits = 0
    for st, (rid, cls, params) in zip(sts, batch, strict=True):
        t = _timings(st)
        info = {e.stage: e.info for e in st.events if e.kind == "done"}
        res = json.loads(st.output) if st.state == "completed" and st.output else {}
        ttff = (res["first_frame_at"] - st.submitted_at) if res.get("first_frame_at") else None
        if ttff is not None:
            ttffs.append((cls, ttff))
        same = "-"
        if verify and res:
            from mooncake_diffusion.orchestrator.worker.reference import frames_digest
            from mooncake_diffusion.pipeline.params import GenerationParams
            from mooncake_diffusion.pipeline.reference import ReferencePipeline

            pipe = pipe or ReferencePipeline()
            p = GenerationParams(**{k: v for k, v in params.items() if k != "chunks"})
            same = "yes" if frames_digest(pipe.run_colocated(p)) == res["sha256"] else "NO"
            ok &= same == "yes"
        ok &= st.state == "completed"
        hit = info.get("encode", {}).get("cache_hit")
        hits += bool(hit)

        def qr(stage: str, t: dict[str, float] = t) -> str:
            q, r = t.get(f"{stage}_queue"), t.get(f"{stage}_run")
            return "-" if q is None or r is None else f"{q:.2f}/{r:.2f}"

        paths = "/".join(sorted({v.get("in_path", "") for v in info.values()} - {""})) or "-"
        table.add_row(
            rid,
            cls,
            st.state,
            "-" if ttff is None else f"{ttff:.2f}",
            qr("encode"),
            qr("denoise"),
            qr("decode"),
            str(info.get("denoise", {}).get("bytes", "-")),
            paths,
            "hit" if hit else "miss",
            str(info.get("denoise", {}).get("resumed_from", 0)),
            Path(res["path"]).name if res.get("path") else "-",
            same,
        )
    console = Console(width=max(200, Console().width))
    console.print()
    console.print(table)
    inter = sorted(x for c, x in ttffs if c == "interactive")
    requeues = sum(v for k, v in stats.items() if k.startswith("requeued"))
    print(
        f"\nsummary: {sum(s.state == 'completed' for s in sts)}/{len(sts)} completed in "
        f"{wall:.1f}s ({len(sts) / wall:.2f} req/s); interactive TTFF median "
        f"{inter[len(inter) // 2] if inter else float('nan'):.2f}s; negative-prompt cache hits "
        f"{hits}/{len(sts)}; preemptions {stats.get('preemptions', 0)}; requeues {requeues}; "
        f"stage changes {stats.get('stage_changes', 0)}"
    )
    print(f"outputs: {out}  (PNG for images, GIF for videos; orchestrator journal and logs there)")
    if verify:
        print(f"bitwise identical to the colocated run: {'all' if ok else 'NOT ALL'}")
    print("(random weights: this measures the serving system, not image quality)")
    return 0 if ok else 1
