"""The source of shardwire's CPU kernels: ggml-python 0.0.45's bindings and CMake project with the
ggml that llama.cpp's release 0.3.36 ships instead of the one the bindings vendor: the same C API,
and the kernels llama.cpp computes with today (its tiled K-quant products read a prompt chunk of
stored Q4_K-Q6_K weights about twice as fast as the older ggml's). Both sources are the sdists on
PyPI, checked against the hashes below; build_backend.py builds them with cmake into the package.

The changes to that ggml are shardwire's own (PATCHES, tiled_q4_Kx8.cpp, vnni_gemm.cpp,
float_gemm.cpp, gemv.cpp, kquant_gemm.cpp, lattice_dot.cpp, products.cpp). Its tiled K-quant
products also read Q4_K weights held in the repacked layout, which the repack buffer's products of a
prompt chunk (and its MUL_MAT_ID experts with 8 rows or more) then take, so that a repacked Q4_K
weight reads prompts as fast as stored blocks do (on x86 the repacked GEMM reads a 64-row chunk 1.6x
slower) and still decodes on the repacked GEMV. And the repack buffer's MUL_MAT_ID, which read an
expert once per row (the one-row GEMV), takes an expert's rows four at a time through the repacked
GEMM, as its MUL_MAT does a matrix's, to the GEMV's bits (Q4_0) or within their rounding (Q4_K): a
64-token prompt of the Qwen3-MoE benchmark layout in Q4_0 1.17x faster. And the tiles fetch the
weight blocks they unpack next into the cache ahead of use (tiled_prefetch_ahead). And on CPUs with
AVX-512 (VNNI for the quantized types) a prompt chunk's product (16 rows or more) on Q8_0, F32, F16
or Q6_K weights, on Q4_0 weights held repacked or on Q4_K held either way goes to vnni_gemm.cpp,
float_gemm.cpp or kquant_gemm.cpp instead of llamafile's tinyBLAS, the repack buffer's GEMM or the
tiled products: at 64 rows on the EPYC (`python benchmarks/products.py --rows 64`) Q8_0 3.4x faster,
Q4_0 1.8x, F32 1.9x, F16 1.2x, Q4_K 1.15-1.22x, Q6_K 1.23x. And there one row of activations (a
decode step) on Q8_0 or F16 weights, which llamafile declines, or on Q4_0 or Q4_K held repacked goes
to gemv.cpp before ggml's dot products or the repack buffer's GEMV: the same arithmetic (F16, Q4_0
to the bit), with the weights fetched 8 KiB ahead, streaming Q8_0 1.3-1.8x, F16 1.1x, repacked Q4_0
1.4-1.6x and Q4_K 1.3x faster on the EPYC (`python benchmarks/products.py`). And ggml's dot products
of IQ2_XXS and IQ3_XXS (every row of such a matrix or expert that is not dequantized) go to
lattice_dot.cpp on CPUs with AVX-512 VNNI, VBMI and BITALG: ggml's bits, 1.3-1.5x faster on the
EPYC. Each of those can be switched off at run time (products.cpp): shardwire times each against the
kernel it stands in for and keeps only the faster.

The bindings' version is LOCAL_VERSION (ggml-python's with a local part): shardwire keeps the
kernel measurements of one build apart from another's by it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

BINDINGS = ("ggml-python", "0.0.45", "10aac52075cf3c7ef2b00d6c35b1c23f7b018dbeff8ae8df67339b4be1166f05")
LLAMA_CPP = ("llama-cpp-python", "0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
LOCAL_VERSION = f"{BINDINGS[1]}+llamacpp.{LLAMA_CPP[1]}.shardwire.23"
GGML_PARTS = ("CMakeLists.txt", "cmake", "include", "src")  # the rest of the vendored folder stays
HERE = Path(__file__).resolve().parent

# (file under ggml/src/ggml-cpu, text found exactly once, its replacement)
PATCHES = [
    (  # where the tiles read a weight block: one place, which another layout specializes
        "tiled/tiled.cpp",
        "template <typename B, int SUBBLK, bool HAS_MIN, int BIAS, bool ACTBIAS>\nstatic void tiled_mmid_gemm_window(",
        "// shardwire: where the tiles read weight block (row, kblk); specialized for other layouts\n"
        "template <typename B>\n"
        "static const B * tiled_src0_at(const char * row0, int64_t row, int64_t kblk, size_t nb01, size_t bs) {\n"
        "    return (const B *) (row0 + row * nb01 + kblk * bs);\n"
        "}\n\n"
        "template <typename B, int SUBBLK, bool HAS_MIN, int BIAS, bool ACTBIAS>\n"
        "static void tiled_mmid_gemm_window(",
    ),
    (
        "tiled/tiled.cpp",
        "const B * wbase = (const B *) (src0_cur + ir0 * src0->nb[1] + kstart * src0_bs);",
        "const B * wbase = tiled_src0_at<B>(src0_cur, ir0, kstart, src0->nb[1], src0_bs);",
    ),
    (
        "tiled/tiled.cpp",
        "tiled_unpack_src0((const B *) (src0_cur + r * src0->nb[1] + kblk * src0_bs), src0_stride",
        "tiled_unpack_src0(tiled_src0_at<B>(src0_cur, r, kblk, src0->nb[1], src0_bs), src0_stride",
    ),
    (
        "tiled/tiled.cpp",
        "const B * wbase = (const B *) (src0_row + ir0 * nb01 + kstart * src0_bs);",
        "const B * wbase = tiled_src0_at<B>(src0_row, ir0, kstart, nb01, src0_bs);",
    ),
    (
        "tiled/tiled.cpp",
        "tiled_unpack_src0((const B *) (src0_row + iir0 * nb01 + kblk * src0_bs), src0_stride, n_src0, &ws->src0, 1);",
        "tiled_unpack_src0(tiled_src0_at<B>(src0_row, iir0, kblk, nb01, src0_bs), src0_stride, n_src0, &ws->src0, 1);",
    ),
    (
        "repack.cpp",
        '#include "repack.h"\n',
        '#include "repack.h"\n\n#include <type_traits>\n\n'
        "// shardwire: a prompt chunk's product on repacked Q4_K through the tiled kernels (tiled.cpp)\n"
        'extern "C" bool ggml_compute_forward_mul_mat_tiled_q4_Kx8(const struct ggml_compute_params *, '
        "struct ggml_tensor *);\n"
        'extern "C" size_t ggml_tiled_q4_Kx8_wdata_size(int, const struct ggml_tensor *);\n'
        'extern "C" bool ggml_tiled_q4_Kx8_mul_mat_id(const struct ggml_compute_params *, struct ggml_tensor *, '
        "int64_t, int64_t, const int32_t *, char *);\n"
        'extern "C" size_t ggml_tiled_q4_Kx8_id_wdata_size(int, const struct ggml_tensor *);\n\n'
        "// shardwire: one thread's room for an expert's rows through the repacked GEMM in MUL_MAT_ID:\n"
        "// 4 rows of K floats, the same quantized and interleaved, 4 rows of N results\n"
        "static inline size_t shardwire_gemm_id_slot(int64_t K, int64_t N, size_t q_row) {\n"
        "    return GGML_PAD(4 * K * sizeof(float) + GGML_PAD(4 * q_row, 64) + 4 * N * sizeof(float), 64);\n"
        "}\n",
    ),
    (
        "repack.cpp",
        "                    size += sizeof_mmid_row_mapping*ne02*(ne12 + 1);\n",
        "                    size += sizeof_mmid_row_mapping*ne02*(ne12 + 1);\n"
        "                    if constexpr (TILED_Q4_Kx8) {  // then the tiled products' workspaces\n"
        "                        size += ggml_tiled_q4_Kx8_id_wdata_size(n_threads, op);\n"
        "                    }\n"
        "                    {  // then the GEMM's rooms\n"
        "                        const int64_t K = op->src[1]->ne[0], N = op->src[0]->ne[1];\n"
        "                        size += 64 + (size_t) n_threads *\n"
        "                            shardwire_gemm_id_slot(K, N, ggml_row_size(PARAM_TYPE, K));\n"
        "                    }\n",
    ),
    (  # an expert's rows four at a time through the repacked GEMM, the rest through the GEMV
        "repack.cpp",
        "            for (int ir1 = 0; ir1 < nr1; ir1++) {\n",
        "            int64_t ir1_first = 0;  // shardwire: rows before this went through the GEMM\n"
        "            if (cne1 >= 4) {\n"
        "                char * room = (char *) (matrix_rows + n_as * ne12);\n"
        "                room = (char *) (((uintptr_t) room + 63) & ~(uintptr_t) 63);\n"
        "                if constexpr (TILED_Q4_Kx8) {\n"
        "                    room += ggml_tiled_q4_Kx8_id_wdata_size(nth, dst);\n"
        "                }\n"
        "                room += (size_t) ith * shardwire_gemm_id_slot(ne10, ne01, nbw1);\n"
        "                float * rows = (float *) room;\n"
        "                char * quantized = room + 4 * ne10 * sizeof(float);\n"
        "                float * out = (float *) (quantized + GGML_PAD(4 * nbw1, 64));\n"
        "                const int64_t ncols = src0_cur_end - src0_cur_start;\n"
        "                for (; ir1_first + 4 <= cne1; ir1_first += 4) {\n"
        "                    for (int r = 0; r < 4; r++) {\n"
        "                        const struct mmid_row_mapping m = MMID_MATRIX_ROW(cur_a, ir1_first + r);\n"
        "                        const char * row = (const char *) src1->data + (m.i1 % ne11) * nb11 + m.i2 * nb12;\n"
        "                        memcpy(rows + r * ne10, row, ne10 * sizeof(float));\n"
        "                    }\n"
        "                    ggml_quantize_mat_t<INTER_SIZE, PARAM_TYPE>(rows, quantized, 4, ne10);\n"
        "                    gemm<BLOC_TYPE, INTER_SIZE, NB_COLS, PARAM_TYPE>(ne00, out + src0_cur_start, ne01,\n"
        "                        src0_cur + src0_cur_start * nb01, quantized, 4, ncols);\n"
        "                    for (int r = 0; r < 4; r++) {\n"
        "                        const struct mmid_row_mapping m = MMID_MATRIX_ROW(cur_a, ir1_first + r);\n"
        "                        char * to = (char *) dst->data + m.i1 * nb1 + m.i2 * nb2;\n"
        "                        memcpy(to + src0_cur_start * sizeof(float), out + r * ne01 + src0_cur_start,\n"
        "                               ncols * sizeof(float));\n"
        "                    }\n"
        "                }\n"
        "            }\n"
        "            for (int ir1 = ir1_first; ir1 < nr1; ir1++) {\n",
    ),
    (
        "repack.cpp",
        "            const auto * src0_cur = (const char *) src0->data + cur_a*nb02;\n",
        "            if constexpr (TILED_Q4_Kx8) {  // an expert with enough rows: the tiled products\n"
        "                char * scratch = (char *) (matrix_rows + n_as * ne12);\n"
        "                scratch = (char *) (((uintptr_t) scratch + 63) & ~(uintptr_t) 63);\n"
        "                if (ggml_tiled_q4_Kx8_mul_mat_id(params, dst, cur_a, cne1,\n"
        "                                                 (const int32_t *) &MMID_MATRIX_ROW(cur_a, 0), scratch)) {\n"
        "                    continue;\n"
        "                }\n"
        "            }\n"
        "            const auto * src0_cur = (const char *) src0->data + cur_a*nb02;\n",
    ),
    (
        "repack.cpp",
        "    bool work_size(int /* n_threads */, const struct ggml_tensor * op, size_t & size) override {\n"
        "        // not realy a GGML_TYPE_Q8_0 but same size.\n"
        "        switch (op->op) {\n"
        "            case GGML_OP_MUL_MAT:\n"
        "                {\n"
        "                    size = ggml_row_size(PARAM_TYPE, ggml_nelements(op->src[1]));\n",
        "    bool work_size(int n_threads, const struct ggml_tensor * op, size_t & size) override {\n"
        "        // not realy a GGML_TYPE_Q8_0 but same size.\n"
        "        switch (op->op) {\n"
        "            case GGML_OP_MUL_MAT:\n"
        "                {\n"
        "                    size = ggml_row_size(PARAM_TYPE, ggml_nelements(op->src[1]));\n"
        "                    if constexpr (TILED_Q4_Kx8) {\n"
        "                        size = std::max(size, ggml_tiled_q4_Kx8_wdata_size(n_threads, op));\n"
        "                    }\n"
        "                    (void) n_threads;\n",
    ),
    (
        "repack.cpp",
        "            case GGML_OP_MUL_MAT:\n                forward_mul_mat(params, op);\n",
        "            case GGML_OP_MUL_MAT:\n"
        "                if constexpr (TILED_Q4_Kx8) {\n"
        "                    if (shardwire_q4_Kx8_gemv(params, op) || shardwire_q4_Kx8_gemm(params, op) ||\n"
        "                        ggml_compute_forward_mul_mat_tiled_q4_Kx8(params, op)) {\n"
        "                        return true;\n"
        "                    }\n"
        "                }\n"
        "                if constexpr (VNNI_Q4_0x8) {\n"
        "                    if (shardwire_q4_0x8_gemv(params, op) || shardwire_q4_0x8_mul_mat(params, op)) {\n"
        "                        return true;\n"
        "                    }\n"
        "                }\n"
        "                forward_mul_mat(params, op);\n",
    ),
    (
        "repack.cpp",
        "template <typename BLOC_TYPE, int64_t INTER_SIZE, int64_t NB_COLS, ggml_type PARAM_TYPE> "
        "class tensor_traits : public tensor_traits_base {\n",
        "template <typename BLOC_TYPE, int64_t INTER_SIZE, int64_t NB_COLS, ggml_type PARAM_TYPE> "
        "class tensor_traits : public tensor_traits_base {\n"
        "    static constexpr bool TILED_Q4_Kx8 =\n"
        "        std::is_same_v<BLOC_TYPE, block_q4_K> && INTER_SIZE == 8 && NB_COLS == 8;\n"
        "    static constexpr bool VNNI_Q4_0x8 =\n"
        "        std::is_same_v<BLOC_TYPE, block_q4_0> && INTER_SIZE == 8 && NB_COLS == 8;\n",
    ),
]
# The tiles unpack a K block of each of their rows in turn: blocks a row apart (a group of 8 rows
# apart in the repacked layout), a stride the hardware prefetchers do not follow across pages, so
# each block waited on memory. Each unpack fetches the block TILED_AHEAD rows on while it unpacks one:
# a 64-row product on the EPYC 1.07x faster on stored Q4_K, 1.25x on repacked Q4_K, 1.09x on Q6_K.
PATCHES += [
    (
        "tiled/tiled.cpp",
        "#define UNUSED GGML_UNUSED\n",
        "#define UNUSED GGML_UNUSED\n\n"
        "// shardwire: the weight block `ahead` rows on from row r (of n_rows), fetched into the cache\n"
        "#define TILED_AHEAD 8\n"
        "template <typename B>\n"
        "static inline void tiled_prefetch_ahead(const B * rows, int64_t row_stride, int r, int slab, int n_rows,\n"
        "                                        int ahead = TILED_AHEAD) {\n"
        "    if (r + ahead < n_rows) {\n"
        "        const char * block = (const char *) &rows[(int64_t) (r + ahead) * row_stride + slab];\n"
        "        const uintptr_t end = (uintptr_t) (block + sizeof(B));\n"
        "        for (uintptr_t line = (uintptr_t) block & ~(uintptr_t) 63; line < end; line += 64) {\n"
        "            __builtin_prefetch((const void *) line);\n"
        "        }\n"
        "    }\n"
        "}\n",
    ),
] + [
    (
        "tiled/tiled.cpp",
        f"const block_{t} & x = rows[r * row_stride + slab];\n",
        f"const block_{t} & x = rows[r * row_stride + slab];\n"
        "            tiled_prefetch_ahead(rows, row_stride, r, slab, n_rows);\n",
    )
    for t in "q2_K q3_K q4_K q5_K q6_K iq1_s iq1_m iq2_xxs iq2_xs iq2_s iq3_xxs iq3_s iq4_xs".split()
]
PATCHES += [  # ggml's dot products of IQ2_XXS and IQ3_XXS go through lattice_dot.cpp, which takes them where on
    (
        "ggml-cpu.c",
        '#include "tiled/tiled.h"\n',
        '#include "tiled/tiled.h"\n\n'
        + "".join(
            f"void shardwire_vec_dot_{t}_q8_K(int, float *, size_t, const void *, size_t, const void *, size_t, int);\n"
            for t in ("iq2_xxs", "iq3_xxs")
        ),
    ),
] + [
    (
        "ggml-cpu.c",
        f"        .vec_dot                  = ggml_vec_dot_{t}_q8_K,\n",
        f"        .vec_dot                  = shardwire_vec_dot_{t}_q8_K,\n",
    )
    for t in ("iq2_xxs", "iq3_xxs")
]
PATCHES += [  # a prompt chunk on Q8_0, F32 or F16 weights, or Q4_0 held repacked, goes to shardwire's kernels first
    (
        "llamafile/sgemm.cpp",
        "#include <type_traits>\n",
        "#include <type_traits>\n\n"
        "// shardwire: a prompt chunk's product on Q8_0 (vnni_gemm.cpp), F32 and F16 weights (float_gemm.cpp)\n"
        + "".join(
            f'extern "C" bool shardwire_{t}_gemm(const struct ggml_compute_params *, int64_t, int64_t, int64_t, '
            "const void *, int64_t, const void *, int64_t, float *, int64_t);\n"
            for t in ("q8_0", "f32", "f16")
        )
        + 'extern "C" bool shardwire_gemv(const struct ggml_compute_params *, int64_t, int64_t, const void *, int64_t, '
        "const void *, float *, int, int);  // shardwire: gemv.cpp\n",
    ),
    (  # one row of activations, which tinyBLAS declines, goes to gemv.cpp before ggml's dot products
        "llamafile/sgemm.cpp",
        "#if !defined(__MMA__)\n    if (n < 2)\n        return false;\n#endif\n",
        "#if !defined(__MMA__)\n    if (n < 2)\n"
        "        return Ctype == GGML_TYPE_F32 && shardwire_gemv(params, m, k, A, lda, B, (float *) C, Atype, Btype);\n"
        "#endif\n",
    ),
    (
        "llamafile/sgemm.cpp",
        "    case GGML_TYPE_F32: {\n        if (Btype != GGML_TYPE_F32)\n            return false;\n",
        "    case GGML_TYPE_F32: {\n        if (Btype != GGML_TYPE_F32)\n            return false;\n"
        "        if (shardwire_f32_gemm(params, m, n, k, A, lda, B, ldb, (float *) C, ldc))\n"
        "            return true;\n",
    ),
    (
        "llamafile/sgemm.cpp",
        "    case GGML_TYPE_F16: {\n#if defined(__AVX512F__)\n",
        "    case GGML_TYPE_F16: {\n#if defined(__AVX512F__)\n"
        "        if (Btype == GGML_TYPE_F32 && shardwire_f16_gemm(params, m, n, k, A, lda, B, ldb, (float *) C, ldc))\n"
        "            return true;\n",
    ),
    (  # the work buffer holds float_gemm.cpp's interleaved rows, in place of ggml's F16 copy of them
        "ggml-cpu.c",
        '#include "tiled/tiled.h"\n',
        '#include "tiled/tiled.h"\n\n'
        "bool shardwire_float_gemm_work_size(const struct ggml_tensor *, size_t *);  // shardwire: float_gemm.cpp\n"
        "bool shardwire_kquant_gemm(const struct ggml_compute_params *, struct ggml_tensor *);  // kquant_gemm.cpp\n",
    ),
    (  # a prompt chunk on stored Q4_K or Q6_K goes to kquant_gemm.cpp before the tiled products
        "ggml-cpu.c",
        "    // If tiled is supported, it will execute the full op here and we return\n",
        "    if (shardwire_kquant_gemm(params, dst)) {\n        return;\n    }\n\n"
        "    // If tiled is supported, it will execute the full op here and we return\n",
    ),
    (
        "ggml-cpu.c",
        "                case GGML_OP_MUL_MAT:\n                    {\n",
        "                case GGML_OP_MUL_MAT:\n                    {\n"
        "                        if (shardwire_float_gemm_work_size(node, &cur)) {\n"
        "                            break;\n"
        "                        }\n",
    ),
    (
        "llamafile/sgemm.cpp",
        "    case GGML_TYPE_Q8_0: {\n        if (Btype != GGML_TYPE_Q8_0)\n           return false;\n",
        "    case GGML_TYPE_Q8_0: {\n        if (Btype != GGML_TYPE_Q8_0)\n           return false;\n"
        "        if (shardwire_q8_0_gemm(params, m, n, k, A, lda, B, ldb, (float *) C, ldc))\n"
        "            return true;\n",
    ),
    (
        "repack.cpp",
        '#include "repack.h"\n',
        '#include "repack.h"\n\n'
        'extern "C" bool shardwire_q4_0x8_mul_mat(const struct ggml_compute_params *, struct ggml_tensor *);\n'
        'extern "C" bool shardwire_q4_0x8_gemv(const struct ggml_compute_params *, struct ggml_tensor *);\n'
        'extern "C" bool shardwire_q4_Kx8_gemv(const struct ggml_compute_params *, struct ggml_tensor *);\n'
        'extern "C" bool shardwire_q4_Kx8_gemm(const struct ggml_compute_params *, struct ggml_tensor *);\n',
    ),
]
APPENDED = [  # (file, this folder's source added at its end)
    ("tiled/tiled.cpp", "tiled_q4_Kx8.cpp"),
    ("repack.cpp", "products.cpp"),
    ("repack.cpp", "vnni_gemm.cpp"),
    ("repack.cpp", "float_gemm.cpp"),
    ("repack.cpp", "gemv.cpp"),
    ("repack.cpp", "kquant_gemm.cpp"),
    ("repack.cpp", "lattice_dot.cpp"),
]


def _sdist(name: str, version: str, sha256: str, into: Path, isolated: bool = False) -> Path:
    """The sdist of name==version from the package index pip is configured with; pip checks its
    hash before it reads anything in it. pip reads an sdist's metadata with its build backend:
    inside shardwire's build with the build's own, elsewhere (`isolated`) in an environment of
    its own."""
    pinned = into / f"{name}.txt"
    into.mkdir(parents=True, exist_ok=True)
    pinned.write_text(f"{name}=={version} --hash=sha256:{sha256}\n")
    isolation = [] if isolated else ["--no-build-isolation"]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", *isolation,
         "--quiet", "-d", str(into), "-r", str(pinned)],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if "BACKEND_PATH" not in k},  # this hook's, not the sdist's
    )  # fmt: skip
    if done.returncode != 0:
        lines = done.stderr.splitlines()
        errors = [line for line in lines if line.startswith("ERROR:")] or lines[-3:]
        raise RuntimeError(f"pip could not download {name}=={version}: " + " ".join(errors))
    return into / f"{name.replace('-', '_')}-{version}.tar.gz"


def kept_llama_cpp() -> Path:
    """Where the pinned llama.cpp sdist is kept between builds: the folder benchmarks/build_llama_cpp.sh
    builds from, which llama.cpp's converter (shardwire_kit/convert.py) also reads."""
    name, version, _ = LLAMA_CPP
    cache = os.environ.get("LLAMA_CPP_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "shardwire", "llama.cpp"
    )
    return Path(cache, "src", f"{name.replace('-', '_')}-{version}.tar.gz")


