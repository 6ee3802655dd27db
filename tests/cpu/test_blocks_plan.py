"""swap_blocks planning on NumPy arrays: addresses, layouts and errors (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy._plans.blocks import as_block_mapping, plan_block_copies
from kvcopy.interop.tensors import block_layout


def apply(plan) -> None:
    """Run a plan on host memory with NumPy (what the GPU would do)."""
    import ctypes

    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()):
        ctypes.memmove(d, s, n)


def test_single_tensor_copies_the_mapped_blocks():
    src = np.random.default_rng(0).integers(0, 255, (10, 4, 8), dtype=np.uint8)
    dst = np.zeros_like(src)
    plan, _ = plan_block_copies(src, dst, [[1, 2], [5, 0], [9, 9]])
    apply(plan)
    for s, d in [(1, 2), (5, 0), (9, 9)]:
        np.testing.assert_array_equal(dst[d], src[s])
    assert dst[1].sum() == 0


def test_k_and_v_views_of_a_2_by_blocks_cache():
    cache = np.random.default_rng(1).integers(0, 255, (2, 6, 3, 4), dtype=np.uint8)
    host = np.zeros((2, 8, 3, 4), dtype=np.uint8)
    plan, _ = plan_block_copies([cache[0], cache[1]], [host[0], host[1]], np.array([[0, 7], [5, 1]]))
    apply(plan)
    np.testing.assert_array_equal(host[:, 7], cache[:, 0])
    np.testing.assert_array_equal(host[:, 1], cache[:, 5])


def test_blocks_by_2_layout_views_have_a_stride_of_two_blocks():
    cache = np.random.default_rng(2).integers(0, 255, (6, 2, 3, 4), dtype=np.uint8)
    k, v = cache[:, 0], cache[:, 1]
    assert block_layout(k, "k").block_stride == 2 * block_layout(k, "k").block_bytes
    dst_k, dst_v = np.zeros_like(k), np.zeros_like(v)
    plan, _ = plan_block_copies([k, v], [dst_k, dst_v], [[4, 0]])
    apply(plan)
    np.testing.assert_array_equal(dst_k[0], k[4])
    np.testing.assert_array_equal(dst_v[0], v[4])


def test_split_blocks_addresses_sub_blocks_from_the_middle_of_a_host_block():
    gpu = np.random.default_rng(3).integers(0, 255, (8, 16), dtype=np.uint8)  # 16-byte blocks
    host = np.zeros((4, 64), dtype=np.uint8)  # 4 sub-blocks each
    plan, _ = plan_block_copies(gpu, host, [[0, 5], [1, 6], [2, 7], [3, 8]], split_blocks=True)
    apply(plan)
    assert plan.count == 1  # four sub-blocks in a row merge into one copy
    np.testing.assert_array_equal(host[1, 16:64], gpu[0:3].ravel())
    np.testing.assert_array_equal(host[2, 0:16], gpu[3])


def test_consecutive_blocks_merge_and_every_tensor_goes_in_one_plan():
    layers = [np.zeros((8, 32), np.uint8) for _ in range(4)]
    out = [np.zeros((8, 32), np.uint8) for _ in range(4)]
    plan, _ = plan_block_copies(layers, out, [[0, 0], [1, 1], [2, 2], [6, 3]])
    assert plan.count == 8 and plan.total_bytes == 4 * 4 * 32


@pytest.mark.parametrize(
    "mapping, kind, match",
    [
        ([[0, 8]], ValueError, r"block_mapping\[0\]: destination block 8 is out of range for dst"),
        ([[1, 1], [-1, 0]], ValueError, r"block_mapping\[1\]: source block -1 is out of range"),
        (np.array([[0.0, 1.0]]), TypeError, "integer block ids"),
        ([[0, 1, 2]], TypeError, r"block_mapping\[0\] must be a pair"),
        ([[True, 1]], TypeError, r"block_mapping\[0\] must be a pair"),
        (np.zeros((3,), np.int64), ValueError, r"shape \(n, 2\)"),
        ("0,1", TypeError, "integer block ids, got dtype <U3"),
    ],
)
def test_bad_mappings(mapping, kind, match):
    with pytest.raises(kind, match=match):
        plan_block_copies(np.zeros((8, 4), np.uint8), np.zeros((8, 4), np.uint8), mapping)


def test_layout_errors():
    a = np.zeros((8, 4, 4), np.uint8)
    with pytest.raises(ValueError, match="must be contiguous"):
        plan_block_copies(a[:, :, ::2], np.zeros((8, 4, 2), np.uint8), [[0, 0]])
    with pytest.raises(ValueError, match="different numbers of tensors: 2 and 1"):
        plan_block_copies([a, a], [a], [[0, 0]])
    with pytest.raises(ValueError, match="blocks of 16 bytes but dst of 8"):
        plan_block_copies(a, np.zeros((8, 8), np.uint8), [[0, 0]])
    with pytest.raises(ValueError, match="do not hold whole blocks"):
        plan_block_copies(a, np.zeros((8, 12), np.uint8), [[0, 0]], split_blocks=True)
    ro = np.zeros((8, 4, 4), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="dst is read-only"):
        plan_block_copies(a, ro, [[0, 0]])
    with pytest.raises(TypeError, match="not a tensor or array"):
        plan_block_copies(object(), a, [[0, 0]])
    with pytest.raises(ValueError, match="0-d"):
        plan_block_copies(np.zeros((), np.uint8), a, [[0, 0]])
    with pytest.raises(ValueError, match="no tensors"):
        plan_block_copies([], [], [[0, 0]])


def test_torch_mapping_and_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    src = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    dst = torch.zeros_like(src)
    plan, _ = plan_block_copies(src, dst, torch.tensor([[7, 0]]))
    apply(plan)
    assert torch.equal(dst[0], src[7])
    assert as_block_mapping(torch.tensor([[1, 2]], dtype=torch.int32)).dtype == np.int64


def test_array_interface_producer():
    class Producer:
        def __init__(self, arr):
            self.arr = arr
            self.__array_interface__ = arr.__array_interface__

    src = np.arange(32, dtype=np.uint8).reshape(4, 8)
    dst = np.zeros_like(src)
    plan, _ = plan_block_copies(Producer(src), Producer(dst), [[3, 1]])
    apply(plan)
    np.testing.assert_array_equal(dst[1], src[3])


def test_a_jax_array_is_read_by_dlpack_with_the_copy_stream_and_read_only():
    """JAX's __cuda_array_interface__ (version 2) names no stream and can give
    address 0 while the computation that writes the array is pending: kvcopy must
    ask DLPack, handing it the copy's stream, and must never write a JAX array."""
    arr = np.arange(64, dtype=np.float32).reshape(4, 16)
    asked: list = []

    class JaxLike:
        __module__ = "jaxlib.xla_extension"
        __cuda_array_interface__ = {"shape": (4, 16), "typestr": "<f4", "data": (0, True), "version": 2}

        def __dlpack__(self, **kw):
            asked.append(kw.get("stream"))
            return arr.__dlpack__()

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA: the copy's stream is handed over

    layout = block_layout(JaxLike(), "src", 0x7F0000001000)
    assert (layout.ptr, layout.num_blocks, layout.block_bytes) == (arr.ctypes.data, 4, 64)
    assert layout.readonly
    assert asked == [0x7F0000001000]
    with pytest.raises(ValueError, match=r"^dst is read-only"):
        plan_block_copies(np.zeros_like(arr), JaxLike(), [[0, 0]])


