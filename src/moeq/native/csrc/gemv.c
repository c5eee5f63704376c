// Small-batch matmuls (gemv, 1-64 rows of x) for the packed formats and bf16: y = x @ dequant(W)^T. Each is tested
// against dequantize + matmul within fp32 accumulation tolerance.
#include "moeq.h"
#include "rtn4_rows.h"
#include "rows_avx2.h"

// y[M, N] = x[M, K] @ dequant(W)^T, fp32 accumulation. xe/xo: x split into even/odd k (fp32, [M, K/2] each, 4-bit)
// or xe = x ([M, K], 8-bit); xsum: per-group sums of x [M, G] (for the zero point). M <= 8.
#if defined(__AVX512F__)
// One output row for a compile-time M (keeps the accumulators in registers). This exact form (8-bit x addressed
// from the group base, U = CHAINS(M) chains with a tail loop, two accumulator sets summed per group) measured
// close to twice the bandwidth of simpler-looking variants for the 8-bit M=1 gemv (every 4-bit preset's lm_head),
// side by side; more chains (U > 1) and split 4-bit accumulators measured slower.
#define CHAINS(M) 1
static inline __attribute__((always_inline)) void rtn_row_avx512(
    const float* xe, const float* xo, const float* xsum, const i64 M, const uint8_t* q, const void* scale,
    int scale_bf16, const uint8_t* zero, int bits, i64 n, i64 K, i64 gs, float* out, float* zt) {
    const i64 G = K / gs;
    const int U = CHAINS(M);
    const float half = (float)(1 << (bits - 1));
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (i64 g = 0; g < G; g++) {
        const float s = load_scale(scale, scale_bf16, n * G + g);
        const float z = zero ? (float)zero[n * G + g] : half;
        for (i64 m = 0; m < M; m++) zt[m] += z * s * xsum[m * G + g];
        __m512 v[8][4], w[8][4];
        for (i64 m = 0; m < M; m++)
            for (int u = 0; u < U; u++) v[m][u] = w[m][u] = _mm512_setzero_ps();
        if (bits == 8) {
            const uint8_t* qq = q + n * K + g * gs;
            const float* xg = xe + g * gs;
            i64 k = 0;
            for (; k + 16 * U <= gs; k += 16 * U)
                for (int u = 0; u < U; u++) {
                    __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i*)(qq + k + 16 * u))));
                    for (i64 m = 0; m < M; m++)
                        v[m][u] = _mm512_fmadd_ps(c, _mm512_loadu_ps(xg + m * K + k + 16 * u), v[m][u]);
                }
            for (; k < gs; k += 16) {
                __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qq + k))));
                for (i64 m = 0; m < M; m++) v[m][0] = _mm512_fmadd_ps(c, _mm512_loadu_ps(xg + m * K + k), v[m][0]);
            }
        } else {
            const uint8_t* qq = q + n * (K / 2) + g * gs / 2;
            for (i64 j = 0; j < gs / 2; j += 16) {
                __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qq + j)));
                __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                const i64 o = g * gs / 2 + j;
                for (i64 m = 0; m < M; m++) {
                    v[m][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xe + m * (K / 2) + o), v[m][0]);
                    v[m][0] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xo + m * (K / 2) + o), v[m][0]);
                }
            }
        }
        const __m512 sv = _mm512_set1_ps(s);
        for (i64 m = 0; m < M; m++) {
            __m512 t = _mm512_add_ps(v[m][0], w[m][0]);
            for (int u = 1; u < U; u++) t = _mm512_add_ps(t, _mm512_add_ps(v[m][u], w[m][u]));
            acc[m] = _mm512_fmadd_ps(t, sv, acc[m]);
        }
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif

void moeq_rtn_gemv(const float* xe, const float* xo, const float* xsum, i64 M, const uint8_t* q, const void* scale,
                   int scale_bf16, const uint8_t* zero, int bits, i64 N, i64 K, i64 gs, float* y) {
    const i64 G = K / gs;
    const float half = (float)(1 << (bits - 1));
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
#if defined(__AVX512F__)
        if (gs % 32 == 0) {  // rows of x in chunks of 8: the weight row is re-read from L1, not memory
            for (i64 m0 = 0; m0 < M; m0 += 8) {
                const i64 mc = M - m0 < 8 ? M - m0 : 8;
                const i64 xs = bits == 8 ? K : K / 2;
                const float* e = xe + m0 * xs;
                const float* o = xo ? xo + m0 * xs : xo;
                float zt[8] = {0}, out[8] = {0};
                switch (mc) {
#define RTN_CASE(c) case c: rtn_row_avx512(e, o, xsum + m0 * G, c, q, scale, scale_bf16, zero, bits, n, K, gs, out, zt); break;
                    RTN_CASE(1) RTN_CASE(2) RTN_CASE(3) RTN_CASE(4) RTN_CASE(5) RTN_CASE(6) RTN_CASE(7) RTN_CASE(8)
#undef RTN_CASE
                }
                for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = out[m] - zt[m];
            }
            continue;
        }
#elif defined(MOEQ_AVX2)
        if (gs % 16 == 0) {
            for (i64 m0 = 0; m0 < M; m0 += 8) {
                const i64 mc = M - m0 < 8 ? M - m0 : 8;
                const i64 xs = bits == 8 ? K : K / 2;
                const float* e = xe + m0 * xs;
                const float* o = xo ? xo + m0 * xs : xo;
                float out[8] = {0};
                switch (mc) {
#define RTN_CASE(c) case c: rtn_row_avx2(e, o, c, q, scale, scale_bf16, bits, n, K, gs, out); break;
                    RTN_CASE(1) RTN_CASE(2) RTN_CASE(3) RTN_CASE(4) RTN_CASE(5) RTN_CASE(6) RTN_CASE(7) RTN_CASE(8)
#undef RTN_CASE
                }
                for (i64 m = 0; m < mc; m++) {
                    float zt = 0.f;
                    for (i64 g = 0; g < G; g++)
                        zt += (zero ? (float)zero[n * G + g] : half) * load_scale(scale, scale_bf16, n * G + g) *
                              xsum[(m0 + m) * G + g];
                    y[(m0 + m) * N + n] = out[m] - zt;
                }
            }
            continue;
        }
#endif
        float zt[64] = {0}, out[64] = {0};
        {
            for (i64 g = 0; g < G; g++) {
                const float s = load_scale(scale, scale_bf16, n * G + g);
                const float z = zero ? (float)zero[n * G + g] : half;
                for (i64 m = 0; m < M; m++) {
                    float a = 0.f;
                    if (bits == 8) {
                        const uint8_t* qq = q + n * K + g * gs;
                        const float* xx = xe + m * K + g * gs;
                        for (i64 k = 0; k < gs; k++) a += (float)qq[k] * xx[k];
                    } else {
                        const uint8_t* qq = q + n * (K / 2) + g * gs / 2;
                        const float* e = xe + m * (K / 2) + g * gs / 2;
                        const float* o = xo + m * (K / 2) + g * gs / 2;
                        for (i64 j = 0; j < gs / 2; j++) a += (float)(qq[j] & 15) * e[j] + (float)(qq[j] >> 4) * o[j];
                    }
                    out[m] += a * s;
                    zt[m] += z * s * xsum[m * G + g];
                }
            }
        }
        for (i64 m = 0; m < M; m++) y[m * N + n] = out[m] - zt[m];
    }
}

