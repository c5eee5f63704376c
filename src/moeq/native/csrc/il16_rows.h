// 4-bit expert stacks in the decode layout "il16": the codes of 16 consecutive output rows interleaved, so that one
// vector's 16 lanes are 16 output rows (llama.cpp's repack idea, here as the stacks' only copy in memory; moeq.nn's
// QuantExperts converts to and from it, and everything outside these kernels sees the row-major layout).
//
// Layout of one stack [E, N, K] (N % 16 == 0, K % 64 == 0; symmetric 4-bit: no zero point):
//   codes  [E][N/16][K/4][16][2]: per 16-row block, per 4-column unit c, per row r: the row-major bytes 2c, 2c + 1 of
//          that row (elements 4c, 4c+1 and 4c+2, 4c+3) — a pure permutation of 2-byte units of the row-major codes;
//   scales [E][N/16][G][16] in their kind (fp32, bf16, int8 codes or E8M0 bytes): per block and group, the 16
//   rows' scales;
//   scale_super (int8 scale codes) stays [E][N].
// One widening of a unit's 32 bytes to words gives, in lane r, the row's (element 4c, 4c+2) as low nibbles and
// (4c+1, 4c+3) as high nibbles: the activations come as those bf16 pairs broadcast (x_to_il16's order), the code
// becomes its bf16 value by one word permute of the format's table (the signed grids -8..7, IQ4_NL's values), and a
// group's scaling is one conversion and one FMA per 16 rows. Per 64 weights: one widening, two permutes, two dot
// products, against the row-major rows' widening, three permutes, two dot products, an FMA, and per row a horizontal
// sum (measured: an 8-expert decode layer 1.7x faster cache-warm, 1.2-1.5x from memory).
#ifndef MOEQ_IL16_ROWS_H
#define MOEQ_IL16_ROWS_H
#include "moeq.h"

// Block b of expert e of stack w: its codes, scales and row factors.
static inline const uint8_t* il16_codes(const moeq_wstack* w, i64 e, i64 b) {
    return w->q + (e * (w->N / 16) + b) * 8 * w->K;
}
static inline const void* il16_scale_at(const moeq_wstack* w, i64 e, i64 b) {
    return (const char*)w->scale + (e * (w->N / 16) + b) * 16 * (w->K / w->gs) * scale_size(w->scale_bf16);
}
static inline const uint16_t* il16_sup(const moeq_wstack* w, i64 e, i64 b) {
    return w->scale_super ? w->scale_super + e * w->N + 16 * b : NULL;
}

#if defined(__AVX512BW__)
// Word indices of the three vpermt2w levels of il16_transpose16 (A/B: rows 0-7 / 8-15 of 4 units from two vectors of
// [2 units][16 rows]; C/D: rows 0-3 / 4-7 of 8 units from two [8 rows][4 units]; E/F: rows 0-1 / 2-3 of 16 units
// from two [4 rows][8 units]).
static inline void il16_tr_index(uint16_t idx[6][32]) {
    for (int r = 0; r < 8; r++)
        for (int u = 0; u < 4; u++)
            for (int h = 0; h < 2; h++)
                idx[h][r * 4 + u] = (uint16_t)((u < 2 ? u * 16 : 32 + (u - 2) * 16) + r + 8 * h);
    for (int r = 0; r < 4; r++)
        for (int u = 0; u < 8; u++)
            for (int h = 0; h < 2; h++)
                idx[2 + h][r * 8 + u] = (uint16_t)((u < 4 ? 0 : 32) + (r + 4 * h) * 4 + (u & 3));
    for (int r = 0; r < 2; r++)
        for (int u = 0; u < 16; u++)
            for (int h = 0; h < 2; h++)
                idx[4 + h][r * 16 + u] = (uint16_t)((u < 8 ? 0 : 32) + (r + 2 * h) * 8 + (u & 7));
}

