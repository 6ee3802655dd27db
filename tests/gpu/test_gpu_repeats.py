"""Repeated calls on a real GPU: swap_blocks over the same torch tensors (by the layout
kernel and by the copy engines) and copy_rows with host indices between the same
layouts, each call with new ids or indices, on a created stream and on the default
stream, every byte checked against a torch gather; swap_blocks and copy_rows over NumPy arrays and
array-interface producers kept the same way; copy_rows with GPU indices
rewritten in place, repeated from C; a repeat after the memory's
registration changed goes the whole way and still moves the right bytes."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import policy
from kvcopy.testing import cuda, engine, plans

LAYERS, BLOCKS, HOST_BLOCKS = 8, 64, 96


def caches(torch, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gpu = [
        torch.randint(-100, 100, (BLOCKS, 16, 64), generator=g, device="cuda").to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    host = [torch.zeros(HOST_BLOCKS, 16, 64, dtype=torch.bfloat16).pin_memory() for _ in range(LAYERS)]
    return gpu, host


def pairs(rng, n: int, a: int, b: int) -> np.ndarray:
    return np.stack([rng.choice(a, n, replace=False), rng.choice(b, n, replace=False)], axis=1)


class Interface:
    """GPU memory of a torch tensor (held) as a ``__cuda_array_interface__`` producer
    that names no stream, as a custom allocator's wrapper does."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


@pytest.mark.parametrize("method", ["kernel", "loop", "auto"])
@pytest.mark.parametrize("default_stream", [False, True])
def test_swap_blocks_repeated_moves_every_calls_blocks(torch_cuda, method, default_stream):
    torch = torch_cuda
    gpu, host = caches(torch, 1)
    stream = None if default_stream else torch.cuda.Stream()
    rng = np.random.default_rng(2)
    for call in range(6):
        mapping = pairs(rng, 5, BLOCKS, HOST_BLOCKS)
        for h in host:
            h.zero_()
        kvcopy.swap_blocks(gpu, host, mapping, stream=0 if default_stream else stream, method=method)
        torch.cuda.synchronize()
        for g, h in zip(gpu, host):
            assert torch.equal(h[mapping[:, 1]], g[mapping[:, 0]].cpu()), f"call {call}"
        back = pairs(rng, 5, HOST_BLOCKS, BLOCKS)
        target = [torch.zeros_like(g) for g in gpu]
        torch.cuda.synchronize()  # (the zeros are written on torch's stream, not ``stream``)
        kvcopy.swap_blocks(host, target, back, stream=0 if default_stream else stream, method=method)
        torch.cuda.synchronize()
        for t, h in zip(target, host):
            assert torch.equal(t[back[:, 1]].cpu(), h[back[:, 0]]), f"call {call}, back"


