// 8-bit weights interleaved by 16 output rows for decode: a second, decode-only copy of one weight (the output head)
// in which a vector holds 16 output rows — llama.cpp's repack idea. The row-major kernels (gemv.c, i8.c) spend per
// (activation row, group of 32) a conversion and an FMA on one vector and a horizontal sum per output row; here a
// vector's lanes are the output rows, the activations come as broadcast pairs / quads, and the group's scaling is one
// conversion and FMA per 16 output rows. On the 151936x2048 Q8_0 head (bench model): 4 rows 2.6-3.2x the row-major
// kernel, 1 row 1.2-1.75x (at the read probe's speed), measured side by side.
//
// Layouts of one block of 16 output rows (rows past N: zero codes, zero scales), blocks in order, codes then scales:
//   MOEQ_ROWS16_I16 (default numerics): per 32-column chunk c, per column pair j (16): 16 rows x 2 int8 (code - 128),
//     read as int16 pairs against int16 activations (x_to_i16_32's, exact for bf16 values within 2^7 of their
//     chunk's largest): vpdpwssd with the pair broadcast.
//   MOEQ_ROWS16_I8 (int8 activations, llama.cpp's numerics): per 32-column chunk, per column quad j (8): 16 rows x 4
//     uint8 codes (code = value + 128) against the chunk's Q8_0 activations: vpdpbusd with the quad broadcast; the
//     offset's term -128 * sum q per chunk starts the accumulator.
//   scales: per 16-row block, per group g, 16 row scales in the weight's kind (fp32 or bf16).
#include "moeq.h"

enum { MOEQ_ROWS16_I16 = 1, MOEQ_ROWS16_I8 = 2 };

static int rows16_domain(const moeq_wstack* w) {  // 8-bit symmetric RTN, fp32/bf16 scales, 32-column chunks
    return w->fmt == MOEQ_FMT_RTN && w->bits == 8 && !w->zero && !w->values && !w->scale_super &&
           (w->scale_bf16 == 0 || w->scale_bf16 == 1) && w->N > 0 && w->K > 0 && w->K % 32 == 0 && w->gs > 0 &&
           w->gs % 32 == 0 && w->K % w->gs == 0;
}

static inline i64 rows16_blocks(i64 N) { return (N + 15) / 16; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MOEQ_ROWS16 1
#define MOEQ_ROWS16_512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MOEQ_ROWS16 1  // the int16 layout only (AVX2 builds take 8-bit weights with the default numerics)
#endif

// Bytes of the interleaved copy of w (one weight, [N, K]); 0 outside the domain or on builds without the kernels.
i64 moeq_rows16_size(const moeq_wstack* w) {
#if !defined(MOEQ_ROWS16)
    return 0;
#endif
    if (!rows16_domain(w)) return 0;
    return rows16_blocks(w->N) * 16 * (w->K + w->K / w->gs * scale_size(w->scale_bf16));
}

// The interleaved copy of w (expert 0) in `layout` into out (moeq_rows16_size bytes). Returns 0 (nothing written)
// outside the domain.
int moeq_rows16_pack(const moeq_wstack* w, int layout, uint8_t* out) {
    if (!rows16_domain(w) || (layout != MOEQ_ROWS16_I16 && layout != MOEQ_ROWS16_I8)) return 0;
    const i64 N = w->N, K = w->K, G = K / w->gs, NB = rows16_blocks(N), sb = scale_size(w->scale_bf16);
    uint8_t* codes = out;
    uint8_t* scales = out + NB * 16 * K;
    const int i16 = layout == MOEQ_ROWS16_I16;
#pragma omp parallel for schedule(static)
    for (i64 b = 0; b < NB; b++) {
        uint8_t* cb = codes + b * 16 * K;
        for (int r = 0; r < 16; r++) {
            const i64 n = 16 * b + r;
            for (i64 k = 0; k < K; k++) {
                const uint8_t c = n < N ? w->q[n * K + k] : 128;
                const i64 chunk = k / 32, j = k % 32;
                // I16: [chunk][pair j/2][row][j%2] as code - 128; I8: [chunk][quad j/4][row][j%4] as the code
                const i64 at = chunk * 512 + (i16 ? (j / 2) * 32 + r * 2 + j % 2 : (j / 4) * 64 + r * 4 + j % 4);
                cb[at] = i16 ? (uint8_t)(c ^ 0x80) : c;
            }
            for (i64 g = 0; g < G; g++) {
                uint8_t* dst = scales + ((b * G + g) * 16 + r) * sb;
                if (n < N) memcpy(dst, (const char*)w->scale + (n * G + g) * sb, (size_t)sb);
                else memset(dst, 0, (size_t)sb);
            }
        }
    }
    return 1;
}

#if defined(MOEQ_ROWS16_512)
static inline __m512 rows16_scales512(const uint8_t* s, int kind) {
    if (!kind) return _mm512_loadu_ps(s);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)s)), 16));
}

