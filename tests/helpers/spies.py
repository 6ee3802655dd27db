"""A layer of the driver that records the calls a test names and runs them for real."""

from __future__ import annotations

from typing import Any, Callable


class LayerSpy:
    """Stands in for a kvcopy._cuda module (through kvcopy.testing.fake_cuda): each call
    of a function in ``names`` is passed to ``note(name, args)`` and then made on
    ``real`` (``done(name, args, result)`` after it, where given); everything else is
    ``real``'s."""

    def __init__(
        self,
        real: Any,
        names: tuple[str, ...],
        note: Callable[[str, tuple], None],
        done: Callable[[str, tuple, Any], None] | None = None,
    ) -> None:
        self._real, self._names, self._note, self._done = real, set(names), note, done

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name not in self._names:
            return value

        def spied(*args: Any, **kwargs: Any) -> Any:
            self._note(name, args)
            result = value(*args, **kwargs)
            if self._done is not None:
                self._done(name, args, result)
            return result

        return spied
