"""Steady-state calls on a CPU, kvcopy's driver layer faked through kvcopy.testing:
each call's median CPU time, and what it asks of the driver layer.

Needs no GPU. Every module of kvcopy's driver layer (kvcopy.testing.fake_cuda's
layers, the planning loop aside) is replaced by a recorder that answers as the
driver would for one GPU and one pinned host pool and counts each function a call
reaches; the copy kernel, the descriptor ring and device 0's facts come from
kvcopy.testing.fake_runtime. Everything above the driver layer (argument checks,
planning, the policy, the issue paths) runs as it does on a GPU host, so this
measures kvcopy's own CPU work; a GPU host adds the driver calls' cost
(bench/steady_calls.py times the same calls there).

    python bench/cpu_calls.py [--calls N] [--path] [--reads]

For each row: the median µs of N calls after warm-up, then the driver layer's
functions one steady call reached, with counts. The GPU side of every row is
``__cuda_array_interface__`` producers (as CuPy's arrays; torch's CUDA tensors need a
GPU), the host side NumPy arrays taken as pinned. ``pointer queries`` counts the
memory ranges the describe pass asked the driver about; ``classify_pointers`` and
``plan_dma`` ask the driver about every pointer they are given.

``--path`` follows one steady call of each row through kvcopy's modules (every
Python and Cython function kvcopy's own code enters, in order): ``stops`` counts the
modules passed through, one stop per stretch of calls inside one module; ``modules``
the distinct ones; ``again`` the stops at a module visited before (control climbing
back up and down), and it prints the path.

``--reads`` times, instead, each read of a torch tensor that a call checking it makes
(its address, shape, stride, dtype and version counter): the floor of a call that
checks every tensor it is given, per tensor.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from typing import Any, Callable, Iterator

import numpy as np

import kvcopy
from kvcopy import testing
from kvcopy.testing import cuda, engine
from steady_calls import median_quartile  # (bench/steady_calls.py: the same timer)

LAYERS = ("driver", "memory", "describe", "launch", "dma", "stage", "classify", "replay_records", "rows")
DEVICE_BASE = 0x7F0000000000  # where the faked GPU's memory starts
DEVICE_SPAN = 1 << 40


class GpuArray:
    """GPU memory as a CUDA array-interface producer describes it (no memory behind it:
    the driver layer that would touch it is faked)."""

    def __init__(self, shape: tuple[int, ...], ptr: int, typestr: str = "|u1") -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class FakeLaunches:
    """kvcopy._cuda.rows.RowsLaunches: built and launched, nothing run."""

    def __init__(self, counts: collections.Counter, *args: Any) -> None:
        self.counts = counts

    def usable(self) -> bool:
        return True

    def launch(self) -> int:
        self.counts["rows.RowsLaunches.launch"] += 1
        return 1

    def launch_indexed(self, src_indices: int, dst_indices: int) -> int:
        return self.launch()


class Recorder:
    """One driver-layer module: its constants as they are, its functions counted and
    answered by ``answers`` (a function without an answer fails the row, by name)."""

    def __init__(self, layer: str, real: Any, counts: collections.Counter, answers: dict) -> None:
        self.layer, self.real, self.counts, self.answers = layer, real, counts, answers

    def __getattr__(self, name: str) -> Any:
        key = f"{self.layer}.{name}"
        value = getattr(self.real, name)
        if key not in self.answers and (not callable(value) or name.isupper()):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.counts[key] += 1
            if key not in self.answers:
                raise NotImplementedError(f"the faked driver layer has no answer for {key}")
            return self.answers[key](*args, **kwargs)

        return call


class FakeHost:
    """One GPU (device 0) at DEVICE_BASE and pinned host memory in ``pools``, as the
    driver layer would answer for them; the memory of ``stand_ins`` (torch CPU tensors
    standing in for CUDA ones) is the GPU's too."""

    def __init__(self, pools: list[np.ndarray], stand_ins: list | None = None) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.device_spans = [(DEVICE_BASE, DEVICE_BASE + DEVICE_SPAN)] + [
            (t.data_ptr(), t.data_ptr() + t.nbytes) for t in stand_ins or []
        ]
        rows = [[lo, hi, cuda.classify.KIND_DEVICE, 0, 0] for lo, hi in self.device_spans]
        rows += [
            [p.ctypes.data, p.ctypes.data + p.nbytes, cuda.classify.KIND_HOST_MAPPED, -1, 0] for p in pools
        ]
        self.ranges = np.array(rows, dtype=np.int64)
        counts = self.counts
        self.answers: dict[str, Callable[..., Any]] = {
            "driver.init": lambda: None,
            "driver.stream_context": lambda handle: 1,
            "driver.current_context": lambda: 1,
            "driver.current_context_key": lambda: 1,
            "driver.context_device": lambda: 0,
            "driver.stream_capture_status": lambda handle: 0,
            "driver.enter_for_repeat": lambda handle, owner, key: 0,
            "driver.event_record": lambda event, stream: None,
            "driver.stream_wait_stream": lambda *args: None,
            "driver.stream_create": lambda *args, **kwargs: 0x7F00_5678,
            "driver.event_create": lambda *args, **kwargs: 0x7F00_9ABC,
            "classify.classify_pointers": self.classify_pointers,
            "describe.describe_copies": self.describe,
            "describe.describe_compact": lambda s, d, z, out, merge: self.describe(s, d, z, out, merge),
            "dma.plan_dma": lambda s, d, z, merge: cuda.plan_arrays.plan_arrays(s, d, z, merge),
            "dma.memcpy_loop": lambda *args: None,
            "dma.memcpy_batch": lambda *args: None,
            "replay_records.replay": lambda *args: None,
            "replay_records.current_context_key": lambda: 0,
            "launch.upload": lambda *args: None,
            "launch.launch_descs_inline": lambda *args: 1,
            "launch.launch_descs": lambda *args, **kwargs: 1,
            "launch.launch_pairs": lambda *args, **kwargs: 1,
            "launch.launch_blocks_uploaded": lambda *args: 1,
            "rows.RowsLaunches": lambda *args: FakeLaunches(counts, *args),
            "dma.BlockCopyAgain": self.block_copy_again,
        }

    def block_copy_again(self, *args: Any) -> Callable[[np.ndarray], bool]:
        """dma.BlockCopyAgain, its calls counted as ``dma.BlockCopyAgain()``: the one
        DMA call of a repeated swap_blocks of one block copy."""
        again = testing.block_copy_again(lambda *copies: None)(*args)

        def issue(mapping: np.ndarray) -> bool:
            self.counts["dma.BlockCopyAgain()"] += 1
            return again(mapping)

        return issue

    def classify_pointers(self, ptrs: np.ndarray, sizes: np.ndarray, view: np.ndarray) -> tuple[int, int]:
        view[:] = ptrs
        device = all(any(lo <= p < hi for lo, hi in self.device_spans) for p in ptrs.tolist())
        kind = cuda.classify.KIND_DEVICE if device else cuda.classify.KIND_HOST_MAPPED
        return kind, 0 if device else -1

    def describe(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, out: int, merge: bool) -> Any:
        batch, _, asked = cuda.testing.describe_copies_answered(self.ranges, src, dst, sizes, out, merge)
        self.counts["pointer queries"] += sum(asked)
        return batch

    @contextlib.contextmanager
    def standing_in(self) -> Iterator[None]:
        scratch = np.zeros(1 << 26, dtype=np.uint8)  # the ring slot's host side: ids are written
        slot = engine.ring.Slot(
            capacity=scratch.nbytes,
            host=scratch.ctypes.data,
            mapped=scratch.ctypes.data,
            device=0x3000,
            event=7,
        )
        kernel = engine.kernels.CopyKernel(1, 2, 3, 4, 5, 6, 7, 8, 9, cuda.launch.INLINE_MAX, None)
        with contextlib.ExitStack() as stack:
            for layer in LAYERS:
                recorder = Recorder(layer, getattr(cuda, layer), self.counts, self.answers)
                stack.enter_context(testing.fake_cuda(recorder, (layer,)))
            stack.enter_context(testing.fake_runtime(copy_kernel=kernel, slot=slot))
            yield


