"""The describe pass's answer as a tuple, for tests that compare two passes."""
from __future__ import annotations

from kvcopy.testing import cuda
DescribedBatch = cuda.describe.DescribedBatch


def described_fields(batch: DescribedBatch) -> tuple[int, int, int, int, int, int, int]:
    """(count, total_bytes, src_kinds, src_device, dst_kinds, dst_device, tiles)."""
    return (batch.count, batch.total_bytes, batch.src_kinds, batch.src_device,
            batch.dst_kinds, batch.dst_device, batch.tiles)