// 4-bit RTN with bf16 activations: AVX512-BF16 dot products (vdpbf16ps, two weights per fp32 lane). Each packed
// byte b (element 2j low nibble, 2j+1 high nibble) becomes the bf16 pair (128 + lo, 128 + hi): 0x4300 | c is
// bf16(128 + c) exactly, so one shift, one or and one ternary-logic op build 32 weights; the +128 (and the zero
// point) come out through per-group sums of x: sum (c - z) x = sum (c + 128) x - (z + 128) sum x. Products are exact
// in fp32; only the summation order differs from the fp32 path. ~1.5-2x fewer instructions per weight.
int moeq_has_dpbf16(void) {  // and AVX512-VNNI (the 8-bit kernel's int16 dot products); every such CPU has both
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

// Which SIMD kernels the library was built with: 2 AVX512-BF16/VNNI (bf16 activations through dot products), 1 AVX2 +
// FMA (fp32 activations; rows_avx2.h), 0 plain C.
// The 3-bit codebook rows on AVX512-BF16 unpack their 24-bit words with VBMI byte permutes (else a scalar unpack).
int moeq_has_cb3_dot(void) {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
    return 1;
#else
    return 0;
#endif
}

int moeq_simd_level(void) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    return 2;
#elif defined(MOEQ_AVX2)
    return 1;
#else
    return 0;
#endif
}


// y[M, N] = x[M, K] @ dequant(W)^T for 4-bit RTN, x bf16 (raw uint16 bits) with per-group sums xsum [M, G] (fp32,
// of the bf16 values). gs % 32 == 0; perm64 (gs % 64 == 0): x is in x_to_bf16's permuted order.
void moeq_rtn4_gemv_bf16(const uint16_t* xb, const float* xsum, i64 M, const uint8_t* q, const void* scale,
                         int scale_bf16, const uint8_t* zero, i64 N, i64 K, i64 gs, float* y, int perm64) {
    const i64 G = K / gs;
#if defined(__AVX512BF16__)
    if (M == 1 && perm64) {  // decode's common case in a loop of its own (faster than via the M loop, measured)
        if (scale_bf16 == 1 && !zero) {
#pragma omp parallel for schedule(static)
            for (i64 n = 0; n < N; n++) y[n] = rtn4_row1_p64(xb, xsum, q, scale, 1, NULL, n, K, gs);
        } else {
#pragma omp parallel for schedule(static)
            for (i64 n = 0; n < N; n++) y[n] = rtn4_row1_p64(xb, xsum, q, scale, scale_bf16, zero, n, K, gs);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        for (i64 m0 = 0; m0 < M; m0 += 8) {
            const i64 mc = M - m0 < 8 ? M - m0 : 8;
            float zt[8] = {0}, out[8] = {0};
#if defined(__AVX512BF16__)
            rtn4_row_bf16(perm64, xb + m0 * K, xsum + m0 * G, mc, q, scale, scale_bf16, zero, n, K, gs, out, zt);
#else
            for (i64 g = 0; g < G; g++) {
                const float s = load_scale(scale, scale_bf16, n * G + g);
                const float z = zero ? (float)zero[n * G + g] : 8.f;
                const uint8_t* qq = q + n * (K / 2) + g * gs / 2;
                for (i64 m = 0; m < mc; m++) {
                    const uint16_t* xx = xb + (m0 + m) * K + g * gs;
                    float a = 0.f;
                    for (i64 j = 0; j < gs / 2; j++) {
                        const i64 k0 = 2 * j, k1 = 2 * j + 1;
                        const i64 p0 = perm64 ? (k0 & ~(i64)63) + ((k0 & 63) >> 1) : k0;
                        const i64 p1 = perm64 ? (k1 & ~(i64)63) + 32 + ((k1 & 63) >> 1) : k1;
                        a += ((float)(qq[j] & 15) - z) * bf2f(xx[p0]) + ((float)(qq[j] >> 4) - z) * bf2f(xx[p1]);
                    }
                    out[m] += a * s;
                }
            }
#endif
            for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = out[m] - zt[m];
        }
    }
}

// 8-bit RTN with bf16 activations through int16 dot products (AVX512-VNNI vpdpwssd, 32 weights per instruction):
// each group of x is scaled by a power of two, s = 2^(e - 15) with max|x| < 2^e, and rounded to int16. A bf16 value
// has 8 significant bits, so every element within 2^7 of its group's largest is exact and the rest are off by at
// most max|x| 2^-16; the codes (0..255) widen to int16 as they are. sum (c - z) x = s (sum c xq - z sum xq), in
// int32 (chunks of 4096 weights cannot overflow: 4096/16 pairs of |c xq| <= 255 * 32640 per lane), then fp32.
// Replaces two bf16 dot products per 32 weights (the codes split into nibbles); on the 151936x2048 lm_head at one
// row, side by side: as fast as a plain read of the weights (README, Benchmarks).
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
// One row of bf16 x -> xq int16 [K], per group: scale sx, and sx * sum xq (the zero-point term's sum of x). A group
// holding NaN/Inf gets a NaN scale, so its outputs come out NaN; groups below 1e-30 count as zero.
static void x_to_i16(const uint16_t* x, i64 K, i64 gs, int16_t* xq, float* sx, float* xs) {
    for (i64 g = 0; g < K / gs; g++) {
        const uint16_t* xg = x + g * gs;
        int16_t* qg = xq + g * gs;
        float amax = 0.f;
        int bad = 0;
        for (i64 k = 0; k < gs; k++) {
            const float a = fabsf(bf2f(xg[k]));
            bad |= !(a <= 3.402823466e38f);
            amax = a > amax ? a : amax;
        }
        if (bad || amax < 1e-30f) {
            memset(qg, 0, (size_t)gs * sizeof(int16_t));
            sx[g] = xs[g] = bad ? NAN : 0.f;
            continue;
        }
        int e;
        frexpf(amax, &e);
        const float inv = ldexpf(1.f, 15 - e);
        int64_t sum = 0;
        for (i64 k = 0; k < gs; k++) {
            const int16_t v = (int16_t)lrintf(bf2f(xg[k]) * inv);
            qg[k] = v;
            sum += v;
        }
        sx[g] = ldexpf(1.f, e - 15);
        xs[g] = sx[g] * (float)sum;
    }
}

#ifndef R8_PREFETCH
#define R8_PREFETCH 2048
#endif
static inline __attribute__((always_inline)) void rtn8_row_i16(
    const int16_t* xq, const float* sx, const float* xs, const i64 M, const uint8_t* q, const void* scale,
    int scale_bf16, const uint8_t* zero, i64 n, i64 K, i64 gs, float* out, float* zt) {
    const i64 G = K / gs;
    float sf[G + 16], sfx[M * G + 16];
    row_scales(scale, scale_bf16, zero, 128.f, 0.f, xs, M, n, G, sf, zt);
    for (i64 m = 0; m < M; m++)  // the group scales times each x row's: one broadcast operand per (row, group)
        for (i64 g = 0; g < G; g += 16) {
            const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
            _mm512_mask_storeu_ps(sfx + m * G + g, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sf + g),
                                                                    _mm512_maskz_loadu_ps(k, sx + m * G + g)));
        }
    const uint8_t* qn = q + n * K;
    if (M == 1 && gs == 32) {  // q8_0 decode: four groups in flight, so no one chain of dependent FMAs bounds the row
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        i64 g = 0;
#define R8_G(A, G_)                                                                                               \
    A = _mm512_fmadd_ps(                                                                                          \
        _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(                                                                   \
            _mm512_setzero_si512(), _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qn + (G_) * 32))),   \
            _mm512_loadu_si512(xq + (G_) * 32))),                                                                 \
        _mm512_set1_ps(sfx[G_]), A)
        for (; g + 4 <= G; g += 4) {
            _mm_prefetch((const char*)(qn + g * 32 + R8_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char*)(qn + g * 32 + 64 + R8_PREFETCH), _MM_HINT_T0);
            R8_G(a0, g);
            R8_G(a1, g + 1);
            R8_G(a2, g + 2);
            R8_G(a3, g + 3);
        }
        for (; g < G; g++) R8_G(a0, g);
