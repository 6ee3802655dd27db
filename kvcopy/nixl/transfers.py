"""A NIXL transfer posted through the caller's agent and waited for within a deadline,
and the notifications that tell the other end (see kvcopy.nixl)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from kvcopy.errors import KVCopyError
from kvcopy.nixl.descriptors import OPERATIONS, Descriptors

POLL_S = 0.0002  # (NIXL's progress thread moves the bytes: the caller only asks)
# A wait looks again without sleeping for its first SPIN_S: a chunk of a packed send,
# or a same-host leg's copy of a few MiB, ends within about a millisecond, and a sleep
# costs the scheduler's wake-up on top of POLL_S, every chunk, at both ends.
# time.sleep(0) still lets other threads run.
SPIN_S = 0.002


def pause(started: float) -> None:
    """Between two looks of a wait that began at ``started`` (time.monotonic()): every
    wait of kvcopy.nixl, on NIXL or on a doorbell, paces its looks so."""
    time.sleep(0 if time.monotonic() - started < SPIN_S else POLL_S)


class TransferFailed(KVCopyError):
    """NIXL refused a transfer or reported it in its error state (a peer gone, memory
    it does not know). The request was released and the agent stays usable."""


@dataclass
class Posted:
    """A transfer in flight: :func:`finish` waits for it and releases it."""

    agent: Any
    handle: Any
    what: str
    timeout: float
    deadline: float
    lists: list = field(default_factory=list)


def _name(agent: Any) -> str:
    return agent.decode() if isinstance(agent, bytes) else str(agent)


@contextlib.contextmanager
def _nixl_errors(what: str) -> Iterator[None]:
    """NIXL's own exceptions (a peer gone, memory it does not know) as TransferFailed."""
    try:
        yield
    except (TimeoutError, KVCopyError):
        raise
    except Exception as exc:
        raise TransferFailed(f"transfer: NIXL refused {what}: {type(exc).__name__}: {exc}") from exc


def post(
    agent: Any,
    operation: str,
    descs: Descriptors,
    remote_agent: str,
    *,
    local_memory: str = "DRAM",
    remote_memory: str = "DRAM",
    notification: bytes = b"",
    timeout: float = 60.0,
) -> Posted:
    """Post ``descs`` through ``agent`` (a ``nixl_agent`` whose memory at both ends is
    registered and that knows ``remote_agent``) and return at once; :func:`finish`
    waits for the end. The remote agent gets ``notification`` once every byte has
    landed. ``*_memory``: NIXL's name for each side's memory ('DRAM', 'VRAM').

    Raises (here or from :func:`finish`) TransferFailed where NIXL refuses the
    request or reports an error (a peer that went away, memory it does not know),
    TimeoutError where it has not ended ``timeout`` seconds after posting; the
    request is released either way and the agent stays usable."""
    if operation not in OPERATIONS:
        raise ValueError(f"transfer: operation must be 'WRITE' or 'READ', got {operation!r}")
    if not isinstance(descs, Descriptors):
        raise TypeError(f"transfer: descs must be kvcopy.nixl.Descriptors, got {type(descs).__name__}")
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"transfer: timeout must be a positive number of seconds, got {timeout!r}")
    what = f"{operation} of {descs.nbytes} bytes ({descs.posted} descriptors) with {_name(remote_agent)!r}"
    posted = Posted(agent, None, what, timeout, time.monotonic() + timeout)
    if descs.posted == 0:  # (every row skipped: nothing to move, the notification alone)
        if notification:
            with _nixl_errors(what):
                agent.send_notif(_name(remote_agent), notification)
        return posted
    try:
        with _nixl_errors(what):
            if descs.strided:
                posted.lists = [
                    agent.prep_xfer_dlist("", descs.local, local_memory),
                    agent.prep_xfer_dlist(remote_agent, descs.remote, remote_memory),
                ]
                every = np.arange(descs.expanded, dtype=np.int32)
                posted.handle = agent.make_prepped_xfer(
                    operation, posted.lists[0], every, posted.lists[1], every, notification
                )
            else:
                posted.handle = agent.initialize_xfer(
                    operation,
                    agent.get_xfer_descs(descs.local, local_memory),
                    agent.get_xfer_descs(descs.remote, remote_memory),
                    remote_agent,
                    notification,
                )
            if agent.transfer(posted.handle, notification) == "ERR":
                raise TransferFailed(f"transfer: NIXL reports {what} in state ERR")
    except BaseException:
        _release(posted)
        raise
    return posted


def finish(posted: Posted) -> None:
    """Wait for a posted transfer to end, then release it. Raises TransferFailed where
    NIXL reports an error, TimeoutError past the transfer's deadline."""
    if posted.handle is None:  # (nothing was posted)
        return
    try:
        with _nixl_errors(posted.what):
            state = posted.agent.check_xfer_state(posted.handle)
            started = time.monotonic()
            while state == "PROC":
                if time.monotonic() > posted.deadline:
                    raise TimeoutError(f"transfer: {posted.what} has not ended after {posted.timeout} s")
                pause(started)
                state = posted.agent.check_xfer_state(posted.handle)
        if state != "DONE":
            raise TransferFailed(f"transfer: NIXL reports {posted.what} in state {state}")
    finally:
        _release(posted)


def transfer(*args: Any, **kwargs: Any) -> None:
    """:func:`post` (same arguments), then :func:`finish`: the transfer has ended
    when this returns."""
    finish(post(*args, **kwargs))


def _release(posted: Posted) -> None:
    """Give the request (and prepared lists) back; one still in flight is left to
    NIXL, which releases it when it ends."""
    agent = posted.agent
    held = [(agent.release_xfer_handle, posted.handle)] if posted.handle is not None else []
    for release, item in held + [(agent.release_dlist_handle, h) for h in posted.lists]:
        try:
            release(item)
        except Exception:  # noqa: BLE001 - NIXL refuses to release a request in flight
            pass
    posted.handle, posted.lists = None, []


def notification(tag: str, *what: object) -> bytes:
    """The notification that says ``what`` of kvcopy's transfer ``tag`` between two
    agents: ``kvcopy/<tag>/<what>/...;`` (the ';' ends it, so that no message is the
    start of another that wait_notification would take for it)."""
    return "/".join(("kvcopy", tag, *map(str, what))).encode() + b";"


def wait_notification(
    agent: Any,
    remote_agent: str,
    message: bytes,
    timeout: float = 60.0,
    meanwhile: Callable[[], object] | None = None,
) -> None:
    """Wait until ``remote_agent``'s notification starting with ``message`` arrives
    (it is consumed), calling ``meanwhile()`` between two looks where given;
    TimeoutError after ``timeout`` seconds."""
    started = time.monotonic()
    deadline = started + timeout
    name = _name(remote_agent)  # (NIXL keys notifications by str; add_remote_agent gives bytes)
    while not agent.check_remote_xfer_done(name, message):
        if time.monotonic() > deadline:
            raise TimeoutError(f"wait_notification: no {message!r} from {name!r} after {timeout} s")
        if meanwhile is not None:
            meanwhile()
        pause(started)
