"""The `mooncake-diffusion` command as a user runs it."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "mooncake_diffusion.cli"]


def test_cluster_up_prints_settings_serves_and_stops_on_ctrl_c():
    proc = subprocess.Popen(
        [*CLI, "cluster", "up", "--pool-size", "128MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(60, proc.kill)  # a hung start fails the test, never the run
    watchdog.start()
    try:
        env = {}
        while "MOONCAKE_PROTOCOL" not in env:
            line = proc.stdout.readline()
            assert line, f"cluster up exited: {proc.wait()} {proc.stderr.read()}"
            m = re.match(r"export (\w+)=(\S+)", line)
            if m:
                env[m[1]] = m[2]
        health = json.loads(
            urllib.request.urlopen(f"http://{env['MOONCAKE_ADMIN']}/health", timeout=5).read()
        )
        assert health["service_ready"] is True
        segments = urllib.request.urlopen(
            f"http://{env['MOONCAKE_ADMIN']}/get_all_segments", timeout=5
        ).read()
        assert segments.strip(), "the store host mounted no segment"
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        watchdog.cancel()
        proc.stdout.close()
        proc.stderr.close()
    assert rc == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{env['MOONCAKE_ADMIN']}/health", timeout=2)


def test_handoff_moves_and_checks_a_latent_through_both_modes():
    out = subprocess.run(
        [*CLI, "handoff", "--shape", "1,16,5,32,32", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"\| p2p \|.*\| True \|", out.stdout), out.stdout
    assert re.search(r"\| store \|.*\| True \|", out.stdout), out.stdout
    assert re.search(r"\| p2p-net \| p2p/net.*\| True \|", out.stdout), out.stdout
    assert "store keys left: 0" in out.stdout
    assert "Local segment descriptor" not in out.stderr


def test_demo_runs_the_whole_system_and_every_output_matches_colocated(tmp_path):
    out = subprocess.run(
        [
            *CLI,
            "demo",
            "--images",
            "1",
            "--videos",
            "1",
            "--steps",
            "2",
            "--denoise-workers",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "bitwise identical to the colocated run: all" in out.stdout, out.stdout


def test_the_demo_shifts_its_mix_and_the_planner_moves_a_worker_to_denoise(tmp_path):
    # the defaults: images on 2 encode / 1 denoise / 1 decode workers, then 6 videos
    # queue at denoise (one runs, five wait: more than the reactive planner's depth)
    out = subprocess.run(
        [*CLI, "demo", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
        env=dict(os.environ),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    moved = r"^stage change: enc-\d encode -> denoise in [\d.]+ s.* \(queued denoise \d+, waited"
    assert re.search(moved, out.stdout, re.M), out.stdout
    assert re.search(r"stage changes [1-9]", out.stdout), out.stdout
    assert "bitwise identical to the colocated run: all" in out.stdout, out.stdout
    # the final table is markdown with padded cells (rich), one row per request
    row = r"\|\s*{}\s*\|\s*{}\s*\|\s*completed\s*\|.*\|\s*yes\s*\|"
    assert re.search(row.format("img-0", "interactive"), out.stdout), out.stdout
    assert re.search(row.format("vid-0", "batch"), out.stdout), out.stdout
    # the live view (its last frame, when stdout is not a terminal): queues per stage
    # and a line per request with its state
    assert re.search(r"queues\s+encode \d+\s+denoise \d+\s+decode \d+", out.stdout)
    assert re.search(r"^img-0\s+interactive\s+completed", out.stdout, re.M), out.stdout
    assert (tmp_path / "img-0.png").stat().st_size > 0
    assert (tmp_path / "vid-0.gif").stat().st_size > 0


def test_store_ls_lists_our_keys_by_kind_size_and_expiry(mooncake_cluster):
    """A keyed send with a TTL, one still untaken: ``store ls`` counts its payload,
    record, the record's anchor and their two expiry markers with their bytes;
    ``--keys --ttl-s`` gives each key its expiry and age; after the take, it says the
    store is empty."""
    import time

    import torch

    from mooncake_diffusion.handoff.keyed import KeyedHandoff

    s = mooncake_cluster.settings
    env = {**os.environ, "MOONCAKE_MASTER": s.master, "MOONCAKE_ADMIN": s.admin_address}

    def ls(*extra: str) -> str:
        done = subprocess.run(
            [*CLI, "store", "ls", *extra], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    with KeyedHandoff(s, ttl_s=600, sweep_s=0) as producer, KeyedHandoff(s, sweep_s=0) as taker:
        producer.send("req-ls_0_0@0_1", {"t": torch.zeros(1 << 20)})  # 4 MiB
        table = ls()
        rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:]}
        assert set(rows) == {"payload", "record", "anchor", "marker"}, table
        assert rows["payload"][:3] == ["1", "4.0", "MiB"], table
        assert rows["record"][0] == rows["anchor"][0] == "1", table
        assert rows["marker"][0] == "2", table  # the record's and the anchor's
        per_key = ls("--keys", "--ttl-s", "600")
        line = next(x for x in per_key.splitlines() if x.startswith("payload"))
        expires_in, age = int(line.split()[3]), int(line.split()[5])
        assert 0 < expires_in <= 600 and 0 <= age < 600 and expires_in + age == 600, line
        entries = json.loads(ls("--json"))
        assert {e["kind"] for e in entries} == {"payload", "record", "anchor", "marker"}
        assert taker.receive("req-ls_0_0@0_1") is not None
        deadline = time.monotonic() + 60
        while mooncake_cluster.keys() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "the store holds no key" in ls()
    assert mooncake_cluster.keys() == []


def test_orchestrator_names_the_known_planners_when_given_an_unknown_one():
    out = subprocess.run(
        [*CLI, "orchestrator", "--planner", "nope", "--port", "0", "--worker-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out
    assert "unknown planner 'nope'; known: predictive, reactive, static" in out.stderr
    assert "Traceback" not in out.stderr
