"""A layout transfer whose host side is rows back to back, moved through GPU staging
buffers (kvcopy._engine.rows_staged): which transfers qualify, and each chunk's work.

A chunk is a run of consecutive rows. Its host side is one span per plane, which the
copy engines move whole to (a load) or from (a store) a staging buffer; the layout
kernel scatters the staging rows to their GPU slots, or gathers them there, reading
the GPU side's indices on the GPU. The planner only computes addresses (numbers): the
engine issues what it says.
"""

from __future__ import annotations

import numpy as np

from kvcopy._plans.rows import RowsPlan
from kvcopy.layouts import Layout

_U64 = (1 << 64) - 1


def rows_back_to_back(layout: Layout) -> bool:
    """Whether every plane's row r lies at base + r * row_bytes, its pieces back to back:
    then rows r0 .. r1 - 1 of a plane are one span."""
    rb = layout.row_bytes
    if layout.pieces > 1 and layout.piece_stride != layout.piece_bytes:
        return False
    if layout.page_size == 1:
        return layout.slots == 1 or layout.page_stride == rb
    return layout.slot_stride == rb and layout.page_stride == layout.page_size * rb


def why_not_staged(plan: RowsPlan, load: bool, max_planes: int) -> str | None:
    """Why ``plan`` cannot be staged (None: it can), as a load (host side the source)
    or a store: its host side must have no indices and rows back to back in at most
    ``max_planes`` planes (one copy-engine span each per chunk); its GPU side must have
    indices, on the GPU (read in place) or on the host (uploaded once for the call)."""
    host, host_indices = (plan.src, plan.src_indices) if load else (plan.dst, plan.dst_indices)
    gpu_indices = plan.dst_indices if load else plan.src_indices
    if host_indices is not None:
        return "the host side has indices"
    if gpu_indices is None:
        return "the GPU side has no indices"
    if not rows_back_to_back(host):
        return "the host side's rows are not back to back"
    if host.num_planes > max_planes:
        return f"the host side has {host.num_planes} planes (at most {max_planes} are staged)"
    return None


def chunk_rows(plan: RowsPlan, chunk_bytes: int) -> int:
    """Rows per chunk: as many as fit ``chunk_bytes`` in every plane. Raises ValueError
    where not one row does."""
    per = chunk_bytes // (plan.src.num_planes * plan.src.row_bytes)
    if per == 0:
        raise ValueError(
            f"a staging chunk of {chunk_bytes} bytes holds no row of "
            f"{plan.src.num_planes} planes x {plan.src.row_bytes} bytes"
        )
    return per


class StagedChunks:
    """Every chunk of a plan, chunk_rows() rows each (the last the rest), chunk k through
    the staging buffer at ``buffers[k % len(buffers)]``, worked out in a few array
    operations for all chunks at once (per chunk they cost the CPU more than issuing),
    as arrays for kvcopy._cuda.rows.StagedRowsSide. Chunk k copies rows
    ``first_rows[k]`` .. ``first_rows[k] + row_counts[k] - 1``; per plane p, its host
    span is at ``host[k, p]``, its place in the buffer at ``staged[k, p]``, its bytes
    ``nbytes[k, p]``, and ``staging_bases[k, p]`` is the base such that its row r lies at
    base + r * row_bytes in the buffer (modulo 2**64: the layout kernel numbers rows
    from the transfer's first). All uint64, (chunks, planes) C-contiguous, or a chunk
    each for the rows."""

    def __init__(self, plan: RowsPlan, load: bool, chunk_bytes: int, buffers: tuple[int, ...]) -> None:
        host = plan.src if load else plan.dst
        rb, planes = np.uint64(host.row_bytes), host.num_planes
        self.per = chunk_rows(plan, chunk_bytes)
        self.count = -(-plan.rows // self.per)
        firsts = np.arange(self.count, dtype=np.uint64) * np.uint64(self.per)
        rows = np.minimum(np.uint64(self.per), np.uint64(plan.rows) - firsts)
        buffer = np.asarray(buffers, dtype=np.uint64)[np.arange(self.count) % len(buffers)]
        plane = np.arange(planes, dtype=np.uint64)
        offset = firsts * rb
        self.first_rows, self.row_counts = firsts, rows
        self.host = host.bases[None, :] + offset[:, None]
        self.staged = buffer[:, None] + plane[None, :] * (rows * rb)[:, None]
        self.nbytes = np.repeat((rows * rb)[:, None], planes, axis=1)
        self.staging_bases = self.staged - offset[:, None]  # (uint64: modulo 2**64)

    def __len__(self) -> int:
        return self.count


def staging_side(plan: RowsPlan) -> tuple[int, int, int, int, int, int]:
    """The staging buffer as a side of the layout kernel's job: rows back to back, no
    indices, the job's pieces back to back."""
    rb = plan.src.row_bytes
    return (0, _U64, 1, rb, rb, plan.piece_bytes)
