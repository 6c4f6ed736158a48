// Attention over the KV cache of any element type (quiver_backend::kvcodec; f16 included): the
// write of the types other than f16 (kv_encode), the split-K attention per head and the
// KV-group decode attention over the records, keys and values decoded on the fly.
//
// Types, as KvType orders them: 0 f16, 1 bf16, 2 q8_0, 3 tq8, 4 tq4. A cache row (one slot of
// one layer) is n_head_kv head records of kv_head_bytes(type, HD) bytes:
//   f16/bf16: the values; q8_0: ggml's block_q8_0 per 32 (f16 scale, 32 int8);
//   tq8/tq4: the codes of the rotated vector (a byte, or a nibble with the even coordinate low),
//            then the f32 RMS of each block of 256 coordinates.
// The TurboQuant tables (`tq`): 512 signs (±1), the 256 tq8 levels (the encoder's; decoders
// compute them, tq8_code), the 16 tq4 levels.
#define KV_F16 0
#define KV_BF16 1
#define KV_Q8_0 2
#define KV_TQ8 3
#define KV_TQ4 4
#define TQ_SIGNS 0
#define TQ_L8 512
#define TQ_L4 768
#define TQ_BLOCK 256
// turboquant::TQ8_STEP, the spacing of tq8's levels: level c is (c − 127.5) · TQ8_STEP.
#define TQ8_STEP 0x1.f802c6p-6f

// Code i (0–3) of the four in `a`, as c − 127.5 (tq8's level without its step), exactly: one
// byte permute makes the float 2^15 + c + ½ (bytes 0x80, c, 0, 0x47), one subtraction the rest.
__device__ __forceinline__ float tq8_code(u32 a, int i) {
    return __uint_as_float(__byte_perm(a, 0x47000080u, 0x7504 | (i << 4))) - 32896.f;
}

// Whether records of type ty and head dim d are rotated (TurboQuant; the Walsh–Hadamard transform
// needs a power of two: other head dims are never launched with those types).
__host__ __device__ constexpr bool kv_tq(int ty) { return ty == KV_TQ8 || ty == KV_TQ4; }
__host__ __device__ constexpr bool kv_rotated(int ty, int d) { return kv_tq(ty) && (d & (d - 1)) == 0; }
__host__ __device__ constexpr int kv_code_bytes(int ty, int d) { return ty == KV_TQ4 ? d / 2 : d; }
__host__ __device__ constexpr int kv_head_bytes(int ty, int d) {
    return ty == KV_F16 || ty == KV_BF16 ? 2 * d
         : ty == KV_Q8_0               ? d / 32 * 34
                                       : kv_code_bytes(ty, d) + 4 * ((d + TQ_BLOCK - 1) / TQ_BLOCK);
}

// The Walsh–Hadamard transform of `rows` rows of d values at x in shared memory, by the
// block's threads (stage by stage, pairs (j, j + h): the CPU's butterfly order per row); every
// thread of the block calls it.
__device__ void fwht_rows(float* x, int rows, int d) {
    int nt = blockDim.x * blockDim.y, tid = threadIdx.x + threadIdx.y * blockDim.x;
    for (int h = 1; h < d; h <<= 1) {
        for (int i = tid; i < rows * d / 2; i += nt) {
            int r = i / (d / 2), k = i % (d / 2);
            int j = r * d + (k / h) * 2 * h + k % h;
            float a = x[j], c = x[j + h];
            x[j] = a + c;
            x[j + h] = a - c;
        }
        __syncthreads();
    }
}

