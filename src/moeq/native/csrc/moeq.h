// moeq native CPU kernels: shared types, the bf16 helpers every file uses, and every export's prototype.
// The Python side mirrors the exports in moeq/native/__init__.py (ABI table) and the format enum / weight-stack
// struct there (Fmt, WStack); keep the three in step.
//
// Layouts (row-major, rows = output features N, K = input features):
//   rtn:  q uint8 [N, K/2] (4-bit, even k in the LOW nibble) or [N, K] (8-bit); scale [N, K/gs]; zero uint8|NULL;
//         codebook grids (iq4nl 4-bit, nl3 3-bit, nl2 2-bit, signed 5-bit): value = scale * values[code], no zero
//   bnb4: packed uint8 [n/2] (even element in the HIGH nibble), absmax fp32 per block of `bs` elements
//   int8: w int8 [N, K], scb fp32 [N]
//   fp8:  q uint8 e4m3 [N, K], s fp32 [ceil(N/bn), ceil(K/bk)] (one scale per tile)
//   iq2s: ggml's block_iq2_s [N, K/256 * 82] (iq2s.c)
#ifndef MOEQ_H
#define MOEQ_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__BMI2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

typedef int64_t i64;

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

#if defined(__AVX512F__)
static inline __m256i f32_to_bf16x16(__m512 v) {  // round to nearest even (finite values), as f2bf_finite
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
#endif

#if defined(__AVX512F__)
static inline __m512 exp512(__m512 x) {  // e^x, ~1 ulp over the clamped range (Cephes' polynomial)
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif

// t[i] = silu(gate[i]) * up[i] (SwiGLU), fp32; AVX512 builds 16 at a time through exp512 (within ~2 ulp of the
// scalar expf form the rest takes).
static inline void silu_glu_row(const float* gate, const float* up, i64 n, float* t) {
    i64 i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(t + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) t[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
}

// Group scales come in four kinds (the int passed as `scale_bf16` throughout): 0 fp32, 1 bf16, 2 int8 codes of a
// double-quantized scale (codebook grids only) whose row factor `sup` (bf16 per output row) the caller applies to
// the row's result: scale = code * sup[n]; 3 E8M0 exponent bytes (mxfp4): scale = 2^(e - 128), e in 0..254
// (validated before any kernel sees it; 2^-127 and 2^-128 are fp32 subnormals, exact).
static inline float e8m0_f32(uint8_t e) {
    const uint32_t u = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load_scale(const void* s, int kind, i64 i) {
    return kind == 3   ? e8m0_f32(((const uint8_t*)s)[i])
           : kind == 2 ? (float)((const int8_t*)s)[i]
           : kind      ? bf2f(((const uint16_t*)s)[i])
                       : ((const float*)s)[i];
}

// Experts with rows in a pair grouping (expert_start [E + 1]); -1 when one has more than most rows.
static inline i64 active_experts(const i64* expert_start, i64 E, i64 most) {
    i64 A = 0;
    for (i64 e = 0; e < E; e++) {
        const i64 m = expert_start[e + 1] - expert_start[e];
        if (m > most) return -1;
        A += m > 0;
    }
    return A;
}

static inline i64 scale_size(int kind) { return kind >= 2 ? 1 : kind ? 2 : 4; }

#if defined(__AVX512F__)
static inline __m512 e8m0_x16(__m128i bytes) {  // 16 E8M0 bytes as fp32 scales (e8m0_f32)
    const __m512i e = _mm512_cvtepu8_epi32(bytes);
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(e, _mm512_set1_epi32(2)), tiny, normal));
}
#endif
#if defined(__AVX2__)
static inline __m256 e8m0_x8(__m128i bytes) {  // the low 8 E8M0 bytes as fp32 scales (e8m0_f32)
    const __m256i e = _mm256_cvtepu8_epi32(bytes);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}
#endif

static inline float row_super(const uint16_t* sup, i64 n) { return sup ? bf2f(sup[n]) : 1.f; }


// Bytes per packed row of K codes (moeq.formats.packing): 2 bits (four per byte, LSB first), 3 bits (eight codes per
// 24-bit little-endian word), 4 bits (two per byte, even element low), 5 bits (the 4-bit plane, then the fifth bits
// LSB first), 8 bits.
static inline i64 packed_row_bytes(int bits, i64 K) {
    return bits == 2 ? K / 4 : bits == 3 ? K / 8 * 3 : bits == 5 ? K / 8 * 5 : bits == 8 ? K : K / 2;
}

// The codebook's bit width for nv values (4, 8, 16 or 32).
static inline int cb_bits(int nv) { return nv == 4 ? 2 : nv == 8 ? 3 : nv == 32 ? 5 : 4; }

// Code k of a packed codebook row (2, 3, 4 or 5 bits, the layouts above).
static inline int packed_code(const uint8_t* row, int bits, i64 K, i64 k) {
    if (bits == 2) return (row[k >> 2] >> (2 * (k & 3))) & 3;
    if (bits == 3) {
        const uint8_t* w = row + (k >> 3) * 3;
        const uint32_t word = (uint32_t)w[0] | (uint32_t)w[1] << 8 | (uint32_t)w[2] << 16;
        return (int)((word >> (3 * (k & 7))) & 7);
    }
    const int c = (row[k >> 1] >> (4 * (k & 1))) & 15;
    return bits == 5 ? c | ((row[K / 2 + (k >> 3)] >> (k & 7)) & 1) << 4 : c;
}

// Eight 3-bit codes (byte i of c8 = code i, little-endian) as their 24-bit word: one pext with BMI2.
static inline uint32_t pack3_word(uint64_t c8) {
#if defined(__BMI2__)
    return (uint32_t)_pext_u64(c8, 0x0707070707070707ull);
#else
    uint32_t word = 0;
    for (int i = 0; i < 8; i++) word |= (uint32_t)((c8 >> (8 * i)) & 7) << (3 * i);
    return word;
#endif
}

// The inverse: a 24-bit word's eight codes as bytes (byte i = code i, little-endian).
static inline uint64_t unpack3_word(uint32_t word) {
#if defined(__BMI2__)
    return _pdep_u64(word, 0x0707070707070707ull);
#else
    uint64_t c8 = 0;
    for (int i = 0; i < 8; i++) c8 |= (uint64_t)((word >> (3 * i)) & 7) << (8 * i);
    return c8;
#endif
}

// Eight 2-bit codes (byte i of c8 = code i) as one 16-bit word, code i at bits 2i: two packed bytes.
static inline uint16_t pack2_word(uint64_t c8) {
#if defined(__BMI2__)
    return (uint16_t)_pext_u64(c8, 0x0303030303030303ull);
#else
    uint16_t word = 0;
    for (int i = 0; i < 8; i++) word |= (uint16_t)(((c8 >> (8 * i)) & 3) << (2 * i));
    return word;
#endif
}

// The inverse: a 16-bit word's eight 2-bit codes as bytes (byte i = code i).
static inline uint64_t unpack2_word(uint16_t word) {
#if defined(__BMI2__)
    return _pdep_u64(word, 0x0303030303030303ull);
#else
    uint64_t c8 = 0;
    for (int i = 0; i < 8; i++) c8 |= (uint64_t)((word >> (2 * i)) & 3) << (8 * i);
    return c8;
#endif
}

// Eight 3-bit codes into their 24-bit word (three bytes, low first).
static inline void pack3_8(const uint8_t* c, uint8_t* o) {
    uint64_t c8;
    memcpy(&c8, c, 8);
    const uint32_t word = pack3_word(c8);
    o[0] = (uint8_t)word;
    o[1] = (uint8_t)(word >> 8);
    o[2] = (uint8_t)(word >> 16);
}


// Symmetric vLLM grid arithmetic helpers (RTN quantize) and a group of weights as fp32.
// A group holding NaN/Inf gets a NaN scale (the caller checks the scales and names the tensor).
// The value of an e4m3fn byte: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities (0x7F/0xFF are NaN:
// refused before any kernel reads them).
static inline float e4m3_value(int c) {
    const int e = (c >> 3) & 15, m = c & 7;
    const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
    return (c & 128) ? -v : v;
}

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

// Activations as int16 per 32-chunk, scaled by a power of two so that the chunk's largest lands in [2^14, 2^15): a bf16
// value has 8 significant bits, so every element within 2^7 of its chunk's largest is exact and the rest are off by at
// most 2^-16 of it (the AVX512 8-bit kernel's numerics); fp32 inputs are off by at most 2^-16 of their chunk's largest.
// sx[c] = the chunk's scale, NaN for a chunk holding NaN/Inf (its outputs come out NaN), 0 for an all-zero one.
// split: each chunk as its 16 even elements then its 16 odd ones (the low / high nibbles of 16 packed bytes).
static inline void x_to_i16_32(const float* x, i64 K, int split, int16_t* xq, float* sx) {
    for (i64 c = 0; c < K; c += 32) {
        float amax = 0.f;
        int bad = 0;
        for (int k = 0; k < 32; k++) {
            const float a = fabsf(x[c + k]);
            bad |= !(a <= 3.402823466e38f);
            amax = a > amax ? a : amax;
        }
        if (bad || amax < 1e-30f) {
            memset(xq + c, 0, 32 * sizeof(int16_t));
            sx[c / 32] = bad ? NAN : 0.f;
            continue;
        }
        int e;
        frexpf(amax, &e);
        const float inv = ldexpf(1.f, 15 - e);
        for (int k = 0; k < 32; k++) {
            long v = lrintf(x[c + k] * inv);
            v = v > 32767 ? 32767 : v < -32767 ? -32767 : v;  // fp32 inputs may round up to 2^15
            xq[c + (split ? (k & 1) * 16 + (k >> 1) : k)] = (int16_t)v;
        }
        sx[c / 32] = ldexpf(1.f, e - 15);
    }
}

// The packed-weight formats the fused kernels take (mirrored by moeq.native.Fmt).
enum moeq_fmt { MOEQ_FMT_RTN = 0, MOEQ_FMT_BNB4 = 1, MOEQ_FMT_FP8 = 2, MOEQ_FMT_IQ2S = 3 };

#define MOEQ_MAX_KERNELS 8

// One weight (or expert stack [E, N, K]) described for the fused kernels (mirrored by moeq.native.WStack).
typedef struct {
    int fmt;                     // enum moeq_fmt
    int dot_bf16;                // RTN 4/8-bit: round activations to bf16 (AVX512-BF16 dot products)
    const uint8_t* q;            // RTN qdata [E, N, K*bits/8]; bnb4 packed [S, n/2]
    const void* scale;           // RTN scale [E, N, G]; bnb4 absmax [S, nb] (fp32, or uint8 with double quant);
                                 // iq2s: ggml's iq2s_grid, uint8 [1024, 8] (q: blocks [E, N, K/256 * 82])
    int scale_bf16;              // RTN: the scale kind (load_scale): 0 fp32, 1 bf16, 2 int8 codes x scale_super, 3 E8M0
    int absmax_u8;               // bnb4: absmax holds uint8 codes (double quant: nested_* resolve them)
    const uint8_t* zero;         // RTN zero points [E, N, G] or NULL
    int bits;                    // RTN bits (4 or 8)
    i64 gs;                      // RTN group size / bnb4 blocksize
    const float* code;           // bnb4 16-entry code
    const float* offset;         // bnb4 double quant: [S]
    const float* nested_absmax;  // bnb4 double quant: [S, ceil(nb/256)]
    const float* nested_code;    // bnb4 double quant: [256]
    i64 spe;                     // bnb4 slices per expert
    i64 N, K;                    // one expert's weight shape
    const float* values;         // RTN codebook grid: its values, 16 readable (value = scale * values[code]) or NULL
    const uint16_t* lut;         // ... and as bf16 (32 words: the table repeated), for the AVX512-BF16 kernels
    const uint16_t* scale_super; // RTN scale kind 2 (int8 codes): the bf16 row factor [E, N]
    int act_i8;                  // decode with int8 activations where i8.c takes the weight (the explicit option)
    const uint8_t* rows16;       // one 8-bit weight interleaved by 16 output rows for decode (rows16.c) or NULL
    int rows16_layout;           // ... its layout: 1 int16 activations (default numerics), 2 int8 (act_i8)
    int il16;                    // 4-bit expert stacks: q/scale in the decode layout il16 (il16_rows.h), not row-major
    i64 bn;                      // fp8: rows per scale tile (gs: its columns); scale fp32 [E, ceil(N/bn), ceil(K/gs)]
    uint8_t kernels[MOEQ_MAX_KERNELS];  // moeq_wstack_plan: the decode kernel rows that take it, best first (moe.c)
    int layers;                  // ... and the layer kernels that take it (enum moeq_layer)
} moeq_wstack;

// The layer kernels a stack can be part of (moeq_wstack.layers, a mask).
#define MOEQ_ROUTED_ROWS 64  // tokens one moeq_moe_routed call takes (in passes of 8 rows per expert)
#define MOEQ_STEP_ROWS 16    // sequences one moeq_decode_step takes

enum moeq_layer { MOEQ_LAYER_I8 = 1, MOEQ_LAYER_EXPERTS = 2, MOEQ_LAYER_GEMM = 4 };

// ---- exports (quants.c) ----
void moeq_set_threads(int n);
void moeq_rtn_quantize_sym(const void* w, int bf16, i64 rows, i64 K, i64 gs, int bits, uint8_t* q, void* scale);
void moeq_rtn_quantize_signed(const void* w, int bf16, i64 rows, i64 K, i64 gs, int bits, uint8_t* q, void* scale);
void moeq_rtn_quantize_asym(const void* w, int bf16, i64 rows, i64 K, i64 gs, int bits, uint8_t* q, void* scale,
                            uint8_t* zero);
void moeq_rtn_dequant(const uint8_t* q, const void* scale, int scale_bf16, const uint8_t* zero, int bits, i64 rows,
                      i64 K, i64 gs, void* out, int out_bf16);
void moeq_bnb4_quantize(const void* w, int bf16, i64 nblocks, i64 bs, const float* bounds, const uint8_t* order,
                        uint8_t* packed, float* absmax);
void moeq_bnb4_quantize_search(const void* w, int bf16, i64 nblocks, i64 bs, const float* bounds, const uint8_t* order,
                               const float* code_sorted, int candidates, float min_alpha, uint8_t* packed,
                               float* absmax);
void moeq_bnb4_dequant(const uint8_t* packed, const float* absmax, const float* code, i64 n, i64 bs, void* out,
                       int out_bf16);
void moeq_bnb4_resolve_absmax(const uint8_t* q, const float* nested_absmax, const float* nested_code,
                              const float* offset, i64 S, i64 nb, float* out);
void moeq_cb4_search(const void* w, int bf16, i64 rows, i64 K, i64 gs, const float* values, int nv, int ntry,
                     int weighting, const float* colw, uint8_t* q, uint16_t* scale);
void moeq_cb4_dequant(const uint8_t* q, const void* scale, int scale_bf16, const uint16_t* sup, const float* values,
                      int bits, i64 rows, i64 K, i64 gs, void* out, int out_bf16);
void moeq_cb4_scale_codes(const uint16_t* scale, i64 rows, i64 G, int8_t* sc, uint16_t* sup);
void moeq_cb4_requant(const void* w, int bf16, i64 rows, i64 K, i64 gs, const float* values, int nv, const int8_t* sc,
                      const uint16_t* sup, uint8_t* q);
void moeq_int8_dequant(const int8_t* w, const float* scb, i64 rows, i64 K, void* out, int out_bf16);
void moeq_ggml_unpack(const uint8_t* blocks, i64 nb, int bits, int head, uint8_t* codes, uint8_t* heads);
int moeq_fp8_dequant(const uint8_t* q, const float* s, i64 lead, i64 N, i64 K, i64 bn, i64 bk, void* out,
                     int out_bf16);
// internal (quants.c): the two dequantizers above over rows r0..r1-1, serially (out holds row r0 first)
void rtn_dequant_rows(const uint8_t* q, const void* scale, int scale_bf16, const uint8_t* zero, int bits, i64 r0,
                      i64 r1, i64 K, i64 gs, void* out, int out_bf16);
void cb4_dequant_rows(const uint8_t* q, const void* scale, int scale_bf16, const uint16_t* sup, const float* values,
                      int bits, i64 r0, i64 r1, i64 K, i64 gs, void* out, int out_bf16);
// ---- exports (gemv.c) ----
int moeq_has_dpbf16(void);
int moeq_simd_level(void);
int moeq_has_cb3_dot(void);
void moeq_rtn_gemv(const float* xe, const float* xo, const float* xsum, i64 M, const uint8_t* q, const void* scale,
                   int scale_bf16, const uint8_t* zero, int bits, i64 N, i64 K, i64 gs, float* y);
void moeq_rtn4_gemv_bf16(const uint16_t* xb, const float* xsum, i64 M, const uint8_t* q, const void* scale,
                         int scale_bf16, const uint8_t* zero, i64 N, i64 K, i64 gs, float* y, int perm64);
int moeq_rtn8_gemv_bf16(const uint16_t* xb, i64 M, const uint8_t* q, const void* scale, int scale_bf16,
                        const uint8_t* zero, i64 N, i64 K, i64 gs, float* y);
int moeq_bf16_gemv(const uint16_t* x, i64 M, const uint16_t* w, i64 N, i64 K, uint16_t* y);
int moeq_bnb4_gemv_bf16(const uint16_t* xb, i64 M, const uint8_t* packed, const float* absmax, const float* code,
                        i64 N, i64 K, i64 bs, float* y);
void moeq_bnb4_gemv(const float* xe, const float* xo, i64 M, const uint8_t* packed, const float* absmax,
                    const float* code, i64 N, i64 K, i64 bs, float* y);
int moeq_cb4_gemv_bf16(const uint16_t* xb, i64 M, const uint8_t* q, const void* scale, int scale_bf16,
                       const uint16_t* sup, const uint16_t* lut, i64 N, i64 K, i64 gs, int bits, float* y);
void moeq_cb4_gemv(const float* x, i64 M, const uint8_t* q, const void* scale, int scale_bf16, const uint16_t* sup,
                   const float* values, i64 N, i64 K, i64 gs, int bits, float* y);
void moeq_int8_gemv(const float* x, i64 M, const int8_t* w, const float* scb, i64 N, i64 K, float* y);
// ---- iq2s.c ----
void moeq_iq2s_quantize(const float* x, i64 rows, i64 K, const float* imp, int mse, const uint8_t* grid, uint8_t* out);
void moeq_iq2s_dequant(const uint8_t* blocks, i64 rows, i64 K, const uint8_t* grid, void* out, int bf16);
void moeq_iq2s_rows_bf16(const uint8_t* blocks, i64 rows, i64 K, const uint8_t* grid, uint16_t* out);
int moeq_iq2s_gemv(const float* x, i64 M, const uint8_t* blocks, i64 N, i64 K, const uint8_t* grid, float* y);
// ---- fp8.c ----
void moeq_fp8_gemv(const float* x, i64 M, const uint8_t* q, const float* s, i64 N, i64 K, i64 bn, i64 bk, float* y);
int moeq_fp8_gemv_bf16(const uint16_t* xb, i64 M, const uint8_t* q, const float* s, i64 N, i64 K, i64 bn, i64 bk,
                       float* y);
int moeq_avx2_gemv_i16(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y, float* scratch);  // internal
int moeq_moe_rtn8_layer(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                        const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out);
// ---- exports (i8.c) ----
int moeq_has_i8_dot(void);
int moeq_i8_gemv(const moeq_wstack* w, i64 e, const float* x, i64 m, float* y);
int moeq_q8_block(const float* x, int* q, float* d);  // internal: one Q8_0 block of activations (0: NaN/Inf)
int moeq_moe_forward_i8(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                        const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out);
// ---- exports (rows16.c) ----
i64 moeq_rows16_size(const moeq_wstack* w);
int moeq_rows16_pack(const moeq_wstack* w, int layout, uint8_t* out);
int moeq_rows16_gemv(const moeq_wstack* w, const float* x, i64 m, float* y);
// moe.c: the il16 decode layout (il16_rows.h)
int moeq_il16_takes(const moeq_wstack* w);
int moeq_il16_dequant(const moeq_wstack* w, i64 e, void* out, int out_bf16);  // quants.c
// ---- exports (moe.c) ----
int moeq_wstack_plan(moeq_wstack* w);
const char* moeq_kernel_name(int k);
void moeq_quant_linear_bf16(const moeq_wstack* w, const uint16_t* x, i64 M, const uint16_t* bias, uint16_t* y,
                            float* scratch);
void moeq_moe_forward(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                      const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out,
                      float* scratch);
void moeq_moe_forward_rtn4_bf16(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I,
                                const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out,
                                float* scratch);
int moeq_moe_routed(const moeq_wstack* w13, const moeq_wstack* w2, const float* x, i64 H, i64 I, const i64* idx,
                    const float* wt, i64 T, i64 A, i64 E, float* out, float* scratch);
int moeq_linear_amx_takes(const moeq_wstack* w, i64 M);
void moeq_set_linear_amx_rows(int rows);
// ---- exports (gemm.c) ----
int moeq_gemm_takes(const moeq_wstack* w);
int moeq_amx_ready(void);
void moeq_set_amx(int on);
void moeq_set_il16_i16(int on);  // several rows per il16 block as int16 activations (moe.c)
int moeq_moe_prefill(const moeq_wstack* w13, const moeq_wstack* w2, const uint16_t* x, i64 T, i64 H, i64 I,
                     const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out);
int moeq_attn_prefill_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, i64 B, i64 Hq, i64 Hkv, i64 L,
                           i64 D, float scale, uint16_t* out);
// One MoE decoder layer for moeq_layer_pre/attn/moe (decode.c), mirrored by moeq.native.Layer.
typedef struct {
    const uint16_t* ln1;            // input RMSNorm weight [H] (bf16)
    const uint16_t* ln2;            // post-attention RMSNorm weight [H]
    const uint16_t* qn;             // q/k RMSNorm weights [D] per head, [Hq*D] / [Hkv*D] with qk_full, or NULL
    const uint16_t* kn;
    const uint16_t* router;         // softmax top-k router weight [E, H] (bf16, no bias)
    const uint16_t* bq;             // q/k/v/o projection biases (bf16) or NULL
    const uint16_t* bk;
    const uint16_t* bv;
    const uint16_t* bo;
    float eps1, eps2, eps_qk, scale;
    i64 H, Hq, Hkv, D, E, topk;
    int renorm, cast;               // top-k weights divided by their sum; rounded to bf16
    int qk_full;                    // qn/kn normalize the whole projection (OLMoE), not each head (Qwen3)
    moeq_wstack q, k, v, o, w13, w2;
} moeq_layer;

// ---- exports (decode.c) ----
void moeq_rmsnorm_bf16(const uint16_t* x, const uint16_t* w, i64 rows, i64 n, float eps, uint16_t* y);
void moeq_attn_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* mask, i64 B, i64 Hq,
                           i64 Hkv, i64 S, i64 D, float scale, uint16_t* out);
