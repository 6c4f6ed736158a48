// Decode products over int8 activations (quantize_a32 / quantize_a256 in ops.cu) with dp4a:
// the row dot products of the types with integer kernels and the mmvq kernels over them.
// Compiled after quant.cu and mmv.cu in a type's module (it uses quant.cu's loads and mmv.cu's
// MmvMat, MMV_BEGIN).

// ---- integer row dot products over quantized activations (decode) ----
// aq: int8 activations [ntok, cols]; ad / abs_: per-32 (d, d·Σq) pairs for the 32-element
// types, per-256 d and per-16 sums for the K-quants (see quantize_a32 / quantize_a256 in ops.cu).
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
// A 32-block's integer dot product: w[0..7] against the activations' two int4 halves.
__device__ __forceinline__ int dp4a8(const int* w, int4 a0, int4 a1) {
    int s = dp4a(w[0], a0.x, 0);
    s = dp4a(w[1], a0.y, s);
    s = dp4a(w[2], a0.z, s);
    s = dp4a(w[3], a0.w, s);
    s = dp4a(w[4], a1.x, s);
    s = dp4a(w[5], a1.y, s);
    s = dp4a(w[6], a1.z, s);
    return dp4a(w[7], a1.w, s);
}
// Bits 0..3 of `bits` to bit 4 of bytes 0..3.
__device__ __forceinline__ u32 spread4(u32 bits) { return ((bits * 0x00204081u) & 0x01010101u) << 4; }

// 32-element types: per block, w[0..3] hold values 0..15 as bytes, w[4..7] values 16..31, and
// the block's value is wd·w + wm (so Σ value·a = wd·d_a·Σ w·q_a + wm·d_a·Σ q_a): load32<T> of
// block g of a row.
template <class T>
__device__ __forceinline__ void load32(const u8* __restrict__ row, int g, int* w, float& wd, float& wm);
template <>
__device__ __forceinline__ void load32<Q4_0>(const u8* __restrict__ row, int g, int* w, float& wd, float& wm) {
    const u8* b = row + g * 18;
    wd = h2f(ld_u16(b));
    wm = -8.f * wd;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = ld_u32_2a(b + 2 + 4 * i);
        w[i] = q & 0x0F0F0F0F;
        w[4 + i] = (q >> 4) & 0x0F0F0F0F;
    }
}
template <>
__device__ __forceinline__ void load32<Q4_1>(const u8* __restrict__ row, int g, int* w, float& wd, float& wm) {
    const u8* b = row + g * 20;
    wd = h2f(ld_u16(b));
    wm = h2f(ld_u16(b + 2));
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = ((const u32*)(b + 4))[i];
        w[i] = q & 0x0F0F0F0F;
        w[4 + i] = (q >> 4) & 0x0F0F0F0F;
    }
}
template <>
__device__ __forceinline__ void load32<Q5_0>(const u8* __restrict__ row, int g, int* w, float& wd, float& wm) {
    const u8* b = row + g * 22;
    wd = h2f(ld_u16(b));
    wm = -16.f * wd;
    u32 qh = ld_u32_2a(b + 2);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = ld_u32_2a(b + 6 + 4 * i);
        w[i] = (q & 0x0F0F0F0F) | spread4((qh >> (4 * i)) & 15);
        w[4 + i] = ((q >> 4) & 0x0F0F0F0F) | spread4((qh >> (16 + 4 * i)) & 15);
    }
}
template <>
__device__ __forceinline__ void load32<Q8_0>(const u8* __restrict__ row, int g, int* w, float& wd, float& wm) {
    const u8* b = row + g * 34;
    wd = h2f(ld_u16(b));
    wm = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = ld_u32_2a(b + 2 + 4 * i);
}

// IQ4: four nibbles (one per byte, 0..15) to their four int8 levels: byte_perm picks each
// byte's level from both halves of the table, the nibble's bit 3 chooses between them.
__device__ __forceinline__ u32 iq4_levels4(u32 x) {
    const u32 t = x & 0x07070707u;
    const u32 u = t | (t >> 4);
    const u32 sel = (u & 0xffu) | ((u >> 8) & 0xff00u);
    const u32 lo = __byte_perm(0xBFAD9881u, 0xF6EADDCFu, sel), hi = __byte_perm(0x26190D01u, 0x71594535u, sel);
    const u32 m = ((x >> 3) & 0x01010101u) * 0xffu;
    return (hi & m) | (lo & ~m);
}
template <>
__device__ __forceinline__ void load32<IQ4_NL>(const u8* __restrict__ row, int g, int* w, float& wd, float& wm) {
    const u8* b = row + g * 18;
    wd = h2f(ld_u16(b));
    wm = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = ld_u32_2a(b + 2 + 4 * i);
        w[i] = iq4_levels4(q & 0x0F0F0F0F);
        w[4 + i] = iq4_levels4((q >> 4) & 0x0F0F0F0F);
    }
}

