/* int4 GEMM with int8 activations, for decode (few rows): out bf16 [M][N] = x [M][K] @ W^T on the CPU int4
 * kernel buffer, as llama.cpp does it (8-bit activations against 4-bit blocks, integer dot products).
 *
 * Activations are quantized per row and per 32-K block, symmetric: d = max|x| / 127, xq = rint(x * (1/d)),
 * so x ~ d * xq. Per weight group g of a channel (scale s, zero z, codes q in 0..15):
 *     sum_k x_k ((q_k - 8) s + z) ~ s * sum_b d_b * sum_{k in b} xq_k q_k + (z - 8 s) * sum_k x_k
 * where the inner sum is exact integer arithmetic and sum_k x_k is taken from the fp32 activations.
 *
 * The buffer layout is ATen's AVX-512 one (64-channel blocks; byte d of a K step holds channel d in its low
 * nibble and channel d + 32 in its high nibble; K steps are 32-byte rows). Unpacking two zmm of four K steps
 * byte by byte (vpunpck{l,h}bw) pairs each channel's codes of steps k and k + 2 (or k + 1 and k + 3) in
 * adjacent bytes, which is what vpmaddubsw multiplies against adjacent activation bytes and adds: one
 * instruction for 64 multiply-adds, against 16 for an fp32 FMA, and no int->float conversion per weight.
 * Sums are kept in int16 over one 32-K block (at most 8 x 2 x 15 x 127 = 30480, no overflow), then
 * widened, scaled by d_b in fp32, and the group's scale and zero applied once per group.
 *
 * Two forms of the inner product (Q8_PAIRS above; Q8_QUADS): with AVX512-VNNI, vpdpbusd multiplies four
 * adjacent bytes and adds them into int32 lanes, so a second level of unpacking (16-bit words of the pairs
 * of steps k, k+2 with those of k+1, k+3) gives each channel its four codes of a K quad in one 32-bit lane,
 * and the sums need no widening. Without VNNI the quads form runs on an exact stand-in (vpmaddubsw then
 * vpmaddwd), so every host can check it; the build's default form is the pairs one there.
 *
 * This file's kernel serves ATen's AVX-512 layout with AVX512BW (Skylake-SP and later, Zen 4); the AVX2 layout
 * has its own, with the same two forms (int4_gemm_q8_avx2.cpp: quads on AVX-VNNI). Elsewhere int4_gemm_q8_supported() is false and the fp32 kernel
 * (int4_gemm.cpp) serves.
 */
#include "bf16.h"
#include "int4_kernels.h"
#include "int4_q8_common.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#ifdef __AVX512BW__
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__)
#define Q8_DEFAULT Q8_QUADS
#else
#define Q8_DEFAULT Q8_PAIRS
#endif
#define QROWS 4 /* activation rows per pass over a block's weights (registers: 4 int16 accumulators a row) */
/* Decode streams the weights from DRAM, and software prefetching keeps the memory busier than the hardware
 * prefetchers alone, but where to and how far ahead is the CPU's: in K quads (128 bytes of a block's weights each).
 * Intel (Xeon AMX host, 2 threads, 1 GiB of 1.7B-shaped weights a token): into L1 16 quads (2 KiB) ahead, 1 row
 * 65.6 -> 54.0 ms, 4 rows 82.5 -> 64.0 against none; 4, 8 and 32 quads within 4% of 16.
 * AMD (EPYC Zen 4, the same weights mapped from a file as serve maps them, alternated runs): into L1 2 KiB ahead
 * was slower than no prefetch at all (21-23 GB/s against 25-29 at 1 row); into L2 64 quads (8 KiB) ahead 28-35 GB/s
 * at 1 row and 18-20 against 16-19 at 4 rows (32, 48 and 96 quads no better, L2 and L1 together worse). */
#define PREFETCH_L1_QUADS 16
#define PREFETCH_L2_QUADS 64
#ifdef __AVX512BW__
static bool prefetch_into_l2() {
    static const bool amd = [] {
        __builtin_cpu_init();  // libgcc reads the CPU's identity in a constructor that need not have run yet
        return __builtin_cpu_is("amd") != 0;
    }();
    return amd;
}
#endif

