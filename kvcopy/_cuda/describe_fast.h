/* The describe pass's fast path (host code, used by kvcopy/_cuda/describe.pyx).
 *
 * Most batches have every copy inside one allocation per side, no copy
 * longer than a tile, none empty. For those the general loop (validate, merge,
 * classify each pointer) reduces to range checks, which this loop does without
 * branches so that the compiler vectorises it (by hand on x86-64, where 64-bit
 * compares need AVX2 and the descriptors go out with streaming stores; the SSE2
 * version would be slower than the general loop, so CPUs without AVX2 keep to
 * the latter).
 */
#ifndef KVCOPY_DESCRIBE_FAST_H
#define KVCOPY_DESCRIBE_FAST_H

#include <stdint.h>
#include "kvcopy/descriptor.h"

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
#define KVCOPY_FAST_MISFIT 1u /* a copy is empty, too long, or outside its side's range */
#define KVCOPY_FAST_MERGES 2u /* a copy continues the previous one on both sides */
#define KVCOPY_FAST_SIZES 4u  /* not every copy has the first one's size */

/* What the fast passes learn of each side besides the entries: how many copies
 * continue the one before on the source and on the destination side (a batch's
 * spans per side are its copies less these), and the largest copy: exact where every
 * copy has one size, else the whole number of tiles every copy kept within (a
 * maximum per copy cost the vector loop a tenth of its time; the bound answers what
 * is asked of it: whether copies fit a tile, or a staging chunk). */
typedef struct {
    uint64_t src_runs, dst_runs, largest;
} kvcopy_sides;

/* Per-copy checks of the scalar pass; also the reference for the AVX2 one. */
static inline uint64_t kvcopy_fast_misfit(uint64_t s, uint64_t t, uint64_t z, uint64_t src_start,
                                          uint64_t src_span, uint64_t dst_start, uint64_t dst_span,
                                          uint64_t max_size) {
    const uint64_t s_end = s + z, t_end = t + z;
    /* unsigned wrap-around folds "below start" into "above span" */
    return (uint64_t)((s - src_start) > src_span) | (uint64_t)((s_end - src_start) > src_span) |
           (uint64_t)((t - dst_start) > dst_span) | (uint64_t)((t_end - dst_start) > dst_span) |
           (uint64_t)(s_end <= s) | (uint64_t)(t_end <= t) | (uint64_t)(z > max_size);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

/* a > b for unsigned 64-bit lanes (AVX2 compares are signed). */
KVCOPY_FAST_TARGET static inline __m256i kvcopy_gt_u64(__m256i a, __m256i b) {
    const __m256i sign = _mm256_set1_epi64x((long long)0x8000000000000000ULL);
    return _mm256_cmpgt_epi64(_mm256_xor_si256(a, sign), _mm256_xor_si256(b, sign));
}

/* The lanes' continuations (each lane's count negated), into *sides. */
KVCOPY_FAST_TARGET static inline void kvcopy_sides_add(kvcopy_sides* sides, __m256i s_runs,
                                                       __m256i t_runs) {
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i*)lanes, s_runs);
    sides->src_runs -= lanes[0] + lanes[1] + lanes[2] + lanes[3];
    _mm256_storeu_si256((__m256i*)lanes, t_runs);
    sides->dst_runs -= lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

/* Copies i..i+3 of a batch, and the ones before each (i >= 1). */
typedef struct {
    __m256i s, t, z;    /* source, destination, size */
    __m256i ps, pt, pz; /* of copies i-1..i+2 */
} kvcopy_four;

KVCOPY_FAST_TARGET static inline kvcopy_four kvcopy_four_at(const uint64_t* src,
                                                            const uint64_t* dst,
                                                            const uint64_t* sizes, int64_t i) {
    kvcopy_four f;
    f.s = _mm256_loadu_si256((const __m256i*)(src + i));
    f.t = _mm256_loadu_si256((const __m256i*)(dst + i));
    f.z = _mm256_loadu_si256((const __m256i*)(sizes + i));
    f.ps = _mm256_loadu_si256((const __m256i*)(src + i - 1));
    f.pt = _mm256_loadu_si256((const __m256i*)(dst + i - 1));
    f.pz = _mm256_loadu_si256((const __m256i*)(sizes + i - 1));
    return f;
}

