/* kvcopy's scatter-gather copy kernel, compiled at first use with NVRTC.
 *
 * Work is split into tiles of KVCOPY_TILE_BYTES; each warp takes tiles
 * warp_id, warp_id + num_warps, ... and copies one tile with all 32 lanes.
 * Every pointer here must be one the device can dereference: device memory or
 * pinned host memory mapped for the device (the host layer guarantees it).
 * Throughput over PCIe is set by bytes in flight, so each lane issues UNROLL
 * independent loads of the widest word the copy's alignment allows before it
 * stores any of them.
 */
#include "descriptor.h"

/* Most threads a CTA of these kernels is launched with: kvcopy.config.MAX_THREADS_PER_CTA,
 * passed by kvcopy._runtime.kernels. ptxas must keep registers within what that many
 * threads can have, else such launches fail with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES. */
#ifndef KVCOPY_MAX_THREADS
#error "compile with -DKVCOPY_MAX_THREADS=<kvcopy.config.MAX_THREADS_PER_CTA>"
#endif

#ifndef KVCOPY_UNROLL
#define KVCOPY_UNROLL 4
#endif

template <typename Word>
__device__ __forceinline__ void kvcopy_copy_words(const Word* __restrict__ src,
                                                  Word* __restrict__ dst, unsigned long long count,
                                                  unsigned lane) {
    unsigned long long i = lane;
    const unsigned long long stride = 32ULL * KVCOPY_UNROLL;
    for (; i + 32ULL * (KVCOPY_UNROLL - 1) < count; i += stride) {
        Word regs[KVCOPY_UNROLL];
#pragma unroll
        for (int u = 0; u < KVCOPY_UNROLL; ++u) regs[u] = src[i + 32ULL * u];
#pragma unroll
        for (int u = 0; u < KVCOPY_UNROLL; ++u) dst[i + 32ULL * u] = regs[u];
    }
    // the rest (under UNROLL words per lane) in one more round, its loads all issued
    // before any store: a 1-2 KiB piece then costs one PCIe round trip, not several
    if (i < count) {
        Word regs[KVCOPY_UNROLL];
#pragma unroll
        for (int u = 0; u < KVCOPY_UNROLL; ++u)
            if (i + 32ULL * u < count) regs[u] = src[i + 32ULL * u];
#pragma unroll
        for (int u = 0; u < KVCOPY_UNROLL; ++u)
            if (i + 32ULL * u < count) dst[i + 32ULL * u] = regs[u];
    }
}

template <typename Word>
__device__ __forceinline__ void kvcopy_copy_aligned(const char* src, char* dst,
                                                    unsigned long long len, unsigned lane) {
    const unsigned long long w = sizeof(Word);
    unsigned long long head = (w - ((unsigned long long)src & (w - 1))) & (w - 1);
    if (head > len) head = len;
    if (lane < head) dst[lane] = src[lane];
    const unsigned long long words = (len - head) / w;
    kvcopy_copy_words<Word>(reinterpret_cast<const Word*>(src + head),
                            reinterpret_cast<Word*>(dst + head), words, lane);
    const unsigned long long done = head + words * w;
    const unsigned long long tail = len - done;
    if (lane < tail) dst[done + lane] = src[done + lane];
}

/* Copies len bytes with one warp, using the widest word for which source and
 * destination share their alignment. */
__device__ __forceinline__ void kvcopy_copy_span(const char* src, char* dst, unsigned long long len,
                                                 unsigned lane) {
    const unsigned long long mis = (unsigned long long)src ^ (unsigned long long)dst;
    if ((mis & 15) == 0) {
        kvcopy_copy_aligned<uint4>(src, dst, len, lane);
    } else if ((mis & 7) == 0) {
        kvcopy_copy_aligned<unsigned long long>(src, dst, len, lane);
    } else if ((mis & 3) == 0) {
        kvcopy_copy_aligned<unsigned int>(src, dst, len, lane);
    } else if ((mis & 1) == 0) {
        kvcopy_copy_aligned<unsigned short>(src, dst, len, lane);
    } else {
        kvcopy_copy_words<unsigned char>(reinterpret_cast<const unsigned char*>(src),
                                         reinterpret_cast<unsigned char*>(dst), len, lane);
    }
}