def rows(
    host: FakeHost, pools: list[np.ndarray], stand_ins: list | None = None
) -> list[tuple[str, Callable[[], object]]]:
    """(label, call) of every row; ``pools`` are the pinned host side's arrays,
    ``stand_ins`` (where torch is present) 32 torch tensors for a GPU's per-layer caches
    and 32 for the host's."""
    rng = np.random.default_rng(0)
    stream = 0x7F00_1234

    def gpu(blocks: int, layers: int, block: int = 2048) -> list[GpuArray]:
        return [GpuArray((blocks, block), DEVICE_BASE + k * blocks * block) for k in range(layers)]

    def pairs(blocks: int, n: int) -> np.ndarray:
        return np.stack([rng.choice(blocks, n, replace=False), rng.choice(blocks, n, replace=False)], axis=1)

    one_tensor, layered, many = pools[0], pools[1:33], pools[33:97]
    one = pairs(64, 1)
    first_gpu, gpu_layers, gpu_many = gpu(64, 1), gpu(64, 32), gpu(8192, 64)
    out: list[tuple[str, Callable[[], object]]] = []
    out.append(
        (
            "swap_blocks 1 pair, 1 tensor a side",
            lambda: kvcopy.swap_blocks(first_gpu, one_tensor, one, stream=stream),
        )
    )
    if stand_ins:
        out.append(
            (
                "swap_blocks 1 pair, 1 torch tensor a side",
                lambda: kvcopy.swap_blocks(stand_ins[0], stand_ins[32], one, stream=stream),
            )
        )
        torch_gpu, torch_host = stand_ins[:32], stand_ins[32:64]
        out.append(
            (
                "swap_blocks 1 pair, 32 torch tensors a side",
                lambda: kvcopy.swap_blocks(torch_gpu, torch_host, one, stream=stream),
            )
        )
    out.append(
        (
            "swap_blocks 1 pair, 32 tensors a side",
            lambda: kvcopy.swap_blocks(gpu_layers, layered, one, stream=stream),
        )
    )
    big = pairs(8192, 4096)
    out.append(
        (
            "swap_blocks 4096 pairs, 64 tensors a side",
            lambda: kvcopy.swap_blocks(gpu_many, many, big, stream=stream),
        )
    )
    if stand_ins:
        import torch

        many_torch = [torch.from_numpy(p).view(torch.bfloat16) for p in many]
        out.append(
            (
                "swap_blocks 4096 pairs, 64 torch tensors a side",
                lambda: kvcopy.swap_blocks(stand_ins[64:], many_torch, big, stream=stream),
            )
        )

    pool = pools[97]
    slots = rng.permutation(pool.shape[0])[:8192].astype(np.uint64) * np.uint64(2048)
    src = np.uint64(pool.ctypes.data) + slots
    dst = np.uint64(DEVICE_BASE) + rng.permutation(16384)[:8192].astype(np.uint64) * np.uint64(2048)
    sizes = np.full(8192, 2048, dtype=np.uint64)
    s1, d1, z1 = src[:1].copy(), dst[:1].copy(), sizes[:1].copy()
    out.append(("copy_batch 1 copy", lambda: kvcopy.copy_batch(s1, d1, z1, stream=stream)))
    out.append(("copy_batch 8192 copies", lambda: kvcopy.copy_batch(src, dst, sizes, stream=stream)))

    tokens_g = kvcopy.Layout.of(GpuArray((8192, 2048), DEVICE_BASE), slot=0)
    tokens_h = kvcopy.Layout.of(pools[98], slot=0)
    index_h = rng.choice(8192, 256, replace=False).astype(np.int64)
    index_g = GpuArray((256,), DEVICE_BASE + (1 << 39), "<i8")
    out.append(
        (
            "copy_rows 256 rows, GPU indices",
            lambda: kvcopy.copy_rows(tokens_g, tokens_h, index_g, index_g, stream=stream),
        )
    )
    if stand_ins:
        rows_g, rows_h = kvcopy.Layout.of(stand_ins[0], slot=0), kvcopy.Layout.of(stand_ins[32], slot=0)
        few = rng.choice(64, 32, replace=False).astype(np.int64)
        out.append(
            (
                "copy_rows 32 rows, host indices, torch layouts",
                lambda: kvcopy.copy_rows(rows_g, rows_h, few, few, stream=stream),
            )
        )
    out.append(
        (
            "copy_rows 256 rows, host indices",
            lambda: kvcopy.copy_rows(tokens_g, tokens_h, index_h, index_h, stream=stream),
        )
    )
    if stand_ins:
        import torch

        from kvcopy.compat import sglang

        slots = torch.from_numpy(few)  # (the drop-ins' indices are tensors)
        k_g, v_g, k_h, v_h = stand_ins[0], stand_ins[1], stand_ins[32], stand_ins[33]
        out.append(
            (
                "SGLang transfer_kv_per_layer, 32 host indices",
                lambda: sglang.transfer_kv_per_layer(k_g, k_h, v_g, v_h, slots, slots, 2048),
            )
        )
    out.append(("vLLM CopyBackend.submit, 64 planes x 8 blocks", vllm_jobs(pools[33:97], rng)))
    return out


