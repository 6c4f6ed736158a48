// The parity mode's kernels (`--numerics parity`), after quant.cu in the same module (its block
// decoders serve here too): each computes what the CPU backend computes
// for a batch-invariant step (every token on the decode path), operation for operation and in
// the same order, so that the two backends' floats are the same bits — and with them
// llama.cpp's CPU floats for one-token steps (docs/ARCHITECTURE.md, "CPU parity").
//
// NVRTC compiles this module with --fmad=false: nothing is fused unless written as fmaf, as
// the CPU code writes it. Exact integer sums may be taken in any order; float operations follow
// the CPU kernels' lanes and reductions (crates/cpu-kernels/src/x86/kern.rs, backend-cpu).
// One thread per output row (or per token and head): slow, and meant to be — this is the
// reference-grade path, not the fast one.

__device__ __forceinline__ float f16r(float x) { return h2f(f2h(x)); }
__device__ __forceinline__ u32 rd16(const u8* p) { return (u32)p[0] | ((u32)p[1] << 8); }

// The CPU's horizontal sum of eight lanes: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1.
__device__ __forceinline__ float hsum8(const float* a) {
    float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    return (s0 + s2) + (s1 + s3);
}

// e^x as glibc's expf computes it (the CPU backend's f32::exp, and llama.cpp's expf): it
// rounds like a correctly rounded e^x but for ~7 inputs in 10,000, so the parity mode computes
// it the same way — x·32/ln2 = k + r in f64, 2^(k/32) from a table, 2^(r/32) by a cubic, the
// product rounded to f32 once. EXPF_TAB[i]: the bits of 2^(i/32) rounded to f64, less i·2^47
// (so that adding k·2^47 gives 2^(k/32)); computed with 60-digit decimals. The constants are
// glibc's; a unit test (exact.rs) checks this algorithm against the host's expf.
__constant__ unsigned long long EXPF_TAB[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};
#define EXPF_INV_LN2_32 0x1.71547652b82fep+5
#define EXPF_SHIFT 0x1.8p+52
#define EXPF_C0 (0x1.c6af84b912394p-5 / 32768.0)
#define EXPF_C1 (0x1.ebfce50fac4f3p-3 / 1024.0)
#define EXPF_C2 (0x1.62e42ff0c52d6p-1 / 32.0)
__device__ float exp_f32(float x) {
    if (x != x) return x + x;
    if (x < -0x1.9fe368p6f) return 0.f;
    if (x > 0x1.62e42ep6f) return __int_as_float(0x7f800000);
    double z = EXPF_INV_LN2_32 * (double)x;
    double kd = z + EXPF_SHIFT;
    unsigned long long ki = (unsigned long long)__double_as_longlong(kd);
    kd = kd - EXPF_SHIFT;
    double r = z - kd;
    double s = __longlong_as_double((long long)(EXPF_TAB[ki % 32] + (ki << 47)));
    double y = fma(fma(EXPF_C0, r, EXPF_C1), r * r, fma(EXPF_C2, r, 1.0));
    return (float)(y * s);
}

// ---- rms norm: one thread per row; squares in f32 summed in f64 in order, as the CPU ----
// With `residual`: residual += x first, and the norm is of the sum. `out` may be `x`.
extern "C" __global__ void x_rms_norm(float* __restrict__ residual, const float* x,
                                      const float* __restrict__ w, float* out, int rows, int cols,
                                      float eps) { pdl_begin();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* src = x + (long long)r * cols;
    if (residual) {
        float* res = residual + (long long)r * cols;
        for (int i = 0; i < cols; i++) res[i] = res[i] + src[i];
        src = res;
    }
    double ss = 0.0;
    for (int i = 0; i < cols; i++) {
        float v = src[i];
        ss += (double)(v * v);
    }
    float inv = 1.0f / sqrtf((float)(ss / (double)cols) + eps);
    float* o = out + (long long)r * cols;
    for (int i = 0; i < cols; i++) o[i] = (src[i] * inv) * w[i];
}

// ---- products: y[t, r] = W[r] · x[t] on the int8 activations of ops.cu's quantizers ----
// grid (ceil(rows / 128), n_tokens), block 128; one thread per (row, token). `lanes16`: the
// CPU runs its AVX-512 kernels (only the "lanes" K-quants below round differently there).

