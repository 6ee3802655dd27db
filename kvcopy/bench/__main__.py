"""Command line: python -m kvcopy.bench [--quick] [--out DIR]."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20
QUICK_BLOCKS = [2 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
FULL_BLOCKS = [2 * KiB, 4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB,
               512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB]


def gpu_or_exit() -> str:
    try:
        import torch
    except ImportError:
        print("kvcopy.bench: torch is needed to run the benchmark (pip install torch)", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("kvcopy.bench: no CUDA GPU found on this machine; the benchmark needs one.",
              file=sys.stderr)
        sys.exit(2)
    return torch.cuda.get_device_name(0)


def progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcopy.bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for JSON/CSV/PNG")
    parser.add_argument("--no-alternatives", action="store_true")
    args = parser.parse_args(argv)
    name = gpu_or_exit()

    from kvcopy.bench.scenarios import block_copy_rows
    import kvcopy

    blocks = QUICK_BLOCKS if args.quick else FULL_BLOCKS
    total = 64 * MiB
    repeats = 5 if args.quick else 9
    methods = ["auto", "kernel", "batch", "loop"]
    jobs = [(d, b) for d in ("h2d", "d2h") for b in blocks]
    jobs += [("d2d", b) for b in blocks if b >= 16 * KiB]
    rows = []
    t0 = time.time()
    for i, (direction, block) in enumerate(jobs):
        progress(i, len(jobs), f"{direction} {block // KiB} KiB")
        for r in block_copy_rows(direction, block, total if direction != "d2d" else 4 * total,
                                 "torch", methods, not args.no_alternatives, repeats):
            rows.append(r.as_dict())
    progress(len(jobs), len(jobs), "done")
    sys.stderr.write("\n")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "python": platform.python_version(), "kvcopy": kvcopy.__version__,
            "quick": args.quick, "seconds": round(time.time() - t0, 1)}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{'dir':4} {'block':>8} {'method':>22} {'chose':>7} {'GB/s':>8} {'ceil':>6} {'cpu_us':>9}")
    for r in rows:
        print(f"{r['direction']:4} {r['block_bytes'] // KiB:>6}Ki {r['method']:>22} {r['chose']:>7} "
              f"{r['gbps']:8.1f} {r['fraction_of_ceiling']:6.2f} {r['cpu_us']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