// The index of the level nearest z (ties to the lower), as turboquant::nearest finds it.
__device__ __forceinline__ int tq_nearest(const float* lv, int n, float z) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (z <= 0.5f * (lv[mid] + lv[mid + 1])) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// K and V of each token (k after rope) into their records at the token's slot.
// grid (n_tokens, n_head_kv, 2: K then V), block 128.
extern "C" __global__ void __launch_bounds__(128) kv_encode(const float* __restrict__ k, const float* __restrict__ v,
                                                  u8* __restrict__ kc, u8* __restrict__ vc,
                                                  const u32* __restrict__ slots, const float* __restrict__ tq,
                                                  int n_head_kv, int hd, int kt, int vt) {
    pdl_begin();
    __shared__ float y[512];
    __shared__ float lv[256];
    __shared__ float rms[2];
    int t = blockIdx.x, h = blockIdx.y, which = blockIdx.z, tid = threadIdx.x;
    u32 slot = slots[t];
    if (slot == NO_SLOT) return;
    int ty = which ? vt : kt;
    const float* x = (which ? v : k) + ((long long)t * n_head_kv + h) * hd;
    u8* rec = (which ? vc : kc) + ((long long)slot * n_head_kv + h) * kv_head_bytes(ty, hd);
    if (ty == KV_F16 || ty == KV_BF16) {
        u16* o = (u16*)rec;
        for (int i = tid; i < hd; i += blockDim.x) o[i] = ty == KV_F16 ? f2h(x[i]) : f2bf(x[i]);
        return;
    }
    if (ty == KV_Q8_0) {
        // ggml's quantize_row_q8_0_ref, a warp per block of 32.
        int lane = tid & 31;
        for (int b = tid >> 5; b < hd / 32; b += blockDim.x / 32) {
            float xv = x[32 * b + lane];
            float amax = warp_max(fabsf(xv));
            float d = amax / 127.f;
            float id = d != 0.f ? 1.f / d : 0.f;
            u8* o = rec + 34 * b;
            // (Records start at even bytes: 34 per block.)
            if (lane == 0) *(u16*)o = f2h(d);
            o[2 + lane] = (u8)(i8)(int)roundf(xv * id);
        }
        return;
    }
    // TurboQuant: y = H(s ⊙ x) / √D, per-256 RMS (f64 sum in order, as the reference), codes.
    bool q8 = ty == KV_TQ8;
    int nl = q8 ? 256 : 16;
    for (int i = tid; i < nl; i += blockDim.x) lv[i] = tq[(q8 ? TQ_L8 : TQ_L4) + i];
    for (int i = tid; i < hd; i += blockDim.x) y[i] = x[i] * tq[TQ_SIGNS + i];
    __syncthreads();
    fwht_rows(y, 1, hd);
    float ks = 1.f / sqrtf((float)hd);
    for (int i = tid; i < hd; i += blockDim.x) y[i] *= ks;
    __syncthreads();
    int nblk = (hd + TQ_BLOCK - 1) / TQ_BLOCK;
    if (tid < nblk) {
        int b0 = tid * TQ_BLOCK, len = min(TQ_BLOCK, hd - b0);
        double s = 0.0;
        for (int i = 0; i < len; i++) s += (double)y[b0 + i] * (double)y[b0 + i];
        float r = (float)sqrt(s / (double)len);
        rms[tid] = r;
        ((float*)(rec + kv_code_bytes(ty, hd)))[tid] = r;
    }
    __syncthreads();
    if (q8) {
        for (int i = tid; i < hd; i += blockDim.x) {
            float r = rms[i / TQ_BLOCK], inv = r > 0.f ? 1.f / r : 0.f;
            rec[i] = (u8)tq_nearest(lv, 256, y[i] * inv);
        }
    } else {
        for (int i = tid; i < hd / 2; i += blockDim.x) {
            float r = rms[(2 * i) / TQ_BLOCK], inv = r > 0.f ? 1.f / r : 0.f;
            int c0 = tq_nearest(lv, 16, y[2 * i] * inv), c1 = tq_nearest(lv, 16, y[2 * i + 1] * inv);
            rec[i] = (u8)(c0 | (c1 << 4));
        }
    }
}

// Element i of a head record of type T (rotated for the TurboQuant types; NR: without the
// factor kv_scale gives, as kv_load8 reads them); lv: tq4's levels in shared memory.
template <int T, int HD, bool NR = false>
__device__ __forceinline__ float kv_elem(const u8* __restrict__ rec, int i, const float* lv) {
    if (T == KV_F16) return h2f(((const u16*)rec)[i]);
    if (T == KV_BF16) return bf2f(((const u16*)rec)[i]);
    if (T == KV_Q8_0) {
        const u8* b = rec + 34 * (i >> 5);
        return (float)(i8)b[2 + (i & 31)] * h2f((u16)(b[0] | (b[1] << 8)));
    }
    const float r = ((const float*)(rec + kv_code_bytes(T, HD)))[i / TQ_BLOCK];
    if (T == KV_TQ8) {
        const float c = tq8_code(rec[i], 0);
        return NR ? c : c * TQ8_STEP * r;
    }
    const float l = lv[(rec[i >> 1] >> ((i & 1) * 4)) & 15];
    return NR ? l : l * r;
}

// The levels a type reads from shared memory (tq4's; none for the others) into `lv`; every
// thread of the block calls it, `tid` of `nt`.
template <int T>
__device__ __forceinline__ void load_levels(float* lv, const float* __restrict__ tq, int tid, int nt) {
    if (T == KV_TQ4)
        for (int i = tid; i < 16; i += nt) lv[i] = tq[TQ_L4 + i];
}
// The size of load_levels' array for type T.
__host__ __device__ constexpr int kv_levels(int t) { return t == KV_TQ4 ? 16 : 1; }

