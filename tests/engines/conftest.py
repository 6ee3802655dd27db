"""The engines' own tests of the ops kvcopy replaces, ported to its drop-ins.

Each file names the repository, path and commit it was ported from, keeps the
parameter grid whole, and says what it leaves out and why. A test taking the
``place`` fixture runs twice: on the GPU (``cuda``: the engine's own setting, GPU
memory and pinned host memory, marked ``gpu`` and skipped without one) and on the
CPU (``host``: every tensor in host memory, kvcopy's copy_rows run row by row
through ``kvcopy.testing.rows_on_host()``, so that CI checks the drop-ins' bytes).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import pytest


@dataclass(frozen=True)
class Place:
    """Where a ported test's memory lives, and how its copies run there."""

    name: str  # "cuda" or "host"
    torch: Any

    @property
    def gpu(self) -> bool:
        return self.name == "cuda"

    @property
    def device(self) -> str:
        """The engine's GPU memory: the GPU, or host memory on the CPU."""
        return "cuda" if self.gpu else "cpu"

    def pinned(self, tensor: Any) -> Any:
        """The engine's pinned host memory (plain host memory on the CPU)."""
        return tensor.pin_memory() if self.gpu else tensor

    def sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize()

    @contextlib.contextmanager
    def copies(self) -> Iterator[None]:
        """kvcopy's copies as the place runs them (host: row by row on the CPU)."""
        if self.gpu:
            yield
            return
        from kvcopy.testing import rows_on_host

        with rows_on_host():
            yield


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "host"])
def place(request) -> Iterator[Place]:
    torch = pytest.importorskip("torch")
    if request.param == "cuda":
        torch.cuda.init()
    found = Place(request.param, torch)
    with found.copies():
        yield found
