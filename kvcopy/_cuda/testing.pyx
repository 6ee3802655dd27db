# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""Entry points for kvcopy's own tests and probes (see kvcopy.testing): the
describe pass with memory ranges known in advance, or with seeded answers standing
in for the driver, so that it runs on a CPU."""

from libc.stdint cimport uint64_t, uintptr_t, int64_t
from libc.stdlib cimport malloc, free

from kvcopy._cuda.classify cimport _Classifier, classifier_init, classifier_seed
from kvcopy._cuda.describe cimport describe_with


def describe_copies_in(const int64_t[:, ::1] known_ranges, const uint64_t[::1] src,
                       const uint64_t[::1] dst, const uint64_t[::1] sizes, uintptr_t descs_out,
                       bint merge=True, bint fast=True, bint compact=False):
    """describe_copies with memory ranges known in advance, for tests and for timing
    the pass itself: rows of (start, end, kind, ordinal, delta), as the driver's
    answers would be; pointers outside them are still asked of the driver.
    ``fast=False`` keeps to the general loop; ``compact`` allows kvcopy_compact_desc
    entries, as describe_compact. Returns the DescribedBatch and whether the
    vectorised pass applied."""
    cdef _Classifier* sides = <_Classifier*>malloc(2 * sizeof(_Classifier))
    cdef bint used = fast
    if sides == NULL:
        raise MemoryError()
    try:
        classifier_init(&sides[0], src.shape[0])
        classifier_init(&sides[1], src.shape[0])
        classifier_seed(&sides[0], known_ranges)
        classifier_seed(&sides[1], known_ranges)
        result = describe_with(src, dst, sizes, descs_out, merge, sides, &used, compact)
        return result, used
    finally:
        free(sides)


def describe_copies_answered(const int64_t[:, ::1] driver_ranges, const uint64_t[::1] src,
                             const uint64_t[::1] dst, const uint64_t[::1] sizes,
                             uintptr_t descs_out, bint merge=True, bint fast=True):
    """describe_copies where ``driver_ranges`` (rows as for describe_copies_in) stand
    in for the driver itself: every range a side looks up, or joins, is asked of
    them, as it would be of the driver, and an address in none of them is pageable.
    With no rows the driver itself answers (a GPU test counts its questions).
    Returns the DescribedBatch, whether the vectorised pass applied, and how many
    ranges each side asked for (src, dst)."""
    cdef _Classifier* sides = <_Classifier*>malloc(2 * sizeof(_Classifier))
    cdef bint used = fast
    if sides == NULL:
        raise MemoryError()
    if driver_ranges.shape[1] != 5:
        free(sides)
        raise ValueError("driver_ranges must be (k, 5)")
    try:
        for side in range(2):
            classifier_init(&sides[side], src.shape[0])
            sides[side].answers = &driver_ranges[0, 0] if driver_ranges.shape[0] else NULL
            sides[side].answer_count = driver_ranges.shape[0]
        result = describe_with(src, dst, sizes, descs_out, merge, sides, &used, False)
        return result, used, (sides[0].queries, sides[1].queries)
    finally:
        free(sides)
