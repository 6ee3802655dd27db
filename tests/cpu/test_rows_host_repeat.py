"""copy_rows with host indices, repeated between layouts that hold their memory: the
call after the first checks the new indices, uploads them and launches the first
call's jobs, its memory not classified and the policy not asked again; every byte
lands where the indices say (the kernel emulated on host memory,
helpers.rows_fakes.RowsOnHostMemory). Bad indices, layouts sharing memory, memory
forgotten and a capturing stream go the whole way, as a first call does."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy.testing import engine
from helpers.rows_fakes import RowsOnHostMemory, emulate_on_host_memory

torch = pytest.importorskip("torch")

STREAM = 0x1234
SLOTS, ROW = 64, 256


@pytest.fixture
def emulated(seams):
    """The driver and the layout kernel emulated on host memory; a GPU-side cache (its
    memory classified as the GPU's) and a host-side one, both torch tensors."""
    gpu = torch.arange(2 * SLOTS * ROW, dtype=torch.int32).to(torch.uint8).reshape(2, SLOTS, ROW)
    host = torch.zeros(2, SLOTS, ROW, dtype=torch.uint8)
    fake = RowsOnHostMemory([gpu.numpy()])
    emulate_on_host_memory(seams, fake)
    engine.rows_memo.forget()
    return fake, gpu, host


def layouts(gpu, host):
    return kvcopy.Layout.of(gpu, planes=(0,), slot=1), kvcopy.Layout.of(host, planes=(0,), slot=1)


def launches(fake) -> int:
    return sum(1 for call in fake.calls if call[0] == "launch")


def test_repeated_calls_move_each_calls_rows_and_classify_once(emulated, plans):
    fake, gpu, host = emulated
    src, dst = layouts(gpu, host)
    rng = np.random.default_rng(0)
    for call in range(5):
        host.zero_()
        a = torch.from_numpy(rng.choice(SLOTS, 12, replace=False))
        b = torch.from_numpy(rng.choice(SLOTS, 12, replace=False))
        assert kvcopy.copy_rows(src, dst, a, b, stream=STREAM) == "kernel"
        want = torch.zeros_like(host)
        want[:, b] = gpu[:, a]
        assert torch.equal(host, want), f"call {call}"
    assert fake.classified == 2  # (each side once, by the first call)
    assert plans[0] == 1 and launches(fake) == 5
    assert kvcopy.last_decision().method == "kernel"


def test_a_repeat_with_one_side_by_row_number_moves_those_rows(emulated):
    fake, gpu, host = emulated
    src, dst = layouts(gpu, host)
    for slots in ([5, 9, 2], [7, 1, 3]):
        host.zero_()
        kvcopy.copy_rows(src, dst, torch.tensor(slots), stream=STREAM)
        assert torch.equal(host[:, :3], gpu[:, slots]) and not host[:, 3:].any()
    assert fake.classified == 2


def test_bad_indices_after_a_repeat_are_refused_as_at_first(emulated):
    fake, gpu, host = emulated
    src, dst = layouts(gpu, host)
    kvcopy.copy_rows(src, dst, torch.tensor([1, 2]), torch.tensor([3, 4]), stream=STREAM)
    kvcopy.copy_rows(src, dst, torch.tensor([1, 2]), torch.tensor([3, 4]), stream=STREAM)
    before = launches(fake)
    with pytest.raises(ValueError, match=r"src_indices\[1\] = 500 is out of range"):
        kvcopy.copy_rows(src, dst, torch.tensor([1, 500]), torch.tensor([3, 4]), stream=STREAM)
    with pytest.raises(ValueError, match="dst_indices: rows 0 and 1 both write slot 4"):
        kvcopy.copy_rows(src, dst, torch.tensor([1, 2]), torch.tensor([4, 4]), stream=STREAM)
    assert launches(fake) == before
    kvcopy.copy_rows(src, dst, torch.tensor([6, 7]), torch.tensor([8, 9]), stream=STREAM)
    assert torch.equal(host[:, [8, 9]], gpu[:, [6, 7]])


def test_negative_indices_skip_their_rows_in_a_repeat(emulated):
    fake, gpu, host = emulated
    src, dst = layouts(gpu, host)
    kvcopy.copy_rows(src, dst, torch.tensor([1, 2]), torch.tensor([3, 4]), stream=STREAM)
    host.zero_()
    kvcopy.copy_rows(src, dst, torch.tensor([5, -1]), torch.tensor([6, 7]), stream=STREAM)
    assert torch.equal(host[:, 6], gpu[:, 5]) and not host[:, 7].any()
    assert fake.classified == 2


def test_layouts_that_share_memory_are_planned_at_every_call(emulated, plans):
    fake, gpu, _ = emulated
    whole = kvcopy.Layout.of(gpu, planes=(0,), slot=1)
    first = kvcopy.Layout.of(gpu[:, :32], planes=(0,), slot=1)
    second = kvcopy.Layout.of(gpu[:, 32:], planes=(0,), slot=1)
    for _ in range(3):
        kvcopy.copy_rows(whole, first, torch.tensor([40, 41]), torch.tensor([0, 1]), stream=STREAM)
    assert torch.equal(gpu[:, [0, 1]], gpu[:, [40, 41]])
    assert plans[0] == 3  # (any indices could make a row read what another writes)
    with pytest.raises(ValueError, match="a row reads bytes another row writes"):
        kvcopy.copy_rows(whole, first, torch.tensor([0, 1]), torch.tensor([1, 2]), stream=STREAM)
    for _ in range(3):
        kvcopy.copy_rows(first, second, torch.tensor([2]), torch.tensor([3]), stream=STREAM)
    assert plans[0] == 5  # (apart: the first call planned, the rest repeated)


def test_memory_forgotten_is_classified_again(emulated, plans):
    fake, gpu, host = emulated
    src, dst = layouts(gpu, host)
    kvcopy.copy_rows(src, dst, torch.tensor([1]), torch.tensor([2]), stream=STREAM)
    engine.kept_memory.forget()  # (as kvcopy.register does when it unregisters)
    kvcopy.copy_rows(src, dst, torch.tensor([1]), torch.tensor([2]), stream=STREAM)
    assert fake.classified == 4 and plans[0] == 2


def test_a_repeat_on_a_capturing_stream_enqueues_nothing_and_hands_the_call_back(emulated):
    fake, gpu, host = emulated
    src, dst = layouts(gpu, host)
    kvcopy.copy_rows(src, dst, torch.tensor([1]), torch.tensor([2]), stream=STREAM)
    found = engine.rows_memo.entry(src, dst)
    assert isinstance(found.repeat, engine.rows.HostRepeat)
    fake.capturing = 1
    calls = len(fake.calls)
    indices = engine.rows.Indices(1, host=np.array([3]))
    assert found.repeat(indices, indices) is None
    assert len(fake.calls) == calls


def test_another_row_count_or_stream_is_planned_afresh(emulated, plans):
    fake, gpu, host = emulated
    src, dst = layouts(gpu, host)
    kvcopy.copy_rows(src, dst, torch.tensor([1]), torch.tensor([2]), stream=STREAM)
    kvcopy.copy_rows(src, dst, torch.tensor([1, 3]), torch.tensor([2, 4]), stream=STREAM)
    kvcopy.copy_rows(src, dst, torch.tensor([1, 3]), torch.tensor([2, 4]), stream=STREAM + 0x1000)
    assert plans[0] == 3
    assert fake.classified == 2  # (the pair's memory is kept: the plans found it)
    assert torch.equal(host[:, [2, 4]], gpu[:, [1, 3]])
    assert launches(fake) == 3


def test_a_repeat_by_row_number_on_both_sides_uploads_nothing(emulated, plans):
    fake, gpu, host = emulated
    src, dst = layouts(gpu, host)
    for _ in range(3):
        host.zero_()
        kvcopy.copy_rows(src, dst, rows=5, stream=STREAM)
        assert torch.equal(host[:, :5], gpu[:, :5]) and not host[:, 5:].any()
    assert plans[0] == 1 and launches(fake) == 3
    assert not any(call[0] == "upload" for call in fake.calls)
