// shardwire: a prompt chunk's product on F32 or F16 weights with AVX-512, 16 activation rows a
// vector. llamafile's tinyBLAS keeps 4x6 dot products running over 16 values of K at a time and
// loads (and converts from F16) both sides for each step. Here the activation rows are interleaved
// 16 at a time first (for F16 weights rounded through F16, as ggml converts them for tinyBLAS), so
// that one cache line holds a value of K for 16 of them, up to 64 rows and 2048 values of K at a
// time (512 KiB, in L2). A group of 6 weight rows is converted to floats (48 KiB at most) and each
// of its values is broadcast: 6 x 4 vectors of sums in registers, each value of K 4 loads and 6
// broadcasts for 24 fused multiply-adds, with no transposes of the weights. A pass takes a group's
// whole span of K at once, so every weight is read once per 64 activation rows; the next group's
// rows, which lie a row apart (a stride the hardware prefetchers do not follow), are fetched during
// it. Each result sums its products in the order of K, where tinyBLAS sums 16 partial sums at the
// end: they differ by float rounding only.
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

constexpr int FLOAT_TILE = 16;               // activation rows a vector, and values of K a transpose
constexpr int64_t FLOAT_MIN_ROWS = 16;       // fewer activation rows do not repay packing them
constexpr int FLOAT_GROUP = 6;               // weight rows a pass broadcasts: 6 x 4 vectors of sums, 4 of activations
constexpr int FLOAT_TILES = 4;               // tiles of 16 activation rows a pass takes
constexpr int64_t FLOAT_CHUNK = FLOAT_TILES * FLOAT_TILE;  // activation rows a pass over the weights takes
constexpr int64_t FLOAT_SHARE = 48;          // weight rows a thread takes at a time: whole groups and whole tiles
constexpr int64_t FLOAT_BLOCK = 2048;        // values of K packed at a time: a chunk's 512 KiB stay in L2

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
    const int64_t rows = std::min(n, FLOAT_CHUNK);
    return (size_t) ((rows + FLOAT_TILE - 1) / FLOAT_TILE * FLOAT_TILE * std::min(k, FLOAT_BLOCK)) * sizeof(float) + 64;
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

