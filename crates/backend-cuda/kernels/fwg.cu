// ---- Prompt attention on Hopper's warpgroup tensor cores (wgmma, sm_90a) over a cache of any
// type; part of the kvq modules (but tq4 keys'), after flash.cu and wgmma.cuh ----
//
// What flash_attention computes, for the same tiles, key ranges (rk absolute positions) and
// partials (merged by flash_merge), on wgmma:
// Rows. A block takes up to 128 (query head, token) rows of one KV group and one query tile:
// the group's G heads × the tile's T tokens, head-major (row i: head i / T, token i % T), cut
// into ceil(G / 2) parts of 128 — two consumer warpgroups of 64 rows — so that each K and V
// tile the block loads serves every row (at G = 4, two heads × 64 tokens).
// Keys. Tiles of KT keys (128; 64 at head dim 256) at multiples of KT, within the block's key
// range. Per tile, S = Q·Kᵀ (HD/16 wgmma m64nKTk16, q and K in shared memory), the online
// softmax in registers (base 2, the scale folded in), then O += P·V (KT/16 wgmma m64nHDk16, P
// from S's registers as f16 pairs, V N-major in shared memory). One f32 accumulator per
// element, the tiles in ascending order, the same KT at every batch: a row's bits depend on
// its own keys only, whatever the rows beside it.
// Pipeline. A producer warpgroup brings each tile's K and V into one of NST stages in FwgLayout
// (the same bytes serve as K-major K for S and N-major V for O) and marks each full (mbarrier);
// the consumers release a stage after its products. A whole tile (every key < the range's end)
// of a swizzled head dim comes by the tensor memory accelerator: one box per cache block of 16
// keys and 64 columns, the blocks' slots from the block table, issued by one warp. Other tiles
// (the range's last, head dim 96, another block size) are copied through the block table by the
// warpgroup's 128 threads (cp.async, 16-byte pieces), keys past the end zeroed. A cache of
// records at head dims 64 and 128 (TurboQuant's at 256 too: fwg_raw) comes raw first: a tile's
// records by cp.async a tile ahead into rows after the stages (FwgCfg::RAW), decoded from there. A cache of
// another type is decoded to f16 by the same threads into the same layout (flash.cu's values:
// the products are f16's either way; tq4's levels from shared memory). TurboQuant keys
// are rotated (their records hold H(s ⊙ k) / √D): each q row is rotated alike as the consumers
// load it (a warp a row, the butterflies across lanes). TurboQuant values give the output
// rotated: a row written here is un-rotated in registers (a row lies on the 4 lanes of a quad),
// a range's partials by flash_merge. While O += P·V
// of tile i runs, S of tile i + 1 is issued; the two consumer warpgroups take turns to issue.
// The producer gives its registers to the consumers (setmaxnreg, FwgCfg::PREG and CREG).
//   grid (n_tiles, n_head_kv · ceil(G / 2), n_ranges), block 384 (2 consumer warpgroups, then
//   the producer's)

// Whether a cache of type ty at head dim hd comes raw first (FwgCfg::RAW): every type but f16
// at head dims 64 and 128, the TurboQuant types at 256 (whole 4-byte copy units, and room beside
// the stages: at 256 q8_0's rows miss it by 112 bytes, bf16's by far).
__host__ __device__ constexpr bool fwg_raw(int ty, int hd) {
    return (ty != KV_F16 && (hd == 64 || hd == 128)) || (kv_tq(ty) && hd == 256);
}

template <int HD, int KTY, int VTY>
struct FwgCfg {
    static constexpr int KT = HD == 256 ? 64 : 128;
    static constexpr int QB = 128 * HD * 2;  // the block's q rows, f16
    static constexpr int TB = KT * HD * 2;   // one K or V tile
    // tq4's 16 levels (f32), after the barriers.
    static constexpr int LV = 16 * 4;
    // A tile's raw records of each cache that comes raw (fwg_raw), a row of RB bytes a key,
    // after the stages (a multiple of 16 bytes: the barriers stay aligned).
    static constexpr bool KRAW = fwg_raw(KTY, HD), VRAW = fwg_raw(VTY, HD);
    static constexpr int KRB = kv_head_bytes(KTY, HD), VRB = kv_head_bytes(VTY, HD);
    static constexpr int RAW = (KRAW ? KT * KRB : 0) + (VRAW ? KT * VRB : 0);
    static_assert(RAW % 16 == 0, "the barriers after the raw rows stay aligned");
    // Three stages where they fit the 227 KiB a block may take, else two.
    static constexpr int NST = QB + 3 * 2 * TB + 3 * 3 * 8 + LV + RAW + 1024 <= 227 * 1024 ? 3 : 2;
    static constexpr int BYTES = QB + NST * 2 * TB + 3 * NST * 8 + LV + RAW + 1024;
    // Registers a thread (setmaxnreg) of the producer's warpgroup and of each consumer's: the
    // block is given 168 a thread (384 threads under 65,536), and an increase waits until the
    // producer's decrease has freed enough: PREG + 2 · CREG ≤ 3 · 168 (else the consumers wait
    // for ever). Head dim 256's accumulators take 232.
    static constexpr int PREG = HD == 256 ? 40 : 56, CREG = HD == 256 ? 232 : 224;
    static_assert(PREG + 2 * CREG <= 3 * 168, "setmaxnreg: more registers than the block holds");
};

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}


