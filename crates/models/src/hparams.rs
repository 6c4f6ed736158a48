//! Hyperparameters common to the decoder-only architectures.

use crate::{ModelError, Result};
use quiver_backend::{Activation, KvTypes, Llama3Scaling, RopeMode, RopeParams};
use quiver_gguf::GgufFile;

#[derive(Clone, Debug)]
pub struct Hparams {
    pub arch: String,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    /// Rope of global-attention layers.
    pub rope: RopeParams,
    /// Rope of sliding-window layers, where it differs.
    pub rope_local: Option<RopeParams>,
    pub sliding_window: Option<u32>,
    /// Whether layer `i` uses the sliding window.
    pub swa_layers: Vec<bool>,
    pub attn_scale: f32,
    pub embed_scale: f32,
    pub act: Activation,
    pub qk_norm: bool,
    /// See [`quiver_backend::AttnParams::scale_q`].
    pub scale_q: bool,
    pub post_norms: bool,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    /// Every layer's FFN is a mixture of experts.
    pub moe: Option<quiver_backend::MoeParams>,
    /// The gate's rows are the first half of `ffn_up` (Phi-3).
    pub fused_gate_up: bool,
    /// LongRoPE's frequency factors for contexts past `n_ctx_orig` (the short ones are
    /// `rope.freq_factors`): [`crate::Model::for_context`] picks, as llama.cpp does.
    pub rope_long: Option<std::sync::Arc<Vec<f32>>>,
    /// The context the rope was trained for (`rope.scaling.original_context_length`, else
    /// `context_length`).
    pub n_ctx_orig: usize,
    /// Each layer's shape (all alike but in Gemma 4). The scalar fields above are the widest.
    pub layers: Vec<LayerHp>,
    /// V is rms-normed (without weight) before the cache (Gemma 4).
    pub v_norm: bool,
    /// Per-layer embeddings of this width (Gemma 4's PLE), 0: none.
    pub n_embd_per_layer: usize,
    /// The dense FFN's products take the file's per-tensor scales (`ffn_gate.scale`, …) and
    /// the experts' the per-expert ones, as llama.cpp's graph of the architecture does; the
    /// attention products' scales apply in every architecture.
    pub ffn_weight_scales: bool,
    /// The gated-delta-net layers' shape (Qwen 3.5), where the model has such layers
    /// (`LayerHp::recurrent`).
    pub delta_net: Option<quiver_backend::DeltaNetParams>,
    /// The q projection carries a sigmoid output gate per head (q and gate interleaved per
    /// head: `head_dim` of q, then `head_dim` of gate); the FFN's input norm is
    /// `post_attention_norm` (Qwen 3.5).
    pub q_gate: bool,
    /// The shared expert's width beside the experts (Qwen 3.5 MoE, DeepSeek-V4), 0: none.
    pub shared_expert_ff: usize,
    /// DeepSeek-V4's own hyperparameters (`deepseek4`; its layers keep per-sequence state,
    /// `LayerHp::recurrent`).
    pub dsv4: Option<crate::Dsv4Hp>,
    /// An EAGLE-3 draft head's own hyperparameters (`eagle3`).
    pub eagle3: Option<crate::Eagle3Hp>,
    /// A multi-token-prediction block run as a draft head (`crate::mtp`): its input is the
    /// target's hidden state and the next token.
    pub mtp: bool,
}

/// One layer's attention and FFN shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerHp {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    /// The layer whose K/V this one attends over: itself, or an earlier layer (Gemma 4's
    /// shared-KV layers, which write no cache of their own).
    pub kv_from: usize,
    /// A layer without paged KV whose state belongs to a sequence (`State::rs`): a
    /// gated-delta-net layer (Qwen 3.5), or any DeepSeek-V4 layer (its raw window and
    /// compressed KV, [`quiver_backend::dsv4::AttnShape`]).
    pub recurrent: bool,
}

impl LayerHp {
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

impl Hparams {
    /// The KV cache of `n_slots` positions this model needs, in element type `ty`.
    pub fn kv_spec(&self, n_slots: usize, kv: KvTypes) -> quiver_backend::KvSpec {
        quiver_backend::KvSpec {
            k: kv.k,
            v: kv.v,
            block_size: quiver_backend::KV_BLOCK_SIZE,
            n_slots,
            layers: self
                .layers
                .iter()
                .enumerate()
                .filter(|(i, l)| l.kv_from == *i && !l.recurrent)
                .map(|(_, l)| quiver_backend::KvLayer {
                    n_head_kv: l.n_head_kv,
                    head_dim: l.head_dim,
                })
                .collect(),
        }
    }

