"""Hooks for kvcopy's own tests and probes (documented, not part of the API).

- ``capabilities(**caps)``: a context manager under which every device reports
  the given DeviceCaps fields (e.g. ``batch_available=False`` for a driver
  older than 12.8), and the engine forgets its remembered decisions.
- ``describe_copies_in(known_ranges, src, dst, sizes, descs_out, merge, fast)``:
  the kernel path's describe pass with memory ranges known in advance (rows of
  start, end, kind, ordinal, delta), so that it runs without a GPU.
- ``describe_copies_answered(driver_ranges, src, dst, sizes, descs_out, merge, fast)``:
  the same pass with ``driver_ranges`` standing in for the driver's answers, so
  that every range asked for (and joined with its neighbours) can be counted;
  with no rows, the driver's own answers are counted.
- ``fast_describe_available()``: whether this CPU runs the vectorised pass.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from kvcopy._runtime import device
from kvcopy._cuda.describe import fast_describe_available
from kvcopy._cuda.testing import describe_copies_answered, describe_copies_in


@contextlib.contextmanager
def capabilities(**caps: bool | int) -> Iterator[None]:
    """Fake device capabilities for the duration of a with-block."""
    device.override_capabilities(**caps)
    try:
        yield
    finally:
        device.override_capabilities()


__all__ = ["capabilities", "describe_copies_answered", "describe_copies_in",
           "fast_describe_available"]
