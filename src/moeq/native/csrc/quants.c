// Quantize and dequantize for the packed formats: each bit-exact with its plain-torch reference in moeq.formats.
#include "moeq.h"

void moeq_set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#endif
}

// ---------------------------------------------------------------- RTN -------------------------------------------
// Symmetric vLLM grid, exactly torch's arithmetic in the weight's dtype (bf16: every op rounded to bf16).

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

