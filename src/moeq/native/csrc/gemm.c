// Prefill of a MoE layer (experts with many rows each): a grouped GEMM per expert straight from the packed codes.
//
// The decode kernels (moe.c, rtn4_rows.h) re-expand every weight for every row of x, which pays while an expert has
// a few rows; in a prompt each expert gets tens to hundreds. Here a tile of 16 weight rows is dequantized once into a
// cache-resident bf16 buffer (the same dequantizers, so the same rounded weights, as the torch path's dequantize +
// matmul) and multiplied with every routed token: the tokens sit in the vector lanes (x transposed to bf16 pairs
// [K/2][tokens]), each weight pair is broadcast, so one AVX512-BF16 dot product does 16 tokens x 2 weights and no
// horizontal sums are needed. gate/up rows land in a [2I][tokens] fp32 tile, SiLU-GLU writes the down projection's
// input directly in the same transposed bf16 layout, and the weighted outputs are summed in fp32 (rounded once, by
// the caller). Experts run in parallel over the threads (each its own scratch and output buffer, summed at the end).
//
// On CPUs with AMX (Sapphire Rapids and later; runtime permission from Linux, see moeq_amx_ready) the products of a
// dequantized tile run on the tile unit instead: the same two layouts are exactly what TDPBF16PS reads — the weight
// tile [16 rows][K] bf16 as A (16 x 32 per step), the transposed tokens [K/2][Pp] bf16 pairs as B (VNNI: 16 pairs x
// 16 tokens) — and C [16 rows][16 tokens] fp32 lands in y [N][Pp] as is. The dequantizers, the SiLU-GLU and the
// weighted sum stay the same code.
#define _GNU_SOURCE
#include "moeq.h"
#include "amx.h"
#include "il16_rows.h"

static int amx_state = -1;  // -1 not asked yet, 0 refused or absent, 1 granted
static int amx_wanted = 1;  // moeq_set_amx(0): the AVX512-BF16 products (tests compare the two on one machine)

