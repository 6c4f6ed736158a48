//! `eagle3`: an EAGLE-3 draft head (the GGUF llama.cpp's converter writes) for speculative
//! decoding. It reads the target model's hidden states at three of its layers
//! (`target_layers`: the input of each such layer, or the final pre-norm state where the id is
//! the target's layer count), concatenated per token and projected by `fc` to the head's width:
//! that token's "g" ([`Model::head_encode`]). The head is one llama layer: at position P it
//! reads the token at P + 1 and g at P; its attention takes
//! [attn_norm(embedding) | hidden_norm(g)] (twice its width) and g (or hidden_norm(g), with
//! `norm_before_residual`) is the residual. Its pre-norm output is the g of the position it
//! drafts next; its logits cover the draft vocabulary (`d2t` maps an id to the target's), by
//! its own output matrix or the target's, as its token embeddings may be the target's.

use crate::decoder::{Ffn, Layer, Scales};
use crate::hparams::{Hparams, Reader};
use crate::{find, weight, Model, ModelError, Result, State};
use quiver_backend::{Activation, AttnParams, Backend, RopeMode, Step};
use quiver_gguf::{GgmlType, GgufFile};
use std::sync::Arc;

/// The head's own hyperparameters (`eagle3.*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Eagle3Hp {
    /// The target layers whose inputs g is made of (the target's layer count: its final
    /// pre-norm state).
    pub target_layers: [usize; 3],
    /// The target's width (`target_hidden_size`).
    pub n_embd_tgt: usize,
    pub norm_before_residual: bool,
    /// The concatenated states are rms-normed (`enc.output_norm`) before `fc`.
    pub norm_before_fc: bool,
}

/// The head's weights beyond its one layer.
pub struct Eagle3<B: Backend> {
    /// [n_embd, 3 · n_embd_tgt]
    pub fc: B::Weight,
    pub enc_norm: Option<B::Weight>,
    /// `blk.0.attn_norm_2`: g's norm.
    pub hidden_norm: B::Weight,
    /// Draft-vocabulary id → the target's id (None: the target's vocabulary).
    pub d2t: Option<Vec<u32>>,
}

/// The head's step buffers ([`State`]).
pub(crate) struct Bufs<B: Backend> {
    /// [n, 2 · n_embd]: the attention's input (a multi-token-prediction block's `eh_proj`'s).
    pub(crate) cat: B::Buf,
    /// [n, n_embd]: g of each row, as [`Model::head_input`] writes it; after
    /// [`Model::head_encode`], the encoded rows.
    pub(crate) g: B::Buf,
    /// [n, 3 · n_embd_tgt]: the normed states, with `norm_before_fc`.
    enc: Option<B::Buf>,
}

impl<B: Backend> Bufs<B> {
    pub(crate) fn floats(hp: &Hparams, n: usize) -> usize {
        let e = hp.eagle3.as_ref().map_or(0, |e| e.n_embd_tgt * 3);
        n * (3 * hp.stream_width() + e)
    }

    /// An EAGLE-3 head's buffers, or a multi-token-prediction block's (`crate::mtp`: g and
    /// cat only; DeepSeek-V4's per stream).
    pub(crate) fn new(b: &B, hp: &Hparams, n: usize) -> Result<Self> {
        let w = hp.stream_width();
        Ok(Bufs {
            cat: b.buf(n * 2 * w)?,
            g: b.buf(n * w)?,
            enc: match hp.eagle3.as_ref().filter(|e| e.norm_before_fc) {
                Some(e) => Some(b.buf(n * 3 * e.n_embd_tgt)?),
                None => None,
            },
        })
    }
}

