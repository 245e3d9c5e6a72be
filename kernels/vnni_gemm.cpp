// shardwire: a prompt chunk's product on Q8_0 weights, and on Q4_0 weights held in the repacked
// layout, with AVX-512 VNNI, 16 weight rows a vector. llamafile's tinyBLAS (Q8_0) takes one
// 32-value block of one row at a time in 256-bit vectors, and spends as many instructions on
// signs, shuffles and conversions as on the products; the repack buffer's Q4_0 GEMM unpacks
// nibbles for every 4 activation rows. Here a tile of 16 weight rows is unpacked and transposed
// once (the rows' 4-byte groups side by side, as unsigned bytes) and then every activation row
// multiplies it with one VNNI instruction per 4-byte group. Each block's exact integer dot
// product is scaled by the two blocks' scales, so results differ from those kernels' only in the
// order of float additions.
//
// kernels/build_backend.py appends this file to ggml-cpu/repack.cpp; llamafile_sgemm's Q8_0 case
// calls shardwire_q8_0_gemm before tinyBLAS, and the repack buffer's Q4_0 8x8 MUL_MAT calls
// shardwire_q4_0x8_mul_mat before its own GEMM, which take the product where products.cpp has
// them switched on.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <vector>

namespace {

constexpr int VNNI_TILE = 16;   // weight rows a vector
constexpr int VNNI_GROUPS = 8;  // 4-byte groups a 32-value block
constexpr int VNNI_ROWS = 8;    // activation rows a pass over a tile
constexpr int64_t VNNI_MIN_ROWS = 16;  // fewer activation rows do not repay a tile's transposes

// z[i] = rows i and i + 8 of a tile's block, 32 bytes each -> out[g] lane r = row r's group g
inline void vnni_transpose(const __m512i z[8], __m512i out[VNNI_GROUPS]) {
    __m512i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // u[j] (j < 4) holds groups j and 4 + j of rows 0-3 (and 8-11) in its 128-bit lanes 0 and 1
    // (2 and 3); u[4 + j] the same of rows 4-7 (12-15)
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int j = 0; j < 4; j++) {
        out[j] = _mm512_permutex2var_epi64(u[j], first, u[4 + j]);
        out[4 + j] = _mm512_permutex2var_epi64(u[j], second, u[4 + j]);
    }
}

// Q8_0 rows tile*16.. at block b: their values plus 128 (unsigned); the product subtracts 128 times
// each activation block's sum
struct q8_0_tiles {
    static constexpr int OFFSET = 128;
    const block_q8_0 * a;
    int64_t lda;

    void operator()(int64_t tile, int64_t b, __m512i out[VNNI_GROUPS], float d[VNNI_TILE]) const {
        const block_q8_0 * rows = a + tile * VNNI_TILE * lda;
        __m512i z[8];
        for (int i = 0; i < 8; i++) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *) rows[i * lda + b].qs);
            const __m256i hi = _mm256_loadu_si256((const __m256i *) rows[(i + 8) * lda + b].qs);
            z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        vnni_transpose(z, out);
        for (int g = 0; g < VNNI_GROUPS; g++) {
            out[g] = _mm512_xor_si512(out[g], _mm512_set1_epi8((char) 0x80));
        }
        for (int r = 0; r < VNNI_TILE; r++) {
            d[r] = GGML_CPU_FP16_TO_FP32(rows[r * lda + b].d);
        }
    }
};

// Q4_0 repacked 8 rows a group (block_q4_0x8: 8 bytes of each row in turn, each nibble XOR 8):
// a tile is two groups; values are the stored nibbles 0-15, the product subtracts 8 times each
// activation block's sum
struct q4_0x8_tiles {
    static constexpr int OFFSET = 8;
    const block_q4_0x8 * a;
    int64_t nb;  // blocks a row

    static __m256i values(const block_q4_0x8 & g, int row) {  // the row's 32 nibbles as bytes, in order
        int64_t first, second;
        memcpy(&first, g.qs + 8 * row, 8);
        memcpy(&second, g.qs + 64 + 8 * row, 8);
        const __m128i bytes = _mm_xor_si128(_mm_set_epi64x(second, first), _mm_set1_epi8((char) 0x88));
        const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
        const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
        return _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
    }

