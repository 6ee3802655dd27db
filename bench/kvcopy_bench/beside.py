"""Compute beside copies: a full-GPU bf16 matmul loop alone and beside continuous
16 KiB block copies, in alternating pairs (clocks drift by more than the effect
between runs, so only per-pair ratios mean anything); and a serving step, the
matmul loop beside a store and a load at once.

Copies are enqueued by a thread of their own for as long as a window lasts, so
batched DMA's CPU cost limits it as it would in an engine. Each matmul window
waits behind a sleep kernel on its stream while it is enqueued, so that the
Python thread's turns never leave the compute stream idle.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, cast

import kvcopy
from kvcopy import testing
from kvcopy_bench.scenarios import Pools
from kvcopy.policy import RequestedMethod

KiB, MiB = 1 << 10, 1 << 20
_GATE_CYCLES = 40_000_000  # ~20 ms at 2 GHz: the copies are flowing when the window opens


@dataclass
class Copier:
    """One kind of copy call and the torch stream its work lands on."""

    name: str
    call: Callable[[], object]
    stream: Any
    nbytes: int


class CopyLoop:
    """Calls every copier in turn from a thread until stopped; GB/s per copier from
    CUDA events around all of its calls."""

    def __init__(self, copiers: list[Copier]) -> None:
        import torch

        self.copiers = copiers
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._events = {
            c.name: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for c in copiers
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            for copier in self.copiers:
                copier.call()
            self.rounds += 1

    def __enter__(self) -> "CopyLoop":
        for copier in self.copiers:
            self._events[copier.name][0].record(copier.stream)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for copier in self.copiers:
            self._events[copier.name][1].record(copier.stream)

    def gbps(self) -> dict[str, float]:
        out = {}
        for copier in self.copiers:
            start, end = self._events[copier.name]
            end.synchronize()
            out[copier.name] = self.rounds * copier.nbytes / start.elapsed_time(end) / 1e6
        return out


class Matmuls:
    """A window of full-GPU bf16 matmuls on a stream of their own, timed by events."""

    def __init__(self, n: int = 8192, reps: int = 8) -> None:
        import torch

        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.stream = torch.cuda.Stream()
        self.reps = reps
        for _ in range(3):
            self.window_ms()

    def window_ms(self, beside: list[Copier] | None = None) -> tuple[float, dict]:
        """GPU time of one window, alone or beside the copiers; and their GB/s.

        The window (a sleep, then the timed matmuls) is enqueued before the copies
        start, so that no driver call of the copy thread can delay its launches."""
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(_GATE_CYCLES)
            start.record()
            for _ in range(self.reps):
                torch.matmul(self.a, self.b)
            end.record()
        if beside is None:
            end.synchronize()
            return start.elapsed_time(end), {}
        with CopyLoop(beside) as loop:
            end.synchronize()
        gbps = loop.gbps()
        torch.cuda.synchronize()
        return start.elapsed_time(end), gbps


def _spread(ratios: list[float]) -> dict:
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "median_slowdown": statistics.median(ratios),
        "p25_slowdown": q[0],
        "p75_slowdown": q[2],
        "min_slowdown": min(ratios),
        "max_slowdown": max(ratios),
    }


def paired(matmuls: Matmuls, copiers: list[Copier], pairs: int) -> tuple[dict, dict, float]:
    """Alone and beside windows in alternation: slowdown spread, median GB/s per
    copier, median alone time."""
    ratios: list[float] = []
    alone: list[float] = []
    rates: dict[str, list[float]] = {c.name: [] for c in copiers}
    for _ in range(pairs):
        t_alone, _ = matmuls.window_ms()
        t_beside, gbps = matmuls.window_ms(copiers)
        ratios.append(t_beside / t_alone - 1)
        alone.append(t_alone)
        for name, value in gbps.items():
            rates[name].append(value)
    return (_spread(ratios), {k: statistics.median(v) for k, v in rates.items()}, statistics.median(alone))


COMPUTE_VARIANTS: list[tuple[str, dict]] = [
    ("batch", {"method": "batch"}),
    ("kernel", {"method": "kernel"}),
    ("kernel, registers", {"method": "kernel", "bulk_stores": False}),
    ("kernel 1 CTA", {"method": "kernel", "max_ctas": 1}),
    ("auto, stores_by_dma", {"stores_by_dma": True}),
]


@contextlib.contextmanager
def settings(options: dict) -> Iterator[dict]:
    """The copy_batch options among ``options``; the others, kvcopy.config settings by
    name, are applied meanwhile and restored after."""
    names = vars(kvcopy.config)
    with testing.settings(**{k: v for k, v in options.items() if k in names}):
        yield {k: v for k, v in options.items() if k not in names}


def compute_beside(
    pairs: int = 20,
    block: int = 16 * KiB,
    total: int = 64 * MiB,
    direction: str = "h2d",
    variants: list[tuple[str, dict]] | None = None,
) -> Iterator[dict]:
    """The matmul window alone and beside continuous copies one way, per variant
    (label, copy_batch options); 'kernel' is the default footprint."""
    import torch

    matmuls = Matmuls()
    pools = Pools(direction, total, "torch")
    ptrs = pools.scattered(block, total // block, 3)
    stream = torch.cuda.Stream()
    for label, options in variants or COMPUTE_VARIANTS:
        with settings(options) as copy_options:

            def call(options: dict = copy_options) -> object:
                return kvcopy.copy_batch(*ptrs, stream=stream, **options)

            spread, gbps, alone_ms = paired(matmuls, [Copier(direction, call, stream, total)], pairs)
        yield {
            "scenario": "compute_beside",
            "direction": direction,
            "method": label,
            "block_bytes": block,
            "pairs": pairs,
            **spread,
            "alone_ms": alone_ms,
            "copy_gbps": gbps[direction],
        }


# The settings of the rows labelled 'each call alone': the traffic window off, so that a
# copy one way is decided without the other way's.
EACH_CALL_ALONE = {"traffic_window_ms": 0}
SERVING_METHODS = (
    "auto",
    "auto, each call alone",
    "kernel",
    "batch",
    "copy_both_ways",
    "auto, stores_by_dma",
)


def _settings_of(method: str) -> dict:
    """The config settings a serving_step row runs under ('each call alone': the
    traffic window off)."""
    if method.endswith("stores_by_dma"):
        return {"stores_by_dma": True}
    if method.endswith("each call alone"):
        return EACH_CALL_ALONE
    return {}


def serving_step(pairs: int = 10, block: int = 16 * KiB, total: int = 64 * MiB) -> Iterator[dict]:
    """A matmul loop while a store (GPU to host) and a load (host to GPU) of ``block``
    bytes each run on two other streams (or together on one, copy_both_ways)."""
    import torch

    matmuls = Matmuls()
    store_pools, load_pools = Pools("d2h", total, "torch"), Pools("h2d", total, "torch")
    count = total // block
    store, load = store_pools.scattered(block, count, 5), load_pools.scattered(block, count, 6)
    s_store, s_load = torch.cuda.Stream(), torch.cuda.Stream()
    for method in SERVING_METHODS:
        with settings(_settings_of(method)):
            if method == "copy_both_ways":
                both = Copier(
                    "store+load",
                    functools.partial(kvcopy.copy_both_ways, store, load, stream=s_store),
                    s_store,
                    2 * total,
                )
                spread, gbps, alone_ms = paired(matmuls, [both], pairs)
                gbps = {"store": gbps["store+load"] / 2, "load": gbps["store+load"] / 2}
            else:
                requested = cast(RequestedMethod, method.split(",")[0])
                copiers = [
                    Copier(
                        name,
                        functools.partial(kvcopy.copy_batch, *batch, stream=stream, method=requested),
                        stream,
                        total,
                    )
                    for name, batch, stream in (("store", store, s_store), ("load", load, s_load))
                ]
                spread, gbps, alone_ms = paired(matmuls, copiers, pairs)
        yield {
            "scenario": "serving_step",
            "method": method,
            "block_bytes": block,
            "pairs": pairs,
            "store_gbps": gbps["store"],
            "load_gbps": gbps["load"],
            **spread,
            "alone_ms": alone_ms,
        }
