import pytest

from helpers import Recorder
from mooncake_diffusion.errors import TransferError
from mooncake_diffusion.memory.registration import Registrations
from mooncake_diffusion.memory.tensors import Region

pytestmark = pytest.mark.unit


def region(ptr, n, base=0, base_n=0):
    return Region(ptr, n, None, "cpu", base, base_n)


def test_views_of_one_allocation_share_one_registration():
    rec = Recorder()
    regs = Registrations(rec.register, rec.unregister)
    a = regs.acquire(region(1000, 10, 1000, 100))
    b = regs.acquire(region(1050, 10, 1000, 100))
    assert rec.calls == 1 and rec.live == {1000: 100}
    regs.release(a)
    assert rec.live == {1000: 100}
    regs.release(b)
    assert rec.live == {} and regs.count == 0


def test_pinned_extent_survives_transfers_and_covers_subranges():
    rec = Recorder()
    regs = Registrations(rec.register, rec.unregister)
    regs.pin(region(0, 4096))
    lease = regs.acquire(region(100, 50))
    regs.release(lease)
    assert rec.calls == 1 and rec.live == {0: 4096} and regs.temporary == 0
    regs.unpin(region(0, 4096))
    assert rec.live == {}


def test_partial_overlap_is_a_clear_error_not_an_engine_code():
    regs = Registrations(Recorder().register, Recorder().unregister)
    regs.pin(region(0, 100))
    with pytest.raises(TransferError, match="partly overlaps"):
        regs.acquire(region(50, 100))


def test_failed_registration_leaves_nothing_recorded():
    def boom(ptr, n, device):
        raise TransferError("no")

    regs = Registrations(boom, lambda p: None)
    with pytest.raises(TransferError):
        regs.acquire(region(0, 10))
    assert regs.count == 0


def test_empty_region_needs_no_registration_and_close_unregisters_all():
    rec = Recorder()
    regs = Registrations(rec.register, rec.unregister)
    lease = regs.acquire(region(0, 0))
    regs.release(lease)
    assert regs.count == 0
    regs.acquire(region(0, 10))
    regs.pin(region(100, 10))
    assert regs.temporary == 1 and regs.nbytes == 20
    regs.close()
    assert rec.live == {} and regs.count == 0
