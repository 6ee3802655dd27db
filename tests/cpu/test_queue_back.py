"""TransferQueue jobs that copy both ways (``submit(..., back=...)``), on the CPU.

What a job with ``back`` checks before anything is queued, and how it is handed to
the both-ways paths; the copies themselves run on a GPU in
test_gpu_blocks.py::test_transfer_queue_job_stores_and_loads_at_once.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import kvcopy
from kvcopy.testing import engine

both_ways = engine.both_ways
from kvcopy._plans.blocks import block_geometry, crossing_pairs


def plan(src, dst, mapping, split_blocks=False):
    return block_geometry(src, dst, split_blocks=split_blocks).with_mapping(mapping)


def queue_without_gpu(src, dst, split_blocks=False) -> kvcopy.TransferQueue:
    """A TransferQueue's planning state, made without the driver (__init__ needs one)."""
    queue = object.__new__(kvcopy.TransferQueue)
    queue.src, queue.dst, queue.split_blocks = [src], [dst], split_blocks
    queue._geometry = block_geometry(queue.src, queue.dst, split_blocks=split_blocks)
    queue._back_geometry = None
    queue.method = "auto"
    return queue


GPU_LIKE, HOST_LIKE = np.zeros((8, 16), np.uint8), np.zeros((32, 16), np.uint8)


def test_submit_takes_back_as_a_keyword():
    params = inspect.signature(kvcopy.TransferQueue.submit).parameters
    assert params["back"].kind is inspect.Parameter.KEYWORD_ONLY and params["back"].default is None


def test_disjoint_blocks_do_not_cross():
    store = plan(GPU_LIKE, HOST_LIKE, [[0, 10], [1, 11]])
    load = plan(HOST_LIKE, GPU_LIKE, [[20, 2], [21, 3]])
    assert crossing_pairs(store, load) is None


def test_a_block_the_store_reads_and_the_load_writes_is_named_by_both_pairs():
    store = plan(GPU_LIKE, HOST_LIKE, [[0, 10], [5, 11], [1, 12]])
    load = plan(HOST_LIKE, GPU_LIKE, [[20, 2], [21, 5]])
    assert crossing_pairs(store, load) == ("block_mapping[1] reads source block 5, which back[1] writes")


def test_a_block_the_store_writes_and_the_load_reads_is_named_by_both_pairs():
    store = plan(GPU_LIKE, HOST_LIKE, [[0, 10], [1, 12]])
    load = plan(HOST_LIKE, GPU_LIKE, [[20, 2], [30, 3], [12, 4]])
    assert crossing_pairs(store, load) == (
        "block_mapping[1] writes destination block 12, which back[2] reads"
    )


def test_one_id_in_the_other_cache_is_another_block():
    # the store reads GPU block 3 and writes host block 4; the load reads host block 3
    # and writes GPU block 4: the same numbers, four different blocks
    store = plan(GPU_LIKE, HOST_LIKE, [[3, 4]])
    load = plan(HOST_LIKE, GPU_LIKE, [[3, 4]])
    assert crossing_pairs(store, load) is None


def test_within_one_set_of_caches_two_writes_of_a_block_cross_too():
    cache = np.zeros((16, 16), np.uint8)
    forward = plan(cache, cache, [[0, 5]])
    assert crossing_pairs(forward, plan(cache, cache, [[1, 6]])) is None
    # back writes block 5 too (and reads neither of forward's blocks)
    assert crossing_pairs(forward, plan(cache, cache, [[2, 5]])) == (
        "block_mapping[0] writes destination block 5, which back[0] writes"
    )
    # between two sets of caches the same ids are different blocks
    assert crossing_pairs(plan(GPU_LIKE, HOST_LIKE, [[0, 5]]), plan(HOST_LIKE, GPU_LIKE, [[2, 5]])) is None


def test_sub_block_ids_cross_only_where_the_same_sub_block_is_used():
    gpu, host = np.zeros((4, 32), np.uint8), np.zeros((16, 16), np.uint8)
    store = plan(gpu, host, [[0, 0], [1, 1]], split_blocks=True)  # GPU block 0's halves
    load = plan(host, gpu, [[5, 2], [6, 3]], split_blocks=True)  # into GPU block 1
    assert crossing_pairs(store, load) is None
    load = plan(host, gpu, [[5, 1]], split_blocks=True)  # GPU block 0's 2nd half
    assert "reads source block 1, which back[0] writes" in crossing_pairs(store, load)