@pytest.mark.parametrize("method", ["auto", "loop", "batch"])
@pytest.mark.parametrize("default_stream", [False, True])
def test_one_block_pair_repeated_is_issued_from_its_ids(torch_cuda, method, default_stream):
    """One pair over one tensor a side, repeated with new ids of every kind an engine
    passes: the repeat is the compiled one (BlockRepeat.direct), every call's block
    lands both ways, and an id out of range is refused by name without a byte moved."""
    torch = torch_cuda
    if method == "batch" and (default_stream or not cuda.dma.batch_abi()):
        pytest.skip("cuMemcpyBatchAsync takes neither default stream, nor a driver before 12.8")
    gpu, host = caches(torch, 7)
    gpu, host = gpu[0], host[0]
    stream = 0 if default_stream else torch.cuda.Stream()
    rng = np.random.default_rng(8)
    kinds = [np.array, lambda ids: torch.tensor(ids, dtype=torch.int64), lambda ids: ids]
    for call in range(6):
        s, d = int(rng.integers(BLOCKS)), int(rng.integers(HOST_BLOCKS))
        host.zero_()
        ran = kvcopy.swap_blocks(gpu, host, kinds[call % 3]([[s, d]]), stream=stream, method=method)
        torch.cuda.synchronize()
        assert ran == method if method != "auto" else ran in ("loop", "batch", "kernel")
        assert torch.equal(host[d], gpu[s].cpu()) and int(host.count_nonzero()) == int(gpu[s].count_nonzero())
        back = torch.zeros_like(gpu)
        torch.cuda.synchronize()  # (the zeros are written on torch's stream, not ``stream``)
        kvcopy.swap_blocks(host, back, np.array([[d, s]]), stream=stream, method=method)
        torch.cuda.synchronize()
        assert torch.equal(back[s].cpu(), host[d]), f"call {call}"
    store = plans.plan_blocks(gpu, host, [[0, 0]]).memory
    if ran != "kernel":
        assert any(repeat.direct is not None for repeat in store.repeats.values())
    host.zero_()
    with pytest.raises(ValueError, match="destination block 96 is out of range"):
        kvcopy.swap_blocks(gpu, host, np.array([[1, HOST_BLOCKS]]), stream=stream, method=method)
    with pytest.raises(ValueError, match="source block -1 is out of range"):
        kvcopy.swap_blocks(gpu, host, np.array([[-1, 0]]), stream=stream, method=method)
    torch.cuda.synchronize()
    assert int(host.count_nonzero()) == 0
    kvcopy.swap_blocks(gpu, host, np.array([[3, 4]]), stream=stream, method=method)
    torch.cuda.synchronize()
    assert torch.equal(host[4], gpu[3].cpu())


@pytest.mark.parametrize("count", [3, 600, 1500])
def test_ids_read_in_place_uploaded_or_chunked_move_the_same_blocks(torch_cuda, count):
    """3 pairs over 8 tensors a side: ids read where the CPU wrote them; 600: one chunk
    uploaded (75 KiB of reads in place would pass policy.indices_in_place's bound);
    1,500: two chunks on a side stream. Each repeated with new ids, every block checked."""
    torch = torch_cuda
    assert policy.indices_in_place(16 * 3, 8) and not policy.indices_in_place(16 * 600, 8)
    gpu = [torch.randint(0, 250, (2048, 256), device="cuda", dtype=torch.uint8) for _ in range(8)]
    host = [torch.zeros(2048, 256, dtype=torch.uint8).pin_memory() for _ in range(8)]
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(count)
    for call in range(3):
        mapping = pairs(rng, count, 2048, 2048)
        for h in host:
            h.zero_()
        assert kvcopy.swap_blocks(gpu, host, mapping, stream=stream, method="kernel") == "kernel"
        stream.synchronize()
        for g, h in zip(gpu, host):
            assert torch.equal(h[mapping[:, 1]], g[mapping[:, 0]].cpu()), f"call {call}"


def test_swap_blocks_repeats_after_a_store_of_its_own(torch_cuda):
    """Many calls in flight on one stream, none waited for: each reads its own ids."""
    torch = torch_cuda
    gpu, host = caches(torch, 3)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(4)
    mappings = [pairs(rng, 8, BLOCKS, HOST_BLOCKS) for _ in range(20)]
    for mapping in mappings:
        kvcopy.swap_blocks(gpu, host, mapping, stream=stream, method="kernel")
    stream.synchronize()
    want = [torch.zeros_like(h) for h in host]
    for mapping in mappings:
        for w, g in zip(want, gpu):
            w[mapping[:, 1]] = g[mapping[:, 0]].cpu()
    for w, h in zip(want, host):
        assert torch.equal(w, h)


@pytest.mark.parametrize("default_stream", [False, True])
def test_copy_rows_with_host_indices_repeated_moves_every_calls_rows(torch_cuda, default_stream):
    torch = torch_cuda
    tokens_g = torch.randint(0, 1 << 15, (2, 512, 256), device="cuda", dtype=torch.int16)
    tokens_h = torch.zeros(2, 300, 256, dtype=torch.int16).pin_memory()
    src = kvcopy.Layout.of(tokens_g, planes=(0,), slot=1)
    dst = kvcopy.Layout.of(tokens_h, planes=(0,), slot=1)
    stream = 0 if default_stream else torch.cuda.Stream()
    rng = np.random.default_rng(5)
    for call in range(6):
        a = torch.from_numpy(rng.choice(512, 40, replace=False))
        b = torch.from_numpy(rng.choice(300, 40, replace=False))
        tokens_h.zero_()
        assert kvcopy.copy_rows(src, dst, a, b, stream=stream) == "kernel"
        torch.cuda.synchronize()
        assert torch.equal(tokens_h[:, b], tokens_g[:, a].cpu()), f"call {call}"
    found = engine.rows_memo.entry(src, dst)
    assert found is not None and isinstance(found.repeat, engine.rows.HostRepeat)


