"""Experiment: a raw-pointer batch built block by block over every layer's tensors.

A framework that keeps one tensor per layer for K and for V (80 layers: 160 per side)
and builds its copy list block by block over all of them cycles through 160
allocations per side. kvcopy asks the driver about each allocation once per call
and keeps the answers; measured here: copy_batch's CPU time (median of 50 calls,
stream idle, the kernel path) for such a batch, against the same copies laid out
in one allocation per side, and the driver questions each side's describe pass
asked (describe_copies_answered of kvcopy.testing with no rows counts the real
driver's answers).

Run on a GPU: python3 experiments/layer_tensors_probe.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import kvcopy
from kvcopy.testing import describe_copies_answered

KiB = 1 << 10
BLOCK, BLOCKS = 16 * KiB, 8


def cpu_us(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream) -> float:
    times = []
    for _ in range(50):
        stream.synchronize()
        t0 = time.perf_counter()
        kvcopy.copy_batch(src, dst, sizes, stream=stream)
        times.append((time.perf_counter() - t0) * 1e6)
    stream.synchronize()
    return statistics.median(times)


def main(tensors: int = 160) -> None:
    host = [torch.empty(2 * BLOCKS * BLOCK, dtype=torch.uint8).pin_memory() for _ in range(tensors)]
    gpu = [torch.empty(2 * BLOCKS * BLOCK, dtype=torch.uint8, device="cuda") for _ in range(tensors)]
    one_host = torch.empty(tensors * 2 * BLOCKS * BLOCK, dtype=torch.uint8).pin_memory()
    one_gpu = torch.empty(tensors * 2 * BLOCKS * BLOCK, dtype=torch.uint8, device="cuda")
    order = [(b, t) for b in range(BLOCKS) for t in range(tensors)]
    h = np.array([host[t].data_ptr() + 2 * b * BLOCK for b, t in order], dtype=np.uint64)
    g = np.array([gpu[t].data_ptr() + 2 * b * BLOCK for b, t in order], dtype=np.uint64)
    span = 2 * BLOCKS * BLOCK
    h1 = np.array([one_host.data_ptr() + t * span + 2 * b * BLOCK for b, t in order], dtype=np.uint64)
    g1 = np.array([one_gpu.data_ptr() + t * span + 2 * b * BLOCK for b, t in order], dtype=np.uint64)
    sizes = np.full(len(order), BLOCK, dtype=np.uint64)
    s = torch.cuda.Stream()
    out = np.zeros((len(order), 4), dtype=np.uint64)
    print(
        f"# layer_tensors on {torch.cuda.get_device_name()}: {tensors} tensors per side, "
        f"{BLOCKS} blocks of {BLOCK // KiB} KiB each, {len(order)} copies block by block"
    )
    for name, (a, b) in {
        "h2d tensors": (h, g),
        "d2h tensors": (g, h),
        "h2d one allocation": (h1, g1),
        "d2h one allocation": (g1, h1),
    }.items():
        questions = describe_copies_answered(np.zeros((0, 5), dtype=np.int64), a, b, sizes, out.ctypes.data)[
            2
        ]
        print(
            f"{name:<20} cpu_us {cpu_us(a, b, sizes, s):7.1f}  driver questions "
            f"(src, dst) {questions}  method {kvcopy.last_decision().method}",
            flush=True,
        )


if __name__ == "__main__":
    torch.cuda.init()
    main()