    void operator()(int64_t tile, int64_t b, __m512i out[VNNI_GROUPS], float d[VNNI_TILE]) const {
        const block_q4_0x8 & g0 = a[(2 * tile) * nb + b];
        const block_q4_0x8 & g1 = a[(2 * tile + 1) * nb + b];
        __m512i z[8];
        for (int i = 0; i < 8; i++) {
            z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(values(g0, i)), values(g1, i), 1);
        }
        vnni_transpose(z, out);
        for (int r = 0; r < 8; r++) {
            d[r] = GGML_CPU_FP16_TO_FP32(g0.d[r]);
            d[8 + r] = GGML_CPU_FP16_TO_FP32(g1.d[r]);
        }
    }
};

// activation rows j0..j0+N-1 by a transposed tile: 16 outputs a row at c + (j0 + j) * ldc
template <int N>
inline void vnni_tile_rows(const __m512i * wt, const __m512 * wd, int64_t kb, const block_q8_0 * B, int64_t ldb,
                           const int32_t * bsum, const float * bd, int64_t j0, float * c, int64_t ldc) {
    __m512 acc[N];
    for (int j = 0; j < N; j++) {
        acc[j] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < kb; b++) {
        __m512i dot[N];
        for (int j = 0; j < N; j++) {
            dot[j] = _mm512_setzero_si512();
        }
        for (int g = 0; g < VNNI_GROUPS; g++) {
            const __m512i w = wt[b * VNNI_GROUPS + g];
            for (int j = 0; j < N; j++) {
                int32_t x;
                memcpy(&x, B[(j0 + j) * ldb + b].qs + 4 * g, 4);
                dot[j] = _mm512_dpbusd_epi32(dot[j], w, _mm512_set1_epi32(x));
            }
        }
        for (int j = 0; j < N; j++) {  // (w + offset) . x, less offset times the sum of x
            const int64_t at = (j0 + j) * kb + b;
            const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[j], _mm512_set1_epi32(bsum[at])));
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(wd[b], _mm512_set1_ps(bd[at])), exact, acc[j]);
        }
    }
    for (int j = 0; j < N; j++) {
        _mm512_storeu_ps(c + (j0 + j) * ldc, acc[j]);
    }
}