pub(crate) fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Normal, Activation::SwiGlu)?;
    if hp.n_layer != 1 {
        return Err(r.bad(
            "block_count",
            format!("{} (EAGLE-3 has one layer)", hp.n_layer),
        ));
    }
    let key = "target_layers";
    let layers: Vec<i64> = match f.get_array(&format!("eagle3.{key}"))? {
        Some(quiver_gguf::Array::I32(v)) => v.iter().map(|&x| x as i64).collect(),
        Some(quiver_gguf::Array::U32(v)) => v.iter().map(|&x| x as i64).collect(),
        Some(_) => return Err(r.bad(key, "is not an array of integers")),
        None => return Err(r.bad(key, "missing (an EAGLE-3 head names 3 target layers)")),
    };
    if layers.len() != 3 || layers.iter().any(|&x| x < 0) {
        return Err(r.bad(key, format!("{layers:?}: EAGLE-3 takes 3 layer ids")));
    }
    let flag =
        |k: &str| -> Result<bool> { Ok(f.get_bool(&format!("eagle3.{k}"))?.unwrap_or(false)) };
    hp.eagle3 = Some(Eagle3Hp {
        target_layers: [layers[0] as usize, layers[1] as usize, layers[2] as usize],
        n_embd_tgt: r.req("target_hidden_size")?,
        norm_before_residual: flag("norm_before_residual")?,
        norm_before_fc: flag("norm_before_fc")?,
    });
    // The logits are over the draft vocabulary where the head maps it to the target's.
    if let Some(t) = f.tensor("d2t") {
        hp.n_vocab = t.shape.first().copied().unwrap_or(0) as usize;
    }
    Ok(hp)
}

/// Whether `target` can feed an EAGLE-3 head of `hp`: its width and the layers the head reads
/// (one line saying why not).
pub fn check_target(hp: &Hparams, target: &Hparams) -> std::result::Result<(), String> {
    let e = hp
        .eagle3
        .as_ref()
        .ok_or("the draft model is not an EAGLE-3 head")?;
    if target.dsv4.is_some() || target.layers.iter().any(|l| l.recurrent) {
        return Err(format!(
            "an EAGLE-3 head reads a decoder's hidden states: the target ({}) has none to give",
            target.arch
        ));
    }
    if e.n_embd_tgt != target.n_embd {
        return Err(format!(
            "the EAGLE-3 head was made for a target {} wide; this target is {}",
            e.n_embd_tgt, target.n_embd
        ));
    }
    if let Some(&l) = e.target_layers.iter().find(|&&l| l > target.n_layer) {
        return Err(format!(
            "the EAGLE-3 head reads layer {l}; the target has {} layers",
            target.n_layer
        ));
    }
    Ok(())
}

/// Loads an EAGLE-3 head whose token embeddings and output matrix may be the target's.
pub fn load<B: Backend>(b: &B, f: &Arc<GgufFile>, target: &Arc<GgufFile>) -> Result<Model<B>> {
    let hp = hparams(f)?;
    let e = hp.eagle3.clone().expect("eagle3 hparams");
    let th = crate::hparams(target)?;
    check_target(&hp, &th).map_err(|detail| ModelError::BadHparam {
        key: "eagle3.target_layers".into(),
        detail,
    })?;
    let lh = &hp.layers[0];
    let (d, ff) = (hp.n_embd as u64, lh.n_ff as u64);
    let (qd, kvd) = (lh.q_dim() as u64, lh.kv_dim() as u64);
    let w = |name: &str, shape: &[u64]| weight(b, f, name, shape);
    // The head's own tensor, else the target's (same shape).
    let own_or_target = |name: &str, shape: &[u64]| match f.tensor(name) {
        Some(_) => w(name, shape),
        None => weight(b, target, name, shape),
    };
    let n_target_vocab = th.n_vocab as u64;
    let tok_embd = own_or_target("token_embd.weight", &[n_target_vocab, d])?;
    let output = match (f.tensor("output.weight"), target.tensor("output.weight")) {
        (Some(_), _) => w("output.weight", &[hp.n_vocab as u64, d])?,
        (None, Some(_)) => weight(b, target, "output.weight", &[n_target_vocab, d])?,
        // The target's output tied to its embeddings.
        (None, None) => weight(b, target, "token_embd.weight", &[n_target_vocab, d])?,
    };
    let d2t = match f.tensor("d2t") {
        None => None,
        Some(_) => Some(read_d2t(f, hp.n_vocab, th.n_vocab)?),
    };
    let n = |s: &str| format!("blk.0.{s}.weight");
    let layer = Layer {
        attn_norm: w(&n("attn_norm"), &[d])?,
        wq: w(&n("attn_q"), &[qd, 2 * d])?,
        wk: Some(w(&n("attn_k"), &[kvd, 2 * d])?),
        wv: Some(w(&n("attn_v"), &[kvd, 2 * d])?),
        wo: w(&n("attn_output"), &[d, qd])?,
        bq: None,
        bk: None,
        bv: None,
        bo: None,
        q_norm: None,
        k_norm: None,
        post_attn_norm: None,
        ffn_norm: w(&n("ffn_norm"), &[d])?,
        ffn: Ffn::Dense {
            gate: w(&n("ffn_gate"), &[ff, d])?,
            up: w(&n("ffn_up"), &[ff, d])?,
            down: w(&n("ffn_down"), &[d, ff])?,
        },
        post_ffw_norm: None,
        attn: AttnParams {
            n_head: lh.n_head,
            n_head_kv: lh.n_head_kv,
            head_dim: lh.head_dim,
            scale: hp.attn_scale,
            scale_q: false,
            window: None,
            softcap: None,
        },
        rope: hp.rope.clone(),
        kv: 0,
        ple: None,
        out_scale: None,
        scales: Scales::default(),
        linear: None,
        reduce_parts: None,
    };
    let dt = e.n_embd_tgt as u64;
    let head = Eagle3 {
        fc: w("fc.weight", &[d, 3 * dt])?,
        enc_norm: match e.norm_before_fc {
            true => Some(w("enc.output_norm.weight", &[3 * dt])?),
            false => None,
        },
        hidden_norm: w(&n("attn_norm_2"), &[d])?,
        d2t,
    };
    Ok(Model {
        output_norm: w("output_norm.weight", &[d])?,
        output: Some(output),
        output_b: None,
        tok_embd,
        layers: vec![layer],
        ple: None,
        dsv4: None,
        eagle3: Some(head),
        mtp: None,
        seq_ctx: None,
        hp,
        kv_types: quiver_backend::KvTypes::default(),
        max_seqs: 1,
    })
}

