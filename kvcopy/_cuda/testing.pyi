"""Type stub of kvcopy._cuda.testing: the describe pass over known memory ranges or
seeded driver answers."""

import numpy as np

from kvcopy._cuda.describe import DescribedBatch

def describe_copies_in(
    known_ranges: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    sizes: np.ndarray,
    descs_out: int,
    merge: bool = True,
    fast: bool = True,
    compact: bool = False,
) -> tuple[DescribedBatch, bool]: ...
def describe_copies_answered(
    driver_ranges: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    sizes: np.ndarray,
    descs_out: int,
    merge: bool = True,
    fast: bool = True,
) -> tuple[DescribedBatch, bool, tuple[int, int]]: ...
