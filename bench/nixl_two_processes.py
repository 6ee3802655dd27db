"""One engine request between two processes through NIXL, in one run: 80 layers x K/V
x 118 blocks at random slots of one cache tensor a side (18,880 rows), moved

- as engines post it (a descriptor per row), with kvcopy's strided descriptors, and
  as one contiguous descriptor of the same bytes (NIXL's best case, the reference);
- packed: gathered by kvcopy into staging, sent a chunk a descriptor, scattered on
  the other side (send_packed / receive_packed), end to end;
- by the same-host leg: the receiver pulls the rows straight from the sender's GPU
  cache, mapped into it by CUDA IPC, the two ends signalling through the shared
  layout's doorbell (kvcopy.nixl.same_host: share_layout and lend_rows, open_layout
  and pull_rows), beside one NIXL notification's latency between the same two agents;

with descriptors posted, CPU to prepare and to post, wall and GB/s, and the bytes
checked at the destination after every way. For the packed way "post ms" is the
sending process's CPU time in ``send_packed`` (all its threads: the gathers launched,
the chunks posted, the slots waited for), an upper bound on its CPU to prepare and post.
``--to host`` puts the destination cache in the other process's pinned host memory
(the same-host leg): the packed way then stages through the receiver's GPU memory,
and a local contiguous GPU-to-host copy of the same bytes is the reference.

    python3 bench/nixl_two_processes.py [--block-kib 2 32] [--to gpu|host] [--repeats 5]
        [--chunk-rows 16] [--slots 4] [--packed-only]

The packed way sends chunks of ``--chunk-rows`` blocks (every plane's rows of them)
through ``--slots`` staging slots a side; ``--packed-only`` runs the packed way and
its reference only (a sweep of chunk sizes).

Without a GPU (``--cpu``) both caches are in host memory and the packed way gathers
and scatters on the CPU (kvcopy.testing.rows_on_host): a check of the script, not a
measurement of kvcopy.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import sys
import time

import numpy as np

from nixl_transfer import BLOCKS, PLANES, USED, make_agent  # (bench/nixl_transfer.py: the same request)

CHUNK_ROWS, SLOTS = 16, 4  # the defaults of --chunk-rows and --slots


def _buffer(nbytes: int, where: str):
    """(keep-alive object, address, NIXL memory name) of zeroed memory ``where`` is
    'gpu', 'pinned' or 'host'."""
    if where == "host":
        array = np.zeros(nbytes, np.uint8)
        return array, array.ctypes.data, "DRAM"
    import torch

    if where == "gpu":
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        return tensor, tensor.data_ptr(), "VRAM"
    tensor = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
    return tensor, tensor.data_ptr(), "DRAM"


def _rows_of(keep, block: int) -> np.ndarray:
    """The cache's bytes as [PLANES, BLOCKS, block] on the host."""
    data = keep if isinstance(keep, np.ndarray) else keep.cpu().numpy()
    return data.reshape(PLANES, BLOCKS, block)


def _side(agent, block: int, where: str, staging_where: str, chunk_rows: int, slots: int) -> tuple:
    """One end's cache and staging, registered with ``agent``: (the cache's
    keep-alive, its address, its NIXL memory name, the Staging, the registrations,
    the staging's keep-alive)."""
    from kvcopy import nixl

    keep, base, memory = _buffer(PLANES * BLOCKS * block, where)
    slot = chunk_rows * PLANES * block
    stage_keep, stage_at, stage_memory = _buffer(slots * slot, staging_where)
    held = [
        agent.register_memory(np.array([[at, size, 0]], np.uint64), kind)
        for at, size, kind in (
            (base, PLANES * BLOCKS * block, memory),
            (stage_at, slots * slot, stage_memory),
        )
    ]
    staging = nixl.Staging(stage_at, slot, slots, memory=stage_memory)
    return keep, base, memory, staging, held, stage_keep


def _planes(keep, base: int, block: int):
    """The cache's layout: PLANES planes of BLOCKS rows of ``block`` bytes from ``base``,
    holding its torch tensor where it has one (its memory is then classified once, as
    an engine's layouts of its own tensors are)."""
    from kvcopy import Layout

    held = () if isinstance(keep, np.ndarray) else (keep,)
    return Layout.from_pointers(
        [base + p * BLOCKS * block for p in range(PLANES)], slots=BLOCKS, row_bytes=block, keep=held
    )


