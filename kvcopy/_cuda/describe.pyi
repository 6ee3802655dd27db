"""Type stub of kvcopy._cuda.describe: the kernel path's one-pass describe."""

import numpy as np

DESCRIPTOR_BYTES: int
COMPACT_BYTES: int

class DescribedBatch:
    count: int
    total_bytes: int
    tiles: int
    src_kinds: int
    src_device: int
    dst_kinds: int
    dst_device: int
    compact_size: int
    src_spans: int
    dst_spans: int
    largest_copy: int
    empty_copies: int
    table: int
    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    def __init__(
        self,
        count: int,
        total_bytes: int,
        tiles: int,
        src_kinds: int,
        src_device: int,
        dst_kinds: int,
        dst_device: int,
        compact_size: int = 0,
        table: int = 0,
        src: np.ndarray | None = None,
        dst: np.ndarray | None = None,
        sizes: np.ndarray | None = None,
        src_spans: int = -1,
        dst_spans: int = -1,
        largest_copy: int = 0,
        empty_copies: int = 0,
    ) -> None: ...

def describe_copies(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, descs_out: int, merge: bool = True
) -> DescribedBatch: ...
def describe_compact(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, descs_out: int, merge: bool = True
) -> DescribedBatch: ...
def fast_describe_available() -> bool: ...