/* One 32-byte store: streaming (aligned ``at`` only) or plain. */
KVCOPY_FAST_TARGET static inline void kvcopy_put(__m256i* at, __m256i v, int stream) {
    if (stream)
        _mm256_stream_si256(at, v);
    else
        _mm256_storeu_si256(at, v);
}

/* Copies [first, n) four at a time; returns the first copy not done. Writes
 * kvcopy_desc entries to out, or kvcopy_compact_desc entries with ``compact``. They go
 * out with streaming stores when the first one written is 32-byte aligned:
 * they are for the GPU, and writing them around the cache spares the CPU the
 * reads for ownership of lines the device has just snooped. */
KVCOPY_FAST_TARGET
static int64_t kvcopy_describe_avx2(const uint64_t* __restrict src, const uint64_t* __restrict dst,
                                    const uint64_t* __restrict sizes, void* entries, int compact,
                                    uint64_t tiles_per_copy, int64_t first, int64_t n,
                                    uint64_t src_start, uint64_t src_span, int64_t src_delta,
                                    uint64_t dst_start, uint64_t dst_span, int64_t dst_delta,
                                    uint64_t* misfit_io, uint64_t* merges_io, uint64_t* sizes_io,
                                    uint64_t* total_io, kvcopy_sides* sides_io) {
    const __m256i s_start = _mm256_set1_epi64x((long long)src_start);
    const __m256i s_span = _mm256_set1_epi64x((long long)src_span);
    const __m256i t_start = _mm256_set1_epi64x((long long)dst_start);
    const __m256i t_span = _mm256_set1_epi64x((long long)dst_span);
    const __m256i s_delta = _mm256_set1_epi64x((long long)src_delta);
    const __m256i t_delta = _mm256_set1_epi64x((long long)dst_delta);
    const __m256i tile = _mm256_set1_epi64x((long long)(tiles_per_copy * KVCOPY_TILE_BYTES));
    const __m256i zero = _mm256_setzero_si256();
    const __m256i four = _mm256_set1_epi64x((long long)(4 * tiles_per_copy));
    const __m256i size0 = _mm256_set1_epi64x((long long)sizes[0]);
    kvcopy_desc* d = (kvcopy_desc*)entries; /* one of the two is written */
    kvcopy_compact_desc* p = (kvcopy_compact_desc*)entries;
    const int stream = ((uintptr_t)(compact ? (void*)(p + first) : (void*)(d + first)) & 31u) == 0;
    const uint64_t k = tiles_per_copy; /* copy i's first tile is i * k */
    __m256i index = _mm256_setr_epi64x((long long)(first * k), (long long)((first + 1) * k),
                                       (long long)((first + 2) * k), (long long)((first + 3) * k));
    __m256i misfit = zero, merges = zero, differ = zero, total = zero;
    __m256i s_runs = zero, t_runs = zero; /* continuations, each lane's negated */
    int64_t i = first;
    for (; i + 4 <= n; i += 4) {
        const kvcopy_four f = kvcopy_four_at(src, dst, sizes, i); /* (first >= 1) */
        const __m256i s = f.s, t = f.t, z = f.z, ps = f.ps, pt = f.pt, pz = f.pz;
        const __m256i s_end = _mm256_add_epi64(s, z), t_end = _mm256_add_epi64(t, z);
        misfit = _mm256_or_si256(misfit, kvcopy_gt_u64(_mm256_sub_epi64(s, s_start), s_span));
        misfit = _mm256_or_si256(misfit, kvcopy_gt_u64(_mm256_sub_epi64(s_end, s_start), s_span));
        misfit = _mm256_or_si256(misfit, kvcopy_gt_u64(_mm256_sub_epi64(t, t_start), t_span));
        misfit = _mm256_or_si256(misfit, kvcopy_gt_u64(_mm256_sub_epi64(t_end, t_start), t_span));
        misfit = _mm256_or_si256(misfit, kvcopy_gt_u64(s, s_end));
        misfit = _mm256_or_si256(misfit, kvcopy_gt_u64(t, t_end));
        misfit = _mm256_or_si256(misfit, _mm256_cmpeq_epi64(z, zero));
        misfit = _mm256_or_si256(misfit, kvcopy_gt_u64(z, tile));
        const __m256i s_on = _mm256_cmpeq_epi64(s, _mm256_add_epi64(ps, pz));
        const __m256i t_on = _mm256_cmpeq_epi64(t, _mm256_add_epi64(pt, pz));
        merges = _mm256_or_si256(merges, _mm256_and_si256(s_on, t_on));
        s_runs = _mm256_add_epi64(s_runs, s_on); /* (a true lane is -1) */
        t_runs = _mm256_add_epi64(t_runs, t_on);
        total = _mm256_add_epi64(total, z);
        differ = _mm256_or_si256(differ, _mm256_xor_si256(f.z, size0));
        const __m256i a = _mm256_add_epi64(s, s_delta), b = _mm256_add_epi64(t, t_delta);
        const __m256i ab_lo = _mm256_unpacklo_epi64(a, b), ab_hi = _mm256_unpackhi_epi64(a, b);
        if (compact) {
            /* four pairs {src, dst}: [a0 b0 a1 b1], [a2 b2 a3 b3] */
            const __m256i p0 = _mm256_permute2x128_si256(ab_lo, ab_hi, 0x20);
            const __m256i p1 = _mm256_permute2x128_si256(ab_lo, ab_hi, 0x31);
            __m256i* po = (__m256i*)(p + i);
            kvcopy_put(po, p0, stream);
            kvcopy_put(po + 1, p1, stream);
            index = _mm256_add_epi64(index, four);
            continue;
        }
        /* four descriptors {src, dst, size, tile_start}: a 4x4 transpose */
        const __m256i cd_lo = _mm256_unpacklo_epi64(z, index),
                      cd_hi = _mm256_unpackhi_epi64(z, index);
        const __m256i d0 = _mm256_permute2x128_si256(ab_lo, cd_lo, 0x20);
        const __m256i d1 = _mm256_permute2x128_si256(ab_hi, cd_hi, 0x20);
        const __m256i d2 = _mm256_permute2x128_si256(ab_lo, cd_lo, 0x31);
        const __m256i d3 = _mm256_permute2x128_si256(ab_hi, cd_hi, 0x31);
        __m256i* out = (__m256i*)(d + i);
        kvcopy_put(out, d0, stream);
        kvcopy_put(out + 1, d1, stream);
        kvcopy_put(out + 2, d2, stream);
        kvcopy_put(out + 3, d3, stream);
        index = _mm256_add_epi64(index, four);
    }
    if (stream) _mm_sfence(); /* streaming stores are weakly ordered */
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i*)lanes, misfit);
    *misfit_io |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
    _mm256_storeu_si256((__m256i*)lanes, merges);
    *merges_io |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
    _mm256_storeu_si256((__m256i*)lanes, differ);
    *sizes_io |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
    _mm256_storeu_si256((__m256i*)lanes, total);
    *total_io += lanes[0] + lanes[1] + lanes[2] + lanes[3];
    kvcopy_sides_add(sides_io, s_runs, t_runs);
    return i;
}

