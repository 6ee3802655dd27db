"""The method policy, with faked device capabilities (CPU)."""

from __future__ import annotations

import dataclasses

import pytest

from kvcopy import policy
from kvcopy.errors import CaptureError, KVCopyError
from kvcopy.policy import (
    BULK_MAX_BYTES,
    BULK_MIN_BYTES,
    CopyRequest,
    DeviceCaps,
    Thresholds,
    choose_method,
    depends_on_other_way,
    kernel_variant,
)

H200 = DeviceCaps(bulk_copy=True)
A100 = DeviceCaps(sm_count=108, bulk_copy=False)
KiB, MiB = 1 << 10, 1 << 20


def req(direction="h2d", count=8192, block=16 * KiB, accessible=True, stream="created", capturing=False):
    return CopyRequest(direction, count, count * block, accessible, stream, capturing)


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("block", [2 * KiB, 16 * KiB, 256 * KiB])
def test_small_and_medium_blocks_use_the_kernel(direction, block):
    assert choose_method(req(direction, block=block), H200).method == "kernel"


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_large_host_blocks_use_batched_dma(direction):
    assert choose_method(req(direction, block=4 * MiB), H200).method == "batch"


def test_device_to_device_never_uses_batch_when_kernel_works():
    assert choose_method(req("d2d", block=64 * MiB), H200).method == "kernel"


def test_calibrated_thresholds_move_the_crossover():
    low = Thresholds(batch_min_bytes={"h2d": 64 * KiB, "d2h": float("inf")})
    assert choose_method(req("h2d", block=64 * KiB), H200, low).method == "batch"
    assert choose_method(req("d2h", block=64 * MiB), H200, low).method == "kernel"


@pytest.mark.parametrize("caps", [DeviceCaps(unified_addressing=False), DeviceCaps(kernel_available=False)])
def test_no_unified_addressing_or_kernel_means_dma(caps):
    assert choose_method(req(), caps).method == "batch"


def test_pageable_memory_goes_to_dma():
    assert choose_method(req(accessible=False), H200).method == "batch"
    assert choose_method(req(accessible=False, stream="legacy"), H200).method == "loop"


@pytest.mark.parametrize("caps", [H200, DeviceCaps(kernel_available=False)])
@pytest.mark.parametrize("block", [4 * KiB, 4 * MiB])
def test_capturing_stream_never_uses_batch(caps, block):
    method = choose_method(req(block=block, capturing=True), caps).method
    assert method in ("kernel", "loop")
    assert method == ("kernel" if caps.kernel_available else "loop")


@pytest.mark.parametrize("block", [4 * KiB, 4 * MiB])
def test_legacy_stream_never_uses_batch(block):
    assert choose_method(req(block=block, stream="legacy"), H200).method == "kernel"
    assert (
        choose_method(req(block=block, stream="legacy"), DeviceCaps(kernel_available=False)).method == "loop"
    )


def test_per_thread_stream_takes_batch():
    caps = DeviceCaps(kernel_available=False)
    assert choose_method(req(stream="per_thread"), caps).method == "batch"


def test_old_driver_without_batch_uses_kernel_or_loop():
    caps = DeviceCaps(batch_available=False)
    assert choose_method(req(block=4 * MiB), caps).method == "kernel"
    caps = DeviceCaps(batch_available=False, kernel_available=False)
    assert choose_method(req(), caps).method == "loop"


def test_single_copy_is_one_memcpy():
    assert choose_method(req(count=1), H200).method == "loop"


def test_host_to_host_is_dma():
    assert choose_method(req("h2h"), H200).method == "batch"


def test_explicit_batch_rules():
    with pytest.raises(CaptureError, match="capturing"):
        choose_method(req(capturing=True), H200, requested="batch")
    with pytest.raises(KVCopyError, match="cuMemcpyBatchAsync"):
        choose_method(req(), DeviceCaps(batch_available=False), requested="batch")
    assert choose_method(req(stream="legacy"), H200, requested="batch").method == "loop"
    assert choose_method(req(), H200, requested="batch").method == "batch"


def test_explicit_kernel_rules():
    with pytest.raises(ValueError, match="pageable"):
        choose_method(req(accessible=False), H200, requested="kernel")
    with pytest.raises(KVCopyError, match="not available"):
        choose_method(req(), DeviceCaps(kernel_available=False), requested="kernel")
    assert choose_method(req(capturing=True), H200, requested="kernel").method == "kernel"


def test_unknown_method():
    with pytest.raises(ValueError, match="method must be one of"):
        choose_method(req(), H200, requested="fast")


def test_decisions_say_why():
    decision = choose_method(req(stream="legacy", accessible=False), H200)
    assert "legacy" in decision.reason


