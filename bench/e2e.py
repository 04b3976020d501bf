"""End to end on this machine: the reference pipeline colocated vs disaggregated, real processes.

Run ``uv run python bench/e2e.py [--quick] [--json PATH]``. One batch of requests
(interactive images and batch 9-frame videos, a shared negative prompt), run twice:

    colocated       one process runs each request's Encode, Denoise and Decode itself,
                    under the disaggregated side's scheduler configuration
                    (``demo.orchestrator_config()``): the highest-priority class first
                    (interactive before batch), first come first served within a class,
                    a running job yields at a step boundary to a waiting job of a
                    higher class (at most ``max_preemptions`` times), and prompt
                    embeddings are cached in the process (the negative prompt is
                    encoded once). The model is built before the clock starts.
    disaggregated   the demo's system: a Mooncake master and store host, the
                    orchestrator, and Encode, Denoise (``--denoise-workers``) and Decode
                    worker processes; bytes through Mooncake Store. Workers are warmed
                    up (torch and model loaded) before the clock starts.

Reported: throughput (requests / wall second), TTFF per request (submit of the batch to
its first decoded frames; all requests are submitted at once), and their ratios. Read it
honestly: this is 2 vCPUs shared by every process, so worker processes compete for the
same cores the colocated run has to itself; the serving gains the simulator models
(pools sized per stage, priorities, preemption, no contention for GPU memory) need
hardware this machine does not have. What it does show: the full path works under load,
interactive requests pass batch videos in the queues, and what each hop costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class ColocatedQueue:
    """The order a single colocated GPU serves ``batch`` in under ``config``: the
    class priorities of ``config.classes`` (lower first), then arrival order; all
    requests are in hand at t0, as on the disaggregated side."""

    def __init__(self, batch: list[tuple[str, str, dict[str, Any]]], config: Any) -> None:
        self.config = config
        self._prio = {c.name: c.priority for c in config.classes}
        self.waiting = list(range(len(batch)))
        self.classes = [cls for _, cls, _ in batch]
        self.preemptions = [0] * len(batch)

    def priority(self, i: int) -> int:
        return self._prio[self.classes[i]]

    def pop(self) -> int:
        """The next request to run (removed from the waiting list)."""
        best = min(self.waiting, key=lambda i: (self.priority(i), i))
        self.waiting.remove(best)
        return best

    def should_yield(self, running: int) -> bool:
        """The core's preemption rule: a waiting request of a higher class, preemption
        on, and the running request not yet preempted ``max_preemptions`` times."""
        if not self.config.preemption or self.preemptions[running] >= self.config.max_preemptions:
            return False
        return any(self.priority(i) < self.priority(running) for i in self.waiting)


def colocated(batch: list[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    from mooncake_diffusion.demo import orchestrator_config
    from mooncake_diffusion.pipeline.params import GenerationParams
    from mooncake_diffusion.pipeline.reference import DenoisePreempted, ReferencePipeline

    pipe = ReferencePipeline()
    pipe.run_colocated(GenerationParams(prompt="warm up", steps=1))
    queue = ColocatedQueue(batch, orchestrator_config())
    embeds: dict[str, Any] = {}  # the process's embedding cache, like the encode worker's

    def encode(prompt: str) -> Any:
        if prompt not in embeds:
            embeds[prompt] = pipe.encode(prompt)["embeds"]
        return embeds[prompt]

    t0 = time.perf_counter()
    ttff: dict[str, float] = {}
    states: dict[int, Any] = {}
    while queue.waiting:
        i = queue.pop()
        rid, _cls, params = batch[i]
        p = GenerationParams(**{k: v for k, v in params.items() if k != "chunks"})
        cond = {"prompt_embeds": encode(p.prompt)}
        if p.cfg:
            cond["negative_embeds"] = encode(p.negative_prompt)
        try:
            latent = pipe.denoise(
                cond,
                p,
                resume=states.pop(i, None),
                should_stop=lambda _k, i=i: queue.should_yield(i),
            )
        except DenoisePreempted as stop:  # back to the queue, resumed from its state
            states[i] = stop.state
            queue.preemptions[i] += 1
            queue.waiting.append(i)
            continue
        for k, _frames in enumerate(pipe.decode_chunks(latent, int(params.get("chunks", 1)))):
            if k == 0:
                ttff[rid] = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "ttff_s": ttff,
        "preemptions": sum(queue.preemptions),
        "config": queue.config,
    }


def disaggregated(batch: list, denoise_workers: int, out: Path) -> dict[str, Any]:
    from mooncake_diffusion.demo import serve_batch

    sts, wall, _stats = serve_batch(batch, denoise_workers, out)
    first = min(st.submitted_at for st in sts)
    ttff = {}
    for st in sts:
        if st.state != "completed":
            raise RuntimeError(f"{st.request_id} {st.state}: {st.reasons}")
        res = json.loads(st.output)
        ttff[st.request_id] = res["first_frame_at"] - first
    return {"wall_s": wall, "ttff_s": ttff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a small batch (~1 min)")
    ap.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    ap.add_argument("--denoise-workers", type=int, default=2)
    a = ap.parse_args(argv)
    from mooncake_diffusion.demo import demo_batch

    images, videos, steps = (4, 2, 6) if a.quick else (12, 4, 12)
    batch = demo_batch(images, videos, steps)
    classes = {rid: cls for rid, cls, _ in batch}
    print(f"batch: {images} interactive images, {videos} batch videos, {steps} steps", flush=True)
    col = colocated(batch)
    print(f"colocated: {col['wall_s']:.2f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        dis = disaggregated(batch, a.denoise_workers, Path(tmp))
    print(f"disaggregated: {dis['wall_s']:.2f} s", flush=True)
    rows = []
    for name, r in (("colocated", col), ("disaggregated", dis)):
        for cls in ("interactive", "batch"):
            xs = sorted(v for k, v in r["ttff_s"].items() if classes[k] == cls)
            rows.append(
                {
                    "mode": name,
                    "class": cls,
                    "requests": len(xs),
                    "ttff_p50_s": statistics.median(xs),
                    "ttff_max_s": max(xs),
                    "throughput_rps": len(batch) / r["wall_s"],
                }
            )
    print("\n| mode | class | requests | TTFF p50 s | TTFF max s | throughput req/s |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['class']} | {r['requests']} | {r['ttff_p50_s']:.2f} "
            f"| {r['ttff_max_s']:.2f} | {r['throughput_rps']:.2f} |"
        )

    def ttff(mode: str, cls: str) -> float:
        return next(r["ttff_p50_s"] for r in rows if r["mode"] == mode and r["class"] == cls)

    from mooncake_diffusion.demo import orchestrator_config

    cfg = orchestrator_config()
    summary = {
        # the colocated loop's config against the one serve_batch's orchestrator runs
        "same_scheduler": col["config"] == cfg,
        "scheduler": {
            "classes": {c.name: c.priority for c in cfg.classes},
            "preemption": cfg.preemption,
            "max_preemptions": cfg.max_preemptions,
        },
        "colocated_preemptions": col["preemptions"],
        "throughput_ratio": col["wall_s"] / dis["wall_s"],
        "ttff_p50_ratio_interactive": ttff("disaggregated", "interactive")
        / ttff("colocated", "interactive"),
        "ttff_p50_ratio_batch": ttff("disaggregated", "batch") / ttff("colocated", "batch"),
    }
    print(
        f"\nsummary (disaggregated / colocated): throughput {summary['throughput_ratio']:.2f}x, "
        f"interactive TTFF p50 {summary['ttff_p50_ratio_interactive']:.2f}x, "
        f"batch TTFF p50 {summary['ttff_p50_ratio_batch']:.2f}x "
        f"({os.cpu_count()} CPUs shared by every process; see --help)"
    )
    if a.json:
        doc = {
            "bench": "e2e",
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
            "config": {"quick": a.quick, "denoise_workers": a.denoise_workers, "steps": steps},
            "rows": rows,
            "summary": summary,
        }
        Path(a.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
