"""Runs pointer copies between host arrays with memmove: what a planned batch writes,
checked on the CPU against an oracle in NumPy."""

from __future__ import annotations

import ctypes

import numpy as np


def run_on_host(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


def random_bytes(shape: tuple, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)