// A tile of ROWS rows of HD halves in shared memory (q rows, or keys: the same bytes are K-major
// for S and N-major V for O). Head dims that are multiples of 64: the 128-byte swizzle — column
// blocks of 64 halves, each ROWS rows of 128 bytes, 16-byte piece c of row r at
// ((c ^ r) % 8) · 16 (atoms of 8 rows, 1024 bytes, 1024-aligned), so that the tensor cores' row
// reads spread over the banks. Else no swizzle: piece c of row r in core matrix (r / 8, c), at
// ((r / 8) · HD/8 + c) · 128 + (r % 8) · 16.
template <int HD>
struct FwgLayout {
    static constexpr bool SW = HD % 64 == 0;
    template <int ROWS>
    static __device__ __forceinline__ int off(int r, int c) {
        if constexpr (SW)
            return (c >> 3) * (ROWS * 128) + r * 128 + (((c ^ r) & 7) << 4);
        else
            return ((r >> 3) * (HD / 8) + c) * 128 + (r & 7) * 16;
    }
    // Piece e of a tile's copy: row and column, consecutive pieces along a row (one 128-byte
    // line of a swizzled block per 8 lanes), or down a core matrix without the swizzle.
    static __device__ __forceinline__ int2 piece(int e) {
        if constexpr (SW)
            return make_int2(e / (HD / 8), e % (HD / 8));
        else
            return make_int2((e / HD) * 8 + (e & 7), (e >> 3) % (HD / 8));
    }
    // Descriptors. K-major (q as A, K as B of S) at k16 step kk of a tile of ROWS rows; N-major
    // (V as B of O) at k16 step kk (keys 16kk …) of a tile of KT keys.
    template <int ROWS>
    static __device__ __forceinline__ u64 kmajor(const u8* t, int kk) {
        if constexpr (SW)
            return wg_desc(t + (kk >> 2) * (ROWS * 128) + (kk & 3) * 32, 16, 1024) | (1ull << 62);
        else
            return wg_desc(t + kk * 256, 128, HD * 16);
    }
    template <int KT>
    static __device__ __forceinline__ u64 nmajor(const u8* t, int kk) {
        if constexpr (SW)
            return wg_desc(t + kk * 2048, KT * 128, 1024) | (1ull << 62);
        else
            return wg_desc(t + kk * 2 * HD * 16, HD * 16, 128);
    }
};

// Keys j0 … j0 + KT − 1 of one cache (those < j_end; the rest zero) into stage buffer `s`, by
// the producer's 128 threads, in FwgLayout.
template <int HD, int KT>
__device__ __forceinline__ void fwg_copy(u8* s, const u8* __restrict__ cache, const u32* __restrict__ bt, u32 bs,
                                         int n_head_kv, int kvh, int j0, int j_end, int pt) {
    typedef FwgLayout<HD> L;
#pragma unroll 4
    for (int e = pt; e < KT * HD / 8; e += 128) {
        const int2 rc = L::piece(e);
        const int r = rc.x, c = rc.y, j = j0 + r;
        const bool ok = j < j_end;
        const u8* src = cache;
        if (ok) src += ((long long)(bt[j / bs] * bs + j % bs) * n_head_kv + kvh) * (HD * 2) + c * 16;
        cp_async16(s + L::template off<KT>(r, c), src, ok);
    }
    cp_async_commit();
}