namespace spark_edge {

void quantize_activations(const uint16_t *x, int64_t m, int64_t k, int8_t *xq, float *d) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < k / Q8_BLOCK; b++) {
            float xf[Q8_BLOCK], amax = 0.0f;
            for (int i = 0; i < Q8_BLOCK; i++) {
                xf[i] = bf16_to_float(x[r * k + b * Q8_BLOCK + i]);
                amax = std::fmax(amax, std::fabs(xf[i]));
            }
            const float db = amax / 127.0f, inv = db > 0.0f ? 1.0f / db : 0.0f;
            d[r * (k / Q8_BLOCK) + b] = db;
            for (int i = 0; i < Q8_BLOCK; i++) {
                const float q = std::rint(xf[i] * inv);
                xq[r * k + b * Q8_BLOCK + i] = (int8_t)(q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q));
            }
        }
}

#ifdef __AVX512BW__
/* Per row, per K quad (steps 4j..4j+3): the 64 activation bytes vpmaddubsw meets after the unpack:
 * 128-bit lanes 0-1 hold (xq[4j], xq[4j+2]) pairs, lanes 2-3 hold (xq[4j+1], xq[4j+3]) pairs. */
static void activation_pairs(const int8_t *xq, int64_t m, int64_t k, __m512i *pairs) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k / 4; j++) {
            const int8_t *q = xq + r * k + 4 * j;
            const short even = (short)(uint16_t)((uint8_t)q[0] | (uint16_t)(uint8_t)q[2] << 8);
            const short odd = (short)(uint16_t)((uint8_t)q[1] | (uint16_t)(uint8_t)q[3] << 8);
            pairs[r * (k / 4) + j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(even)),
                                                         _mm256_set1_epi16(odd), 1);
        }
}

/* int16 sums of the two row halves of an accumulator, widened and added: 16 int32, channel order of the
 * accumulator's lanes 0-1. */
static inline __m512i widen_pairs(__m512i acc) {
    return _mm512_add_epi32(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(acc)),
                            _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(acc, 1)));
}

/* The pairs form: each channel's codes of steps (k, k+2) or (k+1, k+3) in adjacent bytes, against 64-byte
 * activation pairs; vpmaddubsw sums into int16, widened once per 32-K block. */
