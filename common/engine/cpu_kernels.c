/* Fused CPU kernels for the decoder's small ops (common/engine/kernels.py builds and loads them).
 *
 * A batch-1 decode step of a small model is ~2,000 torch ops, most of them tiny: their
 * dispatch, not their arithmetic, is the step (benchmarks/step_profile.py). These kernels do
 * in one call what the eager model does in 5-15: RMSNorm (and the residual add before it),
 * SiLU x up, RoPE plus the KV cache write, and decode attention read straight from the paged
 * cache (no gathered copy). The 4-bit matmuls stay torch's.
 *
 * Compiled on the machine that runs it (-march=native, cached by CPU flags) with
 * -ffp-contract=off so that float32 rounds as torch's eager ops do; OpenMP here is torch's own
 * runtime (libgomp is loaded by torch first), so the engine thread's team runs these too.
 * Work is split only across rows, heads and sequences, never inside a sum: a row's result does
 * not depend on what else is in the batch, which the cluster's token-for-token invariant needs.
 *
 * Every kernel exists for float32 (suffix _f32) and bfloat16 (_bf16): this file includes
 * itself once per type. bf16 is widened to float and rounded back to nearest-even, as c10.
 */
#ifndef KTYPE
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PAR_MIN 32768 /* multiply-adds below which a fork costs more than it saves */

static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded); /* a select, not a branch: vectorizes */
}

/* q . k over D, both float, as 16 lanes then a halving tree: gcc turns the tree into a few
 * vector shuffles and adds, where a plain sum (no -ffast-math) reduces lane by lane in order;
 * either way the order is fixed, so the result does not depend on the batch. */
static inline __attribute__((always_inline)) float dot_f(const float *q, const float *k,
                                                        const int64_t D) {
    if (D % 16) {
        float s = 0.0f;
        for (int64_t i = 0; i < D; i++) s += q[i] * k[i];
        return s;
    }
    float part[16];
    for (int i = 0; i < 16; i++) part[i] = q[i] * k[i];
    for (int64_t c = 16; c < D; c += 16)
        for (int i = 0; i < 16; i++) part[i] += q[c + i] * k[c + i];
    for (int i = 0; i < 8; i++) part[i] += part[i + 8];
    for (int i = 0; i < 4; i++) part[i] += part[i + 4];
    for (int i = 0; i < 2; i++) part[i] += part[i + 2];
    return part[0] + part[1];
}

/* exp(x) as Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial for e^r times
 * 2^n built in the exponent bits (within 2 ulp of expf). Plain arithmetic, so that loops over
 * it vectorize: glibc offers its vector expf to gcc only under -ffast-math, which would also
 * reorder the float32 sums that must round as torch's. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

#define KTYPE float
#define NAME(n) n##_f32
#define LD(x) (x)
#define ST(x) (x)
#include __FILE__
#undef KTYPE
#undef NAME
#undef LD
#undef ST

#define KTYPE uint16_t
#define NAME(n) n##_bf16
#define LD(x) bf16_load(x)
#define ST(x) bf16_store(x)
#include __FILE__

#else /* the kernels, once per KTYPE */

static inline void NAME(norm_row)(const KTYPE *x, const KTYPE *w, KTYPE *o, int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; j++) {
        float v = LD(x[j]);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t j = 0; j < n; j++) o[j] = ST(LD(x[j]) * r * LD(w[j]));
}

/* out = x * rsqrt(mean(x^2) + eps) * w, row by row: x, out (rows, n) */
void NAME(rms_norm)(const KTYPE *x, const KTYPE *w, KTYPE *out, int64_t rows, int64_t n,
                    float eps) {
#pragma omp parallel for if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) NAME(norm_row)(x + r * n, w, out + r * n, n, eps);
}

/* residual += delta (rounded to KTYPE, as an eager add), then out = rms_norm(residual) */
void NAME(add_rms_norm)(KTYPE *residual, const KTYPE *delta, const KTYPE *w, KTYPE *out,
                        int64_t rows, int64_t n, float eps) {
#pragma omp parallel for if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        KTYPE *h = residual + r * n;
        const KTYPE *d = delta + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) h[j] = ST(LD(h[j]) + LD(d[j]));
        NAME(norm_row)(h, w, out + r * n, n, eps);
    }
}