// The keys token t attends to: positions lo … hi−1 of its sequence (causal, within the window).
__device__ __forceinline__ void key_range(BatchView b, int t, int window, int& lo, int& hi) {
    int p = (int)b.pos[t];
    hi = min(p + 1, (int)b.kv_len[b.seq[t]]);
    lo = window > 0 ? max(0, p - window + 1) : 0;
    if (hi < lo) hi = lo;
}

#define KVQ_WARPS 4

// Split-K attention per head over records of types KT (keys) and VT (values): each warp walks
// keys of the split (lane l holds dims l, l+32, … of q and of the output), an online softmax
// per warp, merged across warps in shared memory; q rotated once per block when KT is a
// TurboQuant type and the output un-rotated when VT is one (here when there is one split, else
// in kvq_merge, which combines the splits' (max, sum, unnormalised acc)).
// grid (n_split, n_head, n_tokens), block (32, KVQ_WARPS).
template <int HD, int KT, int VT>
__device__ void kvq_attention_impl(const float* __restrict__ q, const u8* __restrict__ kc,
                                   const u8* __restrict__ vc, float* __restrict__ out,
                                   float* __restrict__ part, BatchView b, const float* __restrict__ tq,
                                   int n_head, int n_head_kv, float scale, int window, float softcap) {
    const int NV = HD / 32;
    // (Head dims that are not powers of two are never launched with a TurboQuant type.)
    constexpr bool KROT = kv_rotated(KT, HD), VROT = kv_rotated(VT, HD);
    const int KB = kv_head_bytes(KT, HD), VB = kv_head_bytes(VT, HD);
    __shared__ float qs[HD];
    __shared__ float lk[kv_levels(KT)], lvv[kv_levels(VT)];
    __shared__ float sm[KVQ_WARPS], sl[KVQ_WARPS], sacc[KVQ_WARPS][HD];
    int split = blockIdx.x, n_split = gridDim.x, h = blockIdx.y, t = blockIdx.z;
    int lane = threadIdx.x, w = threadIdx.y, tid = w * 32 + lane;
    int kvh = h / (n_head / n_head_kv);
    const float* qt = q + ((long long)t * n_head + h) * HD;
    for (int i = tid; i < HD; i += 32 * KVQ_WARPS) qs[i] = KROT ? qt[i] * tq[TQ_SIGNS + i] : qt[i];
    load_levels<KT>(lk, tq, tid, 32 * KVQ_WARPS);
    load_levels<VT>(lvv, tq, tid, 32 * KVQ_WARPS);
    __syncthreads();
    if (KROT) fwht_rows(qs, 1, HD);
    const float rs = 1.f / sqrtf((float)HD);
    u32 s = b.seq[t];
    int lo, hi;
    key_range(b, t, window, lo, hi);
    int chunk = (hi - lo + n_split - 1) / n_split;
    int k0 = lo + split * chunk, k1 = min(hi, k0 + chunk);
    const u32* bt = b.block_tables + b.bt_off[s];
    float qv[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) qv[i] = qs[lane + 32 * i] * (KROT ? rs * scale : scale);
    float m = -1e30f, l = 0.f, acc[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) acc[i] = 0.f;
    for (int j = k0 + w; j < k1; j += KVQ_WARPS) {
        long long slot = (long long)bt[j / b.block_size] * b.block_size + j % b.block_size;
        const u8* kr = kc + (slot * n_head_kv + kvh) * KB;
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < NV; i++) d += qv[i] * kv_elem<KT, HD>(kr, lane + 32 * i, lk);
        d = warp_sum(d);
        if (softcap > 0.f) d = softcap * tanhf(d / softcap);
        float mn = fmaxf(m, d), corr = __expf(m - mn), pj = __expf(d - mn);
        l = l * corr + pj;
        const u8* vr = vc + (slot * n_head_kv + kvh) * VB;
#pragma unroll
        for (int i = 0; i < NV; i++) acc[i] = acc[i] * corr + pj * kv_elem<VT, HD>(vr, lane + 32 * i, lvv);
        m = mn;
    }
    if (lane == 0) { sm[w] = m; sl[w] = l; }
#pragma unroll
    for (int i = 0; i < NV; i++) sacc[w][lane + 32 * i] = acc[i];
    __syncthreads();
    float M = sm[0];
#pragma unroll
    for (int k = 1; k < KVQ_WARPS; k++) M = fmaxf(M, sm[k]);
    float L = 0.f, c[KVQ_WARPS];
