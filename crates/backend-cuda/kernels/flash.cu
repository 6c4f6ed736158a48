// ---- Prompt attention on tensor cores over the KV cache of any type (mma.sync m16n8k16, f16
// in, f32 accumulate); part of each kvq module, after kvq.cu ----
//
// A query tile is up to 64 consecutive tokens of one sequence (tiles[i] = {seq, first token,
// token count, 0}), positions consecutive. grid (n_tiles, n_head, parts · n_ranges), block 128
// (4 warps): block z takes tile rows 16·RG·(z % parts) … +16·RG−1 and the tile's key range
// z / parts; warp w owns 16 of the rows (row group w / CS) and the output columns of its column
// group (w % CS, HD / CS columns each).
//   HD 64, 96, 128: RG 4, CS 1, KT 64 (each warp 16 rows × all columns).
//   HD 256:         RG 2, CS 2, KT 32 (two warps per 16 rows, each half the columns: both
//                   compute the row's scores, so the softmax statistics agree).
// Key ranges: a row's keys are cut at multiples of `rk` (absolute positions; a multiple of 64
// fixed per cache). A row whose keys lie in one range is written by that range's block; a row
// over several gets each range's (max, sum, unnormalised acc) in `part` (row ti·64 + r of the
// launch, n_ranges slots per (row, head)), merged in order by flash_merge. So a row's bits
// depend on its own keys only, whatever the tile, the step or the launch.
// Key tiles of KT keys are loaded to shared memory through the block table (f16: cp.async, the
// next tile's K in flight during P·V and this tile's V during Q·Kᵀ; other types decoded to f16
// by the threads); key tiles entirely masked (after the block's last query position, or before
// its first query's window) are never visited. TurboQuant keys: q rotated in shared memory
// first; TurboQuant values: the output rows un-rotated in shared memory (or by flash_merge).

// Eight values d0 … d0+7 of a record of type T as four f16 pairs.
template <int T, int HD>
__device__ __forceinline__ uint4 kv_load8_h(const u8* __restrict__ rec, int d0, const float* lv) {
    float f[8];
    kv_load8<T, HD>(rec, d0, lv, f);
    return make_uint4(pack_h2(f[0], f[1]), pack_h2(f[2], f[3]), pack_h2(f[4], f[5]), pack_h2(f[6], f[7]));
}

// The KT keys j0 … of a tile (those < j_end; the rest zero) of one cache (K or V) into `s`
// as f16 rows of LD halves.
template <int HD, int KT, int T, int LD>
__device__ __forceinline__ void flash_tile(u16* s, const u8* __restrict__ cache, const u32* bt, u32 bs,
                                           int n_head_kv, int kvh, int j0, int j_end, const float* lv) {
    const int RB = kv_head_bytes(T, HD);
    for (int c = threadIdx.x + threadIdx.y * blockDim.x; c < KT * (HD / 8); c += 128) {
        int kr = c / (HD / 8), col = (c % (HD / 8)) * 8, j = j0 + kr;
        bool ok = j < j_end;
        const u8* rec = cache;
        if (ok) rec += ((long long)(bt[j / bs] * bs + j % bs) * n_head_kv + kvh) * RB;
        if (T == KV_F16) {
            cp_async16(s + kr * LD + col, rec + 2 * col, ok);
        } else {
            *(uint4*)(s + kr * LD + col) = ok ? kv_load8_h<T, HD>(rec, col, lv) : make_uint4(0, 0, 0, 0);
        }
    }
    cp_async_commit();
}

// The first key range and the number of ranges of the row at position p (keys lo … hi−1).
__device__ __forceinline__ void row_ranges(BatchView b, int t, int window, int rk, int& kf, int& nr) {
    int lo, hi;
    key_range(b, t, window, lo, hi);
    kf = lo / rk;
    nr = hi > lo ? (hi - 1) / rk - kf + 1 : 1;
}

