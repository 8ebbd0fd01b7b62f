/* A check of gguf_matmul.c on any target (tests/unit/test_gguf_targets.py runs it natively
 * and, cross-compiled, under qemu-aarch64 for arm64's NEON path).
 *
 * stdin: int32 kind, int64 N, K, rows, then N x K/32 blocks, then rows x K float32.
 * stdout: the compiled path's name (8 bytes, space padded), then float32 arrays:
 *   the kernel on all rows (rows x N), each row alone (rows x N), a scalar emulation of the
 *   SIMD paths' sums (16 lanes, fmaf in block order, the same fold; rows x N), and the
 *   widened weights (N x K).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int gguf_matmul_f32(const float *x, int64_t rows, int64_t K, const uint8_t *w, int64_t N,
                    int kind, float *out);
void gguf_dequantize_f32(const uint8_t *w, int64_t N, int64_t K, int kind, float *out);
const char *gguf_matmul_path(void);

static void take(void *p, size_t n) {
    if (fread(p, 1, n, stdin) != n) exit(2);
}

static void put(const void *p, size_t n) {
    if (fwrite(p, 1, n, stdout) != n) exit(3);
}

int main(void) {
    static const int64_t block_bytes[4] = {18, 20, 34, 128}; /* Q4_0, Q4_1, Q8_0, F32 */
    int32_t kind;
    int64_t N, K, rows;
    take(&kind, 4), take(&N, 8), take(&K, 8), take(&rows, 8);
    if (kind < 0 || kind > 3 || N <= 0 || K <= 0 || K % 32 || rows <= 0) return 4;
    const size_t wbytes = (size_t)(N * (K / 32) * block_bytes[kind]);
    uint8_t *w = malloc(wbytes);
    float *x = malloc(sizeof(float) * rows * K), *out = malloc(sizeof(float) * rows * N);
    float *deq = malloc(sizeof(float) * N * K);
    take(w, wbytes), take(x, sizeof(float) * rows * K);
    char name[9];
    snprintf(name, sizeof name, "%-8s", gguf_matmul_path());
    put(name, 8);
    if (gguf_matmul_f32(x, rows, K, w, N, kind, out)) return 5;
    put(out, sizeof(float) * rows * N);
    for (int64_t r = 0; r < rows; r++)
        if (gguf_matmul_f32(x + r * K, 1, K, w, N, kind, out + r * N)) return 5;
    put(out, sizeof(float) * rows * N);
    gguf_dequantize_f32(w, N, K, kind, deq);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = 0; n < N; n++) {
            float a[16] = {0};
            for (int64_t k = 0; k < K; k++)
                a[k % 16] = fmaf(deq[n * K + k], x[r * K + k], a[k % 16]);
            for (int s = 8; s >= 1; s /= 2)
                for (int j = 0; j < s; j++) a[j] += a[j + s];
            out[r * N + n] = a[0];
        }
    put(out, sizeof(float) * rows * N);
    put(deq, sizeof(float) * N * K);
    return 0;
}
