"""swap_blocks repeated over torch tensors whose reads are kept: the call after the first
(as many pairs, the same stream and method) is issued the way the first was, by the
layout kernel or the copy engines, without asking the policy or classifying memory
again, and every block lands where its ids say (the kernel and the copy engines
emulated on host memory, helpers.rows_fakes.RowsOnHostMemory). Another pair count,
stream or setting, memory forgotten, a changed tensor, a capturing stream or the
guard go the whole way, as a first call does."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import testing
from kvcopy.testing import engine
from helpers.rows_fakes import RowsOnHostMemory, emulate_on_host_memory

torch = pytest.importorskip("torch")

STREAM = 0x1234
BLOCKS, BLOCK = 32, 512


@pytest.fixture
def emulated(seams, monkeypatch):
    """GPU-side caches (memory classified as the GPU's) and host-side ones, 4 layers of
    torch tensors a side; yields (fake driver, gpu, host, decisions asked)."""
    gpu = [torch.randint(0, 255, (BLOCKS, BLOCK), dtype=torch.uint8) for _ in range(4)]
    host = [torch.zeros(BLOCKS, BLOCK, dtype=torch.uint8) for _ in range(4)]
    fake = RowsOnHostMemory([t.numpy() for t in gpu])
    emulate_on_host_memory(seams, fake, 1 << 14)
    return fake, gpu, host, counted(monkeypatch, engine.blocks, "decide")


def counted(monkeypatch, module, name: str) -> list[int]:
    """``module.name`` wrapped to count its calls; returns the count, [n]."""
    calls, real = [0], getattr(module, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def pairs(rng, n: int) -> np.ndarray:
    return np.stack([rng.choice(BLOCKS, n, replace=False), rng.choice(BLOCKS, n, replace=False)], axis=1)


def landed(gpu, host, mapping) -> bool:
    return all(torch.equal(h[mapping[:, 1]], g[mapping[:, 0]]) for g, h in zip(gpu, host))


@pytest.mark.parametrize("method", ["kernel", "loop"])
def test_repeated_calls_move_each_calls_blocks_and_ask_the_policy_once(emulated, method):
    fake, gpu, host, asked = emulated
    rng = np.random.default_rng(1)
    for call in range(4):
        for h in host:
            h.zero_()
        mapping = pairs(rng, 5)
        assert kvcopy.swap_blocks(gpu, host, mapping, stream=STREAM, method=method) == method
        assert landed(gpu, host, mapping), f"call {call}"
    assert asked[0] == 1
    assert fake.classified == 2  # (each side once)
    assert kvcopy.last_decision().method == method


def test_another_pair_count_stream_or_setting_asks_the_policy_again(emulated):
    fake, gpu, host, asked = emulated
    one, two = np.array([[1, 2]]), np.array([[3, 4], [5, 6]])
    kvcopy.swap_blocks(gpu, host, one, stream=STREAM)
    kvcopy.swap_blocks(gpu, host, two, stream=STREAM)
    kvcopy.swap_blocks(gpu, host, two, stream=STREAM + 0x1000)
    with testing.settings(host_ctas=3):
        kvcopy.swap_blocks(gpu, host, two, stream=STREAM)
    assert asked[0] == 4
    assert landed(gpu, host, two)


def test_bad_ids_after_a_repeat_are_refused_before_anything_is_issued(emulated):
    fake, gpu, host, asked = emulated
    for _ in range(2):
        kvcopy.swap_blocks(gpu, host, np.array([[1, 2], [3, 4]]), stream=STREAM)
    calls = len(fake.calls)
    with pytest.raises(ValueError, match="source block 99 is out of range"):
        kvcopy.swap_blocks(gpu, host, np.array([[1, 2], [99, 4]]), stream=STREAM)
    with pytest.raises(ValueError, match="both write destination block 4"):
        kvcopy.swap_blocks(gpu, host, np.array([[1, 4], [3, 4]]), stream=STREAM)
    assert len(fake.calls) == calls


def test_a_changed_tensor_or_forgotten_memory_goes_the_whole_way(emulated):
    fake, gpu, host, asked = emulated
    mapping = np.array([[7, 8]])
    kvcopy.swap_blocks(gpu, host, mapping, stream=STREAM)
    engine.kept_memory.forget()  # (as kvcopy.register does when it unregisters)
    kvcopy.swap_blocks(gpu, host, mapping, stream=STREAM)
    assert asked[0] == 2 and fake.classified == 4
    host[2] = torch.zeros(BLOCKS, BLOCK, dtype=torch.uint8)  # another tensor in the list
    kvcopy.swap_blocks(gpu, host, mapping, stream=STREAM)
    assert asked[0] == 3 and landed(gpu, host, mapping)


def test_a_capturing_stream_goes_the_whole_way(emulated):
    fake, gpu, host, asked = emulated
    mapping = np.array([[7, 8]])
    kvcopy.swap_blocks(gpu, host, mapping, stream=STREAM, method="loop")
    fake.capturing = 1
    kvcopy.swap_blocks(gpu, host, mapping, stream=STREAM, method="loop")
    assert asked[0] == 2


def test_nothing_is_repeated_while_the_guard_times_batches(emulated):
    fake, gpu, host, asked = emulated
    mapping = np.array([[7, 8]])
    with testing.settings(guard=True):
        for _ in range(3):
            kvcopy.swap_blocks(gpu, host, mapping, stream=STREAM, method="kernel")
    assert asked[0] == 3


def test_a_repeat_reads_neither_tensors_nor_plans_again(emulated, monkeypatch):
    fake, gpu, host, asked = emulated
    kvcopy.swap_blocks(gpu, host, np.array([[1, 2]]), stream=STREAM)
    planned = counted(monkeypatch, kvcopy.blocks, "plan_blocks")
    for ids in (np.array([[3, 4]]), torch.tensor([[5, 6]]), [[7, 9]]):
        for h in host:
            h.zero_()
        assert kvcopy.swap_blocks(gpu, host, ids, stream=STREAM) == "kernel"
        assert landed(gpu, host, np.asarray(ids))
    assert planned[0] == 0 and asked[0] == 1


def test_a_repeat_written_to_its_own_caches_checks_races_as_planning_does(emulated):
    fake, gpu, host, asked = emulated
    for _ in range(2):
        kvcopy.swap_blocks(host, host, np.array([[1, 2], [3, 4]]), stream=STREAM, method="kernel")
    calls = len(fake.calls)
    with pytest.raises(ValueError, match="the copies of one call run in no defined order"):
        kvcopy.swap_blocks(host, host, np.array([[1, 2], [2, 5]]), stream=STREAM, method="kernel")
    with pytest.raises(TypeError, match="split_blocks"):
        kvcopy.swap_blocks(gpu, host, np.array([[1, 2]]), stream=STREAM, split_blocks=1)
    assert len(fake.calls) == calls


def test_one_block_copy_repeated_goes_from_its_ids_to_the_copy_engines(emulated, monkeypatch):
    """One pair over one tensor a side: each repeat is the compiled one-copy repeat
    (BlockRepeat.direct), reached without planning, with ids of every kind an engine
    passes; bad ids still get the whole way's refusal, with nothing issued."""
    fake, gpu, host, asked = emulated
    gpu, host = gpu[0], host[0]
    kvcopy.swap_blocks(gpu, host, np.array([[1, 2]]), stream=STREAM, method="loop")
    store = testing.plans.plan_blocks(gpu, host, [[0, 0]]).memory
    assert [repeat.direct is not None for repeat in store.repeats.values()] == [True]
    planned = counted(monkeypatch, kvcopy.blocks, "plan_blocks")
    for ids in (np.array([[3, 4]]), torch.tensor([[5, 6]]), [[31, 0]], np.array([[7, 9]]).T.copy().T):
        host.zero_()
        copies = len(fake.calls)
        assert kvcopy.swap_blocks(gpu, host, ids, stream=STREAM, method="loop") == "loop"
        (s, d) = np.asarray(ids)[0]
        assert torch.equal(host[d], gpu[s]) and int(host.count_nonzero()) == int(gpu[s].count_nonzero())
        assert [call[0] for call in fake.calls[copies:]] == ["memcpy"]
    assert planned[0] == 0 and asked[0] == 1
    issued = len(fake.calls)
    with pytest.raises(ValueError, match="destination block 32 is out of range"):
        kvcopy.swap_blocks(gpu, host, np.array([[1, BLOCKS]]), stream=STREAM, method="loop")
    with pytest.raises(ValueError, match="source block -1 is out of range"):
        kvcopy.swap_blocks(gpu, host, np.array([[-1, 0]]), stream=STREAM, method="loop")
    assert len(fake.calls) == issued


def test_a_layout_kernel_repeat_goes_from_its_ids_to_its_launch(emulated, monkeypatch):
    """Pairs over four tensors a side that cannot race, by the layout kernel: each repeat
    goes from its ids to the first call's launch (BlockRepeat.direct), with no plan
    made, and every block lands; bad ids get the whole way's refusal, nothing issued."""
    fake, gpu, host, asked = emulated
    kvcopy.swap_blocks(gpu, host, np.array([[1, 2], [3, 4]]), stream=STREAM, method="kernel")
    store = testing.plans.plan_blocks(gpu, host, [[0, 0]]).memory
    assert [repeat.direct is not None for repeat in store.repeats.values()] == [True]
    planned = counted(monkeypatch, kvcopy.blocks, "plan_blocks")
    rng = np.random.default_rng(3)
    for ids in (pairs(rng, 2), torch.tensor(pairs(rng, 2)), pairs(rng, 2).tolist()):
        for h in host:
            h.zero_()
        assert kvcopy.swap_blocks(gpu, host, ids, stream=STREAM, method="kernel") == "kernel"
        assert landed(gpu, host, np.asarray(ids))
    assert planned[0] == 0 and asked[0] == 1
    issued = len(fake.calls)
    with pytest.raises(ValueError, match="destination block 32 is out of range"):
        kvcopy.swap_blocks(gpu, host, np.array([[1, BLOCKS], [2, 3]]), stream=STREAM, method="kernel")
    with pytest.raises(ValueError, match="both write destination block 4"):
        kvcopy.swap_blocks(gpu, host, np.array([[1, 4], [3, 4]]), stream=STREAM, method="kernel")
    assert len(fake.calls) == issued


def test_a_block_copied_within_one_tensor_is_not_repeated_from_its_ids(emulated):
    """A tensor's blocks copied among themselves may race from one call to the next
    (a block read and written): such a repeat keeps planning's race check."""
    fake, gpu, host, asked = emulated
    kvcopy.swap_blocks(gpu[0], gpu[0], np.array([[1, 2]]), stream=STREAM, method="loop")
    store = testing.plans.plan_blocks(gpu[0], gpu[0], [[0, 0]]).memory
    assert store.repeats and all(repeat.direct is None for repeat in store.repeats.values())
    before = gpu[0][5].clone()
    kvcopy.swap_blocks(gpu[0], gpu[0], np.array([[5, 6]]), stream=STREAM, method="loop")
    assert torch.equal(gpu[0][6], before)


def test_the_compiled_one_copy_repeat_checks_ids_and_addresses_as_planning_does():
    """dma.BlockCopyAgain itself (no driver reached): every pair in range gives the
    addresses plan_arrays.block_copies gives (split sides included); a pair outside
    either side, a mapping of another shape or type gives none."""
    table = np.array([[0x10000, 0x90000, 4096, 8192, 1, 2]], np.uint64)
    again = testing.cuda.dma.BlockCopyAgain(table, 2048, 8, 6, STREAM)
    for s in range(8):
        for d in range(6):
            ids = np.array([[s, d]])
            src, dst, _ = testing.cuda.plan_arrays.block_copies(ids, table, 2048)
            assert again.addresses(ids) == (int(src[0]), int(dst[0]))
    for bad in ([[8, 0]], [[0, 6]], [[-1, 0]], [[0, -1]], [[1, 2], [3, 4]], [1, 2]):
        assert again.addresses(np.array(bad, np.int64)) is None, bad
    assert again.addresses(np.array([[1, 2]], np.int32)) is None
    assert again.addresses(np.array([[1.0, 2.0]])) is None
    assert again.addresses("no buffer") is None
    with pytest.raises(ValueError, match="one tensor row"):
        testing.cuda.dma.BlockCopyAgain(np.vstack([table, table]), 2048, 8, 6, STREAM)
    with pytest.raises(ValueError, match="factors and block_bytes"):
        testing.cuda.dma.BlockCopyAgain(table, 0, 8, 6, STREAM)
