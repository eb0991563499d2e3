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
 * The vector paths serve the layouts of ATen's vector kernels: AVX-512F its AVX-512 layout (64-channel blocks
 * whose byte d of a K step holds channel d in its low nibble and d + 32 in its high nibble), AVX2 its AVX2
 * layout (32-channel blocks, d and d + 16). A unit is half a block's bytes of a K step (16 or 8): its low-nibble
 * channels and the high-nibble channels half a block above, two vectors of fp32 weights, FMA'd against up to
 * MAX_ROWS activation rows (2 x MAX_ROWS accumulators in registers). Units are walked in tiles of up to
 * TILE_UNITS, group by group, so the scales of a tile are read along N (scales_and_zeros is [G][N][2]) and
 * each unit's codes stay a sequential stream; OpenMP threads split the tiles, i.e. the output channels. A
 * layout is served by its vector path wherever the build has it (an AVX-512 host runs both), so the AVX2
 * path is checked on every x86 host. Everything else (tails, the portable layout, builds without AVX2) runs
 * the portable loop, which is exact to the same formula.
 *
 * Built with -fopenmp against libgomp.so.1, the runtime torch has already loaded, so the threads are
 * torch's own pool.
 */
#include "bf16.h"
#include "int4_kernels.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE_UNITS 8 /* units per tile: 256 channels, 1 KiB of scales per group */

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

#if defined(__AVX512F__) || defined(__AVX2__)
/* The vector kernels walk a full block of BLOCK channels as two units of UB bytes per K step: unit h holds
 * channels h * UB .. h * UB + UB - 1 in its low nibbles and the same + BLOCK / 2 in its high nibbles. A policy
 * struct gives the block geometry of its layout and `group`, one group of one unit for ROWS_ rows: the codes
 * FMA'd against the activations in registers, then scale and zero applied into tot [ROWS_][2 * UB]. */
#endif

#ifdef __AVX512F__
/* ATen's AVX-512 layout: 64-channel blocks, a unit is 16 bytes (two zmm of fp32 weights). */
struct Avx512Units {
    static constexpr int BLOCK = 64, UB = 16, MAX_ROWS = 8; /* 2 x 8 accumulators of 32 zmm */

