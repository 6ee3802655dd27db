"""Foreign objects checked field by field, every bad argument a TypeError or ValueError
naming it (never a foreign exception), and settings that cannot be broken (CPU)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvcopy
from kvcopy._plans.blocks import plan_blocks
from kvcopy._plans.rows import read_indices
from kvcopy.interop.tensors import BlockLayout, block_layout

torch = pytest.importorskip("torch")


class Producer:
    """An object exposing only an array-interface dict."""

    def __init__(self, attr: str, face: dict) -> None:
        setattr(self, attr, face)


def cai(**fields):
    face = {"shape": (4, 64), "typestr": "|u1", "data": (0x7F0000000000, False), "version": 3}
    face.update(fields)
    return face


@pytest.mark.parametrize(
    "face, kind, match",
    [
        (cai(strides=(1,)), ValueError, "1 strides for 2 dimensions"),
        (cai(shape=(4.0, 64)), TypeError, "shape"),
        (cai(shape=(-4, 64)), ValueError, "below 0"),
        (cai(shape=(2**62, 64)), ValueError, "64-bit address space"),
        (cai(data=(0, False)), ValueError, "pointer 0"),
        (cai(shape=(0, 0), data=(2**64 + 1, False)), ValueError, "no 64-bit address"),
        (cai(shape=(0,), data=(-8, False)), ValueError, "pointer -8, which is no 64-bit"),
        (cai(data=(7.0e13, False)), TypeError, "data"),
        (cai(data=None), TypeError, "data as NoneType"),
        (cai(data=(0x7F0000000000,)), TypeError, "data"),
        (cai(mask=object()), TypeError, "mask"),
        (cai(version=4), TypeError, "version 4"),
        (cai(typestr="|O"), TypeError, "not plain bytes"),
        (cai(typestr="garbage"), TypeError, "no dtype"),
        (cai(typestr=5), TypeError, "typestr"),
        (cai(stream=3), ValueError, "handle 3"),
        (cai(stream=1.5), TypeError, "stream"),
        ({k: v for k, v in cai().items() if k != "shape"}, TypeError, "no 'shape'"),
        ({k: v for k, v in cai().items() if k != "version"}, TypeError, "no 'version'"),
    ],
)
def test_a_malformed_cuda_array_interface_is_refused(face, kind, match):
    with pytest.raises(kind, match=match):
        block_layout(Producer("__cuda_array_interface__", face), "dst")


def test_array_interface_and_cai_name_the_argument_through_swap_blocks():
    bad = Producer("__cuda_array_interface__", cai(mask=1))
    with pytest.raises(TypeError, match=r"^dst: __cuda_array_interface__ has a mask"):
        kvcopy.swap_blocks(np.zeros((4, 64), np.uint8), bad, [[0, 1]], stream=0)


class Raising:
    """A producer whose interface raises when read."""

    @property
    def __cuda_array_interface__(self) -> dict:
        raise RuntimeError("the buffer was released")


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_producer_whose_interface_raises_is_named_through_swap_blocks(side):
    """Whether kvcopy may keep what it reads of it is not its reader's first question:
    the reader's TypeError names the argument, and calls after it go on."""
    good = [np.zeros((4, 64), np.uint8)]
    src, dst = ([Raising()], good) if side == "src" else (good, [Raising()])
    for _ in range(2):
        with pytest.raises(
            TypeError, match=rf"^{side}: reading __cuda_array_interface__ raised RuntimeError: the buffer"
        ):
            kvcopy.swap_blocks(src, dst, [[0, 1]], stream=0)
    other = [np.zeros((4, 64), np.uint8)]
    assert plan_blocks(good, other, [[0, 1]]).num_pairs == 1


def test_a_well_formed_interface_reads_as_the_array_it_describes():
    arr = np.zeros((6, 4, 16), dtype=np.float32)
    layout = block_layout(Producer("__array_interface__", dict(arr.__array_interface__)), "src")
    assert layout == BlockLayout(arr.ctypes.data, 6, 256, 256, False)
    face = cai(stream=2, strides=(128, 1), shape=(4, 64))
    assert block_layout(Producer("__cuda_array_interface__", face), "src").stream == 2
    assert block_layout(Producer("__cuda_array_interface__", cai(stream=0)), "src").stream == 1


