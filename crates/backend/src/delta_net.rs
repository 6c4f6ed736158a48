//! The gated delta net (Qwen 3.5's linear-attention layers): a short causal convolution over
//! the in-projection's q, k and v channels, SiLU, L2-normed q and k, and the gated delta rule
//! over one S_k × S_v matrix per value head. Its per-sequence state (the convolution's last
//! `conv_kernel - 1` inputs and the matrices) lives in a slot of the model's recurrent state,
//! beside the paged KV cache.
//!
//! The scalar functions here are the reference every backend is tested against; the CPU
//! backend runs them as they are, one task per (sequence, value head).
//!
//! The delta rule, per token t and value head h (k-head `h % n_k_heads`, as llama.cpp tiles the
//! k heads over the value heads), with the matrix held row j (value index) over i (key index):
//!
//! ```text
//!   M   ← M · exp(g_t)
//!   δ_j = (v_j − Σ_i M[j][i] k_i) · β_t
//!   M[j][i] += δ_j k_i
//!   o_j = Σ_i M[j][i] q_i / √S_k
//! ```
//!
//! [`chunked`] is the same recurrence in the parallel (chunked, WY) form: it equals the
//! recurrent one within rounding (`tests` below), the form a prompt kernel would take.

/// One gated-delta-net layer's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaNetParams {
    /// Key heads (`ssm.group_count`).
    pub n_k_heads: usize,
    /// Value heads (`ssm.time_step_rank`), a multiple of the key heads.
    pub n_v_heads: usize,
    /// Key head width (`ssm.state_size`).
    pub head_k: usize,
    /// Value head width (`ssm.inner_size / n_v_heads`); equal to `head_k`.
    pub head_v: usize,
    /// The convolution's width (`ssm.conv_kernel`).
    pub conv_kernel: usize,
    /// The L2 norm's epsilon (the model's RMS epsilon, as llama.cpp takes it).
    pub eps: f32,
}

impl DeltaNetParams {
    /// Width of the q and of the k channels.
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.head_k
    }
    /// Width of the v channels (and of the layer's output before `ssm_out`).
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.head_v
    }
    /// The convolution's channels: q, k, v.
    pub fn channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Floats of one sequence's convolution state.
    pub fn conv_floats(&self) -> usize {
        (self.conv_kernel.saturating_sub(1)) * self.channels()
    }
    /// Floats of one sequence's delta-rule matrices.
    pub fn matrix_floats(&self) -> usize {
        self.n_v_heads * self.head_k * self.head_v
    }
    /// Floats of one sequence's whole state in one layer: the convolution's, then the
    /// matrices (head after head, each `head_v` rows of `head_k`).
    pub fn state_floats(&self) -> usize {
        self.conv_floats() + self.matrix_floats()
    }
    /// Whether the shape is one the op computes.
    pub fn check(&self) -> Result<(), String> {
        if self.n_k_heads == 0 || self.n_v_heads == 0 || self.head_k == 0 {
            return Err("zero heads or head width".into());
        }
        if !self.n_v_heads.is_multiple_of(self.n_k_heads) {
            return Err(format!(
                "{} value heads are not a multiple of {} key heads",
                self.n_v_heads, self.n_k_heads
            ));
        }
        if self.head_k != self.head_v {
            return Err(format!(
                "key head width {} differs from value head width {}",
                self.head_k, self.head_v
            ));
        }
        if self.conv_kernel == 0 {
            return Err("convolution width 0".into());
        }
        Ok(())
    }
}

/// The weights [`crate::Backend::delta_net`] reads: the convolution's kernel as one vector
/// ([channels · conv_kernel], channel after channel, tap 0 the oldest), the gate's bias
/// (`ssm_dt.bias`) and its per-head factor (`ssm_a`, −exp(A_log)), each [n_v_heads].
#[derive(Clone, Copy)]
pub struct DeltaNetWeights<'a, W> {
    pub conv: &'a W,
    pub dt_bias: &'a W,
    pub a: &'a W,
}

/// Where [`crate::Backend::delta_net`] keeps, beside a speculating sequence's state, the states
/// of its last rows, so that speculative decoding can return it to the state after any
/// accepted proposal: `planes` states per kept slot (a span's `SeqSpan::kept_slot`: the
/// step's speculating sequences each have one; other spans keep nothing), kept slot k's plane
/// j at `(k · planes + j) · state_floats` of `buf`. For a span of `len` rows, plane j holds the
/// state after row `len − 1 − planes + j` ([`Snapshots::row_of`]); the state after the last
/// row is the slot itself, and planes of rows before the span's first are left as they were.
/// A verification span of one token and d ≤ `planes` proposals, a < d of them accepted,
/// returns to plane `planes − d + a`.
pub struct Snapshots<'a, Buf> {
    pub buf: &'a mut Buf,
    pub planes: usize,
}

