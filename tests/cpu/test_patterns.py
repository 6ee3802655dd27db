"""The rules behind kvcopy's handling of other projects' patterns, on the CPU:
capture never touches the descriptor ring or its events, TransferQueue's
``after=`` and wait() arguments, event objects, vLLM's signature, the check of
host mappings, and allow_batch in the policy."""

from __future__ import annotations

import inspect
import mmap

import numpy as np
import pytest

import kvcopy
from kvcopy.testing import cuda

kv_classify = cuda.classify
kv_describe = cuda.describe
kv_dma = cuda.dma
kv_launch = cuda.launch
from kvcopy import policy, testing
from kvcopy.testing import engine

dispatch = engine.dispatch
kernels, ring = engine.kernels, engine.ring
from kvcopy.policy import CopyRequest, DeviceCaps
from kvcopy.interop.streams import resolve_event
from helpers.cpu_fakes import FakeCaptureDriver, FakeScope

MiB = 1 << 20


# ------------------------------------------------------------------ capture


class CapturingDriver(FakeCaptureDriver):
    """Enough of kvcopy._cuda for one kernel-path call on a stream that is capturing;
    records every call, and fails the test on anything that must not happen
    during a capture (event queries and synchronisation, allocations)."""

    KIND_DEVICE = kv_classify.KIND_DEVICE
    KIND_HOST_MAPPED = kv_classify.KIND_HOST_MAPPED
    DESCRIPTOR_BYTES = kv_describe.DESCRIPTOR_BYTES
    INLINE_MAX = kv_launch.INLINE_MAX

    def __init__(self, capturing: int) -> None:
        self.capturing = capturing
        self.calls: list[str] = []

    def describe_copies(self, src, dst, sizes, host, merge):
        self.calls.append(f"describe into {host:#x}")
        return kv_describe.DescribedBatch(
            len(sizes),
            int(sizes.sum()),
            len(sizes),
            kv_classify.KIND_HOST_MAPPED,
            -1,
            kv_classify.KIND_DEVICE,
            0,
            table=host,
        )

    INLINE_MAX, INLINE_MAX_SMALL = kv_launch.INLINE_MAX, kv_launch.INLINE_MAX_SMALL
    INLINE_MAX_TINY = kv_launch.INLINE_MAX_TINY

    def launch_descs_inline(self, function, per_launch, host, count, ctas, threads, stream):
        self.calls.append(f"inline launch of {count}")
        self.variant = (function, per_launch)
        return 1

    def __getattr__(self, name: str):
        raise AssertionError(f"kvcopy._cuda: {name} used while the stream captures")


class RefusedRing:
    """A descriptor ring no capture may reserve from (its events would be queried)."""

    def reserve(self, nbytes: int) -> None:
        raise AssertionError("the descriptor ring was used while the stream captures")


@pytest.fixture
def capture_engine(seams):
    fake = seams.enter_context(testing.fake_cuda(CapturingDriver(capturing=1)))
    seams.enter_context(
        testing.fake_runtime(
            copy_kernel=kernels.CopyKernel(
                1, 2, 3, 4, 5, 6, 7, 8, 9, kv_launch.INLINE_MAX, kernels.ScatterFunctions(11, 12, 13, 14, 15)
            ),
            descriptor_ring=RefusedRing(),
        )
    )
    return fake


@pytest.mark.parametrize("count", [10, 1500, 20000])
def test_capture_describes_into_host_scratch_and_launches_by_value(capture_engine, count):
    src = np.arange(count, dtype=np.uint64) * 8192 + 0x10000
    dst = np.arange(count, dtype=np.uint64) * 8192 + 0x7F0000000000
    sizes = np.full(count, 8192, dtype=np.uint64)
    used = dispatch.execute_copies(FakeScope(), 0x1234, src, dst, sizes, "auto", True, False, None)
    assert used == "kernel"
    assert capture_engine.calls[0].startswith("describe into")
    assert capture_engine.calls[1] == f"inline launch of {count}"


