"""How a pinned host pool is built: which pages back it, where its registrations end,
and how many threads touch it first. Pure functions of the request and the host's
facts (kvcopy._runtime.numa reads them), unit-tested on the CPU with faked facts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcopy.policy.defaults import (
    POOL_CHUNK_BYTES,
    POOL_EXPLICIT_MAX_WASTE,
    POOL_MAX_CHUNK_BYTES,
    POOL_TOUCH_THREADS,
    POOL_TOUCH_WAVE_BYTES,
)

HUGE_PAGES = ("auto", "explicit", "transparent", "none")


@dataclass(frozen=True)
class PageChoice:
    """The pages that back a pool: ``kind`` 'explicit' (hugetlbfs pages reserved by
    the administrator), 'transparent' (the kernel's huge pages, asked for with
    madvise) or 'plain'; ``page_bytes`` their size; ``note`` why, naming any
    fallback."""

    kind: str
    page_bytes: int
    note: str


def choose_pages(
    nbytes: int,
    asked: str,
    free_explicit: dict[int, int],
    transparent_mode: str,
    transparent_bytes: int,
    base_page: int,
) -> PageChoice:
    """The pages for ``nbytes`` when ``asked`` ('auto', 'explicit', 'transparent',
    'none'): explicit pages of the largest size the node holds enough free of and
    that waste at most POOL_EXPLICIT_MAX_WASTE of the pool in rounding, else
    transparent ones where the kernel grants them (mode 'always' or 'madvise') and the
    pool holds one, else plain pages. ValueError where what was asked by name is not
    there."""
    if asked not in HUGE_PAGES:
        raise ValueError(f"huge_pages must be one of {', '.join(HUGE_PAGES)}, got {asked!r}")
    if asked == "none":
        return PageChoice("plain", base_page, "plain pages, as asked")
    notes = []
    if asked in ("auto", "explicit"):
        for size in sorted(free_explicit, reverse=True):
            pages = -(-nbytes // size)
            if pages <= free_explicit[size] and pages * size - nbytes <= nbytes * POOL_EXPLICIT_MAX_WASTE:
                return PageChoice("explicit", size, f"explicit huge pages of {size >> 10} KiB")
        free = ", ".join(f"{count} of {size >> 10} KiB" for size, count in sorted(free_explicit.items()))
        notes.append(f"no explicit huge pages fit ({free or 'none reserved'} free on the node)")
        if asked == "explicit":
            raise ValueError(f"huge_pages='explicit': {notes[0]} for {nbytes} bytes")
    if transparent_mode in ("always", "madvise") and nbytes >= transparent_bytes:
        return PageChoice("transparent", transparent_bytes, "; ".join([*notes, "transparent huge pages"]))
    why = (
        f"transparent huge pages are {transparent_mode!r}"
        if transparent_mode not in ("always", "madvise")
        else f"the pool is smaller than a transparent huge page ({transparent_bytes} bytes)"
    )
    if asked == "transparent":
        raise ValueError(f"huge_pages='transparent': {why}")
    return PageChoice("plain", base_page, "; ".join([*notes, why, "plain pages"]))


def registration_chunks(
    nbytes: int, page_bytes: int, block_bytes: int | None, chunk_bytes: int | None = None
) -> list[tuple[int, int]]:
    """(offset, size) of each registration of a pool of ``nbytes``: about
    ``chunk_bytes`` (POOL_CHUNK_BYTES) each, so that no registration holds the
    driver's locks for long, ending on a page (no page in two registrations) and on a
    block (the copy engines refuse a copy across two registrations). ValueError where
    blocks and pages meet only further apart than POOL_MAX_CHUNK_BYTES."""
    step = math.lcm(page_bytes, block_bytes) if block_bytes else page_bytes
    if step > POOL_MAX_CHUNK_BYTES:
        raise ValueError(
            f"block_bytes={block_bytes} and pages of {page_bytes} bytes end together only "
            f"every {step} bytes, more than one registration may hold "
            f"({POOL_MAX_CHUNK_BYTES}): pick a block size that is a multiple or a "
            "divisor of the page size, or other pages (huge_pages)"
        )
    target = POOL_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    size = max(step, min(target, POOL_MAX_CHUNK_BYTES) // step * step)
    return [(offset, min(size, nbytes - offset)) for offset in range(0, nbytes, size)]


def touch_threads(cpus: int, nbytes: int, page_bytes: int) -> int:
    """Threads that touch a pool first: one per CPU of its node, at most
    POOL_TOUCH_THREADS, and no more than it has pages."""
    return max(1, min(cpus, POOL_TOUCH_THREADS, -(-nbytes // page_bytes)))


def touch_waves(chunks: list[tuple[int, int]], mapped: int) -> list[tuple[int, int]]:
    """(offset, size) of each wave of a pool's first touch, in order, over its
    registration ``chunks`` (registration_chunks) and ``mapped`` bytes: the first chunk
    alone, then runs of whole chunks of at least POOL_TOUCH_WAVE_BYTES (0: the rest in
    one); the last runs to the end of the mapping. Waves end where chunks end, so a registration waits
    for the wave that holds it, and no later one."""
    waves: list[tuple[int, int]] = []
    start = 0
    for k, (offset, size) in enumerate(chunks):
        end = offset + size
        if k == 0 or 0 < POOL_TOUCH_WAVE_BYTES <= end - start:
            waves.append((start, end - start))
            start = end
    chunks_end = chunks[-1][0] + chunks[-1][1] if chunks else 0
    if start < chunks_end:
        waves.append((start, chunks_end - start))
    if waves:  # (the last wave also touches the mapping's rounding past the pool)
        waves[-1] = (waves[-1][0], mapped - waves[-1][0])
    return waves
