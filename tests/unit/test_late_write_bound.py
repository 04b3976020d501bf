"""How long a p2p consumer holds memory back after giving a producer up: Linux's
TCP give-up time for ``tcp_retries2`` retransmissions (``ip-sysctl``: 924.6 s for
15), one more retransmission timer (120 s) and 60 s for the rest of the write."""

from __future__ import annotations

import pytest

from mooncake_diffusion.transports import p2p
from mooncake_diffusion.transports.p2p import late_write_bound


def test_the_kernel_default_gives_up_after_924_6_s():
    assert late_write_bound(15) == pytest.approx(924.6 + 120 + 60)


def test_fewer_retransmissions_give_up_sooner():
    # 0.2 + 0.4 + 0.8 + 1.6 + 3.2 + 6.4: the timeouts before the sixth retransmission
    assert late_write_bound(5) == pytest.approx(12.6 + 180)
    assert late_write_bound(0) == pytest.approx(0.2 + 180)


def test_this_hosts_setting_is_read(tmp_path, monkeypatch):
    f = tmp_path / "tcp_retries2"
    f.write_text("3\n")
    monkeypatch.setattr(p2p, "_TCP_RETRIES2", str(f))
    assert late_write_bound() == pytest.approx(3.0 + 180)


@pytest.mark.parametrize("content", [None, "", "many"])
def test_the_default_where_the_setting_cannot_be_read(tmp_path, monkeypatch, content):
    f = tmp_path / "tcp_retries2"
    if content is not None:
        f.write_text(content)
    monkeypatch.setattr(p2p, "_TCP_RETRIES2", str(f))
    assert late_write_bound() == late_write_bound(15)