// The float order's row dot products over the int8 activations: a lane per 32-block.
template <class T>
__device__ __forceinline__ void rowq(const u8* __restrict__ row, const i8* __restrict__ aq, const float* __restrict__ ad,
                                     const int* __restrict__ abs_, int cols, int ntok, float* acc) {
#pragma unroll 4
    for (int g = threadIdx.x; g < cols / 32; g += 32) {
        int w[8];
        float wd, wm;
        load32<T>(row, g, w, wd, wm);
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < ntok) {
                const int4* ap = (const int4*)(aq + (long long)t * cols + g * 32);
                int4 a0 = ap[0], a1 = ap[1];
                int s = dp4a8(w, a0, a1);
                float2 dsv = *(const float2*)(ad + ((long long)t * (cols / 32) + g) * 2);
                acc[t] += wd * dsv.x * (float)s + wm * dsv.y;
            }
        }
    }
}

// IQ4_XS over per-256 activations: a lane takes one 32-value sub-block (scale d·(ls − 32)).
template <>
__device__ __forceinline__ void rowq<IQ4_XS>(const u8* __restrict__ row, const i8* __restrict__ aq, const float* __restrict__ ad,
                                            const int* __restrict__ abs_, int cols, int ntok, float* acc) {
    int nsl = cols / 32;
#pragma unroll 4
    for (int s = threadIdx.x; s < nsl; s += 32) {
        const int sb = s >> 3, ib = s & 7;
        const u8* b = row + sb * 136;
        const u32 ls = ((b[4 + ib / 2] >> (4 * (ib & 1))) & 15) | (((ld_u16(b + 2) >> (2 * ib)) & 3) << 4);
        const float dl = h2f(ld_u16(b)) * (float)((int)ls - 32);
        // Blocks of 136 bytes: 8-byte aligned at best.
        const uint2 q0 = *(const uint2*)(b + 8 + 16 * ib), q1 = *(const uint2*)(b + 16 + 16 * ib);
        const u32 qw[4] = {q0.x, q0.y, q1.x, q1.y};
        int w[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = iq4_levels4(qw[i] & 0x0F0F0F0F);
            w[4 + i] = iq4_levels4((qw[i] >> 4) & 0x0F0F0F0F);
        }
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < ntok) {
                const int4* ap = (const int4*)(aq + (long long)t * cols + s * 32);
                const int4 a0 = ap[0], a1 = ap[1];
                const int d = dp4a8(w, a0, a1);
                acc[t] += ad[(long long)t * (cols / 256) + sb] * (dl * (float)d);
            }
        }
    }
}

