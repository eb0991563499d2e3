/* The bf16 tile of a 4-bit weight that spark-edge's tile GEMMs run over, and the loop that walks a call's tiles.
 *
 * A tile is one 64-channel block of ATen's AVX-512 buffer layout (or the tail block) times the micro-kernel's K
 * steps (Rows::tile_k: 512 steps, 64 KiB, for vdpbf16ps), dequantized into a per-thread buffer that stays in L2, in
 * the layout bf16 dot-product hardware reads: per K pair (k, k + 1) and channel c one 32-bit lane holding bf16
 * W[c][k] (low half) and W[c][k + 1] (high half). One zmm of a tile row is 16 channels of a pair (what vdpbf16ps
 * takes), and 16 tile rows of 16 channels are an AMX B tile (what tdpbf16ps takes). Each weight is the project's
 * one definition in bf16 (dequantize_code: (q - 8) * scale + zero in fp32, rounded once), so the tile GEMMs
 * multiply exactly the weights dequant + oneDNN multiplies; only the order of the fp32 sums differs.
 *
 * run_tiles<Rows> is the shared loop: the work is the panels (of one or more blocks) x M rows grid flattened panel
 * by panel, each thread of torch's OpenMP pool a contiguous range of it (9 panels on 2 threads split 4.5 / 4.5, the
 * middle panel by rows), so a thread dequantizes each of its tiles once and runs every one of its rows over it.
 * `Rows` is the micro-kernel (int4_gemm_bf16.cpp: vdpbf16ps register blocks; int4_gemm_amx.cpp: AMX tiles), one
 * object per thread, so a kernel may hold per-thread state (the AMX tile configuration) for the whole call.
 */
#pragma once
#ifdef __AVX512BF16__
#include "bf16.h"

#include <cstdint>
#include <cstdlib>
#include <immintrin.h>
#include <omp.h>

namespace spark_edge {
namespace bf16_tiles {

constexpr int NB = 64;   /* channels of a tile: one block of ATen's AVX-512 layout */

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
inline void dequant_tile(const uint8_t *buf, const uint32_t *sz32, int64_t n, int64_t k, int64_t group, int64_t b,
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

/* One row of 64 fp32 sums rounded to bf16 (nearest even) into out, `valid` channels of it. */
inline void store_row_bf16(const __m512 acc[4], uint16_t *out, int64_t valid) {
    if (valid == NB) {
        for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(out + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[j]));
        return;
    }
    float tmp[NB];
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(tmp + 16 * j, acc[j]);
    for (int64_t c = 0; c < valid; c++) out[c] = float_to_bf16(tmp[c]);
}

/* out bf16 [M][N] = x bf16 [M][K] @ W^T over bf16 tiles of the weight, a panel of up to Rows::kPanel 64-channel
 * blocks at a time (each block's tile at t + j * (kc / 2) * 64). Rows is the micro-kernel:
 *   static constexpr int kPanel: most blocks a panel (more: the activations are read fewer times a call);
 *   static int64_t tile_k(int64_t k): K steps of a tile (the last tile of a call takes what is left);
 *   static constexpr bool kAlwaysAcc: whether it needs the fp32 sums buffer even when K fits one tile;
 *   void run(x, k, k0, t, kc, acc, first, last, out, n, valid, rows): `rows` rows (x at their first row)
 *     x the panel's `valid` channels over K steps k0 .. k0 + kc; sums start at zero (first) or from
 *     acc [rows][kPanel * 64], and after the last tile are rounded to bf16 into out (ldo = N), else left in acc.
 * False if a thread's buffers could not be allocated. */
template <class Rows>
bool run_tiles(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
               int64_t k, int64_t group) {
    constexpr int64_t P = Rows::kPanel;
    const int64_t blocks = (n + NB - 1) / NB, panels = (blocks + P - 1) / P, work = panels * m;
    const uint32_t *sz32 = (const uint32_t *)sz;
    const int64_t kc_max = Rows::tile_k(k) < k ? Rows::tile_k(k) : k;
    const bool need_acc = Rows::kAlwaysAcc || k > kc_max;
    bool ok = true;
#pragma omp parallel
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t begin = work * tid / nth, end = work * (tid + 1) / nth;
        uint32_t *tile = (uint32_t *)std::aligned_alloc(64, sizeof(uint32_t) * (size_t)(P * kc_max / 2 * NB));
        const int64_t rows_max = end - begin < m ? end - begin : m; /* of one panel */
        float *acc = need_acc ? (float *)std::aligned_alloc(64, sizeof(float) * (size_t)((rows_max + 1) * P * NB))
                              : nullptr;
        if (!tile || (need_acc && !acc)) {
#pragma omp atomic write
            ok = false;
        } else {
            Rows rows;
            for (int64_t pb = begin / m; pb < panels && pb * m < end; pb++) {
                const int64_t r_lo = pb * m > begin ? 0 : begin - pb * m;
                const int64_t r_hi = (pb + 1) * m < end ? m : end - pb * m;
                if (r_hi <= r_lo) continue;
                /* blocks spread evenly over the panels (9 blocks in panels of 4: 3 + 3 + 3, not 4 + 4 + 1) */
                const int64_t b0 = pb * blocks / panels, in_panel = (pb + 1) * blocks / panels - b0;
                const int64_t valid = n - b0 * NB < in_panel * NB ? n - b0 * NB : in_panel * NB;
                for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
                    const int64_t kc = k - k0 < kc_max ? k - k0 : kc_max;
                    for (int64_t j = 0; j < in_panel; j++)
                        dequant_tile(buf, sz32, n, k, group, b0 + j, k0, kc, tile + j * (kc / 2) * NB);
                    rows.run(x + r_lo * k, k, k0, tile, kc, acc, k0 == 0, k0 + kc >= k, out + r_lo * n + b0 * NB, n,
                             valid, r_hi - r_lo);
                }
            }
        }
        std::free(tile);
        std::free(acc);
    }
    return ok;
}

}  // namespace bf16_tiles
}  // namespace spark_edge
#endif
