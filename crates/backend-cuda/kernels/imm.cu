// Int8 tensor-core products over the decode kernels' int8 activations (the batch-invariant numerics):
// imm_T / imv_T for Q4_0, Q4_1, Q5_0, Q8_0 and IQ4_NL (32-blocks), Q4_K and Q6_K (immk / imvk). Compiled after qmm.cu in
// the modules of those types (it uses qmm.cu's windows, copies, QRows, qmm_store).

// ---- Int8 tensor-core products (the 32-blocks): imm for many tokens, imv for decode ----
// Over the int8 activations of quantize_a32 (aq [n, cols], ad: (d, d·Σq) per token and 32).
// A block's integer dot product is exact whatever computes it, and its float term
// (dw_b · da_b) · isum_b (each product rounded as written) is added in mmvq.cu's exact-sum
// order (fix_of: a multiple of 2^-32 in a 64-bit integer), so a token's result is the same bits
// in any batch, on either kernel, and on the decode kernels mmvqc_T (mmvq.cu rowq_c).
// m16n8k32 s8: a0/a2 = row g's values 4q..4q+3 / 16+4q..16+4q+3, a1/a3 = row g + 8's; b0/b1 =
// token g's same values; c0, c1 = (row g; tokens 2q, 2q+1), c2, c3 = row g + 8's.
__device__ __forceinline__ void mma_s8(int* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// One row's values 4q..4q+3 (lo) and 16+4q..16+4q+3 (hi) of the block at b, as int8, its d
// and its offset m (Q4_1's min; 0 for the others, whose term has none: term32).
template <class T>
__device__ __forceinline__ void iw(const u8* b, int q, u32& lo, u32& hi, float& d, float& m);
template <>
__device__ __forceinline__ void iw<Q8_0>(const u8* b, int q, u32& lo, u32& hi, float& d, float& m) {
    d = h2f(ld_u16(b));
    m = 0.f;
    lo = ld_u32_2a(b + 2 + 4 * q);
    hi = ld_u32_2a(b + 18 + 4 * q);
}
template <>
__device__ __forceinline__ void iw<Q4_0>(const u8* b, int q, u32& lo, u32& hi, float& d, float& m) {
    d = h2f(ld_u16(b));
    m = 0.f;
    const u32 w = ld_u32_2a(b + 2 + 4 * q);
    lo = __vsub4(w & 0x0F0F0F0F, 0x08080808u);
    hi = __vsub4((w >> 4) & 0x0F0F0F0F, 0x08080808u);
}
template <>
__device__ __forceinline__ void iw<Q4_1>(const u8* b, int q, u32& lo, u32& hi, float& d, float& m) {
    d = h2f(ld_u16(b));
    m = h2f(ld_u16(b + 2));
    const u32 w = ld_u32_2a(b + 4 + 4 * q);
    lo = w & 0x0F0F0F0F;
    hi = (w >> 4) & 0x0F0F0F0F;
}
template <>
__device__ __forceinline__ void iw<Q5_0>(const u8* b, int q, u32& lo, u32& hi, float& d, float& m) {
    d = h2f(ld_u16(b));
    m = 0.f;
    const u32 qh = ld_u32_2a(b + 2), w = ld_u32_2a(b + 6 + 4 * q);
    lo = __vsub4((w & 0x0F0F0F0F) | spread4((qh >> (4 * q)) & 15), 0x10101010u);
    hi = __vsub4(((w >> 4) & 0x0F0F0F0F) | spread4((qh >> (16 + 4 * q)) & 15), 0x10101010u);
}
template <>
__device__ __forceinline__ void iw<IQ4_NL>(const u8* b, int q, u32& lo, u32& hi, float& d, float& m) {
    d = h2f(ld_u16(b));
    m = 0.f;
    const u32 w = ld_u32_2a(b + 2 + 4 * q);
    lo = iq4_levels4(w & 0x0F0F0F0F);
    hi = iq4_levels4((w >> 4) & 0x0F0F0F0F);
}
typedef void (*IwFn)(const u8*, int, u32&, u32&, float&, float&);

// A's fragment for rows g and g + 8 from their blocks' bytes, their d and m.
template <IwFn IW>
__device__ __forceinline__ void imm_frag(u32* a, float* dw, float* dm, const u8* r0, const u8* r1, int q) {
    IW(r0, q, a[0], a[2], dw[0], dm[0]);
    IW(r1, q, a[1], a[3], dw[1], dm[1]);
}
// A pair of blocks' A fragments (imm_frag) at w0 / w1 (rows g, g + 8) and kb, kb + 1 = block's
// index and the next; a block at or past ng (the row's blocks) gets d = m = 0, so its term is 0
// whatever its window holds (mmvq.cu quad_sum counts blocks past the row as 0).
template <IwFn IW, int BB>
__device__ __forceinline__ void imm_frag2(u32 (*a)[4], float (*dw)[2], float (*dm)[2], const u8* w0,
                                         const u8* w1, int q, int blk, int ng) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        imm_frag<IW>(a[h], dw[h], dm[h], w0 + h * BB, w1 + h * BB, q);
        if (blk + h >= ng) dw[h][0] = dw[h][1] = dm[h][0] = dm[h][1] = 0.f;
    }
}
// t[e] = the block's terms (term32) of an n8 tile: a, dw, dm as imm_frag made them, the tokens'
// b0/b1, their d and s (da0 / sa0 for token 2q, da1 / sa1 for 2q + 1).
template <bool OFF>
__device__ __forceinline__ void imm_terms(float* t, const u32* a, const float* dw, const float* dm, u32 b0,
                                          u32 b1, float da0, float da1, float sa0, float sa1) {
    int c[4] = {0, 0, 0, 0};
    mma_s8(c, a, b0, b1);
#pragma unroll
    for (int e = 0; e < 4; e++) t[e] = term32<OFF>(dw[e >> 1], dm[e >> 1], (e & 1) ? da1 : da0, (e & 1) ? sa1 : sa0, c[e]);
}
// A pair's terms t0 + t1 for the quad (second: P + that pair, whose quad_sum acc takes; first:
// P = that pair).
__device__ __forceinline__ void quad_step(long long* acc, float* P, const float* t0, const float* t1, bool second) {
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float p = __fadd_rn(t0[e], t1[e]);
        if (second) acc[e] += fix_of(quad_sum(P[e], p));
        else P[e] = p;
    }
}
// The totals of a warp's 16 rows × 64 tokens as floats, into y (qmm_store).
__device__ __forceinline__ void fix_store(const long long (*tot)[4], const QRows& R, int n0, int rows,
                                          float* __restrict__ y, int n) {
    float v[8][4];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) v[i][e] = fix_val(tot[i][e]);
    qmm_store(v, R, n0, rows, y, n);
}
// imm's store: the totals as floats (fix_store), or, when the columns are split over grid z,
// this part's 64-bit totals into its slot of `part` ([z][tile][nt·4 + e][thread]: a warp's
// stores 256 contiguous bytes), and the tile's last part to finish (a counter per tile in `cnt`,
// which it leaves at zero) adds the other parts' totals to its own (integers: the same bits in
// any order) and stores the floats.
__device__ __forceinline__ void imm_store(long long (*tot)[4], const QRows& R, int n0, int rows,
                                          float* __restrict__ y, int n, long long* part, unsigned* cnt) {
    if (gridDim.z == 1) {
        fix_store(tot, R, n0, rows, y, n);
        return;
    }
    constexpr int TS = 32 * 32 * QMM_WARPS;  // a tile's totals
    const unsigned tiles = gridDim.x * gridDim.y, tile = blockIdx.y * gridDim.x + blockIdx.x;
    long long* a = part + (long long)tile * TS + threadIdx.x;
#pragma unroll
    for (int i = 0; i < 32; i++) __stcg(a + (long long)blockIdx.z * tiles * TS + i * 32 * QMM_WARPS, tot[i >> 2][i & 3]);
    __shared__ bool last;
    // The block's stores before the count (one thread's fence after the barrier covers them).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(cnt + tile, 1u) == gridDim.z - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (unsigned z = 0; z < gridDim.z; z++)
        if (z != blockIdx.z)
#pragma unroll
            for (int i = 0; i < 32; i++) tot[i >> 2][i & 3] += __ldcg(a + (long long)z * tiles * TS + i * 32 * QMM_WARPS);
    if (threadIdx.x == 0) cnt[tile] = 0;
    fix_store(tot, R, n0, rows, y, n);
}
// imv's last step: the threads, one per (row, token) of the block's 16·RW rows (from row rb) ×
// 8·NT tokens in turn, add the sums of the warps of the row's group (`part`, [warp][row · 8·NT +
// token], warp = column group · RW + row group) and store the total. (RW = 8, a warp over all
// the columns of its rows storing its own sums, measured slower than 4: BENCHMARKS.)
template <int NT, int RW>
__device__ __forceinline__ void fix_total(const long long* part, int rb, int rows,
                                          float* __restrict__ y, int n) {
    constexpr int TT = 8 * NT, CW = 8 / RW;
    for (int i = threadIdx.x; i < 16 * RW * TT; i += blockDim.x) {
        const int row = i / TT, t = i % TT, rg = row / 16, r16 = row % 16;
        if (t < n && rb + row < rows) {
            long long tot = 0;
            for (int w = 0; w < CW; w++) tot += part[(w * RW + rg) * 16 * TT + r16 * TT + t];
            y[(long long)t * rows + rb + row] = fix_val(tot);
        }
    }
}
// A warp's 16 rows × 8·NT tokens of sums into `part` for fix_total.
template <int NT>
__device__ __forceinline__ void imv_part(long long* part, const long long (*acc)[4], int warp, int g, int q) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            part[warp * 128 * NT + ((e >> 1) * 8 + g) * 8 * NT + nt * 8 + 2 * q + (e & 1)] = acc[nt][e];
}