// The exact-sum order (the types with int8 tensor-core products, imm.cu's imm_T / imv_T, which
// compute the same). A block's integer dot product is exact whatever computes it; its term is
// (dw_b · da_b) · isum_b for a 32-block (each product rounded as written, isum over the signed
// values, Q4_0: q − 8; term32) or q4k_term / q6k_term for a K-quant super-block. The 32-blocks'
// terms are added in quads, 4 consecutive blocks from a multiple of 4, as (t0 + t1) + (t2 + t3)
// (blocks past the row count 0: quad_sum); a quad's sum, or a super-block's term, is rounded
// once to a multiple of 2^-32 (fix_of) and those are added as 64-bit integers. Integer addition
// does not depend on its order, so the total is the same bits whatever kernel, tiling, split
// of the columns (whole 256-column chunks) or number of tokens computes it (|total| < 2^31:
// products' outputs are far smaller). fix_val turns the total back into a float. One
// conversion per quad, not per block: the conversion unit was the 32-blocks' imm's limit.
#define FIX_SCALE 4294967296.f
__device__ __forceinline__ long long fix_of(float t) { return __float2ll_rn(__fmul_rn(t, FIX_SCALE)); }
__device__ __forceinline__ float fix_val(long long s) { return __fmul_rn(__ll2float_rn(s), 1.f / FIX_SCALE); }
__device__ __forceinline__ long long warp_sum_ll(long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// A 32-block's term in the exact-sum order: (dw·da)·isum, plus wm·sa for the types with an
// offset (OFF, the weight type's MIN: Q4_1's min against the activations' sa = d·Σq,
// f16-rounded as ggml's q8_1), each product and the sum rounded as written (|isum| < 2^22:
// i2f_small is exact).
template <bool OFF>
__device__ __forceinline__ float term32(float dw, float wm, float da, float sa, int isum) {
    const float t = __fmul_rn(__fmul_rn(dw, da), i2f_small(isum));
    return OFF ? __fadd_rn(t, __fmul_rn(wm, sa)) : t;
}
// A quad's sum from its pairs' sums (t0 + t1, t2 + t3), as fix_of takes it.
__device__ __forceinline__ float quad_sum(float p01, float p23) { return __fadd_rn(p01, p23); }
// acc[j] += term for this lane's token j (acc indexed by constants only: registers).
__device__ __forceinline__ void acc_own(long long* acc, int j, long long term) {
#pragma unroll
    for (int t = 0; t < 8; t++)
        if (t == j) acc[t] += term;
}
// acc[token] += fix_of(quad sum) for the tokens' block terms t[0..8) of lanes 4k..4k+3 (blocks
// 4k..4k+3 of a quad): a reduce-scatter over the 4 lanes (xor 1 adds the pairs, xor 2 the
// quad: both lanes of an addition get the same bits, a + b = b + a), after which lane j of the
// four holds tokens 4·(j & 1) + (j & 2) and + 1. One token: lane 0 takes it (4 shuffles fewer).
__device__ __forceinline__ void quad_acc(long long* acc, const float* t, int ntok) {
    const int j = threadIdx.x & 3;
    if (ntok == 1) {
        float p = __fadd_rn(t[0], __shfl_xor_sync(0xffffffffu, t[0], 1));
        p = quad_sum(p, __shfl_xor_sync(0xffffffffu, p, 2));
        if (j == 0) acc[0] += fix_of(p);
        return;
    }
    float h[4], q2[2];
    const bool up1 = j & 1, up2 = j & 2;
#pragma unroll
    for (int k = 0; k < 4; k++) h[k] = __fadd_rn(up1 ? t[k + 4] : t[k], __shfl_xor_sync(0xffffffffu, up1 ? t[k] : t[k + 4], 1));
#pragma unroll
    for (int k = 0; k < 2; k++) q2[k] = quad_sum(up2 ? h[k + 2] : h[k], __shfl_xor_sync(0xffffffffu, up2 ? h[k] : h[k + 2], 2));
    const int t0 = 4 * (j & 1) + (j & 2);
#pragma unroll
    for (int k = 0; k < 2; k++)
        if (t0 + k < ntok) acc_own(acc, t0 + k, fix_of(q2[k]));
}
// The exact-sum order's loads: load32's, the values as signed bytes (Q4_0: q − 8, Q5_0: q − 16;
// Q8_0 and IQ4_NL's levels are; Q4_1 stays unsigned, its min the offset term32 adds). wm is
// unused where the term has no offset.
template <class T>
constexpr u32 load32_bias() { return 0u; }
template <>
constexpr u32 load32_bias<Q4_0>() { return 0x08080808u; }
template <>
constexpr u32 load32_bias<Q5_0>() { return 0x10101010u; }
template <class T>
__device__ __forceinline__ void load32c(const u8* __restrict__ row, int g, int* w, float& wd, float& wm) {
    load32<T>(row, g, w, wd, wm);
    if constexpr (load32_bias<T>() != 0) {
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = __vsub4(w[k], load32_bias<T>());
    }
}
// The exact-sum order's row dot products (the kernels mmvqc*_T, beside the mmvq*_T of rowq's
// float order): lane l takes blocks l, l + 32, … as rowq does (all lanes in every iteration, for
// quad_acc's shuffles: a lane past the row loads the last block and counts 0).
template <class T>
__device__ __forceinline__ void rowq_c(const u8* __restrict__ row, const i8* __restrict__ aq, const float* __restrict__ ad,
                                       const int* __restrict__ abs_, int cols, int ntok, long long* acc) {
    const int nb = cols / 32;
#pragma unroll 2
    for (int g0 = 0; g0 < nb; g0 += 32) {
        const bool ok = g0 + (int)threadIdx.x < nb;
        const int g = ok ? g0 + (int)threadIdx.x : nb - 1;
        int w[8];
        float wd, wm = 0.f, t[8];
        load32c<T>(row, g, w, wd, wm);
#pragma unroll
        for (int u = 0; u < 8; u++) {
            t[u] = 0.f;
            if (u < ntok) {
                const int4* ap = (const int4*)(aq + (long long)u * cols + g * 32);
                const int4 a0 = ap[0], a1 = ap[1];
                const int s = dp4a8(w, a0, a1);
                const float2 ds = *(const float2*)(ad + ((long long)u * nb + g) * 2);
                if (ok) t[u] = term32<T::MIN == 1>(wd, wm, ds.x, ds.y, s);
            }
        }
        quad_acc(acc, t, ntok);
    }
}

// Q4_K scales and mins of sub-blocks g and g+1 (g even) from the 16-byte header.
__device__ __forceinline__ void q4k_pair(uint4 hd, int g, float& sc0, float& m0, float& sc1, float& m1) {
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
}

template <>
__device__ __forceinline__ void rowq<Q4_K>(const u8* __restrict__ row, const i8* __restrict__ aq, const float* __restrict__ ad,
                                          const int* __restrict__ abs_, int cols, int ntok, float* acc) {
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
        q4k_pair(hd, g, sc0, m0, sc1, m1);
        u32 qw[4] = {q.x, q.y, q.z, q.w};
        int lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = qw[i] & 0x0F0F0F0F;
            hi[i] = (qw[i] >> 4) & 0x0F0F0F0F;
        }
        int xb = sb * 256 + g * 32 + (j & 1) * 16;
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < ntok) {
                const i8* a = aq + (long long)t * cols + xb;
                int4 a0 = *(const int4*)a, a1 = *(const int4*)(a + 32);
                int s0 = dp4a(lo[3], a0.w, dp4a(lo[2], a0.z, dp4a(lo[1], a0.y, dp4a(lo[0], a0.x, 0))));
                int s1 = dp4a(hi[3], a1.w, dp4a(hi[2], a1.z, dp4a(hi[1], a1.y, dp4a(hi[0], a1.x, 0))));
                const int* bs = abs_ + ((long long)t * cols + xb) / 16;
                float da = ad[(long long)t * (cols / 256) + sb];
                acc[t] += da * (d * (sc0 * (float)s0 + sc1 * (float)s1) - dmin * (m0 * (float)bs[0] + m1 * (float)bs[2]));
            }
        }
    }
}

