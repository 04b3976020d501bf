"""A stage whose input was lost sends its request back to the stage that made it."""

from __future__ import annotations

from orch_harness import Harness, one, only

from mooncake_diffusion.orchestrator import (
    Dispatch,
    ItemFailed,
    ReleasePayloads,
    RequestCompleted,
    RequestFailed,
    Requeued,
    Rerun,
    Submit,
)


def pipeline(h: Harness) -> None:
    h.worker("enc-0", "encode", 1)
    h.worker("den-0", "denoise", 1)
    h.worker("dec-0", "decode", 1)


def lost(d: Dispatch, why: str = "PayloadGoneError: gone with the store host") -> ItemFailed:
    it = d.item
    return ItemFailed(d.worker_id, it.request_id, it.stage, it.attempt, why, input_lost=True)


def test_lost_embeddings_rerun_encode_then_the_request_completes():
    h = Harness()
    pipeline(h)
    enc = one(h.feed(Submit("r")), Dispatch)
    den = one(h.finish(enc, b"emb-1"), Dispatch)
    acts = h.feed(lost(den))
    rerun = one(acts, Rerun)
    assert (rerun.stage, rerun.lost_stage) == ("encode", "denoise")
    assert "gone with the store host" in rerun.reason and not only(acts, Requeued)
    enc2 = one(acts, Dispatch)
    # a new attempt of encode (attempt 1's result is stale now), from the request's input
    assert (enc2.item.stage, enc2.item.attempt, enc2.item.input) == ("encode", 2, b"")
    assert h.core.snapshot().decode_reserved == 0  # the failed denoise's reservation went
    den2 = one(h.finish(enc2, b"emb-2"), Dispatch)
    assert (den2.item.stage, den2.item.attempt, den2.item.input) == ("denoise", 2, b"emb-2")
    dec = one(h.finish(den2, b"lat"), Dispatch)
    acts = h.finish(dec, b"out")
    assert one(acts, RequestCompleted).output == b"out"
    # the lost handle is released with the rest; each once
    assert one(acts, ReleasePayloads).handles == (b"emb-1", b"emb-2", b"lat")


def test_a_late_result_of_the_attempt_before_the_rerun_is_stale():
    h = Harness()
    pipeline(h)
    enc = one(h.feed(Submit("r")), Dispatch)
    den = one(h.finish(enc, b"emb-1"), Dispatch)
    h.feed(lost(den))
    acts = h.finish(enc, b"emb-late")  # encode attempt 1 answers again
    assert not only(acts, Dispatch) and "stale" in repr(acts)


def test_lost_latent_reruns_denoise_with_the_embeddings_it_had():
    h = Harness()
    pipeline(h)
    enc = one(h.feed(Submit("r")), Dispatch)
    den = one(h.finish(enc, b"emb"), Dispatch)
    dec = one(h.finish(den, b"lat-1"), Dispatch)
    acts = h.feed(lost(dec, "PeerGoneError: the producer is unreachable"))
    assert (one(acts, Rerun).stage, one(acts, Rerun).lost_stage) == ("denoise", "decode")
    den2 = one(acts, Dispatch)
    assert (den2.item.stage, den2.item.attempt, den2.item.input) == ("denoise", 2, b"emb")
    dec2 = one(h.finish(den2, b"lat-2"), Dispatch)
    assert (dec2.item.attempt, dec2.item.input) == (2, b"lat-2")


def test_reruns_are_bounded_then_it_is_an_ordinary_failure():
    h = Harness(max_reruns=1, max_attempts=3)
    pipeline(h)
    enc = one(h.feed(Submit("r")), Dispatch)
    den = one(h.finish(enc, b"emb-1"), Dispatch)
    enc2 = one(h.feed(lost(den)), Dispatch)
    den2 = one(h.finish(enc2, b"emb-2"), Dispatch)
    acts = h.feed(lost(den2))  # the one rerun is spent: retried like any failure
    assert not only(acts, Rerun)
    assert one(acts, Requeued).stage == "denoise"
    assert one(acts, Dispatch).item.attempt == 3


def test_no_rerun_at_the_first_stage_or_when_reruns_are_off():
    h = Harness(max_reruns=0)
    pipeline(h)
    enc = one(h.feed(Submit("r")), Dispatch)
    den = one(h.finish(enc, b"emb"), Dispatch)
    assert not only(h.feed(lost(den)), Rerun)
    h2 = Harness()
    h2.worker("den-0", "denoise", 1)
    h2.worker("dec-0", "decode", 1)
    den = one(h2.feed(Submit("r", cached_embeddings=b"client-emb")), Dispatch)
    acts = h2.feed(lost(den))  # the client's own embeddings: nothing upstream to re-run
    assert not only(acts, Rerun) and one(acts, Requeued).stage == "denoise"


def test_a_rerun_needs_attempts_left_on_both_stages():
    h = Harness(max_attempts=1)
    pipeline(h)
    enc = one(h.feed(Submit("r")), Dispatch)
    den = one(h.finish(enc, b"emb"), Dispatch)
    acts = h.feed(lost(den))
    assert not only(acts, Rerun)
    assert one(acts, RequestFailed).reasons == (
        "denoise attempt 1 on den-0: PayloadGoneError: gone with the store host",
    )


def test_a_retried_upstream_stage_counts_its_attempts_in_the_rerun():
    # encode needed two attempts: the rerun's is the third, and with a budget of two
    # there is no rerun at all (the core writes a stage's attempts when it leaves it
    # only where they are not 1: this is the case it writes)
    for budget, rerun in ((3, True), (2, False)):
        h = Harness(max_attempts=budget)
        pipeline(h)
        enc = one(h.feed(Submit("r")), Dispatch)
        it = enc.item
        failed = ItemFailed(enc.worker_id, it.request_id, "encode", it.attempt, "oom")
        enc2 = one(h.feed(failed), Dispatch)
        assert enc2.item.attempt == 2
        den = one(h.finish(enc2, b"emb"), Dispatch)
        assert den.item.attempt == 1
        acts = h.feed(lost(den))
        again = one(acts, Dispatch)
        if rerun:
            assert one(acts, Rerun).stage == "encode"
            assert (again.item.stage, again.item.attempt) == ("encode", 3)
            den2 = one(h.finish(again, b"emb-2"), Dispatch)
            assert (den2.item.stage, den2.item.attempt) == ("denoise", 2)
        else:
            assert not only(acts, Rerun) and one(acts, Requeued).stage == "denoise"
            assert (again.item.stage, again.item.attempt) == ("denoise", 2)
