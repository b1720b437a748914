// softmax_xent.cu: fused softmax + cross-entropy over the last axis of (N, C) logits.
//
// Forward: one block per row, one read of the row. Each thread keeps an online (max, sum of exp)
// pair, so the row maximum never needs a separate pass; pairs are merged across the block with warp
// shuffles. Per row it writes the loss and two saved statistics: stats[2r] = log-sum-exp, stats[2r+1]
// = total target mass (1 for class-index targets, 0 for a row whose target is the ignore index;
// sum(q) for soft targets), which makes the backward an exact gradient even when soft targets do not
// sum to one, and lets the host side count the rows of a mean without reading anything back.
//   hard targets t (int64) with label smoothing eps:
//       q = (1 - eps) * onehot(t) + eps / C,  loss_r = (1 - eps) * (lse - z_t) + eps * (lse - mean(z))
//       a row with t == ignore_index (when has_ignore): loss_r = 0, mass 0
//   soft targets q (N, C):  loss_r = sum(q) * lse - sum(q * z)
// Both are evaluated relative to the row's maximum: lse - z_t as (max - z_t) + log(sum exp(z - max)), and the
// sums of z as sums of (z - max), kept relative to each thread's running maximum while they are summed, so
// logits of 3e4, or a masked class at -1e9, lose nothing to cancellation. A term whose weight is 0 is left
// out (a masked logit of -inf then adds nothing, as on the CPU, not NaN).
// A target index outside [0, C) (and not ignored) gives a NaN row loss instead of an out-of-bounds read.
// Backward (element-wise, one pass): dz = (exp(z - lse) * mass - q) * scale, where q is zero on an
// ignored row (so dz is too) and `scale` points at the upstream gradient already divided by the mean's
// row count (a device scalar, so no host synchronisation is needed).
// Index width: the element-wise backward divides a flat index by C; the launcher picks the 32-bit
// (`unsigned int`) variant when N * C < 2^31 and the `_i64` variant beyond (see common.cuh).
// Storage may be float32 or float16 (`_f16` kernels); all arithmetic is float32.
#include "common.cuh"

// Online update of a (max, sum exp(z - max)) pair with one value z.
__device__ __forceinline__ void online_add(float& m, float& s, float z) {
    if (z > m) {
        s = s * expf(m - z) + 1.f;  // m = -inf on the first value: expf(-inf) = 0
        m = z;
    } else if (z != LEAFLENS_NEG_INF) {
        s += expf(z - m);
    }
}

// Merge (m2, s2) into (m, s); an empty pair has m = -inf, s = 0.
__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == LEAFLENS_NEG_INF) return;  // both empty (or all -inf): nothing to add
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

// Block-wide merge of the online pairs: every thread gets the row's maximum in m and returns
// log(sum exp(z - m)); the log-sum-exp is their sum.
__device__ __forceinline__ float block_max_logsum(float& m, float s, float* sm, float* ss) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        online_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sm[warp] = m;
        ss[warp] = s;
    }
    __syncthreads();
    m = (lane < nwarps) ? sm[lane] : LEAFLENS_NEG_INF;
    s = (lane < nwarps) ? ss[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        online_merge(m, s, m2, s2);
    }
    return logf(s);
}

// Adds w * (v - m) to a weighted sum of logits kept relative to the running maximum m, for a value v that was
// already counted in m (online_add ran first) and whose weight is not 0; wsum is the weight counted before v.
// A new maximum moves the earlier terms down by wsum * (m_new - m_old): relative to the maximum, no term is
// the difference of two large logits (relative to the first logit, a finite -1e9 there cost every digit).
__device__ __forceinline__ void shifted_add(float& dev, float wsum, float w, float v, float m_before, float m) {
    if (m != m_before && wsum != 0.f) dev -= wsum * (m - m_before);
    dev += (v == LEAFLENS_NEG_INF) ? LEAFLENS_NEG_INF * w : w * (v - m);  // -inf with weight: the loss is +inf
}

// The weighted sum of one thread, relative to its own maximum m_own, made relative to the row's maximum m.
__device__ __forceinline__ float to_row_max(float dev, float wsum, float m_own, float m) {
    return (wsum != 0.f && m != m_own) ? dev - wsum * (m - m_own) : dev;
}