/* Pairs for copies [first, n), four at a time, where every copy may have the size
 * z0 (one tile or less, checked by the caller); returns the first copy not done.
 * With one size the range checks need no end: a copy starting at most z0 before
 * its range's end ends inside it, so each side is one compare against
 * ``*_limit`` = span - z0, and a merge is a difference of z0. Half the work of
 * kvcopy_describe_avx2 per copy (a Xeon, 32,768 copies: 30 against 47 us). Its
 * answers hold only where *sizes_io stays 0: a copy of another size may run past its
 * range's end unseen, so the caller then describes the copies again. */
KVCOPY_FAST_TARGET
static int64_t kvcopy_compact_one_size_avx2(
    const uint64_t* __restrict src, const uint64_t* __restrict dst,
    const uint64_t* __restrict sizes, kvcopy_compact_desc* __restrict p, int64_t first, int64_t n,
    uint64_t z0, uint64_t src_start, uint64_t src_limit, int64_t src_delta, uint64_t dst_start,
    uint64_t dst_limit, int64_t dst_delta, uint64_t* misfit_io, uint64_t* merges_io,
    uint64_t* sizes_io, kvcopy_sides* sides_io) {
    const uint64_t sign_bit = 0x8000000000000000ULL;
    const __m256i sign = _mm256_set1_epi64x((long long)sign_bit);
    const __m256i s_start = _mm256_set1_epi64x((long long)src_start);
    const __m256i t_start = _mm256_set1_epi64x((long long)dst_start);
    /* limits with the sign flipped once: AVX2 compares are signed */
    const __m256i s_limit = _mm256_set1_epi64x((long long)(src_limit ^ sign_bit));
    const __m256i t_limit = _mm256_set1_epi64x((long long)(dst_limit ^ sign_bit));
    const __m256i s_delta = _mm256_set1_epi64x((long long)src_delta);
    const __m256i t_delta = _mm256_set1_epi64x((long long)dst_delta);
    const __m256i size0 = _mm256_set1_epi64x((long long)z0);
    __m256i misfit = _mm256_setzero_si256(), merges = misfit, differ = misfit;
    __m256i s_runs = misfit, t_runs = misfit; /* continuations, negated */
    const int stream = ((uintptr_t)(p + first) & 31u) == 0;
    int64_t i = first;
    for (; i + 4 <= n; i += 4) {
        const kvcopy_four f = kvcopy_four_at(src, dst, sizes, i); /* (first >= 1) */
        const __m256i s = f.s, t = f.t; /* (a size other than z0 sets differ) */
        misfit = _mm256_or_si256(
            misfit,
            _mm256_cmpgt_epi64(_mm256_xor_si256(_mm256_sub_epi64(s, s_start), sign), s_limit));
        misfit = _mm256_or_si256(
            misfit,
            _mm256_cmpgt_epi64(_mm256_xor_si256(_mm256_sub_epi64(t, t_start), sign), t_limit));
        differ = _mm256_or_si256(differ, _mm256_xor_si256(f.z, size0));
        const __m256i s_on = _mm256_cmpeq_epi64(_mm256_sub_epi64(s, f.ps), size0);
        const __m256i t_on = _mm256_cmpeq_epi64(_mm256_sub_epi64(t, f.pt), size0);
        merges = _mm256_or_si256(merges, _mm256_and_si256(s_on, t_on));
        s_runs = _mm256_add_epi64(s_runs, s_on);
        t_runs = _mm256_add_epi64(t_runs, t_on);
        const __m256i a = _mm256_add_epi64(s, s_delta), b = _mm256_add_epi64(t, t_delta);
        const __m256i ab_lo = _mm256_unpacklo_epi64(a, b), ab_hi = _mm256_unpackhi_epi64(a, b);
        __m256i* po = (__m256i*)(p + i);
        kvcopy_put(po, _mm256_permute2x128_si256(ab_lo, ab_hi, 0x20), stream);
        kvcopy_put(po + 1, _mm256_permute2x128_si256(ab_lo, ab_hi, 0x31), stream);
    }
    if (stream) _mm_sfence(); /* streaming stores are weakly ordered */
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i*)lanes, misfit);
    *misfit_io |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
    _mm256_storeu_si256((__m256i*)lanes, merges);
    *merges_io |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
    _mm256_storeu_si256((__m256i*)lanes, differ);
    *sizes_io |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
    kvcopy_sides_add(sides_io, s_runs, t_runs);
    return i;
}
#endif

