// shardwire: a prompt chunk's product on F32 or F16 weights with AVX-512, 16 weight rows a
// vector. llamafile's tinyBLAS keeps 4x6 dot products running over 16 values of K at a time and
// loads (and converts from F16) both sides for each step; here a tile of 16 weight rows is
// transposed once (each vector: one value of K of the 16 rows) and every activation row then
// takes one fused multiply-add per value of K, its value broadcast from memory; the activation
// rows are interleaved 16 at a time first (and F16 ones, as ggml converts them for F16 weights,
// widened), so that one cache line holds a value of K for 16 of them. Each result sums its
// products in the order of K, where tinyBLAS sums 16 partial sums at the end: they differ by float
// rounding only.
//
// kernels/build_backend.py appends this file to ggml-cpu/repack.cpp; llamafile_sgemm's F32 and
// F16 cases call shardwire_f32_gemm and shardwire_f16_gemm before tinyBLAS.

#if defined(__AVX512F__)
#include <vector>

namespace {

constexpr int FLOAT_TILE = 16;           // weight rows a vector, and values of K a transpose
constexpr int64_t FLOAT_MIN_ROWS = 16;   // fewer activation rows do not repay a tile's transposes
constexpr int64_t FLOAT_SPAN = 256;      // values of K a tile holds transposed at a time (16 KiB: L1)

inline __m512 widen(const float * p) {
    return _mm512_loadu_ps(p);
}

inline __m512 widen(const ggml_fp16_t * p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p));
}

// r[i] = row i's 16 values -> r[c] = value c of the 16 rows
inline void float_transpose(__m512 r[FLOAT_TILE]) {
    __m512 t[FLOAT_TILE], u[FLOAT_TILE];
    for (int i = 0; i < FLOAT_TILE; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < FLOAT_TILE; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    // u[4q + c], 128-bit lane L: value 4L + c of rows 4q..4q+3
    for (int c = 0; c < 4; c++) {
        const __m512 lo0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), lo1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        const __m512 hi0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        const __m512 hi1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_f32x4(lo0, hi0, 0x88);
        r[4 + c] = _mm512_shuffle_f32x4(lo0, hi0, 0xDD);
        r[8 + c] = _mm512_shuffle_f32x4(lo1, hi1, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(lo1, hi1, 0xDD);
    }
}

// N of a block's 16 activation rows (xt: the block's values of K in turn, 16 rows each) by a
// transposed tile: 16 outputs a row at c + j * ldc
template <int N>
inline void float_tile_rows(const __m512 * wt, int64_t k, const float * xt, int rows, float * c, int64_t ldc,
                            bool first) {
    __m512 acc[N];
    for (int j = 0; j < N; j++) {
        acc[j] = first || j >= rows ? _mm512_setzero_ps() : _mm512_loadu_ps(c + j * ldc);
    }
    for (int64_t i = 0; i < k; i++) {
        const __m512 w = wt[i];
        for (int j = 0; j < N; j++) {
            acc[j] = _mm512_fmadd_ps(w, _mm512_set1_ps(xt[i * FLOAT_TILE + j]), acc[j]);
        }
    }
    for (int j = 0; j < rows; j++) {
        _mm512_storeu_ps(c + j * ldc, acc[j]);
    }
}

// rows 16 to a block, each block's values of K in turn (16 rows each, zero past the last row),
// widened to float: one cache line holds what a value of K multiplies in the block's 16 rows
template <typename T>
void float_pack_rows(const T * B, int64_t ldb, int64_t n, int64_t k, float * xt) {
    for (int64_t first = 0; first < n; first += FLOAT_TILE) {
        for (int64_t i = 0; i < k; i += FLOAT_TILE) {
            __m512 r[FLOAT_TILE];
            for (int j = 0; j < FLOAT_TILE; j++) {
                r[j] = first + j < n ? widen(B + (first + j) * ldb + i) : _mm512_setzero_ps();
            }
            float_transpose(r);
            for (int c = 0; c < FLOAT_TILE; c++) {
                _mm512_storeu_ps(xt + (first * k + (i + c) * FLOAT_TILE), r[c]);
            }
        }
    }
}

// C[j * ldc + i] = row i of A (m rows of k values, lda apart) . row j of B (n rows, ldb apart),
// this thread's share of the 16-row tiles; false: not taken, tinyBLAS computes it
template <typename T>
bool float_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k, const T * A, int64_t lda,
                const T * B, int64_t ldb, float * C, int64_t ldc) {
    if (m % FLOAT_TILE != 0 || k % FLOAT_TILE != 0 || n < FLOAT_MIN_ROWS) {
        return false;
    }
    std::vector<float> xt((n + FLOAT_TILE - 1) / FLOAT_TILE * FLOAT_TILE * k);
    float_pack_rows(B, ldb, n, k, xt.data());
    __m512 wt[FLOAT_SPAN];
    for (int64_t tile = params->ith; tile < m / FLOAT_TILE; tile += params->nth) {
        const T * rows = A + tile * FLOAT_TILE * lda;
        for (int64_t k0 = 0; k0 < k; k0 += FLOAT_SPAN) {
            const int64_t span = std::min<int64_t>(FLOAT_SPAN, k - k0);
            for (int64_t i = 0; i < span; i += FLOAT_TILE) {
                for (int r = 0; r < FLOAT_TILE; r++) {
                    wt[i + r] = widen(rows + r * lda + k0 + i);
                }
                float_transpose(&wt[i]);
            }
            for (int64_t first = 0; first < n; first += FLOAT_TILE) {
                const int rows_here = (int) std::min<int64_t>(FLOAT_TILE, n - first);
                const float * x = xt.data() + first * k + k0 * FLOAT_TILE;
                float * c = C + first * ldc + tile * FLOAT_TILE;
                if (rows_here > 8) {
                    float_tile_rows<FLOAT_TILE>(wt, span, x, rows_here, c, ldc, k0 == 0);
                } else {
                    float_tile_rows<8>(wt, span, x, rows_here, c, ldc, k0 == 0);
                }
            }
        }
    }
    return true;
}

}  // namespace

extern "C" bool shardwire_f32_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                                   const void * A, int64_t lda, const void * B, int64_t ldb, float * C, int64_t ldc) {
    return float_gemm(params, m, n, k, (const float *) A, lda, (const float *) B, ldb, C, ldc);
}

extern "C" bool shardwire_f16_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                                   const void * A, int64_t lda, const void * B, int64_t ldb, float * C, int64_t ldc) {
    return float_gemm(params, m, n, k, (const ggml_fp16_t *) A, lda, (const ggml_fp16_t *) B, ldb, C, ldc);
}
#else
extern "C" bool shardwire_f32_gemm(const struct ggml_compute_params *, int64_t, int64_t, int64_t, const void *,
                                   int64_t, const void *, int64_t, float *, int64_t) {
    return false;
}

extern "C" bool shardwire_f16_gemm(const struct ggml_compute_params *, int64_t, int64_t, int64_t, const void *,
                                   int64_t, const void *, int64_t, float *, int64_t) {
    return false;
}
#endif
