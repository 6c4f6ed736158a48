// Element-wise and row-wise ops: norms (with the residual add fused), rope fused with the KV
// write, gated activations, soft-capping, row gathers, conversions and the device argmax.

// RMSNorm of each row of `cols` (a multiple of 4) times w (w null: no weight).
// If `residual` is non-null: residual += x first and the norm is taken of the sum. If `gate` is
// non-null ([rows, cols] as out): out = silu(gate) · the norm, the glu kernel's SwiGLU (glu_fn).
// With `q` non-null the output is also quantized for the next product, as quantize_a32
// (qblock 32, q8_1 as there; qd its ds) or quantize_a256 (qblock 256; qd its d256, qs its bsums,
// tn its tiling) quantize it, bit for bit: each warp takes whole blocks of 256 values then, a
// lane 8 of them (cols a multiple of 256 for blocks of 256; lanes past cols idle for 32).
__device__ __forceinline__ float4 norm_out(float4 v, float inv, float4 g, const float* gate, long long at) {
    float4 y = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
    if (gate) {
        const float4 z = *(const float4*)(gate + at);
        y = make_float4(glu_fn(z.x, y.x, 0), glu_fn(z.y, y.y, 0), glu_fn(z.z, y.z, 0), glu_fn(z.w, y.w, 0));
    }
    return y;
}
__device__ __forceinline__ int f2i_rn(float f) { int i; asm("cvt.rni.s32.f32 %0, %1;" : "=r"(i) : "f"(f)); return i; }
// The reciprocal scale of a block of 256 spread eight values per lane (ggml's Q8_K); its
// d = 1 / id.
__device__ __forceinline__ float inv_scale256(const float* v) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
    amax = warp_max(amax);
    return amax > 0.f ? 127.f / amax : 0.f;
}
// quantize_a256's block b (of nblocks; nsb a token) from lane's 8 values v (a warp a block):
// the quants (row-major, or tiled for tn tokens), d and the sums (see quantize_a256).
__device__ __forceinline__ void q256_block(const float* v, long long b, int nsb, long long nblocks, int tn, int lane,
                                           i8* __restrict__ q, float* __restrict__ d256, int* __restrict__ bsums) {
    float id = inv_scale256(v), d = id > 0.f ? 1.f / id : 0.f;
    int s = 0;
    u32 packed[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int qi = f2i_rn(v[i] * id);
        s += qi;
        packed[i >> 2] |= ((u32)(qi & 255)) << (8 * (i & 3));
    }
    const long long at = tn > 0 ? (((b % nsb) * 16 + lane / 2) * (long long)tn + b / nsb) * 16 + (lane & 1) * 8 : b * 256 + lane * 8;
    *(uint2*)(q + at) = make_uint2(packed[0], packed[1]);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    if ((lane & 1) == 0) bsums[b * 16 + lane / 2] = s;
    const int s32 = s + __shfl_xor_sync(0xffffffffu, s, 2), h = (s32 + 128) >> 8;
    if ((lane & 3) == 0) {
        i8* hl = (i8*)(bsums + 16 * nblocks) + b * 16;
        hl[lane / 4] = (i8)h;
        hl[8 + lane / 4] = (i8)(s32 - 256 * h);
    }
    if (lane == 0) d256[b] = d;
}

// The norm's output y of a thread's 8 columns from c (v: the normed input, residual added),
// stored, and with q its int8 copy (see rms_norm): a warp holds 256 consecutive columns, a lane
// 8, lanes at or past cols idle.
__device__ __forceinline__ void norm_group(float* v, const float4* g, float inv, int r, int c, int rows, int cols,
                                           const float* __restrict__ gate, float* __restrict__ out,
                                           i8* __restrict__ q, float* __restrict__ qd, int* __restrict__ qs,
                                           int qblock, int q8_1, int tn) {
    const int l = threadIdx.x & 31;
    const long long at = (long long)r * cols + c;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float4 y = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c + 4 * h < cols) {
            y = norm_out(make_float4(v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]), inv, g[h], gate, at + 4 * h);
            *(float4*)(out + at + 4 * h) = y;
        }
        v[4 * h] = y.x, v[4 * h + 1] = y.y, v[4 * h + 2] = y.z, v[4 * h + 3] = y.w;
    }
    if (!q) return;
    const bool live = c < cols;
    if (qblock == 32) {
        // quantize_a32's block of 32: four lanes.
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int s = 0;
        u32 packed[2] = {0, 0};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int qi = f2i_rn(v[i] * id);
            s += qi;
            packed[i >> 2] |= ((u32)(qi & 255)) << (8 * (i & 3));
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (live) *(uint2*)(q + at) = make_uint2(packed[0], packed[1]);
        if (live && (l & 3) == 0) {
            const long long b = at / 32;
            const float d16 = h2f(f2h(d));
            qd[2 * b] = d16;
            qd[2 * b + 1] = q8_1 ? h2f(f2h(d * (float)s)) : d16 * (float)s;
        }
    } else {
        // quantize_a256's block: the warp.
        const int nsb = cols / 256;
        q256_block(v, (long long)r * nsb + (c - 8 * l) / 256, nsb, (long long)rows * nsb, tn, l, q, qd, qs);
    }
}

