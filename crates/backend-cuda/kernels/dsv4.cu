// DeepSeek-V4's hyper-connections and clamped SwiGLU (src/dsv4.rs), each the scalar reference
// of quiver_backend::dsv4 in the same operations (fused multiply-adds where it fuses): a row's
// results never depend on the other rows of the step.

#define HC_MAX 8

// out[t, h·d + c] = x[t, c] for each of the hc streams.
// grid (ceil(rows·hc·d / 256)), block 256.
extern "C" __global__ void hc_expand(const float* __restrict__ x, float* __restrict__ out, long long rows, int hc,
                                     int d) {
    pdl_begin();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= rows * hc * d) return;
    const long long t = i / ((long long)hc * d);
    out[i] = x[t * d + (int)(i % d)];
}

// The grouped product's layouts (src/dsv4.rs matmul_grouped_kernel): row-major [rows, groups, w]
// into group-major [groups, rows, w] (to_groups), or back. grid-stride, block 256.
extern "C" __global__ void group_major(const float* __restrict__ src, float* __restrict__ dst, long long rows,
                                       int groups, int w, int to_groups) {
    pdl_begin();
    const long long n = rows * groups * w;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / ((long long)groups * w);
        const int g = (int)(i / w % groups), c = (int)(i % w);
        const long long gm = ((long long)g * rows + t) * w + c;
        if (to_groups) dst[gm] = src[i];
        else dst[i] = src[gm];
    }
}

__device__ __forceinline__ float hc_sigmoid(float x) { return __fdiv_rn(1.f, 1.f + expf(-x)); }

// One token's pre, post and comb weights from its mixes (quiver_backend::dsv4::hc_weights), by
// one warp: lane l owns comb elements l and l + 32 (src e / hc, dst e % hc) and computes each in
// the reference's operations, every sum in its order (a row's or column's sum is computed alike by
// each lane of that row or column, from the values before the phase: the serial form's bits);
// pre into pre[hc]; unless `head`, post then comb[src·hc + dst] into pc (shared memory).
__device__ void hc_weights_warp(const float* mixes, const float* scale, const float* base, int hc, float eps,
                                int iters, bool head, float* pre, float* pc) {
    const int lane = threadIdx.x & 31, n = hc * hc;
    if (lane < hc) pre[lane] = hc_sigmoid(__fmul_rn(mixes[lane], scale[0]) + base[lane]) + eps;
    if (head) {
        __syncwarp();
        return;
    }
    if (lane < hc) pc[lane] = 2.f * hc_sigmoid(__fmul_rn(mixes[hc + lane], scale[1]) + base[hc + lane]);
    float* comb = pc + hc;
    for (int e = lane; e < n; e += 32) comb[e] = fmaf(mixes[2 * hc + e], scale[2], base[2 * hc + e]);
    __syncwarp();
    // Softmax over dst per src row, + eps.
    float v[2] = {0.f, 0.f};
    for (int k = 0, e = lane; k < 2; k++, e += 32) {
        if (e >= n) break;
        const float* row = comb + e / hc * hc;
        float m = __int_as_float(0xff800000);
        for (int j = 0; j < hc; j++) m = fmaxf(m, row[j]);
        float sum = 0.f;
        for (int j = 0; j < hc; j++) sum += expf(row[j] - m);
        v[k] = fmaf(expf(comb[e] - m), __fdiv_rn(1.f, sum), eps);
    }
    // The Sinkhorn rounds in registers: lane l holds elements l and l + 32 (c[0], c[1]; the
    // second only where hc² > 32), a row's or column's values come by shuffles (all issued
    // before the sums), summed in the serial form's order. Each element's row and column
    // starts are worked out once (a lane's integer divisions by hc, not one per round).
    float c[2] = {v[0], v[1]};
    const int slots = n > 32 ? 2 : 1;
    int row0[2], col0[2];  // each slot's row and column starts
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int e = lane + 32 * k;
        row0[k] = e / hc * hc;
        col0[k] = e % hc;
    }
    for (int it = 0; it < iters; it++) {
        for (int cols = it == 0 ? 1 : 0; cols < 2; cols++) {
            const int step = cols ? hc : 1;
            float nv[2] = {c[0], c[1]};
#pragma unroll
            for (int k = 0; k < 2; k++) {
                if (k >= slots) break;
                float got[HC_MAX];
#pragma unroll
                for (int j = 0; j < HC_MAX; j++) {
                    const int at = ((cols ? col0[k] : row0[k]) + j * step) & 63;  // lanes past n: any element (unused)
                    const float lo = __shfl_sync(0xffffffffu, c[0], at & 31);
                    const float hi = slots > 1 ? __shfl_sync(0xffffffffu, c[1], at & 31) : 0.f;
                    got[j] = at < 32 ? lo : hi;
                }
                float sum = eps;
#pragma unroll
                for (int j = 0; j < HC_MAX; j++)
                    if (j < hc) sum += got[j];
                nv[k] = __fmul_rn(c[k], __fdiv_rn(1.f, sum));
            }
            c[0] = nv[0], c[1] = nv[1];
        }
    }
    for (int k = 0, e = lane; k < 2 && e < n; k++, e += 32) comb[e] = c[k];
    __syncwarp();
}