    template <int ROWS_>
    static inline __attribute__((always_inline)) void group(const float *xg, int64_t k, const float *xsum_g,
                                                            int64_t groups, int64_t group, const uint8_t *wg,
                                                            const uint32_t *sz_lo, const uint32_t *sz_hi, float *tot) {
        const __m512i low4 = _mm512_set1_epi32(0xf), high16 = _mm512_set1_epi32((int)0xffff0000u);
        const __m512 eight = _mm512_set1_ps(8.0f);
        /* Few rows leave too few independent FMA chains to hide the FMA latency (4 cycles, 2 ports: 8 chains
         * needed): below 4 rows, even and odd K steps accumulate separately. */
        constexpr int SPLIT = ROWS_ < 4 ? 2 : 1;
        __m512 acc_lo[SPLIT][ROWS_], acc_hi[SPLIT][ROWS_];
        for (int p = 0; p < SPLIT; p++)
            for (int r = 0; r < ROWS_; r++) acc_lo[p][r] = acc_hi[p][r] = _mm512_setzero_ps();
        for (int64_t kk = 0; kk < group; kk += SPLIT) {
            for (int p = 0; p < SPLIT; p++) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wg + (kk + p) * (BLOCK / 2))));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, low4));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                for (int r = 0; r < ROWS_; r++) {
                    const __m512 xv = _mm512_set1_ps(xg[r * k + kk + p]);
                    acc_lo[p][r] = _mm512_fmadd_ps(lo, xv, acc_lo[p][r]);
                    acc_hi[p][r] = _mm512_fmadd_ps(hi, xv, acc_hi[p][r]);
                }
            }
        }
        /* (scale, zero) bf16 pairs read as uint32: scale in the low half, zero in the high half */
        const __m512i vlo = _mm512_loadu_si512(sz_lo), vhi = _mm512_loadu_si512(sz_hi);
        const __m512 s_lo = _mm512_castsi512_ps(_mm512_slli_epi32(vlo, 16));
        const __m512 s_hi = _mm512_castsi512_ps(_mm512_slli_epi32(vhi, 16));
        const __m512 z_lo = _mm512_fnmadd_ps(eight, s_lo, _mm512_castsi512_ps(_mm512_and_si512(vlo, high16)));
        const __m512 z_hi = _mm512_fnmadd_ps(eight, s_hi, _mm512_castsi512_ps(_mm512_and_si512(vhi, high16)));
        for (int r = 0; r < ROWS_; r++) {
            const __m512 a_lo = SPLIT == 2 ? _mm512_add_ps(acc_lo[0][r], acc_lo[SPLIT - 1][r]) : acc_lo[0][r];
            const __m512 a_hi = SPLIT == 2 ? _mm512_add_ps(acc_hi[0][r], acc_hi[SPLIT - 1][r]) : acc_hi[0][r];
            const __m512 xs = _mm512_set1_ps(xsum_g[r * groups]);
            __m512 t_lo = _mm512_loadu_ps(tot + r * 32), t_hi = _mm512_loadu_ps(tot + r * 32 + 16);
            t_lo = _mm512_fmadd_ps(z_lo, xs, _mm512_fmadd_ps(s_lo, a_lo, t_lo));
            t_hi = _mm512_fmadd_ps(z_hi, xs, _mm512_fmadd_ps(s_hi, a_hi, t_hi));
            _mm512_storeu_ps(tot + r * 32, t_lo);
            _mm512_storeu_ps(tot + r * 32 + 16, t_hi);
        }
    }
};
#endif

#ifdef __AVX2__
/* ATen's AVX2 layout: 32-channel blocks, a unit is 8 bytes (two ymm of fp32 weights); 16 ymm registers hold
 * 2 x 4 accumulators beside the weights and the broadcast activation. */
struct Avx2Units {
    static constexpr int BLOCK = 32, UB = 8, MAX_ROWS = 4;

