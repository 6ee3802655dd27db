/* Whether a batch of copies is free of order dependence, in one expected-linear pass
 * (host code, used by kvcopy/_cuda/plan_arrays.pyx's copies_ok): no two destinations
 * meet, and no copy reads bytes another copy writes (a copy onto exactly itself is
 * left out of the second test, as the exact check leaves it out).
 *
 * Addresses are cut into buckets as wide as the largest copy, rounded up to a power of
 * two, so a range touches at most two buckets and two ranges that share a byte share a
 * bucket. Each destination range is entered under its buckets in a hash table; a range
 * is compared only with the ranges already entered under its own buckets. A bucket
 * that gathers more than KVCOPY_APART_CHAIN ranges (very unequal sizes) ends the pass
 * undecided: the caller then sorts (kvcopy._plans.overlaps), so the pass never costs
 * more than a constant per copy. Where the destinations are dense (a pool's blocks),
 * the buckets are an array indexed from the first one instead of a hash table; where
 * they are also blocks of one size on one grid, a bit a block stands for them.
 *
 * The table lives in a scratch area each thread keeps (up to KVCOPY_APART_KEPT bytes;
 * a larger one is freed after the call), and a slot is free unless it carries the
 * current pass's stamp: a pass neither allocates nor clears memory in the steady state
 * (a fresh allocation of a few hundred KiB costs more in page faults than the pass).
 *
 * Returns 1 where the batch is shown apart, 0 where two copies meet or the pass is
 * undecided (the caller compares exactly, which names the copies), -1 where memory
 * for the table could not be had. Zero-size copies are skipped; the caller has refused
 * copies that wrap the address space (so no range here wraps).
 */
#ifndef KVCOPY_COPIES_APART_H
#define KVCOPY_COPIES_APART_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVCOPY_APART_CHAIN 8
#define KVCOPY_APART_KEPT (16u << 20)

#ifdef __cplusplus
#define KVCOPY_THREAD_LOCAL thread_local
#else
#define KVCOPY_THREAD_LOCAL _Thread_local
#endif

/* A pass over a whole batch built once per instruction set, the widest the CPU has
 * chosen when the module loads (GCC and clang on x86-64 Linux with glibc's ifunc):
 * the summary of 8,192 copies takes about a fifth of the time with AVX-512 vectors. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define KVCOPY_WIDE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef KVCOPY_WIDE_CLONES
#define KVCOPY_WIDE_CLONES
#endif

typedef struct {
    uint64_t bucket; /* the bucket this slot holds */
    uint32_t stamp;  /* the pass that filled it: any other value means free */
    int32_t head;    /* its newest entry */
} kvcopy_bucket_slot_t;

typedef struct {
    int32_t next; /* the entry entered before it under the same bucket, or -1 */
    int32_t copy;
} kvcopy_bucket_entry_t;

typedef struct {
    kvcopy_bucket_slot_t* slots;
    kvcopy_bucket_entry_t* entries;
    uint64_t mask;
    uint32_t stamp;
    int32_t used;
} kvcopy_bucket_table;

typedef struct {
    void* memory;
    size_t bytes;
    uint32_t stamp;
} kvcopy_apart_scratch;

static KVCOPY_THREAD_LOCAL kvcopy_apart_scratch kvcopy_apart_kept = {NULL, 0, 0};

/* At least ``bytes`` of ``kept`` (its contents not kept); 0 where memory is short. */
static inline int kvcopy_scratch_reserve(kvcopy_apart_scratch* kept, size_t bytes) {
    if (kept->bytes < bytes) {
        free(kept->memory);
        kept->memory = malloc(bytes);
        kept->bytes = kept->memory ? bytes : 0;
    }
    return kept->memory != NULL && kept->bytes >= bytes;
}