template <int HD, int KT, int RG, int CS, int KTY, int VTY>
__device__ void flash_impl(const float* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc,
                           float* __restrict__ out, float* __restrict__ part, const int4* __restrict__ tiles,
                           BatchView b, const float* __restrict__ tq, int n_head, int n_head_kv, float scale,
                           int window, float softcap, int rk, int n_ranges) {
    static_assert(RG * CS == 4, "4 warps");
    static_assert(HD % 32 == 0 && (HD / CS) % 16 == 0, "ldmatrix in pairs of steps and of column tiles");
    const int LD = HD + 8;   // padded row (halves): conflict-free fragment loads
    const int OC = HD / CS;  // output columns per warp
    const int ROWS = 16 * RG;
    const bool POW2 = (HD & (HD - 1)) == 0;
    const bool KROT = (KTY == KV_TQ8 || KTY == KV_TQ4) && POW2, VROT = (VTY == KV_TQ8 || VTY == KV_TQ4) && POW2;
    // K and V tiles; the block's rows as floats while q is rotated and the output un-rotated.
    __shared__ __align__(16) u16 kvs[2 * KT * LD];
    static_assert(ROWS * HD * 4 <= 2 * KT * LD * 2, "row buffer");
    __shared__ float lk[kv_levels(KTY)], lvv[kv_levels(VTY)];
    u16 *Ks = kvs, *Vs = kvs + KT * LD;
    float* rows = (float*)kvs;
    int4 tile = tiles[blockIdx.x];
    int s = tile.x, tok0 = tile.y, ntok = tile.z;
    int parts = 64 / ROWS;
    int row0 = (blockIdx.z % parts) * ROWS;  // the block's first row in the tile
    if (row0 >= ntok) return;
    int h = blockIdx.y, kvh = h / (n_head / n_head_kv);
    int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq4 = lane & 3;
    int rg = w / CS, cb = (w % CS) * OC;  // row group, first output column
    int p_first = (int)b.pos[tok0] + row0, p_last = (int)b.pos[tok0] + min(ntok, row0 + ROWS) - 1;
    int kv_len = (int)b.kv_len[s];
    const u32* bt = b.block_tables + b.bt_off[s];
    int j_end = min(p_last + 1, kv_len);
    int j_begin = window > 0 ? max(0, p_first - window + 1) : 0;
    // This block's key range.
    int k = j_begin / rk + (int)blockIdx.z / parts;
    j_begin = max(j_begin - j_begin % KT, k * rk);
    j_end = min(j_end, (k + 1) * rk);
    if (j_begin >= j_end) return;
    load_levels<KTY>(lk, tq, tid, 128);
    load_levels<VTY>(lvv, tq, tid, 128);
    const float rs = 1.f / sqrtf((float)HD);
    if (KROT) {
        for (int e = tid; e < ROWS * HD; e += 128) {
            int r = row0 + e / HD, d = e % HD;
            rows[e] = r < ntok ? q[((long long)(tok0 + r) * n_head + h) * HD + d] * tq[TQ_SIGNS + d] : 0.f;
        }
        __syncthreads();
        fwht_rows(rows, ROWS, HD);
    }

    // Q fragments (f16) of this warp's 16 rows, all HD columns.
    u32 qa[HD / 16][4];
    int r0 = row0 + 16 * rg + g, r1 = r0 + 8;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ks++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int col = ks * 16 + 2 * tq4 + 8 * half;
            float x0 = 0.f, x1 = 0.f, y0 = 0.f, y1 = 0.f;
            if (KROT) {
                const float* a = rows + (16 * rg + g) * HD + col;
                x0 = a[0] * rs; x1 = a[1] * rs; y0 = a[8 * HD] * rs; y1 = a[8 * HD + 1] * rs;
            } else {
                if (r0 < ntok) {
                    const float* qr = q + ((long long)(tok0 + r0) * n_head + h) * HD + col;
                    x0 = qr[0]; x1 = qr[1];
                }
                if (r1 < ntok) {
                    const float* qr = q + ((long long)(tok0 + r1) * n_head + h) * HD + col;
                    y0 = qr[0]; y1 = qr[1];
                }
            }
            qa[ks][2 * half] = pack_h2(x0, x1);
            qa[ks][2 * half + 1] = pack_h2(y0, y1);
        }
    }
    float o[OC / 8][4];
