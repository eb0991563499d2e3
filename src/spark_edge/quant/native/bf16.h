/* bf16 <-> fp32 for spark-edge's int4 kernels: the conversions c10::BFloat16 makes (round to nearest even). */
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

}  // namespace spark_edge
