"""A copy_rows transfer planned once and issued by each call: what a serving step
that moves the same layouts by an index tensor it refills pays per step."""

from __future__ import annotations

from typing import Any

from kvcopy._engine.decide import note_decision
from kvcopy._engine.rows import prepare_launches
from kvcopy._plans.rows import plan_rows, rows_stream
from kvcopy.layouts import Layout


class PreparedRows:
    """A copy_rows transfer checked, classified and built once (kvcopy.prepare_rows);
    each call enqueues the layout kernel on the stream it was prepared for.

    The indices are read on the GPU when each copy runs, so refill them in place
    (``slots.copy_(new, non_blocking=True)`` on the same stream) between calls; the
    object keeps the layouts and the index tensors alive. What was fixed at
    preparation stays fixed: the layouts, the indices' memory and count, the stream,
    and the kernel's CTAs. A call costs the CPU one launch per 128 planes, whatever
    the number of rows, and may be captured in a CUDA graph. Out-of-range indices
    skip their rows and are reported by kvcopy.check_indices, as copy_rows'.
    """

    __slots__ = ("_launches", "_decision", "_keep", "rows", "stream")

    def __init__(self, launches: Any, decision: Any, keep: tuple, rows: int, stream: int) -> None:
        self._launches = launches
        self._decision = decision
        self._keep = keep
        self.rows = rows  # rows per call (row r: index r of each side's indices)
        self.stream = stream  # the raw stream handle every call enqueues on

    def __call__(self) -> str:
        """Enqueue the transfer; returns 'kernel' ('none' for a transfer of no rows).
        Raises ValueError, enqueuing nothing, where a tensor of either layout has moved
        since (``resize_``, ``set_``), and CudaError where the launch fails (its
        context destroyed, say)."""
        if self._launches is None:
            return "none"
        for layout, name in zip(self._keep[:2], ("src", "dst")):
            layout.check_current(name)
        self._launches.launch()
        note_decision(self._decision)
        return "kernel"

    def __repr__(self) -> str:
        return f"<kvcopy.PreparedRows {self.rows} rows on stream {self.stream:#x}>"


def prepare_rows(
    src: Layout,
    dst: Layout,
    src_indices: Any = None,
    dst_indices: Any = None,
    *,
    rows: int | None = None,
    stream: Any = None,
) -> PreparedRows:
    """Prepare a copy_rows transfer to be issued many times: every argument is checked,
    the memory classified and the layout kernel's launches built now, so that each
    call of the result costs one launch on the CPU (copy_rows plans the whole transfer
    at every call).

    Arguments are copy_rows'. Indices must be on the GPU (read when each copy runs)
    or None (slot = row); host indices are refused with ValueError, since they would
    have to be checked and uploaded at each call (copy_rows does that). Both layouts
    must be in memory the GPU reads and writes (GPU or pinned host memory). The stream
    is resolved now (None: the current stream of the framework whose tensors were
    passed, else the default stream).

    Raises:
        TypeError, ValueError: bad arguments, named in the message.
        CudaError: the driver failed.
    """
    plan = plan_rows(src, dst, src_indices, dst_indices, rows)
    handle = rows_stream(stream, (src, dst), (src_indices, dst_indices))
    launches, decision = prepare_launches(plan, handle)
    keep = (src, dst, plan.src_indices, plan.dst_indices)
    return PreparedRows(launches, decision, keep, plan.rows, handle)
