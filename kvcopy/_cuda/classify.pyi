"""Type stub of kvcopy._cuda.classify: what the driver says each pointer is."""

import numpy as np

KIND_DEVICE: int
KIND_HOST_MAPPED: int
KIND_HOST_UNMAPPED: int
KIND_MANAGED: int
KIND_STRADDLE: int
KIND_PAGEABLE: int
KIND_PEER: int
KIND_PEER_UNMAPPED: int
WIDEN_BUDGET: int  # driver queries one side may spend joining pieces of memory, per call

def classify_pointers(ptrs: np.ndarray, sizes: np.ndarray, device_view: np.ndarray) -> tuple[int, int]: ...
def note_peer_access(ctx: int, peer: int) -> None: ...
