//! Tensor parallelism: N ranks each hold part of every layer and run the ordinary forward on
//! it (SPMD). A rank holds its share of the attention heads (the rows of q, k, v and the
//! matching columns of the output projection) and of the FFN's width (the rows of gate and up,
//! the matching columns of down); norms are whole on every rank.
//! The output and down projections then give each rank a partial sum over its columns, which
//! [`Backend::all_reduce`] adds in rank order; everything else is per head or per row, so a
//! rank computes its heads as the whole model does. Embedding and output head are split by
//! vocabulary where the ranks divide it: the embedding's rows of the other ranks' tokens are
//! −0.0 and summed ([`Backend::embed_part`], exact), each rank's logits of its rows gathered
//! ([`Backend::all_gather_cols`]).
//!
//! [`load_reduce_chunks`] loads the whole model with those two products split the same way
//! (each column part's product, the parts added in order): the unsharded model that N ranks
//! equal bit for bit, with the same kernels.

use crate::{decoder, find, hparams, weight, weight_rows, Hparams, Model, ModelError, Result};
use quiver_backend::{Backend, Shard, WeightBytes};
use quiver_gguf::{GgufFile, GgufWriter};
use std::sync::Arc;

/// How a load splits the layers: the rank's part (`shard`), and into how many column parts the
/// whole model's reduced products split (`chunks`, the reference of that many ranks).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tp {
    pub(crate) shard: Shard,
    pub(crate) chunks: usize,
}

/// The column parts of a layer's reduced products ([`load_reduce_chunks`]).
pub struct ReduceParts<B: Backend> {
    /// The attention output projection's, then the FFN's down projection's.
    pub wo: Vec<B::Weight>,
    pub down: Vec<B::Weight>,
}

/// Rank `shard.rank` of a model split over `shard.size` ranks; `backend` must be that rank of
/// its communicator's group ([`Backend::shard`]). Its hyperparameters are the rank's
/// ([`Hparams::shard`]): its states hold its heads' share of every KV block.
pub fn load_shard<B: Backend>(backend: &B, file: &Arc<GgufFile>, shard: Shard) -> Result<Model<B>> {
    if backend.shard() != shard {
        return Err(ModelError::Tp(format!(
            "the model's part is {shard} but the {} backend is {}",
            backend.name(),
            backend.shard()
        )));
    }
    let hp = hparams(file)?.shard(shard.size)?;
    decoder::load(backend, file, hp, Tp { shard, chunks: 1 })
}

/// The whole model, its output and down projections computed as `chunks` ranks compute them:
/// each column part's product, then the parts added in part order with the additions of the
/// all-reduce. N ranks of [`load_shard`] give its results bit for bit.
pub fn load_reduce_chunks<B: Backend>(
    backend: &B,
    file: &Arc<GgufFile>,
    chunks: usize,
) -> Result<Model<B>> {
    let hp = hparams(file)?;
    hp.shard(chunks)?;
    if hp.moe.is_some() {
        return Err(ModelError::Tp(
            "the reference splits dense layers' products only (a mixture of experts runs whole)"
                .into(),
        ));
    }
    let tp = Tp {
        shard: Shard::ONE,
        chunks,
    };
    decoder::load(backend, file, hp, tp)
}

