// shardwire: a prompt chunk's product on Q4_K weights (held repacked, block_q4_Kx8: 8 rows, 8
// bytes of each in turn, or as stored) and on Q6_K weights, with AVX-512 VNNI, 16 weight rows a
// vector. ggml's tiled products unpack each tile into the stored blocks' layout (tiled_q4_Kx8.cpp)
// and multiply a row's values 32 at a time. Here a tile of 16 rows is unpacked once per
// super-block of 256 values into vectors that each hold 4 values of all 16 rows as unsigned bytes
// (Q4_K repacked: a permute of two groups' 64-byte chunks, then their low or high nibbles; stored
// Q4_K and Q6_K: 32 values of each row, then the Q8_0 product's transpose), with each sub-block's
// scales widened to one lane a row. Then 4 activation rows at a time (Q8_K, as ggml quantizes them
// for both) multiply two such tiles, one VNNI instruction per 4 values of 16 rows, each broadcast of
// 4 activation values serving both tiles (3 loads for 4 products, where 8 rows by one tile took 9
// for 8 and ran 1.1x slower). A sub-block's exact integer sums are scaled by its scales in
// integers; what the stored values leave out is taken off with one madd per two sub-blocks (Q4_K:
// its mins times the activation sub-block's sums, as ggml does; Q6_K, stored plus 32: 32 times its
// scales times those sums). The results differ from ggml's only in the order of float additions.
//
// kernels/build_backend.py appends this file to ggml-cpu/repack.cpp after vnni_gemm.cpp (whose
// vnni_transpose and prompt_rows_quantized it uses) and gemv.cpp (whose q4_Kx8_scales reads the
// packed scales here); the repack buffer's Q4_K 8x8 MUL_MAT calls
// shardwire_q4_Kx8_gemm before the tiled products, and ggml_compute_forward_mul_mat calls
// shardwire_kquant_gemm before them, which take the product where products.cpp has it switched on.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <cstring>
#include <vector>

namespace {

constexpr int KQ_ROWS = 4;  // activation rows a pass over two tiles: 2 x 4 sums

// one super-block of a tile of 16 rows, unpacked: SUBS sub-blocks, PAIRS pairs of activation sums
// the offsets take
template <int SUBS, int PAIRS>
struct kquant_tile {
    static constexpr int subs = SUBS, groups = QK_K / SUBS / 4, pairs = PAIRS;
    __m512i w[SUBS][groups];  // lane r: row r's values 4g..4g+3 of sub-block s, unsigned
    __m512i scale[SUBS];      // lane r: row r's scale of sub-block s
    __m512i offset[PAIRS];    // lane r: two int16 that multiply activation pair q's two sums
    __m512 d, dmin;           // lane r: row r's scale of the sums and of the offsets
};
using q4_K_tile = kquant_tile<8, 4>;   // offset: the mins of sub-blocks 2q and 2q + 1 (32 values)
using q6_K_tile = kquant_tile<16, 8>;  // offset: 32 times the scales of sub-blocks 2q and 2q + 1 (16)

// t.w[s0 + g / groups][g % groups] for the 8 groups of 4 values at once: z[i] holds 32 values of
// rows i and i + 8, side by side
template <typename Tile>
void kquant_groups(const __m512i z[8], int s0, Tile & t) {
    __m512i groups[8];
    vnni_transpose(z, groups);
    for (int g = 0; g < 8; g++) {
        t.w[s0 + g / Tile::groups][g % Tile::groups] = groups[g];
    }
}

// groups a (rows 0-7) and b (rows 8-15) of a tile held repacked, one super-block
void q4_K_unpack_repacked(const block_q4_Kx8 & a, const block_q4_Kx8 & b, q4_K_tile & t) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    // a chunk's dword 2r + e: row r's bytes 4e..4e+3 of the chunk; lanes 0-7 from a, 8-15 from b
    const __m512i first = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(1));
    for (int chunk = 0; chunk < 16; chunk++) {  // chunk 4p + u: bytes 8u.. of sub-blocks 2p (low) and 2p + 1
        const int p = chunk / 4, u = chunk % 4;
        const __m512i ca = _mm512_loadu_si512(a.qs + 64 * chunk), cb = _mm512_loadu_si512(b.qs + 64 * chunk);
        for (int e = 0; e < 2; e++) {
            const __m512i v = _mm512_permutex2var_epi32(ca, e ? second : first, cb);
            t.w[2 * p][2 * u + e] = _mm512_and_si512(v, low);
            t.w[2 * p + 1][2 * u + e] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
    }
    __m512i mins[8];
    for (int s = 0; s < 8; s++) {
        const int at = s < 4 ? 12 * s : 48 + 12 * (s - 4);
        uint64_t sa, ma, sb, mb;
        q4_Kx8_scales(a.scales + at, &sa, &ma);
        q4_Kx8_scales(b.scales + at, &sb, &mb);
        t.scale[s] = _mm512_cvtepu8_epi32(_mm_set_epi64x((int64_t) sb, (int64_t) sa));
        mins[s] = _mm512_cvtepu8_epi32(_mm_set_epi64x((int64_t) mb, (int64_t) ma));
    }
    for (int q = 0; q < 4; q++) {
        t.offset[q] = _mm512_or_si512(mins[2 * q], _mm512_slli_epi32(mins[2 * q + 1], 16));
    }
    const __m256i d = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) a.d)),
                                              _mm_loadu_si128((const __m128i *) b.d), 1);
    const __m256i dmin = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) a.dmin)),
                                                 _mm_loadu_si128((const __m128i *) b.dmin), 1);
    t.d = _mm512_cvtph_ps(d);
    t.dmin = _mm512_cvtph_ps(dmin);
}