// 16 units x 16 rows of 2-byte codes ([unit][row] at src) transposed into dst ([row][unit], rows `ld` units apart).
static inline void il16_transpose16(const uint16_t* src, uint16_t* dst, i64 ld, const __m512i ix[6]) {
    __m512i z[8], a[8], c[8];
    for (int i = 0; i < 8; i++) z[i] = _mm512_loadu_si512(src + 32 * i);
    for (int p = 0; p < 4; p++) {  // a[p]: rows 0-7 of units 4p..4p+3; a[4 + p]: rows 8-15
        a[p] = _mm512_permutex2var_epi16(z[2 * p], ix[0], z[2 * p + 1]);
        a[4 + p] = _mm512_permutex2var_epi16(z[2 * p], ix[1], z[2 * p + 1]);
    }
    for (int q = 0; q < 4; q++) {  // q: (row half, unit half) = (q >> 1, q & 1); c[2q]: 4 rows, c[2q + 1]: the next 4
        const __m512i x = a[4 * (q >> 1) + 2 * (q & 1)], y = a[4 * (q >> 1) + 2 * (q & 1) + 1];
        c[2 * q] = _mm512_permutex2var_epi16(x, ix[2], y);
        c[2 * q + 1] = _mm512_permutex2var_epi16(x, ix[3], y);
    }
    for (int s = 0; s < 4; s++) {  // rows 4s..4s+3 of units 0-7 (c[...]) and 8-15
        const int rh = s >> 1, sub = s & 1;  // row half (0: rows 0-7), which 4 rows within it
        const __m512i x = c[2 * (2 * rh) + sub], y = c[2 * (2 * rh + 1) + sub];
        for (int h = 0; h < 2; h++) {
            const __m512i e = _mm512_permutex2var_epi16(x, ix[4 + h], y);
            const i64 r = 4 * s + 2 * h;
            _mm256_storeu_si256((__m256i*)(dst + r * ld), _mm512_castsi512_si256(e));
            _mm256_storeu_si256((__m256i*)(dst + (r + 1) * ld), _mm512_extracti64x4_epi64(e, 1));
        }
    }
}
#endif

#if defined(__SSE2__)
// 8 units x 8 rows of 2-byte codes transposed in place (r[u] holds unit u's 8 rows; out: r[i] holds row i's 8 units).
static inline void il16_transpose8(__m128i* r) {
    const __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
    const __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
    const __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
    const __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
    const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    r[0] = _mm_unpacklo_epi64(b0, b4);
    r[1] = _mm_unpackhi_epi64(b0, b4);
    r[2] = _mm_unpacklo_epi64(b1, b5);
    r[3] = _mm_unpackhi_epi64(b1, b5);
    r[4] = _mm_unpacklo_epi64(b2, b6);
    r[5] = _mm_unpackhi_epi64(b2, b6);
    r[6] = _mm_unpacklo_epi64(b3, b7);
    r[7] = _mm_unpackhi_epi64(b3, b7);
}
#endif

// Block b of an il16 stack's expert e back in row-major order: codes (16 rows of K/2 bytes) into q, scales (16 rows
// of G) into sc (unless NULL).
static inline void il16_unpack(const moeq_wstack* w, i64 e, i64 b, uint8_t* q, uint8_t* sc) {
    const i64 K = w->K, U = K / 4, G = K / w->gs, ss = scale_size(w->scale_bf16);
    const uint16_t* src = (const uint16_t*)il16_codes(w, e, b);
    uint16_t* dst = (uint16_t*)q;
    i64 c0 = 0;
#if defined(__AVX512BW__)
    uint16_t idx[6][32];
    il16_tr_index(idx);
    __m512i ix[6];
    for (int i = 0; i < 6; i++) ix[i] = _mm512_loadu_si512(idx[i]);
    for (; c0 + 16 <= U; c0 += 16) il16_transpose16(src + c0 * 16, dst + c0, U, ix);
#endif
#if defined(__SSE2__)
    for (; c0 + 8 <= U; c0 += 8)
        for (int rh = 0; rh < 2; rh++) {
            __m128i r[8];
            for (int u = 0; u < 8; u++) r[u] = _mm_loadu_si128((const __m128i*)(src + (c0 + u) * 16 + 8 * rh));
            il16_transpose8(r);
            for (int i = 0; i < 8; i++) _mm_storeu_si128((__m128i*)(dst + (8 * rh + i) * U + c0), r[i]);
        }
#endif
    for (i64 c = c0; c < U; c++)
        for (i64 r = 0; r < 16; r++) dst[r * U + c] = src[c * 16 + r];
    if (!sc) return;
    const uint8_t* sb = (const uint8_t*)il16_scale_at(w, e, b);
    for (i64 g = 0; g < G; g++)
        for (i64 r = 0; r < 16; r++) memcpy(sc + (r * G + g) * ss, sb + (g * 16 + r) * ss, (size_t)ss);
}


