"""copy_rows' engine layers faked (through kvcopy.testing's seams): memory classified
as the test says, layout-kernel launches, uploads, fences and stream joins recorded."""

from __future__ import annotations

import ctypes

import numpy as np

from kvcopy import Layout
from kvcopy import testing
from kvcopy.testing import cuda, engine
from helpers.cpu_fakes import FakeCaptureDriver, FakeScope

DEVICE = (cuda.classify.KIND_DEVICE, 0)
PINNED = (cuda.classify.KIND_HOST_MAPPED, -1)
PAGEABLE = (cuda.classify.KIND_HOST_UNMAPPED, -1)
STREAM = 0x1234


class GpuIndices:
    """Int64 indices that say they live on the GPU (at a made-up address)."""

    def __init__(self, count: int, address: int = 0x7000_0000) -> None:
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": "<i8",
            "data": (address, False),
            "version": 3,
        }


class FakeRowsCuda(FakeCaptureDriver):
    """The driver, launch, classify and rows layers as copy_rows' engine calls them:
    the source planes are in ``src`` memory, the destination planes in ``dst``."""

    def __init__(self, src: tuple[int, int], dst: tuple[int, int], capturing: int = 0) -> None:
        self.sides = [src, dst]
        self.capturing = capturing
        self.calls: list[tuple] = []
        self.ctas: list[int] = []
        self.contexts: list[int] = []
        self.context_alive = True  # whether built launches' context still stands
        self.context_key = 1  # the current context's key (a reset makes another)
        self.classified = 0  # sides classified
        self.PLANES_PER_LAUNCH = cuda.rows.PLANES_PER_LAUNCH

    def __getattr__(self, name: str):
        if name.startswith("KIND_"):  # the classify layer's constants are the real ones
            return getattr(cuda.classify, name)
        raise AttributeError(name)

    def classify_pointers(self, ptrs, sizes, device_view):
        self.classified += 1
        device_view[:] = ptrs
        side = self.sides[0]
        self.sides.append(self.sides.pop(0))
        return side

    def RowsLaunches(
        self,
        function,
        src_side,
        dst_side,
        src_bases,
        dst_bases,
        rows,
        pieces,
        piece_bytes,
        ctas,
        threads,
        stream,
        context=0,
    ):
        """Built launches: each launch() is recorded as a call."""
        call = ("launch", function, src_side, dst_side, rows, pieces, piece_bytes, stream)
        driver = self

        class Launches:
            built_in = context

            def usable(self):
                return driver.context_alive

            def launch(self):
                driver.contexts.append(self.built_in)
                driver.calls.append(call)
                driver.ctas.append(ctas)
                return 1

            def launch_indexed(self, src_indices, dst_indices):
                driver.contexts.append(self.built_in)
                driver.calls.append(
                    (*call[:2], (src_indices, *src_side[1:]), (dst_indices, *dst_side[1:]), *call[4:])
                )
                driver.ctas.append(ctas)
                return 1

        return Launches()

    def current_context(self):
        return 0xC0

    def current_context_key(self):
        return self.context_key

    def upload(self, device, host, nbytes, stream):
        self.calls.append(("upload", device, nbytes, stream))

    def event_record(self, event, stream):
        self.calls.append(("fence", event, stream))

    def stream_wait_stream(self, waiter, waited):
        self.calls.append(("wait", waiter, waited))


def install_rows_fakes(seams, slot_memory, src, dst, capturing=0, side_stream=None):
    """FakeRowsCuda in place of the driver layers, a loaded kernel, a descriptor-ring slot
    over ``slot_memory``, and ``side_stream`` for kvcopy's side streams."""
    found = FakeRowsCuda(src, dst, capturing)
    found.slot_memory = slot_memory  # the slot holds only its address: keep it alive
    seams.enter_context(testing.fake_cuda(found, ("driver", "launch", "classify", "rows")))
    kernel = rows_kernel()
    slot = engine.ring.Slot(
        capacity=slot_memory.nbytes, host=slot_memory.ctypes.data, mapped=0x2000, device=0x3000, event=0x77
    )
    seams.enter_context(
        testing.fake_runtime(copy_kernel=kernel, slot=slot, scope=FakeScope, side_stream=side_stream)
    )
    return found


def rows_kernel():
    """A loaded copy kernel as the fakes stand it in: the layout kernel's function is 42."""
    return engine.kernels.CopyKernel(
        1, 2, 3, 4, 5, 6, 7, 8, 9, 1000, None, function_rows=42, rows_report=0x99
    )