# ------------------------------------------------------------ copies between two GPUs


def p2p(block=16 * KiB, accessible=True, devices=(0, 1), unreachable=""):
    return CopyRequest(
        "p2p", 8192, 8192 * block, accessible, "created", devices=devices, unreachable=unreachable
    )


@pytest.mark.parametrize("block", [2 * KiB, 16 * KiB, 256 * KiB])
def test_peer_copies_use_the_kernel_where_the_device_reaches_the_peer(block):
    assert choose_method(p2p(block), H200).method == "kernel"


def test_large_peer_blocks_use_batched_dma():
    """From 1 MiB the copy engines match NVLink (the kernel reaches ~0.93) at little CPU cost."""
    assert choose_method(p2p(4 * MiB), H200).method == "batch"
    assert choose_method(p2p(4 * MiB), H200, Thresholds({})).method == "kernel"


def test_peer_copies_go_by_dma_where_the_peer_is_unreachable():
    assert choose_method(p2p(accessible=False), H200).method == "batch"
    legacy = CopyRequest("p2p", 64, 64 * KiB, False, "legacy", devices=(0, 1))
    assert choose_method(legacy, H200).method == "loop"


def test_peer_thresholds_are_per_device_pair():
    calibrated = Thresholds({"p2p 0>1": 1 * MiB, "p2p": 64 * MiB})
    assert choose_method(p2p(1 * MiB), H200, calibrated).method == "batch"
    assert choose_method(p2p(256 * KiB), H200, calibrated).method == "kernel"
    # the other direction has no pair entry: the device's 'p2p' threshold applies
    assert choose_method(p2p(1 * MiB, devices=(1, 0)), H200, calibrated).method == "kernel"
    assert choose_method(p2p(64 * MiB, devices=(1, 0)), H200, calibrated).method == "batch"
    assert Thresholds().for_request(p2p()) == 1 * MiB
    assert Thresholds({}).for_request(p2p()) == float("inf")


def test_kernel_refusal_names_what_the_device_cannot_reach():
    why = "memory of device 1, which device 0 cannot access (cuDeviceCanAccessPeer is 0)"
    with pytest.raises(ValueError, match="memory of device 1") as info:
        choose_method(p2p(accessible=False, unreachable=why), H200, requested="kernel")
    assert "pageable" not in str(info.value) and "'auto', 'batch' or 'loop'" in str(info.value)


# ------------------------------------------------------------ both ways at once


def test_both_ways_goes_to_the_copy_engines_from_128_kib_blocks():
    from kvcopy.policy import choose_both_ways

    store, load = req("d2h", block=128 * KiB), req("h2d", block=256 * KiB)
    decision = choose_both_ways(store, load, H200)
    assert decision is not None and decision.method == "batch"
    assert "128 KiB" in decision.reason  # the smaller side's blocks
    assert choose_both_ways(req("d2h", block=64 * KiB), load, H200) is None
    # the per-thread default stream takes cuMemcpyBatchAsync; only the legacy one does not
    per_thread = choose_both_ways(
        req("d2h", block=1 * MiB, stream="per_thread"), req("h2d", block=1 * MiB, stream="per_thread"), H200
    )
    assert per_thread is not None and per_thread.method == "batch"


@pytest.mark.parametrize(
    "store,load",
    [
        (req("d2h", block=16 * KiB), req("h2d", block=1 * MiB)),  # one side's blocks small
        (req("d2h", block=1 * MiB, stream="legacy"), req("h2d", block=1 * MiB, stream="legacy")),
        (req("d2h", block=1 * MiB, capturing=True), req("h2d", block=1 * MiB, capturing=True)),
        (req("d2d", block=1 * MiB), req("h2d", block=1 * MiB)),  # inside the GPU: kernel
        (req("d2h", count=1, block=1 * MiB), req("h2d", block=1 * MiB)),  # one copy: its own path
    ],
)
def test_both_ways_leaves_each_side_to_its_own_policy_otherwise(store, load):
    from kvcopy.policy import choose_both_ways

    assert choose_both_ways(store, load, H200) is None


def test_both_ways_respects_the_driver_the_caller_and_the_calibration():
    from kvcopy.policy import choose_both_ways

    store, load = req("d2h", block=1 * MiB), req("h2d", block=1 * MiB)
    assert choose_both_ways(store, load, DeviceCaps(batch_available=False)) is None
    forbidden = CopyRequest("h2d", 64, 64 * MiB, True, "created", batch_allowed=False)
    assert choose_both_ways(store, forbidden, H200) is None
    assert choose_both_ways(store, load, H200, requested="kernel") is None
    higher = Thresholds(both_ways_batch_min_bytes=4 * MiB)
    assert choose_both_ways(store, load, H200, higher) is None
    assert (
        choose_both_ways(req("d2h", block=4 * MiB), req("h2d", block=4 * MiB), H200, higher).method == "batch"
    )