#undef R8_G
        out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        return;
    }
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (i64 g = 0; g < G; g++) {
        _mm_prefetch((const char*)(qn + g * gs + R8_PREFETCH), _MM_HINT_T0);
        for (i64 c0 = 0; c0 < gs; c0 += 4096) {
            const i64 c1 = gs - c0 <= 4096 ? gs : c0 + 4096;
            __m512i v[8];
            for (i64 m = 0; m < M; m++) v[m] = _mm512_setzero_si512();
            for (i64 j = g * gs + c0; j < g * gs + c1; j += 32) {
                const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qn + j)));
                for (i64 m = 0; m < M; m++) v[m] = _mm512_dpwssd_epi32(v[m], w, _mm512_loadu_si512(xq + m * K + j));
            }
            for (i64 m = 0; m < M; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v[m]), _mm512_set1_ps(sfx[m * G + g]), acc[m]);
        }
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif

// y[M, N] = x[M, K] @ dequant(W)^T for 8-bit RTN, x bf16 (raw uint16 bits, natural order). gs % 32 == 0. Returns 0
// (nothing written) without AVX512-BF16/VNNI.
int moeq_rtn8_gemv_bf16(const uint16_t* xb, i64 M, const uint8_t* q, const void* scale, int scale_bf16,
                        const uint8_t* zero, i64 N, i64 K, i64 gs, float* y) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    const i64 G = K / gs;
    int16_t* xq = (int16_t*)malloc((size_t)(M * K) * sizeof(int16_t) + (size_t)(2 * M * G) * sizeof(float) + 64);
    if (!xq) return 0;
    float* sx = (float*)(xq + M * K + 32);
    float* xs = sx + M * G;
    for (i64 r = 0; r < M; r++) x_to_i16(xb + r * K, K, gs, xq + r * K, sx + r * G, xs + r * G);
    if (M <= 8) {  // decode's sizes: one parallel loop per row count, M a constant inside (faster than per row)
        switch (M) {
#define R8_LOOP(c)                                                                                  \
    case c: {                                                                                       \
        _Pragma("omp parallel for schedule(static)") for (i64 n = 0; n < N; n++) {                  \
            float o[c], z[c];                                                                       \
            for (int m = 0; m < c; m++) z[m] = 0.f;                                                 \
            rtn8_row_i16(xq, sx, xs, c, q, scale, scale_bf16, zero, n, K, gs, o, z);                \
            for (int m = 0; m < c; m++) y[m * N + n] = o[m] - z[m];                                 \
        }                                                                                           \
    } break;
            R8_LOOP(1) R8_LOOP(2) R8_LOOP(3) R8_LOOP(4) R8_LOOP(5) R8_LOOP(6) R8_LOOP(7) R8_LOOP(8)
#undef R8_LOOP
        }
    } else {
#pragma omp parallel for schedule(static)
        for (i64 n = 0; n < N; n++) {
            for (i64 m0 = 0; m0 < M; m0 += 8) {
                const i64 mc = M - m0 < 8 ? M - m0 : 8;
                float zt[8] = {0}, out[8] = {0};
                const int16_t* xm = xq + m0 * K;
                const float *sm = sx + m0 * G, *tm = xs + m0 * G;
                switch (mc) {
#define R8_CASE(c) case c: rtn8_row_i16(xm, sm, tm, c, q, scale, scale_bf16, zero, n, K, gs, out, zt); break;
                    R8_CASE(1) R8_CASE(2) R8_CASE(3) R8_CASE(4) R8_CASE(5) R8_CASE(6) R8_CASE(7) R8_CASE(8)
#undef R8_CASE
                }
                for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = out[m] - zt[m];
            }
        }
    }
    free(xq);
    return 1;