def emulate_on_host_memory(seams, fake: "RowsOnHostMemory", slot_bytes: int = 1 << 13, **runtime):
    """``fake`` in place of the driver, launch, classify, rows and copy-engine layers, a
    loaded kernel, and two ring slots over ``slot_bytes`` of host memory the emulated
    kernel reads indices from where they lie (host_ring_slots); ``runtime``: more of
    kvcopy.testing.fake_runtime's stand-ins."""
    fake.slot_memory = np.zeros(slot_bytes, np.uint8)  # (the slots hold only its address)
    fake.slots = host_ring_slots(fake.slot_memory)
    seams.enter_context(testing.fake_cuda(fake, ("driver", "launch", "classify", "rows", "dma")))
    seams.enter_context(
        testing.fake_runtime(copy_kernel=rows_kernel(), scope=FakeScope, slot=fake.slots, **runtime)
    )


def host_ring_slots(memory: np.ndarray) -> list:
    """Two descriptor-ring slots over halves of ``memory``, reserved in turn (fenced by
    events 0x77 and 0x78), whose device side is the host memory itself: an emulated
    kernel reads host indices uploaded there where they lie."""
    half = memory.nbytes // 2
    return [
        engine.ring.Slot(
            capacity=half,
            host=memory.ctypes.data + at,
            mapped=memory.ctypes.data + at,
            device=memory.ctypes.data + at,
            event=event,
        )
        for at, event in ((0, 0x77), (half, 0x78))
    ]


def caches():
    """A paged GPU-side cache (2 planes, 8 pages of 16 slots of 256 B) and a 40-slot chunk,
    as arrays over memory they do not hold (a ctypes buffer at each array's address, as
    a custom allocator's would be), so that each plan classifies their memory and the
    fakes' classification count counts plans."""
    gpu = unheld(np.zeros((2, 8, 16, 256), np.uint8))
    host = unheld(np.zeros((2, 40, 256), np.uint8))
    return Layout.of(gpu, planes=(0,), page=1, slot=2), Layout.of(host, planes=(0,), slot=1)


def unheld(array: np.ndarray) -> np.ndarray:
    """An array over ``array``'s memory through a ctypes buffer made from its address,
    which kvcopy cannot tell holds that memory (the buffer keeps ``array`` alive all the
    same, so the test's memory stays valid)."""
    buffer = (ctypes.c_uint8 * array.nbytes).from_address(array.ctypes.data)
    buffer.keep_alive = array  # type: ignore[attr-defined]
    return np.frombuffer(buffer, np.uint8).reshape(array.shape)


def _u64_at(address: int) -> int:
    return ctypes.c_int64.from_address(address).value


