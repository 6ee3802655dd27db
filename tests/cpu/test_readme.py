"""Every code block of README.md and docs/ runs as written (CPU for the shell
commands' no-GPU behaviour; the Python blocks on a GPU, each in a fresh namespace),
and the performance tables are what the reference results give."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.gpu import gpu_reason

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
SHELL_BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
DOC_BLOCKS = [
    (page.name, i, code)
    for page in DOC_PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]


def test_readme_has_the_blocks_it_promises():
    assert len(PYTHON_BLOCKS) >= 2 and SHELL_BLOCKS[:2] == [
        "bash scripts/bench.sh\n",
        "bash scripts/test.sh\n",
    ]


def test_shell_blocks_name_scripts_that_exist():
    for block in SHELL_BLOCKS:
        for script in re.findall(r"bash (\S+\.sh)", block):
            assert (ROOT / script).is_file(), script


@pytest.mark.skipif(gpu_reason() is None, reason="a GPU is present: the benchmark would run")
def test_benchmark_command_says_plainly_that_there_is_no_gpu():
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi exists here")
    out = subprocess.run(["bash", "scripts/bench.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "no NVIDIA GPU found" in out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs(torch_cuda, capsys, index):
    code = PYTHON_BLOCKS[index]
    # (the blocks assert their results)
    exec(compile(code, f"README.md (python block {index})", "exec"), {})
    out = capsys.readouterr().out
    if "TransferQueue" in code and '"req-1"' in code:
        assert "req-1" in out
    if "print(kvcopy.swap_blocks" in code:
        if "device_count() >= 2" not in code or torch_cuda.cuda.device_count() >= 2:
            assert "kernel" in out


def test_the_docs_have_python_blocks_to_run():
    assert {name for name, _, _ in DOC_BLOCKS} >= {"getting-started.md", "usage.md", "configuration.md"}


@pytest.mark.gpu
@pytest.mark.parametrize("page, index, code", DOC_BLOCKS, ids=[f"{n}-{i}" for n, i, _ in DOC_BLOCKS])
def test_doc_python_block_runs(torch_cuda, page, index, code):
    exec(compile(code, f"docs/{page} (python block {index})", "exec"), {})


def test_the_performance_tables_are_what_the_reference_results_give():
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "make_tables.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def test_readme_stays_short_and_links_what_exists():
    lines = README.splitlines()
    assert len(lines) <= 200
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_the_version_is_one_everywhere():
    """The package, its installed metadata and the changelog's newest release agree."""
    from importlib.metadata import version

    import kvcopy

    newest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert kvcopy.__version__ == version("kvcopy-cuda") == newest
