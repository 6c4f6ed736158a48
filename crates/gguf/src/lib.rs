//! GGUF files: strict reader over mmap, typed metadata getters, and a streaming writer.
//!
//! Shapes are row-major `[.., rows, cols]` everywhere in quiver. GGUF stores dimensions in
//! ggml's `ne` order (innermost first); [`ne_to_shape`] is the one place that converts.

mod error;
#[doc(hidden)]
pub mod malformed;
mod reader;
mod types;
pub mod value;
mod writer;

pub use error::GgufError;
pub use types::GgmlType;
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, TensorSpec};

use indexmap::IndexMap;
use std::path::Path;

pub type Result<T> = std::result::Result<T, GgufError>;

/// Alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of metadata arrays accepted.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Converts ggml `ne` order (innermost dimension first) to a row-major shape, and back
/// (the conversion is its own inverse).
pub fn ne_to_shape(ne: &[u64]) -> Vec<u64> {
    ne.iter().rev().copied().collect()
}

/// One tensor's description.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// Row-major shape: the last entry is the contiguous dimension.
    pub shape: Vec<u64>,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Builds and validates a tensor info from ggml `ne` dimensions.
    pub fn from_ne(name: String, ty: GgmlType, ne: &[u64], offset: u64) -> Result<TensorInfo> {
        let bad = |why: String| GgufError::BadShape {
            name: name.clone(),
            dims: ne.to_vec(),
            why,
        };
        let mut n_elements: u64 = 1;
        for &d in ne {
            // ggml keeps dimensions in int64_t.
            if d > i64::MAX as u64 {
                return Err(bad(format!("dimension {d} exceeds i64")));
            }
            n_elements = n_elements
                .checked_mul(d)
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| bad("element count overflows".into()))?;
        }
        let row = ne.first().copied().unwrap_or(1);
        let row_bytes = ty.row_bytes(row).ok_or_else(|| {
            bad(format!(
                "row length {row} is not a multiple of the {ty} block size {}",
                ty.block_size()
            ))
        })?;
        let n_rows = n_elements.checked_div(row).unwrap_or(0);
        let n_bytes = row_bytes
            .checked_mul(n_rows)
            .ok_or_else(|| bad("byte size overflows".into()))?;
        Ok(TensorInfo {
            name,
            ty,
            shape: ne_to_shape(ne),
            offset,
            n_elements,
            n_bytes,
        })
    }

    /// Dimensions in ggml `ne` order.
    pub fn ne(&self) -> Vec<u64> {
        ne_to_shape(&self.shape)
    }

    /// Length of the contiguous (last) dimension.
    pub fn cols(&self) -> u64 {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Product of all dimensions but the last.
    pub fn rows(&self) -> u64 {
        if self.cols() == 0 {
            0
        } else {
            self.n_elements / self.cols()
        }
    }
}

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
    /// Another file's bytes ([`GgufFile::view`]).
    Shared(std::sync::Arc<GgufFile>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
            Storage::Shared(f) => f.storage.bytes(),
        }
    }
}

/// An open, validated GGUF file. Tensor data is borrowed from the mapping, never copied.
pub struct GgufFile {
    storage: Storage,
    pub version: u32,
    pub metadata: IndexMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute file offset of the first tensor info (the end of the metadata).
    pub infos_offset: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    index: std::collections::HashMap<String, usize>,
}