#pragma unroll
    for (int i = 0; i < OC / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f;
    int p0 = (int)b.pos[tok0] + r0, p1 = (int)b.pos[tok0] + r1;

    // The row buffer (q) and the level tables are read before the first tile lands.
    __syncthreads();
    flash_tile<HD, KT, KTY, LD>(Ks, kc, bt, b.block_size, n_head_kv, kvh, j_begin, j_end, lk);
    for (int j0 = j_begin; j0 < j_end; j0 += KT) {
        // K of this tile landed; every warp is done with the last tile's V.
        cp_async_wait<0>();
        __syncthreads();
        flash_tile<HD, KT, VTY, LD>(Vs, vc, bt, b.block_size, n_head_kv, kvh, j0, j_end, lvv);
        // S = Q·Kᵀ for this warp's 16 rows × KT keys.
        // K's fragments by ldmatrix: matrix i of a load is keys nt·8… × columns (ks + i/2)·16 +
        // (i%2)·8…, so r[0], r[1] are step ks's and r[2], r[3] step ks + 1's.
        float sc[KT / 8][4];
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < HD / 16; ks += 2) {
                u32 kf[4];
                ldsm4(kf, Ks + (nt * 8 + (lane & 7)) * LD + (ks + (lane >> 4)) * 16 + ((lane >> 3) & 1) * 8);
                mma_16816(sc[nt], qa[ks], kf[0], kf[1]);
                mma_16816(sc[nt], qa[ks + 1], kf[2], kf[3]);
            }
        }
        // Scale, soft-cap, mask; row maxima over the 4 lanes of each row.
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int j = j0 + nt * 8 + 2 * tq4 + (e & 1);
                int p = e < 2 ? p0 : p1;
                bool ok = j <= p && j < j_end && (window <= 0 || j > p - window) && (e < 2 ? r0 : r1) < ntok;
                float v = sc[nt][e] * scale;
                if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                v = ok ? v : -1e30f;
                sc[nt][e] = v;
                if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
            }
        }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
        }
        float c0 = __expf(m0 - mx0), c1 = __expf(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int i = 0; i < OC / 8; i++) {
            o[i][0] *= c0; o[i][1] *= c0; o[i][2] *= c1; o[i][3] *= c1;
        }
        // P = exp(S − m), as A fragments over the keys (16 per k-step).
        u32 pa[KT / 16][4];
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            float e0 = sc[nt][0] <= -1e29f ? 0.f : __expf(sc[nt][0] - m0);
            float e1 = sc[nt][1] <= -1e29f ? 0.f : __expf(sc[nt][1] - m0);
            float e2 = sc[nt][2] <= -1e29f ? 0.f : __expf(sc[nt][2] - m1);
            float e3 = sc[nt][3] <= -1e29f ? 0.f : __expf(sc[nt][3] - m1);
            l0 += e0 + e1;
            l1 += e2 + e3;
            pa[nt >> 1][(nt & 1) * 2] = pack_h2(e0, e1);
            pa[nt >> 1][(nt & 1) * 2 + 1] = pack_h2(e2, e3);
        }
        // V of this tile landed; every warp is done with K: the next tile's K is copied in.
        cp_async_wait<0>();
        __syncthreads();
        if (j0 + KT < j_end) flash_tile<HD, KT, KTY, LD>(Ks, kc, bt, b.block_size, n_head_kv, kvh, j0 + KT, j_end, lk);
        // O += P·V over this warp's columns.
        // V's fragments by ldmatrix, transposed: matrix i of a load is keys kk·16 + (i%2)·8… ×
        // columns of dn + i/2, so r[0], r[1] are dn's and r[2], r[3] dn + 1's.
#pragma unroll
        for (int dn = 0; dn < OC / 8; dn += 2) {
#pragma unroll
            for (int kk = 0; kk < KT / 16; kk++) {
                u32 vf[4];
                ldsm4_t(vf, Vs + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + cb + (dn + (lane >> 4)) * 8);
                mma_16816(o[dn], pa[kk], vf[0], vf[1]);
                mma_16816(o[dn + 1], pa[kk], vf[2], vf[3]);
            }
        }
    }
    // Row sums over the 4 lanes of each row; each row written (its only range), or this
    // range's state kept for flash_merge.
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
    }
    int kf0, n0, kf1, n1;
    row_ranges(b, tok0 + min(r0, ntok - 1), window, rk, kf0, n0);
    row_ranges(b, tok0 + min(r1, ntok - 1), window, rk, kf1, n1);
    bool ok0 = r0 < ntok && k >= kf0 && k < kf0 + n0, ok1 = r1 < ntok && k >= kf1 && k < kf1 + n1;
    float* pp0 = part + ((((long long)blockIdx.x * 64 + r0) * n_head + h) * n_ranges + (k - kf0)) * (HD + 2);
    float* pp1 = part + ((((long long)blockIdx.x * 64 + r1) * n_head + h) * n_ranges + (k - kf1)) * (HD + 2);
    if (cb == 0 && tq4 == 0) {
        if (ok0 && n0 > 1) { pp0[0] = m0; pp0[1] = l0; }
        if (ok1 && n1 > 1) { pp1[0] = m1; pp1[1] = l1; }
    }
    if (VROT) {
        // All warps are done with the tiles: the rows go through the row buffer.
        __syncthreads();
    }
