"""Drop-in for vLLM's ``ops.swap_blocks_batch``.

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
from kvcopy.api import copy_batch
from kvcopy.errors import NoDriverError


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