// x [K] as x_to_i16_32's int16 (in order) with each 4-column unit as (x0, x2, x1, x3); sx its chunk scales.
static inline void x_to_il16_i16(const float* x, i64 K, int16_t* xq, float* sx) {
    x_to_i16_32(x, K, 0, xq, sx);
    for (i64 k = 0; k < K; k += 4) {
        const int16_t t = xq[k + 1];
        xq[k + 1] = xq[k + 2];
        xq[k + 2] = t;
    }
}

#if defined(__AVX512BF16__)
#define MOEQ_IL16 1

// x [K] fp32 as bf16 in il16's order: per 4-column unit (x0, x2, x1, x3), rounded as f2bf (NaN kept quiet).
static inline void x_to_il16(const float* x, i64 K, uint16_t* dst) {
    for (i64 k = 0; k < K; k += 16) {
        const __m512 f = _mm512_loadu_ps(x + k);
        const __m512i u = _mm512_castps_si512(f);
        __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
            _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
        b = _mm512_mask_or_epi32(b, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_srli_epi32(u, 16),
                                 _mm512_set1_epi32(0x40));
        const __m256i h = _mm512_cvtepi32_epi16(b);
        _mm256_storeu_si256((__m256i*)(dst + k), _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(h, 0xD8), 0xD8));
    }
}

static inline __m512 il16_scales(const void* s, int kind) {  // 16 scales of one block and group as fp32
    if (kind == 3) return e8m0_x16(_mm_loadu_si128((const __m128i*)s));
    if (kind == 2) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)s)));
    if (kind == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)s)), 16));
    return _mm512_loadu_ps(s);
}

