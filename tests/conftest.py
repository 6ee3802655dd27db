"""Shared fixtures. GPU tests are marked `gpu` and skip where no GPU is found."""
from __future__ import annotations

import functools
import os

import pytest

# JAX, where a GPU test imports it, must not take 75% of the GPU's memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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
        from kvcopy import _driver

        _driver.init()
    except Exception as exc:  # noqa: BLE001 - any failure means no GPU here
        return f"CUDA driver unusable: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def torch_cuda():
    import torch

    torch.cuda.init()
    return torch
