//! Matmul dispatch. Until the SIMD kernels land this dequantizes weight rows in blocks and
//! uses f32 dots, split over threads.

use quiver_backend::{BackendError, Result};
use quiver_gguf::GgmlType;

pub struct MatMul {
    threads: usize,
}

impl MatMul {
    pub fn new(threads: usize) -> Self {
        MatMul { threads: threads.max(1) }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn supports(&self, ty: GgmlType) -> bool {
        quiver_quant::can_dequantize(ty)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn run(&self, ty: GgmlType, w: &[u8], rows: usize, cols: usize, x: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        let rb = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
        if w.len() < rows * rb {
            return Err(BackendError::Shape { op: "matmul", detail: format!("weight bytes {} < {rows}×{rb}", w.len()) });
        }
        // Round activations the way ggml does before its integer dot products, so results
        // track llama.cpp's.
        let act_ty = match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 => Some(GgmlType::Q8_1),
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => Some(GgmlType::Q8_0),
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::IQ4_XS => Some(GgmlType::Q8_K),
            GgmlType::F16 => Some(GgmlType::F16),
            GgmlType::BF16 => Some(GgmlType::BF16),
            _ => None,
        };
        let xq;
        let x = match act_ty {
            Some(at) if cols % at.block_size() == 0 => {
                let mut bytes = Vec::new();
                let _ = quiver_quant::quantize(at, x, &mut bytes);
                let mut back = vec![0f32; x.len()];
                let _ = quiver_quant::dequantize(at, &bytes, &mut back);
                xq = back;
                &xq[..]
            }
            _ => x,
        };
        let per = rows.div_ceil(self.threads);
        let out_ptr = out.as_mut_ptr() as usize;
        std::thread::scope(|s| {
            for t in 0..self.threads {
                let r0 = t * per;
                let r1 = (r0 + per).min(rows);
                if r0 >= r1 {
                    continue;
                }
                s.spawn(move || {
                    let mut row = vec![0f32; cols];
                    for r in r0..r1 {
                        let _ = quiver_quant::dequantize(ty, &w[r * rb..][..rb], &mut row);
                        for tk in 0..n {
                            let xt = &x[tk * cols..][..cols];
                            let d: f32 = row.iter().zip(xt).map(|(a, b)| a * b).sum();
                            // SAFETY: each thread writes only rows r0..r1 of every token, disjoint.
                            unsafe { *(out_ptr as *mut f32).add(tk * rows + r) = d };
                        }
                    }
                });
            }
        });
        Ok(())
    }
}
