// shardwire: a prompt chunk's product on F32 or F16 weights with AVX-512, 16 weight rows a
// vector. llamafile's tinyBLAS keeps 4x6 dot products running over 16 values of K at a time and
// loads (and converts from F16) both sides for each step. Here the weights of a group of 3 tiles
// of 16 rows are transposed 128 values of K at a time (each vector: one value of K of a tile's 16
// rows; 24 KiB, in L1), and 8 activation rows at a time then take them: 3 x 8 vectors of sums in
// registers, each value of K 3 loads and 8 broadcasts for 24 fused multiply-adds. The activation
// rows are interleaved 16 at a time first (for F16 weights rounded through F16, as ggml converts
// them for tinyBLAS), so that one cache line holds a value of K for 16 of them. A group's rows lie
// a row apart, a stride the hardware prefetchers do not follow: the next span's are fetched while
// one is multiplied. Each result sums its products in the order of K, where tinyBLAS sums 16
// partial sums at the end: they differ by float rounding only.
//
// The interleaved rows are packed once, by all threads, at the end of ggml's work buffer:
// ggml_graph_plan reserves room for them (shardwire_float_gemm_work_size). A scratch allocated
// for each product cost page faults and zeroing, 5-10% of a 1B F16 prompt.
//
// kernels/build_backend.py appends this file to ggml-cpu/repack.cpp; llamafile_sgemm's F32 case
// and its F16 case with F32 activations call shardwire_f32_gemm and shardwire_f16_gemm before
// tinyBLAS, which take the product where products.cpp has them switched on.

#if defined(__AVX512F__)
namespace {

constexpr int FLOAT_TILE = 16;           // weight rows a vector, and values of K a transpose
constexpr int64_t FLOAT_MIN_ROWS = 16;   // fewer activation rows do not repay a tile's transposes
constexpr int64_t FLOAT_SPAN = 128;      // values of K held transposed at a time (3 tiles: 24 KiB, in L1)
constexpr int FLOAT_TILES = 3;           // tiles a group: 3 x 8 vectors of sums, 3 of weights, 1 broadcast
constexpr int FLOAT_ROWS = 8;            // activation rows a pass over a group's span
constexpr int64_t FLOAT_BLOCK = 512;     // values of K of the activation rows packed at a time

inline __m512 widen(const float * p) {
    return _mm512_loadu_ps(p);
}

inline __m512 widen(const ggml_fp16_t * p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p));
}

// an activation row's values as F16 weights take them: rounded to the nearest F16, as
// ggml_cpu_fp32_to_fp16 rounds them
inline __m512 rounded_to_f16(const float * p) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_loadu_ps(p), _MM_FROUND_TO_NEAREST_INT));
}