    /// The index of the cache layer `i` reads, among the caches of [`Hparams::kv_spec`].
    pub fn kv_index(&self, i: usize) -> usize {
        let from = self.layers[i].kv_from;
        (0..from)
            .filter(|&j| self.layers[j].kv_from == j && !self.layers[j].recurrent)
            .count()
    }

    /// The recurrent layers' count (each holds one state slot array).
    pub fn n_recurrent(&self) -> usize {
        self.layers.iter().filter(|l| l.recurrent).count()
    }

    /// Bytes of one sequence's recurrent state over every layer (0 without such layers).
    pub fn state_bytes_per_seq(&self) -> u64 {
        match &self.delta_net {
            Some(p) => 4 * (p.state_floats() * self.n_recurrent()) as u64,
            None => 0,
        }
    }

    /// Bytes one sequence keeps to roll its state back over `planes` rows
    /// (`State::keep_states`): `planes` recurrent states (Qwen 3.5) or `planes` rows of
    /// DeepSeek-V4's rings.
    pub fn kept_state_bytes(&self, planes: usize) -> u64 {
        let per = match &self.dsv4 {
            Some(ds) => ds.kept_bytes(self),
            None => self.state_bytes_per_seq(),
        };
        per.saturating_mul(planes as u64)
    }

    /// Whether the model keeps a state per sequence beside (or instead of) the paged KV
    /// (Qwen 3.5's recurrent state, DeepSeek-V4's compressed KV): such a state cannot be
    /// shared by a prefix hit nor rolled back, so sequences continue where they stopped or
    /// start again at position 0.
    pub fn has_seq_state(&self) -> bool {
        self.delta_net.is_some() || self.dsv4.is_some()
    }

    /// Width of a token's hidden state as a multi-token-prediction block reads it and hands
    /// on ([`crate::State::head_hidden`]): DeepSeek-V4's hc streams side by side, else n_embd.
    pub fn stream_width(&self) -> usize {
        self.dsv4.as_ref().map_or(1, |d| d.hc.hc) * self.n_embd
    }

    /// Whether any layer runs a dense FFN (all but pure-MoE models; Gemma 4's MoE layers run
    /// one beside their experts).
    pub fn has_dense_ffn(&self) -> bool {
        self.moe.is_none_or(|m| m.router_given)
    }

    /// A dense FFN needs its width (`feed_forward_length`, which the shared reader takes as
    /// optional), the experts theirs.
    pub(crate) fn check_ffn(&self) -> Result<()> {
        let key = |k: &str| format!("{}.{k}", self.arch);
        if self.has_dense_ffn() && self.layers.iter().any(|l| l.n_ff == 0) {
            return Err(ModelError::BadHparam {
                key: key("feed_forward_length"),
                detail: "missing (the model runs a dense FFN)".into(),
            });
        }
        if self.moe.is_some_and(|m| m.n_ff == 0) {
            return Err(ModelError::BadHparam {
                key: key("expert_feed_forward_length"),
                detail: "missing or 0, and no feed_forward_length to derive it from".into(),
            });
        }
        Ok(())
    }

    /// The widest q, KV and FFN rows of any layer.
    pub fn max_dims(&self) -> (usize, usize, usize) {
        let m = |f: fn(&LayerHp) -> usize| self.layers.iter().map(f).max().unwrap_or(0);
        (m(LayerHp::q_dim), m(LayerHp::kv_dim), m(|l| l.n_ff))
    }

    /// Sets every layer's shape from the scalar fields (after an architecture changed them).
    pub fn uniform_layers(&mut self) {
        self.layers = (0..self.n_layer)
            .map(|i| LayerHp {
                n_head: self.n_head,
                n_head_kv: self.n_head_kv,
                head_dim: self.head_dim,
                n_ff: self.n_ff,
                kv_from: i,
                recurrent: false,
            })
            .collect();
    }
}

/// Reads the keys shared by llama-family files.
pub(crate) struct Reader<'a> {
    pub f: &'a GgufFile,
    pub arch: String,
}

impl<'a> Reader<'a> {
    pub fn new(f: &'a GgufFile) -> Result<Self> {
        Ok(Reader {
            f,
            arch: f.arch()?.to_string(),
        })
    }

    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    pub fn u(&self, k: &str) -> Result<Option<usize>> {
        Ok(self.f.get_u32(&self.key(k))?.map(|v| v as usize))
    }