def test_swap_blocks_validates_method_before_anything():
    with pytest.raises(ValueError, match="method must be one of"):
        kvcopy.swap_blocks(np.zeros((2, 2)), np.zeros((2, 2)), [[0, 1]], method="fast")


# ------------------------------------------------------------------ geometry paths


def test_uniform_torch_lists_take_the_vectorised_path_with_the_same_geometry():
    torch = pytest.importorskip("torch")
    from kvcopy._plans.blocks import _pair_rows, _uniform_geometry, block_geometry

    kv = torch.zeros((2, 12, 4, 8), dtype=torch.float16)  # [2, num_blocks, ...] cache
    host = [torch.zeros((20, 4, 8), dtype=torch.float16) for _ in range(2)]
    src, dst = [kv[0], kv[1]], host
    fast = _uniform_geometry(src, dst)
    assert fast is not None
    rows, block, producers = _pair_rows(src, dst, False, None)
    assert producers == ()
    slow = np.array(rows, dtype=np.uint64)
    assert fast.block_bytes == block == 4 * 8 * 2
    for i, name in enumerate(
        [
            "src_base",
            "dst_base",
            "src_extent",
            "dst_extent",
            "src_stride",
            "dst_stride",
            "src_factor",
            "dst_factor",
            "src_blocks",
            "dst_blocks",
        ]
    ):
        np.testing.assert_array_equal(getattr(fast, name), slow[:, i], err_msg=name)
    assert block_geometry(src, dst).src_base.tolist() == [kv[0].data_ptr(), kv[1].data_ptr()]


