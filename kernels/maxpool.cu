// maxpool.cu: NHWC max-pooling forward (with argmax indices) and backward.
//
// Window (kh, kw), stride (sh, sw), padding (top, left; bottom/right enter through Ho, Wo). Padding
// behaves as -inf. Forward writes y and, per output element, the winning tap t = i * kw + j as uint8
// (so kh * kw <= 256). Ties keep the FIRST maximum in tap order; a NaN in the window wins and
// propagates (as numpy's max/argmax), and a window with only -inf/padding reports tap 0.
// Backward: one thread per input element gathers dy from every output window whose recorded tap points
// at it (no atomics, deterministic); a gradient recorded at a padding position is dropped.
// float32 or float16 (`_f16`) storage. Flat indices are `unsigned int` when x and y have fewer than 2^31
// elements (the launcher's choice), else `long long` (`_i64` kernels).
#include "common.cuh"

template <typename T, typename I>
__device__ __forceinline__ void maxpool_forward(const T* __restrict__ x, T* __restrict__ y,
                                                unsigned char* __restrict__ idx, int N, int H, int W, int C, int kh,
                                                int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    const I total = (I)N * (I)Ho * (I)Wo * (I)C;
    for (I o = (I)grid_start(); o < total; o += (I)grid_stride()) {
        const int c = (int)(o % (I)C);
        const I p = o / (I)C;
        const int wo = (int)(p % (I)Wo);
        const I nho = p / (I)Wo;
        const int ho = (int)(nho % (I)Ho);
        const int n = (int)(nho / (I)Ho);
        float best = LEAFLENS_NEG_INF;
        int arg = 0;
        for (int i = 0; i < kh; ++i) {
            const int h = ho * sh - pt + i;
            if (h < 0 || h >= H) continue;
            for (int j = 0; j < kw; ++j) {
                const int w = wo * sw - pl + j;
                if (w < 0 || w >= W) continue;
                const float v = load_as_float(x, (((I)n * (I)H + (I)h) * (I)W + (I)w) * (I)C + (I)c);
                // Strictly greater (first maximum wins), or the first NaN; nothing replaces a NaN.
                if (best == best && !(v <= best)) {
                    best = v;
                    arg = i * kw + j;
                }
            }
        }
        store_from_float(y, o, best);
        idx[o] = (unsigned char)arg;
    }
}

template <typename T, typename I>
__device__ __forceinline__ void maxpool_backward(const T* __restrict__ gy, const unsigned char* __restrict__ idx,
                                                 T* __restrict__ gx, int N, int H, int W, int C, int kh, int kw,
                                                 int sh, int sw, int pt, int pl, int Ho, int Wo) {
    const I total = (I)N * (I)H * (I)W * (I)C;
    for (I e = (I)grid_start(); e < total; e += (I)grid_stride()) {
        const int c = (int)(e % (I)C);
        const I p = e / (I)C;
        const int w = (int)(p % (I)W);
        const I nh = p / (I)W;
        const int h = (int)(nh % (I)H);
        const int n = (int)(nh / (I)H);
        float acc = 0.f;
        for (int i = 0; i < kh; ++i) {
            const int hp = h + pt - i;
            if (hp < 0) break;
            if (hp % sh != 0) continue;
            const int ho = hp / sh;
            if (ho >= Ho) continue;
            for (int j = 0; j < kw; ++j) {
                const int wp = w + pl - j;
                if (wp < 0) break;
                if (wp % sw != 0) continue;
                const int wo = wp / sw;
                if (wo >= Wo) continue;
                const I o = (((I)n * (I)Ho + (I)ho) * (I)Wo + (I)wo) * (I)C + (I)c;
                if (idx[o] == i * kw + j) acc += load_as_float(gy, o);
            }
        }
        store_from_float(gx, e, acc);
    }
}

extern "C" __global__ void maxpool_forward_f32(const float* x, float* y, unsigned char* idx,
                                               int N, int H, int W, int C, int kh, int kw,
                                               int sh, int sw, int pt, int pl, int Ho, int Wo) {
    maxpool_forward<float, unsigned int>(x, y, idx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_forward_f32_i64(const float* x, float* y, unsigned char* idx,
                                                   int N, int H, int W, int C, int kh, int kw,
                                                   int sh, int sw, int pt, int pl, int Ho, int Wo) {
    maxpool_forward<float, long long>(x, y, idx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_forward_f16(const half_bits* x, half_bits* y, unsigned char* idx,
                                               int N, int H, int W, int C, int kh, int kw,
                                               int sh, int sw, int pt, int pl, int Ho, int Wo) {
    maxpool_forward<half_bits, unsigned int>(x, y, idx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_forward_f16_i64(const half_bits* x, half_bits* y, unsigned char* idx,
                                                   int N, int H, int W, int C, int kh, int kw,
                                                   int sh, int sw, int pt, int pl, int Ho, int Wo) {
    maxpool_forward<half_bits, long long>(x, y, idx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_backward_f32(const float* gy, const unsigned char* idx, float* gx,
                                                int N, int H, int W, int C, int kh, int kw,
                                                int sh, int sw, int pt, int pl, int Ho, int Wo) {
    maxpool_backward<float, unsigned int>(gy, idx, gx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_backward_f32_i64(const float* gy, const unsigned char* idx, float* gx,
                                                    int N, int H, int W, int C, int kh, int kw,
                                                    int sh, int sw, int pt, int pl, int Ho, int Wo) {
    maxpool_backward<float, long long>(gy, idx, gx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_backward_f16(const half_bits* gy, const unsigned char* idx, half_bits* gx,
                                                int N, int H, int W, int C, int kh, int kw,
                                                int sh, int sw, int pt, int pl, int Ho, int Wo) {
    maxpool_backward<half_bits, unsigned int>(gy, idx, gx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_backward_f16_i64(const half_bits* gy, const unsigned char* idx, half_bits* gx,
                                                    int N, int H, int W, int C, int kh, int kw,
                                                    int sh, int sw, int pt, int pl, int Ho, int Wo) {
    maxpool_backward<half_bits, long long>(gy, idx, gx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
