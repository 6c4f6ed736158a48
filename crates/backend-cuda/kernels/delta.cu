// ---- The gated delta net (Qwen 3.5's linear-attention layers) ----
// The scalar reference is crates/backend/src/delta_net.rs; these kernels compute it per
// sequence, in its order of tokens, so that a sequence's floats do not depend on the step's
// other rows. A sequence's rows are consecutive in the step; the block of a sequence's first row
// does the sequence's work (the others return), so that the grid follows the step's rows (a
// graph's bucket) whatever the sequences.
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

// Whether row r begins a sequence of the step (and that sequence's rows r..end).
__device__ __forceinline__ bool dn_first(BatchView b, int rows, int r, int& end) {
    const u32 s = b.seq[r];
    if (b.slot[r] == 0xFFFFFFFFu || (r > 0 && b.seq[r - 1] == s)) return false;
    end = r + 1;
    while (end < rows && b.seq[end] == s && b.slot[end] != 0xFFFFFFFFu) end++;
    return true;
}

__device__ __forceinline__ float dn_silu(float x) { return x / (1.f + expf(-x)); }

// The causal convolution (taps oldest first) then SiLU, in place over x ([rows, C]), channel by
// channel; the state keeps the last k - 1 inputs. grid (rows, ceil(C / 256)), block 256.
extern "C" __global__ void dn_conv(BatchView b, int rows, float* __restrict__ x, int C, const float* __restrict__ w,
                                   int k, float* __restrict__ state, long long per, float* __restrict__ snap,
                                   int planes) {
    pdl_begin();
    int end;
    const int r = blockIdx.x, ch = blockIdx.y * 256 + threadIdx.x;
    if (ch >= C || !dn_first(b, rows, r, end)) return;
    const long long slot = b.state_slot[b.seq[r]];
    const u32 kslot = snap ? b.kept_slot[b.seq[r]] : 0xFFFFFFFFu;
    float* st = state + slot * per;
    const bool fresh = b.pos[r] == 0;
    // The window: k - 1 earlier inputs, then the current one (at most 8 taps).
    float win[8];
    for (int i = 0; i < k - 1; i++) win[i] = fresh ? 0.f : st[(long long)i * C + ch];
    for (int t = r; t < end; t++) {
        win[k - 1] = x[(long long)t * C + ch];
        float s = 0.f;
        for (int i = 0; i < k; i++) s += win[i] * w[ch * k + i];
        x[(long long)t * C + ch] = dn_silu(s);
        for (int i = 0; i + 1 < k; i++) win[i] = win[i + 1];
        const int j = kslot != 0xFFFFFFFFu ? dn_plane(planes, end - r, t - r) : -1;
        if (j >= 0) {
            float* kept = snap + ((long long)kslot * planes + j) * per;
            for (int i = 0; i < k - 1; i++) kept[(long long)i * C + ch] = win[i];
        }
    }
    for (int i = 0; i < k - 1; i++) st[(long long)i * C + ch] = win[i];
}

// The L2 norm of each q and k head (the first 2·nk·S columns of each row of x, [rows, C]):
// x / √(Σx² + eps) as llama.cpp's rms_norm(x, eps / S) / √S. grid (rows, 2·nk), block 32.
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

// The gated delta rule of one sequence and value head: per token, M ← M·e^g, δ_j = (v_j −
// Σ_i M[j][i] k_i)·β, M[j][i] += δ_j k_i, o_j = Σ_i M[j][i] q_i / √S; g = softplus(α + dt_bias)·a,
// β = σ(β raw). Thread j holds the matrix's row j (in shared memory as column j, so that the
// threads' reads at one i fall in consecutive banks). grid (rows, value heads), block S,
// dynamic smem (S·S + 2·S) floats.
extern "C" __global__ void dn_rule(BatchView b, int rows, const float* __restrict__ x, int C, int nk, int S,
                                   const float* __restrict__ alpha, const float* __restrict__ beta,
                                   const float* __restrict__ dt_bias, const float* __restrict__ a,
                                   float* __restrict__ state, long long per, long long conv_floats,
                                   float* __restrict__ snap, int planes, float* __restrict__ out) {
    pdl_begin();
    extern __shared__ float dsm[];
    int end;
    const int r = blockIdx.x, h = blockIdx.y, hv = gridDim.y, j = threadIdx.x;
    if (!dn_first(b, rows, r, end)) return;
    float* m = dsm;  // m[i·S + j] = M[j][i]
    float* qs = dsm + S * S;
    float* ks = qs + S;
    const long long slot = b.state_slot[b.seq[r]];
    const u32 kslot = snap ? b.kept_slot[b.seq[r]] : 0xFFFFFFFFu;
    float* mat = state + slot * per + conv_floats + (long long)h * S * S;
    const bool fresh = b.pos[r] == 0;
    for (int i = 0; i < S; i++) m[i * S + j] = fresh ? 0.f : mat[(long long)j * S + i];
    const int kh = h % nk, kd = nk * S;
    const float scale = 1.f / sqrtf((float)S);
    for (int t = r; t < end; t++) {
        const float* row = x + (long long)t * C;
        __syncthreads();
        qs[j] = row[kh * S + j];
        ks[j] = row[kd + kh * S + j];
        __syncthreads();
        const float v = row[2 * kd + h * S + j];
        const float al = alpha[(long long)t * hv + h] + dt_bias[h];
        const float sp = al > 20.f ? al : logf(1.f + expf(al));
        const float decay = expf(sp * a[h]);
        const float bt = 1.f / (1.f + expf(-beta[(long long)t * hv + h]));
        float dk = 0.f;
        for (int i = 0; i < S; i++) {
            const float e = m[i * S + j] * decay;
            m[i * S + j] = e;
            dk += e * ks[i];
        }
        const float d = (v - dk) * bt;
        float o = 0.f;
        for (int i = 0; i < S; i++) {
            const float e = m[i * S + j] + d * ks[i];
            m[i * S + j] = e;
            o += e * qs[i];
        }
        out[(long long)t * hv * S + h * S + j] = o * scale;
        const int pl = kslot != 0xFFFFFFFFu ? dn_plane(planes, end - r, t - r) : -1;
        if (pl >= 0) {
            float* kept = snap + ((long long)kslot * planes + pl) * per + conv_floats + (long long)h * S * S;
            for (int i = 0; i < S; i++) kept[(long long)j * S + i] = m[i * S + j];
        }
    }
    for (int i = 0; i < S; i++) mat[(long long)j * S + i] = m[i * S + j];
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