impl GgufFile {
    /// Maps and parses a file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| GgufError::io(path, e))?;
        let meta = file.metadata().map_err(|e| GgufError::io(path, e))?;
        if meta.is_dir() {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "is a directory");
            return Err(GgufError::io(path, e));
        }
        if meta.len() == 0 {
            return Self::from_bytes(Vec::new());
        }
        // SAFETY: the mapping is read-only; quiver never writes model files while they are open.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| GgufError::io(path, e))?;
        Self::from_storage(Storage::Mmap(map))
    }

    /// Tells the OS that this process will not read `bytes` (part of this file's image) again
    /// soon: where the file is mapped, their pages leave the process's resident set (the page
    /// cache keeps them, and a later read faults them back in; pages they share with other
    /// bytes too). Nothing for a file held in memory. The CPU backend calls it for the weights
    /// it copies, whose mapped pages would otherwise count twice.
    pub fn release(&self, bytes: &[u8]) {
        match &self.storage {
            Storage::Mmap(m) => {
                let off = (bytes.as_ptr() as usize).wrapping_sub(m.as_ptr() as usize);
                if off.saturating_add(bytes.len()) <= m.len() && !bytes.is_empty() {
                    // SAFETY: the mapping is read-only and file-backed: dropped pages refault
                    // with the file's bytes (quiver never writes a model file while it is
                    // open, as the mapping itself assumes); failure leaves them resident.
                    let _ = unsafe {
                        m.unchecked_advise_range(
                            memmap2::UncheckedAdvice::DontNeed,
                            off,
                            bytes.len(),
                        )
                    };
                }
            }
            Storage::Owned(_) => {}
            Storage::Shared(f) => f.release(bytes),
        }
    }

    /// Parses a file image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::from_storage(Storage::Owned(bytes))
    }

    /// Parses and validates a file image without keeping it (for checks and fuzzing).
    pub fn validate(bytes: &[u8]) -> Result<()> {
        reader::parse(bytes).map(|_| ())
    }

    fn from_storage(storage: Storage) -> Result<GgufFile> {
        let h = reader::parse(storage.bytes())?;
        let index = h
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            storage,
            version: h.version,
            metadata: h.metadata,
            tensors: h.tensors,
            alignment: h.alignment,
            infos_offset: h.infos_offset,
            data_offset: h.data_offset,
            index,
        })
    }

    /// The same bytes under other metadata and tensor names, without a copy: each tensor for
    /// which `rename` gives a name is kept under it (a name given twice keeps the later
    /// tensor). A model part a file carries beside its main model (a multi-token-prediction
    /// block) loads from such a view as a model of its own.
    pub fn view(
        self: &std::sync::Arc<Self>,
        metadata: IndexMap<String, Value>,
        rename: impl Fn(&str) -> Option<String>,
    ) -> GgufFile {
        let mut tensors: Vec<TensorInfo> = Vec::new();
        let mut index = std::collections::HashMap::new();
        for t in &self.tensors {
            let Some(name) = rename(&t.name) else {
                continue;
            };
            let info = TensorInfo {
                name: name.clone(),
                ..t.clone()
            };
            match index.get(&name) {
                Some(&i) => tensors[i] = info,
                None => {
                    index.insert(name, tensors.len());
                    tensors.push(info);
                }
            }
        }
        GgufFile {
            storage: Storage::Shared(self.clone()),
            version: self.version,
            metadata,
            tensors,
            alignment: self.alignment,
            infos_offset: self.infos_offset,
            data_offset: self.data_offset,
            index,
        }
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor (validated to lie inside the file at open).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + t.offset) as usize;
        &self.storage.bytes()[start..start + t.n_bytes as usize]
    }

    /// Looks up a tensor by name and returns its info and bytes.
    pub fn tensor_bytes(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let t = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor { name: name.into() })?;
        Ok((t, self.tensor_data(t)))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// `general.architecture`.
    pub fn arch(&self) -> Result<&str> {
        self.get_str("general.architecture")?
            .ok_or_else(|| GgufError::MissingKey("general.architecture".into()))
    }

    fn wrong(&self, key: &str, v: &Value, expected: &str) -> GgufError {
        GgufError::WrongType {
            key: key.into(),
            found: v.value_type().name().into(),
            expected: expected.into(),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.wrong(key, v, "string")),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.wrong(key, v, "bool")),
        }
    }

    /// An integer key of any integer type that fits in u64.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let i = v.as_i128().ok_or_else(|| self.wrong(key, v, "integer"))?;
                u64::try_from(i)
                    .map(Some)
                    .map_err(|_| GgufError::OutOfRange {
                        key: key.into(),
                        value: i.to_string(),
                    })
            }
        }
    }

    /// An integer key that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.get_u64(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v)
                .map(Some)
                .map_err(|_| GgufError::OutOfRange {
                    key: key.into(),
                    value: v.to_string(),
                }),
        }
    }

    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|f| Some(f as f32))
                .ok_or_else(|| self.wrong(key, v, "float")),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<Option<&Array>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_array()
                .map(Some)
                .ok_or_else(|| self.wrong(key, v, "array")),
        }
    }

    /// Hyperparameters of the file's architecture: `hparams().u32("block_count")` reads
    /// `{arch}.block_count`.
    pub fn hparams(&self) -> Result<HParams<'_>> {
        Ok(HParams {
            file: self,
            arch: self.arch()?.to_string(),
        })
    }
}

/// Typed access to `{arch}.*` keys.
pub struct HParams<'a> {
    file: &'a GgufFile,
    pub arch: String,
}

impl HParams<'_> {
    pub fn key(&self, name: &str) -> String {
        format!("{}.{}", self.arch, name)
    }

    pub fn u32(&self, name: &str) -> Result<Option<u32>> {
        self.file.get_u32(&self.key(name))
    }

    pub fn u64(&self, name: &str) -> Result<Option<u64>> {
        self.file.get_u64(&self.key(name))
    }

    pub fn f32(&self, name: &str) -> Result<Option<f32>> {
        self.file.get_f32(&self.key(name))
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>> {
        self.file.get_bool(&self.key(name))
    }

    pub fn str(&self, name: &str) -> Result<Option<&str>> {
        self.file.get_str(&self.key(name))
    }

    pub fn array(&self, name: &str) -> Result<Option<&Array>> {
        self.file.get_array(&self.key(name))
    }

    /// A required u32 key.
    pub fn req_u32(&self, name: &str) -> Result<u32> {
        self.u32(name)?
            .ok_or_else(|| GgufError::MissingKey(self.key(name)))
    }

    /// A required f32 key.
    pub fn req_f32(&self, name: &str) -> Result<f32> {
        self.f32(name)?
            .ok_or_else(|| GgufError::MissingKey(self.key(name)))
    }
}
