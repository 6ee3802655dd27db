"""Tensors and arrays of any framework -> where their blocks are in memory.

Dimension 0 indexes blocks; every block (dimensions 1 and up) must be
contiguous. Reads torch, NumPy and CuPy attributes directly (cheap), any
``__cuda_array_interface__``/``__array_interface__`` dict, and everything else
(JAX, DLPack producers) through cuda.core's StridedMemoryView.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import numpy as np

from kvcopy.errors import KVCopyError
from kvcopy.interop.frameworks import framework_of, type_name
from kvcopy.interop.protocols import c_strides, read_array_interface
from kvcopy.interop.streams import interface_stream
from kvcopy.kept import make_room


class BlockLayout(NamedTuple):
    """Where a tensor's blocks are (a NamedTuple: built on every call, so cheap)."""

    ptr: int
    num_blocks: int
    block_stride: int  # bytes from one block to the next
    block_bytes: int
    readonly: bool
    stream: int | None = None  # the producer's stream (__cuda_array_interface__ v3):
    # pending writes there must be waited for before a copy


_NOT_ARRAYS = (type(None), bool, int, float, complex, str, bytes, bytearray)
_U64_LIMIT = 1 << 64


_DLPACK_GPU_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged

# The stream a copy runs on, as handed to DLPack producers: a raw handle, None (no
# ordering asked), or a function giving either, asked only where a producer of GPU
# memory is met (the caller's answer may cost a driver call).
ConsumerStream = Union[int, Callable[[], Union[int, None]], None]


def _strided_memory_view() -> type:
    """cuda.core's StridedMemoryView: cuda.core.utils from 0.5, experimental before."""
    try:
        from cuda.core.utils import StridedMemoryView
    except ImportError:  # cuda-core 0.3 and 0.4
        from cuda.core.experimental.utils import StridedMemoryView
    return StridedMemoryView


def _view_of(view_type: type, obj: Any, stream_ptr: int) -> Any:
    """A StridedMemoryView of ``obj``: by ``from_dlpack`` where cuda.core has it (its
    newer releases deprecate the constructor for DLPack producers), else by the
    constructor, which tries DLPack first."""
    from_dlpack = getattr(view_type, "from_dlpack", None)
    if from_dlpack is not None and hasattr(obj, "__dlpack__"):
        return from_dlpack(obj, stream_ptr)
    return view_type(obj, stream_ptr=stream_ptr)


def _dlpack_consumer_stream(obj: Any, stream: ConsumerStream) -> int:
    """The consumer stream to give a DLPack producer: the copy's stream for GPU
    memory (the producer then orders its pending writes before it), -1 (no
    ordering) for host memory or when no stream is known."""
    if stream is None:
        return -1
    try:
        device_type = int(obj.__dlpack_device__()[0])
    except Exception:  # noqa: BLE001 - no DLPack: cuda.core tries the other protocols
        return -1
    if device_type not in _DLPACK_GPU_DEVICES:
        return -1
    handle = stream() if callable(stream) else stream
    return -1 if handle is None else handle