/* One copy's entry, by the scalar loops. */
static inline void kvcopy_write_entry(void* out, int compact, int64_t i, uint64_t s, uint64_t t,
                                      uint64_t z, uint64_t tiles_per_copy) {
    if (compact) {
        kvcopy_compact_desc* p = (kvcopy_compact_desc*)out + i;
        p->src = s;
        p->dst = t;
    } else {
        kvcopy_desc* d = (kvcopy_desc*)out + i;
        d->src = s;
        d->dst = t;
        d->size = z;
        d->tile_start = (uint64_t)i * tiles_per_copy;
    }
}

/* What kvcopy_describe_in_ranges gathers over a batch besides its entries. */
typedef struct {
    uint64_t misfit, merges, differ, total;
    kvcopy_sides sides;
} kvcopy_found;

/* Copies [first, end) one at a time: their checks, entries and what they show, into
 * *f (the head and the tail of the vector loops, and every copy where there is none);
 * returns end. */
static inline int64_t kvcopy_describe_scalar(const uint64_t* src, const uint64_t* dst,
                                             const uint64_t* sizes, void* descs_out, int compact,
                                             uint64_t tiles_per_copy, int64_t first, int64_t end,
                                             uint64_t src_start, uint64_t src_span,
                                             int64_t src_delta, uint64_t dst_start,
                                             uint64_t dst_span, int64_t dst_delta,
                                             uint64_t max_size, kvcopy_found* f) {
    for (int64_t i = first; i < end; ++i) {
        f->misfit |= kvcopy_fast_misfit(src[i], dst[i], sizes[i], src_start, src_span, dst_start,
                                        dst_span, max_size);
        if (i > 0) { /* copy i continues copy i - 1 on each side, on both: merges */
            const uint64_t s_on = src[i] == src[i - 1] + sizes[i - 1];
            const uint64_t t_on = dst[i] == dst[i - 1] + sizes[i - 1];
            f->merges |= s_on & t_on;
            f->sides.src_runs += s_on;
            f->sides.dst_runs += t_on;
        }
        f->differ |= sizes[i] ^ sizes[0];
        f->total += sizes[i];
        kvcopy_write_entry(descs_out, compact, i, src[i] + (uint64_t)src_delta,
                           dst[i] + (uint64_t)dst_delta, sizes[i], tiles_per_copy);
    }
    return end;
}

