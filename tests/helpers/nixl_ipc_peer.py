"""The two ends of the same-host leg, run by tests/cpu/test_nixl_same_host.py (``python
-m helpers.nixl_ipc_peer ROLE FOLDER``), each in its own process, signalling through
the shared layout's doorbell, with CUDA IPC stood in for by shared memory
(helpers.host_ipc) and rows copied on the host:

- ``lender`` shares its cache, lends it for a pull, a push and a pull the host end
  gets wrong (whose refusal it saves), and saves its cache after the push;
- ``host_end`` opens the lender's layout, pulls rows into its own cache (saved), pushes
  rows of that into the lender's, then pulls a row the lender's cache does not have.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from helpers.host_ipc import HostIpc
from helpers.nixl_peer import _publish, _read, _wait_for
from kvcopy import Layout, nixl, testing

PLANES, SLOTS, ROW = 4, 32, 256
PULL = (np.array([3, 17, 31, 0, -1]), np.array([0, 1, 2, 3, 4]))
PUSH = (np.array([0, 2]), np.array([20, 5]))
REFUSED = (np.array([1, SLOTS]), np.array([5, 6]))


def source() -> np.ndarray:
    return np.random.default_rng(11).integers(0, 256, (PLANES, SLOTS, ROW), dtype=np.uint8)


def expected() -> tuple[np.ndarray, np.ndarray]:
    """(the host end's cache after the pull, the lender's after the push)."""
    pulled = np.zeros((PLANES, 8, ROW), np.uint8)
    live = PULL[0] >= 0
    pulled[:, PULL[1][live]] = source()[:, PULL[0][live]]
    pushed = source()
    pushed[:, PUSH[1]] = pulled[:, PUSH[0]]
    return pulled, pushed


def _layout(cache: np.ndarray) -> Layout:
    return Layout.from_pointers(
        [cache[p].ctypes.data for p in range(cache.shape[0])], slots=cache.shape[1], row_bytes=ROW
    )


def lender(folder: Path) -> None:
    fake = HostIpc()
    with testing.fake_cuda(fake, ("driver", "ipc")), testing.rows_on_host():
        cache = fake.allocate(PLANES * SLOTS * ROW).reshape(PLANES, SLOTS, ROW)
        cache[:] = source()
        with nixl.share_layout(_layout(cache)) as shared:
            _publish(folder, "lender", (shared.shared,))
            for tag in ("pull", "push"):
                nixl.lend_rows(shared, tag=tag, timeout=60)
            np.save(folder / "pushed.npy", cache)
            try:
                nixl.lend_rows(shared, tag="refused", timeout=60)
            except nixl.TransferFailed as exc:
                (folder / "lender-refused").write_text(str(exc))
            _wait_for(folder / "host-done")
        del cache
    fake.release()


def host_end(folder: Path) -> None:
    fake = HostIpc()
    cache = np.zeros((PLANES, 8, ROW), np.uint8)
    (shared,) = _read(folder, "lender")
    with testing.fake_cuda(fake, ("driver", "ipc")), testing.rows_on_host():
        with nixl.open_layout(shared) as opened:
            nixl.pull_rows(opened, _layout(cache), *PULL, tag="pull", timeout=60)
            np.save(folder / "pulled.npy", cache)
            nixl.push_rows(_layout(cache), opened, *PUSH, tag="push", timeout=60)
            try:
                nixl.pull_rows(opened, _layout(cache), *REFUSED, tag="refused", timeout=60)
            except ValueError:
                pass  # (the lender saves what it was told)
    (folder / "host-done").touch()


ROLES = {"lender": lender, "host_end": host_end}

if __name__ == "__main__":
    ROLES[sys.argv[1]](Path(sys.argv[2]))
