// Quantize and dequantize for the packed formats: each bit-exact with its plain-torch reference in moeq.formats.
#include "moeq.h"
#include "il16_rows.h"

void moeq_set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#endif
}

// A group into buf as fp32; returns its absmax, *bad = whether it holds NaN/Inf.
static inline float load_group_absmax(const void* w, int bf16, i64 base, i64 bs, float* buf, int* bad) {
    load_group(w, bf16, base, bs, buf);
    float am = 0.f;
    int nbad = 0;
#pragma omp simd reduction(max : am) reduction(+ : nbad)
    for (i64 k = 0; k < bs; k++) {
        const float a = fabsf(buf[k]);
        nbad += !(a <= 3.402823466e38f);
        am = a > am ? a : am;
    }
    *bad = nbad;
    return am;
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
                int bad;
                const float amax = load_group_absmax(w, bf16, base, gs, buf, &bad);
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

// (q - z) * s for each element of rows r0..r1-1 (serial; out holds row r0 first); out fp32 or bf16 (rounded once,
// like the torch reference).
void rtn_dequant_rows(const uint8_t* q, const void* scale, int scale_bf16, const uint8_t* zero, int bits, i64 r0,
                      i64 r1, i64 K, i64 gs, void* out, int out_bf16) {
    const i64 G = K / gs;
    const float half = (float)(1 << (bits - 1));
    for (i64 r = r0; r < r1; r++) {
        for (i64 g = 0; g < G; g++) {
            const float s = load_scale(scale, scale_bf16, r * G + g);
            const float z = zero ? (float)zero[r * G + g] : half;
            const i64 o = (r - r0) * K + g * gs;
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

void moeq_rtn_dequant(const uint8_t* q, const void* scale, int scale_bf16, const uint8_t* zero, int bits, i64 rows,
                      i64 K, i64 gs, void* out, int out_bf16) {
#pragma omp parallel for schedule(static)
    for (i64 r = 0; r < rows; r++)
        rtn_dequant_rows(q, scale, scale_bf16, zero, bits, r, r + 1, K, gs,
                         (char*)out + r * K * (out_bf16 ? 2 : 4), out_bf16);
}

// ---------------------------------------------------------------- bnb4 ------------------------------------------
// Whole blocks only (n % bs == 0): absmax = max|x|, scaled = clamp(x * (1/absmax), -1, 1), code = number of sorted
// midpoints strictly below (ties to the lower code), remapped by `order` (FP4); even element -> HIGH nibble.
// A block holding NaN/Inf gets a NaN absmax (the caller checks and names the tensor).
// A block's codes at absmax am: x * (1/am) clamped to [-1, 1], the nearest code (ties low), even element HIGH.
static inline void bnb4_codes(float* buf, int32_t* idx, i64 bs, float am, const float* bounds, const uint8_t* order,
                              uint8_t* o) {
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
    for (i64 j = 0; j < bs / 2; j++) o[j] = (uint8_t)((order[idx[2 * j]] << 4) | order[idx[2 * j + 1]]);
}

// NF4/FP4 blocks with a searched absmax (the plain-torch bnb4_absmax_search, natively): per block the stored
// absmax among absmax * (1 - (1 - min_alpha) i / candidates), i = 0..candidates, with the least squared error of
// nearest-code decoding (x * (1/am) clamped to [-1, 1], bucketized on the sorted code's midpoints, ties low);
// strictly better candidates win, so ties keep the larger absmax. candidates 0: the plain absmax (moeq_bnb4_quantize).
// Codes as bnb4_codes. bs <= 4096.
void moeq_bnb4_quantize_search(const void* w, int bf16, i64 nblocks, i64 bs, const float* bounds, const uint8_t* order,
                               const float* code_sorted, int candidates, float min_alpha, uint8_t* packed,
                               float* absmax) {
#if defined(__AVX512F__)
    float bpad[16];
    for (int j = 0; j < 16; j++) bpad[j] = j < 15 ? bounds[j] : INFINITY;
    const __m512 bnd = _mm512_loadu_ps(bpad), tabv = code_sorted ? _mm512_loadu_ps(code_sorted) : _mm512_setzero_ps();
#endif
#pragma omp parallel
    {
        float buf[4096];
        int32_t idx[4096];
#pragma omp for schedule(static)
        for (i64 b = 0; b < nblocks; b++) {
            const i64 base = b * bs;
            int bad;
            const float am0 = load_group_absmax(w, bf16, base, bs, buf, &bad);
            if (bad) { absmax[b] = NAN; continue; }
            float best_am = am0, best_e = INFINITY;
            for (int i = 0; candidates > 0 && i <= candidates; i++) {
                const float am = am0 * (float)(1.0 - (1.0 - (double)min_alpha) * i / candidates);
                const float r = 1.0f / (am < 1e-38f ? 1e-38f : am);
                float e = 0.f;
#if defined(__AVX512F__)
                if (bs % 16 == 0) {  // 16 values at once: a 4-step binary search over the midpoints, vpermps lookups
                    __m512 acc = _mm512_setzero_ps();
                    const __m512 rv = _mm512_set1_ps(r), amv = _mm512_set1_ps(am), one = _mm512_set1_ps(1.f);
                    for (i64 k = 0; k < bs; k += 16) {
                        const __m512 x = _mm512_loadu_ps(buf + k);
                        const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x, rv), _mm512_sub_ps(
                            _mm512_setzero_ps(), one)), one);
                        __m512i q = _mm512_setzero_si512();
                        for (int step = 8; step; step >>= 1) {
                            const __m512i probe = _mm512_add_epi32(q, _mm512_set1_epi32(step - 1));
                            const __mmask16 up = _mm512_cmp_ps_mask(_mm512_permutexvar_ps(probe, bnd), v, _CMP_LT_OQ);
                            q = _mm512_mask_add_epi32(q, up, q, _mm512_set1_epi32(step));
                        }
                        const __m512 d = _mm512_sub_ps(x, _mm512_mul_ps(_mm512_permutexvar_ps(q, tabv), amv));
                        acc = _mm512_fmadd_ps(d, d, acc);
                    }
                    e = _mm512_reduce_add_ps(acc);
                } else
#endif
                {
#pragma omp simd reduction(+ : e)
                    for (i64 k = 0; k < bs; k++) {
                        float v = buf[k] * r;
                        v = v < -1.f ? -1.f : v > 1.f ? 1.f : v;
                        int q = 0;
                        for (int j = 0; j < 15; j++) q += bounds[j] < v;
                        const float d = buf[k] - code_sorted[q] * am;
                        e += d * d;
                    }
                }
                if (e < best_e) { best_e = e; best_am = am; }
            }
            absmax[b] = best_am;
            bnb4_codes(buf, idx, bs, best_am, bounds, order, packed + base / 2);
        }
    }
}

// bitsandbytes' blocks with the plain absmax (its reference kernel's arithmetic). A block with NaN/Inf: NaN absmax.
void moeq_bnb4_quantize(const void* w, int bf16, i64 nblocks, i64 bs, const float* bounds, const uint8_t* order,
                        uint8_t* packed, float* absmax) {
    moeq_bnb4_quantize_search(w, bf16, nblocks, bs, bounds, order, NULL, 0, 1.f, packed, absmax);
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

// llama.cpp's 32-weight blocks -> moeq's RTN codes, in one pass: each block is `head` scale bytes (an fp16 scale,
// or MXFP4's E8M0 exponent byte) then the codes. 4-bit (Q4_0, IQ4_NL, MXFP4): 16 bytes, byte j = element j (low
// nibble) and element j + 16 (high) -> two per byte in order, element 2i in the low nibble. 8-bit (Q8_0): 32 int8
// -> code + 128. codes: nb x (32 * bits / 8) bytes; heads: the nb x head scale bytes gathered.
void moeq_ggml_unpack(const uint8_t* blocks, i64 nb, int bits, int head, uint8_t* codes, uint8_t* heads) {
    const i64 per = head + 32 * bits / 8, out = 32 * bits / 8;
#pragma omp parallel for schedule(static)
    for (i64 b = 0; b < nb; b++) {
        const uint8_t* g = blocks + b * per;
        uint8_t* o = codes + b * out;
        for (int j = 0; j < head; j++) heads[b * head + j] = g[j];
        g += head;
        if (bits == 4) {
            for (int i = 0; i < 8; i++) o[i] = (uint8_t)((g[2 * i] & 0xF) | ((g[2 * i + 1] & 0xF) << 4));
            for (int i = 0; i < 8; i++) o[8 + i] = (uint8_t)((g[2 * i] >> 4) | (g[2 * i + 1] & 0xF0));
        } else {
            for (int i = 0; i < 32; i++) o[i] = (uint8_t)(g[i] + 128);
        }
    }
}

// FP8 e4m3fn block-scaled weights (DeepSeek's layout): w[i][j] = e4m3(q[i][j]) * s[i / bn][j / bk] in fp32, then
// bf16 (round to nearest even) or fp32: the arithmetic of the torch reference (moeq.readers.fp8.dequantize).
// q: lead x N x K codes, s: lead x ceil(N/bn) x ceil(K/bk) fp32. Returns 0, or -1 when a NaN code (0x7F/0xFF) is met
// (the output is then incomplete and must not be used).
int moeq_fp8_dequant(const uint8_t* q, const float* s, i64 lead, i64 N, i64 K, i64 bn, i64 bk, void* out,
                     int out_bf16) {
    float lut[256];
    for (int c = 0; c < 256; c++) lut[c] = e4m3_value(c);
    const i64 TN = (N + bn - 1) / bn, TK = (K + bk - 1) / bk;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (i64 r = 0; r < lead * N; r++) {
        const i64 l = r / N, i = r % N;
        const uint8_t* qq = q + r * K;
        const float* ss = s + (l * TN + i / bn) * TK;
        for (i64 k = 0; k < K; k++) bad |= (qq[k] & 127) == 127;
        for (i64 t = 0; t < TK; t++) {  // one scale per column tile
            const float sc = ss[t];
            const i64 k0 = t * bk, k1 = k0 + bk < K ? k0 + bk : K;
            if (out_bf16) {
                uint16_t* o = (uint16_t*)out + r * K;
                for (i64 k = k0; k < k1; k++) o[k] = f2bf_finite(lut[qq[k]] * sc);
            } else {
                float* o = (float*)out + r * K;
                for (i64 k = k0; k < k1; k++) o[k] = lut[qq[k]] * sc;
            }
        }
    }
    return bad ? -1 : 0;
}

// Asymmetric RTN (min/max widened to include 0, integer zero point), exactly the torch reference's fp32 arithmetic:
// scale = (hi - lo) / maxq rounded to the storage dtype; zero = clamp(round(-lo / s)); q = clamp(round(x / s) + zero).
// A group holding NaN/Inf gets a NaN scale.
// The signed grid (llama.cpp's quantize_row_q4_0_ref / q5_0 arithmetic for 4/5 bits, the same rule at 8):
// d = peak / -2^(b-1) in fp32, codes min(2^b - 1, floor(x * (1/d) + 2^(b-1) + 0.5)) — products and sums rounded
// separately (no FMA contraction), exactly the torch reference —, scale d stored in the weight's dtype (bf16 rounds
// to nearest even). Rows: 4-bit nibbles (even low), 5-bit nibbles then fifth bits (LSB first), 8-bit bytes.
// A group holding NaN/Inf gets a NaN scale.
__attribute__((optimize("fp-contract=off")))
void moeq_rtn_quantize_signed(const void* w, int bf16, i64 rows, i64 K, i64 gs, int bits, uint8_t* q, void* scale) {
    const i64 G = K / gs, rowb = bits == 5 ? K / 8 * 5 : bits == 4 ? K / 2 : K;
    const float half = (float)(1 << (bits - 1)), maxq = (float)((1 << bits) - 1);
#pragma omp parallel
    {
        float buf[4096];
#pragma omp for schedule(static)
        for (i64 r = 0; r < rows; r++)
            for (i64 g = 0; g < G; g++) {
                load_group(w, bf16, r * K + g * gs, gs, buf);
                float amax = 0.f, peak = 0.f;
                int bad = 0;
                for (i64 k = 0; k < gs; k++) {
                    const float a = fabsf(buf[k]);
                    bad |= !(a <= 3.402823466e38f);
                    if (a > amax) { amax = a; peak = buf[k]; }
                }
                const float d = -peak / half;
                const float inv = d == 0.f ? 0.f : 1.f / d;
                if (bf16) ((uint16_t*)scale)[r * G + g] = bad ? (uint16_t)0x7fc0 : f2bf_finite(d);
                else ((float*)scale)[r * G + g] = bad ? NAN : d;
                if (bad) continue;
                uint8_t* o = q + r * rowb;
                for (i64 k = 0; k < gs; k++) {
                    const float p = buf[k] * inv;
                    float c = floorf(p + (half + 0.5f));
                    c = c < 0.f ? 0.f : c > maxq ? maxq : c;
                    const i64 e = g * gs + k;
                    const uint8_t u = (uint8_t)c;
                    if (bits == 8) {
                        o[e] = u;
                    } else {
                        if (e & 1) o[e / 2] = (uint8_t)((o[e / 2] & 15) | ((u & 15) << 4));
                        else o[e / 2] = (uint8_t)(u & 15);
                        if (bits == 5) {
                            uint8_t* h = o + K / 2 + e / 8;
                            const uint8_t bit = (uint8_t)(((u >> 4) & 1) << (e & 7));
                            *h = (uint8_t)((e & 7) ? (*h & ~(1u << (e & 7))) | bit : bit);
                        }
                    }
                }
            }
    }
}

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


// ------------------------------------------------------- 2/3/4/5-bit codebooks (iq4nl / nl3 / nl2 / signed) ---
// value = scale * values[code], nv = 8, 16 or 32 values sorted ascending (the pointer holds at least 16: the vector
// forms load 16), one scale per group, no zero point:
// llama.cpp's IQ4_NL (values kvalues_iq4nl), Q4_0 (values -8..7) and Q5_0 (values -16..15) blocks. Rows: the low
// four bits two per byte, even element in the LOW nibble (K/2 bytes); with 32 values then the fifth bits, LSB first
// (K/8 bytes; per group of 32 llama.cpp Q5_0's qh word); with 8 values (nl3) eight 3-bit codes per 24-bit word, three
// bytes low first (3K/8 bytes).

// The nearest value's index for y (ties to the lower index): a binary search over the nv - 1 midpoints (mid[nv-1..]
// are +inf).
static inline __attribute__((unused)) int cb4_nearest(const float* mid, int nv, float y) {
    int i = 0;
    for (int step = nv / 2; step; step >>= 1)
        if (y > mid[i + step - 1]) i += step;
    return i;
}

#if defined(__AVX512F__)
// The nearest index for 16 values at once. Fast form (when every gap between midpoints exceeds the bucket width):
// 32 buckets of width w from lo = mid[0] - w/2, w = (mid[14] - mid[0]) / 30, hold at most one midpoint each;
// index = base[bucket] + (y > that midpoint): two 32-entry table lookups instead of a 4-step binary search.
// Tables of consecutive integers (the signed grids) take index = ceil(y - v0 - 0.5), clamped: no lookups at all.
typedef struct {
    int fast, uniform, nv, noclamp, nb;  // nb: buckets, 32 (16 for tables of 8: one-source permutes)
    __m512 midv, mid1, bm0, bm1, bms0, bms1, tab0, tab1;
    __m512i base0, base1;
    float lo, inv_w, v0;
} cb4_index;

static void cb4_index_init(cb4_index* ix, const float* mid, const float* values, int nv, int ntry) {
    ix->nv = nv;
    ix->noclamp = 0;
    ix->midv = _mm512_loadu_ps(mid);
    ix->mid1 = _mm512_loadu_ps(mid + 16);
    ix->tab0 = _mm512_loadu_ps(values);
    ix->tab1 = nv == 32 ? _mm512_loadu_ps(values + 16) : ix->tab0;
    ix->v0 = values[0];
    ix->uniform = 1;
    for (int j = 1; j < nv; j++) ix->uniform &= values[j] == values[0] + (float)j;
    // The search's y = x * id never leaves +-Y, Y = |v0| (1 + ntry/127): when 32 buckets over +-Y still hold at most one
    // midpoint each, they cover every y and the bucket index needs no clamping (about a tenth of the inner loop).
    const float Y = fabsf(values[0]) * (1.f + (float)ntry / 127.f) * 1.001f + 1e-6f;
    const int nb = nv <= 8 ? 16 : 32;
    ix->nb = nb;
    const float wy = 2.f * Y / (float)nb;
    int wide = nv <= 16 && ntry >= 0;
    for (int j = 0; j < nv - 2; j++) wide &= mid[j + 1] - mid[j] > 1.01f * wy;
    wide &= fabsf(values[nv - 1]) <= fabsf(values[0]);  // the table's far end lies inside +-Y too
    const float w = wide ? wy : (mid[nv - 2] - mid[0]) / (float)(nb - 2);
    ix->fast = nv <= 16 && w > 0.f;
    for (int j = 0; j < nv - 2; j++) ix->fast &= mid[j + 1] - mid[j] > 1.01f * w;
    if (!ix->fast) return;
    ix->noclamp = wide;
    ix->lo = wide ? -Y : mid[0] - 0.5f * w;
    ix->inv_w = 1.f / w;
    int32_t base[32];
    float bm[32];
    for (int b = 0; b < 32; b++) {
        const float start = ix->lo + (float)(b % nb) * w, end = start + w;  // 16 buckets: the table twice
        base[b] = 0;
        bm[b] = INFINITY;
        for (int j = 0; j < nv - 1; j++) {
            base[b] += mid[j] < start;
            if (mid[j] >= start && mid[j] < end) bm[b] = mid[j];
        }
    }
    ix->base0 = _mm512_loadu_si512(base);
    ix->base1 = _mm512_loadu_si512(base + 16);
    ix->bm0 = _mm512_loadu_ps(bm);
    ix->bm1 = _mm512_loadu_ps(bm + 16);
    for (int b = 0; b < 32; b++) bm[b] = (bm[b] - ix->lo) * ix->inv_w;  // the midpoints in bucket units (inf stays)
    ix->bms0 = _mm512_loadu_ps(bm);
    ix->bms1 = _mm512_loadu_ps(bm + 16);
}

static inline __m512i cb4_nearest16(const cb4_index* ix, __m512 y) {
    if (ix->uniform) {
        const __m512i i = _mm512_cvtps_epi32(_mm512_roundscale_ps(
            _mm512_sub_ps(y, _mm512_set1_ps(ix->v0 + 0.5f)), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
        return _mm512_min_epi32(_mm512_max_epi32(i, _mm512_setzero_si512()), _mm512_set1_epi32(ix->nv - 1));
    }
    if (ix->fast) {
        __m512i b = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_sub_ps(y, _mm512_set1_ps(ix->lo)), _mm512_set1_ps(ix->inv_w)));
        b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), _mm512_set1_epi32(ix->nb - 1));
        const __m512i i = _mm512_permutex2var_epi32(ix->base0, b, ix->base1);
        const __mmask16 up = _mm512_cmp_ps_mask(y, _mm512_permutex2var_ps(ix->bm0, b, ix->bm1), _CMP_GT_OQ);
        return _mm512_mask_add_epi32(i, up, i, _mm512_set1_epi32(1));
    }
    __m512i i = _mm512_setzero_si512();
    for (int step = ix->nv / 2; step; step >>= 1) {
        const __m512i probe = _mm512_add_epi32(i, _mm512_set1_epi32(step - 1));
        const __mmask16 up = _mm512_cmp_ps_mask(y, _mm512_permutex2var_ps(ix->midv, probe, ix->mid1), _CMP_GT_OQ);
        i = _mm512_mask_add_epi32(i, up, i, _mm512_set1_epi32(step));
    }
    return i;
}

