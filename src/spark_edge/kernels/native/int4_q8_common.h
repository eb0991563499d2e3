/* What the int8-activation kernels (int4_gemm_q8.cpp, int4_gemm_q8_avx2.cpp) share: the activation block and
 * the quantized activations of one call. */
#pragma once
#include <cstdint>

namespace spark_edge {

constexpr int64_t Q8_BLOCK = 32; /* activation quantization block along K */

/* x ~ d * xq per row and 32-K block; xsum: the fp32 activations summed per row and weight group. */
struct Q8Activations {
    const int8_t *xq;  /* [M][K] */
    const float *d;    /* [M][K / Q8_BLOCK] */
    const float *xsum; /* [M][K / group] */
    int64_t m, k, group;
};

/* Per row, per K quad j of int8 codes xq [M][K]: the int32 a quads form's vpdpbusd meets in every lane, bytes
 * (xq[4j], xq[4j+2], xq[4j+1], xq[4j+3]) in the order two unpack levels leave each channel's codes (both layouts). */
inline void activation_quads(const int8_t *xq, int64_t m, int64_t k, int32_t *quads) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k / 4; j++) {
            const int8_t *q = xq + r * k + 4 * j;
            quads[r * (k / 4) + j] = (int32_t)((uint32_t)(uint8_t)q[0] | (uint32_t)(uint8_t)q[2] << 8 |
                                               (uint32_t)(uint8_t)q[1] << 16 | (uint32_t)(uint8_t)q[3] << 24);
        }
}

/* Whether this build has the AVX2 kernel (the compiler targets AVX2). */
bool int4_gemm_q8_avx2_built();

/* Whether this CPU has AVX-VNNI (asked at run time), what the AVX2 kernel's quads form runs on. */
bool int4_gemm_q8_avx_vnni();

/* out bf16 [M][N] from q on a buffer in ATen's AVX2 layout (32-channel halves blocks, N % 32 == 0), in `form`
 * (Q8_PAIRS or Q8_QUADS); false if the scratch could not be allocated or the build has no AVX2. */
bool int4_gemm_q8_avx2(const Q8Activations &q, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
                       int form);

}  // namespace spark_edge
