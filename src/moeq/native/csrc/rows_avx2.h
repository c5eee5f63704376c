// Row kernels for CPUs with AVX2 + FMA and no AVX512-BF16: most laptops and desktops, and AVX512 CPUs before it
// (Skylake-SP, Cascade Lake, Ice Lake, Tiger Lake), whose AVX512F-only kernels (searches, dequantize, NF4 rows) stay;
// MOEQ_NATIVE_MARCH=x86-64-v3 / skylake-avx512 build them here. fp32 activations, exact fp32 products, fp32
// accumulation — the numerics of the plain-C loops they replace, in another summation order. Included by gemv.c;
// each returns one output element.
#ifndef MOEQ_ROWS_AVX2_H
#define MOEQ_ROWS_AVX2_H
#include "moeq.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#define MOEQ_AVX2 1

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ---- bf16 weights (kept heads, routers) ----
// One row of x (the decode head's case) as fp32, per 16-chunk its 8 even elements then its 8 odd ones: 4 integer/FMA
// ops per 16 weights fewer than converting x on the fly, which one row (fp32 in L1) can afford.
static inline void x_split16_bf16(const uint16_t* x, i64 K, float* xs) {
    for (i64 c = 0; c < K; c += 16)
        for (int j = 0; j < 8; j++) {
            xs[c + j] = bf2f(x[c + 2 * j]);
            xs[c + 8 + j] = bf2f(x[c + 2 * j + 1]);
        }
}

// K % 32 == 0; four accumulator chains (two per 16-chunk of the 32), so the FMAs' latency does not bound the row: the
// AVX2 b1 step's 622 MB bf16 head 19.5-21.4 -> 17.2-17.5 ms (two chains before; alternating runs).
static inline float bf16_row_avx2(const uint16_t* w, const float* xs, i64 K) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (i64 k = 0; k < K; k += 32) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + k));
        const __m256i u = _mm256_loadu_si256((const __m256i*)(w + k + 16));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_loadu_ps(xs + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), _mm256_loadu_ps(xs + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)), _mm256_loadu_ps(xs + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(u, hi)), _mm256_loadu_ps(xs + k + 24), a3);
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// 2-4 rows: a 32-bit lane holds two bf16 values: shifted left 16 it is the even one as fp32, masked to its high half
// the odd one — for the weights and for x alike (x stays bf16: 4 rows of it fit L1 beside the streaming weights,
// where fp32 rows did not: 53 -> 29 ms on a 151936 x 2048 head at 4 rows). Each weight vector is converted once for
// the M rows. K % 16 == 0.
static inline __attribute__((always_inline)) void bf16_rows_avx2(const uint16_t* w, const uint16_t* x, const i64 M,
                                                                 i64 K, float* out) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 a0[4], a1[4];
    for (i64 m = 0; m < M; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    for (i64 k = 0; k < K; k += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + k));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
        for (i64 m = 0; m < M; m++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + m * K + k));
            a0[m] = _mm256_fmadd_ps(we, _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16)), a0[m]);
            a1[m] = _mm256_fmadd_ps(wo, _mm256_castsi256_ps(_mm256_and_si256(xv, hi)), a1[m]);
        }
    }
    for (i64 m = 0; m < M; m++) out[m] = hsum8(_mm256_add_ps(a0[m], a1[m]));
}

// ---- 4/5-bit codebook grids (value = scale * values[code]: iq4nl, Q4_0/Q5_0-style signed grids) ----
// x fp32 per 32-chunk as its 16 even elements, then its 16 odd ones (the low / high nibbles of 16 packed bytes).
static inline void x_split32(const float* x, i64 K, float* xs) {
    for (i64 c = 0; c < K; c += 32)
        for (int j = 0; j < 16; j++) {
            xs[c + j] = x[c + 2 * j];
            xs[c + 16 + j] = x[c + 2 * j + 1];
        }
}