// ROWS weight rows (w: their values of K as floats, ldw apart) by TILES x 16 interleaved activation
// rows (x: tile t's values of K at x + t * ldx, 16 a value), of which the first n are real: ROWS x
// TILES vectors of sums in registers, each value of K one load per tile and one broadcast per
// weight row for ROWS x TILES fused multiply-adds. Output of activation row j, weight row i at
// c[j * ldc + i], which holds the sums of the earlier values of K unless `first`. The weights at
// `ahead` (ROWS rows of `bytes`, lda apart) are fetched a share every 16 values of K.
template <int ROWS, int TILES>
void float_pass(const float * w, int64_t ldw, int64_t span, const float * x, int64_t ldx, int64_t n, float * c,
                int64_t ldc, bool first, const char * ahead, int64_t bytes, int64_t lda) {
    alignas(64) float out[ROWS][TILES * FLOAT_TILE];
    for (int i = 0; i < ROWS; i++) {
        for (int64_t j = 0; j < TILES * FLOAT_TILE; j++) {
            out[i][j] = first || j >= n ? 0.0f : c[j * ldc + i];
        }
    }
    __m512 acc[ROWS][TILES];
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; i++) {
#pragma GCC unroll 4
        for (int t = 0; t < TILES; t++) {
            acc[i][t] = _mm512_load_ps(out[i] + t * FLOAT_TILE);
        }
    }
    const int64_t lines = ahead ? ROWS * (bytes / 64) : 0;
    const int64_t share = (lines + span / FLOAT_TILE - 1) / (span / FLOAT_TILE);
    for (int64_t l0 = 0; l0 < span; l0 += FLOAT_TILE) {
        for (int64_t line = l0 / FLOAT_TILE * share; line < std::min(lines, (l0 / FLOAT_TILE + 1) * share); line++) {
            _mm_prefetch(ahead + line / (bytes / 64) * lda + line % (bytes / 64) * 64, _MM_HINT_T0);
        }
        for (int64_t l = l0; l < l0 + FLOAT_TILE; l++) {
            __m512 v[TILES];
#pragma GCC unroll 4
            for (int t = 0; t < TILES; t++) {
                v[t] = _mm512_load_ps(x + t * ldx + l * FLOAT_TILE);
            }
#pragma GCC unroll 8
            for (int i = 0; i < ROWS; i++) {
                const __m512 b = _mm512_set1_ps(w[i * ldw + l]);
#pragma GCC unroll 4
                for (int t = 0; t < TILES; t++) {
                    acc[i][t] = _mm512_fmadd_ps(b, v[t], acc[i][t]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; i++) {
#pragma GCC unroll 4
        for (int t = 0; t < TILES; t++) {
            _mm512_store_ps(out[i] + t * FLOAT_TILE, acc[i][t]);
        }
    }
    for (int64_t j = 0; j < n; j++) {
        for (int i = 0; i < ROWS; i++) {
            c[j * ldc + i] = out[i][j];
        }
    }
}

// ROWS weight rows by a chunk's n activation rows, in as many tiles as they fill
template <int ROWS>
void float_group(const float * w, int64_t ldw, int64_t span, const float * xt, int64_t n, float * c, int64_t ldc,
                 bool first, const char * ahead, int64_t bytes, int64_t lda) {
    const int64_t ldx = FLOAT_TILE * span;
    switch ((n + FLOAT_TILE - 1) / FLOAT_TILE) {
    case 4: float_pass<ROWS, 4>(w, ldw, span, xt, ldx, n, c, ldc, first, ahead, bytes, lda); break;
    case 3: float_pass<ROWS, 3>(w, ldw, span, xt, ldx, n, c, ldc, first, ahead, bytes, lda); break;
    case 2: float_pass<ROWS, 2>(w, ldw, span, xt, ldx, n, c, ldc, first, ahead, bytes, lda); break;
    default: float_pass<ROWS, 1>(w, ldw, span, xt, ldx, n, c, ldc, first, ahead, bytes, lda); break;
    }
}

// this thread's shares of the m weight rows (lda apart) by a chunk's packed activation rows xt (n
// rows, at most 64; a span of K from `from`): their sums go into C (ldc a row)
template <typename T>
void float_share(const struct ggml_compute_params * params, int64_t m, const T * A, int64_t lda, int64_t from,
                 int64_t span, const float * xt, int64_t n, float * C, int64_t ldc, float * converted) {
    for (int64_t share = params->ith * FLOAT_SHARE; share < m; share += params->nth * FLOAT_SHARE) {
        const int64_t last = std::min(share + FLOAT_SHARE, m);
        const int64_t later = share + params->nth * FLOAT_SHARE;  // this thread's next share
        for (int64_t g = share; g < last; g += FLOAT_GROUP) {
            const int rows = (int) std::min<int64_t>(FLOAT_GROUP, last - g);
            const T * ahead = g + FLOAT_GROUP < last ? A + (g + FLOAT_GROUP) * lda + from
                              : later < m           ? A + later * lda + from
                                                    : nullptr;
            const float * w = (const float *) (A + g * lda + from);
            int64_t ldw = lda;
            if constexpr (!std::is_same_v<T, float>) {
                for (int i = 0; i < rows; i++) {
                    for (int64_t l = 0; l < span; l += FLOAT_TILE) {
                        _mm512_store_ps(converted + i * span + l, widen(A + (g + i) * lda + from + l));
                    }
                }
                w = converted;
                ldw = span;
            }
            const int64_t bytes = span * (int64_t) sizeof(T);
            const int64_t pitch = lda * (int64_t) sizeof(T);
            const bool first = from == 0;
            if (rows == 6) {
                float_group<6>(w, ldw, span, xt, n, C + g, ldc, first, (const char *) ahead, bytes, pitch);
            } else if (rows == 4) {
                float_group<4>(w, ldw, span, xt, n, C + g, ldc, first, (const char *) ahead, bytes, pitch);
            } else {
                float_group<2>(w, ldw, span, xt, n, C + g, ldc, first, (const char *) ahead, bytes, pitch);
            }
        }
    }
}

// C[j * ldc + i] = row i of A (m rows of k values, lda apart) . row j of B (n rows, ldb apart),
// this thread's share of the weight rows; false: not taken, tinyBLAS computes it
template <typename T>
bool float_gemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k, const T * A, int64_t lda,
                const float * B, int64_t ldb, float * C, int64_t ldc) {
    const size_t scratch = float_gemm_scratch(m, n, k);
    if (scratch == 0 || params->wsize < scratch) {  // a plan made without shardwire_float_gemm_work_size
        return false;
    }
    const uintptr_t end = (uintptr_t) params->wdata + params->wsize;
    float * xt = (float *) ((end - scratch + 64) & ~(uintptr_t) 63);
    alignas(64) float converted[std::is_same_v<T, float> ? 1 : FLOAT_GROUP * FLOAT_BLOCK];
    for (int64_t j0 = 0; j0 < n; j0 += FLOAT_CHUNK) {  // each chunk reads the weights once more
        const int64_t rows_here = std::min(FLOAT_CHUNK, n - j0);
        for (int64_t from = 0; from < k; from += FLOAT_BLOCK) {
            const int64_t span = std::min(FLOAT_BLOCK, k - from);
            ggml_barrier(params->threadpool);  // no thread still reads the rows packed before
            float_pack_rows<std::is_same_v<T, ggml_fp16_t>>(B + j0 * ldb + from, ldb, rows_here, span, xt, params->ith,
                                                            params->nth);
            ggml_barrier(params->threadpool);
            float_share<T>(params, m, A, lda, from, span, xt, rows_here, C + j0 * ldc, ldc, converted);
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