/* out = silu(gate) * up with gate_up (rows, 2 * inter); silu's result rounds as eager's */
void NAME(silu_mul)(const KTYPE *gate_up, KTYPE *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows * inter >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const KTYPE *g = gate_up + r * 2 * inter, *u = g + inter;
        KTYPE *o = out + r * inter;
#pragma omp simd
        for (int64_t j = 0; j < inter; j++) {
            float x = LD(g[j]);
            float s = LD(ST(x / (1.0f + exp_approx(-x))));
            o[j] = ST(s * LD(u[j]));
        }
    }
}

/* RoPE in place on the Q and K heads of each qkv row (T, (H + 2 KVH) * D), then K and V into
 * the cache at slots[t] (cache rows (slots, KVH, D)). cos and the signed sin are float32
 * tables (P, D); each product and the sum round as eager's x*cos + roll(x, D/2)*sin. */
void NAME(rope_write)(KTYPE *qkv, const float *cos_t, const float *sin_t, const int64_t *pos,
                      const int64_t *slots, KTYPE *k_cache, KTYPE *v_cache, int64_t T,
                      int64_t H, int64_t KVH, int64_t D) {
    int64_t row = (H + 2 * KVH) * D, half = D / 2;
#pragma omp parallel for if (T * row >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        KTYPE *x = qkv + t * row;
        const float *c = cos_t + pos[t] * D, *s = sin_t + pos[t] * D;
        KTYPE tmp[512];
        for (int64_t h = 0; h < H + KVH; h++) {
            KTYPE *xh = x + h * D;
            memcpy(tmp, xh, D * sizeof(KTYPE));
            for (int64_t i = 0; i < D; i++) { /* roll by D/2: i's partner is i +- D/2 */
                KTYPE partner = i < half ? tmp[i + half] : tmp[i - half];
                float a = LD(ST(LD(tmp[i]) * LD(ST(c[i]))));
                float b = LD(ST(LD(partner) * LD(ST(s[i]))));
                xh[i] = ST(a + b);
            }
        }
        memcpy(k_cache + slots[t] * KVH * D, x + H * D, KVH * D * sizeof(KTYPE));
        memcpy(v_cache + slots[t] * KVH * D, x + (H + KVH) * D, KVH * D * sizeof(KTYPE));
    }
}

/* A cached row as float: bf16 widened into `buf` (exact), float32 used where it lies. */
static inline __attribute__((always_inline)) const float *NAME(widen)(const KTYPE *x, float *buf,
                                                                     const int64_t D) {
    if (sizeof(KTYPE) == sizeof(float)) return (const float *)(const void *)x;
    for (int64_t i = 0; i < D; i++) buf[i] = LD(x[i]);
    return buf;
}

/* Asks for n cached rows (D elements each, row_stride apart) to be brought into cache. */
static inline __attribute__((always_inline)) void NAME(prefetch_rows)(const KTYPE *x, int64_t n,
                                                                     int64_t row_stride,
                                                                     const int64_t D) {
    for (int64_t j = 0; j < n; j++, x += row_stride)
        for (int64_t b = 0; b < D * (int64_t)sizeof(KTYPE); b += 64)
            __builtin_prefetch((const char *)x + b, 0, 3);
}

/* One sequence's G query heads (q: G * D contiguous) sharing KV head kh, over its first L
 * cached tokens: scores in p (G * L), output into out (G * D). Each K and V row is widened to
 * float once and used by all G heads (it was read and widened once per head: 16 sequences of
 * 320 tokens, bf16, measured in benchmarks/step_profile.py). Per head the arithmetic is what
 * it was, in the same order (dot_f's tree, then the softmax, then the weighted sum of V rows
 * token by token), so results are unchanged bit for bit and do not depend on the batch.
 * Always inlined where D and G are constants (64, 128; 3, 4, 8): the loops unroll and the
 * accumulators stay in registers. Positions go block by block (no division per token).
 * A step reads each layer's cache cold (the weights streamed since evicted it), so the next
 * K block and the current V block are prefetched while a block's scores run: 16 x 320 tokens
 * in bf16 from a cold cache, 627 -> ~320 us a layer (a Xeon with AMX; hot, 260 us either way). */