template <typename T>
__device__ __forceinline__ void xent_hard_forward(const T* __restrict__ logits, const long long* __restrict__ targets,
                                                  float* __restrict__ row_loss, float* __restrict__ stats, int N,
                                                  int C, float smoothing, long long ignore_index, int has_ignore) {
    __shared__ float sm[32], ss[32], sz[32];
    const int row = blockIdx.x;
    if (row >= N) return;  // uniform across the block
    const T* z = logits + (long long)row * C;
    float m = LEAFLENS_NEG_INF, s = 0.f, zdev = 0.f, count = 0.f;  // zdev = sum(z - m) over this thread's logits
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = load_as_float(z, c);
        const float before = m;
        online_add(m, s, v);
        shifted_add(zdev, count, 1.f, v, before, m);
        count += 1.f;
    }
    const float m_own = m;
    const float logs = block_max_logsum(m, s, sm, ss);  // m is the row's maximum from here on
    const float lse = m + logs;
    zdev = block_sum(to_row_max(zdev, count, m_own, m), sz);
    if (threadIdx.x == 0) {
        const long long t = targets[row];
        float loss = 0.f, mass = 1.f;
        if (has_ignore && t == ignore_index) {
            loss = 0.f;  // left out of the loss and of the mean's row count
            mass = 0.f;
        } else if (t < 0 || t >= C) {
            loss = __int_as_float(0x7fc00000);  // NaN marks an invalid class index
        } else {
            const float zt = load_as_float(z, t);
            if (smoothing != 1.f) loss += (1.f - smoothing) * ((m - zt) + logs);
            if (smoothing != 0.f) loss += smoothing * (logs - zdev / (float)C);
        }
        row_loss[row] = loss;
        stats[2 * (long long)row] = lse;
        stats[2 * (long long)row + 1] = mass;
    }
}

template <typename T>
__device__ __forceinline__ void xent_soft_forward(const T* __restrict__ logits, const float* __restrict__ q,
                                                  float* __restrict__ row_loss, float* __restrict__ stats, int N,
                                                  int C) {
    __shared__ float sm[32], ss[32], sq[32], sqz[32];
    const int row = blockIdx.x;
    if (row >= N) return;
    const T* z = logits + (long long)row * C;
    const float* qr = q + (long long)row * C;
    float m = LEAFLENS_NEG_INF, s = 0.f, qsum = 0.f, qz = 0.f;  // qz = sum(q * (z - m)) over this thread's logits
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = load_as_float(z, c);
        const float w = qr[c];
        const float before = m;
        online_add(m, s, v);
        if (w != 0.f) {
            shifted_add(qz, qsum, w, v, before, m);  // a masked class (logit -inf) without target mass adds 0
        } else if (m != before && qsum != 0.f) {
            qz -= qsum * (m - before);
        }
        qsum += w;
    }
    const float m_own = m;
    const float logs = block_max_logsum(m, s, sm, ss);  // m is the row's maximum from here on
    const float lse = m + logs;
    qz = block_sum(to_row_max(qz, qsum, m_own, m), sqz);
    qsum = block_sum(qsum, sq);
    if (threadIdx.x == 0) {
        row_loss[row] = qsum * logs - qz;
        stats[2 * (long long)row] = lse;
        stats[2 * (long long)row + 1] = qsum;
    }
}

// I: the flat index type (unsigned int when N * C < 2^31, else long long).
template <typename T, typename I>
__device__ __forceinline__ void xent_hard_backward(const T* __restrict__ logits, const long long* __restrict__ targets,
                                                   const float* __restrict__ stats, const float* __restrict__ scale,
                                                   T* __restrict__ dlogits, int N, int C, float smoothing) {
    const I total = (I)N * (I)C;
    const float g = scale[0];
    const float off = smoothing / (float)C;
    for (I i = (I)grid_start(); i < total; i += (I)grid_stride()) {
        const I row = i / (I)C;
        const int c = (int)(i - row * (I)C);
        const float mass = stats[2 * row + 1];  // 1, or 0 on an ignored row (whose q is 0 too)
        const float p = expf(load_as_float(logits, i) - stats[2 * row]);
        const float q = (targets[row] == c ? 1.f - smoothing : 0.f) + off;
        store_from_float(dlogits, i, mass * (p - q) * g);
    }
}