def test_copy_rows_with_host_indices_repeated_between_arrays_moves_every_calls_rows(torch_cuda):
    """A layout over an array-interface producer (GPU memory) and one over a NumPy array
    of its own, page-locked by kvcopy.register: their memory is kept (the call repeats,
    kvcopy._engine.rows.HostRepeat) and every call's rows land; after the registration
    ends, the same layouts still move the right rows (what was kept is forgotten)."""
    torch = torch_cuda
    tokens_g = torch.randint(0, 250, (2, 512, 256), device="cuda", dtype=torch.uint8)
    producer = Interface(tokens_g)
    tokens_h = np.zeros((2, 300, 256), np.uint8)
    src = kvcopy.Layout.of(producer, planes=(0,), slot=1)
    dst = kvcopy.Layout.of(tokens_h, planes=(0,), slot=1)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(6)

    def moved(call: str) -> None:
        a, b = rng.choice(512, 40, replace=False), rng.choice(300, 40, replace=False)
        tokens_h[:] = 0
        kvcopy.copy_rows(src, dst, a, b, stream=stream)
        stream.synchronize()
        assert np.array_equal(tokens_h[:, b], tokens_g[:, a].cpu().numpy()), call

    with kvcopy.register(tokens_h):
        for call in range(4):
            moved(f"call {call}")
        found = engine.rows_memo.entry(src, dst)
        assert found is not None and isinstance(found.repeat, engine.rows.HostRepeat)
    for call in range(2):
        moved(f"call {call} after the registration")


@pytest.mark.parametrize("stream_kind", ["current", "created", "default"])
def test_copy_rows_with_gpu_indices_repeated_from_c_moves_the_rows_they_hold(
    torch_cuda, monkeypatch, stream_kind
):
    """Index tensors rewritten in place, a new tensor at another address, one tensor for
    both sides: each call's rows land where its indices say; the calls that repeat the
    last one read no index in Python (issued from C)."""
    torch = torch_cuda
    tokens_g = torch.randint(0, 1 << 15, (2, 512, 256), device="cuda", dtype=torch.int16)
    tokens_h = torch.zeros(2, 300, 256, dtype=torch.int16).pin_memory()
    src = kvcopy.Layout.of(tokens_g, planes=(0,), slot=1)
    dst = kvcopy.Layout.of(tokens_h, planes=(0,), slot=1)
    created = torch.cuda.Stream()
    stream = {"current": None, "created": created, "default": 0}[stream_kind]
    read, real = [], kvcopy.rows.read_indices
    monkeypatch.setattr(kvcopy.rows, "read_indices", lambda obj, name: read.append(name) or real(obj, name))
    rng = np.random.default_rng(7)
    a = torch.empty(40, dtype=torch.int64, device="cuda")
    b = torch.empty(40, dtype=torch.int64, device="cuda")
    with torch.cuda.stream(created if stream_kind == "current" else torch.cuda.current_stream()):
        for call in range(8):
            if call == 5:  # (another tensor: another address, planned again)
                a = torch.empty(40, dtype=torch.int64, device="cuda")
            values_a = rng.choice(300, 40, replace=False)
            a.copy_(torch.from_numpy(values_a))
            b.copy_(torch.from_numpy(rng.choice(300, 40, replace=False)))
            same = call == 7
            tokens_h.zero_()
            torch.cuda.synchronize()
            assert kvcopy.copy_rows(src, dst, a, a if same else b, stream=stream) == "kernel"
            torch.cuda.synchronize()
            want = a.cpu() if same else b.cpu()
            assert torch.equal(tokens_h[:, want], tokens_g[:, a.cpu()].cpu()), f"call {call}"
    # (read in Python only by the calls that were not the last one again: the one with a
    # new tensor, and the one with a tensor for both sides)
    assert read == ["src_indices", "dst_indices", "src_indices"]
    found = engine.rows_memo.entry(src, dst)
    assert isinstance(found.repeat, cuda.rows_repeat.GpuRowsRepeat)


