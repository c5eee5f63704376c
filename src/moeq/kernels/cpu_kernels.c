// moeq native CPU kernels: quantize, dequantize and small-batch matmul (gemv) for the packed formats.
// Plain C + OpenMP, built on first use with the system compiler (see cpu.py). Every function mirrors a plain-torch
// reference in moeq.formats / moeq.kernels and is tested against it: quantize/dequantize bit-exactly, gemv within
// fp32 accumulation tolerance.
//
// Layouts (row-major, rows = output features N, K = input features):
//   rtn:  q uint8 [N, K/2] (4-bit, even k in the LOW nibble) or [N, K] (8-bit); scale [N, K/gs]; zero uint8|NULL
//   bnb4: packed uint8 [n/2] (even element in the HIGH nibble), absmax fp32 per block of `bs` elements
//   int8: w int8 [N, K], scb fp32 [N]
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef int64_t i64;

void moeq_set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#endif
}

static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {  // round to nearest even, NaN kept quiet
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load_scale(const void* s, int bf16, i64 i) {
    return bf16 ? bf2f(((const uint16_t*)s)[i]) : ((const float*)s)[i];
}

// ---------------------------------------------------------------- RTN -------------------------------------------
// Symmetric vLLM grid, exactly torch's arithmetic in the weight's dtype (bf16: every op rounded to bf16).
// A group holding NaN/Inf gets a NaN scale (the caller checks the scales and names the tensor).
static inline uint16_t f2bf_finite(float f) {  // round to nearest even; callers only pass finite values
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void load_group(const void* w, int bf16, i64 base, i64 n, float* buf) {
    if (bf16) {
        const uint16_t* p = (const uint16_t*)w + base;
#pragma omp simd
        for (i64 k = 0; k < n; k++) buf[k] = bf2f(p[k]);
    } else {
        memcpy(buf, (const float*)w + base, (size_t)n * sizeof(float));
    }
}

void moeq_rtn_quantize_sym(const void* w, int bf16, i64 rows, i64 K, i64 gs, int bits, uint8_t* q, void* scale) {
    const int maxq = (1 << bits) - 1, half = 1 << (bits - 1);
    const i64 G = K / gs;
#pragma omp parallel
    {
        float buf[4096], c[4096];
#pragma omp for schedule(static)
        for (i64 r = 0; r < rows; r++) {
            for (i64 g = 0; g < G; g++) {
                const i64 base = r * K + g * gs;
                load_group(w, bf16, base, gs, buf);
                float amax = 0.f;
                int bad = 0;
#pragma omp simd reduction(max : amax) reduction(+ : bad)
                for (i64 k = 0; k < gs; k++) {
                    const float a = fabsf(buf[k]);
                    bad += !(a <= 3.402823466e38f);
                    amax = a > amax ? a : amax;
                }
                float s;
                if (bad) {
                    s = NAN;
                } else if (bf16) {
                    s = bf2f(f2bf_finite(bf2f(f2bf_finite(amax * 2.0f)) / (float)maxq));
                } else {
                    s = amax * 2.0f / (float)maxq;
                }
                if (bf16)
                    ((uint16_t*)scale)[r * G + g] = bad ? (uint16_t)0x7fc0 : f2bf_finite(s);
                else
                    ((float*)scale)[r * G + g] = s;
                if (bad) continue;
                const float d = s == 0.f ? 1.f : s;
#pragma omp simd
                for (i64 k = 0; k < gs; k++) {
                    float x = buf[k] / d;
                    if (bf16) x = bf2f(f2bf_finite(x));
                    float v = rintf(x) + (float)half;
                    v = v < 0.f ? 0.f : v;
                    c[k] = v > (float)maxq ? (float)maxq : v;
                }
                if (bits == 8) {
                    uint8_t* o = q + base;
#pragma omp simd
                    for (i64 k = 0; k < gs; k++) o[k] = (uint8_t)c[k];
                } else {
                    uint8_t* o = q + r * (K / 2) + g * gs / 2;
#pragma omp simd
                    for (i64 j = 0; j < gs / 2; j++) o[j] = (uint8_t)((uint8_t)c[2 * j] | ((uint8_t)c[2 * j + 1] << 4));
                }
            }
        }
    }
}

// (q - z) * s for each element; out fp32 or bf16 (rounded once, like the torch reference).
void moeq_rtn_dequant(const uint8_t* q, const void* scale, int scale_bf16, const uint8_t* zero, int bits, i64 rows,
                      i64 K, i64 gs, void* out, int out_bf16) {
    const i64 G = K / gs;
    const float half = (float)(1 << (bits - 1));
#pragma omp parallel for schedule(static)
    for (i64 r = 0; r < rows; r++) {
        for (i64 g = 0; g < G; g++) {
            const float s = load_scale(scale, scale_bf16, r * G + g);
            const float z = zero ? (float)zero[r * G + g] : half;
            const i64 o = r * K + g * gs;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            if (out_bf16 && bits == 4 && gs % 32 == 0) {
                // the group's 16 possible values, (c - z) * s rounded once to bf16, looked up per weight: one word
                // permute per 32 weights (bit-identical to computing each product)
                const uint8_t* qq = q + r * (K / 2) + g * gs / 2;
                const __m512 vals = _mm512_mul_ps(_mm512_sub_ps(_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3,
                                                                              2, 1, 0), _mm512_set1_ps(z)),
                                                  _mm512_set1_ps(s));
                const __m512i tab = _mm512_broadcast_i64x4((__m256i)_mm512_cvtneps_pbh(vals));
                const __m512i mask = _mm512_set1_epi32(0x000F000F);
                for (i64 j = 0; j < gs / 2; j += 16) {
                    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qq + j)));
                    const __m512i idx = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), mask, 0xA8);  // (a|b)&c
                    _mm512_storeu_si512((void*)((uint16_t*)out + o + 2 * j), _mm512_permutexvar_epi16(idx, tab));
                }
                continue;
            }
            if (out_bf16 && bits == 8 && gs % 32 == 0) {
                const uint8_t* qq = q + r * K + g * gs;
                const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
                for (i64 k = 0; k < gs; k += 32) {
                    __m512 a0 = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qq + k)))), zv), sv);
                    __m512 a1 = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qq + k + 16)))), zv), sv);
                    _mm512_storeu_si512((void*)((uint16_t*)out + o + k), (__m512i)_mm512_cvtne2ps_pbh(a1, a0));
                }
                continue;
            }
