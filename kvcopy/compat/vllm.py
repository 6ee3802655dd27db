"""Drop-in for vLLM's ``ops.swap_blocks_batch``.

vLLM's op takes three CPU int64 tensors (source pointers, destination pointers,
byte sizes), copies on torch's current stream, and issues one
cuMemcpyBatchAsync call, which fails on the legacy default stream. This shim
keeps the signature and semantics and lets kvcopy choose the method: the
legacy stream works, and small blocks go through the copy kernel.
"""
from __future__ import annotations

from typing import Any

from kvcopy.engine import copy_batch


def _check(tensor: Any, name: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.dtype != torch.int64 or tensor.dim() != 1:
        raise TypeError(f"{name} must be a 1-D CPU int64 tensor, got {tensor.dtype} "
                        f"of shape {tuple(tensor.shape)} on {tensor.device}")


def swap_blocks_batch(src_ptrs: Any, dst_ptrs: Any, sizes: Any,
                      is_src_access_order_any: bool = False) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` on torch's current stream."""
    import torch

    for tensor, name in ((src_ptrs, "src_ptrs"), (dst_ptrs, "dst_ptrs"), (sizes, "sizes")):
        _check(tensor, name)
    copy_batch(src_ptrs, dst_ptrs, sizes, stream=torch.cuda.current_stream(),
               src_access_order="any" if is_src_access_order_any else "stream")