// The end of imv: the warps' sums through shared memory, added per row.
template <int NT, int RW>
__device__ __forceinline__ void imv_finish(long long* part, const long long (*acc)[4], int rb, int rows,
                                           float* __restrict__ y, int n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    static_assert(RW == 1 || RW == 2 || RW == 4, "row groups that share the columns");
    imv_part<NT>(part, acc, warp, lane >> 2, lane & 3);
    __syncthreads();
    fix_total<NT, RW>(part, rb, rows, y, n);
}
// imm: CTA 64 rows × 64 tokens, 4 warps of 16 rows, stages of 128 columns (4 blocks: a quad) as qmm:
// weight windows, the tokens' int8 activations and their d through shared memory with cp.async,
// QMM_NST stages in flight; split over grid z in whole 256-column chunks (imm_store).
//                                       grid (ceil(n / 64), ceil(rows / 64), parts), block 128
#define IMM_XLD 144
template <IwFn IW, int BB, bool OFF>
__device__ __forceinline__ void imm_impl(const u8* __restrict__ W, long long row_bytes, int rows,
                                         int cols, const i8* __restrict__ aq,
                                         const float* __restrict__ ad, float* __restrict__ y, int n,
                                         long long* part, unsigned* cnt) {
    typedef QWin<BB, 32> Q;
    extern __shared__ __align__(16) u8 qsm[];
    u8* Xs = qsm;                                                   // [stage][token][IMM_XLD]
    float* Ds = (float*)(qsm + QMM_NST * QMM_BN * IMM_XLD);         // [stage][block][token](d, s)
    u8* Ws = (u8*)(Ds + QMM_NST * 4 * QMM_BN * 2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * QMM_BN;
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, (int)blockIdx.y * QMM_BM + warp * 16, rows};
    const int ng = cols / 32, nst = (cols + QMM_BK - 1) / QMM_BK;
    // This block's stages: all of them, or split z's whole chunks (two stages each).
    const int nch = (nst + 1) / 2, S = gridDim.z, z = blockIdx.z;
    const int j0 = 2 * (z * nch / S), j1 = min(2 * ((z + 1) * nch / S), nst);
    auto wbuf = [&](int b) { return Ws + (b * QMM_WARPS + warp) * 16 * Q::WIN; };
    auto copy_x = [&](int b, int j) {
        u8* xs = Xs + b * QMM_BN * IMM_XLD;
        float* ds = Ds + b * 4 * QMM_BN * 2;
        for (int i = threadIdx.x; i < QMM_BN * 8; i += 32 * QMM_WARPS) {
            const int t = i >> 3, p = i & 7, k = j * QMM_BK + 16 * p;
            const bool ok = n0 + t < n && k < cols;
            cp_async16(xs + t * IMM_XLD + 16 * p, ok ? aq + (long long)(n0 + t) * cols + k : aq, ok);
        }
        for (int i = threadIdx.x; i < QMM_BN * 4; i += 32 * QMM_WARPS) {
            const int kb = i / QMM_BN, t = i % QMM_BN, blk = 4 * j + kb;
            const bool ok = n0 + t < n && blk < ng;
            const float* src = ok ? ad + ((long long)(n0 + t) * ng + blk) * 2 : ad;
            cp_async8(ds + 2 * i, src, ok);
        }
    };
    long long tot[8][4];
    float P[8][4];  // the quad's first pair
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) tot[i][e] = 0;
#pragma unroll
    for (int st = j0; st < j0 + QMM_NST - 1; st++) {
        if (st < j1) {
            copy_x(st % QMM_NST, st);
            qmm_copy_w<Q>(wbuf(st % QMM_NST), R, st);
        }
        cp_async_commit();
    }
    for (int j = j0; j < j1; j++) {
        cp_async_wait<QMM_NST - 2>();
        __syncthreads();
        const int st = j + QMM_NST - 1;
        if (st < j1) {
            copy_x(st % QMM_NST, st);
            qmm_copy_w<Q>(wbuf(st % QMM_NST), R, st);
        }
        cp_async_commit();
        const u8* win = wbuf(j % QMM_NST);
        const u8* xs = Xs + (j % QMM_NST) * QMM_BN * IMM_XLD;
        const float* ds = Ds + (j % QMM_NST) * 4 * QMM_BN * 2;
        const int off0 = (int)((u64)(R.row(g) + Q::start(j)) & 15), off1 = (int)((u64)(R.row(g + 8) + Q::start(j)) & 15);
#pragma unroll
        for (int kp = 0; kp < 2; kp++) {
            u32 a[2][4];
            float dw[2][2], dm[2][2];
            imm_frag2<IW, BB>(a, dw, dm, win + g * Q::WIN + off0 + 2 * kp * BB, win + (g + 8) * Q::WIN + off1 + 2 * kp * BB, q,
                              4 * j + 2 * kp, ng);
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                float t[2][4];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int kb = 2 * kp + h;
                    const u8* xb = xs + (nt * 8 + g) * IMM_XLD + kb * 32 + 4 * q;
                    // Tokens 2q and 2q + 1: (d, s) each.
                    const float4 da = *(const float4*)(ds + (kb * QMM_BN + nt * 8 + 2 * q) * 2);
                    imm_terms<OFF>(t[h], a[h], dw[h], dm[h], *(const u32*)xb, *(const u32*)(xb + 16), da.x, da.z, da.y, da.w);
                }
                quad_step(tot[nt], P[nt], t[0], t[1], kp == 1);
            }
        }
    }
    imm_store(tot, R, n0, rows, y, n, part, cnt);
}

