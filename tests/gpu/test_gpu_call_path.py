"""copy_batch's path on a real GPU, followed from api.copy_batch to the driver call that
issues the copy: every kvcopy module that holds the batch (its source array, or the
DescribedBatch made of it) holds it in one stretch of the call (no module is handed it,
gives it up and gets it back; what runs after the copy is issued, such as recording a
small batch's launch for a replay, is not on that path), and the CPU passes over the
batch are counted where kvcopy._cuda makes them:
the describe pass (alone, or inside the replay's attempt), and the issuing path's own
plan: the copy engines' (merged inside allocations, pageable pointers checked) or the
staged path's (its chunks, planned one after another as they are issued)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import kvcopy
from kvcopy import testing
from kvcopy.policy import Decision
from helpers.spies import LayerSpy
from helpers.gpu import ordered_stream

KiB = 1 << 10
# the kvcopy._cuda functions that read a batch copy by copy on the CPU
PASSES = {
    "describe": ("describe_copies", "describe_compact"),
    "replay_records": ("replay",),
    "dma": ("plan_dma", "memcpy_loop"),
    "stage": ("plan_next_chunk",),
    "plan_arrays": ("plan_arrays",),
}
# the kvcopy._cuda functions that issue a copy (and replay_records.replay, where it launches)
ISSUES = {
    "launch": ("launch_descs_inline", "launch_descs", "launch_compact", "issue_staged_chunk"),
    "dma": ("memcpy_batch", "memcpy_loop"),
}


class PathRecorder:
    """The Python frames of kvcopy that hold the batch, per module in visits (a visit:
    a frame of the module holding it while no frame of that module was on the stack),
    and the passes kvcopy._cuda made over it."""

    def __init__(self, src: np.ndarray) -> None:
        self.src = src
        self.visits: dict[str, int] = {}
        self.order: list[str] = []
        self.on_stack: dict[str, int] = {}
        self.frames: dict[int, str] = {}
        self.passes: list[str] = []
        self.chunk_end = 0
        self.issued = False  # the driver call that issues the copy was made

    def holds_batch(self, frame) -> bool:
        for value in frame.f_locals.values():
            if value is self.src or getattr(value, "src", None) is self.src:
                return True
        return False

    def profile(self, frame, event, arg) -> None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("kvcopy") or module.startswith("kvcopy.testing"):
            return
        if event == "call" and not self.issued:
            if not self.on_stack.get(module) and self.holds_batch(frame):
                self.visits[module] = self.visits.get(module, 0) + 1
                self.order.append(module)
            self.on_stack[module] = self.on_stack.get(module, 0) + 1
            self.frames[id(frame)] = module
        elif event == "return" and id(frame) in self.frames:
            self.on_stack[self.frames.pop(id(frame))] -= 1

    def note_issue(self, name: str, args: tuple) -> None:
        self.issued = True

    def note_pass(self, name: str, args: tuple, result=None) -> None:
        # (the replay's attempt passes over the batch only where it described it; the
        # staged plan is one pass, chunk after chunk, each from where the last ended)
        if name == "plan_next_chunk":
            start, first = args[6], not self.passes or self.passes[-1] != name
            assert start == (0 if first else self.chunk_end), (start, self.chunk_end)
            self.chunk_end = result[0]
            if not first:
                return
        if name != "replay" or result is not None:
            self.passes.append(name)
        if name == "replay" and isinstance(result, Decision):
            self.issued = True  # (launched from a record)


def follow(seams, src, dst, sizes, **kwargs) -> PathRecorder:
    recorder = PathRecorder(src)
    for layer in PASSES.keys() | ISSUES.keys():
        real = getattr(testing.cuda, layer)
        passes, issues = PASSES.get(layer, ()), ISSUES.get(layer, ())

        def issue(name, args, issues=issues):
            if name in issues:
                recorder.note_issue(name, args)

        def done(name, args, result, passes=passes):
            if name in passes:
                recorder.note_pass(name, args, result)

        spy = LayerSpy(real, passes + issues, issue, done)
        seams.enter_context(testing.fake_cuda(spy, (layer,)))
    sys.setprofile(recorder.profile)
    try:
        kvcopy.copy_batch(src, dst, sizes, **kwargs)
    finally:
        sys.setprofile(None)
    return recorder


@pytest.mark.parametrize(
    "case", ["small, new", "small, repeated", "small, no record matches", "large", "by the engines", "staged"]
)
def test_copy_batch_hands_the_batch_down_once_and_passes_over_it_at_most_twice(torch_cuda, seams, case):
    torch = torch_cuda
    count = {"large": 4096, "staged": 16384}.get(case, 24)
    block = 4 * KiB
    host = torch.randint(0, 256, (2 * count * block,), dtype=torch.uint8).pin_memory()
    gpu = torch.zeros(2 * count * block, dtype=torch.uint8, device="cuda")
    stream = ordered_stream(torch)
    order = np.random.default_rng(count).permutation(count).astype(np.uint64)
    if case == "staged":  # 64 MiB whose host side is one span: staged through GPU memory
        order = np.arange(count, dtype=np.uint64)
        host = host[: count * block]
    step = block if case == "staged" else 2 * block
    src = np.uint64(host.data_ptr()) + order * np.uint64(step)
    dst = np.uint64(gpu.data_ptr()) + np.arange(count, dtype=np.uint64) * np.uint64(2 * block)
    sizes = np.full(count, block, dtype=np.uint64)
    method = "batch" if case == "by the engines" else "auto"
    testing.engine.replay.forget()
    if case == "small, repeated":
        kvcopy.copy_batch(src, dst, sizes, stream=stream)  # recorded
    elif case == "small, no record matches":
        # a record of fewer copies on this stream: the batch is described, matches none
        kvcopy.copy_batch(src[: count - 4], dst[: count - 4], sizes[: count - 4], stream=stream)
    recorder = follow(seams, src, dst, sizes, stream=stream, method=method)
    stream.synchronize()
    for k in (0, count - 1):  # the bytes arrived
        s = int(order[k]) * step
        assert torch.equal(gpu[k * 2 * block : k * 2 * block + block].cpu(), host[s : s + block])
    # (the batch reached the engine as the caller's array: the count below is of it)
    assert recorder.issued and recorder.order[0] == "kvcopy.pointers"
    assert testing.engine.dispatch.__name__ in recorder.order
    assert all(n == 1 for n in recorder.visits.values()), (recorder.visits, recorder.order)
    expected = {
        "small, new": ["describe_copies"],
        "small, repeated": ["replay"],
        "small, no record matches": ["replay"],  # its description issued
        "large": ["describe_compact"],
        "by the engines": ["describe_copies", "plan_dma"],
        "staged": ["describe_compact", "plan_next_chunk"],
    }[case]
    assert recorder.passes == expected, recorder.passes