/* Index of the descriptor holding tile t: the last i in [lo, n) whose
 * tile_start <= t. A warp-wide 32-way search, so 8192 descriptors take three
 * rounds of loads. */
__device__ __forceinline__ unsigned long long kvcopy_find_desc(const kvcopy_desc* descs,
                                                               unsigned long long lo,
                                                               unsigned long long n,
                                                               unsigned long long t,
                                                               unsigned lane) {
    unsigned long long a = lo, b = n;
    while (b - a > 1) {
        const unsigned long long step = (b - a + 31) / 32;
        const unsigned long long idx = a + lane * step;
        const bool ok = idx < b && descs[idx].tile_start <= t;
        const unsigned mask = __ballot_sync(0xffffffffu, ok);
        const unsigned long long na = a + (unsigned long long)(31 - __clz(mask)) * step;
        const unsigned long long nb = na + step < b ? na + step : b;
        a = na;
        b = nb;
    }
    return a;
}

/* Warps are the unit of work: their index in the grid and how many there are. */
__device__ __forceinline__ unsigned long long kvcopy_warp_index() {
    return (unsigned long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
}

__device__ __forceinline__ unsigned long long kvcopy_warp_count() {
    return (unsigned long long)gridDim.x * (blockDim.x >> 5);
}

/* ---- How a warp moves one span: every kernel below takes a Copier. ---- */

/* Loads into registers and stores from them (any GPU). */
struct kvcopy_register_copier {
    __device__ __forceinline__ void span(const char* src, char* dst, unsigned long long len,
                                         unsigned lane) {
        kvcopy_copy_span(src, dst, len, lane);
    }
    __device__ __forceinline__ void drain(unsigned) {}
};

/* Each warp's ring for the bulk copier (one CTA's worth): buffers, the mbarrier that
 * says a buffer's load is complete, and where the piece in it goes. */
struct kvcopy_bulk_ring {
    alignas(128) unsigned char buf[KVCOPY_BULK_WARPS][KVCOPY_BULK_STAGES][KVCOPY_BULK_STAGE_BYTES];
    unsigned long long bars[KVCOPY_BULK_WARPS][KVCOPY_BULK_STAGES];
    unsigned long long dst[KVCOPY_BULK_WARPS][KVCOPY_BULK_STAGES];
    unsigned len[KVCOPY_BULK_WARPS][KVCOPY_BULK_STAGES];
};

/* Hopper's bulk copy unit (cp.async.bulk, sm_90+): lane 0 of each warp loads each
 * piece (at most a stage) into its ring with one instruction and stores it with
 * another, which the unit carries out from its own queue. GPU-to-host stores issued
 * this way cost a matmul beside them a fraction of what the same stores from
 * registers do. Piece k's store is issued once piece
 * k + KVCOPY_BULK_LAG's load is under way, so a warp keeps LAG + 1 loads in flight
 * (loads from device memory take about a microsecond; with one in flight, 2 KiB
 * blocks ran at half the link). Spans the unit cannot take (addresses or length not
 * multiples of 16 bytes) go through registers; on older GPUs every span does. */
struct kvcopy_bulk_copier {
    kvcopy_bulk_ring* ring;
    unsigned warp;              // this warp's ring in the CTA's
    unsigned long long pieces;  // pieces loaded so far (lane 0)

    __device__ __forceinline__ void init(kvcopy_bulk_ring* shared_ring, unsigned lane) {
        ring = shared_ring;
        warp = threadIdx.x >> 5;
        pieces = 0;
#if __CUDA_ARCH__ >= 900
        if (lane == 0) {
            for (int s = 0; s < KVCOPY_BULK_STAGES; ++s)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar(s)) : "memory");
            // make the initialised barriers visible to the bulk copy unit
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        }
        __syncwarp();
#endif
    }

    __device__ __forceinline__ void span(const char* src, char* dst, unsigned long long len,
                                         unsigned lane) {
#if __CUDA_ARCH__ >= 900
        if (((reinterpret_cast<unsigned long long>(src) |
              reinterpret_cast<unsigned long long>(dst) | len) &
             15ULL) == 0) {
            if (lane == 0) {
                for (unsigned long long off = 0; off < len; off += KVCOPY_BULK_STAGE_BYTES) {
                    const unsigned long long rest = len - off;
                    push(reinterpret_cast<unsigned long long>(src) + off,
                         reinterpret_cast<unsigned long long>(dst) + off,
                         (unsigned)(rest < KVCOPY_BULK_STAGE_BYTES ? rest
                                                                   : KVCOPY_BULK_STAGE_BYTES));
                }
            }
            return;
        }
#endif
        kvcopy_copy_span(src, dst, len, lane);
    }

    /* Store the pieces still held and wait until every store is done. */
    __device__ __forceinline__ void drain(unsigned lane) {
#if __CUDA_ARCH__ >= 900
        if (lane == 0) {
            const unsigned long long first =
                pieces > KVCOPY_BULK_LAG ? pieces - KVCOPY_BULK_LAG : 0;
            for (unsigned long long p = first; p < pieces; ++p) store(p);
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        }
#endif
    }

