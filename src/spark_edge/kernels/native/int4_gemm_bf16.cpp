/* int4 GEMM in tiles on bf16 dot-product hardware (AVX512-BF16 vdpbf16ps), for prefill and batched decode:
 * out bf16 [M][N] = x bf16 [M][K] @ W^T, where W is never dequantized as a whole matrix.
 *
 * The weight is taken one bf16 tile at a time (bf16_tiles.h: 64 channels x 512 K steps, in L2). Every
 * row of the call then runs over the tile in register blocks of MR rows x 64 channels (6 x 4 zmm accumulators;
 * each K pair: 4 weight loads, 6 broadcasts of an activation pair, 24 vdpbf16ps), so the dequantization is
 * paid once per tile and amortized over all M rows. fp32 partial sums of a block's rows are kept between K
 * tiles in a per-thread buffer and rounded once to bf16 (nearest even) at the end.
 *
 * The arithmetic is that of the dequant + oneDNN path it replaces: bf16 weights (the same values), bf16 x bf16
 * products summed in fp32; only the order of the sums differs (vdpbf16ps, like oneDNN's bf16 kernels, flushes
 * denormals).
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on Zen 4, Cooper Lake, Sapphire Rapids
 * and later); elsewhere int4_gemm_bf16_supported() is false and the other kernels serve.
 */
#include "bf16_tiles.h"
#include "int4_kernels.h"

#include <cstdint>

namespace spark_edge {

#ifdef __AVX512BF16__
namespace {

using bf16_tiles::NB;
constexpr int MR = 6; /* rows of a register block: 6 x 4 accumulators + 4 weights + a broadcast */

/* ROWS rows (x at their first row, ldx = K) x 64 channels over `pairs` K pairs of the tile. Accumulators
 * start at zero (first tile) or from acc_buf [ROWS][64]; after the last tile they are rounded to bf16 into
 * out (ldo = N, `valid` channels), else stored back. */
template <int ROWS>
void block_rows(const uint16_t *x, int64_t ldx, const uint32_t *t, int64_t pairs, float *acc_buf, bool first,
                bool last, uint16_t *out, int64_t ldo, int64_t valid) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_buf + r * NB + 16 * j);
    const int32_t *xp = (const int32_t *)x; /* activation pairs as 32-bit words */
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(t + p * NB), w1 = (__m512bh)_mm512_loadu_si512(t + p * NB + 16);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(t + p * NB + 32), w3 = (__m512bh)_mm512_loadu_si512(t + p * NB + 48);
        for (int r = 0; r < ROWS; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[r * (ldx / 2) + p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        if (!last) {
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc_buf + r * NB + 16 * j, acc[r][j]);
        } else {
            bf16_tiles::store_row_bf16(acc[r], out + r * ldo, valid);
        }
    }
}

/* The micro-kernel of run_tiles (bf16_tiles.h): rows in register blocks of MR. */
struct VdpRows {
    static constexpr int kPanel = 1;
    static constexpr bool kAlwaysAcc = false;
    static int64_t tile_k(int64_t) { return 512; } /* 64 x 512 bf16 = 64 KiB */

    void run(const uint16_t *x, int64_t k, int64_t k0, const uint32_t *t, int64_t kc, float *acc, bool first,
             bool last, uint16_t *out, int64_t n, int64_t valid, int64_t rows) {
        for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            const uint16_t *xr = x + r0 * k + k0;
            float *a = acc ? acc + r0 * NB : nullptr;
            uint16_t *o = out + r0 * n;
            switch (rows - r0 < MR ? rows - r0 : MR) { /* constant row counts keep the accumulators in registers */
            case 1: block_rows<1>(xr, k, t, kc / 2, a, first, last, o, n, valid); break;
            case 2: block_rows<2>(xr, k, t, kc / 2, a, first, last, o, n, valid); break;
            case 3: block_rows<3>(xr, k, t, kc / 2, a, first, last, o, n, valid); break;
            case 4: block_rows<4>(xr, k, t, kc / 2, a, first, last, o, n, valid); break;
            case 5: block_rows<5>(xr, k, t, kc / 2, a, first, last, o, n, valid); break;
            default: block_rows<MR>(xr, k, t, kc / 2, a, first, last, o, n, valid); break;
            }
        }
    }
};

}  // namespace
#endif

bool int4_gemm_bf16_supported(int64_t block, int64_t halves) {
#ifdef __AVX512BF16__
    return block == NB && halves;
#else
    (void)block, (void)halves;
    return false;
#endif
}

bool int4_gemm_bf16(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
                    int64_t k, int64_t group) {
#ifdef __AVX512BF16__
    if (k % 2 || group % 2 || n % 2) return false;
    return bf16_tiles::run_tiles<VdpRows>(x, m, buf, sz, out, n, k, group);
#else
    (void)x, (void)m, (void)buf, (void)sz, (void)out, (void)n, (void)k, (void)group;
    return false;
#endif
}

}  // namespace spark_edge
