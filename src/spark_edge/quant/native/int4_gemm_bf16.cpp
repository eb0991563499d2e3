/* int4 GEMM in tiles on bf16 dot-product hardware (AVX512-BF16 vdpbf16ps), for prefill and batched decode:
 * out bf16 [M][N] = x bf16 [M][K] @ W^T, where W is never dequantized as a whole matrix.
 *
 * The weight is taken one tile at a time: one 64-channel block of ATen's AVX-512 buffer layout (or the tail
 * block) times up to KC K steps, dequantized into a 64 KiB buffer that stays in L2, in the layout vdpbf16ps
 * reads: per K pair (k, k + 1) and channel c one 32-bit lane holding bf16 W[c][k] (low half) and W[c][k + 1]
 * (high half), so one zmm is 16 channels of a pair. Every row of the call then runs over the tile in
 * register blocks of MR rows x 64 channels (6 x 4 zmm accumulators; each K pair: 4 weight loads, 6
 * broadcasts of an activation pair, 24 vdpbf16ps), so the dequantization is paid once per tile and
 * amortized over all M rows. fp32 partial sums of a block's rows are kept between K tiles in a per-thread
 * buffer and rounded once to bf16 (nearest even) at the end.
 *
 * The arithmetic is that of the dequant + oneDNN path it replaces: each weight is (q - 8) * scale + zero in
 * fp32 (exact product, one rounding: fma), rounded once to bf16, then bf16 x bf16 products summed in fp32.
 * Only the order of the fp32 sums differs (vdpbf16ps, like oneDNN's bf16 kernels, flushes denormals).
 *
 * Threads (torch's OpenMP pool): the work is the blocks x M rows grid flattened block by block, each thread
 * a contiguous range of it, so 9 blocks on 2 threads split 4.5 / 4.5 (the middle block by rows) instead of
 * 5 / 4, and a thread dequantizes each of its tiles once.
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on Zen 4, Cooper Lake, Sapphire Rapids
 * and later); elsewhere int4_gemm_bf16_supported() is false and the other kernels serve.
 */
#include "bf16.h"
#include "int4_kernels.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace spark_edge {

#ifdef __AVX512BF16__
namespace {

constexpr int NB = 64;   /* channels of a tile: one block of ATen's AVX-512 layout */
constexpr int MR = 6;    /* rows of a register block: 6 x 4 accumulators + 4 weights + a broadcast */
constexpr int KC = 512;  /* K steps of a tile: 64 x 512 bf16 = 64 KiB */

/* One pair of K steps of a full halves block into the tile: 4 zmm of 16 channels (byte d of a K step holds
 * channel d in its low nibble, d + 32 in its high one). */
inline void dequant_pair_halves(const uint8_t *row0, const uint32_t *sz_g, uint32_t *t) {
    const __m512i low4 = _mm512_set1_epi32(0xf), eight = _mm512_set1_epi32(8);
    const __m512i high16 = _mm512_set1_epi32((int)0xffff0000u);
    for (int j = 0; j < 2; j++) { /* bytes 16j..16j+15: channels 16j.. (low nibbles) and 32+16j.. (high) */
        const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row0 + 16 * j)));
        const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row0 + NB / 2 + 16 * j)));
        for (int h = 0; h < 2; h++) {
            const int c0 = 16 * j + 32 * h;
            const __m512i v = _mm512_loadu_si512(sz_g + c0); /* (scale, zero) bf16 pairs of 16 channels */
            const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, high16));
            const __m512i q0 = h ? _mm512_srli_epi32(b0, 4) : _mm512_and_si512(b0, low4);
            const __m512i q1 = h ? _mm512_srli_epi32(b1, 4) : _mm512_and_si512(b1, low4);
            const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q0, eight)), s, z);
            const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q1, eight)), s, z);
            const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w0));
            const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w1));
            _mm512_storeu_si512(t + c0, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
        }
    }
}