// imv: n ≤ 8·NT tokens as NT n8 tiles (NT = 1, 2; a form of 4 tiles measured slower than qmm at
// 24 and 32 tokens, fourteenth session); a block of 8 warps takes 16·RW rows: RW groups of 16
// rows, each over the columns in 8 / RW column groups, warp w (row group w % RW) the chunks
// w / RW, w / RW + 8 / RW, … (8 blocks each, their weight bytes copied to shared memory while
// the previous chunk is multiplied; each A fragment feeds the NT tiles); the sums are integers
// (the exact-sum order), so any split of the columns gives the same bits; the column groups'
// sums meet in shared memory and one thread per (row, token) adds them (imv_finish).
//                                       grid (ceil(rows / (16·RW))), block 256, dynamic smem
template <IwFn IW, int BB, bool OFF, int NT, int RW>
__device__ __forceinline__ void imv_impl(const u8* __restrict__ W, long long row_bytes, int rows,
                                         int cols, const i8* __restrict__ aq,
                                         const float* __restrict__ ad, float* __restrict__ y, int n, int bx) {
    typedef QWinC<BB, 32> Q;
    constexpr int QW = 8;
    extern __shared__ __align__(16) u8 qsm[];
    long long* part = (long long*)(qsm + QW * 2 * 16 * Q::WIN);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    constexpr int CW = QW / RW;
    const int rb = bx * 16 * RW;
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, rb + (warp % RW) * 16, rows};
    const int ng = cols / 32, nch = (ng + 7) / 8;
    // A warp whose rows all lie past the end takes no chunks.
    const int c0 = R.rb < rows ? warp / RW : nch;
    long long acc[NT][4];
    float P[NT][4];  // a quad's first pair
    // Tile nt: token nt·8 + g's activations (zeros past the last token); tokens nt·8 + 2q,
    // nt·8 + 2q + 1's d.
    bool tok[NT];
    const i8* xr[NT];
    int t0[NT], t1[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;
        tok[nt] = nt * 8 + g < n;
        xr[nt] = aq + (long long)(tok[nt] ? nt * 8 + g : 0) * cols;
        t0[nt] = min(nt * 8 + 2 * q, n - 1), t1[nt] = min(nt * 8 + 2 * q + 1, n - 1);
    }
    auto wbuf = [&](int b) { return qsm + (warp * 2 + b) * 16 * Q::WIN; };
    if (c0 < nch) qmm_copy_w<Q>(wbuf(0), R, 2 * c0);
    cp_async_commit();
    for (int c = c0, i = 0; c < nch; c += CW, i++) {
        if (c + CW < nch) qmm_copy_w<Q>(wbuf((i + 1) & 1), R, 2 * (c + CW));
        cp_async_commit();
        cp_async_wait<1>();
        __syncwarp();
        const u8* win = wbuf(i & 1);
        const int off0 = (int)((u64)(R.row(g) + Q::start(2 * c)) & 15), off1 = (int)((u64)(R.row(g + 8) + Q::start(2 * c)) & 15);
        // The chunk's two quads as pairs (a block past the row reads the last one's activations
        // and counts 0: imm_frag2).
        for (int kp = 0; kp < 4 && 8 * c + 2 * kp < ng; kp++) {
            u32 a[2][4];
            float dw[2][2], dm[2][2];
            imm_frag2<IW, BB>(a, dw, dm, win + g * Q::WIN + off0 + 2 * kp * BB, win + (g + 8) * Q::WIN + off1 + 2 * kp * BB, q,
                              8 * c + 2 * kp, ng);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                float t[2][4];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int blk = min(8 * c + 2 * kp + h, ng - 1);
                    const u32* xp = (const u32*)(xr[nt] + blk * 32 + 4 * q);
                    const u32 b0 = tok[nt] ? xp[0] : 0u, b1 = tok[nt] ? xp[4] : 0u;
                    const float2 d0 = *(const float2*)(ad + ((long long)t0[nt] * ng + blk) * 2);
                    const float2 d1 = *(const float2*)(ad + ((long long)t1[nt] * ng + blk) * 2);
                    imm_terms<OFF>(t[h], a[h], dw[h], dm[h], b0, b1, d0.x, d1.x, d0.y, d1.y);
                }
                quad_step(acc[nt], P[nt], t[0], t[1], kp & 1);
            }
            // A quad of one pair (the row ends there): its sum is that pair's.
            if (!(kp & 1) && 8 * c + 2 * kp + 2 >= ng)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[nt][e] += fix_of(quad_sum(P[nt][e], 0.f));
        }
        // Every lane is done with buffer i & 1 before the next copy into it.
        __syncwarp();
    }
    imv_finish<NT, RW>(part, acc, rb, rows, y, n);
}

