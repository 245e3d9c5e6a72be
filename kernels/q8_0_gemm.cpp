// shardwire: a prompt chunk's product on Q8_0 weights with AVX-512 VNNI, 16 weight rows a
// vector. llamafile's tinyBLAS takes one 32-value block of one row at a time in 256-bit vectors,
// and spends as many instructions on signs, shuffles and conversions as on the products; here a
// tile of 16 weight rows is transposed once (the rows' 4-byte groups side by side, offset to
// unsigned) and then every activation row multiplies it with one VNNI instruction per 4-byte
// group. Each block's exact integer dot product is scaled by the two blocks' scales as tinyBLAS
// scales it, so results differ from tinyBLAS's only in the order of float additions.
//
// kernels/build_backend.py appends this file to ggml-cpu/llamafile/sgemm.cpp and calls
// shardwire_q8_0_gemm from llamafile_sgemm's Q8_0 case before tinyBLAS.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <vector>

namespace {

constexpr int Q8_TILE = 16;   // weight rows a vector
constexpr int Q8_GROUPS = 8;  // 4-byte groups a block
constexpr int Q8_ROWS = 8;    // activation rows a pass over a tile

// the 16 rows' block b, transposed: out[g] lane r = row r's group g, plus 128 a byte
inline void q8_0_transpose_tile(const block_q8_0 * rows, int64_t lda, int64_t b, __m512i out[Q8_GROUPS]) {
    __m512i z[8];
    for (int i = 0; i < 8; i++) {  // rows i and i + 8, one per 256-bit half
        const __m256i lo = _mm256_loadu_si256((const __m256i *) rows[i * lda + b].qs);
        const __m256i hi = _mm256_loadu_si256((const __m256i *) rows[(i + 8) * lda + b].qs);
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
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
    const __m512i offset = _mm512_set1_epi8((char) 0x80);
    for (int j = 0; j < 4; j++) {
        out[j] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[j], first, u[4 + j]), offset);
        out[4 + j] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[j], second, u[4 + j]), offset);
    }
}

// activation rows j0..j0+N-1 by the transposed tile: 16 outputs a row at c + (j0 + j) * ldc
template <int N>
inline void q8_0_tile_rows(const __m512i * wt, const __m512 * wd, int64_t kb, const block_q8_0 * B, int64_t ldb,
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
        for (int g = 0; g < Q8_GROUPS; g++) {
            const __m512i w = wt[b * Q8_GROUPS + g];
            for (int j = 0; j < N; j++) {
                int32_t x;
                memcpy(&x, B[(j0 + j) * ldb + b].qs + 4 * g, 4);
                dot[j] = _mm512_dpbusd_epi32(dot[j], w, _mm512_set1_epi32(x));
            }
        }
        for (int j = 0; j < N; j++) {  // (w + 128) . x, less 128 times the sum of x
            const int64_t at = (j0 + j) * kb + b;
            const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[j], _mm512_set1_epi32(bsum[at])));
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(wd[b], _mm512_set1_ps(bd[at])), exact, acc[j]);
        }
    }
    for (int j = 0; j < N; j++) {
        _mm512_storeu_ps(c + (j0 + j) * ldc, acc[j]);
    }
}

}  // namespace

// C[j * ldc + i] = row i of A (m rows of k Q8_0 blocks, lda blocks apart) . row j of B (n rows
// of Q8_0 activations); this thread's share of the 16-row tiles. false: not taken (m not a
// multiple of 16, or too few rows to repay the transposes), tinyBLAS computes it.
static bool shardwire_q8_0_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                                const block_q8_0 * A, int64_t lda, const block_q8_0 * B, int64_t ldb, float * C,
                                int64_t ldc) {
    if (m % Q8_TILE != 0 || n < 16) {
        return false;
    }
    thread_local std::vector<int32_t> bsum;
    thread_local std::vector<float> bd;
    thread_local std::vector<__m512i> wt;
    thread_local std::vector<__m512> wd;
    bsum.resize(n * k);
    bd.resize(n * k);
    wt.resize(k * Q8_GROUPS);
    wd.resize(k);
    for (int64_t j = 0; j < n; j++) {
        for (int64_t b = 0; b < k; b++) {
            const block_q8_0 & x = B[j * ldb + b];
            const __m256i q = _mm256_loadu_si256((const __m256i *) x.qs);
            const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
            bsum[j * k + b] = 128 * _mm_cvtsi128_si32(s);
            bd[j * k + b] = GGML_CPU_FP16_TO_FP32(x.d);
        }
    }
    for (int64_t tile = params->ith; tile < m / Q8_TILE; tile += params->nth) {
        const block_q8_0 * rows = A + tile * Q8_TILE * lda;
        for (int64_t b = 0; b < k; b++) {
            q8_0_transpose_tile(rows, lda, b, &wt[b * Q8_GROUPS]);
            float d[Q8_TILE];
            for (int r = 0; r < Q8_TILE; r++) {
                d[r] = GGML_CPU_FP16_TO_FP32(rows[r * lda + b].d);
            }
            wd[b] = _mm512_loadu_ps(d);
        }
        float * c = C + tile * Q8_TILE;
        int64_t j0 = 0;
        for (; j0 + Q8_ROWS <= n; j0 += Q8_ROWS) {
            q8_0_tile_rows<Q8_ROWS>(wt.data(), wd.data(), k, B, ldb, bsum.data(), bd.data(), j0, c, ldc);
        }
        switch (n - j0) {
            case 7: q8_0_tile_rows<7>(wt.data(), wd.data(), k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 6: q8_0_tile_rows<6>(wt.data(), wd.data(), k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 5: q8_0_tile_rows<5>(wt.data(), wd.data(), k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 4: q8_0_tile_rows<4>(wt.data(), wd.data(), k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 3: q8_0_tile_rows<3>(wt.data(), wd.data(), k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 2: q8_0_tile_rows<2>(wt.data(), wd.data(), k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            case 1: q8_0_tile_rows<1>(wt.data(), wd.data(), k, B, ldb, bsum.data(), bd.data(), j0, c, ldc); break;
            default: break;
        }
    }
    return true;
}
#else
static bool shardwire_q8_0_gemm(const struct ggml_compute_params *, int64_t, int64_t, int64_t, const block_q8_0 *,
                                int64_t, const block_q8_0 *, int64_t, float *, int64_t) {
    return false;
}
#endif
