"""What tells one host's measurements from another's: a calibration holds only for the
GPU it was measured on, over the PCIe link it was measured through, in the host it
sits in, under the driver it ran with. Two machines of one model can differ by half
(the same H100 model and driver read pinned host memory from its SMs at 33 GB/s on
one host and near 50 on another), so a key of model and driver alone is not enough.

The key: the device's model and the driver version (as before), the GPU's UUID, its
PCI address and the link Linux reports for it (speed and width), and the host's
machine id (``/etc/machine-id``, else its host name). Any field that cannot be read is
empty, so a key never fails; it only becomes less specific.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import socket
from pathlib import Path
from typing import Any, Mapping

from kvcopy._runtime import numa

SYS = Path("/sys")
MACHINE_ID = Path("/etc/machine-id")


@dataclasses.dataclass(frozen=True)
class HostKey:
    """The identity of a calibration (see the module's docstring)."""

    device: str
    driver_version: int
    gpu: str = ""  # the GPU's UUID, hex
    pci: str = ""  # its PCI address, "0000:1b:00.0"
    link: str = ""  # "32.0 GT/s PCIe x16", as Linux reports the link now
    host: str = ""  # the machine id, else the host name

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def file_name(self) -> str:
        """The calibration file's name: the model and driver to read, a digest of the
        whole key to tell hosts apart."""
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.device).strip("-")
        digest = hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:12]
        return f"calibration-{slug}-driver{self.driver_version}-{digest}.json"


def pci_link(pci: str, sys_root: Path = SYS) -> str:
    """The PCIe link of device ``pci`` as Linux reports it now ("32.0 GT/s PCIe x16"),
    '' where it does not."""
    if not pci:
        return ""
    folder = sys_root / "bus" / "pci" / "devices" / pci
    speed, width = (numa.read_fact(folder / name) for name in ("current_link_speed", "current_link_width"))
    return f"{speed} x{width}" if speed and width else ""


def machine_id(path: Path = MACHINE_ID) -> str:
    """The host's machine id, else its host name."""
    return numa.read_fact(path) or socket.gethostname()


def read_host_key(attrs: Mapping[str, Any], sys_root: Path = SYS, machine: Path = MACHINE_ID) -> HostKey:
    """The key of the device whose driver facts are ``attrs``
    (kvcopy._cuda.driver.device_attributes)."""
    pci = ""
    if all(name in attrs for name in ("pci_domain", "pci_bus", "pci_device")):
        pci = numa.pci_address(int(attrs["pci_domain"]), int(attrs["pci_bus"]), int(attrs["pci_device"]))
    return HostKey(
        device=str(attrs["name"]),
        driver_version=int(attrs["driver_version"]),
        gpu=str(attrs.get("uuid", "")),
        pci=pci,
        link=pci_link(pci, sys_root),
        host=machine_id(machine),
    )