static inline __m512 cb4_value16(const cb4_index* ix, __m512i i) {
    if (ix->uniform) return _mm512_add_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(ix->v0));
    return ix->nv == 32 ? _mm512_permutex2var_ps(ix->tab0, i, ix->tab1) : _mm512_permutexvar_ps(i, ix->tab0);
}
#endif

// sum w*v[L]*x and sum w*v[L]^2 for the codes L nearest x*id (written to L when L != NULL); scalar form.
static inline __attribute__((unused)) void cb4_sums(const float* x, const float* wt, i64 n, const float* values,
                                                     const float* mid, int nv, float id, float* sqx, float* sq2,
                                                     uint8_t* L) {
    float a = 0.f, b = 0.f;
    for (i64 k = 0; k < n; k++) {
        const int i = cb4_nearest(mid, nv, x[k] * id);
        a += wt[k] * values[i] * x[k];
        b += wt[k] * values[i] * values[i];
        if (L) L[k] = (uint8_t)i;
    }
    *sqx = a;
    *sq2 = b;
}

static inline __attribute__((unused)) float cb4_err(const float* x, const float* wt, i64 n, const float* values, const uint8_t* L, float d) {
    float e = 0.f;
    for (i64 k = 0; k < n; k++) {
        const float r = x[k] - d * values[L[k]];
        e += wt[k] * r * r;
    }
    return e;
}