struct PairsForm {
    using Act = __m512i;
    static inline void weights(__m512i a, __m512i c, __m512i low4, __m512i w[4]) {
        const __m512i plo = _mm512_unpacklo_epi8(a, c), phi = _mm512_unpackhi_epi8(a, c);
        /* w[0]: channels 0-7 and 16-23, w[1]: 8-15 and 24-31, w[2], w[3]: the same + 32 (high nibbles) */
        w[0] = _mm512_and_si512(plo, low4), w[1] = _mm512_and_si512(phi, low4);
        w[2] = _mm512_and_si512(_mm512_srli_epi16(plo, 4), low4), w[3] = _mm512_and_si512(_mm512_srli_epi16(phi, 4), low4);
    }
    static inline __m512i activation(const Act *act) { return _mm512_load_si512(act); }
    static inline __m512i dot(__m512i acc, __m512i w, __m512i x) {
        return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x));
    }
    /* int32 sums of channels 0-15 and 16-31 (of a nibble half) from its two accumulators */
    static inline void natural(__m512i lo, __m512i hi, __m512i *first, __m512i *second) {
        const __m512i even = widen_pairs(lo), odd = widen_pairs(hi);
        *first = _mm512_shuffle_i32x4(even, odd, _MM_SHUFFLE(1, 0, 1, 0));
        *second = _mm512_shuffle_i32x4(even, odd, _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* a block's int32 sums, natural channel order (sums[i]: channels 16 i .. 16 i + 15) */
    static inline void sums(const __m512i acc[4], __m512i out[4]) {
        natural(acc[0], acc[1], &out[0], &out[1]);
        natural(acc[2], acc[3], &out[2], &out[3]);
    }
    static inline void order(__m512i v[4]) { (void)v; }
    static inline int channel(int j) { return j; }
};

/* The quads form: a second unpack level gives each channel its four codes of a K quad in one 32-bit lane, against
 * one broadcast int32 of activations; four-byte dot products sum into int32 with no widening. */
struct QuadsForm {
    using Act = int32_t;
    static inline void weights(__m512i a, __m512i c, __m512i low4, __m512i w[4]) {
        const __m512i plo = _mm512_unpacklo_epi8(a, c), phi = _mm512_unpackhi_epi8(a, c);
        /* steps (k, k+2) of channels 0-7, 16-23, 8-15, 24-31, and (k+1, k+3) of the same channels */
        const __m512i even = _mm512_shuffle_i64x2(plo, phi, _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i odd = _mm512_shuffle_i64x2(plo, phi, _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i lo16 = _mm512_unpacklo_epi16(even, odd), hi16 = _mm512_unpackhi_epi16(even, odd);
        w[0] = _mm512_and_si512(lo16, low4), w[1] = _mm512_and_si512(hi16, low4);
        w[2] = _mm512_and_si512(_mm512_srli_epi16(lo16, 4), low4), w[3] = _mm512_and_si512(_mm512_srli_epi16(hi16, 4), low4);
    }
    static inline __m512i activation(const Act *act) { return _mm512_set1_epi32(*act); }
    /* acc + the four-byte dot products of unsigned w and signed x per 32-bit lane */
    static inline __m512i dot(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
        return _mm512_dpbusd_epi32(acc, w, x);
#else  /* exact here: a pair sums to at most 2 x 15 x 127, far from int16 saturation */
        return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
    }
    /* A block's int32 sums left in lane order (natural() per row and block cost four permutes a row): sums[0]
     * holds channels 0-3, 16-19, 8-11, 24-27, sums[1] 4-7, 20-23, 12-15, 28-31, sums[2], sums[3] the same + 32.
     * The group's scales are put in that order once for all rows (order), and the output is written through
     * channel(), so no row pays for the permutation. */
    static inline void sums(const __m512i acc[4], __m512i out[4]) {
        for (int i = 0; i < 4; i++) out[i] = acc[i];
    }
    /* the channels (of 32) in sums[0]'s lanes; sums[1]'s are the same + 4 */
    static constexpr int8_t kLanes[16] = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    static inline void order(__m512i v[4]) {
        const auto &l = kLanes; /* constexpr: folds into the same constant vectors as written-out literals */
        const __m512i lo = _mm512_setr_epi32(l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7], l[8], l[9], l[10],
                                             l[11], l[12], l[13], l[14], l[15]);
        const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4)); /* constants: folded too */
        const __m512i v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];
        v[0] = _mm512_permutex2var_epi32(v0, lo, v1), v[1] = _mm512_permutex2var_epi32(v0, hi, v1);
        v[2] = _mm512_permutex2var_epi32(v2, lo, v3), v[3] = _mm512_permutex2var_epi32(v2, hi, v3);
    }
    /* the channel (0..63 in the block) at position j = 16 i + lane of the form's order */
    static inline int channel(int j) {
        const int i = j / 16, lane = j % 16;
        return (i >= 2 ? 32 : 0) + kLanes[lane] + (i % 2 ? 4 : 0);
    }
};

/* A group's scales s and zeros z - 8 s of channels ch0 .. ch0 + 63 in Form's order, read once for all rows (the
 * (scale, zero) words are permuted before they are split: four permutes a group, not a row); the next group's are
 * prefetched. */
template <class Form>
static inline void group_scales(const uint32_t *sz32, int64_t g, int64_t groups, int64_t n, int64_t ch0, __m512 s[4],
                                __m512 z[4]) {
    const __m512i high16 = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 eight = _mm512_set1_ps(8.0f);
    if (g + 1 < groups)
        for (int line = 0; line < 4; line++)
            _mm_prefetch((const char *)(sz32 + (g + 1) * n + ch0) + line * 64, _MM_HINT_T0);
    __m512i v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm512_loadu_si512(sz32 + g * n + ch0 + 16 * i);
    Form::order(v);
    for (int i = 0; i < 4; i++) {
        s[i] = _mm512_castsi512_ps(_mm512_slli_epi32(v[i], 16));
        z[i] = _mm512_fnmadd_ps(eight, s[i], _mm512_castsi512_ps(_mm512_and_si512(v[i], high16)));
    }
}

/* One 64-channel block, ROWS_ rows, over all K, in Form: into tot [ROWS_][64] fp32, channels in the form's order
 * (Form::channel). act: the rows' activations in the form's layout, k / 4 per row. Registers: 4 int32 (or int16)
 * accumulators a row; the per-block fp32 sums of a group of several blocks wait in facc (L1), not in registers. */
