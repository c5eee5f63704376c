// The 4-bit RTN row kernels with AVX512-BF16 dot products, shared by the gemv (gemv.c) and the fused MoE layer
// (moe.c): static inline so each is compiled into the loop that calls it.
#ifndef MOEQ_RTN4_ROWS_H
#define MOEQ_RTN4_ROWS_H
#include "moeq.h"

#if defined(__AVX512BF16__)
// Once per weight row of the AVX512-BF16 RTN kernels: its G scales as fp32 into sf (per group only a broadcast from
// L1 remains) and its zero terms sum_g (z_g + offset) s_g xsum[m, g] added to zt[m] as one dot product per x row,
// z_g = zero[g] or zdefault (faster at one row than scalar work per group, measured).
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
// prepared inline: faster than rtn4_row_dpbf16_p64 at M = 1 on every expert and head shape measured side by side.
// (Blocking 2-4 weight rows per step was faster on cache-sized matrices but halved the speed on lm_head-sized ones:
// more concurrent streams per core.)
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
    // 2-8 rows, the presets' layout known at compile time (faster, measured at one row before the form above)
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

// 2/3/4/5-bit codebook rows (value = scale * lut[code], no zero point: iq4nl, nl3, nl2, the signed grids as values -8..7 /
// -16..15), x in x_to_bf16's permuted order (K % 64 == 0). lut: 32 bf16 words — 4-bit: the 16 values twice, so vpermw
// on a widened byte (index = its low 5 bits) needs no mask for the low nibble; 5-bit: the 32 values, the fifth bits
// (a plane after the K/2 nibble bytes of each row, LSB first) or-ed in as bit 4 of each index; 3-bit: the 8 values
// four times, the codes unpacked from their 24-bit words by cb3_chunk. Groups of 16, 32 (llama.cpp's block) or
// multiples of 64: in a 64-chunk of the permuted layout, lane l of each dot product holds elements 4l..4l+3, so a
// chunk's 2 (group 32) or 4 (group 16) scales are one vector of broadcast pieces.
static inline uint32_t cb_pext(uint64_t h, uint64_t m) {
#if defined(__BMI2__)
    return (uint32_t)_pext_u64(h, m);
#else
    uint32_t r = 0;
    for (int i = 0, j = 0; i < 64; i++)
        if ((m >> i) & 1) r |= (uint32_t)((h >> i) & 1) << j++;
    return r;
#endif
}

// 64 3-bit codes of a 64-chunk (24 bytes: three 24-bit words) as word pairs (code 2i, code 2i+1) in *ei / *oi: each
// qword gets its word's 3 bytes (vpermb), vpmultishiftqb moves code j of the qword to byte j — so word i holds codes
// 2i (low byte) and 2i+1 (high byte), each with unmasked bits above it (see below). Without VBMI the same from a
// scalar unpack.
static inline __attribute__((always_inline)) void cb3_chunk(const uint8_t* p, __m512i* ei, __m512i* oi) {
#if defined(__AVX512VBMI__)
    static const uint8_t spread[64] = {
        0, 1, 2, 0, 0, 0, 0, 0, 3, 4, 5, 3, 3, 3, 3, 3, 6, 7, 8, 6, 6, 6, 6, 6, 9, 10, 11, 9, 9, 9, 9, 9,
        12, 13, 14, 12, 12, 12, 12, 12, 15, 16, 17, 15, 15, 15, 15, 15, 18, 19, 20, 18, 18, 18, 18, 18,
        21, 22, 23, 21, 21, 21, 21, 21};
    const __m512i shifts = _mm512_set1_epi64(0x15120F0C09060300ll);  // 0, 3, ..., 21
    const __m512i t = _mm512_permutexvar_epi8(_mm512_loadu_si512(spread), _mm512_maskz_loadu_epi8(0xFFFFFFull, p));
    // no masking: vpermw reads an index's low 5 bits and the lut holds the 8 values four times, so the bits above
    // each code (and the high byte of the even word) select the same value
    const __m512i u = _mm512_multishift_epi64_epi8(shifts, t);
    *ei = u;
    *oi = _mm512_srli_epi16(u, 8);
#else
    uint16_t e[32], o[32];
    for (int w = 0; w < 8; w++) {
        const uint32_t word = (uint32_t)p[3 * w] | (uint32_t)p[3 * w + 1] << 8 | (uint32_t)p[3 * w + 2] << 16;
        for (int i = 0; i < 4; i++) {
            e[4 * w + i] = (uint16_t)((word >> (6 * i)) & 7);
            o[4 * w + i] = (uint16_t)((word >> (6 * i + 3)) & 7);
        }
    }
    *ei = _mm512_loadu_si512(e);
    *oi = _mm512_loadu_si512(o);
#endif
}