// Asks Linux once for this process's permission to use the AMX tile data (ARCH_REQ_XCOMP_PERM for XTILEDATA, which a
// process must hold before its first tile instruction, or it dies of SIGILL) and checks that it was granted. Returns 1
// when the tile kernels may run: built with AMX, a CPU with it, a kernel that grants it. Call it from one thread
// before any parallel use (moeq's Python side does at load).
int moeq_amx_ready(void) {
#if defined(MOEQ_AMX)
    if (amx_state < 0) {
        enum { ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
        unsigned long bits = 0;
        const long rc = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
        amx_state = rc == 0 && syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 &&
                    (bits >> XFEATURE_XTILEDATA & 1);
    }
    return amx_state;
#else
    return 0;
#endif
}

void moeq_set_amx(int on) { amx_wanted = on != 0; }

int moeq_amx_on(void) { return amx_wanted && amx_state == 1; }

#if defined(__AVX512BF16__)
static inline int n_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

// weight rows per dequantized tile; tokens per pass over an expert (96: ~7% less time per token than 64 at 96 or
// more rows, measured)
enum { TILE_R = 16, CHUNK = 96 };

// The tile's K order: natural (pair kp = elements 2kp, 2kp + 1), or for the 4-bit fast path (perm4) per 64-chunk
// pair j < 16 = elements (4j, 4j + 2) and pair 16 + j = (4j + 1, 4j + 3): what one widening of 32 code bytes to
// words gives as (low nibbles, high nibbles). A dot product is the same in any order, so x is transposed into it.
static inline i64 pair_elem(int perm4, i64 kp, int second) {
    if (!perm4) return 2 * kp + second;
    const i64 c = kp >> 5, j = kp & 31;
    return 64 * c + 4 * (j & 15) + (j >> 4) + 2 * second;
}

// 4-bit RTN (zero point or 8) or a 16-value codebook, K % 64 == 0, gs 32 or a multiple of 64: per 64-chunk one
// table of the chunk's two groups' values (scale * value, rounded once to bf16: the same weights as the
// dequantizers in quants.c) and two word permutes.
static int perm4_takes(const moeq_wstack* w) {
    return w->fmt == MOEQ_FMT_RTN && w->bits == 4 && w->K % 64 == 0 && (w->gs == 32 || w->gs % 64 == 0);
}

// The TILE_R rows from q (row-major codes, K/2 bytes apart), sc (the scale of row r, group g at r * rs + g * gst:
// row-major rs = G, gst = 1; an il16 block's rs = 1, gst = 16), zp (row-major, or NULL), sup (or NULL).
static void dequant_tile4(const moeq_wstack* w, const uint8_t* q, const void* sc, i64 rs, i64 gst, const uint8_t* zp,
                          const uint16_t* sup, uint16_t* dst) {
    const i64 K = w->K, G = K / w->gs;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 vals = w->values ? _mm512_loadu_ps(w->values) : iota;
    const __m512i lo4 = _mm512_set1_epi16(15);
    const __m512i grp = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);  // words 16-31: table B
    for (i64 r = 0; r < TILE_R; r++) {
        const uint8_t* qr = q + r * (K / 2);
        const float su = row_super(sup, r);
        uint16_t* o = dst + r * K;
        for (i64 c = 0; c < K / 64; c++) {
            __m512 t[2];
            for (int h = 0; h < 2; h++) {
                const i64 gi = (64 * c + 32 * h) / w->gs, g = r * G + gi;
                const __m512 s = _mm512_set1_ps(load_scale(sc, w->scale_bf16, r * rs + gi * gst) * su);
                const __m512 v = w->values ? vals : _mm512_sub_ps(iota, _mm512_set1_ps(zp ? (float)zp[g] : 8.f));
                t[h] = _mm512_mul_ps(v, s);
            }
            const __m512i tab = (__m512i)_mm512_cvtne2ps_pbh(t[1], t[0]);
            const __m512i wv = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qr + 32 * c)));
            const __m512i il = _mm512_ternarylogic_epi32(wv, lo4, grp, 0xEA);  // (wv & 15) | grp
            const __m512i ih = _mm512_or_si512(_mm512_srli_epi16(wv, 4), grp);
            _mm512_storeu_si512(o + 64 * c, _mm512_permutexvar_epi16(il, tab));
            _mm512_storeu_si512(o + 64 * c + 32, _mm512_permutexvar_epi16(ih, tab));
        }
    }
}

// FP8 e4m3 rows n0..n0+TILE_R of expert e as bf16 [TILE_R][K]: value * its tile's scale in fp32, rounded once to bf16
// (as Fp8Weight.dequantize). An e4m3 byte becomes an fp16 with the same bits shifted, exactly value * 2^-8 (fp8.c),
// times 256 (exact), times the scale.
static void dequant_tile_fp8(const moeq_wstack* w, i64 e, i64 n0, uint16_t* dst) {
    const i64 N = w->N, K = w->K, bk = w->gs, TN = (N + w->bn - 1) / w->bn, TK = (K + bk - 1) / bk;
    const __m256i sign = _mm256_set1_epi16(0x80), rest = _mm256_set1_epi16(0x7F);
    const __m512 k256 = _mm512_set1_ps(256.f);
    for (i64 r = 0; r < TILE_R; r++) {
        const i64 n = n0 + r;
        const uint8_t* qr = w->q + (e * N + n) * K;
        const float* ss = (const float*)w->scale + (e * TN + n / w->bn) * TK;
        uint16_t* o = dst + r * K;
        i64 k = 0;
        if (bk % 16 == 0)  // each 16-chunk inside one tile
            for (; k + 16 <= K; k += 16) {
                const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(qr + k)));
                const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, sign), 8),
                                                  _mm256_slli_epi16(_mm256_and_si256(b, rest), 7));
                const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), k256), _mm512_set1_ps(ss[k / bk]));
                _mm256_storeu_si256((__m256i*)(o + k), (__m256i)_mm512_cvtneps_pbh(v));
            }
        for (; k < K; k++) o[k] = f2bf(e4m3_value(qr[k]) * ss[k / bk]);
    }
}

// Bytes of one weight row of w as stored (IQ2_S: 82 per 256 weights; FP8: one per weight; else packed codes).
static inline i64 row_bytes(const moeq_wstack* w) {
    return w->fmt == MOEQ_FMT_IQ2S ? w->K / 256 * 82 : packed_row_bytes(w->bits, w->K);
}

