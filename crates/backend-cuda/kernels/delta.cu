// ---- The gated delta net (Qwen 3.5's linear-attention layers) ----
// The scalar reference is crates/backend/src/delta_net.rs; these kernels compute it per
// sequence, in its order of tokens, so that a sequence's floats do not depend on the step's
// other rows. A sequence's rows are consecutive in the step; the grid's x goes over the step's
// sequences (dn_seq; src/delta.rs `seq_grid`).
//
// The recurrent state of one sequence in one layer (`state_slot` of the batch, `per` floats a
// slot): the convolution's last k - 1 input rows (oldest first, [k - 1, C]), then one S × S
// matrix per value head, row j (value index) over i (key index). A sequence whose first row is
// at position 0 starts from zeros.
//
// With kept states (`snap` not null, `planes` per kept slot: quiver_backend::Snapshots), the
// state after row t of a span of L rows also goes to plane t + 1 + planes - L of the span's
// kept slot (`kept_slot`; none: 0xFFFFFFFF) when that is in 0..planes and t is not the last row.

// The plane that keeps the state after row t of a span of L rows, or -1.
__device__ __forceinline__ int dn_plane(int planes, int L, int t) {
    const int j = t + 1 + planes - L;
    return (t + 1 < L && j >= 0) ? j : -1;
}

// Whether row r begins a sequence of the step (and that sequence's rows r..end). Every lane of
// the warp calls it (the condition is the warp's: r is the block's); they look for the end 32
// rows a load.
__device__ __forceinline__ bool dn_first(BatchView b, int rows, int r, int& end) {
    const u32 s = b.seq[r];
    if (b.slot[r] == 0xFFFFFFFFu || (r > 0 && b.seq[r - 1] == s)) return false;
    for (int e0 = r + 1;; e0 += 32) {
        const int e = e0 + (int)(threadIdx.x & 31);
        const bool stop = e >= rows || b.seq[e] != s || b.slot[e] == 0xFFFFFFFFu;
        const unsigned m = __ballot_sync(0xffffffffu, stop);
        if (m) {
            end = e0 + __ffs(m) - 1;
            return true;
        }
    }
}

// The sequence of block x: its first row r and its end. The grid goes over the step's sequences,
// or over its rows in a step a graph replays (whose sequences vary under one grid): the blocks
// past the step's sequences (no rows) return.
__device__ __forceinline__ bool dn_seq(BatchView b, int& r, int& end) {
    const int n = (int)b.seq_rows[blockIdx.x];
    r = (int)b.seq_row[blockIdx.x];
    end = r + n;
    return n > 0;
}

__device__ __forceinline__ float dn_silu(float x) { return x / (1.f + expf(-x)); }

