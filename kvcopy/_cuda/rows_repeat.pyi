"""Type stub of kvcopy._cuda.rows_repeat: a copy_rows call with GPU indices, repeated
from C."""

from typing import Any, Callable

def index_site(obj: Any) -> tuple[bool, int, int, int] | None: ...

class GpuRowsRepeat:
    launches: Any
    decision: Any
    traffic: Any
    def __init__(
        self,
        launches: Any,
        decision: Any,
        traffic: Any,
        note_decision: Callable[[Any], None],
        note_again: Callable[[tuple], None],
    ) -> None: ...
    def usable(self) -> bool: ...
    def __call__(self, src_indices: Any = None, dst_indices: Any = None) -> str: ...
    def expect(
        self,
        src_indices: Any,
        dst_indices: Any,
        rows: Any,
        stream: Any,
        method: str,
        handle: int,
        epoch: tuple,
        epoch_sources: tuple[tuple[Any, str], ...],
        resolve_stream: Callable[[Any], int],
        rows_stream: Callable[..., int],
    ) -> bool: ...

def repeat_gpu_rows(
    memo: dict, src: Any, dst: Any, a: Any, b: Any, rows: Any, stream: Any, method: Any
) -> str | None: ...
