"""Issues a described batch by the copy kernel: descriptors by value in one launch
for small batches and under capture, else a table in a ring slot, read in place or
uploaded first, in one launch or several (config.launch_bytes)."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from kvcopy import policy
from kvcopy._cuda import describe, launch
from kvcopy._cuda.describe import DescribedBatch
from kvcopy._engine.decide import Target
from kvcopy._runtime import kernels, ring
from kvcopy.config import config


def launch_kernel(
    batch: DescribedBatch, target: Target, slot: "ring.Slot | HostScratch", max_ctas: int | None
) -> tuple[int, int, int, int] | None:
    """Launch the copy kernel over ``batch``, described into ``slot`` (its entries
    kvcopy_compact_desc where batch.compact_size says so).

    Large batches: one launch. Where every copy is one tile, the kernel reads
    the descriptors where they were written (pinned, mapped): each warp
    fetches its next 32 while it copies, so the fetch hides behind the copies
    instead of an upload running before the kernel. Multi-tile batches and copies between GPUs
    have their descriptors uploaded to the slot's device buffer first. Small batches and
    capture: descriptors by value, which graphs keep with the launch (and
    which leave the slot free at once); for those, returns what they were
    launched with: (function, descriptors per launch, CTAs, threads)."""
    info, handle = target.info, target.handle
    count, tiles, compact_size = batch.count, batch.tiles, batch.compact_size
    kernel = kernels.kernel_for_current_context(*info.cc, info.driver_version)
    functions = kernel.scatter(target.decision.variant)
    ctas, threads = target.launch_shape(max_ctas)
    # compact entries come only from batches past one launch's inline descriptors (describe_compact)
    if compact_size or (count > kernel.per_launch and not target.request.capturing):
        assert isinstance(slot, ring.Slot)  # only capture and small batches use scratch memory
        in_place = policy.descriptors_in_place(tiles, count, (target.request.direction,))
        table, upload = (slot.mapped, 0) if in_place else (slot.device, slot.host)
        entry = describe.COMPACT_BYTES if compact_size else describe.DESCRIPTOR_BYTES
        step = policy.copies_per_launch(
            target.request.direction, count, target.request.total_bytes, config.launch_bytes
        )
        if step >= count:
            slice_tiles = [tiles]
        elif compact_size:  # compact entries have no tile_start: any slice is a batch
            slice_tiles = [min(step, count - start) for start in range(0, count, step)]
        else:
            slice_tiles = number_tiles_per_slice(slot.host, count, tiles, np.arange(0, count, step))
        if upload and len(slice_tiles) > 1:
            # one upload ahead of all the launches: one per launch sat between each
            # two on the stream, a copy engine's round trip each
            launch.upload(table, upload, count * entry, handle)
            upload = 0
        for k, start in enumerate(range(0, count, step)):
            n, offset = min(step, count - start), start * entry
            # (an upload left here is a single launch's, at offset 0)
            if compact_size:
                launch.launch_compact(
                    functions.compact, table + offset, n, compact_size, ctas, threads, handle, upload
                )
            else:
                launch.launch_descs(
                    functions.uploaded, table + offset, n, slice_tiles[k], ctas, threads, handle, upload
                )
        ring.DescriptorRing.fence(slot, handle)
        return None
    # the smaller variants' parameters (1 or 4 KiB) cost the driver less to copy per launch
    if count <= launch.INLINE_MAX_TINY:
        function, per_launch = functions.tiny, launch.INLINE_MAX_TINY
    elif count <= launch.INLINE_MAX_SMALL or kernel.per_launch != launch.INLINE_MAX:
        function, per_launch = functions.small, launch.INLINE_MAX_SMALL
    else:
        function, per_launch = functions.inline, kernel.per_launch
    launch.launch_descs_inline(function, per_launch, slot.host, count, ctas, threads, handle)
    return function, per_launch, ctas, threads


class HostScratch:
    """Where descriptors passed by value are described: plain host memory of the
    calling thread. Used under capture (the graph keeps the descriptors with its
    launch nodes, and the descriptor ring, whose events must not be queried
    during a capture, is left alone) and for small batches, whose one launch
    takes its descriptors by value anyway: nothing has to outlive the call."""

    _local = threading.local()

    def __init__(self, nbytes: int) -> None:
        local = self._local
        if getattr(local, "nbytes", 0) < nbytes:
            local.buffer = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
            # the address, kept: asking NumPy for it (.ctypes) costs microseconds per call
            local.nbytes, local.host = local.buffer.nbytes, local.buffer.ctypes.data
        self.host: int = local.host

    def __enter__(self) -> "HostScratch":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def pinned_descriptors(host: int, count: int) -> np.ndarray:
    """The ``count`` 32-byte descriptors at ``host`` (pinned), as a (count, 4) uint64 view:
    src, dst, size, tile_start."""
    pinned = (ctypes.c_char * (count * describe.DESCRIPTOR_BYTES)).from_address(host)
    return np.frombuffer(memoryview(pinned), dtype=np.uint64).reshape(count, 4)


def number_tiles_per_slice(host_table: int, count: int, tiles: int, starts: np.ndarray) -> list[int]:
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