// The causal convolution (taps oldest first) then SiLU, in place over x ([rows, C]), channel by
// channel; the state keeps the last k - 1 inputs; then the L2 norm of each q and k head (the
// first `normed` heads; the rest by dn_norm). A block takes S channels of one sequence (a head
// where it norms them; lanes past S idle)
// and its tokens in rounds of SEGS segments of DN_CONV_SEG: each thread loads its segment's inputs
// and the 7 before them (from the state before the sequence's first row, and from the previous
// round's last segment, whose inputs the round overwrote, through shared memory), the block
// waits, each thread convolves its segment's rows, a q or k head's squares go through shared
// memory to the segment's warps (row u to warp u mod SW / 32), which sum each row's (lane l
// over channels l, l + 32, .. in double, then a butterfly) into its scale, and each
// thread writes its outputs: x / √(Σx² / S + eps / S) / √S, llama.cpp's rms_norm(x, eps / S) /
// √S. a[j] holds the segment's row j - 7 (the first 7: rows before it); output u takes a[u + q]
// for the taps q = 8 - k .. 7 (tap q - (8 - k)), the window after row u is a[u + q] for
// q = 9 - k .. 7 (state row q - (9 - k)). grid (sequences, ⌈C / S⌉), block (SW = S rounded up
// to 32, SEGS = 256 / SW).
#define DN_CONV_SEG 16
#define DN_CONV_W 128
extern "C" __global__ void __launch_bounds__(256)
    dn_conv(BatchView b, float* __restrict__ x, int C, const float* __restrict__ w, int k,
            float* __restrict__ state, long long per, float* __restrict__ snap, int planes, int S, int normed,
            float eps) {
    pdl_begin();
    __shared__ float carry[7][DN_CONV_W];
    __shared__ float sq[256 * DN_CONV_SEG];  // [segment][row][SW]
    __shared__ float scl[256 / 32][DN_CONV_SEG];
    int r, end;
    const int lane = threadIdx.x, sg = threadIdx.y, SW = blockDim.x, SEGS = blockDim.y;
    const int head = blockIdx.y, ch = head * S + lane;
    if (!dn_seq(b, r, end)) return;
    const bool live = lane < S && ch < C, norm = head < normed;
    const int cc = live ? ch : 0, L = end - r;
    const long long slot = b.state_slot[b.seq[r]];
    const u32 kslot = snap ? b.kept_slot[b.seq[r]] : 0xFFFFFFFFu;
    float* st = state + slot * per;
    const bool fresh = b.pos[r] == 0;
    const float n = (float)S, post = 1.f / sqrtf(n);
    float tap[8];
#pragma unroll
    for (int q = 0; q < 8; q++) tap[q] = q >= 8 - k ? w[(long long)cc * k + q - (8 - k)] : 0.f;
    // The input at row p of the sequence (p ≥ -(k - 1)); before the first row, the state's.
    auto input = [&](int p) {
        if (p >= 0) return x[(long long)(r + min(p, L - 1)) * C + cc];
        const int i = k - 1 + p;
        return (i >= 0 && !fresh) ? st[(long long)i * C + cc] : 0.f;
    };
    float a[DN_CONV_SEG + 7], y[DN_CONV_SEG];
    for (int t0 = 0; t0 < L; t0 += SEGS * DN_CONV_SEG) {
        const int s0 = t0 + sg * DN_CONV_SEG;
        // A segment past the sequence loads nothing (decode: one segment works).
        if (s0 < L) {
#pragma unroll
            for (int j = 0; j < 7; j++) a[j] = (sg == 0 && t0 > 0) ? carry[j][lane] : input(s0 - 7 + j);
#pragma unroll
            for (int u = 0; u < DN_CONV_SEG; u++) a[7 + u] = input(s0 + u);
        }
        __syncthreads();  // every load of the round (carry included) before any write
        if (sg == SEGS - 1)
#pragma unroll
            for (int j = 0; j < 7; j++) carry[j][lane] = a[DN_CONV_SEG + j];
#pragma unroll
        for (int u = 0; u < DN_CONV_SEG; u++) {
            const int t = s0 + u;
            y[u] = 0.f;
            if (live && t < L) {
                float s = 0.f;
#pragma unroll
                for (int q = 0; q < 8; q++)
                    if (q >= 8 - k) s += a[u + q] * tap[q];
                y[u] = dn_silu(s);
                const int pl = kslot != 0xFFFFFFFFu ? dn_plane(planes, L, t) : -1;
                if (pl >= 0) {
                    float* kept = snap + ((long long)kslot * planes + pl) * per;
#pragma unroll
                    for (int q = 0; q < 8; q++)
                        if (q >= 9 - k) kept[(long long)(q - (9 - k)) * C + ch] = a[u + q];
                }
                // The state: the last k - 1 inputs (rows L - k + 1 .. L - 1).
                if (t >= L - (k - 1)) st[(long long)(t - (L - (k - 1))) * C + ch] = a[7 + u];
            }
            if (norm) sq[(sg * DN_CONV_SEG + u) * SW + lane] = y[u] * y[u];
        }
        if (norm) {
            __syncthreads();  // the head's squares in
            const int l = lane & 31;
            for (int u = lane >> 5; u < DN_CONV_SEG && s0 + u < L; u += SW >> 5) {
                const float* row = sq + (sg * DN_CONV_SEG + u) * SW;
                double ss = 0.0;
                for (int i = l; i < S; i += 32) ss += (double)row[i];
                for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                if (l == 0) scl[sg][u] = 1.f / sqrtf((float)(ss / n) + eps / n);
            }
            __syncthreads();  // the scales in
        }
#pragma unroll
        for (int u = 0; u < DN_CONV_SEG; u++) {
            const int t = s0 + u;
            if (!live || t >= L) break;
            x[(long long)(r + t) * C + ch] = norm ? y[u] * scl[sg][u] * post : y[u];
        }
        __syncthreads();  // the writes, the carry and the squares before the next round's
    }
    // A sequence shorter than k - 1 rows keeps the newest of the old state's rows: state row i
    // takes the sequence's row p = L - (k - 1) + i < 0, which the first segment's a[7 + p] holds
    // (its only round).
    if (live && sg == 0 && L < k - 1)
#pragma unroll
        for (int q = 0; q < 7; q++)
            if (q - 7 >= L - (k - 1)) st[(long long)(q - 7 - (L - (k - 1))) * C + ch] = a[q];
}