// Codebooks whose values are all integers in [-128, 127] (every moeq grid) as int8 tables for vpshufb: t[0] the
// first 16 values, t[1] the next 16 (5-bit). Returns 0 (use the plain loop) when a value does not fit, and for 3-bit
// codes (their 24-bit words have no AVX2 row here: the plain loop reads them).
static inline int cb_tables_i8(const float* values, int bits, __m128i* t) {
    int8_t b[32] = {0};
    if (bits != 4 && bits != 5) return 0;
    for (int i = 0; i < (bits == 5 ? 32 : 16); i++) {
        const float v = values[i];
        if (!(v >= -128.f && v <= 127.f) || v != (float)(int)v) return 0;
        b[i] = (int8_t)(int)v;
    }
    t[0] = _mm_loadu_si128((const __m128i*)b);
    t[1] = _mm_loadu_si128((const __m128i*)(b + 16));
    return 1;
}

// 16 mask bits -> 16 bytes of 0xFF / 0x00.
static inline __m128i bits_to_bytes16(uint32_t m) {
    const __m128i v = _mm_shuffle_epi8(_mm_set1_epi16((short)m),
                                       _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    return _mm_cmpeq_epi8(_mm_and_si128(v, bit), bit);
}

static inline uint32_t pext32(uint32_t h, uint32_t m) {
#if defined(__BMI2__)
    return _pext_u32(h, m);
#else
    uint32_t r = 0;
    for (int i = 0, j = 0; i < 32; i++)
        if ((m >> i) & 1) r |= ((h >> i) & 1u) << j++;
    return r;
#endif
}

// The int8 values of 32 weights from 16 packed bytes: ve the 16 even elements (low nibbles), vo the 16 odd ones;
// 5-bit: the fifth bits (4 plane bytes, LSB first) choose the second table.
static inline __attribute__((always_inline)) void cb_values32(const uint8_t* p, const uint8_t* h5, const __m128i* t,
                                                              const int five, __m128i* ve, __m128i* vo) {
    const __m128i m4 = _mm_set1_epi8(15), b = _mm_loadu_si128((const __m128i*)p);
    const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    if (five) {
        uint32_t h;
        memcpy(&h, h5, 4);
        *ve = _mm_blendv_epi8(_mm_shuffle_epi8(t[0], lo), _mm_shuffle_epi8(t[1], lo),
                              bits_to_bytes16(pext32(h, 0x55555555u)));
        *vo = _mm_blendv_epi8(_mm_shuffle_epi8(t[0], hi), _mm_shuffle_epi8(t[1], hi),
                              bits_to_bytes16(pext32(h, 0xAAAAAAAAu)));
    } else {
        *ve = _mm_shuffle_epi8(t[0], lo);
        *vo = _mm_shuffle_epi8(t[0], hi);
    }
}

// 16 int8 values -> the dot product of their fp32 with 16 floats.
static inline __m256 dot16_i8(__m128i v, const float* x) {
    const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_loadu_ps(x));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), _mm256_loadu_ps(x + 8), a);
}

// One output row: each 16 packed bytes are 32 weights; their nibbles index the int8 table (vpshufb; 5-bit: the
// fifth bits of the plane after the K/2 nibble bytes, LSB first, choose the second table), values widen to fp32 and
// meet x_split32's layout. gs % 32 == 0.
static inline __attribute__((always_inline)) float cb_row_avx2(
    const float* xs, const uint8_t* q, const void* scale, int scale_bf16, const __m128i* t, i64 n, i64 K, i64 gs,
    const int five) {
    const i64 G = K / gs;
    const uint8_t* qn = q + n * (five ? K / 8 * 5 : K / 2);
    const uint8_t* hb = qn + K / 2;
    __m256 acc = _mm256_setzero_ps();
    for (i64 g = 0; g < G; g++) {
        __m256 v = _mm256_setzero_ps();
        for (i64 c = g * gs; c < (g + 1) * gs; c += 32) {
            __m128i ve, vo;
            cb_values32(qn + c / 2, hb + c / 8, t, five, &ve, &vo);
            v = _mm256_add_ps(v, _mm256_add_ps(dot16_i8(ve, xs + c), dot16_i8(vo, xs + c + 16)));
        }
        acc = _mm256_fmadd_ps(v, _mm256_set1_ps(load_scale(scale, scale_bf16, n * G + g)), acc);
    }
    return hsum8(acc);
}

