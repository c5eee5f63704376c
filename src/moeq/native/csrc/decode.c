// Decode-step helpers for bf16 models: RMSNorm, RoPE and single-query attention, each reproducing transformers'
// own bf16 rounding.
#include "moeq.h"

// ---------------------------------------------------------------- decode-step helpers ---------------------------
// transformers' bf16 RMSNorm: y = w * bf16(x * rsqrt(mean(x^2) + eps)), the mean and the product in fp32, the
// normalized value rounded to bf16 before the (rounded) product with the weight. x, w, y bf16 bits; rows of n.
// A row whose sum of squares overflows fp32 (values past ~1e19: a checkpoint's scales multiplying past range) gives
// NaN, not the zeros 1/sqrt(inf) would: the step's logits check then names the overflow instead of the model going
// on with a silently zeroed row.
void moeq_rmsnorm_bf16(const uint16_t* x, const uint16_t* w, i64 rows, i64 n, float eps, uint16_t* y) {
    for (i64 r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * n;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (i64 k = 0; k < n; k++) ss += bf2f(xr[k]) * bf2f(xr[k]);
        const float inv = isfinite(ss) ? 1.f / sqrtf(ss / (float)n + eps) : NAN;
        uint16_t* yr = y + r * n;
        for (i64 k = 0; k < n; k++) yr[k] = f2bf(bf2f(w[k]) * bf2f(f2bf(bf2f(xr[k]) * inv)));
    }
}

