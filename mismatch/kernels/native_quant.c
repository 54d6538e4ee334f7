/* Activation fake-quant of mismatch.kernels in C, built and loaded by native.py (ctypes).

   NVFP4 activations in the serving kernels' order: quantize/schemes.py's `_fake_nvfp4_act`,
   operation for operation in FP32, bit for bit (tests/test_native_kernels.py). This file is
   compiled with FP contraction off (-ffp-contract=off): every product and sum is rounded where
   the torch code rounds it, and no multiply-add becomes an FMA. Comparisons are written so that
   NaN flows through as torch's clamp and max pooling let it (a NaN in a block makes its scale
   NaN, and so every value of the block). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define E4M3_MAX 448.0f
#define E2M1_MAX 6.0f

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float f32_of(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* A non-negative float32 (at most 448, or NaN) rounded to E4M3, nearest with ties to even:
   torch's `.to(torch.float8_e4m3fn).float()` on such values. The quantum is 2^(e−3) for a
   normal value in [2^e, 2^(e+1)), 2^−9 below 2^−6; scaling by a power of two is exact and
   nearbyintf rounds half to even. */
static inline float e4m3_round(float v) {
    if (!(v >= 0x1p-6f)) /* subnormal range, zero, NaN */
        return nearbyintf(v * 512.0f) * 0x1p-9f;
    int e = (int)((f32_bits(v) >> 23) & 0xff) - 127;
    float up = f32_of((uint32_t)(127 + 3 - e) << 23), down = f32_of((uint32_t)(127 + e - 3) << 23);
    return nearbyintf(v * up) * down;
}

/* quantize/formats.py's `e2m1_round_` on one float32 magnitude: clamp to 6, then (m + c) − c
   with c = u · 2^23 built from m's exponent bits. */
static inline float e2m1_round(float m) {
    m = m > E2M1_MAX ? E2M1_MAX : m;
    int32_t c = (int32_t)(f32_bits(m) & 0x7F800000u) + (22 << 23);
    const int32_t cmin = (22 + 127) << 23;
    c = c < cmin ? cmin : c;
    float cf = f32_of((uint32_t)c);
    float t = m + cf;
    return t - cf;
}

/* x [blocks · 16] FP32 → out, NVFP4-activation fake-quantized with the FP32 input_scale. */
void mismatch_fake_nvfp4_act(const float *x, float *out, int64_t blocks, float input_scale) {
    const float gs = 1.0f / input_scale;
    const float inv_gs = 1.0f / gs;
    const float sixth = (float)(1.0 / 6.0);
    for (int64_t blk = 0; blk < blocks; blk++) {
        const float *xb = x + blk * 16;
        float *ob = out + blk * 16;
        float m[16];
        float amax = 0.0f;
        int nan = 0;
        for (int j = 0; j < 16; j++) {
            m[j] = fabsf(xb[j]);
            nan |= m[j] != m[j];
            amax = m[j] > amax ? m[j] : amax;
        }
        if (nan)
            amax = NAN;
        float sf = gs * (amax * sixth);
        sf = sf > E4M3_MAX ? E4M3_MAX : sf;
        sf = e4m3_round(sf);
        float scaled = sf * inv_gs;
        float out_scale = sf != 0.0f ? 1.0f / scaled : 0.0f;
        for (int j = 0; j < 16; j++) {
            float q = copysignf(e2m1_round(m[j] * out_scale), xb[j]);
            q = q * sf;
            ob[j] = q * input_scale;
        }
    }
}
