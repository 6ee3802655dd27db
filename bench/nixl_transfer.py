"""One engine request moved through NIXL: 80 layers x K/V x 118 blocks (Llama-70B at
TP 8, 18,880 rows), as engines post it (a descriptor per row) and with kvcopy's
descriptors (runs merged; NIXL's strided form), in one run: descriptors posted, CPU
to prepare them, CPU to post, wall to the end and GB/s, and the bytes checked.

Host memory to host memory through one agent's loopback (NIXL's UCX backend), so it
runs without a GPU; ``--vram`` puts both caches on GPU 0 (needs torch with CUDA).
Blocks are at random slots of one cache tensor a side, as an engine's block table
leaves them.

    python3 bench/nixl_transfer.py [--block-kib 2 32] [--repeats 5] [--vram]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from steady_calls import median_quartile  # (bench/steady_calls.py: the same timer)

PLANES, BLOCKS, USED = 160, 128, 118


def make_agent(name: str = "bench"):
    """A NIXL agent with the UCX backend (nixl-cu13's package, else nixl's)."""
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _caches(block: int, vram: bool) -> tuple[object, object, int, int, str]:
    """Two caches [PLANES, BLOCKS, block] (source random, destination zeros), their
    addresses, and NIXL's name for their memory."""
    if vram:
        import torch

        src = torch.randint(0, 256, (PLANES, BLOCKS, block), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        return src, dst, src.data_ptr(), dst.data_ptr(), "VRAM"
    src = np.random.default_rng(0).integers(0, 256, (PLANES, BLOCKS, block), dtype=np.uint8)
    dst = np.zeros_like(src)
    return src, dst, src.ctypes.data, dst.ctypes.data, "DRAM"


def one_block_size(block: int, repeats: int, vram: bool) -> list[tuple]:
    from kvcopy import Layout, nixl

    agent = make_agent()
    src, dst, src_at, dst_at, memory = _caches(block, vram)
    device = 0
    total = PLANES * BLOCKS * block
    registered = agent.register_memory(
        np.array([[src_at, total, device], [dst_at, total, device]], dtype=np.uint64), memory
    )
    rng = np.random.default_rng(1)
    ours, theirs = rng.permutation(BLOCKS)[:USED], rng.permutation(BLOCKS)[:USED]
    planes = np.arange(PLANES, dtype=np.uint64)[:, None] * np.uint64(BLOCKS * block)

    def engine_way() -> nixl.Descriptors:
        # a descriptor per layer, K/V and block, as engines build them
        local = (src_at + planes + ours.astype(np.uint64) * np.uint64(block)).ravel()
        remote = (dst_at + planes + theirs.astype(np.uint64) * np.uint64(block)).ravel()
        size = np.full(local.size, block, np.uint64)
        zeros = np.zeros(local.size, np.uint64)
        return nixl.Descriptors(
            np.stack([local, size, zeros], 1), np.stack([remote, size, zeros], 1), local.size, total, False
        )

    a = Layout.from_pointers(src_at + planes.ravel(), slots=BLOCKS, row_bytes=block)
    b = Layout.from_pointers(dst_at + planes.ravel(), slots=BLOCKS, row_bytes=block)
    ways = {
        "a descriptor per row (engines)": engine_way,
        "kvcopy descriptors (merged)": lambda: nixl.descriptors("WRITE", a, b, ours, theirs),
        "kvcopy descriptors (strided)": lambda: nixl.descriptors("WRITE", a, b, ours, theirs, strided=True),
    }
    rows = []
    for name, make in ways.items():
        prepare_s = median_quartile(make, lambda: None, max(repeats, 2))[0] / 1e6
        descs = make()
        post_s: list[float] = []
        wall_s: list[float] = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            posted = nixl.post(agent, "WRITE", descs, agent.name, local_memory=memory, remote_memory=memory)
            post_s.append(time.perf_counter() - start)
            nixl.finish(posted)
            wall_s.append(time.perf_counter() - start)
        moved = USED * PLANES * block
        rows.append(
            (
                block,
                name,
                descs.posted,
                prepare_s,
                statistics.median(post_s[1:]),
                statistics.median(wall_s[1:]),
                moved / statistics.median(wall_s[1:]) / 1e9,
            )
        )
    check = (dst[:, theirs] == src[:, ours]).all()
    agent.deregister_memory(registered)
    if not bool(check):
        raise AssertionError("the destination's blocks differ from the source's")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-kib", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vram", action="store_true", help="both caches on GPU 0")
    args = parser.parse_args(argv)
    try:
        make_agent()
    except ImportError:
        print("nixl_transfer: NIXL is not installed here (pip install nixl-cu13)", file=sys.stderr)
        return 2
    print(
        f"{PLANES} planes x {USED} blocks = {PLANES * USED} rows; {'VRAM' if args.vram else 'DRAM'} loopback"
    )
    header = ("block", "way", "posted", "prepare ms", "post ms", "wall ms", "GB/s")
    print("{:>6s}  {:34s} {:>7s} {:>11s} {:>8s} {:>8s} {:>6s}".format(*header))
    for kib in args.block_kib:
        for block, name, posted, prepare, post, wall, rate in one_block_size(
            kib << 10, args.repeats, args.vram
        ):
            print(
                f"{block >> 10:4d} KiB  {name:34s} {posted:7d} {prepare * 1e3:11.3f} {post * 1e3:8.3f} "
                f"{wall * 1e3:8.2f} {rate:6.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
