"""Buffers and reference checks shared by the GPU tests."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest

POOL_DEVICES = {
    "h2d": ("pinned", "cuda"),
    "d2h": ("cuda", "pinned"),
    "d2d": ("cuda", "cuda"),
    "pageable_h2d": ("pageable", "cuda"),
    "pageable_d2h": ("cuda", "pageable"),
}


def ordered_stream(torch: Any) -> Any:
    """A new torch stream whose work starts after what is queued on torch's current
    stream so far. torch's streams do not wait for the default stream, so a tensor
    made or changed there (zeros, randint, an index moved with ``.cuda()``) may still be
    in flight when a copy on a new stream reads or overwrites it: the GPU suite's
    parallel shards delay the default stream's work enough for that to happen."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


def make_pool(kind: str, nbytes: int, seed: int):
    """A uint8 buffer filled with random bytes: torch tensor, or NumPy for 'pageable'."""
    import torch

    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    if kind == "pageable":
        return data
    tensor = torch.from_numpy(data)
    if kind == "pinned":
        return tensor.pin_memory()
    return tensor.cuda()


def address(buf) -> int:
    return buf.ctypes.data if isinstance(buf, np.ndarray) else buf.data_ptr()


def host_bytes(buf) -> np.ndarray:
    import torch

    if isinstance(buf, np.ndarray):
        return buf.copy()
    torch.cuda.synchronize()
    return buf.cpu().numpy().copy()


def scattered(count: int, sizes, pool_bytes: int, rng, align: int = 1):
    """Non-overlapping random [offset, offset + size) ranges inside a pool."""
    sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), (count,)).copy()
    slot = int(sizes.max()) + align
    slots = pool_bytes // slot
    assert slots >= count, "pool too small for the requested copies"
    chosen = rng.choice(slots, size=count, replace=False).astype(np.int64)
    offsets = chosen * slot + rng.integers(0, align, count) if align > 1 else chosen * slot
    return offsets, sizes


def expected_after(src_before: np.ndarray, dst_before: np.ndarray, src_off, dst_off, sizes):
    out = dst_before.copy()
    for s, d, n in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist()):
        out[d : d + n] = src_before[s : s + n]
    return out


def jax_gpu():
    """JAX and its first GPU device; skips the test where JAX or a JAX GPU is missing."""
    jax = pytest.importorskip("jax")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("jax sees no GPU")
    return jax, gpus[0]


@functools.lru_cache(maxsize=None)
def gpu_reason() -> str | None:
    """None when a CUDA GPU and torch with CUDA are usable, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        from kvcopy.testing import cuda

        kv_driver = cuda.driver

        kv_driver.init()
    except Exception as exc:  # noqa: BLE001 - any failure means no GPU here
        return f"CUDA driver unusable: {exc}"
    return None


@dataclasses.dataclass
class ShuffledUpload:
    """``count`` blocks of ``block`` random bytes in pinned host memory, copied in a
    random order into consecutive blocks of a GPU buffer: copy_batch's arrays, and the
    GPU bytes expected after. Holds the host memory the pointers name."""

    host: Any
    dev: Any
    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    expected: Any

    def landed(self) -> bool:
        """Whether the GPU buffer holds the expected bytes (call after the copy ends)."""
        import torch

        return bool(torch.equal(self.dev.view(self.expected.shape), self.expected))


def shuffled_upload(block: int, count: int) -> ShuffledUpload:
    """A ShuffledUpload of ``count`` blocks of ``block`` bytes (fixed seeds)."""
    import torch

    host = torch.from_numpy(np.random.default_rng(0).integers(0, 256, block * count, dtype=np.uint8))
    host = host.pin_memory()
    dev = torch.zeros(block * count, dtype=torch.uint8, device="cuda")
    order = np.random.default_rng(1).permutation(count).astype(np.uint64)
    src = np.uint64(host.data_ptr()) + order * np.uint64(block)
    dst = np.uint64(dev.data_ptr()) + np.arange(count, dtype=np.uint64) * np.uint64(block)
    sizes = np.full(count, block, dtype=np.uint64)
    expected = host.view(count, block)[torch.from_numpy(order.astype(np.int64))].cuda()
    return ShuffledUpload(host, dev, src, dst, sizes, expected)