/// `d2t` as target ids: llama.cpp's converter writes them absolute, as I64.
fn read_d2t(f: &GgufFile, n_draft: usize, n_target: usize) -> Result<Vec<u32>> {
    let (idx, ty) = find(f, "d2t", &[n_draft as u64])?;
    let bad = |detail: String| ModelError::BadHparam {
        key: "d2t".into(),
        detail,
    };
    if ty != GgmlType::I64 {
        return Err(bad(format!("is {ty:?}, not I64")));
    }
    let data = f.tensor_data(&f.tensors[idx]);
    data.chunks_exact(8)
        .map(|c| {
            let v = i64::from_le_bytes(c.try_into().expect("8 bytes"));
            u32::try_from(v)
                .ok()
                .filter(|&t| (t as usize) < n_target)
                .ok_or_else(|| {
                    bad(format!(
                        "maps to {v}, outside the target's {n_target} tokens"
                    ))
                })
        })
        .collect()
}

/// The head's forward over a step: tokens and their g rows (`Bufs::g`) in, logits of the
/// wanted rows and each row's pre-norm state (`State::x`) out.
pub(crate) fn forward<B: Backend>(
    b: &mut B,
    m: &Model<B>,
    e: &Eagle3<B>,
    s: &mut State<B>,
    step: &Step<B::StepCtx>,
) -> Result<()> {
    let (n, hp) = (step.rows, &m.hp);
    let (d, eps) = (hp.n_embd, hp.rms_eps);
    let l = &m.layers[0];
    let ea = s.ea.as_mut().expect("an eagle3 state");
    b.embed(step, &m.tok_embd, 1.0, &mut s.x)?;
    b.rms_norm(&s.x, &l.attn_norm, eps, n, &mut s.xn)?;
    b.rms_norm(&ea.g, &e.hidden_norm, eps, n, &mut s.o)?;
    b.put_cols(&s.xn, d, n, &mut ea.cat, 2 * d, 0)?;
    b.put_cols(&s.o, d, n, &mut ea.cat, 2 * d, d)?;
    let residual = match hp.eagle3.as_ref().is_some_and(|e| e.norm_before_residual) {
        true => &s.o,
        false => &ea.g,
    };
    b.copy_cols(residual, d, 0, d, n, &mut s.x)?;
    let (wk, wv) = (l.wk.as_ref(), l.wv.as_ref());
    let (wk, wv) = (wk.expect("eagle3 k"), wv.expect("eagle3 v"));
    b.matmul_many(
        &[&l.wq, wk, wv],
        &ea.cat,
        n,
        &mut [&mut s.q, &mut s.k, &mut s.v],
    )?;
    b.rope_kv_write(
        step,
        &mut s.q,
        &mut s.k,
        &s.v,
        &l.rope,
        &l.attn,
        &mut s.kv[0],
    )?;
    b.attention(step, &s.q, &s.kv[0], &l.attn, &mut s.attn)?;
    b.matmul(&l.wo, &s.attn, n, &mut s.o)?;
    b.add_rms_norm(&mut s.x, &s.o, &l.ffn_norm, eps, n, &mut s.xn)?;
    let Ffn::Dense { gate, up, down } = &l.ffn else {
        unreachable!("eagle3's FFN is dense")
    };
    let gu = [&mut s.gate, &mut s.up];
    b.matmul_glu(hp.act, gate, up, &s.xn, n, gu, &mut s.act)?;
    b.matmul(down, &s.act, n, &mut s.o)?;
    b.add_rms_norm(&mut s.x, &s.o, &m.output_norm, eps, n, &mut s.xn)?;
    let out = m.output.as_ref().expect("eagle3's output matrix");
    b.matmul_logits(step, out, &s.xn, &mut s.logits)?;
    Ok(())
}

