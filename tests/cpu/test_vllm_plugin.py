"""kvcopy's drop-ins reaching the engines' worker processes: its vLLM general plugin
loaded as vLLM loads plugins (the ``vllm.general_plugins`` entry points read through
importlib.metadata and each called, in a fresh process beside stand-in engines), and
SGLang's workers reached through a ``sitecustomize.py`` in a spawned child; kvcopy's
ops are in place only where asked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

import kvcopy.compat.engines as engines

LOADER = textwrap.dedent("""
    import logging, sys
    from importlib.metadata import entry_points
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
    for ep in entry_points(group="vllm.general_plugins"):   # as vLLM's plugin loader does
        ep.load()()
    from vllm.v1.kv_offload.cpu import gpu_worker
    import lmcache.c_ops
    import kvcopy.compat.lmcache, kvcopy.compat.vllm
    print("vllm:", gpu_worker.CopyBackendAdapter is kvcopy.compat.vllm.CopyBackendAdapter)
    print("lmcache:", lmcache.c_ops.multi_layer_kv_transfer
          is kvcopy.compat.lmcache.multi_layer_kv_transfer)
""")

SPAWNED = textwrap.dedent("""
    import multiprocessing as mp

    def child(queue):
        import sgl_kernel.kvcacheio as kvcacheio
        import kvcopy.compat.sglang
        queue.put(kvcacheio.transfer_kv_per_layer is kvcopy.compat.sglang.transfer_kv_per_layer)

    if __name__ == "__main__":
        context = mp.get_context("spawn")   # as SGLang starts its scheduler processes
        queue = context.Queue()
        worker = context.Process(target=child, args=(queue,))
        worker.start()
        print("sglang worker:", queue.get(timeout=60))
        worker.join()
""")


def _package(root, dotted: str, body: str) -> None:
    """A stand-in module ``dotted`` (its packages made empty) holding ``body``."""
    parts = dotted.split(".")
    folder = root
    for part in parts[:-1]:
        folder = folder / part
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").touch()
    (folder / f"{parts[-1]}.py").write_text(body)


@pytest.fixture
def stand_ins(tmp_path):
    """vLLM's offload worker, LMCache's c_ops and SGLang's kvcacheio, each holding its
    own op."""
    _package(tmp_path, "vllm.v1.kv_offload.cpu.gpu_worker", "class CopyBackendAdapter:\n    pass\n")
    _package(tmp_path, "lmcache.c_ops", "def multi_layer_kv_transfer():\n    pass\n")
    _package(tmp_path, "sgl_kernel.kvcacheio", "def transfer_kv_per_layer():\n    pass\n")
    return tmp_path


def _run(code: str, path: list, cwd, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCOPY_") and k != "VLLM_PLUGINS"}
    environ.update(env, PYTHONPATH=os.pathsep.join([*map(str, path), *sys.path]))
    script = cwd / "main.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=environ, timeout=120, cwd=cwd
    )


def test_kvcopy_is_a_vllm_general_plugin():
    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvcopy"]
    assert [ep.value for ep in found] == ["kvcopy.compat.vllm_plugin:register"]


@pytest.mark.parametrize(
    "env, vllm, lmcache",
    [
        ({"KVCOPY_VLLM": "1"}, True, False),
        ({"VLLM_PLUGINS": "other,kvcopy"}, True, False),
        ({"KVCOPY_LMCACHE": "1"}, False, True),
        ({"KVCOPY_VLLM": "yes", "KVCOPY_LMCACHE": "on"}, True, True),
        ({}, False, False),
        ({"KVCOPY_VLLM": "0"}, False, False),
        ({"VLLM_PLUGINS": "other"}, False, False),
    ],
)
def test_the_plugin_patches_what_is_asked_for_and_nothing_else(stand_ins, env, vllm, lmcache):
    run = _run(LOADER, [stand_ins], stand_ins, **env)
    assert run.returncode == 0, run.stderr
    assert f"vllm: {vllm}" in run.stdout and f"lmcache: {lmcache}" in run.stdout
    assert ("kvcopy.engines kvcopy: vllm's copies go through kvcopy" in run.stdout) == vllm


@pytest.mark.parametrize("asked", [True, False])
def test_sitecustomize_reaches_sglangs_spawned_workers(stand_ins, tmp_path_factory, asked):
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(
        "import kvcopy.compat.engines\nkvcopy.compat.engines.patch_from_environment()\n"
    )
    run = _run(SPAWNED, [site, stand_ins], stand_ins, **({"KVCOPY_SGLANG": "1"} if asked else {}))
    assert run.returncode == 0, run.stderr
    assert f"sglang worker: {asked}" in run.stdout


def test_an_engine_not_installed_is_named_and_left_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "sgl_kernel", None)  # (import sgl_kernel fails)
    assert engines.patch("sglang") == {"sglang": False}
    with pytest.raises(ValueError, match="unknown engine 'trtllm'"):
        engines.patch("trtllm")