// The same tile of a cache of type T (not f16) decoded to f16 by the producer's 128 threads
// (lv: a TurboQuant type's levels), stored in FwgLayout; an empty cp.async group is committed,
// so that the producer's waits count a group per cache whichever way each came. bf16 goes U
// pieces a thread at a time — their block-table entries read together, then their records,
// then converted and stored — which measured 1.5× the one-piece loop on bf16 prompts after 16k
// and 0.95× on q8_0 (H100, 2026-12-07), so the others go a piece at a time.
template <int HD, int KT, int T>
__device__ __forceinline__ void fwg_decode(u8* s, const u8* __restrict__ cache, const u32* __restrict__ bt, u32 bs,
                                           int n_head_kv, int kvh, int j0, int j_end, int pt, const float* lv) {
    typedef FwgLayout<HD> L;
    constexpr int RB = kv_head_bytes(T, HD);
    if constexpr (T == KV_BF16) {
        constexpr int N = KT * HD / 8 / 128, U = HD == 256 ? 2 : 4;
        static_assert(N % U == 0, "whole groups of pieces");
#pragma unroll 1
        for (int i0 = 0; i0 < N; i0 += U) {
            int slot[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int j = j0 + L::piece(pt + 128 * (i0 + u)).x;
                slot[u] = j < j_end ? (int)(bt[j / bs] * bs + j % bs) : -1;
            }
            uint4 raw[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int c = L::piece(pt + 128 * (i0 + u)).y;
                raw[u] = slot[u] >= 0 ? *(const uint4*)(cache + ((long long)slot[u] * n_head_kv + kvh) * RB + c * 16)
                                      : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int2 rc = L::piece(pt + 128 * (i0 + u));
                const u32 w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
                u32 h[4];
#pragma unroll
                for (int i = 0; i < 4; i++) h[i] = pack_h2(bf2f((u16)(w[i] & 0xffff)), bf2f((u16)(w[i] >> 16)));
                *(uint4*)(s + L::template off<KT>(rc.x, rc.y)) = make_uint4(h[0], h[1], h[2], h[3]);
            }
        }
    } else {
#pragma unroll 2
        for (int e = pt; e < KT * HD / 8; e += 128) {
            const int2 rc = L::piece(e);
            const int r = rc.x, c = rc.y, j = j0 + r;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (j < j_end)
                v = kv_load8_h<T, HD>(cache + ((long long)(bt[j / bs] * bs + j % bs) * n_head_kv + kvh) * RB, c * 8, lv);
            *(uint4*)(s + L::template off<KT>(r, c)) = v;
        }
    }
    cp_async_commit();
}

// The raw records (RB bytes) of keys j0 … j0 + KT − 1 of one cache (those < j_end; the rest
// zero-filled) into `raw`, a row a key, by cp.async (not committed): warp w of the producer
// takes keys 32w … 32w + 31, each lane its key's block-table entry, the warp's copies in whole
// rows (as kvd_copy). Every load of the tile is in flight at once, with no register held.
template <int KT, int RB>
__device__ __forceinline__ void fwg_fetch(u8* raw, const u8* __restrict__ cache, const u32* __restrict__ bt, u32 bs,
                                          int n_head_kv, int kvh, int j0, int j_end, int pt) {
    constexpr int CB = kv_chunk(RB), N = RB / CB;
    const int w = pt >> 5, lane = pt & 31, j = j0 + 32 * w + lane;
    if (32 * w >= KT) return;
    const u32 slot = j < j_end ? bt[j / bs] * bs + j % bs : 0;
    u8* dst = raw + 32 * w * RB;
#pragma unroll 1
    for (int c = lane; c < 32 * N; c += 32) {
        const int u = c / N, o = (c % N) * CB;
        const u32 sl = __shfl_sync(0xffffffffu, slot, u);
        const bool ok = j0 + 32 * w + u < j_end;
        cp_async_n<CB>(dst + u * RB + o, ok ? cache + ((long long)sl * n_head_kv + kvh) * RB + o : cache, ok);
    }
}

// A tile of raw records of type T (fwg_fetch's rows) decoded to f16 in FwgLayout by the
// producer's 128 threads: fwg_decode's values, from shared memory.
template <int HD, int KT, int T>
__device__ __forceinline__ void fwg_unpack(u8* s, const u8* raw, int j0, int j_end, int pt, const float* lv) {
    typedef FwgLayout<HD> L;
    constexpr int RB = kv_head_bytes(T, HD);
#pragma unroll 2
    for (int e = pt; e < KT * HD / 8; e += 128) {
        const int2 rc = L::piece(e);
        const int r = rc.x, c = rc.y;
        const uint4 v = j0 + r < j_end ? kv_load8_h<T, HD>(raw + r * RB, c * 8, lv) : make_uint4(0, 0, 0, 0);
        *(uint4*)(s + L::template off<KT>(r, c)) = v;
    }
}

