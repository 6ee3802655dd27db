"""The describe pass's answer as a tuple, for tests that compare two passes, and as
the pass would give it, for fakes of the pass."""

from __future__ import annotations

import numpy as np

from kvcopy.testing import cuda

DescribedBatch = cuda.describe.DescribedBatch


def described_fields(batch: DescribedBatch) -> tuple[int, int, int, int, int, int, int]:
    """(count, total_bytes, src_kinds, src_device, dst_kinds, dst_device, tiles)."""
    return (
        batch.count,
        batch.total_bytes,
        batch.src_kinds,
        batch.src_device,
        batch.dst_kinds,
        batch.dst_device,
        batch.tiles,
    )


def described_like_the_pass(
    src,
    dst,
    sizes,
    kinds: tuple[int, int, int, int],
    table: int,
    tiles_per_copy: int = 1,
    compact_size: int = 0,
) -> DescribedBatch:
    """What the describe pass answers for a batch of non-empty copies that do not merge,
    in memory of ``kinds`` (src kinds, src device, dst kinds, dst device): for fakes of
    the describe pass in tests of the paths after it."""

    def spans(side: np.ndarray) -> int:
        return min(len(side), 1 + int(np.count_nonzero(side[1:] != side[:-1] + sizes[:-1])))

    return DescribedBatch(
        len(sizes),
        int(sizes.sum()),
        tiles_per_copy * len(sizes),
        *kinds,
        compact_size,
        table,
        src,
        dst,
        sizes,
        spans(src),
        spans(dst),
        int(sizes.max(initial=0)),
    )
