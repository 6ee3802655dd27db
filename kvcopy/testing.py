"""Test seams: where kvcopy's own tests, and a user's, stand in for the GPU.

Not part of the copying API. Each seam is a context manager that changes what
every kvcopy module sees for the duration of a with-block and puts it back
after, so that a test fakes the driver or a device, not the wiring of modules:

- ``capabilities(**caps)``: every device reports the given DeviceCaps fields
  (e.g. ``batch_available=False`` for a driver older than 12.8); remembered
  decisions are forgotten.
- ``settings(**values)``: kvcopy.config values for the block (each checked as an
  assignment is), the previous ones back after it.
- ``fake_cuda(fake, layers)``: every use of the driver layer's modules named in
  ``layers`` (kvcopy._cuda.driver, .memory, .describe, .launch, .dma, .stage,
  .classify, .replay_records, .plan_arrays, .rows, .ipc) outside that layer goes to
  ``fake``, an object with the functions and constants the test's path calls.
- ``fake_runtime(...)``: what kvcopy keeps per CUDA context, replaced: the loaded
  copy kernel, the descriptor ring, the staging buffers, the side streams, the
  context a call enters, device 0's facts and thresholds.
- ``fake_compiler(compile_cubin, version)``: NVRTC replaced: ``compile_cubin(arch)``
  returns a cubin's bytes, ``version`` is the NVRTC version in the cache key.
- ``fake_clock(clock)``: the clock kvcopy._engine.traffic_window reads (a callable
  returning seconds).
- ``describe_copies_in`` / ``describe_copies_answered``: the describe pass with
  memory ranges known in advance, or with seeded answers standing in for the
  driver (rows of start, end, kind, ordinal, delta), so that it runs on a CPU;
  ``fast_describe_available()``: whether this CPU runs the vectorised pass.
- ``block_copy_again(memcpy_loop)``: kvcopy._cuda.dma.BlockCopyAgain for a fake dma
  layer: the same checks of a call's ids and the same block addresses, the copy
  issued through the fake's ``memcpy_loop``.
- ``engine`` and ``cuda``: the private modules a white-box test reads (the seams
  above are how it changes them): nothing outside kvcopy imports them otherwise.
- ``rows_on_host()``: every copy_rows call (kvcopy's drop-ins' included) planned
  with every check, then run on the CPU between host memory, row by row; the
  drop-ins that copy on torch's current stream ask for none, and tables of layer
  addresses are sized from the host's mappings. An engine's test can
  run its transfers through kvcopy on CPU tensors and compare the bytes.
- ``host``: the host's NUMA facts (``numa``: read from a sysfs root a test names) and
  a pinned pool's memory (``pages``: mapping, binding, first touch, where pages are).
- ``plans``: copy_rows' planning without a GPU: ``plan_rows`` (every check) and
  ``expand`` (the plan as the pointer copies the kernel computes), so that a test
  can run a plan between host arrays and compare the bytes with an oracle;
  ``refuse_rows_crossing`` (copy_rows_both_ways' race check); and swap_blocks'
  planning (``block_geometry``, kept for unchanged torch tensors, and ``plan_blocks``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import types
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kvcopy import policy
from kvcopy._cuda import (
    classify,
    describe,
    dma,
    driver,
    ipc,
    launch,
    memory,
    plan_arrays,
    replay_records,
    stage,
)
from kvcopy._cuda import rows as rows_cuda
from kvcopy._cuda import rows_repeat
from kvcopy._cuda import testing as cuda_testing
from kvcopy._cuda.describe import fast_describe_available
from kvcopy._cuda.testing import describe_copies_answered, describe_copies_in
from kvcopy._engine import blocks as blocks_engine
from kvcopy._engine import both_ways, decide, dispatch, guard, kernel, replay, staged, traffic_window
from kvcopy._engine import rows as rows_engine
from kvcopy._engine import rows_memo
from kvcopy._plans.blocks import block_geometry, plan_blocks
from kvcopy._plans.rows import RowsPlan, expand, plan_rows
from kvcopy._plans.rows_races import refuse_rows_crossing
from kvcopy._runtime import (
    calibration_file,
    context,
    device,
    first_use,
    host_key,
    host_pages,
    kept_memory,
    kernels,
    numa,
    peers,
    persist,
    prepare,
    ring,
    side_streams,
)
from kvcopy.rows import copy_planned_rows, copy_rows
from kvcopy.pointers import refuse_unless_apart
from kvcopy.compat import pointer_tables
from kvcopy.compat import vllm as compat_vllm
from kvcopy.config import config
from kvcopy.layouts import Layout

CUDA_LAYERS = ("driver", "describe", "launch")
_LAYERS = {
    "driver": driver,
    "memory": memory,
    "describe": describe,
    "launch": launch,
    "dma": dma,
    "stage": stage,
    "classify": classify,
    "replay_records": replay_records,
    "plan_arrays": plan_arrays,
    "rows": rows_cuda,
    "ipc": ipc,
}

# What white-box tests read; changing it goes through the seams above.
cuda = types.SimpleNamespace(
    classify=classify,
    describe=describe,
    dma=dma,
    driver=driver,
    ipc=ipc,
    launch=launch,
    memory=memory,
    plan_arrays=plan_arrays,
    replay_records=replay_records,
    stage=stage,
    testing=cuda_testing,
    rows=rows_cuda,
    rows_repeat=rows_repeat,
)
engine = types.SimpleNamespace(
    blocks=blocks_engine,
    both_ways=both_ways,
    decide=decide,
    dispatch=dispatch,
    guard=guard,
    kernel=kernel,
    replay=replay,
    staged=staged,
    traffic_window=traffic_window,
    context=context,
    device=device,
    kernels=kernels,
    kept_memory=kept_memory,
    peers=peers,
    prepare=prepare,
    ring=ring,
    side_streams=side_streams,
    calibration_file=calibration_file,
    host_key=host_key,
    first_use=first_use,
    persist=persist,
    rows=rows_engine,
    rows_memo=rows_memo,
)
# What a pinned pool reads of the host (NUMA facts) and does to its memory.
host = types.SimpleNamespace(numa=numa, pages=host_pages)
plans = types.SimpleNamespace(
    plan_rows=plan_rows,
    expand=expand,
    block_geometry=block_geometry,
    plan_blocks=plan_blocks,
    refuse_rows_crossing=refuse_rows_crossing,
)


def _users() -> list[types.ModuleType]:
    """kvcopy's modules outside the driver layer and this one, as loaded now."""
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None
        and (name == "kvcopy" or name.startswith("kvcopy."))
        and not name.startswith("kvcopy._cuda")
        and name != __name__
    ]


