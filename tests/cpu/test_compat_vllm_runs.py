"""vLLM's strided runs as layout pairs (kvcopy.compat.vllm.run_groups), run between host
arrays against an oracle that copies each fragment of each run."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from kvcopy.compat.vllm import run_groups
from kvcopy.testing import plans
from helpers.host_copies import random_bytes, run_on_host


class Run(NamedTuple):   # the fields of vLLM's CopyRunDescriptor
    src_base: int
    dst_base: int
    fragment_size: int
    num_fragments: int
    src_stride: int
    dst_stride: int


def test_runs_of_several_shapes_move_every_fragment():
    src = random_bytes((1 << 16,), 1)
    dst = np.zeros(1 << 16, np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    runs = [Run(s, d, 512, 4, 512, 4096), Run(s + 2048, d + 512, 512, 4, 512, 4096),
            (s + 8192, d + 20000, 128, 7, 1024, 136), Run(s + 30000, d + 40000, 64, 0, 64, 64),
            Run(s + 40000, d + 50000, 512, 4, 512, 4096)]
    groups = run_groups(runs)
    assert [(g[0].num_planes, g[2]) for g in groups] == [(3, 4), (1, 7)]
    for a, b, count in groups:
        run_on_host(*plans.expand(plans.plan_rows(a, b, rows=count)))
    want = np.zeros_like(dst)
    for run in runs:
        src_base, dst_base, size, count, src_stride, dst_stride = run
        for j in range(count):
            lo, to = src_base - s + j * src_stride, dst_base - d + j * dst_stride
            want[to:to + size] = src[lo:lo + size]
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("run, error, words", [
    ((64, 64, 8), TypeError, "run_descs[0]: 3 fields"),
    ("abcdef", TypeError, "run_descs[0]: not a CopyRunDescriptor"),
    ((0, 64, 8, 1, 8, 8), ValueError, "run_descs[0]: {'src_base': 0"),
    ((64, 64, 8, 1, -8, 8), ValueError, "is not a run"),
])
def test_bad_runs_are_named(run, error, words):
    with pytest.raises(error) as info:
        run_groups([run])
    assert words in str(info.value)