impl<B: Backend> Model<B> {
    /// A draft head's g of `rows` tokens from the target's states `feat` into `s` (read back
    /// with [`Model::head_g`]): an EAGLE-3 head's from the layers it reads
    /// ([rows, 3 · n_embd_tgt], [`State::features`]); a multi-token-prediction block's is the
    /// target's hidden state itself ([rows, `Hparams::stream_width`], [`State::head_hidden`]).
    pub fn head_encode(&self, b: &B, s: &mut State<B>, feat: &B::Buf, rows: usize) -> Result<()> {
        let ea = s.ea.as_mut().expect("a draft head's state");
        if rows > s.max_tokens {
            return Err(ModelError::BatchTooLarge {
                got: rows,
                max: s.max_tokens,
            });
        }
        let Some(e) = self.eagle3.as_ref() else {
            let w = self.hp.stream_width();
            return Ok(b.copy_cols(feat, w, 0, w, rows, &mut ea.g)?);
        };
        let input = match (&e.enc_norm, ea.enc.as_mut()) {
            (Some(w), Some(enc)) => {
                b.rms_norm(feat, w, self.hp.rms_eps, rows, enc)?;
                &*enc
            }
            _ => feat,
        };
        b.matmul(&e.fc, input, rows, &mut ea.g)?;
        Ok(())
    }

    /// Which of the target's states a draft head reads: its final hidden states
    /// ([`State::head_hidden`], a multi-token-prediction block) or the layers it keeps
    /// ([`State::features`], an EAGLE-3 head).
    pub fn head_reads_hidden(&self) -> bool {
        self.mtp.is_some()
    }

    /// The first `rows` rows of g the last [`Model::head_encode`] made, to the host.
    pub fn head_g(&self, b: &B, s: &State<B>, rows: usize, out: &mut Vec<f32>) -> Result<()> {
        let ea = s.ea.as_ref().expect("a draft head's state");
        Ok(b.read(&ea.g, rows * self.head_width(), out)?)
    }

    /// Width of a draft head's g row: n_embd, or a multi-token-prediction block's
    /// `Hparams::stream_width` (DeepSeek-V4's hc streams).
    pub fn head_width(&self) -> usize {
        match self.mtp {
            Some(_) => self.hp.stream_width(),
            None => self.hp.n_embd,
        }
    }

    /// Writes the next step's g rows ([rows, [`Model::head_width`]], row-major) from the host.
    pub fn head_input(&self, b: &B, s: &mut State<B>, g: &[f32]) -> Result<()> {
        let ea = s.ea.as_mut().expect("a draft head's state");
        Ok(b.write(&mut ea.g, g)?)
    }

    /// The g of each row's next position after the last step ([rows, [`Model::head_width`]]):
    /// an EAGLE-3 head's pre-norm states, a multi-token-prediction block's hidden ones
    /// ([`State::head_hidden`]).
    pub fn head_next_g(&self, b: &B, s: &State<B>, rows: usize, out: &mut Vec<f32>) -> Result<()> {
        let x = if self.mtp.is_some() {
            s.head_hidden()
        } else {
            &s.x
        };
        Ok(b.read(x, rows * self.head_width(), out)?)
    }

    /// The head's draft-vocabulary id as the target's.
    pub fn head_target_id(&self, id: u32) -> u32 {
        match self.eagle3.as_ref().and_then(|e| e.d2t.as_ref()) {
            Some(m) => m.get(id as usize).copied().unwrap_or(u32::MAX),
            None => id,
        }
    }
}