// One block of 16 output rows against M activation rows. Default numerics (i8 = 0): xq int16 [M, K], f [M, K/32] the
// chunks' scales. int8 activations (i8 = 1): xq int8 [M, K] (Q8_0 blocks of 32), f their scales, corr = -128 * each
// block's sum of q (the codes' offset).
static inline __attribute__((always_inline)) void rows16_block(const uint8_t* cb, const uint8_t* sb, int kind, i64 K,
                                                               i64 gs, const void* xq, const float* f,
                                                               const int32_t* corr, const i64 M, const int i8,
                                                               float* out) {
    const i64 C = K / 32, per = gs / 32;
    __m512 acc[8];
    for (i64 m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    __m512 sw = _mm512_setzero_ps();
    for (i64 c = 0; c < C; c++) {
        if (c % per == 0) sw = rows16_scales512(sb + (c / per) * 16 * scale_size(kind), kind);
        __m512i v[8], u[8];
        const uint8_t* cc = cb + c * 512;
        // the activations' pair / quad broadcast as the instruction's memory operand ({1to16}): the intrinsic form
        // compiles to a separate broadcast each, measured 10-15% slower at four rows
        if (i8) {
            for (i64 m = 0; m < M; m++) v[m] = _mm512_set1_epi32(corr[m * C + c]), u[m] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                const __m512i w = _mm512_loadu_si512(cc + 64 * j);
                for (i64 m = 0; m < M; m++)
                    __asm__("vpdpbusd %1%{1to16%}, %2, %0"
                            : "+v"(v[m]) : "m"(*(const int32_t*)((const int8_t*)xq + m * K + 32 * c + 4 * j)), "v"(w));
            }
        } else {
            for (i64 m = 0; m < M; m++) v[m] = u[m] = _mm512_setzero_si512();
            for (int j = 0; j < 16; j += 2) {  // two accumulator chains per row
                const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(cc + 32 * j)));
                const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(cc + 32 * j + 32)));
                for (i64 m = 0; m < M; m++) {
                    const int16_t* xp = (const int16_t*)xq + m * K + 32 * c + 2 * j;
                    __asm__("vpdpwssd %1%{1to16%}, %2, %0" : "+v"(v[m]) : "m"(*(const int32_t*)xp), "v"(w0));
                    __asm__("vpdpwssd %1%{1to16%}, %2, %0" : "+v"(u[m]) : "m"(*(const int32_t*)(xp + 2)), "v"(w1));
                }
            }
        }
        for (i64 m = 0; m < M; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(v[m], u[m])),
                                     _mm512_mul_ps(sw, _mm512_set1_ps(f[m * C + c])), acc[m]);
    }
    for (i64 m = 0; m < M; m++) _mm512_storeu_ps(out + 16 * m, acc[m]);
}
#endif

#if defined(MOEQ_ROWS16) && !defined(MOEQ_ROWS16_512)
static inline __m256 rows16_scales256(const uint8_t* s, int kind) {
    return kind ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)s)), 16))
                : _mm256_loadu_ps((const float*)s);
}

// AVX2, default numerics: rows 0-7 and 8-15 of the block as two 8-lane halves (vpmaddwd on int16 pairs), M (1 or 2)
// activation rows per pass (16 ymm registers: the block is re-read from L1 for rows 3-4).
static inline __attribute__((always_inline)) void rows16_block_i16(const int8_t* cb, const uint8_t* sb, int kind,
                                                                   i64 K, i64 gs, const int16_t* xq, const float* sx,
                                                                   const i64 M, float* out) {
    const i64 C = K / 32, per = gs / 32, ss = scale_size(kind);
    __m256 acc[4];
    for (i64 m = 0; m < 2 * M; m++) acc[m] = _mm256_setzero_ps();
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (i64 c = 0; c < C; c++) {
        if (c % per == 0) {
            s0 = rows16_scales256(sb + (c / per) * 16 * ss, kind);
            s1 = rows16_scales256(sb + ((c / per) * 16 + 8) * ss, kind);
        }
        __m256i v[4];
        for (i64 m = 0; m < 2 * M; m++) v[m] = _mm256_setzero_si256();
        const int8_t* cc = cb + c * 512;
        for (int j = 0; j < 16; j++) {
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(cc + 32 * j)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(cc + 32 * j + 16)));
            for (i64 m = 0; m < M; m++) {
                int32_t p;
                memcpy(&p, xq + m * K + 32 * c + 2 * j, 4);
                const __m256i xp = _mm256_set1_epi32(p);
                v[2 * m] = _mm256_add_epi32(v[2 * m], _mm256_madd_epi16(w0, xp));
                v[2 * m + 1] = _mm256_add_epi32(v[2 * m + 1], _mm256_madd_epi16(w1, xp));
            }
        }
        for (i64 m = 0; m < M; m++) {
            const __m256 xs = _mm256_set1_ps(sx[m * C + c]);
            acc[2 * m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v[2 * m]), _mm256_mul_ps(s0, xs), acc[2 * m]);
            acc[2 * m + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v[2 * m + 1]), _mm256_mul_ps(s1, xs), acc[2 * m + 1]);
        }
    }
    for (i64 m = 0; m < M; m++) {
        _mm256_storeu_ps(out + 16 * m, acc[2 * m]);
        _mm256_storeu_ps(out + 16 * m + 8, acc[2 * m + 1]);
    }
}
#endif