#pragma unroll
    for (int k = 0; k < KVQ_WARPS; k++) { c[k] = __expf(sm[k] - M); L += sl[k] * c[k]; }
    if (n_split == 1) {
        float inv = L > 0.f ? 1.f / L : 0.f;
        // Every thread takes part (the un-rotation is a block transform): qs now holds the row.
        __syncthreads();
        for (int i = tid; i < HD; i += 32 * KVQ_WARPS) {
            float a = 0.f;
#pragma unroll
            for (int k = 0; k < KVQ_WARPS; k++) a += sacc[k][i] * c[k];
            qs[i] = a * inv;
        }
        __syncthreads();
        if (VROT) fwht_rows(qs, 1, HD);
        float* o = out + ((long long)t * n_head + h) * HD;
        for (int i = tid; i < HD; i += 32 * KVQ_WARPS) o[i] = VROT ? qs[i] * rs * tq[TQ_SIGNS + i] : qs[i];
    } else {
        if (w != 0) return;
        float* pp = part + (((long long)t * n_head + h) * n_split + split) * (HD + 2);
        if (lane == 0) { pp[0] = M; pp[1] = L; }
#pragma unroll
        for (int i = 0; i < NV; i++) {
            float a = 0.f;
#pragma unroll
            for (int k = 0; k < KVQ_WARPS; k++) a += sacc[k][lane + 32 * i] * c[k];
            pp[2 + lane + 32 * i] = a;
        }
    }
}

// The first `ns` ranges' partial results (max, sum, unnormalised acc) of one (token, head),
// merged in order into dim `d` of its output row, un-rotated when VROT; a block of HD threads.
template <int HD, bool VROT>
__device__ void merge_ranges(const float* __restrict__ pp, int ns, float* __restrict__ orow,
                             const float* __restrict__ tq) {
    __shared__ float o[HD];
    int d = threadIdx.x;
    float M = -1e30f;
    for (int k = 0; k < ns; k++) M = fmaxf(M, pp[k * (HD + 2)]);
    float L = 0.f, a = 0.f;
    for (int k = 0; k < ns; k++) {
        float c = __expf(pp[k * (HD + 2)] - M);
        L += pp[k * (HD + 2) + 1] * c;
        a += pp[k * (HD + 2) + 2 + d] * c;
    }
    o[d] = L > 0.f ? a / L : 0.f;
    __syncthreads();
    if (VROT) fwht_rows(o, 1, HD);
    orow[d] = VROT ? o[d] * (1.f / sqrtf((float)HD)) * tq[TQ_SIGNS + d] : o[d];
}

// The splits' partial results merged. grid (n_head, n_tokens), block HD.
template <int HD, bool VROT>
__device__ void kvq_merge_impl(const float* __restrict__ part, float* __restrict__ out, const float* __restrict__ tq,
                               int n_head, int n_split) {
    long long r = (long long)blockIdx.y * n_head + blockIdx.x;
    merge_ranges<HD, VROT>(part + r * n_split * (HD + 2), n_split, out + r * HD, tq);
}

// One module per (K type, V type) instantiates these for every head dim (registry.rs `kernels`).
template <int HD, int KT, int VT>
__global__ void __launch_bounds__(32 * KVQ_WARPS)
    kvq_attention(const float* q, const u8* kc, const u8* vc, float* out, float* part, BatchView b, const float* tq,
                  int n_head, int n_head_kv, float scale, int window, float softcap) {
    pdl_begin();
    kvq_attention_impl<HD, KT, VT>(q, kc, vc, out, part, b, tq, n_head, n_head_kv, scale, window, softcap);
}
template <int HD, int VT>
__global__ void kvq_merge(const float* part, float* out, const float* tq, int n_head, int n_split) {
    pdl_begin();
    kvq_merge_impl<HD, kv_rotated(VT, HD)>(part, out, tq, n_head, n_split);
}

// ---- Decode attention by KV group (flash-decoding on CUDA cores) ----
//
// grid (X ≤ KVD_MAX_SPLITS, n_head_kv · ceil(G / KVD_G), n_tokens), block (32, 4). A block takes
// up to KVD_G query heads of one KV head (their q in shared memory) and the key ranges x,
// x + X, … of its token. The token's key ranges depend on its own key count only (kvd_splits:
// ranges of about KVD_KEYS keys, at most KVD_MAX_SPLITS), never on the batch or on X: a token's
// bits are the same in any batch. Each warp copies its tiles of KVD_TK(HD) keys — their K and V
// records — into its own two shared-memory stages with cp.async (whole rows: coalesced; the
// next tile in flight while this one is summed). In a tile lane s·TK + u scores key u over dims
// 8(s + LPK·i) … +7 (LPK = 32 / TK lanes per key, 32 dims each), the partial scores summed over
// s; the warp's online softmax per head; then lane l accumulates the tile's value rows into its
// output dims l·VPL … (VPL = HD / 32). The four warps' states are merged in warp order; then the
// output is written (one range, un-rotated where V is TurboQuant) or the range's (max, sum,
// acc) go to `part` for kvd_merge.
#define KVD_G 4
#define KVD_KEYS 128
#define KVD_MAX_SPLITS 64

