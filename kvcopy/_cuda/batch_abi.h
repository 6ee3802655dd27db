/* The two C ABIs of cuMemcpyBatchAsync, declared independently of cuda.h.
 *
 * CUDA 12.8/12.9 drivers export cuMemcpyBatchAsync with a `size_t *failIdx`
 * argument before the stream; CUDA 13.0 dropped it (`cuMemcpyBatchAsync_v2`).
 * A 13.x driver resolves both through cuGetProcAddress (by requested
 * version), to different functions. Calling one through the other's
 * signature shifts the stream argument and crashes, so kvcopy resolves the
 * entry point itself and calls it through exactly one of these typedefs.
 * Declaring them here (not taking them from cuda.h) keeps one binary valid
 * whatever cuda.h it was compiled against.
 */
#ifndef KVCOPY_BATCH_ABI_H
#define KVCOPY_BATCH_ABI_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Mirrors CUmemLocation (12.8 and 13.x have the same layout). */
typedef struct kvcopy_mem_location {
    int type;
    int id;
} kvcopy_mem_location;

/* Mirrors CUmemcpyAttributes_v1. */
typedef struct kvcopy_memcpy_attributes {
    int src_access_order;
    kvcopy_mem_location src_loc_hint;
    kvcopy_mem_location dst_loc_hint;
    unsigned int flags;
} kvcopy_memcpy_attributes;

/* CUmemcpySrcAccessOrder and CUmemcpyFlags values (identical in 12.8 and 13.x). */
#define KVCOPY_SRC_ACCESS_ORDER_STREAM 1
#define KVCOPY_SRC_ACCESS_ORDER_ANY 3
#define KVCOPY_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE 1

/* CUresult is a C enum: int-sized on every supported platform. */
typedef int (*kvcopy_batch_v12080_fn)(unsigned long long* dsts, unsigned long long* srcs,
                                      size_t* sizes, size_t count, kvcopy_memcpy_attributes* attrs,
                                      size_t* attr_idxs, size_t num_attrs, size_t* fail_idx,
                                      void* stream);

typedef int (*kvcopy_batch_v13000_fn)(unsigned long long* dsts, unsigned long long* srcs,
                                      size_t* sizes, size_t count, kvcopy_memcpy_attributes* attrs,
                                      size_t* attr_idxs, size_t num_attrs, void* stream);

/* Which ABI the resolved entry point has. */
#define KVCOPY_BATCH_ABI_NONE 0
#define KVCOPY_BATCH_ABI_12080 12080
#define KVCOPY_BATCH_ABI_13000 13000

#ifdef __cplusplus
}
#endif

#endif /* KVCOPY_BATCH_ABI_H */
