"""Runs a planned batch: picks the context, classifies memory, asks the policy, issues."""
from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from kvcopy import _driver, device, kernels, ring
from kvcopy.arrays import as_u64_array
from kvcopy.config import config
from kvcopy.context import ContextScope
from kvcopy.errors import CudaError
from kvcopy.plan import CopyPlan, plan_copies
from kvcopy.policy import METHODS, CopyRequest, Decision, choose_method
from kvcopy.streams import (current_framework_stream, effective_handle, resolve_stream,
                            stream_kind)

log = logging.getLogger("kvcopy")
_HOST = _driver.KIND_HOST_MAPPED | _driver.KIND_HOST_UNMAPPED
_DEVICE = _driver.KIND_DEVICE | _driver.KIND_MANAGED
_DMA_ONLY = _driver.KIND_HOST_UNMAPPED | _driver.KIND_MANAGED | _driver.KIND_STRADDLE
_ACCESS_ORDERS = ("stream", "any")
_last = threading.local()


def last_decision() -> Decision | None:
    """The method the calling thread's last copy used, and why."""
    return getattr(_last, "decision", None)


def _direction(src_kinds: int, dst_kinds: int) -> str:
    src = "h" if not src_kinds & _DEVICE else "d" if not src_kinds & _HOST else "m"
    dst = "h" if not dst_kinds & _DEVICE else "d" if not dst_kinds & _HOST else "m"
    if "m" in (src, dst):
        return "mixed"
    return f"{src}2{dst}"


def execute(plan: CopyPlan, stream_handle: int, method: str = "auto",
            access_any: bool = False, max_ctas: int | None = None) -> str:
    """Issue ``plan`` on the stream (a raw handle; 0 means the default stream)."""
    if plan.count == 0:
        return "none"
    _driver.init()
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        src_view = np.empty_like(plan.src)
        dst_view = np.empty_like(plan.dst)
        src_kinds, src_dev = _driver.classify_pointers(plan.src, plan.sizes, src_view)
        dst_kinds, dst_dev = _driver.classify_pointers(plan.dst, plan.sizes, dst_view)
        owners = {o for o in (src_dev, dst_dev) if o != -1}
        if len(owners) == 1 and scope.pushed:
            scope.follow_memory(owners.pop())
        ordinal = _driver.context_device()
        info = device.device_info(ordinal)
        accessible = (not (src_kinds | dst_kinds) & _DMA_ONLY
                      and src_dev in (-1, ordinal) and dst_dev in (-1, ordinal))
        direction = _direction(src_kinds, dst_kinds)
        request = CopyRequest(direction=direction, count=plan.count, total_bytes=plan.total_bytes,
                              device_accessible=accessible, stream_kind=stream_kind(handle),
                              capturing=_driver.stream_capture_status(handle) != 0)
        decision = choose_method(request, info.caps, device.thresholds(ordinal), method)
        _last.decision = decision
        log.debug("kvcopy: %d copies, %d bytes, %s -> %s (%s)", plan.count, plan.total_bytes,
                  direction, decision.method, decision.reason)
        try:
            if decision.method == "batch":
                _driver.memcpy_batch(plan.dst, plan.src, plan.sizes, handle, access_any,
                                     config.batch_chunk)
            elif decision.method == "loop":
                _driver.memcpy_loop(plan.dst, plan.src, plan.sizes, handle)
            else:
                ctas = max_ctas or (config.host_ctas if direction != "d2d"
                                    else config.device_ctas or info.caps.sm_count)
                _launch_kernel(plan, dst_view, src_view, info, ctas, handle, request.capturing)
        except CudaError as exc:
            raise exc.with_index(plan.caller_index(exc.index)) from None
    return decision.method


def _launch_kernel(plan: CopyPlan, dst_view: np.ndarray, src_view: np.ndarray,
                   info: "device.DeviceInfo", ctas: int, handle: int, capturing: bool) -> None:
    """Large batches: one launch reading staged descriptors. Small batches and
    capture: descriptors by value, which graphs keep with the launch."""
    kernel = kernels.kernel_for_current_context(*info.cc, info.driver_version)
    threads = config.threads_per_cta
    if plan.count > kernel.per_launch and not capturing:
        ring.ring_for_current_context().launch(kernel.function_staged, dst_view, src_view,
                                               plan.sizes, ctas, threads, handle)
        return
    function = kernel.function if kernel.per_launch == _driver.INLINE_MAX else kernel.function_small
    _driver.launch_scatter(function, kernel.per_launch, dst_view, src_view, plan.sizes, ctas,
                           threads, handle)


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
               max_ctas: int | None = None) -> str:
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
    handle = (resolve_stream(stream) if stream is not None
              else current_framework_stream(src_ptrs, dst_ptrs, sizes))
    return execute(plan, handle, method, src_access_order == "any", max_ctas)