fields = st.fixed_dictionaries(
    {},
    optional={
        "shape": st.one_of(
            st.tuples(st.integers(-3, 10), st.integers(-3, 70)),
            st.none(),
            st.lists(st.floats(0, 9), max_size=2),
            st.text(max_size=3),
        ),
        "typestr": st.sampled_from(["|u1", "<f4", "|V8", "|O", "x", 3, None]),
        "data": st.one_of(
            st.tuples(st.integers(-5, 2**65), st.booleans()),
            st.none(),
            st.tuples(st.floats(), st.booleans()),
            st.just((1,)),
        ),
        "strides": st.one_of(
            st.none(), st.tuples(st.integers(-256, 256), st.integers(-4, 4)), st.tuples(st.integers(0, 64))
        ),
        "version": st.sampled_from([0, 1, 2, 3, 4, "3", None]),
        "mask": st.sampled_from([None, 1]),
        "stream": st.sampled_from([None, 0, 1, 2, 3, 4095, 2**40, -1, 1.0, True]),
    },
)


@settings(max_examples=500, deadline=None)
@given(face=fields, attr=st.sampled_from(["__cuda_array_interface__", "__array_interface__"]))
def test_any_interface_dict_gives_a_layout_or_a_typeerror_or_valueerror(face, attr):
    try:
        layout = block_layout(Producer(attr, face), "src")
    except (TypeError, ValueError) as exc:
        assert str(exc).startswith("src")
        return
    assert 0 < layout.ptr < 2**64 or layout.num_blocks == 0
    assert layout.block_bytes > 0 and layout.block_stride >= layout.block_bytes or layout.num_blocks <= 1
    assert layout.ptr + max(layout.num_blocks - 1, 0) * layout.block_stride + layout.block_bytes <= 2**64


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.empty(4, 64, device="meta"), "meta tensor"),
        (lambda: torch.zeros(4, 64).to_sparse(), "strided buffer"),
        (lambda: torch.zeros(4, 8, dtype=torch.complex64).conj(), "conjugate view"),
        (lambda: torch.zeros(4, 8, dtype=torch.complex64).conj().imag, "negative view"),
    ],
)
def test_torch_tensors_whose_bytes_are_not_their_values_are_refused(make, match):
    bad = make()
    with pytest.raises(TypeError, match=rf"^src: .*{match}"):
        plan_blocks(bad, torch.zeros(4, 64), [[0, 1]])
    # also as the second tensor of a list of one layout
    good = torch.zeros_like(bad) if not bad.is_meta else torch.zeros(4, 64)
    if bad.layout is torch.strided and not bad.is_meta:
        good = good.resolve_conj().resolve_neg()
        with pytest.raises(TypeError, match=rf"^src\[1\]: .*{match}"):
            plan_blocks([good, bad], [torch.zeros(good.shape, dtype=good.dtype)] * 2, [[0, 1]])


def test_a_nested_tensor_is_refused():
    with warnings.catch_warnings():  # torch calls its nested tensors a prototype
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(3, 3)])
    with pytest.raises(TypeError, match="nested tensor"):
        plan_blocks(nested, torch.zeros(4, 9), [[0, 1]])


@pytest.mark.parametrize(
    "empty_blocks",
    [
        lambda: np.zeros((4, 0), np.uint8),
        lambda: torch.zeros(4, 0),
        lambda: torch.zeros(4, 8, 0),
        lambda: np.zeros((1, 0), np.float32),
    ],
)
def test_blocks_of_zero_bytes_are_refused(empty_blocks):
    with pytest.raises(ValueError, match=r"^src: its blocks hold 0 bytes \(shape \(\d"):
        plan_blocks(empty_blocks(), np.zeros((4, 64), np.uint8), [[0, 1]])


def test_a_masked_array_is_refused():
    masked = np.ma.masked_array(np.zeros((4, 64), np.uint8), mask=False)
    with pytest.raises(TypeError, match="masked array"):
        plan_blocks(masked, np.zeros((4, 64), np.uint8), [[0, 1]])


def test_pinned_empty_keeps_a_structured_dtype():
    pytest.importorskip("kvcopy.testing")
    dtype = np.dtype([("k", np.float16, 4), ("v", np.float16, 4)])
    try:
        arr = kvcopy.pinned_empty(3, dtype)
    except kvcopy.NoDriverError:
        pytest.skip("no driver: pinned memory needs one")
    assert arr.dtype == dtype