// 16 rows of stored Q4_K blocks (rows[r * stride] is row r's), one super-block: the same tile
void q4_K_unpack_stored(const block_q4_K * rows, int64_t stride, q4_K_tile & t) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {  // bytes 32p..: sub-blocks 2p (low nibbles) and 2p + 1 (high)
        __m512i bytes[8], z[8];
        for (int i = 0; i < 8; i++) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *) (rows[i * stride].qs + 32 * p));
            const __m256i hi = _mm256_loadu_si256((const __m256i *) (rows[(i + 8) * stride].qs + 32 * p));
            bytes[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        for (int half = 0; half < 2; half++) {
            for (int i = 0; i < 8; i++) {
                z[i] = _mm512_and_si512(half ? _mm512_srli_epi16(bytes[i], 4) : bytes[i], low);
            }
            kquant_groups(z, 2 * p + half, t);
        }
    }
    alignas(64) int32_t scales[8][16], mins[8][16];
    alignas(64) float d[16], dmin[16];
    for (int r = 0; r < 16; r++) {
        const block_q4_K & x = rows[r * stride];
        const uint8_t * q = x.scales;
        for (int s = 0; s < 8; s++) {  // as ggml's get_scale_min_k4
            scales[s][r] = s < 4 ? q[s] & 63 : (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
            mins[s][r] = s < 4 ? q[s + 4] & 63 : (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
        }
        ggml_half scale_of_scales[2];  // d and dmin, the block's first 4 bytes
        memcpy(scale_of_scales, &x, sizeof scale_of_scales);
        d[r] = GGML_CPU_FP16_TO_FP32(scale_of_scales[0]);
        dmin[r] = GGML_CPU_FP16_TO_FP32(scale_of_scales[1]);
    }
    for (int s = 0; s < 8; s++) {
        t.scale[s] = _mm512_load_si512(scales[s]);
    }
    for (int q = 0; q < 4; q++) {
        const __m512i odd = _mm512_slli_epi32(_mm512_load_si512(mins[2 * q + 1]), 16);
        t.offset[q] = _mm512_or_si512(_mm512_load_si512(mins[2 * q]), odd);
    }
    t.d = _mm512_load_ps(d);
    t.dmin = _mm512_load_ps(dmin);
}

// 16 rows of stored Q6_K blocks, one super-block. Value 128n + 32c + l (l < 32) of a row is the
// low (c < 2) or high nibble of ql[64n + 32(c % 2) + l] and bits 2c, 2c + 1 of qh[32n + l] above
// it: the stored value plus 32, 0-63; its sub-block of 16 values is its index / 16
void q6_K_unpack_stored(const block_q6_K * rows, int64_t stride, q6_K_tile & t) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
    for (int n = 0; n < 2; n++) {
        for (int c = 0; c < 4; c++) {
            __m512i z[8];
            for (int i = 0; i < 8; i++) {
                __m256i v[2];
                for (int h = 0; h < 2; h++) {
                    const block_q6_K & x = rows[(i + 8 * h) * stride];
                    const __m256i ql = _mm256_loadu_si256((const __m256i *) (x.ql + 64 * n + 32 * (c % 2)));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *) (x.qh + 32 * n));
                    const __m256i nibble = _mm256_and_si256(c < 2 ? ql : _mm256_srli_epi16(ql, 4), low);
                    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), two);
                    v[h] = _mm256_or_si256(nibble, _mm256_slli_epi16(top, 4));
                }
                z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1);
            }
            kquant_groups(z, 8 * n + 2 * c, t);
        }
    }
    alignas(64) int32_t scales[16][16];
    alignas(64) float d[16];
    for (int r = 0; r < 16; r++) {
        const block_q6_K & x = rows[r * stride];
        for (int s = 0; s < 16; s++) {
            scales[s][r] = x.scales[s];
        }
        d[r] = GGML_CPU_FP16_TO_FP32(x.d);
    }
    for (int s = 0; s < 16; s++) {
        t.scale[s] = _mm512_load_si512(scales[s]);
    }
    for (int q = 0; q < 8; q++) {  // 32 x scale fits an int16: |scale| <= 128
        const __m512i lo = _mm512_and_si512(_mm512_slli_epi32(t.scale[2 * q], 5), _mm512_set1_epi32(0xFFFF));
        t.offset[q] = _mm512_or_si512(lo, _mm512_slli_epi32(t.scale[2 * q + 1], 21));
    }
    t.d = _mm512_load_ps(d);
    t.dmin = t.d;
}

