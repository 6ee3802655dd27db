"""vLLM's strided runs as layout pairs (kvcopy.compat.vllm.run_groups), run between host
arrays against an oracle that copies each fragment of each run; vLLM's copy backend and
adapter interfaces, their order of transfers and their refusals (their bytes are checked
on a GPU: tests/gpu/test_gpu_compat_layouts.py)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import kvcopy
from kvcopy.compat.vllm import CopyBackend, CopyBackendAdapter, CopyRunDescriptor as Run
from kvcopy.compat.vllm import run_groups
from kvcopy.testing import plans
from helpers.host_copies import random_bytes, run_on_host


def _assert_fragments_moved(runs, src, dst):
    """dst (zeros before) holds every fragment of every run from src, and nothing else."""
    s, d = src.ctypes.data, dst.ctypes.data
    want = np.zeros_like(dst)
    for run in runs:
        src_base, dst_base, size, count, src_stride, dst_stride = run
        for j in range(count):
            lo, to = src_base - s + j * src_stride, dst_base - d + j * dst_stride
            want[to : to + size] = src[lo : lo + size]
    np.testing.assert_array_equal(dst, want)


def test_runs_of_several_shapes_move_every_fragment():
    src = random_bytes((1 << 16,), 1)
    dst = np.zeros(1 << 16, np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    runs = [
        Run(s, d, 512, 4, 512, 4096),
        Run(s + 2048, d + 512, 512, 4, 512, 4096),
        (s + 8192, d + 20000, 128, 7, 1024, 136),
        Run(s + 30000, d + 40000, 64, 0, 64, 64),
        Run(s + 40000, d + 50000, 512, 4, 512, 4096),
    ]
    groups = run_groups(runs)
    assert [(g[0].num_planes, g[2]) for g in groups] == [(3, 4), (1, 7)]
    for a, b, count in groups:
        run_on_host(*plans.expand(plans.plan_rows(a, b, rows=count)))
    _assert_fragments_moved(runs, src, dst)


@pytest.mark.parametrize(
    "run, error, words",
    [
        ((64, 64, 8), TypeError, "run_descs[0]: 3 fields"),
        ("abcdef", TypeError, "run_descs[0]: not a CopyRunDescriptor"),
        ((0, 64, 8, 1, 8, 8), ValueError, "run_descs[0]: {'src_base': 0"),
        ((64, 64, 8, 1, -8, 8), ValueError, "is not a run"),
        # never truncated or parsed into an address or a size
        ((64, 64, 16.7, 1, 8, 8), TypeError, "fragment_size is a float (16.7)"),
        (Run(64, 64, 16, "2", 8, 8), TypeError, "num_fragments is a str ('2')"),
        ((64, 64, 16, 1, 8, np.float64(8)), TypeError, "dst_stride is a float64"),
    ],
)
def test_bad_runs_are_named(run, error, words):
    with pytest.raises(error) as info:
        run_groups([run])
    assert words in str(info.value)


def _parameters(function) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name) for p in inspect.signature(function).parameters.values()]


def test_the_backend_and_the_adapter_take_vllms_arguments():
    assert _parameters(CopyBackend) == [("is_src_access_order_any", "KEYWORD_ONLY")]
    assert _parameters(CopyBackend.submit) == [
        ("self", "POSITIONAL_OR_KEYWORD"),
        ("run_descs", "POSITIONAL_OR_KEYWORD"),
        ("stream", "KEYWORD_ONLY"),  # (kvcopy's: None is vLLM's call)
    ]
    assert _parameters(CopyBackend.finish_transfer) == [("self", "POSITIONAL_OR_KEYWORD")]
    assert [name for name, _ in _parameters(CopyBackendAdapter)] == [
        "layer_refs_per_group",
        "gpu_to_cpu",
        "host_memory_is_pinned",
        "copy_runs",
    ]
    assert _parameters(CopyBackendAdapter.submit)[1:] == [
        ("job_id", "POSITIONAL_OR_KEYWORD"),
        ("run_descs", "POSITIONAL_OR_KEYWORD"),
        ("is_src_access_order_any", "KEYWORD_ONLY"),
    ]
    assert [name for name, _ in _parameters(CopyBackendAdapter.finish_transfer)] == ["self", "job_id"]


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_the_adapter_orders_sources_as_vllm_does(gpu_to_cpu):
    adapter = CopyBackendAdapter(
        layer_refs_per_group=[[object()]], gpu_to_cpu=gpu_to_cpu, host_memory_is_pinned=True, copy_runs=None
    )
    assert adapter.backend.is_src_access_order_any is (not gpu_to_cpu)
    assert CopyBackendAdapter.resolve([], gpu_to_cpu).is_src_access_order_any is (not gpu_to_cpu)


def test_the_adapter_finishes_jobs_in_submission_order():
    adapter = CopyBackendAdapter(gpu_to_cpu=True)
    adapter.submit(7, [])  # no fragment: nothing to enqueue
    adapter.submit(8, [Run(4096, 8192, 512, 0, 512, 512)], is_src_access_order_any=False)
    assert adapter.backend.in_flight == 2
    with pytest.raises(RuntimeError, match=r"finish_transfer\(8\): .* job 7 is the oldest"):
        adapter.finish_transfer(8)
    adapter.finish_transfer(7)
    assert adapter.backend.in_flight == 1
    adapter.clear()
    assert adapter.backend.in_flight == 0
    with pytest.raises(RuntimeError, match=r"finish_transfer\(8\): .* no job is the oldest"):
        adapter.finish_transfer(8)
    backend = CopyBackend()
    backend.submit([])
    backend.finish_transfer()
    with pytest.raises(RuntimeError, match="no transfer is in flight"):
        backend.finish_transfer()


def test_a_submit_that_raises_records_no_transfer():
    torch = pytest.importorskip("torch")
    adapter = CopyBackendAdapter(gpu_to_cpu=False)
    src, dst = random_bytes((4096,), 2), np.zeros(4096, np.uint8)
    good = Run(src.ctypes.data, dst.ctypes.data, 128, 4, 256, 128)
    with pytest.raises(TypeError, match=r"run_descs\[1\]: 3 fields"):
        adapter.submit(1, [good, (1, 2, 3)])
    with pytest.raises(TypeError, match="is_src_access_order_any must be True or False"):
        adapter.submit(1, [good], is_src_access_order_any="yes")
    if not torch.cuda.is_available():
        with pytest.raises(kvcopy.NoDriverError, match="CopyBackend.submit copies on torch's"):
            adapter.submit(1, [good])
    assert adapter.backend.in_flight == 0
    with pytest.raises(RuntimeError, match="no job is the oldest"):
        adapter.finish_transfer(1)
    np.testing.assert_array_equal(dst, 0)


def test_no_group_is_copied_where_a_later_group_is_refused():
    from kvcopy.testing import rows_on_host

    src, dst = random_bytes((4096,), 5), np.zeros(4096, np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    good = Run(s, d, 128, 4, 256, 128)
    crossing = Run(d + 2048, d + 2080, 64, 2, 64, 64)  # row 0 writes what row 1 reads
    adapter = CopyBackendAdapter(gpu_to_cpu=True)
    with rows_on_host(), pytest.raises(ValueError, match="a row reads bytes another row writes"):
        adapter.submit(1, [good, crossing])
    np.testing.assert_array_equal(dst, 0)
    assert adapter.backend.in_flight == 0
    with rows_on_host():
        adapter.submit(2, [good])
    np.testing.assert_array_equal(dst[:512], np.concatenate([src[j * 256 : j * 256 + 128] for j in range(4)]))


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: CopyBackend(is_src_access_order_any=1), "is_src_access_order_any must be True"),
        (lambda: CopyBackendAdapter(gpu_to_cpu="no"), "gpu_to_cpu must be True or False"),
        (lambda: CopyBackendAdapter(host_memory_is_pinned=None), "host_memory_is_pinned must be"),
    ],
)
def test_bad_flags_are_named(make, words):
    with pytest.raises(TypeError, match=words):
        make()


def test_the_backend_moves_every_fragment_of_its_runs():
    from kvcopy.testing import rows_on_host

    src = random_bytes((1 << 14,), 8)
    dst = np.zeros(1 << 14, np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    runs = [Run(s + 64 * k, d + 4000 + 512 * k, 64, 5, 1024, 96) for k in range(3)]
    runs.append(Run(s + 9000, d + 100, 24, 9, 40, 24))
    adapter = CopyBackendAdapter(gpu_to_cpu=True)
    with rows_on_host():
        adapter.submit(1, runs)
    adapter.finish_transfer(1)
    _assert_fragments_moved(runs, src, dst)


def test_submit_plans_each_shape_of_run_once(monkeypatch):
    from kvcopy.compat import vllm as compat_vllm
    from kvcopy.testing import rows_on_host

    src = random_bytes((1 << 14,), 3)
    dst = np.zeros(1 << 14, np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    runs = [
        Run(s, d, 256, 4, 512, 256),
        Run(s + 4096, d + 2048, 96, 3, 200, 96),
        Run(s + 8192, d + 4096, 256, 4, 512, 256),
        Run(s + 12000, d + 8000, 40, 5, 48, 40),
    ]
    planned = []
    real = compat_vllm.plan_rows

    def counting(src_layout, dst_layout, a, b, rows):
        planned.append(rows)
        return real(src_layout, dst_layout, a, b, rows)

    monkeypatch.setattr(compat_vllm, "plan_rows", counting)
    with rows_on_host():
        CopyBackend().submit(runs)
    assert planned == [4, 3, 5]
    _assert_fragments_moved(runs, src, dst)


def _as_lists(groups):
    return [
        (a.bases.tolist(), b.bases.tolist(), a.row_bytes, a.slot_stride, b.slot_stride, n)
        for a, b, n in groups
    ]


def test_runs_read_in_one_pass_group_as_runs_read_one_by_one():
    rng = np.random.default_rng(9)
    shapes = [(512, 16, 512, 4096), (128, 4, 1024, 128), (512, 0, 512, 512)]
    runs = [Run(4096 * (i + 1), 8192 * (i + 1), *shapes[int(rng.integers(3))]) for i in range(300)]

    class Reordered:  # an object with the fields by name, in another order
        def __init__(self, run):
            for name, value in zip(Run._fields, run):
                setattr(self, name, value)

    fast = _as_lists(run_groups(runs))
    assert fast == _as_lists(run_groups([Reordered(r) for r in runs]))
    assert fast == _as_lists(run_groups(tuple(tuple(r) for r in runs)))
    assert [g[5] for g in fast] == [16, 4] or [g[5] for g in fast] == [4, 16]
    assert sum(len(g[0]) for g in fast) == sum(1 for r in runs if r.num_fragments)
    first_shape = next(r for r in runs if r.num_fragments).num_fragments
    assert fast[0][5] == first_shape  # groups in the order first met


def test_a_run_of_seven_fields_among_tuples_is_named():
    runs = [(4096, 8192, 8, 1, 8, 8)] * 3 + [(4096, 8192, 8, 1, 8, 8, 0)]
    with pytest.raises(TypeError, match=r"run_descs\[3\]: 7 fields"):
        run_groups(runs)
    with pytest.raises(ValueError, match=r"run_descs\[1\]: .* is not a run"):
        run_groups([Run(4096, 8192, 8, 1, 8, 8), Run(0, 8192, 8, 1, 8, 8)])


def test_a_run_reading_what_a_run_of_another_shape_writes_is_refused():
    from kvcopy.testing import rows_on_host

    src, dst = random_bytes((4096,), 6), np.zeros(4096, np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    writes = Run(s, d, 128, 2, 128, 128)  # writes dst[0:256]
    reads = Run(d + 64, d + 1024, 64, 2, 64, 64)  # reads dst[64:192]
    twice = Run(s + 512, d + 128, 32, 1, 32, 32)  # writes dst[128:160] again
    adapter = CopyBackendAdapter(gpu_to_cpu=True)
    for runs in ([writes, reads], [writes, twice]):
        with (
            rows_on_host(),
            pytest.raises(ValueError, match="run_descs: runs of shape 0 and of shape 1 .* touch the same"),
        ):
            adapter.submit(1, runs)
    np.testing.assert_array_equal(dst, 0)
    assert adapter.backend.in_flight == 0


def _one_fragment_job(src, dst, rng, blocks=8, planes=6, block=256):
    """A job as vLLM's worker describes one: a run a block and plane, one fragment each."""
    s, d = src.ctypes.data, dst.ctypes.data
    span = src.nbytes // planes
    picks = [
        (rng.choice(span // block, blocks, replace=False), rng.choice(span // block, blocks, replace=False))
    ]
    return [
        Run(s + p * span + int(a) * block, d + p * span + int(b) * block, block, 1, block, block)
        for p in range(planes)
        for a, b in zip(*picks[0])
    ]


def test_a_submit_on_a_named_stream_takes_any_stream_kvcopy_takes():
    from kvcopy.testing import rows_on_host

    src, dst = random_bytes((4096,), 14), np.zeros(4096, np.uint8)
    runs = [Run(src.ctypes.data, dst.ctypes.data + 1024, 256, 1, 256, 256)]
    with rows_on_host():
        CopyBackend().submit(runs, stream=0x7F00_1234)
    _assert_fragments_moved(runs, src, dst)
    with pytest.raises(ValueError, match="stream: handle 7 is not a valid CUstream value"):
        CopyBackend().submit(runs, stream=7)


def test_runs_of_one_fragment_go_as_one_pointer_batch_planned_as_no_rows(monkeypatch):
    from kvcopy.compat import vllm as compat_vllm
    from kvcopy.testing import rows_on_host

    src, dst = random_bytes((6 * 8192,), 12), np.zeros(6 * 8192, np.uint8)
    runs = _one_fragment_job(src, dst, np.random.default_rng(12))
    runs.insert(5, Run(src.ctypes.data, dst.ctypes.data, 256, 0, 256, 256))  # (no fragments)
    batches = []

    def watched(table, stream):
        batches.append(table.shape)
        return on_host(table, stream)

    def no_rows(*args):
        raise AssertionError("planned as rows")

    monkeypatch.setattr(compat_vllm, "plan_rows", no_rows)
    with rows_on_host():
        on_host = compat_vllm._copy_fragments  # (the host's stand-in, every check made)
        compat_vllm._copy_fragments = watched  # (put back before rows_on_host puts back its own)
        try:
            CopyBackend().submit(runs)
        finally:
            compat_vllm._copy_fragments = on_host
    assert batches == [(6, 48)]
    _assert_fragments_moved(runs, src, dst)


def test_one_fragment_runs_that_meet_are_refused_as_rows_refuse_them_and_nothing_moves():
    from kvcopy.testing import rows_on_host

    src, dst = random_bytes((8192,), 13), np.zeros(8192, np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    twice = [Run(s, d, 256, 1, 256, 256), Run(s + 512, d + 128, 256, 1, 256, 256)]
    backend = CopyBackend()
    with rows_on_host(), pytest.raises(ValueError, match=r"dst: its rows overlap \(plane 0 and plane 1"):
        backend.submit(twice)
    np.testing.assert_array_equal(dst, 0)
    assert backend.in_flight == 0
    # runs of one fragment and runs of several in one job: planned as rows, every byte moved
    mixed = [Run(s, d, 256, 1, 256, 256), Run(s + 1024, d + 2048, 128, 3, 256, 128)]
    with rows_on_host():
        backend.submit(mixed)
    _assert_fragments_moved(mixed, src, dst)


@pytest.mark.parametrize(
    "runs",
    [
        [Run(4096, 8192, 8, 1, 8, 8), Run(4096, 8192, True, 1, 8, 8)],  # a bool
        [Run(4096, 8192, 8, 1, 8, 8), Run(4096, 8192, np.int64(8), 1, 8, 8)],  # a NumPy integer
        [Run(4096, 8192, 8, 1, 8, 8), (4096, 8192, 8, 1, 8, 8)],  # two types
        [Run(4096, 8192, 8, 1, 8, 2**63)],  # past int64
        [Run(4096, 8192, 8, 1, 8, -1)],
        [Run(4096, 0, 8, 1, 8, 8)],
    ],
)
def test_the_one_pass_reading_leaves_every_unusual_run_to_the_reading_that_names_it(runs):
    from kvcopy.testing import cuda

    run_table = cuda.plan_arrays.run_table

    assert run_table(runs, type(runs[0])) is None
    good = [Run(4096, 8192, 8, 2, 8, 16), Run(1, 2, 3, 0, 5, 6), (10, 20, 30, 1, 50, 60)]
    assert run_table(good[:2], Run).tolist() == [[4096], [8192], [8], [2], [8], [16]]
    assert run_table(good[2:], tuple).T.tolist() == [[10, 20, 30, 1, 50, 60]]
