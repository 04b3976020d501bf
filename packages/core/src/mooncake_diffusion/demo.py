"""``mooncake-diffusion demo``: the whole system on one machine, with the reference pipeline.

Starts a real Mooncake master and store host, the orchestrator (in this process,
library mode, with its HTTP API), and Encode, Denoise and Decode worker
processes running ``mooncake_diffusion.pipeline.stages``; submits a mixed batch
(interactive images, batch short videos, one negative prompt shared by most);
shows live progress; then prints a per-request table and a summary and leaves
the outputs (PNG, GIF) in a folder it names. Every output is checked bitwise
against the same request run colocated in this process (``--no-verify`` skips it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_diffusion._mooncake import bindshim

__all__ = ["DemoStack", "demo_batch", "demo_stack", "run_demo", "serve_batch"]

STAGES = "mooncake_diffusion.pipeline.stages"
NEGATIVE = "blurry, low quality, watermark"
PROMPTS = [
    "a red fox in fresh snow",
    "a lighthouse at dusk",
    "a bowl of ramen, top view",
    "a paper boat on a pond",
    "a city skyline at night",
    "a hummingbird near a flower",
]


def demo_batch(images: int, videos: int, steps: int) -> list[tuple[str, str, dict[str, Any]]]:
    """Batch videos first (17 frames, four times the steps), then interactive images."""
    out = []
    for i in range(videos):
        neg = NEGATIVE if i % 2 == 0 else "static, jpeg artifacts"
        p = {"prompt": PROMPTS[(i + 3) % len(PROMPTS)], "negative_prompt": neg, "seed": 100 + i}
        video = {**p, "steps": 4 * steps, "frames": 17, "height": 64, "width": 96, "chunks": 3}
        out.append((f"vid-{i}", "batch", video))
    for i in range(images):
        p = {"prompt": PROMPTS[i % len(PROMPTS)], "negative_prompt": NEGATIVE, "seed": i}
        out.append((f"img-{i}", "interactive", {**p, "steps": steps, "height": 64, "width": 64}))
    return out


def _spawn(
    stage: str, wid: str, address: str, env: dict[str, str], log: Path, credits: int = 1
) -> Any:
    argv = [
        sys.executable,
        "-m",
        "mooncake_diffusion.cli",
        "worker",
        "--stage",
        stage,
        "--fn",
        f"{STAGES}:{stage}",
        "--orchestrator",
        address,
        "--worker-id",
        wid,
        "--label",
        "node=local",
        "--credits",
        str(credits),
    ]
    f = open(log, "w")  # noqa: SIM115 (closed with the process)
    p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})
    p.log = f  # type: ignore[attr-defined]
    return p


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

    q = view["queued"]
    head = Text(
        f"queues  encode {len(q.get('encode', ()))}  denoise {len(q.get('denoise', ()))}  "
        f"decode {len(q.get('decode', ()))}   workers {len(view['workers'])}",
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
    videos: int = 2,
    steps: int = 8,
    denoise_workers: int = 2,
    out_dir: str | None = None,
    verify: bool = True,
    serve: bool = False,
) -> int:
    """The demo; 0 when every request completed (and matched colocated, with ``verify``)."""
    out = Path(out_dir or tempfile.mkdtemp(prefix="mooncake-diffusion-demo-"))
    batch = demo_batch(images, videos, steps)
    if not serve:
        sts, wall, stats = serve_batch(batch, denoise_workers, out, stagger=True)
        return _report(sts, batch, out, wall, stats, verify)
    # the report comes first, then the system keeps serving (dashboard, API) until Ctrl-C
    result: list[int] = []

    def report_then_serve(sts: list, wall: float, stats: dict) -> None:
        result.append(_report(sts, batch, out, wall, stats, verify))

    serve_batch(batch, denoise_workers, out, stagger=True, serve=report_then_serve)
    return result[0]


def orchestrator_config() -> Any:
    """The ``OrchestratorConfig`` the demo's orchestrator runs (bench/e2e.py gives its
    colocated side the same one)."""
    from mooncake_diffusion.orchestrator.model import OrchestratorConfig

    return OrchestratorConfig(heartbeat_timeout=5.0, preemption=True)


@dataclass
class DemoStack:
    """A running demo system: the service (library mode), its HTTP API (serving the
    OpenAI-style routes from ``out``) and the worker processes."""

    svc: Any
    api: Any
    procs: list[Any]
    out: Path
    #: the Mooncake cluster's client settings (a store client of the stack's own)
    settings: Any = None

    def check_workers(self) -> None:
        """Raise ``RuntimeError`` when a worker process has exited."""
        if any(p.poll() is not None for p in self.procs):
            raise RuntimeError(f"a worker exited; see {self.out / 'logs'}")


@contextmanager
def demo_stack(denoise_workers: int, out: Path, *, port: int = 0) -> Iterator[DemoStack]:
    """A fresh embedded system: a real Mooncake master and store host, the orchestrator
    with its API on ``127.0.0.1:port`` (0: a free port), an Encode, a Decode and
    ``denoise_workers`` Denoise worker processes, each warmed up (torch and the model
    loaded). On exit every process is stopped and waited for, and the service closed;
    outputs, journal and logs stay in ``out``."""
    from mooncake_diffusion._mooncake.cluster import LocalCluster
    from mooncake_diffusion.orchestrator.api import ApiServer
    from mooncake_diffusion.orchestrator.service import OrchestratorService, ServiceConfig

    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    t0 = time.monotonic()
    procs: list[Any] = []
    with LocalCluster(pool_bytes=512 << 20) as cluster:
        assert cluster.settings is not None
        print(f"cluster up in {time.monotonic() - t0:.1f}s: master {cluster.settings.master}")
        cfg = ServiceConfig(
            orchestrator=orchestrator_config(),
            worker_bind="tcp://127.0.0.1:0",
            journal=str(out / "orchestrator.db"),
        )
        svc = OrchestratorService(cfg).start()
        try:
            api = ApiServer(svc, "127.0.0.1", port, outputs=out)
        except BaseException:
            svc.close()
            raise
        print(f"orchestrator: api {api.url} (dashboard {api.url}/dashboard, docs {api.url}/docs)")
        try:
            # the decode worker writes outputs into its configured folder (never a
            # request's choice), the one the API serves them from
            settings = cluster.settings
            env = {
                **settings.as_env(),
                **bindshim.env(settings.local_hostname),
                "MCD_OUTPUTS": str(out),
            }
            # decode credits are latent receive slots: a denoise job is admitted only
            # when one can be reserved, so give every denoise worker one, and a spare
            plan = [("encode", "enc-0", 1), ("decode", "dec-0", denoise_workers + 1)] + [
                ("denoise", f"den-{i}", 1) for i in range(denoise_workers)
            ]
            for stage, wid, credits in plan:
                log = logs / f"{wid}.log"
                procs.append(_spawn(stage, wid, svc.worker_address, env, log, credits))
            stack = DemoStack(svc, api, procs, out, cluster.settings)
            deadline = time.monotonic() + 120
            while len(svc.cluster()["workers"]) < len(plan):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers did not come up; see {logs}")
                stack.check_workers()
                time.sleep(0.1)
            print(f"workers up: {', '.join(w for _, w, _ in plan)} (logs in {logs})")
            # the first item a worker runs imports torch and builds the model: warm each up
            warm = [
                svc.submit({"prompt": "warm up", "steps": 1}, request_id=f"warmup-{i}")
                for i in range(denoise_workers)
            ]
            t_warm = time.monotonic()
            for w in warm:
                svc.wait(w, timeout=300)
            print(f"workers warm in {time.monotonic() - t_warm:.1f}s (torch + model per process)")
            yield stack
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                p.log.close()
            svc.close()
            api.close()


def serve_batch(
    batch: list[tuple[str, str, dict[str, Any]]],
    denoise_workers: int,
    out: Path,
    *,
    stagger: bool = False,
    serve: Callable[[list[Any], float, dict[str, int]], None] | None = None,
) -> tuple[list[Any], float, dict[str, int]]:
    """Run ``batch`` ((request id, class, params) each) on a fresh ``demo_stack``; the
    final statuses, seconds from first submit to last outcome, service counters.
    ``stagger``: submit the interactive requests only once the batch ones are
    denoising (so they arrive at a busy pool, as in production, and preempt).
    ``serve``: once the batch is done, call it with (statuses, seconds, counters), then
    keep the system (API, dashboard) up until Ctrl-C."""
    images = sum(cls == "interactive" for _, cls, _ in batch)
    videos = len(batch) - images
    with demo_stack(denoise_workers, out) as stack:
        svc = stack.svc
        t_submit = time.time()
        rids = []
        for rid, cls, params in batch:
            if stagger and cls == "interactive" and rids:
                _until_denoising(svc, rids, timeout=30)
                stagger = False
            rids.append(svc.submit({**params, "save": True}, request_id=rid, slo_class=cls))
        kinds = f"{images} interactive images, {videos} batch videos"
        print(f"submitted {len(rids)} requests: {kinds}")
        from rich.live import Live

        with Live(_live_view(svc.cluster(), []), refresh_per_second=4) as live:
            while True:
                sts = [svc.status(r) for r in rids]
                live.update(_live_view(svc.cluster(), sts))
                if all(s.state in ("completed", "failed", "cancelled") for s in sts):
                    break
                stack.check_workers()
                time.sleep(0.25)
        print(flush=True)  # the live view ends without a newline when not on a terminal
        wall = time.time() - t_submit
        stats = svc.cluster()["counters"]
        if serve is not None:
            serve(sts, wall, stats)
            _serve_until_interrupted(stack)
    return sts, wall, stats


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
            from mooncake_diffusion.pipeline.params import GenerationParams
            from mooncake_diffusion.pipeline.reference import ReferencePipeline
            from mooncake_diffusion.pipeline.stages import frames_digest

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
        f"{hits}/{len(sts)}; preemptions {stats.get('preemptions', 0)}; requeues {requeues}"
    )
    print(f"outputs: {out}  (PNG for images, GIF for videos; orchestrator journal and logs there)")
    if verify:
        print(f"bitwise identical to the colocated run: {'all' if ok else 'NOT ALL'}")
    print("(random weights: this measures the serving system, not image quality)")
    return 0 if ok else 1