impl<Buf> Snapshots<'_, Buf> {
    /// The plane that keeps the state after row `row` of a span of `len` rows, if one does.
    pub fn plane_of(planes: usize, len: usize, row: usize) -> Option<usize> {
        (row + 1 < len && row + 1 + planes >= len).then(|| row + 1 + planes - len)
    }

    /// The row whose state plane j keeps in a span of `len` rows, if any.
    pub fn row_of(planes: usize, len: usize, j: usize) -> Option<usize> {
        (j < planes && len + j > planes).then(|| len + j - planes - 1)
    }
}

/// ggml's softplus: x past 20 as is, else ln(1 + eˣ).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The causal convolution of one sequence's `n` new rows of `c` channels (`x`, [n, c]) with
/// its state (`conv`, the previous `k - 1` rows, oldest first), kernel `w` ([c, k], tap 0 the
/// oldest), then SiLU, into `out` ([n, c]); the state becomes the last `k - 1` rows.
pub fn conv_silu(
    x: &[f32],
    n: usize,
    c: usize,
    w: &[f32],
    k: usize,
    conv: &mut [f32],
    out: &mut [f32],
) {
    let hist = k - 1;
    // Row r of the input window: state rows first, then the new rows.
    let row = |conv: &[f32], r: usize, ch: usize| -> f32 {
        if r < hist {
            conv[r * c + ch]
        } else {
            x[(r - hist) * c + ch]
        }
    };
    for t in 0..n {
        for ch in 0..c {
            let mut s = 0.0f32;
            for i in 0..k {
                s += row(conv, t + i, ch) * w[ch * k + i];
            }
            out[t * c + ch] = silu(s);
        }
    }
    // The last k - 1 rows of the window.
    let mut next = vec![0.0f32; hist * c];
    for r in 0..hist {
        for ch in 0..c {
            next[r * c + ch] = row(conv, n + r, ch);
        }
    }
    conv[..hist * c].copy_from_slice(&next);
}

/// x / √(Σx² + eps) (llama.cpp's `rms_norm(x, eps / n) / √n`), in place.
pub fn l2_norm(x: &mut [f32], eps: f32) {
    let n = x.len() as f32;
    // Squares in f32 summed in f64, as ggml's rms_norm.
    let ss: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let scale = 1.0 / ((ss / n as f64) as f32 + eps / n).sqrt();
    let post = 1.0 / n.sqrt();
    for v in x.iter_mut() {
        *v = *v * scale * post;
    }
}

/// One token of the gated delta rule on one head's matrix `m` (`s` rows of `s`: row j over
/// the key index), q already L2-normed (the 1/√S scale is applied here); the head's output
/// into `o` ([s]).
#[allow(clippy::too_many_arguments)]
pub fn step(m: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, o: &mut [f32]) {
    let s = v.len();
    let decay = g.exp();
    let scale = 1.0 / (q.len() as f32).sqrt();
    // Row by row, the row staying in cache through its three passes.
    for j in 0..s {
        o[j] = step_row(&mut m[j * s..(j + 1) * s], q, k, v[j], decay, beta, scale);
    }
}

/// Row j of [`step`]: the row decayed, moved by (v_j − row·k)·β along k; its output row·q
/// scaled.
#[inline]
pub fn step_row(
    row: &mut [f32],
    q: &[f32],
    k: &[f32],
    vj: f32,
    decay: f32,
    beta: f32,
    scale: f32,
) -> f32 {
    for x in row.iter_mut() {
        *x *= decay;
    }
    let d = (vj - dot(row, k)) * beta;
    for (a, &b) in row.iter_mut().zip(k) {
        *a += d * b;
    }
    dot(row, q) * scale
}

/// Σ a·b in 16 lanes (lane l sums elements l, l + 16, …; the lanes then in order, the tail
/// last): an order the compiler vectorizes, the same whatever the batch.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (x, y) in ar.iter().zip(br) {
        sum += x * y;
    }
    sum
}