// The dequantized tile of expert e's rows n0..n0+TILE_R (bf16 [TILE_R][K], in perm4's K order when perm4). stage:
// room for one block's codes and scales in row-major order (il16 stacks are unpacked into it first).
static void dequant_tile(const moeq_wstack* w, int perm4, i64 e, i64 n0, uint16_t* dst, uint8_t* stage) {
    if (w->fmt == MOEQ_FMT_FP8) {
        dequant_tile_fp8(w, e, n0, dst);
        return;
    }
    if (w->fmt == MOEQ_FMT_IQ2S) {  // the grid travels in w->scale
        moeq_iq2s_rows_bf16(w->q + (e * w->N + n0) * row_bytes(w), TILE_R, w->K, (const uint8_t*)w->scale, dst);
        return;
    }
    const i64 N = w->N, K = w->K, G = K / w->gs, rowb = packed_row_bytes(w->bits, K), ss = scale_size(w->scale_bf16);
    const uint8_t* q = w->q + (e * N + n0) * rowb;
    const void* sc = (const char*)w->scale + (e * N + n0) * G * ss;
    const uint8_t* zp = w->zero ? w->zero + (e * N + n0) * G : NULL;
    const uint16_t* sup = w->scale_super ? w->scale_super + e * N + n0 : NULL;
    if (w->il16) {  // TILE_R == 16: one block; perm4 reads its scales in place
        il16_unpack(w, e, n0 / 16, stage, perm4 ? NULL : stage + TILE_R * rowb);
        q = stage;
        if (perm4) {
            dequant_tile4(w, q, il16_scale_at(w, e, n0 / 16), 1, 16, NULL, sup, dst);
            return;
        }
        sc = stage + TILE_R * rowb;
    }
    if (perm4)
        dequant_tile4(w, q, sc, G, 1, zp, sup, dst);
    else if (w->values)
        cb4_dequant_rows(q, sc, w->scale_bf16, sup, w->values, w->bits, 0, TILE_R, K, w->gs, dst, 1);
    else
        rtn_dequant_rows(q, sc, w->scale_bf16, zp, w->bits, 0, TILE_R, K, w->gs, dst, 1);
}

// y[r * ldy + p] = sum_k w[r][k] x_p[k] for R weight rows (bf16 [R][K]) and the 16*TB tokens from p0 (xt: bf16 pairs
// [K/2][Pp]); R and TB compile-time constants per call site. Per pair step TB vector loads and R broadcasts feed
// R*TB dot products: TB = 1 is load-bound (half speed), 2 and 3 are not.
static inline __attribute__((always_inline)) void tile_dot(const uint16_t* w, i64 K, const uint32_t* xt, i64 Pp,
                                                           i64 p0, const int R, const int TB, float* y, i64 ldy) {
    __m512 acc[16][3];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < TB; j++) acc[r][j] = _mm512_setzero_ps();
    const i64 KP = K / 2;
    const uint32_t* xp = xt + p0;
    for (i64 kp = 0; kp < KP; kp++, xp += Pp) {
        __m512bh xv[3];
        for (int j = 0; j < TB; j++) xv[j] = (__m512bh)_mm512_loadu_si512(xp + 16 * j);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, w + r * K + 2 * kp, 4);
            const __m512bh wb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < TB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv[j], wb);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < TB; j++) _mm512_storeu_ps(y + r * ldy + p0 + 16 * j, acc[r][j]);
}

