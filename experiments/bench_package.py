"""Puts the benchmark's package (bench/kvcopy_bench, beside kvcopy and not in its wheel)
on a probe's import path: ``import bench_package`` before ``from kvcopy_bench ...``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
