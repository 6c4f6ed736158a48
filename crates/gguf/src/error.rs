use crate::GgmlType;

/// Everything that can go wrong reading or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The message names the path and the cause (so the cause is not also a `source`, which
    /// error chains would print twice).
    #[error("{path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error("not a GGUF file (magic bytes {0:02x?}, expected \"GGUF\")")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("big-endian GGUF files are not supported")]
    BigEndian,
    #[error("file truncated: need {need} bytes at offset {offset} for {what}, file has {len}")]
    Truncated {
        what: String,
        offset: u64,
        need: u64,
        len: u64,
    },
    #[error("{what}: count {count} is impossible, the rest of the file ({remaining} bytes) cannot hold it")]
    CountTooLarge {
        what: String,
        count: u64,
        remaining: u64,
    },
    #[error("metadata key {key:?}: unknown value type id {id}")]
    UnknownValueType { key: String, id: u32 },
    #[error("metadata key {key:?}: arrays nested deeper than {max} levels")]
    NestingTooDeep { key: String, max: usize },
    #[error("{what}: string is not valid UTF-8")]
    BadUtf8 { what: String },
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        key: String,
        found: String,
        expected: String,
    },
    #[error("metadata key {key:?}: value {value} is out of range")]
    OutOfRange { key: String, value: String },
    #[error("missing metadata key {0:?}")]
    MissingKey(String),
    #[error("general.alignment = {0} is not a non-zero power of two")]
    BadAlignment(u64),
    #[error("tensor {name:?}: unknown tensor type id {id}")]
    UnknownTensorType { name: String, id: u32 },
    #[error("tensor {name:?}: {n_dims} dimensions (at most {max} allowed)")]
    TooManyDims {
        name: String,
        n_dims: u32,
        max: usize,
    },
    #[error("tensor {name:?}: bad shape {dims:?}: {why}")]
    BadShape {
        name: String,
        dims: Vec<u64>,
        why: String,
    },
    #[error(
        "tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensor {name:?}: data [{start}, {end}) lies outside the data section of {len} bytes")]
    TensorOutOfBounds {
        name: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("tensors {a:?} and {b:?} overlap")]
    TensorsOverlap { a: String, b: String },
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("tensor {name:?} not found")]
    MissingTensor { name: String },
    #[error("tensor {name:?}: {detail}")]
    TensorData { name: String, detail: String },
    #[error("tensor {name:?}: {ty} data is {got} bytes, expected {expected}")]
    WrongDataSize {
        name: String,
        ty: GgmlType,
        got: u64,
        expected: u64,
    },
}

impl GgufError {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        GgufError::Io {
            path: path.display().to_string(),
            error: source,
        }
    }
}
