"""Which description and which launch the kernel path picks, on the CPU with a faked
kvcopy._cuda: batches past one launch's inline descriptors ask for 16-byte pairs,
get the pairs kernel where the describe pass wrote pairs (read in place over PCIe,
uploaded first between GPUs), and the descriptor kernel where it did not; smaller
batches keep descriptors by value. The slot is fenced behind every launch that
reads it. GPU-to-host batches on a device with a bulk copy unit get the bulk
copier's entry points and launch shape, unless config.bulk_stores is off."""

from __future__ import annotations

import types

import numpy as np

import kvcopy
import pytest

from kvcopy import policy, testing
from kvcopy.testing import engine

decide, dispatch, staged = engine.decide, engine.dispatch, engine.staged
device, kernels, ring = engine.device, engine.kernels, engine.ring
from kvcopy.testing import cuda

kv_classify = cuda.classify
kv_describe = cuda.describe
DescribedBatch = cuda.describe.DescribedBatch
kv_launch = cuda.launch
from kvcopy.policy import DeviceCaps

from helpers.cpu_fakes import FakeClassify, FakeScope
from helpers.described import described_like_the_pass

SLOT = ring.Slot(capacity=1 << 20, host=0x1000, mapped=0x2000, device=0x3000, event=0x77)
HOST_TO_GPU = (kv_classify.KIND_HOST_MAPPED, -1, kv_classify.KIND_DEVICE, 0)
GPU_TO_HOST = (kv_classify.KIND_DEVICE, 0, kv_classify.KIND_HOST_MAPPED, -1)
BULK = kernels.ScatterFunctions(uploaded=11, compact=12, inline=13, small=14, tiny=15)
GPU_TO_PEER = (kv_classify.KIND_DEVICE, 0, kv_classify.KIND_PEER, 1)


class FakeCuda:
    """The parts of kvcopy._cuda one kernel-path call uses; records what it is asked."""

    DESCRIPTOR_BYTES = kv_describe.DESCRIPTOR_BYTES
    COMPACT_BYTES = kv_describe.COMPACT_BYTES
    INLINE_MAX = kv_launch.INLINE_MAX
    INLINE_MAX_SMALL = kv_launch.INLINE_MAX_SMALL
    INLINE_MAX_TINY = kv_launch.INLINE_MAX_TINY
    BULK_THREADS = kv_launch.BULK_THREADS

    def __init__(self, kinds: tuple, compact_size: int, tiles_per_copy: int = 1) -> None:
        self.kinds, self.compact_size, self.tiles_per_copy = kinds, compact_size, tiles_per_copy
        self.calls: list[tuple] = []
        self.shapes: list[tuple[int, int]] = []  # (CTAs, threads) of every launch
        self.tiles: list[int] = []  # tiles of every launch_descs

    capturing = 0

    def stream_capture_status(self, handle: int) -> int:
        return self.capturing

    def context_device(self) -> int:
        return 0

    def _described(self, src, dst, sizes, out: int, compact_size: int = 0) -> DescribedBatch:
        return described_like_the_pass(src, dst, sizes, self.kinds, out, self.tiles_per_copy, compact_size)

    def describe_compact(self, src, dst, sizes, out, merge):
        self.calls.append(("describe_compact", out))
        return self._described(src, dst, sizes, out, self.compact_size)

    def describe_copies(self, src, dst, sizes, out, merge):
        self.calls.append(("describe_copies", out))
        return self._described(src, dst, sizes, out)

    def launch_compact(self, function, pairs, n, size, ctas, threads, stream, upload_from=0):
        self.calls.append(("launch_compact", function, pairs, n, size, upload_from))
        self.shapes.append((ctas, threads))
        return 1

    def launch_descs(self, function, descs, n, tiles, ctas, threads, stream, upload_from=0):
        self.calls.append(("launch_descs", function, descs, n, upload_from))
        self.tiles.append(tiles)
        self.shapes.append((ctas, threads))
        return 1

    def upload(self, device, host, nbytes, stream):
        self.calls.append(("upload", device, host, nbytes))

    def launch_descs_inline(self, function, per_launch, host, n, ctas, threads, stream):
        self.calls.append(("launch_descs_inline", function, n))
        self.shapes.append((ctas, threads))
        return 1

    def event_record(self, event: int, stream: int) -> None:
        self.calls.append(("fence", event, stream))

    # kvcopy._cuda.dma: every copy planned as it is
    def plan_dma(self, src, dst, sizes, merge):
        self.calls.append(("plan_dma", len(sizes), merge))
        return src, dst, sizes, np.arange(len(sizes), dtype=np.int64)

    def memcpy_loop(self, dst, src, sizes, stream):
        self.calls.append(("memcpy_loop", len(sizes), int(src[0]), stream))