// 64 2-bit codes of a 64-chunk (16 bytes; byte b holds elements 4b..4b+3, LSB first) as word pairs: word i of the
// widened bytes holds byte i/2, shifted right 4 for odd i, so its bits 0-1 are element 2i's code and bits 2-3
// element 2i+1's. No masking: the lut holds the 4 values eight times, so vpermw's index bits above the code select
// the same value.
static inline __attribute__((always_inline)) void cb2_chunk(const uint8_t* p, __m512i* ei, __m512i* oi) {
#if defined(__AVX512VBMI__)
    // one vpermb: byte 2i of the result = source byte i/2 (the high byte of each word is garbage the lut ignores)
    static const uint8_t half[64] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6,
                                     7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11, 12, 12, 12,
                                     12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15};
    const __m512i w = _mm512_permutexvar_epi8(_mm512_loadu_si512(half),
                                              _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p)));
#else
    const __m128i v = _mm_loadu_si128((const __m128i*)p);
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(v, v), _mm_unpacklo_epi8(v, v)));
#endif
    const __m512i u = _mm512_srlv_epi16(w, _mm512_set1_epi32(4 << 16));  // odd words >> 4
    *ei = u;
    *oi = _mm512_srli_epi16(u, 2);
}

// The codebook rows prefetch CB_PF bytes of codes ahead (rows are contiguous: past a row's end is the next row's).
#ifndef CB_PF
#define CB_PF 2048
#endif