def test_bad_back_ids_are_named_as_back_against_the_queues_caches():
    queue = queue_without_gpu(GPU_LIKE, HOST_LIKE)
    forward = queue._geometry.with_mapping([[0, 10]])
    with pytest.raises(
        ValueError,
        match=r"^back\[1\]: source block 40 is out of range for "
        r"dst, which has 32 blocks$",
    ):
        queue._plan_back(forward, [[20, 1], [40, 2]])
    with pytest.raises(
        ValueError,
        match=r"^back\[0\]: destination block 9 is out of range "
        r"for src, which has 8 blocks$",
    ):
        queue._plan_back(forward, [[20, 9]])
    with pytest.raises(
        ValueError,
        match=r"^back\[0\] and back\[1\] both write destination "
        r"block 3$",
    ):
        queue._plan_back(forward, [[20, 3], [21, 3]])


def test_a_crossing_job_is_refused_with_both_pairs_and_what_to_do():
    queue = queue_without_gpu(GPU_LIKE, HOST_LIKE)
    forward = queue._geometry.with_mapping([[0, 10], [1, 11]])
    with pytest.raises(
        ValueError,
        match=r"^block_mapping\[1\] reads source block 1, which "
        r"back\[0\] writes: a job's two ways run at once, in "
        r"no order; submit them as two jobs to order them$",
    ):
        queue._plan_back(forward, [[20, 1]])


def test_caches_that_cannot_be_written_back_are_named_as_the_queues():
    readonly = GPU_LIKE.copy()
    readonly.flags.writeable = False
    queue = queue_without_gpu(readonly, HOST_LIKE)
    forward = queue._geometry.with_mapping([[0, 10]])
    with pytest.raises(
        ValueError,
        match=r"^back: the caches cannot be copied the other way: "
        r"src is read-only$",
    ):
        queue._plan_back(forward, [[20, 1]])


def test_a_job_with_back_goes_out_as_one_both_ways_call(monkeypatch):
    queue = queue_without_gpu(GPU_LIKE, HOST_LIKE)
    queue._stream = 0x5000
    forward = queue._geometry.with_mapping([[0, 10], [1, 11]])
    back = queue._plan_back(forward, [[20, 2]])
    calls = []

    def blocks_both(first, second, stream, method):
        calls.append(("blocks", first, second, stream, method))
        return ("kernel", "kernel")

    monkeypatch.setattr(both_ways, "execute_blocks_both", blocks_both)
    assert queue._execute(forward, back) == ("kernel", "kernel")
    assert calls == [("blocks", forward, back, 0x5000, "auto")]


def test_where_one_block_kernel_launch_does_not_apply_every_copy_goes_both_ways(monkeypatch):
    queue = queue_without_gpu(GPU_LIKE, HOST_LIKE)
    queue._stream = 0x5000
    forward = queue._geometry.with_mapping([[0, 10], [1, 11]])
    back = queue._plan_back(forward, [[20, 2]])
    seen = {}

    def both(first, second, stream, method, names):
        seen.update(first=first, second=second, stream=stream, method=method, names=names)
        return ("batch", "batch")

    monkeypatch.setattr(both_ways, "execute_blocks_both", lambda *args: None)
    monkeypatch.setattr(both_ways, "execute_both", both)
    assert queue._execute(forward, back) == ("batch", "batch")
    assert seen["stream"] == 0x5000 and seen["method"] == "auto"
    assert seen["names"] == ("block_mapping", "back")
    gpu, host = GPU_LIKE.ctypes.data, HOST_LIKE.ctypes.data
    src, dst, sizes = seen["first"]
    assert src.tolist() == [gpu, gpu + 16] and dst.tolist() == [host + 160, host + 176]
    src, dst, sizes = seen["second"]
    assert src.tolist() == [host + 320] and dst.tolist() == [gpu + 32] and sizes.tolist() == [16]


@pytest.mark.parametrize("job_id", [[1, 2], {"a": 1}, {1}])
def test_submit_refuses_a_job_id_that_is_not_hashable(job_id):
    queue = queue_without_gpu(GPU_LIKE, HOST_LIKE)
    with pytest.raises(TypeError, match="job_id must be hashable"):
        queue.submit(job_id, [[0, 1]])
