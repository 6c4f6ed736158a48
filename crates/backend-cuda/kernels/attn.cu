// ---- Flash-attention prefill on tensor cores (mma.sync m16n8k16, f16 in, f32 accumulate) ----
// A query tile is up to 64 consecutive tokens of one sequence (tiles[i] = {seq, first token,
// token count, 0}), positions consecutive. grid (n_tiles, n_head, 64 / (16·RG)), block 128
// (4 warps): block z takes tile rows 16·RG·z … +16·RG−1; warp w owns 16 of them (row group
// w / CS) and the output columns of its column group (w % CS, HD / CS columns each). Key tiles of
// KT keys are loaded to shared memory through the block table; key tiles entirely masked (after
// the block's last query position, or before its first query's window) are never visited.
//   HD 64, 128: RG 4, CS 1, KT 64 (each warp 16 rows × all columns).
//   HD 256:     RG 2, CS 2, KT 32 (two warps per 16 rows, each half the columns: both compute
//               the row's scores, so the softmax statistics agree; registers stay under 255).
template <int HD, int KT, int RG, int CS>
__device__ void flash_impl(const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
                           float* __restrict__ out, const int4* __restrict__ tiles, BatchView b, int n_head,
                           int n_head_kv, float scale, int window, float softcap) {
    static_assert(RG * CS == 4, "4 warps");
    const int LD = HD + 8;  // padded row (halves): conflict-free fragment loads
    const int OC = HD / CS;  // output columns per warp
    __shared__ u16 Ks[KT * LD];
    __shared__ u16 Vs[KT * LD];
    int4 tile = tiles[blockIdx.x];
    int s = tile.x, tok0 = tile.y, ntok = tile.z;
    int row0 = blockIdx.z * 16 * RG;  // the block's first row in the tile
    if (row0 >= ntok) return;
    int h = blockIdx.y, kvh = h / (n_head / n_head_kv), kv_dim = n_head_kv * HD;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    int rg = w / CS, cb = (w % CS) * OC;  // row group, first output column
    int p_first = (int)b.pos[tok0] + row0, p_last = (int)b.pos[tok0] + min(ntok, row0 + 16 * RG) - 1;
    int kv_len = (int)b.kv_len[s];
    const u32* bt = b.block_tables + b.bt_off[s];
    int j_end = min(p_last + 1, kv_len);
    int j_begin = window > 0 ? max(0, p_first - window + 1) : 0;
    j_begin -= j_begin % KT;

    // Q fragments (f16) of this warp's 16 rows, all HD columns.
    u32 qa[HD / 16][4];
    int r0 = row0 + 16 * rg + g, r1 = r0 + 8;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ks++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int col = ks * 16 + 2 * tq + 8 * half;
            float x0 = 0.f, x1 = 0.f, y0 = 0.f, y1 = 0.f;
            if (r0 < ntok) {
                const float* qr = q + ((long long)(tok0 + r0) * n_head + h) * HD + col;
                x0 = qr[0]; x1 = qr[1];
            }
            if (r1 < ntok) {
                const float* qr = q + ((long long)(tok0 + r1) * n_head + h) * HD + col;
                y0 = qr[0]; y1 = qr[1];
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

    for (int j0 = j_begin; j0 < j_end; j0 += KT) {
        __syncthreads();
        // KT keys × HD halves of K and V, 16 bytes per thread per step.
        for (int c = threadIdx.x; c < KT * (HD / 8); c += 128) {
            int kr = c / (HD / 8), kcol = (c % (HD / 8)) * 8, j = j0 + kr;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (j < j_end) {
                long long slot = (long long)bt[j / b.block_size] * b.block_size + j % b.block_size;
                kv4 = *(const uint4*)(kc + slot * kv_dim + kvh * HD + kcol);
                vv4 = *(const uint4*)(vc + slot * kv_dim + kvh * HD + kcol);
            }
            *(uint4*)(Ks + kr * LD + kcol) = kv4;
            *(uint4*)(Vs + kr * LD + kcol) = vv4;
        }
        __syncthreads();
        // S = Q·Kᵀ for this warp's 16 rows × KT keys.
        float sc[KT / 8][4];
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < HD / 16; ks++) {
                const u16* kr = Ks + (nt * 8 + g) * LD + ks * 16 + 2 * tq;
                mma_16816(sc[nt], qa[ks], *(const u32*)kr, *(const u32*)(kr + 8));
            }
        }
        // Scale, soft-cap, mask; row maxima over the 4 lanes of each row.
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int j = j0 + nt * 8 + 2 * tq + (e & 1);
                int p = e < 2 ? p0 : p1;
                bool ok = j <= p && j < kv_len && (window <= 0 || j > p - window) && (e < 2 ? r0 : r1) < ntok;
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
        // O += P·V over this warp's columns.
#pragma unroll
        for (int dn = 0; dn < OC / 8; dn++) {
#pragma unroll
            for (int kk = 0; kk < KT / 16; kk++) {
                const u16* v0 = Vs + (kk * 16 + 2 * tq) * LD + cb + dn * 8 + g;
                u32 b0 = (u32)v0[0] | ((u32)v0[LD] << 16);
                u32 b1 = (u32)v0[8 * LD] | ((u32)v0[9 * LD] << 16);
                mma_16816(o[dn], pa[kk], b0, b1);
            }
        }
    }
    // Row sums over the 4 lanes of each row, then the normalised output.
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
    }
    float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
#pragma unroll
    for (int dn = 0; dn < OC / 8; dn++) {
        int col = cb + dn * 8 + 2 * tq;
        if (r0 < ntok) {
            float* orow = out + ((long long)(tok0 + r0) * n_head + h) * HD + col;
            orow[0] = o[dn][0] * i0;
            orow[1] = o[dn][1] * i0;
        }
        if (r1 < ntok) {
            float* orow = out + ((long long)(tok0 + r1) * n_head + h) * HD + col;
            orow[0] = o[dn][2] * i1;
            orow[1] = o[dn][3] * i1;
        }
    }
}

#define FLASH_KERNEL(HD, KT, RG, CS)                                                                 \
    extern "C" __global__ void __launch_bounds__(128) flash_attention_##HD(                          \
        const float* q, const u16* kc, const u16* vc, float* out, const int4* tiles, BatchView b,    \
        int n_head, int n_head_kv, float scale, int window, float softcap) { pdl_begin();            \
        flash_impl<HD, KT, RG, CS>(q, kc, vc, out, tiles, b, n_head, n_head_kv, scale, window, softcap); \
    }
FLASH_KERNEL(64, 64, 4, 1)
FLASH_KERNEL(96, 64, 4, 1)
FLASH_KERNEL(128, 64, 4, 1)
FLASH_KERNEL(256, 32, 2, 2)