// A block's (or, with `head`, the output head's) input from the hc streams: out[t, c] =
// Σ_h pre[h]·x[t, h·d + c] (the block's fused, the head's products then sums), and the block's
// post and comb weights into pc [rows, hc + hc²]. Each block's first warp makes the token's
// weights (the same bits in every block of the row), then the block takes HC_COLS columns.
// With `part` non-null the mixes come from hc_mix_part's chunks (P of them, R + 1 values each,
// rows of `cols`), summed as hc_mix_sum sums them (its bits; norm_eps its eps), not from `mixes`.
// grid (rows, ceil(d / HC_COLS)), block 128.
#define HC_COLS 512
__device__ __forceinline__ void hc_mix_sum_warp(const float* __restrict__ part, int P, int R, int cols, float eps,
                                                long long t, float* __restrict__ out);
extern "C" __global__ void hc_pre(const float* __restrict__ x, const float* __restrict__ mixes,
                                  const float* __restrict__ scale, const float* __restrict__ base,
                                  float* __restrict__ out, float* __restrict__ pc, int hc, int d, float eps, int iters,
                                  int head, const float* __restrict__ part, int P, int cols, float norm_eps) {
    pdl_begin();
    __shared__ float pre[HC_MAX], w[HC_MAX + HC_MAX * HC_MAX], mx[32];
    const long long t = blockIdx.x;
    const int md = head ? hc : (2 + hc) * hc, pcd = hc + hc * hc;
    // The streams' columns of this thread, loaded before the weights are waited for (their
    // latency under warp 0's).
    const float* xt = x + t * hc * d;
    constexpr int PER = HC_COLS / 128;
    const int c0 = blockIdx.y * HC_COLS + threadIdx.x;
    float xv[HC_MAX][PER];
#pragma unroll
    for (int h = 0; h < HC_MAX; h++)
#pragma unroll
        for (int u = 0; u < PER; u++) xv[h][u] = h < hc && c0 + u * 128 < d ? xt[h * d + c0 + u * 128] : 0.f;
    if (threadIdx.x < 32) {
        if (part) {
            hc_mix_sum_warp(part, P, md, cols, norm_eps, t, mx);
            __syncwarp();
        }
        hc_weights_warp(part ? mx : mixes + t * md, scale, base, hc, eps, iters, head != 0, pre, w);
    }
    __syncthreads();
    if (!head && blockIdx.y == 0)
        for (int i = threadIdx.x; i < pcd; i += blockDim.x) pc[t * pcd + i] = w[i];
    float acc[PER];
#pragma unroll
    for (int u = 0; u < PER; u++) acc[u] = 0.f;
#pragma unroll
    for (int h = 0; h < HC_MAX; h++) {
        if (h >= hc) break;
#pragma unroll
        for (int u = 0; u < PER; u++)
            acc[u] = head ? __fadd_rn(acc[u], __fmul_rn(xv[h][u], pre[h])) : fmaf(xv[h][u], pre[h], acc[u]);
    }
#pragma unroll
    for (int u = 0; u < PER; u++)
        if (c0 + u * 128 < d) out[t * d + c0 + u * 128] = acc[u];
}