static inline __attribute__((always_inline)) void NAME(attend)(
    const KTYPE *q, const KTYPE *k_cache, const KTYPE *v_cache, const int64_t *table, int64_t L,
    int64_t KVH, int64_t kh, const int64_t D, const int64_t G, int64_t bs, float scale, float *p,
    KTYPE *out) {
    int64_t row_stride = KVH * D;
    float qf[G * D], wide[D], inv[G], acc[G * D];
    for (int64_t i = 0; i < G * D; i++) qf[i] = LD(q[i]);
    /* whole blocks: a block's bs rows are all in the cache tensor, and a prefetch never faults */
    NAME(prefetch_rows)(k_cache + (table[0] * bs * KVH + kh) * D, bs, row_stride, D);
    for (int64_t start = 0; start < L; start += bs) {
        int64_t n = L - start < bs ? L - start : bs;
        const KTYPE *k = k_cache + (table[start / bs] * bs * KVH + kh) * D;
        /* the next K block and this V block, on their way while this block's scores run */
        if (start + bs < L)
            NAME(prefetch_rows)(k_cache + (table[start / bs + 1] * bs * KVH + kh) * D, bs,
                                row_stride, D);
        NAME(prefetch_rows)(v_cache + (table[start / bs] * bs * KVH + kh) * D, bs, row_stride, D);
        for (int64_t j = 0; j < n; j++, k += row_stride) {
            const float *row = NAME(widen)(k, wide, D);
            for (int64_t g = 0; g < G; g++) p[g * L + start + j] = dot_f(qf + g * D, row, D) * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * L, mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (int64_t l = 0; l < L; l++) mx = pg[l] > mx ? pg[l] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < L; l++) {
            pg[l] = exp_approx(pg[l] - mx);
            sum += pg[l];
        }
        inv[g] = 1.0f / sum;
    }
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.0f;
    for (int64_t start = 0; start < L; start += bs) {
        int64_t n = L - start < bs ? L - start : bs;
        const KTYPE *v = v_cache + (table[start / bs] * bs * KVH + kh) * D;
        for (int64_t j = 0; j < n; j++, v += row_stride) {
            const float *row = NAME(widen)(v, wide, D);
            for (int64_t g = 0; g < G; g++) {
                float w = p[g * L + start + j], *a = acc + g * D;
#pragma omp simd
                for (int64_t i = 0; i < D; i++) a[i] += w * row[i];
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < D; i++) out[g * D + i] = ST(acc[g * D + i] * inv[g]);
}

/* One query token per sequence against its context in the paged cache, in float:
 * q rows of q_stride elements (B, H * D at the row's start); block_tables (B, nb); lens (B,);
 * out (B, H * D). Each (sequence, KV head) is one task: its G = H / KVH query heads share
 * every K and V row read. Returns 0, or -1 when the scores' buffer cannot be allocated. */
int NAME(decode_attention)(const KTYPE *q, int64_t q_stride, const KTYPE *k_cache,
                            const KTYPE *v_cache, const int64_t *block_tables, int64_t nb,
                            const int64_t *lens, KTYPE *out, int64_t B, int64_t H,
                            int64_t KVH, int64_t D, int64_t bs, float scale) {
    int64_t G = H / KVH, max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    int par = B * KVH * max_len * G * D >= PAR_MIN, teams = par ? omp_get_max_threads() : 1;
    float *scores = malloc(sizeof(float) * (size_t)(teams * G * max_len)); /* a row per thread */
    if (scores == NULL) return -1;
#pragma omp parallel if (par)
    {
        float *p = scores + (size_t)omp_get_thread_num() * (size_t)(G * max_len);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * KVH; task++) {
            int64_t b = task / KVH, kh = task % KVH;
            const KTYPE *qh = q + b * q_stride + kh * G * D;
            KTYPE *o = out + b * H * D + kh * G * D;
            const int64_t *table = block_tables + b * nb;
#define ATTEND(DC, GC) \
    NAME(attend)(qh, k_cache, v_cache, table, lens[b], KVH, kh, DC, GC, bs, scale, p, o)
            if (D == 64 && G == 3) ATTEND(64, 3);
            else if (D == 64 && G == 4) ATTEND(64, 4);
            else if (D == 64) ATTEND(64, G);
            else if (D == 128 && G == 4) ATTEND(128, 4);
            else if (D == 128 && G == 8) ATTEND(128, 8);
            else if (D == 128) ATTEND(128, G);
            else ATTEND(D, G);
#undef ATTEND
        }
    }
    free(scores);
    return 0;
}
#endif