@contextlib.contextmanager
def _standing_in(replacements: list[tuple[object, object]]) -> Iterator[None]:
    """Every module-level name in kvcopy bound to one of the real objects is bound to
    its stand-in for the block (found by identity, so names imported either way are
    covered); then put back."""
    wanted = {id(real): stand_in for real, stand_in in replacements}
    undo: list[tuple[types.ModuleType, str, object]] = []
    try:
        for module in _users():
            for name, value in list(vars(module).items()):
                if id(value) in wanted and not name.startswith("__"):
                    undo.append((module, name, value))
                    setattr(module, name, wanted[id(value)])
        yield
    finally:
        for module, name, value in reversed(undo):
            setattr(module, name, value)


@contextlib.contextmanager
def capabilities(**caps: bool | int) -> Iterator[None]:
    """Fake device capabilities for the duration of a with-block."""
    device.override_capabilities(**caps)
    try:
        yield
    finally:
        device.override_capabilities()


@contextlib.contextmanager
def settings(**values: Any) -> Iterator[None]:
    """kvcopy.config's ``values`` for the block, the previous ones back after it."""
    before = {name: getattr(config, name) for name in values}
    try:
        for name, value in values.items():
            setattr(config, name, value)
        yield
    finally:
        for name, value in before.items():
            setattr(config, name, value)


@contextlib.contextmanager
def fake_cuda(fake: object, layers: tuple[str, ...] = CUDA_LAYERS) -> Iterator[object]:
    """The driver layer's ``layers`` replaced by ``fake`` wherever kvcopy uses them, and
    no policy answer, copy_rows call, classified memory or guard sample remembered from
    before (they were made with the real device)."""
    unknown = set(layers) - set(_LAYERS)
    if unknown:
        raise ValueError(f"fake_cuda: no layer {sorted(unknown)}; layers: {sorted(_LAYERS)}")
    with _standing_in([(_LAYERS[layer], fake) for layer in layers] + _nothing_remembered()):
        yield fake


def _nothing_remembered() -> list[tuple[object, object]]:
    """What kvcopy remembers of the device it ran on (policy answers, copy_rows calls,
    classified memory, the guard's samples), each stood in for by an empty one."""
    remembered = (
        decide._targets,
        rows_memo._memo,
        kept_memory._kept,
        guard._watches,
        guard._pending,
        guard._last_sample,
        guard._heard_under,
    )
    return [(kept, {}) for kept in remembered]


class _Ring:
    """A descriptor ring whose reservations are ``slots`` in turn (a larger request
    fails)."""

    def __init__(self, slots: Sequence[ring.Slot]) -> None:
        self.slots, self.reserved = list(slots), 0

    def reserve(self, nbytes: int) -> "_Ring":
        self.slot = self.slots[self.reserved % len(self.slots)]
        if nbytes > self.slot.capacity:
            raise AssertionError(f"fake ring: {nbytes} bytes asked of a {self.slot.capacity}-byte slot")
        self.reserved += 1
        return self

    def __enter__(self) -> ring.Slot:
        return self.slot

    def __exit__(self, *exc: object) -> None:
        pass