// y[m * ldy + r] = row r of one 16-row block against activation row m (m < M, a compile-time constant per caller),
// cb/sb the block's codes and scales (layout above), sup16 the block's 16 row factors (int8 scale codes) or NULL, xp
// the activations as x_to_il16's pairs (M rows, K/2 pairs apart), lut the table's 16 bf16 values twice.
static inline __attribute__((always_inline)) void il16_block(const uint8_t* cb, const void* sb, const int kind,
                                                             const uint16_t* sup16, const __m512i lut,
                                                             const uint32_t* xp, const i64 M, i64 K, i64 gs,
                                                             float* y, i64 ldy) {
    const i64 G = K / gs, upg = gs / 4;  // 4-column units per group (gs % 16 == 0: an even count)
    const i64 ss = 16 * scale_size(kind);
    __m512 tot[8];
    for (i64 m = 0; m < M; m++) tot[m] = _mm512_setzero_ps();
    for (i64 g = 0; g < G; g++) {
        __m512 a[8][4];
        const int ch = M == 1 ? 4 : 2;  // accumulator chains per activation row
        for (i64 m = 0; m < M; m++)
            for (int j = 0; j < ch; j++) a[m][j] = _mm512_setzero_ps();
        for (i64 c = g * upg; c < (g + 1) * upg; c += 2) {
            _mm_prefetch((const char*)(cb + 32 * c + 4096), _MM_HINT_T0);
            const __m512i w0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(cb + 32 * c)));
            const __m512i w1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(cb + 32 * c + 32)));
            const __m512bh l0 = (__m512bh)_mm512_permutexvar_epi16(w0, lut);
            const __m512bh h0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w0, 4), lut);
            const __m512bh l1 = (__m512bh)_mm512_permutexvar_epi16(w1, lut);
            const __m512bh h1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w1, 4), lut);
            for (i64 m = 0; m < M; m++) {
                const uint32_t* x = xp + m * (K / 2) + 2 * c;
                if (M == 1) {
                    a[m][0] = _mm512_dpbf16_ps(a[m][0], l0, (__m512bh)_mm512_set1_epi32((int)x[0]));
                    a[m][1] = _mm512_dpbf16_ps(a[m][1], h0, (__m512bh)_mm512_set1_epi32((int)x[1]));
                    a[m][2] = _mm512_dpbf16_ps(a[m][2], l1, (__m512bh)_mm512_set1_epi32((int)x[2]));
                    a[m][3] = _mm512_dpbf16_ps(a[m][3], h1, (__m512bh)_mm512_set1_epi32((int)x[3]));
                } else {
                    a[m][0] = _mm512_dpbf16_ps(a[m][0], l0, (__m512bh)_mm512_set1_epi32((int)x[0]));
                    a[m][1] = _mm512_dpbf16_ps(a[m][1], h0, (__m512bh)_mm512_set1_epi32((int)x[1]));
                    a[m][0] = _mm512_dpbf16_ps(a[m][0], l1, (__m512bh)_mm512_set1_epi32((int)x[2]));
                    a[m][1] = _mm512_dpbf16_ps(a[m][1], h1, (__m512bh)_mm512_set1_epi32((int)x[3]));
                }
            }
        }
        const __m512 d = il16_scales((const char*)sb + g * ss, kind);
        for (i64 m = 0; m < M; m++) {
            __m512 s = _mm512_add_ps(a[m][0], a[m][1]);
            if (M == 1) s = _mm512_add_ps(s, _mm512_add_ps(a[m][2], a[m][3]));
            tot[m] = _mm512_fmadd_ps(s, d, tot[m]);
        }
    }
    const __m512 f = sup16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)sup16)), 16))
                           : _mm512_set1_ps(1.f);
    for (i64 m = 0; m < M; m++) _mm512_storeu_ps(y + m * ldy, _mm512_mul_ps(tot[m], f));
}

// One block for M (1..8) activation rows: M a compile-time constant per case.
static inline void il16_block_m(const uint8_t* cb, const void* sb, int kind, const uint16_t* sup16, const __m512i lut,
                                const uint32_t* xp, i64 M, i64 K, i64 gs, float* y, i64 ldy) {
#define IL_CASE(c) case c: il16_block(cb, sb, kind, sup16, lut, xp, c, K, gs, y, ldy); break;
    switch (M) { IL_CASE(1) IL_CASE(2) IL_CASE(3) IL_CASE(4) IL_CASE(5) IL_CASE(6) IL_CASE(7) IL_CASE(8) }
#undef IL_CASE
}

