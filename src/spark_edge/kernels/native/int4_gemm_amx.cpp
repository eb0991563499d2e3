/* int4 GEMM in tiles on AMX (tdpbf16ps), for prefill on hosts whose process may use AMX tiles:
 * out bf16 [M][N] = x bf16 [M][K] @ W^T, where W is never dequantized as a whole matrix.
 *
 * The weight is taken a panel of bf16 tiles at a time (bf16_tiles.h: up to 4 blocks of 64 channels x up to 512 K
 * steps, in L2, already in the pair-interleaved layout an AMX B tile reads: 16 rows of K pairs x 16 channels, row
 * stride 256 bytes), so the kernel needs no repacking and reads the activations once per 256 channels. The rows run
 * over it 32 at a time: two A tiles of 16 rows x 32 K (straight from the row-major activations), two B tiles of 32
 * K x 16 channels, four C tiles of fp32 sums (2 x 2: 32 rows x 32 channels), once per 32 channels of the panel. A last
 * chunk of fewer than 32 rows runs on a configuration with that many rows (one A tile and two C tiles at 16 or
 * fewer). fp32 sums live in a per-thread buffer between K tiles and are rounded once to bf16 (nearest even).
 *
 * Tile state: each thread loads its configuration before its first tile instruction of the call and releases
 * the tiles when it is done (tilerelease), so a kernel that runs next on that thread (vLLM's AMX attention,
 * oneDNN's brgemm) starts from the init state and loads its own configuration, as they do. Tile data is a
 * dynamically enabled XSAVE feature on Linux: the process must have asked for it (arch_prctl
 * ARCH_REQ_XCOMP_PERM); int4_gemm_amx_supported() asks and is false where the kernel refuses, and the other
 * kernels serve.
 *
 * Built only where the compiler targets AMX-BF16 and AVX512-BF16 (-march=native on Sapphire Rapids and later).
 */
#include "bf16_tiles.h"
#include "int4_kernels.h"

#include <cstdint>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SPARK_EDGE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace spark_edge {

#ifdef SPARK_EDGE_AMX
namespace {

using bf16_tiles::NB;
constexpr int TILE_ROWS = 16;     /* rows of an A or C tile, K pairs of a B tile */
constexpr int TILE_K = 32;        /* K steps of an A tile row (64 bytes of bf16) */
constexpr int CHUNK = 2 * TILE_ROWS;  /* rows a pass: two A tiles */
/* Most 64-channel blocks a pass over the activations: 4 read them a quarter as often as 1 (1.7B shapes at 512 rows,
 * Xeon AMX host: 1.2-1.4x faster); 2, 8 and tiles of up to 1024 or 2048 K steps measured within noise of this */
constexpr int PANEL = 4;
constexpr int64_t MAX_TILE_K = 512; /* 4 blocks x 512 K x bf16 = 256 KiB of tiles, in L2 */
/* Tile registers (macros: GCC's tile intrinsics paste the number into the instruction text). */
#define C00 0
#define C01 1
#define C10 2
#define C11 3
#define A0 4
#define A1 5
#define B0 6
#define B1 7

struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

bool amx_permitted() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* The 2 x 2 pattern over `steps` steps of 32 K: C (rows x 32 channels) += A (rows x 32 K) . B (32 K x 32 ch).
 * TWO: a second A tile (rows 16..). a: the activations at the chunk's first row and K step; t: the tile at its
 * first K pair and channel; c: the sums at the chunk's first row and channel (ldc floats a row). */
template <bool TWO>
void chunk_over_half(const uint16_t *a, int64_t lda_bytes, const uint32_t *t, int64_t steps, float *c, int64_t ldc,
                     bool first) {
    const int64_t ldc_bytes = ldc * (int64_t)sizeof(float), ldb = NB * sizeof(uint32_t);
    float *c1 = c + TILE_ROWS * ldc;
    if (first) {
        _tile_zero(C00);
        _tile_zero(C01);
        if (TWO) {
            _tile_zero(C10);
            _tile_zero(C11);
        }
    } else {
        _tile_loadd(C00, c, ldc_bytes);
        _tile_loadd(C01, c + 16, ldc_bytes);
        if (TWO) {
            _tile_loadd(C10, c1, ldc_bytes);
            _tile_loadd(C11, c1 + 16, ldc_bytes);
        }
    }
    const uint16_t *a1 = (const uint16_t *)((const char *)a + TILE_ROWS * lda_bytes);
    for (int64_t s = 0; s < steps; s++) {
        const uint32_t *b = t + s * TILE_ROWS * NB;
        _tile_loadd(A0, a + s * TILE_K, lda_bytes);
        _tile_loadd(B0, b, ldb);
        _tile_dpbf16ps(C00, A0, B0);
        _tile_loadd(B1, b + 16, ldb);
        _tile_dpbf16ps(C01, A0, B1);
        if (TWO) {
            _tile_loadd(A1, a1 + s * TILE_K, lda_bytes);
            _tile_dpbf16ps(C10, A1, B0);
            _tile_dpbf16ps(C11, A1, B1);
        }
    }
    _tile_stored(C00, c, ldc_bytes);
    _tile_stored(C01, c + 16, ldc_bytes);
    if (TWO) {
        _tile_stored(C10, c1, ldc_bytes);
        _tile_stored(C11, c1 + 16, ldc_bytes);
    }
}

/* The micro-kernel of run_tiles (bf16_tiles.h), one per thread: its tile configuration lives as long as the
 * call's work on that thread, and the tiles are released when it ends. */
struct AmxRows {
    static constexpr int kPanel = PANEL;
    static constexpr bool kAlwaysAcc = true; /* C tiles are stored to fp32 sums, then rounded */

