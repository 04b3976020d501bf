import pytest

from mooncake_diffusion.transfer.leases import expired_keys, expiry_of

pytestmark = pytest.mark.unit


def test_expiry_is_read_from_the_key_alone():
    key = "mcd/req-1/latent/0123abcd@1700000000500/0.3"
    assert expiry_of(key) == 1700000000.5
    assert expiry_of("mcd/req-1/latent/0123abcd/0.0") is None
    assert expiry_of("someone-elses/key@123/0") is None


def test_only_keys_past_their_ttl_are_expired():
    keys = [
        "mcd/a/latent/n1@1000/0.0",
        "mcd/b/latent/n2@3000/0.0",
        "mcd/c/latent/n3/0.0",
        "other/x@1/y",
    ]
    assert expired_keys(keys, now=2.0) == ["mcd/a/latent/n1@1000/0.0"]
    assert expired_keys(keys, now=5.0) == keys[:2]


def test_an_expired_marker_takes_the_key_it_marks_with_it():
    from mooncake_diffusion.transfer.leases import ttl_marker

    marker = ttl_marker(1500, "mcd-mbox/req-1_0_0@0_1")
    assert marker == "mcd-ttl/1500/mcd-mbox/req-1_0_0@0_1"
    assert expiry_of(marker) == 1.5
    keys = [marker, ttl_marker(9000, "mcd-mbox/later"), "mcd-mbox/req-1_0_0@0_1"]
    assert expired_keys(keys, now=2.0) == [marker, "mcd-mbox/req-1_0_0@0_1"]
    assert expired_keys(keys, now=1.0) == []