template <class Form, int ROWS_>
static void block_rows(const typename Form::Act *act, const float *d, const float *xsum, int64_t k, int64_t group,
                       const uint8_t *wb, const uint32_t *sz32, int64_t n, int64_t ch0, float *tot) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const int64_t groups = k / group, quads = k / 4, qblocks = k / Q8_BLOCK, per_group = group / Q8_BLOCK;
    alignas(64) float facc[ROWS_ * 64];
    const bool into_l2 = prefetch_into_l2();
    for (int64_t b = 0; b < qblocks; b++) {
        __m512i acc[ROWS_][4];
        for (int r = 0; r < ROWS_; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_si512();
        for (int64_t j = b * (Q8_BLOCK / 4); j < (b + 1) * (Q8_BLOCK / 4); j++) {
            if (into_l2) {
                _mm_prefetch((const char *)(wb + (j + PREFETCH_L2_QUADS) * 128), _MM_HINT_T1);
                _mm_prefetch((const char *)(wb + (j + PREFETCH_L2_QUADS) * 128 + 64), _MM_HINT_T1);
            } else {
                _mm_prefetch((const char *)(wb + (j + PREFETCH_L1_QUADS) * 128), _MM_HINT_T0);
                _mm_prefetch((const char *)(wb + (j + PREFETCH_L1_QUADS) * 128 + 64), _MM_HINT_T0);
            }
            __m512i w[4];
            Form::weights(_mm512_loadu_si512(wb + j * 128), _mm512_loadu_si512(wb + j * 128 + 64), low4, w);
            for (int r = 0; r < ROWS_; r++) {
                const __m512i xv = Form::activation(act + r * quads + j);
                for (int i = 0; i < 4; i++) acc[r][i] = Form::dot(acc[r][i], w[i], xv);
            }
        }
        const int64_t g = b / per_group;
        const bool first = b % per_group == 0, last = (b + 1) % per_group == 0;
        __m512 s[4], z[4];
        if (last) group_scales<Form>(sz32, g, groups, n, ch0, s, z);
        for (int r = 0; r < ROWS_; r++) {
            __m512i sums[4];
            Form::sums(acc[r], sums);
            const __m512 db = _mm512_set1_ps(d[r * qblocks + b]);
            const __m512 xs = _mm512_set1_ps(last ? xsum[r * groups + g] : 0.0f);
            for (int i = 0; i < 4; i++) {
                float *fa = facc + r * 64 + 16 * i, *t = tot + r * 64 + 16 * i;
                const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), db,
                                                 first ? _mm512_setzero_ps() : _mm512_load_ps(fa));
                if (!last) {
                    _mm512_store_ps(fa, f);
                    continue;
                }
                /* a group ends: tot += s * facc + (z - 8 s) * sum of the group's activations */
                _mm512_storeu_ps(t, _mm512_fmadd_ps(z[i], xs, _mm512_fmadd_ps(s[i], f, _mm512_loadu_ps(t))));
            }
        }
    }
}

/* The activations in the form's layout: 64-byte pairs (Q8_PAIRS) or int32 quads (Q8_QUADS), per row and K quad. */
struct Activations {
    int form;
    const __m512i *pairs;
    const int32_t *quads;
};

template <int ROWS_>
static void block_rows_form(const Activations &act, int64_t r0, const float *d, const float *xsum, int64_t k,
                            int64_t group, const uint8_t *wb, const uint32_t *sz32, int64_t n, int64_t ch0, float *tot) {
    if (act.form == Q8_QUADS)
        block_rows<QuadsForm, ROWS_>(act.quads + r0 * (k / 4), d, xsum, k, group, wb, sz32, n, ch0, tot);
    else
        block_rows<PairsForm, ROWS_>(act.pairs + r0 * (k / 4), d, xsum, k, group, wb, sz32, n, ch0, tot);
}

