"""kvcopy as the KV leg of NIXL transfers.

Engines post one NIXL descriptor per layer, K or V and block (Llama-70B at TP 8:
18,880 for one request). kvcopy builds fewer from its layouts and indices
(kvcopy.nixl.descriptors: runs merged, NIXL's strided form where rows are evenly
spaced), or gathers scattered rows into a registered staging region and sends whole
chunks, scattering them on the other side (kvcopy.nixl.packed), and posts and waits
for transfers within a deadline (kvcopy.nixl.transfers). Between two processes of one
host, rows move between one's GPU memory and the other's layout by CUDA IPC, the two
ends signalling through a page of shared memory (kvcopy.nixl.same_host: NIXL carries
only the shared layout's description, once).

kvcopy makes no transport and keeps no network state: the functions take the
caller's ``nixl_agent`` (NIXL's Python package, installed on its own, e.g. ``pip
install nixl-cu13``), and importing kvcopy.nixl imports neither NIXL nor torch. A
remote layout is built with ``Layout.from_pointers`` from the addresses the peer
sent with its metadata.
"""

from kvcopy.nixl.descriptors import Descriptors, descriptors, regions
from kvcopy.nixl.packed import Staging, receive_packed, send_packed
from kvcopy.nixl.same_host import (
    OpenedLayout,
    SharedLayout,
    SharedRows,
    lend_rows,
    open_layout,
    pull_rows,
    push_rows,
    share_layout,
)
from kvcopy.nixl.transfers import TransferFailed, finish, post, transfer, wait_notification

__all__ = [
    "Descriptors",
    "OpenedLayout",
    "SharedLayout",
    "SharedRows",
    "Staging",
    "TransferFailed",
    "descriptors",
    "finish",
    "lend_rows",
    "open_layout",
    "post",
    "pull_rows",
    "push_rows",
    "receive_packed",
    "regions",
    "send_packed",
    "share_layout",
    "transfer",
    "wait_notification",
]