#endif
            if (bits == 8) {
                const uint8_t* qq = q + r * K + g * gs;
                if (out_bf16)
                    for (i64 k = 0; k < gs; k++) ((uint16_t*)out)[o + k] = f2bf(((float)qq[k] - z) * s);
                else
                    for (i64 k = 0; k < gs; k++) ((float*)out)[o + k] = ((float)qq[k] - z) * s;
            } else {
                const uint8_t* qq = q + r * (K / 2) + g * gs / 2;
                for (i64 j = 0; j < gs / 2; j++) {
                    const float lo = ((float)(qq[j] & 15) - z) * s, hi = ((float)(qq[j] >> 4) - z) * s;
                    if (out_bf16) {
                        ((uint16_t*)out)[o + 2 * j] = f2bf(lo);
                        ((uint16_t*)out)[o + 2 * j + 1] = f2bf(hi);
                    } else {
                        ((float*)out)[o + 2 * j] = lo;
                        ((float*)out)[o + 2 * j + 1] = hi;
                    }
                }
            }
        }
    }
}

// y[M, N] = x[M, K] @ dequant(W)^T, fp32 accumulation. xe/xo: x split into even/odd k (fp32, [M, K/2] each, 4-bit)
// or xe = x ([M, K], 8-bit); xsum: per-group sums of x [M, G] (for the zero point). M <= 8.
#if defined(__AVX512F__)
// One output row for a compile-time M (keeps the accumulators in registers). This exact form (8-bit x addressed
// from the group base, U = CHAINS(M) chains with a tail loop, two accumulator sets summed per group) measured
// ~35 GB/s for the 8-bit M=1 gemv (every 4-bit preset's lm_head) vs ~19 GB/s for simpler-looking variants on
// this machine kind, side by side; more chains (U > 1) and split 4-bit accumulators measured slower.
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

#if defined(__AVX512BF16__)
// Once per weight row of the AVX512-BF16 RTN kernels: its G scales as fp32 into sf (per group only a broadcast from
// L1 remains) and its zero terms sum_g (z_g + offset) s_g xsum[m, g] added to zt[m] as one dot product per x row,
// z_g = zero[g] or zdefault (~20% faster at one row than scalar work per group, measured).
static inline __attribute__((always_inline)) void row_scales(
    const void* scale, int scale_bf16, const uint8_t* zero, float zdefault, float offset, const float* xsum,
    const i64 M, i64 n, i64 G, float* sf, float* zt) {
    __m512 ztv[8];
    for (i64 m = 0; m < M; m++) ztv[m] = _mm512_setzero_ps();
    for (i64 g = 0; g < G; g += 16) {
        const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
        const __m512 sv = scale_bf16
            ? _mm512_castsi512_ps(_mm512_slli_epi32(
                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t*)scale + n * G + g)), 16))
            : _mm512_maskz_loadu_ps(k, (const float*)scale + n * G + g);
        _mm512_storeu_ps(sf + g, sv);
        const __m512 zv = zero ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, zero + n * G + g)))
                               : _mm512_set1_ps(zdefault);
        const __m512 szv = _mm512_mul_ps(_mm512_add_ps(zv, _mm512_set1_ps(offset)), sv);
        for (i64 m = 0; m < M; m++) ztv[m] = _mm512_fmadd_ps(szv, _mm512_maskz_loadu_ps(k, xsum + m * G + g), ztv[m]);
    }
    for (i64 m = 0; m < M; m++) zt[m] += _mm512_reduce_add_ps(ztv[m]);
}

static inline __attribute__((always_inline)) void rtn4_row_dpbf16(
    const uint16_t* xb, const float* xsum, const i64 M, const uint8_t* q, const void* scale, int scale_bf16,
    const uint8_t* zero, i64 n, i64 K, i64 gs, float* out, float* zt) {
    const i64 G = K / gs;
    const __m512i magic = _mm512_set1_epi32(0x43004300), mask = _mm512_set1_epi32(0x000F000F);
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (i64 g = 0; g < G; g++) {
        const float s = load_scale(scale, scale_bf16, n * G + g);
        const float z = (zero ? (float)zero[n * G + g] : 8.f) + 128.f;
        for (i64 m = 0; m < M; m++) zt[m] += z * s * xsum[m * G + g];
        __m512 v[8];
        for (i64 m = 0; m < M; m++) v[m] = _mm512_setzero_ps();
        const uint8_t* qq = q + n * (K / 2) + g * gs / 2;
        const uint16_t* xg = xb + g * gs;
        for (i64 j = 0; j < gs / 2; j += 16) {
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qq + j)));
            __m512i t = _mm512_or_si512(b, _mm512_slli_epi32(b, 12));
            __m512i wv = _mm512_ternarylogic_epi32(t, mask, magic, 0xEA);  // (t & mask) | magic
            for (i64 m = 0; m < M; m++)
                v[m] = _mm512_dpbf16_ps(v[m], (__m512bh)wv, (__m512bh)_mm512_loadu_si512(xg + m * K + 2 * j));
        }
        const __m512 sv = _mm512_set1_ps(s);
        for (i64 m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(v[m], sv, acc[m]);
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// Groups of 64 with x pre-permuted per 64-chunk as (even elements, odd elements): 32 packed bytes widen to 32
// words, and (w & 15) | 0x4300, (w >> 4) | 0x4300 are directly the bf16 pairs of the even/odd halves — 9 ops per
// 64 weights instead of 14.
static inline __attribute__((always_inline)) void rtn4_row_dpbf16_p64(
    const uint16_t* xb, const float* xsum, const i64 M, const uint8_t* q, const void* scale, int scale_bf16,
    const uint8_t* zero, i64 n, i64 K, i64 gs, float* out, float* zt) {
    const i64 G = K / gs;
    const __m512i magic = _mm512_set1_epi16(0x4300), lo4 = _mm512_set1_epi16(0x000F);
    float sf[G + 16];
    row_scales(scale, scale_bf16, zero, 8.f, 128.f, xsum, M, n, G, sf, zt);
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const uint8_t* qn = q + n * (K / 2);
    for (i64 g = 0; g < G; g++) {
        __m512 v[8], u[8];
        for (i64 m = 0; m < M; m++) v[m] = u[m] = _mm512_setzero_ps();
        const uint8_t* qq = qn + g * gs / 2;
        const uint16_t* xg = xb + g * gs;
        for (i64 j = 0; j < gs / 2; j += 32) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qq + j)));
            const __m512i even = _mm512_ternarylogic_epi32(w, lo4, magic, 0xEA);  // (w & 15) | 0x4300
            const __m512i odd = _mm512_or_si512(_mm512_srli_epi16(w, 4), magic);
            for (i64 m = 0; m < M; m++) {
                const uint16_t* xc = xg + m * K + 2 * j;
                v[m] = _mm512_dpbf16_ps(v[m], (__m512bh)even, (__m512bh)_mm512_loadu_si512(xc));
                u[m] = _mm512_dpbf16_ps(u[m], (__m512bh)odd, (__m512bh)_mm512_loadu_si512(xc + 32));
            }
        }
        const __m512 sv = _mm512_set1_ps(sf[g]);
        for (i64 m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_add_ps(v[m], u[m]), sv, acc[m]);
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// One x row, groups of 64 (x in x_to_bf16's permuted order): one accumulator chain per group and the row's scales
// prepared inline. Measured against rtn4_row_dpbf16_p64 at M = 1, side by side: 4096x2048 121 -> 101 us, 2048x768
// 35 -> 24 us, 49152x2048 1.50 -> 1.29 ms. (Blocking 2-4 weight rows per step was faster on cache-sized matrices
// but halved the speed on the 49152-row one: more concurrent streams per core.)
static inline __attribute__((always_inline)) float rtn4_row1_p64(
    const uint16_t* xb, const float* xsum, const uint8_t* q, const void* scale, int scale_bf16, const uint8_t* zero,
    i64 n, i64 K, i64 gs) {
    const i64 G = K / gs;
    const __m512i magic = _mm512_set1_epi16(0x4300), lo4 = _mm512_set1_epi16(0x000F);
    float sf[G + 16], zt = 0.f;
    row_scales(scale, scale_bf16, zero, 8.f, 128.f, xsum, 1, n, G, sf, &zt);
    __m512 acc = _mm512_setzero_ps();
    const uint8_t* qn = q + n * (K / 2);
    for (i64 g = 0; g < G; g++) {
        __m512 v = _mm512_setzero_ps();
        for (i64 j = 0; j < gs / 2; j += 32) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qn + g * gs / 2 + j)));
            const uint16_t* xc = xb + g * gs + 2 * j;
            v = _mm512_dpbf16_ps(v, (__m512bh)_mm512_ternarylogic_epi32(w, lo4, magic, 0xEA),
                                 (__m512bh)_mm512_loadu_si512(xc));
            v = _mm512_dpbf16_ps(v, (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), magic),
                                 (__m512bh)_mm512_loadu_si512(xc + 32));
        }
        acc = _mm512_fmadd_ps(v, _mm512_set1_ps(sf[g]), acc);
    }
    return _mm512_reduce_add_ps(acc) - zt;
}

