/* spark-edge's int4 kernels on the CPU int4 kernel buffer (layout: tinygemm_layout.py). */
#pragma once
#include <cstdint>

namespace spark_edge {

/* bf16 W^T [K][N] from the buffer uint8 [N][K/2] and scales_and_zeros bf16 [G][N][2]. */
void int4_dequant_t(const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k, int64_t group,
                    int64_t block, int64_t halves);

/* Whether int4_gemm has its vector path for this layout in this build (else its portable loop runs). */
bool int4_gemm_vectorized(int64_t block, int64_t halves);

/* out bf16 [M][N] = x bf16 [M][K] @ W^T; false if the fp32 scratch could not be allocated. */
bool int4_gemm(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
               int64_t k, int64_t group, int64_t block, int64_t halves);

}  // namespace spark_edge
