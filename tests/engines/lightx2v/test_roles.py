"""Encoder, Transformer and Decoder as three processes of the real LightX2V
(``WanRunner`` through its server worker), selected by their role JSON alone,
moving real bytes through a real Mooncake master and store host. Every byte is
compared by SHA-256 with LightX2V's colocated pipeline run on the same request."""

from __future__ import annotations

import threading

import pytest
from conftest import REPO, ok, request, role_config

# each role process imports all of LightX2V (every runner): ~30 s alone, minutes on
# a busy machine, hence the long hang guard
pytestmark = [pytest.mark.engines, pytest.mark.integration, pytest.mark.timeout(1200)]


def run_all(jobs: dict) -> dict:
    """Run ``{name: (role, body)}`` at once (a p2p send returns only once its
    receiver has pulled, as LightX2V's own); the replies by name."""
    replies: dict = {}

    def one(name, role, body):
        replies[name] = role.request(op="run", seed=body["seed"], task=body)

    threads = [threading.Thread(target=one, args=(n, *rb)) for n, rb in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return {n: ok(replies[n]) for n in jobs}


def test_the_real_lightx2v_from_the_archive_runs_on_a_cpu_platform(spawn_role, mooncake_cluster):
    spec = (REPO / "packages/lightx2v_adapter/engine/source.txt").read_text().splitlines()
    archive = next(line.split()[1] for line in spec if line.startswith("archive "))
    src = REPO / ".venvs/src" / archive.removesuffix(".tar.gz")
    role = spawn_role("encoder", role_config("encoder", mooncake_cluster))
    info = ok(role.request(op="info"))
    assert info["lightx2v"].startswith(str(src / "lightx2v") + "/"), info["lightx2v"]
    assert (info["ai_device"], info["platform"], info["mixin_device"]) == ("cpu",) * 3
    assert info["runner"] == "WanRunner" and info["adapter"]
    assert info["config_locked"]  # LightX2V locks its LockableDict after init_modules
    assert len(info["patched"]) == 6


@pytest.mark.parametrize("mode", ["store", "p2p", "auto"])
def test_three_roles_equal_the_colocated_pipeline_byte_for_byte(
    spawn_role, mooncake_cluster, image, tmp_path, mode
):
    enc = spawn_role("encoder", role_config("encoder", mooncake_cluster, transfer_mode=mode))
    tra = spawn_role(
        "transformer",
        role_config("transformer", mooncake_cluster, decoder_engine_rank=2, transfer_mode=mode),
    )
    dec = spawn_role("decode", role_config("decode", mooncake_cluster, transfer_mode=mode))
    local = spawn_role("colocated", role_config(None, mooncake_cluster))
    for seed in (11, 12):
        body = request(image, seed, save_result_path=str(tmp_path / f"{seed}.mp4"))
        got = run_all({"enc": (enc, body), "tra": (tra, body), "dec": (dec, body)})
        ref = ok(local.request(op="run", seed=seed, task=body))
        for reply in (*got.values(), ref):
            assert reply["status"] == "success", reply
        sent = got["enc"]["inputs"]
        assert got["tra"]["seen"]["dit_inputs"] == ref["seen"]["dit_inputs"]
        assert (
            got["tra"]["seen"]["dit_inputs"]["context"] == (sent["text_encoder_output"]["context"])
        )
        assert (
            got["tra"]["seen"]["dit_inputs"]["vae_encoder_out"]
            == (sent["image_encoder_output"]["vae_encoder_out"])
        )
        assert got["dec"]["seen"]["vae_decode_input"] == ref["seen"]["vae_decode_input"]
        assert got["dec"]["seen"]["vae_decode_input"]["shape"] == [16, 3, 8, 12]
        assert got["dec"]["p2_meta"]["latents_dtype"] == "torch.bfloat16"
        assert (tmp_path / f"{seed}.mp4").stat().st_size > 0  # LightX2V saved the video
    for role in (enc, tra):
        assert ok(role.request(op="info"))["live_publications"] == 0
    info = ok(dec.request(op="info"))
    assert info["pool_bytes_in_use"] == 0
    path = "store" if mode == "store" else "p2p/shm"  # same host: one memory copy
    assert info["last_received"]["path"] == path


def test_a_p2p_sender_that_exits_right_after_its_send_loses_nothing(
    spawn_role, mooncake_cluster, image, tmp_path
):
    """LightX2V's own send returns once the transfer succeeded; so does the
    adapter's: the encoder is released and gone before the transformer runs."""
    enc = spawn_role("encoder", role_config("encoder", mooncake_cluster, transfer_mode="p2p"))
    tra = spawn_role("transformer", role_config("transformer", mooncake_cluster))
    body = request(image, 7, save_result_path=str(tmp_path / "7.mp4"))  # decoded in place
    sent: dict = {}

    def send_and_exit():
        sent.update(ok(enc.request(op="run", seed=7, task=body)))
        ok(enc.request(op="release"))
        enc.close()

    sender = threading.Thread(target=send_and_exit)
    sender.start()
    got = ok(tra.request(op="run", seed=7, task=body))
    sender.join(300)
    assert sent["status"] == "success" and got["status"] == "success", (sent, got)
    assert enc.proc.returncode == 0
    assert got["seen"]["dit_inputs"]["context"] == sent["inputs"]["text_encoder_output"]["context"]


def test_store_payloads_outlive_their_sender(spawn_role, mooncake_cluster, image, tmp_path):
    enc = spawn_role("encoder", role_config("encoder", mooncake_cluster, transfer_mode="store"))
    body = request(image, 4, save_result_path=str(tmp_path / "4.mp4"))  # decoded in place
    sent = ok(enc.request(op="run", seed=4, task=body))
    ok(enc.request(op="release"))
    enc.close()  # the encoder is gone; its payload is in the store host
    tra = spawn_role("transformer", role_config("transformer", mooncake_cluster))
    got = ok(tra.request(op="run", seed=4, task=body))
    assert got["status"] == "success", got
    image_out = sent["inputs"]["image_encoder_output"]
    assert got["seen"]["dit_inputs"]["clip_encoder_out"] == image_out["clip_encoder_out"]


def test_a_receive_with_nothing_sent_fails_the_request_and_the_room_still_works(
    spawn_role, mooncake_cluster, image, tmp_path
):
    enc = spawn_role("encoder", role_config("encoder", mooncake_cluster, transfer_mode="store"))
    tra = spawn_role("transformer", role_config("transformer", mooncake_cluster, timeout_s=0.5))
    body = request(image, 3, save_result_path=str(tmp_path / "3.mp4"))  # decoded in place
    late = ok(tra.request(op="run", seed=3, task=body))
    assert (late["status"], late["error_type"]) == ("failed", "DeadlineExceededError"), late
    assert "room 0" in late["error"]
    ok(enc.request(op="run", seed=3, task=body))
    assert ok(tra.request(op="run", seed=3, task=body))["status"] == "success"


def test_a_dead_master_in_the_json_fails_the_role_at_start(spawn_role, mooncake_cluster):
    config = role_config("encoder", mooncake_cluster)
    config["disagg_config"].update(master="127.0.0.1:1", admin="127.0.0.1:2")
    role = spawn_role("encoder", config)
    with pytest.raises(Exception, match="exited with code 1"):
        role.request(op="info")


def test_a_request_without_a_room_never_takes_the_previous_requests_room(
    spawn_role, mooncake_cluster, image, tmp_path
):
    """Two rooms in flight with requests without a room between them; the
    transformer is asked in another order than the encoder (clients POST to each
    role on their own). A request's ``data_bootstrap_room`` is its own: before,
    LightX2V's ``set_config`` kept it in the role's config, the next request
    without a room inherited it, and seeds 2 and 4 got each other's embeddings."""
    store = {"transfer_mode": "store"}  # sends return at once: all four are in flight
    enc = spawn_role("encoder", role_config("encoder", mooncake_cluster, **store))
    tra = spawn_role("transformer", role_config("transformer", mooncake_cluster, **store))
    rooms = {1: 7, 2: None, 3: 8, 4: None}
    bodies = {}
    for seed, room in rooms.items():
        body = request(image, seed, save_result_path=str(tmp_path / f"{seed}.mp4"))
        bodies[seed] = body if room is None else {**body, "data_bootstrap_room": room}
    sent = {seed: ok(enc.request(op="run", seed=seed, task=bodies[seed])) for seed in rooms}
    for seed in (3, 2, 1, 4):
        got = ok(tra.request(op="run", seed=seed, task=bodies[seed]))
        assert got["status"] == "success", got
        want = sent[seed]["inputs"]["text_encoder_output"]["context"]
        assert got["seen"]["dit_inputs"]["context"] == want, seed