// One output row n for M (1..8) rows of x in either layout; M becomes a compile-time constant per case.
static inline __attribute__((always_inline)) void rtn4_row_bf16(
    int perm64, const uint16_t* xb, const float* xsum, i64 M, const uint8_t* q, const void* scale, int scale_bf16,
    const uint8_t* zero, i64 n, i64 K, i64 gs, float* out, float* zt) {
    if (perm64 && M == 1) {  // one row: its own form; symmetric bf16-scale layout (the presets') known at compile time
        out[0] = scale_bf16 && !zero ? rtn4_row1_p64(xb, xsum, q, scale, 1, NULL, n, K, gs)
                                     : rtn4_row1_p64(xb, xsum, q, scale, scale_bf16, zero, n, K, gs);
        return;
    }
    // 2-8 rows, the presets' layout known at compile time (~10% faster, measured at one row before the form above)
#define DP_SYM_CASE(c) case c: rtn4_row_dpbf16_p64(xb, xsum, c, q, scale, 1, NULL, n, K, gs, out, zt); break;
    if (perm64 && scale_bf16 && !zero) {
        switch (M) { DP_SYM_CASE(2) DP_SYM_CASE(3) DP_SYM_CASE(4) DP_SYM_CASE(5) DP_SYM_CASE(6) DP_SYM_CASE(7)
                     DP_SYM_CASE(8) }
        return;
    }
#undef DP_SYM_CASE
#define DP_CASE(c) case c: \
    if (perm64) rtn4_row_dpbf16_p64(xb, xsum, c, q, scale, scale_bf16, zero, n, K, gs, out, zt); \
    else rtn4_row_dpbf16(xb, xsum, c, q, scale, scale_bf16, zero, n, K, gs, out, zt); \
    break;
    switch (M) { DP_CASE(1) DP_CASE(2) DP_CASE(3) DP_CASE(4) DP_CASE(5) DP_CASE(6) DP_CASE(7) DP_CASE(8) }
#undef DP_CASE
}
#endif

// bf16 activations as the 4-bit kernels read them (per 64-chunk (even, odd) elements when perm64, else in order)
// and their per-group sums, taken from the rounded values. Groups are multiples of 64 when perm64, so a group's
// elements stay within it.
static inline void x_to_bf16(const float* x, i64 K, i64 gs, int perm64, uint16_t* dst, float* sums) {
    for (i64 g = 0; g < K / gs; g++) {
        float sum = 0.f;
        for (i64 k = g * gs; k < (g + 1) * gs; k++) {
            const uint16_t h = f2bf(x[k]);
            dst[perm64 ? (k & ~(i64)63) + (k & 1) * 32 + ((k & 63) >> 1) : k] = h;
            sum += bf2f(h);
        }
        sums[g] = sum;
    }
}