#if defined(MOEQ_ROWS16_512)
// One block against all m (1..8) activation rows, m a compile-time constant per case.
static inline void rows16_rows(int layout, const uint8_t* cb, const uint8_t* sb, int kind, i64 K, i64 gs,
                               const void* xq, const float* f, const int32_t* corr, i64 m, float* o) {
#define R16_CASE(c)                                                                                              \
    case c:                                                                                                      \
        if (layout == MOEQ_ROWS16_I16) rows16_block(cb, sb, kind, K, gs, xq, f, corr, c, 0, o);                  \
        else rows16_block(cb, sb, kind, K, gs, xq, f, corr, c, 1, o);                                            \
        break;
    switch (m) { R16_CASE(1) R16_CASE(2) R16_CASE(3) R16_CASE(4) R16_CASE(5) R16_CASE(6) R16_CASE(7) R16_CASE(8) }
#undef R16_CASE
}
#elif defined(MOEQ_ROWS16)
// AVX2: the int16 layout only, two activation rows per pass.
static inline void rows16_rows(int layout, const uint8_t* cb, const uint8_t* sb, int kind, i64 K, i64 gs,
                               const void* xq, const float* f, const int32_t* corr, i64 m, float* o) {
    (void)layout, (void)corr;
    const int16_t* x16 = (const int16_t*)xq;
    for (i64 r0 = 0; r0 < m; r0 += 2) {
        const int16_t* xr = x16 + r0 * K;
        const float* fr = f + r0 * (K / 32);
        if (m - r0 >= 2) rows16_block_i16((const int8_t*)cb, sb, kind, K, gs, xr, fr, 2, o + 16 * r0);
        else rows16_block_i16((const int8_t*)cb, sb, kind, K, gs, xr, fr, 1, o + 16 * r0);
    }
}
#endif

// y[m, N] = x[m, K] @ W^T through w->rows16 (built by moeq_rows16_pack in layout w->rows16_layout, which must be
// the numerics w asks for: int8 when w->act_i8, which AVX2 builds do not take). m <= 8. Returns 0 (nothing written)
// otherwise, on builds without the kernels, or when the activations hold NaN/Inf in int8 mode (the row-major path
// then reports them as it does).
int moeq_rows16_gemv(const moeq_wstack* w, const float* x, i64 m, float* y) {
#if defined(MOEQ_ROWS16)
    const int layout = w->act_i8 ? MOEQ_ROWS16_I8 : MOEQ_ROWS16_I16;
#if !defined(MOEQ_ROWS16_512)
    if (layout == MOEQ_ROWS16_I8) return 0;
#endif
    if (!w->rows16 || w->rows16_layout != layout || m < 1 || m > 8 || !rows16_domain(w)) return 0;
    const i64 N = w->N, K = w->K, C = K / 32, G = K / w->gs, NB = rows16_blocks(N), gs = w->gs;
    const int kind = w->scale_bf16;
    const uint8_t* scales = w->rows16 + NB * 16 * K;
    const i64 sbytes = G * 16 * scale_size(kind);
    void* xbuf = malloc((size_t)(m * K * 2 + 2 * m * C * 4 + 64));
    if (!xbuf) return 0;
    float* f1 = (float*)xbuf;                 // sx or dx [m, C]
    int32_t* corr = (int32_t*)(f1 + m * C);   // int8: [m, C]
    void* xq = corr + m * C;                  // int16 or int8 codes [m, K]
    if (layout == MOEQ_ROWS16_I16) {
        for (i64 r = 0; r < m; r++) x_to_i16_32(x + r * K, K, 0, (int16_t*)xq + r * K, f1 + r * C);
    } else {
        for (i64 r = 0; r < m; r++)
            for (i64 c = 0; c < C; c++) {
                int qb[32], s = 0;
                if (!moeq_q8_block(x + r * K + 32 * c, qb, f1 + r * C + c)) {
                    free(xbuf);
                    return 0;
                }
                for (int k = 0; k < 32; k++) {
                    ((int8_t*)xq)[r * K + 32 * c + k] = (int8_t)qb[k];
                    s += qb[k];
                }
                corr[r * C + c] = -128 * s;
            }
    }
#pragma omp parallel for schedule(static)
    for (i64 b = 0; b < NB; b++) {
        float o[8 * 16];
        rows16_rows(layout, w->rows16 + b * 16 * K, scales + b * sbytes, kind, K, gs, xq, f1, corr, m, o);
        const i64 rows = N - 16 * b < 16 ? N - 16 * b : 16;
        for (i64 r = 0; r < m; r++) memcpy(y + r * N + 16 * b, o + 16 * r, (size_t)rows * sizeof(float));
    }
    free(xbuf);
    return 1;
#else
    (void)w; (void)x; (void)m; (void)y;
    return 0;
#endif
}