#if __CUDA_ARCH__ >= 900
    __device__ __forceinline__ unsigned bar(unsigned s) const {
        return (unsigned)__cvta_generic_to_shared(&ring->bars[warp][s]);
    }

    __device__ __forceinline__ unsigned buffer(unsigned s) const {
        return (unsigned)__cvta_generic_to_shared(&ring->buf[warp][s][0]);
    }

    /* Load piece k (= pieces) into its stage, then store piece k - LAG. */
    __device__ __forceinline__ void push(unsigned long long src, unsigned long long dst,
                                         unsigned len) {
        const unsigned long long k = pieces;
        const unsigned s = (unsigned)(k % KVCOPY_BULK_STAGES);
        if (k >= KVCOPY_BULK_STAGES) {
            // the stage's previous piece, k - STAGES, must have been read by its store;
            // stores issued so far: pieces 0 .. k - 1 - LAG, so the newest
            // STAGES - 1 - LAG of them may still be pending
            asm volatile(
                "cp.async.bulk.wait_group.read %0;" ::"n"(KVCOPY_BULK_STAGES - 1 - KVCOPY_BULK_LAG)
                : "memory");
        }
        ring->dst[warp][s] = dst;
        ring->len[warp][s] = len;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar(s)),
                     "r"(len)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1], %2, [%3];" ::"r"(buffer(s)),
            "l"(src), "r"(len), "r"(bar(s))
            : "memory");
        if (k >= KVCOPY_BULK_LAG) store(k - KVCOPY_BULK_LAG);
        pieces = k + 1;
    }

    /* Wait for piece p's load, then store it. */
    __device__ __forceinline__ void store(unsigned long long p) {
        const unsigned s = (unsigned)(p % KVCOPY_BULK_STAGES);
        const unsigned parity = (unsigned)((p / KVCOPY_BULK_STAGES) & 1);
        unsigned done = 0;
        while (!done) {
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                " selp.u32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(bar(s)), "r"(parity)
                : "memory");
        }
        asm volatile(
            "cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(ring->dst[warp][s]),
            "r"(buffer(s)), "r"(ring->len[warp][s])
            : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
#endif
};

template <typename Copier>
__device__ __forceinline__ void kvcopy_copy_tile(Copier& copier, const kvcopy_desc& desc,
                                                 unsigned long long t, unsigned lane) {
    const unsigned long long offset = (t - desc.tile_start) * KVCOPY_TILE_BYTES;
    unsigned long long len = desc.size - offset;
    if (len > KVCOPY_TILE_BYTES) len = KVCOPY_TILE_BYTES;
    copier.span(reinterpret_cast<const char*>(desc.src) + offset,
                reinterpret_cast<char*>(desc.dst) + offset, len, lane);
}

/* The copy held by lane src_lane, for the whole warp: source, destination and size
 * (its one caller copies one-tile copies, which need no tile_start). */
