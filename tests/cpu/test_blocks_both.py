"""The one-launch paths of a store and a load at once, on the CPU with the driver, the
ring, the describe pass and the launch faked and the real policy asked.

swap_blocks_both_ways' block-kernel path (both_ways.execute_blocks_both): where both
sides go to the kernel they are one launch of the block-kernel pair, each side with its
tensor table, ids, block size and its direction's CTAs beside the other; everywhere
else nothing is issued and None sends the caller to the per-copy path.
copy_both_ways' fused launch (both_ways._fused) makes the same joint choice: one
launch of the descriptor pair, a Decision for the copy engines, or None (apart)."""

from __future__ import annotations

from typing import Iterator


import numpy as np

import kvcopy
import pytest

from kvcopy import policy, testing
from kvcopy.testing import engine

both_ways, dispatch, staged = engine.both_ways, engine.dispatch, engine.staged
kernels, ring = engine.kernels, engine.ring
from kvcopy.testing import cuda

kv_classify = cuda.classify
kv_describe = cuda.describe
kv_launch = cuda.launch
from kvcopy._plans.blocks import plan_blocks

MemoryClasses = engine.decide.MemoryClasses
from kvcopy.errors import NoDriverError
from kvcopy.policy import Thresholds

from helpers.cpu_fakes import FakeCaptureDriver, FakeClassify, FakeScope
from helpers.described import described_like_the_pass

HANDLE = 0x7F0000001234
SLOT = ring.Slot(capacity=1 << 24, host=0x1000, mapped=0x2000, device=0x3000, event=0x77)
GPU_TO_HOST = MemoryClasses(kv_classify.KIND_DEVICE, 0, kv_classify.KIND_HOST_MAPPED, -1)
HOST_TO_GPU = MemoryClasses(kv_classify.KIND_HOST_MAPPED, -1, kv_classify.KIND_DEVICE, 0)
GPU1_TO_HOST = MemoryClasses(kv_classify.KIND_DEVICE, 1, kv_classify.KIND_HOST_MAPPED, -1)
GPU_TO_PEER = MemoryClasses(kv_classify.KIND_DEVICE, 0, kv_classify.KIND_PEER, 1)


class Fake(FakeCaptureDriver):
    """The driver, ring and launch calls execute_blocks_both makes, in order."""

    def __init__(self, capturing: int) -> None:
        self.capturing = capturing
        self.calls: list[tuple] = []

    def event_record(self, event: int, stream: int) -> None:
        self.calls.append(("fence", event, stream))

    def current_context_key(self) -> int:
        return 0  # (no context: each call's memory is classified by the test's own fake)

    def launch_blocks_both_uploaded(self, *args) -> int:
        self.calls.append(("launch",) + args)
        return 1

    blocks_both_upload_bytes = staticmethod(kv_launch.blocks_both_upload_bytes)

    # copy_both_ways' fused path: describe_copies reports each side's classes in turn
    DESCRIPTOR_BYTES = kv_describe.DESCRIPTOR_BYTES
    classes: "Iterator[MemoryClasses]"

    def describe_copies(self, src, dst, sizes, out, merge):
        return described_like_the_pass(src, dst, sizes, next(self.classes), out)

    def launch_both(
        self,
        function,
        descs,
        count_a,
        tiles_a,
        ctas_a,
        count_b,
        tiles_b,
        ctas_b,
        threads,
        stream,
        upload_from=0,
        descs_b=0,
    ) -> int:
        assert descs_b in (0, descs + count_a * 32)  # described back to back
        self.calls.append(("launch_both", function, descs, count_a, ctas_a, count_b, ctas_b, upload_from))
        return 1


@pytest.fixture
def fake(seams):
    """make(classes, capturing, staging): a Fake for the driver layer, its tensors
    classified as ``classes`` (the store's, then the load's, per classification), the
    copy kernel loaded, the ring reserving SLOT, ``staging`` as the staging buffers."""

    def make(
        classes: tuple[MemoryClasses, MemoryClasses], capturing: int = 0, staging: object = None
    ) -> Fake:
        rec = Fake(capturing)
        seams.enter_context(testing.fake_cuda(rec, ("driver", "launch", "describe")))
        kvcopy.config.launch_bytes = 0  # one launch
        found = iter(classes * 4)  # the store's classes, then the load's, per classification
        rec.classes = found

        seams.enter_context(testing.fake_cuda(FakeClassify(found), ("classify",)))
        seams.enter_context(
            testing.fake_runtime(
                copy_kernel=kernels.CopyKernel(1, 2, 3, 4, 5, 6, 7, 8, 9, kv_launch.INLINE_MAX, None),
                slot=SLOT,
                staging=staging,
                scope=FakeScope,
            )
        )
        return rec

    return make


def plans(block: int, tensors: tuple[int, int] = (3, 2), pairs: tuple[int, int] = (4, 5)):
    """A store of ``pairs[0]`` blocks over ``tensors[0]`` tensors and a load of
    ``pairs[1]`` over ``tensors[1]`` (NumPy stand-ins: only their addresses count)."""
    out = []
    for t, n in zip(tensors, pairs):
        src = [np.zeros((8, block), np.uint8) for _ in range(t)]
        dst = [np.zeros((8, block), np.uint8) for _ in range(t)]
        out.append(plan_blocks(src, dst, np.stack([np.arange(n), np.arange(n)[::-1]], axis=1)))
    return out


