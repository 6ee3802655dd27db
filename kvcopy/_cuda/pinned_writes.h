/* Writes into pinned memory that the GPU reads next (host code, used by
 * kvcopy/_cuda/plan_arrays.pyx): ids for the layout kernel, uploaded from a ring slot.
 *
 * A ring slot's lines are rarely in the CPU's cache (the ring cycles through far more
 * memory than the cache holds), so a plain store first reads each line for ownership:
 * half the traffic of a 512 KiB write is reading what is about to be overwritten. On
 * x86-64 the body goes out with 16-byte streaming stores (SSE2, which every x86-64
 * CPU has), which skip that read; elsewhere, and for the unaligned edges, plain stores.
 * Streaming stores are weakly ordered: each writer ends with a store fence, so that the
 * driver call that follows (the upload) sees every byte.
 */
#ifndef KVCOPY_PINNED_WRITES_H
#define KVCOPY_PINNED_WRITES_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>
#define KVCOPY_STREAMING_STORES 1
#else
#define KVCOPY_STREAMING_STORES 0
#endif

/* pairs[2i] to src[i] and pairs[2i + 1] to dst[i], for i in [0, n). */
static inline void kvcopy_split_pairs(const int64_t* pairs, int64_t* src, int64_t* dst, int64_t n) {
    int64_t i = 0;
#if KVCOPY_STREAMING_STORES
    const int src_aligned = ((uintptr_t)src & 15u) == 0;
    const int dst_aligned = ((uintptr_t)dst & 15u) == 0;
    if (src_aligned && dst_aligned) {
        for (; i + 2 <= n; i += 2) {
            const __m128i a = _mm_loadu_si128((const __m128i*)(pairs + 2 * i));
            const __m128i b = _mm_loadu_si128((const __m128i*)(pairs + 2 * i + 2));
            _mm_stream_si128((__m128i*)(src + i), _mm_unpacklo_epi64(a, b));
            _mm_stream_si128((__m128i*)(dst + i), _mm_unpackhi_epi64(a, b));
        }
        _mm_sfence();
    } else if (src_aligned && ((uintptr_t)dst & 7u) == 0 && n >= 3) {
        /* dst 8 bytes off: its first id alone, then ids i+1, i+2 beside src's i, i+1 */
        dst[0] = pairs[1];
        for (; i + 3 <= n; i += 2) {
            const __m128i a = _mm_loadu_si128((const __m128i*)(pairs + 2 * i));
            const __m128i b = _mm_loadu_si128((const __m128i*)(pairs + 2 * i + 2));
            const __m128i c = _mm_loadu_si128((const __m128i*)(pairs + 2 * i + 4));
            _mm_stream_si128((__m128i*)(src + i), _mm_unpacklo_epi64(a, b));
            _mm_stream_si128((__m128i*)(dst + i + 1), _mm_unpackhi_epi64(b, c));
        }
        _mm_sfence();
        /* src [0, i) and dst [0, i] are written */
        for (; i < n; ++i) {
            src[i] = pairs[2 * i];
            if (i + 1 < n) dst[i + 1] = pairs[2 * i + 3];
        }
        return;
    }
#endif
    for (; i < n; ++i) {
        src[i] = pairs[2 * i];
        dst[i] = pairs[2 * i + 1];
    }
}

/* memcpy(dst, from, nbytes), the 16-byte-aligned body of dst by streaming stores. */
static inline void kvcopy_copy_to_pinned(void* dst, const void* from, size_t nbytes) {
#if KVCOPY_STREAMING_STORES
    char* out = (char*)dst;
    const char* in = (const char*)from;
    const size_t head = (16u - ((uintptr_t)out & 15u)) & 15u;
    if (nbytes >= head + 64) {
        memcpy(out, in, head);
        out += head;
        in += head;
        nbytes -= head;
        for (; nbytes >= 16; nbytes -= 16, out += 16, in += 16)
            _mm_stream_si128((__m128i*)out, _mm_loadu_si128((const __m128i*)in));
        _mm_sfence();
        memcpy(out, in, nbytes);
        return;
    }
#endif
    memcpy(dst, from, nbytes);
}

#endif
