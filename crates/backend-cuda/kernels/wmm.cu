// ---- Hopper's warpgroup products straight from the GGUF blocks (prompt rows, sm_90a) ----
// y[t, r] = W[r, :] · x[t, :] for t < n, like qmm (qmm.cu), on wgmma: the weights are
// dequantized to f16 in registers by qmm's fragments (qmm_frag: the same lanes, groups and
// permuted k order) and are wgmma's A operand (m64nNk16, A from registers); the activations
// are its B operand, read by the tensor cores from shared memory.
//
// Order of summation: one f32 accumulator per output element, the columns' stages of 128 in
// ascending order, 8 steps of 16 values each (one wgmma, the values of qmm's step s). It depends
// on `cols` only: a token's result is the same bits whatever the number of tokens, the tile it
// falls in and the tile's width (BN, 64, 128, 192 or 256 tokens: the same per-element products).
//
// The activations come permuted and tiled (f32_permute, ops.cu): within each stage of 128
// columns, position 16s + kk holds the value qmm's step s takes at k position kk, and 16-byte
// piece c of every token (c over the padded row, 16 a stage) lies at (c · n + t) · 16 bytes. A
// stage's tile (tokens n0..n0+BN-1) is one box of a 2-D tensor map (a row of 8-byte units per
// piece c: the tokens' pieces, BN · 16 bytes in one run of it), which the tensor memory
// accelerator (TMA) writes in the canonical no-swizzle K-major
// layout wgmma reads: core matrix (kc, ng) — positions 8kc..8kc+7 of tokens 8ng..8ng+7 — at
// (kc · BN/8 + ng) · 128 bytes; step s reads kc = 2s, 2s + 1 (leading byte offset BN/8 · 128
// between them, stride 128 between groups of 8 tokens). Tokens past n come as zeros.
// The weights' windows (qmm_copy_w's bytes, from the 16-byte boundary at or below the stage's
// bytes) are one box of a 2-D tensor map over the rows (4-byte units, rows a multiple of 16
// bytes); bytes past a row's end and rows past `rows` come as zeros. Rows of 8-byte units (Q6_K
// and Q3_K at most widths: 22,680 bytes for the 32B's down projection) are read in pairs
// (`pairs`, wmm.rs `wmm_pairs`; past an odd count of rows memory holds one more): the map's rows
// are the pairs, a stage takes
// two boxes of BM / 2 pairs, the even rows' windows and the odd rows' (row_bytes further on);
// bytes past an even row's end are then its odd partner's, in groups the stage masks anyway.
//
// Pipeline (warp-specialized): one thread of the producer warp sends each stage's two tensor
// copies, completing on the stage's `full` barrier, NST stages ahead, reusing a buffer once
// every consumer warp has arrived on its `empty` barrier. Each consumer warpgroup issues stage
// j's 8 wgmma and, while they run, waits for stage j + 1 and dequantizes its fragments into the
// other register set; then it waits for its products and releases stage j. No block barrier in
// the loop.
//
// CTA: BM weight rows (64 or 128: one or two consumer warpgroups of 64, warp w rows
// 16w..16w+15) × BN tokens (64, 128, 192 or 256), and the producer warp; the launcher picks the
// tile by its waves over the multiprocessors (wmm.rs `wmm_tile`). A tile of 192 or 256 tokens is
// two halves of 96 or 128 (a box and an m64n96 / m64n128 product each, both from the same
// fragments: the dequantization serves twice the products), its accumulators 96 or 128
// registers a thread: the producer is a warpgroup that gives its registers to the consumers
// (setmaxnreg: 40 and 232 of the block's 168 a thread).
//                      grid (ceil(n / BN), ceil(rows / BM)), block 2·BM + WmmSmem::PT

// Where row r of a block's BM lies among a stage's windows: in order, or with `pairs` (rows of
// 8-byte units: two copies, the even rows' windows, then the odd rows') the even rows first.
__device__ __forceinline__ int wmm_slot(int r, int bm, bool pairs) { return pairs ? (r & 1) * (bm / 2) + (r >> 1) : r; }

