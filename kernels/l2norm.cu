// l2norm.cu: L2-normalisation over the last axis of a (N, D) array, forward and backward.
//
//   forward:  norm_r = ||x_r||,  y_r = x_r / max(norm_r, eps)
//   backward: dx_r = (dy_r - y_r * <dy_r, y_r>) / norm_r   when norm_r >= eps
//             dx_r = dy_r / eps                            when norm_r <  eps (y = x / eps is linear there)
// One block per row; the squared norm and the dot product are block reductions in float32. The forward
// saves norm (float32, N) for the backward. float32 or float16 storage (`_f16`).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void l2norm_forward(const T* __restrict__ x, T* __restrict__ y, float* __restrict__ norm,
                                               int N, int D, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= N) return;
    const long long base = (long long)row * D;
    float ss = 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const float v = load_as_float(x, base + d);
        ss += v * v;
    }
    const float nrm = sqrtf(block_sum(ss, scratch));
    const float denom = fmaxf(nrm, eps);
    for (int d = threadIdx.x; d < D; d += blockDim.x) store_from_float(y, base + d, load_as_float(x, base + d) / denom);
    if (threadIdx.x == 0) norm[row] = nrm;
}

template <typename T>
__device__ __forceinline__ void l2norm_backward(const T* __restrict__ y, const T* __restrict__ gy,
                                                const float* __restrict__ norm, T* __restrict__ gx, int N, int D,
                                                float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= N) return;
    const long long base = (long long)row * D;
    float dot = 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) dot += load_as_float(gy, base + d) * load_as_float(y, base + d);
    dot = block_sum(dot, scratch);
    const float nrm = norm[row];
    const bool tiny = nrm < eps;
    const float denom = tiny ? eps : nrm;
    const float k = tiny ? 0.f : dot;  // below eps the map is linear: no projection term
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const float g = load_as_float(gy, base + d);
        store_from_float(gx, base + d, (g - load_as_float(y, base + d) * k) / denom);
    }
}

extern "C" __global__ void l2norm_forward_f32(const float* x, float* y, float* norm, int N, int D, float eps) {
    l2norm_forward(x, y, norm, N, D, eps);
}
extern "C" __global__ void l2norm_forward_f16(const half_bits* x, half_bits* y, float* norm, int N, int D, float eps) {
    l2norm_forward(x, y, norm, N, D, eps);
}
extern "C" __global__ void l2norm_backward_f32(const float* y, const float* gy, const float* norm, float* gx, int N,
                                               int D, float eps) {
    l2norm_backward(y, gy, norm, gx, N, D, eps);
}
extern "C" __global__ void l2norm_backward_f16(const half_bits* y, const half_bits* gy, const float* norm,
                                               half_bits* gx, int N, int D, float eps) {
    l2norm_backward(y, gy, norm, gx, N, D, eps);
}
