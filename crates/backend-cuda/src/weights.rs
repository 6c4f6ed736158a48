//! Weights: the GGUF bytes copied from the mapped file straight to device memory (vectors as
//! f32), the kernel names each weight's products launch, and its row of the kernel table.

use crate::dev::DevBuf;
use crate::plan::{ProductRow, WeightKey};
use crate::{check, kernel_suffix, registry, CudaBackend};
use quiver_backend::{BackendError, Numerics, Result, WeightBytes};
use quiver_gguf::GgmlType;

pub struct CudaWeight {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub(crate) row_bytes: usize,
    /// The GGUF bytes (vectors: f32).
    pub(crate) data: DevBuf,
    pub(crate) kernel: &'static str,
    /// Its row of the kernel table: the product family per kind of rows and token count.
    pub(crate) plan: ProductRow,
    /// Its module and kernel names, made once at load (no formatting per launch).
    pub(crate) names: Box<KernelNames>,
}

/// The kernels a weight's products and lookups launch: [general, single-token] variants, then
/// the same that prefetch their weights before waiting for the previous kernel (`mmv_name`).
pub(crate) struct KernelNames {
    pub(crate) module: String,
    pub(crate) embed: String,
    pub(crate) mmv: [String; 4],
    pub(crate) glu: [String; 4],
    /// The tensor-core products over the weight's blocks (kernels/qmm.cu): many tokens, decode.
    pub(crate) qmm: String,
    pub(crate) qmv: String,
    /// qmm over the experts' rows, grouped by a tile list (MoE prefill).
    pub(crate) qmm_g: String,
    /// Hopper's warpgroup products (kernels/wmm.cu), one per tile of `wmm::WMM_TILES`.
    pub(crate) wmm: [String; crate::wmm::WMM_TILES.len()],
    /// The experts' products on wmm (kernels/wmm.cu `wmm_g`).
    pub(crate) wmm_g: String,
    /// The int8 tensor-core products (`registry::int8_mma`).
    pub(crate) imm: String,
    /// imm on wgmma (`registry::imm_wgmma` types).
    pub(crate) immw: String,
    /// imv for 8 and 16 tokens per launch (one, two n8 tiles).
    pub(crate) imv: [String; 2],
    /// The parity mode's product and gather (module "exact").
    pub(crate) x_mm: String,
    pub(crate) x_embed: String,
    /// The expert-indexed product kernels: [gated, plain] per pair, then the same grouped by
    /// expert.
    pub(crate) moe: [String; 4],
    /// [gated, plain] per pair on int8 activations (types with int8 decode kernels), in the
    /// exact-sum order where `canon` (moeqc: imv_g's bits).
    pub(crate) moeq: [String; 2],
    /// A product per group of one row's columns on int8 activations (mmvq.cu `mmvq_groups`),
    /// in the matrix-vector kernels' order.
    pub(crate) mmvq_groups: String,
    /// The experts' products on imv of one and two n8 tiles (kernels/imm.cu `imv_g`;
    /// `registry::int8_mma` types).
    pub(crate) imv_g: [String; 2],
    /// F32 weights' product of 8 tokens a launch column and of one token (kernels/mmv.cu
    /// `f32mm`; module quant_f32 only).
    pub(crate) f32mm: [String; 2],
}

impl KernelNames {
    /// `int8`: the decode kernels over int8 activations (mmvq); `canon`: those that sum in the
    /// int8 tensor-core kernels' order (mmvqc, `registry::int8_mma` types).
    fn new(kernel: &str, int8: bool, canon: bool) -> Self {
        let base = match (int8, canon) {
            (true, true) => "mmvqc",
            (true, false) => "mmvq",
            _ => "mmv",
        };
        let v = |pre: &str, post: &str| {
            [
                format!("{pre}{post}_{kernel}"),
                format!("{pre}1{post}_{kernel}"),
                format!("{pre}p{post}_{kernel}"),
                format!("{pre}p1{post}_{kernel}"),
            ]
        };
        KernelNames {
            module: format!("quant_{kernel}"),
            embed: format!("embed_{kernel}"),
            mmv: v(base, ""),
            glu: v(base, "_glu"),
            qmm: format!("qmm_{kernel}"),
            qmv: format!("qmv_{kernel}"),
            qmm_g: format!("qmm_g_{kernel}"),
            wmm: crate::wmm::WMM_TILES.map(|(bm, bn)| format!("wmm{bm}x{bn}_{kernel}")),
            wmm_g: format!("wmm_g_{kernel}"),
            imm: format!("imm_{kernel}"),
            immw: format!("immw_{kernel}"),
            imv: ["", "2"].map(|t| format!("imv{t}_{kernel}")),
            x_mm: format!("x_mm_{kernel}"),
            x_embed: format!("x_embed_{kernel}"),
            moe: [
                format!("moe_glu_{kernel}"),
                format!("moe_mmv_{kernel}"),
                format!("moe_glu_g_{kernel}"),
                format!("moe_mmv_g_{kernel}"),
            ],
            moeq: ["glu", "mmv"].map(|k| {
                let q = if canon { "moeqc" } else { "moeq" };
                format!("{q}_{k}_{kernel}")
            }),
            mmvq_groups: format!("{base}_groups_{kernel}"),
            imv_g: ["", "2"].map(|t| format!("imv_g{t}_{kernel}")),
            f32mm: ["", "1"].map(|t| format!("f32mm{t}_{kernel}")),
        }
    }
}