impl Hparams {
    /// A rank's hyperparameters when `size` ranks split the model: each layer's heads, KV
    /// heads and FFN width divided by `size`. An error names what does not divide, or what
    /// tensor parallelism does not split yet.
    pub fn shard(&self, size: usize) -> Result<Hparams> {
        let refuse = |what: &str| {
            Err(ModelError::Tp(format!(
                "{} has {what}, which it cannot split across ranks yet",
                self.arch
            )))
        };
        if size == 0 {
            return Err(ModelError::Tp("0 ranks".into()));
        }
        if size == 1 {
            return Ok(self.clone());
        }
        if self.shared_expert_ff > 0 {
            return refuse("a shared expert");
        }
        if self.dsv4.is_some() || self.eagle3.is_some() || self.mtp {
            return refuse("DeepSeek-V4 layers or a draft head");
        }
        if self.delta_net.is_some() || self.q_gate || self.layers.iter().any(|l| l.recurrent) {
            return refuse("recurrent or gated-attention layers (Qwen 3.5)");
        }
        if self.v_norm || self.n_embd_per_layer > 0 {
            return refuse("Gemma 4's layers");
        }
        if self.layers.iter().enumerate().any(|(i, l)| l.kv_from != i) {
            return refuse("layers that share another layer's KV");
        }
        let mut hp = self.clone();
        for (i, l) in hp.layers.iter_mut().enumerate() {
            for (what, v) in [
                ("heads", &mut l.n_head),
                ("KV heads", &mut l.n_head_kv),
                ("FFN width", &mut l.n_ff),
            ] {
                if *v % size != 0 {
                    return Err(ModelError::Tp(format!(
                        "layer {i}'s {what} ({v}) do not divide by {size} ranks"
                    )));
                }
                *v /= size;
            }
        }
        if let Some(m) = hp.moe.as_mut() {
            // By shape: every expert's width split as a dense layer's where each rank's share
            // is whole blocks of 256 (any weight type's columns split there); else whole
            // experts a rank (expert parallelism; the rank's run is set at load, `decoder::load`);
            // else the width, where the loader checks the blocks.
            let width = m.n_ff.is_multiple_of(256 * size);
            if !width && m.n_expert.is_multiple_of(size) {
                m.held = (0, m.n_expert / size);
            } else if m.n_ff.is_multiple_of(size) {
                m.n_ff /= size;
            } else {
                return Err(ModelError::Tp(format!(
                    "neither the experts' FFN width ({}) nor their count ({}) divides by {size} ranks",
                    m.n_ff, m.n_expert
                )));
            }
        }
        let max = |f: fn(&crate::LayerHp) -> usize| hp.layers.iter().map(f).max().unwrap_or(0);
        (hp.n_head, hp.n_head_kv, hp.n_ff) =
            (max(|l| l.n_head), max(|l| l.n_head_kv), max(|l| l.n_ff));
        Ok(hp)
    }
}

impl Tp {
    /// The whole model, whole products.
    pub(crate) const NONE: Tp = Tp {
        shard: Shard::ONE,
        chunks: 1,
    };

    /// The rows of the embedding and output head a rank holds, where the ranks split them by
    /// vocabulary (a vocabulary that divides by the ranks; else every rank holds them whole).
    pub(crate) fn vocab_rows(&self, n_vocab: u64) -> Option<u64> {
        let size = self.shard.size as u64;
        (size > 1 && n_vocab.is_multiple_of(size)).then(|| n_vocab / size)
    }

    /// The rank's rows of the part `first..first + n` of a tensor whose rank-local shape is
    /// `local` (a tensor of several parts, as a fused QKV, holds each part's rows of every
    /// rank together: part p's rows of rank r start at size·first + r·n).
    pub(crate) fn rows<B: Backend>(
        &self,
        b: &B,
        f: &Arc<GgufFile>,
        name: &str,
        local: &[u64; 2],
        first: u64,
        n: u64,
    ) -> Result<B::Weight> {
        let (size, rank) = (self.shard.size as u64, self.shard.rank as u64);
        if size == 1 && first == 0 && n == local[0] {
            return weight(b, f, name, local);
        }
        let full = [local[0] * size, local[1]];
        weight_rows(b, f, name, &full, size * first + rank * n, n)
    }

    /// The rank's `len` values of the vector `name` (a bias of rows split by [`Tp::rows`]).
    pub(crate) fn vector<B: Backend>(
        &self,
        b: &B,
        f: &Arc<GgufFile>,
        name: &str,
        len: u64,
    ) -> Result<B::Weight> {
        let (size, rank) = (self.shard.size as u64, self.shard.rank as u64);
        if size == 1 {
            return weight(b, f, name, &[len]);
        }
        let (idx, ty) = find(f, name, &[len * size])?;
        let part = format!("{name}[{}..{}]", rank * len, (rank + 1) * len);
        let (Some(at), Some(bytes)) = (ty.row_bytes(rank * len), ty.row_bytes(len)) else {
            return Err(off_blocks(&part, ty));
        };
        let mut w = WeightBytes::whole(f.clone(), idx);
        w.range = Some((at as usize, bytes as usize));
        Ok(b.weight(&part, ty, &[len], w)?)
    }

