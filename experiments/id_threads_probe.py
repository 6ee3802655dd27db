"""What the ids of one swap_blocks call cost the CPU at the least, on 1 to 8 threads:
the check (every id in bounds, no destination twice: a bitmap a thread, merged),
the write of both id arrays into a cycling ring of pinned memory by streaming stores
(kvcopy/_cuda/pinned_writes.h), both one after the other, and both fused into one
pass. 32,768 pairs of random ids into pools of 65,536 blocks, the mapping hot in the
cache as an engine's just-built one is, each write at the next ring slot. Median
microseconds of 400 calls per variant, the variants alternating; every variant's
output and verdicts are checked.

The question it settles: whether threads could bring a 32,768-pair call's id work
far enough under the one-call budget (50 µs) to be worth a thread pool in the
library. kvcopy does this work on the calling thread (plan_arrays.block_ids_ok,
then split_block_ids chunk by chunk).

    python3 experiments/id_threads_probe.py          (gcc with OpenMP; pinned memory
                                                      needs a GPU, else pageable)"""

from __future__ import annotations

import ctypes
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

import numpy as np

PAIRS, POOL, RING, CALLS = 32768, 65536, 64 << 20, 400
THREADS = [t for t in (1, 2, 4, 8) if t <= (os.cpu_count() or 1)]
HEADER_DIR = pathlib.Path(__file__).resolve().parents[1] / "kvcopy" / "_cuda"

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "pinned_writes.h"

#define MAX_THREADS 8

/* Thread t of k's pairs [lo, hi). Inner bounds are even, so that each range's ids
 * start 16-byte aligned in both arrays and go out by streaming stores. */
static void thread_range(int64_t n, int t, int k, int64_t* lo, int64_t* hi) {
    *lo = (n * t / k) & ~(int64_t)1;
    *hi = t + 1 == k ? n : (n * (t + 1) / k) & ~(int64_t)1;
}

/* Pairs [lo, hi): bounds, and each destination's bit set in this thread's own bitmap
 * (no atomics: a locked or costs more than the whole rest of a pair's check); the
 * first bad pair, or -1. */
static int64_t check_range(const int64_t* p, int64_t lo, int64_t hi, uint64_t sl,
                           uint64_t dl, uint64_t* bits) {
    for (int64_t i = lo; i < hi; ++i) {
        uint64_t s = (uint64_t)p[2 * i], d = (uint64_t)p[2 * i + 1];
        if (s >= sl || d >= dl) return i;
        uint64_t bit = 1ull << (d & 63);
        if (bits[d >> 6] & bit) return i;
        bits[d >> 6] |= bit;
    }
    return -1;
}

/* After every thread's pass: a destination in two threads' bitmaps is a repeat across
 * their ranges. Each thread merges a slice of the words; true where one is found. */
static int repeats_across(uint64_t* bits, int64_t words, int t, int k) {
    int found = 0;
    for (int64_t w = words * t / k; w < words * (t + 1) / k; ++w) {
        uint64_t seen = 0;
        for (int j = 0; j < k; ++j) {
            uint64_t b = bits[(int64_t)j * words + w];
            found |= (seen & b) != 0;
            seen |= b;
        }
    }
    return found;
}

/* -1: all good; a pair's index: the first bad pair in a range; -2: a repeat across
 * ranges (the caller's sequential check then names the pair). */
static int64_t id_pass(const int64_t* p, int64_t n, uint64_t sl, uint64_t dl,
                       uint64_t* bits, int64_t* src, int64_t* dst, int threads) {
    int64_t words = (int64_t)((dl + 63) / 64), bad = -1;
    int across = 0;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    #pragma omp parallel num_threads(threads) reduction(|:across)
    {
        int t = omp_get_thread_num(), k = omp_get_num_threads();
        int64_t lo, hi;
        thread_range(n, t, k, &lo, &hi);
        uint64_t* mine = bits + (int64_t)t * words;
        memset(mine, 0, 8 * (size_t)words);
        /* in slices of 1,024 pairs: written (when asked) while still in the cache */
        for (int64_t a = lo; a < hi; a += 1024) {
            int64_t b = a + 1024 < hi ? a + 1024 : hi;
            int64_t r = check_range(p, a, b, sl, dl, mine);
            if (r >= 0) {
                #pragma omp critical
                if (bad < 0 || r < bad) bad = r;
                break;
            }
            if (src) kvcopy_split_pairs(p + 2 * a, src + a, dst + a, b - a);
        }
        #pragma omp barrier
        if (k > 1) across |= repeats_across(bits, words, t, k);
    }
    return bad >= 0 ? bad : across ? -2 : -1;
}

int64_t check(const int64_t* p, int64_t n, uint64_t sl, uint64_t dl, uint64_t* bits,
              int threads) {
    return id_pass(p, n, sl, dl, bits, 0, 0, threads);
}

int64_t fused(const int64_t* p, int64_t n, uint64_t sl, uint64_t dl, uint64_t* bits,
              int64_t* src, int64_t* dst, int threads) {
    return id_pass(p, n, sl, dl, bits, src, dst, threads);
}