def test_kernel_sides_are_one_launch_with_each_sides_table_ids_and_ctas(fake):
    rec = fake((GPU_TO_HOST, HOST_TO_GPU))
    store, load = plans(4096)
    assert both_ways.execute_blocks_both(store, load, HANDLE) == ("kernel", "kernel")
    (launch, *args), fence = rec.calls
    function, host, dev, table_a, ids_a, bytes_a, ctas_a, table_b, ids_b, bytes_b, ctas_b, threads, stream = (
        args
    )
    assert (launch, function, host, dev, stream) == ("launch", 9, SLOT.host, SLOT.device, HANDLE)
    thresholds = Thresholds()
    assert (ctas_a, ctas_b) == (
        thresholds.ctas_for("d2h", both_ways=True),
        thresholds.ctas_for("h2d", both_ways=True),
    )
    assert (bytes_a, bytes_b) == (4096, 4096)
    for table, ids, plan in ((table_a, ids_a, store), (table_b, ids_b, load)):
        g = plan.geometry
        assert table.tolist() == plan.tensor_table(g.src_base, g.dst_base).tolist()
        assert ids is plan.mapping
    assert fence == ("fence", SLOT.event, HANDLE)


@pytest.mark.parametrize(
    "case", ["copy engines", "capture", "two devices", "peer", "batch", "empty side", "no driver"]
)
def test_elsewhere_nothing_is_issued_and_the_per_copy_path_runs(fake, seams, case):
    classes = {"two devices": (GPU1_TO_HOST, HOST_TO_GPU), "peer": (GPU_TO_PEER, HOST_TO_GPU)}.get(
        case, (GPU_TO_HOST, HOST_TO_GPU)
    )
    rec = fake(classes, capturing=int(case == "capture"))
    store, load = plans(
        256 << 10 if case == "copy engines" else 4096, pairs=(4, 0) if case == "empty side" else (4, 5)
    )
    if case == "no driver":

        def no_driver(handle):
            raise NoDriverError("no CUDA driver")

        seams.enter_context(testing.fake_runtime(scope=no_driver))
    method = "batch" if case == "batch" else "auto"
    assert both_ways.execute_blocks_both(store, load, HANDLE, method) is None
    assert rec.calls == []


def batch(count: int, block: int) -> tuple:
    src = np.arange(count, dtype=np.uint64) * np.uint64(2 * block) + np.uint64(0x10000)
    return src, src + np.uint64(0x7F0000000000), np.full(count, block, np.uint64)


def fused(store: tuple, load: tuple):
    return both_ways._fused(FakeScope(HANDLE), HANDLE, store, load, "auto", ("store", "load"), None)


def test_copy_both_ways_kernel_sides_are_one_launch_of_the_descriptor_pair(fake):
    rec = fake((GPU_TO_HOST, HOST_TO_GPU))
    assert fused(batch(6, 4096), batch(9, 4096)) == ("kernel", "kernel")
    thresholds = Thresholds()
    assert rec.calls == [
        (
            "launch_both",
            4,
            SLOT.mapped,
            6,
            thresholds.ctas_for("d2h", both_ways=True),
            9,
            thresholds.ctas_for("h2d", both_ways=True),
            0,
        ),
        ("fence", SLOT.event, HANDLE),
    ]


def test_copy_both_ways_large_blocks_are_the_copy_engines_decision(fake):
    rec = fake((GPU_TO_HOST, HOST_TO_GPU))
    joint = fused(batch(6, 256 << 10), batch(9, 256 << 10))
    assert joint.method == "batch" and "both ways at once" in joint.reason
    assert rec.calls == []


@pytest.mark.parametrize(
    "classes, counts", [((GPU1_TO_HOST, HOST_TO_GPU), (6, 9)), ((GPU_TO_HOST, HOST_TO_GPU), (6, 0))]
)
def test_copy_both_ways_of_two_devices_or_an_empty_side_runs_apart(fake, classes, counts):
    rec = fake(classes)
    assert fused(batch(counts[0], 4096), batch(counts[1], 4096)) is None
    assert rec.calls == []


def long_span(count: int, block: int, host_side: str) -> tuple:
    """A batch whose host side (``host_side``: 'src' or 'dst') is one span and whose GPU
    side is scattered."""
    host = np.uint64(0x10000) + np.arange(count, dtype=np.uint64) * np.uint64(block)
    gpu = np.uint64(0x7F0000000000) + np.arange(count, dtype=np.uint64)[::-1] * np.uint64(2 * block)
    sizes = np.full(count, block, np.uint64)
    return (host, gpu, sizes) if host_side == "src" else (gpu, host, sizes)


def test_copy_both_ways_stages_both_sides_or_neither(fake, monkeypatch):
    """Both sides' host memory one long span: both staged, handed back to be issued once
    the slot is given back (nothing launched); one side scattered: the kernel pair."""

    class Buffers:
        def ensure(self, chunk_bytes: int) -> bool:
            return True

    block = 16 << 10
    count = policy.STAGING_MIN_BYTES // block
    rec = fake((GPU_TO_HOST, HOST_TO_GPU), staging=Buffers())
    sides = fused(long_span(count, block, "dst"), long_span(count, block, "src"))
    assert isinstance(sides, list) and [s.direction for s in sides] == ["d2h", "h2d"]
    assert [s.name for s in sides] == ["store", "load"]
    assert all(s.decision.method == "staged" for s in sides)
    assert rec.calls == []
    scattered = long_span(count, block, "src")
    scattered = (scattered[0][::-1].copy(), scattered[1], scattered[2])
    assert fused(long_span(count, block, "dst"), scattered) == ("kernel", "kernel")
    assert [c[0] for c in rec.calls] == ["launch_both", "fence"]
