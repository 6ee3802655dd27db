"""Staged copies (kvcopy._engine.staged) on the CPU: the host-span and chunk planning, the
policy that chooses staging (faked requests and thresholds), the tile numbering of
a chunked descriptor table, and the order in which a staged call issues its work,
with the driver, the ring and the launches faked."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import kvcopy
from kvcopy import policy, testing
from kvcopy.testing import engine

kernel, staged = engine.kernel, engine.staged
from kvcopy.testing import cuda

stage = cuda.stage
kv_describe = cuda.describe
DescribedBatch = cuda.describe.DescribedBatch
from kvcopy.errors import CudaError
from kvcopy.policy import CopyRequest, Decision, HostSpans, Thresholds

KiB, MiB = 1 << 10, 1 << 20
KERNEL = Decision("kernel", "copy kernel")
HOST, GPU = 0x7F00_0000_0000, 0x7E00_0000_0000
HOST_TO_GPU = (cuda.classify.KIND_HOST_MAPPED, -1, cuda.classify.KIND_DEVICE, 0)
GPU_TO_HOST = HOST_TO_GPU[2:] + HOST_TO_GPU[:2]


def u64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


# ---- the span rule and chunks (kvcopy._cuda.stage: no driver)


@pytest.mark.parametrize(
    "total, min_span, spans, staged_there",
    [
        (64 * MiB, 1 * MiB, 64, True),
        (64 * MiB, 1 * MiB, 65, False),
        (64 * MiB + 1, 1 * MiB, 65, False),
        (64 * MiB - 1, 1 * MiB, 64, False),
        (64 * MiB - 1, 1 * MiB, 63, True),
        (96 * MiB, 3 * MiB, 32, True),
        (96 * MiB, 3 * MiB, 33, False),
    ],
)
def test_the_span_limit_is_where_the_mean_span_rule_starts_refusing(total, min_span, spans, staged_there):
    """Staged exactly where the spans average at least min_span bytes."""
    thresholds = Thresholds(staging_min_bytes=1 * MiB, staging_min_span_bytes=min_span)
    req = request(total=total, count=4096)
    staged_at = policy.choose_staging(req, KERNEL, HostSpans(spans, 16 * KiB), 4 * MiB, thresholds)
    assert (staged_at is not None) == staged_there == (total / spans >= min_span)
    assert (staged_at is not None) == (spans <= policy.staging_max_spans(req, thresholds))
    assert policy.staging_max_spans(req, Thresholds(staging_min_span_bytes=0)) == -1


class Planned:
    """A side planned by stage.plan_next_chunk, one chunk per call, as staged.run plans
    it, into ordinary memory standing in for the table: chunk k's descriptors
    [chunk_first[k], chunk_first[k + 1]) of chunk_tiles[k] tiles, its spans
    [span_bounds[k], span_bounds[k + 1])."""

    def __init__(self, host, gpu, sizes, load: bool, chunk: int, even=0xB000_0000, odd=0xC000_0000) -> None:
        n = len(sizes)
        self.table = np.zeros((n + 1, 4), dtype=np.uint64)
        room = n + 1
        self.chunk_first, self.span_bounds, self.span_first = (
            np.full(room, -1, dtype=np.int64) for _ in range(3)
        )
        self.chunk_tiles, self.span_host, self.span_staged, self.span_bytes = (
            np.zeros(room, dtype=np.uint64) for _ in range(4)
        )
        start = count = spans = chunks = 0
        self.chunk_first[0], self.span_bounds[0] = 0, 0
        while True:
            start, taken, tiles, spans = stage.plan_next_chunk(
                host,
                gpu,
                sizes,
                load,
                chunk,
                even if chunks % 2 == 0 else odd,
                start,
                self.table.ctypes.data + count * 32,
                self.span_first,
                self.span_host,
                self.span_staged,
                self.span_bytes,
                spans,
            )
            if not taken:
                break
            count, chunks = count + taken, chunks + 1
            self.chunk_first[chunks], self.chunk_tiles[chunks - 1] = count, tiles
            self.span_bounds[chunks] = spans
        assert start == n
        self.count, self.chunks, self.spans = count, chunks, spans


@pytest.mark.parametrize(
    "sizes, layout, chunk",
    [
        ([16 * KiB] * 100, "one span", 64 * KiB),  # whole chunks
        ([16 * KiB] * 100, "one span", 100 * KiB),  # chunk not a block multiple
        ([4 * KiB, 12 * KiB, 64 * KiB, 8 * KiB, 64 * KiB] * 7, "one span", 64 * KiB),  # mixed sizes
        ([8 * KiB] * 40, "gaps", 32 * KiB),  # spans of 3 copies
        ([8 * KiB, 0, 8 * KiB, 8 * KiB, 0] * 9, "one span", 24 * KiB),  # empty copies among them
        ([16 * KiB, 40 * KiB, 16 * KiB] * 11, "one span", 3 * 16 * KiB * 4),  # several tiles
    ],
)
@pytest.mark.parametrize("load", [True, False])
def test_chunks_take_whole_copies_in_order_and_spans_stop_at_gaps_and_chunk_ends(sizes, layout, chunk, load):
    from kvcopy.testing import cuda

    launch = cuda.launch
    tile = launch.TILE_BYTES
    sizes = u64(sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    if layout == "gaps":  # a 4 KiB gap after every third copy
        starts = starts + (np.arange(len(sizes)) // 3) * 4 * KiB
    host = HOST + starts.astype(np.uint64)
    gpu = GPU + np.arange(len(sizes), dtype=np.uint64)[::-1] * np.uint64(64 * KiB)
    even, odd = 0xB000_0000, 0xC000_0000
    p = Planned(host, gpu, sizes, load, chunk, even, odd)
    kept = np.flatnonzero(sizes)  # the copies that are not empty
    assert p.count == len(kept)
    bounds = p.chunk_first[: p.chunks + 1].tolist()
    assert bounds[0] == 0 and bounds[-1] == p.count
    assert all(a < b for a, b in zip(bounds, bounds[1:]))  # none empty, in order
    table = p.table[: p.count]
    staged_col, gpu_col = (0, 1) if load else (1, 0)
    assert table[:, gpu_col].tolist() == gpu[kept].tolist()
    assert table[:, 2].tolist() == sizes[kept].tolist()
    span_starts = {0} | {int(i) for a, i in zip(kept, kept[1:]) if host[i] != host[a] + sizes[a]}
    for k in range(p.chunks):
        first, stop = bounds[k], bounds[k + 1]
        inside = sizes[kept[first:stop]]
        assert int(inside.sum()) <= chunk
        if stop < p.count:  # filled as far as the next copy fits
            assert int(inside.sum()) + int(sizes[kept[stop]]) > chunk
        buffer = even if k % 2 == 0 else odd
        offsets = np.cumsum(inside) - inside  # back to back from the buffer's start
        assert table[first:stop, staged_col].tolist() == (buffer + offsets).tolist()
        tiles = -(-inside.astype(np.int64) // tile)
        assert table[first:stop, 3].tolist() == (np.cumsum(tiles) - tiles).tolist()
        assert p.chunk_tiles[k] == tiles.sum()
        # spans: cut at the chunk's start and where a copy does not continue the one before
        lo, hi = p.span_bounds[k], p.span_bounds[k + 1]
        want = [int(kept[first])] + [int(i) for i in kept[first + 1 : stop] if int(i) in span_starts]
        assert p.span_first[lo:hi].tolist() == want
        for j in range(lo, hi):
            a = int(np.searchsorted(kept, p.span_first[j]))
            b = int(np.searchsorted(kept, p.span_first[j + 1])) if j + 1 < hi else stop
            assert p.span_host[j] == host[kept[a]]
            assert p.span_staged[j] == table[a, staged_col]
            assert p.span_bytes[j] == sizes[kept[a:b]].sum()
            # the span really is one run on the host
            assert host[kept[b - 1]] + sizes[kept[b - 1]] - host[kept[a]] == p.span_bytes[j]
    assert p.span_bounds[p.chunks] == p.spans


def test_a_copy_of_exactly_one_chunk_is_a_chunk_of_its_own_and_one_over_is_refused():
    sizes = u64([4 * KiB, 64 * KiB, 4 * KiB])
    host = HOST + u64([0, 4 * KiB, 68 * KiB])
    p = Planned(host, host, sizes, True, 64 * KiB)
    assert p.chunk_first[:4].tolist() == [0, 1, 2, 3]
    assert p.span_bytes[:3].tolist() == [4 * KiB, 64 * KiB, 4 * KiB]
    with pytest.raises(ValueError, match="copy 1 of 65536 bytes does not fit a chunk of 32768"):
        Planned(host, host, sizes, True, 32 * KiB)


def test_plan_next_chunk_checks_its_arguments():
    sizes = u64([4 * KiB, 64 * KiB, 4 * KiB])
    host = HOST + u64([0, 4 * KiB, 68 * KiB])
    out = np.zeros(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="start 4 or spans 0 outside 0..3"):
        stage.plan_next_chunk(
            host, host, sizes, True, 64 * KiB, 0, 4, 0, out.view(np.int64), out, out, out, 0
        )
    with pytest.raises(ValueError, match="room for 4 entries"):
        stage.plan_next_chunk(
            host, host, sizes, True, 64 * KiB, 0, 0, 0, out[:3].view(np.int64), out, out, out, 0
        )
    two, small = u64([4, 4]), np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="room for 3 entries"):
        stage.plan_next_chunk(
            two,
            two,
            two,
            True,
            64,
            0,
            0,
            0,
            small,
            small.view(np.uint64),
            small.view(np.uint64),
            small.view(np.uint64),
            0,
        )
    with pytest.raises(ValueError, match="1 host and 2 GPU addresses for 2 sizes"):
        Planned(two[:1], two, two, True, 64)


def test_issuing_a_chunk_checks_its_launch_shape_and_span_arrays_before_any_driver_call():
    from kvcopy.testing import cuda

    launch = cuda.launch
    spans = np.zeros(4, dtype=np.uint64)
    ok = (spans.ctypes.data,) * 3
    with pytest.raises(ValueError, match="max_ctas must be positive"):
        launch.issue_staged_chunk(True, 1, 2, 3, 4, *ok, 0, 1, 5, 6, 1, 1, 0, 512)
    with pytest.raises(ValueError, match="no span arrays"):
        launch.issue_staged_chunk(True, 1, 2, 3, 4, 0, 0, 0, 0, 1, 5, 6, 1, 1, 16, 512)


# ---- the policy


def request(
    direction: str = "h2d", total: int = 64 * MiB, count: int = 4096, capturing: bool = False
) -> CopyRequest:
    return CopyRequest(
        direction=direction,
        count=count,
        total_bytes=total,
        device_accessible=True,
        stream_kind="created",
        capturing=capturing,
    )


def test_long_host_spans_between_host_and_gpu_are_staged():
    for direction in ("h2d", "d2h"):
        decision = policy.choose_staging(request(direction), KERNEL, HostSpans(1, 16 * KiB), 4 * MiB)
        assert decision is not None and decision.method == "staged"
        assert "1 span(s) of 64.0 MiB" in decision.reason and "staging buffer" in decision.reason
    # spans of 1 MiB on average (64 of them) are still long enough by default
    assert policy.choose_staging(request(), KERNEL, HostSpans(64, 16 * KiB), 4 * MiB)


@pytest.mark.parametrize(
    "why, args, kwargs",
    [
        ("DMA was chosen", (request(), Decision("batch", "large"), HostSpans(1, 16 * KiB), 4 * MiB), {}),
        ("explicit kernel", (request(), KERNEL, HostSpans(1, 16 * KiB), 4 * MiB), {"requested": "kernel"}),
        ("inside the GPU", (request("d2d"), KERNEL, HostSpans(1, 16 * KiB), 4 * MiB), {}),
        ("between GPUs", (request("p2p"), KERNEL, HostSpans(1, 16 * KiB), 4 * MiB), {}),
        ("capture", (request(capturing=True), KERNEL, HostSpans(1, 16 * KiB), 4 * MiB), {}),
        ("staging off", (request(), KERNEL, HostSpans(1, 16 * KiB), 0), {}),
        ("a copy over a chunk", (request(), KERNEL, HostSpans(1, 8 * MiB), 4 * MiB), {}),
        ("a small batch", (request(total=4 * MiB, count=256), KERNEL, HostSpans(1, 16 * KiB), 4 * MiB), {}),
        ("short spans", (request(), KERNEL, HostSpans(65, 16 * KiB), 4 * MiB), {}),
        ("scattered host blocks", (request(), KERNEL, HostSpans(4096, 16 * KiB), 4 * MiB), {}),
    ],
)
def test_everything_else_stays_with_the_kernel(why, args, kwargs):
    assert policy.choose_staging(*args, **kwargs) is None, why


def test_thresholds_move_where_staging_starts():
    small = request(total=2 * MiB, count=128)
    assert policy.choose_staging(small, KERNEL, HostSpans(8, 16 * KiB), 1 * MiB) is None
    lower = Thresholds(staging_min_bytes=1 * MiB, staging_min_span_bytes=256 * KiB)
    assert policy.choose_staging(small, KERNEL, HostSpans(8, 16 * KiB), 1 * MiB, lower)
    assert policy.choose_staging(small, KERNEL, HostSpans(9, 16 * KiB), 1 * MiB, lower) is None


def test_staging_bytes_setting_is_checked():
    saved = kvcopy.config.staging_bytes
    try:
        kvcopy.config.staging_bytes = 0
        kvcopy.config.staging_bytes = 8 * MiB
        assert kvcopy.config.staging_bytes == 8 * MiB
        with pytest.raises(ValueError, match="multiple of 4096"):
            kvcopy.config.staging_bytes = 5000
        with pytest.raises(TypeError):
            kvcopy.config.staging_bytes = "4M"
    finally:
        kvcopy.config.staging_bytes = saved


# ---- tile renumbering of a chunked table


def table_of(sizes: list[int]) -> tuple[np.ndarray, int]:
    """A descriptor table as describe writes it (tile_start counted over the whole
    table), in ordinary memory standing in for the pinned slot; and its tile count."""
    table = np.zeros((len(sizes), 4), dtype=np.uint64)
    tiles = 0
    for i, size in enumerate(sizes):
        table[i] = (0, 0, size, tiles)
        tiles += -(-size // kv_describe_tile())
    return table, tiles


def kv_describe_tile() -> int:
    from kvcopy.testing import cuda

    launch = cuda.launch
    return launch.TILE_BYTES


def test_each_slice_counts_its_tiles_from_zero():
    tile = kv_describe_tile()
    sizes = [tile, 4 * tile, 2 * tile, tile, 3 * tile, tile]
    table, tiles = table_of(sizes)
    counts = kernel.number_tiles_per_slice(table.ctypes.data, len(sizes), tiles, np.array([0, 2, 5]))
    assert counts == [5, 6, 1]
    assert table[:, 3].tolist() == [0, 1, 0, 2, 3, 0]


def test_one_tile_copies_keep_their_table():
    table, tiles = table_of([1024] * 7)
    before = table.copy()
    counts = kernel.number_tiles_per_slice(table.ctypes.data, 7, tiles, np.array([0, 3]))
    assert counts == [3, 4] and (table == before).all()


# ---- what a staged call issues, in order


class Recorder:
    """The driver, ring and launch calls of staged.run, in order; its table is written
    into ordinary memory standing in for the pinned slot."""

    def __init__(self, chunk: int) -> None:
        self.calls: list[tuple] = []
        self.table = np.zeros((1 << 16, 4), dtype=np.uint64)
        self.slot = kvcopy.testing.engine.ring.Slot(
            capacity=1 << 30, host=self.table.ctypes.data, mapped=0x2000, device=0xD000_0000, event=0x77
        )
        self.buffers = staged.StagingBuffers.__new__(staged.StagingBuffers)
        self.buffers.capacity, self.buffers.base = chunk, 0xB000_0000
        self.buffers.lock = threading.Lock()
        self.buffers.free = [0xF0, 0xF1, 0xF2, 0xF3]
        self.buffers.filled = [0xE0, 0xE1, 0xE2, 0xE3]
        self.fail_copy: int | None = None
        self.described_at_copy: list[int] = []  # descriptors written when each copy was issued
        self.side_streams = dict(SIDES)  # kvcopy's side streams, by index

    # driver
    def stream_wait_event(self, stream, event):
        self.calls.append(("wait", stream, event))

    def event_record(self, event, stream):
        self.calls.append(("record", event, stream))

    def stream_wait_stream(self, consumer, producer):
        self.calls.append(("join", consumer, producer))

    # describe, launch
    DESCRIPTOR_BYTES = kv_describe.DESCRIPTOR_BYTES
    TILE_BYTES = kv_describe_tile()

    def upload(self, device, host, nbytes, stream):
        self.calls.append(("upload", device, nbytes, stream))

    def launch_descs(self, function, descs, n, tiles, ctas, threads, stream, upload_from):
        # descriptors read where they were written (mapped) or from the slot's device copy
        in_place = descs < self.slot.device
        base = self.slot.mapped if in_place else self.slot.device
        self.calls.append(
            ("kernel in place" if in_place else "kernel", stream, (descs - base) // 32, n, tiles, ctas)
        )
        return 1

    def issue_staged_chunk(
        self,
        load,
        copy_stream,
        kernel_stream,
        free_event,
        filled_event,
        span_host,
        span_staged,
        span_bytes,
        lo,
        hi,
        function,
        descs,
        n,
        tiles,
        ctas,
        threads,
    ):
        """Records what the chunk issues, in the order launch.issue_staged_chunk's
        contract gives (the driver calls themselves run on the GPU tests)."""

        def span_array(address):
            return np.ctypeslib.as_array((ctypes.c_uint64 * hi).from_address(address))[lo:hi]

        host, staged_at, sizes = (span_array(a) for a in (span_host, span_staged, span_bytes))

        def copy():
            if self.fail_copy is not None and self.fail_copy < hi - lo:
                raise CudaError(1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", lo + self.fail_copy)
            dst, src = (staged_at, host) if load else (host, staged_at)
            self.calls.append(("copy", copy_stream, dst.tolist(), src.tolist(), sizes.tolist()))
            self.described_at_copy.append(int(np.count_nonzero(self.table[:, 2])))

        def kernel():
            self.launch_descs(function, descs, n, tiles, ctas, threads, kernel_stream, 0)

        first, second = (copy, kernel) if load else (kernel, copy)
        first_stream, second_stream = (copy_stream, kernel_stream) if load else (kernel_stream, copy_stream)
        self.stream_wait_event(first_stream, free_event)
        first()
        self.event_record(filled_event, first_stream)
        self.stream_wait_event(second_stream, filled_event)
        second()
        self.event_record(free_event, second_stream)


CALLER, SIDES = 0x5000, {0: 0x5100, 1: 0x5101, 2: 0x5102}
FENCE = ("record", 0x77, CALLER)  # the slot's event, recorded behind the call's work


@pytest.fixture
def rec(seams):
    r = Recorder(64 * KiB)

    class Ring:
        def reserve(self, nbytes):
            assert nbytes <= r.table.nbytes
            r.calls.append(("reserve", nbytes))
            return self

        def __enter__(self):
            return r.slot

        def __exit__(self, *exc):
            r.calls.append(("release",))

    class Functions:
        uploaded = 0xF00

    class Kernel:
        @staticmethod
        def scatter(variant):
            assert variant == "registers"
            return Functions

    # (the ring's fence records the slot's event, FENCE, on the caller's stream)
    seams.enter_context(testing.fake_cuda(r, ("driver", "describe", "launch")))
    seams.enter_context(
        testing.fake_runtime(
            copy_kernel=Kernel,
            descriptor_ring=Ring(),
            staging=r.buffers,
            side_stream=lambda handle, index=0: r.side_streams[index],
        )
    )
    return r


def batch(
    direction: str, count: int, block: int = 16 * KiB, name: str = "", largest_known: bool = False
) -> staged.StagedBatch:
    """A side of ``count`` blocks, its host side one span; its largest copy given (as
    plan_batch gives it) with ``largest_known``, else unknown (planned whole)."""
    sizes = np.full(count, block, dtype=np.uint64)
    host = HOST + np.arange(count, dtype=np.uint64) * np.uint64(block)
    gpu = GPU + np.arange(count, dtype=np.uint64)[::-1] * np.uint64(2 * block)
    return staged.StagedBatch(
        direction,
        host,
        gpu,
        sizes,
        count,
        Decision("staged", "test"),
        64 * KiB,
        name,
        block if largest_known else 0,
    )


def test_a_load_copies_each_chunk_in_then_scatters_it_on_the_callers_stream(rec):
    load = batch("h2d", 10)  # 160 KiB: chunks of 4, 4 and 2 blocks of 16 KiB
    staged.run(CALLER, [load], (9, 0), 12080)
    copy, base = SIDES[0], rec.buffers.base
    # the descriptors: from the staging buffers (chunk k in buffer k % 2) to the GPU blocks
    buffer_of = [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    offset = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert rec.table[:10, 0].tolist() == [
        base + b * 64 * KiB + o * 16 * KiB for b, o in zip(buffer_of, offset)
    ]
    assert rec.table[:10, 1].tolist() == load.gpu.tolist()
    assert rec.calls[:3] == [
        ("reserve", 10 * 32),
        ("upload", rec.slot.device, 10 * 32, CALLER),
        ("join", copy, CALLER),
    ]
    chunk = [
        ("wait", copy, 0xF0),
        ("copy", copy, [base], [HOST], [64 * KiB]),
        ("record", 0xE0, copy),
        ("wait", CALLER, 0xE0),
        ("kernel", CALLER, 0, 4, 4, policy.STAGING_CTAS),
        ("record", 0xF0, CALLER),
        ("wait", copy, 0xF1),
        ("copy", copy, [base + 64 * KiB], [HOST + 64 * KiB], [64 * KiB]),
        ("record", 0xE1, copy),
        ("wait", CALLER, 0xE1),
        ("kernel", CALLER, 4, 4, 4, policy.STAGING_CTAS),
        ("record", 0xF1, CALLER),
        ("wait", copy, 0xF0),
        ("copy", copy, [base], [HOST + 128 * KiB], [32 * KiB]),
        ("record", 0xE0, copy),
        ("wait", CALLER, 0xE0),
        ("kernel", CALLER, 8, 2, 2, policy.STAGING_CTAS),
        ("record", 0xF0, CALLER),
    ]
    assert rec.calls[3:-3] == chunk
    assert rec.calls[-3:] == [("join", CALLER, copy), FENCE, ("release",)]


def test_one_tile_copies_are_planned_chunk_by_chunk_and_read_in_place(rec):
    """The first chunk crosses the link while the later ones are still to be planned;
    the table ends up as the whole-side plan writes it, with nothing uploaded."""
    staged.run(CALLER, [batch("h2d", 10)], (9, 0), 12080)
    planned_whole = rec.table[:10].copy()
    rec.table[:] = 0
    rec.calls.clear()
    rec.described_at_copy.clear()
    staged.run(CALLER, [batch("h2d", 10, largest_known=True)], (9, 0), 12080)
    np.testing.assert_array_equal(rec.table[:10], planned_whole)
    assert not [c for c in rec.calls if c[0] == "upload"]
    assert rec.described_at_copy == [4, 8, 10]  # chunks of 4, 4 and 2 blocks
    kernels = [c for c in rec.calls if c[0].startswith("kernel")]
    assert kernels == [
        ("kernel in place", CALLER, 0, 4, 4, policy.STAGING_CTAS),
        ("kernel in place", CALLER, 4, 4, 4, policy.STAGING_CTAS),
        ("kernel in place", CALLER, 8, 2, 2, policy.STAGING_CTAS),
    ]
    assert rec.calls[-3:] == [("join", CALLER, SIDES[0]), FENCE, ("release",)]


def test_both_ways_a_side_of_multi_tile_copies_is_uploaded_beside_one_read_in_place(rec):
    store = batch("d2h", 6, block=32 * KiB, name="store", largest_known=True)  # 2 tiles each
    load = batch("h2d", 8, name="load", largest_known=True)
    staged.run(CALLER, [store, load], (9, 0), 12080)
    assert [c for c in rec.calls if c[0] == "upload"] == [
        ("upload", rec.slot.device, 6 * 32, CALLER)
    ]  # the store's table only, before all
    assert rec.calls[1][0] == "upload"
    kernels = [c for c in rec.calls if c[0].startswith("kernel")]
    assert kernels == [
        ("kernel", CALLER, 0, 2, 4, policy.STAGING_CTAS),
        ("kernel in place", SIDES[1], 6, 4, 4, policy.STAGING_CTAS),
        ("kernel", CALLER, 2, 2, 4, policy.STAGING_CTAS),
        ("kernel in place", SIDES[1], 10, 4, 4, policy.STAGING_CTAS),
        ("kernel", CALLER, 4, 2, 4, policy.STAGING_CTAS),
    ]
    # the load's descriptors follow the store's, from its staging buffers to its blocks
    assert rec.table[6:14, 1].tolist() == load.gpu.tolist()
    assert rec.table[6:14, 0].tolist() == [
        rec.buffers.base + (2 + k // 4 % 2) * 64 * KiB + (k % 4) * 16 * KiB for k in range(8)
    ]


def test_a_store_gathers_each_chunk_then_copies_it_out_and_joins_the_callers_stream(rec):
    store = batch("d2h", 6, block=32 * KiB)  # chunks of 2 blocks of 32 KiB (2 tiles each)
    staged.run(CALLER, [store], (9, 0), 12080)
    copy, base = SIDES[0], rec.buffers.base
    assert rec.table[:6, 0].tolist() == store.gpu.tolist()
    assert rec.table[:6, 1].tolist() == [
        base + (k // 2 % 2) * 64 * KiB + (k % 2) * 32 * KiB for k in range(6)
    ]
    # each chunk's tiles counted from 0 for its own launch
    assert rec.table[:6, 3].tolist() == [0, 2, 0, 2, 0, 2]
    kernels = [c for c in rec.calls if c[0] == "kernel"]
    assert kernels == [("kernel", CALLER, 2 * k, 2, 4, policy.STAGING_CTAS) for k in range(3)]
    first_chunk = rec.calls[3:9]
    assert first_chunk == [
        ("wait", CALLER, 0xF0),
        kernels[0],
        ("record", 0xE0, CALLER),
        ("wait", copy, 0xE0),
        ("copy", copy, [HOST], [base], [64 * KiB]),
        ("record", 0xF0, copy),
    ]
    assert rec.calls[-3:] == [("join", CALLER, copy), FENCE, ("release",)]


def test_both_ways_take_turns_chunk_by_chunk_each_on_streams_and_buffers_of_its_own(rec):
    store, load = batch("d2h", 8, name="store"), batch("h2d", 4, name="load")
    staged.run(CALLER, [store, load], (9, 0), 12080)
    # the store: gathered on the caller's stream into buffers 0-1, out on side 0;
    # the load: in on side 2 into buffers 2-3, scattered on side 1
    kernels = [c for c in rec.calls if c[0] == "kernel"]
    assert kernels == [
        ("kernel", CALLER, 0, 4, 4, policy.STAGING_CTAS),
        ("kernel", SIDES[1], 8, 4, 4, policy.STAGING_CTAS),
        ("kernel", CALLER, 4, 4, 4, policy.STAGING_CTAS),
    ]
    copies = [c for c in rec.calls if c[0] == "copy"]
    base = rec.buffers.base
    assert copies == [
        ("copy", SIDES[0], [HOST], [base], [64 * KiB]),
        ("copy", SIDES[2], [base + 128 * KiB], [HOST], [64 * KiB]),
        ("copy", SIDES[0], [HOST + 64 * KiB], [base + 64 * KiB], [64 * KiB]),
    ]
    forks = {c[1] for c in rec.calls[:8] if c[0] == "join" and c[2] == CALLER}
    joins = {c[2] for c in rec.calls[-6:] if c[0] == "join" and c[1] == CALLER}
    assert forks == joins == {SIDES[0], SIDES[1], SIDES[2]}
    assert rec.calls[-2:] == [FENCE, ("release",)]


def test_where_side_streams_are_shared_every_chunk_still_copies_and_scatters(rec):
    """Past side_streams.MAX_SIDE_STREAMS callers share side streams: a side's copy and
    kernel streams may be one stream, and each chunk must still issue both, in order
    (the first GPU run of copy_both_ways at 64 MiB lost the load's scatter so)."""
    rec.side_streams = {0: 0x5100, 1: 0x5100, 2: 0x5100}
    store, load = batch("d2h", 8, name="store"), batch("h2d", 8, name="load")
    staged.run(CALLER, [store, load], (9, 0), 12080)
    steps = [c[0] for c in rec.calls if c[0] in ("copy", "kernel")]
    # chunk by chunk: the store gathers then copies out, the load copies in then scatters
    assert steps == ["kernel", "copy", "copy", "kernel"] * 2
    loads = [c for c in rec.calls if c[0] == "kernel" and c[2] >= 8]
    assert [c[1] for c in loads] == [0x5100, 0x5100]


def test_a_failed_copy_names_the_side_and_the_callers_index_and_still_joins(rec):
    load = batch("h2d", 10, name="load")
    sizes = load.sizes.copy()
    sizes[:5] = 0  # the first span starts at copy 5
    load = staged.StagedBatch("h2d", load.host, load.gpu, sizes, 5, load.decision, 64 * KiB, "load")
    rec.fail_copy = 0
    with pytest.raises(CudaError, match="load: invalid argument") as info:
        staged.run(CALLER, [load], (9, 0), 12080)
    assert info.value.index == 5 and info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert rec.calls[-3:] == [("join", CALLER, SIDES[0]), FENCE, ("release",)]


# ---- choosing a staged side


def test_plan_batch_counts_the_copies_that_are_not_empty(seams):
    class Buffers:
        def ensure(self, chunk):
            return True

    seams.enter_context(testing.fake_runtime(staging=Buffers()))
    n, block = 2 * policy.STAGING_MIN_BYTES // (16 * KiB), 16 * KiB
    sizes = np.full(n, block, dtype=np.uint64)
    sizes[::5] = 0
    host = HOST + np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)
    gpu = GPU + np.arange(n, dtype=np.uint64) * np.uint64(4 * block)
    req = request("d2h", total=int(sizes.sum()), count=n)
    # as the describe pass finds it: the host side one span (empty copies break none)
    batch = DescribedBatch(
        n,
        int(sizes.sum()),
        n,
        *GPU_TO_HOST,
        src=gpu,
        dst=host,
        sizes=sizes,
        dst_spans=1,
        largest_copy=block,
        empty_copies=len(range(0, n, 5)),
    )
    side = staged.plan_batch(req, KERNEL, batch, "auto", Thresholds(), "store")
    assert side is not None and side.decision.method == "staged" and side.name == "store"
    assert side.count == n - len(range(0, n, 5))
    assert side.host is host and side.gpu is gpu and side.chunk_bytes == kvcopy.config.staging_bytes
    assert "1 span(s)" in side.decision.reason  # empty copies do not break a span