// A lane's fragments of stage j from its warp's windows (qmm_frag's values, the same bits), the
// rows' offsets in their windows fixed for the kernel: a[s] for step s. `FULL`: the stage's 128
// columns are all in the row (every stage but a partial last one); else `ok` says whether this
// lane's group is.
template <DeqFn DEQ, class Q>
struct WFrag {
    u32 w0, w1;    // rows g's and g + 8's windows in the stage's (wmm_slot)
    u32 ra0, ra1;  // the rows' start addresses mod 16
    int q;
    __device__ WFrag(const QRows& R, int warp, int bm, bool pairs) {
        const int g = (threadIdx.x & 31) >> 2;
        q = threadIdx.x & 3;
        ra0 = (u32)(u64)R.row(g) & 15;
        ra1 = (u32)(u64)R.row(g + 8) & 15;
        w0 = wmm_slot(16 * warp + g, bm, pairs) * Q::WIN;
        w1 = wmm_slot(16 * warp + g + 8, bm, pairs) * Q::WIN;
    }
    template <bool FULL>
    __device__ __forceinline__ void frag(u32 (*a)[4], const u8* wins, int j, bool ok) const {
        const int grp = Q::group(j, q);
        const u32 st = (u32)Q::start(j);
        u32 hv[16];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 off = ((h ? ra1 : ra0) + st) & 15;
            DEQ(wins + (h ? w1 : w0) + off, grp, hv);
#pragma unroll
            for (int s = 0; s < 8; s++) {
                a[s][h] = FULL || ok ? hv[2 * s] : 0u;
                a[s][2 + h] = FULL || ok ? hv[2 * s + 1] : 0u;
            }
        }
    }
};

// The stage sizes: activations BN × 128 halves, weights BM rows × the window; after the stages,
// a full and an empty barrier per stage.
template <int BB, int BV, int BM, int BN>
struct WmmSmem {
    static constexpr int X = BN * QMM_BK * 2;
    static constexpr int W = BM * QWin<BB, BV>::WIN;
    static constexpr int FIT = 227 * 1024 - 64;
    // Stages in flight: 4 where they fit the 227 KiB a block may take, else fewer.
    static constexpr int NST = 4 * (X + W) <= FIT ? 4 : 3 * (X + W) <= FIT ? 3 : 2;
    static constexpr int BYTES = NST * (X + W) + 64;
    // Halves past 128 tokens (one box and one product each); producer threads.
    static constexpr int NH = BN > 128 ? 2 : 1, HN = BN / NH, PT = BN > 128 ? 128 : 32;
    static_assert(HN == 64 || HN == 96 || HN == 128, "a product of 64, 96 or 128 tokens");
    static_assert(BN <= 128 || BM == 128, "setmaxnreg's 40 + 2 · 232 registers are 384 threads' 168");
};

