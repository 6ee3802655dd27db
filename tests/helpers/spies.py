"""A layer of the driver that records the calls a test names and runs them for real."""
from __future__ import annotations

from typing import Any, Callable


class LayerSpy:
    """Stands in for a kvcopy._cuda module (through kvcopy.testing.fake_cuda): each call
    of a function in ``names`` is passed to ``note(name, args)`` and then made on
    ``real``; everything else is ``real``'s."""

    def __init__(self, real: Any, names: tuple[str, ...],
                 note: Callable[[str, tuple], None]) -> None:
        self._real, self._names, self._note = real, set(names), note

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name not in self._names:
            return value

        def spied(*args: Any, **kwargs: Any) -> Any:
            self._note(name, args)
            return value(*args, **kwargs)
        return spied
