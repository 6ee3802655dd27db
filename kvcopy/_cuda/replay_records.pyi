"""Type stub of kvcopy._cuda.replay_records: the records small batches are replayed from."""

from typing import Any, Callable

import numpy as np

from kvcopy._cuda.describe import DescribedBatch

MAX_COPIES: int
KEPT: int

def current_context_key() -> int: ...
def record(
    ctx: int,
    stream: int,
    epoch: int,
    method: int,
    batch: DescribedBatch,
    launched: tuple[int, int, int, int],
    decision: Any,
    note: tuple[Callable[..., object], int, str] | None,
) -> None: ...
def record_copies(
    ctx: int,
    stream: int,
    epoch: int,
    method: int,
    batch: DescribedBatch,
    decision: Any,
    note: tuple[Callable[..., object], int, str] | None,
) -> None: ...
def forget() -> None: ...
def records() -> int: ...
def replays() -> int: ...
def replay(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: int, method: int, epoch: int, descs_out: int
) -> Any: ...
