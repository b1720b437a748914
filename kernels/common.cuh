// common.cuh: helpers shared by every leaflens kernel family.
//
// kernels/_cuda.py inlines this file in place of `#include "common.cuh"` before handing the source
// to NVRTC, so CuPy's kernel cache (keyed on the source text) sees every change here. Nothing in it
// needs a CUDA header: float16 values are carried as their raw 16 bits (`half_bits`, how CuPy stores a
// float16 array) and converted with one PTX instruction, so the kernels compile under NVRTC without
// an include path. The test suite also builds these sources for the CPU (LEAFLENS_HOST_EMULATION) to
// run them without a GPU; that branch uses the compiler's _Float16 for the same IEEE conversions.
#ifndef LEAFLENS_COMMON_CUH
#define LEAFLENS_COMMON_CUH

typedef unsigned short half_bits;

#define LEAFLENS_NEG_INF __int_as_float(0xff800000)

#ifdef LEAFLENS_HOST_EMULATION
__device__ __forceinline__ float half_to_float(half_bits h) {
    _Float16 v;
    __builtin_memcpy(&v, &h, 2);
    return (float)v;
}
__device__ __forceinline__ half_bits float_to_half(float f) {
    _Float16 v = (_Float16)f;  // round to nearest even, as cvt.rn
    half_bits h;
    __builtin_memcpy(&h, &v, 2);
    return h;
}
#else
__device__ __forceinline__ float half_to_float(half_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ half_bits float_to_half(float f) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// Loads and stores that work in float32 whatever the storage type (float32 accumulation).
__device__ __forceinline__ float load_as_float(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_as_float(const half_bits* p, long long i) { return half_to_float(p[i]); }
__device__ __forceinline__ void store_from_float(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_from_float(half_bits* p, long long i, float v) { p[i] = float_to_half(v); }

// Index of this thread in a 1-D grid-stride loop, and the stride. Element-wise kernels that split a
// flat index with divisions (im2col, maxpool, softmax_xent's backward) are templates on the index type:
// `unsigned int` when every array they index has fewer than 2^31 elements, `long long` (the `_i64`
// kernels) otherwise; the Python launcher picks one by size (kernels/_checks.py index_suffix).
__device__ __forceinline__ long long grid_start() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_stride() {
    return (long long)gridDim.x * blockDim.x;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum over the whole block; every thread gets the total. blockDim.x must be a multiple of 32 (at most
// 1024) and every thread of the block must call it. `scratch` is a __shared__ float[32]; the leading
// barrier makes back-to-back calls with the same scratch safe.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? scratch[lane] : 0.f;
    return warp_sum(v);
}

#endif  // LEAFLENS_COMMON_CUH
