"""kvcopy's exceptions."""

from __future__ import annotations


class KVCopyError(RuntimeError):
    """Base class of kvcopy's own errors."""


class NoDriverError(KVCopyError):
    """No CUDA driver could be loaded (no NVIDIA GPU or driver on this machine)."""


class CudaError(KVCopyError):
    """A CUDA driver call failed.

    Attributes:
        code: the numeric CUresult.
        name: the driver's name for it, e.g. ``CUDA_ERROR_INVALID_VALUE``.
        message: the driver's explanation.
        index: index of the failing copy in the caller's batch, where known.
    """

    def __init__(self, code: int, name: str, message: str, index: int | None = None) -> None:
        self.code = int(code)
        self.name = name
        self.message = message
        self.index = index
        where = f" (copy {index})" if index is not None else ""
        super().__init__(f"{name}: {message}{where}")

    def __reduce__(self):  # picklable across processes
        return (type(self), (self.code, self.name, self.message, self.index))

    def with_index(self, index: int | None) -> "CudaError":
        """The same error with the copy index translated to the caller's numbering."""
        return type(self)(self.code, self.name, self.message, index)


class CaptureError(KVCopyError):
    """The requested method cannot run while the stream is capturing a CUDA graph."""


class IndexOutOfRange(KVCopyError, IndexError):
    """The layout kernel skipped rows whose GPU-resident index was out of range (it
    writes nothing for such a row). Raised by kvcopy.check_indices.

    Attributes:
        skipped: row copies skipped (a row is counted once per plane it was not copied in).
        first_row: the lowest row position with an out-of-range index.
    """

    def __init__(self, skipped: int, first_row: int) -> None:
        self.skipped = int(skipped)
        self.first_row = int(first_row)
        super().__init__(
            f"{self.skipped} row copies skipped for an out-of-range index; the "
            f"first at row {self.first_row} of the indices"
        )

    def __reduce__(self):
        return (type(self), (self.skipped, self.first_row))