    /// The rank's columns of a tensor whose rank-local shape is `local` (a product whose input
    /// the ranks split: its output is the rank's partial sum).
    pub(crate) fn cols<B: Backend>(
        &self,
        b: &B,
        f: &Arc<GgufFile>,
        name: &str,
        local: &[u64; 2],
    ) -> Result<B::Weight> {
        let (size, rank) = (self.shard.size as u64, self.shard.rank as u64);
        if size == 1 {
            return weight(b, f, name, local);
        }
        let full = [local[0], local[1] * size];
        weight_cols(b, f, name, &full, rank * local[1], local[1])
    }

    /// The rank's rows of every expert of the tensor `name` whose rank-local shape is `local`
    /// ([experts, rows, cols]), its rows `parts` runs of equal length (a fused gate and up: 2),
    /// each split over the ranks as [`Tp::rows`] splits a part.
    pub(crate) fn expert_rows<B: Backend>(
        &self,
        b: &B,
        f: &Arc<GgufFile>,
        name: &str,
        local: &[u64; 3],
        parts: u64,
    ) -> Result<B::Weight> {
        let (size, rank) = (self.shard.size as u64, self.shard.rank as u64);
        if size == 1 {
            return weight(b, f, name, local);
        }
        let [ne, rows, cols] = *local;
        let n = rows / parts;
        let full = [ne, rows * size, cols];
        let (idx, ty) = find(f, name, &full)?;
        let row = ty.row_bytes(cols).unwrap_or(0) as usize;
        let src = f.tensor_data(&f.tensors[idx]);
        let mut bytes = Vec::with_capacity((ne * rows) as usize * row);
        for e in src.chunks_exact((rows * size) as usize * row) {
            for p in 0..parts {
                let at = ((p * size + rank) * n) as usize * row;
                bytes.extend_from_slice(&e[at..at + n as usize * row]);
            }
        }
        let part = format!("{name}[rank {rank} of {size}]");
        in_memory(b, part, ty, local, bytes)
    }

    /// The rank's columns of every expert of the tensor `name` whose rank-local shape is
    /// `local` ([experts, rows, cols]): as [`Tp::cols`], expert by expert.
    pub(crate) fn expert_cols<B: Backend>(
        &self,
        b: &B,
        f: &Arc<GgufFile>,
        name: &str,
        local: &[u64; 3],
    ) -> Result<B::Weight> {
        let (size, rank) = (self.shard.size as u64, self.shard.rank as u64);
        if size == 1 {
            return weight(b, f, name, local);
        }
        let [ne, rows, cols] = *local;
        // Every expert's rows one after another: the columns of a 2-D tensor of ne · rows rows.
        let (idx, ty) = find(f, name, &[ne, rows, cols * size])?;
        let part = format!("{name}[:, :, {}..{}]", rank * cols, (rank + 1) * cols);
        let bytes = gather_cols(
            f,
            idx,
            ty,
            &part,
            [ne * rows, cols * size],
            rank * cols,
            cols,
        )?;
        in_memory(b, part, ty, local, bytes)
    }