template <typename T, typename I>
__device__ __forceinline__ void xent_soft_backward(const T* __restrict__ logits, const float* __restrict__ q,
                                                   const float* __restrict__ stats, const float* __restrict__ scale,
                                                   T* __restrict__ dlogits, int N, int C) {
    const I total = (I)N * (I)C;
    const float g = scale[0];
    for (I i = (I)grid_start(); i < total; i += (I)grid_stride()) {
        const I row = i / (I)C;
        const float p = expf(load_as_float(logits, i) - stats[2 * row]);
        store_from_float(dlogits, i, (p * stats[2 * row + 1] - q[i]) * g);
    }
}

extern "C" __global__ void xent_hard_forward_f32(const float* logits, const long long* targets, float* row_loss,
                                                 float* stats, int N, int C, float smoothing, long long ignore_index,
                                                 int has_ignore) {
    xent_hard_forward(logits, targets, row_loss, stats, N, C, smoothing, ignore_index, has_ignore);
}
extern "C" __global__ void xent_hard_forward_f16(const half_bits* logits, const long long* targets,
                                                 float* row_loss, float* stats, int N, int C, float smoothing,
                                                 long long ignore_index, int has_ignore) {
    xent_hard_forward(logits, targets, row_loss, stats, N, C, smoothing, ignore_index, has_ignore);
}
extern "C" __global__ void xent_soft_forward_f32(const float* logits, const float* q, float* row_loss, float* stats,
                                                 int N, int C) {
    xent_soft_forward(logits, q, row_loss, stats, N, C);
}
extern "C" __global__ void xent_soft_forward_f16(const half_bits* logits, const float* q, float* row_loss,
                                                 float* stats, int N, int C) {
    xent_soft_forward(logits, q, row_loss, stats, N, C);
}
extern "C" __global__ void xent_hard_backward_f32(const float* logits, const long long* targets, const float* stats,
                                                  const float* scale, float* dlogits, int N, int C,
                                                  float smoothing) {
    xent_hard_backward<float, unsigned int>(logits, targets, stats, scale, dlogits, N, C, smoothing);
}
extern "C" __global__ void xent_hard_backward_f16(const half_bits* logits, const long long* targets,
                                                  const float* stats, const float* scale, half_bits* dlogits, int N,
                                                  int C, float smoothing) {
    xent_hard_backward<half_bits, unsigned int>(logits, targets, stats, scale, dlogits, N, C, smoothing);
}
extern "C" __global__ void xent_hard_backward_f32_i64(const float* logits, const long long* targets,
                                                      const float* stats, const float* scale, float* dlogits, int N,
                                                      int C, float smoothing) {
    xent_hard_backward<float, long long>(logits, targets, stats, scale, dlogits, N, C, smoothing);
}
extern "C" __global__ void xent_hard_backward_f16_i64(const half_bits* logits, const long long* targets,
                                                      const float* stats, const float* scale, half_bits* dlogits,
                                                      int N, int C, float smoothing) {
    xent_hard_backward<half_bits, long long>(logits, targets, stats, scale, dlogits, N, C, smoothing);
}
extern "C" __global__ void xent_soft_backward_f32(const float* logits, const float* q, const float* stats,
                                                  const float* scale, float* dlogits, int N, int C) {
    xent_soft_backward<float, unsigned int>(logits, q, stats, scale, dlogits, N, C);
}
extern "C" __global__ void xent_soft_backward_f16(const half_bits* logits, const float* q, const float* stats,
                                                  const float* scale, half_bits* dlogits, int N, int C) {
    xent_soft_backward<half_bits, unsigned int>(logits, q, stats, scale, dlogits, N, C);
}
extern "C" __global__ void xent_soft_backward_f32_i64(const float* logits, const float* q, const float* stats,
                                                      const float* scale, float* dlogits, int N, int C) {
    xent_soft_backward<float, long long>(logits, q, stats, scale, dlogits, N, C);
}
extern "C" __global__ void xent_soft_backward_f16_i64(const half_bits* logits, const float* q, const float* stats,
                                                      const float* scale, half_bits* dlogits, int N, int C) {
    xent_soft_backward<half_bits, long long>(logits, q, stats, scale, dlogits, N, C);
}