void moeq_rope_bf16(uint16_t* x, i64 B, i64 H, i64 D, const uint16_t* cos, const uint16_t* sin);
void moeq_layer_pre(const moeq_layer* L, const uint16_t* x, i64 B, const uint16_t* cos, const uint16_t* sin,
                    uint16_t* q, uint16_t* k, uint16_t* v);
int moeq_layer_attn(const moeq_layer* L, const uint16_t* x, i64 B, const uint16_t* q, const uint16_t* keys,
                    const uint16_t* vals, i64 S, const float* mask, uint16_t* r1, uint16_t* n2, uint16_t* logits);
int moeq_layer_moe(const moeq_layer* L, const uint16_t* r1, const uint16_t* n2, i64 B, const i64* idx,
                   const float* wt, const uint16_t* extra, uint16_t* out);
// internal (decode.c, for model.c)
void moeq_qlinear_bf16(const moeq_wstack* w, const uint16_t* x, i64 B, const uint16_t* bias, uint16_t* y);
int moeq_layer_attn_cached(const moeq_layer* L, const uint16_t* x, i64 B, const uint16_t* q, const uint16_t* keys,
                           const uint16_t* vals, i64 S, i64 Sc, const float* mask, uint16_t* r1, uint16_t* n2,
                           uint16_t* logits);
