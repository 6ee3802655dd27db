"""One end of a two-process NIXL transfer over kvcopy's descriptors, run as its own
process by tests/cpu/test_nixl.py: ``python -m helpers.nixl_peer ROLE FOLDER``.

The target holds a paged cache of zeros, registers it (kvcopy.nixl.regions), writes
its agent's metadata and its planes' addresses to FOLDER/target.pkl, waits for the
initiator's notification and saves its cache to FOLDER/written.npy. The initiator
holds a cache of known bytes, WRITEs rows into the target's (one transfer merged,
one in NIXL's strided form), READs rows back from it, saves what it read to
FOLDER/read.npy and the descriptor counts to FOLDER/counts.json. Both deregister
their memory and forget the peer before they exit.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvcopy import Layout, nixl, testing

TESTS = Path(__file__).resolve().parents[1]
PLANES, SLOTS, ROW = 8, 64, 512
WRITES = {
    "merged": (np.array([0, 1, 2, 3, 10, 11, 40]), np.array([5, 6, 7, 8, 30, 31, 63])),
    "strided": (np.array([20, 21, 22, 50]), np.array([40, 41, 42, 0])),
}
READ = (np.array([30, 31, 7, -1]), np.array([0, 1, 2, 3]))  # (remote rows, local rows)


def source_cache() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (PLANES, SLOTS, ROW), dtype=np.uint8)


def expected_written() -> np.ndarray:
    """The target's cache after the initiator's WRITEs (a NumPy oracle)."""
    source = source_cache()
    expected = np.zeros_like(source)
    for ours, theirs in WRITES.values():
        expected[:, theirs] = source[:, ours]
    return expected


def expected_read() -> np.ndarray:
    """What the initiator READs back from the written cache."""
    written = expected_written()
    read = np.zeros((PLANES, 4, ROW), np.uint8)
    live = READ[0] >= 0
    read[:, READ[1][live]] = written[:, READ[0][live]]
    return read


def expected_packed() -> np.ndarray:
    """The receiver's cache after the packed send of heads HEADS of each row."""
    source = source_cache()
    sliced = source.reshape(PLANES, SLOTS, -1, HEAD_BYTES)[:, :, HEADS].reshape(PLANES, SLOTS, -1)
    expected = np.zeros((PLANES, 40, sliced.shape[2]), np.uint8)
    live = PACKED[1] >= 0
    expected[:, PACKED[1][live]] = sliced[:, PACKED[0][live]]
    return expected


# (lender's rows, host end's rows) of the pull, the push and the refused pull
IPC_PULL = (np.array([3, 17, 63, 0, 40, 41]), np.array([0, 1, 2, 3, 8, 9]))
IPC_PUSH = (np.array([0, 8, 2]), np.array([50, 51, 5]))
IPC_REFUSED = (np.array([1, SLOTS]), np.array([10, 11]))


def expected_ipc() -> tuple[np.ndarray, np.ndarray]:
    """(the host end's cache after the pull, the lender's after the push) of the same-host
    leg on a GPU (helpers.nixl_gpu_peer): NumPy oracles."""
    source = source_cache()
    pulled = np.zeros((PLANES, 16, ROW), np.uint8)
    pulled[:, IPC_PULL[1]] = source[:, IPC_PULL[0]]
    pushed = source.copy()
    pushed[:, IPC_PUSH[1]] = pulled[:, IPC_PUSH[0]]
    return pulled, pushed


def layout_of(cache: np.ndarray) -> Layout:
    return Layout.from_pointers([cache[p].ctypes.data for p in range(PLANES)], slots=SLOTS, row_bytes=ROW)


def nixl_installed() -> bool:
    """Whether NIXL's Python package can be imported here."""
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            __import__(name)
            return True
        except ImportError:
            continue
    return False


