// A whole decode step of a MoE model in one native call (moeq.nn.engine): token embedding, every decoder layer
// (decode.c's parts, with this step's keys and values written into static caches in place and the softmax top-k
// router in C), final norm and output head — transformers' bf16 rounding at every step, as the per-layer calls.
#include "moeq.h"

// The softmax top-k router of one token: idx/wt [A] from bf16 logits [E] (fp32 softmax, the top A by probability,
// renormalized and rounded to bf16 as the layer asks). Returns 0 where the choice depends on a tie order — the A-th
// and (A+1)-th largest logits equal — or a logit is NaN: the caller then routes with the router's own top-k (torch's
// order). Ties within the top A need no care: the MoE kernels sum the experts in expert order, not in this one.
static int route(const moeq_layer* Ly, const uint16_t* logits, i64* idx, float* wt) {
    const i64 E = Ly->E, A = Ly->topk;
    float mx = -INFINITY;
    for (i64 e = 0; e < E; e++) {
        const float v = bf2f(logits[e]);
        if (v != v) return 0;
        mx = v > mx ? v : mx;
    }
    float sum = 0.f;
    for (i64 e = 0; e < E; e++) sum += expf(bf2f(logits[e]) - mx);
    const i64 n = A + 1 < E ? A + 1 : E;
    i64 top[65];
    if (n > 65) return 0;
    for (i64 j = 0; j < n; j++) {  // selection: the largest not yet taken, lowest index first
        i64 best = -1;
        for (i64 e = 0; e < E; e++) {
            int taken = 0;
            for (i64 t = 0; t < j; t++) taken |= top[t] == e;
            if (!taken && (best < 0 || bf2f(logits[e]) > bf2f(logits[best]))) best = e;
        }
        top[j] = best;
        if (j == A && bf2f(logits[best]) == bf2f(logits[top[j - 1]])) return 0;
    }
    float tot = 0.f;
    for (i64 j = 0; j < A; j++) {
        idx[j] = top[j];
        wt[j] = expf(bf2f(logits[top[j]]) - mx) / sum;
        tot += wt[j];
    }
    for (i64 j = 0; j < A; j++) {
        if (Ly->renorm) wt[j] /= tot;
        if (Ly->cast) wt[j] = bf2f(f2bf(wt[j]));
    }
    return 1;
}

