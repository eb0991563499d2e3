/* spark-edge's int4 kernels on the CPU int4 kernel buffer (layout: tinygemm_layout.py). */
#pragma once
#include <cstdint>

namespace spark_edge {

/* bf16 W^T [K][N] from the buffer uint8 [N][K/2] and scales_and_zeros bf16 [G][N][2]. */
void int4_dequant_t(const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k, int64_t group,
                    int64_t block, int64_t halves);

/* bf16 rows [M][K] of W (channels ids[0..M), each in [0, N)) from the same buffer: an embedding lookup. */
void int4_gather_rows(const uint8_t *buf, const uint16_t *sz, const int64_t *ids, int64_t m, uint16_t *out, int64_t n,
                      int64_t k, int64_t group, int64_t block, int64_t halves);

/* Whether int4_gemm has its vector path for this layout in this build (else its portable loop runs). */
bool int4_gemm_vectorized(int64_t block, int64_t halves);

/* out bf16 [M][N] = x bf16 [M][K] @ W^T; false if the fp32 scratch could not be allocated. */
bool int4_gemm(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
               int64_t k, int64_t group, int64_t block, int64_t halves);

/* Whether int4_gemm_bf16 exists for this layout in this build: ATen's AVX-512 layout (64-channel halves blocks)
 * where the compiler targets AVX512-BF16. */
bool int4_gemm_bf16_supported(int64_t block, int64_t halves);

/* out bf16 [M][N] = x bf16 [M][K] @ W^T in tiles of dequantized bf16 weights and vdpbf16ps
 * (int4_gemm_bf16.cpp); false if the build has no such kernel or a tile could not be allocated. */
bool int4_gemm_bf16(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
                    int64_t k, int64_t group);

/* Whether int4_gemm_amx exists for this layout in this build and this process may use AMX tiles (asked of the
 * kernel once): ATen's AVX-512 layout where the compiler targets AMX-BF16. */
bool int4_gemm_amx_supported(int64_t block, int64_t halves);

/* The same product as int4_gemm_bf16 on AMX tiles (int4_gemm_amx.cpp); false if the build or the process has no
 * AMX, K is not a multiple of 32, or a tile could not be allocated. */
bool int4_gemm_amx(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
                   int64_t k, int64_t group);

/* Which tile GEMM int4_linear runs above the native GEMM's rows (the host policy's `tiles`). */
enum { TILES_NONE = 0, TILES_VDP = 1, TILES_AMX = 2 };

/* Whether int4_gemm_q8 serves this shape and layout in this build: ATen's AVX-512 layout (64-channel halves
 * blocks) with AVX512BW, its AVX2 layout (32-channel halves blocks) with AVX2. */
bool int4_gemm_q8_supported(int64_t n, int64_t k, int64_t group, int64_t block, int64_t halves);

/* Forms of int4_gemm_q8's inner product: the layout's default, 2-byte pairs into int16 (vpmaddubsw), 4-byte
 * quads into int32 (vpdpbusd with AVX512-VNNI on the 64-channel layout, AVX-VNNI on the 32-channel one, an exact
 * stand-in without). */
enum { Q8_AUTO = 0, Q8_PAIRS = 1, Q8_QUADS = 2 };

/* The form Q8_AUTO runs on a layout of `block` channels in this build on this CPU. */
int int4_gemm_q8_default_form(int64_t block);

/* Whether `form` exists for a layout of `block` channels. */
bool int4_gemm_q8_form_supported(int64_t block, int form);

/* The same product with the activations quantized to int8 per row and 32-K block (int4_gemm_q8.cpp) on a
 * buffer of `block`-channel halves blocks; false if the scratch could not be allocated or the build has no
 * such kernel. */
bool int4_gemm_q8(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
                  int64_t k, int64_t group, int64_t block, int form = Q8_AUTO);

/* int8 codes xq [M][K] and per-32-K-block scales d [M][K/32] of bf16 activations x [M][K]. */
void quantize_activations(const uint16_t *x, int64_t m, int64_t k, int8_t *xq, float *d);

/* The 8-bit vocabulary table's GEMM (int8_rows_gemm.cpp): out bf16 [M][N] = x bf16 [M][K] @ (codes int8 [N][K] *
 * scale fp32 [N])^T, the activations quantized to int8 per row and 32-K block; false if K is not a multiple of 32
 * or the scratch could not be allocated. */
bool int8_rows_gemm(const uint16_t *x, int64_t m, const int8_t *codes, const float *scale, uint16_t *out, int64_t n,
                    int64_t k);

/* Whether int8_rows_gemm has its vector form in this build (AVX2), else its portable loop runs. */
bool int8_rows_gemm_vectorized();

}  // namespace spark_edge
