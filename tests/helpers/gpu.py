"""Buffers and reference checks shared by the GPU tests."""

from __future__ import annotations

import functools

import numpy as np
import pytest

POOL_DEVICES = {
    "h2d": ("pinned", "cuda"),
    "d2h": ("cuda", "pinned"),
    "d2d": ("cuda", "cuda"),
    "pageable_h2d": ("pageable", "cuda"),
    "pageable_d2h": ("cuda", "pageable"),
}


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
