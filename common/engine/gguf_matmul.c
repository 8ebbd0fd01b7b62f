/* y = x @ W.T with W kept as GGUF's blocks (Q4_0, Q4_1, Q8_0) as shipped, or as float32
 * (F32), x float32.
 *
 * A decode step of a small model reads every weight once per step: in float32 that is 4 bytes
 * a weight, in these blocks 0.56-1.06. So where a CPU has no fast bf16 (an AVX2-only EPYC:
 * torch's 4-bit kernel then takes float activations ~9x slower than dense), these kernels
 * read the blocks and widen each to floats in registers, then multiply-add them with the
 * float activations. Built with cpu_kernels.c into one library (kernels.py).
 *
 * Blocks hold 32 weights of one row, `qs` byte j holding weight j (low nibble) and j + 16
 * (high nibble) for the 4-bit kinds:
 *   Q4_0  d: f16, qs: 16 bytes   w = (q - 8) * d
 *   Q4_1  d: f16, m: f16, qs     w = q * d + m
 *   Q8_0  d: f16, qs: 32 x int8  w = q * d
 *   F32   32 floats (128 bytes)  w = the float: a dense float32 matrix read in place
 * q * d is exact in float32 (4 or 8 bits times 11), so the widened weights equal gguf's own
 * dequantization bit for bit, whichever of fma or mul + add makes them.
 *
 * F32 is here for its sums, not its bytes: in float32, MKL's matmul gives a row other bits
 * when few rows share a call (a GEMV at one row, another path for the rows past a multiple
 * of 4 below 12), so a generated token's logits would depend on its batch. These loops give
 * every row the same operations at any batch (gguf_linear.py runs generated rows on them).
 *
 * Each output is a sum of K products kept in 16 lanes (lane l sums k = l mod 16) over the
 * blocks in order, then folded in a fixed tree: the same operations for a row whatever else
 * is in the batch (rows are split across threads, never a sum), as the cluster's
 * token-for-token invariant needs.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define QK 32
/* Bytes ahead of the block in hand to prefetch: the hardware prefetcher alone kept a thread
 * at ~2-3 GB/s on a Xeon's AVX2 path (7-10 ns a block against 3 in cache); with this, the
 * in-cache rate (512-2048 measured alike). A prefetch past the end does not fault. */
#define GG_PREFETCH 1024
#define GG_PAR_MIN 32768 /* multiply-adds below which a fork costs more than it saves */

enum { GG_Q4_0 = 0, GG_Q4_1 = 1, GG_Q8_0 = 2, GG_F32 = 3 };

static const int64_t gg_block_bytes[4] = {18, 20, 34, 128};

/* IEEE half to float, exact (subnormals included): one instruction with F16C (every AVX2
 * CPU has it) or on arm64 (fcvt, in the base ISA), else bit by bit; twice a block, as much
 * work as a block's FMAs without either. */
#if defined(__F16C__)
static inline float gg_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#elif defined(__aarch64__)
static inline float gg_half(const uint8_t *p) {
    __fp16 h; /* IEEE binary16 on AArch64 */
    memcpy(&h, p, 2);
    return (float)h;
}
#else
static inline float gg_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal half: man * 2^-24, exact in float */
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* Block b's 32 weights widened to float (the portable path; the AVX2 one widens in
 * registers the same way). */
static inline void gg_widen(const uint8_t *blk, int kind, float *w) {
    if (kind == GG_F32) {
        memcpy(w, blk, QK * sizeof(float));
        return;
    }
    const float d = gg_half(blk);
    if (kind == GG_Q8_0) {
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int j = 0; j < QK; j++) w[j] = (float)q[j] * d;
        return;
    }
    if (kind == GG_Q4_1) {
        const uint8_t *qs = blk + 4;
        const float m = gg_half(blk + 2);
        for (int j = 0; j < 16; j++) {
            w[j] = (float)(qs[j] & 0x0F) * d + m;
            w[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
        return;
    }
    /* no "+ 0": (8 - 8) * d is -0 where d < 0 (llama.cpp's Q4_0 scales take either sign), as
     * in gguf's dequantization and the SIMD paths; + 0 would make it +0 */
    const uint8_t *qs = blk + 2;
    for (int j = 0; j < 16; j++) {
        w[j] = (float)((qs[j] & 0x0F) - 8) * d;
        w[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
typedef struct {
    __m256 v[4];
} gg_w8x4;

static inline __attribute__((always_inline)) gg_w8x4 gg_widen_avx2(const uint8_t *blk,
                                                                  const int kind) {
    gg_w8x4 w;
    if (kind == GG_F32) {
        for (int c = 0; c < 4; c++) w.v[c] = _mm256_loadu_ps((const float *)blk + 8 * c);
        return w;
    }
    const __m256 d = _mm256_set1_ps(gg_half(blk));
    if (kind == GG_Q8_0) {
        const uint8_t *q = blk + 2;
        for (int c = 0; c < 4; c++) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(q + 8 * c));
            w.v[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d);
        }
        return w;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (kind == GG_Q4_1 ? 4 : 2)));
    const __m128i nib = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
    if (kind == GG_Q4_0) {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
        hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    if (kind == GG_Q4_1) {
        const __m256 m = _mm256_set1_ps(gg_half(blk + 2));
        for (int c = 0; c < 4; c++)  /* q * d is exact: the fma rounds as mul + add would */
            w.v[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c])), d, m);
    } else {
        for (int c = 0; c < 4; c++)
            w.v[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[c])), d);
    }
    return w;
}