// y[M, N] = x[M, K] @ dequant(W)^T for 4-bit RTN, x bf16 (raw uint16 bits) with per-group sums xsum [M, G] (fp32,
// of the bf16 values). gs % 32 == 0; perm64 (gs % 64 == 0): x is in x_to_bf16's permuted order.
void moeq_rtn4_gemv_bf16(const uint16_t* xb, const float* xsum, i64 M, const uint8_t* q, const void* scale,
                         int scale_bf16, const uint8_t* zero, i64 N, i64 K, i64 gs, float* y, int perm64) {
    const i64 G = K / gs;
#if defined(__AVX512BF16__)
    if (M == 1 && perm64) {  // decode's common case in a loop of its own (measured ~15% faster than via the M loop)
        if (scale_bf16 && !zero) {
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
// row, side by side: as fast as a plain read of the weights (6.4 vs 7.4 ms for the bf16-dot form when the machine's
// memory runs at ~50 GB/s; all equal at ~33 GB/s).
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
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const uint8_t* qn = q + n * K;
    for (i64 g = 0; g < G; g++) {
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

// ---------------------------------------------------------------- decode-step helpers ---------------------------
// transformers' bf16 RMSNorm: y = w * bf16(x * rsqrt(mean(x^2) + eps)), the mean and the product in fp32, the
// normalized value rounded to bf16 before the (rounded) product with the weight. x, w, y bf16 bits; rows of n.
void moeq_rmsnorm_bf16(const uint16_t* x, const uint16_t* w, i64 rows, i64 n, float eps, uint16_t* y) {
    for (i64 r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * n;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (i64 k = 0; k < n; k++) ss += bf2f(xr[k]) * bf2f(xr[k]);
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        uint16_t* yr = y + r * n;
        for (i64 k = 0; k < n; k++) yr[k] = f2bf(bf2f(w[k]) * bf2f(f2bf(bf2f(xr[k]) * inv)));
    }
}

// One query token of grouped-query attention over a bf16 KV cache, in fp32 (a product of two bf16 values is exact in
// fp32): out[b, h] = softmax(scale q[b, h] . K[b, h / g] + mask[b]) V[b, h / g], g = Hq / Hkv. q [B, Hq, D],
// k/v [B, Hkv, S, D], mask additive fp32 [B, S] or NULL, out [B, Hq, D] bf16. A row masked everywhere gives NaN,
// as softmax does.
void moeq_attn_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* mask, i64 B, i64 Hq,
                           i64 Hkv, i64 S, i64 D, float scale, uint16_t* out) {
    const i64 g = Hq / Hkv;
#pragma omp parallel
    {
        float* p = (float*)malloc((size_t)(S + 2 * D) * sizeof(float));
        float* qf = p + S;
        float* acc = qf + D;
#pragma omp for schedule(static)
        for (i64 t = 0; t < B * Hq; t++) {
            const i64 b = t / Hq, kh = (t % Hq) / g;
            const uint16_t* kb = k + (b * Hkv + kh) * S * D;
            const uint16_t* vb = v + (b * Hkv + kh) * S * D;
            for (i64 d = 0; d < D; d++) qf[d] = bf2f(q[t * D + d]);
            float mx = -INFINITY;
            for (i64 s = 0; s < S; s++) {
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (i64 d = 0; d < D; d++) dot += qf[d] * bf2f(kb[s * D + d]);
                const float sc = dot * scale + (mask ? mask[b * S + s] : 0.f);
                p[s] = sc;
                mx = sc > mx ? sc : mx;
            }
            float sum = 0.f;
            for (i64 s = 0; s < S; s++) {
                p[s] = expf(p[s] - mx);
                sum += p[s];
            }
            for (i64 d = 0; d < D; d++) acc[d] = 0.f;
            for (i64 s = 0; s < S; s++) {
                const float ps = p[s];
#pragma omp simd
                for (i64 d = 0; d < D; d++) acc[d] += ps * bf2f(vb[s * D + d]);
            }
            const float inv = 1.f / sum;
            for (i64 d = 0; d < D; d++) out[t * D + d] = f2bf(acc[d] * inv);
        }
        free(p);
    }
}

// RoPE for one token, in place: x [B, H, D] bf16 becomes x cos + rotate_half(x) sin with cos/sin [B, D] bf16,
// rotate_half(x) = (-x[D/2:], x[:D/2]); each product and the sum rounded to bf16, exactly as torch's bf16 ops do.
void moeq_rope_bf16(uint16_t* x, i64 B, i64 H, i64 D, const uint16_t* cos, const uint16_t* sin) {
    const i64 h2 = D / 2;
    for (i64 b = 0; b < B; b++)
        for (i64 h = 0; h < H; h++) {
            uint16_t* r = x + (b * H + h) * D;
            const uint16_t *c = cos + b * D, *s = sin + b * D;
            for (i64 d = 0; d < h2; d++) {
                const float x1 = bf2f(r[d]), x2 = bf2f(r[d + h2]);
                r[d] = f2bf(bf2f(f2bf(x1 * bf2f(c[d]))) + bf2f(f2bf(-x2 * bf2f(s[d]))));
                r[d + h2] = f2bf(bf2f(f2bf(x2 * bf2f(c[d + h2]))) + bf2f(f2bf(x1 * bf2f(s[d + h2]))));
            }
        }
}

// y[M, N] = bf16(x[M, K] @ W[N, K]^T) for bf16 x and W: fp32 accumulation, rounded once, as torch's bf16 linear. For
// routers (a few hundred KB of weight), where torch's CPU bf16 gemv costs ~45 us. K % 32 == 0; returns 0 (nothing
// written) otherwise or without AVX512-BF16.
int moeq_bf16_gemv(const uint16_t* x, i64 M, const uint16_t* w, i64 N, i64 K, uint16_t* y) {
#if defined(__AVX512BF16__)
    if (K % 32) return 0;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
    for (i64 n = 0; n < N; n++) {
        const uint16_t* wn = w + n * K;
        for (i64 m = 0; m < M; m++) {
            __m512 acc = _mm512_setzero_ps();
            for (i64 k = 0; k < K; k += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wn + k),
                                       (__m512bh)_mm512_loadu_si512(x + m * K + k));
            y[m * N + n] = f2bf(_mm512_reduce_add_ps(acc));
        }
    }
    return 1;
#else
    (void)x; (void)M; (void)w; (void)N; (void)K; (void)y;
    return 0;
#endif
}

// ---------------------------------------------------------------- bnb4 ------------------------------------------
// Whole blocks only (n % bs == 0): absmax = max|x|, scaled = clamp(x * (1/absmax), -1, 1), code = number of sorted
// midpoints strictly below (ties to the lower code), remapped by `order` (FP4); even element -> HIGH nibble.
// A block holding NaN/Inf gets a NaN absmax (the caller checks and names the tensor).
void moeq_bnb4_quantize(const void* w, int bf16, i64 nblocks, i64 bs, const float* bounds, const uint8_t* order,
                        uint8_t* packed, float* absmax) {
#pragma omp parallel
    {
        float buf[4096];
        int32_t idx[4096];
#pragma omp for schedule(static)
        for (i64 b = 0; b < nblocks; b++) {
            const i64 base = b * bs;
            load_group(w, bf16, base, bs, buf);
            float am = 0.f;
            int bad = 0;
#pragma omp simd reduction(max : am) reduction(+ : bad)
            for (i64 k = 0; k < bs; k++) {
                const float a = fabsf(buf[k]);
                bad += !(a <= 3.402823466e38f);
                am = a > am ? a : am;
            }
            absmax[b] = bad ? NAN : am;
            if (bad) continue;
            const float r = 1.0f / (am < 1e-38f ? 1e-38f : am);
#pragma omp simd
            for (i64 k = 0; k < bs; k++) {
                float x = buf[k] * r;
                x = x < -1.f ? -1.f : x;
                buf[k] = x > 1.f ? 1.f : x;
                idx[k] = 0;
            }
            for (int i = 0; i < 15; i++) {
                const float bi = bounds[i];
#pragma omp simd
                for (i64 k = 0; k < bs; k++) idx[k] += bi < buf[k];
            }
            uint8_t* o = packed + base / 2;
            for (i64 j = 0; j < bs / 2; j++) o[j] = (uint8_t)((order[idx[2 * j]] << 4) | order[idx[2 * j + 1]]);
        }
    }
}

// out[i] = code[nibble(i)] * absmax[i / bs] (fp32 product, then rounded once to bf16 if asked).
void moeq_bnb4_dequant(const uint8_t* packed, const float* absmax, const float* code, i64 n, i64 bs, void* out,
                       int out_bf16) {
    const i64 nb = n / bs;
#pragma omp parallel for schedule(static)
    for (i64 b = 0; b < nb; b++) {
        const float a = absmax[b];
        const uint8_t* p = packed + b * bs / 2;
        const i64 o = b * bs;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (out_bf16 && bs % 32 == 0) {
            // the block's 16 values code[i] * absmax rounded once to bf16, looked up per weight (element 2j is the
            // high nibble): one word permute per 32 weights, bit-identical to computing each product
            const __m512i tab = _mm512_broadcast_i64x4(
                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(code), _mm512_set1_ps(a))));
            const __m512i mask = _mm512_set1_epi32(0x000F000F);
            for (i64 j = 0; j < bs / 2; j += 16) {
                const __m512i bb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + j)));
                const __m512i idx = _mm512_ternarylogic_epi32(_mm512_srli_epi32(bb, 4), _mm512_slli_epi32(bb, 16), mask,
                                                              0xA8);  // (a | b) & c
                _mm512_storeu_si512((void*)((uint16_t*)out + o + 2 * j), _mm512_permutexvar_epi16(idx, tab));
            }
            continue;
        }
