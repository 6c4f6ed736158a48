// ---- Tensor-core products straight from the GGUF blocks (prefill, batched decode) ----
// y[t, r] = W[r, :] · x[t, :] for t < n, with x in f16 (xh [n, cols], as to_half writes it) and
// W in its GGUF type: the weights are dequantized (deqh<T> below) to f16 in registers and
// multiplied with mma.sync m16n8k16, f32 accumulate. Nothing is copied at load.
//
// One order of summation per output element, which depends on `cols` only: stages of 128
// columns in ascending order, 8 steps of 16 values each (one mma, the values as below), the sum
// restarting from zero every QMM_CHUNK (256) columns and the chunk sums added left to right,
// from zero. The number of tokens, the tile a token falls in and its neighbours change nothing:
// a token's result is the same bits in any batch. (The chunks let the decode kernel, qmv, split
// a row's columns over warps and still give these bits.)
//
// The k order inside a stage of 128 columns (four 32-value groups) is permuted so that each lane
// dequantizes whole groups: mma step s (0..7) of a stage takes, from each group q (0..3),
// values 4s..4s+3, and the lane of quad position q holds exactly those of its rows. So lane
// (g = lane / 4, q = lane % 4) of warp w calls deqh<T> for group q of rows 16w + g and 16w + g + 8
// and feeds their values 4s..4s+3 to step s: no value is dequantized twice. The activations are
// staged in the same permuted order, one 8-byte load per lane per (step, 8 tokens).
//
// The weights' bytes of a stage (per row: the four 32-blocks, or the 256-block that holds the
// stage) are copied to shared memory with cp.async, QMM_NST stages ahead, and dequantized from
// there. The copy starts at the 16-byte boundary below the bytes, so they keep the alignment
// deqh<T> relies on.
//
// CTA: 64 weight rows × 64 tokens, 4 warps of 16 rows × 64 tokens.
//                                 grid (ceil(n / 64), ceil(rows / 64), S), block 128, dynamic smem
// With S > 1 (split-K, for steps whose tiles do not fill the GPU: batched decode; not batch
// invariant, so never in that mode) block z takes the chunks [z·nch/S, (z+1)·nch/S) of the
// row's nch and writes its sum to y + z·n·rows; sum_splits (ops.cu) adds the S partials.
#define QMM_WARPS 4
#define QMM_BM (16 * QMM_WARPS)
#define QMM_BN 64
#define QMM_BK 128
#define QMM_CHUNK 256
#define QMM_NST 3
// A token's row of a staged activation tile: 128 halves and 16 of padding (72 words, 8 mod 32:
// the 8-byte loads of a half-warp hit 32 banks).
#define QMM_XLD 144

typedef void (*DeqFn)(const u8*, int, u32*);

// ---- A group's 32 values as 16 f16 pairs, (0,1), (2,3), … (deqh<T>) ----
// The quantized integers become f16 without a conversion instruction (those run at a quarter of
// the rate): 0x6400 | u is the f16 1024 + u for 0 ≤ u < 1024, and subtracting 1024 (plus the
// type's offset) is exact. For Q4_0 and Q8_0 the value is then (q · d) rounded once, the same
// bits as deq_T's f32 product rounded to f16; the K-quants' scales (d · sc, dmin · m) are
// rounded to f16 first. Types without a deqh of their own take T::deq's values (the generic
// deqh<T>).
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
// Bytes 0 and 1 (SEL_01), or 2 and 3 (SEL_23), of a word into the low byte of each half.
#define SEL_01 0x4140
#define SEL_23 0x4342
#define H2(h) ((u32)(h) | ((u32)(h) << 16))

