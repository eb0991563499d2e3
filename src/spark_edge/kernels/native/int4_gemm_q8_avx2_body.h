/* The body of int4_gemm_q8's AVX2 kernel, included twice by int4_gemm_q8_avx2.cpp: once for AVX2 (the quads form's
 * dot product on its exact stand-in) and once under `#pragma GCC target("avxvnni")`, where it is vpdpbusd in 256-bit
 * registers (Q8_AVX2_DOT_VNNI 1). Templates take the target options of where they are defined, so each inclusion
 * compiles its own copy. No include guard, no headers: the includer's namespace and <immintrin.h> hold. */

/* Per row, per K quad j: the 32 activation bytes vpmaddubsw meets after the unpack, the pair (xq[4j], xq[4j+2])
 * in every 16-bit word of the low lane and (xq[4j+1], xq[4j+3]) in the high lane. */
static void activation_pairs(const int8_t *xq, int64_t m, int64_t k, __m256i *pairs) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k / 4; j++) {
            const int8_t *q = xq + r * k + 4 * j;
            const short even = (short)(uint16_t)((uint8_t)q[0] | (uint16_t)(uint8_t)q[2] << 8);
            const short odd = (short)(uint16_t)((uint8_t)q[1] | (uint16_t)(uint8_t)q[3] << 8);
            pairs[r * (k / 4) + j] = _mm256_set_m128i(_mm_set1_epi16(odd), _mm_set1_epi16(even));
        }
}

/* The pairs form: each channel's codes of steps (k, k+2) (low lane) or (k+1, k+3) (high lane) in adjacent bytes;
 * vpmaddubsw sums into int16, widened once per 32-K block. Channels in natural order. */
struct PairsForm {
    using Act = __m256i;
    static inline void weights(__m256i a, __m256i c, __m256i low4, __m256i w[4]) {
        const __m256i plo = _mm256_unpacklo_epi8(a, c), phi = _mm256_unpackhi_epi8(a, c);
        /* channels 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles) */
        w[0] = _mm256_and_si256(plo, low4), w[1] = _mm256_and_si256(phi, low4);
        w[2] = _mm256_and_si256(_mm256_srli_epi16(plo, 4), low4), w[3] = _mm256_and_si256(_mm256_srli_epi16(phi, 4), low4);
    }
    static inline __m256i activation(const Act *act) { return _mm256_load_si256(act); }
    static inline __m256i dot(__m256i acc, __m256i w, __m256i x) {
        return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x));
    }
    /* int32 sums of 8 channels: the two lanes' int16 sums (steps k, k+2 and k+1, k+3) widened and added */
    static inline __m256i widen(__m256i acc) {
        return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc)),
                                _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc, 1)));
    }
    static inline void order(__m256i v[4]) { (void)v; }
    static inline int channel(int j) { return j; }
};

/* The quads form: a second unpack level gives each channel its four codes of a K quad in one 32-bit lane, against
 * one broadcast int32 of activations; four-byte dot products sum into int32 with no widening. Lane order:
 * w[0] holds channels 0-3 and 8-11, w[1] 4-7 and 12-15, w[2] and w[3] the same + 16 (high nibbles). */
struct QuadsForm {
    using Act = int32_t;
    static inline void weights(__m256i a, __m256i c, __m256i low4, __m256i w[4]) {
        const __m256i plo = _mm256_unpacklo_epi8(a, c), phi = _mm256_unpackhi_epi8(a, c);
        /* steps (k, k+2) of channels 0-7 | 8-15, and (k+1, k+3) of the same */
        const __m256i even = _mm256_permute2x128_si256(plo, phi, 0x20);
        const __m256i odd = _mm256_permute2x128_si256(plo, phi, 0x31);
        const __m256i lo16 = _mm256_unpacklo_epi16(even, odd), hi16 = _mm256_unpackhi_epi16(even, odd);
        w[0] = _mm256_and_si256(lo16, low4), w[1] = _mm256_and_si256(hi16, low4);
        w[2] = _mm256_and_si256(_mm256_srli_epi16(lo16, 4), low4), w[3] = _mm256_and_si256(_mm256_srli_epi16(hi16, 4), low4);
    }
    static inline __m256i activation(const Act *act) { return _mm256_set1_epi32(*act); }
    /* acc + the four-byte dot products of unsigned w and signed x per 32-bit lane */
    static inline __m256i dot(__m256i acc, __m256i w, __m256i x) {
#if Q8_AVX2_DOT_VNNI
        return _mm256_dpbusd_avx_epi32(acc, w, x);
#else  /* exact here: a pair sums to at most 2 x 15 x 127, far from int16 saturation */
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
    }
    static inline __m256i widen(__m256i acc) { return acc; }
    /* a group's (scale, zero) words of channels 0-7, 8-15, 16-23, 24-31 put in the lane order above */
    static inline void order(__m256i v[4]) {
        const __m256i v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];
        v[0] = _mm256_permute2x128_si256(v0, v1, 0x20), v[1] = _mm256_permute2x128_si256(v0, v1, 0x31);
        v[2] = _mm256_permute2x128_si256(v2, v3, 0x20), v[3] = _mm256_permute2x128_si256(v2, v3, 0x31);
    }
    /* the channel (0..31 in the block) at position j = 8 i + lane of that order */
    static inline int channel(int j) {
        const int i = j / 8, lane = j % 8;
        return (i >= 2 ? 16 : 0) + (i % 2 ? 4 : 0) + (lane < 4 ? lane : lane + 4);
    }
};

