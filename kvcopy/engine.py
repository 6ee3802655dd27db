"""Runs a planned batch: picks the context, classifies memory, asks the policy, issues."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcopy import _driver, device, kernels, ring
from kvcopy.arrays import as_u64_array
from kvcopy.config import config
from kvcopy.context import ContextScope
from kvcopy.errors import CudaError
from kvcopy.plan import CopyPlan, find_overlap, plan_copies
from kvcopy.policy import METHODS, CopyRequest, Decision, choose_method
from kvcopy.streams import (current_framework_stream, effective_handle, resolve_stream,
                            stream_kind)

if TYPE_CHECKING:
    from kvcopy.blocks import BlockPlan

log = logging.getLogger("kvcopy")
_HOST = _driver.KIND_HOST_MAPPED | _driver.KIND_HOST_UNMAPPED
_DEVICE = _driver.KIND_DEVICE | _driver.KIND_MANAGED
_DMA_ONLY = _driver.KIND_HOST_UNMAPPED | _driver.KIND_MANAGED | _driver.KIND_STRADDLE
_ACCESS_ORDERS = ("stream", "any")
_last = threading.local()


def last_decision() -> Decision | None:
    """The method the calling thread's last copy used, and why."""
    return getattr(_last, "decision", None)


def memory_owner(src_device: int, dst_device: int) -> int:
    """The one device that owns a batch's device memory; -1 for none, -2 for several.

    Arguments are classify_pointers' ordinals (-1: no device memory, -2: several).
    """
    owners = {o for o in (src_device, dst_device) if o != -1}
    if not owners:
        return -1
    return owners.pop() if len(owners) == 1 else -2


def _direction(src_kinds: int, dst_kinds: int) -> str:
    src = "h" if not src_kinds & _DEVICE else "d" if not src_kinds & _HOST else "m"
    dst = "h" if not dst_kinds & _DEVICE else "d" if not dst_kinds & _HOST else "m"
    if "m" in (src, dst):
        return "mixed"
    return f"{src}2{dst}"


@dataclass
class _Target:
    """Where and how a batch runs, once its memory is classified and the policy asked."""

    handle: int
    info: "device.DeviceInfo"
    request: CopyRequest
    decision: Decision
    src_view: np.ndarray
    dst_view: np.ndarray

    def ctas(self, max_ctas: int | None) -> int:
        if max_ctas:
            return max_ctas
        if self.request.direction == "d2d":
            return config.device_ctas or self.info.caps.sm_count
        return config.host_ctas


def _decide(scope: ContextScope, handle: int, method: str, count: int, total_bytes: int,
            src: np.ndarray, src_sizes: np.ndarray, dst: np.ndarray,
            dst_sizes: np.ndarray) -> _Target:
    """Classify the memory behind (src, dst) ranges and ask the policy for a method."""
    src_view, dst_view = np.empty_like(src), np.empty_like(dst)
    src_kinds, src_dev = _driver.classify_pointers(src, src_sizes, src_view)
    dst_kinds, dst_dev = _driver.classify_pointers(dst, dst_sizes, dst_view)
    owner = memory_owner(src_dev, dst_dev)
    if owner >= 0 and scope.follow_memory(owner):
        # host memory may be mapped at another address for the new device
        src_kinds, src_dev = _driver.classify_pointers(src, src_sizes, src_view)
        dst_kinds, dst_dev = _driver.classify_pointers(dst, dst_sizes, dst_view)
    ordinal = _driver.context_device()
    info = device.device_info(ordinal)
    accessible = (not (src_kinds | dst_kinds) & _DMA_ONLY
                  and src_dev in (-1, ordinal) and dst_dev in (-1, ordinal))
    request = CopyRequest(direction=_direction(src_kinds, dst_kinds), count=count,
                          total_bytes=total_bytes, device_accessible=accessible,
                          stream_kind=stream_kind(handle),
                          capturing=_driver.stream_capture_status(handle) != 0)
    decision = choose_method(request, info.caps, device.thresholds(ordinal), method)
    _last.decision = decision
    log.debug("kvcopy: %d copies, %d bytes, %s -> %s (%s)", count, total_bytes,
              request.direction, decision.method, decision.reason)
    return _Target(handle, info, request, decision, src_view, dst_view)


def _launch_kernel(plan: CopyPlan, target: _Target, ctas: int) -> None:
    """Large batches: one launch reading staged descriptors. Small batches and
    capture: descriptors by value, which graphs keep with the launch."""
    info = target.info
    kernel = kernels.kernel_for_current_context(*info.cc, info.driver_version)
    threads, handle = config.threads_per_cta, target.handle
    src_view, dst_view = target.src_view, target.dst_view
    if plan.count > kernel.per_launch and not target.request.capturing:
        nbytes = plan.count * _driver.DESCRIPTOR_BYTES
        ring.ring_for_current_context().launch(nbytes, handle, lambda host, dev: (
            _driver.launch_scatter_staged(kernel.function_staged, host, dev, dst_view, src_view,
                                          plan.sizes, ctas, threads, handle)))
        return
    function = kernel.function if kernel.per_launch == _driver.INLINE_MAX else kernel.function_small
    _driver.launch_scatter(function, kernel.per_launch, dst_view, src_view, plan.sizes, ctas,
                           threads, handle)