template <class T>
__device__ __forceinline__ void deqh(const u8* row, int g, u32* h) {
    float v[32];
    T::deq(row, g, v);
#pragma unroll
    for (int p = 0; p < 16; p++) h[p] = pack_h2(v[2 * p], v[2 * p + 1]);
}
template <>
__device__ __forceinline__ void deqh<Q4_0>(const u8* row, int g, u32* h) {
    const u8* b = row + g * 18;
    const u32 d = H2(ld_u16(b));
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 w = ld_u32_2a(b + 2 + 4 * i);
        const u32 x01 = prmt(w, 0, SEL_01), x23 = prmt(w, 0, SEL_23);
        // Values 4i..4i+3 are the low nibbles, 16 + 4i.. the high ones; q − 8 exactly.
        h[2 * i] = hmul2(hsub2((x01 & 0x000F000F) | 0x64006400, 0x64086408), d);
        h[2 * i + 1] = hmul2(hsub2((x23 & 0x000F000F) | 0x64006400, 0x64086408), d);
        h[8 + 2 * i] = hmul2(hsub2(((x01 >> 4) & 0x000F000F) | 0x64006400, 0x64086408), d);
        h[8 + 2 * i + 1] = hmul2(hsub2(((x23 >> 4) & 0x000F000F) | 0x64006400, 0x64086408), d);
    }
}
template <>
__device__ __forceinline__ void deqh<Q8_0>(const u8* row, int g, u32* h) {
    const u8* b = row + g * 34;
    const u32 d = H2(ld_u16(b));
#pragma unroll
    for (int i = 0; i < 8; i++) {
        // q + 128 as an unsigned byte under 0x64: 1152 + q, less 1152 exactly.
        const u32 x = ld_u32_2a(b + 2 + 4 * i) ^ 0x80808080u;
        h[2 * i] = hmul2(hsub2(prmt(x, 0x64646464, 0x5140), 0x64806480), d);
        h[2 * i + 1] = hmul2(hsub2(prmt(x, 0x64646464, 0x7362), 0x64806480), d);
    }
}
template <>
__device__ __forceinline__ void deqh<Q4_K>(const u8* row, int g, u32* h) {
    const u8* b = row + (g >> 3) * 144;
    const int s = g & 7, shift = (s & 1) * 4;
    float sc, mn;
    k4_scale_min(b + 4, s, sc, mn);
    const u32 dl = H2(f2h(h2f(ld_u16(b)) * sc)), nml = H2(f2h(-(h2f(ld_u16(b + 2)) * mn)));
    const uint4* q4 = (const uint4*)(b + 16 + (s >> 1) * 32);
#pragma unroll
    for (int v = 0; v < 2; v++) {
        const uint4 qq = q4[v];
        const u32 ws[4] = {qq.x, qq.y, qq.z, qq.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 x01 = prmt(ws[i], 0, SEL_01) >> shift, x23 = prmt(ws[i], 0, SEL_23) >> shift;
            h[8 * v + 2 * i] = hfma2(hsub2((x01 & 0x000F000F) | 0x64006400, 0x64006400), dl, nml);
            h[8 * v + 2 * i + 1] = hfma2(hsub2((x23 & 0x000F000F) | 0x64006400, 0x64006400), dl, nml);
        }
    }
}
template <>
__device__ __forceinline__ void deqh<Q6_K>(const u8* row, int g, u32* h) {
    const u8* b = row + (g >> 3) * 210;
    const int s = g & 7, hf = s >> 2, k = s & 3, shift = (k >> 1) * 4;
    const float d = h2f(ld_u16(b + 208));
    const i8* sc = (const i8*)(b + 192 + hf * 8 + 2 * k);
    const u32 dl0 = H2(f2h(d * sc[0])), dl1 = H2(f2h(d * sc[1]));
    const u8* ql = b + hf * 64 + (k & 1) * 32;
    const u8* qh = b + 128 + hf * 32;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 w = ld_u32_2a(ql + 4 * i), e = ld_u32_2a(qh + 4 * i);
        const u32 dl = i < 4 ? dl0 : dl1;
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const u32 sel = p ? SEL_23 : SEL_01;
            const u32 lo = (prmt(w, 0, sel) >> shift) & 0x000F000F;
            const u32 hi = ((prmt(e, 0, sel) >> (2 * k)) & 0x00030003) << 4;
            // 1056 = 1024 + 32: q − 32 exactly.
            h[2 * i + p] = hmul2(hsub2(lo | hi | 0x64006400, 0x64206420), dl);
        }
    }
}
template <>
__device__ __forceinline__ void deqh<F16>(const u8* row, int g, u32* h) {
    const uint4* p = (const uint4*)(row + g * 64);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint4 u = p[i];
        h[4 * i] = u.x;
        h[4 * i + 1] = u.y;
        h[4 * i + 2] = u.z;
        h[4 * i + 3] = u.w;
    }
}
// Where a stage's weight bytes lie in a row, for blocks of BB bytes holding BV (32 or 256) values
// (qmm: one stage's bytes per copy).
template <int BB, int BV>
struct QWin {
    static constexpr int LEN = BV == 32 ? 4 * BB : BB;
    // Bytes a row's copy takes in shared memory: LEN from any alignment, whole 16-byte pieces.
    static constexpr int WIN = (LEN + 30) / 16 * 16;
    __device__ static int start(int j) { return BV == 32 ? j * 4 * BB : (j >> 1) * BB; }
    // The group of the copy that holds group 4j + q of the row.
    __device__ static int group(int j, int q) { return BV == 32 ? q : 4 * (j & 1) + q; }
};
// qmv's copies: a chunk's bytes (stages 2c and 2c + 1, 256 columns) per copy.
template <int BB, int BV>
struct QWinC {
    static constexpr int LEN = BV == 32 ? 8 * BB : BB;
    static constexpr int WIN = (LEN + 30) / 16 * 16;
    __device__ static int start(int j) { return (j >> 1) * LEN; }
    __device__ static int group(int j, int q) { return 4 * (j & 1) + q; }
};

