// im2col.cu: NHWC im2col and its adjoint col2im, for convolution as one matrix product.
//
// Layout (the engine's contract): x is (N, H, W, C); cols is (M, K) with M = N * Ho * Wo rows,
//   row m = (n * Ho + ho) * Wo + wo,  column k = (i * kw + j) * C + c   (tap-major, channel fastest),
// so cols @ W.transpose(2, 3, 1, 0).reshape(K, Cout) is the NHWC output. Input pixel of (ho, i) is
// h = ho * sh - pad_top + i (same for w with pad_left); outside the image reads as 0. Bottom/right
// padding only enters through Ho and Wo, which the caller computes. Dilation 1.
// im2col: one thread per cols element (coalesced writes; reads are contiguous along c).
// col2im: one thread per x element gathering the (at most kh * kw) cols entries that copied it, so the
// sum of overlapping contributions needs no atomics and is deterministic. Element types: float32, or
// float16 (`_f16`, col2im sums in float32). Flat indices are `unsigned int` when both x and cols have
// fewer than 2^31 elements (the launcher's choice), else `long long` (`_i64` kernels): the divisions
// that split a flat index are the per-element cost, and 32-bit ones are several times cheaper.
#include "common.cuh"

template <typename T, typename I>
__device__ __forceinline__ void im2col_nhwc(const T* __restrict__ x, T* __restrict__ cols, int N, int H, int W,
                                            int C, int kh, int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    const I K = (I)kh * (I)kw * (I)C;
    const I total = (I)N * (I)Ho * (I)Wo * K;
    for (I idx = (I)grid_start(); idx < total; idx += (I)grid_stride()) {
        const I m = idx / K;
        const int k = (int)(idx - m * K);
        const int c = k % C;
        const int tap = k / C;
        const int j = tap % kw;
        const int i = tap / kw;
        const int wo = (int)(m % (I)Wo);
        const I nho = m / (I)Wo;
        const int ho = (int)(nho % (I)Ho);
        const int n = (int)(nho / (I)Ho);
        const int h = ho * sh - pt + i;
        const int w = wo * sw - pl + j;
        T v = (T)0;
        if (h >= 0 && h < H && w >= 0 && w < W) v = x[(((I)n * (I)H + (I)h) * (I)W + (I)w) * (I)C + (I)c];
        cols[idx] = v;
    }
}

template <typename T, typename I>
__device__ __forceinline__ void col2im_nhwc(const T* __restrict__ cols, T* __restrict__ x, int N, int H, int W,
                                            int C, int kh, int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    const I K = (I)kh * (I)kw * (I)C;
    const I total = (I)N * (I)H * (I)W * (I)C;
    for (I idx = (I)grid_start(); idx < total; idx += (I)grid_stride()) {
        const int c = (int)(idx % (I)C);
        const I p = idx / (I)C;
        const int w = (int)(p % (I)W);
        const I nh = p / (I)W;
        const int h = (int)(nh % (I)H);
        const int n = (int)(nh / (I)H);
        float acc = 0.f;
        for (int i = 0; i < kh; ++i) {
            const int hp = h + pt - i;  // = ho * sh when tap i of output row ho lands on h
            if (hp < 0) break;          // larger i only makes hp smaller
            if (hp % sh != 0) continue;
            const int ho = hp / sh;
            if (ho >= Ho) continue;
            for (int j = 0; j < kw; ++j) {
                const int wp = w + pl - j;
                if (wp < 0) break;
                if (wp % sw != 0) continue;
                const int wo = wp / sw;
                if (wo >= Wo) continue;
                const I m = ((I)n * (I)Ho + (I)ho) * (I)Wo + (I)wo;
                acc += load_as_float(cols, m * K + (I)((i * kw + j) * C + c));
            }
        }
        store_from_float(x, idx, acc);
    }
}

extern "C" __global__ void im2col_nhwc_f32(const float* x, float* cols, int N, int H, int W, int C, int kh,
                                           int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    im2col_nhwc<float, unsigned int>(x, cols, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void im2col_nhwc_f32_i64(const float* x, float* cols, int N, int H, int W, int C, int kh,
                                               int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    im2col_nhwc<float, long long>(x, cols, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void im2col_nhwc_f16(const half_bits* x, half_bits* cols, int N, int H, int W, int C, int kh,
                                           int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    im2col_nhwc<half_bits, unsigned int>(x, cols, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void im2col_nhwc_f16_i64(const half_bits* x, half_bits* cols, int N, int H, int W, int C, int kh,
                                               int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    im2col_nhwc<half_bits, long long>(x, cols, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void col2im_nhwc_f32(const float* cols, float* x, int N, int H, int W, int C, int kh,
                                           int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    col2im_nhwc<float, unsigned int>(cols, x, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void col2im_nhwc_f32_i64(const float* cols, float* x, int N, int H, int W, int C, int kh,
                                               int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    col2im_nhwc<float, long long>(cols, x, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void col2im_nhwc_f16(const half_bits* cols, half_bits* x, int N, int H, int W, int C, int kh,
                                           int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    col2im_nhwc<half_bits, unsigned int>(cols, x, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void col2im_nhwc_f16_i64(const half_bits* cols, half_bits* x, int N, int H, int W, int C, int kh,
                                               int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    col2im_nhwc<half_bits, long long>(cols, x, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