// One query token of grouped-query attention over a bf16 KV cache, in fp32 (a product of two bf16 values is exact in
// fp32): out[b, h] = softmax(scale q[b, h] . K[b, h / g] + mask[b]) V[b, h / g], g = Hq / Hkv. q [B, Hq, D],
// k/v [B, Hkv, S, D], mask additive fp32 [B, S] or NULL, out [B, Hq, D] bf16. A row masked everywhere gives NaN,
// as softmax does.
// Sc >= S: the caches' capacity (rows of k/v per head and of mask per sequence), S of them in use.
static void attn_decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* mask, i64 B, i64 Hq,
                        i64 Hkv, i64 S, i64 Sc, i64 D, float scale, uint16_t* out) {
    const i64 g = Hq / Hkv;
#pragma omp parallel
    {
        float* p = (float*)malloc((size_t)(S + 2 * D) * sizeof(float));
        float* qf = p + S;
        float* acc = qf + D;
#pragma omp for schedule(static)
        for (i64 t = 0; t < B * Hq; t++) {
            const i64 b = t / Hq, kh = (t % Hq) / g;
            const uint16_t* kb = k + (b * Hkv + kh) * Sc * D;
            const uint16_t* vb = v + (b * Hkv + kh) * Sc * D;
            for (i64 d = 0; d < D; d++) qf[d] = bf2f(q[t * D + d]);
            float mx = -INFINITY;
            for (i64 s = 0; s < S; s++) {
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (i64 d = 0; d < D; d++) dot += qf[d] * bf2f(kb[s * D + d]);
                const float sc = dot * scale + (mask ? mask[b * Sc + s] : 0.f);
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

void moeq_attn_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* mask, i64 B, i64 Hq,
                           i64 Hkv, i64 S, i64 D, float scale, uint16_t* out) {
    attn_decode(q, k, v, mask, B, Hq, Hkv, S, S, D, scale, out);
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


// ---------------------------------------------------------------- one decoder layer ------------------------------
// A Llama-style MoE decoder layer's decode step (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE: RMSNorms, q/k/v/o quantized
// linears with optional biases, optional q/k RMSNorms per head or over the projection, RoPE, softmax top-k router,
// SiLU-GLU experts) in three native calls — around the caller's cache update and its router top-k —, composing the
// kernels above and in moe.c with the rounding of transformers' bf16 forward at every step (each module output
// rounded to bf16; residual sums in fp32, rounded). B rows of one token each, B <= MOEQ_STEP_ROWS.

void moeq_qlinear_bf16(const moeq_wstack* w, const uint16_t* x, i64 B, const uint16_t* bias, uint16_t* y) {
    const i64 K = w->K, N = w->N;
    const i64 n = B * (K + N + 2 * K + K / 16 + 1) + N * K / 32 + 64;  // moeq_quant_linear_bf16's scratch
    float* s = (float*)malloc((size_t)n * sizeof(float));
    if (!s) return;
    moeq_quant_linear_bf16(w, x, B, bias, y, s);
    free(s);
}

// q [B, Hq, D], k/v [B, Hkv, D] (bf16) for the caller's cache, from hidden x [B, H].
void moeq_layer_pre(const moeq_layer* L, const uint16_t* x, i64 B, const uint16_t* cos, const uint16_t* sin,
                    uint16_t* q, uint16_t* k, uint16_t* v) {
    const i64 H = L->H, D = L->D;
    uint16_t* h = (uint16_t*)malloc((size_t)(B * H) * sizeof(uint16_t));
    if (!h) return;
    moeq_rmsnorm_bf16(x, L->ln1, B, H, L->eps1, h);
    moeq_qlinear_bf16(&L->q, h, B, L->bq, q);
    moeq_qlinear_bf16(&L->k, h, B, L->bk, k);
    moeq_qlinear_bf16(&L->v, h, B, L->bv, v);
    if (L->qn) {  // in place, row by row: per head, or over each token's whole projection
        moeq_rmsnorm_bf16(q, L->qn, L->qk_full ? B : B * L->Hq, L->qk_full ? L->Hq * D : D, L->eps_qk, q);
        moeq_rmsnorm_bf16(k, L->kn, L->qk_full ? B : B * L->Hkv, L->qk_full ? L->Hkv * D : D, L->eps_qk, k);
    }
    moeq_rope_bf16(q, B, L->Hq, D, cos, sin);
    moeq_rope_bf16(k, B, L->Hkv, D, cos, sin);
    free(h);
}

static void add_bf16(const uint16_t* a, const uint16_t* b, i64 n, uint16_t* y) {
    for (i64 i = 0; i < n; i++) y[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
}

// After the cache update: attention over the cache's keys/values [B, Hkv, S, D] (this step's included; mask additive
// fp32 [B, S] or NULL), o projection and residual: r1 [B, H] = x + o; n2 = the post-attention norm of r1; logits
// [B, E] = the router's (bf16). The caller takes the top-k of their softmax as the router module does (torch's own
// tie order), then moeq_layer_moe. Returns 1 (nothing written) when a buffer cannot be had or H % 32 != 0.
int moeq_layer_attn(const moeq_layer* L, const uint16_t* x, i64 B, const uint16_t* q, const uint16_t* keys,
                    const uint16_t* vals, i64 S, const float* mask, uint16_t* r1, uint16_t* n2, uint16_t* logits) {
    return moeq_layer_attn_cached(L, x, B, q, keys, vals, S, S, mask, r1, n2, logits);
}

// moeq_layer_attn over caches of capacity Sc >= S (keys/values [B, Hkv, Sc, D], mask [B, Sc]).
int moeq_layer_attn_cached(const moeq_layer* L, const uint16_t* x, i64 B, const uint16_t* q, const uint16_t* keys,
                           const uint16_t* vals, i64 S, i64 Sc, const float* mask, uint16_t* r1, uint16_t* n2,
                           uint16_t* logits) {
    const i64 H = L->H, D = L->D;
    uint16_t* ao = (uint16_t*)malloc((size_t)(B * L->Hq * D + B * H) * sizeof(uint16_t));
    if (!ao) return 1;
    uint16_t* o = ao + B * L->Hq * D;
    attn_decode(q, keys, vals, mask, B, L->Hq, L->Hkv, S, Sc, D, L->scale, ao);
    moeq_qlinear_bf16(&L->o, ao, B, L->bo, o);
    add_bf16(x, o, B * H, r1);
    moeq_rmsnorm_bf16(r1, L->ln2, B, H, L->eps2, n2);
    const int ok = moeq_bf16_gemv(n2, B, L->router, L->E, H, logits);
    free(ao);
    return !ok;
}

// The experts for the routing idx/wt [B, A] (weights as the router returns them, in fp32) and the second residual:
// out [B, H] = r1 + bf16(experts(n2)) [+ extra: bf16(bf16(experts) + extra), the gated shared expert of Qwen2-MoE].
// Returns 1 (out untouched) when the MoE kernel declines (an expert index out of range, more than MOEQ_ROUTED_ROWS
// rows) or a buffer cannot be had.
int moeq_layer_moe(const moeq_layer* L, const uint16_t* r1, const uint16_t* n2, i64 B, const i64* idx,
                   const float* wt, const uint16_t* extra, uint16_t* out) {
    const i64 H = L->H, E = L->E, A = L->topk, I = L->w2.K;
    const i64 P = B * A, act = P < E ? P : E, hd = H > I ? H : I, nd = 2 * I > H ? 2 * I : H;
    const i64 moe_scratch = act * 8 * (H / 2 + H / 16 + 2 * I + I / 2 + I / 16 + H) + 8 * H * 2 + 8 * 3 * I +
                            2 * 8 * hd + 8 * (hd / 16 + 1) + nd * hd / 32 + 128;
    float* f = (float*)malloc((size_t)(2 * B * H + moe_scratch) * sizeof(float));
    if (!f) return 1;
    float* xf = f;
    float* mo = xf + B * H;
    for (i64 i = 0; i < B * H; i++) {
        xf[i] = bf2f(n2[i]);
        mo[i] = 0.f;
    }
    const int declined = moeq_moe_routed(&L->w13, &L->w2, xf, H, I, idx, wt, B, A, E, mo, mo + B * H);
    if (!declined)
        for (i64 i = 0; i < B * H; i++) {
            float m = bf2f(f2bf(mo[i]));
            if (extra) m = bf2f(f2bf(m + bf2f(extra[i])));
            out[i] = f2bf(bf2f(r1[i]) + m);
        }
    free(f);
    return declined;
}