def kept_sdist() -> Path | None:
    """The kept llama.cpp sdist where its hash is the pinned one, else None."""
    kept = kept_llama_cpp()
    if kept.is_file() and hashlib.sha256(kept.read_bytes()).hexdigest() == LLAMA_CPP[2]:
        return kept
    return None


def keep_sdist(archive: Path) -> None:
    """A downloaded llama.cpp sdist (its hash checked by pip) kept for the next build and the
    converter, so neither fetches 76 MB again; where the cache cannot be written, nothing is kept."""
    kept = kept_llama_cpp()
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=kept.parent, prefix=f".{kept.name}-", delete=False) as tmp:
            shutil.copyfileobj(archive.open("rb"), tmp)
        os.replace(tmp.name, kept)
    except OSError:
        pass


def _llama_cpp_sdist(downloads: Path) -> Path:
    kept = kept_sdist()
    if kept is not None:
        return kept
    archive = _sdist(*LLAMA_CPP, downloads)
    keep_sdist(archive)
    return archive


def _extract(archive: Path, into: Path, *under: str) -> Path:
    """The sdist's top folder, extracted (only the paths `under` within it where given), in one
    pass over the compressed archive."""
    with tarfile.open(archive) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        prefixes = [f"{top}/{part}".rstrip("/") for part in under or ("",)]
        members = [m for m in tar.getmembers() if any(m.name == p or m.name.startswith(p + "/") for p in prefixes)]
        tar.extractall(into, members=members, filter="data")
    return into / top


