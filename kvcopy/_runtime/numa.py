"""The host's NUMA nodes as Linux lists them under /sys: the node a GPU is attached to
(from its PCI address), each node's CPUs and free explicit huge pages, and the
transparent huge page mode.

Everything is read from ``sys_root`` (``/sys``; tests pass a folder of their own). A
host without NUMA (no ``devices/system/node``, as in many containers and VMs) is one
node, 0, holding every CPU this process may run on and no explicit huge pages; a
device whose ``numa_node`` is -1 or absent is on no particular node.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

SYS = Path("/sys")
_HUGE_DIR = re.compile(r"hugepages-(\d+)kB")


@dataclasses.dataclass(frozen=True)
class Node:
    """One NUMA node: its CPUs, and its free explicit huge pages by page size."""

    index: int
    cpus: tuple[int, ...]
    free_huge_pages: dict[int, int]  # page bytes -> pages free on this node


def parse_cpulist(text: str) -> tuple[int, ...]:
    """The CPUs of a kernel cpulist ("0-3,8,10-11"); ValueError for anything else."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"cpulist range {part!r} runs backwards")
        cpus.extend(range(low, high + 1))
    return tuple(cpus)


def read_fact(path: Path) -> str | None:
    """A sysfs (or /etc) file's text, stripped; None where it cannot be read."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _huge_pages(folder: Path, name: str) -> dict[int, int]:
    """page bytes -> the count in ``folder``'s hugepages-*kB/``name`` files."""
    found: dict[int, int] = {}
    for entry in sorted(folder.glob("hugepages-*kB")) if folder.is_dir() else ():
        size = _HUGE_DIR.fullmatch(entry.name)
        count = read_fact(entry / name)
        if size and count is not None and count.isdigit():
            found[int(size.group(1)) << 10] = int(count)
    return found


def nodes(sys_root: Path = SYS) -> dict[int, Node]:
    """Every NUMA node with CPUs or memory, by index; one node 0 without NUMA."""
    system = sys_root / "devices" / "system" / "node"
    listed = {}
    for entry in sorted(system.glob("node[0-9]*")) if system.is_dir() else ():
        cpus = read_fact(entry / "cpulist")
        listed[int(entry.name[4:])] = Node(
            int(entry.name[4:]),
            parse_cpulist(cpus) if cpus is not None else (),
            _huge_pages(entry / "hugepages", "free_hugepages"),
        )
    if listed:
        return listed
    every = tuple(sorted(os.sched_getaffinity(0)))
    return {0: Node(0, every, _huge_pages(sys_root / "kernel" / "mm" / "hugepages", "free_hugepages"))}


def pci_address(domain: int, bus: int, device: int) -> str:
    """The sysfs name of function 0 of a PCI device ("0000:1b:00.0")."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def node_of_pci(address: str, sys_root: Path = SYS) -> int | None:
    """The NUMA node the PCI device ``address`` is attached to, or None where Linux
    names none (-1, no such entry, a host without NUMA)."""
    text = read_fact(sys_root / "bus" / "pci" / "devices" / address / "numa_node")
    if text is None or not text.lstrip("-").isdigit():
        return None
    node = int(text)
    return node if node >= 0 else None


def transparent_huge_pages(sys_root: Path = SYS) -> str:
    """The transparent huge page mode ('always', 'madvise' or 'never'); 'never' where
    the kernel has none."""
    text = read_fact(sys_root / "kernel" / "mm" / "transparent_hugepage" / "enabled") or ""
    chosen = re.search(r"\[(\w+)\]", text)
    return chosen.group(1) if chosen else "never"


def transparent_page_bytes(sys_root: Path = SYS) -> int:
    """The size of a transparent huge page (PMD size), 2 MiB where the kernel does
    not say."""
    text = read_fact(sys_root / "kernel" / "mm" / "transparent_hugepage" / "hpage_pmd_size")
    return int(text) if text is not None and text.isdigit() else 2 << 20
