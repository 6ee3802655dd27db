"""bench/compare.py on results written here: ratios of means, noise within each set, and
a GPU-time change flagged only beyond both the tolerance and the noise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "bench" / "compare.py")
compare_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_module)


def results(tmp_path: Path, name: str, rows: list[tuple[str, int, float, float]]) -> Path:
    """A results file with one 'auto' and one 'kernel' row per (direction, block, gbps,
    wall_gbps)."""
    body = []
    for direction, block, gbps, wall in rows:
        for method in ("auto", "kernel"):
            body.append(
                {
                    "scenario": "blocks",
                    "direction": direction,
                    "block_bytes": block,
                    "count": 64,
                    "memory": "torch",
                    "method": method,
                    "chose": "kernel",
                    "gbps": gbps,
                    "wall_gbps": wall,
                }
            )
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"meta": {}, "rows": body}))
    return path


def test_a_gpu_time_change_beyond_tolerance_and_noise_is_flagged(tmp_path):
    before = [
        results(tmp_path, "b1", [("h2d", 4096, 50.0, 48.0), ("d2h", 4096, 50.0, 48.0)]),
        results(tmp_path, "b2", [("h2d", 4096, 50.2, 46.0), ("d2h", 4096, 50.1, 47.0)]),
    ]
    after = [
        results(tmp_path, "a1", [("h2d", 4096, 45.0, 44.0), ("d2h", 4096, 50.0, 45.0)]),
        results(tmp_path, "a2", [("h2d", 4096, 45.1, 44.5), ("d2h", 4096, 50.3, 49.0)]),
    ]
    lines, beyond = compare_module.compare(before, after, "auto", 0.03)
    assert beyond == 1
    h2d = next(line for line in lines if line.startswith("h2d 4096"))
    assert "0.899" in h2d and "beyond noise" in h2d  # (45.05 / 50.1)
    d2h = next(line for line in lines if line.startswith("d2h 4096"))
    assert "1.002" in d2h and "noise" not in d2h.split("/")[-1] and "beyond" not in d2h
    assert lines[-1].endswith("noise: 1")
    assert compare_module.main(["--before", *map(str, before), "--after", *map(str, after)]) == 1


def test_a_change_within_the_runs_noise_is_not_flagged(tmp_path):
    before = [
        results(tmp_path, "b1", [("h2d", 4096, 50.0, 48.0)]),
        results(tmp_path, "b2", [("h2d", 4096, 40.0, 48.0)]),
    ]  # 20% noise
    after = [
        results(tmp_path, "a1", [("h2d", 4096, 44.0, 48.0)]),
        results(tmp_path, "a2", [("h2d", 4096, 42.0, 48.0)]),
    ]
    lines, beyond = compare_module.compare(before, after, "auto", 0.03)
    assert beyond == 0 and "(noise)" in lines[1]
    assert compare_module.main(["--before", *map(str, before), "--after", *map(str, after)]) == 0