#endif
        for (i64 j = 0; j < bs / 2; j++) {
            const float hi = code[p[j] >> 4] * a, lo = code[p[j] & 15] * a;
            if (out_bf16) {
                ((uint16_t*)out)[o + 2 * j] = f2bf(hi);
                ((uint16_t*)out)[o + 2 * j + 1] = f2bf(lo);
            } else {
                ((float*)out)[o + 2 * j] = hi;
                ((float*)out)[o + 2 * j + 1] = lo;
            }
        }
    }
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

// ---------------------------------------------------------------- fused MoE (decode) -----------------------------
// One call per MoE layer for the token-expert pairs of a decode step: for each expert with rows, y = w2 @
// act(w13 @ x) and out[token] += weight * y. Removes the per-expert Python dispatch that dominates small batches.
typedef struct {
    int fmt;                     // 0 = RTN, 1 = bnb4
    int dot_bf16;                // RTN 4/8-bit: round activations to bf16 (AVX512-BF16 dot products)
    const uint8_t* q;            // RTN qdata [E, N, K*bits/8]; bnb4 packed [S, n/2]
    const void* scale;           // RTN scale [E, N, G]; bnb4 absmax [S, nb] (fp32, or uint8 with double quant)
    int scale_bf16;              // RTN: scale is bf16; bnb4: absmax is uint8 (double quant)
    const uint8_t* zero;         // RTN zero points [E, N, G] or NULL
    int bits;                    // RTN bits (4 or 8)
    i64 gs;                      // RTN group size / bnb4 blocksize
    const float* code;           // bnb4 16-entry code
    const float* offset;         // bnb4 double quant: [S]
    const float* nested_absmax;  // bnb4 double quant: [S, ceil(nb/256)]
    const float* nested_code;    // bnb4 double quant: [256]
    i64 spe;                     // bnb4 slices per expert
    i64 N, K;                    // one expert's weight shape
} moeq_wstack;

static int rtn8_bf16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K, G = K / w->gs;
    uint16_t* xb = (uint16_t*)scratch;
    for (i64 r = 0; r < m; r++)
        for (i64 k = 0; k < K; k++) xb[r * K + k] = f2bf(x[r * K + k]);
    const void* sc = (const char*)w->scale + e * N * G * (w->scale_bf16 ? 2 : 4);
    return moeq_rtn8_gemv_bf16(xb, m, w->q + e * (N * K), sc, w->scale_bf16, w->zero ? w->zero + e * N * G : NULL, N, K,
                               w->gs, y);
}

