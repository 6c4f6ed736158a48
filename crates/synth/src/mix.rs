//! File types ("ftypes") and the per-tensor type choice llama.cpp's quantizer makes for them,
//! so that `quiver synth --type Q4_K_M` writes the same mix of tensor types as
//! `llama-quantize ... Q4_K_M` would.

use quiver_gguf::GgmlType;

/// A whole-file quantization recipe, with llama.cpp's `general.file_type` number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K_S,
    Q3_K_M,
    Q3_K_L,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
}

const FTYPES: &[(FileType, &str, u32, GgmlType)] = &[
    (FileType::F32, "F32", 0, GgmlType::F32),
    (FileType::F16, "F16", 1, GgmlType::F16),
    (FileType::BF16, "BF16", 32, GgmlType::BF16),
    (FileType::Q4_0, "Q4_0", 2, GgmlType::Q4_0),
    (FileType::Q4_1, "Q4_1", 3, GgmlType::Q4_1),
    (FileType::Q5_0, "Q5_0", 8, GgmlType::Q5_0),
    (FileType::Q5_1, "Q5_1", 9, GgmlType::Q5_1),
    (FileType::Q8_0, "Q8_0", 7, GgmlType::Q8_0),
    (FileType::Q2_K, "Q2_K", 10, GgmlType::Q2_K),
    (FileType::Q3_K_S, "Q3_K_S", 11, GgmlType::Q3_K),
    (FileType::Q3_K_M, "Q3_K_M", 12, GgmlType::Q3_K),
    (FileType::Q3_K_L, "Q3_K_L", 13, GgmlType::Q3_K),
    (FileType::Q4_K_S, "Q4_K_S", 14, GgmlType::Q4_K),
    (FileType::Q4_K_M, "Q4_K_M", 15, GgmlType::Q4_K),
    (FileType::Q5_K_S, "Q5_K_S", 16, GgmlType::Q5_K),
    (FileType::Q5_K_M, "Q5_K_M", 17, GgmlType::Q5_K),
    (FileType::Q6_K, "Q6_K", 18, GgmlType::Q6_K),
    (FileType::IQ4_NL, "IQ4_NL", 25, GgmlType::IQ4_NL),
    (FileType::IQ4_XS, "IQ4_XS", 30, GgmlType::IQ4_XS),
];

impl FileType {
    fn row(self) -> &'static (FileType, &'static str, u32, GgmlType) {
        FTYPES
            .iter()
            .find(|r| r.0 == self)
            .expect("every FileType is listed")
    }
    pub fn parse(s: &str) -> Option<FileType> {
        FTYPES
            .iter()
            .find(|r| r.1.eq_ignore_ascii_case(s))
            .map(|r| r.0)
    }
    pub fn names() -> Vec<&'static str> {
        FTYPES.iter().map(|r| r.1).collect()
    }
    pub fn name(self) -> &'static str {
        self.row().1
    }
    /// llama.cpp's `general.file_type` value.
    pub fn id(self) -> u32 {
        self.row().2
    }
    /// The type most weight matrices get.
    pub fn default_type(self) -> GgmlType {
        self.row().3
    }
}

/// What a tensor is, as far as the type choice cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    TokenEmbd,
    Output,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    FfnGate,
    FfnUp,
    FfnDown,
    /// A fused q/k/v matrix (Phi-3).
    AttnQkv,
    /// A mixture-of-experts router: never quantized (llama.cpp keeps it as converted).
    Router,
    /// Norms, biases and other vectors: never quantized.
    Vector,
}

/// Tracks the per-role counters llama.cpp's choice depends on (the layer index of each
/// attn_v / ffn_down seen so far).
pub struct Chooser {
    ftype: FileType,
    n_layer: usize,
    n_gqa: usize,
    tied: bool,
    i_attn_v: usize,
    i_ffn_down: usize,
}

fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as isize - (n / 8) as isize).rem_euclid(3) == 2
}

/// A 256-block type whose row length does not divide falls back to a 32-block type, and to F16
/// when even that does not divide.
fn fallback(ty: GgmlType, ncols: u64) -> GgmlType {
    if ncols.is_multiple_of(ty.block_size() as u64) {
        return ty;
    }
    let f = match ty {
        GgmlType::IQ4_XS => GgmlType::IQ4_NL,
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        other => other,
    };
    if ncols.is_multiple_of(f.block_size() as u64) {
        f
    } else {
        GgmlType::F16
    }
}

impl Chooser {
    pub fn new(
        ftype: FileType,
        n_layer: usize,
        n_head: usize,
        n_head_kv: usize,
        tied: bool,
    ) -> Self {
        Chooser {
            ftype,
            n_layer,
            n_gqa: n_head / n_head_kv.max(1),
            tied,
            i_attn_v: 0,
            i_ffn_down: 0,
        }
    }