// The int16 form of il16_block for several activation rows (batched decode): the activations as x_to_il16_i16's int16
// per 32-column chunk, the table's values as int16 (lut16: its 16 integer values twice), vpdpwssd instead of
// vdpbf16ps — on Sapphire Rapids the bf16 dot product issues at a third of vpdpwssd's rate (1.8 against 5.6 G/s on
// one core, measured), and at 2-8 rows per block it is what bounds the bf16 form. Exact int32 sums per chunk, then
// one conversion and FMA per chunk and row (the group's scales times the chunk's). gs % 32 == 0. Numerics: those of
// the AVX2 build and of the 8-bit head's default rows (x_to_i16_32).
static inline __attribute__((always_inline)) void il16_block_i16(const uint8_t* cb, const void* sb, const int kind,
                                                                 const uint16_t* sup16, const __m512i lut16,
                                                                 const int16_t* xq, const float* sx, const i64 M,
                                                                 i64 K, i64 gs, float* y, i64 ldy) {
    const i64 ss = 16 * scale_size(kind), C = K / 32;
    __m512 tot[8];
    for (i64 m = 0; m < M; m++) tot[m] = _mm512_setzero_ps();
    __m512 d = _mm512_setzero_ps();
    for (i64 ch = 0; ch < C; ch++) {
        if ((32 * ch) % gs == 0) d = il16_scales((const char*)sb + (32 * ch / gs) * ss, kind);
        __m512i v[8], u[8];
        for (i64 m = 0; m < M; m++) v[m] = u[m] = _mm512_setzero_si512();
        const uint8_t* cc = cb + 32 * 8 * ch;
        _mm_prefetch((const char*)(cc + 4096), _MM_HINT_T0);
        _mm_prefetch((const char*)(cc + 4096 + 64), _MM_HINT_T0);
        _mm_prefetch((const char*)(cc + 4096 + 128), _MM_HINT_T0);
        _mm_prefetch((const char*)(cc + 4096 + 192), _MM_HINT_T0);
        for (int c = 0; c < 8; c++) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(cc + 32 * c)));
            const __m512i lo = _mm512_permutexvar_epi16(w, lut16);
            const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), lut16);
            for (i64 m = 0; m < M; m++) {
                const int16_t* xp = xq + m * K + 32 * ch + 4 * c;
                __asm__("vpdpwssd %1%{1to16%}, %2, %0" : "+v"(v[m]) : "m"(*(const int32_t*)xp), "v"(lo));
                __asm__("vpdpwssd %1%{1to16%}, %2, %0" : "+v"(u[m]) : "m"(*(const int32_t*)(xp + 2)), "v"(hi));
            }
        }
        for (i64 m = 0; m < M; m++)
            tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(v[m], u[m])),
                                     _mm512_mul_ps(d, _mm512_set1_ps(sx[m * C + ch])), tot[m]);
    }
    const __m512 f = sup16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)sup16)), 16))
                           : _mm512_set1_ps(1.f);
    for (i64 m = 0; m < M; m++) _mm512_storeu_ps(y + m * ldy, _mm512_mul_ps(tot[m], f));
}

static inline void il16_block_i16_m(const uint8_t* cb, const void* sb, int kind, const uint16_t* sup16,
                                    const __m512i lut16, const int16_t* xq, const float* sx, i64 M, i64 K, i64 gs,
                                    float* y, i64 ldy) {
#define IL_CASE(c) case c: il16_block_i16(cb, sb, kind, sup16, lut16, xq, sx, c, K, gs, y, ldy); break;
    switch (M) { IL_CASE(1) IL_CASE(2) IL_CASE(3) IL_CASE(4) IL_CASE(5) IL_CASE(6) IL_CASE(7) IL_CASE(8) }
#undef IL_CASE
}

// The int16 table of an il16 stack's bf16 one (w->lut: 16 values twice): 1 when every value is an integer within
// int8 range (every table il16 holds today: the signed grids, IQ4_NL's, MXFP4's), 0 otherwise (the bf16 rows run).
static inline int il16_lut16(const moeq_wstack* w, __m512i* out) {
    int16_t t[32];
    if (!w->lut) return 0;
    for (int i = 0; i < 32; i++) {
        const float v = bf2f(((const uint16_t*)w->lut)[i]);
        if (!(v >= -128.f && v <= 127.f) || v != (float)(int)v) return 0;
        t[i] = (int16_t)v;
    }
    *out = _mm512_loadu_si512(t);
    return 1;
}

#elif defined(__AVX2__) && defined(__FMA__)
#include "rows_avx2.h"
#define MOEQ_IL16_AVX2 1
// AVX2 builds (bf16 models): activations as int16 per 32-chunk (x_to_i16_32), codes through an int8 table (the
// format's values, cb_tables_i8) widened to int16, vpmaddwd against the broadcast activation pairs — exact int32 sums
// per chunk, then one conversion and FMA per chunk and 8 rows. gs % 32 == 0.

static inline __m256 il16_scales8(const void* s, int kind) {  // 8 scales of one block half and group as fp32
    if (kind == 3) return e8m0_x8(_mm_loadl_epi64((const __m128i*)s));
    if (kind == 2) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)s)));
    if (kind == 1)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)s)), 16));
    return _mm256_loadu_ps((const float*)s);
}

