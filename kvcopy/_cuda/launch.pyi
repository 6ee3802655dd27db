"""Type stub of kvcopy._cuda.launch: the copy kernel's module and launches."""

import numpy as np

TILE_BYTES: int
INLINE_MAX: int
INLINE_MAX_SMALL: int
INLINE_MAX_TINY: int
BLOCK_TENSOR_BYTES: int
BULK_THREADS: int

def module_load(image: bytes) -> int: ...
def module_function(module: int, name: bytes) -> int: ...
def upload(device: int, host: int, nbytes: int, stream: int) -> None: ...
def launch_descs_inline(
    function: int, per_launch: int, host_descs: int, n: int, max_ctas: int, threads: int, stream: int
) -> int: ...
def launch_descs(
    function: int,
    descs: int,
    n: int,
    tiles: int,
    max_ctas: int,
    threads: int,
    stream: int,
    upload_from: int = 0,
) -> int: ...
def issue_staged_chunk(
    load: bool,
    copy_stream: int,
    kernel_stream: int,
    free_event: int,
    filled_event: int,
    span_host: int,
    span_staged: int,
    span_bytes: int,
    lo: int,
    hi: int,
    function: int,
    descs: int,
    n: int,
    tiles: int,
    ctas: int,
    threads: int,
) -> None: ...
def launch_compact(
    function: int,
    pairs: int,
    n: int,
    size: int,
    max_ctas: int,
    threads: int,
    stream: int,
    upload_from: int = 0,
) -> int: ...
def launch_both(
    function: int,
    descs: int,
    count_a: int,
    tiles_a: int,
    ctas_a: int,
    count_b: int,
    tiles_b: int,
    ctas_b: int,
    threads: int,
    stream: int,
    upload_from: int = 0,
    descs_b: int = 0,
) -> int: ...
def launch_blocks_uploaded(
    function: int,
    host_buf: int,
    device_buf: int,
    tensors: np.ndarray,
    mapping: np.ndarray,
    block_bytes: int,
    max_ctas: int,
    threads: int,
    stream: int,
) -> int: ...
def blocks_upload_bytes(num_tensors: int, num_pairs: int) -> int: ...
def launch_blocks_both_uploaded(
    function: int,
    host_buf: int,
    device_buf: int,
    tensors_a: np.ndarray,
    mapping_a: np.ndarray,
    block_bytes_a: int,
    ctas_a: int,
    tensors_b: np.ndarray,
    mapping_b: np.ndarray,
    block_bytes_b: int,
    ctas_b: int,
    threads: int,
    stream: int,
) -> int: ...
def blocks_both_upload_bytes(tensors_a: int, pairs_a: int, tensors_b: int, pairs_b: int) -> int: ...
