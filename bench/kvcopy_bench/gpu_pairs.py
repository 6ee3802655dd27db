"""Copies between two GPUs: scattered blocks one way (each direction) and both ways
at once, against the contiguous peer copy measured in the same run."""

from __future__ import annotations

import functools
from typing import Iterator

import numpy as np

import kvcopy
from kvcopy_bench.scenarios import scattered_offsets
from kvcopy_bench.timing import measure, span_ms
from kvcopy.policy import RequestedMethod

KiB, MiB = 1 << 10, 1 << 20
METHODS: tuple[RequestedMethod, ...] = ("auto", "kernel", "batch")


def gpu_pair_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


class _Batch:
    """``count`` blocks at random slots of a pool on GPU a, to random slots of a pool
    on GPU b (each pool twice the batch)."""

    def __init__(self, a: int, b: int, block: int, total: int, seed: int) -> None:
        import torch

        self.count = max(total // block, 1)
        self.nbytes = self.count * block
        self.src = torch.empty(2 * self.nbytes, dtype=torch.uint8, device=f"cuda:{a}")
        self.dst = torch.empty(2 * self.nbytes, dtype=torch.uint8, device=f"cuda:{b}")
        self.src.random_(0, 255)
        src_off, dst_off = scattered_offsets(self.count, block, np.random.default_rng(seed))
        self.args = (
            np.uint64(self.src.data_ptr()) + src_off.astype(np.uint64),
            np.uint64(self.dst.data_ptr()) + dst_off.astype(np.uint64),
            np.full(self.count, block, dtype=np.uint64),
        )
        self.stream = torch.cuda.Stream(device=a)  # tensors' copies run on the source GPU

    def contiguous(self) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            self.dst[: self.nbytes].copy_(self.src[: self.nbytes], non_blocking=True)

    def kvcopy(self, method: RequestedMethod) -> functools.partial:
        return functools.partial(kvcopy.copy_batch, *self.args, stream=self.stream, method=method)


def peer_rows(blocks: list[int], total: int = 128 * MiB, repeats: int = 7) -> Iterator[dict]:
    """GB/s (GPU time) of GPU0->GPU1 and GPU1->GPU0 block copies by kvcopy's methods,
    the contiguous peer copy of the same bytes, and both directions at once."""
    for block in blocks:
        pair = {(a, b): _Batch(a, b, block, total, seed=block + a) for a, b in ((0, 1), (1, 0))}
        ceilings = {}
        for (a, b), batch in pair.items():
            t = measure(batch.contiguous, batch.stream, repeats=repeats)
            ceilings[(a, b)] = batch.nbytes / (t.gpu_ms * 1e6)
            yield _row(
                f"{a}>{b}",
                block,
                batch.count,
                "contiguous",
                "",
                ceilings[(a, b)],
                1.0,
                batch.nbytes / (t.wall_ms * 1e6),
                t.cpu_us,
            )
            for method in METHODS:
                chose = batch.kvcopy(method)()
                t = measure(batch.kvcopy(method), batch.stream, repeats=repeats)
                gbps = batch.nbytes / (t.gpu_ms * 1e6)
                yield _row(
                    f"{a}>{b}",
                    block,
                    batch.count,
                    method,
                    chose,
                    gbps,
                    gbps / ceilings[(a, b)],
                    batch.nbytes / (t.wall_ms * 1e6),
                    t.cpu_us,
                )
        one, other = pair[(0, 1)], pair[(1, 0)]
        both_bytes = one.nbytes + other.nbytes

        def contiguous_pair() -> None:
            one.contiguous()
            other.contiguous()

        ceiling = both_bytes / (span_ms(contiguous_pair, one.stream, other.stream, repeats=repeats) * 1e6)
        yield _row("both", block, one.count, "contiguous", "", ceiling, 1.0, 0.0, 0.0)
        for method in METHODS:
            ms = span_ms(
                lambda: (one.kvcopy(method)(), other.kvcopy(method)()),
                one.stream,
                other.stream,
                repeats=repeats,
            )
            gbps = both_bytes / (ms * 1e6)
            yield _row("both", block, one.count, method, one.kvcopy(method)(), gbps, gbps / ceiling, 0.0, 0.0)


def _row(
    direction: str,
    block: int,
    count: int,
    method: str,
    chose: str,
    gbps: float,
    fraction: float,
    wall_gbps: float,
    cpu_us: float,
) -> dict:
    return {
        "scenario": "peer",
        "direction": direction,
        "block_bytes": block,
        "count": count,
        "method": method,
        "chose": chose,
        "gbps": gbps,
        "fraction_of_ceiling": fraction,
        "wall_gbps": wall_gbps,
        "cpu_us": cpu_us,
    }