def stores(block=16 * KiB, **kw) -> CopyRequest:
    return dataclasses.replace(req("d2h", block=block, **kw), stores_by_dma=True)


@pytest.mark.parametrize("block", [2 * KiB, 16 * KiB, 256 * KiB])
def test_stores_by_dma_sends_every_gpu_to_host_block_to_the_copy_engines(block):
    decision = choose_method(stores(block), H200)
    assert decision.method == "batch" and "stores_by_dma" in decision.reason
    # only stores: loads and copies inside the GPU keep the kernel
    for direction in ("h2d", "d2d"):
        other = dataclasses.replace(req(direction, block=block), stores_by_dma=True)
        assert choose_method(other, H200).method == "kernel"


@pytest.mark.parametrize(
    "why, request_changes, caps",
    [
        ("capturing stream", {"capturing": True}, H200),
        ("legacy default stream", {"stream": "legacy"}, H200),
        ("no cuMemcpyBatchAsync", {}, DeviceCaps(batch_available=False)),
    ],
)
def test_stores_by_dma_falls_back_to_the_kernel_where_batch_cannot_run(why, request_changes, caps):
    decision = choose_method(stores(**request_changes), caps)
    assert decision.method == "kernel"
    assert why in decision.reason and "stores_by_dma" in decision.reason
    refused = dataclasses.replace(stores(), batch_allowed=False)
    assert choose_method(refused, H200).method == "kernel"


def test_stores_by_dma_leaves_single_copies_and_unreadable_memory_alone():
    assert choose_method(stores(count=1), H200).method == "loop"
    assert choose_method(stores(accessible=False), H200).method == "batch"
    assert choose_method(stores(accessible=False, stream="legacy"), H200).method == "loop"


@pytest.mark.parametrize("block", [16 * KiB, 32 * KiB, 64 * KiB])
@pytest.mark.parametrize("requested", ["auto", "kernel"])
def test_gpu_to_host_kernel_copies_go_through_the_bulk_copy_unit_where_there_is_one(block, requested):
    decision = choose_method(req("d2h", block=block), H200, requested=requested)
    assert (decision.method, decision.variant) == ("kernel", "bulk")
    assert "bulk copy unit" in decision.reason
    under_capture = choose_method(req("d2h", block=block, capturing=True), H200, requested=requested)
    assert under_capture.variant == "bulk"
    older = choose_method(req("d2h", block=block), A100, requested=requested)
    assert (older.method, older.variant) == ("kernel", "registers")


@pytest.mark.parametrize("direction", ["h2d", "d2d", "p2p", "mixed"])
def test_other_directions_keep_the_register_copier(direction):
    decision = choose_method(req(direction), H200)
    assert (decision.method, decision.variant) == ("kernel", "registers")
    assert "bulk" not in decision.reason


def test_bulk_stores_off_keeps_registers_and_dma_decisions_name_no_variant():
    off = dataclasses.replace(req("d2h"), bulk_stores=False)
    assert kernel_variant(off, H200) == "registers"
    assert choose_method(off, H200).variant == "registers"
    assert choose_method(req("d2h", block=4 * MiB), H200).variant == ""
    assert choose_method(req("d2h", count=1), H200).variant == ""


@pytest.mark.parametrize("block", [2 * KiB, 4 * KiB, BULK_MIN_BYTES - 16, BULK_MAX_BYTES + 16, 256 * KiB])
def test_blocks_outside_the_bulk_window_keep_the_register_copier(block):
    """Below 16 KiB and above 64 KiB, four bulk CTAs stay under 0.90 of the link alone
    on the H200 where registers reach 0.94."""
    decision = choose_method(req("d2h", block=block), H200)
    assert (decision.method, decision.variant) == ("kernel", "registers")
    assert kernel_variant(req("d2h", block=BULK_MIN_BYTES), H200) == "bulk"
    assert kernel_variant(req("d2h", block=BULK_MAX_BYTES), H200) == "bulk"