static inline float f16_round(float f) {  // round to the nearest fp16 value (ties to even; overflow: +-inf)
    const float a = fabsf(f);
    if (a == 0.f || !(a < INFINITY)) return f;
    int e;
    frexpf(a, &e);  // a = m 2^e, m in [0.5, 1): fp16 keeps 11 significant bits, subnormals a 2^-24 step
    const float ulp = ldexpf(1.f, e - 11 > -24 ? e - 11 : -24);
    const float r = rintf(a / ulp) * ulp;
    return copysignf(r > 65504.f ? INFINITY : r, f);
}

static inline float cb4_store_scale(float d) { return f16_round(bf2f(f2bf_finite(d))); }  // exact in bf16 and fp16

static inline float cb4_weight(int weighting, float x, float sigma2) {
    return weighting == 0 ? 1.f : weighting == 1 ? x * x : sigma2 + x * x;
}

#if defined(__AVX512F__)
// 16 consecutive groups b0..b0+nl-1 at once, one per lane (x transposed: xt[k * 16 + lane], gathered from the
// source), so no horizontal sums and independent chains; writes their scales and packed codes. xt, wt: gs * 16
// floats; codes: gs * 32 bytes.
static void cb4_chunk16(const void* w, int bf16, i64 b0, int nl, i64 G, i64 gs, const float* sig, int weighting,
                        const float* colw, const float* values, const cb4_index* ix, int ntry, int zi, float* xt,
                        float* wt, uint8_t* codes, uint8_t* q, i64 K, i64 rowb, uint16_t* scale) {
    const __m512 zero = _mm512_setzero_ps();
    const __mmask16 in = nl == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nl) - 1);
    const __m512i lane = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)gs));
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    __m512 amax = zero;
    __mmask16 bad = 0;
    __m512i pair = _mm512_setzero_si512();
    for (i64 k = 0; k < gs; k++) {
        __m512 x;
        if (bf16) {  // 32-bit gathers of aligned element pairs (never past the tensor), one per pair, split in two
            if (!(k & 1))
                pair = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in,
                    _mm512_add_epi32(lane, _mm512_set1_epi32((int)k)), (const uint16_t*)w + b0 * gs, 2);
            x = _mm512_castsi512_ps(k & 1 ? _mm512_and_si512(pair, _mm512_set1_epi32((int)0xffff0000u))
                                          : _mm512_slli_epi32(pair, 16));
        } else {
            x = _mm512_mask_i32gather_ps(zero, in, _mm512_add_epi32(lane, _mm512_set1_epi32((int)k)),
                                         (const float*)w + b0 * gs, 4);
        }
        _mm512_storeu_ps(xt + k * 16, x);
        const __m512 ax = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), absm));
        bad |= _mm512_cmp_ps_mask(ax, _mm512_set1_ps(3.402823466e38f), _CMP_NLE_UQ);
        amax = _mm512_max_ps(amax, ax);
    }
    __m512 mxv = zero;
    __mmask16 found = bad;
    const __m512 s2 = _mm512_maskz_loadu_ps(in, sig);
    __m512i col = _mm512_setzero_si512();  // each lane's first input column (colw: importance per column)
    if (colw) {
        int32_t c0[16] = {0};
        for (int l = 0; l < nl; l++) c0[l] = (int32_t)(((b0 + l) % G) * gs);
        col = _mm512_loadu_si512(c0);
    }
    for (i64 k = 0; k < gs; k++) {
        __m512 x = _mm512_loadu_ps(xt + k * 16);
        if (bad) {
            x = _mm512_maskz_mov_ps((__mmask16)~bad, x);
            _mm512_storeu_ps(xt + k * 16, x);
        }
        const __m512 ax = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), absm));
        const __mmask16 m = _mm512_cmp_ps_mask(ax, amax, _CMP_EQ_OQ) & (__mmask16)~found;
        mxv = _mm512_mask_mov_ps(mxv, m, x);
        found |= m;
        const __m512 x2 = _mm512_mul_ps(x, x);
        __m512 wk = weighting == 0 ? _mm512_set1_ps(1.f) : weighting == 1 ? x2 : _mm512_add_ps(s2, x2);
        if (colw)
            wk = _mm512_mul_ps(wk, _mm512_mask_i32gather_ps(zero, in, _mm512_add_epi32(col, _mm512_set1_epi32((int)k)),
                                                            colw, 4));
        _mm512_storeu_ps(wt + k * 16, wk);
    }
    const __mmask16 live = _mm512_cmp_ps_mask(mxv, zero, _CMP_NEQ_OQ);
    const __m512 safe = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.f), mxv);
    const __m512 inv_mx = _mm512_maskz_div_ps(live, _mm512_set1_ps(1.f), safe);  // candidates: c * (1 / max)
    __m512 best = _mm512_set1_ps(-1.f), d = zero, bid = zero;
    // the tables in registers, the loop over k unrolled by two with separate accumulators (latency-bound otherwise)
    const __m512 inv_w = _mm512_set1_ps(ix->inv_w), off = _mm512_set1_ps(-ix->lo * ix->inv_w);
    const __m512 bms0 = ix->bms0, bms1 = ix->bms1;
    const __m512i base0 = ix->base0, base1 = ix->base1, one = _mm512_set1_epi32(1), b31 = _mm512_set1_epi32(ix->nb - 1);
    const int nb16 = ix->nb == 16;
    const __m512i z0 = _mm512_setzero_si512();
    const int clamp = !ix->noclamp;
