"""CPU time from the Python call to its return, kernel path, 8192 descriptors as NumPy arrays."""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import kvcopy

KiB = 1 << 10


def scattered_batch(count: int = 8192, block: int = 16 * KiB):
    """Pinned-to-device scattered blocks as NumPy pointer arrays (buffers kept alive)."""
    src = torch.empty(2 * count * block, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(2 * count * block, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(0)
    s = np.uint64(src.data_ptr()) + (rng.permutation(2 * count)[:count] * block).astype(np.uint64)
    d = np.uint64(dst.data_ptr()) + (rng.permutation(2 * count)[:count] * block).astype(np.uint64)
    return (src, dst), s, d, np.full(count, block, dtype=np.uint64)


def main() -> None:
    count, block = 8192, 16 * KiB
    _keep, s, d, sizes = scattered_batch(count, block)
    stream = torch.cuda.Stream()
    for method in ("kernel", "batch"):
        for _ in range(5):
            kvcopy.copy_batch(s, d, sizes, stream=stream, method=method)
        stream.synchronize()
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            kvcopy.copy_batch(s, d, sizes, stream=stream, method=method)
            times.append((time.perf_counter() - t0) * 1e6)
            stream.synchronize()
        print(f"cpu_overhead method={method} count={count} block={block} "
              f"median_us={statistics.median(times):.1f} min_us={min(times):.1f}")


def swap_blocks_overhead() -> None:
    """swap_blocks over 64 tensors (32 layers, K and V) and 1024 block pairs, kernel path."""
    layers, blocks, pairs = 32, 2048, 1024
    shape = (blocks, 16, 8, 128)  # 16-token blocks, 8 heads of 128, bf16: 32 KiB per block
    gpu = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2 * layers)]
    host = [torch.empty(shape, dtype=torch.bfloat16).pin_memory() for _ in range(2 * layers)]
    rng = np.random.default_rng(1)
    mapping = np.stack([rng.choice(blocks, pairs, replace=False),
                        rng.choice(blocks, pairs, replace=False)], axis=1)
    stream = torch.cuda.Stream()
    for direction, (src, dst) in {"d2h": (gpu, host), "h2d": (host, gpu)}.items():
        for _ in range(3):
            used = kvcopy.swap_blocks(src, dst, mapping, stream=stream)
        stream.synchronize()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            kvcopy.swap_blocks(src, dst, mapping, stream=stream)
            times.append((time.perf_counter() - t0) * 1e6)
            stream.synchronize()
        print(f"cpu_overhead swap_blocks {direction} tensors={2 * layers} pairs={pairs} "
              f"method={used} median_us={statistics.median(times):.1f} min_us={min(times):.1f}")


if __name__ == "__main__":
    main()
    swap_blocks_overhead()