#else
    (void)xb; (void)M; (void)q; (void)scale; (void)scale_bf16; (void)zero; (void)N; (void)K; (void)gs; (void)y;
    return 0;
#endif
}

// A decode step's MoE layer for 8-bit RTN experts (both stacks; rows per expert <= 8, as moeq_moe_routed groups
// them): one parallel region for the whole layer — every active expert's w13 rows, SiLU-GLU and the activation
// conversion, every w2 row, the weighted sum — where the per-expert path (moeq_moe_forward) opens two regions per
// expert and runs its glue serially. The same arithmetic as that path (x rounded to bf16, x_to_i16, rtn8_row_i16, the
// sum over experts in expert order per element): the same bits. Returns 1, or 0 (nothing written) outside its domain
// or when memory cannot be had. x fp32 [T, H]; out fp32 [T, H] accumulated into.
static int rtn8_layer_takes(const moeq_wstack* w) {
    return w->fmt == MOEQ_FMT_RTN && w->bits == 8 && w->dot_bf16 && !w->values && !w->il16 && !w->act_i8 &&
           w->gs % 32 == 0 && w->K % w->gs == 0 && w->K / w->gs <= 1024;
}

// Inside a parallel region: y[a, 8, N] rows 0..m-1 = W[act[a]] x[a] for every active expert a with its m rows (x
// int16 at [a, 8, K] with group scales sx and sums xs at [a, 8, G], as x_to_i16 gives them), all rows over the threads.
static inline void rtn8_pass(const moeq_wstack* w, const i64* act, const i64* start, i64 A, const int16_t* xq,
                             const float* sx, const float* xs, float* y) {
    const i64 N = w->N, K = w->K, G = K / w->gs, sb = scale_size(w->scale_bf16);
#pragma omp for schedule(static)
    for (i64 t = 0; t < A * N; t++) {
        const i64 a = t / N, n = t % N, e = act[a], m = start[e + 1] - start[e];
        const uint8_t* q = w->q + e * (N * K);
        const void* sc = (const char*)w->scale + e * N * G * sb;
        const uint8_t* z = w->zero ? w->zero + e * N * G : NULL;
        const int16_t* xa = xq + a * 8 * K;
        const float *sxa = sx + a * 8 * G, *xsa = xs + a * 8 * G;
        float o[8], zt[8] = {0};
        switch (m) {
#define R8_M(c) case c: rtn8_row_i16(xa, sxa, xsa, c, q, sc, w->scale_bf16, z, n, K, w->gs, o, zt); break;
            R8_M(1) R8_M(2) R8_M(3) R8_M(4) R8_M(5) R8_M(6) R8_M(7) R8_M(8)
#undef R8_M
        }
        for (i64 r = 0; r < m; r++) y[(a * 8 + r) * N + n] = o[r] - zt[r];
    }
}

int moeq_moe_rtn8_layer(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                        const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    if (!rtn8_layer_takes(w13) || !rtn8_layer_takes(w2) || w13->N != 2 * I || w13->K != H || w2->N != H || w2->K != I)
        return 0;
    i64 A = active_experts(expert_start, E, 8);
    if (A < 0) return 0;
    const i64 I2 = 2 * I, G1 = H / w13->gs, G2 = I / w2->gs;
    // per active expert, 8 row slots: x as bf16 and int16 with group scales, h, the activation likewise, y (bytes)
    const size_t need = (size_t)(A * 8) * (size_t)(8 * H + 12 * I + 8 * G1 + 8 * G2) + 64;
    i64* act = (i64*)malloc((size_t)(A + 1) * sizeof(i64));
    char* buf = (char*)malloc(need);
    if (!act || !buf) {
        free(act);
        free(buf);
        return 0;
    }
    A = 0;
    for (i64 e = 0; e < E; e++)
        if (expert_start[e + 1] > expert_start[e]) act[A++] = e;
    uint16_t* xb = (uint16_t*)buf;                 // [A, 8, H]
    int16_t* xq = (int16_t*)(xb + A * 8 * H);      // [A, 8, H]
    float* sx = (float*)(xq + A * 8 * H);          // [A, 8, G1]
    float* xs = sx + A * 8 * G1;                   // [A, 8, G1]
    float* h = xs + A * 8 * G1;                    // [A, 8, 2I]
    uint16_t* ab = (uint16_t*)(h + A * 8 * I2);    // [A, 8, I]
    int16_t* aq = (int16_t*)(ab + A * 8 * I);      // [A, 8, I]
    float* sa = (float*)(aq + A * 8 * I);          // [A, 8, G2]
    float* as = sa + A * 8 * G2;                   // [A, 8, G2]
    float* y = as + A * 8 * G2;                    // [A, 8, H]
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (i64 t = 0; t < A * 8; t++) {
            const i64 a = t / 8, r = t % 8, e = act[a];
            if (r >= expert_start[e + 1] - expert_start[e]) continue;
            const float* xr = x + pair_tok[expert_start[e] + r] * H;
            uint16_t* dst = xb + t * H;
            for (i64 k = 0; k < H; k++) dst[k] = f2bf(xr[k]);
            x_to_i16(dst, H, w13->gs, xq + t * H, sx + t * G1, xs + t * G1);
        }
        rtn8_pass(w13, act, expert_start, A, xq, sx, xs, h);
#pragma omp for schedule(static)
        for (i64 t = 0; t < A * 8; t++) {
            const i64 a = t / 8, r = t % 8, e = act[a];
            if (r >= expert_start[e + 1] - expert_start[e]) continue;
            float wide[I <= H ? 1 : I];  // the fp32 activation: in y's row (free until the w2 rows) when it fits
            float* f = I <= H ? y + t * H : wide;
            silu_glu_row(h + t * I2, h + t * I2 + I, I, f);
            uint16_t* dst = ab + t * I;
            for (i64 k = 0; k < I; k++) dst[k] = f2bf(f[k]);
            x_to_i16(dst, I, w2->gs, aq + t * I, sa + t * G2, as + t * G2);
        }
        rtn8_pass(w2, act, expert_start, A, aq, sa, as, y);
#pragma omp for schedule(static)
        for (i64 k = 0; k < H; k++)
            for (i64 a = 0; a < A; a++) {
                const i64 e = act[a], p0 = expert_start[e];
                for (i64 r = 0; r < expert_start[e + 1] - p0; r++)
                    out[pair_tok[p0 + r] * H + k] += pair_w[p0 + r] * y[(a * 8 + r) * H + k];
            }
    }
    free(act);
    free(buf);
    return 1;