/* Writes entry i for copy i (device views: pointer + delta) for all n copies,
 * as kvcopy_desc (tile_start = i * tiles_per_copy) or, with ``compact``, as
 * kvcopy_compact_desc, and *total_out = their bytes; says whether the batch qualified:
 * 0, or KVCOPY_FAST_* bits (the entries are then to be rewritten: by the
 * general loop for MISFIT; by kvcopy_describe_merging for MERGES, and for SIZES
 * where tiles_per_copy > 1, since tile_start then counts every copy as that many
 * tiles; as kvcopy_desc for SIZES alone with one tile per copy, which compact entries
 * cannot describe). A copy longer than tiles_per_copy tiles is a MISFIT. A
 * side's range is [start, start + span]. */
KVCOPY_FAST_TARGET
static unsigned kvcopy_describe_in_ranges(const uint64_t* __restrict src,
                                          const uint64_t* __restrict dst,
                                          const uint64_t* __restrict sizes, void* descs_out,
                                          int compact, uint64_t tiles_per_copy, int64_t n,
                                          uint64_t src_start, uint64_t src_span, int64_t src_delta,
                                          uint64_t dst_start, uint64_t dst_span, int64_t dst_delta,
                                          uint64_t* total_out, kvcopy_sides* sides_out) {
    const uint64_t max_size = tiles_per_copy * KVCOPY_TILE_BYTES;
    kvcopy_found f = {0, 0, 0, 0, {0, 0, 0}};
    int64_t i = 0;
    /* copy 0 (and 1, for compact entries: the vector loop's first store is then 32-byte aligned)
     * here, so that the vector loop may always look one copy back */
    const int64_t head = compact ? 2 : 1;
    i = kvcopy_describe_scalar(src, dst, sizes, descs_out, compact, tiles_per_copy, 0,
                               n < head ? n : head, src_start, src_span, src_delta, dst_start,
                               dst_span, dst_delta, max_size, &f);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    const uint64_t z0 = n ? sizes[0] : 0;
    /* (its continuations assume the copy before has size z0: the head's copies too) */
    if (compact && tiles_per_copy == 1 && z0 != 0 && z0 <= max_size && z0 <= src_span &&
        z0 <= dst_span && !f.differ) {
        uint64_t one_misfit = 0, one_merges = 0, one_differ = 0;
        kvcopy_sides one_sides = f.sides;
        const int64_t end = kvcopy_compact_one_size_avx2(
            src, dst, sizes, (kvcopy_compact_desc*)descs_out, i, n, z0, src_start, src_span - z0,
            src_delta, dst_start, dst_span - z0, dst_delta, &one_misfit, &one_merges, &one_differ,
            &one_sides);
        if (!one_differ) { /* else the pass below describes these copies again */
            f.misfit |= one_misfit;
            f.merges |= one_merges;
            f.sides = one_sides;
            f.total += (uint64_t)(end - i) * z0;
            i = end;
        }
    }
    i = kvcopy_describe_avx2(src, dst, sizes, descs_out, compact, tiles_per_copy, i, n, src_start,
                             src_span, src_delta, dst_start, dst_span, dst_delta, &f.misfit,
                             &f.merges, &f.differ, &f.total, &f.sides);
#endif
    kvcopy_describe_scalar(src, dst, sizes, descs_out, compact, tiles_per_copy, i, n, src_start,
                           src_span, src_delta, dst_start, dst_span, dst_delta, max_size, &f);
    *total_out = f.total;
    f.sides.largest = f.differ ? max_size : (n ? sizes[0] : 0);
    *sides_out = f.sides;
    return (f.misfit ? KVCOPY_FAST_MISFIT : 0u) | (f.merges ? KVCOPY_FAST_MERGES : 0u) |
           (f.differ ? KVCOPY_FAST_SIZES : 0u);
}