// Q4_K in the exact-sum order (imm.cu's imm_q4_k and imv_q4_k compute the same): the 8 lanes
// of a super-block hold their integer parts of S1 = Σ sc·isum and S2 = Σ m·asum for each token;
// a reduce-scatter over those 8 lanes (xor 4, 2, 1: 7 shuffles a value for all 8 tokens, exact)
// leaves lane j of the group token j's sums, and lane j adds that token's super-block term
// da·(d·S1 − dmin·S2) (q4k_term).
// v[0..8) summed over the 8 lanes of this lane's group; returns token (lane & 7)'s total.
__device__ __forceinline__ int reduce_scatter8(const int* v) {
    const int j = threadIdx.x & 7;
    int h[4], q2[2];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const bool up = j & 4;
        h[k] = (up ? v[k + 4] : v[k]) + __shfl_xor_sync(0xffffffffu, up ? v[k] : v[k + 4], 4);
    }
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const bool up = j & 2;
        q2[k] = (up ? h[k + 2] : h[k]) + __shfl_xor_sync(0xffffffffu, up ? h[k] : h[k + 2], 2);
    }
    const bool up = j & 1;
    return (up ? q2[1] : q2[0]) + __shfl_xor_sync(0xffffffffu, up ? q2[0] : q2[1], 1);
}
// reduce_scatter8 for ntok tokens: for one token (mmvqc1_T) v[0]'s sum over the 8 lanes, lane
// 0 of the group taking it (the same integer, 6 shuffles fewer).
__device__ __forceinline__ int reduce_tokens8(const int* v, int ntok) {
    if (ntok > 1) return reduce_scatter8(v);
    int s = v[0];
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}
// One 32-value slice s of a Q4_K row (lane slice j of super-block sb: values 16 of sub-block
// g and 16 of g + 1, g = 2·(j / 2)) for rowq_c<Q4_K>: its nibbles, scales and mins, the
// super-block's d and dmin, and where its activations start (xb).
struct Q4kSlice {
    int lo[4], hi[4], sc0, m0, sc1, m1, xb;
    float d, dmin;
};
__device__ __forceinline__ Q4kSlice q4k_slice(const u8* __restrict__ row, int s) {
    Q4kSlice w;
    const int sb = s >> 3, j = s & 7, g = (j >> 1) * 2;
    const u8* b = row + sb * 144;
    const uint4 qv = *(const uint4*)(b + 16 + 16 * j);
    const uint4 hd = *(const uint4*)b;
    w.d = h2f(hd.x & 0xffff);
    w.dmin = h2f(hd.x >> 16);
    float f0, f1, f2, f3;
    q4k_pair(hd, g, f0, f1, f2, f3);
    w.sc0 = (int)f0, w.m0 = (int)f1, w.sc1 = (int)f2, w.m1 = (int)f3;
    const u32 qw[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        w.lo[k] = qw[k] & 0x0F0F0F0F;
        w.hi[k] = (qw[k] >> 4) & 0x0F0F0F0F;
    }
    w.xb = sb * 256 + g * 32 + (j & 1) * 16;
    return w;
}
// The slice's parts of S1 = Σ sc·isum and S2 = Σ m·asum for token t.
__device__ __forceinline__ void q4k_slice_dot(const Q4kSlice& w, const i8* __restrict__ aq, const int* __restrict__ abs_,
                                              int cols, int t, int& p1, int& p2) {
    const i8* a = aq + (long long)t * cols + w.xb;
    const int4 a0 = *(const int4*)a, a1 = *(const int4*)(a + 32);
    const int s0 = dp4a(w.lo[3], a0.w, dp4a(w.lo[2], a0.z, dp4a(w.lo[1], a0.y, dp4a(w.lo[0], a0.x, 0))));
    const int s1 = dp4a(w.hi[3], a1.w, dp4a(w.hi[2], a1.z, dp4a(w.hi[1], a1.y, dp4a(w.hi[0], a1.x, 0))));
    const int* bs = abs_ + ((long long)t * cols + w.xb) / 16;
    p1 = w.sc0 * s0 + w.sc1 * s1;
    p2 = w.m0 * bs[0] + w.m1 * bs[2];
}
// rowq_c<Q4_K> for one token: four iterations' slices loaded (clamped to the row, their sums
// zeroed past it) before their lanes' sums meet in one reduce-scatter of the four S1 and four
// S2 parts (lane j of a group: S1 of iteration j, or S2 of iteration j − 4); lane j < 4 takes
// its S2 from lane j + 4 and adds iteration j's term.
__device__ __forceinline__ void rowq_c1_q4_k(const u8* __restrict__ row, const i8* __restrict__ aq, const float* __restrict__ ad,
                                             const int* __restrict__ abs_, int cols, long long* acc) {
    const int nsl = cols / 32, lane = threadIdx.x & 31, j = lane & 7;
    for (int i0 = 0; 32 * i0 < nsl; i0 += 4) {
        int v[8];
        float d[4], dmin[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int s = 32 * (i0 + u) + lane;
            if (32 * (i0 + u) >= nsl) {
                // Past the row for the whole warp (rows of under 4,096 columns): nothing to load.
                v[u] = v[4 + u] = 0;
                d[u] = dmin[u] = 0.f;
                continue;
            }
            const Q4kSlice w = q4k_slice(row, min(s, nsl - 1));
            q4k_slice_dot(w, aq, abs_, cols, 0, v[u], v[4 + u]);
            d[u] = w.d, dmin[u] = w.dmin;
            if (s >= nsl) v[u] = v[4 + u] = 0;
        }
        const int t = reduce_scatter8(v), s2 = __shfl_down_sync(0xffffffffu, t, 4);
        const int first = 32 * (i0 + j) + (lane & ~7);
        if (j < 4 && first < nsl) {
            const float dj = j == 0 ? d[0] : j == 1 ? d[1] : j == 2 ? d[2] : d[3];
            const float mj = j == 0 ? dmin[0] : j == 1 ? dmin[1] : j == 2 ? dmin[2] : dmin[3];
            acc[0] += fix_of(q4k_term(ad[first >> 3], dj, mj, t, s2));
        }
    }
}
template <>
__device__ __forceinline__ void rowq_c<Q4_K>(const u8* __restrict__ row, const i8* __restrict__ aq, const float* __restrict__ ad,
                                            const int* __restrict__ abs_, int cols, int ntok, long long* acc) {
    if (ntok == 1) {
        rowq_c1_q4_k(row, aq, ad, abs_, cols, acc);
        return;
    }
    const int nsl = cols / 32, lane = threadIdx.x & 31;
#pragma unroll 2
    for (int i = 0; 32 * i < nsl; i++) {
        const int s = 32 * i + lane, sb = s >> 3, j = s & 7;
        // The same for the 8 lanes of a super-block (nsl is a multiple of 8).
        const bool valid = s < nsl;
        const Q4kSlice w = q4k_slice(row, min(s, nsl - 1));
        int p1[8], p2[8];
#pragma unroll
        for (int t = 0; t < 8; t++) {
            p1[t] = p2[t] = 0;
            if (valid && t < ntok) q4k_slice_dot(w, aq, abs_, cols, t, p1[t], p2[t]);
        }
        // Two tokens or more here (one takes rowq_c1_q4_k).
        const int S1 = reduce_scatter8(p1), S2 = reduce_scatter8(p2);
        if (valid && j < ntok) acc_own(acc, j, fix_of(q4k_term(ad[(long long)j * (cols / 256) + sb], w.d, w.dmin, S1, S2)));
    }
}