// ---- The K-quants on int8 mma (imm_q4_k / imv_q4_k, imm_q6_k / imv_q6_k) over quantize_a256's
// activations ----
// A super-block's term comes from sums exact in int32 and is added in the exact-sum order
// (fix_of); mmvq.cu's rowq_c<Q4_K> / rowq_c<Q6_K> compute the same. Per type a policy KQ<T>:
// BB (block bytes), SUMS (the term needs the activations' per-16 sums), Pair (one 32-value
// pair jj of rows g and g + 8: A fragments and scales), pair(), acc() (the 4 outputs' S1 / S2
// += the pair against the tokens' values x0 / x1 and their sums over the 32) and term().
//
// Q4_K: S1 = Σ_j sc_j·isum_j and S2 = Σ_j m_j·asum_j over its 8 sub-blocks (isum_j: the
// unsigned nibbles against the int8 activations; asum_j: two of quantize_a256's per-16 sums),
// term da·(d·S1 − dmin·S2) (q4k_term). Sub-block jj's values 4q..4q+3 (lo) and 16+4q..16+4q+3
// (hi), 0..15 as bytes, of the super-block at b (16-byte aligned: whole 144-byte blocks).
__device__ __forceinline__ void q4k_frag(const u8* b, int jj, int q, u32& lo, u32& hi) {
    const u8* p = b + 16 + 32 * (jj >> 1) + 4 * q;
    const int sh = 4 * (jj & 1);
    lo = (*(const u32*)p >> sh) & 0x0F0F0F0Fu;
    hi = (*(const u32*)(p + 16) >> sh) & 0x0F0F0F0Fu;
}
template <class T>
struct KQ;
template <>
struct KQ<Q4_K> {
    static constexpr int BB = 144;
    static constexpr bool SUMS = true;
    struct Pair {
        u32 a[4];
        int sc[2], mn[2];
    };
    __device__ static Pair pair(const u8* b0, const u8* b1, int jj, int q) {
        Pair p;
        k4_scale_min_i(b0 + 4, jj, p.sc[0], p.mn[0]);
        k4_scale_min_i(b1 + 4, jj, p.sc[1], p.mn[1]);
        q4k_frag(b0, jj, q, p.a[0], p.a[2]);
        q4k_frag(b1, jj, q, p.a[1], p.a[3]);
        return p;
    }
    __device__ static void acc(const Pair& p, u32 x0, u32 x1, const int* asum, int* S1, int* S2) {
        int c[4] = {0, 0, 0, 0};
        mma_s8(c, p.a, x0, x1);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            S1[e] += p.sc[e >> 1] * c[e];
            S2[e] += p.mn[e >> 1] * asum[e & 1];
        }
    }
    __device__ static float term(float da, const u8* b, int S1, int S2) {
        return q4k_term(da, h2f(ld_u16(b)), h2f(ld_u16(b + 2)), S1, S2);
    }
};
// Q6_K: S = Σ_i sc_i·isum16_i over its 16 sub-blocks (S1; S2 unused), term da·(d·S)
// (q6k_term). The scale changes every 16 values, so each 32 take two mma, one with the first
// 16 values' A fragment (the second half zero), one with the second's.
template <>
struct KQ<Q6_K> {
    static constexpr int BB = 210;
    static constexpr bool SUMS = false;
    struct Pair {
        u32 lo[4], hi[4];
        int sl[2], sh[2];
    };
    __device__ static Pair pair(const u8* b0, const u8* b1, int jj, int q) {
        Pair p;
        const int v = 32 * jj + 4 * q;
        p.lo[0] = q6k_frag4(b0, v), p.lo[1] = q6k_frag4(b1, v), p.lo[2] = p.lo[3] = 0u;
        p.hi[0] = p.hi[1] = 0u, p.hi[2] = q6k_frag4(b0, v + 16), p.hi[3] = q6k_frag4(b1, v + 16);
        p.sl[0] = (i8)b0[192 + 2 * jj], p.sl[1] = (i8)b1[192 + 2 * jj];
        p.sh[0] = (i8)b0[193 + 2 * jj], p.sh[1] = (i8)b1[193 + 2 * jj];
        return p;
    }
    __device__ static void acc(const Pair& p, u32 x0, u32 x1, const int*, int* S1, int*) {
        int cl[4] = {0, 0, 0, 0}, ch[4] = {0, 0, 0, 0};
        mma_s8(cl, p.lo, x0, x1);
        mma_s8(ch, p.hi, x0, x1);
#pragma unroll
        for (int e = 0; e < 4; e++) S1[e] += p.sl[e >> 1] * cl[e] + p.sh[e >> 1] * ch[e];
    }
    __device__ static float term(float da, const u8* b, int S1, int) {
        return q6k_term(da, h2f(ld_u16(b + 208)), S1);
    }
};