    pub fn req(&self, k: &str) -> Result<usize> {
        let v = self.u(k)?.ok_or_else(|| ModelError::BadHparam {
            key: self.key(k),
            detail: "missing".into(),
        })?;
        if v == 0 {
            return Err(ModelError::BadHparam {
                key: self.key(k),
                detail: "is 0".into(),
            });
        }
        Ok(v)
    }

    /// A per-layer key given either as one number or as an array of one per layer.
    pub fn per_layer(&self, k: &str, n_layer: usize) -> Result<Option<Vec<usize>>> {
        let key = self.key(k);
        let Some(quiver_gguf::Value::Array(a)) = self.f.get(&key) else {
            return Ok(self.u(k)?.map(|v| vec![v; n_layer]));
        };
        let v: Vec<usize> = match a {
            quiver_gguf::Array::U32(v) => v.iter().map(|&x| x as usize).collect(),
            quiver_gguf::Array::I32(v) if v.iter().all(|&x| x >= 0) => {
                v.iter().map(|&x| x as usize).collect()
            }
            _ => return Err(self.bad(k, "is an array of something other than counts")),
        };
        if v.len() != n_layer {
            return Err(self.bad(k, format!("has {} entries for {n_layer} layers", v.len())));
        }
        Ok(Some(v))
    }

    pub fn f32(&self, k: &str) -> Result<Option<f32>> {
        Ok(self.f.get_f32(&self.key(k))?)
    }

