"""The layout kernel's defaults (copy_rows, and swap_blocks of one stride per side):
its CTAs between host and GPU, and how swap_blocks' ids go up. Pure functions,
unit-tested on the CPU; each default's measurement is in docs/design.md."""

from __future__ import annotations

from kvcopy.policy.defaults import ID_CHUNK_GROWTH, ID_FIRST_CHUNK, ROWS_HOST_CTAS


def rows_host_ctas(direction: str, host_ctas: int | None = None) -> int:
    """CTAs of the layout kernel (copy_rows) for a batch touching host memory
    (``direction`` 'h2d', 'd2h' or 'mixed', which gets the larger): ROWS_HOST_CTAS, or
    ``host_ctas`` where the caller set one (config.host_ctas). The block kernel's
    calibrated host CTAs do not apply: the layout kernel reads an index before each
    row and needs its own count. Inside a GPU and between two, it takes the copy
    kernel's (device_ctas, peer_ctas)."""
    if host_ctas:
        return host_ctas
    return ROWS_HOST_CTAS.get(direction, max(ROWS_HOST_CTAS.values()))


def id_chunks(pairs: int, first: int = ID_FIRST_CHUNK, growth: int = ID_CHUNK_GROWTH) -> list[int]:
    """How many of a swap_blocks call's ``pairs`` each launch of the layout kernel takes,
    in order: ``first``, then each at most ``growth`` times the one before, the last
    taking the rest (one launch for ``first`` pairs or fewer)."""
    chunks: list[int] = []
    size, left = max(first, 1), pairs
    while left > 0:
        take = min(size, left)
        chunks.append(take)
        left -= take
        size *= max(growth, 1)
    return chunks