// A block's tile: tokens n0.. (stored below n) of the activations' map, weight rows
// blockIdx.y · BM.. of the matrix at W (`rows` rows), which are rows wr.. of the weights' map.
template <DeqFn DEQ, int BB, int BV, int BM, int BN>
__device__ __forceinline__ void wmm_impl(const TMap* xm, const TMap* wm, const u8* __restrict__ W, long long row_bytes,
                                         int rows, int cols, float* __restrict__ y, int n0, int n, int wr, bool pairs) {
#ifdef WG_ON
    typedef QWin<BB, BV> Q;
    typedef WmmSmem<BB, BV, BM, BN> S;
    constexpr int NST = S::NST, CW = 2 * BM / 32;  // consumer warps
    extern __shared__ __align__(128) u8 wsm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ng = cols / 32, nst = (cols + QMM_BK - 1) / QMM_BK;
    u64* full = (u64*)(wsm + NST * (S::X + S::W));
    u64* empty = full + NST;
    auto xbuf = [&](int b) { return wsm + b * S::X; };
    if (threadIdx.x == 0) {
        for (int b = 0; b < NST; b++) {
            mbar_init(full + b, 1);
            mbar_init(empty + b, CW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp >= CW) {
        // The producer: stage st into buffer st % NST once its last use (stage st - NST) is
        // released.
        if constexpr (S::PT == 128) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (warp == CW && lane == 0) {
            for (int st = 0; st < nst; st++) {
                const int b = st % NST;
                if (st >= NST) mbar_wait(empty + b, ((st / NST) - 1) & 1);
                mbar_expect(full + b, S::X + S::W);
#pragma unroll
                for (int h = 0; h < S::NH; h++) tma_2d(xbuf(b) + h * (S::X / S::NH), xm, 2 * (n0 + h * S::HN), 16 * st, full + b);
                u8* wb = wsm + NST * S::X + b * S::W;
                if (pairs) {
                    // Rows in pairs (the map's rows): the even rows' windows, then the odd ones',
                    // which start row_bytes on in the pair.
                    tma_2d(wb, wm, (Q::start(st) & ~15) / 4, wr / 2, full + b);
                    tma_2d(wb + S::W / 2, wm, (int)((row_bytes + Q::start(st)) & ~15) / 4, wr / 2, full + b);
                } else {
                    tma_2d(wb, wm, (Q::start(st) & ~15) / 4, wr, full + b);
                }
            }
        }
        return;
    }
    if constexpr (S::PT == 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, (int)blockIdx.y * BM + warp * 16, rows};
    auto wbuf = [&](int b) { return wsm + NST * S::X + b * S::W; };
    const WFrag<DEQ, Q> wf(R, warp, BM, pairs);
    // Stages whose 128 columns all lie in the rows: every one but a partial last.
    const int nfull = ng / 4;
    auto frag = [&](u32 (*a)[4], int j) {
        mbar_wait(full + j % NST, (j / NST) & 1);
        if (j < nfull)
            wf.template frag<true>(a, wbuf(j % NST), j, true);
        else
            wf.template frag<false>(a, wbuf(j % NST), j, 4 * j + wf.q < ng);
    };
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
    u32 a0[8][4], a1[8][4];
    frag(a0, 0);
    // Stage j: its products from `cur`; while they run, the next stage's fragments into `nxt`;
    // then stage j's buffers are released.
    auto stage = [&](u32 (*cur)[4], u32 (*nxt)[4], int j) {
        wg_fence();
        keep_f<BN / 2>(d);
        keep_u<32>(&cur[0][0]);
        const u8* xb = xbuf(j % NST);
#pragma unroll
        for (int s = 0; s < 8; s++) {
#pragma unroll
            for (int h = 0; h < S::NH; h++) {
                constexpr int HN = S::HN;
                const u64 desc = wg_desc(xb + h * (S::X / S::NH) + s * 2 * (HN / 8) * 128, (HN / 8) * 128, 128);
                if constexpr (HN == 128)
                    wg_rs128<0>(d + h * 64, cur[s], desc);
                else if constexpr (HN == 96)
                    wg_rs96<0>(d + h * 48, cur[s], desc);
                else
                    wg_rs64<0>(d, cur[s], desc);
            }
        }
        wg_commit();
        keep_f<BN / 2>(d);
        if (j + 1 < nst) frag(nxt, j + 1);
        wg_wait0();
        keep_f<BN / 2>(d);
        keep_u<32>(&cur[0][0]);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + j % NST);
    };
    for (int j = 0; j < nst; j += 2) {
        stage(a0, a1, j);
        if (j + 1 < nst) stage(a1, a0, j + 1);
    }
    // d: for n8 tile i, (row g, tokens 8i + 2q, +1), (row g + 8, the same tokens).
    const int g = lane >> 2, q = lane & 3;
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
__global__ void __launch_bounds__(2 * BM + (BN > 128 ? 128 : 32), 1)
    wmm(const __grid_constant__ TMap xm, const __grid_constant__ TMap wm, const u8* __restrict__ W, long long row_bytes,
        int rows, int cols, float* __restrict__ y, int n, int pairs) {
    pdl_begin();
    wmm_impl<deqh<T>, T::BYTES, T::VALUES, BM, BN>(&xm, &wm, W, row_bytes, rows, cols, y, blockIdx.x * BN, n,
                                                   blockIdx.y * BM, pairs != 0);
}

// The experts' products (MoE, moe.rs): the pairs (token, expert) sorted by expert, expert e's at
// rows off[e]..off[e+1] of the activations' map (f32_permute over the sorted rows), in tiles of
// 64 of one expert (ops.cu moe_group: tiles[0] tiles, then (e << 16) | c for its c-th 64);
// expert e's matrix is rows e · expert_rows + row_off.. of the weights (`rows` of them; gate
// and up in one tensor: row_off 0 and rows). A token's results are wmm's bits whatever the
// expert's other tokens. grid (the most tiles there can be, ceil(rows / BM)): blocks past
// tiles[0] leave.
template <class T, int BM>
__global__ void __launch_bounds__(2 * BM + 32, 1)
    wmm_g(const __grid_constant__ TMap xm, const __grid_constant__ TMap wm, const u8* __restrict__ W,
          long long row_bytes, long long expert_rows, int row_off, int rows, int cols, float* __restrict__ y,
          const int* __restrict__ off, const int* __restrict__ tiles, int pairs) {
    pdl_begin();
    if ((int)blockIdx.x >= tiles[0]) return;
    const int tile = tiles[1 + blockIdx.x], e = tile >> 16, c = tile & 0xffff;
    const long long r0 = e * expert_rows + row_off;
    wmm_impl<deqh<T>, T::BYTES, T::VALUES, BM, 64>(&xm, &wm, W + r0 * row_bytes, row_bytes, rows, cols, y,
                                                   off[e] + 64 * c, off[e + 1], (int)r0 + blockIdx.y * BM,
                                                   pairs != 0);
}