// A thread's norm weights (w null: ones) of its 8 columns of the first pass, loaded before
// rms_norm waits for the previous kernel (no kernel writes weights); then the wait.
struct NormW {
    float4 g[2];
};
__device__ __forceinline__ NormW norm_begin(const float* __restrict__ w, int cols) {
    NormW n;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int c = threadIdx.x * 8 + 4 * h;
        n.g[h] = w && c < cols ? *(const float4*)(w + c) : make_float4(1.f, 1.f, 1.f, 1.f);
    }
    pdl_begin();
    return n;
}
// x (+ residual, written back) of the 8 columns from c (cols a multiple of 4) into v, and
// their squares added to ss in order.
__device__ __forceinline__ void norm_load(const float* __restrict__ xr, float* __restrict__ rr, int c, int cols,
                                          float* v, float& ss) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c + 4 * h < cols) {
            a = *(const float4*)(xr + c + 4 * h);
            if (rr) {
                const float4 b = *(const float4*)(rr + c + 4 * h);
                a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
                *(float4*)(rr + c + 4 * h) = a;
            }
        }
        v[4 * h] = a.x, v[4 * h + 1] = a.y, v[4 * h + 2] = a.z, v[4 * h + 3] = a.w;
        ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    }
}
// grid (rows), block a multiple of 32 (≤ 512, norm_threads): one block per row, thread t owning
// columns p·8·blockDim + 8t .. + 8 of each pass p, so that a warp's columns of a pass are one
// block of 256 (the int8 copy's) and the sum's order is a function of cols alone. The first
// pass (a row of up to 4,096) stays in registers; a wider row's later passes are read again
// by the thread that wrote them.
extern "C" __global__ void __launch_bounds__(512)
    rms_norm(float* __restrict__ residual, const float* __restrict__ x, const float* __restrict__ w,
             float* __restrict__ out, int rows, int cols, float eps, const float* __restrict__ gate,
             i8* __restrict__ q, float* __restrict__ qd, int* __restrict__ qs, int qblock, int q8_1, int tn) {
    const NormW g = norm_begin(w, cols);
    const int r = blockIdx.x, tid = threadIdx.x, step = blockDim.x * 8;
    const long long base = (long long)r * cols;
    const float* xr = x + base;
    float* rr = residual ? residual + base : 0;
    float v[8], u[8];
    float ss = 0.f;
    norm_load(xr, rr, tid * 8, cols, v, ss);
    for (int c = step + tid * 8; c < cols; c += step) norm_load(xr, rr, c, cols, u, ss);
    __shared__ float part[32];
    ss = warp_sum(ss);
    const int wi = tid / 32, l = tid % 32, nw = blockDim.x / 32;
    if (l == 0) part[wi] = ss;
    __syncthreads();
    ss = l < nw ? part[l] : 0.f;
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / cols + eps);
    // Whole warps past the row idle (their 256 columns are none of it).
    if (wi * 256 < cols) norm_group(v, g.g, inv, r, tid * 8, rows, cols, gate, out, q, qd, qs, qblock, q8_1, tn);
    const float* src = rr ? rr : xr;
    const float4 one = make_float4(1.f, 1.f, 1.f, 1.f);
    for (int c0 = step + wi * 256; c0 < cols; c0 += step) {
        const int c = c0 + l * 8;
        float4 gw[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const bool in = c + 4 * h < cols;
            const float4 a = in ? *(const float4*)(src + c + 4 * h) : make_float4(0.f, 0.f, 0.f, 0.f);
            gw[h] = w && in ? *(const float4*)(w + c + 4 * h) : one;
            u[4 * h] = a.x, u[4 * h + 1] = a.y, u[4 * h + 2] = a.z, u[4 * h + 3] = a.w;
        }
        norm_group(u, gw, inv, r, c, rows, cols, gate, out, q, qd, qs, qblock, q8_1, tn);
    }
}

