// ---- Hopper's warpgroup products straight from the GGUF blocks (prompt rows, sm_90a) ----
// y[t, r] = W[r, :] · x[t, :] for t < n, like qmm (qmm.cu), on wgmma: the weights are
// dequantized to f16 in registers by qmm's fragments (qmm_frag: the same lanes, groups and
// permuted k order) and are wgmma's A operand (m64nNk16, A from registers); the activations
// are its B operand, read by the tensor cores from shared memory.
//
// Order of summation: one f32 accumulator per output element, the columns' stages of 128 in
// ascending order, 8 steps of 16 values each (one wgmma, the values of qmm's step s). It depends
// on `cols` only: a token's result is the same bits whatever the number of tokens, the tile it
// falls in and the tile's width (BN, 64 or 128 tokens: the same per-element products).
//
// The activations come permuted (f16_permute, ops.cu: within each stage of 128 columns,
// position 16s + kk holds the value qmm's step s takes at k position kk, the rows padded with
// zeros to whole stages), so that wgmma's 8×8 core matrices are 16-byte pieces of a token's row.
// A stage's tile sits in shared memory in the canonical no-swizzle K-major layout: core matrix
// (kc, ng) — positions 8kc..8kc+7 of tokens 8ng..8ng+7 — at (kc · BN/8 + ng) · 128 bytes; step
// s reads kc = 2s, 2s + 1 (leading byte offset BN/8 · 128 between them, stride 128 between
// groups of 8 tokens).
//
// Pipeline: every thread copies (cp.async) a share of the activations and its warp's weight
// windows (qmm_copy_w), NST - 1 stages ahead; a warpgroup issues its stage's 8 wgmma and, while
// they run, sends the copies of a later stage and dequantizes the next stage's fragments into
// the other register set. One block barrier a stage.
//
// CTA: BM weight rows (64 or 128: one or two warpgroups of 64, warp w rows 16w..16w+15) × BN
// tokens (64 or 128); the launcher picks the largest tile that still fills the device.
//                              grid (ceil(n / BN), ceil(rows / BM)), block 2·BM, dynamic smem

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WMM_ON 1
__device__ __forceinline__ void wgmma_n128(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_n64(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
#endif

// Keeps the compiler from moving register work across the asynchronous products: the values
// are read and written here, as far as it knows.
template <int N>
__device__ __forceinline__ void keep_f(float* d) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void keep_a(u32 (*a)[4]) {
#pragma unroll
    for (int s = 0; s < 8; s++)
#pragma unroll
        for (int i = 0; i < 4; i++) asm volatile("" : "+r"(a[s][i])::"memory");
}
__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// A shared-memory matrix descriptor, no swizzle: start, leading byte offset (the K direction),
// stride byte offset (the M/N direction), all in 16-byte units.
__device__ __forceinline__ u64 wmm_desc(const void* p, u32 lbo, u32 sbo) {
    return (u64)((smem_u32(p) & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

// Stage j of the permuted activations (tokens n0..n0+BN-1) into `dst` as the canonical layout,
// by TH threads.
template <int BN, int TH>
__device__ __forceinline__ void wmm_copy_x(u8* dst, const u16* __restrict__ xp, int colsp, int n, int n0,
                                           int j) {
#pragma unroll
    for (int r = 0; r < BN * 16 / TH; r++) {
        const int i = threadIdx.x + TH * r;
        const int kc = (i >> 3) & 15, t = (i >> 7) * 8 + (i & 7);
        const bool ok = n0 + t < n;
        cp_async16(dst + ((kc * (BN / 8) + (t >> 3)) * 8 + (t & 7)) * 16,
                   ok ? xp + (long long)(n0 + t) * colsp + j * QMM_BK + kc * 8 : xp, ok);
    }
}

// The stage sizes: activations BN × 128 halves, weights BM rows × the window.
template <int BB, int BV, int BM, int BN>
struct WmmSmem {
    static constexpr int X = BN * QMM_BK * 2;
    static constexpr int W = BM * QWin<BB, BV>::WIN;
    // Stages in flight: 4 where they fit the 227 KiB a block may take, else fewer.
    static constexpr int NST = 4 * (X + W) <= 227 * 1024 ? 4 : 3 * (X + W) <= 227 * 1024 ? 3 : 2;
    static constexpr int BYTES = NST * (X + W);
};

template <DeqFn DEQ, int BB, int BV, int BM, int BN>
__device__ __forceinline__ void wmm_impl(const u8* __restrict__ W, long long row_bytes, int rows, int cols,
                                         const u16* __restrict__ xp, float* __restrict__ y, int n) {
#ifdef WMM_ON
    typedef QWin<BB, BV> Q;
    typedef WmmSmem<BB, BV, BM, BN> S;
    constexpr int TH = 2 * BM;
    constexpr int NST = S::NST;
    extern __shared__ __align__(128) u8 wsm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * BN;
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, (int)blockIdx.y * BM + warp * 16, rows};
    const int ng = cols / 32, nst = (cols + QMM_BK - 1) / QMM_BK, colsp = nst * QMM_BK;
    auto xbuf = [&](int b) { return wsm + b * S::X; };
    auto wbuf = [&](int b) { return wsm + NST * S::X + (b * (BM / 16) + warp) * 16 * Q::WIN; };
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
    // Stages 0..NST-2 in flight; stage j (j ≥ 0) sends stage j + NST - 1 into the buffers that
    // stage j - 1 used, once every warpgroup is past stage j - 1's products.
#pragma unroll
    for (int st = 0; st < NST - 1; st++) {
        if (st < nst) {
            wmm_copy_x<BN, TH>(xbuf(st), xp, colsp, n, n0, st);
            qmm_copy_w<Q>(wbuf(st), R, st);
        }
        cp_async_commit();
    }
    u32 a0[8][4], a1[8][4];
    cp_async_wait<NST - 2>();
    __syncwarp();
    qmm_frag<DEQ, Q>(a0, wbuf(0), R, 0, ng);
    // Stage j: its products from `cur`; while they run, the copies of stage j + NST - 1 and
    // the next stage's fragments into `nxt`.
    auto stage = [&](u32 (*cur)[4], u32 (*nxt)[4], int j) {
        // Every thread's copies of stage j are complete (waited for before its fragments):
        // visible to the tensor cores' reads once all have passed the barrier, which also
        // finds every warpgroup done with stage j - 1's buffers.
        fence_async_smem();
        __syncthreads();
        wg_fence();
        keep_f<BN / 2>(d);
        keep_a(cur);
        const u8* xb = xbuf(j % NST);
#pragma unroll
        for (int s = 0; s < 8; s++) {
            const u64 desc = wmm_desc(xb + s * 2 * (BN / 8) * 128, (BN / 8) * 128, 128);
            if constexpr (BN == 128)
                wgmma_n128(d, cur[s], desc);
            else
                wgmma_n64(d, cur[s], desc);
        }
        wg_commit();
        keep_f<BN / 2>(d);
        const int st = j + NST - 1, b = st % NST;
        if (st < nst) {
            wmm_copy_x<BN, TH>(xbuf(b), xp, colsp, n, n0, st);
            qmm_copy_w<Q>(wbuf(b), R, st);
        }
        cp_async_commit();
        if (j + 1 < nst) {
            // A warp's weight windows are its own copies.
            cp_async_wait<NST - 2>();
            __syncwarp();
            qmm_frag<DEQ, Q>(nxt, wbuf((j + 1) % NST), R, j + 1, ng);
        }
        wg_wait0();
        keep_f<BN / 2>(d);
        keep_a(cur);
    };
    for (int j = 0; j < nst; j += 2) {
        stage(a0, a1, j);
        if (j + 1 < nst) stage(a1, a0, j + 1);
    }
    // d: for n8 tile i, (row g, tokens 8i + 2q, +1), (row g + 8, the same tokens).
#pragma unroll
    for (int i = 0; i < BN / 8; i++) {
        const int t = n0 + 8 * i + 2 * q;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int rr = R.rb + g + (e >> 1) * 8, tt = t + (e & 1);
            if (rr < rows && tt < n) y[(long long)tt * rows + rr] = d[4 * i + e];
        }
    }
#else
    __trap();
#endif
}

// The kernels of a type T (registry.rs `kernels`): wmm<T, BM, BN> for the tiles the launcher
// picks from.
template <class T, int BM, int BN>
__global__ void __launch_bounds__(2 * BM, 1)
    wmm(const u8* __restrict__ W, long long row_bytes, int rows, int cols, const u16* __restrict__ xp,
        float* __restrict__ y, int n) {
    pdl_begin();
    wmm_impl<deqh<T>, T::BYTES, T::VALUES, BM, BN>(W, row_bytes, rows, cols, xp, y, n);
}