@pytest.fixture
def fake_cuda(seams):
    """make(kinds, compact_size, ...): a FakeCuda for the driver layer, device 0 an H200
    (bulk copy where asked) whose ring reserves ``slot`` and whose staging buffers are
    ``staging``, calls entering a scope that stays put."""

    def make(
        kinds: tuple,
        compact_size: int,
        tiles_per_copy: int = 1,
        bulk_copy: bool = False,
        slot: ring.Slot = SLOT,
        staging: object = None,
    ) -> FakeCuda:
        fake = FakeCuda(kinds, compact_size, tiles_per_copy)
        # (the ring's fence records an event: the fake's too)
        seams.enter_context(testing.fake_cuda(fake, ("driver", "describe", "launch", "dma")))
        kernel = kernels.CopyKernel(1, 2, 3, 4, 5, 6, 7, 8, 9, kv_launch.INLINE_MAX, BULK)
        seams.enter_context(
            testing.fake_runtime(
                caps=DeviceCaps(bulk_copy=bulk_copy),
                copy_kernel=kernel,
                slot=slot,
                staging=staging,
                scope=FakeScope,
            )
        )
        return fake

    return make


@pytest.fixture(autouse=True)
def one_launch_by_default():
    """The tests below that do not test launch_bytes see every batch as one launch."""
    kvcopy.config.launch_bytes = 0


def run(count: int, size: int = 4096) -> str:
    src = np.arange(count, dtype=np.uint64) * np.uint64(2 * size) + np.uint64(0x10000)
    sizes = np.full(count, size, dtype=np.uint64)
    return dispatch.execute_copies(
        FakeScope(), 0x1234, src, src + np.uint64(0x7F0000000000), sizes, "auto", True, False, None
    )


def test_a_large_batch_described_as_pairs_is_read_in_place_by_the_pairs_kernel(fake_cuda):
    fake = fake_cuda(HOST_TO_GPU, 4096)
    assert run(2000) == "kernel"
    assert fake.calls == [
        ("describe_compact", SLOT.host),
        ("launch_compact", 8, SLOT.mapped, 2000, 4096, 0),
        ("fence", SLOT.event, 0x1234),
    ]


def test_a_large_batch_the_pass_could_not_pair_keeps_the_descriptor_kernel(fake_cuda):
    fake = fake_cuda(HOST_TO_GPU, 0)
    assert run(2000) == "kernel"
    assert fake.calls == [
        ("describe_compact", SLOT.host),
        ("launch_descs", 2, SLOT.mapped, 2000, 0),
        ("fence", SLOT.event, 0x1234),
    ]


@pytest.mark.parametrize("kinds, tiles_per_copy", [(GPU_TO_PEER, 1), (HOST_TO_GPU, 2)])
def test_descriptors_between_two_gpus_or_of_several_tiles_are_uploaded(fake_cuda, kinds, tiles_per_copy):
    fake = fake_cuda(kinds, 0, tiles_per_copy)
    assert run(2000) == "kernel"
    assert fake.calls == [
        ("describe_compact", SLOT.host),
        ("launch_descs", 2, SLOT.device, 2000, SLOT.host),
        ("fence", SLOT.event, 0x1234),
    ]


def test_pairs_between_two_gpus_are_uploaded_before_the_launch(fake_cuda):
    fake = fake_cuda(GPU_TO_PEER, 4096)
    assert run(2000) == "kernel"
    assert fake.calls == [
        ("describe_compact", SLOT.host),
        ("launch_compact", 8, SLOT.device, 2000, 4096, SLOT.host),
        ("fence", SLOT.event, 0x1234),
    ]


@pytest.mark.parametrize("count", [16, kv_launch.INLINE_MAX])
def test_batches_of_one_launch_by_value_keep_full_descriptors(fake_cuda, count):
    fake = fake_cuda(HOST_TO_GPU, 4096)
    assert run(count) == "kernel"
    assert fake.calls[0][0] == "describe_copies"
    assert fake.calls[1][:1] == ("launch_descs_inline",) and fake.calls[1][2] == count
    assert not any(call[0] == "launch_compact" for call in fake.calls)