// A bf16 weight [N, K] held losslessly in 12 bits per weight (bf12.c has the layout): kept bf16 heads.
typedef struct {
    const uint8_t* lo;              // [N, K] each weight's low byte, per 128 columns in bf12_pos order
    const uint8_t* hi;              // [N, K/2] nibbles: sign << 3 | exponent code
    const uint8_t* base;            // [N] per row: code c (1..7) means hi byte & 0x7f == base + c
    const int32_t* xptr;            // [N + 1] row n's exceptions: xptr[n] .. xptr[n+1]-1
    const int32_t* xcol;            // exceptions' columns
    const uint16_t* xval;           // exceptions' exact bf16 values
    i64 N, K;
} moeq_bf12;
// ---- exports (bf12.c) ----
void moeq_bf12_pack(const uint16_t* w, i64 N, i64 K, uint8_t* lo, uint8_t* hi, uint8_t* base, int32_t* nexc);
void moeq_bf12_exceptions(const uint16_t* w, i64 N, i64 K, const uint8_t* base, const int32_t* xptr, int32_t* xcol,
                          uint16_t* xval);
void moeq_bf12_unpack(const moeq_bf12* w, i64 n0, i64 n1, uint16_t* out);
int moeq_bf12_gemv(const moeq_bf12* w, const uint16_t* x, i64 M, uint16_t* y);
int moeq_bf12_gemm_amx(const moeq_bf12* w, const uint16_t* x, i64 M, uint16_t* y);
int moeq_bf12_gemm_bf16(const moeq_bf12* w, const uint16_t* x, i64 M, uint16_t* y);
int moeq_bf12_matmul(const moeq_bf12* w, const uint16_t* x, i64 M, uint16_t* y);
// A whole MoE model for moeq_decode_step (model.c), mirrored by moeq.native.Model: its layers, bf16 token embedding,
// final RMSNorm, output head (bf16, bf12, or a quantized weight with its moeq_quant_linear_bf16 scratch), RoPE
// tables of P positions, and static KV caches of B sequences x Sc positions per layer.
typedef struct {
    const moeq_layer* layers;
    i64 L, H, vocab, V, P, B, Sc;
    const uint16_t* embed;          // [vocab, H]
    const uint16_t* norm;           // [H]
    float eps;
    const uint16_t* head;           // [V, H] bf16, or NULL: head12 or hq
    moeq_wstack hq;
    float* head_scratch;
    const moeq_bf12* head12;        // the bf16 head in 12 bits, or NULL
    const uint16_t* cos;            // [P, D] bf16, as the model's rotary embedding gives them
    const uint16_t* sin;
    uint16_t* const* kc;            // L pointers to [B, Hkv, Sc, D] bf16
    uint16_t* const* vc;
} moeq_model;
// ---- exports (model.c) ----
i64 moeq_decode_step(const moeq_model* M, i64 B, const i64* tok, const i64* pos, i64 S, const float* mask, i64 l0,
                     const i64* idx0, const float* wt0, uint16_t* state, uint16_t* logits);
void moeq_argmax_bf16(const uint16_t* x, i64 B, i64 V, const i64* ban, i64 nban, i64* out);
#endif