// DeepSeek-V4's mixes (quiver_backend::Backend::hc_mixes): out[t, r] = (Σ_c w[r, c]·x[t, c]) /
// rms(x[t]), R ≤ HCM_R rows of w in f32, in one order whatever the step: hc_mix_part sums each
// chunk of HCM_COLS columns of a row (a thread's 4 columns as an fmaf chain, the warp's
// butterfly, the block's 8 warps in order) for every r and for Σx², into part [rows, P, R + 1];
// hc_mix_sum adds a row's P chunks in order and scales by rsqrt(Σx² / cols + eps).
#define HCM_COLS 1024
#define HCM_ROWS 8
#define HCM_R 32
// grid (P = ceil(cols / HCM_COLS), ceil(rows / HCM_ROWS)), block 256; cols a multiple of 4.
extern "C" __global__ void __launch_bounds__(256)
    hc_mix_part(const float* __restrict__ x, const float* __restrict__ w, long long w_stride, int R, int cols,
                long long rows, float* __restrict__ part) {
    pdl_begin();
    __shared__ float red[8][HCM_R + 1];
    const int p = blockIdx.x, P = gridDim.x, c = p * HCM_COLS + threadIdx.x * 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool in = c < cols;
    float4 wv[HCM_R];
#pragma unroll
    for (int r = 0; r < HCM_R; r++)
        wv[r] = (r < R && in) ? *(const float4*)(w + r * w_stride + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 0; k < HCM_ROWS; k++) {
        const long long t = (long long)blockIdx.y * HCM_ROWS + k;
        if (t >= rows) break;
        const float4 xv = in ? *(const float4*)(x + t * cols + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        float ss = fmaf(xv.w, xv.w, fmaf(xv.z, xv.z, fmaf(xv.y, xv.y, xv.x * xv.x)));
        ss = warp_sum(ss);
        if (lane == 0) red[warp][HCM_R] = ss;
#pragma unroll
        for (int r = 0; r < HCM_R; r++) {
            float d = fmaf(wv[r].w, xv.w, fmaf(wv[r].z, xv.z, fmaf(wv[r].y, xv.y, wv[r].x * xv.x)));
            d = warp_sum(d);
            if (lane == 0) red[warp][r] = d;
        }
        __syncthreads();
        if (threadIdx.x <= R) {
            const int i = threadIdx.x == R ? HCM_R : threadIdx.x;
            float v = 0.f;
            for (int q = 0; q < 8; q++) v += red[q][i];
            part[(t * P + p) * (R + 1) + threadIdx.x] = v;
        }
        __syncthreads();
    }
}

// Row t's mixes from its parts into out[0..R], by one warp.
__device__ __forceinline__ void hc_mix_sum_warp(const float* __restrict__ part, int P, int R, int cols, float eps,
                                                long long t, float* __restrict__ out) {
    const int i = threadIdx.x & 31;
    float v = 0.f;
    if (i <= R) {
        // The chunks in order, loaded four at a time (one wait for four, the same sums).
        const float* p = part + t * P * (R + 1) + i;
        int q = 0;
        for (; q + 4 <= P; q += 4) {
            const float a0 = p[q * (R + 1)], a1 = p[(q + 1) * (R + 1)], a2 = p[(q + 2) * (R + 1)],
                        a3 = p[(q + 3) * (R + 1)];
            v += a0;
            v += a1;
            v += a2;
            v += a3;
        }
        for (; q < P; q++) v += p[q * (R + 1)];
    }
    const float ss = __shfl_sync(0xffffffffu, v, R);
    if (i < R) out[i] = v * rsqrtf(ss / cols + eps);
}

// grid (rows), block 32.
extern "C" __global__ void hc_mix_sum(const float* __restrict__ part, int P, int R, int cols, float eps,
                                      float* __restrict__ out) {
    pdl_begin();
    hc_mix_sum_warp(part, P, R, cols, eps, blockIdx.x, out + (long long)blockIdx.x * R);
}

// A block's output streams: out[t, dst·d + c] = post[dst]·y[t, c] + Σ_src comb[src][dst]·
// residual[t, src·d + c], fused in src order. grid (ceil(rows·hc·d / 256)), block 256.
extern "C" __global__ void hc_post(const float* __restrict__ y, const float* __restrict__ residual,
                                   const float* __restrict__ pc, float* __restrict__ out, long long rows, int hc,
                                   int d) {
    pdl_begin();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= rows * hc * d) return;
    const long long t = i / ((long long)hc * d);
    const int dst = (int)(i / d % hc), c = (int)(i % d);
    const float* w = pc + t * (hc + hc * hc);
    const float* r = residual + t * hc * d;
    float acc = __fmul_rn(y[t * d + c], w[dst]);
    for (int s = 0; s < hc; s++) acc = fmaf(r[s * d + c], w[hc + s * hc + dst], acc);
    out[i] = acc;
}

// ---- DeepSeek-V4's attention (quiver_backend::dsv4::attention) ----
// In the reference's phases: ds_prepare (each row's key; each sequence's compressor rings and
// compressed rows brought up to its last row, by the block of its first row, in position
// order), ds_select (the lightning indexer's top-k per row, ratio 4), ds_head (each row and
// head over the window and the compressed rows, in chunks of keys by index: a row's floats do
// not depend on the step's other rows), ds_commit (each sequence's keys into its window ring).
// A slot's parts lie at a.off[0..7] (dsv4.rs `layout`): the raw window ring, the compressor's
// value and score rings, its rows, the indexer's rings and its rows.

struct DsAttn {
    int hd, nh, np, cnp, n_swa, raw_ring, ratio, ring, cw, nc, ih, id, top_k, kf, planes;
    long long sf;
    long long off[7];
    float eps, scale, mscale, cmscale;
};