@contextlib.contextmanager
def fake_runtime(
    *,
    caps: policy.DeviceCaps | None = None,
    thresholds: policy.Thresholds | None = None,
    copy_kernel: object = None,
    slot: ring.Slot | Sequence[ring.Slot] | None = None,
    descriptor_ring: object = None,
    staging: object = None,
    side_stream: Callable[..., int] | None = None,
    scope: type | None = None,
) -> Iterator[None]:
    """What kvcopy keeps per context, for the block: device 0 with ``caps`` (an H200's
    by default) and ``thresholds`` (the defaults), no policy answer, copy_rows call,
    classified memory or guard sample remembered; where given, ``copy_kernel`` as the
    kernel loaded in every context,
    every descriptor-ring reservation ``slot`` (a sequence of slots: each in turn; or
    ``descriptor_ring`` as every context's ring: its reserve(nbytes) a context manager
    of a ring.Slot), ``staging`` as every context's staging buffers,
    ``side_stream(handle, index=0)`` for kvcopy's side streams, and ``scope`` for
    the context a call enters (kvcopy._runtime.context.ContextScope's interface)."""
    info = device.DeviceInfo(0, "fake", (9, 0), 13000, caps or policy.DeviceCaps())
    replacements = _nothing_remembered()
    if copy_kernel is not None:
        replacements.append((kernels.kernel_for_current_context, lambda *args: copy_kernel))
    if slot is not None:
        descriptor_ring = _Ring([slot] if isinstance(slot, ring.Slot) else slot)
    if descriptor_ring is not None:
        replacements.append((ring.ring_for_current_context, lambda: descriptor_ring))
    if staging is not None:
        replacements.append((staged._buffers, types.SimpleNamespace(current=lambda: staging)))
    if side_stream is not None:
        replacements.append((side_streams.for_caller, side_stream))
    if scope is not None:
        replacements.append((context.ContextScope, scope))
    saved_info, saved_thresholds = device._infos.get(0), device._thresholds.get(0)
    device._infos[0], device._thresholds[0] = info, thresholds or policy.Thresholds()
    try:
        with _standing_in(replacements):
            yield
    finally:
        _put_back(device._infos, saved_info)
        _put_back(device._thresholds, saved_thresholds)


def _put_back(table: dict[int, Any], value: Any) -> None:
    """Device 0's entry of ``table`` as it was (None: there was none)."""
    if value is None:
        table.pop(0, None)
    else:
        table[0] = value


@contextlib.contextmanager
def fake_compiler(
    compile_cubin: Callable[[int], bytes], version: tuple[int, int] = (13, 0)
) -> Iterator[None]:
    """NVRTC replaced for the block: kernels are compiled by ``compile_cubin(arch)`` and
    the kernel cache keys them under NVRTC ``version``."""
    with _standing_in([(kernels.compile_cubin, compile_cubin), (kernels.nvrtc_version, lambda: version)]):
        yield


@contextlib.contextmanager
def fake_clock(clock: Callable[[], float]) -> Iterator[Callable[[], float]]:
    """The clock of kvcopy._engine.traffic_window (seconds) for the block, and no batch
    noted before it."""
    before = traffic_window._clock
    traffic_window.forget()
    traffic_window._clock = clock
    try:
        yield clock
    finally:
        traffic_window._clock = before
        traffic_window.forget()


def block_copy_again(memcpy_loop: Callable[..., None]) -> Callable[..., Callable[[Any], bool]]:
    """dma.BlockCopyAgain's constructor for a fake dma layer: what it builds checks a
    call's ids and works out the block's addresses with the compiled class itself
    (BlockCopyAgain.addresses: no driver reached) and issues the copy through
    ``memcpy_loop(dst, src, sizes, stream)``."""

    def build(*args: Any) -> Callable[[Any], bool]:
        # (table, block_bytes, src_limit, dst_limit, stream; the rest say how the driver
        # is asked, which the fake's memcpy_loop stands in for)
        table, block_bytes, _, _, stream = args[:5]
        real = dma.BlockCopyAgain(np.ascontiguousarray(table, dtype=np.uint64), *args[1:5])

        def again(mapping: Any) -> bool:
            found = real.addresses(mapping)
            if found is None:
                return False
            src, dst = (np.array([address], np.uint64) for address in found)
            memcpy_loop(dst, src, np.array([block_bytes], np.uint64), stream)
            return True

        return again

    return build


