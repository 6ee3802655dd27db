"""What every repeat of a call shares: whether the policy's answer for the first call may
be kept for the next ones, and the traffic the first call noted, noted again at each
repeat. swap_blocks' repeats (BlockRepeat) are kept here with the store of the
tensors' memory they were built for; copy_rows' in kvcopy._engine.rows_memo.

A repeat issues a call the way the first one was issued without asking the policy:
the policy's inputs are the memory's classes (kept while the tensors or layouts that
hold that memory are unchanged), the batch's size (part of every repeat's key), the
settings and device facts (their epoch, part of the key) and the other direction's
recent traffic, which a repeat does not look at: a decision that would differ with
it is not kept. Nor is one the guard times (it samples batches to hold the path to
what calibration measured).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterable

from kvcopy import policy
from kvcopy._cuda import driver
from kvcopy._engine import replay, traffic_window
from kvcopy._engine.decide import Target, memory_owner, note_decision
from kvcopy._runtime import device, kept_memory
from kvcopy._runtime.context import ContextScope
from kvcopy.config import config
from kvcopy.kept import make_room

Traffic = tuple[int, str, int, int]  # (device ordinal, direction, stream, bytes)


def decided_for_repeats(target: Target, method: str) -> bool:
    """Whether ``target``'s decision may issue the next calls of the same key without
    the policy: it holds whatever the other direction's traffic, and the guard is not
    timing batches."""
    if config.guard or target.sample is not None:
        return False
    if method != "auto" or target.request.direction not in ("h2d", "d2h"):
        return True
    if target.traffic_free is not None:
        return target.traffic_free
    thresholds = device.thresholds(target.info.ordinal)
    return not policy.depends_on_other_way(
        target.request, target.decision, target.info.caps, thresholds, method
    )


def noted_traffic(target: Target, total_bytes: int) -> Traffic | None:
    """What decide() notes in the traffic window for a batch of ``total_bytes``, to note
    again at each repeat (None for a copy inside a GPU or between two)."""
    direction = target.request.direction
    if direction not in ("h2d", "d2h"):
        return None
    return target.info.ordinal, direction, target.handle, total_bytes


def note_again(traffic: Iterable[Traffic | None], uncaptured: bool = False) -> None:
    """Note in the traffic window what a first call noted (noted_traffic; None:
    nothing), for a repeat of it, unless its stream captures a graph (whose work runs
    at replay, not now; ``uncaptured``: the caller has asked) or the window is off."""
    if not config.traffic_window_ms:
        return
    for noted in traffic:
        if noted is not None and (uncaptured or driver.stream_capture_status(noted[2]) == 0):
            traffic_window.note(*noted)


def epoch_key() -> tuple[int, int]:
    """What, besides a call's own arguments, every repeat's key holds: the epoch of the
    settings and device facts the policy reads, and kept_memory's generation (which
    unregistering memory bumps)."""
    return replay.epoch(), kept_memory.generation()


class BlockRepeat:
    """A swap_blocks call over torch tensors whose reads are kept, built: calling it
    with the next call's plan (its ids checked by planning; as many pairs, the same
    stream and method) issues it the way the first call was issued (the layout
    kernel's launches or the copy engines), without classifying memory or asking the
    policy. Returns the method that ran, or None, having enqueued nothing, where
    another context is current on the stream or the stream captures a graph: the call
    goes the whole way then. ``launch(plan, target, views)`` issues the plan in the
    current context (``views``: each side's bases as the device sees them)."""

    __slots__ = ("context", "owner", "target", "views", "launch", "traffic")

    def __init__(
        self,
        target: Target,
        views: tuple,
        launch: Callable[[Any, Target, tuple], None],
    ) -> None:
        self.context = driver.current_context_key()
        self.owner = memory_owner(*target.request.devices)
        self.target, self.views, self.launch = target, views, launch
        self.traffic = noted_traffic(target, target.request.total_bytes)

    def __call__(self, plan: Any) -> str | None:
        handle = self.target.handle
        with ContextScope(handle) as scope:
            scope.follow_memory(self.owner)
            if driver.current_context_key() != self.context or driver.stream_capture_status(handle) != 0:
                return None
            self.launch(plan, self.target, self.views)
        note_decision(self.target.decision)
        note_again((self.traffic,), uncaptured=True)
        return self.target.decision.method


# per store of a set of tensors' memory (kvcopy._runtime.kept_memory.MemoryStore, which
# lives while they are unchanged), the calls remembered over them by key
_blocks: "weakref.WeakKeyDictionary[Any, dict[tuple, BlockRepeat]]" = weakref.WeakKeyDictionary()
_changing = threading.Lock()
_PER_STORE = 16  # (an engine's steps: stores and loads, a few batch sizes, streams)


def block_repeat(store: Any, key: tuple) -> BlockRepeat | None:
    """The swap_blocks call remembered over the tensors of ``store`` under ``key``."""
    found = _blocks.get(store)
    return found.get(key) if found is not None else None


def remember_blocks(store: Any, key: tuple, repeat: BlockRepeat) -> None:
    """Keep ``repeat`` for the tensors of ``store`` under ``key`` (thread-safe)."""
    with _changing:
        kept = _blocks.setdefault(store, {})
        make_room(kept, _PER_STORE)
        kept[key] = repeat