__host__ __device__ __forceinline__ int kvd_splits(int n_keys) {
    int s = (n_keys + KVD_KEYS - 1) / KVD_KEYS;
    return s < 1 ? 1 : (s > KVD_MAX_SPLITS ? KVD_MAX_SPLITS : s);
}

// Eight consecutive values d0 … d0+7 (d0 a multiple of 8) of a record of type T. NR: a
// TurboQuant record's values without the factor kv_scale gives (the caller applies it once).
template <int T, int HD, bool NR = false>
__device__ __forceinline__ void kv_load8(const u8* __restrict__ rec, int d0, const float* lv, float* o) {
    if (T == KV_F16 || T == KV_BF16) {
        uint4 u = *(const uint4*)(rec + 2 * d0);
        u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u16 lo = (u16)(w[i] & 0xffff), hi = (u16)(w[i] >> 16);
            o[2 * i] = T == KV_F16 ? h2f(lo) : bf2f(lo);
            o[2 * i + 1] = T == KV_F16 ? h2f(hi) : bf2f(hi);
        }
    } else if (T == KV_Q8_0) {
        const u8* b = rec + 34 * (d0 >> 5);
        float s = h2f(*(const u16*)b);
        const u16* q = (const u16*)(b + 2 + (d0 & 31));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u16 p = q[i];
            o[2 * i] = (float)(i8)(p & 0xff) * s;
            o[2 * i + 1] = (float)(i8)(p >> 8) * s;
        }
    } else {
        float r = NR ? 1.f : ((const float*)(rec + kv_code_bytes(T, HD)))[d0 / TQ_BLOCK];
        if (T == KV_TQ8) {
            u32 a = *(const u32*)(rec + d0), b = *(const u32*)(rec + d0 + 4);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                o[i] = NR ? tq8_code(a, i) : tq8_code(a, i) * TQ8_STEP * r;
                o[4 + i] = NR ? tq8_code(b, i) : tq8_code(b, i) * TQ8_STEP * r;
            }
        } else {
            u32 a = *(const u32*)(rec + d0 / 2);
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = lv[(a >> (4 * i)) & 15] * r;
        }
    }
}

// What NR leaves out of value d of a record of type T: its 256-value block's RMS, times tq8's
// step for tq8 (1 for the types without one).
template <int T, int HD>
__device__ __forceinline__ float kv_scale(const u8* __restrict__ rec, int d) {
    const float r = kv_tq(T) ? ((const float*)(rec + kv_code_bytes(T, HD)))[d / TQ_BLOCK] : 1.f;
    return T == KV_TQ8 ? r * TQ8_STEP : r;
}

// VPL = HD / 32 consecutive values from d0 = lane · VPL (VPL of 2, 4, 8 or 16), as kv_load8
// gives them (NR).
template <int T, int HD, bool NR = false>
__device__ __forceinline__ void kv_load_lane(const u8* __restrict__ rec, int d0, const float* lv, float* o) {
    const int VPL = HD / 32;
    if (VPL % 8 == 0) {
#pragma unroll
        for (int i = 0; i < VPL; i += 8) kv_load8<T, HD, NR>(rec, d0 + i, lv, o + i);
    } else if (VPL == 4 && (T == KV_F16 || T == KV_BF16)) {
        uint2 u = *(const uint2*)(rec + 2 * d0);
        u32 w[2] = {u.x, u.y};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u16 lo = (u16)(w[i] & 0xffff), hi = (u16)(w[i] >> 16);
            o[2 * i] = T == KV_F16 ? h2f(lo) : bf2f(lo);
            o[2 * i + 1] = T == KV_F16 ? h2f(hi) : bf2f(hi);
        }
    } else if (VPL == 4 && T == KV_TQ8) {
        u32 a = *(const u32*)(rec + d0);
        float r = NR ? 1.f : ((const float*)(rec + kv_code_bytes(T, HD)))[d0 / TQ_BLOCK];
#pragma unroll
        for (int i = 0; i < 4; i++) o[i] = NR ? tq8_code(a, i) : tq8_code(a, i) * TQ8_STEP * r;
    } else if (VPL == 4 && T == KV_TQ4) {
        u32 a = *(const u16*)(rec + d0 / 2);
        float r = NR ? 1.f : ((const float*)(rec + kv_code_bytes(T, HD)))[d0 / TQ_BLOCK];
#pragma unroll
        for (int i = 0; i < 4; i++) o[i] = lv[(a >> (4 * i)) & 15] * r;
    } else {
#pragma unroll
        for (int i = 0; i < VPL; i++) o[i] = kv_elem<T, HD, NR>(rec, d0 + i, lv);
    }
}