@pytest.mark.parametrize(
    "compact_size, count, call",
    [
        (16384, 2000, ("launch_compact", BULK.compact, SLOT.mapped, 2000, 16384, 0)),
        (0, 2000, ("launch_descs", BULK.uploaded, SLOT.mapped, 2000, 0)),
        (16384, 16, ("launch_descs_inline", BULK.tiny, 16)),
        (16384, kv_launch.INLINE_MAX_SMALL, ("launch_descs_inline", BULK.small, kv_launch.INLINE_MAX_SMALL)),
        (16384, kv_launch.INLINE_MAX, ("launch_descs_inline", BULK.inline, kv_launch.INLINE_MAX)),
    ],
)
def test_gpu_to_host_batches_use_the_bulk_copier_where_the_device_has_one(
    fake_cuda, monkeypatch, compact_size, count, call
):
    kvcopy.config.bulk_ctas = None
    kvcopy.config.bulk_stores = True
    fake = fake_cuda(GPU_TO_HOST, compact_size, bulk_copy=True)
    assert run(count, 16384) == "kernel"
    assert call in fake.calls
    assert fake.shapes == [(policy.BULK_STORE_CTAS, kv_launch.BULK_THREADS)]
    assert decide.last_decision().variant == "bulk"


def test_bulk_ctas_and_max_ctas_set_the_bulk_launch(fake_cuda, monkeypatch):
    kvcopy.config.bulk_ctas = 6
    fake = fake_cuda(GPU_TO_HOST, 16384, bulk_copy=True)
    run(2000, 16384)
    src = np.arange(2000, dtype=np.uint64) * np.uint64(32768) + np.uint64(0x10000)
    dispatch.execute_copies(
        FakeScope(),
        0x1234,
        src,
        src + np.uint64(0x7F0000000000),
        np.full(2000, 16384, dtype=np.uint64),
        "auto",
        True,
        False,
        3,
    )
    assert fake.shapes == [(6, kv_launch.BULK_THREADS), (3, kv_launch.BULK_THREADS)]


@pytest.mark.parametrize(
    "kinds, bulk_copy, bulk_stores, size",
    [
        (GPU_TO_HOST, False, True, 16384),  # no bulk copy unit (before sm_90)
        (GPU_TO_HOST, True, False, 16384),  # config.bulk_stores off
        (GPU_TO_HOST, True, True, 4096),  # blocks below the bulk window
        (HOST_TO_GPU, True, True, 16384),
    ],
)  # loads from host memory stay on registers
def test_other_batches_keep_the_register_copier(fake_cuda, monkeypatch, kinds, bulk_copy, bulk_stores, size):
    kvcopy.config.bulk_stores = bulk_stores
    kvcopy.config.host_ctas = None
    fake = fake_cuda(kinds, size, bulk_copy=bulk_copy)
    assert run(2000, size) == "kernel"
    assert fake.calls[1] == ("launch_compact", 8, SLOT.mapped, 2000, size, 0)
    direction = "d2h" if kinds == GPU_TO_HOST else "h2d"
    assert fake.shapes == [(policy.HOST_CTAS[direction], kvcopy.config.threads_per_cta)]
    assert decide.last_decision().variant == "registers"


@pytest.mark.parametrize("kinds", [HOST_TO_GPU, GPU_TO_HOST])
def test_pairs_past_launch_bytes_go_out_as_slices_of_the_table_in_order(fake_cuda, monkeypatch, kinds):
    kvcopy.config.launch_bytes = 600 * 16384
    kvcopy.config.bulk_stores = False
    fake = fake_cuda(kinds, 16384)
    assert run(2000, 16384) == "kernel"
    entry = kv_describe.COMPACT_BYTES
    assert fake.calls == [
        ("describe_compact", SLOT.host),
        ("launch_compact", 8, SLOT.mapped, 600, 16384, 0),
        ("launch_compact", 8, SLOT.mapped + 600 * entry, 600, 16384, 0),
        ("launch_compact", 8, SLOT.mapped + 1200 * entry, 600, 16384, 0),
        ("launch_compact", 8, SLOT.mapped + 1800 * entry, 200, 16384, 0),
        ("fence", SLOT.event, 0x1234),
    ]  # one fence, behind the last