// Rotates the last 2·np values of v by the angles at position p (adjacent pairs; sign −1: back),
// as the reference's rope_tail. The block's threads stride over the pairs.
__device__ void ds_rope_tail(float* v, int n, int np, float p, const float* theta, float mscale, float sign) {
    const int off = n - 2 * np;
    for (int i = threadIdx.x; i < np; i += blockDim.x) {
        float s, c;
        sincosf(p * theta[i], &s, &c);
        s = __fmul_rn(__fmul_rn(s, mscale), sign);
        c = __fmul_rn(c, mscale);
        const float x0 = v[off + 2 * i], x1 = v[off + 2 * i + 1];
        v[off + 2 * i] = fmaf(x0, c, -__fmul_rn(x1, s));
        v[off + 2 * i + 1] = fmaf(x0, s, __fmul_rn(x1, c));
    }
}

// The indexer's rotation (dsv4/select.rs `ix_rotate`): blocks of n (64, doubled while dim allows)
// scaled by 1/√n, then Walsh–Hadamard transformed stage by stage (each stage's pairs are
// independent: the reference's bits). The whole block calls it; v in shared memory.
__device__ void ds_ix_rotate(float* v, int dim) {
    if (dim % 64) return;
    int n = 64;
    while (dim % (2 * n) == 0) n *= 2;
    const float sc = 1.f / sqrtf((float)n);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) v[i] = __fmul_rn(v[i], sc);
    __syncthreads();
    for (int h = 1; h < n; h *= 2) {
        for (int k = threadIdx.x; k < dim / 2; k += blockDim.x) {
            const int blk = k / (n / 2), r = k % (n / 2);
            const int i0 = blk * n + (r / h) * 2 * h + r % h;
            const float x0 = v[i0], x1 = v[i0 + h];
            v[i0] = __fadd_rn(x0, x1);
            v[i0 + h] = __fsub_rn(x0, x1);
        }
        __syncthreads();
    }
}

// Σ over the block of v (f64), the same order every call; `red` holds 32 doubles.
__device__ double ds_block_sum(double v, double* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w];
    __syncthreads();
    return s;
}

// The ring rows position p writes, in kept order (raw, comp value, comp score, indexer value,
// indexer score; absent rings of length 0): their offsets in a slot and lengths
// (dsv4/rollback.rs `ring_rows`).
__device__ void ds_ring_rows(const DsAttn& a, long long p, long long at[5], int len[5]) {
    const int ix = a.ratio == 4 ? 2 * a.id : 0, cw = a.ratio > 0 ? a.cw : 0, ring = a.ring ? a.ring : 1;
    at[0] = a.off[0] + (p % a.raw_ring) * a.hd;
    at[1] = a.off[1] + (p % ring) * cw;
    at[2] = a.off[2] + (p % ring) * cw;
    at[3] = a.off[4] + (p % 8) * ix;
    at[4] = a.off[5] + (p % 8) * ix;
    len[0] = a.hd;
    len[1] = len[2] = cw;
    len[3] = len[4] = ix;
}

// Copies parts lo..hi of the ring rows position p writes from the slot into kept row `row`
// (dsv4/rollback.rs Kept::keep).
__device__ void ds_keep(const DsAttn& a, const float* slot, float* row, long long p, int lo, int hi) {
    long long start[5];
    int len[5];
    ds_ring_rows(a, p, start, len);
    int at = 0;
    for (int k = 0; k < lo; k++) at += len[k];
    for (int k = lo; k < hi; k++) {
        for (int i = threadIdx.x; i < len[k]; i += blockDim.x) row[at + i] = slot[start[k] + i];
        at += len[k];
    }
}

// The kept row of row t of a span of L rows (none: null): its last `planes` rows keep.
__device__ float* ds_kept_row(const DsAttn& a, BatchView b, float* kept, int first, int L, int t) {
    if (!kept || a.planes == 0) return nullptr;
    const u32 q = b.kept_slot[b.seq[first]];
    const int r = t - first;
    if (q == 0xFFFFFFFFu || r + a.planes < L) return nullptr;
    return kept + ((long long)q * a.planes + (r + a.planes - L)) * a.kf;
}

