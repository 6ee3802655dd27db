/* The layout kernel: copies whose addresses it computes itself from a kvcopy_rows_job
 * (rows.h) and index arrays in device-visible memory. Each index is checked before
 * the row it names is written: an out-of-range index skips its row (never a write
 * elsewhere) and is counted in kvcopy_rows_report, which the host reads and clears
 * (kvcopy.check_indices). Included by copy_kernel.cuh, whose span copier it uses. */
#include "rows.h"

__device__ kvcopy_rows_status kvcopy_rows_report = {0ULL, ~0ULL};

/* Row `row`'s slot on a side; false where the row is skipped: a negative index, or
 * one out of range (which also sets *bad). */
__device__ __forceinline__ bool kvcopy_row_slot(const kvcopy_rows_side& side,
                                                unsigned long long row, unsigned long long* slot,
                                                bool* bad) {
    if (!side.indices) {
        *slot = row;
        return true;
    }
    const long long index = reinterpret_cast<const long long*>(side.indices)[row];
    if (index < 0) return false;
    if ((unsigned long long)index >= side.slots) {
        *bad = true;
        return false;
    }
    *slot = (unsigned long long)index;
    return true;
}

__device__ __forceinline__ unsigned long long kvcopy_row_address(const kvcopy_rows_side& side,
                                                                 unsigned long long base,
                                                                 unsigned long long slot,
                                                                 unsigned long long piece) {
    const unsigned long long page = side.page_size == 1 ? slot : slot / side.page_size;
    const unsigned long long within = slot - page * side.page_size;
    return base + page * side.page_stride + within * side.slot_stride + piece * side.piece_stride;
}

/* Unit u of plane p (piece u % pieces of row u / pieces): its source and destination,
 * or false where it is skipped. `report`: count an out-of-range index (once per row
 * and plane: by the unit holding the row's first piece, first part). */
__device__ __forceinline__ bool kvcopy_rows_unit(const kvcopy_rows_job& job, unsigned long long p,
                                                 unsigned long long u, bool report,
                                                 unsigned long long* src, unsigned long long* dst) {
    const unsigned long long local = job.pieces == 1 ? u : u / job.pieces;
    const unsigned long long piece = u - local * job.pieces;
    const unsigned long long row = job.first_row + local;
    unsigned long long s = 0, d = 0;
    bool bad = false;
    if (job.only_skipped_by.indices) {
        unsigned long long ignored = 0;
        if (kvcopy_row_slot(job.only_skipped_by, row, &ignored, &bad)) return false;
        bad = false; /* reported by the job that skipped it */
    }
    const bool src_ok = kvcopy_row_slot(job.src, row, &s, &bad);
    const bool dst_ok = kvcopy_row_slot(job.dst, row, &d, &bad);
    if (bad) {
        if (report && piece == 0) {
            atomicAdd(&kvcopy_rows_report.skipped, 1ULL);
            atomicMin(&kvcopy_rows_report.first_row, row);
        }
        return false;
    }
    if (!src_ok || !dst_ok) return false;
    *src = kvcopy_row_address(job.src, job.planes[p].src, s, piece);
    *dst = kvcopy_row_address(job.dst, job.planes[p].dst, d, piece);
    return true;
}

/* Up to 32 units of `words` words each, one per lane's (src, dst, ok): the warp copies
 * them word by word, UNROLL loads per lane in flight before their stores, so that
 * 128-byte fragments keep as many bytes in flight as a 16 KiB tile does. */
