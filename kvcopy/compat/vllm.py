"""Drop-ins for vLLM's ``ops.swap_blocks_batch`` and its offload copy backend.

vLLM's op takes three 1-D CPU tensors (source pointers, destination pointers,
byte sizes; int64, or uint64 as on XPU), copies on torch's current stream and
issues cuMemcpyBatchAsync, which fails on the legacy default stream;
``is_src_access_order_any`` relaxes the source ordering of that call, and
``use_batch_api=False`` keeps it from being called at all (per-copy
cudaMemcpyAsync instead), for GPUs where the batch API crashed. This shim keeps
the signature and the meaning of every argument and lets kvcopy choose the
method: the legacy stream works, small blocks go through the copy kernel, and
``use_batch_api=False`` never reaches cuMemcpyBatchAsync.

vLLM's offload worker describes a transfer as strided runs (``CopyRunDescriptor``)
and hands them to a copy backend through a per-direction adapter; ``CopyBackend``
and ``CopyBackendAdapter`` keep those two interfaces and copy the runs as
``kvcopy.copy_rows`` does, never expanding them into one descriptor per fragment.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import numpy as np

from kvcopy.arguments import require_bool, require_int, require_same_length
from kvcopy._cuda.plan_arrays import run_table
from kvcopy._plans.rows import plan_rows
from kvcopy._plans.rows_races import refuse_rows_crossing
from kvcopy.pointers import copy_batch
from kvcopy.rows import copy_planned_rows
from kvcopy.errors import NoDriverError
from kvcopy.interop.streams import resolve_stream, torch_current_handle
from kvcopy.layouts import Layout


def _torch_stream(caller: str) -> int:
    """torch's current CUDA stream, on which vLLM's ops copy, as a raw handle;
    NoDriverError where torch has none (a torch built without CUDA, or no GPU)."""
    import torch  # noqa: F401 - (torch_current_handle reads the module imported)

    try:
        return torch_current_handle()
    except (AssertionError, RuntimeError) as exc:
        raise NoDriverError(
            f"{caller} copies on torch's current CUDA stream, and torch has none here: {exc}"
        ) from None


def _check(tensor: Any, name: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.dtype not in (torch.int64, torch.uint64) or tensor.dim() != 1:
        raise TypeError(
            f"{name} must be a 1-D CPU int64 (or uint64) tensor, got {tensor.dtype} "
            f"of shape {tuple(tensor.shape)} on {tensor.device}"
        )


def swap_blocks_batch(
    src_ptrs: Any,
    dst_ptrs: Any,
    sizes: Any,
    is_src_access_order_any: bool = False,
    use_batch_api: bool = True,
    *,
    bytes_per_chunk: int | None = None,
) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` on torch's current stream.

    Args:
        is_src_access_order_any: as vLLM's: the batched DMA path may read the
            sources out of stream order (only safe when nothing on the GPU may
            still be writing them).
        use_batch_api: False never calls cuMemcpyBatchAsync (the copy kernel or
            one cuMemcpyAsync per copy run instead).
        bytes_per_chunk: the chunk of vLLM's Triton ``swap_blocks_batch``, whose
            calls this also takes; accepted (kvcopy's kernel shapes its own work).
    """
    for tensor, name in ((src_ptrs, "src_ptrs"), (dst_ptrs, "dst_ptrs"), (sizes, "sizes")):
        _check(tensor, name)
    access_any = require_bool(is_src_access_order_any, "is_src_access_order_any")
    allow_batch = require_bool(use_batch_api, "use_batch_api")
    if bytes_per_chunk is not None:
        require_int(bytes_per_chunk, "bytes_per_chunk", minimum=1)
    require_same_length(src_ptrs, dst_ptrs, sizes)  # (before torch is asked for its stream)
    stream = _torch_stream("swap_blocks_batch")
    copy_batch(
        src_ptrs,
        dst_ptrs,
        sizes,
        stream=stream,
        src_access_order="any" if access_any else "stream",
        allow_batch=allow_batch,
    )


class CopyRunDescriptor(NamedTuple):
    """vLLM's strided run: ``num_fragments`` fragments of ``fragment_size`` bytes, the
    j-th at ``src_base + j * src_stride``, copied to ``dst_base + j * dst_stride``."""

    src_base: int
    dst_base: int
    fragment_size: int
    num_fragments: int
    src_stride: int
    dst_stride: int


_RUN_FIELDS = CopyRunDescriptor._fields


def _run_table(runs: list) -> np.ndarray | None:
    """The runs as a (6, n) uint64 table (a row a field, the runs with fragments) in one
    C pass, where every run is a tuple of one type with CopyRunDescriptor's fields in
    its order and holds only plain ints (None: the per-run reading below names
    whatever is wrong)."""
    if not runs:
        return np.empty((6, 0), dtype=np.uint64)
    kind = type(runs[0])
    if not issubclass(kind, tuple) or getattr(kind, "_fields", _RUN_FIELDS) != _RUN_FIELDS:
        return None
    return run_table(runs, kind)


