/* The 8-bit vocabulary table's GEMM (vllm_methods/cpu_int8_table.py, kernel `native`): out bf16 [M][N] =
 * x [M][K] @ (codes [N][K] * scale[N])^T on the table's own rows (formats/int8_rows.py, codes in [-127, 127]),
 * no packed copy, so the lookup and the head read one table.
 *
 * For CPUs without integer dot products (AVX2 before AVX-VNNI, Skylake-SP), where oneDNN's int8 GEMM saturates
 * and crawls and PyTorch's _weight_int8pack_mm converts every code to fp32. The activations are quantized to
 * int8 per row and 32-K block, as int4_gemm_q8 does (quantize_activations); a block's 32 products sum in
 * integers: vpmaddubsw needs one unsigned operand, so |x| meets w carrying x's sign (vpsignb), the form ggml's
 * Q8_0 dot product uses; a pair sums to at most 2 x 127 x 127, within int16, and vpmaddwd widens it. Each block
 * is scaled by its d in fp32, each channel by its scale once. Eight channels at a time, every row against them
 * while their rows of codes (8 K bytes) stay in L1: the table is read from memory once per call.
 * Without AVX2 a portable loop computes the same sums.
 */
#include "bf16.h"
#include "int4_kernels.h"

#include <cstdint>
#include <cstdlib>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace spark_edge {
namespace {

constexpr int64_t BLOCK = 32;   /* activation quantization block along K (quantize_activations) */
constexpr int64_t CHANNELS = 8; /* channels a pass: 8 fp32 accumulators of 16 ymm */

/* out[r][c0 + j] for channels c0 .. c0 + count of every row, in plain C++ (tails, builds without AVX2). */
void channels_portable(const int8_t *xq, const float *d, int64_t m, int64_t k, const int8_t *codes,
                       const float *scale, int64_t n, int64_t c0, int64_t count, uint16_t *out) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = c0; c < c0 + count; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < k / BLOCK; b++) {
                int32_t dot = 0;
                for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; i++) dot += (int32_t)xq[r * k + i] * codes[c * k + i];
                acc += d[r * (k / BLOCK) + b] * (float)dot;
            }
            out[r * n + c] = float_to_bf16(acc * scale[c]);
        }
}

#ifdef __AVX2__
/* The eight channel totals of eight accumulators, in channel order. */
inline __m256 totals(const __m256 acc[CHANNELS]) {
    const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* lanes: low and high halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

void channels8_avx2(const int8_t *xq, const float *d, int64_t m, int64_t k, const int8_t *codes, const float *scale,
                    int64_t n, int64_t c0, uint16_t *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 s = _mm256_loadu_ps(scale + c0);
    const int8_t *w = codes + c0 * k;
    for (int64_t r = 0; r < m; r++) {
        __m256 acc[CHANNELS];
        for (int c = 0; c < CHANNELS; c++) acc[c] = _mm256_setzero_ps();
        const int8_t *x = xq + r * k;
        const float *dr = d + r * (k / BLOCK);
        for (int64_t b = 0; b < k / BLOCK; b++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + b * BLOCK));
            const __m256i ax = _mm256_sign_epi8(xv, xv);
            const __m256 db = _mm256_set1_ps(dr[b]);
            for (int c = 0; c < CHANNELS; c++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + c * k + b * BLOCK));
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv)), ones);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), db, acc[c]);
            }
        }
        alignas(32) float t[CHANNELS];
        _mm256_store_ps(t, _mm256_mul_ps(totals(acc), s));
        for (int c = 0; c < CHANNELS; c++) out[r * n + c0 + c] = float_to_bf16(t[c]);
    }
}
#endif

}  // namespace

bool int8_rows_gemm_vectorized() {
#ifdef __AVX2__
    return true;
#else
    return false;
#endif
}

bool int8_rows_gemm(const uint16_t *x, int64_t m, const int8_t *codes, const float *scale, uint16_t *out, int64_t n,
                    int64_t k) {
    if (k % BLOCK) return false;
    void *scratch = malloc((size_t)(m * k) + sizeof(float) * (size_t)(m * (k / BLOCK)));
    if (!scratch) return false;
    float *d = (float *)scratch;
    int8_t *xq = (int8_t *)(d + m * (k / BLOCK));
    quantize_activations(x, m, k, xq, d);
    const int64_t full = n / CHANNELS;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < full; p++) {
#ifdef __AVX2__
        channels8_avx2(xq, d, m, k, codes, scale, n, p * CHANNELS, out);
#else
        channels_portable(xq, d, m, k, codes, scale, n, p * CHANNELS, CHANNELS, out);
#endif
    }
    channels_portable(xq, d, m, k, codes, scale, n, full * CHANNELS, n - full * CHANNELS, out);
    free(scratch);
    return true;
}

}  // namespace spark_edge
