"""kvcopy's structure, checked on its source (CPU): imports run one way, no import
cycles, no kvcopy module imported inside a function, small modules, the probes and
the benchmark use no private names of other modules, nothing outside the package
reaches its private layers but through kvcopy.testing, and every default of a path
lives in the policy."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvcopy"
MAX_LINES = 400

# Layers, lowest first: a module may import its own layer's and lower layers'
# modules, never a higher layer's. The pure modules (no driver calls) may be
# used by every layer but import only each other.
PURE = {
    "kvcopy.arguments",
    "kvcopy.config",
    "kvcopy.errors",
    "kvcopy.kept",
    "kvcopy.policy",
    "kvcopy.policy.layout_kernel",
    "kvcopy.policy.defaults",
    "kvcopy.policy.guard",
    "kvcopy.interop",
    "kvcopy._plans",
    "kvcopy._plans.copies",
    "kvcopy._plans.blocks",
    "kvcopy._plans.races",
    "kvcopy._plans.overlaps",
    "kvcopy._plans.row_overlaps",
    "kvcopy._plans.rows",
    "kvcopy._plans.rows_races",
    "kvcopy._plans.rows_staging",
    "kvcopy.layouts",
    "kvcopy._cuda.plan_arrays",
    "kvcopy._cuda.tensor_stamps",
    "kvcopy._cuda.copy_loop",
    "kvcopy._engine.traffic_window",
    "kvcopy._runtime.persist",
    "kvcopy._runtime.calibration_file",
    "kvcopy._runtime.numa",
    "kvcopy._runtime.host_key",
    "kvcopy._runtime.first_use",
    "kvcopy._runtime.host_pages",
    "kvcopy.policy.host_pool",
    "kvcopy._runtime.kept_memory",
    "kvcopy._engine",
    "kvcopy._runtime",
}  # (the packages' docstring-only __init__)
LAYERS = [
    {"kvcopy._cuda"},  # the driver layer
    {
        "kvcopy._runtime.device",
        "kvcopy._runtime.kernels",
        "kvcopy._runtime.ring",
        "kvcopy._runtime.context",
        "kvcopy._runtime.peers",
        "kvcopy._runtime.side_streams",
        "kvcopy._runtime.prepare",
        "kvcopy.host",
        "kvcopy.host_pool",
    },  # per context
    # parts of paths
    {"kvcopy._engine.replay", "kvcopy._engine.decide", "kvcopy._engine.kernel", "kvcopy._engine.guard"},
    {"kvcopy._engine.repeats"},
    {"kvcopy._engine.dispatch", "kvcopy._engine.staged", "kvcopy._engine.rows"},
    {"kvcopy._engine.blocks"},
    {"kvcopy._engine.both_ways"},
    {"kvcopy._engine.rows_staged"},
    {"kvcopy._engine.rows_both_ways", "kvcopy._engine.rows_memo"},
    {
        "kvcopy.pointers",
        "kvcopy.blocks",
        "kvcopy.rows",
        "kvcopy.prepared_rows",
        "kvcopy.rows_both_ways",
        "kvcopy.queue",
        "kvcopy.calibrate",
        "kvcopy.nixl",
        "kvcopy.compat",
        "kvcopy.testing",
    },
    {"kvcopy"},  # __init__: re-exports
]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> list[Path]:
    return sorted(p for ext in ("py", "pyx", "pxd") for p in PACKAGE.rglob(f"*.{ext}"))


def kvcopy_imports(path: Path) -> tuple[set[str], list[str]]:
    """(kvcopy modules imported at module level, imports of kvcopy inside functions)."""
    text = path.read_text()
    found: set[str] = set()
    nested: list[str] = []
    if path.suffix != ".py":  # Cython: module-level (c)import lines
        for match in re.finditer(
            r"^(?:from\s+(kvcopy[\w.]*)\s+c?import\s+([\w, ()\n]+)"
            r"|import\s+(kvcopy[\w.]*))",
            text,
            re.M,
        ):
            found.add(match.group(1) or match.group(3))
        for match in re.finditer(r"^[ \t]+(?:from|import)[ \t]+kvcopy\b", text, re.M):
            nested.append(f"{path.name}: {match.group(0).strip()}")
        return found, nested
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [_imported_module(node.module or "", a.name) for a in node.names]
            )
            names = [n for n in names if (n == "kvcopy" or n.startswith("kvcopy."))]
            if not names:
                continue
            if node.col_offset > 0 and not _in_type_checking(tree, node):
                nested.append(f"{path.name}:{node.lineno}: {', '.join(names)}")
            else:
                found.update(names)
    return found, nested


def _imported_module(module: str, name: str) -> str:
    """What `from module import name` imports: the submodule module.name where there is
    one (kvcopy/…/name.py, .pyx or a package), else module itself."""
    base = ROOT.joinpath(*f"{module}.{name}".split("."))
    if base.is_dir() or any(base.with_suffix(ext).is_file() for ext in (".py", ".pyx", ".pxd")):
        return f"{module}.{name}"
    return module


def _in_type_checking(tree: ast.AST, target: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            if any(child is target for child in ast.walk(node)):
                return True
    return False


def owner(name: str) -> str:
    """The node of the graph a module belongs to (packages count as one, except their
    pure modules: the planning loop in kvcopy._cuda calls no driver)."""
    if name in PURE:
        return name
    for prefix in ("kvcopy._cuda", "kvcopy.interop", "kvcopy.compat", "kvcopy.nixl"):
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    return name


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in sources():
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue  # kvcopy/__init__ re-exports: it sits above everything
        src = owner(module_name(path))
        imported, _ = kvcopy_imports(path)
        edges.setdefault(src, set()).update(owner(i) for i in imported if owner(i) != src)
    return edges


def rank(name: str) -> int | None:
    for level, members in enumerate(LAYERS):
        if name in members:
            return level
    return None


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_imports_run_one_way():
    wrong = []
    for src, targets in graph().items():
        for dst in targets:
            if dst in PURE:
                continue
            if src in PURE:
                wrong.append(f"pure module {src} imports {dst}")
                continue
            if rank(src) is None or rank(dst) is None:
                wrong.append(f"{src} -> {dst}: a module in no layer (add it to LAYERS or PURE)")
            elif rank(dst) > rank(src):
                wrong.append(f"{src} (layer {rank(src)}) imports {dst} (layer {rank(dst)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_kvcopy_module_is_imported_inside_a_function():
    nested = [entry for path in sources() for entry in kvcopy_imports(path)[1]]
    assert not nested, "\n".join(nested)


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    # A module ends where its concept ends: past MAX_LINES a module is flagged for a look,
    # and only one past twice that fails, as surely holding more than one concept.
    lines = len(path.read_text().splitlines())
    assert lines <= 2 * MAX_LINES, f"{path.name} has {lines} lines (at most {2 * MAX_LINES})"
    if lines > MAX_LINES:
        warnings.warn(f"{path.name} has {lines} lines: does it still hold one concept?", stacklevel=1)


def _private_uses(path: Path) -> list[str]:
    """module._name attribute uses and `from kvcopy.x import _name` in one file."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcopy"):
            for alias in node.names:
                if alias.name.startswith("_") and node.module != "kvcopy":
                    found.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(
                a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("kvcopy")
            )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_probes_and_benchmark_use_no_private_names():
    files = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "bench" / "kvcopy_bench").glob("*.py"))
    found = [use for path in files for use in _private_uses(path)]
    assert not found, "\n".join(found)