// Lane slice jj (0..7) of the Q6_K super-block at b: its four groups of 8 values (at l0, +32,
// +64, +96 of half h = jj / 4, l0 = 8·(jj % 4)) as unsigned 6-bit bytes, q[group][word], and
// the groups' scales.
__device__ __forceinline__ void q6k_lane(const u8* b, int jj, int (*q)[2], int* sc) {
    const int h = jj >> 2, l0 = (jj & 3) * 8;
    const u8* pa = b + h * 64 + l0;
    const u8* pe = b + 128 + h * 32 + l0;
    const u32 a[2] = {ld_u32_2a(pa), ld_u32_2a(pa + 4)};
    const u32 c[2] = {ld_u32_2a(pa + 32), ld_u32_2a(pa + 36)};
    const u32 e[2] = {ld_u32_2a(pe), ld_u32_2a(pe + 4)};
#pragma unroll
    for (int w = 0; w < 2; w++) {
        q[0][w] = (a[w] & 0x0F0F0F0F) | ((e[w] & 0x03030303) << 4);
        q[1][w] = (c[w] & 0x0F0F0F0F) | (((e[w] >> 2) & 0x03030303) << 4);
        q[2][w] = ((a[w] >> 4) & 0x0F0F0F0F) | (((e[w] >> 4) & 0x03030303) << 4);
        q[3][w] = ((c[w] >> 4) & 0x0F0F0F0F) | (((e[w] >> 6) & 0x03030303) << 4);
    }
    const i8* scp = (const i8*)(b + 192 + h * 8 + (l0 >> 4));
#pragma unroll
    for (int k = 0; k < 4; k++) sc[k] = scp[2 * k];
}
// The slice's four group sums Σ (q − 32)·a, the token's activations of the slice at ap.
__device__ __forceinline__ void q6k_dots(const int (*q)[2], const i8* ap, int* s) {
    const int ones = 0x01010101;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int2 x = *(const int2*)(ap + 32 * k);
        s[k] = dp4a(q[k][1], x.y, dp4a(q[k][0], x.x, 0)) - 32 * dp4a(ones, x.y, dp4a(ones, x.x, 0));
    }
}