static inline __attribute__((always_inline)) void cb4_rows_p64(
    const uint16_t* xb, const i64 M, const uint8_t* q, const void* scale, int scale_bf16, const __m512i lut, i64 n,
    i64 K, i64 gs, const int bits, float* out) {
    const i64 G = K / gs, C = K / 64;
    const int five = bits == 5;
    const uint8_t* qn = q + n * packed_row_bytes(bits, K);
    const uint8_t* hb = qn + K / 2;
    const __m512i lo4 = _mm512_set1_epi16(15), b4 = _mm512_set1_epi16(16);
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    // groups of 32 (16): 16 scales — 8 (4) chunks' worth — as one fp32 vector, each chunk's 2 (4) spread over the
    // lanes holding their elements (lane l: elements 4l..4l+3 of the chunk) by one permute
    const int small = gs == 32 || gs == 16, per = gs == 16 ? 4 : 2;
    __m512 s16 = _mm512_setzero_ps();
    __m512i sidx = _mm512_setzero_si512();
    const __m512i idx0 = gs == 16 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                  : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i two = _mm512_set1_epi32(per);
    for (i64 c = 0; c < C; c++) {
        if (small && (c & (16 / per - 1)) == 0) {
            const i64 g0 = n * G + per * c, left = G - per * c;
            const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            s16 = scale_bf16 == 3 ? _mm512_maskz_mov_ps(k, e8m0_x16(_mm_maskz_loadu_epi8(k, (const uint8_t*)scale + g0)))
                  : scale_bf16 == 2 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, (const int8_t*)scale + g0)))
                  : scale_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t*)scale + g0)), 16))
                               : _mm512_maskz_loadu_ps(k, (const float*)scale + g0);
            sidx = idx0;
        }
        __m512i ei, oi;
        if (CB_PF && (c & 3) == 0)  // once per 4 chunks (one to two cache lines of codes)
            _mm_prefetch((const char*)(qn + c * (64 * bits / 8) + CB_PF), _MM_HINT_T0);
        if (bits == 2) {
            cb2_chunk(qn + 16 * c, &ei, &oi);
        } else if (bits == 3) {
            cb3_chunk(qn + 24 * c, &ei, &oi);
        } else {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qn + 32 * c)));
            ei = w;
            oi = _mm512_srli_epi16(w, 4);
        }
        if (five) {
            uint64_t h;
            memcpy(&h, hb + 8 * c, 8);
            ei = _mm512_and_si512(ei, lo4);  // bit 4 is clear in both: adding 16 sets it
            ei = _mm512_mask_add_epi16(ei, (__mmask32)cb_pext(h, 0x5555555555555555ull), ei, b4);
            oi = _mm512_mask_add_epi16(oi, (__mmask32)cb_pext(h, 0xAAAAAAAAAAAAAAAAull), oi, b4);
        }
        const __m512i even = _mm512_permutexvar_epi16(ei, lut);
        const __m512i odd = _mm512_permutexvar_epi16(oi, lut);
        __m512 sv;
        if (small) {
            sv = _mm512_permutexvar_ps(sidx, s16);
            sidx = _mm512_add_epi32(sidx, two);
        } else {
            sv = _mm512_set1_ps(load_scale(scale, scale_bf16, n * G + c * 64 / gs));
        }
        for (i64 m = 0; m < M; m++) {
            const uint16_t* xc = xb + m * K + 64 * c;
            __m512 v = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)even, (__m512bh)_mm512_loadu_si512(xc));
            v = _mm512_dpbf16_ps(v, (__m512bh)odd, (__m512bh)_mm512_loadu_si512(xc + 32));
            acc[m] = _mm512_fmadd_ps(v, sv, acc[m]);
        }
    }
    for (i64 m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// M (1..8) and the bit width compile-time constants per case; bits: 2, 3, 4 or 5.
static inline __attribute__((always_inline)) void cb4_row_bf16(
    const uint16_t* xb, i64 M, const uint8_t* q, const void* scale, int scale_bf16, const uint16_t* lut16, i64 n,
    i64 K, i64 gs, int bits, float* out) {
    const __m512i lut = _mm512_loadu_si512(lut16);
#define CB_CASE(c) case c: \
    if (bits == 5) cb4_rows_p64(xb, c, q, scale, scale_bf16, lut, n, K, gs, 5, out); \
    else if (bits == 3) cb4_rows_p64(xb, c, q, scale, scale_bf16, lut, n, K, gs, 3, out); \
    else if (bits == 2) cb4_rows_p64(xb, c, q, scale, scale_bf16, lut, n, K, gs, 2, out); \
    else cb4_rows_p64(xb, c, q, scale, scale_bf16, lut, n, K, gs, 4, out); \
    break;
    switch (M) { CB_CASE(1) CB_CASE(2) CB_CASE(3) CB_CASE(4) CB_CASE(5) CB_CASE(6) CB_CASE(7) CB_CASE(8) }
#undef CB_CASE
}
#endif

// bf16 activations as the 4-bit kernels read them (per 64-chunk (even, odd) elements when perm64, else in order)
// and their per-group sums (by original index, in either layout), taken from the rounded values. AVX512 builds
// convert 64 elements per step (f2bf's rounding, NaN kept quiet; a group's sum in another order than the scalar
// loop's, the same within fp32 rounding): a decode step's MoE layer converts its token once per routed expert.
static inline void x_to_bf16(const float* x, i64 K, i64 gs, int perm64, uint16_t* dst, float* sums) {
#if defined(__AVX512BW__)
    if (K % 64 == 0 && (gs % 64 == 0 || gs == 32 || gs == 16)) {
        static const uint16_t even[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                          32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
        const __m512i ie = _mm512_loadu_si512(even);
        const __m512i io = _mm512_add_epi16(ie, _mm512_set1_epi16(1));
        __m512 run = _mm512_setzero_ps();  // a group of 64k's sum so far
        for (i64 c = 0; c < K / 64; c++) {
            __m512i h[4];
            __m512 r[4];
            for (int j = 0; j < 4; j++) {
                const __m512 f = _mm512_loadu_ps(x + 64 * c + 16 * j);
                const __m512i u = _mm512_castps_si512(f);
                const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
                __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                    _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
                b = _mm512_mask_or_epi32(b, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
                h[j] = b;
                r[j] = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
            }
            const __m512i v0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(h[0])),
                                                  _mm512_cvtepi32_epi16(h[1]), 1);
            const __m512i v1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(h[2])),
                                                  _mm512_cvtepi32_epi16(h[3]), 1);
            if (perm64) {
                _mm512_storeu_si512(dst + 64 * c, _mm512_permutex2var_epi16(v0, ie, v1));
                _mm512_storeu_si512(dst + 64 * c + 32, _mm512_permutex2var_epi16(v0, io, v1));
            } else {
                _mm512_storeu_si512(dst + 64 * c, v0);
                _mm512_storeu_si512(dst + 64 * c + 32, v1);
            }
            if (gs == 16) {
                for (int j = 0; j < 4; j++) sums[4 * c + j] = _mm512_reduce_add_ps(r[j]);
            } else if (gs == 32) {
                sums[2 * c] = _mm512_reduce_add_ps(_mm512_add_ps(r[0], r[1]));
                sums[2 * c + 1] = _mm512_reduce_add_ps(_mm512_add_ps(r[2], r[3]));
            } else {
                run = _mm512_add_ps(run, _mm512_add_ps(_mm512_add_ps(r[0], r[1]), _mm512_add_ps(r[2], r[3])));
                if ((64 * (c + 1)) % gs == 0) {
                    sums[64 * c / gs] = _mm512_reduce_add_ps(run);
                    run = _mm512_setzero_ps();
                }
            }
        }
        return;
    }
#endif
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
#endif