// One decode step for B <= M->B sequences: token tok[b] at RoPE position pos[b] (< P) and cache slot S - 1 (S <= Sc),
// mask additive fp32 [B, Sc] or NULL. state: bf16 [B, 3H + E] the caller keeps between calls (the hidden stream, the
// attention residual, the normalized input of the experts, router logits). Writes logits [B, V] and returns -1; or
// returns layer l >= 0, its router logits in state + 3BH, where the routing needs the caller (a tie, NaN): the caller
// calls again with l0 = l and its idx0 / wt0 [B, topk] to finish the step. Returns -2 (nothing usable) for a token
// or position out of range, or when a buffer cannot be had.
i64 moeq_decode_step(const moeq_model* M, i64 B, const i64* tok, const i64* pos, i64 S, const float* mask, i64 l0,
                     const i64* idx0, const float* wt0, uint16_t* state, uint16_t* logits) {
    const i64 H = M->H;
    if (B < 1 || B > M->B || B > MOEQ_STEP_ROWS || S < 1 || S > M->Sc || l0 < 0 || l0 >= M->L) return -2;
    const i64 D = M->layers[0].D;
    uint16_t *x = state, *r1 = x + B * H, *n2 = r1 + B * H, *rl = n2 + B * H;
    i64 maxq = 0, maxkv = 0, maxa = 0;
    for (i64 l = 0; l < M->L; l++) {
        const moeq_layer* Ly = &M->layers[l];
        maxq = Ly->Hq > maxq ? Ly->Hq : maxq;
        maxkv = Ly->Hkv > maxkv ? Ly->Hkv : maxkv;
        maxa = Ly->topk > maxa ? Ly->topk : maxa;
    }
    uint16_t* buf = (uint16_t*)malloc((size_t)(B * (maxq + 2 * maxkv) * D + 2 * B * D + B * H) * sizeof(uint16_t));
    i64* idx = (i64*)malloc((size_t)(B * maxa) * sizeof(i64));
    float* wt = (float*)malloc((size_t)(B * maxa) * sizeof(float));
    i64 ret = -2;
    if (!buf || !idx || !wt) goto done;
    uint16_t *q = buf, *k = q + B * maxq * D, *v = k + B * maxkv * D, *cs = v + B * maxkv * D, *sn = cs + B * D;
    uint16_t* h = sn + B * D;
    for (i64 b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= M->P) goto done;
        memcpy(cs + b * D, M->cos + pos[b] * D, (size_t)D * sizeof(uint16_t));
        memcpy(sn + b * D, M->sin + pos[b] * D, (size_t)D * sizeof(uint16_t));
    }
    if (!idx0) {
        if (l0 != 0) goto done;
        for (i64 b = 0; b < B; b++) {
            if (tok[b] < 0 || tok[b] >= M->vocab) goto done;
            memcpy(x + b * H, M->embed + tok[b] * H, (size_t)H * sizeof(uint16_t));
        }
    }
    for (i64 l = l0; l < M->L; l++) {
        const moeq_layer* Ly = &M->layers[l];
        const i64* ri = idx;
        const float* rw = wt;
        if (idx0 && l == l0) {
            ri = idx0, rw = wt0;
        } else {
            moeq_layer_pre(Ly, x, B, cs, sn, q, k, v);
            for (i64 b = 0; b < B; b++)
                for (i64 j = 0; j < Ly->Hkv; j++) {
                    const i64 at = ((b * Ly->Hkv + j) * M->Sc + S - 1) * D;
                    memcpy(M->kc[l] + at, k + (b * Ly->Hkv + j) * D, (size_t)D * sizeof(uint16_t));
                    memcpy(M->vc[l] + at, v + (b * Ly->Hkv + j) * D, (size_t)D * sizeof(uint16_t));
                }
            if (moeq_layer_attn_cached(Ly, x, B, q, M->kc[l], M->vc[l], S, M->Sc, mask, r1, n2, rl)) goto done;
            int ok = 1;
            for (i64 b = 0; b < B && ok; b++) ok = route(Ly, rl + b * Ly->E, idx + b * Ly->topk, wt + b * Ly->topk);
            if (!ok) {
                ret = l;
                goto done;
            }
        }
        if (moeq_layer_moe(Ly, r1, n2, B, ri, rw, NULL, x)) goto done;
    }
    moeq_rmsnorm_bf16(x, M->norm, B, H, M->eps, h);
    if (M->head12) {
        if (!moeq_bf12_matmul(M->head12, h, B, logits)) goto done;
    } else if (M->head) {
        if (!moeq_bf16_gemv(h, B, M->head, M->V, H, logits)) goto done;
    } else {
        moeq_quant_linear_bf16(&M->hq, h, B, NULL, logits, M->head_scratch);
    }
    ret = -1;
done:
    free(buf);
    free(idx);
    free(wt);
    return ret;
}

// out[b] = the first index of the largest of x[b, :V] (bf16; NaN counts as largest, as torch.argmax), skipping the
// nban ids in ban (a generation's suppressed end-of-sequence ids); -1 when every id is banned.
void moeq_argmax_bf16(const uint16_t* x, i64 B, i64 V, const i64* ban, i64 nban, i64* out) {
    for (i64 b = 0; b < B; b++) {
        const uint16_t* r = x + b * V;
        i64 best = -1;
        float bv = 0.f;
        for (i64 i = 0; i < V; i++) {
            int skip = 0;
            for (i64 j = 0; j < nban; j++) skip |= ban[j] == i;
            if (skip) continue;
            const float v = bf2f(r[i]);
            if (best < 0 || (v != v && bv == bv) || v > bv) best = i, bv = v;
            if (v != v) break;
        }
        out[b] = best;
    }
}
