"""Compare two sets of `python bench/run.py` results row by row: two builds (a
change against the code before it) measured alternately on one machine, several runs
each. For every row of the chosen method, GPU-time and wall GB/s of each run, the
ratio of the means (after/before), and the run-to-run noise within each set (the
largest relative difference between its runs): a ratio outside 1 +- tolerance is
flagged, and called beyond noise where the noise of both sets is smaller than the
difference.

    python bench/compare.py --before old1.json old2.json --after new1.json new2.json
        [--method auto] [--tolerance 0.03]

Exit status 1 where a GPU-time ratio is beyond tolerance and beyond noise; wall time
is reported, not judged (a busy host moves it by more than a change does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

KEY = ("scenario", "direction", "block_bytes", "count", "memory", "method")


def rows_by_key(path: Path, method: str) -> dict[tuple, dict[str, Any]]:
    """The rows of one results file whose method is ``method``, by KEY (a repeated key
    gets its occurrence number appended)."""
    found: dict[tuple, dict[str, Any]] = {}
    for row in json.loads(path.read_text())["rows"]:
        if row.get("method") != method:
            continue
        key = tuple(str(row.get(field)) for field in KEY)
        n = sum(1 for k in found if k[: len(KEY)] == key)
        found[key + (n,)] = row
    return found


def summary(values: list[float]) -> tuple[float, float]:
    """(mean, noise): the largest relative difference between two of the runs."""
    mean = statistics.fmean(values)
    noise = (max(values) - min(values)) / max(values) if max(values) else 0.0
    return mean, noise


def compare(before: list[Path], after: list[Path], method: str, tolerance: float) -> tuple[list[str], int]:
    """Report lines, and how many GPU-time ratios are beyond tolerance and noise."""
    old = [rows_by_key(p, method) for p in before]
    new = [rows_by_key(p, method) for p in after]
    keys = [k for k in old[0] if all(k in runs for runs in old + new)]
    lines = [
        f"{'row':44} {'chose':8} {'gpu after/before':>17} {'noise':>11} "
        f"{'wall after/before':>18} {'noise':>11}"
    ]
    beyond = 0
    for key in keys:
        cells = []
        for metric in ("gbps", "wall_gbps"):
            b = [runs[key].get(metric) for runs in old]
            a = [runs[key].get(metric) for runs in new]
            if any(v in (None, 0) for v in a + b):
                cells.append((None, 0.0, 0.0, ""))
                continue
            (mb, nb), (ma, na) = summary(b), summary(a)
            ratio = ma / mb
            mark = ""
            if abs(ratio - 1) > tolerance:
                mark = " beyond noise" if abs(ratio - 1) > max(nb, na) else " (noise)"
                if metric == "gbps" and mark == " beyond noise":
                    beyond += 1
            cells.append((ratio, nb, na, mark))
        name = " ".join(str(part) for part in key[1:5])
        chose = str(new[0][key].get("chose", ""))
        text = [f"{name:44} {chose:8}"]
        for ratio, nb, na, mark in cells:
            text.append(f"{'':>17} {'':>11}" if ratio is None else f"{ratio:17.3f} {nb:5.3f}/{na:5.3f}{mark}")
        lines.append(" ".join(text))
    lines.append(
        f"{len(keys)} rows of method {method!r}; GPU time beyond {tolerance:.0%} and noise: {beyond}"
    )
    return lines, beyond


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", nargs="+", type=Path, required=True)
    parser.add_argument("--after", nargs="+", type=Path, required=True)
    parser.add_argument("--method", default="auto")
    parser.add_argument("--tolerance", type=float, default=0.03)
    args = parser.parse_args(argv)
    lines, beyond = compare(args.before, args.after, args.method, args.tolerance)
    print("\n".join(lines))
    return 1 if beyond else 0


if __name__ == "__main__":
    sys.exit(main())