/* A scratch area larger than KVCOPY_APART_KEPT is freed after its pass. */
static inline void kvcopy_scratch_trim(kvcopy_apart_scratch* kept) {
    if (kept->bytes > KVCOPY_APART_KEPT) {
        free(kept->memory);
        kept->memory = NULL;
        kept->bytes = 0;
    }
}

static inline uint64_t kvcopy_bucket_find(const kvcopy_bucket_table* t, uint64_t bucket) {
    /* Fibonacci hashing spreads buckets that follow each other over the slots */
    uint64_t slot = (bucket * 0x9E3779B97F4A7C15ULL) >> 20;
    for (;; ++slot) {
        const kvcopy_bucket_slot_t* s = &t->slots[slot & t->mask];
        if (s->stamp != t->stamp || s->bucket == bucket) {
            return slot & t->mask;
        }
    }
}

/* 1: no destination under ``bucket`` overlaps [lo, hi); 0: one does, or the bucket
 * holds too many to compare. With ``src``, the destinations of copies onto exactly
 * themselves are passed over. */
static inline int kvcopy_bucket_clear(const kvcopy_bucket_table* t, uint64_t bucket, uint64_t lo,
                                      uint64_t hi, const uint64_t* src, const uint64_t* dst,
                                      const uint64_t* sizes) {
    const kvcopy_bucket_slot_t* s = &t->slots[kvcopy_bucket_find(t, bucket)];
    int seen = 0;
    if (s->stamp != t->stamp) {
        return 1;
    }
    for (int32_t e = s->head; e >= 0; e = t->entries[e].next) {
        int32_t j = t->entries[e].copy;
        if ((src == NULL || src[j] != dst[j]) && dst[j] < hi && lo < dst[j] + sizes[j]) {
            return 0;
        }
        if (++seen > KVCOPY_APART_CHAIN) {
            return 0;
        }
    }
    return 1;
}

/* 1: [lo, hi) meets no destination entered under the one or two buckets it touches
 * (as kvcopy_bucket_clear, with ``src``); 0: it meets one, or a bucket is too full. */
static inline int kvcopy_range_clear(const kvcopy_bucket_table* t, int shift, uint64_t lo,
                                     uint64_t hi, const uint64_t* src, const uint64_t* dst,
                                     const uint64_t* sizes) {
    uint64_t first = lo >> shift, last = (hi - 1) >> shift;
    return kvcopy_bucket_clear(t, first, lo, hi, src, dst, sizes) &&
           (last == first || kvcopy_bucket_clear(t, last, lo, hi, src, dst, sizes));
}

static inline void kvcopy_bucket_enter(kvcopy_bucket_table* t, uint64_t bucket, int32_t copy) {
    kvcopy_bucket_slot_t* s = &t->slots[kvcopy_bucket_find(t, bucket)];
    int32_t e = t->used++;
    if (s->stamp != t->stamp) {
        s->stamp = t->stamp;
        s->bucket = bucket;
        s->head = -1;
    }
    t->entries[e].copy = copy;
    t->entries[e].next = s->head;
    s->head = e;
}

/* Room for ``slots`` slots and ``entries`` entries, from the thread's scratch where it
 * is large enough (kept up to KVCOPY_APART_KEPT bytes); 0 where memory is short. */
static inline int kvcopy_bucket_table_init(kvcopy_bucket_table* t, uint64_t slots,
                                           int64_t entries) {
    size_t slot_bytes = (size_t)slots * sizeof(kvcopy_bucket_slot_t);
    size_t bytes = slot_bytes + (size_t)entries * sizeof(kvcopy_bucket_entry_t);
    kvcopy_apart_scratch* kept = &kvcopy_apart_kept;
    if (kept->bytes < bytes) {
        free(kept->memory);
        kept->memory = malloc(bytes);
        kept->bytes = kept->memory ? bytes : 0;
        kept->stamp = 0;
        if (!kept->memory) {
            return 0;
        }
        memset(kept->memory, 0, bytes); /* stamp 0 is never a pass's */
    }
    if (++kept->stamp == 0) { /* every stamp used: clear, and start again */
        memset(kept->memory, 0, kept->bytes);
        kept->stamp = 1;
    }
    t->slots = (kvcopy_bucket_slot_t*)kept->memory;
    t->entries = (kvcopy_bucket_entry_t*)((char*)kept->memory + slot_bytes);
    t->mask = slots - 1;
    t->stamp = kept->stamp;
    t->used = 0;
    return 1;
}