#define CB4_FAST(x, out, clamp) CB4_FAST2(x, idw, out, clamp)
#define CB4_FAST2(x, idw_, out, clamp) do { /* in bucket units: u = (x id - lo) / w, one FMA */ \
        const __m512 u_ = _mm512_fmadd_ps((x), (idw_), off); \
        __m512i bk_ = _mm512_cvttps_epi32(u_); \
        if (clamp) bk_ = _mm512_min_epi32(_mm512_max_epi32(bk_, z0), b31); \
        const __m512i i_ = nb16 ? _mm512_permutexvar_epi32(bk_, base0) : _mm512_permutex2var_epi32(base0, bk_, base1); \
        const __m512 m_ = nb16 ? _mm512_permutexvar_ps(bk_, bms0) : _mm512_permutex2var_ps(bms0, bk_, bms1); \
        out = _mm512_mask_add_epi32(i_, _mm512_cmp_ps_mask(u_, m_, _CMP_GT_OQ), i_, one); \
    } while (0)
// two elements' weighted sums of x v and v^2 (x0/x1 at k, k+1 with values v0/v1) into the accumulator pairs
#define CB4_ACC() do { \
        const __m512 w0 = _mm512_mul_ps(_mm512_loadu_ps(wt + k * 16), v0); \
        const __m512 w1 = _mm512_mul_ps(_mm512_loadu_ps(wt + k * 16 + 16), v1); \
        a0 = _mm512_fmadd_ps(w0, x0, a0); \
        b0v = _mm512_fmadd_ps(w0, v0, b0v); \
        a1 = _mm512_fmadd_ps(w1, x1, a1); \
        b1v = _mm512_fmadd_ps(w1, v1, b1v); \
    } while (0)
#define CB4_ID(c) _mm512_maskz_mul_ps(live, _mm512_set1_ps((float)((c) < T ? 1 : -1) * values[0] * \
                                                  (1.f - (float)((c) % T - ntry) / 127.f)), inv_mx)
