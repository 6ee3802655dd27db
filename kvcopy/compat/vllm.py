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
"""
from __future__ import annotations

from typing import Any

from kvcopy.arguments import require_bool
from kvcopy.api import copy_batch, copy_rows
from kvcopy.errors import NoDriverError
from kvcopy.layouts import Layout


def _check(tensor: Any, name: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if (tensor.device.type != "cpu" or tensor.dtype not in (torch.int64, torch.uint64)
            or tensor.dim() != 1):
        raise TypeError(f"{name} must be a 1-D CPU int64 (or uint64) tensor, got {tensor.dtype} "
                        f"of shape {tuple(tensor.shape)} on {tensor.device}")


def swap_blocks_batch(src_ptrs: Any, dst_ptrs: Any, sizes: Any,
                      is_src_access_order_any: bool = False, use_batch_api: bool = True) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` on torch's current stream.

    Args:
        is_src_access_order_any: as vLLM's: the batched DMA path may read the
            sources out of stream order (only safe when nothing on the GPU may
            still be writing them).
        use_batch_api: False never calls cuMemcpyBatchAsync (the copy kernel or
            one cuMemcpyAsync per copy run instead).
    """
    import torch

    for tensor, name in ((src_ptrs, "src_ptrs"), (dst_ptrs, "dst_ptrs"), (sizes, "sizes")):
        _check(tensor, name)
    access_any = require_bool(is_src_access_order_any, "is_src_access_order_any")
    allow_batch = require_bool(use_batch_api, "use_batch_api")
    try:
        stream = torch.cuda.current_stream()
    except (AssertionError, RuntimeError) as exc:   # a torch without CUDA, or no GPU
        raise NoDriverError(f"swap_blocks_batch copies on torch's current CUDA stream, and "
                            f"torch has none here: {exc}") from None
    copy_batch(src_ptrs, dst_ptrs, sizes, stream=stream,
               src_access_order="any" if access_any else "stream", allow_batch=allow_batch)


_RUN_FIELDS = ("src_base", "dst_base", "fragment_size", "num_fragments", "src_stride",
               "dst_stride")


def run_groups(run_descs: Any) -> list[tuple[Layout, Layout, int]]:
    """vLLM's strided runs (``CopyRunDescriptor``: src_base, dst_base, fragment_size,
    num_fragments, src_stride, dst_stride; any object with those attributes, or a
    6-tuple in that order) as layout pairs: runs of one shape (fragment size, count
    and both strides) become the planes of one pair, in the order first met, each
    run's fragment j a row. Runs of no fragments are left out. Raises TypeError or
    ValueError naming the run."""
    groups: dict[tuple[int, int, int, int], tuple[list[int], list[int]]] = {}
    for i, run in enumerate(run_descs):
        try:
            values = ([int(getattr(run, f)) for f in _RUN_FIELDS] if hasattr(run, "src_base")
                      else [int(v) for v in run])
        except (TypeError, ValueError):
            raise TypeError(f"run_descs[{i}]: not a CopyRunDescriptor or a tuple of 6 ints")
        if len(values) != 6:
            raise TypeError(f"run_descs[{i}]: {len(values)} fields, expected {_RUN_FIELDS}")
        src, dst, size, count, src_stride, dst_stride = values
        if min(values) < 0 or (count and (src == 0 or dst == 0 or size == 0)):
            raise ValueError(f"run_descs[{i}]: {dict(zip(_RUN_FIELDS, values))} is not a run")
        if count:
            bases = groups.setdefault((size, count, src_stride, dst_stride), ([], []))
            bases[0].append(src)
            bases[1].append(dst)
    return [(Layout.from_pointers(s, slots=count, row_bytes=size, slot_stride=src_stride),
             Layout.from_pointers(d, slots=count, row_bytes=size, slot_stride=dst_stride), count)
            for (size, count, src_stride, dst_stride), (s, d) in groups.items()]


class CopyBackend:
    """vLLM's offload copy backend interface (``submit(job_id, run_descs, *,
    is_src_access_order_any)``, ``finish_transfer(job_id)``, ``clear()``) over
    kvcopy.copy_rows: each submitted job's runs are copied on torch's current stream
    without being expanded into fragments, one copy_rows per shape of run
    (run_groups). Nothing is held per job, so finish_transfer and clear only forget
    job ids; ``is_src_access_order_any`` is accepted (the kernel reads the sources
    in stream order)."""

    def __init__(self) -> None:
        self._jobs: set[Any] = set()

    def submit(self, job_id: Any, run_descs: Any, *, is_src_access_order_any: bool = False) -> None:
        import torch

        require_bool(is_src_access_order_any, "is_src_access_order_any")
        groups = run_groups(run_descs)
        stream = torch.cuda.current_stream()
        self._jobs.add(job_id)
        for src, dst, count in groups:
            copy_rows(src, dst, rows=count, stream=stream)

    def finish_transfer(self, job_id: Any) -> None:
        self._jobs.discard(job_id)

    def clear(self) -> None:
        self._jobs.clear()
