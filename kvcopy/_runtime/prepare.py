"""What a process's first copy on a device does, done when the caller chooses."""

from __future__ import annotations

from kvcopy._runtime import device as devices
from kvcopy._runtime import ring
from kvcopy._cuda import driver
from kvcopy._runtime.context import on_device
from kvcopy.arguments import require_int


def prepare(device: int | None = None) -> None:
    """Learn the device's capabilities, load the copy kernel and create the
    descriptor ring now, in ``device``'s primary context (None: the calling
    thread's current context, else device 0's primary one).

    A process's first copy on a device does this itself, and loading the
    kernel's module waits for all work already running on that GPU. An engine
    that calls prepare() at startup keeps that wait out of its first step.
    Copies work without it; calling it again costs a lookup.

    Raises:
        TypeError, ValueError: ``device`` is not an int, or negative.
        NoDriverError: no CUDA driver.
        CudaError: the device does not exist or its context cannot be made.
    """
    if device is not None:
        require_int(device, "device", minimum=0, maximum=1 << 16)
    driver.init()
    if device is None and driver.current_context():
        prepare_current_context()
        return
    with on_device(0 if device is None else device):
        prepare_current_context()


def prepare_current_context() -> None:
    """prepare() for the calling thread's current context (it must have one)."""
    devices.device_info(driver.context_device())  # (loads the copy kernel)
    ring.ring_for_current_context()