// Keys j0 … j0 + KT − 1 of both caches (all < the range's end) into stage buffers `ks` and `vs`
// by the tensor memory accelerator, issued by the producer's first warp (lane `pt`): box e is
// cache block e / CB of the tile (16 keys, FWG_BOX) and column block e % CB (64 halves), at
// (e % CB) · KT · 128 + (e / CB) · 2048 bytes; the other threads only arrive.
constexpr int FWG_BOX = 16;
template <int HD, int KT>
__device__ __forceinline__ void fwg_tma(u8* ks, u8* vs, u64* fk, u64* fv, const TMap* km, const TMap* vm,
                                        const u32* __restrict__ bt, int kvh, int j0, int pt) {
    constexpr int CB = HD / 64, NB = KT / FWG_BOX * CB;
    if (pt < 32) {
        if (pt == 0) {
            mbar_expect(fk, KT * HD * 2);
            mbar_expect(fv, KT * HD * 2);
        }
        __syncwarp();
        for (int e = pt; e < 2 * NB; e += 32) {
            const int x = e % NB, blk = x / CB, cb = x % CB;
            const int slot = (int)bt[j0 / FWG_BOX + blk] * FWG_BOX;
            const int o = cb * (KT * 128) + blk * (FWG_BOX * 128);
            if (e < NB)
                tma_3d(ks + o, km, cb * 64, kvh, slot, fk);
            else
                tma_3d(vs + o, vm, cb * 64, kvh, slot, fv);
        }
        if (pt != 0) {
            mbar_arrive(fk);
            mbar_arrive(fv);
        }
    } else {
        mbar_arrive(fk);
        mbar_arrive(fv);
    }
}

// A tile's logits in base 2 (scale, soft-cap), masked on an `edge` tile (a key past the row's
// position or the range, or before its window, is −1e30), and the rows' running maxima.
template <int KT, bool CAP>
__device__ __forceinline__ void fwg_logits(float* sc, float* mx, bool edge, int j0, int j_end, const int* rpos,
                                           const bool* rok, int qd, int window, float scale, float softcap) {
    const float LOG2E = 1.4426950408889634f, sl = scale * LOG2E;
#pragma unroll
    for (int i = 0; i < KT / 8; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float v = sc[4 * i + e];
            v = CAP ? softcap * tanhf(v * scale / softcap) * LOG2E : v * sl;
            if (edge) {
                const int h = e >> 1, j = j0 + 8 * i + 2 * qd + (e & 1), p = rpos[h];
                const bool ok = rok[h] && j <= p && j < j_end && (window <= 0 || j > p - window);
                v = ok ? v : -1e30f;
            }
            sc[4 * i + e] = v;
            mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
    }
}

// Walsh–Hadamard butterflies as kv_encode's (pairs (j, j + h): a + c at j, a − c at j + h, the
// same floats), over a row spread on registers and lanes. In a thread's N registers: the pairs
// (j, j + S), j without bit S. Across lanes: for each lane bit m in M0 … M1/2, every register's
// pair (lane, lane ^ m), a + c on the lane without bit m.
template <int N>
__device__ __forceinline__ void fwg_reg_butterflies(float* x, int S) {
#pragma unroll
    for (int j = 0; j < N; j++)
        if (!(j & S)) {
            const float a = x[j], c = x[j + S];
            x[j] = a + c;
            x[j + S] = a - c;
        }
}
template <int N, int M0, int M1>
__device__ __forceinline__ void fwg_lane_butterflies(float* x, int lane) {
#pragma unroll
    for (int m = M0; m < M1; m <<= 1) {
        const bool hi = lane & m;
#pragma unroll
        for (int j = 0; j < N; j++) {
            const float y = __shfl_xor_sync(0xffffffffu, x[j], m);
            x[j] = hi ? y - x[j] : x[j] + y;
        }
    }
}