def _read_runs(runs: list) -> np.ndarray:
    """The runs read one by one, each checked and named where it is not a run."""
    table = []
    for i, run in enumerate(runs):
        try:
            fields = [getattr(run, f) for f in _RUN_FIELDS] if hasattr(run, "src_base") else list(run)
        except TypeError:
            raise TypeError(f"run_descs[{i}]: not a CopyRunDescriptor or a tuple of 6 ints")
        if len(fields) != 6:
            raise TypeError(f"run_descs[{i}]: {len(fields)} fields, expected {_RUN_FIELDS}")
        values = []
        for name, value in zip(_RUN_FIELDS, fields):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(
                    f"run_descs[{i}]: not a CopyRunDescriptor or a tuple of 6 "
                    f"ints: {name} is a {type(value).__name__} ({value!r})"
                )
            values.append(int(value))
        src, dst, size, count, src_stride, dst_stride = values
        if min(values) < 0 or (count and (src == 0 or dst == 0 or size == 0)):
            raise ValueError(f"run_descs[{i}]: {dict(zip(_RUN_FIELDS, values))} is not a run")
        if count:
            table.append(values)
    return np.array(table, dtype=np.uint64).reshape(-1, 6)


def _live_runs(run_descs: Any) -> np.ndarray:
    """The runs with fragments as a (6, n) uint64 table, a row a field; TypeError or
    ValueError naming the run that is not one."""
    runs = run_descs if isinstance(run_descs, list) else list(run_descs)
    table = _run_table(runs)
    return np.ascontiguousarray(_read_runs(runs).T) if table is None else table


def run_groups(run_descs: Any) -> list[tuple[Layout, Layout, int]]:
    """vLLM's strided runs (``CopyRunDescriptor``: src_base, dst_base, fragment_size,
    num_fragments, src_stride, dst_stride; any object with those attributes, or a
    6-tuple in that order) as layout pairs: runs of one shape (fragment size, count
    and both strides) become the planes of one pair, in the order first met, each
    run's fragment j a row. Runs of no fragments are left out. Raises TypeError or
    ValueError naming the run. A list of one kind of tuple is read in one pass."""
    return _groups(_live_runs(run_descs).T)


def _groups(table: np.ndarray) -> list[tuple[Layout, Layout, int]]:
    """run_groups of an (n, 6) table of runs with fragments."""
    if len(table) == 0:
        return []
    shapes = table[:, 2:]
    groups: list[np.ndarray]
    if (shapes == shapes[0]).all():  # (the usual case: one shape of run)
        groups = [table]
    else:
        _, first, which = np.unique(shapes, axis=0, return_index=True, return_inverse=True)
        which = which.reshape(-1)
        groups = [table[which == g] for g in np.argsort(first, kind="stable")]
    pairs = []
    for group in groups:
        size, count, src_stride, dst_stride = (int(v) for v in group[0, 2:])
        pairs.append(
            (
                Layout.from_pointers(group[:, 0], slots=count, row_bytes=size, slot_stride=src_stride),
                Layout.from_pointers(group[:, 1], slots=count, row_bytes=size, slot_stride=dst_stride),
                count,
            )
        )
    return pairs


def _refuse_crossing_shapes(plans: list) -> None:
    """ValueError where runs of two shapes touch the same bytes, one of them writing:
    the groups of one submit run in no order (within a shape, plan_rows refuses it)."""
    for i, first in enumerate(plans):
        for j in range(i + 1, len(plans)):
            try:
                refuse_rows_crossing(first, plans[j])
            except ValueError:
                raise ValueError(
                    f"run_descs: runs of shape {i} and of shape {j} (in the order "
                    "first met) touch the same bytes, at least one of them "
                    "writing; the runs of one submit run in no order"
                ) from None


def _stream_of(stream: Any) -> int | None:
    """The handle of CopyBackend.submit's ``stream``: torch's current one for None."""
    return _torch_stream("CopyBackend.submit") if stream is None else resolve_stream(stream)


def _copy_fragments(table: np.ndarray, stream: int | None) -> bool:
    """Runs of one fragment each (a (6, n) table), copied as the pointer copies they are
    (copy_batch: read, checked, classified and described in one C pass); False, with
    nothing enqueued, where copy_batch refuses them (copy_rows' reading then names what
    is wrong, run by run)."""
    try:
        copy_batch(table[0], table[1], table[2], stream=stream)
    except ValueError:
        return False
    return True


