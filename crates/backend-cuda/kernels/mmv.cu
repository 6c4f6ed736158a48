// Decode matrix-vector products over f32 activations, up to 8 tokens a launch (mmv, mmv_glu),
// and the experts' products of the mixture-of-experts layers (moe_*). Compiled after quant.cu
// in a type's module (it uses quant.cu's dequantizers and weight types).

// ---- row dot products: acc[t] += this lane's share of row · x[t], t < ntok ≤ 8 ----
// Generic: one 32-value group per lane per step.
template <class T>
__device__ __forceinline__ void row_dot(const u8* __restrict__ row, const float* __restrict__ x, int cols, int ntok,
                                        float* acc) {
    for (int g = threadIdx.x; g < cols / 32; g += 32) {
        float v[32];
        T::deq(row, g, v);
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < ntok) {
                const float4* xp = (const float4*)(x + (long long)t * cols + g * 32);
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    float4 xx = xp[i];
                    s += v[4 * i] * xx.x + v[4 * i + 1] * xx.y + v[4 * i + 2] * xx.z + v[4 * i + 3] * xx.w;
                }
                acc[t] += s;
            }
        }
    }
}

__device__ __forceinline__ u32 byte_of3(u32 a, u32 b, u32 c, int k) {
    u32 w = k < 4 ? a : (k < 8 ? b : c);
    return (w >> (8 * (k & 3))) & 255;
}

// Q4_K: a lane takes 16 bytes of quants (16 low-nibble values of group g, 16 high-nibble of
// g+1) and the super-block's 16-byte header (d, dmin, 12 scale bytes), both in one load each.
template <>
__device__ __forceinline__ void row_dot<Q4_K>(const u8* __restrict__ row, const float* __restrict__ x, int cols, int ntok,
                                           float* acc) {
    int nsl = cols / 32;
#pragma unroll 4
    for (int s = threadIdx.x; s < nsl; s += 32) {
        int sb = s >> 3, j = s & 7;
        const u8* b = row + sb * 144;
        uint4 q = *(const uint4*)(b + 16 + 16 * j);
        uint4 hd = *(const uint4*)b;
        float d = h2f(hd.x & 0xffff), dmin = h2f(hd.x >> 16);
        int g = (j >> 1) * 2;
        float sc0, m0, sc1, m1;
        if (g < 4) {
            sc0 = byte_of3(hd.y, hd.z, hd.w, g) & 63;
            m0 = byte_of3(hd.y, hd.z, hd.w, g + 4) & 63;
            sc1 = byte_of3(hd.y, hd.z, hd.w, g + 1) & 63;
            m1 = byte_of3(hd.y, hd.z, hd.w, g + 5) & 63;
        } else {
            sc0 = (byte_of3(hd.y, hd.z, hd.w, g + 4) & 15) | ((byte_of3(hd.y, hd.z, hd.w, g - 4) >> 6) << 4);
            m0 = (byte_of3(hd.y, hd.z, hd.w, g + 4) >> 4) | ((byte_of3(hd.y, hd.z, hd.w, g) >> 6) << 4);
            sc1 = (byte_of3(hd.y, hd.z, hd.w, g + 5) & 15) | ((byte_of3(hd.y, hd.z, hd.w, g - 3) >> 6) << 4);
            m1 = (byte_of3(hd.y, hd.z, hd.w, g + 5) >> 4) | ((byte_of3(hd.y, hd.z, hd.w, g + 1) >> 6) << 4);
        }
        float dl0 = d * sc0, ml0 = dmin * m0, dl1 = d * sc1, ml1 = dmin * m1;
        u32 w[4] = {q.x, q.y, q.z, q.w};
        float lo[16], hi[16];
#pragma unroll
        for (int k = 0; k < 16; k++) {
            u32 by = (w[k >> 2] >> (8 * (k & 3))) & 255;
            lo[k] = (float)(by & 15);
            hi[k] = (float)(by >> 4);
        }
        int xb = sb * 256 + g * 32 + (j & 1) * 16;
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < ntok) {
                const float4* x0 = (const float4*)(x + (long long)t * cols + xb);
                const float4* x1 = x0 + 8;
                float s0 = 0.f, sx0 = 0.f, s1 = 0.f, sx1 = 0.f;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float4 a = x0[i], c = x1[i];
                    s0 += lo[4 * i] * a.x + lo[4 * i + 1] * a.y + lo[4 * i + 2] * a.z + lo[4 * i + 3] * a.w;
                    sx0 += a.x + a.y + a.z + a.w;
                    s1 += hi[4 * i] * c.x + hi[4 * i + 1] * c.y + hi[4 * i + 2] * c.z + hi[4 * i + 3] * c.w;
                    sx1 += c.x + c.y + c.z + c.w;
                }
                acc[t] += dl0 * s0 - ml0 * sx0 + dl1 * s1 - ml1 * sx1;
            }
        }
    }
}