// an activation row's sums, two to an int32, that a tile's offsets multiply: Q4_K's of 32 values
// (sub-blocks 2q and 2q + 1), Q6_K's of 16 (Q8_K's bsums as they are)
template <typename Tile>
void kquant_activation_sums(const block_q8_K & x, int32_t pairs[Tile::pairs]) {
    for (int q = 0; q < Tile::pairs; q++) {
        int32_t even = x.bsums[2 * q], odd = x.bsums[2 * q + 1];
        if constexpr (Tile::subs == 8) {
            even = x.bsums[4 * q] + x.bsums[4 * q + 1];
            odd = x.bsums[4 * q + 2] + x.bsums[4 * q + 3];
        }
        pairs[q] = (int32_t) (((uint32_t) odd << 16) | ((uint32_t) even & 0xFFFF));
    }
}

// activation rows j0..j0+N-1 (kb blocks each) by T unpacked tiles (t[i]: tile i's super-blocks):
// 16 outputs a tile a row at c + j * ldc + 16 * i
template <typename Tile, int T, int N>
void kquant_tile_rows(const Tile * const * t, int64_t kb, const block_q8_K * x, const int32_t * pairs, int64_t j0,
                      float * c, int64_t ldc) {
    __m512 acc[T][N];
    for (int i = 0; i < T; i++) {
        for (int j = 0; j < N; j++) {
            acc[i][j] = _mm512_setzero_ps();
        }
    }
    for (int64_t b = 0; b < kb; b++) {
        __m512i sums[T][N];
        for (int i = 0; i < T; i++) {
            for (int j = 0; j < N; j++) {
                sums[i][j] = _mm512_setzero_si512();
            }
        }
        for (int s = 0; s < Tile::subs; s++) {
            __m512i dot[T][N];
            for (int i = 0; i < T; i++) {
                for (int j = 0; j < N; j++) {
                    dot[i][j] = _mm512_setzero_si512();
                }
            }
            for (int g = 0; g < Tile::groups; g++) {
                for (int j = 0; j < N; j++) {
                    int32_t v;
                    memcpy(&v, x[(j0 + j) * kb + b].qs + 4 * (Tile::groups * s + g), 4);
                    const __m512i xv = _mm512_set1_epi32(v);
                    for (int i = 0; i < T; i++) {
                        dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], t[i][b].w[s][g], xv);
                    }
                }
            }
            for (int i = 0; i < T; i++) {
                for (int j = 0; j < N; j++) {
                    sums[i][j] = _mm512_add_epi32(sums[i][j], _mm512_mullo_epi32(dot[i][j], t[i][b].scale[s]));
                }
            }
        }
        for (int j = 0; j < N; j++) {
            const int32_t * pr = pairs + ((j0 + j) * kb + b) * Tile::pairs;
            const __m512 xd = _mm512_set1_ps(x[(j0 + j) * kb + b].d);
            for (int i = 0; i < T; i++) {
                const Tile & w = t[i][b];
                __m512i taken = _mm512_madd_epi16(w.offset[0], _mm512_set1_epi32(pr[0]));
                for (int q = 1; q < Tile::pairs; q++) {
                    taken = _mm512_add_epi32(taken, _mm512_madd_epi16(w.offset[q], _mm512_set1_epi32(pr[q])));
                }
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i][j]), _mm512_mul_ps(w.d, xd), acc[i][j]);
                acc[i][j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(taken), _mm512_mul_ps(w.dmin, xd), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < T; i++) {
        for (int j = 0; j < N; j++) {
            _mm512_storeu_ps(c + (j0 + j) * ldc + 16 * i, acc[i][j]);
        }
    }
}

