import pytest

from mooncake_diffusion.memory.pool import ALIGN, FreeList

pytestmark = pytest.mark.unit


def test_first_fit_aligns_and_coalesces():
    fl = FreeList(4 * ALIGN)
    a = fl.allocate(10)
    b = fl.allocate(ALIGN + 1)
    c = fl.allocate(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    assert fl.allocate(1) is None
    fl.free(b)
    fl.free(a)
    assert fl.allocate(3 * ALIGN) == 0  # the two holes merged
    fl.free(0)
    fl.free(c)
    assert fl.used == 0 and fl.allocate(4 * ALIGN) == 0


def test_double_free_raises():
    fl = FreeList(ALIGN)
    off = fl.allocate(1)
    fl.free(off)
    with pytest.raises(KeyError):
        fl.free(off)


def test_zero_capacity_never_allocates():
    assert FreeList(0).allocate(1) is None
