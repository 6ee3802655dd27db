"""kvcopy as a vLLM general plugin: its copy backend in place in every vLLM process.

vLLM calls each ``vllm.general_plugins`` entry point in every process it starts (the
API server, the engine core, each worker) before the model is loaded. kvcopy's entry
point, ``register``, puts ``kvcopy.compat.vllm.CopyBackendAdapter`` in place of the
CPU offload worker's own only when asked: ``KVCOPY_VLLM=1`` in the environment, or
``kvcopy`` named in vLLM's own ``VLLM_PLUGINS`` selection (which vLLM reads to load
only the plugins it names). Otherwise installing kvcopy changes nothing in vLLM.
Each process that takes kvcopy's backend logs one line saying so (logger
``kvcopy.vllm``, level INFO).
"""
from __future__ import annotations

import logging
import os

from kvcopy.compat import vllm as kvcopy_vllm

_log = logging.getLogger("kvcopy.vllm")
_TRUE = {"1", "true", "yes", "on"}


def asked() -> bool:
    """Whether the user asked for kvcopy in vLLM: KVCOPY_VLLM, or VLLM_PLUGINS naming it."""
    if os.environ.get("KVCOPY_VLLM", "").strip().lower() in _TRUE:
        return True
    chosen = os.environ.get("VLLM_PLUGINS")
    return chosen is not None and "kvcopy" in {p.strip() for p in chosen.split(",")}


def register() -> bool:
    """vLLM's plugin hook: where asked (see the module's docstring), set kvcopy's copy
    backend in vLLM's CPU offload worker. Returns whether it did; a vLLM without that
    worker is told in a warning and left as it is."""
    if not asked():
        return False
    try:
        from vllm.v1.kv_offload.cpu import gpu_worker
    except ImportError as exc:
        _log.warning("kvcopy: vLLM's CPU offload worker cannot be imported (%s); its copies "
                     "stay vLLM's", exc)
        return False
    if not hasattr(gpu_worker, "CopyBackendAdapter"):
        _log.warning("kvcopy: this vLLM's CPU offload worker has no CopyBackendAdapter; its "
                     "copies stay vLLM's")
        return False
    gpu_worker.CopyBackendAdapter = kvcopy_vllm.CopyBackendAdapter
    _log.info("kvcopy: vLLM's CPU offload copies go through kvcopy's CopyBackendAdapter "
              "(process %d)", os.getpid())
    return True


__all__ = ["asked", "register"]
