"""What every repeat of a call shares: whether the policy's answer for the first call may
be kept for the next ones, and the traffic the first call noted, noted again at each
repeat. swap_blocks' repeats (BlockRepeat) are kept in the store of the tensors'
memory they were built for (MemoryStore.repeats); copy_rows' in
kvcopy._engine.rows_memo.

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
from typing import Any, Callable, Iterable

import numpy as np

from kvcopy import policy
from kvcopy._cuda import driver
from kvcopy._cuda.plan_arrays import block_ids_ok
from kvcopy._engine import replay, traffic_window
from kvcopy._engine.decide import Target, memory_owner, note_decision
from kvcopy._plans.blocks import BlockPlan, kept_geometry
from kvcopy._plans.races import race_in_plan
from kvcopy._runtime import device, kept_memory
from kvcopy.config import config
from kvcopy.interop.arrays import as_block_mapping, as_list
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


def issue_repeat(
    handle: int,
    owner: int,
    context: int,
    decision: policy.Decision,
    traffic: Traffic | None,
    issue: Callable[[], object],
) -> bool:
    """``issue()`` a repeated call in the context it runs in (driver.enter_for_repeat:
    the memory's device ``owner`` followed on the default streams), the caller's context
    back after, then ``decision`` noted as the thread's last and the first call's
    ``traffic`` noted again; False, having issued nothing, where that context's key is
    not ``context``, the stream captures a graph, or ``issue()`` returns False (its own
    checks failed, nothing issued): the call goes the whole way then."""
    entered = driver.enter_for_repeat(handle, owner, context)
    if entered < 0:
        return False
    try:
        issued = issue()
    finally:
        if entered:
            driver.pop_context()
    if issued is False:
        return False
    note_decision(decision)
    note_again((traffic,), uncaptured=True)
    return True


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
    current context (``views``: each side's bases as the device sees them).

    ``direct``, where set, issues a call from its ids alone, in the current context,
    checking them itself (kvcopy._cuda.dma.BlockCopyAgain: one block copy between
    tensors that cannot race): ``direct(mapping)`` is True once issued, False where the
    ids fail its checks (nothing issued). Then no plan is made (issue_ids)."""

    __slots__ = ("context", "owner", "target", "views", "launch", "traffic", "direct")

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
        self.direct: Callable[[np.ndarray], bool] | None = None

    def issue_ids(self, mapping: np.ndarray) -> str | None:
        """A call of ``mapping`` (ids not checked yet) issued by ``direct`` (see the
        class); None, having issued nothing, where the ids fail its checks, another
        context is current on the stream or it captures a graph."""
        direct, target = self.direct, self.target
        assert direct is not None
        issued = issue_repeat(
            target.handle, self.owner, self.context, target.decision, self.traffic, lambda: direct(mapping)
        )
        return target.decision.method if issued else None

    def __call__(self, plan: Any) -> str | None:
        target = self.target
        issued = issue_repeat(
            target.handle,
            self.owner,
            self.context,
            target.decision,
            self.traffic,
            lambda: self.launch(plan, target, self.views),
        )
        return target.decision.method if issued else None


_changing = threading.Lock()
_PER_STORE = 16  # (an engine's steps: stores and loads, a few batch sizes, streams)


def block_repeat(store: Any, key: tuple) -> BlockRepeat | None:
    """The swap_blocks call remembered over the tensors of ``store``
    (kvcopy._runtime.kept_memory.MemoryStore) under ``key``."""
    return store.repeats.get(key)


def remember_blocks(store: Any, key: tuple, repeat: BlockRepeat) -> None:
    """Keep ``repeat`` for the tensors of ``store`` under ``key`` (thread-safe)."""
    with _changing:
        make_room(store.repeats, _PER_STORE)
        store.repeats[key] = repeat


def repeat_blocks(
    src: Any, dst: Any, block_mapping: Any, handle: int, method: str, split_blocks: bool
) -> str | None:
    """A swap_blocks call on ``handle`` (effective) issued straight from its arguments as
    the last one like it was (BlockRepeat), or None, having enqueued nothing, where it
    is not a repeat: its tensors are not the unchanged torch tensors an earlier call
    kept the geometry of, no call of as many pairs on ``handle`` with ``method`` is
    remembered over them, or its ids fail planning's checks (the whole way then says
    which). Planning's checks run as they do on a first call; reading the tensors,
    classifying memory and the policy do not."""
    srcs, dsts = as_list(src), as_list(dst)
    kept = kept_geometry(srcs, dsts, split_blocks)
    if kept is None:
        return None
    geometry, memory = kept
    mapping = as_block_mapping(block_mapping)
    n = mapping.shape[0]
    if not n or geometry.producer_streams or memory is None:
        return None
    again = block_repeat(memory, (handle, method, n, *epoch_key()))
    if again is None:
        return None
    if again.direct is not None:
        return again.issue_ids(mapping)
    mapping = np.ascontiguousarray(mapping)  # (as planning reads it)
    if not block_ids_ok(mapping, *geometry.id_limits):
        return None
    plan = BlockPlan(geometry, mapping, (*srcs, *dsts), memory)
    if race_in_plan(plan):
        return None
    return again(plan)
