"""User-settable defaults, validated when set and when read from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcopy.arguments import require_bool, require_int

MAX_THREADS_PER_CTA = 512  # the copy kernel is compiled for at most 512 threads per CTA


@dataclass(frozen=True)
class _Setting:
    env: str
    default: int | None
    minimum: int
    maximum: int
    multiple_of: int = 1
    optional: bool = False  # None allowed (means "decide per device")
    boolean: bool = False  # True/False; the environment variable is 0 or 1


_SETTINGS = {
    "host_ctas": _Setting("KVCOPY_HOST_CTAS", None, 1, 65535, optional=True),
    "device_ctas": _Setting("KVCOPY_DEVICE_CTAS", None, 1, 65535, optional=True),
    "peer_ctas": _Setting("KVCOPY_PEER_CTAS", None, 1, 65535, optional=True),
    "enable_peer_access": _Setting("KVCOPY_ENABLE_PEER_ACCESS", 1, 0, 1, boolean=True),
    "batch_chunk": _Setting("KVCOPY_BATCH_CHUNK", 16384, 1, 1 << 24),
    "threads_per_cta": _Setting(
        "KVCOPY_THREADS", MAX_THREADS_PER_CTA, 32, MAX_THREADS_PER_CTA, multiple_of=32
    ),
    "stores_by_dma": _Setting("KVCOPY_STORES_BY_DMA", 0, 0, 1, boolean=True),
    "bulk_stores": _Setting("KVCOPY_BULK_STORES", 1, 0, 1, boolean=True),
    "bulk_ctas": _Setting("KVCOPY_BULK_CTAS", None, 1, 65535, optional=True),
    "launch_bytes": _Setting("KVCOPY_LAUNCH_BYTES", 16 << 20, 0, 1 << 40),
    "staging_bytes": _Setting("KVCOPY_STAGING_BYTES", 4 << 20, 0, 1 << 30, multiple_of=4096),
    "traffic_window_ms": _Setting("KVCOPY_TRAFFIC_WINDOW_MS", 50, 0, 60_000),
    "auto_calibrate": _Setting("KVCOPY_AUTO_CALIBRATE", 1, 0, 1, boolean=True),
    "guard": _Setting("KVCOPY_GUARD", 0, 0, 1, boolean=True),
}


def _validate(name: str, value: Any) -> int | bool | None:
    spec = _SETTINGS[name]
    if value is None and spec.optional:
        return None
    if spec.boolean:
        return require_bool(value, f"kvcopy.config.{name}")
    value = require_int(value, f"kvcopy.config.{name}", minimum=spec.minimum, maximum=spec.maximum)
    if value % spec.multiple_of:
        raise ValueError(f"kvcopy.config.{name} must be a multiple of {spec.multiple_of}, got {value}")
    return value


def env_int(variable: str, default: int | None, *, minimum: int, maximum: int) -> int | None:
    """An integer environment variable, or ``default`` where it is unset or empty.

    Raises:
        ValueError: the value is not an integer in [minimum, maximum]; the
            message names the variable.
    """
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = int(text, 10)
    except ValueError:
        raise ValueError(f"environment variable {variable}={text!r} is not an integer") from None
    if not minimum <= value <= maximum:
        raise ValueError(f"environment variable {variable}={value} is out of range [{minimum}, {maximum}]")
    return value


_PTDS = "CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM"


def per_thread_default_stream() -> bool:
    """Whether cuda-python maps stream handle 0 to the per-thread default stream.

    Read as cuda-python reads CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM: unset means
    no, else Python's int() of the text, non-zero meaning yes (so '00' and ' 0' are
    no, '+1' yes), so that the two libraries mean one stream by handle 0.

    Raises:
        ValueError: the value is not an integer (cuda-python cannot read it either).
    """
    text = os.environ.get(_PTDS)
    if text is None:
        return False
    try:
        return int(text) != 0
    except ValueError:
        raise ValueError(
            f"environment variable {_PTDS}={text!r} is not an integer; "
            "cuda-python reads it with int() too (0: legacy, 1: per-thread)"
        ) from None


def cache_dir() -> Path:
    """Where compiled kernels and calibrations are kept: $KVCOPY_CACHE_DIR, else
    $XDG_CACHE_HOME/kvcopy, else ~/.cache/kvcopy."""
    if os.environ.get("KVCOPY_CACHE_DIR"):
        return Path(os.environ["KVCOPY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvcopy"


def kernel_unroll() -> int:
    """Loads in flight per thread in the copy kernel (KVCOPY_UNROLL, 1-16, default 4)."""
    value = env_int("KVCOPY_UNROLL", 4, minimum=1, maximum=16)
    assert value is not None
    return value


def _from_environment(name: str) -> int | bool | None:
    spec = _SETTINGS[name]
    value = env_int(spec.env, spec.default, minimum=spec.minimum, maximum=spec.maximum)
    if spec.boolean:
        return bool(value)
    if value is not None and value % spec.multiple_of:
        raise ValueError(f"environment variable {spec.env}={value} must be a multiple of {spec.multiple_of}")
    return value


_changes = 0  # assignments to kvcopy.config so far (see changes())


def changes() -> int:
    """How many settings have been assigned so far: what was derived from the
    settings under another count (kvcopy._engine.replay's launches) is stale."""
    return _changes


class Config:
    """kvcopy's tunables; change them on ``kvcopy.config``. Every assignment is
    checked (TypeError for a wrong type, ValueError for a value out of range);
    ``del kvcopy.config.X`` restores X's default.

    host_ctas: CTAs the copy kernel uses for copies that touch host memory
        (1-65535, env KVCOPY_HOST_CTAS). None (default) means the device's:
        the fewest that reach 0.90 of the contiguous copy in each direction,
        found by kvcopy.calibrate, else policy.HOST_CTAS: 4 host-to-GPU, 2
        GPU-to-host, leaving the other SMs to the model. Also the layout
        kernel's (copy_rows), whose own default is policy.ROWS_HOST_CTAS.
    device_ctas: CTAs for copies inside one GPU; None means four per SM
        (env KVCOPY_DEVICE_CTAS).
    peer_ctas: CTAs for copies between two GPUs (NVLink or PCIe peer-to-peer);
        None means the device's default (env KVCOPY_PEER_CTAS).
    enable_peer_access: when a batch touches another GPU's memory that the
        launching GPU could reach but is not yet allowed to, enable peer access
        (cuCtxEnablePeerAccess, as torch does for its own copies) so the copy
        kernel can run; False leaves peer access as the application set it and
        such batches go by DMA (env KVCOPY_ENABLE_PEER_ACCESS=0/1, default 1).
    threads_per_cta: threads of each copy-kernel CTA: a multiple of 32 from 32
        to 512 (env KVCOPY_THREADS).
    batch_chunk: descriptors per cuMemcpyBatchAsync call (very large batches
        were reported to hang on some parts; env KVCOPY_BATCH_CHUNK).
    stores_by_dma: 'auto' sends GPU-to-host copies of every block size to the
        copy engines (cuMemcpyBatchAsync) wherever the stream allows them, for
        engines that store KV blocks while the model computes and must not
        lose even 1% to the copies: the engines cost compute next to nothing,
        at the rate one CPU thread feeds them. Default False: the kernel, at
        the link's rate (env KVCOPY_STORES_BY_DMA=0/1).
    bulk_stores: on GPUs with a bulk copy unit (sm_90+: H100, H200, B200), the
        copy kernel moves GPU-to-host copies of mean block 16-64 KiB
        (policy.BULK_MIN_BYTES..BULK_MAX_BYTES) through it (cp.async.bulk)
        rather than through registers: as fast alone, and a sixth of the cost
        to compute beside it. False: registers, as on older GPUs (env
        KVCOPY_BULK_STORES=0/1, default 1).
    bulk_ctas: CTAs (of two warps each) of those bulk copies; None means
        policy.BULK_STORE_CTAS (env KVCOPY_BULK_CTAS). host_ctas does not apply
        to them.
    launch_bytes: the most bytes one copy-kernel launch moves between host and
        GPU memory; larger batches go out as several launches in a row on the
        stream (0: one launch, however large; env KVCOPY_LAUNCH_BYTES, default
        16 MiB). A long-running copy launch holds its SMs across the starts of
        the model's kernels beside it; launches of a few MiB keep that small at
        no cost to the copy. copy_both_ways counts the larger side against it.
    staging_bytes: the chunk of a batch staged through GPU memory (kvcopy._engine.staged:
        batches whose host side is a few long spans, as LMCache's chunks are,
        at 64 MiB and more: the copy engines move each span whole and the copy
        kernel scatters inside the GPU). Four such buffers per GPU, allocated
        on first use (16 MiB at the default). 0 turns staging off; a multiple
        of 4096 up to 1 GiB (env KVCOPY_STAGING_BYTES, default 4 MiB).
    traffic_window_ms: where set, copy_batch's 'auto' treats a batch between
        host and GPU as one side of a copy both ways when the same GPU issued a
        batch the other way within this many milliseconds, on another stream and
        of at least a quarter of its bytes (kvcopy._engine.traffic_window): from the mean block
        at which copy_both_ways goes to the copy engines
        (policy.BOTH_WAYS_BATCH_MIN_BYTES, calibratable), it goes to them too,
        where the copy kernel would share the link badly with the other
        direction. A copy that only alternates direction within the window pays
        batched DMA's CPU cost instead. 0: each batch is decided alone; up to
        60000 (env KVCOPY_TRAFFIC_WINDOW_MS, default 50).
    auto_calibrate: at first use of a GPU whose host has no calibration for it
        (kvcopy._runtime.host_key: the GPU, its PCIe link, the host, the driver),
        measure it in the background, once per host, while the defaults serve
        (kvcopy._runtime.first_use says how it keeps out of the caller's way);
        env KVCOPY_AUTO_CALIBRATE=0/1, default 1 (0: the defaults serve until
        kvcopy.calibrate() measures on demand).
    guard: 'auto' times a sampled batch between host and GPU now and then (two
        events beside it, one batch a device at a time) and, where a path runs far
        below what calibration measured for it several times in a row, moves to the
        other method for a while, saying so in last_decision()
        (kvcopy.policy.guard); only where the device is calibrated. Env
        KVCOPY_GUARD=0/1, default 0.
    """

    host_ctas: int | None
    device_ctas: int | None
    peer_ctas: int | None
    enable_peer_access: bool
    batch_chunk: int
    threads_per_cta: int
    stores_by_dma: bool
    bulk_stores: bool
    bulk_ctas: int | None
    launch_bytes: int
    staging_bytes: int
    traffic_window_ms: int
    auto_calibrate: bool
    guard: bool

    def __init__(self) -> None:
        for name in _SETTINGS:
            object.__setattr__(self, name, _from_environment(name))

    def __setattr__(self, name: str, value: Any) -> None:
        global _changes
        if name not in _SETTINGS:
            raise AttributeError(f"kvcopy.config has no setting {name!r}; settings: {', '.join(_SETTINGS)}")
        object.__setattr__(self, name, _validate(name, value))
        _changes += 1

    def __delattr__(self, name: str) -> None:
        """``del kvcopy.config.X`` puts setting X back to its default (the environment
        variable's value where one is set, as at import)."""
        global _changes
        if name not in _SETTINGS:
            raise AttributeError(f"kvcopy.config has no setting {name!r}; settings: {', '.join(_SETTINGS)}")
        object.__setattr__(self, name, _from_environment(name))
        _changes += 1

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in _SETTINGS)
        return f"Config({values})"


config = Config()
