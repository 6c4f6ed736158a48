//! Rotary position embeddings: the parameters every architecture's rope takes (plain, linear,
//! Llama-3, YaRN and LongRoPE-style factors, attention temperature) and the angles as ggml
//! computes them.

/// How rope pairs dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Adjacent pairs (2i, 2i+1): llama.
    Normal,
    /// Split halves (i, i + n/2): gemma, neox.
    Neox,
}

/// Llama-3 style frequency scaling (`rope.scaling.type = llama3`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    pub mode: RopeMode,
    /// Rotated dimensions per head (≤ head_dim).
    pub n_dims: usize,
    pub base: f32,
    /// Linear position scaling (1 / `rope.scaling.factor` for linear scaling, else 1).
    pub freq_scale: f32,
    pub llama3: Option<Llama3Scaling>,
    /// Per-pair frequency divisors (the `rope_freqs.weight` tensor of Llama-3.1-style files).
    pub freq_factors: Option<std::sync::Arc<Vec<f32>>>,
    /// YaRN (`rope.scaling.type = yarn`): each pair's angle between the scaled and the unscaled
    /// one by a ramp over the pairs, and the rotation scaled by `mscale`.
    pub yarn: Option<Yarn>,
    /// Multiplies the rotated values (llama.cpp's `attn_factor`; 1 without YaRN).
    pub attn_factor: f32,
    /// Llama-4-style attention temperature (Mistral 3): after the rotation, q of a token at
    /// position p is multiplied by [`RopeParams::q_scale`]. (scale, floor).
    pub q_temp: Option<(f32, f32)>,
}

/// YaRN's parameters, as llama.cpp takes them (`ggml_rope_ext`'s ext_factor, beta_fast,
/// beta_slow and n_ctx_orig).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub ext_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub original_context: f32,
}

