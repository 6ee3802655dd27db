"""vLLM's tests of its canonical (cross-topology) offload layout, run on kvcopy's
CopyBackend (kvcopy.compat.vllm).

Ported from vllm-project/vllm, ``tests/v1/kv_offload/cpu/test_canonical_layout.py``
at commit 154b59c096358a6fdc7d2d9ef73194588f12e4ab: the two transfer tests,
``test_gpu_roundtrip_assembles_canonical_page_across_ranks`` (two TP=2 ranks
scatter their shards into one canonical host page; each reloads its own bit-exact
and a whole-page reader sees both) and ``test_cross_topology_roundtrip`` with its
grid whole (writer and reader TP of (2, 4), (4, 2), (2, 1), (4, 4)), the same
mappings, fragments, seeds and checks. vLLM's handler turns a mapping's runs into
``CopyRunDescriptor`` runs for its copy backend; ``_runs`` does the same here, a
run per block and mapping run, and kvcopy's ``CopyBackend`` copies them. The shared
region is one host tensor whose rows are 4 KiB apart (vLLM aligns a region's rows
past a page), its canonical page at the start of each row; on the GPU it is pinned.
Left out: the tests of vLLM's planning helpers (``_build_copy_plan``,
``_canonical_page_ids``, ``_canonical_block_sizes``), which test vLLM code, not a
copy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from kvcopy.compat.vllm import CopyBackend, CopyRunDescriptor

torch = pytest.importorskip("torch")

ROW_STRIDE = 4096


class CopyRun(NamedTuple):
    """vLLM's run of a mapping: ``num_fragments`` fragments of ``fragment_size`` bytes,
    the j-th at ``local_offset + j * local_stride`` in a block's local page and at
    ``canonical_offset + j * canonical_stride`` in its canonical page."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    canonical_stride: int


def _runs(mapping: tuple, local, canonical, blocks: int, store: bool) -> list:
    """The copy runs of ``blocks`` blocks: local (GPU) page rows <-> canonical host rows."""
    found = []
    for block in range(blocks):
        local_page = local.data_ptr() + block * local.stride(0) * local.element_size()
        canonical_page = canonical.data_ptr() + block * canonical.stride(0)
        for run in mapping:
            here = local_page + run.local_offset
            there = canonical_page + run.canonical_offset
            found.append(
                CopyRunDescriptor(
                    here if store else there,
                    there if store else here,
                    run.fragment_size,
                    run.num_fragments,
                    run.local_stride if store else run.canonical_stride,
                    run.canonical_stride if store else run.local_stride,
                )
            )
    return found


def _transfer(place, mapping: tuple, local, canonical, blocks: int, store: bool) -> None:
    backend = CopyBackend(is_src_access_order_any=not store)
    backend.submit(_runs(mapping, local, canonical, blocks, store))
    place.sync()
    backend.finish_transfer()


def _canonical(place, blocks: int, page: int):
    """The shared region's canonical pages: ``page`` bytes at the start of each row."""
    return place.pinned(torch.zeros(blocks, ROW_STRIDE, dtype=torch.int8))[:, :page]


def _tp2_rank_mapping(rank: int) -> tuple:
    # 4-token NHD page, 4 heads of 64 bytes, TP=2: K and V each 4 fragments of 128 bytes
    return (CopyRun(0, rank * 128, 128, 4, 128, 256), CopyRun(512, 1024 + rank * 128, 128, 4, 128, 256))


def test_gpu_roundtrip_assembles_canonical_page_across_ranks(place):
    torch.manual_seed(0)
    blocks = 4
    ranks = [
        torch.randint(-128, 128, (blocks, 1024), dtype=torch.int8, device=place.device) for _ in range(2)
    ]
    canonical = _canonical(place, blocks, 2048)
    for rank in (0, 1):
        _transfer(place, _tp2_rank_mapping(rank), ranks[rank], canonical, blocks, store=True)

    expected = np.zeros((blocks, 2048), dtype=np.int8)  # each rank's runs replayed in NumPy
    for rank in (0, 1):
        local = ranks[rank].cpu().numpy()
        for run in _tp2_rank_mapping(rank):
            for i in range(run.num_fragments):
                lo = run.local_offset + i * run.local_stride
                co = run.canonical_offset + i * run.canonical_stride
                expected[:, co : co + run.fragment_size] = local[:, lo : lo + run.fragment_size]
    assert np.array_equal(canonical.numpy(), expected)

    back = torch.zeros(blocks, 1024, dtype=torch.int8, device=place.device)
    _transfer(place, _tp2_rank_mapping(0), back, canonical, blocks, store=False)
    assert torch.equal(back, ranks[0])

    whole = torch.zeros(blocks, 2048, dtype=torch.int8, device=place.device)
    _transfer(place, (CopyRun(0, 0, 2048, 1, 2048, 2048),), whole, canonical, blocks, store=False)
    assert torch.equal(whole.cpu(), canonical)


TOTAL_HEADS, HEAD_BYTES, BLOCK_TOKENS = 4, 64, 4
CANONICAL_PAGE = 2 * BLOCK_TOKENS * TOTAL_HEADS * HEAD_BYTES


def _nhd_shard_mapping(tp: int, rank: int) -> tuple:
    """A rank's head shard of the canonical NHD page at tensor parallelism ``tp``."""
    fragment = TOTAL_HEADS // tp * HEAD_BYTES
    row = TOTAL_HEADS * HEAD_BYTES
    return (
        CopyRun(0, rank * fragment, fragment, BLOCK_TOKENS, fragment, row),
        CopyRun(
            BLOCK_TOKENS * fragment,
            BLOCK_TOKENS * row + rank * fragment,
            fragment,
            BLOCK_TOKENS,
            fragment,
            row,
        ),
    )


def _head_shard(full, tp: int, rank: int):
    heads = TOTAL_HEADS // tp
    shard = full[:, :, :, rank * heads : (rank + 1) * heads, :]
    return shard.reshape(full.shape[0], -1).contiguous()


@pytest.mark.parametrize("writer_tp,reader_tp", [(2, 4), (4, 2), (2, 1), (4, 4)])
def test_cross_topology_roundtrip(place, writer_tp, reader_tp):
    torch.manual_seed(0)
    blocks = 3
    full = torch.randint(-128, 128, (blocks, 2, BLOCK_TOKENS, TOTAL_HEADS, HEAD_BYTES), dtype=torch.int8)
    canonical = _canonical(place, blocks, CANONICAL_PAGE)
    for rank in range(writer_tp):
        shard = _head_shard(full, writer_tp, rank).to(place.device)
        _transfer(place, _nhd_shard_mapping(writer_tp, rank), shard, canonical, blocks, store=True)
    for rank in range(reader_tp):
        expected = _head_shard(full, reader_tp, rank)
        out = torch.zeros_like(expected, device=place.device)
        _transfer(place, _nhd_shard_mapping(reader_tp, rank), out, canonical, blocks, store=False)
        assert torch.equal(out.cpu(), expected), (
            f"reader tp={reader_tp} rank={rank} differs from the tp={writer_tp} writers' bytes"
        )