def _copy_rows_on_host(
    src: Layout,
    dst: Layout,
    src_indices: Any = None,
    dst_indices: Any = None,
    *,
    rows: int | None = None,
    stream: Any = None,
    method: str = "auto",
) -> str:
    """copy_rows' plan, every check made, run with memmove between host memory."""
    return _run_plan_on_host(plan_rows(src, dst, src_indices, dst_indices, rows), stream)


def _run_plan_on_host(plan: RowsPlan, stream: Any) -> str:
    """A plan run with memmove between host memory, every span checked before any write."""
    if plan.device_indices:
        raise ValueError("rows_on_host: indices on the GPU cannot be read on the host")
    sources, destinations, sizes = (np.ascontiguousarray(part) for part in expand(plan))
    _memmove_on_host(sources, destinations, sizes)
    return "host"


def _fragments_on_host(table: np.ndarray, stream: Any) -> bool:
    """vLLM's runs of one fragment each, checked as copy_batch checks them (False where
    it refuses them: the copy_rows reading names what is wrong), then moved with memmove
    between host memory."""
    sources, destinations, sizes = (np.ascontiguousarray(part) for part in table[:3])
    try:
        refuse_unless_apart(sources, destinations, sizes)
    except ValueError:
        return False
    _memmove_on_host(sources, destinations, sizes)
    return True


def _memmove_on_host(sources: np.ndarray, destinations: np.ndarray, sizes: np.ndarray) -> None:
    """Each copy with memmove, every span checked to be host memory before any write."""
    denied = [
        i
        for i in (
            dma.first_host_span_denied(sources, sizes),
            dma.first_host_span_denied(destinations, sizes, write=True),
        )
        if i >= 0
    ]
    if denied:
        bad = min(denied)
        raise ValueError(
            f"rows_on_host: {int(sizes[bad])} bytes from {int(sources[bad]):#x} to "
            f"{int(destinations[bad]):#x} are not host memory this process reads "
            "and writes"
        )
    for source, destination, size in zip(sources.tolist(), destinations.tolist(), sizes.tolist()):
        ctypes.memmove(destination, source, size)


def _host_reach(address: int, name: str) -> int:
    """The bytes from ``address`` to the end of the run of adjacent host mappings
    holding it (what the driver's range answers for memory it allocated): tables of
    layer addresses on the host, sized without a driver. Adjacent mappings count as
    one: the kernel may list one allocation as several (split, or caught mid-change
    by another thread), and the listing is read in one call for the same reason."""
    fd = os.open("/proc/self/maps", os.O_RDONLY)
    try:
        listing = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    finally:
        os.close(fd)
    end = None
    for line in listing.splitlines():
        start, stop = (int(part, 16) for part in line.split(None, 1)[0].split(b"-"))
        if end is not None and start != end:
            break
        if end is not None or start <= address < stop:
            end = stop
    if end is None:
        raise ValueError(f"{name}: address {address:#x} is not memory this process maps")
    return end - address


def _no_wait(handle: int) -> None:
    """A stream sync where the copies ran on the CPU: nothing to wait for."""


def _host_event(timing: bool = False) -> int:
    """An event where the copies run on the CPU: a number, never 0."""
    return 1


def _host_event_record(event: int, stream: int = 0) -> None:
    """Recording (or destroying) an event where the copies ran on the CPU: nothing."""


def _host_event_ended(event: int) -> bool:
    """Where the copies ran on the CPU, every event has completed."""
    return True


@contextlib.contextmanager
def rows_on_host() -> Iterator[None]:
    """copy_rows, wherever kvcopy calls it, run on the CPU between host memory (see the
    module's docstring); raises ValueError for memory the process cannot read or write
    on the host, and for indices on the GPU. Tables of layer addresses reach to the end
    of the host mapping that holds each address; the waits of kvcopy.nixl's packed
    sends for their stream wait for nothing, and their events have always ended."""
    with _standing_in(
        [
            (copy_rows, _copy_rows_on_host),
            (copy_planned_rows, _run_plan_on_host),
            (compat_vllm._torch_stream, lambda caller: None),
            (compat_vllm._copy_fragments, _fragments_on_host),
            (pointer_tables._reach_of, _host_reach),
            (driver.stream_synchronize, _no_wait),
            (driver.event_create, _host_event),
            (driver.event_record, _host_event_record),
            (driver.event_query, _host_event_ended),
            (driver.event_destroy, _host_event_record),
        ]
    ):
        yield


__all__ = [
    "CUDA_LAYERS",
    "block_copy_again",
    "capabilities",
    "cuda",
    "describe_copies_answered",
    "describe_copies_in",
    "engine",
    "fake_clock",
    "fake_compiler",
    "fake_cuda",
    "fake_runtime",
    "fast_describe_available",
    "rows_on_host",
    "settings",
]