// Q6_K: a lane takes 8 positions l of one half h of a super-block: 8 bytes of ql at l and at
// l+32, 8 bytes of qh — 32 values in four groups of 8.
template <>
__device__ __forceinline__ void row_dot<Q6_K>(const u8* __restrict__ row, const float* __restrict__ x, int cols, int ntok,
                                           float* acc) {
    int nsl = cols / 32;
#pragma unroll 4
    for (int s = threadIdx.x; s < nsl; s += 32) {
        int sb = s >> 3, jj = s & 7, h = jj >> 2, l0 = (jj & 3) * 8;
        const u8* b = row + sb * 210;
        const u16* pa = (const u16*)(b + h * 64 + l0);
        const u16* pc = pa + 16;
        const u16* pe = (const u16*)(b + 128 + h * 32 + l0);
        u32 a[2] = {pa[0] | ((u32)pa[1] << 16), pa[2] | ((u32)pa[3] << 16)};
        u32 c[2] = {pc[0] | ((u32)pc[1] << 16), pc[2] | ((u32)pc[3] << 16)};
        u32 e[2] = {pe[0] | ((u32)pe[1] << 16), pe[2] | ((u32)pe[3] << 16)};
        const i8* sc = (const i8*)(b + 192 + h * 8 + (l0 >> 4));
        float d = h2f(*(const u16*)(b + 208));
        float d0 = d * sc[0], d1 = d * sc[2], d2 = d * sc[4], d3 = d * sc[6];
        float q1[8], q2[8], q3[8], q4[8];
#pragma unroll
        for (int l = 0; l < 8; l++) {
            u32 la = (a[l >> 2] >> (8 * (l & 3))) & 255, lc = (c[l >> 2] >> (8 * (l & 3))) & 255, he = (e[l >> 2] >> (8 * (l & 3))) & 255;
            q1[l] = (float)((int)((la & 15) | ((he & 3) << 4)) - 32);
            q2[l] = (float)((int)((lc & 15) | (((he >> 2) & 3) << 4)) - 32);
            q3[l] = (float)((int)((la >> 4) | (((he >> 4) & 3) << 4)) - 32);
            q4[l] = (float)((int)((lc >> 4) | (((he >> 6) & 3) << 4)) - 32);
        }
        int xb = sb * 256 + h * 128 + l0;
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < ntok) {
                const float* xp = x + (long long)t * cols + xb;
                float s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f;
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    float4 x1 = ((const float4*)xp)[i], x2 = ((const float4*)(xp + 32))[i];
                    float4 x3 = ((const float4*)(xp + 64))[i], x4 = ((const float4*)(xp + 96))[i];
                    s1 += q1[4 * i] * x1.x + q1[4 * i + 1] * x1.y + q1[4 * i + 2] * x1.z + q1[4 * i + 3] * x1.w;
                    s2 += q2[4 * i] * x2.x + q2[4 * i + 1] * x2.y + q2[4 * i + 2] * x2.z + q2[4 * i + 3] * x2.w;
                    s3 += q3[4 * i] * x3.x + q3[4 * i + 1] * x3.y + q3[4 * i + 2] * x3.z + q3[4 * i + 3] * x3.w;
                    s4 += q4[4 * i] * x4.x + q4[4 * i + 1] * x4.y + q4[4 * i + 2] * x4.z + q4[4 * i + 3] * x4.w;
                }
                acc[t] += d0 * s1 + d1 * s2 + d2 * s3 + d3 * s4;
            }
        }
    }
}