// ---- RTN 4/8-bit (value = scale * (code - zero); the zero-point term is the caller's) ----
// sum over the row of s_g * sum_k code * x: 4-bit x split into even (xe) / odd (xo) elements [K/2], 8-bit x in order.
static inline __attribute__((always_inline)) void rtn_row_avx2(
    const float* xe, const float* xo, const i64 M, const uint8_t* q, const void* scale, int scale_bf16, int bits,
    i64 n, i64 K, i64 gs, float* out) {
    const i64 G = K / gs;
    const __m256i m4 = _mm256_set1_epi32(15);
    __m256 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (i64 g = 0; g < G; g++) {
        __m256 v[8];
        for (i64 m = 0; m < M; m++) v[m] = _mm256_setzero_ps();
        if (bits == 8) {
            const uint8_t* qq = q + n * K + g * gs;
            for (i64 k = 0; k < gs; k += 8) {
                const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qq + k))));
                for (i64 m = 0; m < M; m++) v[m] = _mm256_fmadd_ps(c, _mm256_loadu_ps(xe + m * K + g * gs + k), v[m]);
            }
        } else {
            const uint8_t* qq = q + n * (K / 2) + g * gs / 2;
            for (i64 j = 0; j < gs / 2; j += 8) {
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qq + j)));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, m4));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                const i64 o = g * gs / 2 + j;
                for (i64 m = 0; m < M; m++)
                    v[m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xo + m * (K / 2) + o),
                                           _mm256_fmadd_ps(lo, _mm256_loadu_ps(xe + m * (K / 2) + o), v[m]));
            }
        }
        const __m256 sv = _mm256_set1_ps(load_scale(scale, scale_bf16, n * G + g));
        for (i64 m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(v[m], sv, acc[m]);
    }
    for (i64 m = 0; m < M; m++) out[m] = hsum8(acc[m]);
}

// ---- bf16 models: int16 activations (vpmaddwd, 16 multiply-adds per instruction) ----
// x from x_to_i16_32 (moeq.h).

// Two 16-weight int16 vectors against the chunk's 32 int16 activations -> 8 int32 partial sums.
static inline __m256i madd32(__m256i w0, __m256i w1, const int16_t* xq) {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)xq)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xq + 16))));
}