/// Per-token inputs of the delta rule of one sequence and one value head, as [`step`] takes
/// them (q, k normed; v; the gate g, a log decay; β), read in place: token t's q, k and v are
/// `width`-long runs of `rows` at `t · stride` plus their offsets, its g and β
/// `gates[t · gate_stride]` and `betas[t · gate_stride]`.
#[derive(Clone, Copy)]
pub struct HeadInputs<'a> {
    pub rows: &'a [f32],
    pub stride: usize,
    pub q_at: usize,
    pub k_at: usize,
    pub v_at: usize,
    pub width: usize,
    pub gates: &'a [f32],
    pub betas: &'a [f32],
    pub gate_stride: usize,
    pub n: usize,
}

impl<'a> HeadInputs<'a> {
    fn run(&self, t: usize, at: usize) -> &'a [f32] {
        &self.rows[t * self.stride + at..][..self.width]
    }
    pub fn q(&self, t: usize) -> &'a [f32] {
        self.run(t, self.q_at)
    }
    pub fn k(&self, t: usize) -> &'a [f32] {
        self.run(t, self.k_at)
    }
    pub fn v(&self, t: usize) -> &'a [f32] {
        self.run(t, self.v_at)
    }
    pub fn g(&self, t: usize) -> f32 {
        self.gates[t * self.gate_stride]
    }
    pub fn beta(&self, t: usize) -> f32 {
        self.betas[t * self.gate_stride]
    }
}

/// The recurrent form over a run of tokens: `emit(t, o, m)` gets token t's output row and the
/// matrix after it.
pub fn recurrent_with(
    m: &mut [f32],
    h: &HeadInputs,
    row: &mut [f32],
    mut emit: impl FnMut(usize, &[f32], &[f32]),
) {
    for t in 0..h.n {
        step(m, h.q(t), h.k(t), h.v(t), h.g(t), h.beta(t), row);
        emit(t, row, m);
    }
}

/// The recurrent form over a run of tokens: `o` gets one row of `width` per token.
pub fn recurrent(m: &mut [f32], h: &HeadInputs, o: &mut [f32]) {
    let s = h.width;
    let mut row = vec![0f32; s];
    recurrent_with(m, h, &mut row, |t, r, _| {
        o[t * s..(t + 1) * s].copy_from_slice(r)
    });
}

/// The chunked (parallel) form of [`recurrent`]: tokens in chunks of `cs`; within a chunk the
/// delta rule's triangular system is solved once (the WY representation), the chunk's outputs
/// come from the matrix at the chunk's start plus the intra-chunk attention, and the matrix
/// moves once per chunk. Computed in f64 within a chunk.
pub fn chunked(m: &mut [f32], h: &HeadInputs, cs: usize, o: &mut [f32]) {
    let n = h.n;
    if n == 0 {
        return;
    }
    let (s, sk) = (h.width, h.width);
    let scale = 1.0 / (sk as f64).sqrt();
    let mut st: Vec<f64> = m.iter().map(|&x| x as f64).collect(); // [s rows (j)][sk (i)]
    let mut c0 = 0;
    while c0 < n {
        let c = cs.min(n - c0);
        // Cumulative log decay within the chunk (through token t, inclusive).
        let mut gc = vec![0f64; c];
        let mut acc = 0f64;
        for (t, x) in gc.iter_mut().enumerate() {
            acc += h.g(c0 + t) as f64;
            *x = acc;
        }
        let kk = |t: usize, i: usize| h.k(c0 + t)[i] as f64;
        let qq = |t: usize, i: usize| h.q(c0 + t)[i] as f64 * scale;
        let beta = |t: usize| h.beta(c0 + t) as f64;
        // A[t][u] (u < t) = β_t exp(gc_t − gc_u) k_t·k_u; T = (I + A)⁻¹ (lower unitriangular).
        let dot = |a: usize, b: usize| (0..sk).map(|i| kk(a, i) * kk(b, i)).sum::<f64>();
        // The pseudo-values: u_t = β_t (v_t − exp(gc_t) M₀ k_t) − Σ_{u<t} A[t][u] u_u, solved
        // by forward substitution (rows over the value index j).
        let mut u = vec![0f64; c * s];
        for t in 0..c {
            let eg = gc[t].exp();
            for j in 0..s {
                let row = &st[j * sk..(j + 1) * sk];
                let mk: f64 = (0..sk).map(|i| row[i] * kk(t, i)).sum();
                u[t * s + j] = beta(t) * (h.v(c0 + t)[j] as f64 - eg * mk);
            }
            for p in 0..t {
                let a = beta(t) * (gc[t] - gc[p]).exp() * dot(t, p);
                for j in 0..s {
                    u[t * s + j] -= a * u[p * s + j];
                }
            }
        }
        // Outputs: o_t = exp(gc_t) M₀ q_t + Σ_{p≤t} exp(gc_t − gc_p) (q_t·k_p) u_p.
        for t in 0..c {
            let eg = gc[t].exp();
            for j in 0..s {
                let row = &st[j * sk..(j + 1) * sk];
                let mq: f64 = (0..sk).map(|i| row[i] * qq(t, i)).sum();
                let mut y = eg * mq;
                for p in 0..=t {
                    let qk: f64 = (0..sk).map(|i| qq(t, i) * kk(p, i)).sum();
                    y += (gc[t] - gc[p]).exp() * qk * u[p * s + j];
                }
                o[(c0 + t) * s + j] = y as f32;
            }
        }
        // The matrix at the chunk's end: exp(gc_last) M₀ + Σ_p exp(gc_last − gc_p) u_p k_pᵀ.
        let gl = gc[c - 1];
        for x in st.iter_mut() {
            *x *= gl.exp();
        }
        for p in 0..c {
            let w = (gl - gc[p]).exp();
            for j in 0..s {
                let up = w * u[p * s + j];
                for i in 0..sk {
                    st[j * sk + i] += up * kk(p, i);
                }
            }
        }
        c0 += c;
    }
    for (d, &x) in m.iter_mut().zip(&st) {
        *d = x as f32;
    }
}

