// shardwire: ggml's tiled K-quant products read Q4_K weights held in the repacked layout
// (block_q4_Kx8, 8 rows interleaved 8 bytes at a time: repack.cpp's layout for x86), so that a
// prompt chunk on a repacked weight (or a mixture of experts' expert with several rows) is
// multiplied as it would be on the stored blocks (the tiled kernels read a chunk faster than the
// repacked layout's GEMM or row-by-row GEMV on some CPUs), while one row keeps the repacked GEMV,
// which reads it faster. Each tile is unpacked from the interleaved groups into the same values
// the stored blocks give, so the products are the stored blocks' exactly.
//
// kernels/build_backend.py appends this file to ggml-cpu/tiled/tiled.cpp (its templates and
// statics are used here) and routes the repack buffer's Q4_K 8x8 products here.

struct block_q4_Kx8_tiled {  // one block of each of 8 rows (repack.h's block_q4_Kx8)
    ggml_half d[8];
    ggml_half dmin[8];
    uint8_t   scales[96];  // per sub-block, the 8 rows' 6-bit scales and mins in 12 bytes
    uint8_t   qs[1024];    // the rows' quants, 8 bytes of each row in turn
};
static_assert(sizeof(block_q4_Kx8_tiled) == 8 * sizeof(block_q4_K), "one group holds 8 stored blocks");

// The tiles name a weight block by its row (a multiple of 8) and K block: in the repacked
// layout, the group of 8 rows starting there, at its K block.
template <>
const block_q4_Kx8_tiled * tiled_src0_at<block_q4_Kx8_tiled>(const char * row0, int64_t row, int64_t kblk,
                                                             size_t nb01, size_t bs) {
    GGML_ASSERT(row % 8 == 0);
    return (const block_q4_Kx8_tiled *) (row0 + row * nb01 + kblk * 8 * bs);
}

// m[i] byte j -> m[j] byte i: an 8x8 byte matrix transposed, one uint64 per row
static void tiled_transpose8(uint64_t m[8]) {
    for (int i = 0; i < 8; i += 2) {
        const uint64_t a = m[i], b = m[i + 1];
        m[i]     = (a & 0x00FF00FF00FF00FFull) | ((b & 0x00FF00FF00FF00FFull) << 8);
        m[i + 1] = ((a & 0xFF00FF00FF00FF00ull) >> 8) | (b & 0xFF00FF00FF00FF00ull);
    }
    for (int i = 0; i < 8; i += 4) {
        for (int k = 0; k < 2; k++) {
            const uint64_t a = m[i + k], b = m[i + k + 2];
            m[i + k]     = (a & 0x0000FFFF0000FFFFull) | ((b & 0x0000FFFF0000FFFFull) << 16);
            m[i + k + 2] = ((a & 0xFFFF0000FFFF0000ull) >> 16) | (b & 0xFFFF0000FFFF0000ull);
        }
    }
    for (int k = 0; k < 4; k++) {
        const uint64_t a = m[k], b = m[k + 4];
        m[k]     = (a & 0x00000000FFFFFFFFull) | (b << 32);
        m[k + 4] = (a >> 32) | (b & 0xFFFFFFFF00000000ull);
    }
}

// A group's 6-bit scales and mins, scales[lane] byte s: lane's scale of sub-block s. The group
// keeps each sub-block's 8 values in 12 bytes: rows 0-3 whole in the low 6 bits of bytes 0-3
// (scales) and 4-7 (mins), rows 4-7 in those bytes' top 2 bits over the nibbles of bytes 8-11.
static void tiled_q4_Kx8_scales(const uint8_t * in, uint64_t scales[8], uint64_t mins[8]) {
    for (int s = 0; s < 8; s++) {
        const uint8_t * b = in + (s / 4) * 48 + (s % 4) * 12;
        uint32_t b0, b1, b2;
        memcpy(&b0, b, 4);
        memcpy(&b1, b + 4, 4);
        memcpy(&b2, b + 8, 4);
        const uint32_t s_hi = (((b0 >> 6) & 0x03030303u) << 4) | (b2 & 0x0F0F0F0Fu);
        const uint32_t m_hi = (((b1 >> 6) & 0x03030303u) << 4) | ((b2 >> 4) & 0x0F0F0F0Fu);
        scales[s] = (b0 & 0x3F3F3F3Fu) | ((uint64_t) s_hi << 32);
        mins[s]   = (b1 & 0x3F3F3F3Fu) | ((uint64_t) m_hi << 32);
    }
    tiled_transpose8(scales);
    tiled_transpose8(mins);
}