// y [N][Pp] = W[e] (N x K) @ the Pp (<= CHUNK) tokens of xt, a tile of TILE_R dequantized rows (wt: TILE_R * K halves)
// at a time; N % TILE_R == 0. Token blocks of 48 or 32 (16 only when that is all there is).
static void expert_gemm(const moeq_wstack* w, int perm4, i64 e, const uint32_t* xt, i64 Pp, float* y, uint16_t* wt,
                        uint8_t* stage) {
    const i64 N = w->N, K = w->K;
    const i64 rowb = row_bytes(w), tileb = TILE_R * rowb;
    const char* codes = (const char*)w->q + e * N * rowb;
    for (i64 n0 = 0; n0 < N; n0 += TILE_R) {
        dequant_tile(w, perm4, e, n0, wt, stage);
        if (n0 + TILE_R < N)  // the next tile's codes on their way while this one's products run
            for (i64 b = 0; b < tileb; b += 64) _mm_prefetch(codes + (n0 + TILE_R) * rowb + b, _MM_HINT_T1);
        float* yt = y + n0 * Pp;
        for (i64 p = 0; p < Pp;) {
            const i64 left = Pp - p;
            if (left == 48) {
                tile_dot(wt, K, xt, Pp, p, 8, 3, yt, Pp);
                tile_dot(wt + 8 * K, K, xt, Pp, p, 8, 3, yt + 8 * Pp, Pp);
                p += 48;
            } else if (left >= 32) {
                tile_dot(wt, K, xt, Pp, p, 8, 2, yt, Pp);
                tile_dot(wt + 8 * K, K, xt, Pp, p, 8, 2, yt + 8 * Pp, Pp);
                p += 32;
            } else {
                tile_dot(wt, K, xt, Pp, p, 16, 1, yt, Pp);
                p += 16;
            }
        }
    }
}

#if defined(MOEQ_AMX)
// expert_gemm on the tile unit (the caller configured the tiles): two dequantized tiles of 16 rows at a time (wt:
// 2 * TILE_R * K halves); K % 32 == 0.
static void expert_gemm_amx(const moeq_wstack* w, int perm4, i64 e, const uint32_t* xt, i64 Pp, float* y,
                            uint16_t* wt, uint8_t* stage) {
    const i64 N = w->N, K = w->K;
    const i64 rowb = row_bytes(w), tileb = TILE_R * rowb;
    const char* codes = (const char*)w->q + e * N * rowb;
    for (i64 n0 = 0; n0 < N; n0 += 2 * TILE_R) {
        const int two = n0 + 2 * TILE_R <= N;
        dequant_tile(w, perm4, e, n0, wt, stage);
        if (two) dequant_tile(w, perm4, e, n0 + TILE_R, wt + TILE_R * K, stage);
        if (n0 + 2 * TILE_R < N)  // the next tiles' codes on their way while these products run
            for (i64 b = 0; b < 2 * tileb && (n0 + 2 * TILE_R) * rowb + b < N * rowb; b += 64)
                _mm_prefetch(codes + (n0 + 2 * TILE_R) * rowb + b, _MM_HINT_T1);
        float* yt = y + n0 * Pp;
        i64 p = 0;
        if (two) {
            for (; Pp - p >= 32; p += 32) amx_block(wt, K, xt, Pp, p, 2, 2, yt);
            if (p < Pp) amx_block(wt, K, xt, Pp, p, 2, 1, yt);
        } else {
            for (; Pp - p >= 32; p += 32) amx_block(wt, K, xt, Pp, p, 1, 2, yt);
            if (p < Pp) amx_block(wt, K, xt, Pp, p, 1, 1, yt);
        }
    }
}
#endif