// The 16 rows of a warp: row i (0..15) of the tile starting at row `rb`, past the last read as
// the last (its results are never stored).
struct QRows {
    const u8* W;
    const u8* end;
    long long row_bytes;
    int rb, rows;
    __device__ const u8* row(int i) const { return W + (long long)min(rb + i, rows - 1) * row_bytes; }
};

// Copies stage j's window (Q) of the warp's 16 rows to `win` (16 × WIN bytes).
template <class Q>
__device__ __forceinline__ void qmm_copy_w(u8* win, const QRows& R, int j) {
    constexpr int CH = Q::WIN / 16;
    for (int i = threadIdx.x & 31; i < 16 * CH; i += 32) {
        const int r = i / CH, c = i - r * CH;
        const u8* a = (const u8*)((u64)(R.row(r) + Q::start(j)) & ~15ull) + 16 * c;
        cp_async16(win + r * Q::WIN + 16 * c, a < R.end ? a : R.W, a < R.end);
    }
}

// This lane's A fragments of stage j from the copy in `win` (window Q): a[s] for step s.
template <DeqFn DEQ, class Q>
__device__ __forceinline__ void qmm_frag(u32 (*a)[4], const u8* win, const QRows& R, int j, int ng) {
    const int g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
    const bool ok = 4 * j + q < ng;
    u32 hv[16];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const u8* src = R.row(g + 8 * h) + Q::start(j);
        DEQ(win + (g + 8 * h) * Q::WIN + ((u64)src & 15), Q::group(j, q), hv);
#pragma unroll
        for (int s = 0; s < 8; s++) {
            a[s][h] = ok ? hv[2 * s] : 0u;
            a[s][2 + h] = ok ? hv[2 * s + 1] : 0u;
        }
    }
}

// Stage j of the activations (columns 128j..128j+127 of tokens n0..n0+63) into `dst`, permuted:
// values 4p..4p+3 of the stage (group p / 8, step p % 8) at step·16 + group·4.
__device__ __forceinline__ void qmm_copy_x(u16* dst, const u16* __restrict__ xh, int cols, int n,
                                           int n0, int j) {
#pragma unroll
    for (int c = 0; c < QMM_BN * 32 / (32 * QMM_WARPS); c++) {
        const int i = threadIdx.x + 32 * QMM_WARPS * c;
        const int t = i >> 5, p = i & 31;
        const int k = j * QMM_BK + 4 * p;
        const bool ok = n0 + t < n && k < cols;
        cp_async8(dst + t * QMM_XLD + (p & 7) * 16 + (p >> 3) * 4,
                  ok ? xh + (long long)(n0 + t) * cols + k : xh, ok);
    }
}

// A warp's 16 rows × 64 tokens of results (the mma's C layout: lane (g, q) holds rows g and
// g + 8, tokens 2q and 2q + 1 of each n8 tile) into y [n, rows].
template <typename V>
__device__ __forceinline__ void qmm_store(const V (*tot)[4], const QRows& R, int n0, int rows,
                                          V* __restrict__ y, int n) {
    const int g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        const int t = n0 + nt * 8 + 2 * q;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int rr = R.rb + g + (e >> 1) * 8, tt = t + (e & 1);
            if (rr < rows && tt < n) y[(long long)tt * rows + rr] = tot[nt][e];
        }
    }
}