def test_device_pointer_of_an_empty_buffer_is_refused_before_the_driver():
    with pytest.raises(ValueError, match="empty buffer"):
        kvcopy.device_pointer(b"")


@pytest.mark.parametrize(
    "ptrs, kind, match",
    [
        ([2**64 - 1, -1], ValueError, r"src_ptrs\[1\] = -1 is negative"),
        ([-1, 2**64 - 1], ValueError, r"src_ptrs\[0\] = -1 is negative"),
        ([2**64], ValueError, "does not fit in 64 bits"),
        (range(2**40, 2**40 + 10**18), ValueError, "too long|more than"),
    ],
)
def test_pointer_arguments_give_valueerror_naming_them(ptrs, kind, match):
    with pytest.raises(kind, match=match):
        kvcopy.copy_batch(ptrs, [0x1000], [8], stream=0)


@pytest.mark.parametrize(
    "mapping, match",
    [
        ([[2**63, 0]], r"source block 9223372036854775808 is out of range"),
        ([[0, 2**64 + 5]], r"destination block .* out of range"),
    ],
)
def test_huge_block_ids_are_named_as_such(mapping, match):
    with pytest.raises(ValueError, match=match):
        plan_blocks(np.zeros((4, 8), np.uint8), np.zeros((4, 8), np.uint8), mapping)


def test_blockview_refuses_what_is_not_a_layout():
    with pytest.raises(TypeError, match="kvcopy.block_view"):
        kvcopy.BlockView("garbage")


def test_copy_batch_length_mismatch_is_a_valueerror_before_the_driver():
    with pytest.raises(ValueError, match="differ in length: 2, 1 and 1"):
        kvcopy.copy_batch([0x1000, 0x2000], [0x3000], [8], stream=0)


@pytest.mark.parametrize(
    "call, kind, match",
    [
        (lambda: kvcopy.calibrate(repeats=0), ValueError, "repeats must be at least 1"),
        (lambda: kvcopy.calibrate(total_bytes=1.5), TypeError, "total_bytes must be an int"),
        (lambda: kvcopy.calibrate(total_bytes=4096), ValueError, "total_bytes must be at least"),
        (lambda: kvcopy.calibrate(save_result="yes"), TypeError, "save_result must be True or False"),
        (lambda: kvcopy.calibrate_peers(repeats=-1), ValueError, "repeats"),
        (lambda: kvcopy.prepare(-1), ValueError, "device must be at least 0"),
        (lambda: kvcopy.prepare("0"), TypeError, "device must be an int"),
    ],
)
def test_calibrate_and_prepare_check_arguments_before_the_driver(call, kind, match):
    with pytest.raises(kind, match=match):
        call()


def test_the_vllm_drop_in_without_cuda_says_so_after_checking_its_arguments():
    from kvcopy.compat.vllm import swap_blocks_batch

    with pytest.raises(TypeError, match="src_ptrs must be"):
        swap_blocks_batch([1], [2], [3])
    ok = torch.tensor([0x1000], dtype=torch.int64)
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here")
    with pytest.raises(kvcopy.NoDriverError, match="current CUDA stream"):
        swap_blocks_batch(ok, ok, torch.tensor([8], dtype=torch.int64))


def test_a_deleted_setting_returns_to_its_default(monkeypatch):
    default = kvcopy.config.launch_bytes
    kvcopy.config.launch_bytes = 4096
    del kvcopy.config.launch_bytes
    assert kvcopy.config.launch_bytes == default
    with pytest.raises(AttributeError, match="no setting 'nonsense'"):
        del kvcopy.config.nonsense


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, False),
        ("0", False),
        ("00", False),
        (" 0", False),
        ("1", True),
        ("+1", True),
        ("2", True),
        ("-1", True),
    ],
)
def test_the_per_thread_variable_is_read_as_cuda_python_reads_it(monkeypatch, text, expected):
    from kvcopy.config import per_thread_default_stream

    if text is None:
        monkeypatch.delenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", raising=False)
    else:
        monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", text)
    assert per_thread_default_stream() is expected


@pytest.mark.parametrize("text", ["false", "", "yes"])
def test_a_per_thread_variable_cuda_python_cannot_read_is_a_valueerror(monkeypatch, text):
    from kvcopy.config import per_thread_default_stream

    monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", text)
    with pytest.raises(ValueError, match="CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM"):
        per_thread_default_stream()


class Stream:
    def __init__(self, value):
        self.value = value

    def __cuda_stream__(self):
        return self.value


