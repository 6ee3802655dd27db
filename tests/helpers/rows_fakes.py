"""copy_rows' engine layers faked (through kvcopy.testing's seams): memory classified
as the test says, layout-kernel launches, uploads, fences and stream joins recorded."""
from __future__ import annotations

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
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<i8",
                                         "data": (address, False), "version": 3}


class FakeRowsCuda(FakeCaptureDriver):
    """The driver, launch, classify and rows layers as copy_rows' engine calls them:
    the source planes are in ``src`` memory, the destination planes in ``dst``."""

    def __init__(self, src: tuple[int, int], dst: tuple[int, int], capturing: int = 0) -> None:
        self.sides = [src, dst]
        self.capturing = capturing
        self.calls: list[tuple] = []
        self.ctas: list[int] = []
        self.contexts: list[int] = []
        self.context_alive = True   # whether built launches' context still stands
        self.classified = 0         # sides classified
        self.PLANES_PER_LAUNCH = cuda.rows.PLANES_PER_LAUNCH

    def __getattr__(self, name: str):
        if name.startswith("KIND_"):   # the classify layer's constants are the real ones
            return getattr(cuda.classify, name)
        raise AttributeError(name)

    def classify_pointers(self, ptrs, sizes, device_view):
        self.classified += 1
        device_view[:] = ptrs
        side = self.sides[0]
        self.sides.append(self.sides.pop(0))
        return side

    def RowsLaunches(self, function, src_side, dst_side, src_bases, dst_bases, rows, pieces,
                     piece_bytes, ctas, threads, stream, context=0):
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
        return Launches()

    def current_context(self):
        return 0xC0

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
    found.slot_memory = slot_memory   # the slot holds only its address: keep it alive
    seams.enter_context(testing.fake_cuda(found, ("driver", "launch", "classify", "rows")))
    kernel = engine.kernels.CopyKernel(1, 2, 3, 4, 5, 6, 7, 8, 9, 1000, None,
                                       function_rows=42, rows_report=0x99)
    slot = engine.ring.Slot(capacity=slot_memory.nbytes, host=slot_memory.ctypes.data, mapped=0x2000,
                            device=0x3000, event=0x77)
    seams.enter_context(testing.fake_runtime(copy_kernel=kernel, slot=slot, scope=FakeScope,
                                             side_stream=side_stream))
    return found


def caches():
    """A paged GPU-side cache (2 planes, 8 pages of 16 slots of 256 B) and a 40-slot chunk."""
    gpu = np.zeros((2, 8, 16, 256), np.uint8)
    host = np.zeros((2, 40, 256), np.uint8)
    return Layout.of(gpu, planes=(0,), page=1, slot=2), Layout.of(host, planes=(0,), slot=1)