// One output row for M (1..4) rows of x of a 4/5-bit codebook grid (int8 table values, see cb_row_avx2) or of 4/8-bit
// RTN (codes minus the zero point, default 2^(bits-1)), x from x_to_i16_32 (split for 4/5-bit; row m at xq + m*K,
// sx + m*K/32). gs % 32 == 0. The weights are decoded once per chunk for all M rows; exact integer dot products per
// 32-chunk, then fp32.
static inline __attribute__((always_inline)) void row_i16(
    const int16_t* xq, const float* sx, const i64 M, const uint8_t* q, const void* scale, int scale_bf16,
    const uint8_t* zero, const __m128i* t, i64 n, i64 K, i64 gs, const int bits, const int codebook, float* out) {
    const i64 G = K / gs;
    const uint8_t* qn = q + n * (bits == 8 ? K : bits == 5 ? K / 8 * 5 : K / 2);
    const uint8_t* hb = qn + K / 2;
    const __m128i m4 = _mm_set1_epi8(15);
    __m256 acc[4];
    for (i64 m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    // Q4_0 / IQ4_NL blocks (groups of 32 = one chunk): one FMA per chunk at the product of both scales — the same
    // result (sx is a power of two), one FMA and a group step fewer per 32 weights: the AVX2 b1 step's experts 9.4-12.5
    // -> 7.7-9.2 ms (bench model, alternating runs)
    if (gs == 32 && codebook && bits == 4) {
        for (i64 c = 0; c < K; c += 32) {
            __m128i ve, vo;
            cb_values32(qn + c / 2, hb, t, 0, &ve, &vo);
            const __m256i w0 = _mm256_cvtepi8_epi16(ve), w1 = _mm256_cvtepi8_epi16(vo);
            const float s = load_scale(scale, scale_bf16, n * G + c / 32);
            for (i64 m = 0; m < M; m++)
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(madd32(w0, w1, xq + m * K + c)),
                                         _mm256_set1_ps(s * sx[m * (K / 32) + c / 32]), acc[m]);
        }
        for (i64 m = 0; m < M; m++) out[m] = hsum8(acc[m]);
        return;
    }
    for (i64 g = 0; g < G; g++) {
        const __m256i zv = _mm256_set1_epi16((short)(zero ? zero[n * G + g] : 1 << (bits - 1)));
        __m256 v[4];
        for (i64 m = 0; m < M; m++) v[m] = _mm256_setzero_ps();
        for (i64 c = g * gs; c < (g + 1) * gs; c += 32) {
            __m256i w0, w1;
            if (bits == 8) {
                w0 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(qn + c))), zv);
                w1 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(qn + c + 16))), zv);
            } else {
                const __m128i b = _mm_loadu_si128((const __m128i*)(qn + c / 2));
                const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
                if (codebook) {
                    __m128i ve, vo;
                    cb_values32(qn + c / 2, hb + c / 8, t, bits == 5, &ve, &vo);
                    w0 = _mm256_cvtepi8_epi16(ve);
                    w1 = _mm256_cvtepi8_epi16(vo);
                } else {
                    w0 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(lo), zv);
                    w1 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(hi), zv);
                }
            }
            for (i64 m = 0; m < M; m++)
                v[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(madd32(w0, w1, xq + m * K + c)),
                                       _mm256_set1_ps(sx[m * (K / 32) + c / 32]), v[m]);
        }
        const __m256 sv = _mm256_set1_ps(load_scale(scale, scale_bf16, n * G + g));
        for (i64 m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(v[m], sv, acc[m]);
    }
    for (i64 m = 0; m < M; m++) out[m] = hsum8(acc[m]);
}

// ---- 2/3-bit codebooks (nl2: four codes per byte; nl3: eight codes per 24-bit word; value = scale * values[code]) --
// The nv (4 or 8) values as an int8 vpshufb table (both 128-bit lanes); 0 when one is not an integer in [-128, 127].
static inline int cb3_table_i8(const float* values, int nv, __m256i* t) {
    int8_t b[16] = {0};
    for (int i = 0; i < nv; i++) {
        const float v = values[i];
        if (!(v >= -128.f && v <= 127.f) || v != (float)(int)v) return 0;
        b[i] = (int8_t)(int)v;
    }
    *t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)b));
    return 1;
}