static inline void kvcopy_bucket_table_done(void) {
    kvcopy_apart_scratch* kept = &kvcopy_apart_kept;
    if (kept->bytes > KVCOPY_APART_KEPT) {
        free(kept->memory);
        kept->memory = NULL;
        kept->bytes = 0;
    }
}

/* The dense pass: where the destinations' span holds at most KVCOPY_APART_DENSE
 * buckets a copy (blocks of a pool, as a KV cache hands them out), a bucket's chain
 * head is found by its distance from the first bucket of the span: no hashing, and a
 * table of a few int32 a copy that stays in cache (the hashed table's random reads
 * cost most of its pass). A source bucket outside the span holds no destination. Its
 * own scratch (the hashed table's slots rely on stamps that a cleared array would
 * break). */
#define KVCOPY_APART_DENSE 8

static KVCOPY_THREAD_LOCAL kvcopy_apart_scratch kvcopy_dense_kept = {NULL, 0, 0};

/* 1: [lo, hi) meets no destination entered under its buckets (with ``src``, passing
 * over copies onto exactly themselves); 0: it meets one, or a chain is too long. */
static inline int kvcopy_dense_clear(const int32_t* heads, const kvcopy_bucket_entry_t* entries,
                                     uint64_t first_bucket, uint64_t span, int shift, uint64_t lo,
                                     uint64_t hi, const uint64_t* src, const uint64_t* dst,
                                     const uint64_t* sizes) {
    uint64_t first = lo >> shift, last = (hi - 1) >> shift;
    for (uint64_t b = first; b <= last; ++b) {
        if (b < first_bucket || b - first_bucket >= span) {
            continue;
        }
        int seen = 0;
        for (int32_t e = heads[b - first_bucket]; e >= 0; e = entries[e].next) {
            int32_t j = entries[e].copy;
            if ((src == NULL || src[j] != dst[j]) && dst[j] < hi && lo < dst[j] + sizes[j]) {
                return 0;
            }
            if (++seen > KVCOPY_APART_CHAIN) {
                return 0;
            }
        }
    }
    return 1;
}

static inline int kvcopy_copies_apart_dense(const uint64_t* src, const uint64_t* dst,
                                            const uint64_t* sizes, int64_t n, int sources_apart,
                                            int shift, uint64_t first_bucket, uint64_t span,
                                            int64_t live) {
    size_t head_bytes = (size_t)span * sizeof(int32_t);
    size_t bytes = head_bytes + (size_t)(2 * live) * sizeof(kvcopy_bucket_entry_t);
    kvcopy_apart_scratch* kept = &kvcopy_dense_kept;
    if (!kvcopy_scratch_reserve(kept, bytes)) {
        return -1;
    }
    int32_t* heads = (int32_t*)kept->memory;
    kvcopy_bucket_entry_t* entries = (kvcopy_bucket_entry_t*)((char*)kept->memory + head_bytes);
    memset(heads, 0xFF, head_bytes); /* every chain empty (-1) */
    int32_t used = 0;
    int apart = 1;
    for (int64_t i = 0; i < n && apart; ++i) {
        if (sizes[i] == 0) {
            continue;
        }
        uint64_t lo = dst[i], hi = dst[i] + sizes[i];
        if (!kvcopy_dense_clear(heads, entries, first_bucket, span, shift, lo, hi, NULL, dst,
                                sizes)) {
            apart = 0;
            break;
        }
        uint64_t first = lo >> shift, last = (hi - 1) >> shift;
        for (uint64_t b = first; b <= last; ++b) {
            entries[used].copy = (int32_t)i;
            entries[used].next = heads[b - first_bucket];
            heads[b - first_bucket] = used++;
        }
    }
    for (int64_t i = 0; i < n && apart && !sources_apart; ++i) {
        if (sizes[i] == 0 || src[i] == dst[i]) {
            continue;
        }
        if (!kvcopy_dense_clear(heads, entries, first_bucket, span, shift, src[i],
                                src[i] + sizes[i], src, dst, sizes)) {
            apart = 0;
        }
    }
    kvcopy_scratch_trim(kept);
    return apart;
}

