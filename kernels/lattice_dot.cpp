// shardwire: the dot product of a row of IQ2_XXS or IQ3_XXS weights with a row of Q8_K activations,
// with AVX-512, in place of ggml's (ggml_vec_dot_iq2_xxs_q8_K and _iq3_xxs_, whose AVX2 forms they
// are on x86) wherever ggml calls it: a decode step's one row, and each row of a prompt chunk that
// is not dequantized, the experts' rows too. A block is 256 values in 8 groups of 32. A group is
// lattice points (IQ2_XXS: 4 indices into iq2xxs_grid, 8 magnitudes each; IQ3_XXS: 8 into
// iq3xxs_grid, 4 each) and a word of 4 times 7 sign bits (the eighth of each 8 is their parity) and
// a 4-bit scale. ggml builds 32 values at a time from table reads of magnitudes and 4 of signs;
// these take a block's signs and scales from its words in a few vector steps, read the magnitudes
// 64 values at a time and negate the activations under a mask: on the AMD EPYC (Zen 4), weights in
// cache, IQ2_XXS 1.43x and IQ3_XXS 1.32x ggml's speed. Their integer sums are ggml's, and they scale
// and add them as ggml's AVX2 forms do: ggml's bits.
//
// kernels/build_backend.py appends this file to ggml-cpu/repack.cpp, after products.cpp; the
// patched type traits (ggml-cpu.c) call shardwire_vec_dot_iq2_xxs_q8_K and _iq3_xxs_q8_K.

#include "quants.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
namespace {

// where a type keeps a block's group words and lattice points, and what its sums are scaled by
template <typename Block> struct lattice;

template <> struct lattice<block_iq2_xxs> {  // each group's 4 indices, then its word
    static constexpr float scale = 0.125f;

    static __m512i words(const block_iq2_xxs & b) {  // group g's word in the low 32 bits of lane g
        return _mm512_srli_epi64(_mm512_loadu_si512(b.qs), 32);
    }

    static __m512i magnitudes(const block_iq2_xxs & b, int pair) {  // groups 2 * pair and the next
        const uint8_t * at = (const uint8_t *) b.qs + 16 * pair;
        return _mm512_set_epi64(
            (int64_t) iq2xxs_grid[at[11]], (int64_t) iq2xxs_grid[at[10]], (int64_t) iq2xxs_grid[at[9]],
            (int64_t) iq2xxs_grid[at[8]], (int64_t) iq2xxs_grid[at[3]], (int64_t) iq2xxs_grid[at[2]],
            (int64_t) iq2xxs_grid[at[1]], (int64_t) iq2xxs_grid[at[0]]);
    }
};

template <> struct lattice<block_iq3_xxs> {  // every group's 8 indices, then the 8 words
    static constexpr float scale = 0.25f;

    static __m512i words(const block_iq3_xxs & b) {
        return _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *) (b.qs + QK_K / 4)));
    }

    static __m512i magnitudes(const block_iq3_xxs & b, int pair) {  // two points to a 64-bit lane
        const uint8_t * at = b.qs + 16 * pair;
        const auto two = [at](int i) { return (int64_t) iq3xxs_grid[at[i]] | (int64_t) iq3xxs_grid[at[i + 1]] << 32; };
        return _mm512_set_epi64(two(14), two(12), two(10), two(8), two(6), two(4), two(2), two(0));
    }
};

inline float lattice_sum_8(const __m256 x) {  // in the order of ggml's hsum_float_8
    __m128 sum = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

template <typename Block>
float lattice_row(const Block * x, const block_q8_K * y, int blocks) {
    // the 4 sign fields of each group's word (bits 0, 7, 14 and 21), one to a byte
    const __m512i fields = _mm512_set1_epi64(0x0000000015'0E'07'00);
    const __m512i seven = _mm512_set1_epi8(0x7F), one = _mm512_set1_epi8(1);
    // the groups' scales (the low 32 bits of lane g) as 32-bit lanes: 0-3 and 4-7 those of groups
    // 0, 2, 4, 6, lanes 8-15 those of groups 1, 3, 5, 7
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 2, 6, 10, 14, 2, 6, 10, 14);
    alignas(32) uint64_t signs[4];  // pair p of groups (2p, 2p + 1): bit j set where its value j is negative
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < blocks; i++) {
        const __m512i words = lattice<Block>::words(x[i]);
        const __m512i bits = _mm512_and_si512(_mm512_multishift_epi64_epi8(fields, words), seven);
        const __m512i parity = _mm512_and_si512(_mm512_popcnt_epi8(bits), one);
        _mm256_store_si256((__m256i *) signs, _mm512_cvtepi64_epi32(_mm512_or_si512(bits, _mm512_slli_epi16(parity, 7))));
        // 2 * scale + 1 (the word's top 4 bits), in both 16-bit halves
        const __m512i scale = _mm512_or_si512(_mm512_srli_epi64(words, 27), _mm512_set1_epi64(1));
        const __m512i scales = _mm512_permutexvar_epi32(order, _mm512_or_si512(scale, _mm512_slli_epi64(scale, 16)));
        __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            const __m512i a = _mm512_loadu_si512(y[i].qs + 64 * p);
            const __m512i signed_a = _mm512_mask_sub_epi8(a, _cvtu64_mask64(signs[p]), _mm512_setzero_si512(), a);
            // lanes 0-7 group 2p's scale, 8-15 group 2p + 1's
            const __m512i scale_p = _mm512_shuffle_epi32(scales, (_MM_PERM_ENUM) (p * 0x55));
            sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(lattice<Block>::magnitudes(x[i], p), signed_a), scale_p);
        }
        // lane l of ggml's sums: values 4l-4l+3 of every group, even groups' and odd groups' added
        const __m256i lanes = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
        const float d = GGML_CPU_FP16_TO_FP32(x[i].d) * y[i].d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc);
    }
    return lattice<Block>::scale * lattice_sum_8(acc);
}

}  // namespace

extern "C" void shardwire_vec_dot_iq2_xxs_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy,
                                               size_t by, int nrc) {
    if (!shardwire_product_on(SHARDWIRE_IQ2_XXS_DOT)) {
        ggml_vec_dot_iq2_xxs_q8_K(n, s, bs, vx, bx, vy, by, nrc);
        return;
    }
    *s = lattice_row((const block_iq2_xxs *) vx, (const block_q8_K *) vy, n / QK_K);
}

extern "C" void shardwire_vec_dot_iq3_xxs_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy,
                                               size_t by, int nrc) {
    if (!shardwire_product_on(SHARDWIRE_IQ3_XXS_DOT)) {
        ggml_vec_dot_iq3_xxs_q8_K(n, s, bs, vx, bx, vy, by, nrc);
        return;
    }
    *s = lattice_row((const block_iq3_xxs *) vx, (const block_q8_K *) vy, n / QK_K);
}
#else
extern "C" void shardwire_vec_dot_iq2_xxs_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy,
                                               size_t by, int nrc) {
    ggml_vec_dot_iq2_xxs_q8_K(n, s, bs, vx, bx, vy, by, nrc);
}

extern "C" void shardwire_vec_dot_iq3_xxs_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy,
                                               size_t by, int nrc) {
    ggml_vec_dot_iq3_xxs_q8_K(n, s, bs, vx, bx, vy, by, nrc);
}
#endif
