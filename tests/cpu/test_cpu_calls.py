"""bench/cpu_calls.py, the steady-state calls with the driver layer faked: every row
runs on the CPU, and what a steady call asks of the driver layer is what the
benchmark reports."""

from __future__ import annotations

import cpu_calls  # bench/cpu_calls.py (tests/conftest.py puts bench/ on the path)
import pytest

import kvcopy


TORCH_ROWS = 5 * bool(cpu_calls.torch_stand_ins())  # (rows of torch tensors where torch is)


@pytest.fixture(scope="module")
def faked():
    pools, stand_ins = cpu_calls.host_pools(), cpu_calls.torch_stand_ins()
    host = cpu_calls.FakeHost(pools, cpu_calls.device_stand_ins(stand_ins))
    with host.standing_in():
        yield host, dict(cpu_calls.rows(host, pools, stand_ins))


def steady(host, call):
    """What the second of two calls asked of the driver layer."""
    call()
    host.counts.clear()
    call()
    return dict(host.counts)


def test_every_row_runs_with_the_driver_layer_faked(faked):
    host, calls = faked
    assert len(calls) == 8 + TORCH_ROWS
    for label, call in calls.items():
        assert steady(host, call), label  # (each reaches the driver layer: a copy is issued)


def test_a_vllm_job_of_one_fragment_runs_is_one_described_batch_and_one_launch(faked):
    host, calls = faked
    asked = steady(host, calls["vLLM CopyBackend.submit, 64 planes x 8 blocks"])
    assert asked.pop("describe.describe_copies") == 1
    assert asked.pop("launch.launch_descs_inline") == 1
    assert not any("rows" in name or "classify" in name for name in asked), asked


def test_copy_rows_repeated_with_gpu_indices_asks_for_its_launch_only(faked):
    """Its launch, and (where the traffic window notes a copy between the GPU and the
    host) whether the stream captures: nothing else of the driver layer."""
    host, calls = faked
    asked = steady(host, calls["copy_rows 256 rows, GPU indices"])
    assert asked.pop("rows.RowsLaunches.launch") == 1
    assert asked in ({}, {"driver.stream_capture_status": 1})


def test_swap_blocks_of_one_pair_is_one_dma_call(faked):
    """One pair goes to the copy engines as one cuMemcpyAsync: no describe pass, no
    launch, nothing uploaded (a view made at each call: read, classified and planned
    each time)."""
    host, _ = faked
    src, dst = cpu_calls.GpuArray((64, 2048), cpu_calls.DEVICE_BASE), cpu_calls.host_pools()[-1]
    asked = steady(host, lambda: kvcopy.swap_blocks(src, dst[:64], [[3, 5]], stream=0x7F00_1234))
    assert asked["dma.memcpy_loop"] == 1
    assert not {"describe.describe_copies", "launch.upload", "rows.RowsLaunches"} & set(asked)


@pytest.mark.parametrize(
    "row", ["swap_blocks 1 pair, 1 tensor a side", "swap_blocks 1 pair, 1 torch tensor a side"]
)
def test_a_repeated_swap_blocks_of_one_block_copy_is_one_compiled_call(faked, row):
    """Over torch tensors or arrays whose reads are kept, the steady call enters the
    stream's context and makes the one DMA call (dma.BlockCopyAgain): no pointer query,
    no classification, no plan."""
    if "torch" in row and not TORCH_ROWS:
        pytest.skip("torch is not installed")
    host, calls = faked
    asked = steady(host, calls[row])
    assert asked == {"driver.enter_for_repeat": 1, "dma.BlockCopyAgain()": 1}


@pytest.mark.parametrize(
    "row",
    [
        "swap_blocks 1 pair, 32 tensors a side",
        "swap_blocks 1 pair, 32 torch tensors a side",
        "copy_rows 32 rows, host indices, torch layouts",
        "SGLang transfer_kv_per_layer, 32 host indices",
    ],
)
def test_a_repeated_layout_kernel_call_with_few_host_indices_is_its_launch_and_fence(faked, row):
    """Its host indices written where the kernel reads them (no upload), its launch and
    the ring slot's event record, in the context the repeat entered: nothing else of the
    driver layer."""
    if "torch" in row or "SGLang" in row:
        if not TORCH_ROWS:
            pytest.skip("torch is not installed")
    host, calls = faked
    asked = steady(host, calls[row])
    assert asked == {"driver.enter_for_repeat": 1, "driver.event_record": 1, "rows.RowsLaunches.launch": 1}


@pytest.mark.parametrize(
    "row", ["swap_blocks 4096 pairs, 64 tensors a side", "swap_blocks 4096 pairs, 64 torch tensors a side"]
)
def test_a_repeated_swap_blocks_of_chunked_ids_builds_no_launches(faked, row):
    """4,096 pairs over 64 arrays or torch tensors a side: two chunks of ids, each
    uploaded on a side stream the launch waits for, each launched by the launches the
    first call built."""
    if "torch" in row and not TORCH_ROWS:
        pytest.skip("torch is not installed")
    host, calls = faked
    asked = steady(host, calls[row])
    assert "rows.RowsLaunches" not in asked
    assert (
        asked["rows.RowsLaunches.launch"] == asked["launch.upload"] == asked["driver.stream_wait_stream"] == 2
    )
    assert not any("classify" in name or "describe" in name for name in asked), asked