// A range's result from the four warps' states (max, sum, unnormalised acc per head of the
// group), merged in warp order: the output row (one range; un-rotated when VROT, through
// `tmp`) or the range's partials for kvd_merge. Every thread of the block calls it.
template <int HD, bool VROT>
__device__ void kvd_range_out(const float (*wm)[KVD_G], const float (*wl)[KVD_G], const float (*wacc)[KVD_G][HD],
                              float* tmp, float* __restrict__ out, float* __restrict__ part,
                              const float* __restrict__ tq, int i, int t, int h0, int gn, int n_head, int split,
                              int ns) {
    int tid = threadIdx.y * 32 + threadIdx.x;
    const float rs = 1.f / sqrtf((float)HD);
    for (int g = 0; g < gn; g++) {
        float M = fmaxf(fmaxf(wm[0][g], wm[1][g]), fmaxf(wm[2][g], wm[3][g]));
        float c[4], L = 0.f;
#pragma unroll
        for (int k = 0; k < 4; k++) { c[k] = __expf(wm[k][g] - M); L += wl[k][g] * c[k]; }
        int h = h0 + g;
        if (ns == 1) {
            float inv = L > 0.f ? 1.f / L : 0.f;
            for (int d = tid; d < HD; d += 128) {
                float a = 0.f;
#pragma unroll
                for (int k = 0; k < 4; k++) a += wacc[k][g][d] * c[k];
                tmp[d] = a * inv;
            }
            __syncthreads();
            if (VROT) fwht_rows(tmp, 1, HD);
            float* o = out + ((long long)t * n_head + h) * HD;
            for (int d = tid; d < HD; d += 128) o[d] = VROT ? tmp[d] * rs * tq[TQ_SIGNS + d] : tmp[d];
            __syncthreads();
        } else {
            float* pp = part + (((long long)i * n_head + h) * KVD_MAX_SPLITS + split) * (HD + 2);
            if (tid == 0) { pp[0] = M; pp[1] = L; }
            for (int d = tid; d < HD; d += 128) {
                float a = 0.f;
#pragma unroll
                for (int k = 0; k < 4; k++) a += wacc[k][g][d] * c[k];
                pp[2 + d] = a;
            }
        }
    }
}

#define KVD_TK(HD) (1024 / (HD))

// The copy unit of a record of `bytes`: the largest of 16, 8, 4 dividing it (every record of a
// cache starts aligned to it).
__host__ __device__ constexpr int kv_chunk(int bytes) { return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : 4; }
// A K record's row in shared memory: an odd number of chunks, so that lanes reading the same
// offset of consecutive keys fall in different banks.
__host__ __device__ constexpr int kv_row_k(int bytes) {
    return (bytes / kv_chunk(bytes)) % 2 ? bytes : bytes + kv_chunk(bytes);
}

template <int CB>
__device__ __forceinline__ void cp_async_n(void* dst, const void* src, bool ok) {
    if (CB == 16) cp_async16(dst, src, ok);
    else if (CB == 8) cp_async8(dst, src, ok);
    else cp_async4(dst, src, ok);
}

// One record per key of keys j0 … j0 + TK − 1 (those < k1; the rest zero-filled) into rows of
// `rowb` bytes at `st`, by the warp's lanes in chunks of CB bytes; `slot`: lane u's is key u's.
template <int TK, int RB, int CB>
__device__ __forceinline__ void kvd_copy(u8* st, int rowb, const u8* __restrict__ cache, long long slot,
                                         int n_head_kv, int kvh, int j0, int k1, int lane) {
    const int N = RB / CB, ALL = TK * N;
#pragma unroll
    for (int c0 = 0; c0 < ALL; c0 += 32) {
        int c = c0 + lane, u = c < ALL ? c / N : 0, o = (c % N) * CB;
        long long sl = __shfl_sync(0xffffffffu, slot, u);
        bool ok = c < ALL && j0 + u < k1;
        if (c < ALL) cp_async_n<CB>(st + u * rowb + o, ok ? cache + (sl * n_head_kv + kvh) * RB + o : cache, ok);
    }
}