def run_peers(folder: Path, module: str, *roles: str, loopback: bool = True) -> None:
    """Run ``module``'s ``roles``, each in its own process (``loopback``: UCX over TCP on
    the loopback device, as without a GPU); each must exit 0."""
    env = dict(os.environ, NIXL_LOG_LEVEL="ERROR")
    if loopback:
        env.update(UCX_TLS="tcp,self", UCX_NET_DEVICES="lo")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    peers = [
        subprocess.Popen(
            [sys.executable, "-m", module, role, str(folder)],
            cwd=TESTS,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for role in roles
    ]
    for peer in peers:
        out, _ = peer.communicate(timeout=300)
        assert peer.returncode == 0, out


def _agent(name: str):
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


def _published_target(folder: Path) -> tuple:
    """A target agent with a registered cache of zeros, its metadata and the cache's
    plane addresses written to FOLDER/target.pkl: (agent, cache, registration)."""
    agent = _agent("target")
    cache = np.zeros((PLANES, SLOTS, ROW), np.uint8)
    registered = agent.register_memory(nixl.regions(layout_of(cache)), "DRAM")
    facts = (agent.get_agent_metadata(), [int(cache[p].ctypes.data) for p in range(PLANES)])
    (folder / "target.tmp").write_bytes(pickle.dumps(facts))
    os.replace(folder / "target.tmp", folder / "target.pkl")
    return agent, cache, registered


def target(folder: Path) -> None:
    agent, cache, registered = _published_target(folder)
    nixl.wait_notification(agent, "initiator", b"kvcopy-strided", timeout=60)
    np.save(folder / "written.npy", cache)
    _wait_for(folder / "read.npy")  # (the initiator reads from the cache after)
    agent.deregister_memory(registered)


def initiator(folder: Path) -> None:
    agent = _agent("initiator")
    cache = source_cache()
    back = np.zeros((PLANES, 4, ROW), np.uint8)
    registered = [agent.register_memory(nixl.regions(layout_of(c)), "DRAM") for c in (cache, back)]
    _wait_for(folder / "target.pkl")
    metadata, bases = pickle.loads((folder / "target.pkl").read_bytes())
    peer = agent.add_remote_agent(metadata)
    theirs = Layout.from_pointers(bases, slots=SLOTS, row_bytes=ROW)
    counts = {}
    for form, (ours_rows, their_rows) in WRITES.items():
        descs = nixl.descriptors(
            "WRITE", layout_of(cache), theirs, ours_rows, their_rows, strided=form == "strided"
        )
        nixl.transfer(agent, "WRITE", descs, peer, notification=b"kvcopy-" + form.encode(), timeout=60)
        counts[form] = {"posted": descs.posted, "copies": descs.copies, "expanded": descs.expanded}
    got = Layout.from_pointers([back[p].ctypes.data for p in range(PLANES)], slots=4, row_bytes=ROW)
    descs = nixl.descriptors("READ", got, theirs, READ[1], READ[0])
    nixl.transfer(agent, "READ", descs, peer, timeout=60)
    counts["read"] = {"posted": descs.posted, "copies": descs.copies, "expanded": descs.expanded}
    np.save(folder / "read.tmp.npy", back)
    os.replace(folder / "read.tmp.npy", folder / "read.npy")
    (folder / "counts.json").write_text(json.dumps(counts))
    agent.remove_remote_agent(peer)
    for handle in registered:
        agent.deregister_memory(handle)


def leaving(folder: Path) -> None:
    """A target that goes away once the initiator knows it."""
    agent, _cache, registered = _published_target(folder)  # (the cache lives till the end)
    _wait_for(folder / "added")
    agent.deregister_memory(registered)


def after_leaving(folder: Path) -> None:
    """Transfers to a peer that went away fail clearly, and the agent works after."""
    agent = _agent("initiator")
    cache = source_cache()
    registered = agent.register_memory(nixl.regions(layout_of(cache)), "DRAM")
    _wait_for(folder / "target.pkl")
    metadata, bases = pickle.loads((folder / "target.pkl").read_bytes())
    peer = agent.add_remote_agent(metadata)
    (folder / "added").touch()
    _wait_for(folder / "left")
    time.sleep(1.0)  # (for UCX to see the connection closed)
    outcome = {}
    descs = nixl.descriptors(
        "WRITE", layout_of(cache), Layout.from_pointers(bases, slots=SLOTS, row_bytes=ROW), [0, 1], [2, 3]
    )
    for name, step in (
        ("transfer", lambda: nixl.transfer(agent, "WRITE", descs, peer, timeout=10)),
        ("notification", lambda: nixl.wait_notification(agent, peer, b"never", timeout=0.3)),
    ):
        try:
            step()
            outcome[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - what it raised is the outcome
            outcome[name] = f"{type(exc).__name__}: {exc}"
    # the agent still moves bytes: a loopback transfer into memory of its own
    copy = np.zeros_like(cache)
    mine = agent.register_memory(nixl.regions(layout_of(copy)), "DRAM")
    loop = nixl.descriptors("WRITE", layout_of(cache), layout_of(copy), [5, 6], [5, 6])
    nixl.transfer(agent, "WRITE", loop, agent.name, timeout=10)
    outcome["loopback equal"] = bool(np.array_equal(copy[:, 5:7], cache[:, 5:7]))
    (folder / "outcome.json").write_text(json.dumps(outcome))
    agent.deregister_memory(mine)
    agent.remove_remote_agent(peer)
    agent.deregister_memory(registered)


# A packed send: rows of the sender's cache, heads HEADS of each (HEAD_BYTES a head),
# into the receiver's cache, which holds only those heads (as between tensor-parallel
# degrees), in chunks of CHUNK rows through two slots a side.
HEAD_BYTES, HEADS, CHUNK = 64, slice(2, 4), 5
PACKED = (np.arange(37) * 7 % SLOTS, np.r_[np.random.default_rng(3).permutation(36), -1])


def heads_of(planes: list[int]) -> Layout:
    """Heads HEADS of each row of a cache whose planes start at ``planes``."""
    return Layout.from_pointers(
        [base + HEADS.start * HEAD_BYTES for base in planes],
        slots=SLOTS,
        row_bytes=(HEADS.stop - HEADS.start) * HEAD_BYTES,
        slot_stride=ROW,
    )


def _publish(folder: Path, name: str, facts: tuple) -> None:
    (folder / f"{name}.tmp").write_bytes(pickle.dumps(facts))
    os.replace(folder / f"{name}.tmp", folder / f"{name}.pkl")


def _read(folder: Path, name: str) -> tuple:
    _wait_for(folder / f"{name}.pkl")
    return pickle.loads((folder / f"{name}.pkl").read_bytes())


def _staging() -> tuple[np.ndarray, nixl.Staging]:
    heads = HEADS.stop - HEADS.start
    buffer = np.zeros(2 * CHUNK * PLANES * heads * HEAD_BYTES, np.uint8)
    return buffer, nixl.Staging(buffer.ctypes.data, buffer.nbytes // 2, slots=2)


def packed_receiver(folder: Path) -> None:
    agent = _agent("receiver")
    row = (HEADS.stop - HEADS.start) * HEAD_BYTES
    cache = np.zeros((PLANES, 40, row), np.uint8)
    buffer, staging = _staging()
    registered = agent.register_memory(staging.regions(), "DRAM")
    _publish(folder, "receiver", (agent.get_agent_metadata(), staging))
    peer = agent.add_remote_agent(_read(folder, "sender")[0])
    layout = Layout.from_pointers([cache[p].ctypes.data for p in range(PLANES)], slots=40, row_bytes=row)
    with testing.rows_on_host():
        chunks = nixl.receive_packed(agent, layout, PACKED[1], peer, staging, tag="t1", chunk_rows=CHUNK)
    np.save(folder / "packed.npy", cache)
    (folder / "packed.json").write_text(json.dumps({"chunks": chunks}))
    _wait_for(folder / "sent")
    agent.remove_remote_agent(peer)
    agent.deregister_memory(registered)


def packed_sender(folder: Path) -> None:
    agent = _agent("sender")
    cache = source_cache()
    buffer, staging = _staging()
    registered = agent.register_memory(staging.regions(), "DRAM")
    _publish(folder, "sender", (agent.get_agent_metadata(),))
    metadata, peer_staging = _read(folder, "receiver")
    peer = agent.add_remote_agent(metadata)
    sliced = heads_of([cache[p].ctypes.data for p in range(PLANES)])
    with testing.rows_on_host():
        nixl.send_packed(agent, sliced, PACKED[0], peer, staging, peer_staging, tag="t1", chunk_rows=CHUNK)
    _wait_for(folder / "packed.json")  # (the receiver has scattered every chunk)
    (folder / "sent").touch()
    agent.remove_remote_agent(peer)
    agent.deregister_memory(registered)


ROLES = {
    "target": target,
    "initiator": initiator,
    "leaving": leaving,
    "after_leaving": after_leaving,
    "packed_receiver": packed_receiver,
    "packed_sender": packed_sender,
}

if __name__ == "__main__":
    role, folder = sys.argv[1], Path(sys.argv[2])
    ROLES[role](folder)
    if role == "leaving":
        (folder / "left").touch()
