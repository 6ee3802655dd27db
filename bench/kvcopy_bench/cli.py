"""Command line: python bench/run.py [--quick] [--device N] [--calibrate] [--out DIR]."""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path

import kvcopy
from kvcopy_bench import beside, extra, gpu_pairs, layouts, nixl_stage, report
from kvcopy_bench.gpu import gpu_or_exit
from kvcopy_bench.scenarios import block_copy_rows
from kvcopy.policy import RequestedMethod

KiB, MiB = 1 << 10, 1 << 20
BATCH_BYTES = 64 * MiB  # bytes per batch of the block sweep (GPU-to-GPU: four times that)
SCHEMA_VERSION = 2  # of results.json: meta says device, driver, CUDA, torch, kvcopy, date
QUICK_BLOCKS = [2 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
PEER_BLOCKS = [2 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
FULL_BLOCKS = [
    2 * KiB,
    4 * KiB,
    8 * KiB,
    16 * KiB,
    32 * KiB,
    64 * KiB,
    128 * KiB,
    256 * KiB,
    512 * KiB,
    1 * MiB,
    2 * MiB,
    4 * MiB,
]


def torch_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    sys.stderr.flush()


def _block_list(text: str) -> list[int]:
    """--blocks: KiB integers separated by commas, each from 1 KiB to the batch's 64 MiB."""
    try:
        sizes = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KiB integers separated by commas, got {text!r}")
    bad = [k for k in sizes if not 1 <= k <= BATCH_BYTES // KiB]
    if bad:
        raise argparse.ArgumentTypeError(
            f"block sizes must be from 1 to {BATCH_BYTES // KiB} KiB (the batch's size); got {bad}"
        )
    return [k * KiB for k in sizes]


def _device_index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a GPU index, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"a GPU index is at least 0, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Every argument checked before anything is measured (the output folder made and
    written to once), so that a run never ends in an error after its stages."""
    parser = argparse.ArgumentParser(
        prog="python bench/run.py", description="kvcopy against the ceiling and the alternatives"
    )
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out"),
        help="folder for results.json, results.csv and the plots (default "
        "bench-out; made if missing, files in it replaced)",
    )
    parser.add_argument(
        "--device",
        type=_device_index,
        default=0,
        help="the GPU to measure (default 0); GPU-to-GPU rows use it and the next",
    )
    parser.add_argument(
        "--no-alternatives",
        action="store_true",
        help="leave out the other libraries' paths (Triton, cuda.core, torch)",
    )
    parser.add_argument(
        "--blocks",
        type=_block_list,
        default=None,
        help="comma-separated block sizes in KiB instead of the sweep's, e.g. 16,64",
    )
    parser.add_argument(
        "--no-scenarios",
        action="store_true",
        help="only the block sweep (no GPU-to-GPU, bidirectional, compute, layouts, swap_blocks)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="run kvcopy.calibrate() first (not saved), so that 'auto' uses what "
        "it finds on this host, as a deployment that calibrates would",
    )
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: not a folder")
    return args


def make_out(out: Path) -> None:
    """Make ``--out`` and show it can be written (exit 2 where not): only once a GPU is
    there to measure, so that a machine without one is left as it was."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kvcopy-bench-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        print(
            f"python bench/run.py: error: --out {out}: cannot write there ({exc.strerror or exc})",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def run_metadata(name: str, device: int) -> dict:
    """What a result file must say about where and with what it was measured."""
    import datetime
    import subprocess

    import torch

    version = None
    try:
        from cuda.bindings import driver as cu

        err, found = cu.cuDriverGetVersion()
        version = int(found) if int(err) == 0 else None
    except Exception:  # noqa: BLE001 - no driver library: the file says so (None)
        pass
    commit = None
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(kvcopy.__file__).parent,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "schema_version": SCHEMA_VERSION,
        "device": name,
        "device_index": device,
        "driver_version": version,
        "driver": None if version is None else f"{version // 1000}.{version % 1000 // 10}",
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "kvcopy": kvcopy.__version__,
        "kvcopy_commit": commit,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def first_use_calibration(device: int) -> float | None:
    """Ask for the device's thresholds as a first copy does; where that started kvcopy's
    calibration at first use (no file for this host; config.auto_calibrate), wait for it
    rather than time 'auto' beside it. Seconds from the ask to the file loaded, None
    where none started (a file was found, or calibration at first use is off)."""
    import torch

    from kvcopy.testing import engine

    torch.empty(1, device=f"cuda:{device}")  # (the device's context current, as a copy has it)
    started = time.perf_counter()
    engine.device.thresholds(device)
    if engine.first_use.wait(0):  # (none running: a file was found, or it is off)
        return None
    engine.first_use.wait()
    return round(time.perf_counter() - started, 2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = gpu_or_exit(args.device)
    make_out(args.out)
    calibrated = None
    if args.calibrate:
        calibrated = dataclasses.asdict(kvcopy.calibrate(save_result=False))
    first_use_s = first_use_calibration(args.device)
    if first_use_s is not None:
        print(f"calibration at first use: {first_use_s} s (this host had none)", file=sys.stderr)
    blocks = args.blocks or (QUICK_BLOCKS if args.quick else FULL_BLOCKS)
    total = BATCH_BYTES
    repeats = 5 if args.quick else 9
    methods: list[RequestedMethod] = ["auto", "kernel", "batch", "loop"]
    jobs = [(d, b, "torch") for d in ("h2d", "d2h") for b in blocks]
    jobs += [("d2d", b, "torch") for b in blocks if b >= 16 * KiB]
    kvcopy_memory = [b for b in blocks if b == 16 * KiB] if args.quick else blocks
    jobs += [(d, b, "kvcopy") for d in ("h2d", "d2h") for b in kvcopy_memory]
    rows, scenarios, stage_seconds = [], {}, {}
    max_loop_count = 4096 if args.quick else 32768  # per-block alternatives: seconds per batch
    t0 = time.time()
    steps = len(jobs) + (0 if args.no_scenarios else 8)
    for i, (direction, block, memory) in enumerate(jobs):
        label = f"{direction} {block // KiB} KiB ({memory} memory)"
        progress(i, steps, label)
        started = time.time()
        size = 4 * total if direction == "d2d" else total
        alternatives = not args.no_alternatives and memory == "torch"
        rows += [
            r.as_dict()
            for r in block_copy_rows(
                direction, block, size, memory, methods, alternatives, repeats, max_loop_count
            )
        ]
        stage_seconds[label] = round(time.time() - started, 2)
    if not args.no_scenarios and gpu_pairs.gpu_pair_available():
        progress(len(jobs), steps, "GPU0 <-> GPU1")
        started = time.time()
        peer_blocks = [b for b in blocks if b in PEER_BLOCKS] if not args.blocks else blocks
        scenarios["peer"] = list(gpu_pairs.peer_rows(peer_blocks, repeats=repeats))
        stage_seconds["peer"] = round(time.time() - started, 2)
    if not args.no_scenarios:
        # quick: a 1024-block cache (2 GiB pinned); full: 4096 blocks (8 GiB pinned, ~10 s to pin)
        counts = (16, 256, 1024) if args.quick else (16, 64, 256, 1024, 4096)
        stages = [
            ("bidirectional", "both directions at once", lambda: extra.bidirectional(repeats=repeats)),
            ("host_spans", "host side one span (staged)", lambda: extra.host_spans(repeats=repeats)),
            ("small_batches", "16-256 blocks, call to completion", extra.small_batches),
            (
                "compute_beside",
                "compute beside the copy (paired)",
                lambda: [
                    row
                    for direction in ("h2d", "d2h")
                    for row in beside.compute_beside(pairs=12 if args.quick else 24, direction=direction)
                ],
            ),
            (
                "serving_step",
                "matmul beside a store and a load",
                lambda: [
                    row
                    for block in (16 * KiB, 256 * KiB)
                    for row in beside.serving_step(pairs=8 if args.quick else 16, block=block)
                ],
            ),
            ("layouts", "layout transfers (copy_rows)", layouts.run_here),
            ("nixl", "NIXL between two processes (where installed)", lambda: nixl_stage.nixl_rows(repeats)),
            (
                "swap_blocks",
                "swap_blocks on a paged cache",
                lambda: extra.swap_blocks_cache(
                    counts, repeats, batch_max_copies=16384 if args.quick else None
                ),
            ),
        ]
        for k, (key, label, run) in enumerate(stages):
            progress(len(jobs) + k, steps, label)
            started = time.time()
            scenarios[key] = list(run())
            stage_seconds[key] = round(time.time() - started, 2)
    progress(steps, steps, "done")
    sys.stderr.write("\n")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        **run_metadata(name, args.device),
        "quick": args.quick,
        "seconds": round(time.time() - t0, 1),
        "stage_seconds": stage_seconds,
        "gpus": torch_device_count(),
        "calibrated": calibrated,
        "first_use_calibration_s": first_use_s,
        "timing": "gbps: bytes / GPU time of the enqueued work (CUDA events, the call's CPU "
        "time hidden behind a sleep kernel); wall_gbps: bytes / (call + completion) "
        "from an idle stream; medians",
    }
    report.write_json(args.out / "results.json", meta, rows, {"scenarios": scenarios})
    report.write_csv(args.out / "results.csv", rows)
    plotted = report.plot(
        args.out / "results.png",
        rows,
        f"kvcopy on {name}: scattered blocks, {total >> 20} MiB per batch (GPU-to-GPU {4 * total >> 20} MiB)",
    )
    plotted_scenarios = report.plot_scenarios(
        args.out / "scenarios.png", scenarios, f"kvcopy on {name}: serving-like load"
    )
    print_table(rows, scenarios)
    print(
        f"wrote {args.out}/results.json, results.csv"
        + (", results.png" if plotted else "")
        + (", scenarios.png" if plotted_scenarios else "")
    )
    return 0


def print_table(rows: list[dict], scenarios: dict) -> None:
    print(
        f"{'dir':4} {'block':>8} {'memory':>6} {'method':>22} {'chose':>7} {'copier':>9} "
        f"{'GB/s':>8} {'ceil':>6} {'wallGB/s':>9} {'cpu_us':>9}"
    )
    for r in rows:
        print(
            f"{r['direction']:4} {r['block_bytes'] // KiB:>6}Ki {r['memory']:>6} {r['method']:>22} "
            f"{r['chose']:>7} {r.get('copier', ''):>9} {r['gbps']:8.1f} {r['fraction_of_ceiling']:6.2f} "
            f"{r['wall_gbps']:9.1f} {r['cpu_us']:9.1f}"
        )
    for name, items in scenarios.items():
        print(f"-- {name}")
        for item in items:
            print(
                "   "
                + " ".join(
                    f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in item.items()
                    if k != "scenario"
                )
            )