/// A weight's shape: (rows, cols) of a row-major GGUF shape.
pub(crate) fn rows_cols(shape: &[u64]) -> (usize, usize) {
    let cols = *shape.last().unwrap_or(&1) as usize;
    let rows = shape.iter().rev().skip(1).product::<u64>() as usize;
    (rows, cols)
}

impl CudaBackend {
    /// Moves the load progress bar on by `n` bytes.
    fn loaded(&self, n: u64) {
        if let Some((p, done, total)) = self.load_progress.lock().unwrap().as_mut() {
            *done += n;
            p.update(*done, &mut std::io::stderr());
            if *done >= *total {
                eprintln!();
            }
        }
    }

    /// A vector (one row) as f32, whatever its GGUF type.
    pub(crate) fn vector_weight(
        &self,
        name: &str,
        ty: GgmlType,
        cols: usize,
        bytes: &WeightBytes,
    ) -> Result<CudaWeight> {
        let raw = bytes.bytes();
        let mut v = vec![0f32; cols];
        quiver_quant::dequantize(ty, raw, &mut v).map_err(|e| BackendError::Shape {
            op: "weight",
            detail: format!("{name}: {e}"),
        })?;
        let data = self.alloc(cols * 4, name)?;
        self.dev
            .htod_sync(data.ptr, &v)
            .map_err(BackendError::Device)?;
        self.mem.lock().unwrap().weights += data.bytes as u64;
        self.loaded(raw.len() as u64);
        Ok(CudaWeight {
            ty: GgmlType::F32,
            rows: 1,
            cols,
            row_bytes: cols * 4,
            data,
            kernel: "f32",
            plan: self.product_row("f32", GgmlType::F32, cols),
            names: Box::new(KernelNames::new("f32", false, false)),
        })
    }

    /// A weight's row of the kernel table.
    pub(crate) fn product_row(
        &self,
        kernel: &'static str,
        ty: GgmlType,
        cols: usize,
    ) -> ProductRow {
        ProductRow::pinned(
            self.cfg.numerics,
            self.dev.info.arch,
            WeightKey {
                kernel,
                blas: ty == GgmlType::F16 && self.blas.is_some(),
                qmv_fits: crate::qmm::qmv_fits(kernel, cols),
                wmm_fits: crate::wmm::wmm_fits(ty.row_bytes(cols as u64).unwrap_or(0) as usize),
            },
            self.cfg.pin,
        )
    }

    /// A matrix in its GGUF type, on the device as the file has it.
    pub(crate) fn matrix_weight(
        &self,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &WeightBytes,
    ) -> Result<CudaWeight> {
        let raw = bytes.bytes();
        let kernel = kernel_suffix(ty).ok_or(BackendError::Unsupported {
            op: "matmul",
            ty,
            backend: "cuda",
        })?;
        check("weight", cols.is_multiple_of(32), || {
            format!("{name}: {cols} columns is not a multiple of 32")
        })?;
        self.reg
            .lock()
            .unwrap()
            .ensure(&format!("quant_{kernel}"))
            .map_err(BackendError::Device)?;
        let row_bytes = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
        check("weight", row_bytes * rows == raw.len(), || {
            format!("{name}: {} bytes for {rows}×{cols} {ty}", raw.len())
        })?;
        // An odd count of rows that wmm reads in pairs: a row more, never written or stored.
        let pad = if crate::wmm::wmm_pairs(row_bytes) && !rows.is_multiple_of(2) {
            row_bytes
        } else {
            0
        };
        let data = self.alloc(raw.len() + pad, name)?;
        // Straight from the mapped file, in pieces so the progress bar moves.
        const PIECE: usize = 64 << 20;
        for (i, chunk) in raw.chunks(PIECE).enumerate() {
            self.dev
                .htod_sync(data.ptr + (i * PIECE) as u64, chunk)
                .map_err(BackendError::Device)?;
            self.loaded(chunk.len() as u64);
        }
        self.mem.lock().unwrap().weights += data.bytes as u64;
        Ok(CudaWeight {
            ty,
            rows,
            cols,
            row_bytes,
            data,
            kernel,
            plan: self.product_row(kernel, ty, cols),
            names: Box::new(KernelNames::new(
                kernel,
                registry::int8_activations(kernel).is_some(),
                self.cfg.numerics == Numerics::BatchInvariant && registry::int8_mma(kernel),
            )),
        })
    }
}
