"""Type stub of kvcopy._cuda.testing: the describe pass over known memory ranges or
seeded driver answers."""
import numpy as np

def describe_copies_in(known_ranges: np.ndarray, src: np.ndarray, dst: np.ndarray,
                       sizes: np.ndarray, descs_out: int, merge: bool = True, fast: bool = True,
                       compact: bool = False) -> tuple[tuple[int, ...], bool]: ...

def describe_copies_answered(driver_ranges: np.ndarray, src: np.ndarray, dst: np.ndarray,
                             sizes: np.ndarray, descs_out: int, merge: bool = True,
                             fast: bool = True
                             ) -> tuple[tuple[int, ...], bool, tuple[int, int]]: ...
