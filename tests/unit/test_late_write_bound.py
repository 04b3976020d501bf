"""How long a p2p consumer holds memory back after a fetch's deadline once it gave a
producer up: Linux's TCP give-up time for ``tcp_retries2`` retransmissions
(``ip-sysctl``: 924.6 s for 15), one more retransmission timer (120 s) and 60 s for
the rest of the write."""

from __future__ import annotations

import pytest

from mooncake_diffusion.transfer.transports import p2p
from mooncake_diffusion.transfer.transports.p2p import late_write_bound


def test_the_kernel_default_gives_up_after_924_6_s():
    assert late_write_bound(15) == pytest.approx(924.6 + 120 + 60)


def test_fewer_retransmissions_give_up_sooner():
    # 0.2 + 0.4 + 0.8 + 1.6 + 3.2 + 6.4: the timeouts before the sixth retransmission
    assert late_write_bound(5) == pytest.approx(12.6 + 180)
    assert late_write_bound(0) == pytest.approx(0.2 + 180)


def test_this_hosts_setting_is_read_where_it_is_above_the_default(tmp_path, monkeypatch):
    f = tmp_path / "tcp_retries2"
    f.write_text("16\n")
    monkeypatch.setattr(p2p, "_TCP_RETRIES2", str(f))
    assert late_write_bound() == pytest.approx(924.6 + 120 + 180)


@pytest.mark.parametrize("content", [None, "", "many", "3"])
def test_the_default_where_the_setting_is_lower_or_unreadable(tmp_path, monkeypatch, content):
    """The setting that counts is the producer's (per network namespace): a consumer
    that lowered its own still holds memory as long as a default producer needs."""
    f = tmp_path / "tcp_retries2"
    if content is not None:
        f.write_text(content)
    monkeypatch.setattr(p2p, "_TCP_RETRIES2", str(f))
    assert late_write_bound() == late_write_bound(15)