def prepared_source(work: Path) -> Path:
    """ggml-python's source tree in `work` with llama.cpp's ggml, patched, in place of its vendored
    one, its bindings marked with LOCAL_VERSION and loading their library from whichever package
    holds them."""
    downloads = work / "sdists"
    bindings = _extract(_sdist(*BINDINGS, downloads), work)
    llama_cpp = _extract(_llama_cpp_sdist(downloads), work, "vendor/llama.cpp/ggml")
    vendored, newer = bindings / "vendor" / "ggml", llama_cpp / "vendor" / "llama.cpp" / "ggml"
    for part in GGML_PARTS:
        target = vendored / part
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        (shutil.copytree if (newer / part).is_dir() else shutil.copy2)(newer / part, target)
    _patch(vendored / "src" / "ggml-cpu")
    _replace_once(
        bindings / "ggml" / "__init__.py", f'__version__ = "{BINDINGS[1]}"', f'__version__ = "{LOCAL_VERSION}"'
    )
    _replace_once(bindings / "ggml" / "ggml.py", 'module_name = "ggml"\n', "module_name = __package__\n")
    return bindings


def _replace_once(path: Path, found: str, replacement: str) -> None:
    text = path.read_text()
    if text.count(found) != 1:
        raise RuntimeError(f"{path}: {found[:60]!r}... occurs {text.count(found)} times, not once")
    path.write_text(text.replace(found, replacement))


def _patch(cpu: Path) -> None:
    """PATCHES and APPENDED applied to ggml's CPU sources, each anchor checked to occur once."""
    for name, found, replacement in PATCHES:
        _replace_once(cpu / name, found, replacement)
    for name, source in APPENDED:
        path = cpu / name
        path.write_text(path.read_text() + "\n" + (HERE / source).read_text())