// y[m, N] = x[m, K] @ W[e]^T; scratch must hold 2*m*K + m*(K/16+1) + N*K/32 floats.
static void expert_gemv(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch) {
    const i64 N = w->N, K = w->K;
    if (w->fmt == 0 && w->bits == 4 && w->dot_bf16) {
        const i64 G = K / w->gs;
        uint16_t* xb = (uint16_t*)scratch;  // m*K bf16 = m*K/2 floats
        float* xs = scratch + m * K;
        const int p64 = w->gs % 64 == 0;
        for (i64 r = 0; r < m; r++) x_to_bf16(x + r * K, K, w->gs, p64, xb + r * K, xs + r * G);
        const void* sc = (const char*)w->scale + e * N * G * (w->scale_bf16 ? 2 : 4);
        moeq_rtn4_gemv_bf16(xb, xs, m, w->q + e * (N * K / 2), sc, w->scale_bf16,
                            w->zero ? w->zero + e * N * G : NULL, N, K, w->gs, y, p64);
    } else if (w->fmt == 0 && w->bits == 8 && w->dot_bf16 && rtn8_bf16(w, e, x, m, y, scratch)) {
        return;
    } else if (w->fmt == 0) {
        const i64 G = K / w->gs;
        float* xe = scratch;
        float* xo = xe + m * K;
        float* xs = xo + m * K;
        for (i64 r = 0; r < m; r++) {
            for (i64 g = 0; g < G; g++) {
                float s = 0.f;
                for (i64 k = 0; k < w->gs; k++) s += x[r * K + g * w->gs + k];
                xs[r * G + g] = s;
            }
            if (w->bits == 4)
                for (i64 j = 0; j < K / 2; j++) {
                    xe[r * (K / 2) + j] = x[r * K + 2 * j];
                    xo[r * (K / 2) + j] = x[r * K + 2 * j + 1];
                }
        }
        const i64 qb = N * K * w->bits / 8;
        const void* sc = (const char*)w->scale + e * N * G * (w->scale_bf16 ? 2 : 4);
        moeq_rtn_gemv(w->bits == 4 ? xe : x, xo, xs, m, w->q + e * qb, sc, w->scale_bf16,
                      w->zero ? w->zero + e * N * G : NULL, w->bits, N, K, w->gs, y);
    } else {
        const i64 bs = w->gs, n = N * K / w->spe, nb = n / bs, nn = (nb + 255) / 256;
        float* xe = scratch;
        float* xo = xe + m * (K / 2);
        float* am = xo + m * (K / 2);
        for (i64 r = 0; r < m; r++)
            for (i64 j = 0; j < K / 2; j++) {
                xe[r * (K / 2) + j] = x[r * K + 2 * j];
                xo[r * (K / 2) + j] = x[r * K + 2 * j + 1];
            }
        for (i64 s = 0; s < w->spe; s++) {
            const i64 S = e * w->spe + s;
            for (i64 b = 0; b < nb; b++) {
                float a;
                if (w->scale_bf16) {
                    const uint8_t c = ((const uint8_t*)w->scale)[S * nb + b];
                    a = w->nested_code[c] * w->nested_absmax[S * nn + b / 256] + w->offset[S];
                } else {
                    a = ((const float*)w->scale)[S * nb + b];
                }
                am[s * nb + b] = a;
            }
        }
        if (w->dot_bf16 && bs % 64 == 0) {
            uint16_t* xb = (uint16_t*)scratch;  // m*K bf16 fill exactly the xe region
            float* sums = xo;  // per-group sums are unused by bnb4; xo is rebuilt below if needed
            for (i64 r = 0; r < m; r++) x_to_bf16(x + r * K, K, 64, 1, xb + r * K, sums);
            if (moeq_bnb4_gemv_bf16(xb, m, w->q + e * (N * K / 2), am, w->code, N, K, bs, y)) return;
            for (i64 r = 0; r < m; r++)  // no AVX512-BF16: rebuild xe/xo
                for (i64 j = 0; j < K / 2; j++) {
                    xe[r * (K / 2) + j] = x[r * K + 2 * j];
                    xo[r * (K / 2) + j] = x[r * K + 2 * j + 1];
                }
        }
        moeq_bnb4_gemv(xe, xo, m, w->q + e * (N * K / 2), am, w->code, N, K, bs, y);
    }
}

// A whole decode-path linear in one call for bf16 activations: y [M, N] bf16 = bf16(bf16(x W^T) + bias) as the Python
// path computes it (rounded, then the bias added in bf16), W described like one expert (RTN 4/8-bit or NF4/FP4,
// double quant included). Saves the ~30 us of torch glue per call the Python path spends around the same kernels.
// scratch (floats): M*K + expert_gemv's + M*N.
void moeq_quant_linear_bf16(const moeq_wstack* w, const uint16_t* x, i64 M, const uint16_t* bias, uint16_t* y,
                            float* scratch) {
    const i64 N = w->N, K = w->K;
    float* xf = scratch;
    float* yf = xf + M * K;
    float* sc = yf + M * N;
    for (i64 i = 0; i < M * K; i++) xf[i] = bf2f(x[i]);
    expert_gemv(w, 0, xf, M, yf, sc);
#pragma omp parallel for schedule(static) if (M * N >= 65536)
    for (i64 i = 0; i < M * N; i++) {
        const uint16_t h = f2bf(yf[i]);
        y[i] = bias ? f2bf(bf2f(h) + bf2f(bias[i % N])) : h;
    }
}

static inline float silu(float v) { return v / (1.f + expf(-v)); }

void moeq_moe_forward(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                      const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out,
                      float* scratch) {
    // scratch: 8*H (x rows) + 8*2I (h) + 8*I (act) + 8*H (y) + gemv scratch (max of both)
    float* xr = scratch;
    float* h = xr + 8 * H;
    float* a = h + 8 * 2 * I;
    float* y = a + 8 * I;
    float* gs = y + 8 * H;
    for (i64 e = 0; e < E; e++) {
        for (i64 p0 = expert_start[e]; p0 < expert_start[e + 1]; p0 += 8) {
            const i64 m = expert_start[e + 1] - p0 < 8 ? expert_start[e + 1] - p0 : 8;
            for (i64 r = 0; r < m; r++) memcpy(xr + r * H, x + pair_tok[p0 + r] * H, (size_t)H * sizeof(float));
            expert_gemv(w13, e, xr, m, h, gs);
            for (i64 r = 0; r < m; r++)
                for (i64 i = 0; i < I; i++) a[r * I + i] = silu(h[r * 2 * I + i]) * h[r * 2 * I + I + i];
            expert_gemv(w2, e, a, m, y, gs);
            for (i64 r = 0; r < m; r++) {
                const float wgt = pair_w[p0 + r];
                float* o = out + pair_tok[p0 + r] * H;
                for (i64 k = 0; k < H; k++) o[k] += wgt * y[r * H + k];
            }
        }
    }
}

#if defined(__AVX512BF16__)
// Inside a parallel region: y[a, 8, N] row 0 = W[act[a]] x[a] for every active expert a (one x row each, K in
// groups of 64, x in x_to_bf16's layout at [a, 8, K]), the rows of all experts shared out over the threads.
static inline void one_row_pass(const moeq_wstack* w, const i64* act, i64 A, const uint16_t* xb, const float* xs, i64 K,
                                i64 N, float* y) {
    const i64 G = K / w->gs, sb = w->scale_bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (i64 t = 0; t < A * N; t++) {
        const i64 a = t / N, n = t % N, e = act[a];
        y[a * 8 * N + n] = rtn4_row1_p64(xb + a * 8 * K, xs + a * 8 * G, w->q + e * (N * K / 2),
                                         (const char*)w->scale + e * N * G * sb, w->scale_bf16,
                                         w->zero ? w->zero + e * N * G : NULL, n, K, w->gs);
    }
}