template <>
__device__ __forceinline__ void rowq<Q6_K>(const u8* __restrict__ row, const i8* __restrict__ aq, const float* __restrict__ ad,
                                          const int* __restrict__ abs_, int cols, int ntok, float* acc) {
    int nsl = cols / 32;
#pragma unroll 4
    for (int s = threadIdx.x; s < nsl; s += 32) {
        int sb = s >> 3, jj = s & 7;
        const u8* b = row + sb * 210;
        int q[4][2], sc[4];
        q6k_lane(b, jj, q, sc);
        float d = h2f(ld_u16(b + 208));
        float f0 = d * sc[0], f1 = d * sc[1], f2 = d * sc[2], f3 = d * sc[3];
        int base = sb * 256 + (jj >> 2) * 128 + (jj & 3) * 8;
#pragma unroll
        for (int t = 0; t < 8; t++) {
            if (t < ntok) {
                int g[4];
                q6k_dots(q, aq + (long long)t * cols + base, g);
                float da = ad[(long long)t * (cols / 256) + sb];
                acc[t] += da * (f0 * (float)g[0] + f1 * (float)g[1] + f2 * (float)g[2] + f3 * (float)g[3]);
            }
        }
    }
}

// Q6_K in the exact-sum order (imm.cu's KQ<Q6_K> computes the same): rowq<Q6_K>'s lanes, each
// one's integer part of S = Σ sc·Σ (q − 32)·a per token, the 8 lanes of a super-block
// reduce-scattered (reduce_scatter8), lane j adding token j's term da·(d·S).
template <>
__device__ __forceinline__ void rowq_c<Q6_K>(const u8* __restrict__ row, const i8* __restrict__ aq, const float* __restrict__ ad,
                                            const int* __restrict__ abs_, int cols, int ntok, long long* acc) {
    const int nsl = cols / 32, lane = threadIdx.x & 31;
#pragma unroll 2
    for (int i = 0; 32 * i < nsl; i++) {
        const int s = 32 * i + lane, sb = s >> 3, jj = s & 7;
        const bool valid = s < nsl;
        int q[4][2] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}}, sc[4] = {0, 0, 0, 0};
        float d = 0.f;
        if (valid) {
            q6k_lane(row + sb * 210, jj, q, sc);
            d = h2f(ld_u16(row + sb * 210 + 208));
        }
        const int base = sb * 256 + (jj >> 2) * 128 + (jj & 3) * 8;
        int p[8];