# Constants of the paths' modules that are no default: how many sides and buffers the
# staged path's structure has, and the codes by which replay's records name methods.
STRUCTURAL = {
    "kvcopy._engine.staged": {"BUFFERS_PER_SIDE", "SIDES"},
    "kvcopy._engine.replay": {"METHODS"},
    # the kernel's interface numbers (mmap, madvise and mbind flags, syscall numbers)
    "kvcopy._runtime.host_pages": {
        "PROT_READ",
        "PROT_WRITE",
        "MAP_PRIVATE",
        "MAP_ANONYMOUS",
        "MAP_HUGETLB",
        "MAP_HUGE_SHIFT",
        "MADV_HUGEPAGE",
        "MADV_POPULATE_WRITE",
        "MPOL_PREFERRED",
        "SYS_MBIND",
    },
}
# Limits of a file format, not of a path.
FILE_FORMATS = {"kvcopy._runtime.persist", "kvcopy._runtime.calibration_file"}


def _numeric(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, (ast.Dict, ast.Tuple)):
        values = node.values if isinstance(node, ast.Dict) else node.elts
        return bool(values) and all(_numeric(v) for v in values)
    return False


def test_no_default_of_a_path_is_defined_outside_the_policy_and_config():
    """Every number that steers how a batch is issued lives in kvcopy.policy (or is a
    setting in kvcopy.config): the engine's and the runtime's modules define none."""
    found = []
    for path in sorted((PACKAGE / "_engine").glob("*.py")) + sorted((PACKAGE / "_runtime").glob("*.py")):
        name = module_name(path)
        if name in FILE_FORMATS:
            continue
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign) and node.value
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Name)
                    and re.fullmatch(r"[A-Z][A-Z0-9_]*", target.id)
                    and node.value is not None
                    and _numeric(node.value)
                    and target.id not in STRUCTURAL.get(name, ())
                ):
                    found.append(f"{name}.{target.id} (line {node.lineno})")
    assert not found, "defaults outside kvcopy.policy: " + ", ".join(found)


