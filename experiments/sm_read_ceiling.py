"""What limits the SMs' reads of pinned host memory on a host: the copy kernel's
host-to-GPU rate by CTAs, by block size and by the pages behind the pinned memory
(torch's cudaHostAlloc, a kvcopy.pinned_pool on transparent huge pages, on plain
pages), against the copy engines (batched DMA) and one contiguous copy, with what the
host says of its PCIe link, its maximum read request and its IOMMU.

One H100 host read host memory from its SMs at about 33 GB/s (kernel, Triton and
vLLM's kernel alike) where its copy engines reached 54-55 GB/s and another host of the
same model reached 50 from its SMs; this probe separates the causes (reads in
flight per SM, pages and IOMMU, the read request size) and shows whether more CTAs
or other pages get past the ceiling.

    python3 experiments/sm_read_ceiling.py [--mib 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

import kvcopy
from kvcopy import testing

CTAS = (2, 4, 8, 16, 32, 64, 132)
BLOCKS = (2 << 10, 16 << 10, 256 << 10)


def host_facts(torch) -> list[str]:
    """The GPU's PCIe link, its DevCtl (MaxReadReq) and the IOMMU, as the host says."""
    attrs = testing.cuda.driver.device_attributes(torch.cuda.current_device())
    address = f"{attrs['pci_domain']:04x}:{attrs['pci_bus']:02x}:{attrs['pci_device']:02x}.0"
    folder = Path("/sys/bus/pci/devices") / address
    facts = [f"GPU {attrs['name']} at {address}"]
    for name in ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width", "numa_node"):
        path = folder / name
        facts.append(f"{name}: {path.read_text().strip() if path.exists() else '?'}")
    try:
        lspci = subprocess.run(
            ["lspci", "-vvv", "-s", address], capture_output=True, text=True, timeout=10
        ).stdout
        facts += [line.strip() for line in lspci.splitlines() if "MaxReadReq" in line or "LnkSta:" in line]
    except (OSError, subprocess.SubprocessError):
        facts.append("lspci: not here")
    groups = list(Path("/sys/kernel/iommu_groups").glob("*"))
    facts.append(f"IOMMU groups: {len(groups)}; cmdline: {Path('/proc/cmdline').read_text().strip()}")
    return facts


def gbps(torch, stream, run, nbytes: int, repeats: int = 5) -> float:
    """GB/s of ``run``'s work on ``stream`` (median GPU time of ``repeats``)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.cuda.stream(stream):
        run()
        for _ in range(repeats):
            start.record(stream)
            run()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return nbytes / (sorted(times)[len(times) // 2] / 1e3) / 1e9


def host_memories(torch, nbytes: int) -> dict:
    """Pinned host memory of each kind, as uint8 tensors (kept alive by the dict)."""
    found = {"torch pin_memory": torch.empty(nbytes, dtype=torch.uint8).pin_memory()}
    for pages in ("transparent", "none"):
        try:
            pool = kvcopy.pinned_pool(nbytes, huge_pages=pages)
            found[f"pool, {pool.wait().pages} pages"] = (torch.from_numpy(pool.view()), pool)
        except ValueError as exc:
            print(f"pool with huge_pages={pages!r}: {exc}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="bytes a batch moves, MiB")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("sm_read_ceiling: no CUDA GPU here", file=sys.stderr)
        return 2
    for fact in host_facts(torch):
        print(fact)
    nbytes = args.mib << 20
    device = torch.empty(2 * nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    for label, memory in host_memories(torch, 2 * nbytes).items():
        host = memory[0] if isinstance(memory, tuple) else memory
        whole = gbps(torch, stream, lambda: device[:nbytes].copy_(host[:nbytes], non_blocking=True), nbytes)
        print(f"\n{label}: one contiguous copy {whole:.1f} GB/s")
        for block in BLOCKS:
            count = nbytes // block
            slots = np.arange(2 * count, dtype=np.uint64)
            src = np.uint64(host.data_ptr()) + rng.permutation(slots)[:count] * np.uint64(block)
            dst = np.uint64(device.data_ptr()) + rng.permutation(slots)[:count] * np.uint64(block)
            sizes = np.full(count, block, np.uint64)
            row = []
            for ctas in CTAS:
                kvcopy.config.host_ctas = ctas
                rate = gbps(
                    torch,
                    stream,
                    lambda: kvcopy.copy_batch(src, dst, sizes, stream=stream, method="kernel"),
                    nbytes,
                )
                row.append(f"{ctas}:{rate:.1f}")
            del kvcopy.config.host_ctas
            dma = gbps(
                torch,
                stream,
                lambda: kvcopy.copy_batch(src, dst, sizes, stream=stream, method="batch"),
                nbytes,
            )
            print(f"  {block >> 10:4d} KiB blocks  kernel by CTAs {' '.join(row)}  batched DMA {dma:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
