"""Run the same tests N times in a row and report how often each passed.

    uv run --locked python tests/repeat.py 20 tests/faults tests/chaos
    uv run --locked python tests/repeat.py 5 --under-load tests/faults -k kill
    ./dev repeat 20 tests/faults            (the same, through ./dev)

Each round is a fresh ``pytest`` process over the given arguments (a failure in one
round cannot leak state into the next), writing a JUnit report that this script
reads. The table gives, for every test seen, how many rounds it passed, failed,
errored or was skipped in. A skip is never counted as a pass. ``--under-load``
runs every round beside ``stress-ng --cpu N`` (N = ``--cpus``, default every core),
started here and stopped when the rounds end; like ``./dev test --under-load`` it then
widens pytest-timeout's hang guard to 900 s per test (unless ``--timeout`` is given),
never the tests' own bounds. ``--budget-s S`` starts no new round once S seconds have
passed (the table then says how many of N rounds ran). ``--json PATH`` writes the
counts and, per red test, the first line of each failure.
Exit status 0 only when every test passed in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")
#: pytest-timeout per test under the CPU hog (./dev test --under-load uses the same)
LOADED_HANG_GUARD_S = 900


def parse_junit(path: Path) -> dict[str, str]:
    """Test id -> outcome from one pytest JUnit report (empty if there is none)."""
    if not path.exists():
        return {}
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # pytest's entry for an interrupted session, not a test
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            out[tid] = "failed"
        elif "error" in kinds:
            out[tid] = "error"
        elif "skipped" in kinds:
            out[tid] = "skipped"
        else:
            out[tid] = "passed"
    return out


def failure_lines(path: Path) -> dict[str, str]:
    """Test id -> first line of its failure or error message, for the red tests of one
    pytest JUnit report (empty if there is none)."""
    if not path.exists():
        return {}
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        for child in case:
            if case.get("name") and child.tag in ("failure", "error"):
                tid = f"{case.get('classname', '')}::{case.get('name', '')}"
                first = (child.get("message") or child.text or "").strip().splitlines()
                out.setdefault(tid, first[0][:300] if first else "")
    return out


def tally(rounds: list[dict[str, str]]) -> dict[str, dict[str, int]]:
    """Per test, how many rounds gave each outcome ("missing": a round without it)."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(OUTCOMES, 0))
    for r in rounds:
        for tid, outcome in r.items():
            counts[tid][outcome] += 1
    for tid in counts:
        counts[tid]["missing"] = len(rounds) - sum(counts[tid][o] for o in OUTCOMES)
    return dict(sorted(counts.items()))


def start_hog(cpus: int) -> subprocess.Popen[bytes]:
    if shutil.which("stress-ng") is None:
        raise SystemExit("--under-load needs stress-ng (apt-get install -y stress-ng)")
    return subprocess.Popen(
        ["stress-ng", "--cpu", str(cpus), "--timeout", "0", "--quiet"], start_new_session=True
    )


def stop_hog(p: subprocess.Popen[bytes] | None) -> None:
    if p is not None and p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Run pytest N times in a row; report per-test pass counts.",
        epilog="Everything after the options is passed to pytest (put -- before "
        "pytest options that look like ours).",
    )
    ap.add_argument("n", type=int, help="rounds to run (each a fresh pytest process)")
    ap.add_argument("--under-load", action="store_true", help="run beside stress-ng --cpu N")
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="stress-ng workers")
    ap.add_argument("--json", type=Path, help="write the counts here")
    ap.add_argument("--stop-on-fail", action="store_true", help="end at the first red round")
    ap.add_argument(
        "--budget-s", type=float, help="start no new round after this many seconds in all"
    )
    args, pytest_args = ap.parse_known_args(argv)
    if args.n < 1:
        ap.error("n must be at least 1")
    if args.cpus < 1:
        ap.error("--cpus must be at least 1")
    pytest_args = [a for a in pytest_args if a != "--"]
    if args.under_load and not any(a.startswith("--timeout") for a in pytest_args):
        pytest_args = [f"--timeout={LOADED_HANG_GUARD_S}", *pytest_args]
    rounds: list[dict[str, str]] = []
    walls: list[float] = []
    firsts: dict[str, list[str]] = defaultdict(list)
    start = time.monotonic()
    hog = start_hog(args.cpus) if args.under_load else None
    try:
        with tempfile.TemporaryDirectory(prefix="mcd-repeat-") as tmp:
            for i in range(args.n):
                if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                    print(f"[repeat] --budget-s {args.budget_s:g} spent", file=sys.stderr)
                    break
                xml = Path(tmp) / f"round{i}.xml"
                t0 = time.monotonic()
                rc = subprocess.call(
                    [sys.executable, "-m", "pytest", "-q", f"--junitxml={xml}", *pytest_args]
                )
                walls.append(round(time.monotonic() - t0, 1))
                got = parse_junit(xml)
                if rc != 0 and all(o == "passed" for o in got.values()):
                    got["<pytest exit status>"] = "error"  # red without a red test: count it
                rounds.append(got)
                for tid, line in failure_lines(xml).items():
                    firsts[tid].append(f"round {i + 1}: {line}")
                bad = sum(o in ("failed", "error") for o in got.values())
                print(
                    f"[repeat] round {i + 1}/{args.n}: rc {rc}, {len(got)} tests, "
                    f"{bad} red, {walls[-1]} s",
                    file=sys.stderr,
                    flush=True,
                )
                if bad and args.stop_on_fail:
                    break
    finally:
        stop_hog(hog)
    counts = tally(rounds)
    green = sum(all(o == "passed" for o in r.values()) and bool(r) for r in rounds)
    print(
        f"\n{len(rounds)} of {args.n} rounds run, {green} fully green; "
        f"under load: {args.under_load}"
    )
    print(f"{'passed':>6} {'failed':>6} {'error':>6} {'skip':>6} {'miss':>6}  test")
    for tid, c in counts.items():
        print(
            f"{c['passed']:>6} {c['failed']:>6} {c['error']:>6} {c['skipped']:>6} "
            f"{c['missing']:>6}  {tid}"
        )
    for tid, lines in firsts.items():
        print(f"red: {tid}", *(f"  {line}" for line in lines), sep="\n")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rounds": len(rounds),
                    "green_rounds": green,
                    "under_load": args.under_load,
                    "pytest_args": pytest_args,
                    "round_wall_s": walls,
                    "tests": counts,
                    "failure_first_lines": firsts,
                },
                indent=2,
            )
        )
    return 0 if rounds and green == len(rounds) == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