class RowsOnHostMemory(FakeRowsCuda):
    """FakeRowsCuda whose layout-kernel launches and copy-engine copies move real bytes,
    at once, in ordinary memory standing in for the GPU's (addresses are real host
    addresses): a launch does what rows.h says a job does, index arrays read where
    they lie. Memory inside one of ``gpu_buffers`` (numpy arrays) is classified as
    device memory, the rest as pinned host memory. Out-of-range rows are collected in
    ``reported`` (row numbers), as the kernel's report counts them."""

    def __init__(self, gpu_buffers: list) -> None:
        super().__init__(DEVICE, PINNED)
        self.gpu = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in gpu_buffers]
        self.reported: list[int] = []

    def _on_gpu(self, address: int) -> bool:
        return any(lo <= address < hi for lo, hi in self.gpu)

    def classify_pointers(self, ptrs, sizes, device_view):
        self.classified += 1
        device_view[:] = ptrs
        return DEVICE if all(self._on_gpu(int(p)) for p in ptrs) else PINNED

    def stream_wait_event(self, stream, event):
        self.calls.append(("wait event", stream, event))

    def event_record(self, event, stream):
        self.calls.append(("record", event, stream))

    def plan_dma(self, src, dst, sizes, merge=True):
        """The copy engines' plan: the copies as given, each its own caller index."""
        return src, dst, sizes, np.arange(len(sizes), dtype=np.int64)

    def BlockCopyAgain(self, *args):
        """dma.BlockCopyAgain, its copy issued through memcpy_loop below."""
        return testing.block_copy_again(self.memcpy_loop)(*args)

    def memcpy_loop(self, dst, src, sizes, stream):
        for d, s, n in zip(dst, src, sizes):
            ctypes.memmove(int(d), int(s), int(n))
        self.calls.append(
            (
                "memcpy",
                stream,
                tuple(int(d) for d in dst),
                tuple(int(s) for s in src),
                tuple(int(n) for n in sizes),
            )
        )

    def RowsLaunches(
        self,
        function,
        src_side,
        dst_side,
        src_bases,
        dst_bases,
        rows,
        pieces,
        piece_bytes,
        ctas,
        threads,
        stream,
        context=0,
        only_skipped_by=(0, 0),
        first_row=0,
    ):
        driver = self
        src_bases, dst_bases = [int(b) for b in src_bases], [int(b) for b in dst_bases]

        def slot(side, row):
            """The row's slot on a side; None: skipped ('bad' where out of range)."""
            if not side[0]:
                return row
            index = _u64_at(side[0] + 8 * row)
            if index < 0:
                return None
            return "bad" if index >= side[1] else index

        def address(side, base, s, piece):
            page_size, page_stride, slot_stride, piece_stride = side[2:]
            return (
                base + (s // page_size) * page_stride + (s % page_size) * slot_stride + piece * piece_stride
            ) & ((1 << 64) - 1)

        class Launches:
            def usable(self):
                return True

            def launch(self):
                return self.launch_indexed(src_side[0], dst_side[0])

            def launch_indexed(self, src_indices, dst_indices):
                src, dst = (src_indices, *src_side[1:]), (dst_indices, *dst_side[1:])
                driver.calls.append(("launch", stream, first_row, rows, only_skipped_by[0] != 0))
                for row in range(first_row, first_row + rows):
                    if only_skipped_by[0]:
                        index = _u64_at(only_skipped_by[0] + 8 * row)
                        if 0 <= index < only_skipped_by[1]:
                            continue
                    s, d = slot(src, row), slot(dst, row)
                    if "bad" in (s, d):
                        if not only_skipped_by[0]:
                            driver.reported.extend([row] * len(src_bases))
                        continue
                    if s is None or d is None:
                        continue
                    for p in range(len(src_bases)):
                        for j in range(pieces):
                            ctypes.memmove(
                                address(dst, dst_bases[p], d, j),
                                address(src, src_bases[p], s, j),
                                piece_bytes,
                            )
                return 1

        return Launches()

    def StagedRowsSide(
        self,
        function,
        load,
        staging_side,
        gpu_side,
        host_side,
        gpu_bases,
        host_bases,
        only_skipped_by,
        pieces,
        piece_bytes,
        ctas,
        threads,
        copy_stream,
        kernel_stream,
        first_rows,
        row_counts,
        host,
        staged,
        nbytes,
        staging_bases,
    ):
        """kvcopy._cuda.rows.StagedRowsSide on this memory: each issue() makes the calls the
        C side makes, in its order, through the fakes above (so they are recorded and
        move the bytes)."""
        driver = self

        def launch(k, src_side, dst_side, src_bases, dst_bases, **only):
            driver.RowsLaunches(
                function,
                src_side,
                dst_side,
                src_bases,
                dst_bases,
                int(row_counts[k]),
                pieces,
                piece_bytes,
                ctas,
                threads,
                kernel_stream,
                first_row=int(first_rows[k]),
                **only,
            ).launch()

        indices = {"gpu": gpu_side, "only": only_skipped_by}

        class Side:
            def __len__(self):
                return len(first_rows)

            def set_indices(self, address):
                driver.calls.append(("set indices", address))
                indices["gpu"] = (address, *indices["gpu"][1:])
                if not load:
                    indices["only"] = (address, indices["only"][1])

            def issue(self, k, free, filled):
                if not 0 <= k < len(first_rows):
                    raise IndexError(k)
                if load:
                    driver.stream_wait_event(copy_stream, free)
                    driver.memcpy_loop(staged[k], host[k], nbytes[k], copy_stream)
                    driver.event_record(filled, copy_stream)
                    driver.stream_wait_event(kernel_stream, filled)
                    launch(k, staging_side, indices["gpu"], staging_bases[k], gpu_bases)
                    driver.event_record(free, kernel_stream)
                    return
                driver.stream_wait_event(kernel_stream, free)
                launch(
                    k, host_side, staging_side, host_bases, staging_bases[k], only_skipped_by=indices["only"]
                )
                launch(k, indices["gpu"], staging_side, gpu_bases, staging_bases[k])
                driver.event_record(filled, kernel_stream)
                driver.stream_wait_event(copy_stream, filled)
                driver.memcpy_loop(host[k], staged[k], nbytes[k], copy_stream)
                driver.event_record(free, copy_stream)

        return Side()