__device__ __forceinline__ kvcopy_desc kvcopy_share_desc(const kvcopy_desc& d, int src_lane) {
    kvcopy_desc r;
    r.src = __shfl_sync(0xffffffffu, d.src, src_lane);
    r.dst = __shfl_sync(0xffffffffu, d.dst, src_lane);
    r.size = __shfl_sync(0xffffffffu, d.size, src_lane);
    r.tile_start = 0;
    return r;
}

/* Every copy is one tile (blocks <= KVCOPY_TILE_BYTES), so tile t is copy t and
 * warp w copies w, w + W, w + 2W, ... Descriptors may be read straight from
 * pinned host memory, a PCIe round trip each: every lane loads one descriptor
 * of the warp's next 32 copies and shuffles share them, and the loads of the
 * following 32 are issued before the current ones are copied, so their
 * latency hides behind 32 copies instead of adding to each. */
template <typename Source, typename Copier>
__device__ __forceinline__ void kvcopy_scatter_single_tiles(Copier& copier, Source descs,
                                                            unsigned long long count,
                                                            unsigned long long warp,
                                                            unsigned long long num_warps,
                                                            unsigned lane) {
    const kvcopy_desc none = {0ULL, 0ULL, 0ULL, 0ULL};
    const unsigned long long group = 32ULL * num_warps;
    unsigned long long base = warp;
    kvcopy_desc mine = base + lane * num_warps < count ? descs[base + lane * num_warps] : none;
    while (base < count) {
        const unsigned long long next = base + group;
        const kvcopy_desc ahead =
            next + lane * num_warps < count ? descs[next + lane * num_warps] : none;
        for (int j = 0; j < 32; ++j) {
            if (base + (unsigned long long)j * num_warps >= count) break;
            // the whole copy (one tile): tile_start is not read, so a launch may take
            // any slice of a table described for a larger batch
            const kvcopy_desc d = kvcopy_share_desc(mine, j);
            copier.span(reinterpret_cast<const char*>(d.src), reinterpret_cast<char*>(d.dst),
                        d.size, lane);
        }
        mine = ahead;
        base = next;
    }
}

/* Small batches (fewer tiles than half the warps): each tile is cut into
 * ``split`` parts of whole 16-byte words, one warp each, so that every warp has
 * loads in flight; latency, not bandwidth, bounds such batches. */
template <typename Copier>
__device__ __forceinline__ void kvcopy_scatter_split(Copier& copier, const kvcopy_desc* descs,
                                                     unsigned long long count,
                                                     unsigned long long total_tiles,
                                                     unsigned long long warp,
                                                     unsigned long long num_warps, unsigned lane) {
    unsigned long long split = num_warps / total_tiles;
    if (split > KVCOPY_MAX_SPLIT) split = KVCOPY_MAX_SPLIT;
    for (unsigned long long u = warp; u < total_tiles * split; u += num_warps) {
        const unsigned long long t = u / split, part = u - t * split;
        // one tile per copy: tile t is copy t, no search (descriptors may be in host memory)
        const kvcopy_desc desc =
            descs[total_tiles == count ? t : kvcopy_find_desc(descs, 0, count, t, lane)];
        // one-tile copies start at their first byte whatever tile_start says (a slice)
        const unsigned long long offset =
            total_tiles == count ? 0ULL : (t - desc.tile_start) * KVCOPY_TILE_BYTES;
        unsigned long long len = desc.size - offset;
        if (len > KVCOPY_TILE_BYTES) len = KVCOPY_TILE_BYTES;
        const unsigned long long piece = ((len + split - 1) / split + 15) & ~15ULL;
        const unsigned long long begin = part * piece;
        if (begin >= len) continue;
        const unsigned long long n = len - begin < piece ? len - begin : piece;
        copier.span(reinterpret_cast<const char*>(desc.src) + offset + begin,
                    reinterpret_cast<char*>(desc.dst) + offset + begin, n, lane);
    }
}

