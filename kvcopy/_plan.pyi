import numpy as np

def plan_arrays(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, merge: bool = True
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