@pytest.mark.parametrize(
    "count, variant",
    [(1, (7, 31)), (31, (7, 31)), (32, (6, 127)), (127, (6, 127)), (128, (5, 1000)), (1000, (5, 1000))],
)
def test_launches_by_value_take_the_smallest_parameter_block_that_fits(capture_engine, count, variant):
    src = np.arange(count, dtype=np.uint64) * 8192 + 0x10000
    sizes = np.full(count, 4096, dtype=np.uint64)
    dispatch.execute_copies(
        FakeScope(), 0x1234, src, src + 0x7F0000000000, sizes, "kernel", True, False, None
    )
    assert capture_engine.variant == variant


def test_capture_with_batch_requested_raises_before_anything(capture_engine):
    sizes = np.full(4, 1 << 20, dtype=np.uint64)
    with pytest.raises(kvcopy.CaptureError):
        dispatch.execute_copies(
            FakeScope(), 0x1234, sizes + 0x10000, sizes + 0x7F0000000000, sizes, "batch", True, False, None
        )
    assert not any("launch" in call for call in capture_engine.calls)


# ------------------------------------------------------------------ policy: allow_batch


def _request(**kw) -> CopyRequest:
    base = dict(
        direction="h2d", count=64, total_bytes=64 * 4 * MiB, device_accessible=True, stream_kind="created"
    )
    base.update(kw)
    return CopyRequest(**base)


def test_allow_batch_false_never_picks_batched_dma():
    caps = DeviceCaps()
    assert policy.choose_method(_request(), caps).method == "batch"
    assert policy.choose_method(_request(batch_allowed=False), caps).method == "kernel"
    pageable = _request(batch_allowed=False, device_accessible=False)
    decision = policy.choose_method(pageable, caps)
    assert decision.method == "loop" and "not allowed" in decision.reason
    with pytest.raises(ValueError, match="allow_batch=False"):
        policy.choose_method(_request(batch_allowed=False), caps, requested="batch")


def test_copy_batch_refuses_batch_with_allow_batch_false():
    with pytest.raises(ValueError, match="allow_batch=False"):
        kvcopy.copy_batch([1], [2], [3], method="batch", allow_batch=False)


# ------------------------------------------------------------------ events


class _Named:
    """An object whose type looks like another library's, for resolve_event."""

    def __init__(self, module: str, name: str, **attrs) -> None:
        kind = type(name, (), {"__module__": module})
        self.obj = kind()
        for key, value in attrs.items():
            setattr(self.obj, key, value)


def test_resolve_event_recognises_each_library():
    driver = pytest.importorskip("cuda.bindings.driver")
    assert resolve_event(driver.CUevent(0xABC0)) == 0xABC0
    assert resolve_event(_Named("torch.cuda.streams", "Event", cuda_event=0x1000).obj) == 0x1000
    assert resolve_event(_Named("cupy.cuda.stream", "Event", ptr=0x2000).obj) == 0x2000
    assert resolve_event(_Named("cuda.core._event", "Event", handle=0x3000).obj) == 0x3000
    assert resolve_event(_Named("cupy.cuda.stream", "Stream", ptr=0x2000).obj) is None
    # torch creates its event lazily: 0 until first recorded
    assert resolve_event(_Named("torch.cuda.streams", "Event", cuda_event=0).obj) == 0
    assert resolve_event(5) is None and resolve_event(None) is None


def test_resolve_event_refuses_handles_inside_the_first_page():
    with pytest.raises(
        ValueError,
        match=r"^event: handle 16 is not a valid CUevent value: "
        r"handles are the address of a CUevent, never below 4096",
    ):
        resolve_event(_Named("torch.cuda.streams", "Event", cuda_event=16).obj)


def test_resolve_event_rejects_float_handles():
    with pytest.raises(TypeError, match="event"):
        resolve_event(_Named("torch.cuda.streams", "Event", cuda_event=1.5).obj)


