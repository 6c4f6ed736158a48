//! How a backend may round: the one numerics choice every command takes (`--numerics`) and
//! hands to whichever backend runs it.

/// Whether a token's result may depend on the other tokens of its step, and whether a backend
/// must reproduce another's floats.
///
/// - [`Numerics::BatchInvariant`] (the default): a sequence's rows are computed in an order
///   that does not depend on the other rows of the step, so a request gets the same answer
///   alone and under any load, and a prompt the same logits however it is chunked.
/// - [`Numerics::Fast`]: each step takes its fastest kernels; a token's bits may follow the
///   batch (the CPU rounds as llama.cpp's CPU build does for the same batch).
/// - [`Numerics::Parity`]: the CUDA backend rounds as the CPU backend's batch-invariant path
///   does, operation for operation (the same logits bit for bit, far slower); on the CPU it is
///   that batch-invariant path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Numerics {
    Fast,
    #[default]
    BatchInvariant,
    Parity,
}

impl Numerics {
    pub const ALL: [Numerics; 3] = [Numerics::Fast, Numerics::BatchInvariant, Numerics::Parity];

    /// True when a token's result does not depend on its batch (batch-invariant and parity).
    pub fn is_batch_invariant(self) -> bool {
        self != Numerics::Fast
    }

    /// The name `--numerics` takes and the load log prints.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Fast => "fast",
            Numerics::BatchInvariant => "invariant",
            Numerics::Parity => "parity",
        }
    }

    /// The numerics named `s` (`fast`, `invariant`, `parity`; `batch-invariant` too).
    pub fn parse(s: &str) -> Option<Numerics> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fast" => Some(Numerics::Fast),
            "invariant" | "batch-invariant" => Some(Numerics::BatchInvariant),
            "parity" => Some(Numerics::Parity),
            _ => None,
        }
    }
}

impl std::fmt::Display for Numerics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// q·k in the order of ggml's f16 dot product on AVX-512 (`ggml_vec_dot_f16`), which llama.cpp's
/// CPU attention uses: per 64 elements, four 16-lane partial sums; then sums 0+2 and 1+3, their
/// sum, and the 16 lanes reduced as `_mm512_reduce_add_ps` does (halves, quarters, then pairs);
/// a tail past the last 64 is added in f64. In the row-by-row form both inputs hold f16
/// values, so each product is exact in f32 and only the order of the additions matters (an FMA
/// would round alike).
#[inline(always)]
pub fn f16_dot(a: &[f32], b: &[f32]) -> f32 {
    ggml_dot::<false>(a, b)
}

/// x·y in the order of ggml's f32 dot product on AVX-512 (`ggml_vec_dot_f32`: llama.cpp's
/// product of an f32 weight with a single token): [`f16_dot`]'s, its lane sums fused
/// multiply-adds.
#[inline(always)]
pub fn f32_dot(a: &[f32], b: &[f32]) -> f32 {
    ggml_dot::<true>(a, b)
}

/// The order of ggml's AVX-512 dot products ([`f16_dot`]), the lanes' products added
/// (`FUSED` false) or fused into them.
#[inline(always)]
fn ggml_dot<const FUSED: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [[0f32; 16]; 4];
    let (ca, cb) = (a.chunks_exact(64), b.chunks_exact(64));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for (j, sj) in s.iter_mut().enumerate() {
            for (l, v) in sj.iter_mut().enumerate() {
                let (x, y) = (x[16 * j + l], y[16 * j + l]);
                *v = if FUSED { x.mul_add(y, *v) } else { *v + x * y };
            }
        }
    }
    // 0+2 and 1+3, their sum, then the 16 lanes as `_mm512_reduce_add_ps` reduces them.
    let mut x0 = [0f32; 16];
    for l in 0..16 {
        x0[l] = (s[0][l] + s[2][l]) + (s[1][l] + s[3][l]);
    }
    let mut t3 = [0f32; 8];
    for i in 0..8 {
        t3[i] = x0[i] + x0[8 + i];
    }
    let t6 = [t3[0] + t3[4], t3[1] + t3[5], t3[2] + t3[6], t3[3] + t3[7]];
    let mut sum = ((t6[0] + t6[2]) + (t6[1] + t6[3])) as f64;
    for (x, y) in ra.iter().zip(rb) {
        sum += (x * y) as f64;
    }
    sum as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for n in Numerics::ALL {
            assert_eq!(Numerics::parse(n.name()), Some(n));
        }
        assert_eq!(
            Numerics::parse(" Batch-Invariant "),
            Some(Numerics::BatchInvariant)
        );
        assert_eq!(Numerics::parse("exact"), None);
        assert_eq!(Numerics::default(), Numerics::BatchInvariant);
        assert!(!Numerics::Fast.is_batch_invariant());
        assert!(Numerics::Parity.is_batch_invariant());
    }
}