    template <int ROWS_>
    static inline __attribute__((always_inline)) void group(const float *xg, int64_t k, const float *xsum_g,
                                                            int64_t groups, int64_t group, const uint8_t *wg,
                                                            const uint32_t *sz_lo, const uint32_t *sz_hi, float *tot) {
        const __m256i low4 = _mm256_set1_epi32(0xf), high16 = _mm256_set1_epi32((int)0xffff0000u);
        const __m256 eight = _mm256_set1_ps(8.0f);
        constexpr int SPLIT = ROWS_ < 2 ? 2 : 1; /* as above, within the 16 registers */
        __m256 acc_lo[SPLIT][ROWS_], acc_hi[SPLIT][ROWS_];
        for (int p = 0; p < SPLIT; p++)
            for (int r = 0; r < ROWS_; r++) acc_lo[p][r] = acc_hi[p][r] = _mm256_setzero_ps();
        for (int64_t kk = 0; kk < group; kk += SPLIT) {
            for (int p = 0; p < SPLIT; p++) {
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wg + (kk + p) * (BLOCK / 2))));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                for (int r = 0; r < ROWS_; r++) {
                    const __m256 xv = _mm256_broadcast_ss(xg + r * k + kk + p);
                    acc_lo[p][r] = _mm256_fmadd_ps(lo, xv, acc_lo[p][r]);
                    acc_hi[p][r] = _mm256_fmadd_ps(hi, xv, acc_hi[p][r]);
                }
            }
        }
        const __m256i vlo = _mm256_loadu_si256((const __m256i *)sz_lo), vhi = _mm256_loadu_si256((const __m256i *)sz_hi);
        const __m256 s_lo = _mm256_castsi256_ps(_mm256_slli_epi32(vlo, 16));
        const __m256 s_hi = _mm256_castsi256_ps(_mm256_slli_epi32(vhi, 16));
        const __m256 z_lo = _mm256_fnmadd_ps(eight, s_lo, _mm256_castsi256_ps(_mm256_and_si256(vlo, high16)));
        const __m256 z_hi = _mm256_fnmadd_ps(eight, s_hi, _mm256_castsi256_ps(_mm256_and_si256(vhi, high16)));
        for (int r = 0; r < ROWS_; r++) {
            const __m256 a_lo = SPLIT == 2 ? _mm256_add_ps(acc_lo[0][r], acc_lo[SPLIT - 1][r]) : acc_lo[0][r];
            const __m256 a_hi = SPLIT == 2 ? _mm256_add_ps(acc_hi[0][r], acc_hi[SPLIT - 1][r]) : acc_hi[0][r];
            const __m256 xs = _mm256_set1_ps(xsum_g[r * groups]);
            __m256 t_lo = _mm256_loadu_ps(tot + r * 16), t_hi = _mm256_loadu_ps(tot + r * 16 + 8);
            t_lo = _mm256_fmadd_ps(z_lo, xs, _mm256_fmadd_ps(s_lo, a_lo, t_lo));
            t_hi = _mm256_fmadd_ps(z_hi, xs, _mm256_fmadd_ps(s_hi, a_hi, t_hi));
            _mm256_storeu_ps(tot + r * 16, t_lo);
            _mm256_storeu_ps(tot + r * 16 + 8, t_hi);
        }
    }
};
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
/* A tile of `count` consecutive units, group by group: the tile's (scale, zero) pairs of a group are
 * count x UB x 8 contiguous bytes of scales_and_zeros [G][N][2] (a unit on its own would read a line per
 * group and half, N * 4 bytes apart: a stride the prefetchers do not follow, a DRAM miss each), and each
 * unit's codes stay a sequential stream. */
template <class U, int ROWS_>
static void tile_rows(const float *xf, const float *xsum, int64_t k, int64_t group, const uint8_t *buf,
                      const uint32_t *sz32, int64_t n, int64_t unit0, int count, float *tot) {
    const int64_t groups = k / group;
    for (int64_t g = 0; g < groups; g++) {
        if (g + 1 < groups) /* the next group's scales of the whole tile */
            for (int line = 0; line < count * U::UB / 8; line++)
                _mm_prefetch((const char *)(sz32 + (g + 1) * n + unit0 / 2 * U::BLOCK) + line * 64, _MM_HINT_T0);
        for (int t = 0; t < count; t++) {
            const int64_t unit = unit0 + t, b = unit / 2, h = unit % 2;
            const int64_t ch_lo = b * U::BLOCK + h * U::UB;
            const uint8_t *wg = buf + b * U::BLOCK * (k / 2) + h * U::UB + g * group * (U::BLOCK / 2);
            U::template group<ROWS_>(xf + g * group, k, xsum + g, groups, group, wg, sz32 + g * n + ch_lo,
                                     sz32 + g * n + ch_lo + U::BLOCK / 2, tot + t * U::MAX_ROWS * 2 * U::UB);
        }
    }
}