@pytest.mark.parametrize(
    "direction, count, total, limit, expected",
    [
        ("d2h", 4096, 64 << 20, 16 << 20, 1024),  # 64 MiB of 16 KiB: four launches
        ("h2d", 32768, 64 << 20, 16 << 20, 8192),  # of 2 KiB
        ("h2d", 3000, 3000 * 5000, 1 << 20, 209),  # odd sizes: by the mean block
        ("d2h", 1024, 16 << 20, 16 << 20, 1024),  # at the limit: one launch
        ("d2h", 4096, 64 << 20, 0, 4096),  # 0: no limit
        ("d2h", 1024, 64 << 20, 16 << 20, 256),  # 64 KiB copies (4 tiles each) too
        ("d2d", 4096, 64 << 20, 16 << 20, 4096),  # inside the GPU: short anyway
        ("p2p", 4096, 64 << 20, 16 << 20, 4096),
        ("h2d", 10, 10 << 20, 1 << 10, 1),  # a block larger than the limit: one each
    ],
)
def test_copies_per_launch(direction, count, total, limit, expected):
    from kvcopy.policy import copies_per_launch

    assert copies_per_launch(direction, count, total, limit) == expected


@pytest.mark.parametrize(
    "block, direction, depends",
    [
        (256 * KiB, "h2d", True),  # the copy engines beside the other way, the kernel alone
        (256 * KiB, "d2h", True),
        (16 * KiB, "h2d", False),  # below the both-ways crossover: the kernel either way
        (4 * MiB, "h2d", False),  # past the batch threshold: the copy engines either way
        (256 * KiB, "d2d", False),  # inside one GPU: no other direction
    ],
)
@pytest.mark.parametrize("recent", [False, True])
def test_a_decision_depends_on_the_other_way_only_where_the_answer_flips(block, direction, depends, recent):
    asked = dataclasses.replace(req(direction, count=64, block=block), other_way_recent=recent)
    decision = choose_method(asked, H200)
    assert depends_on_other_way(asked, decision, H200) is depends
    flipped = dataclasses.replace(asked, other_way_recent=not recent)
    assert (choose_method(flipped, H200) != decision) is depends


@pytest.mark.parametrize(
    "requested, caller_ctas, batch_allowed, capturing, allowed",
    [
        ("auto", None, True, False, True),
        ("kernel", None, True, False, True),
        ("batch", None, True, False, False),  # the copy engines: no launch to replay
        ("loop", None, True, False, False),
        ("auto", 4, True, False, False),  # a caller's CTA limit is not in a record's key
        ("auto", None, False, False, False),  # nor is cuMemcpyBatchAsync ruled out
        ("auto", None, True, True, False),  # a graph keeps its own launches
    ],
)
def test_may_replay_only_the_kernel_asked_plainly_outside_capture(
    requested, caller_ctas, batch_allowed, capturing, allowed
):
    assert policy.may_replay(requested, caller_ctas, batch_allowed, capturing) is allowed


def test_layout_kernel_host_ctas_per_direction():
    assert policy.rows_host_ctas("h2d") == policy.ROWS_HOST_CTAS["h2d"] == 16
    assert policy.rows_host_ctas("d2h") == policy.ROWS_HOST_CTAS["d2h"] == 2
    assert policy.rows_host_ctas("mixed") == 16  # the larger of the two
    assert policy.rows_host_ctas("h2d", host_ctas=5) == 5  # config.host_ctas wins
    # the block kernel's calibrated counts are its own: the layout kernel's differ
    assert policy.rows_host_ctas("h2d") != policy.HOST_CTAS["h2d"]


@pytest.mark.parametrize(
    "pairs, first, growth, chunks",
    [
        (0, 1024, 8, []),
        (3, 1024, 8, [3]),
        (1024, 1024, 8, [1024]),
        (32768, 1024, 8, [1024, 8192, 23552]),
        (100, 10, 2, [10, 20, 40, 30]),
    ],
)
def test_swap_blocks_ids_go_up_in_growing_chunks(pairs, first, growth, chunks):
    assert policy.id_chunks(pairs, first, growth) == chunks
    assert sum(chunks) == pairs


def test_id_chunks_defaults_start_small_and_grow():
    chunks = policy.id_chunks(32768)
    assert chunks[0] == policy.ID_FIRST_CHUNK
    assert all(b <= policy.ID_CHUNK_GROWTH * a for a, b in zip(chunks, chunks[1:]))


@pytest.mark.parametrize(
    "index_bytes, planes, in_place",
    [
        (16, 1, True),  # one block pair, one tensor a side
        (16, 64, True),  # one block pair over a model's layers
        (4096, 16, True),  # 256 rows a side over 16 planes: 64 KiB of reads
        (4096, 17, False),
        (16 * 4096, 1, True),
        (16 * 4096, 2, False),  # thousands of pairs over planes: uploaded once
        (0, 8, False),  # no host indices: nothing to read
        (16, 0, False),  # no layout-kernel readers named (the staged path's indices)
    ],
)
def test_host_indices_are_read_in_place_while_their_reads_stay_small(index_bytes, planes, in_place):
    assert policy.INDICES_IN_PLACE_MAX_BYTES == 64 << 10
    assert policy.indices_in_place(index_bytes, planes) is in_place
