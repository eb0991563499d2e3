/* Dequantize the CPU int4 GEMM's weight buffer to a transposed bf16 matrix W^T [K][N] in one pass, or some of
 * its rows (output channels: an embedding lookup) to bf16 [M][K].
 *
 * Layout of the buffer (see tinygemm_layout.py, which detects it on the running torch): output
 * channels in full blocks of `block`, each [K][block/2] bytes, then one tail block of
 * r = N mod block channels laid out [K][r/2]. In a full block with `halves` set, byte d holds
 * channel d (low nibble) and channel d + block/2 (high nibble); otherwise, and in the tail,
 * byte j holds channels 2j (low) and 2j+1 (high). scales_and_zeros is bf16 [G][N][2]
 * (scale, zero), G = K / group.
 *
 * Writing W^T row by row keeps both sides contiguous: row k of W^T is, block after block, the
 * bytes of that block at k expanded to values. The arithmetic is the project's one definition,
 * (q - 8) * scale + zero in fp32, rounded once to bf16 (nearest even): (q - 8) * scale is exact in
 * fp32, so a contracted fma gives the same bits as a multiply and an add.
 *
 * Threads: OpenMP over rows of W^T. Built with -fopenmp against libgomp.so.1, the runtime torch has
 * already loaded (same soname), so this runs on torch's own thread pool and its core binding.
 */
#include "bf16.h"
#include "int4_kernels.h"

#include <cstdint>
#include <cstring>

namespace spark_edge {

/* Adjacent pairs: byte j -> channels 2j, 2j+1 (the tail block, the portable kernel's blocks). */
static inline void dq_adjacent(const uint8_t *src, const uint16_t *s, uint16_t *o, int64_t channels) {
    for (int64_t j = 0; j < channels / 2; j++) {
        o[2 * j] = dequantize_code(src[j] & 0xfu, s + 4 * j);
        o[2 * j + 1] = dequantize_code(src[j] >> 4, s + 4 * j + 2);
    }
}

/* Halves: byte d -> channels d, d + channels/2 (full blocks of the AVX2 and AVX-512 kernels). */
static inline void dq_halves(const uint8_t *src, const uint16_t *s, uint16_t *o, int64_t channels) {
    const int64_t half = channels / 2;
    for (int64_t d = 0; d < half; d++) {
        o[d] = dequantize_code(src[d] & 0xfu, s + 2 * d);
        o[d + half] = dequantize_code(src[d] >> 4, s + 2 * (d + half));
    }
}

void int4_dequant_t(const uint8_t *buf, const uint16_t *sz, uint16_t *out,
                    int64_t n, int64_t k, int64_t group, int64_t block, int64_t halves) {
    const int64_t blocks = n / block, full = blocks * block, tail = n - full;
    const uint8_t *tail_buf = buf + full * (k / 2);
#pragma omp parallel for schedule(static)
    for (int64_t kk = 0; kk < k; kk++) {
        const uint16_t *sz_row = sz + (kk / group) * n * 2; /* [N][2] of this row's group */
        uint16_t *o = out + kk * n;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *src = buf + (b * k + kk) * (block / 2);
            if (halves)
                dq_halves(src, sz_row + b * block * 2, o + b * block, block);
            else
                dq_adjacent(src, sz_row + b * block * 2, o + b * block, block);
        }
        if (tail) dq_adjacent(tail_buf + kk * (tail / 2), sz_row + full * 2, o + full, tail);
    }
}

/* Row `id` of W (channel id) is one nibble per K step, at a fixed byte of each K step of its block: for a full
 * block the block's `block / 2` bytes a step, for the tail its `tail / 2`. Few rows (the prompt's or the step's
 * tokens), so one thread: the parallel region would cost more than the rows. */
void int4_gather_rows(const uint8_t *buf, const uint16_t *sz, const int64_t *ids, int64_t m, uint16_t *out, int64_t n,
                      int64_t k, int64_t group, int64_t block, int64_t halves) {
    const int64_t full = n / block * block, tail = n - full;
    for (int64_t r = 0; r < m; r++) {
        const int64_t id = ids[r], c = id < full ? id % block : id - full;
        const uint8_t *src;
        int64_t step, shift;
        if (id < full) {
            src = buf + (id - c) * (k / 2) + (halves ? c % (block / 2) : c / 2);
            step = block / 2, shift = (halves ? c >= block / 2 : c % 2) ? 4 : 0;
        } else {
            src = buf + full * (k / 2) + c / 2;
            step = tail / 2, shift = c % 2 ? 4 : 0;
        }
        uint16_t *o = out + r * k;
        for (int64_t kk = 0; kk < k; kk++)
            o[kk] = dequantize_code((src[kk * step] >> shift) & 0xfu, sz + ((kk / group) * n + id) * 2);
    }
}

}  // namespace spark_edge