def test_plan_batch_leaves_the_kernel_where_staging_does_not_apply_or_has_no_room(seams):
    room = {"ok": False}

    class Buffers:
        def ensure(self, chunk):
            return room["ok"]

    seams.enter_context(testing.fake_runtime(staging=Buffers()))
    n, block = 2 * policy.STAGING_MIN_BYTES // (16 * KiB), 16 * KiB
    sizes = np.full(n, block, dtype=np.uint64)
    host = HOST + np.arange(n, dtype=np.uint64) * np.uint64(block)
    scattered = HOST + np.arange(n, dtype=np.uint64)[::-1] * np.uint64(block)
    req = request("h2d", total=n * block, count=n)
    args = (Thresholds(),)

    def described(src, spans):
        return DescribedBatch(
            n,
            n * block,
            n,
            *HOST_TO_GPU,
            src=src,
            dst=host + 1,
            sizes=sizes,
            src_spans=spans,
            largest_copy=block,
        )

    one_span = described(host, 1)
    assert staged.plan_batch(req, KERNEL, one_span, "auto", *args) is None  # no room
    room["ok"] = True
    assert staged.plan_batch(req, KERNEL, one_span, "auto", *args) is not None
    assert staged.plan_batch(req, KERNEL, described(scattered, n), "auto", *args) is None
    assert staged.plan_batch(req, KERNEL, one_span, "kernel", *args) is None
    kvcopy.config.staging_bytes = 0
    assert staged.plan_batch(req, KERNEL, one_span, "auto", *args) is None
