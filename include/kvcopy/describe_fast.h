/* The describe pass's fast path (host code, used by kvcopy/_driver.pyx).
 *
 * Most batches have every copy inside one allocation per side, no copy
 * longer than a tile, none empty, none continuing the previous one. For those
 * the general loop (validate, merge, classify each pointer) reduces to range
 * checks, which this loop does without branches so that the compiler
 * vectorises it. 64-bit unsigned compares need AVX2 on x86-64 (the SSE2
 * version is slower than the general loop), so there it is built for AVX2 and
 * used only on CPUs that have it.
 */
#ifndef KVCOPY_DESCRIBE_FAST_H
#define KVCOPY_DESCRIBE_FAST_H

#include <stdint.h>
#include "descriptor.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVCOPY_FAST_TARGET __attribute__((target("avx2")))
static inline int kvcopy_fast_describe_available(void) { return __builtin_cpu_supports("avx2"); }
#elif defined(__aarch64__)
#define KVCOPY_FAST_TARGET
static inline int kvcopy_fast_describe_available(void) { return 1; }
#else
#define KVCOPY_FAST_TARGET
static inline int kvcopy_fast_describe_available(void) { return 0; }
#endif

/* Bits of kvcopy_describe_in_ranges' answer. */
#define KVCOPY_FAST_MISFIT 1u   /* a copy is empty, too long, or outside its side's range */
#define KVCOPY_FAST_MERGES 2u   /* a copy continues the previous one on both sides */

/* Writes descriptor i for copy i (device views: pointer + delta; tile_start = i)
 * for all n copies and *total_out = their bytes, and says whether the batch
 * qualified: 0, or KVCOPY_FAST_* bits (the descriptors are then to be
 * rewritten by the general loop). A side's range is [start, start + span]. */
KVCOPY_FAST_TARGET
static unsigned kvcopy_describe_in_ranges(const uint64_t* __restrict src,
                                          const uint64_t* __restrict dst,
                                          const uint64_t* __restrict sizes, void* descs_out,
                                          int64_t n, uint64_t src_start, uint64_t src_span,
                                          int64_t src_delta, uint64_t dst_start, uint64_t dst_span,
                                          int64_t dst_delta, uint64_t* total_out) {
    kvcopy_desc* __restrict d = (kvcopy_desc*)descs_out;
    uint64_t misfit = 0, merges = 0, total = 0;
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t s = src[i], t = dst[i], z = sizes[i];
        const uint64_t s_end = s + z, t_end = t + z;
        /* unsigned wrap-around folds "below start" into "above span" */
        misfit |= (uint64_t)((s - src_start) > src_span) | (uint64_t)((s_end - src_start) > src_span)
                | (uint64_t)((t - dst_start) > dst_span) | (uint64_t)((t_end - dst_start) > dst_span)
                | (uint64_t)(s_end <= s) | (uint64_t)(z > KVCOPY_TILE_BYTES);
        total += z;
        d[i].src = s + (uint64_t)src_delta;
        d[i].dst = t + (uint64_t)dst_delta;
        d[i].size = z;
        d[i].tile_start = (uint64_t)i;
    }
    for (int64_t i = 1; i < n; ++i) {
        merges |= (uint64_t)(src[i] == src[i - 1] + sizes[i - 1])
                & (uint64_t)(dst[i] == dst[i - 1] + sizes[i - 1]);
    }
    *total_out = total;
    return (misfit ? KVCOPY_FAST_MISFIT : 0u) | (merges ? KVCOPY_FAST_MERGES : 0u);
}

#endif /* KVCOPY_DESCRIBE_FAST_H */