    /// The reference's column parts of the tensor `name` of `shape` ([`load_reduce_chunks`]);
    /// None for whole products.
    pub(crate) fn col_parts<B: Backend>(
        &self,
        b: &B,
        f: &Arc<GgufFile>,
        name: &str,
        shape: &[u64; 2],
    ) -> Result<Option<Vec<B::Weight>>> {
        let c = self.chunks as u64;
        if c <= 1 {
            return Ok(None);
        }
        let w = shape[1] / c;
        (0..c)
            .map(|i| weight_cols(b, f, name, shape, i * w, w))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

fn off_blocks(part: &str, ty: quiver_gguf::GgmlType) -> ModelError {
    ModelError::Tp(format!(
        "{part}: the split does not fall on {ty}'s blocks of {} values",
        ty.block_size()
    ))
}

/// Columns `first..first + n` of every row of the 2-D tensor `name` of `shape`, gathered into
/// a weight of its own. The columns must lie on the type's blocks.
pub(crate) fn weight_cols<B: Backend>(
    b: &B,
    f: &Arc<GgufFile>,
    name: &str,
    shape: &[u64; 2],
    first: u64,
    n: u64,
) -> Result<B::Weight> {
    let (idx, ty) = find(f, name, shape)?;
    let part = format!("{name}[:, {first}..{}]", first + n);
    let bytes = gather_cols(f, idx, ty, &part, *shape, first, n)?;
    in_memory(b, part, ty, &[shape[0], n], bytes)
}

/// The bytes of columns `first..first + n` of every row of tensor `idx` of `shape` (rows,
/// columns), row after row; `part` names them in the error of columns off the type's blocks.
fn gather_cols(
    f: &GgufFile,
    idx: usize,
    ty: quiver_gguf::GgmlType,
    part: &str,
    shape: [u64; 2],
    first: u64,
    n: u64,
) -> Result<Vec<u8>> {
    let (Some(row), Some(at), Some(len)) =
        (ty.row_bytes(shape[1]), ty.row_bytes(first), ty.row_bytes(n))
    else {
        return Err(off_blocks(part, ty));
    };
    let (row, at, len) = (row as usize, at as usize, len as usize);
    let src = f.tensor_data(&f.tensors[idx]);
    let mut bytes = Vec::with_capacity(shape[0] as usize * len);
    for r in src.chunks_exact(row) {
        bytes.extend_from_slice(&r[at..at + len]);
    }
    Ok(bytes)
}

/// Gathered bytes as a weight of `shape`: a one-tensor GGUF in memory, what a backend takes a
/// weight from.
fn in_memory<B: Backend>(
    b: &B,
    part: String,
    ty: quiver_gguf::GgmlType,
    shape: &[u64],
    bytes: Vec<u8>,
) -> Result<B::Weight> {
    let mut w = GgufWriter::new();
    w.add_tensor(part.clone(), ty, shape);
    let file = GgufFile::from_bytes(w.to_bytes(&[&bytes])?)?;
    let whole = WeightBytes::whole(Arc::new(file), 0);
    Ok(b.weight(&part, ty, shape, whole)?)
}

/// The step's token embeddings into `x`: a rank's rows of an embedding split by vocabulary
/// ([`Backend::embed_part`]: −0.0 for the other ranks' tokens), summed over the ranks.
pub(crate) fn embed<B: Backend>(
    b: &B,
    m: &Model<B>,
    step: &quiver_backend::Step<B::StepCtx>,
    x: &mut B::Buf,
) -> Result<()> {
    let (rows, hp) = (b.weight_rows(&m.tok_embd), &m.hp);
    if rows == hp.n_vocab {
        return Ok(b.embed(step, &m.tok_embd, hp.embed_scale, x)?);
    }
    // (No rank holds a token past the vocabulary: refused as the whole table refuses it.)
    if let Some(&id) = step
        .batch
        .tokens
        .iter()
        .find(|&&t| t as usize >= hp.n_vocab)
    {
        return Err(quiver_backend::BackendError::Shape {
            op: "embed",
            detail: format!("token id {id} ≥ vocabulary {}", hp.n_vocab),
        }
        .into());
    }
    let first = b.shard().rank * rows;
    b.embed_part(step, &m.tok_embd, first, hp.embed_scale, x)?;
    Ok(b.all_reduce(x, step.rows * hp.n_embd)?)
}

/// out = x · wᵀ over `rows` rows of x [rows, cols], summed over the ranks (the rank's partial
/// product, then [`Backend::all_reduce`]). With `parts` (the reference of
/// [`load_reduce_chunks`]): part i's product over x's columns of part i (gathered into
/// `scratch[0]`, [rows, cols / parts]), the parts added in order (part i > 0 into
/// `scratch[1]`, [rows, out]), as the all-reduce adds the ranks' products.
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduced_matmul<B: Backend>(
    b: &B,
    w: &B::Weight,
    parts: Option<&[B::Weight]>,
    x: &B::Buf,
    cols: usize,
    rows: usize,
    scratch: [&mut B::Buf; 2],
    out: &mut B::Buf,
) -> Result<()> {
    let n_out = rows * b.weight_rows(w);
    let Some(parts) = parts else {
        b.matmul(w, x, rows, out)?;
        return Ok(b.all_reduce(out, n_out)?);
    };
    let [slice, part] = scratch;
    let width = cols / parts.len();
    for (i, p) in parts.iter().enumerate() {
        b.copy_cols(x, cols, i * width, width, rows, slice)?;
        if i == 0 {
            b.matmul(p, slice, rows, out)?;
        } else {
            b.matmul(p, slice, rows, part)?;
            b.add(out, part, n_out)?;
        }
    }
    Ok(())
}
