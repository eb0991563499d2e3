/* int4_gemm_q8 on ATen's AVX2 layout, with AVX2 instructions only: 32-channel blocks whose byte d of a 16-byte
 * K step holds channel d in its low nibble and channel d + 16 in its high nibble.
 *
 * The arithmetic is int4_gemm_q8.cpp's pairs form at half the width. One ymm holds K steps (k, k+1) of a
 * block, a second (k+2, k+3); unpacking them byte by byte (vpunpck{l,h}bw, within each 128-bit lane) leaves
 * each channel's codes of steps (k, k+2) as adjacent bytes of the low lane and those of (k+1, k+3) in the
 * high lane, against activation pairs broadcast the same way. vpmaddubsw multiplies and adds the pairs into
 * int16 over one 32-K block (at most 8 x 2 x 15 x 127 = 30480, no overflow); then the two lanes are widened
 * and added, scaled by the block's d in fp32, and the group's scale and zero applied once per group.
 *
 * Compiled wherever the compiler targets AVX2, AVX-512 hosts included, so every x86 host checks it on
 * buffers packed in this layout (an AVX-512 host's ATen packs the 64-channel one).
 */
#include "bf16.h"
#include "int4_kernels.h"
#include "int4_q8_common.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QROWS_AVX2 2 /* rows per pass over a block's weights: 2 x (4 int16 + 4 fp32) accumulators of 16 ymm */

namespace spark_edge {

#ifdef __AVX2__
/* Per row, per K quad j: the 32 activation bytes vpmaddubsw meets after the unpack, the pair (xq[4j], xq[4j+2])
 * in every 16-bit word of the low lane and (xq[4j+1], xq[4j+3]) in the high lane. */
static void activation_pairs(const int8_t *xq, int64_t m, int64_t k, __m256i *pairs) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k / 4; j++) {
            const int8_t *q = xq + r * k + 4 * j;
            const short even = (short)(uint16_t)((uint8_t)q[0] | (uint16_t)(uint8_t)q[2] << 8);
            const short odd = (short)(uint16_t)((uint8_t)q[1] | (uint16_t)(uint8_t)q[3] << 8);
            pairs[r * (k / 4) + j] = _mm256_set_m128i(_mm_set1_epi16(odd), _mm_set1_epi16(even));
        }
}

/* One 32-channel block, ROWS_ rows, over all K: into tot [ROWS_][32] fp32, channels in natural order. */
template <int ROWS_>
static void block_rows(const __m256i *act, const float *d, const float *xsum, int64_t k, int64_t group,
                       const uint8_t *wb, const uint32_t *sz32, int64_t n, int64_t ch0, float *tot) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), high16 = _mm256_set1_epi32((int)0xffff0000u);
    const __m256 eight = _mm256_set1_ps(8.0f);
    const int64_t groups = k / group, quads = k / 4, qblocks = k / Q8_BLOCK;
    __m256 facc[ROWS_][4];
    for (int r = 0; r < ROWS_; r++)
        for (int i = 0; i < 4; i++) facc[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < qblocks; b++) {
        __m256i acc[ROWS_][4];
        for (int r = 0; r < ROWS_; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_si256();
        for (int64_t j = b * (Q8_BLOCK / 4); j < (b + 1) * (Q8_BLOCK / 4); j++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(wb + j * 64));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(wb + j * 64 + 32));
            const __m256i plo = _mm256_unpacklo_epi8(a, c), phi = _mm256_unpackhi_epi8(a, c);
            /* channels 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles) */
            const __m256i w[4] = {_mm256_and_si256(plo, low4), _mm256_and_si256(phi, low4),
                                  _mm256_and_si256(_mm256_srli_epi16(plo, 4), low4),
                                  _mm256_and_si256(_mm256_srli_epi16(phi, 4), low4)};
            for (int r = 0; r < ROWS_; r++) {
                const __m256i xv = _mm256_load_si256(act + r * quads + j);
                for (int i = 0; i < 4; i++) acc[r][i] = _mm256_add_epi16(acc[r][i], _mm256_maddubs_epi16(w[i], xv));
            }
        }
        for (int r = 0; r < ROWS_; r++) {
            const __m256 db = _mm256_set1_ps(d[r * qblocks + b]);
            for (int i = 0; i < 4; i++) {
                const __m256i sum = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[r][i])),
                                                     _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[r][i], 1)));
                facc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), db, facc[r][i]);
            }
        }
        if ((b + 1) * Q8_BLOCK % group) continue;
        /* a group ends: tot += s * facc + (z - 8 s) * the group's activation sum, scale and zero read once */
        const int64_t g = (b + 1) * Q8_BLOCK / group - 1;
        if (g + 1 < groups)
            for (int line = 0; line < 2; line++)
                _mm_prefetch((const char *)(sz32 + (g + 1) * n + ch0) + line * 64, _MM_HINT_T0);
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(sz32 + g * n + ch0 + 8 * i));
            const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 z = _mm256_fnmadd_ps(eight, s, _mm256_castsi256_ps(_mm256_and_si256(v, high16)));
            for (int r = 0; r < ROWS_; r++) {
                const __m256 t = _mm256_loadu_ps(tot + r * 32 + 8 * i);
                const __m256 xs = _mm256_set1_ps(xsum[r * groups + g]);
                _mm256_storeu_ps(tot + r * 32 + 8 * i, _mm256_fmadd_ps(z, xs, _mm256_fmadd_ps(s, facc[r][i], t)));
                facc[r][i] = _mm256_setzero_ps();
            }
        }
    }
}

static void block_all_rows(const __m256i *act, const float *d, const float *xsum, int64_t m, int64_t k,
                           int64_t group, const uint8_t *buf, const uint32_t *sz32, int64_t n, int64_t blk,
                           uint16_t *out) {
    const int64_t groups = k / group, qblocks = k / Q8_BLOCK, ch0 = blk * 32, quads = k / 4;
    const uint8_t *wb = buf + blk * 32 * (k / 2);
    alignas(32) float tot[QROWS_AVX2 * 32];
    for (int64_t r0 = 0; r0 < m; r0 += QROWS_AVX2) {
        const int rows = m - r0 < QROWS_AVX2 ? (int)(m - r0) : QROWS_AVX2;
        memset(tot, 0, sizeof tot);
        const __m256i *a = act + r0 * quads;
        const float *dr = d + r0 * qblocks, *xs = xsum + r0 * groups;
        if (rows == 1)
            block_rows<1>(a, dr, xs, k, group, wb, sz32, n, ch0, tot);
        else
            block_rows<QROWS_AVX2>(a, dr, xs, k, group, wb, sz32, n, ch0, tot);
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 32; c++) out[(r0 + r) * n + ch0 + c] = float_to_bf16(tot[r * 32 + c]);
    }
}
#endif

bool int4_gemm_q8_avx2_built() {
#ifdef __AVX2__
    return true;
#else
    return false;
#endif
}

bool int4_gemm_q8_avx2(const Q8Activations &q, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n) {
#ifdef __AVX2__
    const int64_t m = q.m, k = q.k;
    __m256i *pairs = (__m256i *)aligned_alloc(32, sizeof(__m256i) * (size_t)(m * (k / 4)));
    if (!pairs) return false;
    activation_pairs(q.xq, m, k, pairs);
    const uint32_t *sz32 = (const uint32_t *)sz;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < n / 32; blk++) block_all_rows(pairs, q.d, q.xsum, m, k, q.group, buf, sz32, n, blk, out);
    free(pairs);
    return true;
#else
    (void)q, (void)buf, (void)sz, (void)out, (void)n;
    return false;
#endif
}

}  // namespace spark_edge
