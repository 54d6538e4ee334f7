/* Candidate ranking of mismatch.engines.logits in C, built and loaded by native.py (ctypes).

   `ranked_topk`: each row's k best values ranked by value descending, then token id ascending,
   NaN above every number (NaNs by id), −0 tied with +0 — logits.py's `ranked_topk` rule, the
   one the recorded candidates and the nucleus share. Only comparisons: every value returned is
   a value of the row, copied, so the result is that of the torch code whatever the order of the
   work (tests/test_native_kernels.py compares them on ties, NaN, ±0 and ±inf).

   Each value and its id make one 64-bit key whose unsigned order is the ranking: the high word
   the value's rank among floats (reversed: the largest first), the low word the id. The k
   smallest keys are found and sorted by one partial quicksort (it sorts only the parts that
   hold ranks < k). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The value's place in the order of floats as an unsigned word, larger for larger values:
   NaN above +inf, −0 equal to +0. */
static inline uint32_t order_of(float v) {
    uint32_t b;
    if (v != v) return 0xFFFFFFFFu;
    if (v == 0.0f) return 0x80000000u;
    memcpy(&b, &v, 4);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

static inline void swap_u64(uint64_t *a, uint64_t *b) {
    uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* Sort a[lo..hi] (inclusive) far enough that a[0..k) holds the k smallest keys, ascending.
   The keys are distinct (each holds its id). */
static void partial_sort(uint64_t *a, int64_t lo, int64_t hi, int64_t k) {
    while (hi - lo >= 16) {
        int64_t mid = lo + (hi - lo) / 2;
        if (a[mid] < a[lo]) swap_u64(&a[mid], &a[lo]);
        if (a[hi] < a[lo]) swap_u64(&a[hi], &a[lo]);
        if (a[hi] < a[mid]) swap_u64(&a[hi], &a[mid]);
        uint64_t pivot = a[mid];
        int64_t i = lo - 1, j = hi + 1;
        for (;;) {  /* Hoare: a[lo..j] <= pivot <= a[j+1..hi] */
            do i++; while (a[i] < pivot);
            do j--; while (a[j] > pivot);
            if (i >= j) break;
            swap_u64(&a[i], &a[j]);
        }
        if (j + 1 < k) partial_sort(a, j + 1, hi, k);  /* the right part holds ranks < k */
        hi = j;
    }
    for (int64_t i = lo + 1; i <= hi; i++) {
        uint64_t t = a[i];
        int64_t j = i - 1;
        while (j >= lo && a[j] > t) {
            a[j + 1] = a[j];
            j--;
        }
        a[j + 1] = t;
    }
}

/* x: rows × v float32, row stride ldx (elements); k ≤ v < 2^32 → vals [rows, k] (values of x)
   and ids [rows, k] (int64). Returns 0, or 1 where the work buffer cannot be allocated. */
int mismatch_ranked_topk(const float *x, int64_t rows, int64_t v, int64_t ldx, int64_t k,
                         float *vals, int64_t *ids) {
    if (rows <= 0 || k <= 0) return 0;
    uint64_t *keys = malloc((size_t)v * sizeof(uint64_t));
    if (!keys) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ldx;
        for (int64_t i = 0; i < v; i++)
            keys[i] = ((uint64_t)(~order_of(row[i])) << 32) | (uint64_t)i;
        partial_sort(keys, 0, v - 1, k);
        for (int64_t i = 0; i < k; i++) {
            int64_t id = (int64_t)(keys[i] & 0xFFFFFFFFu);
            ids[r * k + i] = id;
            vals[r * k + i] = row[id];
        }
    }
    free(keys);
    return 0;
}