#pragma unroll
        for (int t = 0; t < 8; t++) {
            p[t] = 0;
            if (valid && t < ntok) {
                int g[4];
                q6k_dots(q, aq + (long long)t * cols + base, g);
                p[t] = sc[0] * g[0] + sc[1] * g[1] + sc[2] * g[2] + sc[3] * g[3];
            }
        }
        const int S = reduce_tokens8(p, ntok);
        if (valid && jj < ntok) acc_own(acc, jj, fix_of(q6k_term(ad[(long long)jj * (cols / 256) + sb], d, S)));
    }
}

// A row's dot products over the int8 activations in the float order (C false: rowq) or the
// exact-sum order (C true: rowq_c): a lane's accumulator per token (Acc), the row's lane sums
// (dot), a token's total over the warp (fin).
template <class T, bool C>
struct RowQ {
    typedef float Acc;
    __device__ __forceinline__ static void dot(const u8* __restrict__ row, const i8* __restrict__ aq,
                                               const float* __restrict__ ad, const int* __restrict__ abs_, int cols,
                                               int ntok, float* acc) {
        rowq<T>(row, aq, ad, abs_, cols, ntok, acc);
    }
    __device__ __forceinline__ static float fin(float v) { return warp_sum(v); }
};
template <class T>
struct RowQ<T, true> {
    typedef long long Acc;
    __device__ __forceinline__ static void dot(const u8* __restrict__ row, const i8* __restrict__ aq,
                                               const float* __restrict__ ad, const int* __restrict__ abs_, int cols,
                                               int ntok, long long* acc) {
        rowq_c<T>(row, aq, ad, abs_, cols, ntok, acc);
    }
    __device__ __forceinline__ static float fin(long long v) { return fix_val(warp_sum_ll(v)); }
};

// mmvq / mmvq_glu: as mmv / mmv_glu over int8 activations, in the order C (RowQ).
template <class T, bool C, int NTOK, bool PF>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    mmvq(MmvMat m0, MmvMat m1, MmvMat m2, const i8* __restrict__ aq, const float* __restrict__ ad,
         const int* __restrict__ abs_, int cols, int ntok_arg) {
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
    typename RowQ<T, C>::Acc acc[8];
#pragma unroll
    for (int t = 0; t < 8; t++) acc[t] = 0;
    RowQ<T, C>::dot(m.w + (long long)r * m.row_bytes, aq, ad, abs_, cols, ntok, acc);
#pragma unroll
    for (int t = 0; t < 8; t++) {
        if (t < ntok) {
            float s = RowQ<T, C>::fin(acc[t]);
            if (threadIdx.x == 0) m.y[(long long)t * m.rows + r] = s;
        }
    }
}
template <class T, bool C, int NTOK, bool PF>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    mmvq_glu(const u8* __restrict__ wg, const u8* __restrict__ wu, long long row_bytes, const i8* __restrict__ aq,
             const float* __restrict__ ad, const int* __restrict__ abs_, float* __restrict__ out, int rows, int cols,
             int ntok_arg, int act) {
    GLU_BEGIN(PF)
    const int ntok = NTOK ? NTOK : ntok_arg;
    int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    if (r >= rows) return;
    typename RowQ<T, C>::Acc ag[8], au[8];
#pragma unroll
    for (int t = 0; t < 8; t++) ag[t] = au[t] = 0;
    RowQ<T, C>::dot(wg + (long long)r * row_bytes, aq, ad, abs_, cols, ntok, ag);
    RowQ<T, C>::dot(wu + (long long)r * row_bytes, aq, ad, abs_, cols, ntok, au);
#pragma unroll
    for (int t = 0; t < 8; t++) {
        if (t < ntok) {
            float g = RowQ<T, C>::fin(ag[t]), u = RowQ<T, C>::fin(au[t]);
            if (threadIdx.x == 0) out[(long long)t * rows + r] = glu_fn(g, u, act);
        }
    }
}
// MoE decode on int8 activations (as moe_glu / moe_mmv in mmv.cu, which read f32): one warp
// per output row of one (token, slot) pair p = blockIdx.y, from the expert routes[2p] chose, in
// the order C (RowQ; true: imm.cu imv_g's bits). The activations are quantize_a32's or
// quantize_a256's (ablk: 32 or 256) of the tokens (moeq_glu: token p / k) or of the pairs
// (moeq_mmv: row p).                                         grid (rows / 4, pairs), block (32, 4)
#define MOEQ_ACT                                                                                      \
    const i8* a = aq + t * cols;                                                                      \
    const float* d = ad + t * (ablk == 32 ? (cols / 32) * 2 : cols / 256);                            \
    const int* s = abs_ + (ablk == 32 ? 0 : t * (cols / 16));
