"""Where a staged call's CPU time goes: call and call-to-completion times of
copy_both_ways and copy_batch, staged ('auto', the host side one span) against the
kernel ('kernel'), 64 MiB each way of 4 KiB blocks, then the top of a cProfile of
twenty staged copy_both_ways calls.

Run on a GPU: python3 experiments/staged_cpu_probe.py
"""

import cProfile, pstats, time
import numpy as np, torch, kvcopy

KiB, MiB = 1 << 10, 1 << 20
total, block = 64 * MiB, 4 * KiB
n = total // block
hin = torch.empty(total, dtype=torch.uint8).pin_memory()
hout = torch.empty(total, dtype=torch.uint8).pin_memory()
g1 = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
g2 = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
rng = np.random.default_rng(0)
host = np.arange(n, dtype=np.uint64) * np.uint64(block)
sizes = np.full(n, block, np.uint64)
load = (
    np.uint64(hin.data_ptr()) + host,
    np.uint64(g1.data_ptr()) + rng.permutation(2 * n)[:n].astype(np.uint64) * np.uint64(block),
    sizes,
)
store = (
    np.uint64(g2.data_ptr()) + rng.permutation(2 * n)[:n].astype(np.uint64) * np.uint64(block),
    np.uint64(hout.data_ptr()) + host,
    sizes,
)
s = torch.cuda.Stream()
for name, fn in [
    ("both staged", lambda: kvcopy.copy_both_ways(store, load, stream=s)),
    ("both kernel", lambda: kvcopy.copy_both_ways(store, load, stream=s, method="kernel")),
    ("h2d staged", lambda: kvcopy.copy_batch(*load, stream=s)),
    ("h2d kernel", lambda: kvcopy.copy_batch(*load, stream=s, method="kernel")),
]:
    fn()
    torch.cuda.synchronize()
    cpu, wall = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        cpu.append((t1 - t0) * 1e6)
        wall.append((t2 - t0) * 1e6)
    print(
        f"{name}: call {np.median(cpu):.0f} us, wall {np.median(wall):.0f} us, chose {kvcopy.last_decision().method}",
        flush=True,
    )
pr = cProfile.Profile()
pr.enable()
for _ in range(20):
    kvcopy.copy_both_ways(store, load, stream=s)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