// ---- immk: the K-quants' imm (Q4_K, Q6_K) ----
// Per type a policy IK<T> of two steps over a warp's 16 rows × 64 tokens: kb() adds sub-block
// pair jj (32 values) of rows g, g + 8 against the 8 n8 tiles' activations (xs) into the int32
// accumulators P / Q, fin() adds each output's super-block term (fix_of) to tot and clears P / Q.
//
// Q4_K with the scales folded into the A fragments: sc = 8·sh + sl (sh, sl ≤ 7, sh·q, sl·q ≤ 105
// as int8), so P = Σ (sh·q)·x and Q = Σ (sl·q)·x over the super-block are mma accumulators and
// S1 = 8·P + Q; S2 = Σ_j m_j·asum_j by two m16n8k16 mma from the activations' 32-sums split as
// asum = 256·h + l (quantize_a256's `hl`: h_0..h_7, l_0..l_7 per token and super-block):
// S2 = 256·Σ m·h + Σ m·l. Exact integers, so the same term as mmvq.cu's rowq_c<Q4_K>.
__device__ __forceinline__ void mma_s8_k16(int* c, u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}
// The Q4_K super-block at b's 6-bit scales and mins as bytes: sub-blocks 0..3 in [0], 4..7 in [1].
__device__ __forceinline__ void q4k_scales_mins(const u8* b, u32* sc, u32* mn) {
    const u32 w0 = *(const u32*)(b + 4), w1 = *(const u32*)(b + 8), w2 = *(const u32*)(b + 12);
    sc[0] = w0 & 0x3F3F3F3Fu;
    mn[0] = w1 & 0x3F3F3F3Fu;
    sc[1] = (w2 & 0x0F0F0F0Fu) | (((w0 >> 6) & 0x03030303u) << 4);
    mn[1] = ((w2 >> 4) & 0x0F0F0F0Fu) | (((w1 >> 6) & 0x03030303u) << 4);
}
// Token tile nt's b0 / b1 for sub-block pair kb of the stage (xs as immk stages it).
__device__ __forceinline__ void imm_xfrag(const u8* xs, int nt, int kb, int g, int q, u32& x0, u32& x1) {
    const u8* xb = xs + (nt * 8 + g) * IMM_XLD + kb * 32 + 4 * q;
    x0 = *(const u32*)xb;
    x1 = *(const u32*)(xb + 16);
}
template <class T>
struct IK;
template <>
struct IK<Q4_K> {
    static constexpr int BB = 144;
    static constexpr bool HL = true;
    __device__ static void kb(int (*P)[4], int (*Q)[4], const u8* b0, const u8* b1, int jj, const u8* xs, int kb, int g, int q) {
        u32 s0[2], s1[2], m[2];
        q4k_scales_mins(b0, s0, m);
        q4k_scales_mins(b1, s1, m);
        const int sc0 = (s0[jj >> 2] >> (8 * (jj & 3))) & 63, sc1 = (s1[jj >> 2] >> (8 * (jj & 3))) & 63;
        u32 a[4], ah[4], al[4];
        q4k_frag(b0, jj, q, a[0], a[2]);
        q4k_frag(b1, jj, q, a[1], a[3]);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int sc = (i & 1) ? sc1 : sc0;
            ah[i] = a[i] * (u32)(sc >> 3);
            al[i] = a[i] * (u32)(sc & 7);
        }
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            u32 x0, x1;
            imm_xfrag(xs, nt, kb, g, q, x0, x1);
            mma_s8(P[nt], ah, x0, x1);
            mma_s8(Q[nt], al, x0, x1);
        }
    }
    template <bool CLEAR = true>
    __device__ static void fin(long long (*tot)[4], int (*P)[4], int (*Q)[4], const u8* b0, const u8* b1,
                               const u8* hs, const float* dd, int g, int q) {
        u32 s[2], m0[2], m1[2];
        q4k_scales_mins(b0, s, m0);
        q4k_scales_mins(b1, s, m1);
        // m16n8k16: A1 = the mins in k 0..7 (against h), A2 in k 8..15 (against l).
        const u32 h0 = q < 2 ? m0[q & 1] : 0u, h1 = q < 2 ? m1[q & 1] : 0u;
        const u32 l0 = q < 2 ? 0u : m0[q & 1], l1 = q < 2 ? 0u : m1[q & 1];
        const float d[2] = {h2f(ld_u16(b0)), h2f(ld_u16(b1))}, dmin[2] = {h2f(ld_u16(b0 + 2)), h2f(ld_u16(b1 + 2))};
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const u32 x = *(const u32*)(hs + (nt * 8 + g) * 16 + 4 * q);
            int ch[4] = {0, 0, 0, 0}, cl[4] = {0, 0, 0, 0};
            mma_s8_k16(ch, h0, h1, x);
            mma_s8_k16(cl, l0, l1, x);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float da = dd[nt * 8 + 2 * q + (e & 1)];
                // S1 = 8·P + Q rounded once (|P|, |Q| < 2^22), S2 exact (|S2| < 2^22): as
                // q4k_term's conversions, without the conversion unit.
                const float s1 = __fmaf_rn(i2f_small(P[nt][e]), 8.f, i2f_small(Q[nt][e]));
                const float s2 = i2f_small(256 * ch[e] + cl[e]);
                tot[nt][e] += fix_of(q4k_term_f(da, d[e >> 1], dmin[e >> 1], s1, s2));
                if (CLEAR) P[nt][e] = Q[nt][e] = 0;
            }
        }
    }
};
template <>
struct IK<Q6_K> {
    static constexpr int BB = 210;
    static constexpr bool HL = false;
    __device__ static void kb(int (*P)[4], int (*)[4], const u8* b0, const u8* b1, int jj, const u8* xs, int kb, int g, int q) {
        const KQ<Q6_K>::Pair p = KQ<Q6_K>::pair(b0, b1, jj, q);
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            u32 x0, x1;
            imm_xfrag(xs, nt, kb, g, q, x0, x1);
            KQ<Q6_K>::acc(p, x0, x1, nullptr, P[nt], nullptr);
        }
    }
    template <bool CLEAR = true>
    __device__ static void fin(long long (*tot)[4], int (*P)[4], int (*)[4], const u8* b0, const u8* b1,
                               const u8*, const float* dd, int, int q) {
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float da = dd[nt * 8 + 2 * q + (e & 1)];
                tot[nt][e] += fix_of(KQ<Q6_K>::term(da, (e >> 1) ? b1 : b0, P[nt][e], 0));
                if (CLEAR) P[nt][e] = 0;
            }
    }
};