// The layer kernel below when every active expert has one row (a batch-1 decode step), x in groups of 64: one
// parallel region whose loops also spread the glue (activation conversion, SiLU-GLU, the weighted sum, which keeps
// the serial order per element) over the threads, and the one-row gemv form (rtn4_row1_p64).
static void moe_rtn4_one_row(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                             const i64* pair_tok, const float* pair_w, const i64* expert_start, const i64* act, i64 A,
                             float* out, float* scratch) {
    const i64 G1 = H / w13->gs, G2 = I / w2->gs, I2 = 2 * I;
    uint16_t* xb = (uint16_t*)scratch;  // the layer kernel's scratch layout, one row per expert used
    float* xs = scratch + A * 8 * H / 2;
    float* h = xs + A * 8 * G1;
    uint16_t* ab = (uint16_t*)(h + A * 8 * I2);
    float* as = h + A * 8 * I2 + A * 8 * I / 2;
    float* y = as + A * 8 * G2;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (i64 a = 0; a < A; a++)
            x_to_bf16(x + pair_tok[expert_start[act[a]]] * H, H, w13->gs, 1, xb + a * 8 * H, xs + a * 8 * G1);
        one_row_pass(w13, act, A, xb, xs, H, I2, h);
#pragma omp for schedule(static)
        for (i64 a = 0; a < A; a++) {
            const float* hr = h + a * 8 * I2;
            float* t = y + a * 8 * H;  // free until the w2 loop: the fp32 activation row
            for (i64 i = 0; i < I; i++) t[i] = silu(hr[i]) * hr[I + i];
            x_to_bf16(t, I, w2->gs, 1, ab + a * 8 * I, as + a * 8 * G2);
        }
        one_row_pass(w2, act, A, ab, as, I, H, y);
#pragma omp for schedule(static)
        for (i64 k = 0; k < H; k++)
            for (i64 a = 0; a < A; a++) {
                const i64 p = expert_start[act[a]];
                out[pair_tok[p] * H + k] += pair_w[p] * y[a * 8 * H + k];
            }
    }
}
#endif

// The same layer for 4-bit RTN experts with bf16 activations, parallel across experts: one parallel loop over the
// rows of every active expert's w13 (SiLU-GLU applied after), one over every active expert's w2 — two fork/joins
// per layer instead of two per expert, and the threads stream the experts' weights back to back.
// scratch (floats): A*8*(H/2 + H/16 + 2I + I/2 + I/16 + H) + 64, A = active experts (rows per expert <= 8).
void moeq_moe_forward_rtn4_bf16(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                                const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E,
                                float* out, float* scratch) {
    i64 A = 0;
    for (i64 e = 0; e < E; e++) A += expert_start[e + 1] > expert_start[e];
    i64* act = (i64*)malloc((size_t)(A + 1) * sizeof(i64));
    A = 0;
    for (i64 e = 0; e < E; e++)
        if (expert_start[e + 1] > expert_start[e]) act[A++] = e;
    const i64 G1 = H / w13->gs, G2 = I / w2->gs, I2 = 2 * I;
    const int p13 = w13->gs % 64 == 0, p2 = w2->gs % 64 == 0;
    uint16_t* xb = (uint16_t*)scratch;                  // [A, 8, H] bf16
    float* xs = scratch + A * 8 * H / 2;                // [A, 8, G1]
    float* h = xs + A * 8 * G1;                         // [A, 8, 2I]
    uint16_t* ab = (uint16_t*)(h + A * 8 * I2);         // [A, 8, I] bf16
    float* as = h + A * 8 * I2 + A * 8 * I / 2;         // [A, 8, G2]
    float* y = as + A * 8 * G2;                         // [A, 8, H]
    const i64 sb13 = w13->scale_bf16 ? 2 : 4, sb2 = w2->scale_bf16 ? 2 : 4;
    int one = p13 && p2;  // every active expert has one row (a batch-1 decode step)
    for (i64 a = 0; a < A; a++) one &= expert_start[act[a] + 1] - expert_start[act[a]] == 1;
#if defined(__AVX512BF16__)
    if (one) {
        moe_rtn4_one_row(w13, w2, x, H, I, pair_tok, pair_w, expert_start, act, A, out, scratch);
        free(act);
        return;
    }
#endif
    for (i64 a = 0; a < A; a++) {
        const i64 e = act[a], p0 = expert_start[e], m = expert_start[e + 1] - p0;
        for (i64 r = 0; r < m; r++)
            x_to_bf16(x + pair_tok[p0 + r] * H, H, w13->gs, p13, xb + (a * 8 + r) * H, xs + (a * 8 + r) * G1);
    }
#pragma omp parallel for schedule(static)
    for (i64 t = 0; t < A * I2; t++) {
        const i64 a = t / I2, n = t % I2, e = act[a], m = expert_start[e + 1] - expert_start[e];
        float zt[8] = {0}, o[8] = {0};
        const uint8_t* q = w13->q + e * (I2 * H / 2);
        const void* sc = (const char*)w13->scale + e * I2 * G1 * sb13;
        const uint8_t* z = w13->zero ? w13->zero + e * I2 * G1 : NULL;
        const uint16_t* xa = xb + a * 8 * H;
        const float* xsa = xs + a * 8 * G1;
#if defined(__AVX512BF16__)
        rtn4_row_bf16(p13, xa, xsa, m, q, sc, w13->scale_bf16, z, n, H, w13->gs, o, zt);
#endif
        for (i64 r = 0; r < m; r++) h[(a * 8 + r) * I2 + n] = o[r] - zt[r];
    }
    for (i64 a = 0; a < A; a++) {
        const i64 e = act[a], m = expert_start[e + 1] - expert_start[e];
        for (i64 r = 0; r < m; r++) {
            const float* hr = h + (a * 8 + r) * I2;
            uint16_t* dst = ab + (a * 8 + r) * I;
            float* t = y;  // y is free until the w2 pass: the fp32 activation row
            for (i64 i = 0; i < I; i++) t[i] = silu(hr[i]) * hr[I + i];
            x_to_bf16(t, I, w2->gs, p2, dst, as + (a * 8 + r) * G2);
        }
    }
#pragma omp parallel for schedule(static)
    for (i64 t = 0; t < A * H; t++) {
        const i64 a = t / H, n = t % H, e = act[a], m = expert_start[e + 1] - expert_start[e];
        float zt[8] = {0}, o[8] = {0};
        const uint8_t* q = w2->q + e * (H * I / 2);
        const void* sc = (const char*)w2->scale + e * H * G2 * sb2;
        const uint8_t* z = w2->zero ? w2->zero + e * H * G2 : NULL;
#if defined(__AVX512BF16__)
        rtn4_row_bf16(p2, ab + a * 8 * I, as + a * 8 * G2, m, q, sc, w2->scale_bf16, z, n, I, w2->gs, o, zt);
#endif
        for (i64 r = 0; r < m; r++) y[(a * 8 + r) * H + n] = o[r] - zt[r];
    }
    for (i64 a = 0; a < A; a++) {
        const i64 e = act[a], p0 = expert_start[e], m = expert_start[e + 1] - p0;
        for (i64 r = 0; r < m; r++) {
            const float wgt = pair_w[p0 + r];
            float* o = out + pair_tok[p0 + r] * H;
            const float* yr = y + (a * 8 + r) * H;
            for (i64 k = 0; k < H; k++) o[k] += wgt * yr[k];
        }
    }
    free(act);
}