/* The copies of descriptors [0, count) by warps warp, warp + num_warps, ... */
template <typename Copier>
__device__ __forceinline__ void kvcopy_scatter_warps(Copier& copier, const kvcopy_desc* descs,
                                                     unsigned long long count,
                                                     unsigned long long total_tiles,
                                                     unsigned long long warp,
                                                     unsigned long long num_warps) {
    const unsigned lane = threadIdx.x & 31u;
    if (total_tiles * 2 <= num_warps) {
        kvcopy_scatter_split(copier, descs, count, total_tiles, warp, num_warps, lane);
        return;
    }
    if (total_tiles == count) {
        kvcopy_scatter_single_tiles(copier, descs, count, warp, num_warps, lane);
        return;
    }
    unsigned long long d = 0;  // tiles are visited in increasing order
    for (unsigned long long t = warp; t < total_tiles; t += num_warps) {
        d = kvcopy_find_desc(descs, d, count, t, lane);
        kvcopy_copy_tile(copier, descs[d], t, lane);
    }
}

__device__ __forceinline__ void kvcopy_scatter_body(const kvcopy_desc* descs,
                                                    unsigned long long count,
                                                    unsigned long long total_tiles) {
    kvcopy_register_copier copier;
    kvcopy_scatter_warps(copier, descs, count, total_tiles, kvcopy_warp_index(),
                         kvcopy_warp_count());
}

/* Runs work(copier) with a bulk copier whose ring lives in this CTA's shared
 * memory, then waits until the stores it issued have completed. CTAs of exactly
 * KVCOPY_BULK_THREADS threads. */
template <typename Work>
__device__ __forceinline__ void kvcopy_with_bulk_copier(Work work) {
    __shared__ kvcopy_bulk_ring ring;
    const unsigned lane = threadIdx.x & 31u;
    kvcopy_bulk_copier copier;
    copier.init(&ring, lane);
    work(copier);
    copier.drain(lane);
}

/* The same as kvcopy_scatter_body, through the bulk copier. */
__device__ __forceinline__ void kvcopy_bulk_body(const kvcopy_desc* descs, unsigned long long count,
                                                 unsigned long long total_tiles) {
    kvcopy_with_bulk_copier([&](kvcopy_bulk_copier& copier) {
        kvcopy_scatter_warps(copier, descs, count, total_tiles, kvcopy_warp_index(),
                             kvcopy_warp_count());
    });
}

/* kvcopy_compact_desc entries seen as descriptors: copy i is tile i, of the batch's one size. */
struct kvcopy_compact_source {
    const kvcopy_compact_desc* entries;
    unsigned long long size;
    __device__ __forceinline__ kvcopy_desc operator[](unsigned long long i) const {
        // one 16-byte load (entries are 16-byte aligned)
        const ulonglong2 p = reinterpret_cast<const ulonglong2*>(entries)[i];
        const kvcopy_desc d = {p.x, p.y, size, i};
        return d;
    }
};

/* A batch of ``count`` copies of ``size`` bytes each (at most one tile), as
 * kvcopy_compact_desc entries in device memory or in pinned host memory mapped for the
 * device. Launched with at most one warp per copy. */
extern "C" __global__ void __launch_bounds__(KVCOPY_MAX_THREADS)
    kvcopy_scatter_compact(const kvcopy_compact_desc* __restrict__ entries,
                           unsigned long long count, unsigned long long size) {
    const kvcopy_compact_source source = {entries, size};
    kvcopy_register_copier copier;
    kvcopy_scatter_single_tiles(copier, source, count, kvcopy_warp_index(), kvcopy_warp_count(),
                                threadIdx.x & 31u);
}

extern "C" __global__ void __launch_bounds__(KVCOPY_BULK_THREADS)
    kvcopy_bulk_compact(const kvcopy_compact_desc* __restrict__ entries, unsigned long long count,
                        unsigned long long size) {
    const kvcopy_compact_source source = {entries, size};
    kvcopy_with_bulk_copier([&](kvcopy_bulk_copier& copier) {
        kvcopy_scatter_single_tiles(copier, source, count, kvcopy_warp_index(), kvcopy_warp_count(),
                                    threadIdx.x & 31u);
    });
}

