// ---- Hopper's int8 warpgroup products for imm (sm_90a; registry.rs `imm_wgmma`) ----
// Compiled after imm.cu in the modules of the types it takes (it uses immk's IK<T> policies and
// KQ<Q6_K> pairs, q4k_frag, q4k_scales_mins and imm_store, and wgmma.cuh).

// immw4: Q4_K's imm on Hopper's warpgroup products (sm_90a), the same terms and order as immk
// (so the same bits as mmvq.cu's rowq_c<Q4_K>). The block is one warpgroup (warp w rows
// 16w..16w+15, immk's tile of 64 rows × 64 tokens); a stage is a whole super-block, IMW_NST in
// flight. Thread 0 sends each stage's two tensor copies (the tensor memory accelerator),
// completing on the stage's barrier: the rows' 144-byte blocks (Q4_K rows are whole 16-byte
// units, so a block starts on one), and the tokens' 256 int8 activations in wgmma's canonical
// K-major layout (core matrix (piece p of 16 values, tokens 8i..8i+7) at p · 1024 + i · 128
// bytes: quantize_a256's tiles, piece p's 64 tokens one run of 1 KiB); the tokens' 32-sums
// split and d come by cp.async. The weights' copies of the first stages are sent before the
// wait for the previous kernel (programmatic dependent launch), which never writes them.
// The sub-block pairs' A fragments (sh·q and sl·q, immk's) are wgmma's register operand, the
// activations its B operand: per stage two groups of 8 wgmma m64n64k32 (pairs 0..3, then 4..7)
// into P and Q, which the stage's first product overwrites: the second group's fragments are
// made while the first runs, the next stage's first group's while the second runs; then the
// super-block's terms as immk's fin. Split over grid z in whole super-blocks (imm_store).
//                                grid (ceil(n / 64), ceil(rows / 64), parts), block 128
#define IMW_NST 3
#define IMW_X (QMM_BN * 256)
#define IMW_W (QMM_BM * 144)
template <class K>
__device__ __forceinline__ void immw4_impl(const TMap* xm, const TMap* wm, const u8* __restrict__ W, long long row_bytes,
                                          int rows, int cols, const float* __restrict__ ad,
                                          const int* __restrict__ abs_, float* __restrict__ y, int n, long long* part,
                                          unsigned* cnt) {
#ifdef WG_ON
    extern __shared__ __align__(128) u8 imw_sm[];
    u8* Xs = imw_sm;                                           // [stage][piece][token][16]
    u8* Ws = imw_sm + IMW_NST * IMW_X;                           // [stage][row][144]
    u8* Hs = Ws + IMW_NST * IMW_W;                             // [stage][token][16]
    float* Dd = (float*)(Hs + IMW_NST * QMM_BN * 16);          // [stage][token]
    u64* full = (u64*)(Dd + IMW_NST * QMM_BN);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * QMM_BN, r0 = blockIdx.y * QMM_BM;
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, r0 + warp * 16, rows};
    const int nsb = cols / 256;
    const u8* hl = (const u8*)(abs_ + (long long)n * (cols / 16));
    const int S = gridDim.z, z = blockIdx.z;
    const int s0 = z * nsb / S, s1 = (z + 1) * nsb / S;
    if (threadIdx.x == 0) {
        for (int b = 0; b < IMW_NST; b++) mbar_init(full + b, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto send_w = [&](int b, int sb) {
        mbar_expect(full + b, IMW_X + IMW_W);
        tma_2d(Ws + b * IMW_W, wm, sb * 36, r0, full + b);
    };
    auto send_x = [&](int b, int sb) { tma_2d(Xs + b * IMW_X, xm, 2 * n0, sb * 16, full + b); };
    auto copy_s = [&](int b, int sb) {
        const int t = threadIdx.x & 63;
        const bool ok = n0 + t < n;
        if (threadIdx.x < 64)
            cp_async16(Hs + (b * QMM_BN + t) * 16, ok ? hl + ((long long)(n0 + t) * nsb + sb) * 16 : hl, ok);
        else
            cp_async4(Dd + b * QMM_BN + t, ok ? ad + (long long)(n0 + t) * nsb + sb : ad, ok);
    };
    if (threadIdx.x == 0)
        for (int st = 0; st < IMW_NST - 1 && s0 + st < s1; st++) send_w(st, s0 + st);
    pdl_begin();
#pragma unroll
    for (int st = 0; st < IMW_NST - 1; st++) {
        if (s0 + st < s1) {
            if (threadIdx.x == 0) send_x(st, s0 + st);
            copy_s(st, s0 + st);
        }
        cp_async_commit();
    }
    int P[32], Qa[32];
    long long tot[8][4];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) tot[i][e] = 0;
    // Row g's blocks in buffer b (row g + 8's 8 · 144 bytes on).
    auto rowp = [&](int b) { return Ws + b * IMW_W + (16 * warp + g) * 144; };
    // Group h's A fragments (sub-block pairs 4h..4h+3) of the super-block whose rows are at p0.
    auto frags = [&](u32 (*a)[2][4], const u8* p0, int h) {
        u32 sc[2][2], mn[2];
        q4k_scales_mins(p0, sc[0], mn);
        q4k_scales_mins(p0 + 8 * 144, sc[1], mn);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int jj = 4 * h + k;
            const int c0 = (sc[0][h] >> (8 * k)) & 63, c1 = (sc[1][h] >> (8 * k)) & 63;
            u32 v[4];
            q4k_frag(p0, jj, q, v[0], v[2]);
            q4k_frag(p0 + 8 * 144, jj, q, v[1], v[3]);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int c = (i & 1) ? c1 : c0;
                a[k][0][i] = v[i] * (u32)(c >> 3);
                a[k][1][i] = v[i] * (u32)(c & 7);
            }
        }
    };
    u32 A[2][4][2][4];  // [group][pair][sh, sl][fragment]
    auto issue = [&](u32 (*a)[2][4], int h, const u8* xs) {
        wg_fence();
        keep_u<32>((u32*)P);
        keep_u<32>((u32*)Qa);
        keep_u<32>(&a[0][0][0]);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int jj = 4 * h + k;
            const u64 desc = wg_desc(xs + 2 * jj * (QMM_BN * 16), QMM_BN * 16, 128);
            wg_s8_rs64(P, a[k][0], desc, jj);
            wg_s8_rs64(Qa, a[k][1], desc, jj);
        }
        wg_commit();
    };
    // Super-block sb's group 0 is made before its turn: while the previous one's group 1 runs.
    if (s0 < s1) {
        mbar_wait(full, 0);
        frags(A[0], rowp(0), 0);
    }
    for (int sb = s0; sb < s1; sb++) {
        const int b = (sb - s0) % IMW_NST;
        cp_async_wait<IMW_NST - 2>();
        mbar_wait(full + b, ((sb - s0) / IMW_NST) & 1);
        __syncthreads();
        // Into the buffer of super-block sb - 1, whose products finished before the barrier.
        if (sb + IMW_NST - 1 < s1) {
            const int nb = (sb - s0 + IMW_NST - 1) % IMW_NST;
            if (threadIdx.x == 0) {
                send_w(nb, sb + IMW_NST - 1);
                send_x(nb, sb + IMW_NST - 1);
            }
            copy_s(nb, sb + IMW_NST - 1);
        }
        cp_async_commit();
        const u8* b0 = rowp(b);
        const u8* b1 = b0 + 8 * 144;
        const u8* xs = Xs + b * IMW_X;
        issue(A[0], 0, xs);
        frags(A[1], b0, 1);
        issue(A[1], 1, xs);
        if (sb + 1 < s1) {
            // Group 0 done: its fragments' registers take the next super-block's.
            wg_wait1();
            keep_u<32>(&A[0][0][0][0]);
            const int b2 = (sb + 1 - s0) % IMW_NST;
            mbar_wait(full + b2, ((sb + 1 - s0) / IMW_NST) & 1);
            frags(A[0], rowp(b2), 0);
        }
        wg_wait0();
        keep_u<32>((u32*)P);
        keep_u<32>((u32*)Qa);
        keep_u<32>(&A[1][0][0][0]);
        // The super-block's terms (P and Q are overwritten by the next stage's first product).
        K::template fin<false>(tot, (int(*)[4])P, (int(*)[4])Qa, b0, b1, Hs + b * QMM_BN * 16, Dd + b * QMM_BN, g, q);
    }
    imm_store(tot, R, n0, rows, y, n, part, cnt);