// Dense half-precision rows: 8 values (16 bytes) per lane per step, consecutive across the warp.
// Not unrolled: fewer registers, more warps resident, and the H200 keeps more loads in flight
// that way (8B F16 tg128 in one run: 215.7 unrolled 1×, 214.6 2×, 212.1 4×, 207.0 8×, 203 16×).
template <bool BF>
__device__ __forceinline__ void row_dot_dense(const u8* __restrict__ rowb, const float* __restrict__ x, int cols,
                                          int ntok, float* acc) {
    const uint4* row = (const uint4*)rowb;
#pragma unroll 1
    for (int i = threadIdx.x; i < cols / 8; i += 32) {
        uint4 u = row[i];
        u32 w[4] = {u.x, u.y, u.z, u.w};
        float v[8];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            v[2 * k] = (BF ? bf2f(w[k] & 0xffff) : h2f(w[k] & 0xffff));
            v[2 * k + 1] = (BF ? bf2f(w[k] >> 16) : h2f(w[k] >> 16));
        }
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < ntok) {
                const float4* xp = (const float4*)(x + (long long)t * cols + i * 8);
                float4 a = xp[0], b = xp[1];
                acc[t] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x + v[5] * b.y +
                          v[6] * b.z + v[7] * b.w;
            }
        }
    }
}
template <>
__device__ __forceinline__ void row_dot<F16>(const u8* __restrict__ row, const float* __restrict__ x, int cols, int ntok,
                                         float* acc) {
    row_dot_dense<false>(row, x, cols, ntok, acc);
}
template <>
__device__ __forceinline__ void row_dot<BF16>(const u8* __restrict__ row, const float* __restrict__ x, int cols, int ntok,
                                          float* acc) {
    row_dot_dense<true>(row, x, cols, ntok, acc);
}

// ---- kernels: templates over the weight type T (registry.rs `kernels` instantiates one type's
// in its module) ----
// mmv: y[t, r] = W[r, :] · x[t, :] for t < ntok ≤ 8; up to three matrices in one launch
//      (q, k and v): warp-row r < rows0 is W0's, then W1's, then W2's.  grid (Σrows / 4), block (32, 4)
// mmv_glu: out[t, r] = act(Wg[r] · x[t]) · (Wu[r] · x[t]).       grid (rows / 4), block (32, 4)
#define MMV_WARPS 4
struct MmvMat {
    const u8* w;
    float* y;
    long long row_bytes;
    int rows;
};
// The weight row warp-row r of an mmv launch reads (0 past the last matrix), for the prefetch.
__device__ __forceinline__ const u8* mmv_row(MmvMat m0, MmvMat m1, MmvMat m2, int r) {
    if (r < m0.rows) return m0.w + (long long)r * m0.row_bytes;
    r -= m0.rows;
    if (r < m1.rows) return m1.w + (long long)r * m1.row_bytes;
    r -= m1.rows;
    if (r < m2.rows) return m2.w + (long long)r * m2.row_bytes;
    return 0;
}
// How a matrix-vector kernel begins: PF 0 waits for its predecessor (pdl_begin); PF 1 first
// prefetches the warp's weight rows into L2 (pdl_begin_prefetch). The host picks PF 1 for
// launches of at most 4 MiB of weights (`MMV_PREFETCH_MAX` in lib.rs), whose blocks are all
// resident while the previous kernel still runs; larger launches start most blocks later,
// where a prefetch only doubles each request (8B Q4_0 tg128 −12% with it everywhere).
// Measured: SmolLM2 shape tg128 +5%, Gemma3 shape +2%, 8B shapes unchanged (BENCHMARKS.md).
#define MMV_BEGIN(PF)                                                                                 \
    if (PF) pdl_begin_prefetch(mmv_row(m0, m1, m2, blockIdx.x * MMV_WARPS + threadIdx.y), 0, m0.row_bytes); \
    else pdl_begin();
#define GLU_BEGIN(PF)                                                                                 \
    if (PF) {                                                                                         \
        int pr = blockIdx.x * MMV_WARPS + threadIdx.y;                                                \
        pdl_begin_prefetch(pr < rows ? wg + (long long)pr * row_bytes : 0,                            \
                           pr < rows ? wu + (long long)pr * row_bytes : 0, row_bytes);                \
    } else pdl_begin();