def _raw(obj: Any, name: str, stream: ConsumerStream) -> tuple[int, tuple, tuple, int, bool, int | None]:
    """(pointer, shape, byte strides, itemsize, readonly, producer stream).

    ``stream`` is the consumer's stream handle, given to DLPack producers so that
    they order their pending writes before it (None: no ordering asked).

    JAX arrays go by DLPack although they also offer ``__cuda_array_interface__``:
    theirs is version 2, which names no stream, and gives the buffer's address
    without waiting for the computation that writes it (it has given 0 while that
    computation was pending). DLPack, handed the copy's stream, orders that
    computation before the copy."""
    if isinstance(obj, _NOT_ARRAYS):
        raise TypeError(f"{name}: expected a tensor or array, got {type(obj).__name__}")
    framework = framework_of(obj)
    if framework == "torch":
        refusal = torch_refusal(obj)
        if refusal:
            raise TypeError(f"{name}: {refusal}")
        size = obj.element_size()
        return (obj.data_ptr(), tuple(obj.shape), tuple(s * size for s in obj.stride()), size, False, None)
    if isinstance(obj, np.ndarray):
        if isinstance(obj, np.ma.MaskedArray):
            raise TypeError(
                f"{name}: a masked array's bytes are not its values; pass "
                "array.data (and copy the mask separately)"
            )
        if obj.dtype.hasobject:
            raise TypeError(
                f"{name}: a NumPy array of dtype {obj.dtype} holds Python objects, not block data"
            )
        return obj.ctypes.data, obj.shape, obj.strides, obj.itemsize, not obj.flags.writeable, None
    jax = framework == "jax"
    for attr in () if jax else ("__cuda_array_interface__", "__array_interface__"):
        try:
            face = getattr(obj, attr, None)
        except Exception as exc:  # noqa: BLE001 - a producer's property that fails
            raise TypeError(f"{name}: reading {attr} raised {type(exc).__name__}: {exc}") from None
        if face is not None and not isinstance(face, dict):
            raise TypeError(f"{name}: {attr} is a {type(face).__name__}, not a dict")
        if isinstance(face, dict):
            fields = read_array_interface(face, attr, name, interface_stream)
            return (fields.ptr, fields.shape, fields.strides, fields.itemsize, fields.readonly, fields.stream)
    try:
        StridedMemoryView = _strided_memory_view()
        view: Any = (
            obj
            if isinstance(obj, StridedMemoryView)
            else _view_of(StridedMemoryView, obj, _dlpack_consumer_stream(obj, stream))
        )
        itemsize = np.dtype(view.dtype).itemsize
        strides = (
            tuple(s * itemsize for s in view.strides)
            if view.strides is not None
            else c_strides(tuple(view.shape), itemsize)
        )
        # a JAX array is immutable, whatever flag its capsule carries
        return int(view.ptr), tuple(view.shape), strides, itemsize, bool(view.readonly) or jax, None
    except KVCopyError:  # (asking for the copy's stream failed: not the object's doing)
        raise
    except Exception:  # noqa: BLE001 - anything that is not an array
        raise TypeError(
            f"{name}: {type_name(obj)} is not a tensor "
            "or array kvcopy can read (torch, NumPy, CuPy, JAX, DLPack, array "
            "interface, cuda.core Buffer or kvcopy.block_view)"
        ) from None


def _prod(extents) -> int:
    out = 1
    for e in extents:
        out *= e
    return out


def torch_refusal(t: Any) -> str | None:
    """Why a torch tensor's memory is not its values as bytes, or None: a meta tensor
    has no memory, sparse and nested tensors keep their values elsewhere than one
    strided buffer, a masked tensor's mask is not in its bytes (and its address reads
    0), and conjugate or negative views only mark their bytes to be transformed."""
    if t.is_meta:
        return "a meta tensor has no memory to copy"
    if t.is_nested:
        return "a nested tensor is not one strided buffer; copy its components"
    if t.layout is not _torch_strided(t):
        return f"a {t.layout} tensor is not one strided buffer (to_dense() first)"
    if type(t).__name__ == "MaskedTensor":
        return "a masked tensor's mask is not in its bytes; pass get_data() (and copy the mask separately)"
    if t.is_conj():
        return "a conjugate view's bytes are not its values (resolve_conj() first)"
    if t.is_neg():
        return "a negative view's bytes are not its values (resolve_neg() first)"
    return None


def torch_integers_refusal(t: Any) -> str | None:
    """Why a torch tensor cannot be read as integers (pointers, sizes, block ids, row
    indices), or None: torch_refusal's reasons, a quantized tensor (its integers are
    not its values), or a dtype that is not an integer."""
    refusal = torch_refusal(t)
    if refusal:
        return refusal
    if t.is_quantized:
        return f"a quantized tensor ({t.dtype}) holds no plain integers"
    dtype = t.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype is _torch_bool(t):
        return f"expected integers, got dtype {dtype}"
    return None


def _torch_bool(t: Any) -> Any:
    import sys

    return sys.modules["torch"].bool


def _torch_strided(t: Any) -> Any:
    import sys

    return sys.modules["torch"].strided