#else
    (void)w13, (void)w2, (void)x, (void)H, (void)I, (void)pair_tok, (void)pair_w, (void)expert_start, (void)E;
    (void)out;
    return 0;
#endif
}

// y[M, N] = bf16(x[M, K] @ W[N, K]^T) for bf16 x and W: fp32 accumulation, rounded once, as torch's bf16 linear. For
// routers (a few hundred KB of weight), where torch's CPU bf16 gemv is dominated by dispatch, and kept heads. K % 32 == 0;
// returns 0 (nothing written) otherwise or without AVX512-BF16 or AVX2.
#if defined(__AVX512BF16__)
// One weight row against M (1..4) x rows, one accumulator per x row: per 32 columns 1 + M loads serve M dot
// products, and each thread reads one weight stream. (Tiles of 4 weight rows x M x rows were 51 -> 28 ms over the
// per-row loop before this one on 4 rows of the 151936x2048 bf16 head; this form is at the read probe's speed there:
// 15-17 ms against 19-23 for the tiles at 2-4 rows, measured side by side — four streams per core cost more than
// the loads they saved.) Each output one chain in column order.
// The one-row form prefetches BF16_PF weights (2 KB) ahead: the 151936 x 2048 bf16 head 28 / 33 / 42 ms at 1 / 2 / 4
// rows without, 22 / 26 / 28 with (4 KB ahead: 22-23 / 29 / 31; 2 threads, Intel SPR).
#define BF16_PF 1024
static inline __attribute__((always_inline)) void bf16_row512(const uint16_t* w, const uint16_t* x, const i64 M, i64 K,
                                                              float* out) {
    __m512 acc[4];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (i64 k = 0; k < K; k += 32) {
        _mm_prefetch((const char*)(w + k + BF16_PF), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
        for (i64 m = 0; m < M; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k));
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif

#if defined(__AVX512BF16__)
// Two weight rows against M (1..8) x rows: per 32 columns 2 + M loads serve 2M dot products where the one-row form's
// 1 + M serve M, and two rows further on (pf, NULL near the end) are prefetched: past 4 rows the one-row form is
// bound by its loads and memory stalls it (the 151936 x 2048 head at 8 rows: 48 -> 29 ms, torch's GEMM 34; at 16
// rows level with it, 44; Zen 4, 2 threads). Each output is one chain in column order exactly as in bf16_row512 (same
// instruction, same operand order, same reduction): a row's result has the same bits whatever the batch it is in.
static inline __attribute__((always_inline)) void bf16_rows2_512(const uint16_t* w, const uint16_t* x, const i64 M,
                                                                 i64 K, const uint16_t* pf, float* out0, float* out1) {
    __m512 a0[8], a1[8];
    for (i64 m = 0; m < M; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    for (i64 k = 0; k < K; k += 32) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + K + k);
        if (pf) {
            _mm_prefetch((const char*)(pf + k), _MM_HINT_T0);
            _mm_prefetch((const char*)(pf + K + k), _MM_HINT_T0);
        }
        for (i64 m = 0; m < M; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
            a0[m] = _mm512_dpbf16_ps(a0[m], w0, xv);
            a1[m] = _mm512_dpbf16_ps(a1[m], w1, xv);
        }
    }
    for (i64 m = 0; m < M; m++) {
        out0[m] = _mm512_reduce_add_ps(a0[m]);
        out1[m] = _mm512_reduce_add_ps(a1[m]);
    }
}

// y[M, N] for M > 4: pairs of weight rows, x rows in chunks of 8 (a constant count inside each call), the pair 8
// rows on prefetched during the first chunk; an odd last weight row by the one-row form.
static void bf16_gemv_many(const uint16_t* x, i64 M, const uint16_t* w, i64 N, i64 K, uint16_t* y) {
#pragma omp parallel for schedule(static)
    for (i64 p = 0; p < (N + 1) / 2; p++) {
        const i64 n = 2 * p;
        for (i64 m0 = 0; m0 < M; m0 += 8) {
            const i64 mc = M - m0 < 8 ? M - m0 : 8;
            const uint16_t* xm = x + m0 * K;
            float o0[8], o1[8];
            if (n + 1 == N) {
                for (i64 c = 0; c < mc; c += 4) bf16_row512(w + n * K, xm + c * K, mc - c < 4 ? mc - c : 4, K, o0 + c);
                for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = f2bf(o0[m]);
                continue;
            }
            const uint16_t* pf = m0 == 0 && n + 9 < N ? w + (n + 8) * K : NULL;
            switch (mc) {
#define B2_CASE(c) case c: bf16_rows2_512(w + n * K, xm, c, K, pf, o0, o1); break;
                B2_CASE(1) B2_CASE(2) B2_CASE(3) B2_CASE(4) B2_CASE(5) B2_CASE(6) B2_CASE(7) B2_CASE(8)
#undef B2_CASE
            }
            for (i64 m = 0; m < mc; m++) {
                y[(m0 + m) * N + n] = f2bf(o0[m]);
                y[(m0 + m) * N + n + 1] = f2bf(o1[m]);
            }
        }
    }
}
#endif

#if defined(__AVX512BF16__)
#define BF16_ROWS bf16_row512
#elif defined(MOEQ_AVX2)
#define BF16_ROWS bf16_rows_avx2
#endif

int moeq_bf16_gemv(const uint16_t* x, i64 M, const uint16_t* w, i64 N, i64 K, uint16_t* y) {
#if defined(BF16_ROWS)
    if (K % 32) return 0;
#if !defined(__AVX512BF16__)
    if (M == 1) {  // AVX2, one row: x split to fp32 once
        float* xs = (float*)malloc((size_t)K * sizeof(float));
        if (!xs) return 0;
        x_split16_bf16(x, K, xs);
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
        for (i64 n = 0; n < N; n++) y[n] = f2bf(bf16_row_avx2(w + n * K, xs, K));
        free(xs);
        return 1;
    }
#else
    if (M > 4 && N * K >= (1 << 18)) {
        bf16_gemv_many(x, M, w, N, K, y);
        return 1;
    }
#endif
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
    for (i64 n = 0; n < N; n++)
        for (i64 m0 = 0; m0 < M; m0 += 4) {
            const i64 mc = M - m0 < 4 ? M - m0 : 4;
            float o[4];
            switch (mc) {
                case 1: BF16_ROWS(w + n * K, x + m0 * K, 1, K, o); break;
                case 2: BF16_ROWS(w + n * K, x + m0 * K, 2, K, o); break;
                case 3: BF16_ROWS(w + n * K, x + m0 * K, 3, K, o); break;
                default: BF16_ROWS(w + n * K, x + m0 * K, 4, K, o); break;
            }
            for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = f2bf(o[m]);
        }
    return 1;
#else
    (void)x; (void)M; (void)w; (void)N; (void)K; (void)y;
    return 0;
#endif
}

// y[M, N] = x @ dequant(W)^T for a bnb4 weight [N, K] with K % bs == 0. xe/xo: even/odd k of x ([M, K/2] fp32).
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void bnb4_row_avx512(
    const float* xe, const float* xo, const i64 M, const uint8_t* packed, const float* absmax, const float* code,
    i64 n, i64 K, i64 bs, float* out) {
    const i64 nbr = K / bs;
    const __m512 tab = _mm512_loadu_ps(code);
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (i64 g = 0; g < nbr; g++) {
        const uint8_t* p = packed + (n * K + g * bs) / 2;
        __m512 v[8];
        for (i64 m = 0; m < M; m++) v[m] = _mm512_setzero_ps();
        for (i64 j = 0; j < bs / 2; j += 16) {
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + j)));
            __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tab);
            __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), tab);
            const i64 o = g * bs / 2 + j;
            for (i64 m = 0; m < M; m++) {
                v[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xe + m * (K / 2) + o), v[m]);
                v[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xo + m * (K / 2) + o), v[m]);
            }
        }
        const __m512 av = _mm512_set1_ps(absmax[n * nbr + g]);
        for (i64 m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(v[m], av, acc[m]);
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif

// NF4/FP4 with bf16 activations (blocksize % 64 == 0, x permuted per 64-chunk like the 4-bit RTN kernel): each
// nibble indexes a 16-entry table of bf16(code) words (vpermw), two dot products per 64 weights, absmax per block
// in fp32. bf16(code) carries the rounding bitsandbytes itself applies when it dequantizes to bf16 for a matmul.
#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void bnb4_row_dpbf16_p64(
    const uint16_t* xb, const i64 M, const uint8_t* packed, const float* absmax, __m512i tab, i64 n, i64 K, i64 bs,
    float* out) {
    const i64 nbr = K / bs;
    const __m512i lo4 = _mm512_set1_epi16(0x000F);
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (i64 g = 0; g < nbr; g++) {
        const uint8_t* p = packed + (n * K + g * bs) / 2;
        const uint16_t* xg = xb + g * bs;
        __m512 v[8], u[8];
        for (i64 m = 0; m < M; m++) v[m] = u[m] = _mm512_setzero_ps();
        for (i64 j = 0; j < bs / 2; j += 32) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(p + j)));
            const __m512i even = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), tab);  // high nibble: element 2j
            const __m512i odd = _mm512_permutexvar_epi16(_mm512_and_si512(w, lo4), tab);
            for (i64 m = 0; m < M; m++) {
                const uint16_t* xc = xg + m * K + 2 * j;
                v[m] = _mm512_dpbf16_ps(v[m], (__m512bh)even, (__m512bh)_mm512_loadu_si512(xc));
                u[m] = _mm512_dpbf16_ps(u[m], (__m512bh)odd, (__m512bh)_mm512_loadu_si512(xc + 32));
            }
        }
        const __m512 av = _mm512_set1_ps(absmax[n * nbr + g]);
        for (i64 m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_add_ps(v[m], u[m]), av, acc[m]);
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif

// y[M, N] = x @ dequant(W)^T, bnb4 weight [N, K], x bf16 permuted per 64-chunk (x_to_bf16), K % bs == 0,
// bs % 64 == 0. Returns 0 (nothing written) when built without AVX512-BF16.
int moeq_bnb4_gemv_bf16(const uint16_t* xb, i64 M, const uint8_t* packed, const float* absmax, const float* code,
                        i64 N, i64 K, i64 bs, float* y) {
#if defined(__AVX512BF16__)
    uint16_t t[32] = {0};
    for (int c = 0; c < 16; c++) t[c] = f2bf(code[c]);
    const __m512i tab = _mm512_loadu_si512(t);
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        for (i64 m0 = 0; m0 < M; m0 += 8) {
            const i64 mc = M - m0 < 8 ? M - m0 : 8;
            float out[8] = {0};
            switch (mc) {
#define NB_CASE(c) case c: bnb4_row_dpbf16_p64(xb + m0 * K, c, packed, absmax, tab, n, K, bs, out); break;
                NB_CASE(1) NB_CASE(2) NB_CASE(3) NB_CASE(4) NB_CASE(5) NB_CASE(6) NB_CASE(7) NB_CASE(8)
#undef NB_CASE
            }
            for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = out[m];
        }
    }
    return 1;