#else
    __trap();
#endif
}

// immw6: Q6_K's imm on wgmma, the same terms and order as immk's (mmvq.cu rowq_c<Q6_K>): a
// super-block's S = Σ sc_i · isum16_i (16 sub-blocks of 16, int8 scales) exact in int32, its
// term da·(d·S). The block and its stages as immw's; the activations by the tensor copy of
// their tiles, the rows' blocks (210 bytes, at any alignment) by cp.async in qmm's windows, d
// by cp.async. Per sub-block pair jj two wgmma m64n64k32 (A: the pair's first 16 values and
// zeros, then zeros and its second 16: immk's fragments) give each sub-block's integer sums
// (cl, ch), which its scales weigh into S; the next pair's fragments are made while a pair's
// products run.
#define IMW6_W (QMM_BM * 240)
__device__ __forceinline__ void immw6_impl(const TMap* xm, const u8* __restrict__ W, long long row_bytes, int rows,
                                           int cols, const float* __restrict__ ad, float* __restrict__ y, int n,
                                           long long* part, unsigned* cnt) {
#ifdef WG_ON
    typedef QWin<210, 256> Q;
    extern __shared__ __align__(128) u8 imw_sm[];
    u8* Xs = imw_sm;                                           // [stage][piece][token][16]
    u8* Ws = imw_sm + IMW_NST * IMW_X;                         // [stage][warp][16 rows][WIN]
    float* Dd = (float*)(Ws + IMW_NST * IMW6_W);               // [stage][token]
    u64* full = (u64*)(Dd + IMW_NST * QMM_BN);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * QMM_BN;
    const QRows R = {W, W + (long long)rows * row_bytes, row_bytes, (int)blockIdx.y * QMM_BM + warp * 16, rows};
    const int nsb = cols / 256;
    const int S = gridDim.z, z = blockIdx.z;
    const int s0 = z * nsb / S, s1 = (z + 1) * nsb / S;
    static_assert(Q::WIN == 240, "Q6_K's window");
    if (threadIdx.x == 0) {
        for (int b = 0; b < IMW_NST; b++) mbar_init(full + b, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto wbuf = [&](int b) { return Ws + b * IMW6_W + warp * 16 * Q::WIN; };
    // Weights (never written by the previous kernel) may go before the dependent-launch wait.
    auto copy_w = [&](int b, int sb) { qmm_copy_w<Q>(wbuf(b), R, 2 * sb); };
    auto copy_x = [&](int b, int sb) {
        if (threadIdx.x == 0) {
            mbar_expect(full + b, IMW_X);
            tma_2d(Xs + b * IMW_X, xm, 2 * n0, sb * 16, full + b);
        }
        const int t = threadIdx.x;
        const bool ok = t < QMM_BN && n0 + t < n;
        if (t < QMM_BN)
            cp_async4(Dd + b * QMM_BN + t, ok ? ad + (long long)(n0 + t) * nsb + sb : ad, ok);
    };
    for (int st = 0; st < IMW_NST - 1 && s0 + st < s1; st++) copy_w(st, s0 + st);
    pdl_begin();
#pragma unroll
    for (int st = 0; st < IMW_NST - 1; st++) {
        if (s0 + st < s1) copy_x(st, s0 + st);
        cp_async_commit();
    }
    int cl[32], ch[32];
    long long tot[8][4];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) tot[i][e] = 0;
    const int off0 = (int)((u64)R.row(g) & 15), off1 = (int)((u64)R.row(g + 8) & 15);
    for (int sb = s0; sb < s1; sb++) {
        const int b = (sb - s0) % IMW_NST;
        cp_async_wait<IMW_NST - 2>();
        mbar_wait(full + b, ((sb - s0) / IMW_NST) & 1);
        __syncthreads();
        // Into the buffer of super-block sb - 1, whose products finished before the barrier.
        if (sb + IMW_NST - 1 < s1) {
            const int nb = (sb - s0 + IMW_NST - 1) % IMW_NST;
            copy_w(nb, sb + IMW_NST - 1);
            copy_x(nb, sb + IMW_NST - 1);
        }
        cp_async_commit();
        const int st = sb * 210;
        const u8* b0 = wbuf(b) + g * Q::WIN + ((off0 + st) & 15);
        const u8* b1 = wbuf(b) + (g + 8) * Q::WIN + ((off1 + st) & 15);
        const u8* xs = Xs + b * IMW_X;
        int Sx[32];
#pragma unroll
        for (int e = 0; e < 32; e++) Sx[e] = 0;
        KQ<Q6_K>::Pair pr[2];
        pr[0] = KQ<Q6_K>::pair(b0, b1, 0, q);
#pragma unroll 2
        for (int jj = 0; jj < 8; jj++) {
            KQ<Q6_K>::Pair& p = pr[jj & 1];
            wg_fence();
            keep_u<32>((u32*)cl);
            keep_u<32>((u32*)ch);
            keep_u<4>(p.lo);
            keep_u<4>(p.hi);
            const u64 desc = wg_desc(xs + 2 * jj * (QMM_BN * 16), QMM_BN * 16, 128);
            wg_s8_rs64(cl, p.lo, desc, 0);
            wg_s8_rs64(ch, p.hi, desc, 0);
            wg_commit();
            if (jj + 1 < 8) pr[(jj + 1) & 1] = KQ<Q6_K>::pair(b0, b1, jj + 1, q);
            wg_wait0();
            keep_u<32>((u32*)cl);
            keep_u<32>((u32*)ch);
            keep_u<4>(p.lo);
            keep_u<4>(p.hi);
#pragma unroll
            for (int e = 0; e < 32; e++) {
                const int r = (e >> 1) & 1;
                Sx[e] += p.sl[r] * cl[e] + p.sh[r] * ch[e];
            }
        }
        IK<Q6_K>::fin<false>(tot, (int(*)[4])Sx, nullptr, b0, b1, nullptr, Dd + b * QMM_BN, g, q);
    }
    imm_store(tot, R, n0, rows, y, n, part, cnt);
#else
    __trap();
#endif
}

// A type's immw: Q4_K's (immw4_impl) or Q6_K's (immw6_impl).
template <class T>
__device__ __forceinline__ void immw_impl(const TMap* xm, const TMap* wm, const u8* __restrict__ W, long long row_bytes,
                                          int rows, int cols, const float* __restrict__ ad,
                                          const int* __restrict__ abs_, float* __restrict__ y, int n, long long* part,
                                          unsigned* cnt) {
    if constexpr (T::BYTES == 210)
        immw6_impl(xm, W, row_bytes, rows, cols, ad, y, n, part, cnt);
    else
        immw4_impl<IK<T>>(xm, wm, W, row_bytes, rows, cols, ad, abs_, y, n, part, cnt);
}
template <class T>
__global__ void __launch_bounds__(32 * QMM_WARPS)
    immw(const __grid_constant__ TMap xm, const __grid_constant__ TMap wm, const u8* __restrict__ W, long long row_bytes,
         int rows, int cols, const float* __restrict__ ad, const int* __restrict__ abs_, float* __restrict__ y, int n,
         long long* part, unsigned* cnt) {
    immw_impl<T>(&xm, &wm, W, row_bytes, rows, cols, ad, abs_, y, n, part, cnt);
}