@pytest.mark.parametrize(
    "value, kind, match",
    [
        ((1, 0x7F0000000000), TypeError, "version 1"),
        (("0", 0x7F0000000000), TypeError, "version"),
        ((0, 3), ValueError, "handle 3"),
        ((0, 0x7F0000000000, 1), TypeError, "tuple"),
    ],
)
def test_cuda_stream_protocol_is_checked(value, kind, match):
    with pytest.raises(kind, match=match):
        kvcopy.resolve_stream(Stream(value))
    assert kvcopy.resolve_stream(Stream((0, 0x7F0000000000))) == 0x7F0000000000


def test_bad_copies_and_device_numbers_are_refused_before_the_driver_is_loaded():
    """Refusals that need no driver come first: nothing asks the driver before them."""
    from kvcopy.testing import fake_cuda

    class NoDriverCalls:
        def __getattr__(self, name):
            raise AssertionError(f"driver.{name} was asked for before the arguments were checked")

    with fake_cuda(NoDriverCalls(), ("driver", "describe", "launch", "classify")):
        _refused_before_the_driver()


def _refused_before_the_driver():
    with pytest.raises(ValueError, match=r"sizes\[0\]"):
        kvcopy.copy_batch([4096], [8192], [1 << 63], stream=0)
    with pytest.raises(ValueError, match=r"dst_ptrs\[1\] is a null pointer"):
        kvcopy.copy_batch([4096, 8192], [16384, 0], [8, 8], stream=0)
    with pytest.raises(TypeError, match="device must be an int"):
        kvcopy.calibrate(device="0")
    with pytest.raises(ValueError, match="src_device and dst_device are both 0"):
        kvcopy.calibrate_peers(0, 0)


def test_vllms_swap_blocks_batch_checks_lengths_before_asking_torch_for_a_stream():
    torch = pytest.importorskip("torch")
    from kvcopy.compat import vllm

    ptrs = torch.tensor([4096, 8192], dtype=torch.int64)
    with pytest.raises(ValueError, match="src_ptrs, dst_ptrs and sizes differ in length: 2, 2 and 1"):
        vllm.swap_blocks_batch(ptrs, ptrs, torch.tensor([8], dtype=torch.int64))


def _gpu_index_face(ptr: int = 0x7F0000001000, n: int = 16, **fields) -> dict:
    face = {
        "shape": (n,),
        "typestr": "<i8",
        "data": (ptr, False),
        "version": 3,
        "strides": None,
        "stream": None,
    }
    face.update(fields)
    return face


def test_gpu_indices_read_again_from_their_fields_give_the_same_reading():
    """An index interface read before is known by its fields (a new object with the same
    fields reads the same; another address or length reads anew); each reading keeps
    its own object."""
    first = Producer("__cuda_array_interface__", _gpu_index_face())
    again = Producer("__cuda_array_interface__", _gpu_index_face())
    a, b = read_indices(first, "src_indices"), read_indices(again, "src_indices")
    assert (a.count, a.device, a.keep) == (16, 0x7F0000001000, first)
    assert (b.count, b.device, b.keep) == (16, 0x7F0000001000, again)
    moved = read_indices(Producer("__cuda_array_interface__", _gpu_index_face(ptr=0x7F0000002000, n=3)), "x")
    assert (moved.count, moved.device) == (3, 0x7F0000002000)


@pytest.mark.parametrize(
    "fields, kind, match",
    [
        ({"data": (0x7F0000001000, 0)}, TypeError, "data"),
        ({"version": 3.0}, TypeError, "version 3.0"),
        ({"strides": (16,)}, ValueError, "one contiguous dimension"),
        ({"shape": (16, 1)}, ValueError, "one contiguous dimension"),
        ({"typestr": "<i4"}, TypeError, "int64"),
        ({"mask": object()}, TypeError, "mask"),
    ],
)
def test_gpu_indices_like_ones_read_before_are_still_checked_in_full(fields, kind, match):
    """A field of another type or value than a reading kept before (0 for False, 3.0 for
    3) is no match for it: the interface is read, and refused, in full."""
    read_indices(Producer("__cuda_array_interface__", _gpu_index_face()), "src_indices")
    bad = Producer("__cuda_array_interface__", _gpu_index_face(**fields))
    with pytest.raises(kind, match=match):
        read_indices(bad, "src_indices")