#else
    (void)xb; (void)M; (void)packed; (void)absmax; (void)code; (void)N; (void)K; (void)bs; (void)y;
    return 0;
#endif
}

void moeq_bnb4_gemv(const float* xe, const float* xo, i64 M, const uint8_t* packed, const float* absmax,
                    const float* code, i64 N, i64 K, i64 bs, float* y) {
    const i64 nbr = K / bs;  // blocks per row
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
#if defined(__AVX512F__)
        if (bs % 32 == 0) {  // rows of x in chunks of 8 (weight row re-read from L1)
            for (i64 m0 = 0; m0 < M; m0 += 8) {
                const i64 mc = M - m0 < 8 ? M - m0 : 8;
                float out[8] = {0};
                switch (mc) {
#define BNB_CASE(c) case c: bnb4_row_avx512(xe + m0 * (K / 2), xo + m0 * (K / 2), c, packed, absmax, code, n, K, bs, out); break;
                    BNB_CASE(1) BNB_CASE(2) BNB_CASE(3) BNB_CASE(4) BNB_CASE(5) BNB_CASE(6) BNB_CASE(7) BNB_CASE(8)
#undef BNB_CASE
                }
                for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = out[m];
            }
            continue;
        }
#elif defined(MOEQ_AVX2)
        if (bs % 16 == 0) {
            for (i64 m0 = 0; m0 < M; m0 += 8) {
                const i64 mc = M - m0 < 8 ? M - m0 : 8;
                float out[8] = {0};
                switch (mc) {
#define BNB_CASE(c) case c: bnb4_row_avx2(xe + m0 * (K / 2), xo + m0 * (K / 2), c, packed, absmax, code, n, K, bs, out); break;
                    BNB_CASE(1) BNB_CASE(2) BNB_CASE(3) BNB_CASE(4) BNB_CASE(5) BNB_CASE(6) BNB_CASE(7) BNB_CASE(8)
#undef BNB_CASE
                }
                for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = out[m];
            }
            continue;
        }
#endif
        float out[64] = {0};
        {
            for (i64 g = 0; g < nbr; g++) {
                const float a = absmax[n * nbr + g];
                const uint8_t* p = packed + (n * K + g * bs) / 2;
                for (i64 m = 0; m < M; m++) {
                    const float* e = xe + m * (K / 2) + g * bs / 2;
                    const float* o = xo + m * (K / 2) + g * bs / 2;
                    float s = 0.f;
                    for (i64 j = 0; j < bs / 2; j++) s += code[p[j] >> 4] * e[j] + code[p[j] & 15] * o[j];
                    out[m] += s * a;
                }
            }
        }
        for (i64 m = 0; m < M; m++) y[m * N + n] = out[m];
    }
}

// ---------------------------------------------------------------- LLM.int8 --------------------------------------
void moeq_int8_gemv(const float* x, i64 M, const int8_t* w, const float* scb, i64 N, i64 K, float* y) {
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++) {
        const int8_t* ww = w + n * K;
        const float s = scb[n] * 7.874015718698502e-3f;
        for (i64 m0 = 0; m0 < M; m0 += 8) {  // rows of x in chunks of 8 (weight row re-read from L1)
            const i64 mc = M - m0 < 8 ? M - m0 : 8;
            const float* xm = x + m0 * K;
            float out[8] = {0};
            i64 k0 = 0;
#if defined(__AVX512F__)
            __m512 v[8];
            for (i64 m = 0; m < mc; m++) v[m] = _mm512_setzero_ps();
            for (; k0 + 16 <= K; k0 += 16) {
                __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(ww + k0))));
                for (i64 m = 0; m < mc; m++) v[m] = _mm512_fmadd_ps(c, _mm512_loadu_ps(xm + m * K + k0), v[m]);
            }
            for (i64 m = 0; m < mc; m++) out[m] = _mm512_reduce_add_ps(v[m]);
#endif
            for (i64 m = 0; m < mc; m++) {
                float a = 0.f;
                for (i64 k = k0; k < K; k++) a += (float)ww[k] * xm[m * K + k];
                y[(m0 + m) * N + n] = (out[m] + a) * s;
            }
        }
    }
}


// y[M, N] = x @ dequant(W)^T for the 2/3/4/5-bit codebook grids (value = scale * values[code]; see cb4_rows_p64), x
// bf16 in x_to_bf16's permuted order, K % 64 == 0, gs 16, 32 or a multiple of 64. lut: the values as bf16 (32
// words: the table repeated). Returns 0 (nothing written) without AVX512-BF16.
int moeq_cb4_gemv_bf16(const uint16_t* xb, i64 M, const uint8_t* q, const void* scale, int scale_bf16,
                       const uint16_t* sup, const uint16_t* lut, i64 N, i64 K, i64 gs, int bits, float* y) {
#if defined(__AVX512BF16__)
    if (M == 1) {
#pragma omp parallel for schedule(static)
        for (i64 n = 0; n < N; n++) {
            cb4_row_bf16(xb, 1, q, scale, scale_bf16, lut, n, K, gs, bits, y + n);
            y[n] *= row_super(sup, n);
        }
        return 1;
    }
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++)
        for (i64 m0 = 0; m0 < M; m0 += 8) {
            const i64 mc = M - m0 < 8 ? M - m0 : 8;
            float out[8];
            cb4_row_bf16(xb + m0 * K, mc, q, scale, scale_bf16, lut, n, K, gs, bits, out);
            for (i64 m = 0; m < mc; m++) y[(m0 + m) * N + n] = out[m] * row_super(sup, n);
        }
    return 1;
#else
    (void)xb; (void)M; (void)q; (void)scale; (void)scale_bf16; (void)sup; (void)lut; (void)N; (void)K; (void)gs;
    (void)bits; (void)y;
    return 0;
#endif
}