def test_one_tile_descriptors_past_launch_bytes_are_sliced_with_their_own_tile_counts(fake_cuda, monkeypatch):
    kvcopy.config.launch_bytes = 1000 * 4096
    fake = fake_cuda(HOST_TO_GPU, 0)
    assert run(2500) == "kernel"
    entry = kv_describe.DESCRIPTOR_BYTES
    assert fake.calls[1:] == [
        ("launch_descs", 2, SLOT.mapped, 1000, 0),
        ("launch_descs", 2, SLOT.mapped + 1000 * entry, 1000, 0),
        ("launch_descs", 2, SLOT.mapped + 2000 * entry, 500, 0),
        ("fence", SLOT.event, 0x1234),
    ]
    assert fake.tiles == [1000, 1000, 500]


def test_batches_between_gpus_stay_one_launch_past_launch_bytes(fake_cuda, monkeypatch):
    kvcopy.config.launch_bytes = 100 * 4096
    fake = fake_cuda(GPU_TO_PEER, 0)
    assert run(2000) == "kernel"
    launches = [call for call in fake.calls if call[0].startswith("launch")]
    assert launches == [("launch_descs", 2, SLOT.device, 2000, SLOT.host)]


def test_copies_of_several_tiles_are_sliced_with_tiles_counted_from_0_per_slice(fake_cuda, monkeypatch):
    """Each slice of a multi-tile table is launched as a batch of its own: its
    descriptors' tile_start renumbered from 0 in the pinned table before the table is
    uploaded (once, ahead of every launch, so that no copy sits between two launches on
    the stream), and its launch given its own tile count."""
    count, per_copy = 2000, 3  # 2000 copies of 3 tiles (48 KiB) each
    table = np.zeros((count, 4), dtype=np.uint64)
    table[:, 2] = 3 * 16384
    table[:, 3] = np.arange(count, dtype=np.uint64) * per_copy  # as describe_copies numbers them
    slot = ring.Slot(capacity=1 << 20, host=table.ctypes.data, mapped=0x2000, device=0x3000, event=0x77)
    kvcopy.config.launch_bytes = 600 * 3 * 16384  # 600 copies a slice
    fake = fake_cuda(HOST_TO_GPU, 0, tiles_per_copy=per_copy, slot=slot)
    assert run(count, 3 * 16384) == "kernel"
    entry = kv_describe.DESCRIPTOR_BYTES
    launches = [call for call in fake.calls if call[0] in ("upload", "launch_descs")]
    slices = (600, 600, 600, 200)
    assert launches == [("upload", 0x3000, table.ctypes.data, count * entry)] + [
        ("launch_descs", 2, 0x3000 + k * 600 * entry, n, 0) for k, n in enumerate(slices)
    ]
    assert fake.tiles == [per_copy * n for n in slices]
    expected = np.concatenate([np.arange(n, dtype=np.uint64) * per_copy for n in slices])
    np.testing.assert_array_equal(table[:, 3], expected)


def test_a_batch_whose_host_side_is_one_long_span_goes_to_the_staged_path(fake_cuda, monkeypatch):
    """A batch of STAGING_MIN_BYTES whose host side is one span is checked by the
    describe pass, then handed to kvcopy._engine.staged (nothing launched or fenced here);
    'kernel' or a CTA limit keep the kernel, and so does a scattered host side."""

    class Buffers:
        def ensure(self, chunk_bytes: int) -> bool:
            return True

    fake = fake_cuda(HOST_TO_GPU, 4096, staging=Buffers())
    handed: list[tuple] = []
    monkeypatch.setattr(
        staged, "run", lambda handle, batches, cc, version: handed.append((handle, batches, cc))
    )
    size = 4096
    count = policy.STAGING_MIN_BYTES // size
    host = np.uint64(0x10000) + np.arange(count, dtype=np.uint64) * np.uint64(size)
    gpu = np.uint64(0x7F0000000000) + np.arange(count, dtype=np.uint64)[::-1] * np.uint64(2 * size)
    sizes = np.full(count, size, dtype=np.uint64)

    def call(method: str = "auto", max_ctas: int | None = None, src=host) -> str:
        return dispatch.execute_copies(FakeScope(), 0x1234, src, gpu, sizes, method, True, False, max_ctas)

    assert call() == "staged"
    assert fake.calls == [("describe_compact", SLOT.host)]
    ((handle, batches, cc),) = handed
    assert handle == 0x1234 and cc == (9, 0)
    assert batches[0].direction == "h2d" and batches[0].host is host and batches[0].gpu is gpu
    assert decide.last_decision().method == "staged"
    handed.clear()
    assert call("kernel") == "kernel"
    assert call(max_ctas=4) == "kernel"
    assert call(src=host[::-1].copy()) == "kernel"
    assert not handed