template <class U>
static void tile_vector(const float *xf, const float *xsum, int64_t m, int64_t k, int64_t group, const uint8_t *buf,
                        const uint16_t *sz, int64_t n, int64_t unit0, int count, uint16_t *out) {
    constexpr int R = U::MAX_ROWS, W = 2 * U::UB; /* tot: W fp32 of each unit's channels per row */
    const int64_t groups = k / group;
    const uint32_t *sz32 = (const uint32_t *)sz;
    float tot[TILE_UNITS * R * W];
    for (int64_t r0 = 0; r0 < m; r0 += R) {
        const int rows = m - r0 < R ? (int)(m - r0) : R;
        memset(tot, 0, sizeof tot);
        const float *x = xf + r0 * k, *xs = xsum + r0 * groups;
        switch (rows) { /* constant row counts, so the accumulators stay in registers */
        case 1: tile_rows<U, 1>(x, xs, k, group, buf, sz32, n, unit0, count, tot); break;
        case 2: tile_rows<U, 2 < R ? 2 : R>(x, xs, k, group, buf, sz32, n, unit0, count, tot); break;
        case 3: tile_rows<U, 3 < R ? 3 : R>(x, xs, k, group, buf, sz32, n, unit0, count, tot); break;
        case 4: tile_rows<U, 4 < R ? 4 : R>(x, xs, k, group, buf, sz32, n, unit0, count, tot); break;
        case 5: tile_rows<U, 5 < R ? 5 : R>(x, xs, k, group, buf, sz32, n, unit0, count, tot); break;
        case 6: tile_rows<U, 6 < R ? 6 : R>(x, xs, k, group, buf, sz32, n, unit0, count, tot); break;
        case 7: tile_rows<U, 7 < R ? 7 : R>(x, xs, k, group, buf, sz32, n, unit0, count, tot); break;
        default: tile_rows<U, R>(x, xs, k, group, buf, sz32, n, unit0, count, tot); break;
        }
        for (int t = 0; t < count; t++) {
            const int64_t unit = unit0 + t, ch_lo = unit / 2 * U::BLOCK + unit % 2 * U::UB, ch_hi = ch_lo + U::BLOCK / 2;
            for (int r = 0; r < rows; r++) {
                const float *tr = tot + t * R * W + r * W;
                uint16_t *o = out + (r0 + r) * n;
                for (int i = 0; i < U::UB; i++) {
                    o[ch_lo + i] = float_to_bf16(tr[i]);
                    o[ch_hi + i] = float_to_bf16(tr[U::UB + i]);
                }
            }
        }
    }
}

/* This thread's share of the vector channels: a contiguous run of whole blocks (2 units each), as even as
 * blocks allow (9 blocks on 2 threads: 5 and 4; fixed-size tiles dealt out statically gave one thread 16
 * units and the other 2), walked in tiles of up to TILE_UNITS units that start on whole blocks, so a tile's
 * scales are contiguous. */
template <class U>
static void vector_share(const float *xf, const float *xsum, int64_t m, int64_t k, int64_t group, const uint8_t *buf,
                         const uint16_t *sz, int64_t n, int64_t blocks, uint16_t *out) {
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t u_end = blocks * (tid + 1) / nth * 2;
    for (int64_t u0 = blocks * tid / nth * 2; u0 < u_end; u0 += TILE_UNITS) {
        const int count = (int)(u_end - u0 < TILE_UNITS ? u_end - u0 : TILE_UNITS);
        tile_vector<U>(xf, xsum, m, k, group, buf, sz, n, u0, count, out);
    }
}
#endif

bool int4_gemm_vectorized(int64_t block, int64_t halves) {
    if (!halves) return false;
#ifdef __AVX512F__
    if (block == Avx512Units::BLOCK) return true;
#endif
#ifdef __AVX2__
    if (block == Avx2Units::BLOCK) return true;
#endif
    return false;
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
    const int64_t rest = n - vector_channels;
#pragma omp parallel
    {
        const int64_t blocks = vector_channels / block;
#ifdef __AVX512F__
        if (block == Avx512Units::BLOCK) vector_share<Avx512Units>(xf, xsum, m, k, group, buf, sz, n, blocks, out);
#endif
#ifdef __AVX2__
        if (block == Avx2Units::BLOCK) vector_share<Avx2Units>(xf, xsum, m, k, group, buf, sz, n, blocks, out);
#endif
        (void)blocks;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < rest; c++) {
            int64_t run;
            int shift;
            const uint8_t *base = locate(buf, n, k, block, halves, vector_channels + c, &run, &shift);
            channel_portable(xf, xsum, m, k, group, base, run, shift, sz, n, vector_channels + c, out);
        }
    }
    free(xf);
    return true;
}

}  // namespace spark_edge
