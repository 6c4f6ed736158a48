//! Strict GGUF parsing. Every count, length and offset is checked against the bytes that are
//! actually there before it is used, so a hostile file gives an error, never a panic or an
//! allocation the file cannot justify.

use crate::value::{Array, Value, ValueType};
use crate::{GgmlType, GgufError, TensorInfo, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS};
use indexmap::IndexMap;

type Result<T> = std::result::Result<T, GgufError>;

/// Most entries reserved ahead from a count in the file: past it, collections grow as their
/// entries are read (each backed by bytes of the file), never from the count alone (an entry
/// takes several times the bytes in memory it takes in the file).
const RESERVE: usize = 4096;

/// The parsed header of a GGUF file: everything but the tensor data.
pub(crate) struct Header {
    pub version: u32,
    pub metadata: IndexMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute file offset of the first tensor info.
    pub infos_offset: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                need: n,
                len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Checks that `count` items of at least `min_bytes` each can fit in the rest of the file.
    fn check_count(&self, count: u64, min_bytes: u64, what: &dyn Fn() -> String) -> Result<()> {
        if count.saturating_mul(min_bytes) > self.remaining() {
            return Err(GgufError::CountTooLarge {
                what: what(),
                count,
                remaining: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 { what: what() })
    }
}

/// Parses header, metadata and tensor infos of a complete file image and validates the tensor
/// data ranges against the file length.
pub(crate) fn parse(buf: &[u8]) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array(&|| "magic".into())?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32(&|| "version".into())?;
    if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
        return Err(GgufError::BigEndian);
    }
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata count".into())?;
    // key length + type + smallest value
    c.check_count(n_kv, 8 + 4 + 1, &|| "metadata count".into())?;
    let mut metadata = IndexMap::with_capacity((n_kv as usize).min(RESERVE));
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let ty = c.u32(&|| format!("type of metadata key {key:?}"))?;
        let ty = ValueType::from_id(ty).ok_or_else(|| GgufError::UnknownValueType {
            key: key.clone(),
            id: ty,
        })?;
        let value = read_value(&mut c, ty, &key, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => {
            let a = v.as_i128().ok_or_else(|| GgufError::WrongType {
                key: "general.alignment".into(),
                found: v.value_type().name().into(),
                expected: "an integer".into(),
            })?;
            if a <= 0 || a > u32::MAX as i128 || (a as u64).count_ones() != 1 {
                return Err(GgufError::BadAlignment(a.clamp(0, u64::MAX as i128) as u64));
            }
            a as u64
        }
    };

    // name length + n_dims + type + offset
    let infos_offset = c.pos as u64;
    c.check_count(n_tensors, 8 + 4 + 4 + 8, &|| "tensor count".into())?;
    let mut tensors = Vec::with_capacity((n_tensors as usize).min(RESERVE));
    let mut names = std::collections::HashSet::with_capacity((n_tensors as usize).min(RESERVE));
    for i in 0..n_tensors {
        let name = c.string(&|| format!("name of tensor #{i}"))?;
        let n_dims = c.u32(&|| format!("dimension count of tensor {name:?}"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(c.u64(&|| format!("dimensions of tensor {name:?}"))?);
        }
        let type_id = c.u32(&|| format!("type of tensor {name:?}"))?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
            name: name.clone(),
            id: type_id,
        })?;
        let offset = c.u64(&|| format!("data offset of tensor {name:?}"))?;
        if !names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor(name));
        }
        let info = TensorInfo::from_ne(name, ty, &ne, offset)?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                name: info.name,
                offset,
                alignment,
            });
        }
        tensors.push(info);
    }

    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (buf.len() as u64).saturating_sub(data_offset);
    check_ranges(&tensors, data_len)?;
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        infos_offset,
        data_offset,
    })
}