/* The tile of block `b` (channels b * 64 ..) for K steps k0 .. k0 + kc: t is [kc / 2][64] lanes. The tail
 * block (r = N mod 64 channels in adjacent pairs, [K][r / 2] bytes) is dequantized lane by lane, its missing
 * channels zero. */
void dequant_tile(const uint8_t *buf, const uint32_t *sz32, int64_t n, int64_t k, int64_t group, int64_t b,
                  int64_t k0, int64_t kc, uint32_t *t) {
    const int64_t full = n / NB * NB;
    if (b * NB < full) {
        const uint8_t *base = buf + b * NB * (k / 2);
        for (int64_t p = 0; p < kc / 2; p++) {
            const int64_t kk = k0 + 2 * p;
            dequant_pair_halves(base + kk * (NB / 2), sz32 + (kk / group) * n + b * NB, t + p * NB);
        }
        return;
    }
    const int64_t r = n - full;
    const uint8_t *tail = buf + full * (k / 2);
    const uint16_t *sz = (const uint16_t *)sz32;
    for (int64_t p = 0; p < kc / 2; p++) {
        const int64_t kk = k0 + 2 * p;
        for (int64_t c = 0; c < NB; c++) {
            uint32_t lane = 0;
            if (c < r)
                for (int i = 0; i < 2; i++) {
                    const uint32_t q = (tail[(kk + i) * (r / 2) + c / 2] >> ((c & 1) * 4)) & 0xfu;
                    lane |= (uint32_t)dequantize_code(q, sz + ((kk + i) / group * n + full + c) * 2) << (16 * i);
                }
            t[p * NB + c] = lane;
        }
    }
}

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
        } else if (valid == NB) {
            for (int j = 0; j < 4; j++)
                _mm256_storeu_si256((__m256i *)(out + r * ldo + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
        } else {
            float tmp[NB];
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(tmp + 16 * j, acc[r][j]);
            for (int64_t c = 0; c < valid; c++) out[r * ldo + c] = float_to_bf16(tmp[c]);
        }
    }
}

void rows_over_tile(const uint16_t *x, int64_t k, int64_t k0, const uint32_t *t, int64_t kc, float *acc, bool first,
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
    const int64_t blocks = (n + NB - 1) / NB, work = blocks * m;
    const uint32_t *sz32 = (const uint32_t *)sz;
    bool ok = true;
#pragma omp parallel
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t begin = work * tid / nth, end = work * (tid + 1) / nth;
        const int64_t kc_max = k < KC ? k : KC;
        uint32_t *tile = (uint32_t *)std::aligned_alloc(64, sizeof(uint32_t) * (size_t)(kc_max / 2 * NB));
        /* partial sums between K tiles: only when K takes more than one tile */
        const int64_t rows_max = end - begin < m ? end - begin : m; /* of one block */
        float *acc = k > KC ? (float *)std::aligned_alloc(64, sizeof(float) * (size_t)((rows_max + 1) * NB)) : nullptr;
        if (!tile || (k > KC && !acc)) {
#pragma omp atomic write
            ok = false;
        } else {
            for (int64_t b = begin / m; b < blocks && b * m < end; b++) {
                const int64_t r_lo = b * m > begin ? 0 : begin - b * m;
                const int64_t r_hi = (b + 1) * m < end ? m : end - b * m;
                if (r_hi <= r_lo) continue;
                const int64_t valid = n - b * NB < NB ? n - b * NB : NB;
                for (int64_t k0 = 0; k0 < k; k0 += KC) {
                    const int64_t kc = k - k0 < KC ? k - k0 : KC;
                    dequant_tile(buf, sz32, n, k, group, b, k0, kc, tile);
                    rows_over_tile(x + r_lo * k, k, k0, tile, kc, acc, k0 == 0, k0 + kc >= k,
                                   out + r_lo * n + b * NB, n, valid, r_hi - r_lo);
                }
            }
        }
        std::free(tile);
        std::free(acc);
    }
    return ok;
#else
    (void)x, (void)m, (void)buf, (void)sz, (void)out, (void)n, (void)k, (void)group;
    return false;
#endif
}

}  // namespace spark_edge