template <class T, bool C>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    moeq_glu(const u8* __restrict__ wg, const u8* __restrict__ wu, long long row_bytes, long long expert_rows,
             const float* __restrict__ routes, const i8* __restrict__ aq, const float* __restrict__ ad,
             const int* __restrict__ abs_, float* __restrict__ out, int rows, int cols, int k, int act, int ablk) {
    pdl_begin();
    const int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    if (r >= rows) return;
    const long long p = blockIdx.y, e = (long long)routes[2 * p], t = p / k;
    MOEQ_ACT
    typename RowQ<T, C>::Acc ag[8], au[8];
#pragma unroll
    for (int i = 0; i < 8; i++) ag[i] = au[i] = 0;
    RowQ<T, C>::dot(wg + (e * expert_rows + r) * row_bytes, a, d, s, cols, 1, ag);
    RowQ<T, C>::dot(wu + (e * expert_rows + r) * row_bytes, a, d, s, cols, 1, au);
    const float g = RowQ<T, C>::fin(ag[0]), u = RowQ<T, C>::fin(au[0]);
    if (threadIdx.x == 0) out[p * rows + r] = glu_fn(g, u, act);
}
// A product per group of one row's columns (DeepSeek-V4's grouped output projection): group
// t = blockIdx.y multiplies its own matrix w.p[t] by the row's int8 activations from column
// t·cols (a row's int8 copy is laid out along its columns: the slice is token t's of a
// [groups, cols] copy), each output as mmvq's one-token rows (RowQ, order C), y[t·rows + r].
// grid (rows / 4, groups ≤ MMVQ_GROUPS), block (32, 4)
#define MMVQ_GROUPS 8
struct MmvGroups {
    const u8* p[MMVQ_GROUPS];
};
template <class T, bool C>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    mmvq_groups(MmvGroups w, long long row_bytes, const i8* __restrict__ aq, const float* __restrict__ ad,
                const int* __restrict__ abs_, float* __restrict__ y, int rows, int cols, int ablk) {
    pdl_begin();
    const int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    if (r >= rows) return;
    const long long t = blockIdx.y;
    MOEQ_ACT
    typename RowQ<T, C>::Acc acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0;
    RowQ<T, C>::dot(w.p[t] + (long long)r * row_bytes, a, d, s, cols, 1, acc);
    const float v = RowQ<T, C>::fin(acc[0]);
    if (threadIdx.x == 0) y[t * rows + r] = v;
}
template <class T, bool C>
__global__ void __launch_bounds__(32 * MMV_WARPS)
    moeq_mmv(const u8* __restrict__ w, long long row_bytes, long long expert_rows, const float* __restrict__ routes,
             const i8* __restrict__ aq, const float* __restrict__ ad, const int* __restrict__ abs_,
             float* __restrict__ y, int rows, int cols, int ablk) {
    pdl_begin();
    const int r = blockIdx.x * MMV_WARPS + threadIdx.y;
    if (r >= rows) return;
    const long long p = blockIdx.y, e = (long long)routes[2 * p], t = p;
    MOEQ_ACT
    typename RowQ<T, C>::Acc acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0;
    RowQ<T, C>::dot(w + (e * expert_rows + r) * row_bytes, a, d, s, cols, 1, acc);
    const float v = RowQ<T, C>::fin(acc[0]);
    if (threadIdx.x == 0) y[p * rows + r] = v;
}
