"""The README's TransferQueue example runs as written and keeps its promise."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
README = Path(__file__).resolve().parent.parent / "README.md"


def test_offload_and_reload_example(torch_cuda, capsys):
    text = README.read_text()
    section = text[text.index("### Offload and reload"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})  # the example ends with its own assert
    assert "req-1" in capsys.readouterr().out
