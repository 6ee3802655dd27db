"""The benchmark's NIXL stage run on the CPU (both caches in host memory, two real
processes over NIXL's UCX backend on the loopback device): a row for every way, the
bytes checked inside (bench/nixl_two_processes.py asserts them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers.nixl_peer import nixl_installed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install nixl-cu13)")
def test_the_nixl_stage_gives_a_row_for_every_way(monkeypatch):
    from kvcopy_bench import nixl_stage

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "ERROR")
    rows = nixl_stage.nixl_rows(repeats=1, cpu=True, blocks_kib=(2,))  # (32 KiB: seconds on TCP)
    ways = {
        "a descriptor per row (engines)",
        "kvcopy strided descriptors",
        "one contiguous descriptor",
        "kvcopy packed (gather, send, scatter)",
    }
    found = {row["way"]: row for row in rows}
    assert set(found) == ways and all(row["block_bytes"] == 2048 for row in rows)
    assert found["a descriptor per row (engines)"]["descriptors"] == 18880
    assert found["kvcopy strided descriptors"]["descriptors"] == 118
    assert all(row["gbps"] > 0 and row["wall_ms"] > 0 for row in found.values())
