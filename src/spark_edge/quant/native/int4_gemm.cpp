/* Multi-row int4 GEMM on the CPU int4 kernel buffer: out bf16 [M][N] = x bf16 [M][K] @ W^T, reading
 * each 4-bit weight from memory once per call whatever M (PyTorch's tinygemm is run one row at a time
 * on this path, so M rows read the weights M times).
 *
 * Buffer layout as in int4_dequant.cpp (detected on the running torch by tinygemm_layout.py): full blocks
 * of `block` output channels, each [K][block/2] bytes, then a tail block of r = N mod block channels
 * laid out [K][r/2] in adjacent pairs. scales_and_zeros is bf16 [G][N][2] (scale, zero), G = K / group,
 * and a weight is (q - 8) * scale + zero.
 *
 * Per group g of a channel, with x_k the fp32 activations:
 *     sum_k x_k ((q_k - 8) s + z) = s * sum_k x_k q_k + (z - 8 s) * sum_k x_k
 * so the inner loop is one FMA per weight and row on the unsigned codes, and the scale is applied once
 * per group; sum_k x_k per (row, group) is computed once per call. Accumulation is fp32 throughout,
 * rounded once to bf16 (nearest even) at the end.
 *
 * The vector path (AVX-512F) serves the layout of ATen's AVX-512 kernel: 64-channel blocks whose byte d
 * of a K step holds channel d (low nibble) and d + 32 (high nibble). A unit of work is 16 bytes of a K
 * step: 16 low-nibble channels and the 16 high-nibble channels 32 above them, two zmm of fp32 weights,
 * FMA'd against up to ROWS activation rows (2 x ROWS accumulators in registers). Units are independent,
 * so OpenMP threads split the output channels. Everything else (tails, other layouts, builds without
 * AVX-512) runs the portable loop, which is exact to the same formula.
 *
 * Built with -fopenmp against libgomp.so.1, the runtime torch has already loaded, so the threads are
 * torch's own pool.
 */
#include "bf16.h"
#include "int4_kernels.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define ROWS 8 /* activation rows per pass over a unit's weights (registers: 2 x ROWS accumulators) */
#define SZ_PREFETCH 8 /* groups ahead whose scales are prefetched */

namespace spark_edge {

/* One output channel, all rows, any layout: byte of K step k at base + k * run, nibble at `shift`. */
static void channel_portable(const float *xf, const float *xsum, int64_t m, int64_t k, int64_t group,
                             const uint8_t *base, int64_t run, int shift, const uint16_t *sz, int64_t n,
                             int64_t ch, uint16_t *out) {
    const int64_t groups = k / group;
    for (int64_t r = 0; r < m; r++) {
        const float *x = xf + r * k;
        float total = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            float acc = 0.0f;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++)
                acc += x[kk] * (float)((base[kk * run] >> shift) & 0xf);
            const uint16_t *p = sz + (g * n + ch) * 2;
            const float s = bf16_to_float(p[0]), z = bf16_to_float(p[1]) - 8.0f * s;
            total += s * acc + z * xsum[r * groups + g];
        }
        out[r * n + ch] = float_to_bf16(total);
    }
}

/* Where channel `ch` lives: its bytes' base, bytes per K step, and nibble shift. */
static const uint8_t *locate(const uint8_t *buf, int64_t n, int64_t k, int64_t block, int64_t halves, int64_t ch,
                             int64_t *run, int *shift) {
    const int64_t full = n / block * block;
    if (ch >= full) { /* the tail block: adjacent pairs */
        const int64_t c = ch - full;
        *run = (n - full) / 2;
        *shift = (int)(c & 1) * 4;
        return buf + full * (k / 2) + c / 2;
    }
    const int64_t b = ch / block, c = ch % block;
    *run = block / 2;
    if (halves) {
        *shift = c >= block / 2 ? 4 : 0;
        return buf + b * block * (k / 2) + c % (block / 2);
    }
    *shift = (int)(c & 1) * 4;
    return buf + b * block * (k / 2) + c / 2;
}

