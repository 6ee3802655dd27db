"""kvcopy's drop-ins set in the engines' own modules, in the process that asks.

``patch("sglang", "lmcache", "vllm")`` puts kvcopy's ops in place of each named
engine's: SGLang's ``sgl_kernel.kvcacheio`` transfers (and its JIT HiCache
transfers in ``sglang.jit_kernel.hicache``, where that module exists), LMCache's
``lmcache.c_ops`` transfer ops, and vLLM's CPU offload ``CopyBackendAdapter``. An
engine that is not installed, or lacks the module, is left alone (its entry reads
False). ``patch_from_environment()`` patches the engines named by ``KVCOPY_VLLM``,
``KVCOPY_SGLANG`` and ``KVCOPY_LMCACHE`` (1, true, yes or on).

The engines run their copies in worker processes. vLLM's (and LMCache's, which runs
inside vLLM's workers) are reached by kvcopy's vLLM plugin
(kvcopy.compat.vllm_plugin), which vLLM calls in every process. SGLang has no plugin
hook; a ``sitecustomize.py`` on ``PYTHONPATH`` that calls ``patch_from_environment()``
runs in every Python process, its spawned workers included (docs/engines.md).
Each engine patched logs one line (logger ``kvcopy.engines``, INFO).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

from kvcopy.compat import lmcache, sglang, sglang_jit
from kvcopy.compat import vllm as vllm_compat

_log = logging.getLogger("kvcopy.engines")
_TRUE = {"1", "true", "yes", "on"}
_LMCACHE_OPS = (
    "multi_layer_kv_transfer",
    "multi_layer_kv_transfer_unilateral",
    "single_layer_kv_transfer",
    "single_layer_kv_transfer_sgl",
)


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _set(module: ModuleType, names: list[str] | tuple[str, ...], source: ModuleType) -> None:
    for name in names:
        setattr(module, name, getattr(source, name))


def _patch_sglang() -> bool:
    kvcacheio = _module("sgl_kernel.kvcacheio")
    if kvcacheio is None:
        return False
    _set(kvcacheio, sglang.__all__, sglang)
    hicache = _module("sglang.jit_kernel.hicache")
    if hicache is not None:
        _set(hicache, sglang_jit.__all__, sglang_jit)
    return True


def _patch_lmcache() -> bool:
    c_ops = _module("lmcache.c_ops")
    if c_ops is None:
        return False
    _set(c_ops, _LMCACHE_OPS, lmcache)
    return True


def _patch_vllm() -> bool:
    gpu_worker = _module("vllm.v1.kv_offload.cpu.gpu_worker")
    if gpu_worker is None or not hasattr(gpu_worker, "CopyBackendAdapter"):
        return False
    setattr(gpu_worker, "CopyBackendAdapter", vllm_compat.CopyBackendAdapter)
    return True


_PATCHES = {"sglang": _patch_sglang, "lmcache": _patch_lmcache, "vllm": _patch_vllm}


def patch(*engines: str) -> dict[str, bool]:
    """Set kvcopy's drop-ins in the named engines' modules (all three where none is
    named); for each engine, whether it was patched. ValueError for an unknown name."""
    names = engines or tuple(_PATCHES)
    unknown = [n for n in names if n not in _PATCHES]
    if unknown:
        raise ValueError(f"patch: unknown engine {unknown[0]!r}; expected one of {', '.join(_PATCHES)}")
    done = {}
    for name in names:
        done[name] = _PATCHES[name]()
        if done[name]:
            _log.info("kvcopy: %s's copies go through kvcopy (process %d)", name, os.getpid())
        else:
            _log.warning(
                "kvcopy: %s was asked for but its modules cannot be imported here; its copies stay its own",
                name,
            )
    return done


def asked(engine: str) -> bool:
    """Whether ``KVCOPY_<ENGINE>`` asks for kvcopy in that engine."""
    return os.environ.get(f"KVCOPY_{engine.upper()}", "").strip().lower() in _TRUE


def patch_from_environment() -> dict[str, bool]:
    """patch() for the engines the environment asks for (KVCOPY_VLLM, KVCOPY_SGLANG,
    KVCOPY_LMCACHE); {} where it asks for none."""
    wanted = [name for name in _PATCHES if asked(name)]
    return patch(*wanted) if wanted else {}


__all__ = ["asked", "patch", "patch_from_environment"]
