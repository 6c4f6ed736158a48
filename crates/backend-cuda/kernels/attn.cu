// Attention of each batch token over its sequence's paged f16 K/V cache, split over the keys.
//
// grid (n_split, n_head, n_tokens), block (32, ATT_WARPS). Each warp walks keys of the split;
// lane l holds dims l, l+32, … of q and of the output (HD/32 each). Online softmax per warp,
// merged across warps in shared memory. With n_split == 1 the result goes straight to `out`;
// otherwise each split writes (max, sum, unnormalised acc) to `part` and attn_merge combines.
#define ATT_WARPS 4

template <int HD>
__device__ void attention_impl(const float* __restrict__ q, const u16* __restrict__ kc,
                               const u16* __restrict__ vc, float* __restrict__ out,
                               float* __restrict__ part, BatchView b, int n_head, int n_head_kv,
                               float scale, int window, float softcap) {
    const int NV = HD / 32;
    int split = blockIdx.x, n_split = gridDim.x, h = blockIdx.y, t = blockIdx.z;
    int lane = threadIdx.x, w = threadIdx.y;
    int kv_dim = n_head_kv * HD, kvh = h / (n_head / n_head_kv);
    u32 s = b.seq[t];
    int p = (int)b.pos[t];
    int hi = min(p + 1, (int)b.kv_len[s]);
    int lo = window > 0 ? max(0, p - window + 1) : 0;
    if (hi < lo) hi = lo;
    int chunk = (hi - lo + n_split - 1) / n_split;
    int k0 = lo + split * chunk, k1 = min(hi, k0 + chunk);
    const u32* bt = b.block_tables + b.bt_off[s];
    float qv[NV];
    const float* qt = q + ((long long)t * n_head + h) * HD;
#pragma unroll
    for (int i = 0; i < NV; i++) qv[i] = qt[lane + 32 * i] * scale;
    float m = -1e30f, l = 0.f, acc[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) acc[i] = 0.f;
    for (int j = k0 + w; j < k1; j += ATT_WARPS) {
        long long slot = (long long)bt[j / b.block_size] * b.block_size + j % b.block_size;
        const u16* kr = kc + slot * kv_dim + kvh * HD;
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < NV; i++) d += qv[i] * h2f(kr[lane + 32 * i]);
        d = warp_sum(d);
        if (softcap > 0.f) d = softcap * tanhf(d / softcap);
        float mn = fmaxf(m, d), corr = __expf(m - mn), pj = __expf(d - mn);
        l = l * corr + pj;
        const u16* vr = vc + slot * kv_dim + kvh * HD;
#pragma unroll
        for (int i = 0; i < NV; i++) acc[i] = acc[i] * corr + pj * h2f(vr[lane + 32 * i]);
        m = mn;
    }
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS], sacc[ATT_WARPS][HD];
    if (lane == 0) { sm[w] = m; sl[w] = l; }
#pragma unroll
    for (int i = 0; i < NV; i++) sacc[w][lane + 32 * i] = acc[i];
    __syncthreads();
    if (w != 0) return;
    float M = sm[0];
#pragma unroll
    for (int k = 1; k < ATT_WARPS; k++) M = fmaxf(M, sm[k]);
    float L = 0.f, c[ATT_WARPS];
#pragma unroll
    for (int k = 0; k < ATT_WARPS; k++) { c[k] = __expf(sm[k] - M); L += sl[k] * c[k]; }
    if (n_split == 1) {
        float inv = L > 0.f ? 1.f / L : 0.f;
        float* o = out + ((long long)t * n_head + h) * HD;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            float a = 0.f;
#pragma unroll
            for (int k = 0; k < ATT_WARPS; k++) a += sacc[k][lane + 32 * i] * c[k];
            o[lane + 32 * i] = a * inv;
        }
    } else {
        float* pp = part + (((long long)t * n_head + h) * n_split + split) * (HD + 2);
        if (lane == 0) { pp[0] = M; pp[1] = L; }
#pragma unroll
        for (int i = 0; i < NV; i++) {
            float a = 0.f;
#pragma unroll
            for (int k = 0; k < ATT_WARPS; k++) a += sacc[k][lane + 32 * i] * c[k];
            pp[2 + lane + 32 * i] = a;
        }
    }
}

// grid (n_head, n_tokens), block HD.
template <int HD>
__device__ void attn_merge_impl(const float* __restrict__ part, float* __restrict__ out, int n_head, int n_split) {
    int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    const float* pp = part + ((long long)t * n_head + h) * n_split * (HD + 2);
    float M = -1e30f;
    for (int k = 0; k < n_split; k++) M = fmaxf(M, pp[k * (HD + 2)]);
    float L = 0.f, a = 0.f;
    for (int k = 0; k < n_split; k++) {
        float c = __expf(pp[k * (HD + 2)] - M);
        L += pp[k * (HD + 2) + 1] * c;
        a += pp[k * (HD + 2) + 2 + d] * c;
    }
    out[((long long)t * n_head + h) * HD + d] = L > 0.f ? a / L : 0.f;
}

#define ATTN_KERNELS(HD)                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attention_##HD(                     \
        const float* q, const u16* kc, const u16* vc, float* out, float* part, BatchView b,         \
        int n_head, int n_head_kv, float scale, int window, float softcap) {                        \
        attention_impl<HD>(q, kc, vc, out, part, b, n_head, n_head_kv, scale, window, softcap);      \
    }                                                                                                \
    extern "C" __global__ void attn_merge_##HD(const float* part, float* out, int n_head, int n_split) { \
        attn_merge_impl<HD>(part, out, n_head, n_split);                                             \
    }
ATTN_KERNELS(64)
ATTN_KERNELS(128)
ATTN_KERNELS(256)
