// DeepSeek-V4's hyper-connections and clamped SwiGLU (src/dsv4.rs), each the scalar reference
// of quiver_backend::dsv4 in the same operations (fused multiply-adds where it fuses): a row's
// results never depend on the other rows of the step.

#define HC_MAX 8

// out[t, h·d + c] = x[t, c] for each of the hc streams.
// grid (ceil(rows·hc·d / 256)), block 256.
extern "C" __global__ void hc_expand(const float* __restrict__ x, float* __restrict__ out, long long rows, int hc,
                                     int d) {
    pdl_begin();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= rows * hc * d) return;
    const long long t = i / ((long long)hc * d);
    out[i] = x[t * d + (int)(i % d)];
}

// silu(min(gate, limit)) · clamp(up, −limit, limit). grid (ceil(n / 256)), block 256.
extern "C" __global__ void swiglu_clamp(const float* __restrict__ gate, const float* __restrict__ up,
                                        float* __restrict__ out, long long n, float limit) {
    pdl_begin();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = fminf(gate[i], limit);
    const float u0 = up[i];
    const float u = u0 != u0 ? u0 : fminf(fmaxf(u0, -limit), limit);
    out[i] = __fdiv_rn(g, 1.f + expf(-g)) * u;
}

__device__ __forceinline__ float hc_sigmoid(float x) { return __fdiv_rn(1.f, 1.f + expf(-x)); }

// One token's pre, post and comb weights from its mixes (quiver_backend::dsv4::hc_weights): pre
// into pre[hc]; unless `head`, post then comb[src·hc + dst] into pc.
__device__ void hc_weights(const float* mixes, const float* scale, const float* base, int hc, float eps,
                           int iters, bool head, float* pre, float* pc) {
    for (int h = 0; h < hc; h++) pre[h] = hc_sigmoid(__fmul_rn(mixes[h], scale[0]) + base[h]) + eps;
    if (head) return;
    for (int h = 0; h < hc; h++) pc[h] = 2.f * hc_sigmoid(__fmul_rn(mixes[hc + h], scale[1]) + base[hc + h]);
    float* comb = pc + hc;
    for (int i = 0; i < hc * hc; i++) comb[i] = fmaf(mixes[2 * hc + i], scale[2], base[2 * hc + i]);
    for (int s = 0; s < hc; s++) {
        float* row = comb + s * hc;
        float m = __int_as_float(0xff800000);
        for (int j = 0; j < hc; j++) m = fmaxf(m, row[j]);
        float sum = 0.f;
        for (int j = 0; j < hc; j++) {
            row[j] = expf(row[j] - m);
            sum += row[j];
        }
        const float inv = __fdiv_rn(1.f, sum);
        for (int j = 0; j < hc; j++) row[j] = fmaf(row[j], inv, eps);
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            for (int s = 0; s < hc; s++) {
                float sum = eps;
                for (int j = 0; j < hc; j++) sum += comb[s * hc + j];
                const float inv = __fdiv_rn(1.f, sum);
                for (int j = 0; j < hc; j++) comb[s * hc + j] = __fmul_rn(comb[s * hc + j], inv);
            }
        }
        for (int dst = 0; dst < hc; dst++) {
            float sum = eps;
            for (int s = 0; s < hc; s++) sum += comb[s * hc + dst];
            const float inv = __fdiv_rn(1.f, sum);
            for (int s = 0; s < hc; s++) comb[s * hc + dst] = __fmul_rn(comb[s * hc + dst], inv);
        }
    }
}

// A block's (or, with `head`, the output head's) input from the hc streams: out[t, c] =
// Σ_h pre[h]·x[t, h·d + c] (the block's fused, the head's products then sums), and the block's
// post and comb weights into pc [rows, hc + hc²]. grid (rows), block 256.
extern "C" __global__ void hc_pre(const float* __restrict__ x, const float* __restrict__ mixes,
                                  const float* __restrict__ scale, const float* __restrict__ base,
                                  float* __restrict__ out, float* __restrict__ pc, int hc, int d, float eps, int iters,
                                  int head) {
    pdl_begin();
    __shared__ float pre[HC_MAX];
    const long long t = blockIdx.x;
    const int md = head ? hc : (2 + hc) * hc, pcd = hc + hc * hc;
    if (threadIdx.x == 0) {
        float w[HC_MAX + HC_MAX * HC_MAX];
        hc_weights(mixes + t * md, scale, base, hc, eps, iters, head != 0, pre, w);
        if (!head)
            for (int i = 0; i < pcd; i++) pc[t * pcd + i] = w[i];
    }
    __syncthreads();
    const float* xt = x + t * hc * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.f;
        for (int h = 0; h < hc; h++)
            acc = head ? __fadd_rn(acc, __fmul_rn(xt[h * d + c], pre[h])) : fmaf(xt[h * d + c], pre[h], acc);
        out[t * d + c] = acc;
    }
}

// A block's output streams: out[t, dst·d + c] = post[dst]·y[t, c] + Σ_src comb[src][dst]·
// residual[t, src·d + c], fused in src order. grid (ceil(rows·hc·d / 256)), block 256.
extern "C" __global__ void hc_post(const float* __restrict__ y, const float* __restrict__ residual,
                                   const float* __restrict__ pc, float* __restrict__ out, long long rows, int hc,
                                   int d) {
    pdl_begin();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= rows * hc * d) return;
    const long long t = i / ((long long)hc * d);
    const int dst = (int)(i / d % hc), c = (int)(i % d);
    const float* w = pc + t * (hc + hc * hc);
    const float* r = residual + t * hc * d;
    float acc = __fmul_rn(y[t * d + c], w[dst]);
    for (int s = 0; s < hc; s++) acc = fmaf(r[s * d + c], w[hc + s * hc + dst], acc);
    out[i] = acc;
}