// immk: qmm's tiling (64 rows × 64 tokens, stages of 128 columns: half a super-block). Per
// stage the tokens' int8 activations, their super-block's d and (HL) 32-sums split go through
// shared memory; the terms are added at the super-block's second stage (fin). Split over grid z
// in whole super-blocks (imm_store).
template <class K>
__device__ __forceinline__ void immk_impl(const u8* __restrict__ W, long long row_bytes, int rows,
                                          int cols, const i8* __restrict__ aq,
                                          const float* __restrict__ ad, const int* __restrict__ abs_,
                                          float* __restrict__ y, int n, long long* part, unsigned* cnt) {
    typedef QWin<K::BB, 256> Q;
    extern __shared__ __align__(16) u8 qsm[];
    u8* Xs = qsm;                                              // [stage][token][IMM_XLD]
    u8* Hs = qsm + QMM_NST * QMM_BN * IMM_XLD;                 // [stage][token][16]
    float* Dd = (float*)(Hs + QMM_NST * QMM_BN * 16);          // [stage][token]
    u8* Ws = (u8*)(Dd + QMM_NST * QMM_BN);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * QMM_BN;
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, (int)blockIdx.y * QMM_BM + warp * 16, rows};
    const int nsb = cols / 256;
    // quantize_a256's 32-sums split, after its per-16 sums.
    const u8* hl = (const u8*)(abs_ + (long long)n * (cols / 16));
    // Split z's super-blocks (two stages each).
    const int S = gridDim.z, z = blockIdx.z;
    const int j0 = 2 * (z * nsb / S), j1 = 2 * ((z + 1) * nsb / S);
    auto wbuf = [&](int b) { return Ws + (b * QMM_WARPS + warp) * 16 * Q::WIN; };
    auto copy_x = [&](int b, int j) {
        u8* xs = Xs + b * QMM_BN * IMM_XLD;
        for (int i = threadIdx.x; i < QMM_BN * 8; i += 32 * QMM_WARPS) {
            const int t = i >> 3, p = i & 7, k = j * QMM_BK + 16 * p;
            const bool ok = n0 + t < n;
            cp_async16(xs + t * IMM_XLD + 16 * p, ok ? aq + (long long)(n0 + t) * cols + k : aq, ok);
        }
        if (K::HL)
            for (int t = threadIdx.x; t < QMM_BN; t += 32 * QMM_WARPS) {
                const bool ok = n0 + t < n;
                cp_async16(Hs + (b * QMM_BN + t) * 16, ok ? hl + ((long long)(n0 + t) * nsb + (j >> 1)) * 16 : hl, ok);
            }
        float* dd = Dd + b * QMM_BN;
        for (int t = threadIdx.x; t < QMM_BN; t += 32 * QMM_WARPS) {
            const bool ok = n0 + t < n;
            const float* src = ok ? ad + (long long)(n0 + t) * nsb + (j >> 1) : ad;
            cp_async4(dd + t, src, ok);
        }
    };
    int P[8][4], Qa[8][4];
    long long tot[8][4];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            P[i][e] = Qa[i][e] = 0;
            tot[i][e] = 0;
        }
