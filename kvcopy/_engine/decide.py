"""Decides how a batch runs: the memory it touches (classified by the describe pass
or per tensor), its direction, and the policy's answer for it on this device,
remembered per question; the calling thread's last decision is kept for
kvcopy.last_decision()."""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from kvcopy import policy
from kvcopy._engine import guard, replay, traffic_window
from kvcopy._runtime import device, peers
from kvcopy._cuda import classify, describe, driver, launch
from kvcopy.config import config
from kvcopy.interop.streams import stream_kind
from kvcopy.kept import make_room
from kvcopy.policy import CopyRequest, Decision, choose_method

log = logging.getLogger("kvcopy")
_HOST = classify.KIND_HOST_MAPPED | classify.KIND_HOST_UNMAPPED
_PEER = classify.KIND_PEER | classify.KIND_PEER_UNMAPPED
_DEVICE = classify.KIND_DEVICE | classify.KIND_MANAGED | _PEER
_DMA_ONLY = (
    classify.KIND_HOST_UNMAPPED | classify.KIND_MANAGED | classify.KIND_STRADDLE | classify.KIND_PEER_UNMAPPED
)
_last = threading.local()


def last_decision() -> Decision | None:
    """The method the calling thread's last copy used, and why."""
    return getattr(_last, "decision", None)


def note_decision(decision: Decision) -> None:
    """Record ``decision`` as the calling thread's last (for a path decided outside
    decide(), such as copy_both_ways' joint one)."""
    _last.decision = decision


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
    if src == dst == "d" and (src_kinds | dst_kinds) & _PEER:
        return "p2p"
    return f"{src}2{dst}"


class MemoryClasses(NamedTuple):
    """What classify_pointers found on each side of a batch."""

    src_kinds: int
    src_device: int
    dst_kinds: int
    dst_device: int

    @classmethod
    def of(cls, batch: "describe.DescribedBatch") -> "MemoryClasses":
        """What the describe pass found of ``batch``'s memory."""
        return cls(batch.src_kinds, batch.src_device, batch.dst_kinds, batch.dst_device)

    @property
    def owner(self) -> int:
        return memory_owner(self.src_device, self.dst_device)

    @property
    def kinds(self) -> int:
        return self.src_kinds | self.dst_kinds


def reach_peers(found: MemoryClasses, method: str) -> bool:
    """Enable peer access for a batch with another GPU's memory that the kernel could
    reach once it is enabled (config.enable_peer_access). True: memory must be
    classified again."""
    if not found.kinds & classify.KIND_PEER_UNMAPPED or method not in ("auto", "kernel"):
        return False
    here = driver.context_device()
    return peers.enable_for(here, peers.peers_of((found.src_device, found.dst_device), here))


def classify_sides(
    src: Any, src_extent: Any, dst: Any, dst_extent: Any, src_view: Any, dst_view: Any
) -> MemoryClasses:
    """Classify each side's bases (uint64 arrays, each reaching ``extent`` bytes), writing
    each base as the device sees it into the side's view."""
    return MemoryClasses(
        *classify.classify_pointers(src, src_extent, src_view),
        *classify.classify_pointers(dst, dst_extent, dst_view),
    )


def settled_classes(scope: Any, method: str, classify_again: Callable[[], MemoryClasses]) -> MemoryClasses:
    """A call's memory as ``classify_again`` finds it, classified once more where the
    call's scope switched to the device that owns it (host memory may be mapped
    elsewhere there) and once more where peer access was enabled for it."""
    found = classify_again()
    if scope.follow_memory(found.owner):
        found = classify_again()
    if reach_peers(found, method):
        found = classify_again()
    return found


def unreachable(found: MemoryClasses, here: int) -> str:
    """What, in a batch, the device ``here`` cannot dereference (for error messages)."""
    kinds = found.kinds
    if kinds & classify.KIND_PEER_UNMAPPED:
        return peers.why_unreachable(here, peers.peers_of((found.src_device, found.dst_device), here))
    if kinds & classify.KIND_MANAGED:
        return "managed memory"
    if kinds & classify.KIND_HOST_UNMAPPED:
        return "pageable or unmapped host memory"
    if kinds & classify.KIND_STRADDLE:
        return "a copy that runs past the end of its allocation"
    return ""