/* One 32-channel block, ROWS_ rows, over all K, in Form: into tot [ROWS_][32] fp32, channels in the form's order
 * (Form::channel). act: the rows' activations in the form's layout, k / 4 per row. */
template <class Form, int ROWS_>
static void block_rows(const typename Form::Act *act, const float *d, const float *xsum, int64_t k, int64_t group,
                       const uint8_t *wb, const uint32_t *sz32, int64_t n, int64_t ch0, float *tot) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), high16 = _mm256_set1_epi32((int)0xffff0000u);
    const __m256 eight = _mm256_set1_ps(8.0f);
    const int64_t groups = k / group, quads = k / 4, qblocks = k / Q8_BLOCK;
    __m256 facc[ROWS_][4];
    for (int r = 0; r < ROWS_; r++)
        for (int i = 0; i < 4; i++) facc[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < qblocks; b++) {
        __m256i acc[ROWS_][4];
        for (int r = 0; r < ROWS_; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_si256();
        for (int64_t j = b * (Q8_BLOCK / 4); j < (b + 1) * (Q8_BLOCK / 4); j++) {
            __m256i w[4];
            Form::weights(_mm256_loadu_si256((const __m256i *)(wb + j * 64)),
                          _mm256_loadu_si256((const __m256i *)(wb + j * 64 + 32)), low4, w);
            for (int r = 0; r < ROWS_; r++) {
                const __m256i xv = Form::activation(act + r * quads + j);
                for (int i = 0; i < 4; i++) acc[r][i] = Form::dot(acc[r][i], w[i], xv);
            }
        }
        for (int r = 0; r < ROWS_; r++) {
            const __m256 db = _mm256_set1_ps(d[r * qblocks + b]);
            for (int i = 0; i < 4; i++)
                facc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Form::widen(acc[r][i])), db, facc[r][i]);
        }
        if ((b + 1) * Q8_BLOCK % group) continue;
        /* a group ends: tot += s * facc + (z - 8 s) * the group's activation sum, scale and zero read once */
        const int64_t g = (b + 1) * Q8_BLOCK / group - 1;
        if (g + 1 < groups)
            for (int line = 0; line < 2; line++)
                _mm_prefetch((const char *)(sz32 + (g + 1) * n + ch0) + line * 64, _MM_HINT_T0);
        __m256i v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_si256((const __m256i *)(sz32 + g * n + ch0 + 8 * i));
        Form::order(v);
        for (int i = 0; i < 4; i++) {
            const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v[i], 16));
            const __m256 z = _mm256_fnmadd_ps(eight, s, _mm256_castsi256_ps(_mm256_and_si256(v[i], high16)));
            for (int r = 0; r < ROWS_; r++) {
                const __m256 t = _mm256_loadu_ps(tot + r * 32 + 8 * i);
                const __m256 xs = _mm256_set1_ps(xsum[r * groups + g]);
                _mm256_storeu_ps(tot + r * 32 + 8 * i, _mm256_fmadd_ps(z, xs, _mm256_fmadd_ps(s, facc[r][i], t)));
                facc[r][i] = _mm256_setzero_ps();
            }
        }
    }
}

template <class Form>
static void block_all_rows(const typename Form::Act *act, const float *d, const float *xsum, int64_t m, int64_t k,
                           int64_t group, const uint8_t *buf, const uint32_t *sz32, int64_t n, int64_t blk,
                           uint16_t *out) {
    const int64_t groups = k / group, qblocks = k / Q8_BLOCK, ch0 = blk * 32, quads = k / 4;
    const uint8_t *wb = buf + blk * 32 * (k / 2);
    alignas(32) float tot[QROWS_AVX2 * 32];
    for (int64_t r0 = 0; r0 < m; r0 += QROWS_AVX2) {
        const int rows = m - r0 < QROWS_AVX2 ? (int)(m - r0) : QROWS_AVX2;
        memset(tot, 0, sizeof tot);
        const typename Form::Act *a = act + r0 * quads;
        const float *dr = d + r0 * qblocks, *xs = xsum + r0 * groups;
        if (rows == 1)
            block_rows<Form, 1>(a, dr, xs, k, group, wb, sz32, n, ch0, tot);
        else
            block_rows<Form, QROWS_AVX2>(a, dr, xs, k, group, wb, sz32, n, ch0, tot);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 32; j++) out[(r0 + r) * n + ch0 + Form::channel(j)] = float_to_bf16(tot[r * 32 + j]);
    }
}

/* out from q in Form; false if the activations' scratch could not be allocated. */
template <class Form>
static bool gemm(const Q8Activations &q, const uint8_t *buf, const uint16_t *sz, uint16_t *out, int64_t n) {
    const int64_t m = q.m, k = q.k;
    const size_t bytes = sizeof(typename Form::Act) * (size_t)(m * (k / 4));
    void *scratch = aligned_alloc(32, (bytes + 31) / 32 * 32);
    if (!scratch) return false;
    typename Form::Act *act = (typename Form::Act *)scratch;
    if constexpr (sizeof(typename Form::Act) == sizeof(int32_t))
        activation_quads(q.xq, m, k, (int32_t *)act);
    else
        activation_pairs(q.xq, m, k, (__m256i *)act);
    const uint32_t *sz32 = (const uint32_t *)sz;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < n / 32; blk++) block_all_rows<Form>(act, q.d, q.xsum, m, k, q.group, buf, sz32, n, blk, out);
    free(scratch);
    return true;
}