static inline float gg_fold(__m256 a0, __m256 a1) {
    __m256 s = _mm256_add_ps(a0, a1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* Output n for R rows (1, 2 or 4): each block widened once for all of them. A row keeps two
 * accumulators (chunks 0 and 2 in one, 1 and 3 in the other): 2 x R of them and the block's
 * 4 vectors fit AVX2's 16 registers at R = 4. */
static inline __attribute__((always_inline)) void gg_tile(const uint8_t *wr, int64_t nb,
                                                         const int kind, const float *x,
                                                         int64_t K, float *y, int64_t N,
                                                         const int R) {
    const int64_t bs = gg_block_bytes[kind];
    __m256 a[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb; k++) {
        __builtin_prefetch(wr + k * bs + GG_PREFETCH);
        const gg_w8x4 w = gg_widen_avx2(wr + k * bs, kind);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *p = x + r * K + k * QK;
            a[r][0] = _mm256_fmadd_ps(w.v[0], _mm256_loadu_ps(p), a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w.v[1], _mm256_loadu_ps(p + 8), a[r][1]);
            a[r][0] = _mm256_fmadd_ps(w.v[2], _mm256_loadu_ps(p + 16), a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w.v[3], _mm256_loadu_ps(p + 24), a[r][1]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) y[r * N] = gg_fold(a[r][0], a[r][1]);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* NEON (every arm64 CPU): the same 16 lanes as four 4-lane accumulators a row (lane l sums
 * k = l mod 16, weights 4c..4c+3 of a block going to accumulator c mod 4), the same fused
 * multiply-adds in the same order and the same fold as the AVX2 path: the results are the
 * AVX2 path's bit for bit. 4 x 4 accumulators and a block's 8 weight vectors fit the 32
 * registers. */
typedef struct {
    float32x4_t v[8];
} gg_w4x8;

static inline __attribute__((always_inline)) void gg_s8_to_f32(int8x16_t q, float32x4_t d,
                                                              float32x4_t *w) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
    w[0] = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), d);
    w[1] = vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(lo)), d);
    w[2] = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), d);
    w[3] = vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(hi)), d);
}

static inline __attribute__((always_inline)) void gg_u8_to_f32(uint8x16_t q, float32x4_t d,
                                                              float32x4_t m, float32x4_t *w) {
    const uint16x8_t lo = vmovl_u8(vget_low_u8(q)), hi = vmovl_high_u8(q);
    /* q * d is exact: the fused multiply-add rounds as mul + add would */
    w[0] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), d);
    w[1] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_high_u16(lo)), d);
    w[2] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), d);
    w[3] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_high_u16(hi)), d);
}