// One compressor: position p's value and score rows (score + ape) into the rings, and block
// p / ratio's row when p ends it (dsv4.rs `compress`): per channel the softmax-weighted sum over
// the block's ring rows (ratio 4: the previous block's first halves too), RMS norm, rope at
// b·ratio, the indexer's rotation (`rot`), f16. `buf` holds dim floats of shared memory.
__device__ void ds_compress_step(const DsAttn& a, float* slot, const float* kv, const float* sc, const float* ape,
                                 const float* norm, int parts0, int ratio, int ring, int w, int dim, long long p,
                                 const float* ctheta, bool rot, float* buf, double* red) {
    float* rk = slot + a.off[parts0];
    float* rs = slot + a.off[parts0 + 1];
    float* rows = slot + a.off[parts0 + 2];
    const long long rr = p % ring;
    const float* ap = ape + (p % ratio) * w;
    for (int i = threadIdx.x; i < w; i += blockDim.x) {
        rk[rr * w + i] = kv[i];
        rs[rr * w + i] = __fadd_rn(sc[i], ap[i]);
    }
    __syncthreads();
    if ((p + 1) % ratio) return;
    const long long blk = p / ratio;
    const bool overlap = ratio == 4;
    const int n0 = (overlap && blk > 0) ? ratio : 0;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        auto src = [&](int j, long long& row, int& off) {
            if (j < n0) { row = ((blk - 1) * ratio + j) % ring; off = 0; }
            else { row = (blk * ratio + (j - n0)) % ring; off = overlap ? dim : 0; }
        };
        const int n = n0 + ratio;
        float m = __int_as_float(0xff800000);
        for (int j = 0; j < n; j++) {
            long long row; int off;
            src(j, row, off);
            m = fmaxf(m, rs[row * w + off + c]);
        }
        double den = 0.0;
        for (int j = 0; j < n; j++) {
            long long row; int off;
            src(j, row, off);
            den += (double)expf(__fsub_rn(rs[row * w + off + c], m));
        }
        const float inv = (float)(1.0 / den);
        double num = 0.0;
        for (int j = 0; j < n; j++) {
            long long row; int off;
            src(j, row, off);
            const float wt = __fmul_rn(expf(__fsub_rn(rs[row * w + off + c], m)), inv);
            num += (double)__fmul_rn(rk[row * w + off + c], wt);
        }
        buf[c] = (float)num;
    }
    __syncthreads();
    double ss = 0.0;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += (double)__fmul_rn(buf[c], buf[c]);
    ss = ds_block_sum(ss, red);
    const float mean = (float)(ss / dim);
    const float s = 1.f / sqrtf(__fadd_rn(mean, a.eps));
    for (int c = threadIdx.x; c < dim; c += blockDim.x) buf[c] = __fmul_rn(__fmul_rn(buf[c], s), norm[c]);
    __syncthreads();
    ds_rope_tail(buf, dim, a.cnp, (float)(blk * ratio), ctheta, a.cmscale, 1.f);
    __syncthreads();
    if (rot) ds_ix_rotate(buf, dim);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) rows[blk * dim + c] = h2f(f2h(buf[c]));
    __syncthreads();
}

// Phase 1. Every row: its key (kv rotated at its position, f16-rounded) into keys [rows, hd] and
// its sequence's first row into row0. The block of a sequence's first row: the compressors over
// its rows in position order (what each row's ring rows held first into its kept row).
// grid (rows), block 256; shared memory: 2·max(hd, id) + 32 doubles.
extern "C" __global__ void ds_prepare(BatchView b, int rows, DsAttn a, const float* __restrict__ theta,
                                      const float* __restrict__ ctheta, const float* __restrict__ kv,
                                      const float* __restrict__ ckv, const float* __restrict__ csc,
                                      const float* __restrict__ ikv, const float* __restrict__ isc,
                                      const float* __restrict__ ape, const float* __restrict__ norm,
                                      const float* __restrict__ ix_ape, const float* __restrict__ ix_norm,
                                      float* __restrict__ state, float* __restrict__ kept, float* __restrict__ keys,
                                      int* __restrict__ row0) {
    pdl_begin();
    __shared__ double red[32];
    extern __shared__ float dsm[];
    const int r = blockIdx.x;
    if (b.slot[r] == 0xFFFFFFFFu) return;
    float* k = dsm;
    for (int i = threadIdx.x; i < a.hd; i += blockDim.x) k[i] = kv[(long long)r * a.hd + i];
    __syncthreads();
    ds_rope_tail(k, a.hd, a.np, (float)b.pos[r], theta, a.mscale, 1.f);
    __syncthreads();
    for (int i = threadIdx.x; i < a.hd; i += blockDim.x) keys[(long long)r * a.hd + i] = h2f(f2h(k[i]));
    int end;
    if (!dn_first(b, rows, r, end)) return;
    for (int t = r + threadIdx.x; t < end; t += blockDim.x) row0[t] = r;
    if (a.ratio == 0) return;
    float* slot = state + (long long)b.state_slot[b.seq[r]] * a.sf;
    for (int t = r; t < end; t++) {
        const long long p = b.pos[t];
        float* kr = ds_kept_row(a, b, kept, r, end - r, t);
        if (kr) ds_keep(a, slot, kr, p, 1, 5);
        __syncthreads();
        ds_compress_step(a, slot, ckv + (long long)t * a.cw, csc + (long long)t * a.cw, ape, norm, 1, a.ratio, a.ring,
                         a.cw, a.hd, p, ctheta, false, dsm, red);
        if (a.ratio == 4)
            ds_compress_step(a, slot, ikv + (long long)t * 2 * a.id, isc + (long long)t * 2 * a.id, ix_ape, ix_norm, 4,
                             4, 8, 2 * a.id, a.id, p, ctheta, true, dsm, red);
    }
}

