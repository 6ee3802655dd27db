# kvcopy_desc and the kernel's parameter structs (include/kvcopy/descriptor.h),
# shared by the describe pass and the launches.
cdef extern from "kvcopy/descriptor.h":
    unsigned long long KVCOPY_TILE_BYTES
    int KVCOPY_INLINE_MAX
    int KVCOPY_INLINE_MAX_SMALL
    int KVCOPY_INLINE_MAX_TINY
    unsigned long long KVCOPY_MAX_SPLIT
    int KVCOPY_BULK_THREADS
    ctypedef struct kvcopy_desc:
        unsigned long long src
        unsigned long long dst
        unsigned long long size
        unsigned long long tile_start
    ctypedef struct kvcopy_compact_desc:
        unsigned long long src
        unsigned long long dst
    ctypedef struct kvcopy_block_tensor:
        unsigned long long src_base
        unsigned long long dst_base
        unsigned long long src_stride
        unsigned long long dst_stride
        unsigned long long src_factor
        unsigned long long dst_factor
    ctypedef struct kvcopy_inline_batch:
        unsigned long long count
        unsigned long long total_tiles
        kvcopy_desc descs[1000]