// Rope on q (in place) and k, then k and v into the f16 cache at each token's slot.
// grid (n_tokens, n_head + n_head_kv), block 64: one block per (token, head); the blocks of the
// K heads also write their K and V head to the cache. theta: [n_dims / 2] angles per position.
// mode 0 normal, 1 neox.
extern "C" __global__ void rope_kv_write(float* __restrict__ q, float* __restrict__ k,
                                         const float* __restrict__ v, u16* __restrict__ kc,
                                         u16* __restrict__ vc, const u32* __restrict__ pos,
                                         const u32* __restrict__ slots, const float* __restrict__ theta,
                                         int n_head, int n_head_kv, int head_dim, int n_dims, int mode,
                                         float mscale, float temp_scale, float temp_floor,
                                         const float* __restrict__ qn, const float* __restrict__ kn,
                                         float eps) { pdl_begin();
    int t = blockIdx.x, h = blockIdx.y;
    float p = (float)pos[t];
    int half = n_dims / 2, kv_dim = n_head_kv * head_dim;
    bool is_k = h >= n_head;
    float* base = is_k ? k + (long long)t * kv_dim + (h - n_head) * head_dim
                       : q + ((long long)t * n_head + h) * head_dim;
    // The head's RMS norm first (Qwen 3, Gemma 3 / 4: qn / kn of head_dim; null: none). Block 64.
    const float* nw = is_k ? kn : qn;
    if (nw) {
        __shared__ float part[2];
        float ss = 0.f;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) ss += base[i] * base[i];
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
        __syncthreads();
        const float inv = rsqrtf((part[0] + part[1]) / head_dim + eps);
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) base[i] = base[i] * inv * nw[i];
        __syncthreads();
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        int ia = mode ? i : 2 * i, ib = mode ? i + half : 2 * i + 1;
        float s, c;
        sincosf(p * theta[i], &s, &c);
        s *= mscale;
        c *= mscale;
        float x0 = base[ia], x1 = base[ib];
        base[ia] = x0 * c - x1 * s;
        base[ib] = x0 * s + x1 * c;
    }
    if (!is_k) {
        // Llama-4-style temperature of q (temp_scale 0: none), after the rotation.
        if (temp_scale != 0.f) {
            __syncthreads();
            float f = (float)(log((double)floorf(p / temp_floor) + 1.0) * (double)temp_scale + 1.0);
            for (int i = threadIdx.x; i < head_dim; i += blockDim.x) base[i] *= f;
        }
        return;
    }
    u32 slot = slots[t];
    // No f16 cache (kc null): kv_encode writes the records from the rotated k.
    if (slot == NO_SLOT || !kc) return;
    __syncthreads();
    int off = (h - n_head) * head_dim;
    const float* vt = v + (long long)t * kv_dim + off;
    u16* kd = kc + (long long)slot * kv_dim + off;
    u16* vd = vc + (long long)slot * kv_dim + off;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        kd[i] = f2h(base[i]);
        vd[i] = f2h(vt[i]);
    }
}

// out = act(gate) · up (common.cuh glu_fn: the act codes).
extern "C" __global__ void glu(const float* __restrict__ gate, const float* __restrict__ up,
                               float* __restrict__ out, long long n, int act) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = glu_fn(gate[i], up[i], act);
}

extern "C" __global__ void softcap(float* __restrict__ x, long long n, float cap) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

// The ops only some architectures use (Gemma 4): x *= s; x[t, c] *= w[c]; and a column range
// of each row copied out (out[t, c] = src[t, first + c]).
extern "C" __global__ void scale(float* __restrict__ x, long long n, float s) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= s;
}
extern "C" __global__ void mul_cols(float* __restrict__ x, const float* __restrict__ w, long long n,
                                    int cols) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= w[i % cols];
}
extern "C" __global__ void copy_cols(const float* __restrict__ src, float* __restrict__ out, long long n,
                                     int src_cols, int first, int width) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = src[(i / width) * src_cols + first + i % width];
}

// out[t, at + c] = src[t, c] over n = rows · width values (out rows of out_cols).
extern "C" __global__ void put_cols(const float* __restrict__ src, float* __restrict__ out, long long n,
                                    int width, int out_cols, int at) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[(i / width) * out_cols + at + i % width] = src[i];
}

// dst[i] = src[i] over n values (pointers already at their offsets).
extern "C" __global__ void copy_range(const float* __restrict__ src, float* __restrict__ dst, long long n) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

extern "C" __global__ void add(float* __restrict__ a, const float* __restrict__ b, long long n) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        a[i] += b[i];
}

// Tensor parallelism over NCCL (src/tp.rs): x[i] = Σ_r g[r · n + i], the ranks' values (an
// all-gather's) added in rank order, ((g_0 + g_1) + g_2) + …: every rank the same bits, those of
// LocalComm's sum.
extern "C" __global__ void tp_sum_ranks(const float* __restrict__ g, float* __restrict__ x, long long n, int size) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float s = g[i];
        for (int r = 1; r < size; r++) s += g[r * n + i];
        x[i] = s;
    }
}