template <typename Word>
__device__ __forceinline__ void kvcopy_rows_gather(unsigned long long src, unsigned long long dst,
                                                   bool ok, unsigned units, unsigned words,
                                                   unsigned lane) {
    const unsigned total = units * words;
    for (unsigned base = 0; base < total; base += 32u * KVCOPY_UNROLL) {
        Word regs[KVCOPY_UNROLL];
        unsigned long long to[KVCOPY_UNROLL];
        bool live[KVCOPY_UNROLL];
#pragma unroll
        for (int k = 0; k < KVCOPY_UNROLL; ++k) {
            const unsigned w = base + lane + 32u * k;
            unsigned unit = w / words;
            if (unit > 31u) unit = 31u;
            const unsigned long long s = __shfl_sync(0xffffffffu, src, unit);
            const unsigned long long d = __shfl_sync(0xffffffffu, dst, unit);
            const int v = __shfl_sync(0xffffffffu, ok ? 1 : 0, unit);
            const unsigned long long offset = (unsigned long long)(w - unit * words) * sizeof(Word);
            live[k] = w < total && v;
            to[k] = d + offset;
            if (live[k]) regs[k] = *reinterpret_cast<const Word*>(s + offset);
        }
#pragma unroll
        for (int k = 0; k < KVCOPY_UNROLL; ++k)
            if (live[k]) *reinterpret_cast<Word*>(to[k]) = regs[k];
    }
}

/* The OR of every lane's value: the warp's common alignment. */
__device__ __forceinline__ unsigned long long kvcopy_warp_or(unsigned long long value) {
#pragma unroll
    for (int step = 16; step > 0; step >>= 1) value |= __shfl_xor_sync(0xffffffffu, value, step);
    return value;
}

/* The layout kernel: tile t is plane t / tiles_per_plane; within a plane a tile is
 * units_per_tile consecutive units (pieces up to half a tile), or one part of
 * KVCOPY_TILE_BYTES of one unit (longer pieces). */
extern "C" __global__ void __launch_bounds__(KVCOPY_MAX_THREADS)
    kvcopy_rows(const __grid_constant__ kvcopy_rows_job job) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned long long units = job.rows * job.pieces;
    const unsigned long long total = job.tiles_per_plane * job.num_planes;
    const unsigned long long num_warps = kvcopy_warp_count();
    for (unsigned long long t = kvcopy_warp_index(); t < total; t += num_warps) {
        const unsigned long long p = t / job.tiles_per_plane;
        const unsigned long long local = t - p * job.tiles_per_plane;
        if (job.units_per_tile == 0) {
            const unsigned long long parts =
                (job.piece_bytes + KVCOPY_TILE_BYTES - 1) / KVCOPY_TILE_BYTES;
            const unsigned long long unit = local / parts;
            const unsigned long long part = local - unit * parts;
            unsigned long long src = 0, dst = 0;
            const bool ok = kvcopy_rows_unit(job, p, unit, part == 0 && lane == 0, &src, &dst);
            if (!ok) continue;
            const unsigned long long offset = part * KVCOPY_TILE_BYTES;
            unsigned long long len = job.piece_bytes - offset;
            if (len > KVCOPY_TILE_BYTES) len = KVCOPY_TILE_BYTES;
            kvcopy_copy_span(reinterpret_cast<const char*>(src + offset),
                             reinterpret_cast<char*>(dst + offset), len, lane);
            continue;
        }
        const unsigned long long first = local * job.units_per_tile;
        const unsigned long long left = units - first;
        const unsigned count = (unsigned)(left < job.units_per_tile ? left : job.units_per_tile);
        unsigned long long src = 0, dst = 0;
        const bool ok = lane < count && kvcopy_rows_unit(job, p, first + lane, true, &src, &dst);
        const unsigned long long align = kvcopy_warp_or(ok ? (src | dst) : 0ULL) | job.piece_bytes;
        const unsigned bytes = (unsigned)job.piece_bytes;
        if ((align & 15) == 0) {
            kvcopy_rows_gather<uint4>(src, dst, ok, count, bytes / 16, lane);
        } else if ((align & 7) == 0) {
            kvcopy_rows_gather<unsigned long long>(src, dst, ok, count, bytes / 8, lane);
        } else if ((align & 3) == 0) {
            kvcopy_rows_gather<unsigned int>(src, dst, ok, count, bytes / 4, lane);
        } else {
            kvcopy_rows_gather<unsigned char>(src, dst, ok, count, bytes, lane);
        }
    }
}
