"""The replay: a small batch like one launched before goes straight to that launch.

A decode step's copy_batch calls repeat themselves: tens of blocks, the same stream
and pools, the same policy answer every time. On the full path most of a small
batch's CPU time is Python (context, classification, the remembered decision, the
launch's arguments), not the launch, all of it before the copy can start. So after
the full path launches a batch of at most MAX_COPIES copies by value, record() keeps
what it launched (kvcopy._cuda.replay_records); replay() describes the next batch in
C (every copy checked and classified, as always) and, where context, stream, method,
memory kinds, planned copies and bytes match a record, launches it there; where none
matches, the description goes on to the full path, which issues the batch from it
(the batch is described once either way). What the policy reads beyond that key is
part of the record's epoch (settings assigned, device facts changed: epoch()); the
traffic of the other direction is read only for 'auto' with config.traffic_window_ms
set, and a batch whose decision would differ with it (policy.depends_on_other_way)
is never recorded. Replays note their own traffic, as the full path does.
last_decision() reports the recorded decision.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from kvcopy._engine import traffic_window
from kvcopy._runtime import device, kernels
from kvcopy._cuda import replay_records
from kvcopy._cuda.describe import DescribedBatch
from kvcopy.config import changes, config
from kvcopy.policy import Decision

# the methods whose batches are recorded, as replay_records' keys take them
METHODS = {"auto": 1, "kernel": 2}
MAX_COPIES: int = replay_records.MAX_COPIES
forget = replay_records.forget  # drop every record
replays = replay_records.replays  # batches launched from a record so far


class Decided(Protocol):
    """What record() reads of engine.Target."""

    @property
    def handle(self) -> int: ...
    @property
    def info(self) -> Any: ...
    @property
    def request(self) -> Any: ...
    @property
    def decision(self) -> Decision: ...
    @property
    def traffic_free(self) -> bool | None: ...

    def launch_shape(self, max_ctas: int | None) -> tuple[int, int]: ...


def epoch() -> int:
    """Changes with every setting assigned and every device fact the policy reads."""
    return device.generation << 32 | changes()


def replay(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, handle: int, method: str, descs_out: int
) -> Decision | DescribedBatch | None:
    """Launch a batch that repeats a recorded one and return its recorded decision.
    A DescribedBatch: the batch was described into ``descs_out`` (host memory for
    MAX_COPIES descriptors) and matched no record; the full path issues it from
    there. None: nothing described, nothing enqueued. The caller has asked
    policy.may_replay."""
    code = METHODS.get(method)
    if code is None:
        return None
    # (a batch of more than MAX_COPIES copies comes back at once, undescribed)
    return replay_records.replay(src, dst, sizes, handle, code, epoch(), descs_out)


def record_copies(target: Decided, batch: DescribedBatch, method: str) -> bool:
    """Record a batch the full path just issued as one cuMemcpyAsync a copy (the policy
    chose 'loop' for memory the device reaches: the caller's copies go as given), so
    that a batch like it goes straight to its copies. The caller has asked
    policy.may_replay and kvcopy._engine.repeats.decided_for_repeats (the decision
    holds whatever the other direction's traffic, and the guard is not timing).
    Returns whether it recorded."""
    code = METHODS.get(method)
    if code is None or batch.count > MAX_COPIES or batch.compact_size:
        return False
    ctx = replay_records.current_context_key()
    if not ctx:
        return False
    replay_records.record_copies(ctx, target.handle, epoch(), code, batch, target.decision, _note(target))
    return True


def _note(target: Decided) -> tuple | None:
    """What a replay notes in the traffic window after issuing: (callable, device,
    direction), or None."""
    if not config.traffic_window_ms or target.request.direction not in ("h2d", "d2h"):
        return None
    return traffic_window.note, target.info.ordinal, target.request.direction


def record(target: Decided, batch: DescribedBatch, method: str, launched: tuple[int, int, int, int]) -> bool:
    """Record a batch the full path just launched by value (``launched``: function,
    descriptors per launch, CTAs, threads) under ``target`` (decide.Target). A target
    whose decision depends on the other direction's traffic (not ``traffic_free``)
    is not recorded. The caller has asked policy.may_replay (capture included).
    Returns whether it recorded."""
    code = METHODS.get(method)
    if code is None or batch.count > MAX_COPIES or not target.traffic_free:
        return False
    # only the copy kernel kvcopy loaded in this context is ever replayed
    ctx = replay_records.current_context_key()
    if not ctx or launched[0] not in kernels.loaded_by_value(ctx):
        return False
    replay_records.record(ctx, target.handle, epoch(), code, batch, launched, target.decision, _note(target))
    return True