def test_transfer_queue_wait_refuses_a_single_string():
    queue = object.__new__(kvcopy.TransferQueue)
    with pytest.raises(TypeError, match=r"job_ids.*\['req-1'\]"):
        queue.wait("req-1")
    with pytest.raises(TypeError, match="job_ids"):
        queue.wait(7)


def test_transfer_queue_submit_takes_after():
    params = inspect.signature(kvcopy.TransferQueue.submit).parameters
    assert params["after"].kind is inspect.Parameter.KEYWORD_ONLY and params["after"].default is None


# ------------------------------------------------------------------ vLLM's signature


def test_vllm_shim_takes_vllms_current_arguments():
    from kvcopy.compat.vllm import swap_blocks_batch

    params = list(inspect.signature(swap_blocks_batch).parameters.values())
    assert [p.name for p in params] == [
        "src_ptrs",
        "dst_ptrs",
        "sizes",
        "is_src_access_order_any",
        "use_batch_api",
        "bytes_per_chunk",
    ]
    assert params[3].default is False and params[4].default is True
    assert params[5].kind is inspect.Parameter.KEYWORD_ONLY  # vLLM's Triton form's


def test_vllm_shim_checks_its_flags_before_the_driver():
    torch = pytest.importorskip("torch")
    from kvcopy.compat.vllm import swap_blocks_batch

    t = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="use_batch_api"):
        swap_blocks_batch(t, t, t, False, "no")
    with pytest.raises(TypeError, match="sizes"):
        swap_blocks_batch(t, t, torch.zeros(1, dtype=torch.float32))
    with pytest.raises(ValueError, match="bytes_per_chunk must be at least 1, got 0"):
        swap_blocks_batch(t, t, t, False, bytes_per_chunk=0)


# ------------------------------------------------------------------ host mappings


def _allowed(ptr: int, size: int, write: bool = False) -> bool:
    spans = np.array([ptr], np.uint64), np.array([size], np.uint64)
    return kv_dma.first_host_span_denied(*spans, write) == -1


def test_host_access_follows_the_process_mappings():
    arr = np.zeros(8192, np.uint8)
    assert _allowed(arr.ctypes.data, arr.nbytes, write=True)
    assert not _allowed(42, 8)
    assert not _allowed(0x10, 1, write=True)
    region = mmap.mmap(-1, 8192, prot=mmap.PROT_READ)
    ptr = np.frombuffer(region, np.uint8).ctypes.data
    assert _allowed(ptr, 8192)
    assert not _allowed(ptr, 8192, write=True)
    assert not _allowed(arr.ctypes.data, 1 << 46)  # runs past any mapping
    del ptr


def test_first_host_span_denied_names_the_first_span_outside_the_mappings():
    arr = np.zeros(8192, np.uint8)
    region = mmap.mmap(-1, 8192, prot=mmap.PROT_READ)
    readonly = np.frombuffer(region, np.uint8).ctypes.data
    base = arr.ctypes.data
    ptrs = np.array([base, base + 4096, readonly, 42, base], np.uint64)
    sizes = np.array([4096, 4096, 8192, 8, 1 << 46], np.uint64)
    assert kv_dma.first_host_span_denied(ptrs[:2], sizes[:2], write=True) == -1
    assert kv_dma.first_host_span_denied(ptrs[:3], sizes[:3]) == -1
    assert kv_dma.first_host_span_denied(ptrs[:3], sizes[:3], write=True) == 2
    assert kv_dma.first_host_span_denied(ptrs, sizes) == 3
    assert kv_dma.first_host_span_denied(ptrs[4:], sizes[4:]) == 0  # runs past any mapping
    assert kv_dma.first_host_span_denied(ptrs[:0], sizes[:0]) == -1
    with pytest.raises(ValueError, match="5 addresses but 4 sizes"):
        kv_dma.first_host_span_denied(ptrs, sizes[:4])