def _issue(plan: CopyPlan, target: _Target, access_any: bool, max_ctas: int | None) -> str:
    method = target.decision.method
    try:
        if method == "batch":
            _driver.memcpy_batch(plan.dst, plan.src, plan.sizes, target.handle, access_any,
                                 config.batch_chunk)
        elif method == "loop":
            _driver.memcpy_loop(plan.dst, plan.src, plan.sizes, target.handle)
        else:
            _launch_kernel(plan, target, target.ctas(max_ctas))
    except CudaError as exc:
        raise exc.with_index(plan.caller_index(exc.index)) from None
    return method


def execute(plan: CopyPlan, stream_handle: int, method: str = "auto",
            access_any: bool = False, max_ctas: int | None = None) -> str:
    """Issue ``plan`` on the stream (a raw handle; 0 means the default stream)."""
    if plan.count == 0:
        return "none"
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        target = _decide(scope, handle, method, plan.count, plan.total_bytes,
                         plan.src, plan.sizes, plan.dst, plan.sizes)
        return _issue(plan, target, access_any, max_ctas)


def execute_blocks(blocks: "BlockPlan", stream_handle: int, method: str = "auto") -> str:
    """Issue a swap_blocks plan: memory is classified per tensor, not per block, and
    the kernel computes block addresses itself from the tensor table and the ids."""
    if blocks.num_pairs == 0:
        return "none"
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        target = _decide(scope, handle, method, blocks.num_copies, blocks.total_bytes,
                         blocks.src_base, blocks.src_extent, blocks.dst_base, blocks.dst_extent)
        if target.decision.method == "kernel" and not target.request.capturing:
            kernel = kernels.kernel_for_current_context(*target.info.cc, target.info.driver_version)
            table = blocks.tensor_table(target.src_view, target.dst_view)
            nbytes = _driver.blocks_staging_bytes(table.shape[0], blocks.num_pairs)
            ring.ring_for_current_context().launch(nbytes, handle, lambda host, dev: (
                _driver.launch_blocks_staged(kernel.function_blocks, host, dev, table,
                                             blocks.mapping, blocks.block_bytes,
                                             target.ctas(None), config.threads_per_cta, handle)))
            return "kernel"
        return _issue(blocks.copy_plan(), target, False, None)


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


def _check_options(method: str, src_access_order: str, max_ctas: int | None) -> None:
    check_method(method)
    if src_access_order not in _ACCESS_ORDERS:
        raise ValueError(f"src_access_order must be 'stream' or 'any'; got {src_access_order!r}")
    if max_ctas is not None and (isinstance(max_ctas, bool) or not isinstance(max_ctas, int)
                                 or max_ctas <= 0):
        raise ValueError(f"max_ctas must be a positive int or None; got {max_ctas!r}")


def copy_batch(src_ptrs: Any, dst_ptrs: Any, sizes: Any, *, stream: Any = None,
               method: str = "auto", src_access_order: str = "stream",
               max_ctas: int | None = None, check_overlap: bool = False) -> str:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i, asynchronously.

    Pointers may be device memory, pinned host memory or pageable host memory,
    in any mix; they and the sizes may be sequences of ints, NumPy integer
    arrays, CPU torch tensors or buffers. Everything is validated before any
    copy is enqueued; zero-size copies are dropped and copies that continue
    each other on both sides are merged.

    Args:
        stream: any stream kvcopy.resolve_stream accepts. None means the
            current stream of the framework whose tensors were passed, else
            the default stream.
        method: 'auto' (the policy picks), 'batch' (cuMemcpyBatchAsync),
            'loop' (one cuMemcpyAsync per copy) or 'kernel' (kvcopy's copy
            kernel). 'batch' on the legacy default stream runs as 'loop', since
            the driver rejects that stream; on a capturing stream it raises.
        src_access_order: 'stream' (safe default) or 'any', which lets the
            driver read the sources at any time after the call: unsafe when
            work on the GPU may still be writing them (e.g. GPU-to-host right
            after compute).
        max_ctas: CTAs for the copy kernel (default: kvcopy.config).
        check_overlap: raise ValueError if two copies write overlapping bytes.
            Off by default (it sorts the batch); copies of one batch run in no
            defined order, so overlapping destinations get unspecified bytes.

    Returns:
        The method that ran: 'batch', 'loop' or 'kernel' ('none' for an empty batch).

    Raises:
        TypeError, ValueError: bad arguments, named in the message.
        CudaError: the driver failed; ``.index`` is the failing copy where known.
        CaptureError: method='batch' on a capturing stream.
    """
    _check_options(method, src_access_order, max_ctas)
    src = as_u64_array(src_ptrs, "src_ptrs")
    dst = as_u64_array(dst_ptrs, "dst_ptrs")
    size_arr = as_u64_array(sizes, "sizes")
    plan = plan_copies(src, dst, size_arr)
    if check_overlap:
        clash = find_overlap(dst, size_arr)
        if clash:
            raise ValueError(f"dst_ptrs[{clash[0]}] and dst_ptrs[{clash[1]}] write overlapping bytes")
    handle = (resolve_stream(stream) if stream is not None
              else current_framework_stream(src_ptrs, dst_ptrs, sizes))
    return execute(plan, handle, method, src_access_order == "any", max_ctas)
