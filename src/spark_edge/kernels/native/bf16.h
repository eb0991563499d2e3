/* bf16 <-> fp32 for spark-edge's int4 kernels: the conversions c10::BFloat16 makes (round to nearest even), and the
 * project's one definition of a 4-bit weight in bf16. */
#pragma once
#include <cstdint>
#include <cstring>

namespace spark_edge {

inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as c10::BFloat16 does */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* A 4-bit code with its (scale, zero) bf16 pair as bf16: (q - 8) * scale + zero in fp32 ((q - 8) * scale is exact,
 * so a contracted fma gives the same bits), rounded once. */
inline uint16_t dequantize_code(uint32_t code, const uint16_t *sz_pair) {
    return float_to_bf16((float)((int32_t)code - 8) * bf16_to_float(sz_pair[0]) + bf16_to_float(sz_pair[1]));
}

}  // namespace spark_edge