template <int HD, int KT, int VT>
__device__ void kvd_attention_impl(const float* __restrict__ q, const u8* __restrict__ kc,
                                   const u8* __restrict__ vc, float* __restrict__ out,
                                   float* __restrict__ part, BatchView b, const float* __restrict__ tq,
                                   int n_head, int n_head_kv, float scale, int window, float softcap) {
    const int VPL = HD / 32, TK = KVD_TK(HD), LPK = 32 / TK;
    constexpr bool KROT = kv_rotated(KT, HD), VROT = kv_rotated(VT, HD);
    const int KB = kv_head_bytes(KT, HD), VB = kv_head_bytes(VT, HD);
    const int KS = kv_row_k(KB), STAGE = TK * (KS + VB);
    const int SB = 8 * STAGE > 16 * KVD_G * HD ? 8 * STAGE : 16 * KVD_G * HD;
    // Two stages per warp while the ranges run; the warps' accumulators at each range's end.
    __shared__ __align__(16) u8 sbuf[SB];
    __shared__ __align__(16) float qs[KVD_G][HD];
    __shared__ float lk[kv_levels(KT)], lvv[kv_levels(VT)];
    __shared__ float wm[4][KVD_G], wl[4][KVD_G];
    float(*wacc)[KVD_G][HD] = (float(*)[KVD_G][HD])sbuf;
    int i = blockIdx.z, t = b.drows ? (int)b.drows[i] : i;
    int G = n_head / n_head_kv, hg = (G + KVD_G - 1) / KVD_G;
    int kvh = blockIdx.y / hg, h0 = kvh * G + (blockIdx.y % hg) * KVD_G, gn = min(KVD_G, kvh * G + G - h0);
    int lane = threadIdx.x, w = threadIdx.y, tid = w * 32 + lane;
    u32 s = b.seq[t];
    int lo, hi;
    key_range(b, t, window, lo, hi);
    const int ns = kvd_splits(hi - lo);
    if ((int)blockIdx.x >= ns) return;
    const int chunk = (hi - lo + ns - 1) / ns;
    const float rs = 1.f / sqrtf((float)HD);
    for (int e = tid; e < KVD_G * HD; e += 128) {
        int g = e / HD, d = e % HD;
        float x = g < gn ? q[((long long)t * n_head + h0 + g) * HD + d] : 0.f;
        qs[g][d] = KROT ? x * tq[TQ_SIGNS + d] : x * scale;
    }
    load_levels<KT>(lk, tq, tid, 128);
    load_levels<VT>(lvv, tq, tid, 128);
    __syncthreads();
    if (KROT) {
        fwht_rows(qs[0], KVD_G, HD);
        for (int e = tid; e < KVD_G * HD; e += 128) qs[e / HD][e % HD] *= rs * scale;
        __syncthreads();
    }
    const u32* bt = b.block_tables + b.bt_off[s];
    u8* stg = sbuf + w * 2 * STAGE;
    const int u = lane % TK, sub = lane / TK;
    // A lane's score chunks; a TurboQuant key of one 256-value block (head dims to 256) is
    // summed over its codes' values and weighed by kv_scale once (KNR), a wider one per value
    // (one sum: registers).
    constexpr int NC = HD / (8 * LPK);
    constexpr bool KNR = kv_tq(KT) && HD <= TQ_BLOCK;
    // A TurboQuant value's kv_scale in its weight, likewise (VNR): a value costs a byte permute
    // and a subtraction (tq8) or a lookup (tq4).
    constexpr bool VNR = kv_tq(VT) && HD <= TQ_BLOCK;
    for (int split = blockIdx.x; split < ns; split += gridDim.x) {
        const int k0 = lo + split * chunk, k1 = min(hi, k0 + chunk);
        const int ntiles = k1 > k0 ? (k1 - k0 + TK - 1) / TK : 0;
        float m[KVD_G], l[KVD_G], acc[KVD_G][VPL];
#pragma unroll
        for (int g = 0; g < KVD_G; g++) {
            m[g] = -1e30f;
            l[g] = 0.f;
#pragma unroll
            for (int d = 0; d < VPL; d++) acc[g][d] = 0.f;
        }
        // Tile t of the range (keys k0 + TK·t …) into stage `buf`, or an empty group past the end.
        auto issue = [&](int tile, int buf) {
            if (tile < ntiles) {
                int j0 = k0 + tile * TK, j = j0 + lane;
                long long slot = lane < TK && j < k1 ? (long long)bt[j / b.block_size] * b.block_size + j % b.block_size : 0;
                u8* st = stg + buf * STAGE;
                kvd_copy<TK, KB, kv_chunk(KB)>(st, KS, kc, slot, n_head_kv, kvh, j0, k1, lane);
                kvd_copy<TK, VB, kv_chunk(VB)>(st + TK * KS, VB, vc, slot, n_head_kv, kvh, j0, k1, lane);
            }
            cp_async_commit();
        };
        issue(w, 0);
        issue(w + 4, 1);
        for (int tile = w, it = 0; tile < ntiles; tile += 4, it++) {
            cp_async_wait<1>();
            __syncwarp();
            const u8* kb = stg + (it & 1) * STAGE;
            const u8* vb = kb + TK * KS;
            const int j0 = k0 + tile * TK;
            const bool valid = j0 + u < k1;
            float sc[KVD_G];
#pragma unroll
            for (int g = 0; g < KVD_G; g++) sc[g] = 0.f;
#pragma unroll
            for (int c = 0; c < NC; c++) {
                const int d = 8 * (sub + LPK * c);
                float kv8[8];
                kv_load8<KT, HD, KNR>(kb + u * KS, d, lk, kv8);
#pragma unroll
                for (int g = 0; g < KVD_G; g++)
#pragma unroll
                    for (int e = 0; e < 8; e++) sc[g] += qs[g][d + e] * kv8[e];
            }
            if (KNR) {
                const float r = kv_scale<KT, HD>(kb + u * KS, 0);
#pragma unroll
                for (int g = 0; g < KVD_G; g++) sc[g] *= r;
            }
            float pr[KVD_G];
#pragma unroll
            for (int g = 0; g < KVD_G; g++) {
#pragma unroll
                for (int o = TK; o < 32; o <<= 1) sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], o);
                float x = sc[g];
                if (softcap > 0.f) x = softcap * tanhf(x / softcap);
                x = valid ? x : -1e30f;
                float mx = x;
#pragma unroll
                for (int o = 1; o < TK; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                float mn = fmaxf(m[g], mx), corr = __expf(m[g] - mn);
                pr[g] = valid ? __expf(x - mn) : 0.f;
                float ps = pr[g];
#pragma unroll
                for (int o = 1; o < TK; o <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
                l[g] = l[g] * corr + ps;
                m[g] = mn;
#pragma unroll
                for (int d = 0; d < VPL; d++) acc[g][d] *= corr;
            }
            const int nk = min(TK, k1 - j0);
#pragma unroll
            for (int uu = 0; uu < TK; uu++) {
                if (uu < nk) {
                    float vv[VPL];
                    kv_load_lane<VT, HD, VNR>(vb + uu * VB, lane * VPL, lvv, vv);
                    const float rv = VNR ? kv_scale<VT, HD>(vb + uu * VB, 0) : 1.f;
#pragma unroll
                    for (int g = 0; g < KVD_G; g++) {
                        float pj = __shfl_sync(0xffffffffu, pr[g], uu) * rv;
#pragma unroll
                        for (int d = 0; d < VPL; d++) acc[g][d] += pj * vv[d];
                    }
                }
            }
            // Every lane is done with this stage before the tile after next is copied into it.
            __syncwarp();
            issue(tile + 8, it & 1);
        }
        cp_async_wait<0>();
        // The stages become the warps' accumulators: every warp done with them first.
        __syncthreads();
#pragma unroll
        for (int g = 0; g < KVD_G; g++) {
            if (lane == 0) { wm[w][g] = m[g]; wl[w][g] = l[g]; }
#pragma unroll
            for (int d = 0; d < VPL; d++) wacc[w][g][lane * VPL + d] = acc[g][d];
        }
        __syncthreads();
        kvd_range_out<HD, VROT>(wm, wl, wacc, qs[0], out, part, tq, i, t, h0, gn, n_head, split, ns);
        // The accumulators are read before the next range's stages are written.
        __syncthreads();
    }
}

