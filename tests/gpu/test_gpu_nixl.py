"""kvcopy.nixl between two processes on one GPU: with NIXL installed (UCX's CUDA lanes),
rows of one process's GPU cache into another's by kvcopy's descriptors and back, and a
packed send of a slice of each row's heads from GPU memory into the other process's
pinned host memory, gathered and scattered by kvcopy; with or without it, the
same-host leg by CUDA IPC (rows pulled from one process's GPU cache into another's
host cache and pushed back); bytes against NumPy oracles."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.nixl_peer import (
    expected_ipc,
    expected_packed,
    expected_read,
    expected_written,
    nixl_installed,
    run_peers,
)

needs_nixl = pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install nixl-cu13)")


@needs_nixl
def test_gpu_rows_move_between_two_processes_with_kvcopys_descriptors(tmp_path):
    run_peers(tmp_path, "helpers.nixl_gpu_peer", "vram_target", "vram_initiator", loopback=False)
    assert np.array_equal(np.load(tmp_path / "written.npy"), expected_written())
    assert np.array_equal(np.load(tmp_path / "read.npy"), expected_read())


@needs_nixl
@pytest.mark.parametrize("receiver", ["host_receiver", "host_receiver_via_gpu"])
def test_a_packed_send_from_gpu_memory_lands_in_another_process_host_layout(tmp_path, receiver):
    run_peers(tmp_path, "helpers.nixl_gpu_peer", receiver, "vram_sender", loopback=False)
    assert np.array_equal(np.load(tmp_path / "packed.npy"), expected_packed())
    assert int((tmp_path / "chunks").read_text()) == 8


def test_the_same_host_leg_pulls_and_pushes_rows_by_cuda_ipc(tmp_path):
    run_peers(tmp_path, "helpers.nixl_gpu_peer", "ipc_host", "ipc_lender", loopback=False)
    pulled, pushed = expected_ipc()
    assert np.array_equal(np.load(tmp_path / "pulled.npy"), pulled)
    assert np.array_equal(np.load(tmp_path / "pushed.npy"), pushed)
    # a row the lender's cache does not have: refused at both ends, nothing moved
    assert "src_indices" in (tmp_path / "host-refused").read_text()
    assert (
        "refused transfer 'refused': ValueError: src_indices[1]" in (tmp_path / "lender-refused").read_text()
    )
    assert np.array_equal(np.load(tmp_path / "after.npy"), pulled)
