//! Copies between buffers (parts of rows, host data), with their shape checks.

use quiver_backend::{reference, BackendError, Result};

pub(crate) fn check(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(BackendError::Shape {
            op,
            detail: detail(),
        })
    }
}

pub(crate) fn copy_cols(
    src: &[f32],
    src_cols: usize,
    first: usize,
    width: usize,
    rows: usize,
    out: &mut [f32],
) -> Result<()> {
    let ok = first + width <= src_cols && src.len() >= rows * src_cols && out.len() >= rows * width;
    check("copy_cols", ok, || {
        format!(
            "{rows} rows, columns {first}..{} of {src_cols}",
            first + width
        )
    })?;
    reference::copy_cols(src, src_cols, first, width, rows, out);
    Ok(())
}

pub(crate) fn put_cols(
    src: &[f32],
    width: usize,
    rows: usize,
    out: &mut [f32],
    out_cols: usize,
    at: usize,
) -> Result<()> {
    let ok = at + width <= out_cols && src.len() >= rows * width && out.len() >= rows * out_cols;
    check("put_cols", ok, || {
        format!("{rows} rows, columns {at}..{} of {out_cols}", at + width)
    })?;
    reference::put_cols(src, width, rows, out, out_cols, at);
    Ok(())
}

pub(crate) fn write(x: &mut [f32], data: &[f32]) -> Result<()> {
    check("write", data.len() <= x.len(), || {
        format!("{} values into {}", data.len(), x.len())
    })?;
    x[..data.len()].copy_from_slice(data);
    Ok(())
}

pub(crate) fn copy_range(
    src: &[f32],
    src_at: usize,
    dst: &mut [f32],
    dst_at: usize,
    n: usize,
) -> Result<()> {
    let ok = src_at + n <= src.len() && dst_at + n <= dst.len();
    check("copy_range", ok, || {
        format!(
            "{n} values from {src_at} of {} to {dst_at} of {}",
            src.len(),
            dst.len()
        )
    })?;
    dst[dst_at..dst_at + n].copy_from_slice(&src[src_at..src_at + n]);
    Ok(())
}

/// out[t] = dequantized row `tokens[t]` of `table` · scale; with `part` (the table holds rows
/// `part..` of the vocabulary), rows of the tokens outside it are −0.0.
pub(crate) fn embed(
    tokens: &[u32],
    table: &crate::CpuWeight,
    part: Option<usize>,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let cols = table.cols;
    let row_bytes = table.ty.row_bytes(cols as u64).unwrap_or(0) as usize;
    let n = tokens.len();
    check("embed", out.len() >= n * cols, || {
        format!("out holds {} < {n}×{cols}", out.len())
    })?;
    for (t, &id) in tokens.iter().enumerate() {
        let o = &mut out[t * cols..][..cols];
        let id = match part {
            None => id as usize,
            Some(first) => match (id as usize).checked_sub(first) {
                Some(i) if i < table.rows => i,
                _ => {
                    o.fill(-0.0);
                    continue;
                }
            },
        };
        check("embed", id < table.rows, || {
            format!("token id {id} ≥ vocabulary {}", table.rows)
        })?;
        quiver_quant::dequantize(table.ty, &table.bytes()[id * row_bytes..][..row_bytes], o)
            .map_err(|e| BackendError::Shape {
                op: "embed",
                detail: e.to_string(),
            })?;
        if scale != 1.0 {
            o.iter_mut().for_each(|x| *x *= scale);
        }
    }
    Ok(())
}
