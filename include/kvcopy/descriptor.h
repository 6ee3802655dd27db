/* The copy descriptor shared by the host (Cython) and the copy kernel (NVRTC).
 * Plain C with no includes, so that NVRTC can compile it as given.
 */
#ifndef KVCOPY_DESCRIPTOR_H
#define KVCOPY_DESCRIPTOR_H

/* Bytes one warp copies as one unit of work. Copies longer than this are split
 * into tiles so that one large block is spread over many warps. A multiple of
 * 16, so tile starts keep the alignment of their copy's start. */
#define KVCOPY_TILE_BYTES 16384ULL

/* At most this many warps share one tile of a small batch (1 KiB each): the
 * kernel splits tiles when it has at least twice as many warps as tiles, and
 * the launches size their grids for it. */
#define KVCOPY_MAX_SPLIT 16ULL

/* The bulk copier's kernels (sm_90+, GPU-to-host): CTAs of KVCOPY_BULK_WARPS warps,
 * each with a ring of KVCOPY_BULK_STAGES shared-memory buffers of
 * KVCOPY_BULK_STAGE_BYTES (32 KiB per CTA), and KVCOPY_BULK_LAG + 1 loads in flight
 * (LAG < STAGES: a buffer is refilled only once its piece's store has read it). */
#define KVCOPY_BULK_WARPS 2
#define KVCOPY_BULK_THREADS (32 * KVCOPY_BULK_WARPS)
#define KVCOPY_BULK_STAGES 8
#define KVCOPY_BULK_STAGE_BYTES 2048ULL
#define KVCOPY_BULK_LAG 5

/* One copy: device-visible source and destination, byte count, and the index of
 * its first tile in the batch (an exclusive prefix sum of tile counts). */
typedef struct kvcopy_desc {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long size;
    unsigned long long tile_start;
} kvcopy_desc;

/* A batch's copies in half the bytes, where every copy has the same size (one tile
 * at most, passed to the kernel beside them) and copy i is tile i: the common
 * KV-cache batch. Written by the host and read by the kernel in place, so half
 * the bytes cost half the time on both sides (and half the descriptor reads
 * over the link). */
typedef struct kvcopy_compact_desc {
    unsigned long long src;
    unsigned long long dst;
} kvcopy_compact_desc;

/* Descriptors passed by value as a kernel parameter. Kernel parameters are
 * copied into the launch (and into a captured graph node), so no host or device
 * buffer has to outlive the call: this is what makes the kernel path safe under
 * stream capture. 1000 descriptors keep the struct under the 32764-byte
 * parameter limit of CUDA >= 12.1 on sm_70+; the small variant fits the
 * 4096-byte limit of older drivers. */
#define KVCOPY_INLINE_MAX 1000
#define KVCOPY_INLINE_MAX_SMALL 127
/* A decode step's batch (tens of blocks) in 1 KiB of parameters: the driver and the
 * GPU's front end move a quarter of the small variant's bytes per launch. */
#define KVCOPY_INLINE_MAX_TINY 31

typedef struct kvcopy_inline_batch {
    unsigned long long count;
    unsigned long long total_tiles;
    kvcopy_desc descs[KVCOPY_INLINE_MAX];
} kvcopy_inline_batch;

typedef struct kvcopy_inline_batch_tiny {
    unsigned long long count;
    unsigned long long total_tiles;
    kvcopy_desc descs[KVCOPY_INLINE_MAX_TINY];
} kvcopy_inline_batch_tiny;

typedef struct kvcopy_inline_batch_small {
    unsigned long long count;
    unsigned long long total_tiles;
    kvcopy_desc descs[KVCOPY_INLINE_MAX_SMALL];
} kvcopy_inline_batch_small;

/* One pair of tensors of a block copy (swap_blocks): the kernel computes each
 * block's address from these and the block-id mapping, so the host does O(1)
 * work per tensor and none per block. A block id b of a side with factor f
 * (blocks that hold f smaller blocks) lives at
 * base + (b / f) * stride + (b % f) * block_bytes. */
typedef struct kvcopy_block_tensor {
    unsigned long long src_base;
    unsigned long long dst_base;
    unsigned long long src_stride;
    unsigned long long dst_stride;
    unsigned long long src_factor;
    unsigned long long dst_factor;
} kvcopy_block_tensor;

#endif /* KVCOPY_DESCRIPTOR_H */
