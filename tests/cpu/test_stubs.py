"""Every name a Cython module's .pyi stub declares exists in the built module, with
the same kind (function or constant): the stubs are what users and type checkers
read, and a name lost from a .pyx would otherwise surface only on a GPU."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

KVCOPY = Path(__file__).resolve().parents[2] / "kvcopy"


def declared(stub: Path) -> dict[str, str]:
    names: dict[str, str] = {}
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = "function"
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = "constant"
        elif isinstance(node, ast.Assign):
            names.update({t.id: "constant" for t in node.targets if isinstance(t, ast.Name)})
    return names


STUBS = sorted(KVCOPY.glob("_*.pyi")) + sorted((KVCOPY / "_cuda").glob("*.pyi"))


def module_of(stub: Path) -> str:
    return ".".join(stub.relative_to(KVCOPY.parent).with_suffix("").parts)


def test_every_cython_module_has_a_stub():
    modules = sorted(KVCOPY.rglob("*.pyx"))
    missing = [p.name for p in modules if not p.with_suffix(".pyi").is_file()]
    assert not missing, f"Cython modules without a .pyi stub: {missing}"


@pytest.mark.parametrize("stub", STUBS, ids=module_of)
def test_stub_names_exist_in_the_built_module(stub):
    module = importlib.import_module(module_of(stub))
    names = declared(stub)
    assert names, f"{stub.name} declares nothing"
    missing = sorted(n for n in names if not hasattr(module, n))
    assert not missing, f"{stub.name} declares names kvcopy.{stub.stem} lacks: {missing}"
    wrong = sorted(n for n, kind in names.items() if callable(getattr(module, n)) != (kind == "function"))
    assert not wrong, f"functions and constants mixed up: {wrong}"