def test_the_benchmark_prints_a_row_for_every_call(capsys):
    assert cpu_calls.main(["--calls", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 8 + TORCH_ROWS and not any("failed" in line for line in lines)


def test_the_path_of_a_call_lists_each_stretch_in_one_module_once():
    from kvcopy import Layout

    path = cpu_calls.module_path(lambda: Layout.from_pointers([4096, 8192], slots=4, row_bytes=64))
    assert path[0] == "kvcopy.layouts" and "kvcopy.arguments" in path
    assert all(a != b for a, b in zip(path, path[1:]))  # (one stop per stretch)
    assert cpu_calls.module_path(lambda: None) == []


def test_a_repeated_copy_rows_with_gpu_indices_takes_a_short_path(faked):
    host, calls = faked
    call = calls["copy_rows 256 rows, GPU indices"]
    call()
    path = cpu_calls.module_path(call)
    assert path[0] == "kvcopy.rows" and len(path) < 30  # (the figure docs/performance.md quotes: 19)


def test_the_benchmark_times_each_read_of_a_torch_tensor(capsys):
    pytest.importorskip("torch")
    assert cpu_calls.main(["--reads", "--calls", "1000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == ["data_ptr()", "shape", "stride()", "dtype", "_version"]
    assert all(float(line.split()[3]) > 0 for line in lines)


def test_one_copy_of_reachable_memory_goes_to_the_copy_engines_as_given(faked):
    """One copy the device reaches (its memory classified by the describe pass) is not
    planned for the copy engines again (nothing to merge, no pageable pointer to check);
    two copies, or one of pageable memory, are."""
    import numpy as np

    import kvcopy

    host, _ = faked
    pinned = cpu_calls.host_pools()[0]  # (not among the faked pools: pageable to it)
    gpu = np.array([cpu_calls.DEVICE_BASE], np.uint64)
    size = np.array([2048], np.uint64)
    pool = host.ranges[-1]  # (pinned: the last pool FakeHost answers for)
    one = np.array([pool[0]], np.uint64)
    assert (
        steady(host, lambda: kvcopy.copy_batch(gpu, one, size, stream=0x7F00_1234, method="loop"))[
            "dma.memcpy_loop"
        ]
        == 1
    )
    assert "dma.plan_dma" not in host.counts
    two = (
        np.array([cpu_calls.DEVICE_BASE, cpu_calls.DEVICE_BASE + 4096], np.uint64),
        np.full(2, 2048, np.uint64),
    )
    steady(
        host,
        lambda: kvcopy.copy_batch(
            two[0], np.array([pool[0], pool[0] + 4096], np.uint64), two[1], stream=0x7F00_1234, method="loop"
        ),
    )
    assert host.counts["dma.plan_dma"] == 1
    pageable = np.array([pinned.ctypes.data], np.uint64)
    steady(host, lambda: kvcopy.copy_batch(gpu, pageable, size, stream=0x7F00_1234, method="loop"))
    assert host.counts["dma.plan_dma"] == 1


@pytest.mark.parametrize(
    "options, recorded",
    [
        ({}, 1),
        ({"method": "loop"}, 0),  # (asked for: the record's key is 'auto' or 'kernel')
        ({"max_ctas": 4}, 0),
        ({"allow_batch": False}, 0),
    ],
)
def test_a_copy_engine_batch_is_recorded_for_the_replay_where_it_may_replay(
    faked, monkeypatch, options, recorded
):
    """copy_batch of one copy of pinned to device memory by one cuMemcpyAsync: recorded
    (kvcopy._engine.replay.record_copies) so that the next like it goes to its copy at
    once, only where a replay may take it."""
    import numpy as np

    import kvcopy
    from kvcopy.testing import engine

    host, _ = faked
    taken = []
    monkeypatch.setattr(engine.replay, "record_copies", lambda target, batch, method: taken.append(method))
    pinned = host.ranges[-1][0]  # (the last pool FakeHost answers for: pinned)
    s, d, z = (np.array([value], np.uint64) for value in (pinned, cpu_calls.DEVICE_BASE, 2048))
    assert kvcopy.copy_batch(s, d, z, stream=0x7F00_1234, **options) == "loop"
    assert taken == ["auto"] * recorded
    pageable = np.array([cpu_calls.host_pools()[0].ctypes.data], np.uint64)  # (not faked: pageable)
    assert kvcopy.copy_batch(pageable, d, z, stream=0x7F00_1234, **options) in ("loop", "batch")
    assert taken == ["auto"] * recorded  # (pageable memory: planned for the copy engines each call)
