// shardwire: one row of activations (a decode step of one sequence) by Q8_0 or F16 weights, or
// Q4_0 or Q4_K held repacked, with AVX-512. ggml's one-row products (ggml_vec_dot_q8_0_q8_0,
// ggml_vec_dot_f16, the repack buffer's GEMVs) do a weight row's arithmetic in the order its
// bytes arrive and leave the fetching to the hardware prefetchers; on a core that streams ~33
// GB/s they read Q8_0 at ~22, F16 at ~26 and repacked Q4_0 and Q4_K at ~16-21. These products
// ask for the weights GEMV_PREFETCH bytes ahead of the row they multiply and read ~24-35 there.
//
// Q8_0: each activation block's values sit contiguous, two blocks to a vector, and one VNNI
// instruction multiplies them with two weight blocks, whose values are made unsigned (plus 128);
// the accumulator starts at -128 times the activation block's sum, so each block's integer dot
// product is exact. It is scaled by the two blocks' scales in float, as ggml scales it.
// Its results differ from ggml's only in the order of float additions.
// F16: the activations rounded through F16 (as ggml converts them for its F16 dot product), the
// weights widened to float, products summed in ggml's order: ggml's bits.
// Q4_0 and Q4_K held repacked: 8 rows at a time (q4_0x8_rows, q4_Kx8_rows); Q4_0 to the bits of
// ggml's GEMV (and so of the repacked GEMM, as a prompt computes it), Q4_K within its rounding.
//
// kernels/build_backend.py appends this file to ggml-cpu/repack.cpp, after products.cpp;
// llamafile_sgemm, which takes no single row, calls shardwire_gemv instead of declining one.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <cstring>
#include <vector>

namespace {

constexpr int GEMV_PREFETCH = 8192;  // bytes ahead of the weights being multiplied

inline void gemv_fetch(const void * at) {
    _mm_prefetch((const char *) at + GEMV_PREFETCH, _MM_HINT_T0);
}

// the rows this thread takes: [first, end)
inline void gemv_rows(const struct ggml_compute_params * params, int64_t m, int64_t * first, int64_t * end) {
    *first = m * params->ith / params->nth;
    *end = m * (params->ith + 1) / params->nth;
}

// one activation row of k blocks, laid out for q8_0_row
struct q8_0_activations {
    std::vector<int8_t> values;     // the blocks' values, contiguous
    std::vector<int32_t> offsets;   // 8 lanes a block: -16 times its sum (the lanes add to -128 times)
    std::vector<float> scales;

    void take(const block_q8_0 * x, int64_t k) {
        values.resize(k * QK8_0);
        offsets.resize(k * 8);
        scales.resize(k);
        for (int64_t b = 0; b < k; b++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *) x[b].qs);
            _mm256_storeu_si256((__m256i *) &values[b * QK8_0], q);
            const __m512i wide = _mm512_cvtepi8_epi16(q);
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_madd_epi16(wide, _mm512_set1_epi16(1)));
            _mm256_storeu_si256((__m256i *) &offsets[b * 8], _mm256_set1_epi32(-16 * sum));
            scales[b] = GGML_CPU_FP16_TO_FP32(x[b].d);
        }
    }
};

// two consecutive weight blocks' values, plus 128
inline __m512i q8_0_pair(const block_q8_0 * w) {
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) w[0].qs)),
                                            _mm256_loadu_si256((const __m256i *) w[1].qs), 1);
    return _mm512_xor_si512(both, _mm512_set1_epi8((char) 0x80));
}

float q8_0_row(const block_q8_0 * w, int64_t k, const q8_0_activations & x) {
    const __m512i first_two = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i last_two = _mm512_add_epi32(first_two, _mm512_set1_epi32(2));
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= k; b += 4) {
        for (int line = 0; line < 3; line++) {  // 136 bytes of blocks: three lines ahead cover them
            gemv_fetch((const char *) (w + b) + 64 * line);
        }
        const __m512i d0 = _mm512_dpbusd_epi32(_mm512_loadu_si512(&x.offsets[b * 8]), q8_0_pair(w + b),
                                               _mm512_loadu_si512(&x.values[b * QK8_0]));
        const __m512i d1 = _mm512_dpbusd_epi32(_mm512_loadu_si512(&x.offsets[b * 8 + 16]), q8_0_pair(w + b + 2),
                                               _mm512_loadu_si512(&x.values[b * QK8_0 + 64]));
        __m128i d = _mm_cvtsi32_si128(w[b].d);
        d = _mm_insert_epi16(d, w[b + 1].d, 1);
        d = _mm_insert_epi16(d, w[b + 2].d, 2);
        d = _mm_insert_epi16(d, w[b + 3].d, 3);
        const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(_mm_cvtph_ps(d), _mm_loadu_ps(&x.scales[b])));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(first_two, s), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(last_two, s), acc1);
    }
    __m256 tail = _mm256_setzero_ps();
    for (; b < k; b++) {
        const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) w[b].qs), _mm256_set1_epi8((char) 0x80));
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *) &x.offsets[b * 8]), q,
                                                _mm256_loadu_si256((const __m256i *) &x.values[b * QK8_0]));
        tail = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(w[b].d) * x.scales[b]), tail);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + _mm512_reduce_add_ps(_mm512_zextps256_ps512(tail));
}