#pragma unroll
    for (int st = j0; st < j0 + QMM_NST - 1; st++) {
        if (st < j1) {
            copy_x(st % QMM_NST, st);
            qmm_copy_w<Q>(wbuf(st % QMM_NST), R, st);
        }
        cp_async_commit();
    }
    for (int j = j0; j < j1; j++) {
        cp_async_wait<QMM_NST - 2>();
        __syncthreads();
        const int st = j + QMM_NST - 1;
        if (st < j1) {
            copy_x(st % QMM_NST, st);
            qmm_copy_w<Q>(wbuf(st % QMM_NST), R, st);
        }
        cp_async_commit();
        const int b = j % QMM_NST;
        const u8* win = wbuf(b);
        const u8* xs = Xs + b * QMM_BN * IMM_XLD;
        const u8* b0 = win + g * Q::WIN + (int)((u64)(R.row(g) + Q::start(j)) & 15);
        const u8* b1 = win + (g + 8) * Q::WIN + (int)((u64)(R.row(g + 8) + Q::start(j)) & 15);
        const int half = j & 1;
#pragma unroll
        for (int kb = 0; kb < 4; kb++) K::kb(P, Qa, b0, b1, 4 * half + kb, xs, kb, g, q);
        if (half == 1) K::template fin<true>(tot, P, Qa, b0, b1, Hs + b * QMM_BN * 16, Dd + b * QMM_BN, g, q);
    }
    imm_store(tot, R, n0, rows, y, n, part, cnt);
}

// imvk: imv's layout (NT n8 tiles, RW row groups), one super-block per chunk.
//                                                     grid (ceil(rows / (16·RW))), block 256
template <class K, int NT, int RW, bool XS = false>
__device__ __forceinline__ void imvk_impl(const u8* __restrict__ W, long long row_bytes, int rows,
                                          int cols, const i8* __restrict__ aq,
                                          const float* __restrict__ ad, const int* __restrict__ abs_,
                                          float* __restrict__ y, int n, int bx) {
    typedef QWinC<K::BB, 256> Q;
    constexpr int QW = 8;
    extern __shared__ __align__(16) u8 qsm[];
    long long* part = (long long*)(qsm + QW * 2 * 16 * Q::WIN);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    constexpr int CW = QW / RW;
    const int rb = bx * 16 * RW;
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, rb + (warp % RW) * 16, rows};
    const int nch = cols / 256;
    // A warp whose rows all lie past the end takes no chunks.
    const int c0 = R.rb < rows ? warp / RW : nch;
    // The activations and their per-16 sums: read where they lie, or (XS) copied once into
    // shared memory behind the sums (rows cols + 16 bytes apart: a quad's lanes on distinct banks).
    const i8* xa = aq;
    const int* xb = abs_;
    long long xst = cols;
    if constexpr (XS) {
        u8* xs = (u8*)(part + QW * 16 * 8 * NT);
        const int xstr = cols + 16, cpr = cols / 16, bpr = cols / 64;
        int* bsm = (int*)(xs + 8 * NT * xstr);
        for (int i = threadIdx.x; i < n * cpr; i += blockDim.x) {
            const int t = i / cpr, c = i - t * cpr;
            cp_async16(xs + t * xstr + 16 * c, aq + (long long)t * cols + 16 * c, true);
        }
        if (K::SUMS)
            for (int i = threadIdx.x; i < n * bpr; i += blockDim.x) {
                const int t = i / bpr, c = i - t * bpr;
                cp_async16((u8*)bsm + t * (cols / 4) + 16 * c, (const u8*)(abs_ + (long long)t * (cols / 16)) + 16 * c, true);
            }
        cp_async_commit();
        xa = (const i8*)xs;
        xb = bsm;
        xst = xstr;
    }
    long long acc[NT][4];
    bool tok[NT];
    const i8* xr[NT];
    int tk[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;
        tok[nt] = nt * 8 + g < n;
        xr[nt] = xa + (tok[nt] ? nt * 8 + g : 0) * xst;
        tk[nt][0] = min(nt * 8 + 2 * q, n - 1), tk[nt][1] = min(nt * 8 + 2 * q + 1, n - 1);
    }
    auto wbuf = [&](int b) { return qsm + (warp * 2 + b) * 16 * Q::WIN; };
    if (c0 < nch) qmm_copy_w<Q>(wbuf(0), R, 2 * c0);
    cp_async_commit();
    if constexpr (XS) {
        // This thread's activation copies done (the weights' may still be in flight), then
        // every thread's.
        cp_async_wait<1>();
        __syncthreads();
    }
    for (int c = c0, i = 0; c < nch; c += CW, i++) {
        if (c + CW < nch) qmm_copy_w<Q>(wbuf((i + 1) & 1), R, 2 * (c + CW));
        cp_async_commit();
        cp_async_wait<1>();
        __syncwarp();
        const u8* win = wbuf(i & 1);
        const u8* b0 = win + g * Q::WIN + (int)((u64)(R.row(g) + Q::start(2 * c)) & 15);
        const u8* b1 = win + (g + 8) * Q::WIN + (int)((u64)(R.row(g + 8) + Q::start(2 * c)) & 15);
        int S1[NT][4], S2[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) S1[nt][e] = S2[nt][e] = 0;
        for (int jj = 0; jj < 8; jj++) {
            const typename K::Pair p = K::pair(b0, b1, jj, q);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const u32* xp = (const u32*)(xr[nt] + c * 256 + jj * 32 + 4 * q);
                int asum[2] = {0, 0};
                if (K::SUMS) {
#pragma unroll
                    for (int t = 0; t < 2; t++) {
                        const int* bs = xb + (long long)tk[nt][t] * (cols / 16) + c * 16 + 2 * jj;
                        asum[t] = bs[0] + bs[1];
                    }
                }
                K::acc(p, tok[nt] ? xp[0] : 0u, tok[nt] ? xp[4] : 0u, asum, S1[nt], S2[nt]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float da = ad[(long long)tk[nt][e & 1] * nch + c];
                acc[nt][e] += fix_of(K::term(da, (e >> 1) ? b1 : b0, S1[nt][e], S2[nt][e]));
            }
        __syncwarp();
    }
    imv_finish<NT, RW>(part, acc, rb, rows, y, n);
}

