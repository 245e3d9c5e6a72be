// shardwire: which of shardwire's products (a prompt chunk's: vnni_gemm.cpp, float_gemm.cpp,
// kquant_gemm.cpp; one row's: gemv.cpp, lattice_dot.cpp) this build has, and which of them run.
// Each is taken only where it was timed faster than the kernel it stands in for on this CPU
// (shardwire/weights/measure.py switches them with shardwire_products_use); a build for a CPU
// without AVX-512 has none. Switching one off gives its products back to tinyBLAS, the repack
// buffer's GEMM, the tiled products or ggml's dot products on the next graph computed: the work
// sizes planned cover either.
//
// kernels/build_backend.py appends this file to ggml-cpu/repack.cpp, before the products.

#include <atomic>

enum : unsigned {  // one bit a product; shardwire/weights/ggml_cpu.py names them by rows and stored type
    SHARDWIRE_Q8_0 = 1u << 0,
    SHARDWIRE_Q4_0X8 = 1u << 1,  // Q4_0 held repacked
    SHARDWIRE_F32 = 1u << 2,
    SHARDWIRE_F16 = 1u << 3,
    SHARDWIRE_Q8_0_GEMV = 1u << 4,  // one row
    SHARDWIRE_F16_GEMV = 1u << 5,
    SHARDWIRE_Q4_0X8_GEMV = 1u << 6,
    SHARDWIRE_Q4_KX8_GEMV = 1u << 7,
    SHARDWIRE_Q4_K = 1u << 8,  // held repacked or as stored: kquant_gemm.cpp
    SHARDWIRE_Q6_K = 1u << 9,
    SHARDWIRE_IQ2_XXS_DOT = 1u << 10,  // ggml's dot products, one row or more: lattice_dot.cpp
    SHARDWIRE_IQ3_XXS_DOT = 1u << 11,
};

static std::atomic<unsigned> shardwire_products_on{~0u};

static inline bool shardwire_product_on(unsigned product) {
    return (shardwire_products_on.load(std::memory_order_relaxed) & product) != 0;
}

extern "C" unsigned shardwire_products_built(void) {
    unsigned built = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    built |= SHARDWIRE_Q8_0 | SHARDWIRE_Q4_0X8;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    built |= SHARDWIRE_Q8_0_GEMV | SHARDWIRE_F16_GEMV | SHARDWIRE_Q4_0X8_GEMV | SHARDWIRE_Q4_KX8_GEMV | SHARDWIRE_Q4_K |
             SHARDWIRE_Q6_K;
#endif
#if defined(__AVX512F__)
    built |= SHARDWIRE_F32 | SHARDWIRE_F16;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
    built |= SHARDWIRE_IQ2_XXS_DOT | SHARDWIRE_IQ3_XXS_DOT;
#endif
    return built;
}

// between graph computations only: a computation reads the switches as it goes
extern "C" void shardwire_products_use(unsigned products) {
    shardwire_products_on.store(products, std::memory_order_relaxed);
}

extern "C" unsigned shardwire_products_used(void) {
    return shardwire_products_on.load(std::memory_order_relaxed) & shardwire_products_built();
}
