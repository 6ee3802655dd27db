"""kvcopy.testing's seams put back what they changed, on leaving and on an error."""

from __future__ import annotations

import pytest

import kvcopy
from kvcopy import testing


def test_settings_hold_for_the_block_and_are_put_back_after_an_error():
    before = kvcopy.config.launch_bytes
    with pytest.raises(RuntimeError):
        with testing.settings(launch_bytes=4096):
            assert kvcopy.config.launch_bytes == 4096
            raise RuntimeError("inside")
    assert kvcopy.config.launch_bytes == before
    with pytest.raises(ValueError, match="launch_bytes"):
        with testing.settings(launch_bytes=-1):
            pass
    assert kvcopy.config.launch_bytes == before


def test_fake_cuda_reaches_every_user_of_a_layer_and_leaves_none_behind():
    real = testing.cuda.driver
    users = [testing.engine.dispatch, testing.engine.decide, testing.engine.ring, testing.engine.context]
    fake = object()
    with testing.fake_cuda(fake, ("driver",)):
        assert all(module.driver is fake for module in users)
    assert all(module.driver is real for module in users)
    with pytest.raises(ValueError, match="no layer"):
        with testing.fake_cuda(fake, ("drivers",)):
            pass


def test_rows_on_host_runs_copy_rows_between_host_arrays_and_puts_it_back():
    import numpy as np

    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    a = kvcopy.Layout.from_pointers([src.ctypes.data], slots=8, row_bytes=8)
    b = kvcopy.Layout.from_pointers([dst.ctypes.data], slots=8, row_bytes=8)
    real = kvcopy.copy_rows
    with testing.rows_on_host():
        assert kvcopy.copy_rows(a, b, [3, 0, -1], [1, 6, 2]) == "host"
        wild = kvcopy.Layout.from_pointers([8], slots=8, row_bytes=8)  # no host mapping
        with pytest.raises(ValueError, match="are not host memory this process reads"):
            kvcopy.copy_rows(a, wild, [3, 2], [0, 1])
    assert kvcopy.copy_rows is real
    want = np.zeros(64, np.uint8)
    want[8:16], want[48:56] = src[24:32], src[0:8]
    np.testing.assert_array_equal(dst, want)


def test_host_reach_runs_over_an_allocation_the_kernel_lists_as_several_mappings():
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 3 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    # a read-only middle page: the kernel lists the one mapping as three
    assert libc.mprotect(ctypes.c_void_p(base + page), page, mmap.PROT_READ) == 0
    try:
        assert testing._host_reach(base, "table") >= 3 * page
        assert testing._host_reach(base + 2 * page + 8, "table") >= page - 8
        with pytest.raises(ValueError, match=r"table: address 0x8 is not memory this process maps"):
            testing._host_reach(8, "table")
    finally:
        libc.mprotect(ctypes.c_void_p(base + page), page, mmap.PROT_READ | mmap.PROT_WRITE)
        del base
        region.close()