def test_a_128_layer_model_swapped_layer_by_layer_keeps_every_geometry():
    """vLLM's per-layer swap_blocks of a 128-layer model, both ways: the second step
    finds each layer's geometry as the first built it."""
    torch = pytest.importorskip("torch")
    from kvcopy._plans.blocks import block_geometry

    gpu = [torch.zeros((4, 64), dtype=torch.uint8) for _ in range(128)]
    host = [torch.zeros((4, 64), dtype=torch.uint8) for _ in range(128)]

    def step() -> list:
        return [block_geometry(a, b) for g, h in zip(gpu, host) for a, b in ((g, h), (h, g))]

    first = step()
    assert all(again is kept for again, kept in zip(step(), first))


def test_mixed_shapes_fall_back_to_per_tensor_reading():
    torch = pytest.importorskip("torch")
    from kvcopy._plans.blocks import _uniform_geometry, block_geometry

    src = [torch.zeros((8, 16), dtype=torch.uint8), torch.zeros((6, 16), dtype=torch.uint8)]
    dst = [torch.zeros((8, 16), dtype=torch.uint8)] * 2
    assert _uniform_geometry(src, dst) is None
    geometry = block_geometry(src, dst)
    assert geometry.src_blocks.tolist() == [8, 6]
    with pytest.raises(ValueError, match=r"source block 7 is out of range for src\[1\], which has 6"):
        geometry.with_mapping([[7, 0]])


def test_uniform_path_still_rejects_bad_blocks_and_ids():
    torch = pytest.importorskip("torch")
    a = [torch.zeros((8, 4, 4), dtype=torch.uint8)[:, :, ::2] for _ in range(3)]
    with pytest.raises(ValueError, match="must be contiguous"):
        plan_block_copies(a, a, [[0, 1]])
    b = [torch.zeros((8, 16), dtype=torch.uint8) for _ in range(3)]
    with pytest.raises(ValueError, match=r"destination block 8 is out of range for dst\[0\]"):
        plan_block_copies(b, b, [[0, 8]])
    with pytest.raises(
        ValueError,
        match=r"block_mapping\[0\] and block_mapping\[2\] both write "
        "destination block 3",
    ):
        plan_block_copies(b, b, [[0, 3], [1, 4], [2, 3]])


def test_geometry_is_reused_with_new_mappings():
    from kvcopy._plans.blocks import block_geometry

    src = np.arange(10 * 8, dtype=np.uint8).reshape(10, 8)
    dst = np.zeros_like(src)
    geometry = block_geometry(src, dst)
    for pairs in ([[1, 2]], [[3, 4], [5, 6]]):
        apply(geometry.with_mapping(pairs).copy_plan())
    for s, d in [(1, 2), (3, 4), (5, 6)]:
        np.testing.assert_array_equal(dst[d], src[s])