// The kernels of a type T (a tag of quant.cu; registry.rs `kernels`): the 32-blocks' forms
// (imm_impl, imv_impl) or the K-quants' (immk_impl, imvk_impl). imv takes NT n8 tiles (8 or
// 16 tokens).
template <class T>
__global__ void __launch_bounds__(32 * QMM_WARPS)
    imm(const u8* __restrict__ W, long long row_bytes, int rows, int cols, const i8* __restrict__ aq,
        const float* __restrict__ ad, const int* __restrict__ abs_, float* __restrict__ y, int n, long long* part,
        unsigned* cnt) {
    pdl_begin();
    if constexpr (T::VALUES == 32)
        imm_impl<iw<T>, T::BYTES, T::MIN == 1>(W, row_bytes, rows, cols, aq, ad, y, n, part, cnt);
    else
        immk_impl<IK<T>>(W, row_bytes, rows, cols, aq, ad, abs_, y, n, part, cnt);
}
// imv over the experts of a mixture: tile blockIdx.y of `tiles` (ops.cu moe_group with 8·NT
// pairs a tile: expert e, its c-th 8·NT pairs) takes expert e's `rows` rows at row
// e·expert_rows against those pairs' activations (sorted by expert: rows off[e] + 8·NT·c on),
// into the same rows of y: the same bits as moeqc (and imv, imm) for each pair, for a decode
// step's few pairs an expert. Two products over the same activations in one launch (gate and
// up): the first `nb` row blocks take W and y, the rest W2 and y2.
//                                 grid (nb + blocks of W2, at most tiles), block 256
template <class T, int NT, int RW, bool XS>
__global__ void __launch_bounds__(256)
    imv_g(const u8* __restrict__ W, const u8* __restrict__ W2, long long row_bytes, long long expert_rows,
          int rows, int cols, const i8* __restrict__ aq, const float* __restrict__ ad,
          const int* __restrict__ abs_, float* __restrict__ y, float* __restrict__ y2, int nb,
          const int* __restrict__ off, const int* __restrict__ tiles) {
    pdl_begin();
    if ((int)blockIdx.y >= tiles[0]) return;
    const int tl = tiles[1 + blockIdx.y], e = tl >> 16, o = off[e] + (tl & 0xffff) * 8 * NT;
    const int n = min(off[e + 1] - o, 8 * NT);
    const bool second = (int)blockIdx.x >= nb;
    const u8* We = (second ? W2 : W) + (long long)e * expert_rows * row_bytes;
    float* yo = (second ? y2 : y) + (long long)o * rows;
    // imv_impl / imvk_impl read blockIdx.x as their row block.
    const int bx = second ? (int)blockIdx.x - nb : (int)blockIdx.x;
    if constexpr (T::VALUES == 32)
        imv_impl<iw<T>, T::BYTES, T::MIN == 1, NT, RW>(We, row_bytes, rows, cols, aq + (long long)o * cols,
                                                       ad + (long long)o * (cols / 32) * 2, yo, n, bx);
    else
        imvk_impl<KQ<T>, NT, RW, XS>(We, row_bytes, rows, cols, aq + (long long)o * cols, ad + (long long)o * (cols / 256),
                                 abs_ + (long long)o * (cols / 16), yo, n, bx);
}
template <class T, int NT>
__global__ void __launch_bounds__(256)
    imv(const u8* __restrict__ W, long long row_bytes, int rows, int cols, const i8* __restrict__ aq,
        const float* __restrict__ ad, const int* __restrict__ abs_, float* __restrict__ y, int n) {
    pdl_begin();
    if constexpr (T::VALUES == 32)
        imv_impl<iw<T>, T::BYTES, T::MIN == 1, NT, 1>(W, row_bytes, rows, cols, aq, ad, y, n, blockIdx.x);
    else
        imvk_impl<KQ<T>, NT, 1>(W, row_bytes, rows, cols, aq, ad, abs_, y, n, blockIdx.x);
}