def test_a_repeat_after_host_memory_was_unregistered_goes_the_whole_way(torch_cuda):
    torch = torch_cuda
    gpu = [torch.randint(0, 100, (BLOCKS, 4096), device="cuda", dtype=torch.uint8) for _ in range(2)]
    host = kvcopy.pinned_empty((2, HOST_BLOCKS, 4096), np.uint8)
    views = [torch.from_numpy(host[k]) for k in range(2)]
    mapping = np.array([[1, 2], [3, 4]])
    kvcopy.swap_blocks(gpu, views, mapping, stream=0)
    kvcopy.swap_blocks(gpu, views, mapping, stream=0)
    torch.cuda.synchronize()
    generation = engine.kept_memory.generation()
    engine.kept_memory.forget()  # (what kvcopy.register's unregistering does)
    assert engine.kept_memory.generation() == generation + 1
    host[:] = 0
    kvcopy.swap_blocks(gpu, views, np.array([[5, 6]]), stream=0)
    torch.cuda.synchronize()
    for g, v in zip(gpu, views):
        assert torch.equal(v[6], g[5].cpu())


@pytest.mark.parametrize("gpu_side", ["torch", "interface"])
@pytest.mark.parametrize("method", ["kernel", "loop", "auto"])
def test_swap_blocks_repeated_over_arrays_moves_every_calls_blocks(torch_cuda, gpu_side, method):
    """The host side NumPy arrays over kvcopy's pinned memory, the GPU side torch tensors
    or array-interface producers: their reads are kept (kvcopy.interop.kept_reads), and
    every call's blocks land both ways; an array changed in place between calls is read
    again (made read-only: refused by name; put back: moved again)."""
    torch = torch_cuda
    gpu_tensors = [torch.randint(0, 250, (BLOCKS, 2048), device="cuda", dtype=torch.uint8) for _ in range(4)]
    gpu = gpu_tensors if gpu_side == "torch" else [Interface(t) for t in gpu_tensors]
    pool = kvcopy.pinned_empty((4, HOST_BLOCKS, 2048), np.uint8)
    host = [pool[k] for k in range(4)]
    rng = np.random.default_rng(5)
    stream = torch.cuda.Stream()
    for call in range(6):
        mapping = pairs(rng, 3, BLOCKS, HOST_BLOCKS)
        pool[:] = 0
        kvcopy.swap_blocks(gpu, host, mapping, stream=stream, method=method)
        stream.synchronize()
        for g, h in zip(gpu_tensors, host):
            assert np.array_equal(h[mapping[:, 1]], g[mapping[:, 0]].cpu().numpy()), f"call {call}"
        back = pairs(rng, 3, HOST_BLOCKS, BLOCKS)
        for g in gpu_tensors:
            g.zero_()
        torch.cuda.synchronize()
        kvcopy.swap_blocks(host, gpu, back, stream=stream, method=method)
        stream.synchronize()
        for g, h in zip(gpu_tensors, host):
            assert np.array_equal(g[back[:, 1]].cpu().numpy(), h[back[:, 0]]), f"call {call}, back"
    host[2].flags.writeable = False
    with pytest.raises(ValueError, match=r"^dst\[2\] is read-only$"):
        kvcopy.swap_blocks(gpu, host, [[1, 2]], stream=stream, method=method)
    host[2].flags.writeable = True
    pool[:] = 0
    kvcopy.swap_blocks(gpu, host, [[1, 2]], stream=stream, method=method)
    stream.synchronize()
    for g, h in zip(gpu_tensors, host):
        assert np.array_equal(h[2], g[1].cpu().numpy())