@dataclass(frozen=True)
class Target:
    """Where and how a batch runs, once its memory is classified and the policy asked
    (shared by every call that asks the same question: never changed)."""

    handle: int
    info: "device.DeviceInfo"
    request: CopyRequest
    decision: Decision
    host_ctas: int = policy.HOST_CTAS["h2d"]  # the device's, for this direction
    both_ways_ctas: int = policy.BOTH_WAYS_CTAS["h2d"]  # the same, beside the other way
    # the same decision whichever way the other direction's traffic was answered
    # (kvcopy._engine.replay replays only such batches' launches); None: not asked,
    # as for batches too large ever to be recorded
    traffic_free: bool | None = True
    # the GB/s calibration expects of this batch where the guard times it
    # (kvcopy._engine.guard.timed), else None
    sample: float | None = None

    def launch_shape(self, max_ctas: int | None) -> tuple[int, int]:
        """CTAs and threads per CTA of a scatter launch by the decided copier."""
        if self.decision.variant == "bulk":
            return (max_ctas or config.bulk_ctas or policy.BULK_STORE_CTAS, launch.BULK_THREADS)
        return self.ctas(max_ctas), config.threads_per_cta

    def ctas(self, max_ctas: int | None, both_ways: bool = False) -> int:
        if max_ctas:
            return max_ctas
        if self.request.direction == "d2d":
            return config.device_ctas or policy.device_ctas(self.info.caps)
        if self.request.direction == "p2p":
            return config.peer_ctas or policy.peer_ctas(self.info.caps)
        if both_ways:
            return self.both_ways_ctas
        return config.host_ctas or self.host_ctas

    def rows_ctas(self) -> int:
        """CTAs of a layout-kernel launch (copy_rows)."""
        if self.request.direction in ("d2d", "p2p"):
            return self.ctas(None)
        return policy.rows_host_ctas(self.request.direction, config.host_ctas)


_targets: dict[tuple, Target] = {}
_TARGETS_KEPT = 256


def decide(
    handle: int,
    method: str,
    count: int,
    total_bytes: int,
    found: MemoryClasses,
    capturing: bool | None = None,
    allow_batch: bool = True,
    note_traffic: bool = False,
) -> Target:
    """Ask the policy for a method, given the classified memory of a batch
    (``capturing``: the stream's capture state, asked of the driver when None).
    With ``note_traffic`` (copy_batch's one-sided calls) and
    config.traffic_window_ms set (the default), the batch's direction, stream and
    bytes are noted in kvcopy._engine.traffic_window, and whether the other direction copied a
    comparable batch lately on another stream is part of the question (outside
    capture).

    The policy is a pure function of what is in the key below, and engines
    repeat the same batch shapes step after step, so its answers are
    remembered (per device.generation: a calibration or a capability change
    starts afresh)."""
    ordinal = driver.context_device()
    if capturing is None:
        capturing = driver.stream_capture_status(handle) != 0
    recent, direction = False, None
    if note_traffic and config.traffic_window_ms and not capturing:
        direction = _direction(found.src_kinds, found.dst_kinds)
        # (only 'auto' asks: an explicit method's answer does not depend on it)
        recent = method == "auto" and traffic_window.other_way_recent(
            ordinal, direction, config.traffic_window_ms / 1000, handle, total_bytes
        )
        traffic_window.note(ordinal, direction, handle, total_bytes)
    key = (
        ordinal,
        device.generation,
        handle,
        method,
        found,
        count,
        total_bytes,
        capturing,
        allow_batch,
        config.stores_by_dma,
        config.bulk_stores,
        recent,
    )
    target = _targets.get(key)
    if target is None:
        target = ask_policy(
            ordinal, handle, method, count, total_bytes, found, capturing, allow_batch, recent, direction
        )
        # (traffic was part of the question; whether it mattered is asked only where a
        # replay could follow)
        if method == "auto" and direction is not None:
            if count > replay.MAX_COPIES or not policy.may_replay(method, None, allow_batch, capturing):
                target = dataclasses.replace(target, traffic_free=None)
            elif policy.depends_on_other_way(
                target.request, target.decision, target.info.caps, device.thresholds(ordinal), method
            ):
                target = dataclasses.replace(target, traffic_free=False)
        make_room(_targets, _TARGETS_KEPT)
        _targets[key] = target
    target = guard.heard(target, method)  # (after the cache: it hears samples as they come)
    _last.decision = target.decision
    log.debug(
        "kvcopy: %d copies, %d bytes, %s -> %s (%s)",
        count,
        total_bytes,
        target.request.direction,
        target.decision.method,
        target.decision.reason,
    )
    return target


def ask_policy(
    ordinal: int,
    handle: int,
    method: str,
    count: int,
    total_bytes: int,
    found: MemoryClasses,
    capturing: bool,
    allow_batch: bool,
    other_way_recent: bool = False,
    direction: str | None = None,
) -> Target:
    """The policy's answer for a classified batch (``direction``: where the caller
    already derived it from ``found``)."""
    info = device.device_info(ordinal)
    # classify's kinds are relative to this context's device: another device's memory
    # is KIND_PEER only where this device may access it
    accessible = not found.kinds & _DMA_ONLY
    if direction is None:
        direction = _direction(found.src_kinds, found.dst_kinds)
    request = CopyRequest(
        direction=direction,
        count=count,
        total_bytes=total_bytes,
        device_accessible=accessible,
        stream_kind=stream_kind(handle),
        capturing=capturing,
        batch_allowed=allow_batch,
        devices=(found.src_device, found.dst_device),
        unreachable="" if accessible else unreachable(found, ordinal),
        stores_by_dma=config.stores_by_dma,
        bulk_stores=config.bulk_stores,
        other_way_recent=other_way_recent,
    )
    thresholds = device.thresholds(ordinal)
    decision = choose_method(request, info.caps, thresholds, method)
    return Target(
        handle,
        info,
        request,
        decision,
        thresholds.ctas_for(request.direction),
        thresholds.ctas_for(request.direction, both_ways=True),
    )