// One output row for M (1..4) rows of x as int16 per 32-chunk in order (x_to_i16_32 without split): each chunk's 12
// bytes unpack to 32 codes (pdep), vpshufb makes them int8 values, vpmaddwd takes each half of the chunk against its
// 16 activations — so a group of 16 (the chunk's halves at their own scales) costs nothing extra. gs % 16 == 0,
// K % 32 == 0.
// bits 3 (12 bytes a chunk) or 2 (8 bytes a chunk, pdep into one code a byte).
static inline __attribute__((always_inline)) void cb3_row_i16(
    const int16_t* xq, const float* sx, const i64 M, const uint8_t* q, const void* scale, int scale_kind,
    const __m256i t, i64 n, i64 K, i64 gs, const int bits, float* out) {
    const i64 G = K / gs;
    const uint8_t* qn = q + n * packed_row_bytes(bits, K);
    __m256 acc[4];
    for (i64 m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    i64 g = n * G, pos = 0;  // the group of the chunk's first half (no division in the loop)
    for (i64 c = 0; c < K; c += 32) {
        __m256i codes;
        if (bits == 2) {
            uint64_t a;  // the chunk's 8 bytes: code i at bits 2i
            memcpy(&a, qn + c / 4, 8);
            codes = _mm256_setr_epi64x((long long)unpack2_word((uint16_t)a), (long long)unpack2_word((uint16_t)(a >> 16)),
                                       (long long)unpack2_word((uint16_t)(a >> 32)),
                                       (long long)unpack2_word((uint16_t)(a >> 48)));
        } else {
            uint64_t a, b;  // the chunk's 12 bytes as two 8-byte loads inside it (bytes 0-7 and 4-11)
            memcpy(&a, qn + c / 8 * 3, 8);
            memcpy(&b, qn + c / 8 * 3 + 4, 8);
            codes = _mm256_setr_epi64x(
                (long long)unpack3_word((uint32_t)a), (long long)unpack3_word((uint32_t)(a >> 24)),
                (long long)unpack3_word((uint32_t)(b >> 16)), (long long)unpack3_word((uint32_t)(b >> 40)));
        }
        const __m256i v = _mm256_shuffle_epi8(t, codes);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
        float s0, s1;
        if (gs == 16) {
            s0 = load_scale(scale, scale_kind, g);
            s1 = load_scale(scale, scale_kind, g + 1);
            g += 2;
        } else {
            s0 = s1 = load_scale(scale, scale_kind, g);
            pos += 32;
            if (pos == gs) {
                pos = 0;
                g++;
            }
        }
        for (i64 m = 0; m < M; m++) {
            const int16_t* xc = xq + m * K + c;
            const float f = sx[m * (K / 32) + c / 32];
            const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)xc));
            const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xc + 16)));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(f * s0), acc[m]);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(f * s1), acc[m]);
        }
    }
    for (i64 m = 0; m < M; m++) out[m] = hsum8(acc[m]);
}

// ---- NF4/FP4 (value = absmax * code[nibble], even element in the HIGH nibble) ----
// 16-entry fp32 table lookup as two 8-entry permutes chosen by the nibble's bit 3. xe/xo as the RTN row's.
static inline __m256 lut16_ps(__m256i idx, __m256 t0, __m256 t1) {
    const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, idx), _mm256_permutevar8x32_ps(t1, idx), sel);
}

static inline __attribute__((always_inline)) void bnb4_row_avx2(
    const float* xe, const float* xo, const i64 M, const uint8_t* packed, const float* absmax, const float* code,
    i64 n, i64 K, i64 bs, float* out) {
    const i64 nbr = K / bs;
    const __m256 t0 = _mm256_loadu_ps(code), t1 = _mm256_loadu_ps(code + 8);
    const __m256i m4 = _mm256_set1_epi32(15);
    __m256 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (i64 g = 0; g < nbr; g++) {
        const uint8_t* p = packed + (n * K + g * bs) / 2;
        __m256 v[8];
        for (i64 m = 0; m < M; m++) v[m] = _mm256_setzero_ps();
        for (i64 j = 0; j < bs / 2; j += 8) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + j)));
            const __m256 hi = lut16_ps(_mm256_srli_epi32(b, 4), t0, t1);
            const __m256 lo = lut16_ps(_mm256_and_si256(b, m4), t0, t1);
            const i64 o = g * bs / 2 + j;
            for (i64 m = 0; m < M; m++)
                v[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xo + m * (K / 2) + o),
                                       _mm256_fmadd_ps(hi, _mm256_loadu_ps(xe + m * (K / 2) + o), v[m]));
        }
        const __m256 av = _mm256_set1_ps(absmax[n * nbr + g]);
        for (i64 m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(v[m], av, acc[m]);
    }
    for (i64 m = 0; m < M; m++) out[m] = hsum8(acc[m]);
}
#endif
#endif