#define CB4_WIN(a, b, idv) do { \
        const __mmask16 up_ = _mm512_cmp_ps_mask(b, zero, _CMP_GT_OQ) & \
                              _mm512_cmp_ps_mask(_mm512_mul_ps(a, a), _mm512_mul_ps(best, b), _CMP_GT_OQ); \
        d = _mm512_mask_div_ps(d, up_, a, b); \
        best = _mm512_mask_mul_ps(best, up_, d, a); \
        bid = _mm512_mask_mov_ps(bid, up_, idv); \
    } while (0)
    // candidates c = 0..2T-1: s = +1 then -1, t = -ntry..ntry (id = s v0 (1 - t/127) / max)
    const int T = 2 * ntry + 1;
    int c = 0;
    if (ix->fast && !ix->uniform && gs % 2 == 0)  // two candidates per pass over the group: x and w loaded once
        for (; c + 2 <= 2 * T; c += 2) {
            const __m512 idA = CB4_ID(c), idB = CB4_ID(c + 1);
            const __m512 idwA = _mm512_mul_ps(idA, inv_w), idwB = _mm512_mul_ps(idB, inv_w);
            __m512 a0 = zero, b0v = zero, a1 = zero, b1v = zero, e0 = zero, f0 = zero, e1 = zero, f1 = zero;
            for (i64 k = 0; k < gs; k += 2) {  // per candidate the same sums, in the same order, as the loop below
                const __m512 x0 = _mm512_loadu_ps(xt + k * 16), x1 = _mm512_loadu_ps(xt + k * 16 + 16);
                const __m512 w0 = _mm512_loadu_ps(wt + k * 16), w1 = _mm512_loadu_ps(wt + k * 16 + 16);
                __m512i iA0, iA1, iB0, iB1;
                CB4_FAST2(x0, idwA, iA0, clamp);
                CB4_FAST2(x1, idwA, iA1, clamp);
                CB4_FAST2(x0, idwB, iB0, clamp);
                CB4_FAST2(x1, idwB, iB1, clamp);
                const __m512 vA0 = _mm512_permutexvar_ps(iA0, ix->tab0), vA1 = _mm512_permutexvar_ps(iA1, ix->tab0);
                const __m512 vB0 = _mm512_permutexvar_ps(iB0, ix->tab0), vB1 = _mm512_permutexvar_ps(iB1, ix->tab0);
                const __m512 wA0 = _mm512_mul_ps(w0, vA0), wA1 = _mm512_mul_ps(w1, vA1);
                const __m512 wB0 = _mm512_mul_ps(w0, vB0), wB1 = _mm512_mul_ps(w1, vB1);
                a0 = _mm512_fmadd_ps(wA0, x0, a0);
                b0v = _mm512_fmadd_ps(wA0, vA0, b0v);
                a1 = _mm512_fmadd_ps(wA1, x1, a1);
                b1v = _mm512_fmadd_ps(wA1, vA1, b1v);
                e0 = _mm512_fmadd_ps(wB0, x0, e0);
                f0 = _mm512_fmadd_ps(wB0, vB0, f0);
                e1 = _mm512_fmadd_ps(wB1, x1, e1);
                f1 = _mm512_fmadd_ps(wB1, vB1, f1);
            }
            const __m512 aA = _mm512_add_ps(a0, a1), bA = _mm512_add_ps(b0v, b1v);
            const __m512 aB = _mm512_add_ps(e0, e1), bB = _mm512_add_ps(f0, f1);
            CB4_WIN(aA, bA, idA);
            CB4_WIN(aB, bB, idB);
        }
    for (; c < 2 * T; c++) {
        {
            const __m512 idv = CB4_ID(c);
            __m512 a0 = zero, b0v = zero, a1 = zero, b1v = zero;
            const __m512 idw = _mm512_mul_ps(idv, inv_w);
            i64 k = 0;
            if (ix->uniform) {
                const __m512 off = _mm512_set1_ps(ix->v0 + 0.5f), top = _mm512_set1_ps((float)(ix->nv - 1));
                const __m512 v0f = _mm512_set1_ps(ix->v0);
                for (; k + 2 <= gs; k += 2) {  // index = clamp(ceil(y - v0 - 0.5)), value = v0 + index
                    const __m512 x0 = _mm512_loadu_ps(xt + k * 16), x1 = _mm512_loadu_ps(xt + k * 16 + 16);
                    const __m512 c0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_sub_ps(
                        _mm512_mul_ps(x0, idv), off), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC), zero), top);
                    const __m512 c1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_sub_ps(
                        _mm512_mul_ps(x1, idv), off), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC), zero), top);
                    const __m512 v0 = _mm512_add_ps(c0, v0f), v1 = _mm512_add_ps(c1, v0f);
                    CB4_ACC();
                }
            } else if (ix->fast) {  // clamp: loop-invariant (gcc unswitches the loop)
                for (; k + 2 <= gs; k += 2) {
                    const __m512 x0 = _mm512_loadu_ps(xt + k * 16), x1 = _mm512_loadu_ps(xt + k * 16 + 16);
                    __m512i i0, i1;
                    CB4_FAST(x0, i0, clamp);
                    CB4_FAST(x1, i1, clamp);
                    const __m512 v0 = _mm512_permutexvar_ps(i0, ix->tab0), v1 = _mm512_permutexvar_ps(i1, ix->tab0);
                    CB4_ACC();
                }
            }
            for (; k < gs; k++) {
                const __m512 xv = _mm512_loadu_ps(xt + k * 16);
                const __m512 v = cb4_value16(ix, cb4_nearest16(ix, _mm512_mul_ps(xv, idv)));
                const __m512 wv = _mm512_mul_ps(_mm512_loadu_ps(wt + k * 16), v);
                a0 = _mm512_fmadd_ps(wv, xv, a0);
                b0v = _mm512_fmadd_ps(wv, v, b0v);
            }
            const __m512 a = _mm512_add_ps(a0, a1), b = _mm512_add_ps(b0v, b1v);
            CB4_WIN(a, b, idv);
        }
    }
#undef CB4_FAST
#undef CB4_FAST2
#undef CB4_ACC
#undef CB4_ID
#undef CB4_WIN
    // lanes without a winner (every weight 0: x^2 underflowed, or an all-zero group): plain max mapping
    const __mmask16 none = _mm512_cmp_ps_mask(best, zero, _CMP_LT_OQ);
    const __m512 dn = _mm512_div_ps(mxv, _mm512_set1_ps(values[0]));
    d = _mm512_mask_mov_ps(d, none, dn);
    bid = _mm512_mask_mov_ps(bid, none, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dn, zero, _CMP_NEQ_OQ),
                                                            _mm512_set1_ps(1.f), dn));
    // cb4_store_scale for 16 lanes: bf16 rounding (finite), then fp16's (vcvtps2ph: nearest even, overflow inf)
    const __m512 db = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32_to_bf16x16(d)), 16));
    const __m512 dsv = _mm512_cvtph_ps(_mm512_cvtps_ph(db, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    float ds[16];
    _mm512_storeu_ps(ds, dsv);
    // the codes at the winning candidate vs re-rounded to the stored scale: the lower weighted error per lane
    const __m512 id1 = bid;
    const __m512 id2 = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dsv, zero, _CMP_NEQ_OQ), _mm512_set1_ps(1.f), dsv);
    __m512 e1 = zero, e2 = zero;
    for (i64 k = 0; k < gs; k++) {
        const __m512 xv = _mm512_loadu_ps(xt + k * 16), wv = _mm512_loadu_ps(wt + k * 16);
        const __m512i i1 = cb4_nearest16(ix, _mm512_mul_ps(xv, id1)), i2 = cb4_nearest16(ix, _mm512_mul_ps(xv, id2));
        const __m512 r1 = _mm512_fnmadd_ps(dsv, cb4_value16(ix, i1), xv);
        const __m512 r2 = _mm512_fnmadd_ps(dsv, cb4_value16(ix, i2), xv);
        e1 = _mm512_fmadd_ps(_mm512_mul_ps(wv, r1), r1, e1);
        e2 = _mm512_fmadd_ps(_mm512_mul_ps(wv, r2), r2, e2);
        _mm_storeu_si128((__m128i*)(codes + k * 16), _mm512_cvtepi32_epi8(i1));
        _mm_storeu_si128((__m128i*)(codes + (gs + k) * 16), _mm512_cvtepi32_epi8(i2));
    }
    const __mmask16 take2 = _mm512_cmp_ps_mask(e2, e1, _CMP_LE_OQ);
    const __mmask16 dead = bad | (__mmask16)~live;  // all-zero or non-finite groups: code zi everywhere
    const __m128i zc = _mm_set1_epi8((char)zi), lo4 = _mm_set1_epi8(15);
    for (i64 k = 0; k < gs; k++) {  // the final codes [k][lane], in place
        __m128i c = _mm_mask_blend_epi8(take2, _mm_loadu_si128((const __m128i*)(codes + k * 16)),
                                        _mm_loadu_si128((const __m128i*)(codes + (gs + k) * 16)));
        _mm_storeu_si128((__m128i*)(codes + k * 16), _mm_mask_blend_epi8(dead, c, zc));
    }
    for (int l = 0; l < nl; l++) {
        const i64 b = b0 + l, r = b / G, g = b % G;
        scale[b] = (bad >> l) & 1 ? (uint16_t)0x7fc0 : (live >> l) & 1 ? f2bf_finite(ds[l]) : 0;
        if (ix->nv == 32) {  // fifth bits, LSB first
            uint8_t* h = q + r * rowb + K / 2 + g * gs / 8;
            for (i64 m = 0; m < gs / 8; m++) {
                uint8_t byte = 0;
                for (int i = 0; i < 8; i++) byte |= (uint8_t)(((codes[(8 * m + i) * 16 + l] >> 4) & 1) << i);
                h[m] = byte;
            }
        }
    }
    if (ix->nv == 4) {  // 2-bit: four codes per byte, LSB first
        for (int l = 0; l < nl; l++) {
            const i64 b = b0 + l;
            uint8_t* o = q + (b / G) * rowb + (b % G) * gs / 4;
            for (i64 j = 0; j < gs / 4; j++)
                o[j] = (uint8_t)((codes[(4 * j) * 16 + l] & 3) | (codes[(4 * j + 1) * 16 + l] & 3) << 2 |
                                 (codes[(4 * j + 2) * 16 + l] & 3) << 4 | (codes[(4 * j + 3) * 16 + l] & 3) << 6);
        }
        return;
    }
    if (ix->nv == 8) {  // 3-bit: eight codes per 24-bit word, the 16 lanes' words at once
        for (i64 m = 0; m < gs / 8; m++) {
            __m512i wv = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++)
                wv = _mm512_or_si512(wv, _mm512_sll_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                    (const __m128i*)(codes + (8 * m + i) * 16))), _mm_cvtsi32_si128(3 * i)));
            uint32_t words[16];
            _mm512_storeu_si512(words, wv);
            for (int l = 0; l < nl; l++) {
                const i64 b = b0 + l;
                uint8_t* o = q + (b / G) * rowb + (b % G) * gs / 8 * 3 + 3 * m;
                o[0] = (uint8_t)words[l];
                o[1] = (uint8_t)(words[l] >> 8);
                o[2] = (uint8_t)(words[l] >> 16);
            }
        }
        return;
    }
    for (i64 j = 0; j < gs / 2; j++) {  // low nibbles: packed pairs [j][lane], then written out per lane
        const __m128i c0 = _mm_and_si128(_mm_loadu_si128((const __m128i*)(codes + 2 * j * 16)), lo4);
        const __m128i c1 = _mm_and_si128(_mm_loadu_si128((const __m128i*)(codes + (2 * j + 1) * 16)), lo4);
        _mm_storeu_si128((__m128i*)(codes + (gs + j) * 16), _mm_or_si128(c0, _mm_slli_epi16(c1, 4)));
    }
    for (int l = 0; l < nl; l++) {
        const i64 b = b0 + l;
        uint8_t* o = q + (b / G) * rowb + (b % G) * gs / 2;
        for (i64 j = 0; j < gs / 2; j++) o[j] = codes[(gs + j) * 16 + l];
    }
}
#else
// One group (the scalar form of cb4_search16).
static void cb4_search1(const float* x, const float* wt, i64 gs, const float* values, const float* mid, int nv,
                        int ntry, float mx, float* dout, uint8_t* L, uint8_t* Lb) {
    float best = -1.f, d = 0.f, sqx, sq2;
    for (int s = 1; s >= -1; s -= 2)
        for (int t = -ntry; t <= ntry; t++) {
            const float id = mx != 0.f ? (float)s * values[0] * (1.f - (float)t / 127.f) * (1.f / mx) : 0.f;
            cb4_sums(x, wt, gs, values, mid, nv, id, &sqx, &sq2, L);
            if (sq2 > 0.f && sqx * sqx > best * sq2) {
                d = sqx / sq2;
                best = d * sqx;
                memcpy(Lb, L, (size_t)gs);
            }
        }
    if (best < 0.f) {
        d = mx / values[0];
        cb4_sums(x, wt, gs, values, mid, nv, d != 0.f ? 1.f / d : 0.f, &sqx, &sq2, Lb);
    }
    const float ds = cb4_store_scale(d);
    cb4_sums(x, wt, gs, values, mid, nv, ds != 0.f ? 1.f / ds : 0.f, &sqx, &sq2, L);
    if (cb4_err(x, wt, gs, values, Lb, ds) < cb4_err(x, wt, gs, values, L, ds)) memcpy(L, Lb, (size_t)gs);
    *dout = ds;
}
#endif

