"""What is measured: scattered block copies by every method and the alternatives."""

from __future__ import annotations

from dataclasses import asdict, dataclass
import functools
from typing import Callable, Iterator, Sequence

import numpy as np

import kvcopy
from kvcopy_bench.timing import measure
from kvcopy.policy import RequestedMethod

KiB, MiB = 1 << 10, 1 << 20


@dataclass
class Row:
    scenario: str
    direction: str
    block_bytes: int
    count: int
    memory: str
    method: str  # kvcopy method asked for, 'contiguous', or an alternative's name
    chose: str  # what kvcopy actually ran ('' for alternatives)
    gbps: float
    fraction_of_ceiling: float
    gpu_ms: float
    cpu_us: float
    wall_gbps: float  # bytes / (call + completion), from an idle stream
    copier: str = ""  # for kernel rows, the copier that ran ('registers' or 'bulk')

    def as_dict(self) -> dict:
        return asdict(self)


def last_method() -> str:
    """The method kvcopy's last copy on this thread used; '' before any."""
    decision = kvcopy.last_decision()
    return decision.method if decision else ""


def last_copier() -> str:
    """The copier of kvcopy's last copy on this thread, if the copy kernel ran it
    ('registers' or 'bulk'); '' otherwise."""
    decision = kvcopy.last_decision()
    return decision.variant if decision and decision.method == "kernel" else ""


