//! The paged KV cache's shape: element types, layers, bytes.

/// Tokens per block of the paged KV pool.
pub const KV_BLOCK_SIZE: usize = 16;

/// How K or V values are stored in the cache (layouts in [`crate::kvcodec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvType {
    /// IEEE half precision (llama.cpp's default).
    F16,
    /// bfloat16.
    Bf16,
    /// ggml's q8_0 blocks (llama.cpp's `-ctk q8_0`).
    Q8_0,
    /// TurboQuant, 8 bits (docs/TURBOQUANT.md).
    Tq8,
    /// TurboQuant, 4 bits; as keys, 4-bit codes between each channel's minimum and maximum
    /// over a 16-slot block (`crate::kblock`).
    Tq4,
}

/// The element types of K and of V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvTypes {
    pub k: KvType,
    pub v: KvType,
}

impl Default for KvTypes {
    fn default() -> Self {
        KvTypes {
            k: KvType::F16,
            v: KvType::F16,
        }
    }
}

impl std::fmt::Display for KvTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.k == self.v {
            write!(f, "{}", self.k.name())
        } else {
            write!(f, "K {}, V {}", self.k.name(), self.v.name())
        }
    }
}

/// One layer's KV shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayer {
    pub n_head_kv: usize,
    pub head_dim: usize,
}

impl KvLayer {
    /// `n_head_kv * head_dim`.
    pub fn dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

/// The KV cache a model asks of a backend: element types, the paged pool's size and each
/// layer's shape. Bytes follow from it, before anything is allocated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSpec {
    pub k: KvType,
    pub v: KvType,
    /// Tokens per block of the paged pool.
    pub block_size: usize,
    /// Positions in the pool (a whole number of blocks).
    pub n_slots: usize,
    /// Each cache layer's heads and head dim.
    pub layers: Vec<KvLayer>,
}

impl KvSpec {
    /// Bytes one position takes over every layer, K and V (tq4 keys: with their share of the
    /// exact keys kept, `crate::kblock::ExactKeys::bytes_per_slot`).
    pub fn bytes_per_token(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| {
                let exact = if self.k.key_blocks() {
                    crate::kblock::ExactKeys::bytes_per_slot(l.dim())
                } else {
                    0
                };
                self.k.key_row_bytes(l.n_head_kv, l.head_dim)
                    + exact
                    + self.v.row_bytes(l.n_head_kv, l.head_dim)
            })
            .sum()
    }

    /// Bytes of the whole cache.
    pub fn bytes(&self) -> u64 {
        self.bytes_per_token().saturating_mul(self.n_slots as u64)
    }

    /// Whether both types can store every layer's heads; else which layer cannot, and why.
    pub fn check(&self) -> std::result::Result<(), String> {
        let bs = crate::kblock::SLOTS;
        if self.k.key_blocks() && self.block_size != bs {
            return Err(format!(
                "tq4 keys need KV blocks of {bs} slots, not {}",
                self.block_size
            ));
        }
        if self.k.key_blocks() && !self.n_slots.is_multiple_of(bs) {
            return Err(format!(
                "tq4 keys need a whole number of {bs}-slot blocks, not {} slots",
                self.n_slots
            ));
        }
        for (i, l) in self.layers.iter().enumerate() {
            for t in [self.k, self.v] {
                t.check(l.head_dim)
                    .map_err(|e| format!("KV cache layer {i}: {e}"))?;
            }
        }
        Ok(())
    }
}