impl Yarn {
    /// The pairs the ramp runs over: [low, high] (`ggml_rope_yarn_corr_dims`).
    pub fn corr_dims(&self, n_dims: usize, base: f32) -> [f32; 2] {
        let dim = |rot: f32| {
            n_dims as f32 * (self.original_context / (rot * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let start = dim(self.beta_fast).floor();
        let end = dim(self.beta_slow).ceil();
        [start.max(0.0), end.min(n_dims as f32 - 1.0)]
    }

    /// How much of pair i's angle is the unscaled one (`rope_yarn_ramp` × ext_factor).
    pub fn mix(&self, corr: [f32; 2], i: usize) -> f32 {
        let y = (i as f32 - corr[0]) / (corr[1] - corr[0]).max(0.001);
        (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor
    }
}

impl RopeParams {
    /// Plain rope: `n_dims` rotated dims at `base`, no scaling of any kind.
    pub fn plain(mode: RopeMode, n_dims: usize, base: f32) -> RopeParams {
        RopeParams {
            mode,
            n_dims,
            base,
            freq_scale: 1.0,
            llama3: None,
            freq_factors: None,
            yarn: None,
            attn_factor: 1.0,
            q_temp: None,
        }
    }

    /// q's temperature factor at position `pos` (1 without one): ln(⌊pos / floor⌋ + 1)·scale + 1,
    /// evaluated as llama.cpp does (the logarithm in double precision).
    pub fn q_scale(&self, pos: u32) -> f32 {
        match self.q_temp {
            None => 1.0,
            Some((scale, floor)) => {
                let f = (pos as f32 / floor).floor() as f64 + 1.0;
                (f.ln() * scale as f64 + 1.0) as f32
            }
        }
    }

    /// What multiplies the rotated values: `attn_factor`, and YaRN's 1 + 0.1·ln(1/freq_scale)
    /// (`rope_yarn`).
    pub fn mscale(&self) -> f32 {
        match self.yarn {
            Some(y) if y.ext_factor != 0.0 => {
                // (`1 + 0.1·ln(1/freq_scale)` fused, as ggml's C contracts it.)
                self.attn_factor * 0.1f32.mul_add((1.0 / self.freq_scale).ln(), 1.0)
            }
            _ => self.attn_factor,
        }
    }

    /// The angle per position of dimension pair `i` (0 ≤ i < n_dims/2), scaling included.
    pub fn theta(&self, i: usize) -> f32 {
        if let Some(y) = self.yarn {
            let inv = self.base.powf(-2.0 * i as f32 / self.n_dims as f32);
            let inv = match &self.freq_factors {
                Some(f) => inv / f.get(i).copied().unwrap_or(1.0),
                None => inv,
            };
            let mix = y.mix(y.corr_dims(self.n_dims, self.base), i);
            return inv * self.freq_scale * (1.0 - mix) + inv * mix;
        }
        let inv = self.base.powf(-2.0 * i as f32 / self.n_dims as f32);
        let inv = match self.llama3 {
            None => inv,
            Some(s) => {
                let wavelen = 2.0 * std::f32::consts::PI / inv;
                let low = s.original_context / s.low_freq_factor;
                let high = s.original_context / s.high_freq_factor;
                if wavelen < high {
                    inv
                } else if wavelen > low {
                    inv / s.factor
                } else {
                    let smooth = (s.original_context / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * inv / s.factor + smooth * inv
                }
            }
        };
        let inv = match &self.freq_factors {
            Some(f) => inv / f.get(i).copied().unwrap_or(1.0),
            None => inv,
        };
        inv * self.freq_scale
    }
}

/// The sines and cosines of a position's rotation angles as ggml's CPU rope computes them
/// (llama.cpp parity): the position times `base^(−2/n_dims)` raised one pair at a time in f32,
/// divided by the pair's frequency factor and scaled; Llama-3 scaling, which ggml expresses as
/// frequency factors, keeps `position × theta(i)`. The CPU backend rotates with these, and the
/// CUDA backend's parity mode uploads them, so both rotate by the same bits.
pub struct RopeAngles<'a> {
    half: usize,
    /// `theta(i)` per pair, for Llama-3 scaling (then `llama3`).
    theta: [f32; ROPE_MAX_PAIRS],
    llama3: bool,
    /// Frequency factors per pair, where the model has them.
    ff: Option<&'a [f32]>,
    theta_scale: f32,
    freq_scale: f32,
    /// YaRN's ramp range and factor, where the rope has YaRN.
    yarn: Option<(Yarn, [f32; 2])>,
    mscale: f32,
}

/// Rotated pairs [`RopeAngles`] takes at most (head dims up to 512).
pub const ROPE_MAX_PAIRS: usize = 256;

impl<'a> RopeAngles<'a> {
    /// Nothing is allocated (rope runs every step). Panics past [`ROPE_MAX_PAIRS`] pairs:
    /// callers check `n_dims` first.
    pub fn new(p: &'a RopeParams) -> RopeAngles<'a> {
        let half = p.n_dims / 2;
        assert!(half <= ROPE_MAX_PAIRS, "{} rotated dims", p.n_dims);
        let mut theta = [0f32; ROPE_MAX_PAIRS];
        if p.llama3.is_some() {
            for (i, t) in theta[..half].iter_mut().enumerate() {
                *t = p.theta(i);
            }
        }
        RopeAngles {
            half,
            theta,
            llama3: p.llama3.is_some(),
            ff: p.freq_factors.as_deref().map(|v| v.as_slice()),
            theta_scale: p.base.powf(-2.0 / p.n_dims as f32),
            freq_scale: p.freq_scale,
            yarn: p.yarn.map(|y| (y, y.corr_dims(p.n_dims, p.base))),
            mscale: p.mscale(),
        }
    }

    /// Rotated pairs (`n_dims / 2`).
    pub fn pairs(&self) -> usize {
        self.half
    }

    /// `sin[i]`, `cos[i]` of pair i's angle at `pos`, for i < `pairs()`.
    pub fn at(&self, pos: u32, sin: &mut [f32], cos: &mut [f32]) {
        let mut th = pos as f32;
        for i in 0..self.half {
            let angle = if self.llama3 {
                pos as f32 * self.theta[i]
            } else {
                let f = self.ff.and_then(|f| f.get(i)).copied().unwrap_or(1.0);
                let extrap = th / f;
                let interp = self.freq_scale * extrap;
                match self.yarn {
                    Some((y, corr)) if y.ext_factor != 0.0 => {
                        // (ggml's contraction of `interp·(1 − mix) + extrap·mix`: the first
                        // product fused.)
                        let mix = y.mix(corr, i);
                        interp.mul_add(1.0 - mix, extrap * mix)
                    }
                    _ => interp,
                }
            };
            (sin[i], cos[i]) = angle.sin_cos();
            if self.mscale != 1.0 {
                sin[i] *= self.mscale;
                cos[i] *= self.mscale;
            }
            th *= self.theta_scale;
        }
    }
}