/* The uniform pass: where every non-empty copy has one size, a power of two, and every
 * destination lies at the same offset from a multiple of it (the blocks of a pool),
 * two destinations meet only where they are the same block, and a source meets a
 * destination only where it touches that destination's block: one bit a block of the
 * destinations' span (at most KVCOPY_APART_BITS blocks a copy), in a table small
 * enough to stay in the first-level cache, instead of chains. Returns 1 where the
 * batch is apart, 0 where two destinations are one block, KVCOPY_APART_UNDECIDED where
 * the pass does not apply or a source touches a written block (which may be a copy's
 * onto exactly itself: the dense pass decides), -1 where memory is short. */
#define KVCOPY_APART_BITS 64
#define KVCOPY_APART_UNDECIDED 2

static KVCOPY_THREAD_LOCAL kvcopy_apart_scratch kvcopy_bits_kept = {NULL, 0, 0};

static inline int kvcopy_copies_apart_uniform(const uint64_t* src, const uint64_t* dst,
                                              const uint64_t* sizes, int64_t n, int sources_apart,
                                              int shift, uint64_t dst_lo, uint64_t dst_hi,
                                              int64_t live) {
    uint64_t blocks = (dst_hi - dst_lo) >> shift;
    if (blocks > KVCOPY_APART_BITS * (uint64_t)live) {
        return KVCOPY_APART_UNDECIDED;
    }
    size_t bytes = (size_t)((blocks + 63) / 64) * sizeof(uint64_t);
    kvcopy_apart_scratch* kept = &kvcopy_bits_kept;
    if (!kvcopy_scratch_reserve(kept, bytes)) {
        return -1;
    }
    uint64_t* bits = (uint64_t*)kept->memory;
    memset(bits, 0, bytes);
    int apart = 1;
    uint64_t size = 1ULL << shift;
    for (int64_t i = 0; i < n; ++i) {
        if (sizes[i] == 0) {
            continue;
        }
        uint64_t b = (dst[i] - dst_lo) >> shift, bit = 1ULL << (b & 63);
        if (bits[b >> 6] & bit) {
            apart = 0;
            break;
        }
        bits[b >> 6] |= bit;
    }
    for (int64_t i = 0; i < n && apart == 1 && !sources_apart; ++i) {
        if (sizes[i] == 0 || src[i] == dst[i] || src[i] >= dst_hi || src[i] + size <= dst_lo) {
            continue;
        }
        uint64_t lo = src[i] > dst_lo ? src[i] : dst_lo;
        uint64_t hi = (src[i] + size < dst_hi ? src[i] + size : dst_hi) - 1;
        for (uint64_t b = (lo - dst_lo) >> shift; b <= (hi - dst_lo) >> shift; ++b) {
            if (bits[b >> 6] & (1ULL << (b & 63))) {
                apart = KVCOPY_APART_UNDECIDED;
                break;
            }
        }
    }
    kvcopy_scratch_trim(kept);
    return apart;
}

/* What one pass over a batch learns of its non-empty copies: each side's span (sources
 * of copies onto exactly themselves left out), whether the destinations come in
 * address order without meeting, and whether any copy may be bad (too large, a null
 * pointer, wrapping the address space: the caller finds which, copy by copy, with
 * copy_problem). Branch-light, and no more than the glance needs: a batch whose
 * destinations are in order and whose sources lie outside them is decided by it. */
