// Weights in their GGUF types: dequantization of 32-value groups, the weight types' tags (the
// kernels' template parameter) and the embedding gather. Every module of products starts with
// this file (the matrix-vector kernels follow in mmv.cu).
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
__device__ __forceinline__ void k4_scale_min_i(const u8* q, int j, int& sc, int& mn) {
    if (j < 4) {
        sc = q[j] & 63;
        mn = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
__device__ __forceinline__ void k4_scale_min(const u8* q, int j, float& sc, float& mn) {
    int s, m;
    k4_scale_min_i(q, j, s, m);
    sc = (float)s;
    mn = (float)m;
}
// A Q4_K super-block's term over int8 activations in the one order the int8 kernels share
// (imm.cu imm<Q4_K> / imv<Q4_K, NT>, mmvq.cu rowq_c<Q4_K>): da·(d·S1 − dmin·S2), rounded as written.
__device__ __forceinline__ float q4k_term_f(float da, float d, float dmin, float s1, float s2) {
    return __fmul_rn(da, __fsub_rn(__fmul_rn(d, s1), __fmul_rn(dmin, s2)));
}
__device__ __forceinline__ float q4k_term(float da, float d, float dmin, int s1, int s2) {
    return q4k_term_f(da, d, dmin, __int2float_rn(s1), __int2float_rn(s2));
}
// v as a float, exactly, for |v| < 2^22, on the integer and float pipes (1.5·2^23's mantissa
// takes v) rather than the conversion unit.
__device__ __forceinline__ float i2f_small(int v) { return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.f); }
// Q6_K in the exact-sum order: a super-block's S = Σ_i sc_i · Σ (q − 32)·a over its 16
// sub-blocks of 16 values (exact in int32: |S| < 2^28), its term da·(d·S), each product
// rounded as written (mmvq.cu rowq_c<Q6_K>, imm.cu imm<Q6_K> / imv<Q6_K, NT>).
__device__ __forceinline__ float q6k_term(float da, float d, int s) {
    return __fmul_rn(da, __fmul_rn(d, __int2float_rn(s)));
}
// Values v … v + 3 (v a multiple of 4) of the Q6_K super-block at b (2-byte aligned) as int8
// q − 32: half h = v / 128; l = v % 128 takes ql[64h + l % 64] (low nibble below 64, high
// above) and the 2 bits of qh[32h + l % 32] at 2·(l / 32).
__device__ __forceinline__ u32 q6k_frag4(const u8* b, int v) {
    const int h = v >> 7, l = v & 127;
    const u32 lo = ld_u32_2a(b + h * 64 + (l & 63)), hi = ld_u32_2a(b + 128 + h * 32 + (l & 31));
    const u32 q = ((lo >> (4 * (l >> 6))) & 0x0F0F0F0Fu) | (((hi >> (2 * (l >> 5))) & 0x03030303u) << 4);
    return __vsub4(q, 0x20202020u);
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

// ---- non-linear 4-bit blocks: a nibble picks one of IQ4_NL's 16 int8 levels ----
// The levels (−127, −104, …, 113) as bytes of four words, picked with byte_perm.
__device__ __forceinline__ float iq4_level(u32 q) {
    const u32 b = q < 8 ? __byte_perm(0xBFAD9881u, 0xF6EADDCFu, q) : __byte_perm(0x26190D01u, 0x71594535u, q & 7);
    return (float)(i8)(b & 255);
}
// 32 values from 16 bytes: values j and j + 16 are the low and high nibbles of byte j.
__device__ __forceinline__ void deq_iq4_32(const u8* qs, float d, float* v) {
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
        u32 q = ld_u16(qs + j);
        v[j] = d * iq4_level(q & 15);
        v[j + 16] = d * iq4_level((q >> 4) & 15);
        v[j + 1] = d * iq4_level((q >> 8) & 15);
        v[j + 17] = d * iq4_level((q >> 12) & 15);
    }
}
__device__ __forceinline__ void deq_iq4_nl(const u8* row, int g, float* v) {
    const u8* b = row + g * 18;
    deq_iq4_32(b + 2, h2f(ld_u16(b)), v);
}
// IQ4_XS: 256 values, d, a 6-bit scale per 32 (low 4 bits in scales_l, high 2 in scales_h).
__device__ __forceinline__ void deq_iq4_xs(const u8* row, int g, float* v) {
    const u8* b = row + (g >> 3) * 136;
    const int ib = g & 7;
    const u32 ls = ((b[4 + ib / 2] >> (4 * (ib & 1))) & 15) | (((ld_u16(b + 2) >> (2 * ib)) & 3) << 4);
    deq_iq4_32(b + 8 + 16 * ib, h2f(ld_u16(b)) * (float)((int)ls - 32), v);
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

// ---- weight types: the kernels' template parameter ----
// A tag struct per GGUF type: its block's bytes and values (the float types as blocks of 32),
// MIN 1 for the 32-blocks with a min (a value is d·q + m: Q4_1, Q5_1), and deq, the 32 values of
// group g (enums, not static members: those would each be a global of the module). The registry names a type's kernels by its tag (registry.rs
// `kernels`: quant_q4_k's mmv1_q4_k is mmv<Q4_K, 1, false>).
#define WEIGHT_TYPE(W, T, BB, BV, MN)                                                                 \
    struct W {                                                                                        \
        enum : int { BYTES = BB, VALUES = BV, MIN = MN };                                             \
        __device__ __forceinline__ static void deq(const u8* row, int g, float* v) { deq_##T(row, g, v); } \
    };
WEIGHT_TYPE(Q4_0, q4_0, 18, 32, 0)
WEIGHT_TYPE(Q4_1, q4_1, 20, 32, 1)
WEIGHT_TYPE(Q5_0, q5_0, 22, 32, 0)
WEIGHT_TYPE(Q5_1, q5_1, 24, 32, 1)
WEIGHT_TYPE(Q8_0, q8_0, 34, 32, 0)
WEIGHT_TYPE(Q2_K, q2_k, 84, 256, 0)
WEIGHT_TYPE(Q3_K, q3_k, 110, 256, 0)
WEIGHT_TYPE(Q4_K, q4_k, 144, 256, 0)
WEIGHT_TYPE(Q5_K, q5_k, 176, 256, 0)
WEIGHT_TYPE(Q6_K, q6_k, 210, 256, 0)
WEIGHT_TYPE(IQ4_NL, iq4_nl, 18, 32, 0)
WEIGHT_TYPE(IQ4_XS, iq4_xs, 136, 256, 0)
WEIGHT_TYPE(F32, f32, 128, 32, 0)
WEIGHT_TYPE(F16, f16, 64, 32, 0)
WEIGHT_TYPE(BF16, bf16, 64, 32, 0)

// An embedding gather: out[t, :] = deq(row tokens[t]) · scale (also the parity mode's x_embed_T,
// compiled there without fused multiply-adds). The table holds the vocabulary's rows first …
// first + rows − 1 (a tensor-parallel rank's part; first 0 and every row for a whole table): a
// token outside them gets −0.0, which the ranks' sum adds exactly.   grid (n_tokens), block 128
template <class T>
__global__ void embed(const u8* __restrict__ W, const u32* __restrict__ tokens, float* __restrict__ out, int cols,
                      long long row_bytes, float scale, long long first, long long rows) {
    pdl_begin();
    const long long id = (long long)tokens[blockIdx.x] - first;
    float* o = out + (long long)blockIdx.x * cols;
    if (id < 0 || id >= rows) {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = -0.f;
        return;
    }
    const u8* row = W + id * row_bytes;
    for (int g = threadIdx.x; g < cols / 32; g += blockDim.x) {
        float v[32];
        T::deq(row, g, v);
        float4* o4 = (float4*)(o + g * 32);
#pragma unroll
        for (int i = 0; i < 8; i++)
            o4[i] = make_float4(v[4 * i] * scale, v[4 * i + 1] * scale, v[4 * i + 2] * scale, v[4 * i + 3] * scale);
    }
}