class CopyBackend:
    """vLLM's offload copy backend (``vllm.v1.kv_offload.cpu.copy_backend.CopyBackend``:
    ``submit(run_descs)``, ``finish_transfer()``, ``clear()``) over kvcopy.copy_rows.

    ``submit`` copies the runs (``CopyRunDescriptor``, any object with its fields, or a
    6-tuple in their order) on torch's current stream without expanding them into
    fragments: one copy_rows per shape of run (see run_groups), whatever the fragments'
    size or alignment; runs of one fragment each (a block of a layer a run, as vLLM's
    worker describes a job) are the pointer copies they are, one copy_batch. Every group
    is planned, with all of copy_rows' checks, before any is enqueued; a submit that
    raises records no transfer. Fragments that write the same bytes twice, or read bytes
    another fragment writes, are refused (ValueError), within one shape of run and
    between shapes: their copies would run in no order. Nothing is held per transfer, so
    ``finish_transfer`` only retires the oldest one in flight (RuntimeError where none
    is) and ``clear`` forgets them all.

    ``is_src_access_order_any`` is kept for vLLM's constructor: kvcopy reads the sources
    in stream order, which is correct for either value."""

    def __init__(self, *, is_src_access_order_any: bool = False) -> None:
        self.is_src_access_order_any = require_bool(is_src_access_order_any, "is_src_access_order_any")
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Transfers submitted and not yet finished."""
        return self._in_flight

    def submit(self, run_descs: Any, *, stream: Any = None) -> None:
        """Copy every fragment of ``run_descs`` on ``stream``: any stream
        kvcopy.resolve_stream takes; None (vLLM's call) is torch's current stream."""
        table = _live_runs(run_descs)
        if table.shape[1] and (table[3] == 1).all() and _copy_fragments(table, _stream_of(stream)):
            self._in_flight += 1
            return
        # (every group planned, with copy_rows' checks, before any is issued)
        plans = [plan_rows(src, dst, None, None, count) for src, dst, count in _groups(table.T)]
        _refuse_crossing_shapes(plans)
        if plans:
            handle = _stream_of(stream)
            for plan in plans:
                copy_planned_rows(plan, handle)
        self._in_flight += 1

    def finish_transfer(self) -> None:
        """Retire the oldest transfer in flight (its copies are done: the caller waited)."""
        if not self._in_flight:
            raise RuntimeError("finish_transfer: no transfer is in flight")
        self._in_flight -= 1

    def clear(self) -> None:
        """Forget every transfer in flight."""
        self._in_flight = 0


class CopyBackendAdapter:
    """vLLM's per-direction adapter (``vllm.v1.kv_offload.cpu.copy_backend
    .CopyBackendAdapter``): the worker's job ids over one kvcopy CopyBackend, built from
    the adapter's own arguments, so that vLLM's CPU offload worker takes it in place of
    its own::

        from vllm.v1.kv_offload.cpu import gpu_worker
        gpu_worker.CopyBackendAdapter = kvcopy.compat.vllm.CopyBackendAdapter

    ``gpu_to_cpu`` sets the backend's ``is_src_access_order_any`` as vLLM does (any for
    loads); ``layer_refs_per_group``, ``host_memory_is_pinned`` and ``copy_runs`` are
    accepted and not needed: kvcopy finds the kind of each memory itself and takes runs
    of any size, stride and alignment. Transfers finish in submission order, as in vLLM:
    ``finish_transfer`` of any job but the oldest in flight raises RuntimeError."""

    @staticmethod
    def resolve(
        layer_refs_per_group: Any = None,
        gpu_to_cpu: bool = False,
        host_memory_is_pinned: bool = True,
        copy_runs: Any = None,
    ) -> CopyBackend:
        """The backend for one direction (vLLM's ``resolve``, which picks among its own)."""
        require_bool(host_memory_is_pinned, "host_memory_is_pinned")
        return CopyBackend(is_src_access_order_any=not require_bool(gpu_to_cpu, "gpu_to_cpu"))

    def __init__(
        self,
        layer_refs_per_group: Any = None,
        gpu_to_cpu: bool = False,
        host_memory_is_pinned: bool = True,
        copy_runs: Any = None,
    ) -> None:
        self.backend = self.resolve(layer_refs_per_group, gpu_to_cpu, host_memory_is_pinned, copy_runs)
        self._jobs: deque[Any] = deque()

    def submit(self, job_id: Any, run_descs: Any, *, is_src_access_order_any: bool | None = None) -> None:
        """Copy the job's runs (``is_src_access_order_any``, passed by earlier vLLM
        workers, is checked and, as the backend's, needs nothing of kvcopy)."""
        if is_src_access_order_any is not None:
            require_bool(is_src_access_order_any, "is_src_access_order_any")
        self.backend.submit(run_descs)
        self._jobs.append(job_id)

    def finish_transfer(self, job_id: Any) -> None:
        """Retire ``job_id``, the oldest job in flight."""
        if not self._jobs or self._jobs[0] != job_id:
            oldest = f"job {self._jobs[0]!r} is" if self._jobs else "no job is"
            raise RuntimeError(
                f"finish_transfer({job_id!r}): transfers finish in submission "
                f"order, and {oldest} the oldest in flight"
            )
        self._jobs.popleft()
        self.backend.finish_transfer()

    def clear(self) -> None:
        """Forget every job in flight."""
        self._jobs.clear()
        self.backend.clear()


__all__ = [
    "CopyBackend",
    "CopyBackendAdapter",
    "CopyRunDescriptor",
    "run_groups",
    "swap_blocks_batch",
]