// A 32-element block as the CPU's legacy kernels see it: signed values (ggml's q − 8, q − 16),
// or unsigned with an offset m (Q4_1, Q5_1); d and m from f16. T: 0 q4_0, 1 q4_1, 2 q5_0,
// 3 q5_1, 4 q8_0.
template <int T> struct Legacy;
template <> struct Legacy<0> {
    static const int BYTES = 18, M = 0;
    __device__ static void get(const u8* b, int* v, float& d, float& m) {
        d = h2f(rd16(b)); m = 0.f;
        for (int j = 0; j < 16; j++) { v[j] = (b[2 + j] & 15) - 8; v[j + 16] = (b[2 + j] >> 4) - 8; }
    }
};
template <> struct Legacy<1> {
    static const int BYTES = 20, M = 1;
    __device__ static void get(const u8* b, int* v, float& d, float& m) {
        d = h2f(rd16(b)); m = h2f(rd16(b + 2));
        for (int j = 0; j < 16; j++) { v[j] = b[4 + j] & 15; v[j + 16] = b[4 + j] >> 4; }
    }
};
template <> struct Legacy<2> {
    static const int BYTES = 22, M = 0;
    __device__ static void get(const u8* b, int* v, float& d, float& m) {
        d = h2f(rd16(b)); m = 0.f;
        u32 qh = (u32)b[2] | ((u32)b[3] << 8) | ((u32)b[4] << 16) | ((u32)b[5] << 24);
        for (int j = 0; j < 16; j++) {
            v[j] = ((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16;
            v[j + 16] = ((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
        }
    }
};
template <> struct Legacy<3> {
    static const int BYTES = 24, M = 1;
    __device__ static void get(const u8* b, int* v, float& d, float& m) {
        d = h2f(rd16(b)); m = h2f(rd16(b + 2));
        u32 qh = (u32)b[4] | ((u32)b[5] << 8) | ((u32)b[6] << 16) | ((u32)b[7] << 24);
        for (int j = 0; j < 16; j++) {
            v[j] = (b[8 + j] & 15) | (((qh >> j) & 1) << 4);
            v[j + 16] = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        }
    }
};
template <> struct Legacy<4> {
    static const int BYTES = 34, M = 0;
    __device__ static void get(const u8* b, int* v, float& d, float& m) {
        d = h2f(rd16(b)); m = 0.f;
        for (int j = 0; j < 32; j++) v[j] = (int)(signed char)b[2 + j];
    }
};

// ggml's order (kern.rs `legacy_step`): one 8-lane accumulator fed block by block, lane l
// holding the integer sum of elements 4l..4l+3 times d·d_a (fused); the offset terms m·s fused
// into one scalar chain; then hsum + that chain. ds: (d_a, s_a) per block, as quantize_a32.
template <int T>
__device__ void mm_legacy(const u8* __restrict__ W, long long row_bytes, int rows, int nb,
                          const i8* __restrict__ aq, const float* __restrict__ ds,
                          float* __restrict__ y) {
    int r = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (r >= rows) return;
    const u8* row = W + (long long)r * row_bytes;
    const i8* q = aq + (long long)t * nb * 32;
    const float* a = ds + (long long)t * nb * 2;
    float acc[8], msum = 0.f;
    for (int l = 0; l < 8; l++) acc[l] = 0.f;
    for (int i = 0; i < nb; i++) {
        int v[32];
        float d, m;
        Legacy<T>::get(row + (long long)i * Legacy<T>::BYTES, v, d, m);
        const i8* qi = q + 32 * i;
        if (Legacy<T>::M) msum = fmaf(m, a[2 * i + 1], msum);
        float f = d * a[2 * i];
        for (int l = 0; l < 8; l++) {
            int s = v[4 * l] * qi[4 * l] + v[4 * l + 1] * qi[4 * l + 1] + v[4 * l + 2] * qi[4 * l + 2] +
                    v[4 * l + 3] * qi[4 * l + 3];
            acc[l] = fmaf((float)s, f, acc[l]);
        }
    }
    y[(long long)t * rows + r] = hsum8(acc) + msum;
}

// x_mm_q4_0 … x_mm_q8_0 (registry.rs: x_mm_legacy<0> … <4>).
template <int T>
__global__ void x_mm_legacy(const u8* __restrict__ W, long long row_bytes, int rows, int nb, const i8* __restrict__ aq,
                            const float* __restrict__ ds, const int* __restrict__ bsums, float* __restrict__ y,
                            int lanes16) {
    pdl_begin();
    mm_legacy<T>(W, row_bytes, rows, nb, aq, ds, y);
}

// Q4_K (144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles), as ggml's
// repacked GEMV sums a super-block (kern.rs GGML_Q4K): the whole integer sum Σ sc·v·q and the
// whole correction Σ min·bsum, each fused into its own scalar chain with d·d_a and −dmin·d_a;
// the result is their sum.
extern "C" __global__ void x_mm_q4_k(const u8* __restrict__ W, long long row_bytes, int rows, int nb,
                                     const i8* __restrict__ aq, const float* __restrict__ d256,
                                     const int* __restrict__ bsums, float* __restrict__ y,
                                     int lanes16) { pdl_begin();
    int r = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (r >= rows) return;
    const u8* row = W + (long long)r * row_bytes;
    float acc = 0.f, accm = 0.f;
    for (int bi = 0; bi < nb; bi++) {
        const u8* b = row + bi * 144;
        const u8* s = b + 4;
        const u8* qs = b + 16;
        long long ab = (long long)t * nb + bi;
        const i8* q = aq + ab * 256;
        const int* bs = bsums + ab * 16;
        int isum = 0, csum = 0;
        for (int j = 0; j < 8; j++) {
            float scf, mnf;
            k4_scale_min(s, j, scf, mnf);  // quant.cu: exact small integers
            int sc = (int)scf, mn = (int)mnf;
            int dot = 0;
            for (int l = 0; l < 32; l++) {
                int byte = qs[32 * (j / 2) + l];
                int v = (j & 1) ? byte >> 4 : byte & 15;
                dot += v * q[32 * j + l];
            }
            isum += sc * dot;
            csum += mn * (bs[2 * j] + bs[2 * j + 1]);
        }
        float da = d256[ab];
        acc = fmaf((float)isum, h2f(rd16(b)) * da, acc);
        accm = fmaf((float)csum, -h2f(rd16(b + 2)) * da, accm);
    }
    y[(long long)t * rows + r] = acc + accm;
}

// Q6_K (210 bytes: 128 low nibbles, 64 bytes of high bits, 16 i8 scales, d), as ggml's
// vec_dot sums it (kern.rs GGML_Q6K): eight i32 lanes, lane l holding elements 4l..4l+3 of
// each 32 times the scale of their 16 (even 16s in lanes 0-3, odd in 4-7), minus
// 32 · (bsum·sc of the 16s 2l and 2l+1), each lane fused with d·d_a; then hsum.
extern "C" __global__ void x_mm_q6_k(const u8* __restrict__ W, long long row_bytes, int rows, int nb,
                                     const i8* __restrict__ aq, const float* __restrict__ d256,
                                     const int* __restrict__ bsums, float* __restrict__ y,
                                     int lanes16) { pdl_begin();
    int r = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (r >= rows) return;
    const u8* row = W + (long long)r * row_bytes;
    float acc[8];
    for (int l = 0; l < 8; l++) acc[l] = 0.f;
    for (int bi = 0; bi < nb; bi++) {
        const u8* b = row + bi * 210;
        const u8* ql = b;
        const u8* qh = b + 128;
        const signed char* sc = (const signed char*)(b + 192);
        long long ab = (long long)t * nb + bi;
        const i8* q = aq + ab * 256;
        const int* bs = bsums + ab * 16;
        int lane[8];
        for (int l = 0; l < 8; l++) lane[l] = 0;
        for (int e = 0; e < 256; e++) {
            int n = e / 128, k = (e % 128) / 32, l = e % 32;
            int lo = (ql[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15;
            int hi = (qh[32 * n + l] >> (2 * k)) & 3;
            int v = lo | (hi << 4);
            lane[(e % 32) / 4] += sc[e / 16] * v * q[e];
        }
        for (int l = 0; l < 8; l++) lane[l] -= 32 * (bs[2 * l] * sc[2 * l] + bs[2 * l + 1] * sc[2 * l + 1]);
        float f = h2f(rd16(b + 208)) * d256[ab];
        for (int l = 0; l < 8; l++) acc[l] = fmaf((float)lane[l], f, acc[l]);
    }
    y[(long long)t * rows + r] = hsum8(acc);
}

// The other K-quants (Q2_K, Q3_K, Q5_K) in ggml's "lanes" form (kern.rs GGML_LANES), whose
// float order depends on the CPU's SIMD level: per super-block, integer lane sums of Σ sc·v·q
// (lane l: elements 4l..4l+3 of each 32, times the scale of their 16) fused with d·d_a, and the
// correction lanes (Σ corr·bsum over the 16s 2l and 2l+1) fused with cd·d_a into a second
// accumulator. AVX2 keeps 8 lanes and sums acc + accm lane by lane, then hsum. AVX-512 keeps
// 16 value lanes (the even 32s in 0-7, the odd in 8-15), reduced by halves, quarters and pairs,
// plus hsum of the 8 correction lanes. A block decodes to values v (unsigned), 16 scales and
// 16 correction coefficients per 16 elements, d and cd, as decode.rs's KScales.
template <int T> struct KLanes;
template <> struct KLanes<0> {  // Q2_K: scales[16] (scale | min << 4), qs[64], d, dmin
    static const int BYTES = 84;
    __device__ static void get(const u8* b, int* v, int* sc, int* corr, float& d, float& cd) {
        for (int i = 0; i < 16; i++) { sc[i] = b[i] & 15; corr[i] = b[i] >> 4; }
        for (int e = 0; e < 256; e++) v[e] = (b[16 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        d = h2f(rd16(b + 80)); cd = -h2f(rd16(b + 82));
    }
};
template <> struct KLanes<1> {  // Q3_K: hmask[32], qs[64], scales[12] (6-bit, −32), d
    static const int BYTES = 110;
    __device__ static void get(const u8* b, int* v, int* sc, int* corr, float& d, float& cd) {
        for (int j = 0; j < 16; j++) sc[j] = corr[j] = q3k_scale(b + 96, j);  // quant.cu
        for (int e = 0; e < 256; e++) {
            int n = e / 128, j = (e % 128) / 32, l = e % 32;
            v[e] = ((b[32 + 32 * n + l] >> (2 * j)) & 3) | (((b[l] >> (4 * n + j)) & 1) << 2);
        }
        d = h2f(rd16(b + 108)); cd = -4.0f * d;
    }
};
template <> struct KLanes<2> {  // Q5_K: d, dmin, scales[12] (as Q4_K), qh[32], qs[128]
    static const int BYTES = 176;
    __device__ static void get(const u8* b, int* v, int* sc, int* corr, float& d, float& cd) {
        const u8* s = b + 4;
        for (int j = 0; j < 8; j++) {
            float a, m;
            k4_scale_min(s, j, a, m);
            sc[2 * j] = sc[2 * j + 1] = (int)a;
            corr[2 * j] = corr[2 * j + 1] = (int)m;
        }
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int q = b[48 + 32 * j + l], h = b[16 + l] >> (2 * j);
                v[64 * j + l] = (q & 15) | ((h & 1) << 4);
                v[64 * j + 32 + l] = (q >> 4) | ((h & 2) << 3);
            }
        d = h2f(rd16(b)); cd = -h2f(rd16(b + 2));
    }
};

template <int T>
__device__ void mm_k_lanes(const u8* __restrict__ W, long long row_bytes, int rows, int nb,
                           const i8* __restrict__ aq, const float* __restrict__ d256,
                           const int* __restrict__ bsums, float* __restrict__ y, int lanes16) {
    int r = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (r >= rows) return;
    const u8* row = W + (long long)r * row_bytes;
    float acc[16], accm[8];
    for (int l = 0; l < 16; l++) acc[l] = 0.f;
    for (int l = 0; l < 8; l++) accm[l] = 0.f;
    for (int bi = 0; bi < nb; bi++) {
        int v[256], sc[16], corr[16];
        float d, cd;
        KLanes<T>::get(row + (long long)bi * KLanes<T>::BYTES, v, sc, corr, d, cd);
        long long ab = (long long)t * nb + bi;
        const i8* q = aq + ab * 256;
        const int* bs = bsums + ab * 16;
        int lane[16];
        for (int l = 0; l < 16; l++) lane[l] = 0;
        for (int e = 0; e < 256; e++) {
            int g = e / 32, l = (e % 32) / 4;
            lane[l + 8 * (g & 1)] += sc[e / 16] * v[e] * q[e];
        }
        float da = d256[ab], f = d * da, fm = cd * da;
        if (lanes16) {
            for (int l = 0; l < 16; l++) acc[l] = fmaf((float)lane[l], f, acc[l]);
        } else {
            for (int l = 0; l < 8; l++) acc[l] = fmaf((float)(lane[l] + lane[l + 8]), f, acc[l]);
        }
        for (int l = 0; l < 8; l++)
            accm[l] = fmaf((float)(bs[2 * l] * corr[2 * l] + bs[2 * l + 1] * corr[2 * l + 1]), fm, accm[l]);
    }
    float out;
    if (lanes16) {
        float t8[8], t4[4];
        for (int i = 0; i < 8; i++) t8[i] = acc[i] + acc[i + 8];
        for (int i = 0; i < 4; i++) t4[i] = t8[i] + t8[i + 4];
        out = ((t4[0] + t4[2]) + (t4[1] + t4[3])) + hsum8(accm);
    } else {
        float s8[8];
        for (int l = 0; l < 8; l++) s8[l] = acc[l] + accm[l];
        out = hsum8(s8);
    }
    y[(long long)t * rows + r] = out;
}

// x_mm_q2_k, x_mm_q3_k, x_mm_q5_k (registry.rs: x_mm_k_lanes<0> … <2>).
template <int T>
__global__ void x_mm_k_lanes(const u8* __restrict__ W, long long row_bytes, int rows, int nb, const i8* __restrict__ aq,
                             const float* __restrict__ d256, const int* __restrict__ bsums, float* __restrict__ y,
                             int lanes16) {
    pdl_begin();
    mm_k_lanes<T>(W, row_bytes, rows, nb, aq, d256, bsums, y, lanes16);
}

// ---- rope, then q scaled and rounded to f16, k and v into the f16 cache ----
// grid (n_tokens, n_head + n_head_kv), block 32. sc: per token, n_dims/2 sines then as many
// cosines, computed on the host by the CPU backend's own code (RopeAngles). The products as
// the CPU (and GCC for ggml) contract them: x0·cos − x1·sin with the first product fused.
extern "C" __global__ void x_rope_kv_write(float* __restrict__ q, float* __restrict__ k,
                                           const float* __restrict__ v, u16* __restrict__ kc,
                                           u16* __restrict__ vc, const float* __restrict__ sc,
                                           BatchView b, int n_head, int n_head_kv, int head_dim,
                                           int n_dims, int mode, float q_scale) { pdl_begin();
    int t = blockIdx.x, h = blockIdx.y;
    int half = n_dims / 2, kv_dim = n_head_kv * head_dim;
    bool is_k = h >= n_head;
    float* base = is_k ? k + (long long)t * kv_dim + (h - n_head) * head_dim
                       : q + ((long long)t * n_head + h) * head_dim;
    const float* sn = sc + (long long)t * n_dims;
    const float* cs = sn + half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        int ia = mode ? i : 2 * i, ib = mode ? i + half : 2 * i + 1;
        float x0 = base[ia], x1 = base[ib];
        base[ia] = fmaf(x0, cs[i], -(x1 * sn[i]));
        base[ib] = fmaf(x0, sn[i], x1 * cs[i]);
    }
    __syncthreads();
    if (!is_k) {
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) base[i] = f16r(base[i] * q_scale);
        return;
    }
    u32 slot = b.slot[t];
    if (slot == NO_SLOT) return;
    int off = (h - n_head) * head_dim;
    const float* vt = v + (long long)t * kv_dim + off;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        kc[(long long)slot * kv_dim + off + i] = f2h(base[i]);
        vc[(long long)slot * kv_dim + off + i] = f2h(vt[i]);
    }
}

// ---- attention: one thread per (token, head), as ggml's one-row CPU flash attention ----
// q·k in the AVX-512 f16 dot's order (four 16-lane sums per 64, then 0+2 and 1+3, their sum,
// then halves, quarters and pairs; a tail in f64), the online softmax with the running sum and
// the p·v update fused, the accumulator rounded to f16 after every key (backend-cpu attn.rs).
// grid (n_tokens), block (n_head).
#define X_MAX_HD 256
__device__ float dot_ggml(const float* a, const float* b, int n) {
    float s[64];
    for (int i = 0; i < 64; i++) s[i] = 0.f;
    int c = n / 64;
    for (int k = 0; k < c; k++)
        for (int i = 0; i < 64; i++) s[i] = s[i] + a[64 * k + i] * b[64 * k + i];
    float x0[16], t3[8];
    for (int l = 0; l < 16; l++) x0[l] = (s[l] + s[32 + l]) + (s[16 + l] + s[48 + l]);
    for (int i = 0; i < 8; i++) t3[i] = x0[i] + x0[8 + i];
    float t6_0 = t3[0] + t3[4], t6_1 = t3[1] + t3[5], t6_2 = t3[2] + t3[6], t6_3 = t3[3] + t3[7];
    double sum = (double)((t6_0 + t6_2) + (t6_1 + t6_3));
    for (int i = 64 * c; i < n; i++) sum += (double)(a[i] * b[i]);
    return (float)sum;
}

extern "C" __global__ void x_attention(const float* __restrict__ q, const u16* __restrict__ kc,
                                       const u16* __restrict__ vc, float* __restrict__ out,
                                       BatchView b, int n_head, int n_head_kv, int hd, float scale,
                                       int window, float softcap) { pdl_begin();
    int t = blockIdx.x, h = threadIdx.x;
    if (h >= n_head || hd > X_MAX_HD) return;
    int kv_dim = n_head_kv * hd, koff = (h / (n_head / n_head_kv)) * hd;
    u32 s = b.seq[t];
    int pos = (int)b.pos[t];
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    const u32* bt = b.block_tables + b.bt_off[s];
    const float* qh = q + ((long long)t * n_head + h) * hd;
    float acc[X_MAX_HD], row[X_MAX_HD];
    for (int i = 0; i < hd; i++) acc[i] = 0.f;
    if (softcap > 0.f) scale = scale / softcap;
    float m = -__int_as_float(0x7f800000), sum = 0.f;
    for (int p = first; p <= pos; p++) {
        long long slot = (long long)bt[p / b.block_size] * b.block_size + p % b.block_size;
        const u16* kr = kc + slot * kv_dim + koff;
        for (int i = 0; i < hd; i++) row[i] = h2f(kr[i]);
        float sc = dot_ggml(qh, row, hd) * scale;
        if (softcap > 0.f) sc = softcap * (float)tanh((double)sc);
        float w;
        if (sc > m) {
            float r = exp_f32(m - sc);
            m = sc;
            sum = fmaf(sum, r, 1.0f);
            for (int i = 0; i < hd; i++) acc[i] = f16r(acc[i] * r);
            w = 1.0f;
        } else {
            w = exp_f32(sc - m);
            sum = sum + w;
        }
        const u16* vr = vc + slot * kv_dim + koff;
        for (int i = 0; i < hd; i++) acc[i] = f16r(fmaf(h2f(vr[i]), w, acc[i]));
    }
    float inv = 1.0f / sum;
    float* o = out + ((long long)t * n_head + h) * hd;
    for (int i = 0; i < hd; i++) o[i] = acc[i] * inv;
}

// ---- embedding rows, dequantized as the CPU's quiver_quant::dequantize rounds them ----
// quant.cu's embed<T> (this module includes it; registry.rs: x_embed_T), compiled here without
// fused multiply-adds: `d·q + m` and `dl·q − ml` round twice, as the CPU computes them.

// ---- gated activations: SiLU through ggml's vectorised e^x, GELU through its f16 table ----
// e^x as ggml_v_expf computes it on AVX-512 (act_fn.rs ggml_expf: the same fused operations).
__device__ float ggml_expf(float x) {
    const float r = 12582912.0f;
    float z = fmaf(x, __int_as_float(0x3fb8aa3b), r);
    float n = z - r;
    float b = fmaf(-n, __int_as_float(0x35bfbe8e), fmaf(-n, __int_as_float(0x3f317200), x));
    float u = b * b;
    float j = fmaf(fmaf(fmaf(__int_as_float(0x3c072010), b, __int_as_float(0x3d2b9f17)), u,
                        fmaf(__int_as_float(0x3e2aaf33), b, __int_as_float(0x3efffedb))),
                   u, fmaf(__int_as_float(0x3f7ffff6), b, 1.0f));
    int ni = (int)n;
    float res = j * __int_as_float((min(max(ni, -126), 127) + 127) << 23);
    if (ni > 127) return __int_as_float(0x7f800000);
    if (ni < -126) return 0.f;
    return res;
}

// out = act(gate) · up; act 0: silu = x / (1 + e^(0 − x)); 1: gelu from `table` (indexed by
// the f16 bits of the input, saturating outside ±10).
extern "C" __global__ void x_glu(const float* __restrict__ gate, const float* __restrict__ up,
                                 float* __restrict__ out, long long n, int act,
                                 const float* __restrict__ table) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float g = gate[i], a;
        if (act == 0) {
            a = g / (1.0f + ggml_expf(0.0f - g));
        } else {
            a = g <= -10.f ? 0.f : (g >= 10.f ? g : table[f2h(g)]);
        }
        out[i] = a * up[i];
    }
}