// A float's key in the order of the reference's sort (larger first; −0 as +0; NaN last).
__device__ __forceinline__ u32 ds_key(float v) {
    if (v != v) return 0u;
    if (v == 0.f) v = 0.f;
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of x over the block (blockDim 256), and the total; `sh` holds 9 ints.
__device__ int ds_scan(int x, int* sh, int& total) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int v = x;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    if (lane == 31) sh[w] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int i = 0; i < 8; i++) { const int c = sh[i]; sh[i] = s; s += c; }
        sh[8] = s;
    }
    __syncthreads();
    const int r = sh[w] + v - x;
    total = sh[8];
    __syncthreads();
    return r;
}

// Phase 2 (ratio 4): row r0 + blockIdx.x's compressed rows when more are visible than top_k
// (dsv4/select.rs): the indexer's queries rotated (rope at the row's position, the rotation),
// each visible row's score Σ_h max(q_h·k, 0)·w_h/√(id·ih) (one thread a row, the reference's
// order), then the top_k by score (ties to the earlier row) by a radix select, written
// ascending into sel [rows, top_k]. grid (chunk rows), block 256; shared memory ih·id floats.
extern "C" __global__ void ds_select(BatchView b, int r0, int rows, DsAttn a, const float* __restrict__ ctheta,
                                     const float* __restrict__ ixq, const float* __restrict__ ixw,
                                     const float* __restrict__ state, float* __restrict__ scores,
                                     int* __restrict__ sel) {
    pdl_begin();
    __shared__ int hist[256];
    __shared__ int sh[9];
    __shared__ u32 pre_s;
    __shared__ int need_s;
    extern __shared__ float iq[];
    const int t = r0 + blockIdx.x;
    if (t >= rows || b.slot[t] == 0xFFFFFFFFu) return;
    const long long p = b.pos[t];
    const int n_vis = (int)((p + 1) / 4);
    if (n_vis <= a.top_k) return;
    const float* slot = state + (long long)b.state_slot[b.seq[t]] * a.sf;
    const float* icomp = slot + a.off[6];
    const int ih = a.ih, id = a.id;
    for (int i = threadIdx.x; i < ih * id; i += blockDim.x) iq[i] = ixq[(long long)t * ih * id + i];
    __syncthreads();
    for (int h = 0; h < ih; h++) {
        ds_rope_tail(iq + h * id, id, a.cnp, (float)p, ctheta, a.cmscale, 1.f);
        __syncthreads();
        ds_ix_rotate(iq + h * id, id);
        __syncthreads();
    }
    const float wscale = 1.f / sqrtf((float)(id * ih));
    float* sc = scores + (long long)blockIdx.x * a.nc;
    for (int rr = threadIdx.x; rr < n_vis; rr += blockDim.x) {
        const float* k = icomp + (long long)rr * id;
        float s = 0.f;
        for (int h = 0; h < ih; h++) {
            float dot = 0.f;
            for (int i = 0; i < id; i++) dot = __fadd_rn(dot, __fmul_rn(iq[h * id + i], k[i]));
            s = __fadd_rn(s, __fmul_rn(fmaxf(dot, 0.f), __fmul_rn(ixw[(long long)t * ih + h], wscale)));
        }
        sc[rr] = s;
    }
    __syncthreads();
    // The top_k-th largest key, 8 bits at a time from the top.
    u32 pre = 0, mask = 0;
    int need = a.top_k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int rr = threadIdx.x; rr < n_vis; rr += blockDim.x) {
            const u32 k = ds_key(sc[rr]);
            if ((k & mask) == pre) atomicAdd(&hist[(k >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255, acc = 0;
            while (d > 0 && acc + hist[d] < need) acc += hist[d--];
            pre_s = pre | ((u32)d << shift);
            need_s = need - acc;
        }
        __syncthreads();
        pre = pre_s;
        need = need_s;
        mask |= 255u << shift;
        __syncthreads();
    }
    // Rows above the threshold, and the first `need` equal to it, in row order.
    int base = 0, ties = 0;
    int* out = sel + (long long)t * a.top_k;
    for (int c0 = 0; c0 < n_vis; c0 += blockDim.x) {
        const int rr = c0 + threadIdx.x;
        const u32 k = rr < n_vis ? ds_key(sc[rr]) : 0u;
        const bool tie = rr < n_vis && k == pre;
        int nt;
        const int tie_rank = ties + ds_scan(tie ? 1 : 0, sh, nt);
        const bool take = rr < n_vis && (k > pre || (tie && tie_rank < need));
        int nk;
        const int at = base + ds_scan(take ? 1 : 0, sh, nk);
        if (take) out[at] = rr;
        base += nk;
        ties += nt;
    }
}

#define DS_CH 128

// Phase 3: row t's head blockIdx.y into out [rows, nh·hd], rotated back (dsv4/head.rs): q rotated
// and rounded to f16 as the reference's row form; the keys are the window's (this step's from
// its sequence's first row on, the ring's before) then the compressed rows (every visible one,
// or sel's); the softmax online over chunks of DS_CH keys by index (a chunk's scores by a warp a
// key, its weights and sum in key order), the sink's logit last. grid (rows, nh), block 128;
// shared memory hd floats.
extern "C" __global__ void ds_head(BatchView b, int rows, DsAttn a, const float* __restrict__ theta,
                                   const float* __restrict__ q, const float* __restrict__ state,
                                   const float* __restrict__ keys, const int* __restrict__ row0,
                                   const int* __restrict__ sel, const float* __restrict__ sinks,
                                   float* __restrict__ out) {
    pdl_begin();
    __shared__ float sc[DS_CH];
    __shared__ const float* kp[DS_CH];
    extern __shared__ float qs[];
    const int t = blockIdx.x, hh = blockIdx.y, hd = a.hd;
    if (b.slot[t] == 0xFFFFFFFFu) return;
    const long long p = b.pos[t];
    const int f0 = row0[t];
    const long long p0 = b.pos[f0];
    const float* slot = state + (long long)b.state_slot[b.seq[t]] * a.sf;
    const float* raw = slot + a.off[0];
    const float* comp = slot + a.off[3];
    const long long first = p + 1 > a.n_swa ? p + 1 - a.n_swa : 0;
    const int n_raw = (int)(p + 1 - first);
    const int n_vis = a.ratio ? (int)((p + 1) / a.ratio) : 0;
    const bool use_sel = a.ratio == 4 && n_vis > a.top_k;
    const int n = n_raw + (use_sel ? a.top_k : n_vis);
    const float* qt = q + ((long long)t * a.nh + hh) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = qt[i];
    __syncthreads();
    ds_rope_tail(qs, hd, a.np, (float)p, theta, a.mscale, 1.f);
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = h2f(f2h(qs[i]));
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    float m = __int_as_float(0xff800000), sum = 0.f;
    for (int j0 = 0; j0 < n; j0 += DS_CH) {
        const int cn = min(DS_CH, n - j0);
        for (int j = threadIdx.x; j < cn; j += blockDim.x) {
            const int jj = j0 + j;
            const float* kk;
            if (jj < n_raw) {
                const long long qp = first + jj;
                kk = qp >= p0 ? keys + (f0 + (qp - p0)) * hd : raw + (qp % a.raw_ring) * hd;
            } else {
                int rr = jj - n_raw;
                if (use_sel) rr = sel[(long long)t * a.top_k + rr];
                kk = comp + (long long)rr * hd;
            }
            kp[j] = kk;
        }
        __syncthreads();
        for (int j = warp; j < cn; j += nw) {
            const float* kk = kp[j];
            float d = 0.f;
            for (int i = lane; i < hd; i += 32) d = fmaf(qs[i], kk[i], d);
            d = warp_sum(d);
            if (lane == 0) sc[j] = __fmul_rn(d, a.scale);
        }
        __syncthreads();
        float cm = __int_as_float(0xff800000);
        for (int j = 0; j < cn; j++) cm = fmaxf(cm, sc[j]);
        const float mn = fmaxf(m, cm);
        const float alpha = expf(m - mn);
        sum *= alpha;
        for (int i = 0; i < 4; i++) o[i] *= alpha;
        m = mn;
        __syncthreads();
        for (int j = threadIdx.x; j < cn; j += blockDim.x) sc[j] = expf(sc[j] - m);
        __syncthreads();
        for (int j = 0; j < cn; j++) sum += sc[j];
        for (int i = 0; i < 4; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c >= hd) break;
            float acc = o[i];
            for (int j = 0; j < cn; j++) acc = fmaf(sc[j], kp[j][c], acc);
            o[i] = acc;
        }
        __syncthreads();
    }
    const float sk = sinks[hh];
    if (sk > m) {
        const float ms = expf(m - sk);
        for (int i = 0; i < 4; i++) o[i] *= ms;
        sum = fmaf(sum, ms, 1.f);
    } else {
        sum += expf(sk - m);
    }
    const float inv = sum == 0.f ? 0.f : 1.f / sum;
    for (int i = 0; i < 4; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < hd) qs[c] = o[i] * inv;
    }
    __syncthreads();
    ds_rope_tail(qs, hd, a.np, (float)p, theta, a.mscale, -1.f);
    __syncthreads();
    float* ot = out + ((long long)t * a.nh + hh) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) ot[i] = qs[i];
}