// The warpgroup's 64 q rows (from row0 of the block's G·T, head-major) rotated as TurboQuant's
// keys are, H(s ⊙ q) / √D, f16 in FwgLayout; rows past GT zeros. Warp w takes rows w, w + 4, …;
// lane l holds the V = HD / 32 values from l · V: the spans below V in the lane, the others
// across lanes, in ascending order (kv_encode's and flash.cu's sums).
template <int HD>
__device__ __forceinline__ void fwg_rotate_q(u8* qs, const float* __restrict__ q, const float* __restrict__ tq, int tok0,
                                             int T, int n_head, int head0, int row0, int GT, int w, int lane) {
    typedef FwgLayout<HD> L;
    constexpr int V = HD / 32;
    const float rs = 1.f / sqrtf((float)HD);
    for (int r = w; r < 64; r += 4) {
        const int idx = row0 + r;
        float x[V];
        const float* src = q + ((long long)(tok0 + idx % T) * n_head + head0 + idx / T) * HD + lane * V;
#pragma unroll
        for (int j = 0; j < V; j++) x[j] = idx < GT ? src[j] * tq[TQ_SIGNS + lane * V + j] : 0.f;
        // Spans 1 … V/2 in the lane, then V … HD/2: lane bits 1 … 16.
#pragma unroll
        for (int h = 1; h < V; h <<= 1) fwg_reg_butterflies<V>(x, h);
        fwg_lane_butterflies<V, 1, 32>(x, lane);
        u32 p[V / 2];
#pragma unroll
        for (int j = 0; j < V / 2; j++) p[j] = pack_h2(x[2 * j] * rs, x[2 * j + 1] * rs);
        u8* dst = qs + L::template off<64>(r, lane * V / 8) + (lane * V % 8) * 2;
        if constexpr (V == 2)
            *(u32*)dst = p[0];
        else if constexpr (V == 4)
            *(uint2*)dst = make_uint2(p[0], p[1]);
        else
            *(uint4*)dst = make_uint4(p[0], p[1], p[2], p[3]);
    }
}