// The L2 norm of each q and k head (the first 2·nk·S columns of each row of x, [rows, C]) apart
// from the convolution (prompts), in dn_conv's order: x / √(Σx² / S + eps / S) / √S.
// grid (rows, 2·nk), block 32.
extern "C" __global__ void dn_norm(float* __restrict__ x, int C, int S, float eps) {
    pdl_begin();
    float* h = x + (long long)blockIdx.x * C + blockIdx.y * S;
    double ss = 0.0;
    for (int i = threadIdx.x; i < S; i += 32) ss += (double)(h[i] * h[i]);
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float n = (float)S;
    const float scale = 1.f / sqrtf((float)(ss / n) + eps / n), post = 1.f / sqrtf(n);
    for (int i = threadIdx.x; i < S; i += 32) h[i] = h[i] * scale * post;
}

// The sum of v over the H lanes of a row (lanes h·⌊l/H⌋ ..): a butterfly, whose additions give
// every lane of the row the same bits (a + b = b + a).
template <int H>
__device__ __forceinline__ float dn_row_sum(float v) {
#pragma unroll
    for (int o = 1; o < H; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The gated delta rule of one sequence and value head: per token, M ← M·e^g, δ_j = (v_j −
// Σ_i M[j][i] k_i)·β, M[j][i] += δ_j k_i, o_j = Σ_i M[j][i] q_i / √S; g = softplus(α + dt_bias)·a,
// β = σ(β raw). Rows j of M are independent of each other: H lanes hold a row in registers, 32
// entries each, in chunks of 4: lane h of the row holds chunk c's entries i = c·4H + 4h .. + 3
// (so that a warp's load of a chunk reads whole 32-byte sectors of M's rows). Each lane sums its
// entries in four chains (entry e of each chunk into chain e, the chains then (c0 + c1) +
// (c2 + c3)) and the row's lanes meet in dn_row_sum: a token's floats are the same in a prompt
// and in decode (one order, whatever the step). Tokens' q, k and v come through the warp's shared
// memory in a ring of DN_RING tokens (cp.async, DN_RING - 1 tokens ahead); the gate and β of 32
// tokens at a time, lane l computing token l's and the token's lane handing them out, the next 32
// tokens' raw values loaded meanwhile. The sums run over all SM: the entries past S are zeros in
// M, q and k, which add exact zeros (no branch between the steps). Instances: src/delta.rs
// `RULE_LANES`. grid (sequences, value heads, ceil(S / (32 / H))), block 32.
#define DN_RING 4
template <int SM, int H>
__global__ void dn_rule(BatchView b, const float* __restrict__ x, int C, int nk, int S,
                        const float* __restrict__ alpha, const float* __restrict__ beta,
                        const float* __restrict__ dt_bias, const float* __restrict__ a, float* __restrict__ state,
                        long long per, long long conv_floats, float* __restrict__ snap, int planes,
                        float* __restrict__ out) {
    pdl_begin();
    constexpr int W = SM / H, NC = W / 4;   // a lane's entries and chunks
    constexpr int PER = (SM + 31) / 32;     // q and k values a lane copies
    constexpr int NR = 32 / H;              // the warp's rows
    static_assert(W == 32, "32 entries a lane");
    __shared__ __align__(16) float qk[DN_RING][2][SM];  // [token % ring][q, k][entry]
    __shared__ __align__(16) float vs[DN_RING][NR];
    int r, end;
    const int h = blockIdx.y, hv = gridDim.y, lane = threadIdx.x;
    const int part = lane % H, j = blockIdx.z * NR + lane / H;
    if (!dn_seq(b, r, end)) return;
    const bool live = j < S;
    const long long slot = b.state_slot[b.seq[r]];
    const u32 kslot = snap ? b.kept_slot[b.seq[r]] : 0xFFFFFFFFu;
    float* mat = state + slot * per + conv_floats + (long long)h * S * S;
    const bool fresh = b.pos[r] == 0;
    // Chunk c's first entry of this lane; whole chunks by float4 where the rows allow it.
    auto at = [&](int c) { return c * 4 * H + 4 * part; };
    const bool vec = S % 4 == 0 && ((unsigned long long)mat & 15) == 0 && ((unsigned long long)snap & 15) == 0 &&
                     (per & 3) == 0 && (conv_floats & 3) == 0;
    // Row j's entries of this lane from `src` into m, or m into `dst`.
    auto load = [&](float* m, const float* src) {
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const int i = at(c);
            if (vec && live && i < S) {
                const float4 v = *(const float4*)(src + (long long)j * S + i);
                m[4 * c] = v.x, m[4 * c + 1] = v.y, m[4 * c + 2] = v.z, m[4 * c + 3] = v.w;
            } else {
#pragma unroll
                for (int e = 0; e < 4; e++) m[4 * c + e] = (live && i + e < S) ? src[(long long)j * S + i + e] : 0.f;
            }
        }
    };
    auto store = [&](const float* m, float* dst) {
        if (!live) return;
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const int i = at(c);
            if (vec && i < S) {
                *(float4*)(dst + (long long)j * S + i) = make_float4(m[4 * c], m[4 * c + 1], m[4 * c + 2], m[4 * c + 3]);
            } else {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (i + e < S) dst[(long long)j * S + i + e] = m[4 * c + e];
            }
        }
    };
    float m[W];
    if (fresh) {
#pragma unroll
        for (int u = 0; u < W; u++) m[u] = 0.f;
    } else {
        load(m, mat);
    }
    const int kh = h % nk, kd = nk * S;
    const float scale = 1.f / sqrtf((float)S), dtb = dt_bias[h], ah = a[h];
    // Token t's q, k and v into ring slot t % DN_RING (cp.async: no registers); a group always
    // (empty past the end), so that DN_RING - 2 groups younger than token t's are in flight.
    auto fetch = [&](int t) {
        if (t < end) {
            const float* row = x + (long long)t * C;
#pragma unroll
            for (int u = 0; u < PER; u++) {
                const int i = u * 32 + lane;
                if (i < SM) {
                    cp_async4(&qk[t % DN_RING][0][i], row + kh * S + (i < S ? i : 0), i < S);
                    cp_async4(&qk[t % DN_RING][1][i], row + kd + kh * S + (i < S ? i : 0), i < S);
                }
            }
            const int jv = blockIdx.z * NR + lane;
            if (lane < NR) cp_async4(&vs[t % DN_RING][lane], row + 2 * kd + h * S + (jv < S ? jv : 0), jv < S);
        }
        cp_async_commit();
    };
    // The raw α and β of token t0 + lane.
    float pa = 0.f, pb = 0.f;
    auto raw = [&](int t0) {
        const int t = t0 + lane;
        if (t < end) {
            pa = alpha[(long long)t * hv + h];
            pb = beta[(long long)t * hv + h];
        }
    };
#pragma unroll
    for (int d = 0; d < DN_RING - 1; d++) fetch(r + d);
    raw(r);
    float gd = 0.f, gb = 0.f;  // this lane's token of the current 32: e^g and β
    for (int t = r; t < end; t++) {
        const int tl = (t - r) & 31;
        if (tl == 0) {
            const float al = pa + dtb;
            const float sp = al > 20.f ? al : logf(1.f + expf(al));
            gd = expf(sp * ah);
            gb = 1.f / (1.f + expf(-pb));
            raw(t + 32);
        }
        const float decay = __shfl_sync(0xffffffffu, gd, tl), bt = __shfl_sync(0xffffffffu, gb, tl);
        cp_async_wait<DN_RING - 2>();
        __syncwarp();  // token t's inputs in, every lane past token t - 1 (whose slot t + RING - 1 takes)
        fetch(t + DN_RING - 1);
        const float* qs = qk[t % DN_RING][0];
        const float* ks = qk[t % DN_RING][1];
        const float v = vs[t % DN_RING][lane / H];
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int cc = 0; cc < NC; cc++) {
            const float4 kv = *(const float4*)(ks + at(cc));
            const float kk[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float en = m[4 * cc + e] * decay;
                m[4 * cc + e] = en;
                c[e] += en * kk[e];
            }
        }
        const float dk = dn_row_sum<H>((c[0] + c[1]) + (c[2] + c[3]));
        const float d = (v - dk) * bt;
#pragma unroll
        for (int e = 0; e < 4; e++) c[e] = 0.f;
#pragma unroll
        for (int cc = 0; cc < NC; cc++) {
            const float4 kv = *(const float4*)(ks + at(cc)), qv = *(const float4*)(qs + at(cc));
            const float kk[4] = {kv.x, kv.y, kv.z, kv.w}, qq[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float en = m[4 * cc + e] + d * kk[e];
                m[4 * cc + e] = en;
                c[e] += en * qq[e];
            }
        }
        const float o = dn_row_sum<H>((c[0] + c[1]) + (c[2] + c[3]));
        if (live && part == 0) out[(long long)t * hv * S + h * S + j] = o * scale;
        const int pl = kslot != 0xFFFFFFFFu ? dn_plane(planes, end - r, t - r) : -1;
        if (pl >= 0) store(m, snap + ((long long)kslot * planes + pl) * per + conv_floats + (long long)h * S * S);
    }
    cp_async_wait<0>();
    store(m, mat);
}


// x[r, c] *= σ(gate[r, c]), or σ(gate[r]) with per_row. grid (ceil(rows·cols / 256)), block 256.
extern "C" __global__ void sigmoid_mul(float* __restrict__ x, const float* __restrict__ gate, long long rows,
                                       int cols, int per_row) {
    pdl_begin();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const float g = per_row ? gate[i / cols] : gate[i];
    x[i] *= 1.f / (1.f + expf(-g));
}
