// maxpool.cu: NHWC max-pooling forward (with argmax indices) and backward.
//
// Window (kh, kw), stride (sh, sw), padding (top, left; bottom/right enter through Ho, Wo). Padding
// behaves as -inf. Forward writes y and, per output element, the winning tap t = i * kw + j as uint8
// (so kh * kw <= 256). Ties keep the FIRST maximum in tap order; a NaN in the window wins and
// propagates (as numpy's max/argmax), and a window with only -inf/padding reports tap 0.
// Backward: one thread per input element gathers dy from every output window whose recorded tap points
// at it (no atomics, deterministic); a gradient recorded at a padding position is dropped.
// float32 or float16 (`_f16`) storage.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void maxpool_forward(const T* __restrict__ x, T* __restrict__ y,
                                                unsigned char* __restrict__ idx, int N, int H, int W, int C, int kh,
                                                int kw, int sh, int sw, int pt, int pl, int Ho, int Wo) {
    const long long total = (long long)N * Ho * Wo * C;
    for (long long o = grid_start(); o < total; o += grid_stride()) {
        const int c = (int)(o % C);
        const long long p = o / C;
        const int wo = (int)(p % Wo);
        const long long nho = p / Wo;
        const int ho = (int)(nho % Ho);
        const int n = (int)(nho / Ho);
        float best = LEAFLENS_NEG_INF;
        int arg = 0;
        for (int i = 0; i < kh; ++i) {
            const int h = ho * sh - pt + i;
            if (h < 0 || h >= H) continue;
            for (int j = 0; j < kw; ++j) {
                const int w = wo * sw - pl + j;
                if (w < 0 || w >= W) continue;
                const float v = load_as_float(x, (((long long)n * H + h) * W + w) * C + c);
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

template <typename T>
__device__ __forceinline__ void maxpool_backward(const T* __restrict__ gy, const unsigned char* __restrict__ idx,
                                                 T* __restrict__ gx, int N, int H, int W, int C, int kh, int kw,
                                                 int sh, int sw, int pt, int pl, int Ho, int Wo) {
    const long long total = (long long)N * H * W * C;
    for (long long e = grid_start(); e < total; e += grid_stride()) {
        const int c = (int)(e % C);
        const long long p = e / C;
        const int w = (int)(p % W);
        const long long nh = p / W;
        const int h = (int)(nh % H);
        const int n = (int)(nh / H);
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
                const long long o = (((long long)n * Ho + ho) * Wo + wo) * C + c;
                if (idx[o] == i * kw + j) acc += load_as_float(gy, o);
            }
        }
        store_from_float(gx, e, acc);
    }
}

extern "C" __global__ void maxpool_forward_f32(const float* x, float* y, unsigned char* idx, int N, int H, int W,
                                               int C, int kh, int kw, int sh, int sw, int pt, int pl, int Ho,
                                               int Wo) {
    maxpool_forward(x, y, idx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_forward_f16(const half_bits* x, half_bits* y, unsigned char* idx, int N, int H,
                                               int W, int C, int kh, int kw, int sh, int sw, int pt, int pl, int Ho,
                                               int Wo) {
    maxpool_forward(x, y, idx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_backward_f32(const float* gy, const unsigned char* idx, float* gx, int N, int H,
                                                int W, int C, int kh, int kw, int sh, int sw, int pt, int pl, int Ho,
                                                int Wo) {
    maxpool_backward(gy, idx, gx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
extern "C" __global__ void maxpool_backward_f16(const half_bits* gy, const unsigned char* idx, half_bits* gx, int N,
                                                int H, int W, int C, int kh, int kw, int sh, int sw, int pt, int pl,
                                                int Ho, int Wo) {
    maxpool_backward(gy, idx, gx, N, H, W, C, kh, kw, sh, sw, pt, pl, Ho, Wo);
}