// one group's quants for its 8 rows, each row's 128 bytes in stored order (4 runs of 32, each
// run unpacked as the stored blocks' are) at out(lane) = q + lane * qk_stride. The group holds
// 8 bytes of each row in turn: run u of a row is its bytes 8c..8c+7 for c = 4u..4u+3.
static void tiled_q4_Kx8_quants(const uint8_t * qs, uint8_t * q, int qk_stride) {
#if defined(__AVX2__)
    // 4 rows' run u at once: a 4x4 transpose of 8-byte pieces, in registers
    for (int half = 0; half < 2; half++) {
        for (int u = 0; u < 4; u++) {
            const uint8_t * run = qs + u * 4 * 64 + half * 32;
            const __m256i a0 = _mm256_loadu_si256((const __m256i *) (run + 0 * 64));
            const __m256i a1 = _mm256_loadu_si256((const __m256i *) (run + 1 * 64));
            const __m256i a2 = _mm256_loadu_si256((const __m256i *) (run + 2 * 64));
            const __m256i a3 = _mm256_loadu_si256((const __m256i *) (run + 3 * 64));
            const __m256i t0 = _mm256_unpacklo_epi64(a0, a1), t1 = _mm256_unpackhi_epi64(a0, a1);
            const __m256i t2 = _mm256_unpacklo_epi64(a2, a3), t3 = _mm256_unpackhi_epi64(a2, a3);
            const __m256i rows[4] = {
                _mm256_permute2x128_si256(t0, t2, 0x20), _mm256_permute2x128_si256(t1, t3, 0x20),
                _mm256_permute2x128_si256(t0, t2, 0x31), _mm256_permute2x128_si256(t1, t3, 0x31)};
            for (int i = 0; i < 4; i++) {
                uint8_t * out = q + (half * 4 + i) * qk_stride + u * 64;
                _mm256_storeu_si256((__m256i *) out, _mm256_and_si256(rows[i], _mm256_set1_epi8(0x0F)));
                _mm256_storeu_si256((__m256i *) (out + 32),
                                    _mm256_and_si256(_mm256_srli_epi16(rows[i], 4), _mm256_set1_epi8(0x0F)));
            }
        }
    }
#else
    for (int lane = 0; lane < 8; lane++) {
        uint8_t row[QK_K / 2];
        for (int c = 0; c < QK_K / 2 / 8; c++) {
            memcpy(row + c * 8, qs + (c * 8 + lane) * 8, 8);
        }
        uint8_t * out = q + lane * qk_stride;
        for (int u = 0; u < 4; u++) {
            tiled_unpk_nib4(row + u * 32, out + u * 64, out + u * 64 + 32);
        }
    }
#endif
}

// tiled_unpack_src0 for block_q4_K, reading the window's rows a group of 8 at a time (fetching the
// group 16 rows on while it unpacks one, as build_backend.py's patch has the stored blocks' do);
// `row_stride`: stored blocks a row (so a group of 8 rows is row_stride groups)
static void tiled_unpack_src0(const block_q4_Kx8_tiled * groups, int64_t row_stride, int n_rows,
                              tiled_tile_src0 * tile, int num_k) {
    GGML_ASSERT(n_rows <= TILED_TILE_ROWS && n_rows % 8 == 0);
    constexpr int NB = 8;  // 32-wide subblocks
    const int qk_stride = num_k * TILED_TILE_K;
    const int nb_stride = NB * num_k;
    for (int slab = 0; slab < num_k; slab++) {
        for (int g = 0; g < n_rows / 8; g++) {
            const block_q4_Kx8_tiled & x = groups[g * row_stride + slab];
            tiled_prefetch_ahead(groups, row_stride, g, slab, n_rows / 8, TILED_AHEAD / 4);
            uint64_t scales[8], mins[8];
            tiled_q4_Kx8_scales(x.scales, scales, mins);
            for (int lane = 0; lane < 8; lane++) {
                const int r = g * 8 + lane;
                const int d_off = slab * TILED_MICRO + r;
                const int s_off = r * nb_stride + slab * NB;

                tile->d[d_off]    = ggml_fp16_to_fp32(x.d[lane]);
                tile->dmin[d_off] = ggml_fp16_to_fp32(x.dmin[lane]);
                for (int s = 0; s < NB; s++) {
                    tile->scales[s_off + s] = (int32_t) ((scales[lane] >> (8 * s)) & 0xFF);
                    tile->mins[s_off + s]   = (int32_t) ((mins[lane] >> (8 * s)) & 0xFF);
                }
            }
            tiled_q4_Kx8_quants(x.qs, &tile->q[g * 8 * qk_stride + slab * TILED_TILE_K], qk_stride);
        }
    }
}

