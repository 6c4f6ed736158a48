// Weights in their GGUF types: dequantization of 32-value groups, embedding gather, bf16
// copies for the tensor-core path, and the decode matrix-vector product.
//
// Every type provides `deq_<T>(row, g, v)`: the 32 values of group g (0 ≤ g < cols/32) of a
// row that starts at `row`, in the order ggml's dequantize_row_<T> writes them.

__device__ __forceinline__ u32 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld_u32_2a(const u8* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

// ---- 32-value blocks ----
__device__ __forceinline__ void deq_q4_0(const u8* row, int g, float* v) {
    const u8* b = row + g * 18;
    float d = h2f(ld_u16(b));
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
        u32 q = ld_u16(b + 2 + j);
        v[j] = ((int)(q & 15) - 8) * d;
        v[j + 16] = ((int)((q >> 4) & 15) - 8) * d;
        v[j + 1] = ((int)((q >> 8) & 15) - 8) * d;
        v[j + 17] = ((int)((q >> 12) & 15) - 8) * d;
    }
}
__device__ __forceinline__ void deq_q4_1(const u8* row, int g, float* v) {
    const u8* b = row + g * 20;
    float d = h2f(ld_u16(b)), m = h2f(ld_u16(b + 2));
    const u32* qs = (const u32*)(b + 4);
#pragma unroll
    for (int w = 0; w < 4; w++) {
        u32 q = qs[w];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 byte = (q >> (8 * k)) & 255;
            v[4 * w + k] = (byte & 15) * d + m;
            v[4 * w + k + 16] = (byte >> 4) * d + m;
        }
    }
}
__device__ __forceinline__ void deq_q5_0(const u8* row, int g, float* v) {
    const u8* b = row + g * 22;
    float d = h2f(ld_u16(b));
    u32 qh = ld_u32_2a(b + 2);
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
        u32 q = ld_u16(b + 6 + j);
#pragma unroll
        for (int k = 0; k < 2; k++) {
            u32 byte = (q >> (8 * k)) & 255;
            int jj = j + k;
            u32 h0 = ((qh >> jj) << 4) & 0x10, h1 = (qh >> (jj + 12)) & 0x10;
            v[jj] = ((int)((byte & 15) | h0) - 16) * d;
            v[jj + 16] = ((int)((byte >> 4) | h1) - 16) * d;
        }
    }
}
__device__ __forceinline__ void deq_q5_1(const u8* row, int g, float* v) {
    const u8* b = row + g * 24;
    float d = h2f(ld_u16(b)), m = h2f(ld_u16(b + 2));
    u32 qh = *(const u32*)(b + 4);
    const u32* qs = (const u32*)(b + 8);
#pragma unroll
    for (int w = 0; w < 4; w++) {
        u32 q = qs[w];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 byte = (q >> (8 * k)) & 255;
            int jj = 4 * w + k;
            u32 h0 = ((qh >> jj) << 4) & 0x10, h1 = (qh >> (jj + 12)) & 0x10;
            v[jj] = ((byte & 15) | h0) * d + m;
            v[jj + 16] = ((byte >> 4) | h1) * d + m;
        }
    }
}
__device__ __forceinline__ void deq_q8_0(const u8* row, int g, float* v) {
    const u8* b = row + g * 34;
    float d = h2f(ld_u16(b));
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
        u32 q = ld_u16(b + 2 + j);
        v[j] = (float)(i8)(q & 255) * d;
        v[j + 1] = (float)(i8)(q >> 8) * d;
    }
}

// ---- 256-value super-blocks ----
__device__ __forceinline__ void deq_q2_k(const u8* row, int g, float* v) {
    const u8* b = row + (g >> 3) * 84;
    int s = g & 7, h = s >> 2, j = s & 3;
    float d = h2f(ld_u16(b + 80)), dmin = h2f(ld_u16(b + 82));
    u32 sc0 = b[h * 8 + 2 * j], sc1 = b[h * 8 + 2 * j + 1];
    const u8* q = b + 16 + h * 32;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        u32 sc = l < 16 ? sc0 : sc1;
        v[l] = d * (sc & 15) * ((q[l] >> (2 * j)) & 3) - dmin * (sc >> 4);
    }
}
__device__ __forceinline__ int q3k_scale(const u8* sc, int i) {
    int lo = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
    int hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}