class Pools:
    """Source and destination pools for one direction, twice the batch's size."""

    def __init__(self, direction: str, total: int, memory: str):
        import torch

        self.direction = direction
        kinds = {"h2d": ("host", "cuda"), "d2h": ("cuda", "host"), "d2d": ("cuda", "cuda")}[direction]
        self.src = self._alloc(kinds[0], 2 * total, memory)
        self.dst = self._alloc(kinds[1], 2 * total, memory)
        if self.src.is_cuda:
            self.src.random_(0, 255)
        else:
            self.src.copy_(torch.randint(0, 255, self.src.shape, dtype=torch.uint8))

    def scattered(self, block: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``count`` copies of ``block`` bytes between random slots of the two pools
        (scattered_offsets, seeded): source and destination pointers and sizes, uint64."""
        src_off, dst_off = scattered_offsets(count, block, np.random.default_rng(seed))
        return (
            np.uint64(self.src.data_ptr()) + src_off.astype(np.uint64),
            np.uint64(self.dst.data_ptr()) + dst_off.astype(np.uint64),
            np.full(count, block, dtype=np.uint64),
        )

    @staticmethod
    def _alloc(kind: str, nbytes: int, memory: str):
        import torch

        if kind == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        if memory == "kvcopy":
            return torch.from_numpy(kvcopy.pinned_empty(nbytes, dtype=np.uint8))
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def scattered_offsets(count: int, block: int, rng) -> tuple[np.ndarray, np.ndarray]:
    slots = np.arange(2 * count, dtype=np.int64)
    return rng.permutation(slots)[:count] * block, rng.permutation(slots)[:count] * block


def block_copy_rows(
    direction: str,
    block: int,
    total: int,
    memory: str,
    methods: Sequence[RequestedMethod],
    alternatives: bool,
    repeats: int,
    max_loop_count: int = 32768,
) -> Iterator[Row]:
    """Rows for one direction and block size: the contiguous ceiling, kvcopy's
    methods, and (with ``alternatives``) what users would write instead.
    Alternatives that issue one call per block run only up to ``max_loop_count``
    blocks (they take seconds per batch below that size)."""
    import torch

    count = max(total // block, 1)
    pools = Pools(direction, count * block, memory)
    rng = np.random.default_rng(0)
    src_off, dst_off = scattered_offsets(count, block, rng)
    src_ptrs = np.uint64(pools.src.data_ptr()) + src_off.astype(np.uint64)
    dst_ptrs = np.uint64(pools.dst.data_ptr()) + dst_off.astype(np.uint64)
    sizes = np.full(count, block, dtype=np.uint64)
    stream = torch.cuda.Stream()
    nbytes = count * block

    def row(
        method: str, chose: str, fn: Callable[[], object], ceiling: float | None, host_work: bool = False
    ) -> Row:
        """host_work: fn waits for the GPU and works on the CPU, so only wall time is fair."""
        t = measure(fn, stream, repeats=repeats)
        gbps = nbytes / (t.wall_ms * 1e6) if host_work else nbytes / (t.gpu_ms * 1e6)
        return Row(
            "blocks",
            direction,
            block,
            count,
            memory,
            method,
            chose,
            gbps,
            gbps / ceiling if ceiling else 1.0,
            t.gpu_ms,
            t.cpu_us,
            nbytes / (t.wall_ms * 1e6),
            last_copier() if chose == "kernel" else "",
        )

    contiguous_src, contiguous_dst = pools.src[:nbytes], pools.dst[:nbytes]
    with torch.cuda.stream(stream):
        ceiling_row = row(
            "contiguous", "", lambda: contiguous_dst.copy_(contiguous_src, non_blocking=True), None
        )
    ceiling = ceiling_row.gbps
    yield ceiling_row
    for method in methods:
        if method == "loop" and count > 40000:
            continue
        chose = kvcopy.copy_batch(src_ptrs, dst_ptrs, sizes, stream=stream, method=method)
        yield row(
            method,
            chose,
            functools.partial(kvcopy.copy_batch, src_ptrs, dst_ptrs, sizes, stream=stream, method=method),
            ceiling,
        )
    if alternatives:
        yield from alternative_rows(pools, src_off, dst_off, block, stream, row, ceiling, max_loop_count)


def alternative_rows(
    pools, src_off, dst_off, block, stream, row, ceiling, max_loop_count: int = 32768
) -> Iterator[Row]:
    """What users would write without kvcopy."""
    import torch

    count = len(src_off)
    src_blocks = pools.src.view(-1, block)
    dst_blocks = pools.dst.view(-1, block)
    src_idx = torch.from_numpy(src_off // block)
    dst_idx = torch.from_numpy(dst_off // block)
    for name, programs in (("triton_blocks", 16), ("triton_vllm_grid", 12)):
        triton_fn = triton_copy_blocks(pools, src_off, dst_off, block, stream, programs)
        if triton_fn is not None:
            yield row(name, "", triton_fn, ceiling)
    if count <= max_loop_count:

        def per_block():
            with torch.cuda.stream(stream):
                for i, j in zip(src_idx.tolist(), dst_idx.tolist()):
                    dst_blocks[j].copy_(src_blocks[i], non_blocking=True)

        yield row("torch_copy_loop", "", per_block, ceiling)
    if pools.direction == "h2d":
        staging = torch.empty((count, block), dtype=torch.uint8, pin_memory=True)
        staging_dev = torch.empty((count, block), dtype=torch.uint8, device="cuda")
        dst_idx_dev = dst_idx.cuda()

        def gather_h2d():
            with torch.cuda.stream(stream):
                torch.index_select(src_blocks, 0, src_idx, out=staging)
                staging_dev.copy_(staging, non_blocking=True)
                dst_blocks.index_copy_(0, dst_idx_dev, staging_dev)

        yield row("torch_gather_staging", "", gather_h2d, ceiling, host_work=True)
    elif pools.direction == "d2h":
        staging_dev = torch.empty((count, block), dtype=torch.uint8, device="cuda")
        staging = torch.empty((count, block), dtype=torch.uint8, pin_memory=True)
        src_idx_dev = src_idx.cuda()

        def gather_d2h():
            with torch.cuda.stream(stream):
                torch.index_select(src_blocks, 0, src_idx_dev, out=staging_dev)
                staging.copy_(staging_dev, non_blocking=True)
            stream.synchronize()  # the host-side scatter needs the bytes
            dst_blocks.index_copy_(0, dst_idx, staging)

        yield row("torch_gather_staging", "", gather_d2h, ceiling, host_work=True)
    core_row = (
        cuda_core_copy_batch(pools, src_off, dst_off, block, stream) if count <= max_loop_count else None
    )
    if core_row is not None:
        yield row("cuda.core.copy_batch", "", core_row, ceiling)


def triton_block_copier(src_addrs, dst_addrs, block: int, stream, programs: int | None = None):
    """kvcopy_bench.triton_alt's block copier over these addresses, on ``programs``
    programs (None: vLLM's grid); None where the blocks are not whole 8-byte words or
    Triton cannot run here."""
    if block % 8:
        return None
    try:
        from kvcopy_bench import triton_alt
    except Exception:  # noqa: BLE001 - no (working) Triton here: the row is left out
        return None
    return triton_alt.block_copier(src_addrs, dst_addrs, block, stream, programs or triton_alt.VLLM_PROGRAMS)


def triton_copy_blocks(pools, src_off, dst_off, block, stream, programs: int):
    """A Triton block-copy kernel in the style vLLM uses for small host-to-GPU loads:
    per-block pointer arrays uploaded each call, a fixed grid of ``programs``
    copying 8-byte words through unified addressing (16: kvcopy's CTA budget;
    12: vLLM's grid). None where Triton is not installed."""
    if pools.direction == "d2d":
        return None
    return triton_block_copier(
        pools.src.data_ptr() + src_off, pools.dst.data_ptr() + dst_off, block, stream, programs
    )


def cuda_core_copy_batch(pools, src_off, dst_off, block, stream):
    """cuda.core.utils.copy_batch over Buffers wrapping the same blocks, where it exists."""
    try:
        from cuda.core import Buffer, Device
        from cuda.core.utils import copy_batch
    except ImportError:
        return None
    try:
        device = Device(0)
        device.set_current()  # cuda.core wants its device made current in this thread
        core_stream = device.create_stream(stream)
        srcs = [Buffer.from_handle(pools.src.data_ptr() + int(o), block) for o in src_off]
        dsts = [Buffer.from_handle(pools.dst.data_ptr() + int(o), block) for o in dst_off]
        copy_batch(core_stream, srcs, dsts)
    except Exception as exc:  # noqa: BLE001 - an alternative that cannot run is left out
        import sys

        print(
            f"\nkvcopy bench: cuda.core.utils.copy_batch left out: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return None
    return lambda: copy_batch(core_stream, srcs, dsts)
