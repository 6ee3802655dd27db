"""One signal between two processes of one host, rung in one and seen in the other:
the same-host leg's doorbell (kvcopy.nixl.doorbell, what a transfer's "lent" and
"returned" are) against one NIXL notification between two agents (what they were
before it), each in the same run. Needs no GPU; the NIXL row needs NIXL.

    python3 bench/signal_latency.py [--signals N]

The receiving process looks for each signal as the leg's ends look for theirs
(spinning first, then polling); the sender rings it a few milliseconds after the
receiver started looking, and the time from ring to seen is read on one clock
(time.monotonic, shared by the processes of a host). Prints the median, the 90th
percentile and the largest, µs.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import statistics
import sys
import time
from typing import Callable

from nixl_transfer import make_agent  # (bench/nixl_transfer.py: NIXL imported when called)

RECEIVER_START_S = 0.001  # (the receiver is looking when the signal comes)


def _doorbell_receiver(conn, path: str, signals: int) -> None:
    from kvcopy.nixl import doorbell

    bell = doorbell.Doorbell.open(path)
    for k in range(1, signals + 1):
        conn.recv()
        conn.send(None)
        seen = bell.wait("lent", lambda value, k=k: doorbell.fields(value)[0] == k, 10.0)
        conn.send(time.monotonic() if seen is not None else None)
    bell.close()


def doorbell_latencies(signals: int) -> list[float]:
    """Seconds from ring to seen, one a signal, through a doorbell page."""
    from kvcopy.nixl import doorbell

    bell = doorbell.Doorbell.create()
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    peer = ctx.Process(target=_doorbell_receiver, args=(theirs, bell.path, signals))
    peer.start()
    try:
        return _ring_and_time(
            mine, signals, lambda k: bell.ring("lent", doorbell.word(k, doorbell.LENT, "bench"), "bench")
        )
    finally:
        peer.join(30)
        bell.close()


def _ring_and_time(conn, signals: int, ring: Callable[[int], None]) -> list[float]:
    """Signals 1..signals, each rung once the receiver at ``conn`` looks for it: the
    seconds from ring to seen."""
    latencies = []
    for k in range(1, signals + 1):
        conn.send(k)
        conn.recv()
        time.sleep(RECEIVER_START_S)
        start = time.monotonic()
        ring(k)
        seen = conn.recv()
        if seen is None:
            raise RuntimeError(f"signal {k} was not seen")
        latencies.append(seen - start)
    return latencies


def _nixl_receiver(conn, signals: int) -> None:
    from kvcopy.nixl import transfers

    agent = make_agent("receiver")
    conn.send(agent.get_agent_metadata())
    peer = agent.add_remote_agent(conn.recv())
    for k in range(1, signals + 1):
        conn.recv()
        conn.send(None)
        transfers.wait_notification(agent, peer, transfers.notification(f"s{k}", "lent"), 10.0)
        conn.send(time.monotonic())
    conn.recv()  # (the sender has forgotten this agent)
    agent.remove_remote_agent(peer)


def nixl_latencies(signals: int) -> list[float]:
    """Seconds from send to seen, one a signal, as NIXL notifications between two
    agents (UCX) of two processes."""
    from kvcopy.nixl import transfers

    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    peer_process = ctx.Process(target=_nixl_receiver, args=(theirs, signals))
    peer_process.start()
    agent = make_agent("sender")
    peer = agent.add_remote_agent(mine.recv())
    mine.send(agent.get_agent_metadata())
    name = peer.decode() if isinstance(peer, bytes) else peer
    try:
        return _ring_and_time(
            mine, signals, lambda k: agent.send_notif(name, transfers.notification(f"s{k}", "lent"))
        )
    finally:
        agent.remove_remote_agent(peer)
        mine.send(None)
        peer_process.join(30)


def _nixl_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu13", "nixl"))


def _row(name: str, latencies: list[float]) -> str:
    ordered = sorted(x * 1e6 for x in latencies[1:])  # (the first one warms up)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{name:<38} {statistics.median(ordered):>9.1f} {p90:>9.1f} {ordered[-1]:>9.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--signals", type=int, default=200)
    args = parser.parse_args(argv)
    if args.signals < 2:
        parser.error("--signals must be at least 2")
    print(f"{'one signal, rung to seen, µs':<38} {'median':>9} {'p90':>9} {'largest':>9}")
    print(_row("kvcopy doorbell (shared memory)", doorbell_latencies(args.signals)))
    if _nixl_installed():
        print(_row("NIXL notification (UCX)", nixl_latencies(args.signals)))
    else:
        print("NIXL notification: NIXL is not installed (pip install nixl-cu13)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
