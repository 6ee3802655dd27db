"""Type stub of kvcopy._cuda.dma: DMA planning, batched and per-copy DMA."""

import numpy as np

def plan_dma(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, merge: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
def first_host_span_denied(ptrs: np.ndarray, sizes: np.ndarray, write: bool = False) -> int: ...
def batch_abi() -> int: ...
def memcpy_batch(
    dst: np.ndarray,
    src: np.ndarray,
    sizes: np.ndarray,
    stream: int,
    access_any: bool,
    chunk: int,
    *,
    order: int = 0,
    flags: int = -1,
    hints: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> None: ...
def memcpy_loop(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None: ...

class BlockCopyAgain:
    def __init__(
        self,
        table: np.ndarray,
        block_bytes: int,
        src_limit: int,
        dst_limit: int,
        stream: int,
        batch: bool = False,
        access_any: bool = False,
    ) -> None: ...
    def __call__(self, mapping: object) -> bool: ...
    def addresses(self, mapping: object) -> tuple[int, int] | None: ...
