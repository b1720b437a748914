// activation_grad.cu: ReLU / LeakyReLU / ReLU6 backward from the saved OUTPUT y, element-wise.
//
// The forward keeps only y, so the mask comes from y itself:
//   relu:        dx = y > 0       ? dy : 0
//   leaky_relu:  dx = y > 0       ? dy : slope * dy   (slope > 0 keeps the sign of x in y)
//   relu6:       dx = 0 < y < 6   ? dy : 0
// The conditions are value selects (compiled to selp), not branches, so a warp never diverges. A
// masked-out position yields exactly 0 even when dy is inf/NaN, as in PyTorch. Grid-stride loops;
// float32 or float16 storage (`_f16`), float32 arithmetic.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void relu_grad(const T* __restrict__ y, const T* __restrict__ gy, T* __restrict__ gx,
                                          long long n) {
    for (long long i = grid_start(); i < n; i += grid_stride()) {
        const float g = load_as_float(gy, i);
        store_from_float(gx, i, load_as_float(y, i) > 0.f ? g : 0.f);
    }
}

template <typename T>
__device__ __forceinline__ void leaky_relu_grad(const T* __restrict__ y, const T* __restrict__ gy,
                                                T* __restrict__ gx, long long n, float slope) {
    for (long long i = grid_start(); i < n; i += grid_stride()) {
        const float g = load_as_float(gy, i);
        store_from_float(gx, i, load_as_float(y, i) > 0.f ? g : slope * g);
    }
}

template <typename T>
__device__ __forceinline__ void relu6_grad(const T* __restrict__ y, const T* __restrict__ gy, T* __restrict__ gx,
                                           long long n) {
    for (long long i = grid_start(); i < n; i += grid_stride()) {
        const float v = load_as_float(y, i);
        const float g = load_as_float(gy, i);
        const bool pass = (v > 0.f) & (v < 6.f);
        store_from_float(gx, i, pass ? g : 0.f);
    }
}

extern "C" __global__ void relu_grad_f32(const float* y, const float* gy, float* gx, long long n) {
    relu_grad(y, gy, gx, n);
}
extern "C" __global__ void relu_grad_f16(const half_bits* y, const half_bits* gy, half_bits* gx, long long n) {
    relu_grad(y, gy, gx, n);
}
extern "C" __global__ void leaky_relu_grad_f32(const float* y, const float* gy, float* gx, long long n, float slope) {
    leaky_relu_grad(y, gy, gx, n, slope);
}
extern "C" __global__ void leaky_relu_grad_f16(const half_bits* y, const half_bits* gy, half_bits* gx, long long n,
                                               float slope) {
    leaky_relu_grad(y, gy, gx, n, slope);
}
extern "C" __global__ void relu6_grad_f32(const float* y, const float* gy, float* gx, long long n) {
    relu6_grad(y, gy, gx, n);
}
extern "C" __global__ void relu6_grad_f16(const half_bits* y, const half_bits* gy, half_bits* gx, long long n) {
    relu6_grad(y, gy, gx, n);
}