// Per group: the scale minimizing sum w (x - d v[L])^2 over candidate inverse scales id = s v0 (1 - t/127) (1 / max),
// s = +-1, t = -ntry..ntry (llama.cpp's quantize_row_iq4_nl_impl search, over both signs), d refit by least squares
// per candidate; the winner's d rounded to a value exact in both bf16 and fp16 (stored bf16, exported fp16), then its
// codes re-rounded to that d when that lowers the weighted error. Weights: 0 uniform, 1 x^2 (llama.cpp without an
// importance matrix), 2 sigma2 + x^2 (sigma2 = the row's mean square); times colw[k] per input column k when colw
// is given (>= 0, finite: e.g. the preceding norm's scale squared). A group holding NaN/Inf gets a NaN scale.
// gs % 16 == 0 and gs <= 4096 (the scalar form's buffers; the caller checks).
void moeq_cb4_search(const void* w, int bf16, i64 rows, i64 K, i64 gs, const float* values, int nv, int ntry,
                     int weighting, const float* colw, uint8_t* q, uint16_t* scale) {
    const i64 G = K / gs, NB = rows * G, rowb = packed_row_bytes(cb_bits(nv), K);
    float mid[32];
    for (int j = 0; j < 32; j++) mid[j] = j < nv - 1 ? 0.5f * (values[j] + values[j + 1]) : INFINITY;
    int zi = 0;  // the code nearest zero (an all-zero or non-finite group)
    for (int j = 1; j < nv; j++) if (fabsf(values[j]) < fabsf(values[zi])) zi = j;
    float* sig = (float*)calloc((size_t)rows, sizeof(float));
    if (weighting == 2) {
#pragma omp parallel for schedule(static)
        for (i64 r = 0; r < rows; r++) {
            float buf[4096], acc = 0.f;
            for (i64 k0 = 0; k0 < K; k0 += 4096) {  // the row in pieces (any group size)
                const i64 n = K - k0 < 4096 ? K - k0 : 4096;
                load_group(w, bf16, r * K + k0, n, buf);
#pragma omp simd reduction(+ : acc)
                for (i64 k = 0; k < n; k++) acc += buf[k] * buf[k];
            }
            sig[r] = acc / (float)K;
        }
    }
#if defined(__AVX512F__)
    cb4_index ix;
    cb4_index_init(&ix, mid, values, nv, ntry);
#pragma omp parallel
    {
        float* xt = (float*)malloc((size_t)gs * 16 * sizeof(float));
        float* wt = (float*)malloc((size_t)gs * 16 * sizeof(float));
        uint8_t* codes = (uint8_t*)malloc((size_t)gs * 32);
#pragma omp for schedule(static)
        for (i64 c = 0; c < (NB + 15) / 16; c++) {
            const i64 b0 = c * 16;
            const int nl = NB - b0 < 16 ? (int)(NB - b0) : 16;
            float s2[16] = {0};
            for (int l = 0; l < nl; l++) s2[l] = sig[(b0 + l) / G];
            cb4_chunk16(w, bf16, b0, nl, G, gs, s2, weighting, colw, values, &ix, ntry, zi, xt, wt, codes, q, K, rowb,
                        scale);
        }
        free(xt);
        free(wt);
        free(codes);
    }
#else
#pragma omp parallel
    {
        float* x = (float*)malloc((size_t)gs * sizeof(float));
        float* wt = (float*)malloc((size_t)gs * sizeof(float));
        uint8_t* codes = (uint8_t*)malloc((size_t)gs * 2);
#pragma omp for schedule(static)
        for (i64 b = 0; b < NB; b++) {
            load_group(w, bf16, b * gs, gs, x);  // group b starts at b*gs: rows are whole groups
            float amax = 0.f, mx = 0.f, ds = 0.f;
            int bad = 0;
            for (i64 k = 0; k < gs; k++) {
                const float a = fabsf(x[k]);
                bad |= !(a <= 3.402823466e38f);
                if (a > amax) { amax = a; mx = x[k]; }
                wt[k] = cb4_weight(weighting, x[k], sig[b / G]) * (colw ? colw[(b % G) * gs + k] : 1.f);
            }
            const i64 r = b / G, g = b % G;
            uint8_t* o = q + r * rowb + g * gs / 2;  // (4/5-bit; 2/3-bit below)
            if (bad || mx == 0.f) {
                scale[b] = bad ? (uint16_t)0x7fc0 : 0;
                for (i64 k = 0; k < gs; k++) codes[k] = (uint8_t)zi;
            } else {
                cb4_search1(x, wt, gs, values, mid, nv, ntry, mx, &ds, codes, codes + gs);
            }
            if (nv == 4)
                for (i64 j = 0; j < gs / 4; j++)
                    q[r * rowb + g * gs / 4 + j] = (uint8_t)((codes[4 * j] & 3) | (codes[4 * j + 1] & 3) << 2 |
                                                             (codes[4 * j + 2] & 3) << 4 | (codes[4 * j + 3] & 3) << 6);
            else if (nv == 8)
                for (i64 m = 0; m < gs / 8; m++) pack3_8(codes + 8 * m, q + r * rowb + (g * gs + 8 * m) / 8 * 3);
            else
                for (i64 j = 0; j < gs / 2; j++) o[j] = (uint8_t)((codes[2 * j] & 15) | ((codes[2 * j + 1] & 15) << 4));
            if (nv == 32)
                for (i64 m = 0; m < gs / 8; m++) {
                    uint8_t byte = 0;
                    for (int i = 0; i < 8; i++) byte |= (uint8_t)(((codes[8 * m + i] >> 4) & 1) << i);
                    q[r * rowb + K / 2 + g * gs / 8 + m] = byte;
                }
            if (bad || mx == 0.f) continue;
            scale[b] = f2bf_finite(ds);
        }
        free(x);
        free(wt);
        free(codes);
    }
#endif
    free(sig);
}