// at[kp][p] = bf16 pair kp (in the K order of perm4, see pair_elem) of a = silu(gate) * up, gate/up the rows i and
// I + i of h [2I][Pp].
static void silu_glu_pairs(const float* h, i64 I, i64 Pp, int perm4, uint32_t* at) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (i64 kp = 0; kp < I / 2; kp++)
        for (i64 p = 0; p < Pp; p += 16) {
            __m512 a[2];
            for (int j = 0; j < 2; j++) {
                const i64 i = pair_elem(perm4, kp, j);
                const __m512 g = _mm512_loadu_ps(h + i * Pp + p), u = _mm512_loadu_ps(h + (I + i) * Pp + p);
                const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                a[j] = _mm512_mul_ps(s, u);
            }
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a[0]));
            const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a[1]));
            _mm512_storeu_si512(at + kp * Pp + p, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

// One pass over expert e with the P (<= CHUNK) pairs at tok/wts: out[tok] += wts * W2 silu-glu(W13 x[tok]).
static void expert_pass(const moeq_wstack* w13, const moeq_wstack* w2, i64 e, const uint16_t* x, i64 H, i64 I,
                        const i64* tok, const float* wts, i64 P, float* out, float* scratch, int amx) {
    const i64 Pp = (P + 15) & ~(i64)15;
    uint32_t* xt = (uint32_t*)scratch;             // (H/2) * Pp
    float* h = scratch + (H / 2) * Pp;              // 2I * Pp
    uint32_t* at = (uint32_t*)(h + 2 * I * Pp);    // (I/2) * Pp
    float* y = (float*)(at + (I / 2) * Pp);        // H * Pp
    uint16_t* wt = (uint16_t*)(y + H * Pp);         // 2 * TILE_R * max(H, I) halves (AMX: two tiles at a time)
    uint8_t* stage = (uint8_t*)(wt + 2 * TILE_R * (H > I ? H : I));  // an il16 block unpacked: 16 * max(H, I) bytes
    const int p13 = perm4_takes(w13), p2 = perm4_takes(w2);
    for (i64 p = 0; p < P; p++) {
        const uint16_t* row = x + tok[p] * H;
        for (i64 kp = 0; kp < H / 2; kp++)
            xt[kp * Pp + p] = (uint32_t)row[pair_elem(p13, kp, 0)] | (uint32_t)row[pair_elem(p13, kp, 1)] << 16;
    }
    for (i64 p = P; p < Pp; p++)
        for (i64 kp = 0; kp < H / 2; kp++) xt[kp * Pp + p] = 0;
#if defined(MOEQ_AMX)
    if (amx) {
        expert_gemm_amx(w13, p13, e, xt, Pp, h, wt, stage);
        silu_glu_pairs(h, I, Pp, p2, at);
        expert_gemm_amx(w2, p2, e, at, Pp, y, wt, stage);
    } else
#endif
    {
        (void)amx;
        expert_gemm(w13, p13, e, xt, Pp, h, wt, stage);
        silu_glu_pairs(h, I, Pp, p2, at);
        expert_gemm(w2, p2, e, at, Pp, y, wt, stage);
    }
    for (i64 p = 0; p < P; p++) {
        float* o = out + tok[p] * H;
        const float wgt = wts[p];
        for (i64 k = 0; k < H; k++) o[k] += wgt * y[k * Pp + p];
    }
}

#endif

// Whether the prompt GEMM takes w on this build: AVX512-BF16, RTN 4/8-bit and the 2-5-bit codebook grids (row-major
// or il16; K even, whole groups), FP8 e4m3 tiles (any tile shape, K even) and IQ2_S blocks, N % TILE_R == 0 (moeq_wstack_plan
// records it as MOEQ_LAYER_GEMM).
int moeq_gemm_takes(const moeq_wstack* w) {
#if defined(__AVX512BF16__)
    if (w->fmt == MOEQ_FMT_FP8) return w->K % 2 == 0 && w->gs > 0 && w->bn > 0 && w->N % TILE_R == 0;
    if (w->fmt == MOEQ_FMT_IQ2S) return w->K % 256 == 0 && w->N % TILE_R == 0;
    return w->fmt == MOEQ_FMT_RTN && (w->values ? w->bits >= 2 && w->bits <= 5 : w->bits == 4 || w->bits == 8) &&
           w->K % 2 == 0 && w->gs > 0 && w->K % w->gs == 0 && w->N % TILE_R == 0;
#else
    (void)w;
    return 0;
#endif
}

// out[T, H] (fp32, zeroed by the caller) += for each pair (grouped by expert: expert_start[E + 1]) its weight times
// expert e's SiLU-GLU MLP of x[pair_tok] (bf16 [T, H]). Returns 0 (nothing written) without AVX512-BF16 or outside
// the formats above; -1 when scratch could not be allocated, -2 for a token index outside [0, T).
int moeq_moe_prefill(const moeq_wstack* w13, const moeq_wstack* w2, const uint16_t* x, i64 T, i64 H, i64 I,
                     const i64* pair_tok, const float* pair_w, const i64* expert_start, i64 E, float* out) {
#if defined(__AVX512BF16__)
    if (!moeq_gemm_takes(w13) || !moeq_gemm_takes(w2) || w13->N != 2 * I || w13->K != H || w2->N != H || w2->K != I || I % 2)
        return 0;
    i64 pmax = 0, ne = 0;
    for (i64 e = 0; e < E; e++) {
        const i64 c = expert_start[e + 1] - expert_start[e];
        pmax = c > pmax ? c : pmax;
        ne += c > 0;
    }
    for (i64 j = 0; j < expert_start[E]; j++)
        if (pair_tok[j] < 0 || pair_tok[j] >= T) return -2;
    if (ne == 0) return 1;
    i64* order = (i64*)malloc((size_t)ne * sizeof(i64));  // busiest experts first: the threads end together
    if (!order) return -1;
    for (i64 e = 0, j = 0; e < E; e++)
        if (expert_start[e + 1] > expert_start[e]) order[j++] = e;
    for (i64 a = 1; a < ne; a++) {
        const i64 v = order[a], c = expert_start[v + 1] - expert_start[v];
        i64 b = a;
        for (; b > 0 && expert_start[order[b - 1] + 1] - expert_start[order[b - 1]] < c; b--) order[b] = order[b - 1];
        order[b] = v;
    }
    const i64 Pp = ((pmax < CHUNK ? pmax : CHUNK) + 15) & ~(i64)15, KM = H > I ? H : I;
    const i64 per = (H / 2 + 2 * I + I / 2 + H) * Pp + TILE_R * KM + 4 * KM + 16;  // floats per thread
    const int nt = n_threads(), amx = moeq_amx_on() && H % 32 == 0 && I % 32 == 0;
    float* scratch = (float*)malloc((size_t)(nt * per) * sizeof(float));
    float* extra = nt > 1 ? (float*)calloc((size_t)((nt - 1) * T * H), sizeof(float)) : NULL;
    if (!scratch || (nt > 1 && !extra)) {
        free(order);
        free(scratch);
        free(extra);
        return -1;
    }
#pragma omp parallel num_threads(nt)
    {
        const int tid = thread_id();
        float* mine = scratch + tid * per;
        float* o = tid == 0 ? out : extra + (tid - 1) * T * H;
#if defined(MOEQ_AMX)
        if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (i64 j = 0; j < ne; j++) {
            const i64 e = order[j];
            for (i64 p0 = expert_start[e]; p0 < expert_start[e + 1]; p0 += CHUNK) {
                const i64 P = expert_start[e + 1] - p0 < CHUNK ? expert_start[e + 1] - p0 : CHUNK;
                expert_pass(w13, w2, e, x, H, I, pair_tok + p0, pair_w + p0, P, o, mine, amx);
            }
        }
#if defined(MOEQ_AMX)
        if (amx) _tile_release();
#endif
#pragma omp for schedule(static)
        for (i64 i = 0; i < T * H; i++)
            for (int t = 1; t < nt; t++) out[i] += extra[(t - 1) * T * H + i];
    }
    free(order);
    free(scratch);
    free(extra);
    return 1;
#else
    (void)w13; (void)w2; (void)x; (void)T; (void)H; (void)I; (void)pair_tok; (void)pair_w; (void)expert_start;
    (void)E; (void)out;
    return 0;
#endif
}

// ------------------------------------------------------------------------------------------------------------------
// Causal attention of a prompt (queries 0..L-1 against keys 0..L-1, query i seeing keys <= i; the top-left causal
// mask of torch's scaled_dot_product_attention with is_causal), grouped-query heads, bf16 in and out, fp32 softmax.
// Flash-style: per task the g query heads sharing a kv head at 16 / g consecutive positions (16 rows); key blocks of 32
// scored by tile_dot (queries as the weight rows, keys in the lanes: k transposed to bf16 pairs [D/2][Sp]), an online
// softmax per row, and P V with D in the lanes (v as pairs of keys [Sp/2][D], the probabilities' pairs broadcast).
#if defined(__AVX512BF16__)
enum { ATT_R = 16, ATT_KB = 32 };

// rows [ATT_R][D] (bf16) of one task; o: ATT_R x D fp32 accumulators; m, l: running max and sum per row.
static void attn_task(const uint16_t* qrows, const int* qpos, i64 D, const uint32_t* kt, const uint32_t* vp, i64 Sp,
                      float scale, float* o, uint16_t* out, i64 ostride) {
    float m[ATT_R], l[ATT_R], s[ATT_R * ATT_KB];
    uint32_t pp[ATT_R * ATT_KB / 2];
    __mmask16 bad[ATT_R] = {0};  // a NaN among a row's visible scores: the row's output is NaN (as torch's)
    int last = 0;
    for (int r = 0; r < ATT_R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        last = qpos[r] > last ? qpos[r] : last;
    }
    memset(o, 0, (size_t)(ATT_R * D) * sizeof(float));
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (i64 k0 = 0; k0 <= last; k0 += ATT_KB) {
        tile_dot(qrows, D, kt + k0, Sp, 0, 8, 2, s, ATT_KB);
        tile_dot(qrows + 8 * D, D, kt + k0, Sp, 0, 8, 2, s + 8 * ATT_KB, ATT_KB);
        __m512 alpha[ATT_R];
        for (int r = 0; r < ATT_R; r++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(s + r * ATT_KB), _mm512_set1_ps(scale));
            __m512 b = _mm512_mul_ps(_mm512_loadu_ps(s + r * ATT_KB + 16), _mm512_set1_ps(scale));
            const __m512i lim = _mm512_set1_epi32(qpos[r] - (int)k0);  // keys past the row's position: -inf
            a = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(lane, lim), a, _mm512_set1_ps(-INFINITY));
            b = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), lim), b,
                                     _mm512_set1_ps(-INFINITY));
            bad[r] |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
            const float mx = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
            const float mn = mx > m[r] ? mx : m[r];  // key 0 is always visible: finite from the first block on
            const float al = expf(m[r] - mn);
            m[r] = mn;
            a = exp512(_mm512_sub_ps(a, _mm512_set1_ps(mn)));
            b = exp512(_mm512_sub_ps(b, _mm512_set1_ps(mn)));
            a = _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(lane, lim), a);  // exact zeros where masked
            b = _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), lim), b);
            l[r] = l[r] * al + _mm512_reduce_add_ps(_mm512_add_ps(a, b));
            alpha[r] = _mm512_set1_ps(al);
            _mm512_storeu_si512(pp + r * (ATT_KB / 2), (__m512i)_mm512_cvtne2ps_pbh(b, a));  // key pairs in order
        }
        const uint32_t* vb = vp + (k0 / 2) * D;
        for (int r = 0; r < ATT_R; r += 2)
            for (i64 d0 = 0; d0 < D; d0 += 128) {  // 8 vectors of D per row pair
                const int nd = D - d0 >= 128 ? 8 : (int)((D - d0) / 16);
                __m512 acc[2][8];
                for (int j = 0; j < 2; j++)
                    for (int z = 0; z < nd; z++)
                        acc[j][z] = _mm512_mul_ps(_mm512_loadu_ps(o + (r + j) * D + d0 + 16 * z), alpha[r + j]);
                for (int t = 0; t < ATT_KB / 2; t++) {
                    const __m512bh p0 = (__m512bh)_mm512_set1_epi32((int)pp[r * (ATT_KB / 2) + t]);
                    const __m512bh p1 = (__m512bh)_mm512_set1_epi32((int)pp[(r + 1) * (ATT_KB / 2) + t]);
                    for (int z = 0; z < nd; z++) {
                        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vb + t * D + d0 + 16 * z);
                        acc[0][z] = _mm512_dpbf16_ps(acc[0][z], vv, p0);
                        acc[1][z] = _mm512_dpbf16_ps(acc[1][z], vv, p1);
                    }
                }
                for (int j = 0; j < 2; j++)
                    for (int z = 0; z < nd; z++) _mm512_storeu_ps(o + (r + j) * D + d0 + 16 * z, acc[j][z]);
            }
    }
    for (int r = 0; r < ATT_R; r++) {
        const __m512 inv = _mm512_set1_ps(bad[r] ? NAN : 1.f / l[r]);
        for (i64 d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i*)(out + r * ostride + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv)));
    }
}
#endif