// C[j * ldc + i] = weight row i . activation row j (n rows of k Q8_0 blocks, ldb blocks apart),
// for this thread's share of the m / 16 tiles that `tiles` unpacks
template <typename Tiles>
void vnni_gemm(const Tiles & tiles, int ith, int nth, int64_t m, int64_t n, int64_t k, const block_q8_0 * B,
               int64_t ldb, float * C, int64_t ldc) {
    // this call's scratch: nothing stays allocated between products (float_gemm.cpp's lives in
    // ggml's work buffer instead, as this could)
    std::vector<int32_t> bsum(n * k);
    std::vector<float> bd(n * k);
    std::vector<__m512i> wt(k * VNNI_GROUPS);
    std::vector<__m512> wd(k);
    for (int64_t j = 0; j < n; j++) {
        for (int64_t b = 0; b < k; b++) {
            const block_q8_0 & x = B[j * ldb + b];
            const __m256i q = _mm256_loadu_si256((const __m256i *) x.qs);
            const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
            bsum[j * k + b] = Tiles::OFFSET * _mm_cvtsi128_si32(s);
            bd[j * k + b] = GGML_CPU_FP16_TO_FP32(x.d);
        }
    }
    for (int64_t tile = ith; tile < m / VNNI_TILE; tile += nth) {
        for (int64_t b = 0; b < k; b++) {
            float d[VNNI_TILE];
            tiles(tile, b, &wt[b * VNNI_GROUPS], d);
            wd[b] = _mm512_loadu_ps(d);
        }
        float * c = C + tile * VNNI_TILE;
        const __m512i * w = wt.data();
        const __m512 * s = wd.data();
        int64_t j0 = 0;
        for (; j0 + VNNI_ROWS <= n; j0 += VNNI_ROWS) {
            vnni_tile_rows<VNNI_ROWS>(w, s, k, B, ldb, bsum.data(), bd.data(), j0, c, ldc);
        }
        switch (n - j0) {
            case 7: vnni_tile_rows<7>(w, s, k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 6: vnni_tile_rows<6>(w, s, k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 5: vnni_tile_rows<5>(w, s, k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 4: vnni_tile_rows<4>(w, s, k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 3: vnni_tile_rows<3>(w, s, k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 2: vnni_tile_rows<2>(w, s, k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 1: vnni_tile_rows<1>(w, s, k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            default: break;
        }
    }
}

// a prompt chunk's MUL_MAT that a product of these files takes: src0's rows (whole tiles of 16,
// whole blocks of `block` values) by VNNI_MIN_ROWS float32 rows of src1 or more, into float32 dst
// rows; those rows quantized to `type` (as ggml quantizes them for src0's type) into the work
// buffer by all threads together. nullptr: not taken (switched off, or not such a product)
const void * prompt_rows_quantized(const struct ggml_compute_params * params, const struct ggml_tensor * dst,
                                   unsigned product, ggml_type type, int64_t block) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    const int64_t K = src0->ne[0], M = src0->ne[1], N = src1->ne[1];
    const size_t row = ggml_row_size(type, K);
    if (!shardwire_product_on(product) || params->use_ref || src1->type != GGML_TYPE_F32 ||
        dst->type != GGML_TYPE_F32 || src1->nb[0] != sizeof(float) || dst->nb[0] != sizeof(float) ||
        src0->ne[2] != 1 || src0->ne[3] != 1 || src1->ne[2] != 1 || src1->ne[3] != 1 || M % VNNI_TILE != 0 ||
        K % block != 0 || N < VNNI_MIN_ROWS || params->wsize < row * N) {
        return nullptr;
    }
    const ggml_from_float_t quantize = ggml_get_type_traits_cpu(type)->from_float;
    for (int64_t j = params->ith; j < N; j += params->nth) {
        quantize((const float *) ((const char *) src1->data + j * src1->nb[1]), (char *) params->wdata + j * row, K);
    }
    ggml_barrier(params->threadpool);
    return params->wdata;
}

}  // namespace

// llamafile_sgemm's Q8_0 case: C[j * ldc + i] = row i of A (m rows of k blocks, lda blocks apart)
// . row j of B; false: not taken (m not a multiple of 16, or too few rows), tinyBLAS computes it
extern "C" bool shardwire_q8_0_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                                    const void * A, int64_t lda, const void * B, int64_t ldb, float * C,
                                    int64_t ldc) {
    if (!shardwire_product_on(SHARDWIRE_Q8_0) || m % VNNI_TILE != 0 || n < VNNI_MIN_ROWS) {
        return false;
    }
    vnni_gemm(q8_0_tiles{(const block_q8_0 *) A, lda}, params->ith, params->nth, m, n, k, (const block_q8_0 *) B,
              ldb, C, ldc);
    return true;
}

// the repack buffer's MUL_MAT on Q4_0 in the 8x8 layout: its float32 rows quantized to Q8_0 (as
// ggml quantizes them for Q4_0) into the work buffer, then the tiles; false: not taken
extern "C" bool shardwire_q4_0x8_mul_mat(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const void * quantized = prompt_rows_quantized(params, dst, SHARDWIRE_Q4_0X8, GGML_TYPE_Q8_0, QK8_0);
    if (quantized == nullptr) {
        return false;
    }
    const int64_t K = dst->src[0]->ne[0];
    vnni_gemm(q4_0x8_tiles{(const block_q4_0x8 *) dst->src[0]->data, K / QK4_0}, params->ith, params->nth,
              dst->src[0]->ne[1], dst->src[1]->ne[1], K / QK8_0, (const block_q8_0 *) quantized, K / QK8_0,
              (float *) dst->data, dst->nb[1] / (int64_t) sizeof(float));
    return true;
}
#else
extern "C" bool shardwire_q8_0_gemm(const struct ggml_compute_params *, int64_t, int64_t, int64_t, const void *,
                                    int64_t, const void *, int64_t, float *, int64_t) {
    return false;
}

extern "C" bool shardwire_q4_0x8_mul_mat(const struct ggml_compute_params *, struct ggml_tensor *) {
    return false;
}
#endif