// scale * values[code] per element of rows r0..r1-1 (serial; out holds row r0 first): 2-bit, 3-bit, 4-bit codes, or 5-bit
// (the row's fifth-bit plane after its nibbles); out fp32 or bf16 (rounded once).
void cb4_dequant_rows(const uint8_t* q, const void* scale, int scale_bf16, const uint16_t* sup, const float* values,
                      int bits, i64 r0, i64 r1, i64 K, i64 gs, void* out, int out_bf16) {
    const i64 G = K / gs, rowb = packed_row_bytes(bits, K);
    for (i64 r = r0; r < r1; r++)
        for (i64 g = 0; g < G; g++) {
            const float s = load_scale(scale, scale_bf16, r * G + g) * row_super(sup, r);  // exact: 8 x 8 bits
            const uint8_t* qq = q + r * rowb + g * gs / 2;
            const uint8_t* hb = q + r * rowb + K / 2 + g * gs / 8;
            const i64 o = (r - r0) * K + g * gs;
#if defined(__AVX512BW__)
            if (bits == 2) {  // 4 bytes -> 16 values (code i at bits 2i of the little-endian word); gs % 16 == 0
                const __m512 t0 = _mm512_loadu_ps(values), sv = _mm512_set1_ps(s);
                const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                const uint8_t* q2 = q + r * rowb + g * gs / 4;
                for (i64 j = 0; j < gs; j += 16) {
                    uint32_t word;
                    memcpy(&word, q2 + j / 4, 4);
                    const __m512i c = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)word), sh),
                                                       _mm512_set1_epi32(3));
                    const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(c, t0), sv);
                    if (out_bf16) _mm256_storeu_si256((__m256i*)((uint16_t*)out + o + j), f32_to_bf16x16(v));
                    else _mm512_storeu_ps((float*)out + o + j, v);
                }
                continue;
            }
            if (bits == 3) {  // 6 bytes (two 24-bit words) -> 16 values; gs % 16 == 0
                const __m512 t0 = _mm512_loadu_ps(values), sv = _mm512_set1_ps(s);
                const uint8_t* q3 = q + r * rowb + g * gs / 8 * 3;
                for (i64 j = 0; j < gs; j += 16) {
                    const uint8_t* p6 = q3 + j / 8 * 3;
                    uint64_t six = 0;  // the 6 bytes, by one 8-byte load ending inside them where one fits
                    if (p6 - q >= 2) {
                        memcpy(&six, p6 - 2, 8);
                        six >>= 16;
                    } else {
                        memcpy(&six, p6, 6);
                    }
                    const __m128i c = _mm_set_epi64x((long long)unpack3_word((uint32_t)(six >> 24)),
                                                     (long long)unpack3_word((uint32_t)(six & 0xFFFFFFu)));
                    const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c), t0), sv);
                    if (out_bf16) _mm256_storeu_si256((__m256i*)((uint16_t*)out + o + j), f32_to_bf16x16(v));
                    else _mm512_storeu_ps((float*)out + o + j, v);
                }
                continue;
            }
            if (gs % 32 == 0) {  // 16 bytes -> 32 values: low nibbles are the even elements, high the odd
                const __m512 t0 = _mm512_loadu_ps(values), t1 = bits == 5 ? _mm512_loadu_ps(values + 16) : t0;
                const __m512 sv = _mm512_set1_ps(s);
                const __m512i idx_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
                const __m512i idx_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
                const __m512i f = _mm512_set1_epi32(15), b4 = _mm512_set1_epi32(16);
                for (i64 j = 0; j < gs / 2; j += 16) {
                    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qq + j)));
                    __m512i ei = _mm512_and_si512(b, f), oi = _mm512_srli_epi32(b, 4);
                    if (bits == 5) {  // elements 2j.. 2j+31: their fifth bits, even ones to ei, odd ones to oi
                        uint32_t h;
                        memcpy(&h, hb + j / 4, 4);
                        uint16_t me = 0, mo = 0;
                        for (int i = 0; i < 16; i++) {
                            me |= (uint16_t)(((h >> (2 * i)) & 1) << i);
                            mo |= (uint16_t)(((h >> (2 * i + 1)) & 1) << i);
            }
                        ei = _mm512_mask_or_epi32(ei, me, ei, b4);
                        oi = _mm512_mask_or_epi32(oi, mo, oi, b4);
                    }
                    const __m512 ev = _mm512_mul_ps(_mm512_permutex2var_ps(t0, ei, t1), sv);
                    const __m512 od = _mm512_mul_ps(_mm512_permutex2var_ps(t0, oi, t1), sv);
                    const __m512 lo = _mm512_permutex2var_ps(ev, idx_lo, od), hi = _mm512_permutex2var_ps(ev, idx_hi, od);
                    if (out_bf16) {
                        uint16_t* dst = (uint16_t*)out + o + 2 * j;
                        _mm256_storeu_si256((__m256i*)dst, f32_to_bf16x16(lo));
                        _mm256_storeu_si256((__m256i*)(dst + 16), f32_to_bf16x16(hi));
                    } else {
                        _mm512_storeu_ps((float*)out + o + 2 * j, lo);
                        _mm512_storeu_ps((float*)out + o + 2 * j + 16, hi);
                    }
                }
                continue;
            }
#endif
            for (i64 k = 0; k < gs; k++) {
                const float v = s * values[packed_code(q + r * rowb, bits, K, g * gs + k)];
                if (out_bf16) ((uint16_t*)out)[o + k] = f2bf(v);
                else ((float*)out)[o + k] = v;
            }
        }
}

void moeq_cb4_dequant(const uint8_t* q, const void* scale, int scale_bf16, const uint16_t* sup, const float* values,
                      int bits, i64 rows, i64 K, i64 gs, void* out, int out_bf16) {
#pragma omp parallel for schedule(static)
    for (i64 r = 0; r < rows; r++)
        cb4_dequant_rows(q, scale, scale_bf16, sup, values, bits, r, r + 1, K, gs,
                         (char*)out + r * K * (out_bf16 ? 2 : 4), out_bf16);
}

