"""The blocks of docs/engines.md put kvcopy's ops in the engines' own modules where the
engines are installed (stand-in modules here) and do nothing where they are not."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

import kvcopy.compat.lmcache
import kvcopy.compat.sglang
import kvcopy.compat.vllm

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE, re.S)
ENGINES = [  # (the module a block changes, and the modules above it; what it must hold)
    (
        [
            "vllm",
            "vllm.v1",
            "vllm.v1.kv_offload",
            "vllm.v1.kv_offload.cpu",
            "vllm.v1.kv_offload.cpu.gpu_worker",
        ],
        kvcopy.compat.vllm,
        ["CopyBackendAdapter"],
    ),
    (["sgl_kernel", "sgl_kernel.kvcacheio"], kvcopy.compat.sglang, kvcopy.compat.sglang.__all__),
    (
        ["lmcache", "lmcache.c_ops"],
        kvcopy.compat.lmcache,
        [
            "multi_layer_kv_transfer",
            "multi_layer_kv_transfer_unilateral",
            "single_layer_kv_transfer",
            "single_layer_kv_transfer_sgl",
        ],
    ),
]


def test_the_page_has_a_block_per_engine():
    assert len(BLOCKS) == len(ENGINES)


@pytest.mark.parametrize("index", range(len(ENGINES)), ids=["vllm", "sglang", "lmcache"])
def test_a_block_does_nothing_without_its_engine(index):
    names, _, _ = ENGINES[index]
    if importlib.util.find_spec(names[0]) is not None:
        pytest.skip(f"{names[0]} is installed here: the block would change it")
    exec(compile(BLOCKS[index], "docs/engines.md", "exec"), {})
    assert names[0] not in sys.modules


@pytest.mark.parametrize("index", range(len(ENGINES)), ids=["vllm", "sglang", "lmcache"])
def test_a_block_puts_kvcopys_ops_in_its_engines_module(monkeypatch, index):
    names, ours, ops = ENGINES[index]
    made: dict[str, types.ModuleType] = {}
    for name in names:
        module = made[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(made[parent], child, module)
    exec(compile(BLOCKS[index], "docs/engines.md", "exec"), {})
    target = made[names[-1]]
    assert ops and all(getattr(target, op) is getattr(ours, op) for op in ops)
