/* The accumulation-model GEMM of mismatch.kernels, built and loaded by native.py (plain C,
   ctypes). It computes what quantize/accumulate.py's `accumulate_matmul` computes, bit for bit
   (tests/test_native_kernels.py). This file alone is compiled with FP contraction on
   (-ffp-contract=fast): its products are exact and so is every sum, so fusing a·b + c into one
   FMA changes no bit here; the other files of the library are compiled with it off. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------
   The accumulation-model GEMM (quantize/accumulate.py, `accumulate_matmul`): per output
   element, per slice of `mk` products along K, the register takes the slice's exact sum and is
   then truncated to `keep` (mode 1: the float64 bits ANDed with a mask) or rounded to FP32
   (mode 0); every `promote` whole slices (0: never) it is added into an FP32 total and cleared.

   Inputs are on the FP8 grid: a's E4M3 codes and b's values (bfloat16 holding E4M3 values), so
   every product is a multiple of 2^-18 below 2^18 and every register-plus-products sum is exact
   in float64 (module docstring of accumulate.py): the products are added one at a time, as
   multiply-adds the compiler may fuse into FMAs, which round nothing here, and the order of
   the sums does not matter.

   Grouped: `groups` GEMMs of one K and N, group g's rows a[row_off[g]:row_off[g+1]] against its
   own b[g] ([K, N] bfloat16, row stride ldb, contiguous rows), results c [rows, N] FP32, each
   group's results multiplied by scale[g] (FP32, one rounding) when scale is not NULL. */

/* A tile is MR rows by NR = 2 vectors of VW doubles: 8 accumulator registers either way (the 16
   ymm registers of AVX2 hold them with room for b and a's broadcast; AVX-512 has 32 zmm). */
#if defined(__AVX512F__)
#define VW 8
#else
#define VW 4
#endif
#define MR 4
#define NR (2 * VW)

typedef double vd __attribute__((vector_size(8 * VW)));
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int64_t vl __attribute__((vector_size(8 * VW)));
typedef uint16_t vh __attribute__((vector_size(2 * VW)));
typedef uint32_t vu __attribute__((vector_size(4 * VW)));

static double e4m3_values[256];

static void e4m3_table(void) {
    for (int code = 0; code < 256; code++) {
        int e = (code >> 3) & 15, m = code & 7;
        double v;
        if (e == 15 && m == 7)
            v = NAN;
        else if (e == 0)
            v = ldexp((double)m, -9); /* subnormal: m / 8 · 2^-6 */
        else
            v = ldexp((double)(8 + m), e - 10); /* (1 + m/8) · 2^(e-7) */
        e4m3_values[code] = (code & 128) ? -v : v;
    }
}

static inline vd fp32_rounded(vd x) {
    return __builtin_convertvector(__builtin_convertvector(x, vf), vd);
}

/* VW bfloat16 values from p, widened to float64 (exact). */
static inline vd bf16_vector(const uint16_t *p) {
    vh bits;
    memcpy(&bits, p, sizeof bits);
    vu wide = __builtin_convertvector(bits, vu) << 16; /* bf16 → fp32 bits */
    vf f;
    memcpy(&f, &wide, sizeof f);
    return __builtin_convertvector(f, vd);
}

/* One tile of `mr` rows by NR columns over the whole of K: b [K, N] bfloat16 from this tile's
   first column, row stride ldb, NR columns readable; nr of them are stored. */