template <DeqFn DEQ, int BB, int BV>
__device__ __forceinline__ void qmm_impl(const u8* __restrict__ W, long long row_bytes, int rows,
                                         int cols, const u16* __restrict__ xh,
                                         float* __restrict__ y, int n, int n0) {
    typedef QWin<BB, BV> Q;
    extern __shared__ __align__(16) u8 qsm[];
    u16* Xs = (u16*)qsm;
    u8* Ws = qsm + QMM_NST * QMM_BN * QMM_XLD * 2;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, (int)blockIdx.y * QMM_BM + warp * 16, rows};
    const int ng = cols / 32, nst = (cols + QMM_BK - 1) / QMM_BK;
    // This block's stages: all of them, or split z's whole chunks (two stages each).
    const int nch = (nst + 1) / 2, S = gridDim.z, z = blockIdx.z;
    const int j0 = 2 * (z * nch / S), j1 = min(2 * ((z + 1) * nch / S), nst);
    y += (long long)z * n * rows;
    auto wbuf = [&](int b) { return Ws + (b * QMM_WARPS + warp) * 16 * Q::WIN; };
    auto xbuf = [&](int b) { return Xs + b * QMM_BN * QMM_XLD; };
    float acc[8][4], tot[8][4];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[i][e] = tot[i][e] = 0.f;
#pragma unroll
    for (int st = 0; st < QMM_NST - 1; st++) {
        if (j0 + st < j1) {
            qmm_copy_x(xbuf(st), xh, cols, n, n0, j0 + st);
            qmm_copy_w<Q>(wbuf(st), R, j0 + st);
        }
        cp_async_commit();
    }
    for (int j = j0; j < j1; j++) {
        cp_async_wait<QMM_NST - 2>();
        __syncthreads();
        const int st = j + QMM_NST - 1, b = (j - j0) % QMM_NST;
        if (st < j1) {
            qmm_copy_x(xbuf((b + QMM_NST - 1) % QMM_NST), xh, cols, n, n0, st);
            qmm_copy_w<Q>(wbuf((b + QMM_NST - 1) % QMM_NST), R, st);
        }
        cp_async_commit();
        u32 a[8][4];
        qmm_frag<DEQ, Q>(a, wbuf(b), R, j, ng);
        const u16* xs = xbuf(b);
#pragma unroll
        for (int s = 0; s < 8; s++)
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const uint2 b = *(const uint2*)(xs + (nt * 8 + g) * QMM_XLD + s * 16 + q * 4);
                mma_16816(acc[nt], a[s], b.x, b.y);
            }
        if (((j + 1) * QMM_BK) % QMM_CHUNK == 0 || j + 1 == j1) {
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    tot[i][e] += acc[i][e];
                    acc[i][e] = 0.f;
                }
        }
    }
    qmm_store(tot, R, n0, rows, y, n);
}

// The decode kernels' last step: one thread per (row, token) of the block's 16 rows adds the
// chunk sums (`part`, [chunk][row · 8 + token]) left to right from 0 and stores the total.
__device__ __forceinline__ void qmv_total(const float* part, int nch, const QRows& R, int rows,
                                          float* __restrict__ y, int n) {
    if (threadIdx.x < 128) {
        const int row = threadIdx.x >> 3, t = threadIdx.x & 7;
        if (t < n && R.rb + row < rows) {
            float tot = 0.f;
            for (int c = 0; c < nch; c++) tot = __fadd_rn(tot, part[c * 128 + row * 8 + t]);
            y[(long long)t * rows + R.rb + row] = tot;
        }
    }
}