// Rank r's rows × width values of `g` (an all-gather's, rank after rank) as columns r · width …
// of rows of size · width in x: n = rows · width · size values.
extern "C" __global__ void tp_gather_cols(const float* __restrict__ g, float* __restrict__ x, long long n, int rows,
                                          int width) {
    pdl_begin();
    const long long part = (long long)rows * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / part, t = (i % part) / width, c = i % width;
        x[(t * (n / part) + r) * width + c] = g[i];
    }
}

// x[t, c] += bias[c] over n = rows · cols values (a product's bias; exact in f32 either way).
extern "C" __global__ void add_bias(float* __restrict__ x, const float* __restrict__ bias, long long n,
                                    int cols) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += bias[i % cols];
}

// y[i] = part[i] + part[len + i] + … over the s partials of a split-K product (qmm.cu), in
// order from the first.
extern "C" __global__ void sum_splits(const float* __restrict__ part, int s, long long len,
                                      float* __restrict__ y) { pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len; i += (long long)gridDim.x * blockDim.x) {
        float v = part[i];
        for (int z = 1; z < s; z++) v += part[z * len + i];
        y[i] = v;
    }
}

// out[i, :] = x[rows[i], :]; grid (n_rows), block 256.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ rows,
                                       float* __restrict__ out, int cols) { pdl_begin();
    const float* src = x + (long long)rows[blockIdx.x] * cols;
    float* dst = out + (long long)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}

// Four values per thread (both pointers 16-byte aligned), grid-stride; thread 0 converts the
// last n % 4.
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, u16* __restrict__ out, long long n) { pdl_begin();
    long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (long long i = t; i < n / 4; i += (long long)gridDim.x * blockDim.x) {
        float4 v = ((const float4*)x)[i];
        ((uint2*)out)[i] = make_uint2((u32)f2h(v.x) | ((u32)f2h(v.y) << 16), (u32)f2h(v.z) | ((u32)f2h(v.w) << 16));
    }
    if (t == 0)
        for (long long j = n & ~3LL; j < n; j++) out[j] = f2h(x[j]);
}

// Round to nearest, ties to even (the activations' int8 grid).

// The activations of wmm (wmm.cu) from `n` f32 rows of `cols` (x): f16 on the int8 grid of the
// weight's type (`grid` 32 or 256, as f32_to_f16_q32 / f32_to_f16_q256 round; 0: plain f16), as
// rows of `colsp` (whole stages of 128 columns, zeros past `cols`), each stage permuted as qmm's
// steps take it: 16-byte piece c (step c / 2, half c % 2, of stage c / 16) holds the pairs of
// columns 32g + 4·(c / 2) + 2·(c % 2) + {0, 1} for the four 32-groups g; tiled: piece c of token
// t at (c · np + t) · 16 bytes (np ≥ n, tokens n..np-1 left as they are).
// grid (ceil(colsp / 256), ceil(n / 32)), block 256: a block rounds 32 tokens' 256 columns into
// shared memory (a warp a token at a time, a lane 8 columns: rows read whole), then writes their
// 32 pieces, consecutive threads consecutive tokens (whole lines).
extern "C" __global__ void f32_permute(const float* __restrict__ x, u16* __restrict__ xp, int n, int cols, int colsp,
                                       int np, int grid) {
    pdl_begin();
    constexpr int RW = 129;  // a token's 256 columns in 4-byte words, one more: no bank conflicts
    __shared__ u32 tile[32 * RW];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = blockIdx.x * 256, t0 = blockIdx.y * 32;
    for (int tl = warp; tl < 32; tl += 8) {
        const int t = t0 + tl;
        if (t >= n) break;
        const float* r = x + (long long)t * cols;
        const int col = c0 + 8 * lane;
        float v[8];
        if ((cols & 7) == 0 && col < cols) {
            const float4 u = *(const float4*)(r + col), w = *(const float4*)(r + col + 4);
            v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w, v[4] = w.x, v[5] = w.y, v[6] = w.z, v[7] = w.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = col + i < cols ? r[col + i] : 0.f;
        }
        u32 h[4];
        if (grid == 256) {
            // (cols a multiple of 256: the warp's 256 columns are one block)
            const float id = inv_scale256(v), d = id > 0.f ? 1.f / id : 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++)
                h[i] = (u32)f2h((float)f2i_rn(v[2 * i] * id) * d) | ((u32)f2h((float)f2i_rn(v[2 * i + 1] * id) * d) << 16);
        } else if (grid == 32) {
            float amax = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            const float id = amax > 0.f ? 127.f / amax : 0.f, d = h2f(f2h(amax / 127.f));
#pragma unroll
            for (int i = 0; i < 4; i++)
                h[i] = (u32)f2h((float)f2i_rn(v[2 * i] * id) * d) | ((u32)f2h((float)f2i_rn(v[2 * i + 1] * id) * d) << 16);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) h[i] = (u32)f2h(v[2 * i]) | ((u32)f2h(v[2 * i + 1]) << 16);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) tile[tl * RW + 4 * lane + i] = h[i];
    }
    __syncthreads();
    const int pieces = colsp / 8;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int item = k * 256 + threadIdx.x, pl = item >> 5, tl = item & 31;
        const int t = t0 + tl, c = c0 / 8 + pl;
        if (t >= n || c >= pieces) continue;
        // piece pl of the block's two stages: stage pl / 16, step (pl % 16) / 2, half pl % 2
        const int base = (pl >> 4) * 64 + 2 * ((pl & 15) >> 1) + (pl & 1);
        const u32* row = tile + tl * RW;
        *(uint4*)(xp + ((long long)c * np + t) * 8) = make_uint4(row[base], row[base + 16], row[base + 32], row[base + 48]);
    }
}