/// Every tensor lies inside the data section and no two overlap.
fn check_ranges(tensors: &[TensorInfo], data_len: u64) -> Result<()> {
    for t in tensors {
        let end = t.offset.checked_add(t.n_bytes).filter(|&e| e <= data_len);
        if end.is_none() {
            return Err(GgufError::TensorOutOfBounds {
                name: t.name.clone(),
                start: t.offset,
                end: t.offset.saturating_add(t.n_bytes),
                len: data_len,
            });
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        if w[0].offset + w[0].n_bytes > w[1].offset {
            return Err(GgufError::TensorsOverlap {
                a: w[0].name.clone(),
                b: w[1].name.clone(),
            });
        }
    }
    Ok(())
}

fn read_value(c: &mut Cursor, ty: ValueType, key: &str, depth: usize) -> Result<Value> {
    let what = || format!("value of metadata key {key:?}");
    Ok(match ty {
        ValueType::U8 => Value::U8(c.array::<1>(&what)?[0]),
        ValueType::I8 => Value::I8(c.array::<1>(&what)?[0] as i8),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array(&what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array(&what)?)),
        ValueType::U32 => Value::U32(u32::from_le_bytes(c.array(&what)?)),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array(&what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array(&what)?)),
        ValueType::U64 => Value::U64(u64::from_le_bytes(c.array(&what)?)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array(&what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array(&what)?)),
        ValueType::Bool => Value::Bool(read_bool(c, key)?),
        ValueType::String => Value::String(c.string(&what)?),
        ValueType::Array => Value::Array(read_array(c, key, depth)?),
    })
}

/// `n` items read one by one, the vector growing as they come ([`RESERVE`]).
fn read_n<T>(n: usize, mut one: impl FnMut() -> Result<T>) -> Result<Vec<T>> {
    let mut v = Vec::with_capacity(n.min(RESERVE));
    for _ in 0..n {
        v.push(one()?);
    }
    Ok(v)
}

fn read_bool(c: &mut Cursor, key: &str) -> Result<bool> {
    match c.array::<1>(&|| format!("value of metadata key {key:?}"))?[0] {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(GgufError::OutOfRange {
            key: key.into(),
            value: format!("bool byte {b}"),
        }),
    }
}

fn read_array(c: &mut Cursor, key: &str, depth: usize) -> Result<Array> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            key: key.into(),
            max: MAX_ARRAY_DEPTH,
        });
    }
    let what = || format!("array of metadata key {key:?}");
    let ty = c.u32(&what)?;
    let ty = ValueType::from_id(ty).ok_or_else(|| GgufError::UnknownValueType {
        key: key.into(),
        id: ty,
    })?;
    let n = c.u64(&what)?;
    c.check_count(n, ty.min_bytes(), &what)?;
    let n = n as usize;
    macro_rules! fixed {
        ($variant:ident, $t:ty) => {{
            const W: usize = std::mem::size_of::<$t>();
            let bytes = c.take((n * W) as u64, &what)?;
            Array::$variant(
                bytes
                    .chunks_exact(W)
                    .map(|b| <$t>::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
            )
        }};
    }
    Ok(match ty {
        ValueType::U8 => Array::U8(c.take(n as u64, &what)?.to_vec()),
        ValueType::I8 => Array::I8(c.take(n as u64, &what)?.iter().map(|&b| b as i8).collect()),
        ValueType::U16 => fixed!(U16, u16),
        ValueType::I16 => fixed!(I16, i16),
        ValueType::U32 => fixed!(U32, u32),
        ValueType::I32 => fixed!(I32, i32),
        ValueType::F32 => fixed!(F32, f32),
        ValueType::U64 => fixed!(U64, u64),
        ValueType::I64 => fixed!(I64, i64),
        ValueType::F64 => fixed!(F64, f64),
        ValueType::Bool => Array::Bool(read_n(n, || read_bool(c, key))?),
        ValueType::String => Array::String(read_n(n, || c.string(&what))?),
        ValueType::Array => Array::Array(read_n(n, || read_array(c, key, depth + 1))?),
    })
}