    /// The type of the next tensor of `role` with `ncols` columns. Call in file order.
    pub fn choose(&mut self, role: Role, ncols: u64) -> GgmlType {
        use FileType as F;
        use GgmlType as T;
        let def = self.ftype.default_type();
        if role == Role::Vector || role == Role::Router {
            return T::F32;
        }
        if !def.is_quantized() {
            return def;
        }
        let n = self.n_layer;
        let ft = self.ftype;
        let ty = match role {
            Role::Output | Role::TokenEmbd if role == Role::Output || self.tied => {
                if !ncols.is_multiple_of(def.block_size() as u64) {
                    T::Q8_0
                } else if def != T::Q8_0 {
                    T::Q6_K
                } else {
                    def
                }
            }
            Role::AttnV => {
                let i = self.i_attn_v;
                self.i_attn_v += 1;
                match ft {
                    F::Q2_K => {
                        if self.n_gqa >= 4 {
                            T::Q4_K
                        } else {
                            T::Q3_K
                        }
                    }
                    F::Q3_K_M => {
                        if i < 2 {
                            T::Q5_K
                        } else {
                            T::Q4_K
                        }
                    }
                    F::Q3_K_L => T::Q5_K,
                    F::IQ4_NL | F::IQ4_XS if self.n_gqa >= 4 => T::Q5_K,
                    F::Q4_K_M | F::Q5_K_M if use_more_bits(i, n) => T::Q6_K,
                    F::Q4_K_S if i < 4 => T::Q5_K,
                    _ => def,
                }
            }
            Role::FfnDown => {
                let i = self.i_ffn_down;
                self.i_ffn_down += 1;
                match ft {
                    F::Q2_K => T::Q3_K,
                    F::Q3_K_M => {
                        if i < n / 16 {
                            T::Q5_K
                        } else {
                            T::Q4_K
                        }
                    }
                    F::Q3_K_L => T::Q5_K,
                    F::Q4_K_M if use_more_bits(i, n) => T::Q6_K,
                    F::IQ4_NL | F::IQ4_XS if i < n / 8 => T::Q5_K,
                    F::Q5_K_M if use_more_bits(i, n) => T::Q6_K,
                    F::Q4_K_S if i < n / 8 => T::Q5_K,
                    _ => def,
                }
            }
            Role::AttnQkv => match ft {
                F::Q3_K_M | F::Q3_K_L => T::Q4_K,
                F::Q4_K_M => T::Q5_K,
                F::Q5_K_M => T::Q6_K,
                _ => def,
            },
            Role::AttnOutput => match ft {
                F::Q2_K => T::Q3_K,
                F::Q3_K_M => T::Q4_K,
                F::Q3_K_L => T::Q5_K,
                _ => def,
            },
            _ => def,
        };
        fallback(ty, ncols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_layers_match_llama_cpp_for_30_layers() {
        let picked: Vec<usize> = (0..30).filter(|&i| use_more_bits(i, 30)).collect();
        // n/8 = 3: layers 0..3, 26..30, and every third from 3 + 2.
        assert_eq!(
            picked,
            vec![0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
        );
    }

    #[test]
    fn gemma3_270m_q4_k_m_mix_matches_the_real_file() {
        // The real gemma-3-270m Q4_K_M: 18 layers, n_embd 640 (not a multiple of 256).
        let mut c = Chooser::new(FileType::Q4_K_M, 18, 4, 1, true);
        assert_eq!(c.choose(Role::TokenEmbd, 640), GgmlType::Q8_0);
        let mut v = Vec::new();
        let mut down = Vec::new();
        for _ in 0..18 {
            assert_eq!(c.choose(Role::AttnQ, 640), GgmlType::Q5_0);
            v.push(c.choose(Role::AttnV, 640));
            assert_eq!(c.choose(Role::AttnOutput, 1024), GgmlType::Q4_K);
            assert_eq!(c.choose(Role::FfnUp, 640), GgmlType::Q5_0);
            down.push(c.choose(Role::FfnDown, 2048));
        }
        assert_eq!(v.iter().filter(|&&t| t == GgmlType::Q8_0).count(), 9);
        assert_eq!(v.iter().filter(|&&t| t == GgmlType::Q5_0).count(), 9);
        assert_eq!(down.iter().filter(|&&t| t == GgmlType::Q6_K).count(), 9);
        assert_eq!(down.iter().filter(|&&t| t == GgmlType::Q4_K).count(), 9);
    }

    #[test]
    fn llama3_8b_q4_k_m_output_is_q6_k_and_untied_embedding_is_q4_k() {
        let mut c = Chooser::new(FileType::Q4_K_M, 32, 32, 8, false);
        assert_eq!(c.choose(Role::TokenEmbd, 4096), GgmlType::Q4_K);
        assert_eq!(c.choose(Role::Output, 4096), GgmlType::Q6_K);
        assert_eq!(c.choose(Role::Vector, 4096), GgmlType::F32);
        let mut c = Chooser::new(FileType::Q8_0, 32, 32, 8, false);
        assert_eq!(c.choose(Role::Output, 4096), GgmlType::Q8_0);
        let mut c = Chooser::new(FileType::F16, 32, 32, 8, false);
        assert_eq!(c.choose(Role::Output, 4096), GgmlType::F16);
    }
}