def _torch_layout(t: Any) -> BlockLayout | None:
    """Fast path for torch tensors whose blocks are contiguous (the usual case); None
    sends the tensor down the full path, which names any problem. Sparse and nested
    tensors raise RuntimeError at data_ptr() or .shape and meta tensors have address
    0, so those cost nothing here; conjugate and negative bits are the caller's to
    check (a call each)."""
    try:
        shape = t.shape
        ptr = t.data_ptr()
    except RuntimeError:
        return None
    if not shape or not ptr:
        return None
    if t.is_contiguous():
        size = t.element_size()
        block = size * (t.numel() // shape[0] if shape[0] else _prod(shape[1:]))
        if not block:
            return None  # blocks of 0 bytes: the full path refuses them
        return BlockLayout(ptr, shape[0], block, block, False)
    strides = t.stride()
    step = 1
    for k in range(len(shape) - 1, 0, -1):
        if shape[k] != 1 and strides[k] != step:
            return None
        step *= shape[k]
    size = t.element_size()
    if shape[0] > 1 and strides[0] < step:
        return None
    return BlockLayout(ptr, shape[0], strides[0] * size, step * size, False)


def block_layout(obj: Any, name: str, stream: ConsumerStream = None) -> BlockLayout:
    """Where ``obj``'s blocks are. Raises TypeError/ValueError naming ``name``.

    ``stream``: the stream the copy will run on, given to DLPack producers (see
    _raw); a __cuda_array_interface__ producer's stream is returned in the layout."""
    if isinstance(obj, BlockView):
        return obj.layout
    if framework_of(obj) == "torch":
        fast = _torch_layout(obj)
        if fast is not None and not (obj.is_neg() or obj.is_conj()):
            return fast
    ptr, shape, strides, itemsize, readonly, producer = _raw(obj, name, stream)
    if len(shape) == 0:
        raise ValueError(f"{name}: a 0-d array has no block dimension")
    if shape[0] > 0 and _prod(shape[1:]) == 0:
        raise ValueError(
            f"{name}: its blocks hold 0 bytes (shape {tuple(shape)}): there is nothing in them to copy"
        )
    expected = itemsize
    for extent, stride in zip(reversed(shape[1:]), reversed(strides[1:])):
        if extent != 1 and stride != expected:
            raise ValueError(
                f"{name}: each block (dimensions 1 and up) must be contiguous in "
                f"memory; shape {tuple(shape)} has strides {tuple(strides)} bytes"
            )
        expected *= extent
    if shape[0] > 1 and strides[0] < expected:
        raise ValueError(
            f"{name}: blocks overlap or run backwards (stride {strides[0]} bytes "
            f"for blocks of {expected} bytes)"
        )
    return BlockLayout(ptr, int(shape[0]), int(strides[0]), int(expected), readonly, producer)


def uniform_torch_layout(tensors: list) -> tuple[BlockLayout, np.ndarray] | None:
    """One layout for a list of torch tensors of one type, shape, stride and dtype,
    and every tensor's address: O(1) attribute reads per tensor. None otherwise."""
    first = tensors[0]
    kind = type(first)
    if framework_of(first) != "torch":
        return None
    layout = _torch_layout(first)
    if layout is None:
        return None
    shape, stride, dtype = first.shape, first.stride(), first.dtype
    ptrs = []
    try:
        for t in tensors:
            if type(t) is not kind or t.shape != shape or t.stride() != stride or t.dtype != dtype:
                return None
            ptrs.append(t.data_ptr())  # sparse tensors raise here, nested ones at .shape
    except RuntimeError:
        return None  # the full path names the tensor and what it is
    if 0 in ptrs:
        return None  # a meta tensor (no memory) or an empty one: the full path decides
    found = np.array(ptrs, dtype=np.uint64)
    # Conjugate and negative bits are per tensor and cost a call each: a list is checked
    # once per set of addresses (an engine passes the same caches every step).
    key = (kind, shape, stride, dtype, found.tobytes())
    if key not in _plain_lists:
        if any(t.is_neg() or t.is_conj() for t in tensors):
            return None
        make_room(_plain_lists, _PLAIN_LISTS_KEPT)
        _plain_lists[key] = None
    return layout, found


_PLAIN_LISTS_KEPT = 1024
_plain_lists: dict[tuple, None] = {}  # tensor lists found free of conjugate/negative bits


def is_flat_buffer(obj: Any) -> bool:
    """A cuda.core Buffer: bytes without a shape, whose blocks are sized by the other side."""
    return (
        framework_of(obj) == "cuda.core"
        and hasattr(obj, "handle")
        and hasattr(obj, "size")
        and not hasattr(obj, "shape")
    )


def _buffer_address(buffer: Any) -> int:
    return int(buffer.handle)


def flat_buffer_layout(buffer: Any, block_bytes: int, name: str) -> BlockLayout:
    """A flat buffer seen as back-to-back blocks of ``block_bytes``."""
    size = int(buffer.size)
    if block_bytes <= 0 or size % block_bytes:
        raise ValueError(
            f"{name}: a buffer of {size} bytes does not hold whole blocks of {block_bytes} bytes"
        )
    return BlockLayout(_buffer_address(buffer), size // block_bytes, block_bytes, block_bytes, False)


class BlockView:
    """Blocks in memory kvcopy cannot infer a shape for: a raw pointer from a
    custom allocator, or a cuda.core Buffer. Made by :func:`kvcopy.block_view`."""

    __slots__ = ("layout", "owner")

    def __init__(self, layout: BlockLayout, owner: Any = None) -> None:
        if not isinstance(layout, BlockLayout):
            raise TypeError(
                f"BlockView takes a BlockLayout, got {type(layout).__name__}; make "
                "views with kvcopy.block_view(memory, block_bytes, ...)"
            )
        self.layout = layout
        self.owner = owner  # keeps a Buffer alive as long as the view

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"BlockView(ptr={lay.ptr:#x}, num_blocks={lay.num_blocks}, "
            f"block_bytes={lay.block_bytes}, block_stride={lay.block_stride})"
        )


def block_view(
    memory: Any,
    block_bytes: int,
    *,
    num_blocks: int | None = None,
    block_stride: int | None = None,
    readonly: bool = False,
) -> BlockView:
    """Describe blocks for :func:`kvcopy.swap_blocks` in memory without a shape.

    Args:
        memory: an integer address (device, pinned or pageable host memory) or
            a cuda.core Buffer.
        block_bytes: bytes of one block (each block contiguous).
        num_blocks: blocks in the memory; required for an address, for a
            Buffer defaults to as many as fit.
        block_stride: bytes from one block to the next (default block_bytes).
        readonly: refuse to be a destination.

    Raises:
        TypeError: ``memory`` is neither an int nor a cuda.core Buffer.
        ValueError: sizes that are not positive, or blocks past the Buffer's end.
    """
    for label, value in (
        ("block_bytes", block_bytes),
        ("num_blocks", num_blocks),
        ("block_stride", block_stride),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise TypeError(f"block_view: {label} must be an int, got {type(value).__name__}")
    if not isinstance(readonly, (bool, np.bool_)):
        raise TypeError(f"block_view: readonly must be a bool, got {type(readonly).__name__}")
    block_bytes = int(block_bytes)
    if block_bytes <= 0:
        raise ValueError(f"block_view: block_bytes must be positive, got {block_bytes}")
    stride = block_bytes if block_stride is None else int(block_stride)
    if stride < block_bytes:
        raise ValueError(f"block_view: block_stride {stride} is smaller than block_bytes {block_bytes}")
    if isinstance(memory, (int, np.integer)) and not isinstance(memory, bool):
        if num_blocks is None:
            raise ValueError("block_view: num_blocks is required for an integer address")
        ptr, owner, capacity = int(memory), None, None
        if not 0 < ptr < _U64_LIMIT:
            raise ValueError(f"block_view: address must be positive and below 2**64, got {ptr}")
    elif is_flat_buffer(memory):
        ptr, owner, capacity = _buffer_address(memory), memory, int(memory.size)
    else:
        raise TypeError(f"block_view: expected an int address or a cuda.core Buffer, got {type_name(memory)}")
    if num_blocks is None:
        assert capacity is not None  # an integer address requires num_blocks (checked above)
        num_blocks = 1 + (capacity - block_bytes) // stride if capacity >= block_bytes else 0
    num_blocks = int(num_blocks)
    if num_blocks < 0:
        raise ValueError(f"block_view: num_blocks must be >= 0, got {num_blocks}")
    span = (num_blocks - 1) * stride + block_bytes if num_blocks else 0
    if capacity is not None and span > capacity:
        raise ValueError(
            f"block_view: {num_blocks} blocks of {block_bytes} bytes every {stride} "
            f"bytes need {span} bytes; the buffer has {capacity}"
        )
    if ptr + span > _U64_LIMIT:
        raise ValueError(
            f"block_view: {num_blocks} blocks of {block_bytes} bytes every {stride} "
            f"bytes from {ptr:#x} run past the end of the 64-bit address space"
        )
    return BlockView(BlockLayout(ptr, num_blocks, stride, block_bytes, bool(readonly)), owner)


def strided(obj: Any, name: str) -> tuple[int, tuple, tuple, int]:
    """(pointer, shape, byte strides, itemsize) of a tensor or array of any framework
    kvcopy reads. Raises TypeError naming ``name`` for anything else."""
    ptr, shape, strides, itemsize, _readonly = strided_access(obj, name)
    return ptr, shape, strides, itemsize


def strided_access(obj: Any, name: str) -> tuple[int, tuple, tuple, int, bool]:
    """strided's answer and whether the memory is read-only (a read-only NumPy array or
    memmap, a ``bytes`` object's buffer, a JAX array, a producer that says so)."""
    ptr, shape, strides, itemsize, readonly, _stream = _raw(obj, name, None)
    return (
        int(ptr),
        tuple(int(e) for e in shape),
        tuple(int(s) for s in strides),
        int(itemsize),
        bool(readonly),
    )