def target(conn, block: int, where: str, staging_where: str, cpu: bool, chunk_rows: int, slots: int) -> None:
    """The receiving process: its cache, its staging, and what the sender asks."""
    from kvcopy import nixl, testing
    from kvcopy.nixl import transfers

    agent = make_agent("target")
    keep, base, memory, staging, held, _staging_kept = _side(
        agent, block, where, staging_where, chunk_rows, slots
    )
    layout = _planes(keep, base, block)
    conn.send((agent.get_agent_metadata(), base, memory, staging))
    peer = agent.add_remote_agent(conn.recv())
    opened = None
    while True:
        command, argument = conn.recv()
        if command == "clear":
            if isinstance(keep, np.ndarray):
                keep.fill(0)
            else:
                keep.zero_()
            conn.send(None)
        elif command == "rows":
            conn.send(_rows_of(keep, block)[:, argument].copy())
        elif command == "receive":
            with testing.rows_on_host() if cpu else contextlib.nullcontext():
                nixl.receive_packed(
                    agent, layout, argument, peer, staging, tag="bench", chunk_rows=chunk_rows
                )
            conn.send(time.monotonic())  # (one clock for both processes)
        elif command == "open":
            opened = nixl.open_layout(argument)
            conn.send(None)
        elif command == "pull":
            src_rows, dst_rows, tag = argument
            method = nixl.pull_rows(opened, layout, src_rows, dst_rows, tag=tag)
            conn.send((time.monotonic(), method))
        elif command == "copy":  # the leg's copy alone, no signal: (seconds, method)
            src_rows, dst_rows, requested = argument
            conn.send(_copy_alone(opened, layout, src_rows, dst_rows, requested))
        elif command == "notified":  # one NIXL notification's arrival (the leg rings instead)
            conn.send(None)
            transfers.wait_notification(agent, peer, transfers.notification(argument, "lent"))
            conn.send(time.monotonic())
        elif command == "close":
            opened.close()
            conn.send(None)
        else:
            break
    agent.remove_remote_agent(peer)
    for handle in held:
        agent.deregister_memory(handle)
    del keep


def _copy_alone(opened, layout, src_rows, dst_rows, requested: str) -> tuple[float, str]:
    """The same-host leg's copy_rows from the opened layout, timed to its end in the
    receiving process (the lender's rows ready: nothing waited for)."""
    import torch

    from kvcopy import copy_rows

    torch.cuda.synchronize()
    start = time.monotonic()
    method = copy_rows(opened.layout, layout, src_rows, dst_rows, method=requested)
    torch.cuda.synchronize()
    return time.monotonic() - start, method