// the n activation rows by T unpacked tiles, KQ_ROWS rows a pass
template <typename Tile, int T>
void kquant_tiles(const Tile * const * t, int64_t kb, const block_q8_K * x, const int32_t * pairs, int64_t n,
                  float * c, int64_t ldc) {
    int64_t j0 = 0;
    for (; j0 + KQ_ROWS <= n; j0 += KQ_ROWS) {
        kquant_tile_rows<Tile, T, KQ_ROWS>(t, kb, x, pairs, j0, c, ldc);
    }
    static_assert(KQ_ROWS == 4, "the rows left after whole passes are 0-3");
    switch (n - j0) {
    case 3: kquant_tile_rows<Tile, T, 3>(t, kb, x, pairs, j0, c, ldc); break;
    case 2: kquant_tile_rows<Tile, T, 2>(t, kb, x, pairs, j0, c, ldc); break;
    case 1: kquant_tile_rows<Tile, T, 1>(t, kb, x, pairs, j0, c, ldc); break;
    default: break;
    }
}

// dst = src0's rows, which `unpack` gives a 16-row tile of at a time (unpack(t, b, tile): tile t's
// super-block b), by src1's rows as Q8_K (prompt_rows_quantized); this thread's tiles, two at a
// time. False: not taken
template <typename Tile, typename Unpack>
bool kquant_gemm(const struct ggml_compute_params * params, const struct ggml_tensor * dst, unsigned product,
                 const Unpack & unpack) {
    const auto * x = (const block_q8_K *) prompt_rows_quantized(params, dst, product, GGML_TYPE_Q8_K, QK_K);
    if (x == nullptr) {
        return false;
    }
    const int64_t m = dst->src[0]->ne[1], n = dst->src[1]->ne[1], kb = dst->src[0]->ne[0] / QK_K;
    float * C = (float *) dst->data;
    const int64_t ldc = dst->nb[1] / (int64_t) sizeof(float);
    // kept between products, as gemv.cpp keeps its activations: no allocation a call
    thread_local std::vector<int32_t> pairs;
    pairs.resize(n * kb * Tile::pairs);
    for (int64_t i = 0; i < n * kb; i++) {
        kquant_activation_sums<Tile>(x[i], &pairs[i * Tile::pairs]);
    }
    thread_local std::vector<Tile> tiles;
    tiles.resize(2 * kb);
    const Tile * unpacked[2] = {tiles.data(), tiles.data() + kb};
    for (int64_t t = 2 * params->ith; t < m / 16; t += 2 * params->nth) {
        const int here = (int) std::min<int64_t>(2, m / 16 - t);
        for (int i = 0; i < here; i++) {
            for (int64_t b = 0; b < kb; b++) {
                unpack(t + i, b, tiles[i * kb + b]);
            }
        }
        if (here == 2) {
            kquant_tiles<Tile, 2>(unpacked, kb, x, pairs.data(), n, C + 16 * t, ldc);
        } else {
            kquant_tiles<Tile, 1>(unpacked, kb, x, pairs.data(), n, C + 16 * t, ldc);
        }
    }
    return true;
}

