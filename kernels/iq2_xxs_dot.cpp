// shardwire: the dot product of a row of IQ2_XXS weights with a row of Q8_K activations, with
// AVX-512, in place of ggml's (ggml_vec_dot_iq2_xxs_q8_K, whose AVX2 form it is on x86) wherever
// ggml calls it: a decode step's one row, and each row of a prompt chunk that is not dequantized.
// A block is 256 values in 8 groups of 32, each stored as 4 indices into the lattice
// (iq2xxs_grid: 8 magnitudes each) and a word of 4 times 7 sign bits (the eighth is their parity)
// and a 4-bit scale. ggml builds 32 values at a time from 4 table reads of magnitudes and 4 of
// signs; this product takes a block's signs and scales from its 64 bytes in a few vector steps,
// reads the magnitudes 64 values at a time and negates the activations under a mask: 1.43x
// ggml's speed on the AMD EPYC (Zen 4) on weights in cache. Its integer sums are ggml's, and it
// scales and adds them as ggml's AVX2 form does: ggml's bits.
//
// kernels/build_backend.py appends this file to ggml-cpu/repack.cpp, after products.cpp; the
// patched type traits (ggml-cpu.c) call shardwire_vec_dot_iq2_xxs_q8_K for IQ2_XXS.

#include "quants.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
namespace {

inline float iq2_xxs_sum_8(const __m256 x) {  // in the order of ggml's hsum_float_8
    __m128 sum = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

float iq2_xxs_row(const block_iq2_xxs * x, const block_q8_K * y, int blocks) {
    // per group (a 64-bit lane: 4 index bytes, then its word): the 4 sign fields at bits 32, 39,
    // 46 and 53, one to a byte
    const __m512i fields = _mm512_set1_epi64(0x00000000352E2720);
    const __m512i seven = _mm512_set1_epi8(0x7F), one = _mm512_set1_epi8(1);
    // the groups' scales (from the low 32 bits of lane g) as 32-bit lanes: 0-3 and 4-7 those of
    // groups 0, 2, 4, 6, lanes 8-15 those of groups 1, 3, 5, 7
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 2, 6, 10, 14, 2, 6, 10, 14);
    alignas(32) uint64_t signs[4];  // pair p of groups (2p, 2p + 1): bit j set where its value j is negative
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < blocks; i++) {
        const __m512i q = _mm512_loadu_si512(x[i].qs);
        const __m512i bits = _mm512_and_si512(_mm512_multishift_epi64_epi8(fields, q), seven);
        const __m512i parity = _mm512_and_si512(_mm512_popcnt_epi8(bits), one);
        _mm256_store_si256((__m256i *) signs, _mm512_cvtepi64_epi32(_mm512_or_si512(bits, _mm512_slli_epi16(parity, 7))));
        // 2 * scale + 1, in both 16-bit halves
        const __m512i scale = _mm512_or_si512(_mm512_srli_epi64(q, 59), _mm512_set1_epi64(1));
        const __m512i scales = _mm512_permutexvar_epi32(order, _mm512_or_si512(scale, _mm512_slli_epi64(scale, 16)));
        const uint8_t * indices = (const uint8_t *) x[i].qs;  // group g's 4 at 8g
        __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            const uint8_t * at = indices + 16 * p;
            const __m512i magnitudes = _mm512_set_epi64(
                (int64_t) iq2xxs_grid[at[11]], (int64_t) iq2xxs_grid[at[10]], (int64_t) iq2xxs_grid[at[9]],
                (int64_t) iq2xxs_grid[at[8]], (int64_t) iq2xxs_grid[at[3]], (int64_t) iq2xxs_grid[at[2]],
                (int64_t) iq2xxs_grid[at[1]], (int64_t) iq2xxs_grid[at[0]]);
            const __m512i a = _mm512_loadu_si512(y[i].qs + 64 * p);
            const __m512i signed_a = _mm512_mask_sub_epi8(a, _cvtu64_mask64(signs[p]), _mm512_setzero_si512(), a);
            // lanes 0-7 group 2p's scale, 8-15 group 2p + 1's
            const __m512i scale_p = _mm512_shuffle_epi32(scales, (_MM_PERM_ENUM) (p * 0x55));
            sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(magnitudes, signed_a), scale_p);
        }
        // lane l of ggml's sums: values 4l-4l+3 of every group, even groups' and odd groups' added
        const __m256i lanes = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
        const float d = GGML_CPU_FP16_TO_FP32(x[i].d) * y[i].d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc);
    }
    return 0.125f * iq2_xxs_sum_8(acc);
}

}  // namespace

extern "C" void shardwire_vec_dot_iq2_xxs_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy,
                                               size_t by, int nrc) {
    if (!shardwire_product_on(SHARDWIRE_IQ2_XXS_DOT)) {
        ggml_vec_dot_iq2_xxs_q8_K(n, s, bs, vx, bx, vy, by, nrc);
        return;
    }
    *s = iq2_xxs_row((const block_iq2_xxs *) vx, (const block_q8_K *) vy, n / QK_K);
}
#else
extern "C" void shardwire_vec_dot_iq2_xxs_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy,
                                               size_t by, int nrc) {
    ggml_vec_dot_iq2_xxs_q8_K(n, s, bs, vx, bx, vy, by, nrc);
}
#endif