#pragma unroll
    for (int dn = 0; dn < OC / 8; dn++) {
        int col = cb + dn * 8 + 2 * tq4;
        if (ok0 && n0 > 1) { pp0[2 + col] = o[dn][0]; pp0[3 + col] = o[dn][1]; }
        if (ok1 && n1 > 1) { pp1[2 + col] = o[dn][2]; pp1[3 + col] = o[dn][3]; }
        // The division as flash_merge's (a row's value does not depend on the path).
        float a0 = l0 > 0.f ? o[dn][0] / l0 : 0.f, a1 = l0 > 0.f ? o[dn][1] / l0 : 0.f;
        float b0 = l1 > 0.f ? o[dn][2] / l1 : 0.f, b1 = l1 > 0.f ? o[dn][3] / l1 : 0.f;
        if (VROT) {
            float* x = rows + (16 * rg + g) * HD + col;
            x[0] = a0; x[1] = a1; x[8 * HD] = b0; x[8 * HD + 1] = b1;
            continue;
        }
        if (ok0 && n0 == 1) {
            float* orow = out + ((long long)(tok0 + r0) * n_head + h) * HD + col;
            orow[0] = a0;
            orow[1] = a1;
        }
        if (ok1 && n1 == 1) {
            float* orow = out + ((long long)(tok0 + r1) * n_head + h) * HD + col;
            orow[0] = b0;
            orow[1] = b1;
        }
    }
    if (VROT) {
        __syncthreads();
        fwht_rows(rows, ROWS, HD);
        for (int e = tid; e < ROWS * HD; e += 128) {
            int r = row0 + e / HD, d = e % HD, kf, n;
            if (r >= ntok) continue;
            row_ranges(b, tok0 + r, window, rk, kf, n);
            if (n == 1) out[((long long)(tok0 + r) * n_head + h) * HD + d] = rows[e] * rs * tq[TQ_SIGNS + d];
        }
    }
}

// The ranges of the rows over several, merged in order (merge_ranges: as kvd_merge, un-rotated
// when VROT). grid (n_head, n_tiles, 64), block HD.
template <int HD, bool VROT>
__device__ void flash_merge_impl(const float* __restrict__ part, float* __restrict__ out, const int4* __restrict__ tiles,
                                 BatchView b, const float* __restrict__ tq, int n_head, int window, int rk,
                                 int n_ranges) {
    int h = blockIdx.x, ti = blockIdx.y, r = blockIdx.z;
    int4 tile = tiles[ti];
    if (r >= tile.z) return;
    int t = tile.y + r, kf, nr;
    row_ranges(b, t, window, rk, kf, nr);
    if (nr <= 1) return;  // written by flash_attention
    merge_ranges<HD, VROT>(part + (((long long)ti * 64 + r) * n_head + h) * n_ranges * (HD + 2), nr,
                           out + ((long long)t * n_head + h) * HD, tq);
}

// The kernels of a (K type, V type) module, per head dim (registry.rs `kernels`). KT, RG, CS as
// at the top of this file: HD 256 takes key tiles of 32 and two warps per 16 rows.
template <int HD, int KTY, int VTY>
__global__ void __launch_bounds__(128)
    flash_attention(const float* q, const u8* kc, const u8* vc, float* out, float* part, const int4* tiles, BatchView b,
                    const float* tq, int n_head, int n_head_kv, float scale, int window, float softcap, int rk,
                    int n_ranges) {
    pdl_begin();
    constexpr int KT = HD == 256 ? 32 : 64, RG = HD == 256 ? 2 : 4, CS = 4 / RG;
    flash_impl<HD, KT, RG, CS, KTY, VTY>(q, kc, vc, out, part, tiles, b, tq, n_head, n_head_kv, scale, window, softcap,
                                         rk, n_ranges);
}
template <int HD, int VTY>
__global__ void flash_merge(const float* part, float* out, const int4* tiles, BatchView b, const float* tq, int n_head,
                            int window, int rk, int n_ranges) {
    pdl_begin();
    flash_merge_impl<HD, kv_rotated(VTY, HD)>(part, out, tiles, b, tq, n_head, window, rk, n_ranges);
}
