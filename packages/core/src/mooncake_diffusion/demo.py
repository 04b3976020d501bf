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
from pathlib import Path
from typing import Any

__all__ = ["demo_batch", "run_demo", "serve_batch"]

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


def _live_line(view: dict[str, Any], done: int, total: int) -> str:
    q = view["queued"]
    running = []
    for r in sorted(view["running"], key=lambda r: r["request_id"]):
        step = f" {r['step']}/{r['total']}" if r.get("step") else ""
        running.append(f"{r['request_id']}:{r['stage']}{step}")
    return (
        f"  queues E{len(q.get('encode', ()))} D{len(q.get('denoise', ()))} "
        f"V{len(q.get('decode', ()))} | running {', '.join(running) or '-'} | done {done}/{total}"
    )


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
) -> int:
    """The demo; 0 when every request completed (and matched colocated, with ``verify``)."""
    out = Path(out_dir or tempfile.mkdtemp(prefix="mooncake-diffusion-demo-"))
    batch = demo_batch(images, videos, steps)
    sts, wall, stats = serve_batch(batch, denoise_workers, out, stagger=True)
    return _report(sts, batch, out, wall, stats, verify)


def orchestrator_config() -> Any:
    """The ``OrchestratorConfig`` the demo's orchestrator runs (bench/e2e.py gives its
    colocated side the same one)."""
    from mooncake_diffusion.orchestrator.model import OrchestratorConfig

    return OrchestratorConfig(heartbeat_timeout=5.0, preemption=True)


def serve_batch(
    batch: list[tuple[str, str, dict[str, Any]]],
    denoise_workers: int,
    out: Path,
    *,
    stagger: bool = False,
) -> tuple[list[Any], float, dict[str, int]]:
    """Run ``batch`` ((request id, class, params) each) on a fresh embedded system; the
    final statuses, seconds from first submit to last outcome, service counters.
    ``stagger``: submit the interactive requests only once the batch ones are
    denoising (so they arrive at a busy pool, as in production, and preempt)."""
    from mooncake_diffusion._mooncake.cluster import LocalCluster
    from mooncake_diffusion.orchestrator.api import ApiServer
    from mooncake_diffusion.orchestrator.service import OrchestratorService, ServiceConfig

    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    images = sum(cls == "interactive" for _, cls, _ in batch)
    videos = len(batch) - images
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
        api = ApiServer(svc, "127.0.0.1", 0)
        print(
            f"orchestrator: api {api.url} (try {api.url}/v1/cluster), workers {svc.worker_address}"
        )
        try:
            env = cluster.settings.as_env()
            # decode credits are latent receive slots: a denoise job is admitted only
            # when one can be reserved, so give every denoise worker one, and a spare
            plan = [("encode", "enc-0", 1), ("decode", "dec-0", denoise_workers + 1)] + [
                ("denoise", f"den-{i}", 1) for i in range(denoise_workers)
            ]
            for stage, wid, credits in plan:
                log = logs / f"{wid}.log"
                procs.append(_spawn(stage, wid, svc.worker_address, env, log, credits))
            deadline = time.monotonic() + 120
            while len(svc.cluster()["workers"]) < len(plan):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"workers did not come up; see {logs}")
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
            t_submit = time.time()
            rids = []
            for rid, cls, params in batch:
                if stagger and cls == "interactive" and rids:
                    _until_denoising(svc, rids, timeout=30)
                    stagger = False
                rids.append(
                    svc.submit({**params, "out_dir": str(out)}, request_id=rid, slo_class=cls)
                )
            kinds = f"{images} interactive images, {videos} batch videos"
            print(f"submitted {len(rids)} requests: {kinds}")
            last = ""
            while True:
                sts = [svc.status(r) for r in rids]
                done = sum(s.state in ("completed", "failed", "cancelled") for s in sts)
                line = _live_line(svc.cluster(), done, len(rids))
                if line != last:
                    print(line, flush=True)
                    last = line
                if done == len(rids):
                    break
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"a worker exited; see {logs}")
                time.sleep(0.25)
            wall = time.time() - t_submit
            stats = svc.cluster()["counters"]
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
    return sts, wall, stats


def _report(sts: list[Any], batch: list, out: Path, wall: float, stats: dict, verify: bool) -> int:
    rows = [
        "| request | class | state | TTFF s | E queue/run s | D queue/run s | V queue/run s "
        "| latent bytes | paths | neg cache | resumed | output | bitwise |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|---:|---|---|",
    ]
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
        rows.append(
            f"| {rid} | {cls} | {st.state} | {'-' if ttff is None else f'{ttff:.2f}'} "
            f"| {qr('encode')} | {qr('denoise')} | {qr('decode')} "
            f"| {info.get('denoise', {}).get('bytes', '-')} | {paths} "
            f"| {'hit' if hit else 'miss'} | {info.get('denoise', {}).get('resumed_from', 0)} "
            f"| {Path(res['path']).name if res.get('path') else '-'} | {same} |"
        )
    print("\n" + "\n".join(rows))
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