// the activations as ggml's F16 dot product reads them: rounded to F16
void f16_activations(const float * x, int64_t k, std::vector<float> & out) {
    out.resize(k);
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm512_storeu_ps(&out[i], _mm512_cvtph_ps(h));
    }
    for (; i < k; i++) {
        out[i] = GGML_CPU_FP16_TO_FP32(GGML_CPU_FP32_TO_FP16(x[i]));
    }
}

// in ggml_vec_dot_f16's order (4 sums of 16 lanes a step of 64 values, added as it adds them, the
// values past the last step in double), so that one row gives its bits
float f16_row(const ggml_fp16_t * w, int64_t k, const float * x) {
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t steps = k & ~int64_t(63);
    for (int64_t i = 0; i < steps; i += 64) {
        gemv_fetch(w + i);
        gemv_fetch(w + i + 32);
        for (int j = 0; j < 4; j++) {
            const __m512 wj = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (w + i + 16 * j)));
            sum[j] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(x + i + 16 * j), sum[j]);
        }
    }
    sum[0] = _mm512_add_ps(sum[0], sum[2]);
    sum[1] = _mm512_add_ps(sum[1], sum[3]);
    sum[0] = _mm512_add_ps(sum[0], sum[1]);
    double total = _mm512_reduce_add_ps(sum[0]);
    for (int64_t i = steps; i < k; i++) {
        total += (double) (GGML_CPU_FP16_TO_FP32(w[i]) * x[i]);
    }
    return (float) total;
}

// one Q8_0 activation row as q4_0x8_rows reads it: for each block, -8 times the sums of the
// activation values each lane of a repacked Q4_0 block's products takes (lanes 2r and 2r + 1 take
// row r's bytes 0-3 and 4-7 of each 8-byte chunk), and its scale
struct q4_0x8_activations {
    std::vector<int32_t> offsets;  // 16 lanes a block
    std::vector<float> scales;

    void take(const block_q8_0 * x, int64_t k) {
        offsets.resize(k * 16);
        scales.resize(k);
        const __m512i eight = _mm512_set1_epi8(8);
        for (int64_t b = 0; b < k; b++) {
            __m512i sum = _mm512_setzero_si512();
            for (int part = 0; part < 4; part++) {
                sum = _mm512_dpbusd_epi32(sum, eight, _mm512_set1_epi64(*(const int64_t *) (x[b].qs + 8 * part)));
            }
            _mm512_storeu_si512(&offsets[b * 16], _mm512_sub_epi32(_mm512_setzero_si512(), sum));
            scales[b] = GGML_CPU_FP16_TO_FP32(x[b].d);
        }
    }
};

// 8 rows of Q4_0 held repacked (block_q4_0x8: their 8 scales, then 8 bytes of each row in turn,
// twice; nibbles stored minus 8 in two's complement) by one activation row -> out[0..7]. The
// nibbles made unsigned again (the stored values, 0-15) multiply the activation's 8-byte chunk
// that each byte's nibble takes, broadcast to every row; the lanes start at -8 times what they add.
// A row's two lanes make its block's exact integer product, which goes into its sum as ggml's GEMV
// adds it (times the weight's scale times the activation's, block after block): a row gets the
// GEMV's bits, and so the bits the repacked GEMM gives it in a prompt.
void q4_0x8_rows(const block_q4_0x8 * w, int64_t k, const block_q8_0 * x, const q4_0x8_activations & a, float * out) {
    const __m512i low = _mm512_set1_epi8(0x0F), unsign = _mm512_set1_epi8((char) 0x88);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < k; b++) {
        for (int line = 0; line < 3; line++) {  // 144 bytes a block: three lines ahead cover them
            gemv_fetch((const char *) (w + b) + 64 * line);
        }
        const __m512i first = _mm512_xor_si512(_mm512_loadu_si512(w[b].qs), unsign);  // bytes 0-7 of each row
        const __m512i second = _mm512_xor_si512(_mm512_loadu_si512(w[b].qs + 64), unsign);  // bytes 8-15
        const int8_t * q = x[b].qs;
        __m512i dot = _mm512_loadu_si512(&a.offsets[b * 16]);
        dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(first, low), _mm512_set1_epi64(*(const int64_t *) q));
        dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(second, low), _mm512_set1_epi64(*(const int64_t *) (q + 8)));
        dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(_mm512_srli_epi16(first, 4), low),
                                  _mm512_set1_epi64(*(const int64_t *) (q + 16)));
        dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(_mm512_srli_epi16(second, 4), low),
                                  _mm512_set1_epi64(*(const int64_t *) (q + 24)));
        const __m256i rows = _mm512_cvtepi64_epi32(_mm512_add_epi32(dot, _mm512_srli_epi64(dot, 32)));
        const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) w[b].d)),
                                       _mm256_set1_ps(a.scales[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), d, acc);
    }
    _mm256_storeu_ps(out, acc);
}