// Phase 4: each sequence's keys into its slot's window ring in position order (what a row
// overwrites kept first). grid (rows), block 256.
extern "C" __global__ void ds_commit(BatchView b, int rows, DsAttn a, float* __restrict__ state,
                                     float* __restrict__ kept, const float* __restrict__ keys) {
    pdl_begin();
    int end;
    const int r = blockIdx.x;
    if (!dn_first(b, rows, r, end)) return;
    float* slot = state + (long long)b.state_slot[b.seq[r]] * a.sf;
    for (int t = r; t < end; t++) {
        const long long p = b.pos[t];
        float* kr = ds_kept_row(a, b, kept, r, end - r, t);
        if (kr) ds_keep(a, slot, kr, p, 0, 1);
        __syncthreads();
        float* dst = slot + a.off[0] + (p % a.raw_ring) * a.hd;
        for (int i = threadIdx.x; i < a.hd; i += blockDim.x) dst[i] = keys[(long long)t * a.hd + i];
        __syncthreads();
    }
}

// dsv4/rollback.rs `rewind`: slot `slot` back to its state after row `row` of a span of `len`
// rows from position `start`, the last row first, from kept slot `kslot`. grid 1, block 256.
extern "C" __global__ void ds_rewind(DsAttn a, float* __restrict__ state, const float* __restrict__ kept,
                                     long long slot, long long kslot, long long start, int len, int row) {
    pdl_begin();
    float* st = state + slot * a.sf;
    for (int r = len - 1; r > row; r--) {
        const float* src = kept + (kslot * a.planes + (r + a.planes - len)) * a.kf;
        long long at[5];
        int lens[5];
        ds_ring_rows(a, start + r, at, lens);
        int o = 0;
        for (int k = 0; k < 5; k++) {
            for (int i = threadIdx.x; i < lens[k]; i += blockDim.x) st[at[k] + i] = src[o + i];
            o += lens[k];
        }
        __syncthreads();
    }
}

