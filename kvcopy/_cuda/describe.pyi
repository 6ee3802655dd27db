"""Type stub of kvcopy._cuda.describe: the kernel path's one-pass describe."""
import numpy as np

DESCRIPTOR_BYTES: int
COMPACT_BYTES: int

def describe_copies(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, descs_out: int,
                    merge: bool = True) -> tuple[int, int, int, int, int, int, int]: ...
def describe_compact(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, descs_out: int,
                     merge: bool = True) -> tuple[int, int, int, int, int, int, int, int]: ...
def fast_describe_available() -> bool: ...