/* Descriptors in device memory, or in pinned host memory mapped for the device
 * (one-tile copies only: the multi-tile search would cross PCIe per step). */
extern "C" __global__ void __launch_bounds__(KVCOPY_MAX_THREADS)
    kvcopy_scatter(const kvcopy_desc* __restrict__ descs, unsigned long long count,
                   unsigned long long total_tiles) {
    kvcopy_scatter_body(descs, count, total_tiles);
}

/* One copier's three by-value entry points (kvcopy_inline_batch and its 4 KiB and
 * 1 KiB variants), named <prefix>_inline, _inline_small and _inline_tiny. */
#define KVCOPY_INLINE_ENTRIES(prefix, threads, body)                                     \
    extern "C" __global__ void __launch_bounds__(threads)                                \
        prefix##_inline(const __grid_constant__ kvcopy_inline_batch batch) {             \
        body(batch.descs, batch.count, batch.total_tiles);                               \
    }                                                                                    \
    extern "C" __global__ void __launch_bounds__(threads)                                \
        prefix##_inline_small(const __grid_constant__ kvcopy_inline_batch_small batch) { \
        body(batch.descs, batch.count, batch.total_tiles);                               \
    }                                                                                    \
    extern "C" __global__ void __launch_bounds__(threads)                                \
        prefix##_inline_tiny(const __grid_constant__ kvcopy_inline_batch_tiny batch) {   \
        body(batch.descs, batch.count, batch.total_tiles);                               \
    }

KVCOPY_INLINE_ENTRIES(kvcopy_scatter, KVCOPY_MAX_THREADS, kvcopy_scatter_body)

/* The bulk copier's entry points: descriptors in a table, and by value. */
extern "C" __global__ void __launch_bounds__(KVCOPY_BULK_THREADS)
    kvcopy_bulk_scatter(const kvcopy_desc* __restrict__ descs, unsigned long long count,
                        unsigned long long total_tiles) {
    kvcopy_bulk_body(descs, count, total_tiles);
}

KVCOPY_INLINE_ENTRIES(kvcopy_bulk, KVCOPY_BULK_THREADS, kvcopy_bulk_body)

/* Two batches in one launch, each with its own CTAs: CTAs [0, ctas_a) copy the
 * count_a descriptors at descs, the others the count_b at descs_b (each batch's
 * tile_start counts from 0; a launch over slices of two tables needs no
 * reordering). Used for a store and a load over PCIe at the same time, whose
 * shares of the link depend on how many SMs issue each. */
extern "C" __global__ void __launch_bounds__(KVCOPY_MAX_THREADS)
    kvcopy_scatter_both(const kvcopy_desc* __restrict__ descs, unsigned long long count_a,
                        unsigned long long tiles_a, unsigned long long ctas_a,
                        unsigned long long count_b, unsigned long long tiles_b,
                        const kvcopy_desc* __restrict__ descs_b) {
    const unsigned long long per_cta = blockDim.x >> 5;
    const unsigned long long in_cta = threadIdx.x >> 5;
    kvcopy_register_copier copier;
    if (blockIdx.x < ctas_a) {
        kvcopy_scatter_warps(copier, descs, count_a, tiles_a, blockIdx.x * per_cta + in_cta,
                             ctas_a * per_cta);
    } else {
        kvcopy_scatter_warps(copier, descs_b, count_b, tiles_b,
                             (blockIdx.x - ctas_a) * per_cta + in_cta,
                             (gridDim.x - ctas_a) * per_cta);
    }
}

__device__ __forceinline__ unsigned long long kvcopy_block_address(unsigned long long base,
                                                                   unsigned long long stride,
                                                                   unsigned long long factor,
                                                                   unsigned long long id,
                                                                   unsigned long long block_bytes) {
    return factor == 1 ? base + id * stride
                       : base + (id / factor) * stride + (id % factor) * block_bytes;
}

/* swap_blocks' copies, warp `warp` of `num_warps`: tile t is part (t % tiles_per_block)
 * of pair (t / tiles_per_block) % num_pairs of tensor t / (tiles_per_block * num_pairs).
 * mapping holds [src id, dst id] pairs. */