// NTOK: the token count, or 0 for the launch's (ntok_arg); PF: the prefetch.
template <class T, int NTOK, bool PF>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    mmv(MmvMat m0, MmvMat m1, MmvMat m2, const float* __restrict__ x, int cols, int ntok_arg) {
    MMV_BEGIN(PF)
    const int ntok = NTOK ? NTOK : ntok_arg;
    int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    MmvMat m = m0;
    if (r >= m0.rows) {
        r -= m0.rows;
        m = m1;
        if (r >= m1.rows) {
            r -= m1.rows;
            m = m2;
            if (r >= m2.rows) return;
        }
    }
    float acc[8];
#pragma unroll
    for (int t = 0; t < 8; t++) acc[t] = 0.f;
    row_dot<T>(m.w + (long long)r * m.row_bytes, x, cols, ntok, acc);
#pragma unroll
    for (int t = 0; t < 8; t++) {
        if (t < ntok) {
            float s = warp_sum(acc[t]);
            if (threadIdx.x == 0) m.y[(long long)t * m.rows + r] = s;
        }
    }
}
template <class T, int NTOK, bool PF>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    mmv_glu(const u8* __restrict__ wg, const u8* __restrict__ wu, long long row_bytes, const float* __restrict__ x,
            float* __restrict__ out, int rows, int cols, int ntok_arg, int act) {
    GLU_BEGIN(PF)
    const int ntok = NTOK ? NTOK : ntok_arg;
    int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    if (r >= rows) return;
    float ag[8], au[8];
#pragma unroll
    for (int t = 0; t < 8; t++) ag[t] = au[t] = 0.f;
    row_dot<T>(wg + (long long)r * row_bytes, x, cols, ntok, ag);
    row_dot<T>(wu + (long long)r * row_bytes, x, cols, ntok, au);
#pragma unroll
    for (int t = 0; t < 8; t++) {
        if (t < ntok) {
            float g = warp_sum(ag[t]), u = warp_sum(au[t]);
            if (threadIdx.x == 0) out[(long long)t * rows + r] = glu_fn(g, u, act);
        }
    }
}

// Mixture-of-experts products, one warp per output row of one (token, slot) pair p =
// blockIdx.y, from the expert routes[2p] chose (the experts stacked: expert e's row r is row
// e·expert_rows + r). moe_glu: out[p, r] = act(Wg_e[r] · x[p / k]) · (Wu_e[r] · x[p / k]);
// moe_mmv: y[p, r] = W_e[r] · x[p].                            grid (rows / 4, pairs), block (32, 4)
template <class T>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    moe_glu(const u8* __restrict__ wg, const u8* __restrict__ wu, long long row_bytes, long long expert_rows,
            const float* __restrict__ routes, const float* __restrict__ x, float* __restrict__ out, int rows, int cols,
            int k, int act) {
    pdl_begin();
    const int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    if (r >= rows) return;
    const long long p = blockIdx.y;
    const long long e = (long long)routes[2 * p];
    const float* xt = x + (p / k) * cols;
    float ag[8], au[8];
#pragma unroll
    for (int t = 0; t < 8; t++) ag[t] = au[t] = 0.f;
    row_dot<T>(wg + (e * expert_rows + r) * row_bytes, xt, cols, 1, ag);
    row_dot<T>(wu + (e * expert_rows + r) * row_bytes, xt, cols, 1, au);
    float g = warp_sum(ag[0]), u = warp_sum(au[0]);
    if (threadIdx.x == 0) out[p * rows + r] = glu_fn(g, u, act);
}
template <class T>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    moe_mmv(const u8* __restrict__ w, long long row_bytes, long long expert_rows, const float* __restrict__ routes,
            const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    pdl_begin();
    const int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    if (r >= rows) return;
    const long long p = blockIdx.y;
    const long long e = (long long)routes[2 * p];
    float acc[8];
#pragma unroll
    for (int t = 0; t < 8; t++) acc[t] = 0.f;
    row_dot<T>(w + (e * expert_rows + r) * row_bytes, x + p * cols, cols, 1, acc);
    float s = warp_sum(acc[0]);
    if (threadIdx.x == 0) y[p * rows + r] = s;
}
// The grouped forms, for steps of many tokens: the pairs sorted by expert (moe_group), expert
// e's inputs at rows off[e]..off[e+1] of xs; a block takes rows of one expert (blockIdx.y) and
// runs its tokens 8 at a time, so a weight row is read once per 8 tokens. Each token's sums are
// the pair-wise kernels' (row_dot's arithmetic per token does not depend on how many share a
// call): a token gets the same bits whichever form and whatever else is in the step.
//                                                               grid (rows / 4, n_expert), block (32, 4)
template <class T>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    moe_glu_g(const u8* __restrict__ wg, const u8* __restrict__ wu, long long row_bytes, long long expert_rows,
              const int* __restrict__ off, const float* __restrict__ xs, float* __restrict__ out, int rows, int cols,
              int act) {
    pdl_begin();
    const int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    if (r >= rows) return;
    const long long e = blockIdx.y;
    const int a = off[e], b = off[e + 1];
    const u8* rg = wg + (e * expert_rows + r) * row_bytes;
    const u8* ru = wu + (e * expert_rows + r) * row_bytes;
    for (int c = a; c < b; c += 8) {
        const int n = min(8, b - c);
        float ag[8], au[8];
#pragma unroll
        for (int t = 0; t < 8; t++) ag[t] = au[t] = 0.f;
        row_dot<T>(rg, xs + (long long)c * cols, cols, n, ag);
        row_dot<T>(ru, xs + (long long)c * cols, cols, n, au);
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < n) {
                float g = warp_sum(ag[t]), u = warp_sum(au[t]);
                if (threadIdx.x == 0) out[(long long)(c + t) * rows + r] = glu_fn(g, u, act);
            }
        }
    }
}
template <class T>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    moe_mmv_g(const u8* __restrict__ w, long long row_bytes, long long expert_rows, const int* __restrict__ off,
              const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    pdl_begin();
    const int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    if (r >= rows) return;
    const long long e = blockIdx.y;
    const int a = off[e], b = off[e + 1];
    const u8* rw = w + (e * expert_rows + r) * row_bytes;
    for (int c = a; c < b; c += 8) {
        const int n = min(8, b - c);
        float acc[8];
#pragma unroll
        for (int t = 0; t < 8; t++) acc[t] = 0.f;
        row_dot<T>(rw, x + (long long)c * cols, cols, n, acc);
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < n) {
                float s = warp_sum(acc[t]);
                if (threadIdx.x == 0) y[(long long)(c + t) * rows + r] = s;
            }
        }
    }
}

