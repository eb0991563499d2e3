/* Dequantize the CPU int4 GEMM's weight buffer to a transposed bf16 matrix W^T [K][N] in one pass.
 *
 * Layout of the buffer (see tinygemm_layout.py): output channels in full blocks of 64, each block
 * [K][32] bytes where byte d holds channel d (low nibble) and channel d + 32 (high nibble); then one
 * tail block of r = N mod 64 channels laid out [K][r/2], byte j holding channels 2j (low) and 2j+1
 * (high). scales_and_zeros is bf16 [G][N][2] (scale, zero), G = K / group.
 *
 * Writing W^T row by row keeps both sides contiguous: row k of W^T is, block after block, the 32
 * bytes of that block at k expanded to 64 values. The arithmetic is the project's one definition,
 * (q - 8) * scale + zero in fp32, rounded once to bf16 (nearest even): (q - 8) * scale is exact in
 * fp32, so a contracted fma gives the same bits as a multiply and an add.
 *
 * Threads: OpenMP over rows of W^T. Built with -fopenmp against libgomp.so.1, the runtime torch has
 * already loaded (same soname), so this runs on torch's own thread pool and its core binding.
 */
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as c10::BFloat16 does */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t dq(uint32_t code, const uint16_t *sz_pair) {
    return float_to_bf16((float)((int32_t)code - 8) * bf16_to_float(sz_pair[0]) + bf16_to_float(sz_pair[1]));
}

void spark_edge_int4_dequant_t(const uint8_t *buf, const uint16_t *sz, uint16_t *out,
                               int64_t n, int64_t k, int64_t group) {
    const int64_t full = n / 64 * 64, blocks = n / 64, tail = n - full;
    const uint8_t *tail_buf = buf + full * (k / 2);
#pragma omp parallel for schedule(static)
    for (int64_t kk = 0; kk < k; kk++) {
        const uint16_t *sz_row = sz + (kk / group) * n * 2; /* [N][2] of this row's group */
        uint16_t *o = out + kk * n;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *src = buf + (b * k + kk) * 32;
            const uint16_t *s = sz_row + b * 64 * 2;
            uint16_t *ob = o + b * 64;
            for (int d = 0; d < 32; d++) {
                ob[d] = dq(src[d] & 0xfu, s + 2 * d);
                ob[d + 32] = dq(src[d] >> 4, s + 2 * (d + 32));
            }
        }
        if (tail) {
            const uint8_t *src = tail_buf + kk * (tail / 2);
            const uint16_t *s = sz_row + full * 2;
            uint16_t *ot = o + full;
            for (int64_t j = 0; j < tail / 2; j++) {
                ot[2 * j] = dq(src[j] & 0xfu, s + 4 * j);
                ot[2 * j + 1] = dq(src[j] >> 4, s + 4 * j + 2);
            }
        }
    }
}