class Replays:
    """kvcopy._engine.replay as the engine calls it: what it was asked to record, and
    the decision its replay() answers with (None: no record matches)."""

    MAX_COPIES = kv_launch.INLINE_MAX_SMALL

    def __init__(self, answer=None) -> None:
        self.recorded: list[tuple] = []
        self.asked: list[int] = []
        self.answer = answer

    def record(self, target, batch, method, launched) -> bool:
        self.recorded.append((method, batch.count, batch.total_bytes, launched))
        return True

    def replay(self, src, dst, sizes, handle, method, descs_out):
        self.asked.append(len(sizes))
        # (a description: the batch described into descs_out, matching no record)
        return self.answer(descs_out, sizes) if callable(self.answer) else self.answer


@pytest.mark.parametrize(
    "merge, max_ctas, allow_batch, count, recorded",
    [
        (True, None, True, 16, True),  # copy_batch's small batch: recorded
        (True, None, True, 127, True),  # the 4 KiB variant
        (False, None, True, 16, False),  # a planned batch (execute): copy_batch never replays it
        (True, 3, True, 16, False),  # a CTA limit asked for
        (True, None, False, 16, False),  # batched DMA ruled out: another question
        (True, None, True, 2000, False),  # the descriptor table in a slot: no launch by value
    ],
)
def test_the_full_path_records_only_what_copy_batch_replays(
    fake_cuda, monkeypatch, merge, max_ctas, allow_batch, count, recorded
):
    fake_cuda(HOST_TO_GPU, 0)
    memory = Replays()
    for module in (decide, dispatch):
        monkeypatch.setattr(module, "replay", memory)
    src = np.arange(count, dtype=np.uint64) * np.uint64(8192) + np.uint64(0x10000)
    sizes = np.full(count, 4096, dtype=np.uint64)
    assert (
        dispatch.execute_copies(
            FakeScope(),
            0x1234,
            src,
            src + np.uint64(0x7F0000000000),
            sizes,
            "auto",
            merge,
            False,
            max_ctas,
            allow_batch,
        )
        == "kernel"
    )
    function = 7 if count <= kv_launch.INLINE_MAX_TINY else 6  # tiny, small (CopyKernel above)
    per_launch = (
        kv_launch.INLINE_MAX_TINY if count <= kv_launch.INLINE_MAX_TINY else kv_launch.INLINE_MAX_SMALL
    )
    ctas, threads = policy.HOST_CTAS["h2d"], kvcopy.config.threads_per_cta
    assert memory.recorded == (
        [("auto", count, count * 4096, (function, per_launch, ctas, threads))] if recorded else []
    )


def test_a_launch_under_capture_is_never_recorded(fake_cuda, monkeypatch):
    """A graph keeps its own launches by value: the full path records none of them for
    a replay (policy.may_replay, asked with the capture state)."""
    fake = fake_cuda(HOST_TO_GPU, 0)
    fake.capturing = 1
    memory = Replays()
    for module in (decide, dispatch):
        monkeypatch.setattr(module, "replay", memory)
    src = np.arange(16, dtype=np.uint64) * np.uint64(8192) + np.uint64(0x10000)
    sizes = np.full(16, 4096, dtype=np.uint64)
    assert (
        dispatch.execute_copies(
            FakeScope(), 0x1234, src, src + np.uint64(0x7F0000000000), sizes, "auto", True, False, None
        )
        == "kernel"
    )
    assert [c[0] for c in fake.calls] == ["describe_copies", "launch_descs_inline"]
    assert memory.recorded == []


def described_by_replay(descs_out: int, sizes: np.ndarray) -> DescribedBatch:
    return DescribedBatch(len(sizes), int(sizes.sum()), len(sizes), *HOST_TO_GPU, 0, descs_out)