def one_block_size(
    block: int,
    to: str,
    repeats: int,
    cpu: bool,
    chunk_rows: int = CHUNK_ROWS,
    slots: int = SLOTS,
    packed_only: bool = False,
) -> list[tuple]:
    from kvcopy import Layout, nixl, testing

    ctx = multiprocessing.get_context("spawn")
    mine, theirs_end = ctx.Pipe()
    where = "host" if cpu else ("gpu" if to == "gpu" else "pinned")
    peer_process = ctx.Process(
        target=target, args=(theirs_end, block, where, "host" if cpu else "gpu", cpu, chunk_rows, slots)
    )
    peer_process.start()
    agent = make_agent("initiator")
    source_where = "host" if cpu else "gpu"
    keep, base, memory, staging, held, _staging_kept = _side(
        agent, block, source_where, source_where, chunk_rows, slots
    )
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, PLANES * BLOCKS * block, dtype=np.uint8)
    if isinstance(keep, np.ndarray):
        keep[:] = source
    else:
        import torch

        keep.copy_(torch.from_numpy(source))
    metadata, their_base, their_memory, their_staging = mine.recv()
    peer = agent.add_remote_agent(metadata)
    mine.send(agent.get_agent_metadata())
    ours, theirs = rng.permutation(BLOCKS)[:USED], rng.permutation(BLOCKS)[:USED]
    a = _planes(keep, base, block)
    b = Layout.from_pointers(
        [their_base + p * BLOCKS * block for p in range(PLANES)], slots=BLOCKS, row_bytes=block
    )
    planes = np.arange(PLANES, dtype=np.uint64)[:, None] * np.uint64(BLOCKS * block)
    moved = USED * PLANES * block

    def per_row() -> nixl.Descriptors:  # as engines build them
        local = (base + planes + ours.astype(np.uint64) * np.uint64(block)).ravel()
        remote = (their_base + planes + theirs.astype(np.uint64) * np.uint64(block)).ravel()
        size, zero = np.full(local.size, block, np.uint64), np.zeros(local.size, np.uint64)
        return nixl.Descriptors(
            np.stack([local, size, zero], 1), np.stack([remote, size, zero], 1), local.size, moved, False
        )

    def contiguous() -> nixl.Descriptors:  # the same bytes in one piece (no check)
        one = np.array([[base, moved, 0]], np.uint64)
        return nixl.Descriptors(one, np.array([[their_base, moved, 0]], np.uint64), 1, moved, False)

    ways = {
        "a descriptor per row (engines)": per_row,
        "kvcopy strided descriptors": lambda: nixl.descriptors("WRITE", a, b, ours, theirs, strided=True),
        "one contiguous descriptor": contiguous,
    }
    rows = []
    expected = source.reshape(PLANES, BLOCKS, block)[:, ours]
    for name, make in {} if packed_only else ways.items():
        mine.send(("clear", None))
        mine.recv()
        start = time.perf_counter()
        descs = make()
        prepare = time.perf_counter() - start
        posts, walls = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            posted = nixl.post(agent, "WRITE", descs, peer, local_memory=memory, remote_memory=their_memory)
            posts.append(time.perf_counter() - start)
            nixl.finish(posted)
            walls.append(time.perf_counter() - start)
        if name != "one contiguous descriptor":
            mine.send(("rows", theirs))
            assert np.array_equal(mine.recv(), expected), name
        rows.append((block, name, descs.posted, prepare, statistics.median(posts[1:]), *_rate(walls, moved)))
    walls, cpus = [], []
    mine.send(("clear", None))  # (once, as for the ways above: see _same_host_leg)
    mine.recv()
    for _ in range(repeats + 1):
        mine.send(("receive", theirs))
        start, cpu_start = time.monotonic(), time.process_time()
        with testing.rows_on_host() if cpu else contextlib.nullcontext():
            nixl.send_packed(agent, a, ours, peer, staging, their_staging, tag="bench", chunk_rows=chunk_rows)
        cpus.append(time.process_time() - cpu_start)
        walls.append(mine.recv() - start)
    mine.send(("rows", theirs))
    assert np.array_equal(mine.recv(), expected), "packed"
    chunks = -(-USED // chunk_rows)
    # (the sender's CPU time in send_packed, every thread of the process: its gathers
    # launched and its chunks posted, the staging slots waited for)
    sender_cpu = statistics.median(cpus[1:])
    rows.append(
        (block, "kvcopy packed (gather, send, scatter)", chunks, 0.0, sender_cpu, *_rate(walls, moved))
    )
    if not cpu:
        rows.extend(_same_host_leg(agent, peer, mine, a, ours, theirs, expected, block, moved, repeats))
    if not cpu and to == "host":
        rows.append(_local_copy(block, moved, repeats))
    mine.send(("quit", None))
    peer_process.join(60)
    agent.remove_remote_agent(peer)
    for handle in held:
        agent.deregister_memory(handle)
    del keep
    return rows


def _same_host_leg(
    agent, peer, conn, src, ours, theirs, expected, block: int, moved: int, repeats: int
) -> list[tuple]:
    """The rows pulled by the receiver from this process's GPU cache through CUDA IPC,
    end to end (lent, pulled, returned; the method copy_rows chose), then the
    receiver's copy_rows alone (auto, and the kernel asked for), and one NIXL
    notification between the same two processes (what a leg signalled through NIXL
    would wait for, twice a transfer); the layout shared and opened once, untimed."""
    from kvcopy import nixl
    from kvcopy.nixl import transfers

    walls = []
    with nixl.share_layout(src) as shared:
        conn.send(("open", shared.shared))
        conn.recv()
        # (the destination cleared once, before the first repeat, as for every way: a
        # clear before each would leave it dirty in the CPU's caches, which the GPU's
        # writes must then evict, and which the local copy beside it does not meet)
        conn.send(("clear", None))
        conn.recv()
        for k in range(repeats + 1):
            conn.send(("pull", (ours, theirs, f"leg{k}")))
            start = time.monotonic()
            nixl.lend_rows(shared, tag=f"leg{k}")
            ended, method = conn.recv()
            walls.append(ended - start)
        conn.send(("rows", theirs))
        assert np.array_equal(conn.recv(), expected), "same-host leg"
        rows = [(block, f"kvcopy same-host leg (CUDA IPC, {method})", 0, 0.0, 0.0, _rate(walls, moved))]
        for requested in ("auto", "kernel"):
            copies = []
            for _ in range(repeats + 1):
                conn.send(("copy", (ours, theirs, requested)))
                seconds, method = conn.recv()
                copies.append(seconds)
            rows.append(
                (block, f"  its copy_rows alone ({requested}: {method})", 0, 0.0, 0.0, _rate(copies, moved))
            )
        name = peer.decode() if isinstance(peer, bytes) else peer
        waits = []
        for k in range(repeats + 1):
            conn.send(("notified", f"ping{k}"))
            conn.recv()
            start = time.monotonic()
            agent.send_notif(name, transfers.notification(f"ping{k}", "lent"))
            waits.append(conn.recv() - start)
        rows.append(
            (block, "  one NIXL notification, sent to seen", 1, 0.0, 0.0, (statistics.median(waits[1:]), 0.0))
        )
        conn.send(("close", None))
        conn.recv()
    return [(*row[:5], *row[5]) for row in rows]


def _rate(times: list[float], moved: int) -> tuple[float, float]:
    """(median seconds after the first, GB/s) of ``times``."""
    wall = statistics.median(times[1:])
    return wall, moved / wall / 1e9


def _local_copy(block: int, moved: int, repeats: int) -> tuple:
    """The same bytes GPU to host within one process, one contiguous copy."""
    import torch

    gpu = torch.empty(moved, dtype=torch.uint8, device="cuda")
    host = torch.empty(moved, dtype=torch.uint8).pin_memory()
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(gpu, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return (block, "local contiguous GPU->host copy", 1, 0.0, 0.0, *_rate(times, moved))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-kib", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--to", choices=("gpu", "host"), default="gpu", help="where the destination cache is")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="host memory both sides, no GPU (a check)")
    parser.add_argument(
        "--chunk-rows", type=_positive, default=CHUNK_ROWS, help="blocks a packed chunk carries"
    )
    parser.add_argument("--slots", type=_positive, default=SLOTS, help="staging slots a side")
    parser.add_argument("--packed-only", action="store_true", help="the packed way and its reference only")
    args = parser.parse_args(argv)
    try:
        make_agent("probe")
    except ImportError:
        print("nixl_two_processes: NIXL is not installed here (pip install nixl-cu13)", file=sys.stderr)
        return 2
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print(
                "nixl_two_processes: no CUDA GPU here (--cpu checks the script on host memory)",
                file=sys.stderr,
            )
            return 2
        from kvcopy_bench.cli import first_use_calibration

        # (a calibration at first use, in the background, would run beside the timed
        # transfers in both processes: done here, its file found by the other process)
        first_use_calibration(0)
    header = ("block", "way", "descriptors", "prepare ms", "post ms", "wall ms", "GB/s")
    print("{:>6s}  {:48s} {:>11s} {:>10s} {:>8s} {:>8s} {:>7s}".format(*header))
    for kib in args.block_kib:
        for block, name, posted, prepare, post, wall, rate in one_block_size(
            kib << 10, args.to, args.repeats, args.cpu, args.chunk_rows, args.slots, args.packed_only
        ):
            print(
                f"{block >> 10:4d} KiB  {name:48s} {posted:11d} {prepare * 1e3:10.3f} {post * 1e3:8.3f} "
                f"{wall * 1e3:8.2f} {rate:7.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
