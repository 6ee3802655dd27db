/* Which host addresses this process may read or write, from /proc/self/maps.
 *
 * The driver dereferences pageable host pointers itself, so a copy from an
 * address that is not mapped kills the process (SIGSEGV) instead of failing.
 * kvcopy checks every pointer the driver does not know against the process's
 * mappings before such a copy is issued. Only pageable pointers are checked:
 * device and pinned memory never come here. Linux only; elsewhere the table
 * is unavailable and nothing is refused.
 */
#ifndef KVCOPY_HOST_MAPS_H
#define KVCOPY_HOST_MAPS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVCOPY_MAP_READ 1u
#define KVCOPY_MAP_WRITE 2u

typedef struct kvcopy_map {
    uint64_t start;
    uint64_t end;
    unsigned flags;
} kvcopy_map;

typedef struct kvcopy_maps {
    kvcopy_map* entries; /* sorted by start, as the kernel lists them */
    int64_t count;
    int available; /* 0: /proc/self/maps could not be read */
} kvcopy_maps;

/* Read the calling process's mappings. Returns 0, or -1 when out of memory. */
static int kvcopy_maps_load(kvcopy_maps* maps) {
    char line[4096];
    int64_t capacity = 256;
    maps->entries = NULL;
    maps->count = 0;
    maps->available = 0;
    FILE* f = fopen("/proc/self/maps", "r");
    if (f == NULL) {
        return 0;
    }
    maps->entries = (kvcopy_map*)malloc((size_t)capacity * sizeof(kvcopy_map));
    if (maps->entries == NULL) {
        fclose(f);
        return -1;
    }
    while (fgets(line, sizeof line, f) != NULL) {
        char* cursor = line;
        uint64_t start = strtoull(cursor, &cursor, 16);
        if (*cursor != '-') {
            continue;
        }
        uint64_t end = strtoull(cursor + 1, &cursor, 16);
        while (*cursor == ' ') {
            cursor++;
        }
        unsigned flags = (cursor[0] == 'r' ? KVCOPY_MAP_READ : 0u) |
                         (cursor[0] != '\0' && cursor[1] == 'w' ? KVCOPY_MAP_WRITE : 0u);
        if (maps->count == capacity) {
            capacity *= 2;
            kvcopy_map* grown =
                (kvcopy_map*)realloc(maps->entries, (size_t)capacity * sizeof(kvcopy_map));
            if (grown == NULL) {
                fclose(f);
                return -1;
            }
            maps->entries = grown;
        }
        maps->entries[maps->count].start = start;
        maps->entries[maps->count].end = end;
        maps->entries[maps->count].flags = flags;
        maps->count++;
        /* a line longer than the buffer (a very long path) continues in the next reads */
        while (strchr(line, '\n') == NULL && fgets(line, sizeof line, f) != NULL) {
        }
    }
    fclose(f);
    maps->available = 1;
    return 0;
}

static void kvcopy_maps_free(kvcopy_maps* maps) {
    free(maps->entries);
    maps->entries = NULL;
    maps->count = 0;
}

/* 1 when every byte of [ptr, ptr + size) lies in mappings that grant `need`
 * (KVCOPY_MAP_READ and/or KVCOPY_MAP_WRITE), else 0. Always 1 when the table
 * could not be read. */
static int kvcopy_maps_allow(const kvcopy_maps* maps, uint64_t ptr, uint64_t size, unsigned need) {
    if (!maps->available) {
        return 1;
    }
    int64_t lo = 0, hi = maps->count;
    while (lo < hi) { /* first entry whose end is above ptr */
        int64_t mid = lo + (hi - lo) / 2;
        if (maps->entries[mid].end <= ptr) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    uint64_t covered = ptr;
    uint64_t want_end = ptr + size;
    for (int64_t i = lo; i < maps->count && covered < want_end; i++) {
        const kvcopy_map* m = &maps->entries[i];
        if (m->start > covered || (m->flags & need) != need) {
            return 0;
        }
        covered = m->end;
    }
    return covered >= want_end;
}

#endif /* KVCOPY_HOST_MAPS_H */