#ifdef __AVX512F__
/* One unit (16 low + 16 high channels of a 64-channel halves block), `rows` rows (<= ROWS). */
static inline __attribute__((always_inline)) void unit_rows(const float *xf, const float *xsum, int64_t k,
                                                            int64_t group, const uint8_t *w, const uint32_t *sz_lo,
                                                            const uint32_t *sz_hi, int64_t n, float *tot,
                                                            const int rows) {
    const int64_t groups = k / group;
    const __m512i low4 = _mm512_set1_epi32(0xf), high16 = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 eight = _mm512_set1_ps(8.0f);
    /* Few rows leave too few independent FMA chains to hide the FMA latency (4 cycles, 2 ports: 8 chains
     * needed): below 4 rows, even and odd K steps accumulate separately. */
    const int split = rows < 4 ? 2 : 1;
    /* A unit's (scale, zero) pairs are one 64-byte line per group and half, N * 4 bytes apart: a stride the
     * hardware prefetchers do not follow across pages. Without software prefetch each is a DRAM miss (the
     * 49152-channel head decoded at 2/3 of tinygemm's speed). */
    for (int64_t g = 0; g < groups && g < SZ_PREFETCH; g++) {
        _mm_prefetch((const char *)(sz_lo + g * n), _MM_HINT_T0);
        _mm_prefetch((const char *)(sz_hi + g * n), _MM_HINT_T0);
    }
    for (int64_t g = 0; g < groups; g++) {
        if (g + SZ_PREFETCH < groups) {
            _mm_prefetch((const char *)(sz_lo + (g + SZ_PREFETCH) * n), _MM_HINT_T0);
            _mm_prefetch((const char *)(sz_hi + (g + SZ_PREFETCH) * n), _MM_HINT_T0);
        }
        __m512 acc_lo[2][ROWS], acc_hi[2][ROWS];
        for (int p = 0; p < split; p++)
            for (int r = 0; r < rows; r++) acc_lo[p][r] = acc_hi[p][r] = _mm512_setzero_ps();
        const uint8_t *wg = w + g * group * 32;
        const float *xg = xf + g * group;
        for (int64_t kk = 0; kk < group; kk += split) {
            for (int p = 0; p < split; p++) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wg + (kk + p) * 32)));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, low4));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                for (int r = 0; r < rows; r++) {
                    const __m512 xv = _mm512_set1_ps(xg[r * k + kk + p]);
                    acc_lo[p][r] = _mm512_fmadd_ps(lo, xv, acc_lo[p][r]);
                    acc_hi[p][r] = _mm512_fmadd_ps(hi, xv, acc_hi[p][r]);
                }
            }
        }
        if (split == 2)
            for (int r = 0; r < rows; r++) {
                acc_lo[0][r] = _mm512_add_ps(acc_lo[0][r], acc_lo[1][r]);
                acc_hi[0][r] = _mm512_add_ps(acc_hi[0][r], acc_hi[1][r]);
            }
        /* (scale, zero) bf16 pairs read as uint32: scale in the low half, zero in the high half */
        const __m512i vlo = _mm512_loadu_si512(sz_lo + g * n), vhi = _mm512_loadu_si512(sz_hi + g * n);
        const __m512 s_lo = _mm512_castsi512_ps(_mm512_slli_epi32(vlo, 16));
        const __m512 s_hi = _mm512_castsi512_ps(_mm512_slli_epi32(vhi, 16));
        const __m512 z_lo = _mm512_fnmadd_ps(eight, s_lo, _mm512_castsi512_ps(_mm512_and_si512(vlo, high16)));
        const __m512 z_hi = _mm512_fnmadd_ps(eight, s_hi, _mm512_castsi512_ps(_mm512_and_si512(vhi, high16)));
        for (int r = 0; r < rows; r++) {
            const __m512 xs = _mm512_set1_ps(xsum[r * groups + g]);
            __m512 t_lo = _mm512_loadu_ps(tot + r * 32), t_hi = _mm512_loadu_ps(tot + r * 32 + 16);
            t_lo = _mm512_fmadd_ps(z_lo, xs, _mm512_fmadd_ps(s_lo, acc_lo[0][r], t_lo));
            t_hi = _mm512_fmadd_ps(z_hi, xs, _mm512_fmadd_ps(s_hi, acc_hi[0][r], t_hi));
            _mm512_storeu_ps(tot + r * 32, t_lo);
            _mm512_storeu_ps(tot + r * 32 + 16, t_hi);
        }
    }
}

