"""Which copy method to use, and every default behind it: pure functions of device facts
and the request, unit-tested on the CPU with faked capabilities. The copy kernel keeps
about 0.9 of the PCIe link at every block size; cuMemcpyBatchAsync is as fast only from
about 1 MiB blocks, on copy engines instead of SMs. Each default's measurement is in
docs/design.md."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Mapping

from kvcopy.errors import CaptureError, KVCopyError
from kvcopy.policy.defaults import (
    BOTH_WAYS_BATCH_MIN_BYTES,
    BOTH_WAYS_CTAS,
    BOTH_WAYS_DMA_CHUNK,
    BULK_MAX_BYTES,
    BULK_MIN_BYTES,
    BULK_STORE_CTAS,
    DEVICE_CTAS_PER_SM,
    HOST_CTAS,
    ID_CHUNK_GROWTH,
    ID_FIRST_CHUNK,
    INDICES_IN_PLACE_MAX_BYTES,
    MAX_SIDE_STREAMS,
    OTHER_WAY_MIN_SHARE,
    PEER_CTAS,
    RING_MIN_CAPACITY_BYTES,
    RING_SLOTS,
    ROWS_HOST_CTAS,
    ROWS_STAGING_MAX_PLANES,
    ROWS_STAGING_MIN_BYTES,
    STAGING_CTAS,
    STAGING_MIN_BYTES,
    STAGING_MIN_SPAN_BYTES,
)

from kvcopy.policy.layout_kernel import id_chunks, rows_host_ctas

Method = Literal["batch", "loop", "kernel", "staged"]  # what ran
Variant = Literal["", "registers", "bulk"]  # how the kernel copies ('' for DMA)
RequestedMethod = Literal["auto", "batch", "loop", "kernel"]  # what a caller may ask for
METHODS = ("auto", "batch", "loop", "kernel")
MiB = 1 << 20


@dataclass(frozen=True)
class DeviceCaps:
    """What the device and driver can do (from kvcopy._cuda.driver.device_attributes)."""

    sm_count: int = 132
    unified_addressing: bool = True
    can_map_host_memory: bool = True
    batch_available: bool = True  # the driver exports cuMemcpyBatchAsync (>= 12.8)
    kernel_available: bool = True  # the copy kernel compiled and loaded
    bulk_copy: bool = False  # sm_90+: the SM's bulk copy unit (cp.async.bulk)


@dataclass(frozen=True)
class CopyRequest:
    """One batch, as planned and classified."""

    direction: str  # 'h2d', 'd2h', 'd2d', 'p2p' (two GPUs), 'h2h', 'mixed'
    count: int
    total_bytes: int
    device_accessible: bool  # the launching device can dereference every pointer
    stream_kind: str  # 'legacy', 'per_thread', 'created'
    capturing: bool = False
    batch_allowed: bool = True  # False: the caller forbids cuMemcpyBatchAsync
    devices: tuple[int, int] = (-1, -1)  # source and destination device (-1: host memory)
    unreachable: str = ""  # what the device cannot access, when not accessible
    stores_by_dma: bool = False  # copy engines preferred GPU-to-host (config)
    bulk_stores: bool = True  # GPU-to-host kernel copies may go bulk (config)
    other_way_recent: bool = False  # the other direction copied lately (traffic_window)

    @property
    def mean_bytes(self) -> float:
        return self.total_bytes / self.count if self.count else 0.0


@dataclass(frozen=True)
class Thresholds:
    """A device's calibrated facts (kvcopy.calibrate): the mean block size from which
    batched DMA is used instead of the kernel, per direction; and the copy kernel's
    CTAs for copies that touch host memory, alone and beside the other direction."""

    batch_min_bytes: dict = field(default_factory=lambda: {"h2d": 1 * MiB, "d2h": 1 * MiB, "p2p": 1 * MiB})
    host_ctas: dict = field(default_factory=lambda: dict(HOST_CTAS))
    both_ways_ctas: dict = field(default_factory=lambda: dict(BOTH_WAYS_CTAS))
    both_ways_batch_min_bytes: float = BOTH_WAYS_BATCH_MIN_BYTES
    staging_min_bytes: int = STAGING_MIN_BYTES
    staging_min_span_bytes: int = STAGING_MIN_SPAN_BYTES
    # GB/s calibration measured by direction, block bytes and method ('kernel', 'batch'):
    # what the guard holds sampled batches to (kvcopy.policy.guard)
    rates: dict = field(default_factory=dict)

    def for_direction(self, direction: str) -> float:
        return self.batch_min_bytes.get(direction, float("inf"))

    def for_request(self, req: CopyRequest) -> float:
        """Copies between two GPUs use their pair's threshold ('p2p 0>1'), found by
        calibrate_peers, else the device's 'p2p' one; others their direction's."""
        if req.direction == "p2p":
            pair = self.batch_min_bytes.get(f"p2p {req.devices[0]}>{req.devices[1]}")
            return pair if pair is not None else self.for_direction("p2p")
        return self.for_direction(req.direction)

    def ctas_for(self, direction: str, both_ways: bool = False) -> int:
        """Copy-kernel CTAs for a copy touching host memory ('h2d', 'd2h', or 'mixed',
        which gets the larger of the two)."""
        table = self.both_ways_ctas if both_ways else self.host_ctas
        if direction in table:
            return int(table[direction])
        return int(max(table.values(), default=max(HOST_CTAS.values())))


def fewest_ctas(fractions: dict, floor: float = 0.90) -> int:
    """The fewest CTAs whose measured fraction of the contiguous copy reaches ``floor``
    (``fractions``: CTAs -> fraction, the worst over the block sizes measured);
    where none does, the count that came closest."""
    if not fractions:
        raise ValueError("fewest_ctas: no measurements")
    enough = [ctas for ctas, fraction in fractions.items() if fraction >= floor]
    if enough:
        return min(enough)
    return max(fractions, key=lambda ctas: (fractions[ctas], -ctas))


def dma_crossover(measured: Mapping[int, Mapping[str, float]]) -> float:
    """The smallest block size from which batched DMA keeps up with the copy kernel
    (within 2%) at every larger size measured (``measured``: block bytes -> GB/s by
    'kernel' and 'batch'); infinity where it does not at the largest. A host whose SMs
    read host memory slowly gets the copy engines from the first size where they win;
    one whose SMs read fast keeps the kernel up to large blocks. Where only the
    engines were measured (no kernel on the device), from the smallest size."""
    found = float("inf")
    for block in sorted(measured):
        gbps = measured[block]
        if "batch" in gbps and gbps["batch"] >= 0.98 * gbps.get("kernel", 0.0):
            found = min(found, float(block))
        else:
            found = float("inf")
    return found


@dataclass(frozen=True)
class Decision:
    """The method to run and why; for the kernel, which copier (``variant``)."""

    method: Method
    reason: str
    variant: Variant = ""


def device_ctas(caps: DeviceCaps) -> int:
    """CTAs for a copy inside one GPU: DEVICE_CTAS_PER_SM on every SM."""
    return DEVICE_CTAS_PER_SM * caps.sm_count


def peer_ctas(caps: DeviceCaps) -> int:
    """CTAs for a copy between GPUs: enough to keep NVLink busy, not the whole GPU."""
    return min(PEER_CTAS, caps.sm_count)


def descriptors_in_place(tiles: int, count: int, directions: tuple[str, ...]) -> bool:
    """Whether the copy kernel reads a table of descriptors where the CPU wrote it
    (mapped pinned memory) instead of from an upload that runs first: for one-tile
    copies only (one read each), never between GPUs (the table would be read over the
    link), and in one launch of two batches only over PCIe (h2d and d2h)."""
    if tiles != count or "p2p" in directions:
        return False
    return len(directions) == 1 or "d2d" not in directions


def indices_in_place(index_bytes: int, readers: int) -> bool:
    """Whether the layout kernel reads ``index_bytes`` of a call's host indices where the
    CPU wrote them (mapped pinned memory) instead of from an upload queued before its
    launch: where every index is read by ``readers`` of its units (a row's pieces in
    each plane), at most INDICES_IN_PLACE_MAX_BYTES in all (a few hundred rows over a
    few planes, one block pair over a model's layers); more are uploaded once and read
    from GPU memory. No readers named (0: indices read by another kernel than the
    layout kernel, as the staged path's): never in place."""
    return 0 < index_bytes and 0 < readers and index_bytes * readers <= INDICES_IN_PLACE_MAX_BYTES


def kernel_variant(req: CopyRequest, caps: DeviceCaps) -> Variant:
    """How the copy kernel moves a batch: GPU-to-host copies of mean block size in
    [BULK_MIN_BYTES, BULK_MAX_BYTES] through the bulk copy unit, where the device has
    one and the caller allows it (there its stores cost compute beside them a sixth of
    what stores from registers do, at the same speed alone); every other batch from
    registers."""
    if (
        req.direction == "d2h"
        and caps.bulk_copy
        and req.bulk_stores
        and BULK_MIN_BYTES <= req.mean_bytes <= BULK_MAX_BYTES
    ):
        return "bulk"
    return "registers"


def copies_per_launch(direction: str, count: int, total_bytes: int, launch_bytes: int) -> int:
    """How many of a described batch's ``count`` copies one kernel launch takes.

    Batches between host and GPU are cut into launches of about ``launch_bytes``
    (config.launch_bytes; 0: no limit), in order on one stream: a launch of milliseconds
    holds its SMs across the starts of the model's kernels beside it. Others: one launch."""
    if not launch_bytes or direction not in ("h2d", "d2h") or total_bytes <= launch_bytes or count <= 1:
        return count
    return max(launch_bytes // max(total_bytes // count, 1), 1)


def both_ways_launches(store_bytes: int, load_bytes: int, launch_bytes: int) -> int:
    """How many launches copy_both_ways' fused kernel takes for a store and a load of
    one-tile copies (each a slice of both, in step): enough that neither side moves more
    than ``launch_bytes`` in one (0: one launch). The sides run at once, so such a launch
    lasts about as long as a one-way launch of ``launch_bytes`` (see copies_per_launch)."""
    if not launch_bytes:
        return 1
    return max(-(-max(store_bytes, load_bytes) // launch_bytes), 1)


def _kernel(req: CopyRequest, caps: DeviceCaps, reason: str) -> Decision:
    variant = kernel_variant(req, caps)
    if variant == "bulk":
        reason += "; stores through the SM's bulk copy unit"
    return Decision("kernel", reason, variant)


def check_method(method: object) -> None:
    """Raise TypeError/ValueError unless ``method`` is one of METHODS."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, one of {', '.join(METHODS)}; got {type(method).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


def _explicit(req: CopyRequest, caps: DeviceCaps, requested: str) -> Decision:
    if requested == "loop":
        return Decision("loop", "requested")
    if requested == "batch":
        if not req.batch_allowed:
            raise ValueError("method='batch' contradicts allow_batch=False")
        if req.capturing:
            raise CaptureError(
                "method='batch' cannot be used on a capturing stream: cuMemcpyBatchAsync is not "
                "recorded into CUDA graphs and the copy would be lost; use 'auto', 'kernel' or 'loop'"
            )
        if not caps.batch_available:
            raise KVCopyError(
                "method='batch' needs cuMemcpyBatchAsync (CUDA driver >= 12.8), "
                "which this driver lacks; use 'auto' or 'loop'"
            )
        if req.stream_kind == "legacy":
            return Decision(
                "loop",
                "requested batch, but the driver rejects the legacy "
                "default stream: one cuMemcpyAsync per copy instead",
            )
        return Decision("batch", "requested")
    # requested == "kernel"
    if not caps.kernel_available:
        raise KVCopyError(
            "method='kernel': the copy kernel is not available on this device "
            "(NVRTC could not build it); use 'auto'"
        )
    if not req.device_accessible:
        raise ValueError(
            "method='kernel' needs every pointer to be memory the launching device can access: "
            "its own, a peer GPU's it may access, or pinned host memory mapped for it; this "
            f"batch has {req.unreachable or 'pageable or unmapped host memory'}, which must go "
            "by DMA (use 'auto', 'batch' or 'loop'; pin host buffers with kvcopy.register)"
        )
    if not caps.unified_addressing:
        raise KVCopyError("method='kernel' needs unified addressing, which this device lacks")
    return _kernel(req, caps, "requested")


def _batch_possible(req: CopyRequest, caps: DeviceCaps) -> bool:
    """Whether cuMemcpyBatchAsync may take the batch: the driver has it, the caller
    allows it, and the stream is neither the legacy default stream (the driver
    rejects it) nor capturing (the copies would be left out of the graph)."""
    return caps.batch_available and req.batch_allowed and req.stream_kind != "legacy" and not req.capturing


def _one_side_of_both_ways(req: CopyRequest, thresholds: Thresholds) -> bool:
    """A batch between host and GPU, the other direction busy lately, of blocks from
    which copy_both_ways sends both sides to the copy engines (choose_both_ways)."""
    return (
        req.other_way_recent
        and req.direction in ("h2d", "d2h")
        and req.mean_bytes >= thresholds.both_ways_batch_min_bytes
    )


def _why_no_batch(req: CopyRequest) -> str:
    """What rules batched DMA out, where _batch_possible is False."""
    return (
        "capturing stream"
        if req.capturing
        else "batched DMA not allowed by the caller"
        if not req.batch_allowed
        else "legacy default stream"
        if req.stream_kind == "legacy"
        else "no cuMemcpyBatchAsync in this driver"
    )


def choose_method(
    req: CopyRequest, caps: DeviceCaps, thresholds: Thresholds | None = None, requested: str = "auto"
) -> Decision:
    """Pick the fastest correct method for ``req``.

    Rules, in order: a single copy is one cuMemcpyAsync; the kernel needs unified
    addressing and pointers the device can dereference; batched DMA needs the entry
    point, a stream other than the legacy one, and no capture. Blocks of at least the
    calibrated size go by batched DMA (as fast, no SMs), so do host<->GPU blocks from
    ``thresholds.both_ways_batch_min_bytes`` while the other direction copies
    (``req.other_way_recent``) and GPU-to-host copies where ``req.stores_by_dma``;
    the rest go to the kernel. Where neither can, one cuMemcpyAsync per copy.

    Raises:
        ValueError: unknown method, or 'kernel' with memory it cannot read.
        CaptureError: 'batch' on a capturing stream.
        KVCopyError: the requested method is not available.
    """
    check_method(requested)
    if requested != "auto":
        return _explicit(req, caps, requested)
    thresholds = thresholds or Thresholds()
    if req.count <= 1:
        return Decision("loop", "a single copy: one cuMemcpyAsync")
    kernel_ok = (
        caps.kernel_available and caps.unified_addressing and req.device_accessible and req.direction != "h2h"
    )
    batch_ok = _batch_possible(req, caps)
    store_by_dma = req.stores_by_dma and req.direction == "d2h"
    if kernel_ok:
        if batch_ok and req.mean_bytes >= thresholds.for_request(req):
            return Decision(
                "batch",
                f"blocks of {req.mean_bytes / MiB:.2f} MiB: DMA engines "
                "reach the link's limit without using SMs",
            )
        if batch_ok and _one_side_of_both_ways(req, thresholds):
            return Decision(
                "batch",
                f"blocks of {req.mean_bytes / 1024:.0f} KiB with copies "
                "the other way lately (config.traffic_window_ms): copy "
                "engines keep both directions at the link's limit",
            )
        if batch_ok and store_by_dma:
            return Decision(
                "batch",
                "GPU-to-host by copy engines (config.stores_by_dma): "
                "no SM writes to host memory beside compute",
            )
        if store_by_dma:
            return _kernel(
                req,
                caps,
                f"copy kernel: {_why_no_batch(req)} rules out the copy engines config.stores_by_dma prefers",
            )
        return _kernel(req, caps, "copy kernel: link-rate for blocks of every size")
    if batch_ok:
        return Decision("batch", "memory the kernel cannot read: batched DMA")
    return Decision("loop", f"{_why_no_batch(req)}: one cuMemcpyAsync per copy")


def depends_on_other_way(
    req: CopyRequest,
    decision: Decision,
    caps: DeviceCaps,
    thresholds: Thresholds | None = None,
    requested: str = "auto",
) -> bool:
    """Whether ``decision`` (choose_method's for ``req``) would differ with the other
    direction's traffic answered the other way: a replay, which does not look, may not."""
    flipped = replace(req, other_way_recent=not req.other_way_recent)
    return choose_method(flipped, caps, thresholds, requested) != decision


def may_replay(requested: str, caller_ctas: int | None, batch_allowed: bool, capturing: bool = False) -> bool:
    """Whether a small batch may be launched from the record of an earlier one like it
    (kvcopy._engine.replay), or recorded for that: 'auto' or 'kernel' asked, outside
    capture (a graph keeps its own launches), no CTA limit of the caller's and
    cuMemcpyBatchAsync not ruled out by the caller (neither is part of a record's
    key). Both the replay and the recording ask this; nothing else decides it."""
    return requested in ("auto", "kernel") and caller_ctas is None and batch_allowed and not capturing


def choose_both_ways(
    first: CopyRequest,
    second: CopyRequest,
    caps: DeviceCaps,
    thresholds: Thresholds | None = None,
    requested: str = "auto",
) -> Decision | None:
    """For two batches copied at once (copy_both_ways, 'auto' only): batched DMA for
    both when each side goes between host and GPU, its mean block reaches
    ``thresholds.both_ways_batch_min_bytes`` and both could take it. Copy engines move
    both directions at the link's limit from there, where the kernel pair shares the
    upstream link less well. None: each side as choose_method says."""
    if requested != "auto":
        return None
    thresholds = thresholds or Thresholds()
    for req in (first, second):
        if not (
            req.direction in ("h2d", "d2h")
            and _batch_possible(req, caps)
            and req.count > 1
            and req.mean_bytes >= thresholds.both_ways_batch_min_bytes
        ):
            return None
    smaller = min(first.mean_bytes, second.mean_bytes)
    return Decision(
        "batch",
        f"both ways at once, blocks of {smaller / 1024:.0f} KiB and more: "
        "copy engines in interleaved chunks keep both directions at the "
        "link's limit",
    )


@dataclass(frozen=True)
class HostSpans:
    """A batch's host side: ``count`` spans of host-adjacent copies, its largest copy."""

    count: int
    largest_copy: int


def staging_possible(
    req: CopyRequest, decision: Decision, chunk_bytes: int, thresholds: Thresholds, requested: str = "auto"
) -> bool:
    """What choose_staging asks of a batch before it looks at its host spans: 'auto',
    the kernel chosen, staging on, between host and GPU, outside capture, and at least
    ``thresholds.staging_min_bytes`` (the staging buffers are not made for less)."""
    return (
        requested == "auto"
        and decision.method == "kernel"
        and bool(chunk_bytes)
        and req.direction in ("h2d", "d2h")
        and not req.capturing
        and req.total_bytes >= thresholds.staging_min_bytes
    )


def staging_max_spans(req: CopyRequest, thresholds: Thresholds) -> int:
    """The most host spans a staged batch may lie in (total bytes / spans >=
    thresholds.staging_min_span_bytes); -1: no limit."""
    if thresholds.staging_min_span_bytes <= 0:
        return -1
    return req.total_bytes // thresholds.staging_min_span_bytes


def choose_staging(
    req: CopyRequest,
    decision: Decision,
    spans: HostSpans,
    chunk_bytes: int,
    thresholds: Thresholds | None = None,
    requested: str = "auto",
) -> Decision | None:
    """Whether a batch the policy gave the copy kernel goes through a GPU staging buffer
    instead (kvcopy._engine.staged): 'auto' only, between host and GPU, outside capture (the
    staging buffer is shared by every call; a graph would keep its addresses), with
    staging on (``chunk_bytes``: config.staging_bytes, 0 turns it off), every copy
    fitting one chunk, at least ``thresholds.staging_min_bytes`` in all and host spans
    of ``thresholds.staging_min_span_bytes`` on average. None: the kernel as decided."""
    thresholds = thresholds or Thresholds()
    if (
        not staging_possible(req, decision, chunk_bytes, thresholds, requested)
        or not spans.count
        or spans.largest_copy > chunk_bytes
    ):
        return None
    if spans.count > staging_max_spans(req, thresholds) >= 0:
        return None  # spans shorter than thresholds.staging_min_span_bytes on average
    mean_span = req.total_bytes / spans.count
    return Decision(
        "staged",
        f"host side in {spans.count} span(s) of {mean_span / MiB:.1f} MiB "
        "on average: copy engines move each whole through a GPU staging "
        "buffer, the copy kernel scatters inside the GPU",
    )


def choose_rows_staging(
    directions: tuple[str, str],
    side_bytes: tuple[int, int],
    why_not: tuple[str | None, str | None],
    chunk_bytes: int,
    capturing: bool,
    requested: str = "auto",
    min_bytes: int = ROWS_STAGING_MIN_BYTES,
) -> Decision | None:
    """Whether a store and a load at once in layout form (copy_rows_both_ways) go through
    GPU staging buffers, each side's host rows moved whole by the copy engines
    (kvcopy._engine.rows_staged): 'auto' only, staging on (``chunk_bytes``:
    config.staging_bytes), outside capture (the buffers are shared; a graph would keep
    their addresses), one side each way ('h2d' and 'd2h'), each side stageable
    (``why_not``: kvcopy._plans.rows_staging.why_not_staged's answers, None where it
    is) and of at least ``min_bytes``. None: each side by the layout kernel."""
    if (
        requested != "auto"
        or not chunk_bytes
        or capturing
        or sorted(directions) != ["d2h", "h2d"]
        or any(w is not None for w in why_not)
        or min(side_bytes) < min_bytes
    ):
        return None
    return Decision(
        "staged",
        f"a store and a load of {min(side_bytes) / MiB:.0f} MiB or more "
        "with host rows back to back: copy engines move the rows "
        "through GPU staging buffers, the layout kernel gathers and "
        "scatters inside the GPU",
    )