__device__ __forceinline__ void deq_q3_k(const u8* row, int g, float* v) {
    const u8* b = row + (g >> 3) * 110;
    int s = g & 7, h = s >> 2, j = s & 3;
    float d = h2f(ld_u16(b + 108));
    const u8* hm = b;
    const u8* q = b + 32 + h * 32;
    const u8* sc = b + 96;
    float d0 = d * q3k_scale(sc, h * 8 + 2 * j), d1 = d * q3k_scale(sc, h * 8 + 2 * j + 1);
    u32 m = 1u << (h * 4 + j);
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int qv = (int)((q[l] >> (2 * j)) & 3) - ((hm[l] & m) ? 0 : 4);
        v[l] = (l < 16 ? d0 : d1) * qv;
    }
}
__device__ __forceinline__ void k4_scale_min(const u8* q, int j, float& sc, float& mn) {
    if (j < 4) {
        sc = q[j] & 63;
        mn = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
__device__ __forceinline__ void deq_q4_k(const u8* row, int g, float* v) {
    const u8* b = row + (g >> 3) * 144;
    int s = g & 7;
    float d = h2f(ld_u16(b)), dmin = h2f(ld_u16(b + 2)), sc, mn;
    k4_scale_min(b + 4, s, sc, mn);
    float dl = d * sc, ml = dmin * mn;
    const uint4* q4 = (const uint4*)(b + 16 + (s >> 1) * 32);
    int shift = (s & 1) * 4;
#pragma unroll
    for (int w = 0; w < 2; w++) {
        uint4 qq = q4[w];
        u32 ws[4] = {qq.x, qq.y, qq.z, qq.w};
#pragma unroll
        for (int k = 0; k < 16; k++) v[w * 16 + k] = dl * ((ws[k >> 2] >> (8 * (k & 3) + shift)) & 15) - ml;
    }
}
__device__ __forceinline__ void deq_q5_k(const u8* row, int g, float* v) {
    const u8* b = row + (g >> 3) * 176;
    int s = g & 7;
    float d = h2f(ld_u16(b)), dmin = h2f(ld_u16(b + 2)), sc, mn;
    k4_scale_min(b + 4, s, sc, mn);
    float dl = d * sc, ml = dmin * mn;
    const uint4* qh4 = (const uint4*)(b + 16);
    const uint4* q4 = (const uint4*)(b + 48 + (s >> 1) * 32);
    int shift = (s & 1) * 4;
#pragma unroll
    for (int w = 0; w < 2; w++) {
        uint4 qq = q4[w], hh = qh4[w];
        u32 ws[4] = {qq.x, qq.y, qq.z, qq.w};
        u32 hs[4] = {hh.x, hh.y, hh.z, hh.w};
#pragma unroll
        for (int k = 0; k < 16; k++) {
            u32 lo = (ws[k >> 2] >> (8 * (k & 3) + shift)) & 15;
            u32 hi = ((hs[k >> 2] >> (8 * (k & 3) + s)) & 1) << 4;
            v[w * 16 + k] = dl * (lo | hi) - ml;
        }
    }
}
__device__ __forceinline__ void deq_q6_k(const u8* row, int g, float* v) {
    const u8* b = row + (g >> 3) * 210;
    int s = g & 7, h = s >> 2, k = s & 3;
    float d = h2f(ld_u16(b + 208));
    const u8* ql = b + h * 64 + (k & 1) * 32;
    const u8* qh = b + 128 + h * 32;
    const i8* sc = (const i8*)(b + 192 + h * 8 + 2 * k);
    float d0 = d * sc[0], d1 = d * sc[1];
    int shift = (k >> 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; l += 2) {
        u32 lq = ld_u16(ql + l), hq = ld_u16(qh + l);
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int q = (int)(((lq >> (8 * e + shift)) & 15) | (((hq >> (8 * e + 2 * k)) & 3) << 4)) - 32;
            v[l + e] = (l + e < 16 ? d0 : d1) * q;
        }
    }
}

// ---- float types ----
__device__ __forceinline__ void deq_f32(const u8* row, int g, float* v) {
    const float4* p = (const float4*)(row + g * 128);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 f = p[i];
        v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
}
__device__ __forceinline__ void deq_f16(const u8* row, int g, float* v) {
    const uint4* p = (const uint4*)(row + g * 64);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 u = p[i];
        u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; k++) { v[8 * i + 2 * k] = h2f(w[k] & 0xffff); v[8 * i + 2 * k + 1] = h2f(w[k] >> 16); }
    }
}
__device__ __forceinline__ void deq_bf16(const u8* row, int g, float* v) {
    const uint4* p = (const uint4*)(row + g * 64);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 u = p[i];
        u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; k++) { v[8 * i + 2 * k] = bf2f(w[k] & 0xffff); v[8 * i + 2 * k + 1] = bf2f(w[k] >> 16); }
    }
}