// a sub-block's 6-bit scales and mins of 8 rows of Q4_K held repacked (12 bytes, as
// make_block_q4_Kx8 packs them: bytes 0-3 the scales of rows 0-3 and the top bits of rows 4-7's,
// bytes 4-7 the same of the mins, bytes 8-11 the low 4 bits of rows 4-7's scale and min) -> 8
// bytes each
inline void q4_Kx8_scales(const uint8_t * packed, uint64_t * scales, uint64_t * mins) {
    uint32_t lo, mid, hi;
    memcpy(&lo, packed, 4);
    memcpy(&mid, packed + 4, 4);
    memcpy(&hi, packed + 8, 4);
    const uint32_t s_high = (hi & 0x0F0F0F0F) | ((lo >> 2) & 0x30303030);
    const uint32_t m_high = ((hi >> 4) & 0x0F0F0F0F) | ((mid >> 2) & 0x30303030);
    *scales = (uint64_t) (lo & 0x3F3F3F3F) | ((uint64_t) s_high << 32);
    *mins = (uint64_t) (mid & 0x3F3F3F3F) | ((uint64_t) m_high << 32);
}

// 8 rows of Q4_K held repacked (block_q4_Kx8: per 256 values their 8 scales and mins of scales,
// the sub-blocks' 6-bit scales and mins, then 8 bytes of each row in turn, 16 times) by one Q8_K
// activation row -> out[0..7]. Each 8-byte chunk's low nibbles are values of sub-block 2p, its
// high ones of 2p + 1, and multiply the activation's 8 bytes at those positions, broadcast to
// every row; a sub-block's exact integer sums are scaled by its 6-bit scales before the float
// scales, and its mins times the activation sub-block's sum are taken off, as ggml does.
void q4_Kx8_rows(const block_q4_Kx8 * w, int64_t k, const block_q8_K * x, float * out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 acc = _mm512_setzero_ps();
    __m256 taken = _mm256_setzero_ps();
    for (int64_t b = 0; b < k; b++) {
        for (int line = 0; line < 18; line++) {  // 1152 bytes a block
            gemv_fetch((const char *) (w + b) + 64 * line);
        }
        const int8_t * q = x[b].qs;
        __m512i sums = _mm512_setzero_si512();
        __m256i mins_sums = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
            for (int u = 0; u < 4; u++) {
                const __m512i bytes = _mm512_loadu_si512(w[b].qs + 64 * (4 * p + u));
                even = _mm512_dpbusd_epi32(even, _mm512_and_si512(bytes, low),
                                           _mm512_set1_epi64(*(const int64_t *) (q + 64 * p + 8 * u)));
                odd = _mm512_dpbusd_epi32(odd, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low),
                                          _mm512_set1_epi64(*(const int64_t *) (q + 64 * p + 32 + 8 * u)));
            }
            for (int half = 0; half < 2; half++) {
                const int j = 2 * p + half;  // the sub-block
                uint64_t scales, mins;
                q4_Kx8_scales(w[b].scales + (j < 4 ? 12 * j : 48 + 12 * (j - 4)), &scales, &mins);
                const __m512i scale = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi64_si128((int64_t) scales), twice));
                sums = _mm512_add_epi32(sums, _mm512_mullo_epi32(half ? odd : even, scale));
                const int32_t activation_sum = x[b].bsums[2 * j] + x[b].bsums[2 * j + 1];
                mins_sums = _mm256_add_epi32(mins_sums, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t) mins)),
                                                                            _mm256_set1_epi32(activation_sum)));
            }
        }
        const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) w[b].d)), _mm256_set1_ps(x[b].d));
        const __m256 dmin = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) w[b].dmin)), _mm256_set1_ps(x[b].d));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(pairs, _mm512_zextps256_ps512(d)), acc);
        taken = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins_sums), dmin, taken);
    }
    alignas(64) float lanes[16];
    alignas(32) float mins[8];
    _mm512_store_ps(lanes, acc);
    _mm256_store_ps(mins, taken);
    for (int r = 0; r < 8; r++) {
        out[r] = lanes[2 * r] + lanes[2 * r + 1] - mins[r];
    }
}