typedef struct { /* (filled in this order by the passes below) */
    uint64_t dst_lo, dst_hi, src_lo, src_hi;
    /* the widest copy; or and and of the sizes and of the destinations (one size, and
       destinations alike in their low bits, make the uniform pass apply) */
    uint64_t widest, size_or, size_and, dst_or, dst_and;
    int64_t live;
    int ordered;
    int suspect;
} kvcopy_batch_summary;

/* kvcopy_summarize of the common batch, in vectors: every copy non-empty, from another
 * place, between non-null addresses below 2**63 (so no range wraps and each
 * destination is compared with the one before it in the arrays, nothing carried over
 * skipped copies). Returns 0, having summarized nothing, for any other batch. */
KVCOPY_WIDE_CLONES
static inline int kvcopy_summarize_plain(const uint64_t* src, const uint64_t* dst,
                                         const uint64_t* sizes, int64_t n,
                                         kvcopy_batch_summary* s) {
    uint64_t dst_lo = UINT64_MAX, dst_hi = 0, src_lo = UINT64_MAX, src_hi = 0;
    uint64_t high = 0, unusual = 0, disorder = 0, widest = 0;
    uint64_t size_or = 0, size_and = UINT64_MAX, dst_or = 0, dst_and = UINT64_MAX;
    for (int64_t i = 0; i < n; ++i) {
        uint64_t size = sizes[i], a = src[i], b = dst[i], end = b + size, a_end = a + size;
        uint64_t before = i > 0 ? dst[i - 1] + sizes[i - 1] : 0;
        high |= a | b | size | a_end | end;
        unusual |=
            (uint64_t)(size == 0) | (uint64_t)(a == b) | (uint64_t)(a == 0) | (uint64_t)(b == 0);
        disorder |= (uint64_t)(b < before);
        widest = size > widest ? size : widest;
        size_or |= size;
        size_and &= size;
        dst_or |= b;
        dst_and &= b;
        dst_hi = end > dst_hi ? end : dst_hi;
        dst_lo = b < dst_lo ? b : dst_lo;
        src_lo = a < src_lo ? a : src_lo;
        src_hi = a_end > src_hi ? a_end : src_hi;
    }
    if ((high >> 63) | unusual) {
        return 0;
    }
    kvcopy_batch_summary found = {dst_lo,   dst_hi, src_lo,  src_hi, widest,        size_or,
                                  size_and, dst_or, dst_and, n,      disorder == 0, 0};
    *s = found;
    return 1;
}

static inline void kvcopy_summarize(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes,
                                    int64_t n, kvcopy_batch_summary* s) {
    if (n > 0 && kvcopy_summarize_plain(src, dst, sizes, n, s)) {
        return;
    }
    uint64_t dst_lo = UINT64_MAX, dst_hi = 0, src_lo = UINT64_MAX, src_hi = 0, reach = 0;
    uint64_t suspect = 0, disorder = 0, widest = 0;
    uint64_t size_or = 0, size_and = UINT64_MAX, dst_or = 0, dst_and = UINT64_MAX;
    int64_t live = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint64_t size = sizes[i], a = src[i], b = dst[i];
        if (size == 0) {
            continue;
        }
        ++live;
        widest = size > widest ? size : widest;
        size_or |= size;
        size_and &= size;
        dst_or |= b;
        dst_and &= b;
        suspect |= (size >> 63) | (uint64_t)(a == 0) | (uint64_t)(b == 0) |
                   (uint64_t)(a + size < a) | (uint64_t)(b + size < b);
        disorder |= (uint64_t)(b < reach);
        reach = b + size;
        dst_hi = reach > dst_hi ? reach : dst_hi;
        dst_lo = b < dst_lo ? b : dst_lo;
        uint64_t moved_lo = a != b ? a : UINT64_MAX, moved_hi = a != b ? a + size : 0;
        src_lo = moved_lo < src_lo ? moved_lo : src_lo;
        src_hi = moved_hi > src_hi ? moved_hi : src_hi;
    }
    kvcopy_batch_summary found = {dst_lo,   dst_hi, src_lo,  src_hi, widest,        size_or,
                                  size_and, dst_or, dst_and, live,   disorder == 0, suspect != 0};
    *s = found;
}