static inline __attribute__((always_inline)) void
acc_tile(const int mr, const uint8_t *a, int64_t lda, const uint16_t *b, int64_t ldb, int64_t k,
         int64_t mk, int mode, uint64_t keep, int64_t promote, float *c, int64_t ldc, int nr,
         const float *scale) {
    vd acc[MR][2], total[MR][2];
    const vl keepv = (vl){0} + (int64_t)keep;
    for (int r = 0; r < MR; r++)
        acc[r][0] = acc[r][1] = total[r][0] = total[r][1] = (vd){0};
    int64_t slices = (k + mk - 1) / mk;
    for (int64_t s = 0; s < slices; s++) {
        int64_t k1 = (s + 1) * mk < k ? (s + 1) * mk : k;
        for (int64_t kk = s * mk; kk < k1; kk++) {
            vd b0 = bf16_vector(b + kk * ldb), b1 = bf16_vector(b + kk * ldb + VW);
            for (int r = 0; r < mr; r++) {
                double av = e4m3_values[a[r * lda + kk]];
                acc[r][0] += av * b0;
                acc[r][1] += av * b1;
            }
        }
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++)
                acc[r][h] = mode == 1 ? (vd)((vl)acc[r][h] & keepv) : fp32_rounded(acc[r][h]);
        if (promote && (s + 1) % promote == 0 && s + 1 < slices) {
            for (int r = 0; r < mr; r++)
                for (int h = 0; h < 2; h++) {
                    total[r][h] = fp32_rounded(total[r][h] + acc[r][h]);
                    acc[r][h] = (vd){0};
                }
        }
    }
    for (int r = 0; r < mr; r++) {
        double y[NR];
        for (int h = 0; h < 2; h++) {
            /* a register never promoted is rounded once (+0.0 turns −0 into +0, as torch's
               zero total does); a promoted one is added into its total */
            vd v = promote ? total[r][h] + acc[r][h] : acc[r][h] + (vd){0};
            memcpy(y + VW * h, &v, sizeof v);
        }
        for (int j = 0; j < nr; j++)
            c[r * ldc + j] = scale ? (float)y[j] * *scale : (float)y[j];
    }
}

static void acc_rows(int64_t m, const uint8_t *a, int64_t lda, const uint16_t *b, int64_t ldb,
                     int64_t k, int64_t n, int64_t mk, int mode, uint64_t keep, int64_t promote,
                     float *c, int64_t ldc, const float *scale, uint16_t *tail) {
    for (int64_t j0 = 0; j0 < n; j0 += NR) {
        int nr = n - j0 < NR ? (int)(n - j0) : NR;
        const uint16_t *bt = b + j0;
        int64_t ldt = ldb;
        if (nr < NR) { /* the last columns, zero-padded to a whole tile */
            for (int64_t kk = 0; kk < k; kk++)
                for (int j = 0; j < NR; j++)
                    tail[kk * NR + j] = j < nr ? b[kk * ldb + j0 + j] : 0;
            bt = tail;
            ldt = NR;
        }
        int64_t r0 = 0;
        for (; r0 + MR <= m; r0 += MR)
            acc_tile(MR, a + r0 * lda, lda, bt, ldt, k, mk, mode, keep, promote,
                     c + r0 * ldc + j0, ldc, nr, scale);
        switch (m - r0) {
        case 3:
            acc_tile(3, a + r0 * lda, lda, bt, ldt, k, mk, mode, keep, promote,
                     c + r0 * ldc + j0, ldc, nr, scale);
            break;
        case 2:
            acc_tile(2, a + r0 * lda, lda, bt, ldt, k, mk, mode, keep, promote,
                     c + r0 * ldc + j0, ldc, nr, scale);
            break;
        case 1:
            acc_tile(1, a + r0 * lda, lda, bt, ldt, k, mk, mode, keep, promote,
                     c + r0 * ldc + j0, ldc, nr, scale);
            break;
        }
    }
}

/* Called once when the library is loaded, before any kernel. */
void mismatch_native_init(void) { e4m3_table(); }

/* Doubles per vector this build computes with (8: AVX-512, 4: AVX2 or narrower). */
int mismatch_native_vector_width(void) { return VW; }

int mismatch_accumulate_grouped(int64_t groups, const int64_t *row_off, const uint8_t *a,
                                int64_t lda, const int64_t *b_addr, int64_t ldb, int64_t k,
                                int64_t n, int64_t mk, int mode, uint64_t keep,
                                int64_t promote, float *c, const float *scale) {
    uint16_t *tail = malloc(sizeof(uint16_t) * NR * (k > 0 ? k : 1));
    if (!tail)
        return -1;
    for (int64_t g = 0; g < groups; g++) {
        int64_t r0 = row_off[g], m = row_off[g + 1] - r0;
        if (m > 0)
            acc_rows(m, a + r0 * lda, lda, (const uint16_t *)(intptr_t)b_addr[g], ldb, k, n, mk,
                     mode, keep, promote, c + r0 * n, n, scale ? scale + g : NULL, tail);
    }
    free(tail);
    return 0;
}