// the repack buffer's MUL_MAT on 8-row groups of repacked weights (K values a row, in blocks of
// `block`) with one row of activations: that row quantized to `type` (as ggml quantizes it for the
// weights) into the work buffer, by the first thread while the others wait; its blocks, and this
// thread's groups [*first, *end). nullptr: not taken (switched off or not such a product), ggml's
// GEMV computes it.
const void * repacked_gemv_row(const struct ggml_compute_params * params, const struct ggml_tensor * dst,
                               unsigned product, ggml_type type, int64_t block, int64_t * first, int64_t * end) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    const int64_t K = src0->ne[0], M = src0->ne[1];
    if (!shardwire_product_on(product) || params->use_ref || src1->type != GGML_TYPE_F32 || src1->ne[1] != 1 ||
        src1->ne[2] != 1 || src1->ne[3] != 1 || M % 8 != 0 || K % block != 0 ||
        params->wsize < ggml_row_size(type, K)) {
        return nullptr;
    }
    if (params->ith == 0) {
        ggml_get_type_traits_cpu(type)->from_float((const float *) src1->data, params->wdata, K);
    }
    ggml_barrier(params->threadpool);
    gemv_rows(params, M / 8, first, end);
    return params->wdata;
}

}  // namespace

// the repack buffer's MUL_MAT on Q4_K in the 8x8 layout with one row: Q8_K activations, 8 weight
// rows at a time; false: not taken
extern "C" bool shardwire_q4_Kx8_gemv(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    int64_t first, end;
    const auto * x = (const block_q8_K *) repacked_gemv_row(params, dst, SHARDWIRE_Q4_KX8_GEMV, GGML_TYPE_Q8_K, QK_K,
                                                            &first, &end);
    if (x == nullptr) {
        return false;
    }
    const int64_t blocks = dst->src[0]->ne[0] / QK_K;
    const block_q4_Kx8 * w = (const block_q4_Kx8 *) dst->src[0]->data;
    for (int64_t g = first; g < end; g++) {
        q4_Kx8_rows(w + g * blocks, blocks, x, (float *) dst->data + 8 * g);
    }
    return true;
}

// the repack buffer's MUL_MAT on Q4_0 in the 8x8 layout with one row: Q8_0 activations, 8 weight
// rows at a time; false: not taken
extern "C" bool shardwire_q4_0x8_gemv(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    int64_t first, end;
    const auto * x = (const block_q8_0 *) repacked_gemv_row(params, dst, SHARDWIRE_Q4_0X8_GEMV, GGML_TYPE_Q8_0, QK8_0,
                                                            &first, &end);
    if (x == nullptr) {
        return false;
    }
    const int64_t blocks = dst->src[0]->ne[0] / QK4_0;
    thread_local q4_0x8_activations a;
    a.take(x, blocks);
    const block_q4_0x8 * w = (const block_q4_0x8 *) dst->src[0]->data;
    for (int64_t g = first; g < end; g++) {
        q4_0x8_rows(w + g * blocks, blocks, x, a, (float *) dst->data + 8 * g);
    }
    return true;
}

// C[r] = row r of A (m rows, lda apart) . B, for this thread's rows; k: values of K (F16) or blocks
// (Q8_0). False: not a product these take, or switched off.
extern "C" bool shardwire_gemv(const struct ggml_compute_params * params, int64_t m, int64_t k, const void * A,
                               int64_t lda, const void * B, float * C, int Atype, int Btype) {
    int64_t first, end;
    gemv_rows(params, m, &first, &end);
    if (Atype == GGML_TYPE_Q8_0 && Btype == GGML_TYPE_Q8_0 && shardwire_product_on(SHARDWIRE_Q8_0_GEMV)) {
        thread_local q8_0_activations x;
        x.take((const block_q8_0 *) B, k);
        for (int64_t r = first; r < end; r++) {
            C[r] = q8_0_row((const block_q8_0 *) A + r * lda, k, x);
        }
        return true;
    }
    if (Atype == GGML_TYPE_F16 && Btype == GGML_TYPE_F32 && shardwire_product_on(SHARDWIRE_F16_GEMV)) {
        thread_local std::vector<float> x;
        f16_activations((const float *) B, k, x);
        for (int64_t r = first; r < end; r++) {
            C[r] = f16_row((const ggml_fp16_t *) A + r * lda, k, x.data());
        }
        return true;
    }
    return false;
}
#else
extern "C" bool shardwire_q4_Kx8_gemv(const struct ggml_compute_params *, struct ggml_tensor *) {
    return false;
}

extern "C" bool shardwire_q4_0x8_gemv(const struct ggml_compute_params *, struct ggml_tensor *) {
    return false;
}

extern "C" bool shardwire_gemv(const struct ggml_compute_params *, int64_t, int64_t, const void *, int64_t,
                               const void *, float *, int, int) {
    return false;
}
#endif