def vllm_jobs(planes_h: list[np.ndarray], rng: np.random.Generator) -> Callable[[], None]:
    """vLLM's offload worker storing a job a call, as bench/steady_calls.py's row: 8
    scattered 2 KiB blocks of each of 64 GPU planes into the host's, a run a block and
    plane, through 16 jobs in turn, on a stream named (torch's current one needs a GPU)."""
    from kvcopy.compat import vllm

    block, blocks = 2048, planes_h[0].shape[0]

    def job() -> list:
        src_ids, dst_ids = rng.choice(blocks, 8, replace=False), rng.choice(blocks, 8, replace=False)
        return [
            vllm.CopyRunDescriptor(
                DEVICE_BASE + k * blocks * block + int(s) * block,
                h.ctypes.data + int(d) * block,
                block,
                1,
                block,
                block,
            )
            for k, h in enumerate(planes_h)
            for s, d in zip(src_ids, dst_ids)
        ]

    jobs, backend, step = [job() for _ in range(16)], vllm.CopyBackend(), [0]

    def submit() -> None:
        backend.submit(jobs[step[0] % len(jobs)], stream=0x7F00_1234)  # (a created stream)
        backend.finish_transfer()
        step[0] += 1

    return submit


def torch_stand_ins() -> list:
    """128 torch CPU tensors, or none where torch is missing: 64 of 64 blocks of 2 KiB,
    the first 32 standing in for a GPU's per-layer caches (FakeHost's device memory),
    then 64 of 8,192 blocks standing in for a GPU's too (never written: their pages
    are not touched)."""
    try:
        import torch
    except ImportError:
        return []
    small = [torch.zeros(64, 1024, dtype=torch.bfloat16) for _ in range(64)]
    return small + [torch.empty(8192, 1024, dtype=torch.bfloat16) for _ in range(64)]


