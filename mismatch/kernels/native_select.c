/* Candidate ranking of mismatch.engines.logits in C, built and loaded by native.py (ctypes).

   `ranked_topk`: each row's k best values ranked by value descending, then token id ascending,
   NaN above every number (NaNs by id), −0 tied with +0 — logits.py's `ranked_topk` rule, the
   one the recorded candidates and the nucleus share. Only comparisons: every value returned is
   a value of the row, copied, so the result is that of the torch code whatever the order of the
   work (tests/test_native_kernels.py compares them on ties, NaN, ±0 and ±inf).

   Each value becomes a 32-bit word whose unsigned order is the ranking (the best first). The
   k-th word is found a byte at a time (radix select: the top byte counted over the row, each
   lower byte over the words that share the bytes above it), the k best are collected in id order
   (ties at the k-th word: the lowest ids) and sorted by word with a stable radix sort, which
   keeps tied words in id order. Counting rather than comparing: a decode step's rows cost a few
   passes each. */

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

/* rank words of n ids (w[id]), ids ascending → sorted by word ascending, ties keeping their
   order (so by id): least significant digit first, 8 bits a pass, stable. */
static void sort_by_word(const uint32_t *w, int64_t *ids, int64_t *tmp, int64_t n) {
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < n; i++) count[((w[ids[i]] >> shift) & 0xFFu) + 1]++;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int64_t i = 0; i < n; i++) tmp[count[(w[ids[i]] >> shift) & 0xFFu]++] = ids[i];
        memcpy(ids, tmp, (size_t)n * sizeof(int64_t));
    }
}

/* x: rows × v float32, row stride ldx (elements); k ≤ v < 2^32 → vals [rows, k] (values of x)
   and ids [rows, k] (int64). Returns 0, or 1 where the work buffer cannot be allocated. */
int mismatch_ranked_topk(const float *x, int64_t rows, int64_t v, int64_t ldx, int64_t k,
                         float *vals, int64_t *ids) {
    if (rows <= 0 || k <= 0) return 0;
    uint32_t *w = malloc((size_t)v * sizeof(uint32_t));
    int64_t *cand = malloc((size_t)v * sizeof(int64_t));
    int64_t *tmp = malloc((size_t)k * sizeof(int64_t));
    if (!w || !cand || !tmp) {
        free(w);
        free(cand);
        free(tmp);
        return 1;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ldx;
        int64_t *sel = ids + r * k;
        /* the words, ascending = best first, and a histogram of their top byte (four
           interleaved copies: most words share it, and one counter would chain the adds) */
        int64_t count4[4][256];
        memset(count4, 0, sizeof(count4));
        int64_t i = 0;
        for (; i + 4 <= v; i += 4) {
            for (int j = 0; j < 4; j++) {
                w[i + j] = ~order_of(row[i + j]);
                count4[j][w[i + j] >> 24]++;
            }
        }
        for (; i < v; i++) {
            w[i] = ~order_of(row[i]);
            count4[0][w[i] >> 24]++;
        }
        /* the k-th smallest word t, a byte at a time (radix select), and how many of its ties
           the k best take (`need`: the lowest ids among them) */
        int64_t need = k;
        int b = 0;
        for (;; b++) {
            int64_t c = count4[0][b] + count4[1][b] + count4[2][b] + count4[3][b];
            if (need <= c) break;
            need -= c;
        }
        uint32_t t = (uint32_t)b << 24;
        int64_t m = 0;
        for (i = 0; i < v; i++) {  /* the candidates: words of that top byte */
            cand[m] = i;
            m += (w[i] >> 24) == (uint32_t)b;
        }
        for (int shift = 16; shift >= 0; shift -= 8) {
            int64_t count[256] = {0};
            for (i = 0; i < m; i++) count[(w[cand[i]] >> shift) & 0xFFu]++;
            for (b = 0; need > count[b]; b++) need -= count[b];
            t |= (uint32_t)b << shift;
            int64_t kept = 0;
            for (i = 0; i < m; i++) {
                cand[kept] = cand[i];
                kept += ((w[cand[i]] >> shift) & 0xFFu) == (uint32_t)b;
            }
            m = kept;
        }
        int64_t n = 0;
        for (i = 0; i < v && n < k; i++) {  /* in id order: ties at t by lowest id */
            int take = w[i] < t || (w[i] == t && need > 0);
            need -= take & (w[i] == t);
            sel[n] = i;
            n += take;
        }
        sort_by_word(w, sel, tmp, k);
        for (i = 0; i < k; i++) vals[r * k + i] = row[sel[i]];
    }
    free(w);
    free(cand);
    free(tmp);
    return 0;
}
