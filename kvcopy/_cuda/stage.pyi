"""Type stub of kvcopy._cuda.stage: the staged path's pass over a batch."""

import numpy as np

def plan_next_chunk(
    host: np.ndarray,
    gpu: np.ndarray,
    sizes: np.ndarray,
    load: bool,
    chunk_bytes: int,
    buffer: int,
    start: int,
    table: int,
    span_first: np.ndarray,
    span_host: np.ndarray,
    span_staged: np.ndarray,
    span_bytes: np.ndarray,
    spans: int,
) -> tuple[int, int, int, int]: ...