// out [B, L, Hq, D] = softmax(q k^T * scale, causal) v for q [B, Hq, L, D], k, v [B, Hkv, L, D] (all bf16,
// contiguous; Hq % Hkv == 0, D % 32 == 0). Returns 0 (nothing written) without AVX512-BF16 or outside that domain, -1
// when scratch could not be allocated.
int moeq_attn_prefill_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, i64 B, i64 Hq, i64 Hkv, i64 L,
                           i64 D, float scale, uint16_t* out) {
#if defined(__AVX512BF16__)
    if (B <= 0 || L <= 0 || Hkv <= 0 || Hq % Hkv || D % 32 || D > 512) return 0;
    const i64 g = Hq / Hkv, Sp = (L + ATT_KB - 1) / ATT_KB * ATT_KB, nkv = B * Hkv;
    const int nt = n_threads();
    uint32_t* kt = (uint32_t*)malloc((size_t)(nkv * (D / 2) * Sp) * sizeof(uint32_t));
    uint32_t* vp = (uint32_t*)malloc((size_t)(nkv * (Sp / 2) * D) * sizeof(uint32_t));
    // per thread: a task's query rows and output rows (bf16) and its fp32 accumulators
    float* work = (float*)malloc((size_t)(nt * 2 * ATT_R * D) * sizeof(float));
    if (!kt || !vp || !work) {
        free(kt);
        free(vp);
        free(work);
        return -1;
    }
    // tasks: per kv head, rows (query position, head of the group) in blocks of ATT_R, latest positions first
    const i64 rows = L * g, per_kv = (rows + ATT_R - 1) / ATT_R, ntask = nkv * per_kv;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (i64 c = 0; c < nkv; c++) {
            const uint16_t* kc = k + c * L * D;
            const uint16_t* vc = v + c * L * D;
            uint32_t* ktc = kt + c * (D / 2) * Sp;
            uint32_t* vpc = vp + c * (Sp / 2) * D;
            for (i64 d2 = 0; d2 < D / 2; d2++)
                for (i64 s = 0; s < Sp; s++) {
                    uint32_t pair = 0;
                    if (s < L) memcpy(&pair, kc + s * D + 2 * d2, 4);
                    ktc[d2 * Sp + s] = pair;
                }
            for (i64 s2 = 0; s2 < Sp / 2; s2++)
                for (i64 d = 0; d < D; d++) {
                    const uint32_t lo = 2 * s2 < L ? vc[2 * s2 * D + d] : 0;
                    const uint32_t hi = 2 * s2 + 1 < L ? vc[(2 * s2 + 1) * D + d] : 0;
                    vpc[s2 * D + d] = lo | hi << 16;
                }
        }
        float* o = work + thread_id() * 2 * ATT_R * D;
        uint16_t* qrows = (uint16_t*)(o + ATT_R * D);
        uint16_t* ob = qrows + ATT_R * D;
#pragma omp for schedule(dynamic, 1)
        for (i64 t = 0; t < ntask; t++) {
            const i64 c = t / per_kv, blk = per_kv - 1 - t % per_kv, b = c / Hkv, hk = c % Hkv;
            const i64 nrow = rows - blk * ATT_R < ATT_R ? rows - blk * ATT_R : ATT_R;  // the last block may be short
            int qpos[ATT_R];  // padding rows: zero queries at position 0, computed and dropped
            i64 dst[ATT_R];
            for (int r = 0; r < ATT_R; r++) {
                const i64 row = blk * ATT_R + r, i = row / g, h = hk * g + row % g;
                qpos[r] = r < nrow ? (int)i : 0;
                if (r < nrow) {
                    memcpy(qrows + r * D, q + ((b * Hq + h) * L + i) * D, (size_t)D * sizeof(uint16_t));
                    dst[r] = ((b * L + i) * Hq + h) * D;
                } else {
                    memset(qrows + r * D, 0, (size_t)D * sizeof(uint16_t));
                }
            }
            attn_task(qrows, qpos, D, kt + c * (D / 2) * Sp, vp + c * (Sp / 2) * D, Sp, scale, o, ob, D);
            for (int r = 0; r < nrow; r++) memcpy(out + dst[r], ob + r * D, (size_t)D * sizeof(uint16_t));
        }
    }
    free(kt);
    free(vp);
    free(work);
    return 1;
#else
    (void)q; (void)k; (void)v; (void)B; (void)Hq; (void)Hkv; (void)L; (void)D; (void)scale; (void)out;
    return 0;
#endif
}