// AVX2 builds, bf16 models: y[m, N] = x[m, K] @ W[e]^T for RTN 4/8-bit and the 2/3/4/5-bit codebook grids through
// rows_avx2.h's int16-activation rows (gs % 32 == 0; 2/3-bit: gs % 16 == 0). scratch: m*K/2 + m*K/32 + 16 floats.
// Returns 0 (nothing written) outside that domain or on other builds.
int moeq_avx2_gemv_i16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
#if defined(MOEQ_AVX2)
    const i64 N = w->N, K = w->K, G = K / w->gs;
    const int bits = w->bits, cb = w->values != NULL;
    __m128i t[2] = {_mm_setzero_si128(), _mm_setzero_si128()};
    __m256i t3 = _mm256_setzero_si256();
    if (w->fmt == MOEQ_FMT_RTN && cb && (bits == 3 || bits == 2)) {  // nl3 / nl2: groups of 16, x in order
        if (w->gs % 16 || K % 32 || w->zero || !cb3_table_i8(w->values, 1 << bits, &t3)) return 0;
    } else if (w->fmt != MOEQ_FMT_RTN || w->gs % 32 || K % 32 ||
               !(cb ? bits == 4 || bits == 5 : bits == 4 || bits == 8) ||
               (cb && (w->zero || !cb_tables_i8(w->values, bits, t)))) {
        return 0;
    }
    int16_t* xq = (int16_t*)scratch;
    float* sx = scratch + m * K / 2;
    for (i64 r = 0; r < m; r++)
        x_to_i16_32(x + r * K, K, bits != 8 && bits != 3 && bits != 2, xq + r * K, sx + r * K / 32);
    const uint8_t* q = w->q + e * N * packed_row_bytes(bits, K);
    const void* sc = (const char*)w->scale + e * N * G * scale_size(w->scale_bf16);
    const uint8_t* z = w->zero ? w->zero + e * N * G : NULL;
    const uint16_t* sup = w->scale_super ? w->scale_super + e * N : NULL;
// ROWS(FN, ...): every output row n for the m rows of x, 4 at a time: FN(xr, sr, rows, <the rest>, o), the row
// count a compile-time constant per case
#define ROWS(FN, ...)                                                                                         \
    _Pragma("omp parallel for schedule(static)") for (i64 n = 0; n < N; n++)                                  \
        for (i64 r0 = 0; r0 < m; r0 += 4) {                                                                   \
            const i64 mc = m - r0 < 4 ? m - r0 : 4;                                                           \
            float o[4];                                                                                       \
            const int16_t* xr = xq + r0 * K;                                                                  \
            const float* sr = sx + r0 * K / 32;                                                               \
            switch (mc) {                                                                                     \
                case 1: FN(xr, sr, 1, __VA_ARGS__, o); break;                                                 \
                case 2: FN(xr, sr, 2, __VA_ARGS__, o); break;                                                 \
                case 3: FN(xr, sr, 3, __VA_ARGS__, o); break;                                                 \
                default: FN(xr, sr, 4, __VA_ARGS__, o); break;                                                \
            }                                                                                                 \
            for (i64 r = 0; r < mc; r++) y[(r0 + r) * N + n] = o[r] * row_super(sup, n);                      \
        }
    const int kind = w->scale_bf16;
    const i64 gs = w->gs;
    if (cb && bits == 3) { ROWS(cb3_row_i16, q, sc, kind, t3, n, K, gs, 3) }
    else if (cb && bits == 2) { ROWS(cb3_row_i16, q, sc, kind, t3, n, K, gs, 2) }
    else if (cb && bits == 5) { ROWS(row_i16, q, sc, kind, z, t, n, K, gs, 5, 1) }
    else if (cb) { ROWS(row_i16, q, sc, kind, z, t, n, K, gs, 4, 1) }
    else if (bits == 8) { ROWS(row_i16, q, sc, kind, z, t, n, K, gs, 8, 0) }
    else { ROWS(row_i16, q, sc, kind, z, t, n, K, gs, 4, 0) }
#undef ROWS
    return 1;
#else
    (void)w; (void)e; (void)x; (void)m; (void)y; (void)scratch;
    return 0;
#endif
}

// The same in fp32 for any CPU: x [M, K] in order, gs % 8 == 0 (AVX2: rows_avx2.h's row for gs % 32 == 0).
void moeq_cb4_gemv(const float* x, i64 M, const uint8_t* q, const void* scale, int scale_bf16, const uint16_t* sup,
                   const float* values, i64 N, i64 K, i64 gs, int bits, float* y) {
    const i64 G = K / gs, rowb = packed_row_bytes(bits, K);
#if defined(MOEQ_AVX2)
    __m128i t[2];
    float* xs = gs % 32 == 0 && cb_tables_i8(values, bits, t) ? (float*)malloc((size_t)(M * K) * sizeof(float)) : NULL;
    if (xs) {
        for (i64 m = 0; m < M; m++) x_split32(x + m * K, K, xs + m * K);
#pragma omp parallel for schedule(static)
        for (i64 n = 0; n < N; n++)
            for (i64 m = 0; m < M; m++)
                y[m * N + n] = (bits == 5 ? cb_row_avx2(xs + m * K, q, scale, scale_bf16, t, n, K, gs, 1)
                                          : cb_row_avx2(xs + m * K, q, scale, scale_bf16, t, n, K, gs, 0)) *
                               row_super(sup, n);
        free(xs);
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (i64 n = 0; n < N; n++)
        for (i64 m = 0; m < M; m++) {
            const float* xx = x + m * K;
            const uint8_t* qn = q + n * rowb;
            float acc = 0.f;
            for (i64 g = 0; g < G; g++) {
                const float* xg = xx + g * gs;
                float a = 0.f;
                if (bits == 4) {
                    const uint8_t* qq = qn + g * gs / 2;
                    for (i64 j = 0; j < gs / 2; j++)
                        a += values[qq[j] & 15] * xg[2 * j] + values[qq[j] >> 4] * xg[2 * j + 1];
                } else {
                    for (i64 k = 0; k < gs; k++) a += values[packed_code(qn, bits, K, g * gs + k)] * xg[k];
                }
                acc += a * load_scale(scale, scale_bf16, n * G + g);
            }
            y[m * N + n] = acc * row_super(sup, n);
        }
}