static void block_all_rows(const Activations &act, const float *d, const float *xsum, int64_t m, int64_t k,
                           int64_t group, const uint8_t *buf, const uint32_t *sz32, int64_t n, int64_t blk,
                           uint16_t *out) {
    const int64_t groups = k / group, qblocks = k / Q8_BLOCK, ch0 = blk * 64;
    const uint8_t *wb = buf + blk * 64 * (k / 2);
    alignas(64) float tot[QROWS * 64];
    int channel[64]; /* where the form's order puts each of tot's 64 sums */
    for (int j = 0; j < 64; j++) channel[j] = act.form == Q8_QUADS ? QuadsForm::channel(j) : PairsForm::channel(j);
    for (int64_t r0 = 0; r0 < m; r0 += QROWS) {
        const int rows = m - r0 < QROWS ? (int)(m - r0) : QROWS;
        memset(tot, 0, sizeof tot);
        const float *dr = d + r0 * qblocks, *xs = xsum + r0 * groups;
        switch (rows) { /* constant row counts, so the accumulators stay in registers */
        case 1: block_rows_form<1>(act, r0, dr, xs, k, group, wb, sz32, n, ch0, tot); break;
        case 2: block_rows_form<2>(act, r0, dr, xs, k, group, wb, sz32, n, ch0, tot); break;
        case 3: block_rows_form<3>(act, r0, dr, xs, k, group, wb, sz32, n, ch0, tot); break;
        default: block_rows_form<QROWS>(act, r0, dr, xs, k, group, wb, sz32, n, ch0, tot); break;
        }
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 64; j++) out[(r0 + r) * n + ch0 + channel[j]] = float_to_bf16(tot[r * 64 + j]);
    }
}

/* out from q on the 64-channel layout, in `form`; false if the activations' scratch could not be allocated. */
static bool int4_gemm_q8_avx512(const Q8Activations &q, const uint8_t *buf, const uint16_t *sz, uint16_t *out,
                                int64_t n, int form) {
    const int64_t m = q.m, k = q.k;
    const size_t bytes = form == Q8_QUADS ? sizeof(int32_t) * (size_t)(m * (k / 4)) : sizeof(__m512i) * (size_t)(m * (k / 4));
    void *scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!scratch) return false;
    const Activations act{form, (const __m512i *)scratch, (const int32_t *)scratch};
    if (form == Q8_QUADS)
        activation_quads(q.xq, m, k, (int32_t *)scratch);
    else
        activation_pairs(q.xq, m, k, (__m512i *)scratch);
    const uint32_t *sz32 = (const uint32_t *)sz;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < n / 64; blk++) block_all_rows(act, q.d, q.xsum, m, k, q.group, buf, sz32, n, blk, out);
    free(scratch);
    return true;
}
#endif

bool int4_gemm_q8_supported(int64_t n, int64_t k, int64_t group, int64_t block, int64_t halves) {
    if (!halves || k % Q8_BLOCK || group % Q8_BLOCK) return false;
#ifdef __AVX512BW__
    if (block == 64 && n % 64 == 0) return true;
#endif
    return block == 32 && n % 32 == 0 && int4_gemm_q8_avx2_built();
}

int int4_gemm_q8_default_form(int64_t block) {
    if (block == 64) return Q8_DEFAULT;
    return int4_gemm_q8_avx_vnni() ? Q8_QUADS : Q8_PAIRS;
}

bool int4_gemm_q8_form_supported(int64_t block, int form) {
    return form == Q8_AUTO || form == Q8_PAIRS || (form == Q8_QUADS && (block == 64 || block == 32));
}

bool int4_gemm_q8(const uint16_t *x, int64_t m, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n,
                  int64_t k, int64_t group, int64_t block, int form) {
    if (!int4_gemm_q8_supported(n, k, group, block, 1) || !int4_gemm_q8_form_supported(block, form)) return false;
    if (form == Q8_AUTO) form = int4_gemm_q8_default_form(block);
    const int64_t groups = k / group, qblocks = k / Q8_BLOCK;
    /* scratch: int8 codes, block scales, group sums */
    char *scratch = (char *)malloc((size_t)(m * k) + sizeof(float) * (size_t)(m * qblocks + m * groups) + 64);
    if (!scratch) return false;
    int8_t *xq = (int8_t *)scratch;
    float *d = (float *)(((uintptr_t)(xq + m * k) + 63) & ~(uintptr_t)63), *xsum = d + m * qblocks;
    quantize_activations(x, m, k, xq, d);
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++) s += bf16_to_float(x[r * k + kk]);
            xsum[r * groups + g] = s;
        }
    const Q8Activations q{xq, d, xsum, m, k, group};
    bool done = false;
    if (block == 32) done = int4_gemm_q8_avx2(q, buf, sz, out, n, form);
#ifdef __AVX512BW__
    if (block == 64) done = int4_gemm_q8_avx512(q, buf, sz, out, n, form);
#endif
    free(scratch);
    return done;
}

}  // namespace spark_edge