// bytes of the interleaved activation rows (a block of K of them) of a product of m weight rows by
// n activation rows of k values, 64 of them alignment; 0 where this product does not take it
size_t float_gemm_scratch(int64_t m, int64_t n, int64_t k) {
    if (m % FLOAT_TILE != 0 || k % FLOAT_TILE != 0 || n < FLOAT_MIN_ROWS) {
        return 0;
    }
    return (size_t) ((n + FLOAT_TILE - 1) / FLOAT_TILE * FLOAT_TILE * std::min(k, FLOAT_BLOCK)) * sizeof(float) + 64;
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

// ROWS activation rows (x: their values of K in turn, 16 rows of the interleaved block apart) by
// TILES transposed weight tiles (wt: a value of K of each tile in turn): ROWS x TILES vectors of
// sums in registers, each value of K one load per tile and one broadcast per row for TILES x ROWS
// fused multiply-adds. Results of `rows` rows: 16 x TILES outputs a row at c + j * ldc.
template <int TILES, int ROWS>
inline void float_micro(const __m512 * wt, int64_t span, const float * x, int rows, float * c, int64_t ldc,
                        bool first) {
    __m512 acc[TILES][ROWS];
#pragma GCC unroll 8
    for (int j = 0; j < ROWS; j++) {
#pragma GCC unroll 4
        for (int t = 0; t < TILES; t++) {
            acc[t][j] = first || j >= rows ? _mm512_setzero_ps() : _mm512_loadu_ps(c + j * ldc + t * FLOAT_TILE);
        }
    }
    for (int64_t i = 0; i < span; i++) {
        __m512 w[TILES];
#pragma GCC unroll 4
        for (int t = 0; t < TILES; t++) {
            w[t] = wt[i * TILES + t];
        }
#pragma GCC unroll 8
        for (int j = 0; j < ROWS; j++) {
            const __m512 b = _mm512_set1_ps(x[i * FLOAT_TILE + j]);
#pragma GCC unroll 4
            for (int t = 0; t < TILES; t++) {
                acc[t][j] = _mm512_fmadd_ps(w[t], b, acc[t][j]);
            }
        }
    }
    for (int j = 0; j < rows; j++) {
#pragma GCC unroll 4
        for (int t = 0; t < TILES; t++) {
            _mm512_storeu_ps(c + j * ldc + t * FLOAT_TILE, acc[t][j]);
        }
    }
}

// rows 16 to a block, each block's values of K in turn (16 rows each, zero past the last row),
// as floats (rounded through F16 where `to_f16`): one cache line holds what a value of K
// multiplies in the block's 16 rows. This thread packs every nth block from the ith.
template <bool to_f16>
void float_pack_rows(const float * B, int64_t ldb, int64_t n, int64_t k, float * xt, int ith, int nth) {
    for (int64_t first = ith * FLOAT_TILE; first < n; first += nth * FLOAT_TILE) {
        for (int64_t i = 0; i < k; i += FLOAT_TILE) {
            __m512 r[FLOAT_TILE];
            for (int j = 0; j < FLOAT_TILE; j++) {
                const float * x = B + (first + j) * ldb + i;
                r[j] = first + j >= n ? _mm512_setzero_ps() : to_f16 ? rounded_to_f16(x) : widen(x);
            }
            float_transpose(r);
            for (int c = 0; c < FLOAT_TILE; c++) {
                _mm512_storeu_ps(xt + (first * k + (i + c) * FLOAT_TILE), r[c]);
            }
        }
    }
}

// TILES x 16 weight rows (lda apart, k values) by the n interleaved activation rows xt: their
// outputs at c (ldc a row; added to what is there where `add`), FLOAT_SPAN values of K transposed
// at a time. `after`: the rows of this thread's next group, whose first span is fetched during
// the last span here.
template <int TILES, typename T>
void float_group(const T * rows, int64_t lda, int64_t k, const T * after, const float * xt, int64_t n, float * c,
                 int64_t ldc, bool add) {
    __m512 wt[FLOAT_SPAN * TILES];
    for (int64_t k0 = 0; k0 < k; k0 += FLOAT_SPAN) {
        const int64_t span = std::min<int64_t>(FLOAT_SPAN, k - k0);
        for (int t = 0; t < TILES; t++) {
            for (int64_t i = 0; i < span; i += FLOAT_TILE) {
                __m512 r[FLOAT_TILE];
                for (int j = 0; j < FLOAT_TILE; j++) {
                    r[j] = widen(rows + (t * FLOAT_TILE + j) * lda + k0 + i);
                }
                float_transpose(r);
                for (int v = 0; v < FLOAT_TILE; v++) {
                    wt[(i + v) * TILES + t] = r[v];
                }
            }
        }
        // the next span's weights are on their way while this one's products run, a share before
        // each pass: a span reads the group's rows a row apart, a stride the hardware prefetchers do
        // not follow
        const T * ahead = k0 + FLOAT_SPAN < k ? rows + k0 + FLOAT_SPAN : after;
        const int64_t passes = (n + FLOAT_ROWS - 1) / FLOAT_ROWS;
        for (int64_t first = 0; first < n; first += FLOAT_ROWS) {
            const int64_t pass = first / FLOAT_ROWS;
            for (int64_t r = pass * TILES * FLOAT_TILE / passes; ahead && r < (pass + 1) * TILES * FLOAT_TILE / passes;
                 r++) {
                const char * p = (const char *) (ahead + r * lda);
                for (int64_t b = 0; b < (int64_t) (FLOAT_SPAN * sizeof(T)); b += 64) {
                    _mm_prefetch(p + b, _MM_HINT_T0);
                }
            }
            const int rows_here = (int) std::min<int64_t>(FLOAT_ROWS, n - first);
            const float * x = xt + first / FLOAT_TILE * FLOAT_TILE * k + k0 * FLOAT_TILE + first % FLOAT_TILE;
            float_micro<TILES, FLOAT_ROWS>(wt, span, x, rows_here, c + first * ldc, ldc, k0 == 0 && !add);
        }
    }
}

// C[j * ldc + i] = row i of A (m rows of k values, lda apart) . row j of B (n rows, ldb apart),
// this thread's share of the 16-row tiles; false: not taken, tinyBLAS computes it
template <typename T>
bool float_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k, const T * A, int64_t lda,
                const float * B, int64_t ldb, float * C, int64_t ldc) {
    const size_t scratch = float_gemm_scratch(m, n, k);
    if (scratch == 0 || params->wsize < scratch) {  // a plan made without shardwire_float_gemm_work_size
        return false;
    }
    const uintptr_t end = (uintptr_t) params->wdata + params->wsize;
    float * xt = (float *) ((end - scratch + 64) & ~(uintptr_t) 63);
    const int64_t tiles = m / FLOAT_TILE;
    for (int64_t from = 0; from < k; from += FLOAT_BLOCK) {
        const int64_t block = std::min(FLOAT_BLOCK, k - from);
        ggml_barrier(params->threadpool);  // no thread still reads the rows packed before
        float_pack_rows<std::is_same_v<T, ggml_fp16_t>>(B + from, ldb, n, block, xt, params->ith, params->nth);
        ggml_barrier(params->threadpool);
        for (int64_t tile = params->ith * FLOAT_TILES; tile < tiles; tile += params->nth * FLOAT_TILES) {
            const int64_t here = std::min<int64_t>(FLOAT_TILES, tiles - tile);
            const T * rows = A + tile * FLOAT_TILE * lda + from;
            const int64_t later = tile + params->nth * FLOAT_TILES;  // this thread's next group
            const T * after = later + FLOAT_TILES <= tiles ? A + later * FLOAT_TILE * lda + from : nullptr;
            float * c = C + tile * FLOAT_TILE;
            if (here == 3) {
                float_group<3>(rows, lda, block, after, xt, n, c, ldc, from > 0);
            } else if (here == 2) {
                float_group<2>(rows, lda, block, after, xt, n, c, ldc, from > 0);
            } else {
                float_group<1>(rows, lda, block, after, xt, n, c, ldc, from > 0);
            }
        }
    }
    return true;
}

}  // namespace