// kvd's ranges merged in order (the token's own count, kvd_splits), un-rotated when VROT.
// grid (n_head, n_tokens), block HD.
template <int HD, bool VROT>
__device__ void kvd_merge_impl(const float* __restrict__ part, float* __restrict__ out, const float* __restrict__ tq,
                               BatchView b, int n_head, int window) {
    int h = blockIdx.x, i = blockIdx.y, t = b.drows ? (int)b.drows[i] : i;
    int lo, hi;
    key_range(b, t, window, lo, hi);
    int ns = kvd_splits(hi - lo);
    if (ns == 1) return;  // written by kvd_attention
    long long r = (long long)i * n_head + h;
    merge_ranges<HD, VROT>(part + r * KVD_MAX_SPLITS * (HD + 2), ns, out + ((long long)t * n_head + h) * HD, tq);
}

template <int HD, int KT, int VT>
__global__ void __launch_bounds__(128)
    kvd_attention(const float* q, const u8* kc, const u8* vc, float* out, float* part, BatchView b, const float* tq,
                  int n_head, int n_head_kv, float scale, int window, float softcap) {
    pdl_begin();
    kvd_attention_impl<HD, KT, VT>(q, kc, vc, out, part, b, tq, n_head, n_head_kv, scale, window, softcap);
}
template <int HD, int VT>
__global__ void kvd_merge(const float* part, float* out, const float* tq, BatchView b, int n_head, int window) {
    pdl_begin();
    kvd_merge_impl<HD, kv_rotated(VT, HD)>(part, out, tq, b, n_head, window);
}