    /* K split evenly into tiles of at most MAX_TILE_K steps, in whole A-tile rows (K = 576: two of 288, not
     * 512 + 64, whose short second pass costs a round trip of the sums for 2 steps) */
    static int64_t tile_k(int64_t k) {
        const int64_t tiles = (k + MAX_TILE_K - 1) / MAX_TILE_K;
        return ((k + tiles - 1) / tiles + TILE_K - 1) / TILE_K * TILE_K;
    }
    TileConfig config;
    int configured = 0; /* rows of the loaded configuration (0: none) */

    ~AmxRows() {
        if (configured) _tile_release();
    }

    void configure(int rows) {
        if (rows == configured) return;
        const int r0 = rows < TILE_ROWS ? rows : TILE_ROWS, r1 = rows - r0; /* rows of the first and second A */
        const int tile_rows[8] = {r0, r0, r1, r1, r0, r1, TILE_ROWS, TILE_ROWS}; /* by tile register */
        config = TileConfig{};
        for (int tile = 0; tile < 8; tile++) { /* a tile of 0 rows stays unconfigured (no second A at <= 16) */
            config.rows[tile] = (uint8_t)tile_rows[tile];
            config.colsb[tile] = tile_rows[tile] ? 64 : 0;
        }
        _tile_loadconfig(&config);
        configured = rows;
    }

    void run(const uint16_t *x, int64_t k, int64_t k0, const uint32_t *t, int64_t kc, float *acc, bool first,
             bool last, uint16_t *out, int64_t n, int64_t valid, int64_t rows) {
        constexpr int64_t ldc = PANEL * NB;
        const int64_t steps = kc / TILE_K, halves = (valid + 31) / 32; /* 32-channel halves holding channels */
        for (int64_t r0 = 0; r0 < rows; r0 += CHUNK) {
            const int chunk = (int)(rows - r0 < CHUNK ? rows - r0 : CHUNK);
            configure(chunk);
            const uint16_t *a = x + r0 * k + k0;
            float *c = acc + r0 * ldc;
            for (int64_t h = 0; h < halves; h++) { /* channels 32h .. 32h + 31 of the panel */
                const uint32_t *th = t + (h / 2) * (kc / 2) * NB + 32 * (h % 2);
                if (chunk > TILE_ROWS)
                    chunk_over_half<true>(a, k * 2, th, steps, c + 32 * h, ldc, first);
                else
                    chunk_over_half<false>(a, k * 2, th, steps, c + 32 * h, ldc, first);
            }
            if (last)
                for (int r = 0; r < chunk; r++)
                    for (int64_t c0 = 0; c0 < valid; c0 += NB) {
                        const float *row = c + r * ldc + c0;
                        const __m512 sums[4] = {_mm512_load_ps(row), _mm512_load_ps(row + 16),
                                                _mm512_load_ps(row + 32), _mm512_load_ps(row + 48)};
                        bf16_tiles::store_row_bf16(sums, out + (r0 + r) * n + c0, valid - c0 < NB ? valid - c0 : NB);
                    }
        }
    }
};

#undef C00
#undef C01
#undef C10
#undef C11
#undef A0
#undef A1
#undef B0
#undef B1

}  // namespace
#endif

bool int4_gemm_amx_supported(int64_t block, int64_t halves) {
#ifdef SPARK_EDGE_AMX
    return block == NB && halves && amx_permitted();
#else
    (void)block, (void)halves;
    return false;
#endif
}

bool int4_gemm_amx(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
                   int64_t k, int64_t group) {
#ifdef SPARK_EDGE_AMX
    if (k % TILE_K || group % 2 || n % 2 || !amx_permitted()) return false;
    return bf16_tiles::run_tiles<AmxRows>(x, m, buf, sz, out, n, k, group);
#else
    (void)x, (void)m, (void)buf, (void)sz, (void)out, (void)n, (void)k, (void)group;
    return false;
#endif
}

}  // namespace spark_edge