    /// A per-pair factor tensor (`rope_freqs`, `rope_factors_long/short`) of `n` f32, if the
    /// file has it.
    pub fn factors(&self, name: &str, n: usize) -> Result<Option<std::sync::Arc<Vec<f32>>>> {
        let Some(t) = self.f.tensor(name) else {
            return Ok(None);
        };
        if t.ty != quiver_gguf::GgmlType::F32 || t.n_elements as usize != n {
            return Err(ModelError::WrongShape {
                name: name.into(),
                got: t.shape.clone(),
                expected: vec![n as u64],
            });
        }
        let v = self
            .f
            .tensor_data(t)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Some(std::sync::Arc::new(v)))
    }

    pub fn bad(&self, k: &str, detail: impl Into<String>) -> ModelError {
        ModelError::BadHparam {
            key: self.key(k),
            detail: detail.into(),
        }
    }

    /// Which layers use the sliding window: `attention.sliding_window_pattern` as an array of
    /// one flag per layer (booleans, or integers where non-zero marks a sliding layer) or as
    /// a period n (every n-th layer global, the others local), else the architecture's
    /// period, as llama.cpp reads it.
    pub fn swa_layers(&self, n_layer: usize, default_period: usize) -> Result<Vec<bool>> {
        let key = self.key("attention.sliding_window_pattern");
        if let Some(quiver_gguf::Value::Array(a)) = self.f.get(&key) {
            let v: Vec<bool> = match a {
                quiver_gguf::Array::Bool(v) => v.clone(),
                quiver_gguf::Array::U32(v) => v.iter().map(|&x| x != 0).collect(),
                quiver_gguf::Array::I32(v) => v.iter().map(|&x| x != 0).collect(),
                _ => {
                    return Err(self.bad(
                        "attention.sliding_window_pattern",
                        "is an array of something other than booleans or integers",
                    ))
                }
            };
            if v.len() != n_layer {
                return Err(self.bad(
                    "attention.sliding_window_pattern",
                    format!("has {} entries for {n_layer} layers", v.len()),
                ));
            }
            return Ok(v);
        }
        let period = self
            .u("attention.sliding_window_pattern")?
            .unwrap_or(default_period);
        Ok((0..n_layer)
            .map(|i| period == 0 || i % period < period - 1)
            .collect())
    }

    /// A key llama.cpp reads as one number or one per layer, where quiver needs one value for
    /// every layer: the number, or the array's entries if they are all equal.
    pub fn same_per_layer(&self, k: &str) -> Result<Option<usize>> {
        let n_layer = self.u("block_count")?.unwrap_or(0);
        let Some(v) = self.per_layer(k, n_layer)? else {
            return Ok(None);
        };
        match v.first() {
            Some(&first) if v.iter().all(|&x| x == first) => Ok(Some(first)),
            Some(_) => Err(self.bad(k, "differs between layers (not supported)")),
            None => Ok(None),
        }
    }

    /// The MoE keys (`expert_count`, `expert_used_count`, `expert_feed_forward_length`),
    /// checked against each other. The chosen weights are left unscaled: none of our
    /// architectures' llama.cpp loaders reads `expert_weights_scale`.
    pub fn moe(
        &self,
        n_ff: usize,
        gating: quiver_backend::Gating,
        norm: bool,
        act: Activation,
    ) -> Result<quiver_backend::MoeParams> {
        let n_expert = self.req("expert_count")?;
        let n_used = self
            .same_per_layer("expert_used_count")?
            .filter(|&v| v > 0)
            .ok_or_else(|| self.bad("expert_used_count", "missing or 0"))?;
        if n_used > n_expert {
            return Err(self.bad(
                "expert_used_count",
                format!("{n_used} is more than expert_count {n_expert}"),
            ));
        }
        let n_ff = match self.same_per_layer("expert_feed_forward_length")? {
            Some(v) if v > 0 => v,
            _ => n_ff / n_used,
        };
        Ok(quiver_backend::MoeParams {
            n_expert,
            n_used,
            n_ff,
            gating,
            norm,
            scale: 0.0,
            act,
            router_given: false,
            held: (0, n_expert),
        })
    }

    /// The shape every llama-family model shares; architecture files adjust the rest.
    pub fn base(&self, mode: RopeMode, act: Activation) -> Result<Hparams> {
        let n_embd = self.req("embedding_length")?;
        let n_layer = self.req("block_count")?;
        // Every layer has tensors of its own: a count the file's tensors cannot back is
        // refused before anything is allocated per layer.
        let n_tensors = self.f.tensors.len();
        if n_layer > n_tensors {
            return Err(self.bad(
                "block_count",
                format!("{n_layer} layers, but the file holds {n_tensors} tensors"),
            ));
        }
        let heads = self
            .per_layer("attention.head_count", n_layer)?
            .ok_or_else(|| self.bad("attention.head_count", "missing"))?;
        let heads_kv = self
            .per_layer("attention.head_count_kv", n_layer)?
            .unwrap_or_else(|| heads.clone());
        for (i, (&h, &hkv)) in heads.iter().zip(&heads_kv).enumerate() {
            if h == 0 {
                return Err(self.bad("attention.head_count", format!("is 0 for layer {i}")));
            }
            if hkv == 0 || h % hkv != 0 {
                return Err(self.bad(
                    "attention.head_count_kv",
                    format!("{hkv} does not divide head_count {h} (layer {i})"),
                ));
            }
        }
        // Optional, as llama.cpp reads it: a model without a dense FFN (DeepSeek-V4, Qwen3 MoE)
        // needs none ([`Hparams::check_ffn`] refuses its absence where one runs).
        let n_ffs = match self.per_layer("feed_forward_length", n_layer)? {
            Some(v) => match v.iter().position(|&v| v == 0) {
                Some(i) => {
                    return Err(self.bad("feed_forward_length", format!("is 0 for layer {i}")))
                }
                None => v,
            },
            None => vec![0; n_layer],
        };
        let n_head = heads.iter().copied().max().unwrap_or(0);
        let n_head_kv = heads_kv.iter().copied().max().unwrap_or(0);
        let head_dim = match self.u("attention.key_length")? {
            Some(0) => return Err(self.bad("attention.key_length", "is 0")),
            Some(k) => k,
            None => {
                if n_embd % n_head != 0 {
                    return Err(ModelError::BadHparam {
                        key: self.key("attention.head_count"),
                        detail: format!("{n_head} does not divide embedding_length {n_embd}"),
                    });
                }
                n_embd / n_head
            }
        };
        // The decoder's values are as wide as its keys.
        match self.u("attention.value_length")? {
            Some(v) if v != head_dim => {
                return Err(self.bad(
                    "attention.value_length",
                    format!("{v} differs from the key length {head_dim} (not supported)"),
                ))
            }
            _ => {}
        }
        let n_vocab = match self.f.get_array("tokenizer.ggml.tokens")? {
            Some(a) => a.len(),
            None => match self.u("vocab_size")? {
                Some(v) => v,
                None => self
                    .f
                    .tensor("token_embd.weight")
                    .map(|t| t.shape[0] as usize)
                    .unwrap_or(0),
            },
        };
        let rope_dims = self.u("rope.dimension_count")?.unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(ModelError::BadHparam {
                key: self.key("rope.dimension_count"),
                detail: format!("{rope_dims}"),
            });
        }
        let mut rope = RopeParams::plain(
            mode,
            rope_dims,
            self.f32("rope.freq_base")?.unwrap_or(10000.0),
        );
        // A factor of 0 (or none) is no scaling, as llama.cpp reads it.
        let factor = self
            .f32("rope.scaling.factor")?
            .filter(|&f| f != 0.0)
            .unwrap_or(1.0);
        match self.f.get_str(&self.key("rope.scaling.type"))? {
            None | Some("none") => {}
            // LongRoPE's factors are tensors (`Hparams::rope_long`, phi3.rs).
            Some("linear") | Some("longrope") => rope.freq_scale = 1.0 / factor,
            Some("llama3") => {
                rope.llama3 = Some(Llama3Scaling {
                    factor,
                    low_freq_factor: self.f32("rope.scaling.low_freq_factor")?.unwrap_or(1.0),
                    high_freq_factor: self.f32("rope.scaling.high_freq_factor")?.unwrap_or(4.0),
                    original_context: self
                        .u("rope.scaling.original_context_length")?
                        .unwrap_or(8192) as f32,
                })
            }
            Some("yarn") => {
                rope.freq_scale = 1.0 / factor;
                let original = self
                    .u("rope.scaling.original_context_length")?
                    .or(self.u("context_length")?)
                    .unwrap_or(4096) as f32;
                // As llama.cpp: ext_factor 1; the betas and the log multiplier are read for
                // the architectures whose loader reads them (of ours, mistral3).
                let own = self.arch == "mistral3";
                let key = |k: &str| -> Result<Option<f32>> {
                    if own {
                        self.f32(k)
                    } else {
                        Ok(None)
                    }
                };
                let yarn = quiver_backend::Yarn {
                    ext_factor: 1.0,
                    beta_fast: key("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                    beta_slow: key("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
                    original_context: original,
                };
                // llama.cpp's attention factor (llama_context): YaRN's own 1 + 0.1·ln(factor)
                // cancelled here, applied again by the rope (`RopeParams::mscale`).
                let mscale = |m: f32| {
                    if factor <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * factor.ln() + 1.0
                    }
                };
                let mut attn = match key("rope.scaling.yarn_log_multiplier")? {
                    Some(l) if l != 0.0 => mscale(1.0) / mscale(l),
                    _ => mscale(1.0),
                };
                if yarn.ext_factor != 0.0 {
                    attn *= 1.0 / (1.0 + 0.1 * factor.ln());
                }
                rope.attn_factor = attn;
                rope.yarn = Some(yarn);
            }
            Some(other) => {
                return Err(ModelError::BadHparam {
                    key: self.key("rope.scaling.type"),
                    detail: format!("{other:?} is not supported (none, linear, llama3, yarn)"),
                })
            }
        }
        if let Some(a) = self.f32("rope.scaling.attn_factor")? {
            rope.attn_factor *= a;
        }
        rope.freq_factors = self.factors("rope_freqs.weight", rope_dims / 2)?;
        Ok(Hparams {
            arch: self.arch.clone(),
            n_vocab,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: n_ffs.iter().copied().max().unwrap_or(0),
            n_ctx_train: self.u("context_length")?.unwrap_or(4096),
            rms_eps: self
                .f32("attention.layer_norm_rms_epsilon")?
                .unwrap_or(1e-5),
            rope,
            rope_local: None,
            sliding_window: None,
            swa_layers: vec![false; n_layer],
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            embed_scale: 1.0,
            act,
            qk_norm: false,
            scale_q: false,
            post_norms: false,
            attn_softcap: None,
            final_softcap: None,
            moe: None,
            fused_gate_up: false,
            rope_long: None,
            n_ctx_orig: self
                .u("rope.scaling.original_context_length")?
                .or(self.u("context_length")?)
                .unwrap_or(4096),
            layers: (0..n_layer)
                .map(|i| LayerHp {
                    n_head: heads[i],
                    n_head_kv: heads_kv[i],
                    head_dim,
                    n_ff: n_ffs[i],
                    kv_from: i,
                    recurrent: false,
                })
                .collect(),
            v_norm: false,
            n_embd_per_layer: 0,
            ffn_weight_scales: false,
            delta_net: None,
            q_gate: false,
            shared_expert_ff: 0,
            dsv4: None,
            eagle3: None,
            mtp: false,
        })
    }
}
