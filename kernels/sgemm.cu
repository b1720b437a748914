// sgemm.cu: tiled shared-memory single-precision matrix product C = A @ B (row-major, float32).
//
// Educational reference kernel, benchmarked against cuBLAS in benchmarks/gpu.py. Each block of 256
// threads computes a 64x64 tile of C, walking K in steps of 16: the A and B tiles are staged in shared
// memory (A stored k-major so the inner loop reads both tiles along rows), and each thread keeps a 4x4
// block of accumulators in registers. Thread (ty, tx) owns rows ty + 16*i and columns tx + 16*j of the
// tile, so a warp reads 16 consecutive floats of the B tile (no bank conflicts) and writes C coalesced.
// All loads and stores are bounds-checked, so any M, N, K works (K = 0 gives C = 0).
#include "common.cuh"

#define SGEMM_BM 64
#define SGEMM_BN 64
#define SGEMM_BK 16
#define SGEMM_THREADS 256

extern "C" __global__ void __launch_bounds__(SGEMM_THREADS)
sgemm_tiled(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N,
            int K) {
    __shared__ float As[SGEMM_BK][SGEMM_BM + 4];
    __shared__ float Bs[SGEMM_BK][SGEMM_BN + 4];

    const int tid = threadIdx.x;
    const int tx = tid % 16;
    const int ty = tid / 16;
    const int row0 = blockIdx.y * SGEMM_BM;
    const int col0 = blockIdx.x * SGEMM_BN;

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

    for (int k0 = 0; k0 < K; k0 += SGEMM_BK) {
        // A tile (BM x BK): 1024 values, 4 per thread; consecutive threads read consecutive k.
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int e = tid + r * SGEMM_THREADS;
            const int m = e / SGEMM_BK;
            const int kk = e % SGEMM_BK;
            const int gm = row0 + m;
            const int gk = k0 + kk;
            As[kk][m] = (gm < M && gk < K) ? A[(long long)gm * K + gk] : 0.f;
        }
        // B tile (BK x BN): consecutive threads read consecutive columns.
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int e = tid + r * SGEMM_THREADS;
            const int kk = e / SGEMM_BN;
            const int n = e % SGEMM_BN;
            const int gk = k0 + kk;
            const int gn = col0 + n;
            Bs[kk][n] = (gk < K && gn < N) ? B[(long long)gk * N + gn] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < SGEMM_BK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int gm = row0 + ty + 16 * i;
        if (gm >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int gn = col0 + tx + 16 * j;
            if (gn < N) C[(long long)gm * N + gn] = acc[i][j];
        }
    }
}
