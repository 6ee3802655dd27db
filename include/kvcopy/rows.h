/* A rows job: the layout kernel's whole work, passed by value (so that a captured
 * graph keeps it). Plain C with no includes, so that NVRTC can compile it as given.
 *
 * Each of num_planes planes (a layer's K or V, one run of fragments, ...) copies
 * `rows` rows, first_row .. first_row + rows - 1 (a chunk of a longer transfer reads
 * the caller's index arrays where they lie and reports by the caller's row); a row
 * is `pieces` pieces of `piece_bytes`. A side maps row r to a slot (indices[r] where
 * it has an index array, else r), and slot s, piece j of plane p to
 *     base_p + (s / page_size) * page_stride + (s % page_size) * slot_stride
 *            + j * piece_stride
 * where base_p is planes[p].src (or .dst). A negative index skips its row on
 * purpose; an index >= slots skips it as out of range and is counted in the
 * module's kvcopy_rows_report.
 *
 * Where `only_skipped_by.indices` is set, the job copies only the rows that index array
 * skips (negative, or >= only_skipped_by.slots), reporting none: a staged store fills the
 * staging rows its gather leaves, so that the destination keeps its own bytes there. */
#ifndef KVCOPY_ROWS_H
#define KVCOPY_ROWS_H

/* Planes per launch: the job stays under the 4 KiB parameter limit of every driver. */
#define KVCOPY_ROWS_PLANES 128

typedef struct kvcopy_rows_side {
    unsigned long long indices;      /* device-visible int64 slots, one per row; 0: slot = row */
    unsigned long long slots;        /* an index >= slots is out of range */
    unsigned long long page_size;    /* slots per page */
    unsigned long long page_stride;  /* bytes from a page to the next */
    unsigned long long slot_stride;  /* bytes from a slot to the next within a page */
    unsigned long long piece_stride; /* bytes from a piece of a row to the next */
} kvcopy_rows_side;

typedef struct kvcopy_rows_plane {
    unsigned long long src;
    unsigned long long dst;
} kvcopy_rows_plane;

typedef struct kvcopy_rows_job {
    kvcopy_rows_side src;
    kvcopy_rows_side dst;
    kvcopy_rows_side only_skipped_by; /* indices and slots only; indices 0: every row */
    unsigned long long first_row;     /* the job copies rows first_row .. first_row + rows - 1 */
    unsigned long long rows;
    unsigned long long pieces;
    unsigned long long piece_bytes;
    unsigned long long units_per_tile; /* pieces one warp takes at once; 0: one tile each */
    unsigned long long tiles_per_plane;
    unsigned long long num_planes;
    kvcopy_rows_plane planes[KVCOPY_ROWS_PLANES];
} kvcopy_rows_job;

/* What the layout kernel met since the host last read and cleared it: row copies
 * skipped for an out-of-range index, and the lowest such row (~0 when none). */
typedef struct kvcopy_rows_status {
    unsigned long long skipped;
    unsigned long long first_row;
} kvcopy_rows_status;

#endif /* KVCOPY_ROWS_H */
