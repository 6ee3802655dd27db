"""bench/signal_latency.py on the CPU: a signal rung in one process is seen in the
other, through the doorbell always and as a NIXL notification where NIXL is installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers.nixl_peer import nixl_installed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_every_doorbell_signal_is_seen_once_rung():
    import signal_latency

    latencies = signal_latency.doorbell_latencies(5)
    assert len(latencies) == 5 and all(0 < x < 10 for x in latencies)


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install nixl-cu13)")
def test_the_benchmark_prints_the_doorbell_beside_a_nixl_notification(capsys, monkeypatch):
    import signal_latency

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "ERROR")
    assert signal_latency.main(["--signals", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("kvcopy doorbell") and lines[2].startswith("NIXL notification (UCX)")
    for line in lines[1:3]:
        assert all(float(figure) > 0 for figure in line.split()[-3:])


def test_the_benchmark_refuses_fewer_than_two_signals():
    import signal_latency

    with pytest.raises(SystemExit):
        signal_latency.main(["--signals", "1"])
