/* int4_gemm_q8 on ATen's AVX2 layout, with AVX2 instructions (and AVX-VNNI's where the CPU has them): 32-channel
 * blocks whose byte d of a 16-byte K step holds channel d in its low nibble and channel d + 16 in its high nibble.
 *
 * The arithmetic is int4_gemm_q8.cpp's at half the width. One ymm holds K steps (k, k+1) of a block, a second
 * (k+2, k+3); unpacking them byte by byte (vpunpck{l,h}bw, within each 128-bit lane) leaves each channel's codes of
 * steps (k, k+2) as adjacent bytes of the low lane and those of (k+1, k+3) in the high lane. Two forms of the inner
 * product, as on AVX-512:
 *   pairs  vpmaddubsw against activation pairs broadcast the same way, int16 sums over one 32-K block (at most
 *          8 x 2 x 15 x 127 = 30480, no overflow), widened once per block;
 *   quads  a second unpack level (16-bit words) puts each channel's four codes of a K quad in one 32-bit lane,
 *          against one broadcast int32 of activations: vpdpbusd (AVX-VNNI: Alder Lake, Intel N100/N305, Sapphire
 *          Rapids and later; not AMD Zen 4) sums four products into int32, no widening; without AVX-VNNI an exact
 *          stand-in (vpmaddubsw then vpmaddwd) runs it, so every AVX2 host checks the form.
 * The default form is quads where the CPU has AVX-VNNI (asked at run time: the library may be built for
 * x86-64-v3), pairs elsewhere. Then each block's sums are scaled by its d in fp32, and the group's scale and zero
 * applied once per group.
 *
 * Compiled wherever the compiler targets AVX2, AVX-512 hosts included, so every x86 host checks it on buffers
 * packed in this layout (an AVX-512 host's ATen packs the 64-channel one).
 */
#include "bf16.h"
#include "int4_kernels.h"
#include "int4_q8_common.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QROWS_AVX2 2 /* rows per pass over a block's weights: 2 x (4 int + 4 fp32) accumulators of 16 ymm */

namespace spark_edge {

#ifdef __AVX2__
namespace q8_avx2 {
#define Q8_AVX2_DOT_VNNI 0
#include "int4_gemm_q8_avx2_body.h"
#undef Q8_AVX2_DOT_VNNI
}  // namespace q8_avx2

#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace q8_avx_vnni {
#define Q8_AVX2_DOT_VNNI 1
#include "int4_gemm_q8_avx2_body.h"
#undef Q8_AVX2_DOT_VNNI
}  // namespace q8_avx_vnni
#pragma GCC pop_options
#endif

bool int4_gemm_q8_avx2_built() {
#ifdef __AVX2__
    return true;
#else
    return false;
#endif
}

bool int4_gemm_q8_avx_vnni() {
#ifdef __AVX2__
    static const bool has = __builtin_cpu_supports("avxvnni");
    return has;
#else
    return false;
#endif
}

bool int4_gemm_q8_avx2(const Q8Activations &q, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
                       int form) {
#ifdef __AVX2__
    if (form == Q8_PAIRS) return q8_avx2::gemm<q8_avx2::PairsForm>(q, buf, sz, out, n);
    if (int4_gemm_q8_avx_vnni()) return q8_avx_vnni::gemm<q8_avx_vnni::QuadsForm>(q, buf, sz, out, n);
    return q8_avx2::gemm<q8_avx2::QuadsForm>(q, buf, sz, out, n);
#else
    (void)q, (void)buf, (void)sz, (void)out, (void)n, (void)form;
    return false;
#endif
}

}  // namespace spark_edge
