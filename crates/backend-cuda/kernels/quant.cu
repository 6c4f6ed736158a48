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
// (imm.cu imm_q4_k / imv_q4_k, mmvq.cu rowq_c_q4_k): da·(d·S1 − dmin·S2), rounded as written.
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
// rounded as written (mmvq.cu rowq_c_q6_k, imm.cu imm_q6_k / imv_q6_k).
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

// ---- row dot products: acc[t] += this lane's share of row · x[t], t < ntok ≤ 8 ----
// Generic: one 32-value group per lane per step.
#define ROW_DOT_GENERIC(T)                                                                           \
    __device__ __forceinline__ void row_dot_##T(const u8* __restrict__ row, const float* __restrict__ x, \
                                                int cols, int ntok, float* acc) {                    \
        for (int g = threadIdx.x; g < cols / 32; g += 32) {                                          \
            float v[32];                                                                             \
            deq_##T(row, g, v);                                                                      \
            _Pragma("unroll") for (int t = 0; t < 8; t++) {                                          \
                if (t < ntok) {                                                                      \
                    const float4* xp = (const float4*)(x + (long long)t * cols + g * 32);            \
                    float s = 0.f;                                                                   \
                    _Pragma("unroll") for (int i = 0; i < 8; i++) {                                  \
                        float4 xx = xp[i];                                                           \
                        s += v[4 * i] * xx.x + v[4 * i + 1] * xx.y + v[4 * i + 2] * xx.z + v[4 * i + 3] * xx.w; \
                    }                                                                                \
                    acc[t] += s;                                                                     \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

__device__ __forceinline__ u32 byte_of3(u32 a, u32 b, u32 c, int k) {
    u32 w = k < 4 ? a : (k < 8 ? b : c);
    return (w >> (8 * (k & 3))) & 255;
}

// Q4_K: a lane takes 16 bytes of quants (16 low-nibble values of group g, 16 high-nibble of
// g+1) and the super-block's 16-byte header (d, dmin, 12 scale bytes), both in one load each.
__device__ __forceinline__ void row_dot_q4_k(const u8* __restrict__ row, const float* __restrict__ x, int cols, int ntok, float* acc) {
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
__device__ __forceinline__ void row_dot_q6_k(const u8* __restrict__ row, const float* __restrict__ x, int cols, int ntok, float* acc) {
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
#define ROW_DOT_DENSE(T, CVT)                                                                        \
    __device__ __forceinline__ void row_dot_##T(const u8* __restrict__ rowb, const float* __restrict__ x, \
                                                int cols, int ntok, float* acc) {                    \
        const uint4* row = (const uint4*)rowb;                                                       \
        _Pragma("unroll 1") for (int i = threadIdx.x; i < cols / 8; i += 32) {                       \
            uint4 u = row[i];                                                                        \
            u32 w[4] = {u.x, u.y, u.z, u.w};                                                         \
            float v[8];                                                                              \
            _Pragma("unroll") for (int k = 0; k < 4; k++) {                                          \
                v[2 * k] = CVT(w[k] & 0xffff);                                                       \
                v[2 * k + 1] = CVT(w[k] >> 16);                                                      \
            }                                                                                        \
            _Pragma("unroll") for (int t = 0; t < 8; t++) {                                          \
                if (t < ntok) {                                                                      \
                    const float4* xp = (const float4*)(x + (long long)t * cols + i * 8);             \
                    float4 a = xp[0], b = xp[1];                                                     \
                    acc[t] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x + v[5] * b.y + \
                              v[6] * b.z + v[7] * b.w;                                               \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

// ---- kernels, one set per type (the registry instantiates one type per module) ----
// embed: out[t, :] = row tokens[t] of the table · scale.         grid (n_tokens), block 128
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
#define MMV_K(NAME, T, NTOK, PF) \
    extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS)                                      \
        NAME(MmvMat m0, MmvMat m1, MmvMat m2, const float* __restrict__ x, int cols, int ntok_arg) { MMV_BEGIN(PF) \
        const int ntok = NTOK; \
        int r = blockIdx.x * MMV_WARPS + threadIdx.y;                                                 \
        MmvMat m = m0;                                                                                \
        if (r >= m0.rows) {                                                                           \
            r -= m0.rows;                                                                             \
            m = m1;                                                                                   \
            if (r >= m1.rows) {                                                                       \
                r -= m1.rows;                                                                         \
                m = m2;                                                                               \
                if (r >= m2.rows) return;                                                             \
            }                                                                                         \
        }                                                                                             \
        float acc[8];                                                                                 \
        _Pragma("unroll") for (int t = 0; t < 8; t++) acc[t] = 0.f;                                   \
        row_dot_##T(m.w + (long long)r * m.row_bytes, x, cols, ntok, acc);                            \
        _Pragma("unroll") for (int t = 0; t < 8; t++) {                                               \
            if (t < ntok) {                                                                           \
                float s = warp_sum(acc[t]);                                                           \
                if (threadIdx.x == 0) m.y[(long long)t * m.rows + r] = s;                             \
            }                                                                                         \
        }                                                                                             \
    }
#define MMV_GLU_K(NAME, T, NTOK, PF) \
    extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS)                                      \
        NAME(const u8* __restrict__ wg, const u8* __restrict__ wu, long long row_bytes,        \
                    const float* __restrict__ x, float* __restrict__ out, int rows, int cols,         \
                    int ntok_arg, int act) { GLU_BEGIN(PF) const int ntok = NTOK;                                                              \
        int r = blockIdx.x * MMV_WARPS + threadIdx.y;                                                 \
        if (r >= rows) return;                                                                        \
        float ag[8], au[8];                                                                           \
        _Pragma("unroll") for (int t = 0; t < 8; t++) ag[t] = au[t] = 0.f;                            \
        row_dot_##T(wg + (long long)r * row_bytes, x, cols, ntok, ag);                                \
        row_dot_##T(wu + (long long)r * row_bytes, x, cols, ntok, au);                                \
        _Pragma("unroll") for (int t = 0; t < 8; t++) {                                               \
            if (t < ntok) {                                                                           \
                float g = warp_sum(ag[t]), u = warp_sum(au[t]);                                       \
                if (threadIdx.x == 0) out[(long long)t * rows + r] = act_fn(g, act) * u;              \
            }                                                                                         \
        }                                                                                             \
    }
// An embedding gather kernel: out[t, :] = deq(row tokens[t]) · scale (also the parity mode's,
// exact.cu, compiled there without fused multiply-adds).
#define EMBED_K(NAME, T)                                                                              \
    extern "C" __global__ void NAME(const u8* __restrict__ W, const u32* __restrict__ tokens,        \
                                    float* __restrict__ out, int cols, long long row_bytes,           \
                                    float scale) { pdl_begin();                                       \
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
    }
// Mixture-of-experts products, one warp per output row of one (token, slot) pair p =
// blockIdx.y, from the expert routes[2p] chose (the experts stacked: expert e's row r is row
// e·expert_rows + r). moe_glu: out[p, r] = act(Wg_e[r] · x[p / k]) · (Wu_e[r] · x[p / k]);
// moe_mmv: y[p, r] = W_e[r] · x[p].                            grid (rows / 4, pairs), block (32, 4)
#define MOE_K(T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS)                                      \
        moe_glu_##T(const u8* __restrict__ wg, const u8* __restrict__ wu, long long row_bytes,       \
                    long long expert_rows, const float* __restrict__ routes,                          \
                    const float* __restrict__ x, float* __restrict__ out, int rows, int cols, int k,  \
                    int act) { pdl_begin();                                                           \
        const int r = blockIdx.x * MMV_WARPS + threadIdx.y;                                           \
        if (r >= rows) return;                                                                        \
        const long long p = blockIdx.y;                                                               \
        const long long e = (long long)routes[2 * p];                                                 \
        const float* xt = x + (p / k) * cols;                                                         \
        float ag[8], au[8];                                                                           \
        _Pragma("unroll") for (int t = 0; t < 8; t++) ag[t] = au[t] = 0.f;                            \
        row_dot_##T(wg + (e * expert_rows + r) * row_bytes, xt, cols, 1, ag);                         \
        row_dot_##T(wu + (e * expert_rows + r) * row_bytes, xt, cols, 1, au);                         \
        float g = warp_sum(ag[0]), u = warp_sum(au[0]);                                               \
        if (threadIdx.x == 0) out[p * rows + r] = act_fn(g, act) * u;                                 \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS)                                      \
        moe_mmv_##T(const u8* __restrict__ w, long long row_bytes, long long expert_rows,            \
                    const float* __restrict__ routes, const float* __restrict__ x,                   \
                    float* __restrict__ y, int rows, int cols) { pdl_begin();                         \
        const int r = blockIdx.x * MMV_WARPS + threadIdx.y;                                           \
        if (r >= rows) return;                                                                        \
        const long long p = blockIdx.y;                                                               \
        const long long e = (long long)routes[2 * p];                                                 \
        float acc[8];                                                                                 \
        _Pragma("unroll") for (int t = 0; t < 8; t++) acc[t] = 0.f;                                   \
        row_dot_##T(w + (e * expert_rows + r) * row_bytes, x + p * cols, cols, 1, acc);               \
        float s = warp_sum(acc[0]);                                                                   \
        if (threadIdx.x == 0) y[p * rows + r] = s;                                                    \
    }                                                                                                 \
    MOE_GROUPED_K(T)
// The grouped forms, for steps of many tokens: the pairs sorted by expert (moe_group), expert
// e's inputs at rows off[e]..off[e+1] of xs; a block takes rows of one expert (blockIdx.y) and
// runs its tokens 8 at a time, so a weight row is read once per 8 tokens. Each token's sums are
// the pair-wise kernels' (row_dot's arithmetic per token does not depend on how many share a
// call): a token gets the same bits whichever form and whatever else is in the step.
//                                                               grid (rows / 4, n_expert), block (32, 4)
#define MOE_GROUPED_K(T)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS)                                      \
        moe_glu_g_##T(const u8* __restrict__ wg, const u8* __restrict__ wu, long long row_bytes,     \
                      long long expert_rows, const int* __restrict__ off,                            \
                      const float* __restrict__ xs, float* __restrict__ out, int rows, int cols,      \
                      int act) { pdl_begin();                                                         \
        const int r = blockIdx.x * MMV_WARPS + threadIdx.y;                                           \
        if (r >= rows) return;                                                                        \
        const long long e = blockIdx.y;                                                               \
        const int a = off[e], b = off[e + 1];                                                         \
        const u8* rg = wg + (e * expert_rows + r) * row_bytes;                                        \
        const u8* ru = wu + (e * expert_rows + r) * row_bytes;                                        \
        for (int c = a; c < b; c += 8) {                                                              \
            const int n = min(8, b - c);                                                              \
            float ag[8], au[8];                                                                       \
            _Pragma("unroll") for (int t = 0; t < 8; t++) ag[t] = au[t] = 0.f;                        \
            row_dot_##T(rg, xs + (long long)c * cols, cols, n, ag);                                   \
            row_dot_##T(ru, xs + (long long)c * cols, cols, n, au);                                   \
            _Pragma("unroll") for (int t = 0; t < 8; t++) {                                           \
                if (t < n) {                                                                          \
                    float g = warp_sum(ag[t]), u = warp_sum(au[t]);                                   \
                    if (threadIdx.x == 0) out[(long long)(c + t) * rows + r] = act_fn(g, act) * u;    \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS)                                      \
        moe_mmv_g_##T(const u8* __restrict__ w, long long row_bytes, long long expert_rows,          \
                      const int* __restrict__ off, const float* __restrict__ x,                      \
                      float* __restrict__ y, int rows, int cols) { pdl_begin();                       \
        const int r = blockIdx.x * MMV_WARPS + threadIdx.y;                                           \
        if (r >= rows) return;                                                                        \
        const long long e = blockIdx.y;                                                               \
        const int a = off[e], b = off[e + 1];                                                         \
        const u8* rw = w + (e * expert_rows + r) * row_bytes;                                         \
        for (int c = a; c < b; c += 8) {                                                              \
            const int n = min(8, b - c);                                                              \
            float acc[8];                                                                             \
            _Pragma("unroll") for (int t = 0; t < 8; t++) acc[t] = 0.f;                               \
            row_dot_##T(rw, x + (long long)c * cols, cols, n, acc);                                   \
            _Pragma("unroll") for (int t = 0; t < 8; t++) {                                           \
                if (t < n) {                                                                          \
                    float s = warp_sum(acc[t]);                                                       \
                    if (threadIdx.x == 0) y[(long long)(c + t) * rows + r] = s;                       \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }
#define QUANT_KERNELS(T)                                                                              \
    EMBED_K(embed_##T, T)                                                                             \
    MOE_K(T)                                                                                          \
    MMV_K(mmv_##T, T, ntok_arg, 0) MMV_K(mmv1_##T, T, 1, 0) MMV_GLU_K(mmv_glu_##T, T, ntok_arg, 0)            \
    MMV_GLU_K(mmv1_glu_##T, T, 1, 0) MMV_K(mmvp_##T, T, ntok_arg, 1) MMV_K(mmvp1_##T, T, 1, 1)              \
    MMV_GLU_K(mmvp_glu_##T, T, ntok_arg, 1) MMV_GLU_K(mmvp1_glu_##T, T, 1, 1)