// The output rows of a thread (o[4i + 2h + e]: row h, column 8i + 2·qd + e) un-rotated in
// place, both rows: spans 1 and 8, 16, … in the thread, 2 and 4 across the quad's lanes (qd),
// ascending (as merge_ranges' fwht_rows), then × (1/√D) · s.
template <int HD>
__device__ __forceinline__ void fwg_unrotate_rows(float* o, const float* __restrict__ tq, int qd) {
    // Span 1: register bit 0 (e); 2 and 4: qd's bits; 8m: register bit 4m (i's bits).
    fwg_reg_butterflies<HD / 2>(o, 1);
    fwg_lane_butterflies<HD / 2, 1, 4>(o, qd);
#pragma unroll
    for (int m = 1; m < HD / 8; m <<= 1) fwg_reg_butterflies<HD / 2>(o, 4 * m);
    const float rs = 1.f / sqrtf((float)HD);
#pragma unroll
    for (int i = 0; i < HD / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[4 * i + e] = o[4 * i + e] * rs * tq[TQ_SIGNS + 8 * i + 2 * qd + (e & 1)];
}

template <int HD, int KTY, int VTY>
__device__ void fwg_impl(const TMap* km, const TMap* vm, const float* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc,
                         float* __restrict__ out, float* __restrict__ part, const int4* __restrict__ tiles, BatchView b,
                         const float* __restrict__ tq, int n_head, int n_head_kv, float scale, int window, float softcap,
                         int rk, int n_ranges) {
#ifdef WG_ON
    typedef FwgCfg<HD, KTY, VTY> C;
    constexpr int KT = C::KT, NST = C::NST;
    typedef FwgLayout<HD> L;
    extern __shared__ __align__(1024) u8 fsm_raw[];
    // The swizzle's atoms are 1024-aligned (BYTES holds the slack).
    u8* fsm = fsm_raw + ((1024 - (smem_u32(fsm_raw) & 1023)) & 1023);
    u8* kbuf = fsm + C::QB;
    u8* vbuf = kbuf + NST * C::TB;
    // The raw rows right after the tiles (16-byte aligned, bf16's copy unit), then the
    // barriers and the levels.
    u8* rawk = vbuf + NST * C::TB;
    u8* rawv = rawk + (C::KRAW ? KT * C::KRB : 0);
    u64* full_k = (u64*)(rawk + C::RAW);
    u64* full_v = full_k + NST;
    u64* empty = full_v + NST;
    float* l4 = (float*)(empty + NST);
    constexpr bool KROT = kv_rotated(KTY, HD), VROT = kv_rotated(VTY, HD);
    const int4 tile = tiles[blockIdx.x];
    const int s = tile.x, tok0 = tile.y, T = tile.z;
    const int G = n_head / n_head_kv, parts = (G + 1) / 2;
    const int kvh = blockIdx.y / parts, idx0 = (blockIdx.y % parts) * 128, GT = G * T;
    const int nrows = min(128, GT - idx0);
    if (nrows <= 0) return;
    // The tokens the block's rows cover: the whole tile, or a run of it.
    int t_lo = 0, t_hi = T - 1;
    if (nrows < T) {
        const int a = idx0 % T, z = (idx0 + nrows - 1) % T;
        if (a <= z) t_lo = a, t_hi = z;
    }
    const int pos0 = (int)b.pos[tok0], p_lo = pos0 + t_lo, p_hi = pos0 + t_hi;
    const u32* bt = b.block_tables + b.bt_off[s];
    int j_end = min(p_hi + 1, (int)b.kv_len[s]);
    int j_begin = window > 0 ? max(0, p_lo - window + 1) : 0;
    // This block's key range.
    const int k = j_begin / rk + (int)blockIdx.z;
    j_begin = max(j_begin - j_begin % KT, k * rk);
    j_end = min(j_end, (k + 1) * rk);
    if (j_begin >= j_end) return;
    const int ntiles = (j_end - j_begin + KT - 1) / KT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nwg = (nrows + 63) / 64;
    if (threadIdx.x == 0) {
        for (int i = 0; i < NST; i++) {
            mbar_init(full_k + i, 128);
            mbar_init(full_v + i, 128);
            mbar_init(empty + i, 4 * nwg);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp >= 8) {
        // The producer: tile i into stage i % NST once tile i − NST has released it; each
        // thread marks K and then V full once its own copies have landed (the proxy fence makes
        // them visible to the tensor cores' reads).
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(C::PREG));
        const int pt = threadIdx.x - 256;
        const bool tma = L::SW && b.block_size == FWG_BOX && KTY == KV_F16 && VTY == KV_F16;
        if (KTY == KV_TQ4 || VTY == KV_TQ4) {
            if (pt < 16) l4[pt] = tq[TQ_L4 + pt];
            asm volatile("bar.sync 5, 128;" ::: "memory");
        }
        // Raw records: tile i + 1's are in flight while tile i is decoded and handed over.
        constexpr bool RAW = C::KRAW || C::VRAW;
        auto fetch = [&](int j0) {
            if constexpr (C::KRAW) fwg_fetch<KT, C::KRB>(rawk, kc, bt, b.block_size, n_head_kv, kvh, j0, j_end, pt);
            if constexpr (C::VRAW) fwg_fetch<KT, C::VRB>(rawv, vc, bt, b.block_size, n_head_kv, kvh, j0, j_end, pt);
            cp_async_commit();
        };
        if constexpr (RAW) fetch(j_begin);
        for (int i = 0; i < ntiles; i++) {
            const int st = i % NST;
            if (i >= NST) mbar_wait(empty + st, ((i / NST) - 1) & 1);
            const int j0 = j_begin + i * KT;
            if (tma && j0 + KT <= j_end) {
                fwg_tma<HD, KT>(kbuf + st * C::TB, vbuf + st * C::TB, full_k + st, full_v + st, km, vm, bt, kvh, j0, pt);
                continue;
            }
            if constexpr (RAW) {
                // Tile i's raw records (the only copies in flight), seen by every thread.
                cp_async_wait<0>();
                asm volatile("bar.sync 5, 128;" ::: "memory");
            }
            if constexpr (KTY == KV_F16)
                fwg_copy<HD, KT>(kbuf + st * C::TB, kc, bt, b.block_size, n_head_kv, kvh, j0, j_end, pt);
            else if constexpr (C::KRAW)
                fwg_unpack<HD, KT, KTY>(kbuf + st * C::TB, rawk, j0, j_end, pt, l4);
            else
                fwg_decode<HD, KT, KTY>(kbuf + st * C::TB, kc, bt, b.block_size, n_head_kv, kvh, j0, j_end, pt, l4);
            if constexpr (VTY == KV_F16)
                fwg_copy<HD, KT>(vbuf + st * C::TB, vc, bt, b.block_size, n_head_kv, kvh, j0, j_end, pt);
            else if constexpr (C::VRAW)
                fwg_unpack<HD, KT, VTY>(vbuf + st * C::TB, rawv, j0, j_end, pt, l4);
            else
                fwg_decode<HD, KT, VTY>(vbuf + st * C::TB, vc, bt, b.block_size, n_head_kv, kvh, j0, j_end, pt, l4);
            if constexpr (RAW) {
                // Every thread done with tile i's raw records: tile i + 1's into their place (an
                // empty group after the last), then all but those copies landed.
                asm volatile("bar.sync 5, 128;" ::: "memory");
                if (i + 1 < ntiles) fetch(j0 + KT);
                else cp_async_commit();
                cp_async_wait<1>();
                fence_async_smem();
                mbar_arrive(full_k + st);
                mbar_arrive(full_v + st);
            } else {
                cp_async_wait<1>();
                fence_async_smem();
                mbar_arrive(full_k + st);
                cp_async_wait<0>();
                fence_async_smem();
                mbar_arrive(full_v + st);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(C::CREG));
    const int wg = warp >> 2;
    if (wg >= nwg) return;
    const int tid = threadIdx.x & 127, w = warp & 3, g = lane >> 2, qd = lane & 3;
    // The warpgroup's 64 q rows, f16, in FwgLayout; rows past the block's are zeros. Rotated
    // for TurboQuant keys (fwg_rotate_q).
    u8* qs = fsm + wg * (C::QB / 2);
    if constexpr (KROT) {
        fwg_rotate_q<HD>(qs, q, tq, tok0, T, n_head, kvh * G, idx0 + wg * 64, GT, w, lane);
    } else {
        for (int e = tid; e < 64 * HD / 8; e += 128) {
            const int2 rc = L::piece(e);
            const int r = rc.x, c = rc.y, idx = idx0 + wg * 64 + r;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (idx < GT) {
                const float4* src =
                    (const float4*)(q + ((long long)(tok0 + idx % T) * n_head + kvh * G + idx / T) * HD + c * 8);
                const float4 x = src[0], y = src[1];
                v = make_uint4(pack_h2(x.x, x.y), pack_h2(x.z, x.w), pack_h2(y.x, y.y), pack_h2(y.z, y.w));
            }
            *(uint4*)(qs + L::template off<64>(r, c)) = v;
        }
    }
    fence_async_smem();
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");

    // This thread's two rows (g and g + 8 of its warp's 16).
    int rpos[2], ridx[2];
    bool rok[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        ridx[h] = idx0 + wg * 64 + 16 * w + g + 8 * h;
        rok[h] = ridx[h] < GT;
        rpos[h] = pos0 + ridx[h] % T;
    }
    float o[HD / 2], sc[KT / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < KT / 2; i++) sc[i] = 0.f;
    float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
    auto qk = [&](int st) {
        const u8* kb = kbuf + st * C::TB;
        wg_fence();
        keep_f<KT / 2>(sc);
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            const u64 da = L::template kmajor<64>(qs, kk), db = L::template kmajor<KT>(kb, kk);
            if constexpr (KT == 64)
                wg_ss64(sc, da, db, kk > 0);
            else
                wg_ss128(sc, da, db, kk > 0);
        }
        wg_commit();
    };
    // The two consumer warpgroups take turns to issue their products (FlashAttention-3's
    // ping-pong, named barriers 3 and 4): one's softmax runs while the other's products do. A
    // turn is one group of products; warpgroup 1 gives warpgroup 0 the first.
    const bool pp = nwg == 2;
    auto turn = [&] {
        if (pp) asm volatile("bar.sync %0, 256;" ::"r"(3 + wg) : "memory");
    };
    auto pass = [&] {
        if (pp) asm volatile("bar.arrive %0, 256;" ::"r"(4 - wg) : "memory");
    };
    if (wg == 1) pass();
    mbar_wait(full_k, 0);
    turn();
    qk(0);
    pass();
    wg_wait0();
    keep_f<KT / 2>(sc);
    for (int it = 0; it < ntiles; it++) {
        const int st = it % NST;
        const int j0 = j_begin + it * KT;
        // Scale, soft-cap, mask (base-2 logits); row maxima over the 4 lanes of each row. Only a
        // tile with a key some row of the block must not see (past its position, before its
        // window, past the range) is masked: a seen key's value is the same on either path.
        float mx[2] = {m[0], m[1]};
        const bool edge = j0 + KT > j_end || j0 + KT - 1 > p_lo || (window > 0 && j0 <= p_hi - window);
        if (softcap > 0.f)
            fwg_logits<KT, true>(sc, mx, edge, j0, j_end, rpos, rok, qd, window, scale, softcap);
        else
            fwg_logits<KT, false>(sc, mx, edge, j0, j_end, rpos, rok, qd, window, scale, softcap);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        }
        const float c0 = ex2(m[0] - mx[0]), c1 = ex2(m[1] - mx[1]);
        m[0] = mx[0];
        m[1] = mx[1];
        l[0] *= c0;
        l[1] *= c1;
#pragma unroll
        for (int i = 0; i < HD / 8; i++) {
            o[4 * i] *= c0;
            o[4 * i + 1] *= c0;
            o[4 * i + 2] *= c1;
            o[4 * i + 3] *= c1;
        }
        // P = 2^(S − m) as the A operand: k16 slice kk is n8 tiles 2kk, 2kk + 1.
        u32 pa[KT / 16][4];
#pragma unroll
        for (int i = 0; i < KT / 8; i++) {
            float e[4];
#pragma unroll
            for (int x = 0; x < 4; x++) {
                // A masked key (only on edge tiles) weighs 0, also in a row with no key yet.
                const float v = sc[4 * i + x];
                e[x] = edge && v <= -1e29f ? 0.f : ex2(v - m[x >> 1]);
            }
            l[0] += e[0] + e[1];
            l[1] += e[2] + e[3];
            pa[i >> 1][(i & 1) * 2] = pack_h2(e[0], e[1]);
            pa[i >> 1][(i & 1) * 2 + 1] = pack_h2(e[2], e[3]);
        }
        mbar_wait(full_v + st, (it / NST) & 1);
        if (it + 1 < ntiles) mbar_wait(full_k + (it + 1) % NST, ((it + 1) / NST) & 1);
        turn();
        wg_fence();
        keep_f<HD / 2>(o);
        keep_u<KT / 4>(&pa[0][0]);
        const u8* vb = vbuf + st * C::TB;
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            const u64 dv = L::template nmajor<KT>(vb, kk);
            if constexpr (HD == 64)
                wg_rs64<1>(o, pa[kk], dv);
            else if constexpr (HD == 96)
                wg_rs96<1>(o, pa[kk], dv);
            else if constexpr (HD == 128)
                wg_rs128<1>(o, pa[kk], dv);
            else
                wg_rs256<1>(o, pa[kk], dv);
        }
        wg_commit();
        if (it + 1 < ntiles) qk((it + 1) % NST);
        // Warpgroup 1's last turn passes none on: warpgroup 0 has no more.
        if (wg == 0 || it + 1 < ntiles) pass();
        wg_wait0();
        keep_f<HD / 2>(o);
        keep_f<KT / 2>(sc);
        keep_u<KT / 4>(&pa[0][0]);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + st);
    }
    // Row sums over the 4 lanes of each row; each row written (its only range), or this range's
    // (max in natural-log units, sum, unnormalised acc) kept for flash_merge (which un-rotates
    // TurboQuant values); a row written here is un-rotated first (all lanes: shuffles).
    const float LN2 = 0.6931471805599453f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    bool direct[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        direct[h] = false;
        if (!rok[h]) continue;
        const int t = ridx[h] % T, head = kvh * G + ridx[h] / T;
        int kf, nr;
        row_ranges(b, tok0 + t, window, rk, kf, nr);
        if (k < kf || k >= kf + nr) continue;
        direct[h] = nr == 1;
        if (nr == 1) continue;
        float* pp = part + ((((long long)blockIdx.x * 64 + t) * n_head + head) * n_ranges + (k - kf)) * (HD + 2);
        if (qd == 0) {
            pp[0] = m[h] * LN2;
            pp[1] = l[h];
        }
#pragma unroll
        for (int i = 0; i < HD / 8; i++) {
            pp[2 + 8 * i + 2 * qd] = o[4 * i + 2 * h];
            pp[3 + 8 * i + 2 * qd] = o[4 * i + 2 * h + 1];
        }
    }
