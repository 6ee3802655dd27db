"""kvcopy's vLLM general plugin, loaded as vLLM loads plugins: the entry points of the
``vllm.general_plugins`` group read through importlib.metadata and each called, in a
fresh process beside a stand-in vLLM; kvcopy's backend is in place only where asked."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

import kvcopy.compat.vllm_plugin as plugin

LOADER = textwrap.dedent("""
    import logging, sys
    from importlib.metadata import entry_points
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
    for ep in entry_points(group="vllm.general_plugins"):   # as vLLM's plugin loader does
        ep.load()()
    from vllm.v1.kv_offload.cpu import gpu_worker
    import kvcopy.compat.vllm
    print("kvcopy backend:", gpu_worker.CopyBackendAdapter is kvcopy.compat.vllm.CopyBackendAdapter)
""")


@pytest.fixture
def stand_in_vllm(tmp_path):
    """A vllm package holding the CPU offload worker's module and its own adapter."""
    worker = tmp_path / "vllm" / "v1" / "kv_offload" / "cpu"
    worker.mkdir(parents=True)
    for folder in (tmp_path / "vllm", tmp_path / "vllm" / "v1", tmp_path / "vllm" / "v1" /
                   "kv_offload", worker):
        (folder / "__init__.py").write_text("")
    (worker / "gpu_worker.py").write_text("class CopyBackendAdapter:\n    pass\n")
    return tmp_path


def _load(stand_in, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("KVCOPY_VLLM", "VLLM_PLUGINS")}
    environ.update(env, PYTHONPATH=os.pathsep.join([str(stand_in), *sys.path]))
    return subprocess.run([sys.executable, "-c", LOADER], capture_output=True, text=True,
                          env=environ, timeout=120)


def test_kvcopy_is_a_vllm_general_plugin():
    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvcopy"]
    assert [ep.value for ep in found] == ["kvcopy.compat.vllm_plugin:register"]


@pytest.mark.parametrize("env", [{"KVCOPY_VLLM": "1"}, {"VLLM_PLUGINS": "other,kvcopy"}])
def test_asked_the_plugin_puts_kvcopys_backend_in_place(stand_in_vllm, env):
    run = _load(stand_in_vllm, **env)
    assert run.returncode == 0, run.stderr
    assert "kvcopy backend: True" in run.stdout
    assert "kvcopy.vllm kvcopy: vLLM's CPU offload copies go through kvcopy" in run.stdout


@pytest.mark.parametrize("env", [{}, {"KVCOPY_VLLM": "0"}, {"VLLM_PLUGINS": "other"}])
def test_unasked_the_plugin_changes_nothing(stand_in_vllm, env):
    run = _load(stand_in_vllm, **env)
    assert run.returncode == 0, run.stderr
    assert "kvcopy backend: False" in run.stdout


def test_a_vllm_without_the_offload_worker_is_named_and_left_alone(monkeypatch):
    monkeypatch.setenv("KVCOPY_VLLM", "1")
    monkeypatch.setitem(sys.modules, "vllm", None)   # (import vllm fails)
    assert plugin.register() is False
