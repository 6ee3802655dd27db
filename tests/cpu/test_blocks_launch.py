"""The block kernel's launches, the parts that run before the driver: the staging each
needs, and the arguments refused before anything is written or enqueued (buffers of
address 0 are never touched)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcopy.testing import cuda

launch = cuda.launch

ROW = launch.BLOCK_TENSOR_BYTES  # one kvcopy_block_tensor: six 64-bit fields


def test_a_tensor_row_is_six_words():
    assert ROW == 48


@pytest.mark.parametrize("tensors, pairs", [(1, 1), (3, 5), (64, 256), (7, 0)])
def test_one_launch_stages_its_rows_then_its_id_pairs_at_a_16_byte_boundary(tensors, pairs):
    table = tensors * ROW
    assert launch.blocks_upload_bytes(tensors, pairs) == -(-table // 16) * 16 + pairs * 16


@pytest.mark.parametrize("ta, na, tb, nb", [(1, 1, 1, 1), (3, 5, 2, 7), (64, 256, 64, 256)])
def test_a_pair_stages_both_tables_back_to_back_then_both_mappings(ta, na, tb, nb):
    """The kernel finds side b's rows right after side a's, and its id pairs right
    after side a's, past the 16-byte boundary after both tables."""
    tables = (ta + tb) * ROW
    assert launch.blocks_both_upload_bytes(ta, na, tb, nb) == -(-tables // 16) * 16 + (na + nb) * 16


def side(tensors: int = 2, pairs: int = 3, columns: int = 6):
    return (np.zeros((tensors, columns), np.uint64), np.zeros((pairs, 2), np.int64))


@pytest.mark.parametrize(
    "a, b, bytes_ab, ctas, message",
    [
        (side(columns=5), side(), (4096, 4096), (4, 4), r"tensors must be \(T, 6\)"),
        (side(), side(pairs=0), (4096, 4096), (4, 4), "each side needs tensors, pairs and bytes"),
        (side(tensors=0), side(), (4096, 4096), (4, 4), "each side needs tensors, pairs and bytes"),
        (side(), side(), (4096, 0), (4, 4), "each side needs tensors, pairs and bytes"),
        (side(), side(), (4096, 4096), (0, 4), "max_ctas must be positive"),
    ],
)
def test_a_pair_refuses_bad_arguments_before_touching_its_buffers(a, b, bytes_ab, ctas, message):
    with pytest.raises(ValueError, match=message):
        launch.launch_blocks_both_uploaded(
            0, 0, 0, a[0], a[1], bytes_ab[0], ctas[0], b[0], b[1], bytes_ab[1], ctas[1], 512, 0
        )