// DeepSeek-V4's routing (quiver_backend::dsv4::moe_route) into routes as moe_route writes them:
// probabilities √softplus(logit); the experts of the row's token's row of `hash` (ids as f32),
// else the k best of probability + bias (ties to the smaller index, NaN last); their weights the
// unbiased probabilities, normalised where `norm` (the sum in f64, at least 2⁻¹⁴), times scale
// (≠ 0, 1). grid (rows), block 32; n_expert ≤ 1024, k ≤ 32.
__device__ __forceinline__ float ds_prob(float l) { return sqrtf(l > 20.f ? l : logf(1.f + expf(l))); }

extern "C" __global__ void moe_route_dsv4(BatchView b, const float* __restrict__ logits, float* __restrict__ routes,
                                          int n_expert, int k, const float* __restrict__ bias,
                                          const float* __restrict__ hash, int norm, float scale) {
    pdl_begin();
    const long long t = blockIdx.x;
    const float* l = logits + t * n_expert;
    const int lane = threadIdx.x;
    float my_w = 0.f;
    int my_e = 0;
    if (hash) {
        if (lane < k) {
            my_e = (int)hash[(long long)b.tokens[t] * k + lane];
            my_w = ds_prob(l[my_e]);
        }
    } else {
        // The lane's experts' scores once, in registers (expert lane + 32c in pv[c]).
        float pv[32];
#pragma unroll
        for (int c = 0; c < 32; c++) {
            const int i = lane + 32 * c;
            if (32 * c >= n_expert) break;
            pv[c] = i < n_expert ? (bias ? __fadd_rn(ds_prob(l[i]), bias[i]) : ds_prob(l[i])) : 0.f;
        }
        u32 taken = 0;
        for (int j = 0; j < k && j < n_expert; j++) {
            float bv = 0.f;
            int bi = -1;
#pragma unroll
            for (int c = 0; c < 32; c++) {
                const int i = lane + 32 * c;
                if (32 * c >= n_expert) break;
                if (i < n_expert && !(taken >> c & 1u) && route_before(pv[c], i, bv, bi)) { bv = pv[c]; bi = i; }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (oi >= 0 && route_before(ov, oi, bv, bi)) { bv = ov; bi = oi; }
            }
            if (bi % 32 == lane) taken |= 1u << (bi / 32);
            if (lane == j) { my_e = bi; my_w = ds_prob(l[bi]); }
        }
    }
    const int kk = min(k, n_expert);
    double s = lane < kk ? (double)my_w : 0.0;
    // The weights' sum in slot order, as the reference's.
    double tot = 0.0;
    for (int j = 0; j < kk; j++) tot += __shfl_sync(0xffffffffu, s, j);
    if (lane < kk) {
        float w = my_w;
        if (norm) w = __fdiv_rn(w, fmaxf((float)tot, 6.103515625e-5f));
        if (scale != 0.f && scale != 1.f) w = __fmul_rn(w, scale);
        float* r = routes + (t * k + lane) * 2;
        r[0] = (float)my_e;
        r[1] = w;
    }
}
