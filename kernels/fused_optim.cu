// fused_optim.cu: optimiser updates over ONE flat float32 parameter buffer, in a single pass.
//
// The buffer may hold many parameters or one: the engine's optimisers (engine/optim, through
// engine/ops/_kernels.py) launch once per parameter over a flat view of it, one launch instead of
// several element-wise kernels per tensor.
// PyTorch semantics:
//   SGD:   d = g * grad_scale + weight_decay * p        (L2 decay added to the gradient)
//          b = momentum * b + d                          (dampening 0; b starts at 0, so b_1 = d_1)
//          p -= lr * (nesterov ? d + momentum * b : b)  (momentum 0 gives plain SGD)
//   AdamW: p *= 1 - lr * weight_decay                    (decoupled decay, before the moments)
//          m = beta1 * m + (1 - beta1) * g,  v = beta2 * v + (1 - beta2) * g^2   (g = grad * grad_scale)
//          p -= step_size * m / (sqrt(v) / bias_correction2_sqrt + eps)
//          with step_size = lr / (1 - beta1^t), bias_correction2_sqrt = sqrt(1 - beta2^t), computed by the
//          caller in float64 for step t.
// grad_scale folds gradient unscaling (1 / loss_scale) and a clipping factor into the same pass.
//   EMA:   avg = decay * avg + (1 - decay) * p             (the running average of the weights, ModelEMA)
#include "common.cuh"

extern "C" __global__ void sgd_momentum_f32(float* __restrict__ p, const float* __restrict__ g,
                                            float* __restrict__ buf, long long n, float lr, float momentum,
                                            float weight_decay, float grad_scale, int nesterov) {
    for (long long i = grid_start(); i < n; i += grid_stride()) {
        const float pi = p[i];
        const float d = g[i] * grad_scale + weight_decay * pi;
        const float b = momentum * buf[i] + d;
        buf[i] = b;
        const float step = nesterov ? d + momentum * b : b;
        p[i] = pi - lr * step;
    }
}

extern "C" __global__ void adamw_f32(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                     float* __restrict__ v, long long n, float lr, float beta1, float beta2, float eps,
                                     float weight_decay, float step_size, float bias_correction2_sqrt,
                                     float grad_scale) {
    const float decay = 1.f - lr * weight_decay;
    for (long long i = grid_start(); i < n; i += grid_stride()) {
        const float gi = g[i] * grad_scale;
        const float mi = beta1 * m[i] + (1.f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float denom = sqrtf(vi) / bias_correction2_sqrt + eps;
        p[i] = p[i] * decay - step_size * mi / denom;
    }
}

extern "C" __global__ void ema_f32(float* __restrict__ avg, const float* __restrict__ p, long long n, float decay) {
    const float rest = 1.f - decay;
    for (long long i = grid_start(); i < n; i += grid_stride()) {
        avg[i] = decay * avg[i] + rest * p[i];
    }
}