static void unit_avx512(const float *xf, const float *xsum, int64_t m, int64_t k, int64_t group, const uint8_t *buf,
                        const uint16_t *sz, int64_t n, int64_t unit, uint16_t *out) {
    const int64_t b = unit / 2, h = unit % 2, groups = k / group;
    const int64_t ch_lo = b * 64 + h * 16, ch_hi = ch_lo + 32;
    const uint8_t *w = buf + b * 64 * (k / 2) + h * 16;
    const uint32_t *sz32 = (const uint32_t *)sz;
    float tot[ROWS * 32];
    for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
        memset(tot, 0, sizeof tot);
        const float *x = xf + r0 * k, *xs = xsum + r0 * groups;
        switch (rows) { /* constant row counts, so the accumulators stay in registers */
        case 1: unit_rows(x, xs, k, group, w, sz32 + ch_lo, sz32 + ch_hi, n, tot, 1); break;
        case 2: unit_rows(x, xs, k, group, w, sz32 + ch_lo, sz32 + ch_hi, n, tot, 2); break;
        case 3: unit_rows(x, xs, k, group, w, sz32 + ch_lo, sz32 + ch_hi, n, tot, 3); break;
        case 4: unit_rows(x, xs, k, group, w, sz32 + ch_lo, sz32 + ch_hi, n, tot, 4); break;
        case 5: unit_rows(x, xs, k, group, w, sz32 + ch_lo, sz32 + ch_hi, n, tot, 5); break;
        case 6: unit_rows(x, xs, k, group, w, sz32 + ch_lo, sz32 + ch_hi, n, tot, 6); break;
        case 7: unit_rows(x, xs, k, group, w, sz32 + ch_lo, sz32 + ch_hi, n, tot, 7); break;
        default: unit_rows(x, xs, k, group, w, sz32 + ch_lo, sz32 + ch_hi, n, tot, ROWS); break;
        }
        for (int r = 0; r < rows; r++) {
            uint16_t *o = out + (r0 + r) * n;
            for (int i = 0; i < 16; i++) {
                o[ch_lo + i] = float_to_bf16(tot[r * 32 + i]);
                o[ch_hi + i] = float_to_bf16(tot[r * 32 + 16 + i]);
            }
        }
    }
}
#endif

bool int4_gemm_vectorized(int64_t block, int64_t halves) {
#ifdef __AVX512F__
    return block == 64 && halves;
#else
    (void)block, (void)halves;
    return false;
#endif
}

bool int4_gemm(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
               int64_t k, int64_t group, int64_t block, int64_t halves) {
    const int64_t groups = k / group;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k + m * groups));
    if (!xf) return false;
    float *xsum = xf + m * k;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++) s += (xf[r * k + kk] = bf16_to_float(x[r * k + kk]));
            xsum[r * groups + g] = s;
        }
    const int64_t vector_channels = int4_gemm_vectorized(block, halves) ? n / block * block : 0;
    const int64_t units = vector_channels / 32, rest = n - vector_channels;
#pragma omp parallel
    {
#ifdef __AVX512F__
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < units; u++) unit_avx512(xf, xsum, m, k, group, buf, sz, n, u, out);
#endif
#pragma omp for schedule(static)
        for (int64_t c = 0; c < rest; c++) {
            int64_t run;
            int shift;
            const uint8_t *base = locate(buf, n, k, block, halves, vector_channels + c, &run, &shift);
            channel_portable(xf, xsum, m, k, group, base, run, shift, sz, n, vector_channels + c, out);
        }
    }
    (void)units;
    free(xf);
    return true;
}

}  // namespace spark_edge