// Double quantization of the search's bf16 group scales [rows, G]: per row the factor sup = bf16(max |s| / 127) and
// each scale's int8 code round(s / sup) (nearest even, clamped to +-127; 0 when sup is 0). A row holding a
// non-finite scale (the search's mark of a group it could not fit) gets a NaN factor and codes 0, so the result
// fails validation as the torch twin's does (its amax propagates NaN). The twin of rtn._double_quant's torch lines.
void moeq_cb4_scale_codes(const uint16_t* scale, i64 rows, i64 G, int8_t* sc, uint16_t* sup) {
#pragma omp parallel for schedule(static)
    for (i64 r = 0; r < rows; r++) {
        float amax = 0.f;
        int bad = 0;
        for (i64 g = 0; g < G; g++) {
            const float a = fabsf(bf2f(scale[r * G + g]));
            bad |= !(a <= 3.402823466e38f);
            amax = a > amax ? a : amax;
        }
        if (bad) {
            sup[r] = 0x7fc0;
            memset(sc + r * G, 0, (size_t)G);
            continue;
        }
        const uint16_t h = f2bf(amax / 127.f);
        const float f = bf2f(h);
        sup[r] = h;
        for (i64 g = 0; g < G; g++) {
            float c = f > 0.f ? rintf(bf2f(scale[r * G + g]) / f) : 0.f;
            c = c > 127.f ? 127.f : c < -127.f ? -127.f : c;
            sc[r * G + g] = (int8_t)c;
        }
    }
}

// Codes for given double-quantized scales (scale = sc[r, g] * sup[r], a codebook of nv sorted values): each weight
// gets the nearest value of w / scale (ties to the lower value; a zero scale gives the code of the value nearest 0).
// How the scale search's codes are re-rounded after its scales are quantized to int8 codes of a row factor.
void moeq_cb4_requant(const void* w, int bf16, i64 rows, i64 K, i64 gs, const float* values, int nv, const int8_t* sc,
                      const uint16_t* sup, uint8_t* q) {
    const i64 G = K / gs, rowb = packed_row_bytes(cb_bits(nv), K);
    float mid[32] = {0};
    for (int i = 0; i + 1 < nv; i++) mid[i] = 0.5f * (values[i] + values[i + 1]);
    mid[nv - 1] = INFINITY;
#if defined(__AVX512F__)
    cb4_index ix;  // the search's nearest-index form: 16 weights per step
    cb4_index_init(&ix, mid, values, nv, -1);
#endif
#pragma omp parallel for schedule(static)
    for (i64 r = 0; r < rows; r++) {
        uint8_t* qr = q + r * rowb;
        memset(qr, 0, (size_t)rowb);
        const float f = bf2f(sup[r]);
        float buf[4096];
        uint8_t code[4096];
        for (i64 g = 0; g < G; g++) {
            const float s = (float)sc[r * G + g] * f;
            const float inv = s != 0.f ? 1.f / s : 0.f;
            load_group(w, bf16, r * K + g * gs, gs, buf);
            i64 k0 = 0;
#if defined(__AVX512F__)
            for (; k0 + 16 <= gs; k0 += 16) {  // 16 codes -> 8 nibble bytes (+ 2 fifth-bit bytes), written whole
                const __m512i i = cb4_nearest16(&ix, _mm512_mul_ps(_mm512_loadu_ps(buf + k0), _mm512_set1_ps(inv)));
                const __m128i c = _mm512_cvtepi32_epi8(i), lo = _mm_and_si128(c, _mm_set1_epi8(15));
                if (nv == 4) {  // 2-bit: 16 codes -> 4 bytes
                    uint64_t c8[2];
                    _mm_storeu_si128((__m128i*)c8, c);
                    const uint32_t four = pack2_word(c8[0]) | (uint32_t)pack2_word(c8[1]) << 16;
                    memcpy(qr + (g * gs + k0) / 4, &four, 4);
                    continue;
                }
                if (nv == 8) {  // 3-bit: 16 codes -> two 24-bit words, written whole (6 bytes)
                    uint64_t c8[2];
                    _mm_storeu_si128((__m128i*)c8, c);
                    const uint64_t two = pack3_word(c8[0]) | (uint64_t)pack3_word(c8[1]) << 24;
                    memcpy(qr + (g * gs + k0) / 8 * 3, &two, 6);
                    continue;
                }
                const __m128i pk = _mm_and_si128(_mm_or_si128(lo, _mm_srli_epi16(lo, 4)), _mm_set1_epi16(0x00FF));
                const i64 e = g * gs + k0;
                _mm_storel_epi64((__m128i*)(qr + e / 2), _mm_packus_epi16(pk, pk));
                if (nv == 32) {
                    const uint16_t hb = (uint16_t)_mm_movemask_epi8(_mm_slli_epi16(c, 3));  // bit 4 of each code
                    memcpy(qr + K / 2 + e / 8, &hb, 2);
                }
            }
#endif
            for (i64 k = k0; k < gs; k++) {  // the rest (gs % 16 == 0 leaves none on AVX512)
                const float v = buf[k] * inv;
                int c = 0;  // binary search over the nv - 1 midpoints (nv 4, 8, 16 or 32)
                for (int step = nv / 2; step >= 1; step /= 2) c += v > mid[c + step - 1] ? step : 0;
                code[k] = (uint8_t)c;
            }
            if (nv == 4) {  // (the AVX512 loop packed 0..k0 already)
                for (i64 k = k0; k < gs; k++) qr[(g * gs + k) >> 2] |= (uint8_t)((code[k] & 3) << (2 * (k & 3)));
                continue;
            }
            if (nv == 8) {  // (the AVX512 loop packed 0..k0 already)
                for (i64 m = k0 / 8; m < gs / 8; m++) pack3_8(code + 8 * m, qr + (g * gs + 8 * m) / 8 * 3);
                continue;
            }
            for (i64 k = k0; k < gs; k++) {
                const int c = code[k];
                const i64 e = g * gs + k;
                qr[e >> 1] |= (uint8_t)((c & 15) << ((e & 1) * 4));
                if (nv == 32) qr[K / 2 + (e >> 3)] |= (uint8_t)(((c >> 4) & 1) << (e & 7));
            }
        }
    }
}

// Expert e of an il16 stack (il16_rows.h) dequantized into row-major out [N, K] (bf16 or fp32): each 16-row block
// unpacked, then the row-major dequantizers above (the same values as for the row-major stack). Returns 1, 0 outside
// the layout's domain, -1 when scratch could not be allocated.
int moeq_il16_dequant(const moeq_wstack* w, i64 e, void* out, int out_bf16) {
    if (!w->il16 || w->bits != 4 || w->zero || w->N % 16 || w->K % 4 || w->gs <= 0 || w->K % w->gs) return 0;
    const i64 K = w->K, G = K / w->gs, ss = scale_size(w->scale_bf16), NB = w->N / 16, per = 8 * K + 16 * G * ss;
#ifdef _OPENMP
    const int nt = omp_get_max_threads();
#else
    const int nt = 1;
#endif
    int grid8 = 1;  // values -8..7 (the signed / vLLM grids): the RTN dequantizer, as the row-major path takes them
    for (int i = 0; i < 16 && w->values; i++) grid8 &= w->values[i] == (float)(i - 8);
    const float* values = w->values && !grid8 ? w->values : NULL;
    uint8_t* buf = (uint8_t*)malloc((size_t)(nt * per));
    if (!buf) return -1;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        uint8_t* mine = buf + omp_get_thread_num() * per;
#else
        uint8_t* mine = buf;
#endif
#pragma omp for schedule(static)
        for (i64 b = 0; b < NB; b++) {
            il16_unpack(w, e, b, mine, mine + 8 * K);
            void* o = (char*)out + 16 * b * K * (out_bf16 ? 2 : 4);
            if (values || w->scale_super)
                cb4_dequant_rows(mine, mine + 8 * K, w->scale_bf16, il16_sup(w, e, b), w->values, 4, 0, 16, K, w->gs,
                                 o, out_bf16);
            else
                rtn_dequant_rows(mine, mine + 8 * K, w->scale_bf16, NULL, 4, 0, 16, K, w->gs, o, out_bf16);
        }
    }
    free(buf);
    return 1;
}