// ---- kernels, one set per type (the registry instantiates one type per module) ----
// embed: out[t, :] = row tokens[t] of the table · scale.       grid (n_tokens), block 128
// dequant_bf16: the whole matrix to bf16.                      grid (rows), block 128
// mmv: y[t, r] = W[r, :] · x[t, :] for t < ntok ≤ 8.            grid (rows / 4), block (32, 4)
#define MMV_WARPS 4
#define QUANT_KERNELS(T)                                                                              \
    extern "C" __global__ void embed_##T(const u8* __restrict__ W, const u32* __restrict__ tokens,   \
                                         float* __restrict__ out, int cols, long long row_bytes,      \
                                         float scale) {                                               \
        const u8* row = W + (long long)tokens[blockIdx.x] * row_bytes;                               \
        float* o = out + (long long)blockIdx.x * cols;                                                \
        for (int g = threadIdx.x; g < cols / 32; g += blockDim.x) {                                   \
            float v[32];                                                                              \
            deq_##T(row, g, v);                                                                       \
            float4* o4 = (float4*)(o + g * 32);                                                       \
            _Pragma("unroll") for (int i = 0; i < 8; i++)                                             \
                o4[i] = make_float4(v[4 * i] * scale, v[4 * i + 1] * scale, v[4 * i + 2] * scale,    \
                                    v[4 * i + 3] * scale);                                            \
        }                                                                                             \
    }                                                                                                 \
    extern "C" __global__ void dequant_bf16_##T(const u8* __restrict__ W, u16* __restrict__ out,     \
                                                int cols, long long row_bytes) {                      \
        const u8* row = W + (long long)blockIdx.x * row_bytes;                                        \
        u16* o = out + (long long)blockIdx.x * cols;                                                  \
        for (int g = threadIdx.x; g < cols / 32; g += blockDim.x) {                                   \
            float v[32];                                                                              \
            deq_##T(row, g, v);                                                                       \
            u32* o2 = (u32*)(o + g * 32);                                                             \
            _Pragma("unroll") for (int i = 0; i < 16; i++)                                            \
                o2[i] = (u32)f2bf(v[2 * i]) | ((u32)f2bf(v[2 * i + 1]) << 16);                        \
        }                                                                                             \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS)                                      \
        mmv_##T(const u8* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,         \
                int rows, int cols, long long row_bytes, int ntok) {                                  \
        int r = blockIdx.x * MMV_WARPS + threadIdx.y;                                                 \
        if (r >= rows) return;                                                                        \
        const u8* row = W + (long long)r * row_bytes;                                                 \
        float acc[8];                                                                                 \
        _Pragma("unroll") for (int t = 0; t < 8; t++) acc[t] = 0.f;                                   \
        for (int g = threadIdx.x; g < cols / 32; g += 32) {                                           \
            float v[32];                                                                              \
            deq_##T(row, g, v);                                                                       \
            _Pragma("unroll") for (int t = 0; t < 8; t++) {                                           \
                if (t < ntok) {                                                                       \
                    const float4* xp = (const float4*)(x + (long long)t * cols + g * 32);             \
                    float s = 0.f;                                                                    \
                    _Pragma("unroll") for (int i = 0; i < 8; i++) {                                   \
                        float4 xx = xp[i];                                                            \
                        s += v[4 * i] * xx.x + v[4 * i + 1] * xx.y + v[4 * i + 2] * xx.z +            \
                             v[4 * i + 3] * xx.w;                                                     \
                    }                                                                                 \
                    acc[t] += s;                                                                      \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        _Pragma("unroll") for (int t = 0; t < 8; t++) {                                               \
            if (t < ntok) {                                                                           \
                float s = warp_sum(acc[t]);                                                           \
                if (threadIdx.x == 0) y[(long long)t * rows + r] = s;                                 \
            }                                                                                         \
        }                                                                                             \
    }


// Dense half-precision weights read 16 bytes per lane per step, consecutive across the warp.
#define DENSE_MMV(T, CVT)                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS)                                      \
        mmv_dense_##T(const u16* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,  \
                      int rows, int cols, int ntok) {                                                 \
        int r = blockIdx.x * MMV_WARPS + threadIdx.y;                                                 \
        if (r >= rows) return;                                                                        \
        const uint4* row = (const uint4*)(W + (long long)r * cols);                                   \
        float acc[8];                                                                                 \
        _Pragma("unroll") for (int t = 0; t < 8; t++) acc[t] = 0.f;                                   \
        for (int i = threadIdx.x; i < cols / 8; i += 32) {                                            \
            uint4 u = row[i];                                                                         \
            u32 w[4] = {u.x, u.y, u.z, u.w};                                                          \
            float v[8];                                                                               \
            _Pragma("unroll") for (int k = 0; k < 4; k++) {                                           \
                v[2 * k] = CVT(w[k] & 0xffff);                                                        \
                v[2 * k + 1] = CVT(w[k] >> 16);                                                       \
            }                                                                                         \
            _Pragma("unroll") for (int t = 0; t < 8; t++) {                                           \
                if (t < ntok) {                                                                       \
                    const float4* xp = (const float4*)(x + (long long)t * cols + i * 8);              \
                    float4 a = xp[0], b = xp[1];                                                      \
                    acc[t] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x +        \
                              v[5] * b.y + v[6] * b.z + v[7] * b.w;                                   \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        _Pragma("unroll") for (int t = 0; t < 8; t++) {                                               \
            if (t < ntok) {                                                                           \
                float s = warp_sum(acc[t]);                                                           \
                if (threadIdx.x == 0) y[(long long)t * rows + r] = s;                                 \
            }                                                                                         \
        }                                                                                             \
    }