#pragma unroll
    for (int i = 0; i < HD / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float li = l[e >> 1];
            o[4 * i + e] = li > 0.f ? o[4 * i + e] / li : 0.f;
        }
    if constexpr (VROT) fwg_unrotate_rows<HD>(o, tq, qd);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (!direct[h]) continue;
        const int t = ridx[h] % T, head = kvh * G + ridx[h] / T;
        float* orow = out + ((long long)(tok0 + t) * n_head + head) * HD;
#pragma unroll
        for (int i = 0; i < HD / 8; i++)
            *(float2*)(orow + 8 * i + 2 * qd) = make_float2(o[4 * i + 2 * h], o[4 * i + 2 * h + 1]);
    }
#else
    __trap();
#endif
}

// The module's kernels per head dim (registry.rs `kernels`: every pair but tq4 keys).
template <int HD, int KTY, int VTY>
__global__ void __launch_bounds__(384, 1)
    fwg_attention(const __grid_constant__ TMap km, const __grid_constant__ TMap vm, const float* q, const u8* kc, const u8* vc, float* out, float* part, const int4* tiles, BatchView b,
                  const float* tq, int n_head, int n_head_kv, float scale, int window, float softcap, int rk, int n_ranges) {
    pdl_begin();
    fwg_impl<HD, KTY, VTY>(&km, &vm, q, kc, vc, out, part, tiles, b, tq, n_head, n_head_kv, scale, window, softcap, rk, n_ranges);
}