// y[m * ldy + r] = row r of one 16-row block against activation row m (m < M <= 2, compile-time), xq/sx as
// x_to_il16_i16 gives them (rows K and K/32 apart), tab the 16 int8 values in both 128-bit lanes. Both 8-row halves
// per pass: one 32-byte load, nibble split and table lookup per unit serve them, the activation pairs are broadcast
// once for both.
static inline __attribute__((always_inline)) void il16_block_avx2(const uint8_t* cb, const void* sb, const int kind,
                                                                  const uint16_t* sup16, const __m256i tab,
                                                                  const int16_t* xq, const float* sx, const i64 M,
                                                                  i64 K, i64 gs, float* y, i64 ldy) {
    const i64 ss = scale_size(kind);
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 tot[2][2];
    for (i64 m = 0; m < M; m++) tot[m][0] = tot[m][1] = _mm256_setzero_ps();
    for (i64 c0 = 0; c0 < K / 4; c0 += 8) {  // one 32-element chunk
        __m256i acc[2][2];
        for (i64 m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
        for (i64 c = c0; c < c0 + 8; c++) {
            const __m256i b = _mm256_loadu_si256((const __m256i*)(cb + 32 * c));
            const __m256i vl = _mm256_shuffle_epi8(tab, _mm256_and_si256(b, m4));  // rows 0-7 | rows 8-15
            const __m256i vh = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(b, 4), m4));
            const __m256i l0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(vl));
            const __m256i l1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(vl, 1));
            const __m256i h0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(vh));
            const __m256i h1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(vh, 1));
            for (i64 m = 0; m < M; m++) {
                int32_t p0, p1;
                memcpy(&p0, xq + m * K + 4 * c, 4);
                memcpy(&p1, xq + m * K + 4 * c + 2, 4);
                const __m256i x0 = _mm256_set1_epi32(p0), x1 = _mm256_set1_epi32(p1);
                acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_add_epi32(_mm256_madd_epi16(l0, x0),
                                                                         _mm256_madd_epi16(h0, x1)));
                acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_add_epi32(_mm256_madd_epi16(l1, x0),
                                                                         _mm256_madd_epi16(h1, x1)));
            }
        }
        const char* sg = (const char*)sb + (4 * c0 / gs) * 16 * ss;
        const __m256 d0 = il16_scales8(sg, kind), d1 = il16_scales8(sg + 8 * ss, kind);
        for (i64 m = 0; m < M; m++) {
            const __m256 s = _mm256_set1_ps(sx[m * (K / 32) + c0 / 8]);
            tot[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][0]), _mm256_mul_ps(d0, s), tot[m][0]);
            tot[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][1]), _mm256_mul_ps(d1, s), tot[m][1]);
        }
    }
    for (int h = 0; h < 2; h++) {
        const __m256 f = sup16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                     _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(sup16 + 8 * h))), 16))
                               : _mm256_set1_ps(1.f);
        for (i64 m = 0; m < M; m++) _mm256_storeu_ps(y + m * ldy + 8 * h, _mm256_mul_ps(tot[m][h], f));
    }
}

// The same for M (1..8) activation rows, 2 at a time (more would spill the 16 ymm registers).
static inline void il16_block_avx2_m(const uint8_t* cb, const void* sb, int kind, const uint16_t* sup16,
                                     const __m128i tab128, const int16_t* xq, const float* sx, i64 M, i64 K, i64 gs,
                                     float* y, i64 ldy) {
    const __m256i tab = _mm256_broadcastsi128_si256(tab128);
    for (i64 m0 = 0; m0 < M; m0 += 2) {
        const int16_t* xr = xq + m0 * K;
        const float* sr = sx + m0 * (K / 32);
        float* yr = y + m0 * ldy;
        if (M - m0 == 1) il16_block_avx2(cb, sb, kind, sup16, tab, xr, sr, 1, K, gs, yr, ldy);
        else il16_block_avx2(cb, sb, kind, sup16, tab, xr, sr, 2, K, gs, yr, ldy);
    }
}
#endif
#endif