/// The gate and β of one token's value heads: g = softplus(α + dt_bias) · a, β = σ(b).
pub fn gates(
    alpha: &[f32],
    beta_raw: &[f32],
    dt_bias: &[f32],
    a: &[f32],
    g: &mut [f32],
    beta: &mut [f32],
) {
    for h in 0..alpha.len() {
        g[h] = softplus(alpha[h] + dt_bias[h]) * a[h];
        beta[h] = sigmoid(beta_raw[h]);
    }
}

/// The whole op on the host over one sequence's `n` rows: `qkv` ([n, channels], the
/// in-projection, overwritten by the convolution's output with q and k normed), `alpha`,
/// `beta` ([n, n_v_heads], the raw products), the convolution weight `conv_w` ([channels, k]),
/// `dt_bias` and `a` ([n_v_heads]), the sequence's state `state` ([`DeltaNetParams::state_floats`])
/// and the output `out` ([n, value_dim]).
#[allow(clippy::too_many_arguments)]
pub fn sequence(
    p: &DeltaNetParams,
    n: usize,
    qkv: &mut [f32],
    alpha: &[f32],
    beta: &[f32],
    conv_w: &[f32],
    dt_bias: &[f32],
    a: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    let c = p.channels();
    let (conv, mats) = state.split_at_mut(p.conv_floats());
    let x = qkv[..n * c].to_vec();
    conv_silu(&x, n, c, conv_w, p.conv_kernel, conv, &mut qkv[..n * c]);
    normalize_qk(p, n, qkv);
    let hv = p.n_v_heads;
    let mut g = vec![0f32; n * hv];
    let mut b = vec![0f32; n * hv];
    for t in 0..n {
        let r = t * hv..(t + 1) * hv;
        gates(
            &alpha[r.clone()],
            &beta[r.clone()],
            dt_bias,
            a,
            &mut g[r.clone()],
            &mut b[r],
        );
    }
    let mut o = vec![0f32; n * p.head_v];
    for h in 0..hv {
        let inputs = head_inputs(p, n, qkv, &g, &b, h);
        let m = &mut mats[h * p.head_k * p.head_v..(h + 1) * p.head_k * p.head_v];
        recurrent(m, &inputs, &mut o);
        for t in 0..n {
            out[t * p.value_dim() + h * p.head_v..][..p.head_v]
                .copy_from_slice(&o[t * p.head_v..(t + 1) * p.head_v]);
        }
    }
}

/// L2-norms each q and k head of `n` convolved rows of `qkv` in place.
pub fn normalize_qk(p: &DeltaNetParams, n: usize, qkv: &mut [f32]) {
    let c = p.channels();
    for t in 0..n {
        let row = &mut qkv[t * c..t * c + 2 * p.key_dim()];
        for head in row.chunks_exact_mut(p.head_k) {
            l2_norm(head, p.eps);
        }
    }
}