def device_stand_ins(stand_ins: list) -> list:
    """The stand-ins FakeHost takes for the GPU's memory."""
    return stand_ins[:32] + stand_ins[64:]


def host_pools() -> list[np.ndarray]:
    """The host side's arrays: 1 + 32 + 64 caches, a pointer pool, a token pool."""
    small = [np.zeros((64, 2048), np.uint8) for _ in range(33)]
    large = [np.zeros((8192, 2048), np.uint8) for _ in range(64)]
    return small + large + [np.zeros((16384, 2048), np.uint8), np.zeros((8192, 2048), np.uint8)]


def module_path(call: Callable[[], object]) -> list[str]:
    """The kvcopy modules one call of ``call`` passes through, in order, one entry per
    stretch of calls inside one module (Python frames by their module, Cython
    functions by theirs)."""
    path: list[str] = []

    def seen(name: str) -> None:
        if (name == "kvcopy" or name.startswith("kvcopy.")) and name != "kvcopy.testing":
            if not path or path[-1] != name:
                path.append(name)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            seen(frame.f_globals.get("__name__", ""))
        elif event == "c_call":
            seen(getattr(arg, "__module__", None) or "")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return path


def tensor_reads(calls: int = 100_000) -> list[tuple[str, float]]:
    """(what, ns) of each read a call that checks a torch tensor makes of it: its
    address, shape, stride, dtype and version counter, the best of five rounds of
    ``calls`` reads; [] where torch is missing."""
    try:
        import torch
    except ImportError:
        return []
    import timeit

    t = torch.zeros(64, 1024, dtype=torch.bfloat16)
    reads = {
        "data_ptr()": t.data_ptr,
        "shape": lambda: t.shape,
        "stride()": t.stride,
        "dtype": lambda: t.dtype,
        "_version": lambda: t._version,
    }
    return [
        (name, min(timeit.repeat(read, number=calls, repeat=5)) / calls * 1e9) for name, read in reads.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls a row")
    parser.add_argument("--path", action="store_true", help="the modules one call passes through")
    parser.add_argument("--reads", action="store_true", help="what reading a torch tensor's facts costs")
    args = parser.parse_args(argv)
    if args.reads:
        for name, ns in tensor_reads(max(args.calls, 1000)):
            print(f"torch tensor {name:12s} {ns:7.0f} ns")
        return 0
    pools, stand_ins = host_pools(), torch_stand_ins()
    host = FakeHost(pools, device_stand_ins(stand_ins))
    with host.standing_in():
        print(f"median of {args.calls} calls, µs; the driver layer's functions one steady call reaches")
        for label, call in rows(host, pools, stand_ins):
            calls = (
                args.calls
                if "4096" not in label and "8192 copies" not in label
                else max(args.calls // 10, 20)
            )
            try:
                median, _ = median_quartile(call, lambda: None, calls)
                host.counts.clear()
                call()
            except Exception as exc:  # (a row the fake cannot answer says so; the others run)
                print(f"{label:48s} failed: {type(exc).__name__}: {exc}")
                continue
            reached = ", ".join(f"{name} {n}" for name, n in sorted(host.counts.items()))
            print(f"{label:48s} {median:8.1f}  {reached}")
            if args.path:
                path = module_path(call)
                again = len(path) - len(set(path))
                print(f"{'':48s} stops {len(path)}, modules {len(set(path))}, again {again}")
                print(f"{'':48s} {' > '.join(name.removeprefix('kvcopy.') for name in path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
