"""The ends of two-process NIXL transfers on one GPU, run by tests/gpu/test_gpu_nixl.py
(``python -m helpers.nixl_gpu_peer ROLE FOLDER``), each in its own process:

- ``vram_target`` / ``vram_initiator``: rows of one process's GPU cache WRITTEN into
  another's GPU cache with kvcopy's descriptors (merged and strided), then READ back;
- ``host_receiver`` (or ``host_receiver_via_gpu``) / ``vram_sender``: a packed send
  of a slice of each row's heads (between tensor-parallel degrees) from one process's
  GPU cache, gathered by kvcopy into GPU staging, into the other process's pinned
  host cache through pinned staging (or GPU staging: the same-host leg, which UCX
  has no lane for between one process's GPU and another's host memory), scattered
  there by kvcopy;
- ``ipc_host`` / ``ipc_lender``: the same-host leg by CUDA IPC: the lender shares its
  GPU cache, the host end opens it, pulls rows into its pinned host cache, pushes
  rows of that into the lender's cache, then asks for a row the cache does not have
  (refused at both ends, nothing moved).

What each end holds at the end is saved to FOLDER as NumPy files for the test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

from helpers.nixl_peer import (
    CHUNK,
    IPC_PULL,
    IPC_PUSH,
    IPC_REFUSED,
    HEAD_BYTES,
    HEADS,
    PACKED,
    PLANES,
    READ,
    ROW,
    SLOTS,
    WRITES,
    _agent,
    _publish,
    _read,
    _wait_for,
    heads_of,
    source_cache,
)
from kvcopy import Layout, nixl


def _layout(cache: torch.Tensor, row: int = ROW) -> Layout:
    return Layout.from_pointers(
        [cache[p].data_ptr() for p in range(cache.shape[0])], slots=cache.shape[1], row_bytes=row
    )


def _regions(cache: torch.Tensor) -> np.ndarray:
    return nixl.regions(_layout(cache, cache.shape[2]), device=max(cache.get_device(), 0))


def vram_target(folder: Path) -> None:
    agent = _agent("target")
    cache = torch.zeros(PLANES, SLOTS, ROW, dtype=torch.uint8, device="cuda")
    registered = agent.register_memory(_regions(cache), "VRAM")
    _publish(folder, "target", (agent.get_agent_metadata(), [cache[p].data_ptr() for p in range(PLANES)]))
    nixl.wait_notification(agent, "initiator", b"kvcopy-strided", timeout=120)
    np.save(folder / "written.npy", cache.cpu().numpy())
    _wait_for(folder / "read.npy")
    agent.deregister_memory(registered)


def vram_initiator(folder: Path) -> None:
    agent = _agent("initiator")
    cache = torch.from_numpy(source_cache()).cuda()
    back = torch.zeros(PLANES, 4, ROW, dtype=torch.uint8, device="cuda")
    registered = [agent.register_memory(_regions(c), "VRAM") for c in (cache, back)]
    metadata, bases = _read(folder, "target")
    peer = agent.add_remote_agent(metadata)
    theirs = Layout.from_pointers(bases, slots=SLOTS, row_bytes=ROW)
    memories = {"local_memory": "VRAM", "remote_memory": "VRAM"}
    for form, (ours, their_rows) in WRITES.items():
        descs = nixl.descriptors("WRITE", _layout(cache), theirs, ours, their_rows, strided=form == "strided")
        nixl.transfer(
            agent, "WRITE", descs, peer, notification=b"kvcopy-" + form.encode(), timeout=120, **memories
        )
    descs = nixl.descriptors("READ", _layout(back), theirs, READ[1], READ[0])
    nixl.transfer(agent, "READ", descs, peer, timeout=120, **memories)
    np.save(folder / "read.tmp.npy", back.cpu().numpy())
    os.replace(folder / "read.tmp.npy", folder / "read.npy")
    agent.remove_remote_agent(peer)
    for handle in registered:
        agent.deregister_memory(handle)


def _slot_bytes() -> int:
    return CHUNK * PLANES * (HEADS.stop - HEADS.start) * HEAD_BYTES


def host_receiver(folder: Path, staging_on_gpu: bool = False) -> None:
    """The receiving end, its cache in pinned host memory; its staging too, or
    (``staging_on_gpu``: the same-host leg) on the GPU, which the sender's GPU reaches
    by CUDA IPC, kvcopy moving each chunk from there into the host layout."""
    agent = _agent("receiver")
    row = (HEADS.stop - HEADS.start) * HEAD_BYTES
    cache = torch.zeros(PLANES, 40, row, dtype=torch.uint8).pin_memory()
    if staging_on_gpu:
        buffer = torch.zeros(2 * _slot_bytes(), dtype=torch.uint8, device="cuda")
    else:
        buffer = torch.zeros(2 * _slot_bytes(), dtype=torch.uint8).pin_memory()
    memory = "VRAM" if staging_on_gpu else "DRAM"
    staging = nixl.Staging(buffer.data_ptr(), _slot_bytes(), slots=2, memory=memory)
    registered = agent.register_memory(staging.regions(), memory)
    _publish(folder, "receiver", (agent.get_agent_metadata(), staging))
    peer = agent.add_remote_agent(_read(folder, "sender")[0])
    chunks = nixl.receive_packed(
        agent, _layout(cache, row), PACKED[1], peer, staging, tag="g1", chunk_rows=CHUNK
    )
    np.save(folder / "packed.npy", cache.numpy())
    (folder / "chunks").write_text(str(chunks))
    _wait_for(folder / "sent")
    agent.remove_remote_agent(peer)
    agent.deregister_memory(registered)


def vram_sender(folder: Path) -> None:
    agent = _agent("sender")
    cache = torch.from_numpy(source_cache()).cuda()
    buffer = torch.zeros(2 * _slot_bytes(), dtype=torch.uint8, device="cuda")
    staging = nixl.Staging(buffer.data_ptr(), _slot_bytes(), slots=2, memory="VRAM")
    registered = agent.register_memory(staging.regions(), "VRAM")
    _publish(folder, "sender", (agent.get_agent_metadata(),))
    metadata, peer_staging = _read(folder, "receiver")
    peer = agent.add_remote_agent(metadata)
    sliced = heads_of([cache[p].data_ptr() for p in range(PLANES)])
    nixl.send_packed(agent, sliced, PACKED[0], peer, staging, peer_staging, tag="g1", chunk_rows=CHUNK)
    _wait_for(folder / "chunks")
    (folder / "sent").touch()
    agent.remove_remote_agent(peer)
    agent.deregister_memory(registered)


def ipc_lender(folder: Path) -> None:
    cache = torch.from_numpy(source_cache()).cuda()
    with nixl.share_layout(_layout(cache)) as shared:
        _publish(folder, "lender", (shared.shared,))
        stream = torch.cuda.current_stream().cuda_stream
        for tag in ("pull", "push"):
            nixl.lend_rows(shared, tag=tag, stream=stream, timeout=120)
        np.save(folder / "pushed.npy", cache.cpu().numpy())
        try:
            nixl.lend_rows(shared, tag="refused", stream=stream, timeout=120)
        except nixl.TransferFailed as exc:
            (folder / "lender-refused").write_text(str(exc))
        _wait_for(folder / "host-done")


def ipc_host(folder: Path) -> None:
    cache = torch.zeros(PLANES, 16, ROW, dtype=torch.uint8).pin_memory()
    (shared,) = _read(folder, "lender")
    here = _layout(cache)
    with nixl.open_layout(shared) as opened:
        nixl.pull_rows(opened, here, *IPC_PULL, tag="pull", timeout=120)
        np.save(folder / "pulled.npy", cache.numpy())
        nixl.push_rows(here, opened, *IPC_PUSH, tag="push", timeout=120)
        try:
            nixl.pull_rows(opened, here, *IPC_REFUSED, tag="refused", timeout=120)
        except ValueError as exc:
            (folder / "host-refused").write_text(str(exc))
        np.save(folder / "after.npy", cache.numpy())
    (folder / "host-done").touch()


ROLES = {
    "vram_target": vram_target,
    "vram_initiator": vram_initiator,
    "host_receiver": host_receiver,
    "host_receiver_via_gpu": lambda folder: host_receiver(folder, staging_on_gpu=True),
    "vram_sender": vram_sender,
    "ipc_lender": ipc_lender,
    "ipc_host": ipc_host,
}

if __name__ == "__main__":
    ROLES[sys.argv[1]](Path(sys.argv[2]))
