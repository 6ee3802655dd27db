"""Experiment: where one transfer of the same-host leg spends its time, and whether
a lender that waits for its own event on the CPU (the peer then not waiting for the
interprocess event on the GPU) is faster.

bench/nixl_two_processes.py --to host at one block size, with each end's half of
the leg (kvcopy.nixl.same_host's lend and _move) replaced by a copy of it that
stamps each stage on time.monotonic (one clock for the processes of a host):

- the receiver (``R``): the lend seen, the GPU wait queued, copy_rows returned, the
  copy ended (stream synchronized), the answer rung; ms from the start of its wait;
- the lender (``L``): its event recorded (and, with ``cpuwait``, waited for), the
  answer seen; ms from the start of its lend.

Then the benchmark's rows for the leg, its copy_rows alone and the local copy.

    LEG_VARIANT=gpuwait|cpuwait python3 experiments/same_host_leg_stages.py [block bytes]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import nixl_two_processes as bench  # noqa: E402  (bench/nixl_two_processes.py)

VARIANT = os.environ.get("LEG_VARIANT", "gpuwait")


def _stamped(stamps: list[float]) -> str:
    return " ".join(f"{(t - stamps[0]) * 1e3:.3f}" for t in stamps[1:])


def _patch() -> None:
    import kvcopy.nixl
    from kvcopy.testing import cuda, engine
    from kvcopy.interop.streams import resolve_stream
    from kvcopy.nixl import doorbell, same_host
    from kvcopy.rows import copy_rows

    def move(caller, opened, src, dst, src_indices, dst_indices, tag, rows, stream, timeout):
        stamps = [time.monotonic()]
        handle = resolve_stream(stream)
        bell, taken = opened.doorbell, opened.taken

        def lent(value: int) -> bool:
            return doorbell.fields(value)[1] == doorbell.LENT and doorbell.fields(value)[0] != taken

        sequence = doorbell.fields(bell.wait("lent", lent, timeout))[0]
        opened.taken = sequence
        stamps.append(time.monotonic())
        with engine.context.on_device(opened.ordinal):
            if VARIANT == "gpuwait":
                cuda.driver.stream_wait_event(handle, opened.event)
            stamps.append(time.monotonic())
            method = copy_rows(src, dst, src_indices, dst_indices, rows=rows, stream=handle)
            stamps.append(time.monotonic())
            cuda.driver.stream_synchronize(handle)
            stamps.append(time.monotonic())
        bell.ring("answer", doorbell.word(sequence, doorbell.RETURNED, tag), tag)
        stamps.append(time.monotonic())
        print(
            f"R {VARIANT} {tag} seen/waited/copy-returned/synced/answered ms: {_stamped(stamps)} "
            f"start {stamps[0]:.6f}",
            flush=True,
        )
        return method

    def lend_rows(rows, *, tag, stream=None, timeout=60.0):
        stamps = [time.monotonic()]
        handle = resolve_stream(stream)
        with engine.context.on_device(rows.ordinal):
            cuda.driver.event_record(rows.event, handle)
            if VARIANT == "cpuwait":
                cuda.driver.event_synchronize(rows.event)
        stamps.append(time.monotonic())
        rows.sequence += 1
        sequence = rows.sequence & 0xFFFFFFFF
        rows.doorbell.ring("lent", doorbell.word(sequence, doorbell.LENT, tag), tag)
        rows.doorbell.wait("answer", lambda value: doorbell.fields(value)[0] == sequence, timeout)
        stamps.append(time.monotonic())
        print(
            f"L {VARIANT} {tag} start {stamps[0]:.6f} recorded {(stamps[1] - stamps[0]) * 1e3:.3f} "
            f"answered {(stamps[2] - stamps[0]) * 1e3:.3f}",
            flush=True,
        )

    same_host._move = move
    same_host.lend_rows = lend_rows
    kvcopy.nixl.lend_rows = lend_rows


_target = bench.target


def target(*args):
    """The receiving process of the benchmark, its half of the leg stamped."""
    _patch()
    _target(*args)


def main() -> None:
    bench.target = target
    _patch()
    block = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    for row in bench.one_block_size(block, "host", 5, False):
        if "leg" in row[1] or "alone" in row[1] or "local" in row[1]:
            print(VARIANT, row[1].strip(), f"{row[5] * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