// f32mm: y[t, r] = Σ_k W[r, k] · x[t, k] for weights stored in f32, in f32 on the CUDA cores
// (llama.cpp's products of F32 weights are f32 throughout; the tensor-core families would round
// both sides to f16), in one order whatever the launch: lane l of a warp takes the columns
// 4l..4l+3 of every 128 as one fmaf chain, and the 32 chains meet in the warp's butterfly
// (warp_sum) — so a token's results are the same bits for decode rows and prompt rows at any
// count. NT tokens a launch column (8, or 1 for a single token: more warps, deeper loads), a
// warp takes R = 2 rows (1 for one token) × NT tokens, a block 8 warps over the same tokens.
// A second matrix of the same row bytes and columns (W2, rows2 > 0) over the same x: the blocks
// past the first matrix's take its rows into y2 (two products, one launch; each row's bits
// its own). cols a multiple of 4.  grid (ceil(n / NT), ceil(rows / (8·R)) + ceil(rows2 / (8·R))),
// block 256
template <class T, int NT>
__global__ void __launch_bounds__(256)
    f32mm(const u8* __restrict__ W, long long row_bytes, int rows, int cols, const float* __restrict__ x,
          float* __restrict__ y, int n, const u8* __restrict__ W2, int rows2, float* __restrict__ y2) {
    pdl_begin();
    constexpr int R = NT == 1 ? 1 : 2;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int by = blockIdx.y;
    const int first = (rows + 8 * R - 1) / (8 * R);
    if (by >= first) {
        W = W2, rows = rows2, y = y2;
        by -= first;
    }
    const int r0 = (by * 8 + warp) * R, t0 = blockIdx.x * NT;
    if (r0 >= rows) return;
    const int nt = min(NT, n - t0);
    const float* wr[R];
#pragma unroll
    for (int i = 0; i < R; i++) wr[i] = (const float*)(W + (long long)min(r0 + i, rows - 1) * row_bytes);
    const float* xt = x + (long long)t0 * cols;
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[i][j] = 0.f;
#pragma unroll(NT == 1 ? 8 : 4)
    for (int k = 4 * lane; k < cols; k += 128) {
        float4 xv[NT];
#pragma unroll
        for (int j = 0; j < NT; j++)
            xv[j] = j < nt ? *(const float4*)(xt + (long long)j * cols + k) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < R; i++) {
            const float4 w = *(const float4*)(wr[i] + k);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                float a = acc[i][j];
                a = fmaf(w.x, xv[j].x, a);
                a = fmaf(w.y, xv[j].y, a);
                a = fmaf(w.z, xv[j].z, a);
                acc[i][j] = fmaf(w.w, xv[j].w, a);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const float v = warp_sum(acc[i][j]);
            if (lane == 0 && r0 + i < rows && j < nt) y[(long long)(t0 + j) * rows + r0 + i] = v;
        }
}