// ggml_graph_plan's work size for a MUL_MAT that these products may take: the room for the
// interleaved rows, or for ggml's F16 copy of the activations where that is larger (these
// products round the rows as they pack them and make no such copy, but a product switched off
// after the plan leaves the MUL_MAT to ggml, which makes it); false: ggml's own size
extern "C" bool shardwire_float_gemm_work_size(const struct ggml_tensor * node, size_t * size) {
    const struct ggml_tensor * w = node->src[0];
    const struct ggml_tensor * x = node->src[1];
    if ((w->type != GGML_TYPE_F32 && w->type != GGML_TYPE_F16) || x->type != GGML_TYPE_F32 ||
        !ggml_is_contiguous(x)) {
        return false;
    }
    const size_t scratch = float_gemm_scratch(w->ne[1], x->ne[1], w->ne[0]);
    if (scratch == 0) {
        return false;
    }
    const size_t copy = w->type == GGML_TYPE_F16 ? ggml_row_size(GGML_TYPE_F16, ggml_nelements(x)) : 0;
    *size = std::max(scratch, copy);
    return true;
}

extern "C" bool shardwire_f32_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                                   const void * A, int64_t lda, const void * B, int64_t ldb, float * C, int64_t ldc) {
    return shardwire_product_on(SHARDWIRE_F32) &&
           float_gemm(params, m, n, k, (const float *) A, lda, (const float *) B, ldb, C, ldc);
}

extern "C" bool shardwire_f16_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                                   const void * A, int64_t lda, const void * B, int64_t ldb, float * C, int64_t ldc) {
    return shardwire_product_on(SHARDWIRE_F16) &&
           float_gemm(params, m, n, k, (const ggml_fp16_t *) A, lda, (const float *) B, ldb, C, ldc);
}
#else
extern "C" bool shardwire_float_gemm_work_size(const struct ggml_tensor *, size_t *) {
    return false;
}

extern "C" bool shardwire_f32_gemm(const struct ggml_compute_params *, int64_t, int64_t, int64_t, const void *,
                                   int64_t, const void *, int64_t, float *, int64_t) {
    return false;
}

extern "C" bool shardwire_f16_gemm(const struct ggml_compute_params *, int64_t, int64_t, int64_t, const void *,
                                   int64_t, const void *, int64_t, float *, int64_t) {
    return false;
}
#endif