static inline __attribute__((always_inline)) gg_w4x8 gg_widen_neon(const uint8_t *blk,
                                                                   const int kind) {
    gg_w4x8 w;
    if (kind == GG_F32) {
        for (int c = 0; c < 8; c++) w.v[c] = vld1q_f32((const float *)blk + 4 * c);
        return w;
    }
    const float32x4_t d = vdupq_n_f32(gg_half(blk));
    if (kind == GG_Q8_0) {
        gg_s8_to_f32(vld1q_s8((const int8_t *)(blk + 2)), d, w.v);
        gg_s8_to_f32(vld1q_s8((const int8_t *)(blk + 18)), d, w.v + 4);
        return w;
    }
    const uint8x16_t raw = vld1q_u8(blk + (kind == GG_Q4_1 ? 4 : 2));
    const uint8x16_t lo = vandq_u8(raw, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(raw, 4);
    if (kind == GG_Q4_1) {
        const float32x4_t m = vdupq_n_f32(gg_half(blk + 2));
        gg_u8_to_f32(lo, d, m, w.v);
        gg_u8_to_f32(hi, d, m, w.v + 4);
    } else {
        const int8x16_t eight = vdupq_n_s8(8);
        gg_s8_to_f32(vsubq_s8(vreinterpretq_s8_u8(lo), eight), d, w.v);
        gg_s8_to_f32(vsubq_s8(vreinterpretq_s8_u8(hi), eight), d, w.v + 4);
    }
    return w;
}

static inline __attribute__((always_inline)) void gg_tile(const uint8_t *wr, int64_t nb,
                                                         const int kind, const float *x,
                                                         int64_t K, float *y, int64_t N,
                                                         const int R) {
    const int64_t bs = gg_block_bytes[kind];
    float32x4_t a[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = vdupq_n_f32(0.0f);
    for (int64_t k = 0; k < nb; k++) {
        __builtin_prefetch(wr + k * bs + GG_PREFETCH);
        const gg_w4x8 w = gg_widen_neon(wr + k * bs, kind);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *p = x + r * K + k * QK;
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                a[r][c & 3] = vfmaq_f32(a[r][c & 3], w.v[c], vld1q_f32(p + 4 * c));
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) { /* lanes l + l+8, then + l+4, then the AVX2 fold's pairs */
        const float32x4_t s = vaddq_f32(vaddq_f32(a[r][0], a[r][2]), vaddq_f32(a[r][1], a[r][3]));
        const float32x2_t h = vadd_f32(vget_low_f32(s), vget_high_f32(s));
        y[r * N] = vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
    }
}
#else
/* The same sums in portable C: 16 lanes (a row's two 8-lane accumulators), the same fold. */
static inline void gg_tile(const uint8_t *wr, int64_t nb, const int kind, const float *x,
                           int64_t K, float *y, int64_t N, const int R) {
    const int64_t bs = gg_block_bytes[kind];
    float a[4][16] = {{0}}, w[QK];
    for (int64_t k = 0; k < nb; k++) {
        __builtin_prefetch(wr + k * bs + GG_PREFETCH);
        gg_widen(wr + k * bs, kind, w);
        for (int r = 0; r < R; r++) {
            const float *p = x + r * K + k * QK;
            for (int j = 0; j < 16; j++) a[r][j] += w[j] * p[j];
            for (int j = 0; j < 16; j++) a[r][j] += w[j + 16] * p[j + 16];
        }
    }
    for (int r = 0; r < R; r++) {
        for (int s = 8; s >= 1; s /= 2)
            for (int j = 0; j < s; j++) a[r][j] += a[r][j + s];
        y[r * N] = a[r][0];
    }
}
#endif

/* One loop per kind, the kind a literal inside the parallel region (which OpenMP outlines into
 * a function of its own, where a variable would reach the inner loop as a runtime value). */
#define GG_MATMUL(NAME, KIND)                                                                  \
    static void NAME(const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,     \
                     float *out) {                                                             \
        const int64_t nb = K / QK, row_bytes = nb * gg_block_bytes[KIND];                      \
        _Pragma("omp parallel for schedule(static) if (N * K * rows >= GG_PAR_MIN)")           \
        for (int64_t n = 0; n < N; n++) {                                                      \
            const uint8_t *wr = w + n * row_bytes;                                             \
            int64_t r = 0;                                                                     \
            for (; r + 4 <= rows; r += 4) gg_tile(wr, nb, KIND, x + r * K, K, out + r * N + n, N, 4); \
            if (r + 2 <= rows) {                                                               \
                gg_tile(wr, nb, KIND, x + r * K, K, out + r * N + n, N, 2);                    \
                r += 2;                                                                        \
            }                                                                                  \
            if (r < rows) gg_tile(wr, nb, KIND, x + r * K, K, out + r * N + n, N, 1);          \
        }                                                                                      \
    }
GG_MATMUL(gg_matmul_q4_0, GG_Q4_0)
GG_MATMUL(gg_matmul_q4_1, GG_Q4_1)
GG_MATMUL(gg_matmul_q8_0, GG_Q8_0)
GG_MATMUL(gg_matmul_f32w, GG_F32)

/* out (rows, N) = x (rows, K) @ W.T, W (N, K) as blocks of `kind`, K a multiple of 32.
 * Returns 0, or -1 for an unknown kind or a K the blocks cannot tile. */
int gguf_matmul_f32(const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                    int kind, float *out) {
    if (kind < 0 || kind > 3 || K % QK || rows < 0 || N < 0) return -1;
    switch (kind) {
        case GG_Q4_0: gg_matmul_q4_0(x, rows, K, w, N, out); break;
        case GG_Q4_1: gg_matmul_q4_1(x, rows, K, w, N, out); break;
        case GG_Q8_0: gg_matmul_q8_0(x, rows, K, w, N, out); break;
        default: gg_matmul_f32w(x, rows, K, w, N, out); break;
    }
    return 0;
}

/* W's rows widened to float (N, K): the reference the tests hold the kernel to, and a GGUF
 * model's weights at load (loader.py; rows split across the caller's threads). */
void gguf_dequantize_f32(const uint8_t *w, int64_t N, int64_t K, int kind, float *out) {
    const int64_t nb = K / QK, bs = gg_block_bytes[kind];
#pragma omp parallel for schedule(static) if (N * K >= 64 * GG_PAR_MIN)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < nb; k++) gg_widen(w + (n * nb + k) * bs, kind, out + n * K + k * QK);
}

/* Which of the sums above this build runs (tests/unit/test_gguf_targets.py). */
const char *gguf_matmul_path(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return "neon";
#else
    return "portable";
#endif
}
