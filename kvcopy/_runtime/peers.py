"""Peer access between GPUs: whether the launching device's copy kernel may read and
write another device's memory, enabling it on first need, and saying why not."""

from __future__ import annotations

import logging
import threading
from typing import Iterable

from kvcopy._cuda import classify, driver
from kvcopy.config import config
from kvcopy.errors import KVCopyError

log = logging.getLogger("kvcopy")
_lock = threading.Lock()
_attempted: set[tuple[int, int]] = set()  # (context key, peer device) asked once each
_enabled_here: set[tuple[int, int]] = set()  # ... where access is now enabled


def forget() -> None:
    """Forget which peer access was asked for and enabled (tests; a process whose
    contexts were all reset)."""
    _attempted.clear()
    _enabled_here.clear()


def peers_of(ordinals: Iterable[int], here: int) -> list[int]:
    """The devices other than ``here`` among classify's ordinals (-1: no device
    memory, -2: several devices, so every device is a candidate)."""
    found = set(ordinals)
    if -2 in found:
        return [d for d in range(driver.device_count()) if d != here]
    return sorted(d for d in found if d >= 0 and d != here)


def enable_for(here: int, peers: Iterable[int]) -> bool:
    """Enable access from the current context (on device ``here``) to each peer's
    memory, where the hardware allows it and ``config.enable_peer_access`` is set.

    Asked once per context and peer: enabling maps every allocation of the peer
    into this context, and torch and the runtime enable the same access lazily,
    so kvcopy does likewise (the driver cannot be asked whether access is
    enabled, so kvcopy can use it only where it enabled it or learnt that it
    already was). Returns True when access became usable (the batch's memory
    must be classified again)."""
    if not config.enable_peer_access:
        return False
    ctx = driver.current_context_key()  # (a reset context must enable access again)
    changed = False
    with _lock:
        for peer in peers:
            key = (ctx, peer)
            if key in _attempted:
                continue
            _attempted.add(key)
            if not driver.can_access_peer(here, peer):
                continue
            try:
                driver.enable_peer_access(peer)  # or it already was: as good
            except KVCopyError as exc:  # e.g. too many peers: DMA still copies
                log.warning(
                    "kvcopy: peer access from device %d to device %d could not be "
                    "enabled (%s); copies between them go by DMA",
                    here,
                    peer,
                    exc,
                )
                continue
            classify.note_peer_access(ctx, peer)
            _enabled_here.add(key)
            changed = True
    return changed


def why_unreachable(here: int, peers: Iterable[int]) -> str:
    """Why the current context's device cannot access the given peers' memory, for
    error messages (the first peer that explains it)."""
    for peer in peers:
        if not driver.can_access_peer(here, peer):
            return (
                f"memory of device {peer}, which device {here} cannot access "
                f"(cuDeviceCanAccessPeer is 0: no peer-to-peer path between them)"
            )
        if (driver.current_context_key(), peer) not in _enabled_here:
            if not config.enable_peer_access:
                return (
                    f"memory of device {peer}, and kvcopy.config.enable_peer_access is False: "
                    f"kvcopy neither enables peer access from device {here} nor can ask the "
                    f"driver whether the application did, so such memory goes by DMA (set "
                    f"it to True to let kvcopy enable it, as torch does for its own copies)"
                )
            return (
                f"memory of device {peer}, and peer access from device {here} to it could "
                f"not be enabled (see the warning in kvcopy's log)"
            )
        return (
            f"memory of device {peer} that is not mapped for device {here} although peer "
            f"access is possible: a virtual-memory or memory-pool allocation without access "
            f"for device {here} (grant it with cuMemSetAccess or cuMemPoolSetAccess)"
        )
    return "memory of another device that this device cannot access"
