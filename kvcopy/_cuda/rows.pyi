"""Type stub of kvcopy._cuda.rows: the layout kernel's launches and report."""

import numpy as np

PLANES_PER_LAUNCH: int
NO_ROW: int

def units_per_tile(piece_bytes: int) -> int: ...
def tiles_per_plane(units: int, piece_bytes: int) -> int: ...

class RowsLaunches:
    count: int
    def __init__(
        self,
        function: int,
        src_side: tuple[int, ...],
        dst_side: tuple[int, ...],
        src_bases: np.ndarray,
        dst_bases: np.ndarray,
        rows: int,
        pieces: int,
        piece_bytes: int,
        max_ctas: int,
        threads: int,
        stream: int,
        context: int = 0,
        only_skipped_by: tuple[int, int] = (0, 0),
        first_row: int = 0,
    ) -> None: ...
    def usable(self) -> bool: ...
    def launch(self) -> int: ...
    def launch_indexed(self, src_indices: int, dst_indices: int) -> int: ...

class StagedRowsSide:
    def __init__(
        self,
        function: int,
        load: bool,
        staging_side: tuple[int, ...],
        gpu_side: tuple[int, ...],
        host_side: tuple[int, ...],
        gpu_bases: np.ndarray,
        host_bases: np.ndarray,
        only_skipped_by: tuple[int, int],
        pieces: int,
        piece_bytes: int,
        max_ctas: int,
        threads: int,
        copy_stream: int,
        kernel_stream: int,
        first_rows: np.ndarray,
        row_counts: np.ndarray,
        host: np.ndarray,
        staged: np.ndarray,
        nbytes: np.ndarray,
        staging_bases: np.ndarray,
    ) -> None: ...
    def __len__(self) -> int: ...
    def set_indices(self, indices: int) -> None: ...
    def issue(self, k: int, free_event: int, filled_event: int) -> None: ...

def report_address(module: int) -> int: ...
def take_report(address: int, stream: int, whole_context: bool) -> tuple[int, int]: ...