# ------------------------------------------------------------------ block_view


def test_block_view_of_a_raw_pointer_copies_like_the_array():
    src = np.random.default_rng(3).integers(0, 255, (6, 32), dtype=np.uint8)
    dst = np.zeros((4, 32), np.uint8)
    view = kvcopy.block_view(src.ctypes.data, 32, num_blocks=6)
    plan, _ = plan_block_copies(view, kvcopy.block_view(dst.ctypes.data, 32, num_blocks=4), [[5, 0], [2, 3]])
    apply(plan)
    np.testing.assert_array_equal(dst[0], src[5])
    np.testing.assert_array_equal(dst[3], src[2])


def test_block_view_with_a_stride_and_read_only():
    src = np.arange(4 * 64, dtype=np.uint8)
    dst = np.zeros((4, 16), np.uint8)
    view = kvcopy.block_view(src.ctypes.data, 16, num_blocks=4, block_stride=64, readonly=True)
    plan, _ = plan_block_copies(view, dst, [[3, 1]])
    apply(plan)
    np.testing.assert_array_equal(dst[1], src[192:208])
    with pytest.raises(ValueError, match="dst is read-only"):
        plan_block_copies(dst, view, [[0, 0]])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(memory=4096, block_bytes=16), ValueError, "num_blocks is required"),
        (dict(memory=4096, block_bytes=0, num_blocks=1), ValueError, "block_bytes must be positive"),
        (
            dict(memory=4096, block_bytes=16, num_blocks=2, block_stride=8),
            ValueError,
            "block_stride 8 is smaller",
        ),
        (dict(memory=4096, block_bytes=16, num_blocks=-1), ValueError, "num_blocks must be >= 0"),
        (dict(memory=0, block_bytes=16, num_blocks=1), ValueError, "address must be positive"),
        (dict(memory="0x10", block_bytes=16, num_blocks=1), TypeError, "expected an int address"),
        (dict(memory=4096, block_bytes=16.0, num_blocks=1), TypeError, "block_bytes must be an int"),
    ],
)
def test_block_view_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        kvcopy.block_view(**kwargs)


class FakeBuffer:
    """Looks like a cuda.core Buffer (flat bytes, no shape) for CPU tests."""

    __module__ = "cuda.core._memory"

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.handle = array.ctypes.data
        self.size = array.nbytes


def test_flat_buffer_takes_its_block_size_from_the_other_side():
    src = np.random.default_rng(5).integers(0, 255, (4, 2, 8), dtype=np.uint8)  # 16-byte blocks
    raw = np.zeros(6 * 16, np.uint8)
    plan, _ = plan_block_copies(src, FakeBuffer(raw), [[3, 5], [0, 1]])
    apply(plan)
    np.testing.assert_array_equal(raw[80:96], src[3].ravel())
    np.testing.assert_array_equal(raw[16:32], src[0].ravel())
    view = kvcopy.block_view(FakeBuffer(raw), 32)
    assert view.layout.num_blocks == 3


def test_flat_buffers_need_a_block_size():
    raw = np.zeros(64, np.uint8)
    with pytest.raises(TypeError, match="both flat buffers"):
        plan_block_copies(FakeBuffer(raw), FakeBuffer(raw), [[0, 0]])
    with pytest.raises(ValueError, match=r"dst: a buffer of 60 bytes does not hold whole blocks of 16"):
        plan_block_copies(np.zeros((2, 16), np.uint8), FakeBuffer(np.zeros(60, np.uint8)), [[0, 0]])
    with pytest.raises(ValueError, match="need 80 bytes; the buffer has 64"):
        kvcopy.block_view(FakeBuffer(raw), 16, num_blocks=5)
