"""The benchmark's compute-beside-copies scenarios alone (one GPU): paired matmul
slowdown beside continuous 16 KiB copies, and a serving step (store + load beside
the matmul). python3 scripts/serving_probe.py"""
from __future__ import annotations

import json
import traceback

from kvcopy.bench import serving


def show(rows) -> None:
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)


if __name__ == "__main__":
    for scenario in (serving.compute_slowdown, serving.serving_step):
        try:
            show(scenario())
        except Exception:  # noqa: BLE001 - a probe reports and goes on
            traceback.print_exc()