# The package's private layers; outside kvcopy/ only kvcopy.testing (the documented test
# seam) hands them out. setup.py names their extension modules to build them, and this
# file names them to check the package's source.
PRIVATE = re.compile(r"kvcopy\._(engine|runtime|cuda)(\.\w+)*")
CHILD_IMPORT = re.compile(r"^\s*(from|import)\s+kvcopy\._(engine|runtime|cuda)\b", re.M)
NOT_SCANNED = {"kvcopy", "build", "dist", "docs"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else ""


def private_reaches(path: Path, root: Path = ROOT) -> list[str]:
    """Where a file imports or names kvcopy._engine, ._runtime or ._cuda: its imports,
    attribute chains, module names passed as strings, and the imports of code it runs
    in a child process; one entry per line, in order."""
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Attribute):
            names = [_dotted(node)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            child = CHILD_IMPORT.search(node.value)
            names = [node.value] if not child else [f"{child.group(0).strip()} (child code)"]
        for name in names:
            if PRIVATE.fullmatch(name) or name.endswith("(child code)"):
                found.setdefault(node.lineno, f"{path.relative_to(root)}:{node.lineno}: {name}")
    return [found[line] for line in sorted(found)]


def outside_files() -> list[Path]:
    return sorted(
        p
        for p in ROOT.rglob("*.py")
        if p.relative_to(ROOT).parts[0] not in NOT_SCANNED
        and not p.relative_to(ROOT).parts[0].startswith(".")
        and p not in (ROOT / "setup.py", Path(__file__).resolve())
    )


def test_nothing_outside_the_package_reaches_its_private_layers_but_through_the_seam():
    """Tests, the benchmark's scripts and the probes take kvcopy's private modules from
    kvcopy.testing (its engine and cuda namespaces, and its seams to change them)."""
    files = outside_files()
    assert ROOT / "tests" / "cpu" / "test_describe.py" in files  # (the scan sees the tests)
    found = [reach for path in files for reach in private_reaches(path)]
    assert not found, "\n".join(found)


def test_the_scan_finds_every_way_of_reaching_in(tmp_path):
    probe = tmp_path / "probe.py"
    quotes = '"' * 3
    probe.write_text(
        "import kvcopy._cuda.driver\n"
        "from kvcopy._engine import dispatch\n"
        "x = kvcopy._runtime.ring.Slot\n"
        "pytest.importorskip('kvcopy._cuda.driver')\n"
        f"CHILD = {quotes}\nfrom kvcopy._runtime import device\n{quotes}\n"
        "from kvcopy.testing import engine\n"
        "y = engine.ring.Slot  # kvcopy._runtime.ring, named in prose\n"
    )
    found = private_reaches(probe, tmp_path)
    assert [line.split(":")[1] for line in found] == ["1", "2", "3", "4", "5"], found


def test_the_package_cites_no_results_file_and_the_reference_runs_stay_few():
    # figures live in the docs; bench/results holds only the runs the docs are built from
    repo = PACKAGE.parent
    cited = [
        f"{path.relative_to(repo)}:{n}"
        for root in (PACKAGE, repo / "include")
        for path in root.rglob("*")
        if path.suffix in (".py", ".pyx", ".pxd", ".h", ".cuh")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bresults/[\w.-]+\.(txt|json|log|png|csv)", line)
    ]
    assert not cited, cited
    runs = sorted(p.name for p in (repo / "bench" / "results").iterdir())
    assert len(runs) <= 15, runs
    docs = " ".join(
        p.read_text()
        for p in [
            *(repo / "docs").rglob("*.md"),
            *(repo / "docs").rglob("*.py"),
            repo / "bench" / "README.md",
        ]
    )
    assert [name for name in runs if name not in docs] == []


def test_every_package_of_kvcopy_is_in_the_distribution():
    """pyproject.toml lists the packages the wheel ships: a package left out installs
    from a checkout and is missing from the wheel."""
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+: read the one list)
    found_list = re.search(r"^\[tool\.setuptools\]\npackages = \[(.*?)\]", text, re.S | re.M)
    assert found_list, "pyproject.toml: no [tool.setuptools] packages list"
    listed = set(re.findall(r'"([\w.]+)"', found_list.group(1)))
    found = {module_name(init) for init in PACKAGE.rglob("__init__.py")}
    assert found == listed