@pytest.mark.parametrize("replay", [None, policy.Decision("kernel", "remembered"), described_by_replay])
def test_copy_batch_asks_for_a_replay_first(fake_cuda, monkeypatch, replay):
    fake = fake_cuda(HOST_TO_GPU, 0)
    memory = Replays(replay)
    for module in (decide, dispatch):
        monkeypatch.setattr(module, "replay", memory)
    src = np.arange(16, dtype=np.uint64) * np.uint64(8192) + np.uint64(0x10000)
    sizes = np.full(16, 4096, dtype=np.uint64)
    decide._last.decision = None
    assert dispatch.execute_arrays(src, src + np.uint64(0x7F0000000000), sizes, 0x1234) == "kernel"
    assert memory.asked == [16]
    if isinstance(replay, policy.Decision):  # replayed: nothing described or launched here
        assert fake.calls == [] and decide.last_decision() is replay
    elif replay is None:  # the full path, which records its launch
        assert [c[0] for c in fake.calls] == ["describe_copies", "launch_descs_inline"]
        assert len(memory.recorded) == 1
    else:  # described once, by the replay's attempt: launched from there
        assert [c[0] for c in fake.calls] == ["launch_descs_inline"]
        assert len(memory.recorded) == 1
    # a CTA limit, or batched DMA ruled out, is another question: never replayed
    memory.asked.clear()
    dispatch.execute_arrays(src, src + np.uint64(0x7F0000000000), sizes, 0x1234, max_ctas=2)
    dispatch.execute_arrays(src, src + np.uint64(0x7F0000000000), sizes, 0x1234, allow_batch=False)
    # nor is a batch larger than any record, and no scratch is made for its description
    scratch = dispatch.HostScratch(0).host
    large = np.arange(2000, dtype=np.uint64) * np.uint64(8192) + np.uint64(0x10000)
    dispatch.execute_arrays(
        large, large + np.uint64(0x7F0000000000), np.full(2000, 4096, dtype=np.uint64), 0x1234
    )
    assert memory.asked == [] and dispatch.HostScratch(0).host == scratch


class PlannedBlocks:
    """A swap_blocks plan of ``count`` 4 KiB blocks from host to GPU, as execute_blocks reads
    it (its memory is classified per tensor by blocks_path's FakeClassify)."""

    def __init__(self, count: int) -> None:
        self.num_pairs = self.num_copies = count
        self.total_bytes = count * 4096
        self.owners, self.memory = (), None  # (read from no tensors: classified at every call)
        base = np.zeros(1, dtype=np.uint64)
        self.geometry = types.SimpleNamespace(
            src_base=base, dst_base=base, src_extent=base, dst_extent=base, producer_streams=(), key=None
        )
        self.src = np.arange(count, dtype=np.uint64) * np.uint64(8192) + np.uint64(0x10000)
        self.arrays_made = 0

    def copy_arrays(self):
        self.arrays_made += 1
        return self.src, self.src + np.uint64(0x7F0000000000), np.full(len(self.src), 4096, dtype=np.uint64)


@pytest.fixture
def blocks_path(seams):
    """execute_blocks' tensors classified host to GPU."""
    seams.enter_context(testing.fake_cuda(FakeClassify([HOST_TO_GPU] * 2), ("classify",)))


def test_swap_blocks_under_capture_is_described_once_and_launched_by_value(fake_cuda, blocks_path):
    """Under capture the block kernel's ring slot cannot be used: the plan's copies are
    described into scratch and launched by value with the decision made per tensor, not
    sent back through copy_batch's path (which would decide again)."""
    fake = fake_cuda(HOST_TO_GPU, 0)
    fake.capturing = 1
    blocks = PlannedBlocks(40)
    assert engine.blocks.execute_blocks(blocks, 0x1234) == "kernel"
    # one question asked of the policy, and its answer remembered: no second decision
    assert len(decide._targets) == 1 and blocks.arrays_made == 1
    assert [c[0] for c in fake.calls] == ["describe_copies", "launch_descs_inline"]
    assert fake.calls[1][2] == 40


def test_swap_blocks_by_dma_goes_to_the_copy_engines_directly(fake_cuda, blocks_path):
    """The plan's copies go to the copy engines as they are (planned for them once), not
    described for the kernel first."""
    fake = fake_cuda(HOST_TO_GPU, 0)
    blocks = PlannedBlocks(8)
    assert engine.blocks.execute_blocks(blocks, 0x1234, "loop") == "loop"
    assert fake.calls == [("plan_dma", 8, True), ("memcpy_loop", 8, int(blocks.src[0]), 0x1234)]
    assert blocks.arrays_made == 1