// Constrained decoding's masks: mask m's row (rows[m]) keeps column c only where bit c of its
// `words` words is set (bits past them refuse). grid (ceil(cols / 256), masks), block 256.
extern "C" __global__ void mask_rows(float* __restrict__ x, const u32* __restrict__ bits, const u32* __restrict__ rows,
                                     int words, int cols) { pdl_begin();
    const int m = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const u32 w = c / 32 < words ? bits[(long long)m * words + c / 32] : 0u;
    if (!((w >> (c & 31)) & 1u)) x[(long long)rows[m] * cols + c] = -__int_as_float(0x7f800000);
}

// Index of the largest value of each row (the first on ties; NaN never wins, a row of NaN
// gives 0). grid (rows, P), block 256: block p scans its chunk of the row (chunk a multiple
// of 4 columns), writes its best (value, index) into part[row·P + p] (values, then indices at
// part + rows·P), and the row's last block to finish (count[row], left at 0 again) takes the
// best of the P.
__device__ __forceinline__ void amax_pick(float& best, int& bi, float ov, int oi) {
    if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
}
__device__ __forceinline__ void amax_block(float& best, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax_pick(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
    const int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    if (l == 0) { sv[w] = best; si[w] = bi; }
    __syncthreads();
    best = l < nw ? sv[l] : -__int_as_float(0x7f800000);
    bi = l < nw ? si[l] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax_pick(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
}
extern "C" __global__ void argmax_rows(const float* __restrict__ x, u32* __restrict__ out, int cols, int chunk,
                                       float* __restrict__ part, u32* __restrict__ count) { pdl_begin();
    const int P = gridDim.y, p = blockIdx.y;
    const long long row = blockIdx.x;
    const float* r = x + row * cols;
    const int c0 = p * chunk, c1 = min(cols, c0 + chunk);
    float best = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;
    if ((cols & 3) == 0) {
        // float4 loads, four in flight per thread; within a thread the indices rise, so `>`
        // keeps the first of equal values.
        const float4* r4 = (const float4*)r;
#pragma unroll 4
        for (int c = c0 / 4 + threadIdx.x; c < c1 / 4; c += blockDim.x) {
            float4 v = r4[c];
            if (v.x > best) { best = v.x; bi = 4 * c; }
            if (v.y > best) { best = v.y; bi = 4 * c + 1; }
            if (v.z > best) { best = v.z; bi = 4 * c + 2; }
            if (v.w > best) { best = v.w; bi = 4 * c + 3; }
        }
    } else {
        for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
            float v = r[c];
            if (v > best) { best = v; bi = c; }
        }
    }
    amax_block(best, bi);
    if (P == 1) {
        if (threadIdx.x == 0) out[row] = bi == 0x7fffffff ? 0 : bi;
        return;
    }
    const long long rows = gridDim.x;
    int* pidx = (int*)(part + rows * P);
    __shared__ bool last;
    if (threadIdx.x == 0) {
        part[row * P + p] = best;
        pidx[row * P + p] = bi;
        __threadfence();
        last = atomicAdd(&count[row], 1u) == (u32)P - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    best = -__int_as_float(0x7f800000);
    bi = 0x7fffffff;
    for (int q = threadIdx.x; q < P; q += blockDim.x) {
        amax_pick(best, bi, ((volatile float*)part)[row * P + q], ((volatile int*)pidx)[row * P + q]);
    }
    amax_block(best, bi);
    if (threadIdx.x == 0) {
        out[row] = bi == 0x7fffffff ? 0 : bi;
        count[row] = 0;
    }
}

// ---- activation quantization (as the CPU backend and ggml do it: quants round(x · 127/max),
// ties to even), for the integer matrix-vector kernels ----
__device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Blocks of 32: q int8, ds[2b] = d in f16 precision, ds[2b + 1] = the offset sum: d16 · Σq
// (ggml's q8_0), or for Q4_1/Q5_1 weights (q8_1 != 0) d · Σq rounded to f16 (ggml's q8_1).
// One warp per block; block (32, 8).
extern "C" __global__ void quantize_a32(const float* __restrict__ x, i8* __restrict__ q, float* __restrict__ ds, long long nblocks, int q8_1) { pdl_begin();
    long long b = blockIdx.x * 8LL + threadIdx.y;
    if (b >= nblocks) return;
    float v = x[b * 32 + threadIdx.x];
    float amax = warp_max(fabsf(v));
    float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int qi = f2i_rn(v * id);
    q[b * 32 + threadIdx.x] = (i8)qi;
    int s = warp_sum_i(qi);
    if (threadIdx.x == 0) {
        float d16 = h2f(f2h(d));
        ds[2 * b] = d16;
        ds[2 * b + 1] = q8_1 ? h2f(f2h(d * (float)s)) : d16 * (float)s;
    }
}

// Blocks of 256 (ggml's Q8_K: d = 1 / (127/max)): q int8, d per block, sums of each 16 quants,
// and after those sums (at bsums + 16·nblocks) each 32's sum split for imm.cu's Q4_K mins term
// as 256·h + l (h, l int8): per block h_0..h_7, l_0..l_7. One warp per block.
// q: row-major ([token][cols]), or with tn > 0 (the token count; nsb blocks a token) tiled for
// imm on wgmma (imm.cu immw): piece c (16 values) of token t at (c · tn + t) · 16 bytes, so that
// a stage's pieces of 64 tokens are whole runs of 1 KiB.
extern "C" __global__ void quantize_a256(const float* __restrict__ x, i8* __restrict__ q, float* __restrict__ d256, int* __restrict__ bsums, long long nblocks, int nsb, int tn) { pdl_begin();
    long long b = blockIdx.x * 8LL + threadIdx.y;
    if (b >= nblocks) return;
    int lane = threadIdx.x;
    const float4* xp = (const float4*)(x + b * 256 + lane * 8);
    float4 u = xp[0], w = xp[1];
    float v[8] = {u.x, u.y, u.z, u.w, w.x, w.y, w.z, w.w};
    q256_block(v, b, nsb, nblocks, tn, lane, q, d256, bsums);
}

// f16 activations for the tensor-core products, on the same int8 grid as the quantizers above
// (and the CPU backend): each element f16(q · d) with d as the decode kernels see it. One warp
// per block of 256 (Q8_K's d), block (32, 8); for blocks of 32 (d in f16) eight lanes per
// block, four values each, block 256.
extern "C" __global__ void f32_to_f16_q32(const float* __restrict__ x, u16* __restrict__ out, long long nblocks) { pdl_begin();
    long long i = blockIdx.x * 256LL + threadIdx.x;   // this lane's four values start at 4i
    if (i / 8 >= nblocks) return;                     // whole groups of 8 lanes leave together
    float4 v = ((const float4*)x)[i];
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float id = amax > 0.f ? 127.f / amax : 0.f, d = h2f(f2h(amax / 127.f));
    u32 lo = (u32)f2h((float)f2i_rn(v.x * id) * d) | ((u32)f2h((float)f2i_rn(v.y * id) * d) << 16);
    u32 hi = (u32)f2h((float)f2i_rn(v.z * id) * d) | ((u32)f2h((float)f2i_rn(v.w * id) * d) << 16);
    ((uint2*)out)[i] = make_uint2(lo, hi);
}
extern "C" __global__ void f32_to_f16_q256(const float* __restrict__ x, u16* __restrict__ out, long long nblocks) { pdl_begin();
    long long b = blockIdx.x * 8LL + threadIdx.y;
    if (b >= nblocks) return;
    const float4* xp = (const float4*)(x + b * 256 + threadIdx.x * 8);
    float4 u = xp[0], w = xp[1];
    float v[8] = {u.x, u.y, u.z, u.w, w.x, w.y, w.z, w.w};
    float id = inv_scale256(v), d = id > 0.f ? 1.f / id : 0.f;
    u32 packed[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        packed[i] = (u32)f2h((float)f2i_rn(v[2 * i] * id) * d) | ((u32)f2h((float)f2i_rn(v[2 * i + 1] * id) * d) << 16);
    *(uint4*)(out + b * 256 + threadIdx.x * 8) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// The k largest values of each row as (index, value), best first, ties to the smaller index,
// NaN never: k rounds, each the best element strictly after the previous pick in that order.
// grid (rows), block 1024. Rows with fewer than k usable values end in (0, -inf).
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }
extern "C" __global__ void topk_rows(const float* __restrict__ x, u32* __restrict__ ids, float* __restrict__ vals, int cols, int k) { pdl_begin();
    const float* r = x + (long long)blockIdx.x * cols;
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float pick_v;
    __shared__ int pick_i;
    const float inf = __int_as_float(0x7f800000);
    float pv = inf;
    int pi = -1;
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    for (int round = 0; round < k; round++) {
        float best = -inf;
        int bi = 0x7fffffff;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = r[c];
            bool after = v < pv || (v == pv && c > pi);
            if (after && better(v, c, best, bi)) {
                best = v;
                bi = c;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (better(ov, oi, best, bi)) {
                best = ov;
                bi = oi;
            }
        }
        if (l == 0) {
            sv[w] = best;
            si[w] = bi;
        }
        __syncthreads();
        if (w == 0) {
            best = l < nw ? sv[l] : -inf;
            bi = l < nw ? si[l] : 0x7fffffff;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, best, o);
                int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (better(ov, oi, best, bi)) {
                    best = ov;
                    bi = oi;
                }
            }
            if (l == 0) {
                bool none = bi == 0x7fffffff;
                ids[(long long)blockIdx.x * k + round] = none ? 0 : bi;
                vals[(long long)blockIdx.x * k + round] = none ? -inf : best;
                pick_v = none ? -inf : best;
                pick_i = none ? 0x7fffffff : bi;
            }
        }
        __syncthreads();
        pv = pick_v;
        pi = pick_i;
    }
}

// Mixture-of-experts routing, one warp per token: the experts' probabilities (gating 0
// softmax over all n_expert logits, 1 each logit's sigmoid), the k largest (ties to the smaller
// index), divided by their sum (at least 2^-14) when norm, times scale when scale is neither 0
// nor 1. Always k distinct experts (the reference's moe_route): a NaN probability (a NaN or
// infinite logit) ranks below every number, is left out of the softmax's sum and weighs 0.
// routes[(t·k + j)·2] = expert (as a float), routes[(t·k + j)·2 + 1] = its weight.
// n_expert ≤ 1024, k ≤ 32.                                             grid (n_tokens), block 32
// Whether (v, i) ranks before (bv, bi) in moe_route: numbers by value, larger first, then NaN;
// ties to the smaller index; bi < 0 is no candidate.
__device__ __forceinline__ bool route_before(float v, int i, float bv, int bi) {
    if (bi < 0) return true;
    const bool a = !isnan(v), b = !isnan(bv);
    if (a != b) return a;
    return (a && v > bv) || ((!a || v == bv) && i < bi);
}
extern "C" __global__ void moe_route(const float* __restrict__ logits, float* __restrict__ routes,
                                     int n_expert, int k, int gating, int norm, float scale) { pdl_begin();
    const float* l = logits + (long long)blockIdx.x * n_expert;
    const int lane = threadIdx.x;
    float m = __int_as_float(0xff800000);
    for (int i = lane; i < n_expert; i += 32) m = fmaxf(m, l[i]);
    m = warp_max(m);
    float s = 0.f;
    if (gating == 0) {
        for (int i = lane; i < n_expert; i += 32) {
            const float e = expf(l[i] - m);
            if (!isnan(e)) s += e;
        }
        s = warp_sum(s);
    }
    auto prob = [&](int i) { return gating == 0 ? expf(l[i] - m) / s : 1.f / (1.f + expf(-l[i])); };
    u32 taken = 0;  // bit c: expert lane + 32c is chosen
    float my_w = 0.f;
    int my_e = 0;
    for (int j = 0; j < k && j < n_expert; j++) {
        float bv = 0.f;
        int bi = -1;
        for (int c = 0, i = lane; i < n_expert; c++, i += 32) {
            const float p = prob(i);
            if (!(taken >> c & 1u) && route_before(p, i, bv, bi)) { bv = p; bi = i; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && route_before(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (bi % 32 == lane) taken |= 1u << (bi / 32);
        if (lane == j) { my_w = isnan(bv) ? 0.f : bv; my_e = bi; }
    }
    const int kk = min(k, n_expert);
    float sum = warp_sum(lane < kk ? my_w : 0.f);
    if (lane < kk) {
        float w = my_w;
        if (norm) w /= fmaxf(sum, 6.103515625e-5f);
        if (scale != 0.f && scale != 1.f) w *= scale;
        float* r = routes + ((long long)blockIdx.x * k + lane) * 2;
        r[0] = (float)my_e;
        r[1] = w;
    }
}

// Sorts a step's (token, slot) pairs by expert: off[e] = the first sorted row of expert e
// (n_expert + 1 entries), pos[p] = pair p's sorted row. Within an expert the order is whatever
// the atomics give: each pair's sums do not depend on it. With bn > 0 also the grouped
// products' tile list: tiles[0] = their count, then for each expert in turn its ceil(count / bn)
// chunks of bn sorted pairs as e << 16 | chunk (qmm.cu `qmm_g_T`, imm.cu `imv_g`, wmm.cu
// `wmm_g`). Counts and chunks are summed by one scan of the block.
//                                                   grid 1, block 1024; n_expert ≤ 1024
extern "C" __global__ void moe_group(const float* __restrict__ routes, int* __restrict__ off,
                                     int* __restrict__ pos, int* __restrict__ tiles, int n_pairs,
                                     int n_expert, int bn) { pdl_begin();
    __shared__ int cnt[1024];
    __shared__ int fill[1024];
    __shared__ int2 scan[2][1024];  // (pairs, tiles) before expert e, ping-pong
    const int e = threadIdx.x;
    if (e < n_expert) { cnt[e] = 0; fill[e] = 0; }
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) atomicAdd(&cnt[(int)routes[2 * p]], 1);
    __syncthreads();
    const int c = e < n_expert ? cnt[e] : 0, ch = bn > 0 ? (c + bn - 1) / bn : 0;
    // Inclusive scan (Hillis-Steele) of (count, chunks) over the experts.
    int b = 0;
    scan[0][e] = make_int2(c, ch);
    __syncthreads();
    for (int d = 1; d < 1024; d <<= 1) {
        int2 v = scan[b][e];
        if (e >= d) { const int2 u = scan[b][e - d]; v.x += u.x; v.y += u.y; }
        scan[b ^ 1][e] = v;
        b ^= 1;
        __syncthreads();
    }
    const int2 incl = scan[b][e];
    const int first = incl.x - c, tile0 = incl.y - ch;
    if (e < n_expert) {
        cnt[e] = first;
        off[e] = first;
        for (int j = 0; j < ch; j++) tiles[1 + tile0 + j] = (e << 16) | j;
    }
    if (e == n_expert - 1) {
        off[n_expert] = incl.x;
        if (bn > 0) tiles[0] = incl.y;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        int ex = (int)routes[2 * p];
        pos[p] = cnt[ex] + atomicAdd(&fill[ex], 1);
    }
}

// xh[pos[p], :] = f16(x[p / k, :]): moe_gather's rows as the grouped product reads them.
//                                                                      grid (n_pairs), block 256
extern "C" __global__ void moe_gather_h(const float* __restrict__ x, const int* __restrict__ pos,
                                        u16* __restrict__ xh, int k, int cols) { pdl_begin();
    const float* src = x + (long long)(blockIdx.x / k) * cols;
    u16* dst = xh + (long long)pos[blockIdx.x] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = f2h(src[c]);
}

// xs[pos[p], :] = x[p / k, :] (each pair's input at its sorted row).      grid (n_pairs), block 256
extern "C" __global__ void moe_gather(const float* __restrict__ x, const int* __restrict__ pos,
                                      float* __restrict__ xs, int k, int cols) { pdl_begin();
    const float* src = x + (long long)(blockIdx.x / k) * cols;
    float* dst = xs + (long long)pos[blockIdx.x] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}

// out[t, c] = Σ_j weight(t, j) · ys[row(t·k + j), c], summed in slot order; row(p) = pos[p], or p
// where pos is null (the pair-wise kernels). grid (n_tokens, column blocks), block 256: a decode
// step's one token spread over the multiprocessors (one block took ~10 µs for 8 × 2048 floats).
extern "C" __global__ void moe_sum(const float* __restrict__ ys, const float* __restrict__ routes,
                                   const int* __restrict__ pos, const float* __restrict__ scale,
                                   float* __restrict__ out, int k, int cols) { pdl_begin();
    const long long t = blockIdx.x;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < cols; c += gridDim.y * blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < k; j++) {
            long long p = t * k + j;
            long long row = pos ? pos[p] : p;
            // Each expert's output times its scale (Gemma 4; null: none), then its weight.
            float y = ys[row * cols + c];
            if (scale) y *= scale[(int)routes[p * 2]];
            float v = y * routes[p * 2 + 1];
            acc = j == 0 ? v : acc + v;
        }
        out[t * cols + c] = acc;
    }
}
