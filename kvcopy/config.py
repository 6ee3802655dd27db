"""User-settable defaults."""
from __future__ import annotations

import os
from dataclasses import dataclass


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else default


@dataclass
class Config:
    """kvcopy's tunables; change them on ``kvcopy.config``.

    host_ctas: CTAs the copy kernel uses for copies that touch host memory.
        16 saturate PCIe on an H200 in both directions while leaving the other
        116 SMs to the model (a 16-CTA copy slowed a full-GPU kernel by ~1.5%).
    device_ctas: CTAs for GPU-to-GPU copies; None means one per SM.
    threads_per_cta: threads of each copy-kernel CTA (a multiple of 32, at most 512).
    batch_chunk: descriptors per cuMemcpyBatchAsync call (very large batches
        were reported to hang on some parts).
    """

    host_ctas: int = _env_int("KVCOPY_HOST_CTAS", 16)
    device_ctas: int | None = _env_int("KVCOPY_DEVICE_CTAS", None)
    batch_chunk: int = _env_int("KVCOPY_BATCH_CHUNK", 16384)
    threads_per_cta: int = _env_int("KVCOPY_THREADS", 512)


config = Config()