// The rows of src0 each chunk of ggml_compute_forward_mul_mat_tiled_driver starts at a multiple
// of (its chunking, for nr1 rows of src1 on nth threads)
static int64_t ggml_tiled_chunk_rows(int64_t nr0, int64_t nr1, int nth) {
    int64_t chunk_size = 256;
    int64_t nchunk0 = (nr0 + chunk_size - 1) / chunk_size;
    int64_t nchunk1 = (nr1 + chunk_size - 1) / chunk_size;
    while (nchunk0 * nchunk1 < nth * 4 && chunk_size > 16) {
        chunk_size = chunk_size / 2;
        nchunk0 = (nr0 + chunk_size - 1) / chunk_size;
        nchunk1 = (nr1 + chunk_size - 1) / chunk_size;
    }
    return (nr0 + nchunk0 - 1) / nchunk0;
}

// whether the tiled products may take a product of repacked Q4_K rows by float32 ones here: on
// the CPUs ggml's tiled kernels are built for, where they are switched on
static bool ggml_tiled_reads_q4_Kx8(const struct ggml_tensor * dst) {
#if !defined(__AVX512VNNI__) && !defined(__AVX2__) && !defined(__AVX__)
    UNUSED(dst);
    return false;
#else
    return ggml_tiled_matmul_enabled() && dst->src[0]->type == GGML_TYPE_Q4_K && dst->src[0]->ne[1] % 8 == 0 &&
           dst->src[1]->type == GGML_TYPE_F32;
#endif
}

// whether the tiled products take dst on nth threads: a 2-D product of enough rows whose every
// tile starts on a group of 8 rows
static bool ggml_tiled_q4_Kx8_takes(const struct ggml_tensor * dst, int nth) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    return ggml_tiled_reads_q4_Kx8(dst) && src0->ne[2] == 1 && src0->ne[3] == 1 && src1->ne[2] == 1 &&
           src1->ne[3] == 1 && ggml_tiled_min_batch(src1->ne[1]) &&
           ggml_tiled_chunk_rows(src0->ne[1], src1->ne[1], nth) % 8 == 0;
}

// the work buffer the product takes here: src1 quantized, then a tile workspace per thread
extern "C" size_t ggml_tiled_q4_Kx8_wdata_size(int n_threads, const struct ggml_tensor * dst) {
    if (!ggml_tiled_q4_Kx8_takes(dst, n_threads)) {
        return 0;
    }
    const size_t src1 = ggml_row_size(GGML_TYPE_Q8_K, ggml_nelements(dst->src[1]));
    return GGML_PAD(src1, 64) + 64 + (size_t) n_threads * ggml_tiled_ws_size();
}

// MUL_MAT on a repacked Q4_K 8x8 weight; false: not taken here (the repacked kernels compute it)
extern "C" bool ggml_compute_forward_mul_mat_tiled_q4_Kx8(const struct ggml_compute_params * params,
                                                          struct ggml_tensor *               dst) {
    if (params->use_ref || !ggml_tiled_q4_Kx8_takes(dst, params->nth) ||
        params->wsize < ggml_tiled_q4_Kx8_wdata_size(params->nth, dst)) {
        return false;
    }
    ggml_compute_forward_mul_mat_tiled_driver<block_q4_Kx8_tiled, 32, true, 0, false>(params, dst);
    return true;
}

// the work buffer MUL_MAT_ID on a repacked Q4_K 8x8 weight takes here beyond the repack's own:
// a tile workspace per thread, 64-byte aligned
extern "C" size_t ggml_tiled_q4_Kx8_id_wdata_size(int n_threads, const struct ggml_tensor * dst) {
    return ggml_tiled_reads_q4_Kx8(dst) ? 64 + (size_t) n_threads * ggml_tiled_ws_size() : 0;
}

// one expert of MUL_MAT_ID on a repacked Q4_K 8x8 weight, its `cne1` rows listed at expert_rows
// as ggml's MUL_MAT_ID lists them (expert slot, src1 row); src1 quantized in the work buffer as
// ggml quantizes it for the stored blocks. false: not taken here (too few rows).
extern "C" bool ggml_tiled_q4_Kx8_mul_mat_id(const struct ggml_compute_params * params, struct ggml_tensor * dst,
                                             int64_t cur_a, int64_t cne1, const int32_t * expert_rows,
                                             char * scratch) {
    if (params->use_ref || !ggml_tiled_reads_q4_Kx8(dst) || !ggml_tiled_min_batch(cne1)) {
        return false;
    }
    ggml_compute_forward_mul_mat_id_tiled_one_expert<block_q4_Kx8_tiled, 32, true, 0, false>(
        params, dst, cur_a, cne1, expert_rows, scratch);
    return true;
}
