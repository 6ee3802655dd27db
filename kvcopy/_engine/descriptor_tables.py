"""The copy kernel's descriptor tables in pinned memory, as NumPy sees them."""
from __future__ import annotations

import ctypes

import numpy as np

from kvcopy._cuda import describe


def pinned_descriptors(host: int, count: int) -> np.ndarray:
    """The ``count`` 32-byte descriptors at ``host`` (pinned), as a (count, 4) uint64 view:
    src, dst, size, tile_start."""
    pinned = (ctypes.c_char * (count * describe.DESCRIPTOR_BYTES)).from_address(host)
    return np.frombuffer(memoryview(pinned), dtype=np.uint64).reshape(count, 4)


def number_tiles_per_slice(host_table: int, count: int, tiles: int,
                           starts: np.ndarray) -> list[int]:
    """Renumber the tiles of the ``count`` descriptors at ``host_table`` (pinned, not yet
    read by the GPU) so that each slice (``starts``: each slice's first descriptor,
    ascending, the first 0) counts its tiles from 0, as a batch of its own; return
    each slice's tile count. The kernel finds a tile's copy by its tile_start, so a
    slice launched alone must start at 0 (where every copy is one tile, the kernel
    ignores tile_start and the table is left as it is)."""
    counts = np.diff(np.append(starts, count))
    if tiles == count:
        return [int(n) for n in counts]
    table = pinned_descriptors(host_table, count)
    first_tiles = table[starts, 3].copy()
    ends = np.append(first_tiles[1:], np.uint64(tiles))
    table[:, 3] -= np.repeat(first_tiles, counts)
    return [int(t) for t in ends - first_tiles]