// A decode step's MoE layer straight from the router's output: groups the token-expert pairs by expert (a stable
// counting sort, the order of argsort(top_k_index.flatten(), stable=True)) and runs the layer kernel above, in one
// call instead of a dozen small torch ops. Returns 1 (nothing written) when an index is outside [0, E) or an expert
// gets more than 8 rows: the caller takes its general path. scratch: as the layer kernel for min(E, T*A) active
// experts.
int moeq_moe_routed(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I, const i64* idx,
                    const float* wt, i64 T, i64 A, i64 E, float* out, float* scratch) {
    const i64 P = T * A;
    i64* starts = (i64*)calloc((size_t)(E + 1), sizeof(i64));
    i64* tok = (i64*)malloc((size_t)P * sizeof(i64));
    float* wts = (float*)malloc((size_t)P * sizeof(float));
    int declined = 0;
    for (i64 p = 0; p < P; p++) {
        if (idx[p] < 0 || idx[p] >= E) { declined = 1; break; }
        starts[idx[p] + 1]++;
    }
    for (i64 e = 0; e < E && !declined; e++) {
        if (starts[e + 1] > 8) declined = 1;
        starts[e + 1] += starts[e];
    }
    if (!declined) {
        i64* fill = (i64*)malloc((size_t)E * sizeof(i64));
        memcpy(fill, starts, (size_t)E * sizeof(i64));
        for (i64 p = 0; p < P; p++) {
            const i64 slot = fill[idx[p]]++;
            tok[slot] = p / A;
            wts[slot] = wt[p];
        }
        free(fill);
        if (w13->fmt == 0 && w2->fmt == 0 && w13->bits == 4 && w2->bits == 4 && w13->dot_bf16 && w2->dot_bf16)
            moeq_moe_forward_rtn4_bf16(w13, w2, x, H, I, tok, wts, starts, E, out, scratch);
        else
            moeq_moe_forward(w13, w2, x, H, I, tok, wts, starts, E, out, scratch);
    }
    free(starts);
    free(tok);
    free(wts);
    return declined;
}

// LLM.int8 dequantization: w * scb * (1/127) in fp32 (torch's order), rounded once to bf16 if asked.
void moeq_int8_dequant(const int8_t* w, const float* scb, i64 rows, i64 K, void* out, int out_bf16) {
    const float inv = 7.874015718698502e-3f;
#pragma omp parallel for schedule(static)
    for (i64 r = 0; r < rows; r++) {
        const float s = scb[r];
        const int8_t* ww = w + r * K;
        if (out_bf16) {
            uint16_t* o = (uint16_t*)out + r * K;
#pragma omp simd
            for (i64 k = 0; k < K; k++) o[k] = f2bf_finite(((float)ww[k] * s) * inv);
        } else {
            float* o = (float*)out + r * K;
#pragma omp simd
            for (i64 k = 0; k < K; k++) o[k] = ((float)ww[k] * s) * inv;
        }
    }
}

// Asymmetric RTN (min/max widened to include 0, integer zero point), exactly the torch reference's fp32 arithmetic:
// scale = (hi - lo) / maxq rounded to the storage dtype; zero = clamp(round(-lo / s)); q = clamp(round(x / s) + zero).
// A group holding NaN/Inf gets a NaN scale.
void moeq_rtn_quantize_asym(const void* w, int bf16, i64 rows, i64 K, i64 gs, int bits, uint8_t* q, void* scale,
                            uint8_t* zero) {
    const int maxq = (1 << bits) - 1;
    const i64 G = K / gs;
#pragma omp parallel
    {
        float buf[4096], c[4096];
#pragma omp for schedule(static)
        for (i64 r = 0; r < rows; r++) {
            for (i64 g = 0; g < G; g++) {
                const i64 base = r * K + g * gs;
                load_group(w, bf16, base, gs, buf);
                float lo = 0.f, hi = 0.f;
                int bad = 0;
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(+ : bad)
                for (i64 k = 0; k < gs; k++) {
                    const float v = buf[k];
                    bad += !(fabsf(v) <= 3.402823466e38f);
                    lo = v < lo ? v : lo;
                    hi = v > hi ? v : hi;
                }
                if (bad) {
                    if (bf16) ((uint16_t*)scale)[r * G + g] = 0x7fc0; else ((float*)scale)[r * G + g] = NAN;
                    zero[r * G + g] = 0;
                    continue;
                }
                float s = (hi - lo) / (float)maxq;
                if (bf16) {
                    const uint16_t h = f2bf_finite(s);
                    ((uint16_t*)scale)[r * G + g] = h;
                    s = bf2f(h);
                } else {
                    ((float*)scale)[r * G + g] = s;
                }
                const float d = s == 0.f ? 1.f : s;
                float z = rintf(-lo / d);
                z = z < 0.f ? 0.f : (z > (float)maxq ? (float)maxq : z);
                zero[r * G + g] = (uint8_t)z;
#pragma omp simd
                for (i64 k = 0; k < gs; k++) {
                    float v = rintf(buf[k] / d) + z;
                    v = v < 0.f ? 0.f : v;
                    c[k] = v > (float)maxq ? (float)maxq : v;
                }
                if (bits == 8) {
                    uint8_t* o = q + base;
#pragma omp simd
                    for (i64 k = 0; k < gs; k++) o[k] = (uint8_t)c[k];
                } else {
                    uint8_t* o = q + r * (K / 2) + g * gs / 2;
#pragma omp simd
                    for (i64 j = 0; j < gs / 2; j++) o[j] = (uint8_t)((uint8_t)c[2 * j] | ((uint8_t)c[2 * j + 1] << 4));
                }
            }
        }
    }
}

// Double-quantized absmax -> fp32: out[s, b] = nested_code[q[s, b]] * nested_absmax[s, b / 256] + offset[s].
void moeq_bnb4_resolve_absmax(const uint8_t* q, const float* nested_absmax, const float* nested_code,
                              const float* offset, i64 S, i64 nb, float* out) {
    const i64 nn = (nb + 255) / 256;
    for (i64 s = 0; s < S; s++)
        for (i64 b = 0; b < nb; b++)
            out[s * nb + b] = nested_code[q[s * nb + b]] * nested_absmax[s * nn + b / 256] + offset[s];
}
