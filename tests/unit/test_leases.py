import pytest

from mooncake_diffusion.leases import expired_keys, expiry_of

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