/* kvcopy_copies_apart of a batch already summarized (every copy good). */
static inline int kvcopy_copies_apart_summarized(const uint64_t* src, const uint64_t* dst,
                                                 const uint64_t* sizes, int64_t n,
                                                 int sources_apart,
                                                 const kvcopy_batch_summary* found) {
    uint64_t widest = found->widest, slots = 4, dst_lo = found->dst_lo, dst_hi = found->dst_hi;
    int shift = 0;
    int64_t live = found->live;
    if (live == 0) {
        return 1;
    }
    if (n >= INT32_MAX / 2) {
        return 0; /* entries are counted in 32 bits: the exact check decides */
    }
    while (shift < 63 && (1ULL << shift) < widest) {
        ++shift;
    }
    /* one size, a power of two, and one offset from its multiples: the uniform pass */
    if (found->size_or == found->size_and && widest == 1ULL << shift &&
        ((found->dst_or ^ found->dst_and) & (widest - 1)) == 0) {
        int uniform = kvcopy_copies_apart_uniform(src, dst, sizes, n, sources_apart, shift, dst_lo,
                                                  dst_hi, live);
        if (uniform != KVCOPY_APART_UNDECIDED) {
            return uniform;
        }
    }
    uint64_t first_bucket = dst_lo >> shift, span = ((dst_hi - 1) >> shift) - first_bucket + 1;
    if (span <= KVCOPY_APART_DENSE * (uint64_t)live) {
        return kvcopy_copies_apart_dense(src, dst, sizes, n, sources_apart, shift, first_bucket,
                                         span, live);
    }
    while (slots < 4 * (uint64_t)live) {
        slots *= 2;
    }
    kvcopy_bucket_table t;
    if (!kvcopy_bucket_table_init(&t, slots, 2 * live)) {
        return -1;
    }
    int apart = 1;
    /* destinations against each other, each entered after it is compared */
    for (int64_t i = 0; i < n && apart; ++i) {
        if (sizes[i] == 0) {
            continue;
        }
        uint64_t lo = dst[i], hi = dst[i] + sizes[i];
        if (!kvcopy_range_clear(&t, shift, lo, hi, NULL, dst, sizes)) {
            apart = 0;
            break;
        }
        uint64_t first = lo >> shift, last = (hi - 1) >> shift;
        kvcopy_bucket_enter(&t, first, (int32_t)i);
        if (last != first) {
            kvcopy_bucket_enter(&t, last, (int32_t)i);
        }
    }
    /* every moved copy's source against every moved copy's destination, unless the
       caller found the sources' span outside the destinations' */
    for (int64_t i = 0; i < n && apart && !sources_apart; ++i) {
        if (sizes[i] == 0 || src[i] == dst[i]) {
            continue;
        }
        if (!kvcopy_range_clear(&t, shift, src[i], src[i] + sizes[i], src, dst, sizes)) {
            apart = 0;
        }
    }
    kvcopy_bucket_table_done();
    return apart;
}

static inline int kvcopy_copies_apart(const uint64_t* src, const uint64_t* dst,
                                      const uint64_t* sizes, int64_t n, int sources_apart) {
    kvcopy_batch_summary found;
    kvcopy_summarize(src, dst, sizes, n, &found);
    return kvcopy_copies_apart_summarized(src, dst, sizes, n, sources_apart, &found);
}

#endif /* KVCOPY_COPIES_APART_H */