void split(const int64_t* p, int64_t n, int64_t* src, int64_t* dst, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), k = omp_get_num_threads();
        int64_t lo, hi;
        thread_range(n, t, k, &lo, &hi);
        kvcopy_split_pairs(p + 2 * lo, src + lo, dst + lo, hi - lo);
    }
}
"""


def build() -> ctypes.CDLL:
    """The C above as a shared library (gcc -O3 -fopenmp)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvcopy-id-threads-"))
    (folder / "ids.c").write_text(SOURCE)
    subprocess.run(
        [
            "gcc",
            "-O3",
            "-march=native",
            "-fopenmp",
            "-shared",
            "-fPIC",
            f"-I{HEADER_DIR}",
            str(folder / "ids.c"),
            "-o",
            str(folder / "ids.so"),
        ],
        check=True,
    )
    lib = ctypes.CDLL(str(folder / "ids.so"))
    i64, u64, ptr, c_int = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
    lib.check.argtypes = [ptr, i64, u64, u64, ptr, c_int]
    lib.check.restype = i64
    lib.split.argtypes = [ptr, i64, ptr, ptr, c_int]
    lib.split.restype = None
    lib.fused.argtypes = [ptr, i64, u64, u64, ptr, ptr, ptr, c_int]
    lib.fused.restype = i64
    return lib


def ring_memory() -> tuple[np.ndarray, str]:
    """The ring: pinned where a GPU is present (as kvcopy's rings are), else pageable."""
    try:
        import kvcopy

        return kvcopy.pinned_empty(RING, dtype=np.uint8), "pinned"
    except Exception as exc:  # no driver or no GPU: the CPU-side figures still hold
        print(f"(no pinned memory: {type(exc).__name__}; pageable ring)")
        return np.zeros(RING, dtype=np.uint8), "pageable"


def main() -> None:
    lib = build()
    ring, kind = ring_memory()
    rng = np.random.default_rng(1)
    mapping = np.ascontiguousarray(
        np.stack([rng.permutation(POOL)[:PAIRS], rng.permutation(POOL)[:PAIRS]], axis=1)
    )
    bits = np.zeros(max(THREADS) * POOL // 64, dtype=np.uint64)  # a bitmap a thread
    nbytes, offset = 16 * PAIRS, 0

    def slot() -> tuple[int, int]:
        nonlocal offset
        offset = (offset + nbytes) % (RING - nbytes)
        base = ring.ctypes.data + offset
        return base, base + 8 * PAIRS

    m, b = mapping.ctypes.data, bits.ctypes.data

    def check(t: int) -> int:
        return lib.check(m, PAIRS, POOL, POOL, b, t)

    def write(t: int) -> int:
        lib.split(m, PAIRS, *slot(), t)
        return -1

    def both(t: int) -> int:
        bad = lib.check(m, PAIRS, POOL, POOL, b, t)
        lib.split(m, PAIRS, *slot(), t)
        return bad

    def fused(t: int) -> int:
        return lib.fused(m, PAIRS, POOL, POOL, b, *slot(), t)

    variants = {"check": check, "write": write, "check, then write": both, "fused": fused}
    verify(lib, mapping, bits, ring)
    print(f"{PAIRS} pairs, pools of {POOL} blocks, {kind} ring; median (least) µs of {CALLS}")
    for threads in THREADS:
        spent: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(CALLS):
            for name, run in variants.items():
                start = time.perf_counter()
                bad = run(threads)
                spent[name].append(time.perf_counter() - start)
                assert bad == -1, (name, threads, bad)
        row = "  ".join(
            f"{name} {statistics.median(v) * 1e6:6.1f} ({min(v) * 1e6:5.1f})" for name, v in spent.items()
        )
        print(f"threads {threads}:  {row}")


def verify(lib: ctypes.CDLL, mapping: np.ndarray, bits: np.ndarray, ring: np.ndarray) -> None:
    """Every variant writes the ids exactly and finds a repeated and an out-of-range id."""
    m, b = mapping.ctypes.data, bits.ctypes.data
    src, dst = ring.ctypes.data, ring.ctypes.data + 8 * PAIRS
    written = np.frombuffer(ring[: 16 * PAIRS].data, dtype=np.int64)
    bad_at = PAIRS * 3 // 4
    for threads in THREADS:
        for run in (
            lambda: lib.split(m, PAIRS, src, dst, threads),
            lambda: lib.fused(m, PAIRS, POOL, POOL, b, src, dst, threads),
        ):
            written[:] = -7
            run()
            assert (written[:PAIRS] == mapping[:, 0]).all(), threads
            assert (written[PAIRS:] == mapping[:, 1]).all(), threads
        twice, outside = mapping.copy(), mapping.copy()
        twice[bad_at, 1] = twice[5, 1]
        outside[bad_at, 0] = POOL
        # (a repeat across two threads' ranges is reported as -2)
        for case, found in ((twice, {bad_at} if threads == 1 else {bad_at, -2}), (outside, {bad_at})):
            c = case.ctypes.data
            assert lib.check(c, PAIRS, POOL, POOL, b, threads) in found, threads
            assert lib.fused(c, PAIRS, POOL, POOL, b, src, dst, threads) in found, threads


if __name__ == "__main__":
    main()