__device__ __forceinline__ void kvcopy_blocks_warps(
    const kvcopy_block_tensor* __restrict__ tensors, unsigned long long num_tensors,
    const long long* __restrict__ mapping, unsigned long long num_pairs,
    unsigned long long block_bytes, unsigned long long tiles_per_block, unsigned long long warp,
    unsigned long long num_warps) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned long long tiles_per_tensor = tiles_per_block * num_pairs;
    const unsigned long long total = tiles_per_tensor * num_tensors;
    for (unsigned long long t = warp; t < total; t += num_warps) {
        const unsigned long long k = t / tiles_per_tensor;
        const unsigned long long within = t - k * tiles_per_tensor;
        const unsigned long long pair = within / tiles_per_block;
        const unsigned long long part = within - pair * tiles_per_block;
        const kvcopy_block_tensor tensor = tensors[k];
        const unsigned long long src =
            kvcopy_block_address(tensor.src_base, tensor.src_stride, tensor.src_factor,
                                 (unsigned long long)mapping[2 * pair], block_bytes);
        const unsigned long long dst =
            kvcopy_block_address(tensor.dst_base, tensor.dst_stride, tensor.dst_factor,
                                 (unsigned long long)mapping[2 * pair + 1], block_bytes);
        const unsigned long long offset = part * KVCOPY_TILE_BYTES;
        unsigned long long len = block_bytes - offset;
        if (len > KVCOPY_TILE_BYTES) len = KVCOPY_TILE_BYTES;
        kvcopy_copy_span(reinterpret_cast<const char*>(src) + offset,
                         reinterpret_cast<char*>(dst) + offset, len, lane);
    }
}

/* swap_blocks: the block copies of one tensor table and id mapping, over the grid. */
extern "C" __global__ void __launch_bounds__(KVCOPY_MAX_THREADS)
    kvcopy_blocks(const kvcopy_block_tensor* __restrict__ tensors, unsigned long long num_tensors,
                  const long long* __restrict__ mapping, unsigned long long num_pairs,
                  unsigned long long block_bytes, unsigned long long tiles_per_block) {
    kvcopy_blocks_warps(tensors, num_tensors, mapping, num_pairs, block_bytes, tiles_per_block,
                        kvcopy_warp_index(), kvcopy_warp_count());
}

/* swap_blocks_both_ways: two swap_blocks in one launch, each with its own CTAs (as
 * kvcopy_scatter_both): CTAs [0, ctas_a) copy side a, the others side b. Side b's
 * tensor rows follow side a's num_tensors_a rows, its id pairs side a's num_pairs_a. */
extern "C" __global__ void __launch_bounds__(KVCOPY_MAX_THREADS)
    kvcopy_blocks_both(const kvcopy_block_tensor* __restrict__ tensors,
                       const long long* __restrict__ mapping, unsigned long long num_tensors_a,
                       unsigned long long num_pairs_a, unsigned long long block_bytes_a,
                       unsigned long long ctas_a, unsigned long long num_tensors_b,
                       unsigned long long num_pairs_b, unsigned long long block_bytes_b) {
    const unsigned long long per_cta = blockDim.x >> 5;
    const unsigned long long in_cta = threadIdx.x >> 5;
    if (blockIdx.x < ctas_a) {
        kvcopy_blocks_warps(tensors, num_tensors_a, mapping, num_pairs_a, block_bytes_a,
                            (block_bytes_a + KVCOPY_TILE_BYTES - 1) / KVCOPY_TILE_BYTES,
                            blockIdx.x * per_cta + in_cta, ctas_a * per_cta);
    } else {
        kvcopy_blocks_warps(
            tensors + num_tensors_a, num_tensors_b, mapping + 2 * num_pairs_a, num_pairs_b,
            block_bytes_b, (block_bytes_b + KVCOPY_TILE_BYTES - 1) / KVCOPY_TILE_BYTES,
            (blockIdx.x - ctas_a) * per_cta + in_cta, (gridDim.x - ctas_a) * per_cta);
    }
}
#include "rows_kernel.cuh"
