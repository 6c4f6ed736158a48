//! A streaming GGUF (version 3) writer. Tensor data is asked for one tensor at a time, so a
//! multi-gigabyte file never has to be held in memory.

use crate::value::{Array, Value};
use crate::{ne_to_shape, GgmlType, GgufError, Result, TensorInfo, DEFAULT_ALIGNMENT};
use indexmap::IndexMap;
use std::io::Write;
use std::path::Path;

/// A tensor to be written: name, type and row-major shape.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub ty: GgmlType,
    pub shape: Vec<u64>,
}

#[derive(Default)]
pub struct GgufWriter {
    pub metadata: IndexMap<String, Value>,
    pub tensors: Vec<TensorSpec>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        self.metadata.insert(key.into(), value);
        self
    }

    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        shape: &[u64],
    ) -> &mut Self {
        self.tensors.push(TensorSpec {
            name: name.into(),
            ty,
            shape: shape.to_vec(),
        });
        self
    }

    fn alignment(&self) -> Result<u64> {
        match self.metadata.get("general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(v) => match v.as_i128() {
                Some(a) if a > 0 && a <= u32::MAX as i128 && (a as u64).is_power_of_two() => {
                    Ok(a as u64)
                }
                _ => Err(GgufError::BadAlignment(
                    v.as_i128().unwrap_or(0).clamp(0, u64::MAX as i128) as u64,
                )),
            },
        }
    }

    /// Validated infos with the offsets the file will have.
    pub fn layout(&self) -> Result<Vec<TensorInfo>> {
        let align = self.alignment()?;
        let mut offset = 0u64;
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(GgufError::DuplicateTensor(t.name.clone()));
            }
            let info = TensorInfo::from_ne(t.name.clone(), t.ty, &ne_to_shape(&t.shape), offset)?;
            offset += info.n_bytes.div_ceil(align) * align;
            out.push(info);
        }
        Ok(out)
    }

    /// Writes the file to `w`. `data(i, info, buf)` must fill `buf` (cleared before each call)
    /// with exactly the bytes of tensor `i`.
    pub fn write(
        &self,
        w: &mut dyn Write,
        mut data: impl FnMut(usize, &TensorInfo, &mut Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        let io = |e| GgufError::io(Path::new("<output>"), e);
        let align = self.alignment()?;
        let infos = self.layout()?;
        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(infos.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut head, k);
            head.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut head, v);
        }
        for t in &infos {
            put_str(&mut head, &t.name);
            let ne = t.ne();
            head.extend_from_slice(&(ne.len() as u32).to_le_bytes());
            for d in ne {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&t.offset.to_le_bytes());
        }
        pad(&mut head, align);
        w.write_all(&head).map_err(io)?;
        let mut buf = Vec::new();
        for (i, t) in infos.iter().enumerate() {
            buf.clear();
            data(i, t, &mut buf)?;
            if buf.len() as u64 != t.n_bytes {
                return Err(GgufError::WrongDataSize {
                    name: t.name.clone(),
                    ty: t.ty,
                    got: buf.len() as u64,
                    expected: t.n_bytes,
                });
            }
            pad(&mut buf, align);
            w.write_all(&buf).map_err(io)?;
        }
        w.flush().map_err(io)
    }

    /// Writes to `path` through a temporary file renamed into place, so a failed or killed
    /// write never leaves a partial file under the final name.
    pub fn write_file(
        &self,
        path: &Path,
        data: impl FnMut(usize, &TensorInfo, &mut Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        let tmp = path.with_extension(format!("partial.{}", std::process::id()));
        let res = (|| {
            let f = std::fs::File::create(&tmp).map_err(|e| GgufError::io(&tmp, e))?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            self.write(&mut w, data)?;
            let f = w
                .into_inner()
                .map_err(|e| GgufError::io(&tmp, e.into_error()))?;
            f.sync_all().map_err(|e| GgufError::io(&tmp, e))?;
            std::fs::rename(&tmp, path).map_err(|e| GgufError::io(path, e))
        })();
        if res.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        res
    }

    /// The whole file in memory, with tensor data taken from `data[i]` (for tests and fixtures).
    pub fn to_bytes(&self, data: &[&[u8]]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.write(&mut out, |i, _, buf| {
            buf.extend_from_slice(data.get(i).copied().unwrap_or(&[]));
            Ok(())
        })?;
        Ok(out)
    }
}

fn pad(buf: &mut Vec<u8>, align: u64) {
    let n = (buf.len() as u64).div_ceil(align) * align;
    buf.resize(n as usize, 0);
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.push(*x as u8),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(*x as u8),
        Value::String(s) => put_str(buf, s),
        Value::Array(a) => put_array(buf, a),
    }
}

fn put_array(buf: &mut Vec<u8>, a: &Array) {
    buf.extend_from_slice(&(a.elem_type() as u32).to_le_bytes());
    buf.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                buf.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => buf.extend_from_slice(v),
        Array::I8(v) => buf.extend(v.iter().map(|&x| x as u8)),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Bool(v) => buf.extend(v.iter().map(|&x| x as u8)),
        Array::String(v) => v.iter().for_each(|s| put_str(buf, s)),
        Array::Array(v) => v.iter().for_each(|x| put_array(buf, x)),
    }
}
