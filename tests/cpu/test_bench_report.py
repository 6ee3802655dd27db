"""Benchmark output on the CPU: JSON, CSV and the plot from synthetic rows; no-GPU exit."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
import sys

import pytest

from kvcopy.testing import engine

decide = engine.decide
from kvcopy_bench import report


def rows():
    out = []
    for direction in ("h2d", "d2h", "d2d"):
        for block in (4096, 16384, 1 << 20):
            for method, gbps in (("contiguous", 55.0), ("auto", 50.0), ("batch", 20.0)):
                scale = 40 if direction == "d2d" else 1
                out.append(
                    {
                        "direction": direction,
                        "block_bytes": block,
                        "memory": "torch",
                        "method": method,
                        "gbps": gbps * scale,
                        "wall_gbps": gbps * scale * (0.2 if method == "batch" else 0.9),
                    }
                )
    return out


def test_json_and_csv_round_trip(tmp_path):
    data = rows()
    report.write_json(tmp_path / "r.json", {"device": "fake"}, data, {"scenarios": {}})
    report.write_csv(tmp_path / "r.csv", data)
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == data
    with (tmp_path / "r.csv").open() as fh:
        back = list(csv.DictReader(fh))
    assert len(back) == len(data) and back[0]["method"] == "contiguous"


def test_plot_has_a_panel_per_direction(tmp_path):
    pytest.importorskip("matplotlib")
    assert report.plot(tmp_path / "r.png", rows(), "fake")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("bench", [["run.py", "--quick"], ["layouts.py"]])
def test_bench_without_gpu_says_so_and_fails(bench):
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    script = Path(__file__).resolve().parents[2] / "bench" / bench[0]
    out = subprocess.run([sys.executable, str(script), *bench[1:]], capture_output=True, text=True)
    assert out.returncode == 2
    assert "no CUDA GPU found" in out.stderr or "torch is needed" in out.stderr


def test_block_pairs_are_distinct_ids_in_range():
    from kvcopy_bench.workloads import block_pairs

    pairs = block_pairs(2048, 1024, seed=3)
    assert pairs.shape == (1024, 2)
    for column in pairs.T:
        assert len(set(column.tolist())) == 1024 and column.min() >= 0 and column.max() < 2048


def test_bench_variants_set_config_settings_only_meanwhile():
    import kvcopy
    from kvcopy_bench import beside

    before = kvcopy.config.stores_by_dma
    with beside.settings({"stores_by_dma": not before, "method": "auto"}) as options:
        assert options == {"method": "auto"}
        assert kvcopy.config.stores_by_dma is (not before)
    assert kvcopy.config.stores_by_dma is before
    with pytest.raises(RuntimeError):
        with beside.settings({"stores_by_dma": not before}):
            raise RuntimeError("a failing variant")
    assert kvcopy.config.stores_by_dma is before
    bulk_before = kvcopy.config.bulk_stores, kvcopy.config.bulk_ctas
    with beside.settings({"bulk_stores": False, "bulk_ctas": 8, "max_ctas": 2}) as options:
        assert options == {"max_ctas": 2}
        assert (kvcopy.config.bulk_stores, kvcopy.config.bulk_ctas) == (False, 8)
    assert (kvcopy.config.bulk_stores, kvcopy.config.bulk_ctas) == bulk_before


def test_pools_scatter_copies_between_distinct_slots_of_both_pools():
    """Pools.scattered (what the benchmark and the probes copy): every copy starts at
    a block boundary inside its pool, no slot twice, and the same seed gives the
    same batch."""
    import numpy as np

    from kvcopy_bench.scenarios import Pools

    class Buffer:
        def __init__(self, address: int) -> None:
            self.address = address

        def data_ptr(self) -> int:
            return self.address

    pools = Pools.__new__(Pools)  # no GPU: only the two base addresses are used
    pools.src, pools.dst = Buffer(0x10000), Buffer(0x7F0000000000)
    block, count = 4096, 100
    src, dst, sizes = pools.scattered(block, count, 3)
    assert src.dtype == dst.dtype == sizes.dtype == np.uint64
    assert (sizes == block).all() and len(src) == len(dst) == count
    for ptrs, base in ((src, 0x10000), (dst, 0x7F0000000000)):
        slots = (ptrs - np.uint64(base)) // np.uint64(block)
        assert ((ptrs - np.uint64(base)) % np.uint64(block) == 0).all()
        assert len(set(slots.tolist())) == count and slots.max() < 2 * count
    again = pools.scattered(block, count, 3)
    assert all((a == b).all() for a, b in zip((src, dst, sizes), again))


@pytest.mark.parametrize(
    "decision, copier",
    [(("kernel", "bulk"), "bulk"), (("kernel", "registers"), "registers"), (("batch", ""), ""), (None, "")],
)
def test_rows_name_the_copier_only_where_the_kernel_ran(decision, copier):
    from kvcopy_bench.scenarios import last_copier, last_method
    from kvcopy.policy import Decision

    made = Decision(decision[0], "faked", decision[1]) if decision else None
    decide.note_decision(made)
    assert last_copier() == copier
    assert last_method() == (decision[0] if decision else "")


def test_table_prints_the_copier_column(capsys):
    from kvcopy_bench.cli import print_table

    row = {
        "direction": "d2h",
        "block_bytes": 16384,
        "memory": "torch",
        "method": "auto",
        "chose": "kernel",
        "copier": "bulk",
        "gbps": 51.5,
        "fraction_of_ceiling": 0.94,
        "wall_gbps": 50.0,
        "cpu_us": 30.0,
    }
    print_table([row, dict(row, method="batch", chose="batch", copier="")], {})
    header, bulk, batch = capsys.readouterr().out.splitlines()
    assert header.split()[5] == "copier"
    assert bulk.split()[5] == "bulk" and bulk.split()[6] == "51.5"
    assert batch.split()[3:6] == ["batch", "batch", "51.5"]  # no copier: the column is blank


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--blocks", "0"], "block sizes must be from 1"),
        (["--blocks", "-16"], "block sizes must be from 1"),
        (["--blocks", "16,x"], "KiB integers"),
        (["--blocks", "131072"], "block sizes must be from 1"),
        (["--device", "-1"], "at least 0"),
        (["--device", "gpu"], "GPU index"),
    ],
)
def test_the_benchmark_refuses_bad_arguments_before_measuring(argv, message, capsys, tmp_path):
    from kvcopy_bench.cli import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(argv + ["--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_benchmark_refuses_an_output_folder_it_cannot_write_before_measuring(tmp_path, capsys):
    from kvcopy_bench.cli import make_out, parse_args

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--out", str(blocker)])
    assert exit_.value.code == 2 and "not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        make_out(blocker / "out")
    assert exit_.value.code == 2 and "cannot write there" in capsys.readouterr().err


def test_without_a_gpu_the_benchmark_exits_2_and_makes_no_output_folder(tmp_path, capsys):
    from kvcopy_bench.cli import main

    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is here: the benchmark would run")
    except ImportError:
        pass
    with pytest.raises(SystemExit) as exit_:
        main(["--quick", "--out", str(tmp_path / "new")])
    assert exit_.value.code == 2
    assert not (tmp_path / "new").exists()


def test_every_benchmark_flag_has_help():
    import argparse
    from kvcopy_bench import cli

    parser_actions = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, *a, **k):
        parser_actions.extend(self._actions)
        return real(self, *a, **k)

    argparse.ArgumentParser.parse_args = capture
    try:
        cli.parse_args(["--quick", "--out", "/tmp/kvcopy-bench-help-test"])
    finally:
        argparse.ArgumentParser.parse_args = real
    assert parser_actions and all(a.help for a in parser_actions)


def test_results_record_where_and_with_what_they_were_measured():
    pytest.importorskip("torch")
    import datetime

    import kvcopy
    from kvcopy_bench.cli import SCHEMA_VERSION, run_metadata

    meta = run_metadata("Some GPU", 1)
    assert meta["schema_version"] == SCHEMA_VERSION and meta["device"] == "Some GPU"
    assert meta["device_index"] == 1 and meta["kvcopy"] == kvcopy.__version__
    assert meta["torch"] and set(meta) >= {
        "driver_version",
        "driver",
        "cuda_runtime",
        "kvcopy_commit",
        "python",
        "date",
    }
    assert datetime.datetime.fromisoformat(meta["date"]).tzinfo is not None
    json.dumps(meta)  # it goes into results.json as it is