/* One finished entry, as kvcopy_put writes the vector pass's (``stream``: streaming). */
KVCOPY_FAST_TARGET static inline void kvcopy_put_desc(kvcopy_desc* at, uint64_t s, uint64_t t,
                                                      uint64_t z, uint64_t tile_start, int stream) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    kvcopy_put((__m256i*)at,
               _mm256_setr_epi64x((long long)s, (long long)t, (long long)z, (long long)tile_start),
               stream);
#else
    (void)stream;
    at->src = s;
    at->dst = t;
    at->size = z;
    at->tile_start = tile_start;
#endif
}

/* The entries the general loop writes, for a batch kvcopy_describe_in_ranges found
 * inside one range per side with no empty or over-long copy, but with copies that
 * continue the one before on both sides (merged into it with ``merge``) or sizes
 * that make tile_start more than i * tiles_per_copy: one scalar pass over the
 * caller's arrays, no pointer classified again (each side's view is pointer +
 * delta). Merging the caller's copies one by one in the general loop cost 4x the
 * vectorised pass, and one continuing pair in a batch of 16,384 sent it there.
 * Returns the entries written; *tiles_out = their tiles. */
KVCOPY_FAST_TARGET
static int64_t kvcopy_describe_merging(const uint64_t* __restrict src,
                                       const uint64_t* __restrict dst,
                                       const uint64_t* __restrict sizes,
                                       kvcopy_desc* __restrict out, int64_t n, int merge,
                                       int64_t src_delta, int64_t dst_delta, uint64_t* tiles_out) {
    int64_t kept = 0;
    uint64_t tiles = 0;
    /* streaming where the entries are 32-byte aligned, as in the vector pass */
    const int stream = ((uintptr_t)out & 31u) == 0;
    if (n <= 0) {
        *tiles_out = 0;
        return 0;
    }
    /* the entry being gathered, written once whole */
    uint64_t at_src = src[0], at_dst = dst[0], size = sizes[0];
    for (int64_t i = 1; i < n; ++i) {
        const uint64_t s = src[i], t = dst[i], z = sizes[i];
        if (merge && s == at_src + size && t == at_dst + size) {
            size += z;
            continue;
        }
        kvcopy_put_desc(out + kept++, at_src + (uint64_t)src_delta, at_dst + (uint64_t)dst_delta,
                        size, tiles, stream);
        tiles += (size + KVCOPY_TILE_BYTES - 1) / KVCOPY_TILE_BYTES;
        at_src = s, at_dst = t, size = z;
    }
    kvcopy_put_desc(out + kept++, at_src + (uint64_t)src_delta, at_dst + (uint64_t)dst_delta, size,
                    tiles, stream);
    tiles += (size + KVCOPY_TILE_BYTES - 1) / KVCOPY_TILE_BYTES;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (stream) _mm_sfence(); /* streaming stores are weakly ordered */
#endif
    *tiles_out = tiles;
    return kept;
}

#endif /* KVCOPY_DESCRIBE_FAST_H */
