"""kvcopy: many KV-cache block copies at once, at the speed of the link.

Framework-agnostic: accepts raw pointers, torch/CuPy/NumPy/JAX arrays and any
stream object, and calls the CUDA driver directly through cuda-python.
"""

from kvcopy.blocks import swap_blocks, swap_blocks_both_ways
from kvcopy.pointers import copy_batch, copy_both_ways
from kvcopy.rows import check_indices, copy_rows
from kvcopy._engine.decide import last_decision
from kvcopy.calibrate import calibrate, calibrate_peers
from kvcopy.config import config
from kvcopy.errors import CaptureError, CudaError, IndexOutOfRange, KVCopyError, NoDriverError
from kvcopy.host import device_pointer, pinned_empty, register
from kvcopy.host_pool import HostPool, PoolReport, pinned_pool
from kvcopy.interop.streams import resolve_stream
from kvcopy.interop.tensors import BlockView, block_view
from kvcopy.layouts import Layout
from kvcopy.prepared_rows import PreparedRows, prepare_rows
from kvcopy.rows_both_ways import copy_rows_both_ways
from kvcopy.queue import TransferQueue, TransferResult
from kvcopy._runtime.prepare import prepare

__version__ = "0.3.0"

__all__ = [
    "BlockView",
    "CaptureError",
    "CudaError",
    "HostPool",
    "IndexOutOfRange",
    "KVCopyError",
    "Layout",
    "NoDriverError",
    "PoolReport",
    "PreparedRows",
    "TransferQueue",
    "TransferResult",
    "block_view",
    "calibrate",
    "calibrate_peers",
    "check_indices",
    "config",
    "copy_batch",
    "copy_both_ways",
    "copy_rows",
    "copy_rows_both_ways",
    "device_pointer",
    "last_decision",
    "pinned_empty",
    "pinned_pool",
    "prepare",
    "prepare_rows",
    "register",
    "resolve_stream",
    "swap_blocks",
    "swap_blocks_both_ways",
]