/// Value head `h`'s inputs over `n` convolved, normed rows of `qkv`, with the gates `g` and
/// `b` ([n, n_v_heads]).
pub fn head_inputs<'a>(
    p: &DeltaNetParams,
    n: usize,
    qkv: &'a [f32],
    g: &'a [f32],
    b: &'a [f32],
    h: usize,
) -> HeadInputs<'a> {
    let kh = h % p.n_k_heads;
    let kd = p.key_dim();
    HeadInputs {
        rows: qkv,
        stride: p.channels(),
        q_at: kh * p.head_k,
        k_at: kd + kh * p.head_k,
        v_at: 2 * kd + h * p.head_v,
        width: p.head_v,
        gates: &g[h..],
        betas: &b[h..],
        gate_stride: p.n_v_heads,
        n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// The chunked form equals the recurrent one on random inputs (normed q/k, decays in
    /// (0, 1), β in (0, 1)), over runs that end mid-chunk and start from a non-zero matrix.
    #[test]
    fn chunked_equals_recurrent() {
        let mut r = rng(7);
        for &(n, s, cs) in &[
            (1usize, 8usize, 4usize),
            (37, 16, 8),
            (64, 32, 64),
            (100, 16, 16),
        ] {
            let mk = |len: usize, r: &mut dyn FnMut() -> f32| -> Vec<f32> {
                (0..len).map(|_| r()).collect()
            };
            let mut q = mk(n * s, &mut r);
            let mut k = mk(n * s, &mut r);
            let v = mk(n * s, &mut r);
            for t in 0..n {
                l2_norm(&mut q[t * s..(t + 1) * s], 1e-6);
                l2_norm(&mut k[t * s..(t + 1) * s], 1e-6);
            }
            let g: Vec<f32> = (0..n).map(|_| -softplus(r() * 2.0) * 0.5).collect();
            let beta: Vec<f32> = (0..n).map(|_| sigmoid(r() * 3.0)).collect();
            let m0 = mk(s * s, &mut r);
            // q, k, v of a token side by side, as the op's rows hold them.
            let rows: Vec<f32> = (0..n)
                .flat_map(|t| {
                    [&q, &k, &v]
                        .into_iter()
                        .flat_map(move |x| x[t * s..(t + 1) * s].iter().copied())
                })
                .collect();
            let h = HeadInputs {
                rows: &rows,
                stride: 3 * s,
                q_at: 0,
                k_at: s,
                v_at: 2 * s,
                width: s,
                gates: &g,
                betas: &beta,
                gate_stride: 1,
                n,
            };
            let (mut m1, mut m2) = (m0.clone(), m0.clone());
            let (mut o1, mut o2) = (vec![0f32; n * s], vec![0f32; n * s]);
            recurrent(&mut m1, &h, &mut o1);
            chunked(&mut m2, &h, cs, &mut o2);
            let d = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max)
            };
            assert!(
                d(&o1, &o2) < 2e-5,
                "n {n} s {s}: outputs differ by {}",
                d(&o1, &o2)
            );
            assert!(
                d(&m1, &m2) < 2e-5,
                "n {n} s {s}: states differ by {}",
                d(&m1, &m2)
            );
        }
    }

    /// A sequence split into steps (the state carried between them) gives what it gives whole.
    #[test]
    fn split_sequence_equals_whole() {
        let p = DeltaNetParams {
            n_k_heads: 1,
            n_v_heads: 2,
            head_k: 8,
            head_v: 8,
            conv_kernel: 4,
            eps: 1e-6,
        };
        let mut r = rng(3);
        let n = 11;
        let c = p.channels();
        let qkv: Vec<f32> = (0..n * c).map(|_| r()).collect();
        let alpha: Vec<f32> = (0..n * 2).map(|_| r()).collect();
        let beta: Vec<f32> = (0..n * 2).map(|_| r()).collect();
        let w: Vec<f32> = (0..c * 4).map(|_| r()).collect();
        let (dt, a) = (vec![0.5, -0.25], vec![-1.0, -0.5]);
        let mut whole_state = vec![0f32; p.state_floats()];
        let mut whole = vec![0f32; n * p.value_dim()];
        sequence(
            &p,
            n,
            &mut qkv.clone(),
            &alpha,
            &beta,
            &w,
            &dt,
            &a,
            &mut whole_state,
            &mut whole,
        );
        let mut st = vec![0f32; p.state_floats()];
        let mut parts = vec![0f32; n * p.value_dim()];
        let mut t0 = 0;
        for len in [3usize, 1, 5, 2] {
            let mut x = qkv[t0 * c..(t0 + len) * c].to_vec();
            sequence(
                &p,
                len,
                &mut x,
                &alpha[t0 * 2..(t0 + len) * 2],
                &beta[t0 * 2..(t0 + len) * 2],
                &w,
                &dt,
                &a,
                &mut st,
                &mut parts[t0 * p.value_dim()..(t0 + len) * p.value_dim()],
            );
            t0 += len;
        }
        assert_eq!(whole, parts);
        assert_eq!(whole_state, st);
    }
}