// stored blocks of `Block`, 16 rows a tile
template <typename Tile, typename Block, typename Unpack>
bool kquant_stored_gemm(const struct ggml_compute_params * params, const struct ggml_tensor * dst, unsigned product,
                        const Unpack & unpack) {
    const char * w = (const char *) dst->src[0]->data;
    const size_t nb01 = dst->src[0]->nb[1];
    const int64_t stride = (int64_t) (nb01 / sizeof(Block));
    return kquant_gemm<Tile>(params, dst, product, [&](int64_t t, int64_t b, Tile & tile) {
        unpack((const Block *) (w + 16 * t * nb01) + b, stride, tile);
    });
}

}  // namespace

// the repack buffer's MUL_MAT on Q4_K in the 8x8 layout; false: not taken, the tiled products compute it
extern "C" bool shardwire_q4_Kx8_gemm(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const auto * w = (const block_q4_Kx8 *) dst->src[0]->data;
    const int64_t kb = dst->src[0]->ne[0] / QK_K;
    return kquant_gemm<q4_K_tile>(params, dst, SHARDWIRE_Q4_K, [w, kb](int64_t t, int64_t b, q4_K_tile & tile) {
        q4_K_unpack_repacked(w[2 * t * kb + b], w[(2 * t + 1) * kb + b], tile);
    });
}

// ggml_compute_forward_mul_mat on stored Q4_K blocks (the same product as on repacked ones, to the
// same bits, so that holding a weight repacked or as stored changes nothing a prompt computes) or
// on Q6_K blocks; false: not taken
extern "C" bool shardwire_kquant_gemm(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    switch (dst->src[0]->type) {
    case GGML_TYPE_Q4_K:
        return kquant_stored_gemm<q4_K_tile, block_q4_K>(params, dst, SHARDWIRE_Q4_K, q4_K_unpack_stored);
    case GGML_TYPE_Q6_K:
        return kquant_stored_gemm<q6_K_tile, block_q6_K>(params, dst, SHARDWIRE_Q6_K, q6_K_unpack_stored);
    default:
        return false;
    }
}
#else
extern "C" bool shardwire_q4_Kx8_gemm(const struct ggml_compute_params *, struct ggml_tensor *) {
    return false;
}

extern "C" bool shardwire_kquant_gemm(const struct ggml_compute_params *, struct ggml_tensor *) {
    return false;
}
#endif