// ---- The same products for decode (n ≤ 8 tokens): the same bits as qmm ----
// A block takes 16 rows and all their columns; warp w takes the chunks (QMM_CHUNK columns,
// two stages) w, w + QW, …, each summed from zero exactly as qmm sums a chunk (same stages,
// steps, fragments and k order), for tokens 0..7 as one n8 tile whose activations come straight
// from xh. A warp copies a chunk's weight bytes of its 16 rows to shared memory with cp.async
// while it multiplies the previous chunk (two buffers). The chunk sums meet in shared memory and
// one thread per (row, token) adds them left to right, from 0, as qmm does. Every chunk of a row
// is in flight at once when the row has at most 2·QW chunks (cols ≤ 4096 with QW = 8).
//                                 grid (ceil(rows / 16)), block 32·QW, dynamic smem
template <DeqFn DEQ, int BB, int BV, int QW>
__device__ __forceinline__ void qmv_impl(const u8* __restrict__ W, long long row_bytes, int rows,
                                         int cols, const u16* __restrict__ xh,
                                         float* __restrict__ y, int n) {
    typedef QWinC<BB, BV> Q;
    extern __shared__ __align__(16) u8 qsm[];
    // After the warps' copies: the chunk sums, [chunk][row · 8 + token].
    float* part = (float*)(qsm + QW * 2 * 16 * Q::WIN);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, (int)blockIdx.x * 16, rows};
    const int ng = cols / 32, nst = (cols + QMM_BK - 1) / QMM_BK;
    const int nch = (nst + 1) / 2;
    auto wbuf = [&](int b) { return qsm + (warp * 2 + b) * 16 * Q::WIN; };
    // Token g's activations (zeros past the last token).
    const bool tok = g < n;
    const u16* xr = xh + (long long)(tok ? g : 0) * cols;
    if (warp < nch) qmm_copy_w<Q>(wbuf(0), R, 2 * warp);
    cp_async_commit();
    for (int c = warp, i = 0; c < nch; c += QW, i++) {
        if (c + QW < nch) qmm_copy_w<Q>(wbuf((i + 1) & 1), R, 2 * (c + QW));
        cp_async_commit();
        cp_async_wait<1>();
        __syncwarp();
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const int j1 = min(2 * c + 2, nst);
        for (int j = 2 * c; j < j1; j++) {
            u32 a[8][4];
            qmm_frag<DEQ, Q>(a, wbuf(i & 1), R, j, ng);
            const int k = j * QMM_BK + 32 * q;
            const bool ok = tok && k < cols;
            const uint2* xp = (const uint2*)(xr + (ok ? k : 0));
#pragma unroll
            for (int s = 0; s < 8; s++) {
                uint2 b = ok ? xp[s] : make_uint2(0, 0);
                mma_16816(acc, a[s], b.x, b.y);
            }
        }
        // acc: (row g, tokens 2q, 2q+1), (row g + 8, the same tokens).
#pragma unroll
        for (int e = 0; e < 4; e++) part[c * 128 + ((e >> 1) * 8 + g) * 8 + 2 * q + (e & 1)] = acc[e];
        // Every lane is done with buffer i & 1 before the next copy into it.
        __syncwarp();
    }
    __syncthreads();
    qmv_total(part, nch, R, rows, y, n);
}

// Warps of a qmv block: 8, or 4 where a chunk's copy is large (F32, F16, BF16 rows), so that
// the two buffers per warp stay near 64 KiB (products.rs `qmv_warps`).
#define QMV_WARPS(BB, BV) (QWinC<BB, BV>::WIN > 384 ? 4 : 8)

// The kernels of a type T (a tag of quant.cu; registry.rs `kernels`).
template <class T>
__global__ void __launch_bounds__(32 * QMM_WARPS)
    qmm(const u8* __restrict__ W, long long row_bytes, int rows, int cols, const u16* __restrict__ xh,
        float* __restrict__ y, int n) {
    pdl_begin();
    qmm_impl<deqh<T>, T::BYTES, T::VALUES>(W, row_bytes, rows, cols, xh, y, n, blockIdx.x * QMM_BN);
}
// The experts' grouped product (MoE): tile i of the list (tiles[0] of them) is 64 tokens of one
// expert e (tiles[1 + i] = e << 16 | chunk), its rows off[e].. of xh and y, its weights the
// [rows, cols] at row e · expert_rows of W (expert_rows = rows, or 2 · rows where an expert's gate
// and up lie in one tensor). grid (at most tiles, ceil(rows / 64)); other blocks return.
template <class T>
__global__ void __launch_bounds__(32 * QMM_WARPS)
    qmm_g(const u8* __restrict__ W, long long row_bytes, long long expert_rows, int rows, int cols,
          const u16* __restrict__ xh, float* __restrict__ y, const int* __restrict__ off,
          const int* __restrict__ tiles) {
    pdl_begin();
    if ((int)blockIdx.x >= tiles[0]) return;
    const int tl = tiles[1 + blockIdx.x], e = tl >> 16, o = off[e];
    qmm_impl<deqh<T>, T::BYTES, T::VALUES>(W + (long long)e * expert_rows * row_bytes, row_bytes, rows, cols,
                                           xh + (long long)o * cols, y + (long long)o * rows, off[e + 1] - o,
                                           (tl & 0xffff) * QMM_BN);
}
template <class T>
__global__ void __launch_bounds__(32 * QMV_WARPS(T::BYTES, T::VALUES))
    qmv(const u8* __restrict__ W, long long row_bytes, int rows, int cols, const u16* __restrict__ xh,
        float* __restrict__ y, int n) {
    pdl_begin();
    qmv_impl<deqh<T>, T::BYTES, T::VALUES, QMV_WARPS(T::BYTES, T::VALUES)>(W, row_bytes, rows, cols, xh, y, n);
}
