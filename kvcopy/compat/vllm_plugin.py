"""kvcopy as a vLLM general plugin: its drop-ins in place in every vLLM process.

vLLM calls each ``vllm.general_plugins`` entry point in every process it starts (the
API server, the engine core, each worker) before the model is loaded. kvcopy's entry
point, ``register``, acts only when asked: ``KVCOPY_VLLM=1`` (or ``kvcopy`` named in
vLLM's own ``VLLM_PLUGINS`` selection) puts ``kvcopy.compat.vllm.CopyBackendAdapter``
in place of the CPU offload worker's own, and ``KVCOPY_LMCACHE=1`` kvcopy's ops in
``lmcache.c_ops`` (LMCache runs inside vLLM's workers as its KV connector).
Otherwise installing kvcopy changes nothing in vLLM. Each process that takes
kvcopy's ops logs one line saying so (logger ``kvcopy.engines``, INFO).
"""

from __future__ import annotations

import os

from kvcopy.compat.engines import asked as asked_by_name
from kvcopy.compat.engines import patch


def asked() -> bool:
    """Whether the user asked for kvcopy in vLLM: KVCOPY_VLLM, or VLLM_PLUGINS naming it."""
    if asked_by_name("vllm"):
        return True
    chosen = os.environ.get("VLLM_PLUGINS")
    return chosen is not None and "kvcopy" in {p.strip() for p in chosen.split(",")}


def register() -> dict[str, bool]:
    """vLLM's plugin hook: patch the engines asked for (see the module's docstring);
    for each, whether it was patched."""
    wanted = [name for name, yes in (("vllm", asked()), ("lmcache", asked_by_name("lmcache"))) if yes]
    return patch(*wanted) if wanted else {}


__all__ = ["asked", "register"]
