//! The backend's configuration: every switch and tuning knob in one struct, built once (from
//! the environment with [`CudaConfig::from_env`], then adjusted by the caller) and handed to
//! [`CudaBackend::new`](crate::CudaBackend::new). Nothing else in the crate reads a
//! `QUIVER_CUDA_*` variable (`QUIVER_CUDA_LIB_DIR`, read where the libraries load, aside).

/// How a [`CudaBackend`](crate::CudaBackend) runs. [`Default`] is what runs when no variable is
/// set; [`CudaConfig::from_env`] reads the `QUIVER_CUDA_*` variables (docs/ENV.md) over it.
/// Switches that need something the machine lacks (cuBLAS, compute capability 9.0) are
/// turned off by `CudaBackend::new`, whose [`config`](crate::CudaBackend::config) says what is
/// in effect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// The parity mode (`QUIVER_CUDA_EXACT=1`, src/exact.rs): every op rounds as the CPU
    /// backend's batch-invariant path does; graphs off, no f16 weight copies, weight types
    /// without a parity product refused at load.
    pub exact: bool,
    /// Decode steps captured as CUDA graphs and replayed (`QUIVER_CUDA_GRAPHS=0`: off). Always
    /// off in the parity mode.
    pub graphs: bool,
    /// Load cuBLAS for the products of F16 weights and of f16 copies (`QUIVER_CUDA_CUBLAS=0`:
    /// never loaded, no f16 copies; every tensor-core product on the qmm kernel).
    pub cublas: bool,
    /// f16 copies of the quantized weights for cuBLAS, when there is room: opt-in
    /// (`QUIVER_CUDA_F16_COPIES=1`), 3–4× the weights' memory (BENCHMARKS.md has what they
    /// gain). Without them the tensor-core products read the GGUF blocks (kernels/qmm.cu).
    pub f16_copies: bool,
    /// Products over `gemm_min_tokens` or more tokens on the tensor cores
    /// (`QUIVER_CUDA_TENSOR_CORES=0`: every product on the matrix-vector kernels).
    pub tensor_cores: bool,
    /// Batch-invariant products (`QUIVER_CUDA_INVARIANT=1`): with the tensor cores on, every
    /// product runs on the qmm kernels (qmv for up to 8 tokens), which give a token the same
    /// bits whatever the batch. Off by default for now: qmv decodes at half the speed of the
    /// matrix-vector kernels (BENCHMARKS.md). Off, products of fewer than `gemm_min_tokens`
    /// tokens take the matrix-vector kernels and larger ones the tensor cores.
    pub invariant: bool,
    /// Products over at least this many tokens go to the tensor cores
    /// (`QUIVER_CUDA_GEMM_MIN_TOKENS`, at least 1); fewer run on the matrix-vector kernels.
    /// Default 9 ([`GEMM_MIN_TOKENS`]), or 3 with f16 copies ([`GEMM_MIN_TOKENS_COPIES`]).
    pub gemm_min_tokens: usize,
    /// Decode products of the quantized types on int8 activations (dp4a), as llama.cpp's and
    /// the CPU backend's (`QUIVER_CUDA_INT8=0`: f32 activations).
    pub int8: bool,
    /// Batch invariance for the int8 types (Q4_0, Q4_1, Q5_0, Q8_0, IQ4_NL, Q4_K, Q6_K;
    /// `registry::int8_mma`), on by default (`QUIVER_CUDA_INT8_MMA=0`: off): a step's decode
    /// rows take kernels that compute a token's products in one order whatever the token count
    /// (the exact-sum order, mmvq.cu `fix_of`: mmvqc*_T for up to 8 tokens, imm.cu's int8
    /// `mma` kernels imv_T / imm_T above), its prompt rows qmm unsplit; with the KV-group
    /// attention (`kvd`) a request's answer is the same alone and under any load. Its cost
    /// against off on the H200 (8B, sixteenth session, BENCHMARKS.md): Q4_K_M pp512 −2.8%,
    /// S_TG at 1 / 8 / 64 / 128 sequences −4.8% / −0.4% / −1.9% / −7.2%; Q4_0 and Q4_1 −23%
    /// to −29% at 64–128 sequences (a term per 32 values, against one per 256 for the
    /// K-quants). Turned off by `f16_copies` (cuBLAS). The other types' products are not batch
    /// invariant unless `invariant`.
    pub int8_mma: bool,
    /// Products of the int8 types (with `int8_mma` off: Q4_0, Q8_0, Q4_K and Q6_K,
    /// `registry::imv_default`) over `imv_tokens.0..=imv_tokens.1` tokens on the
    /// int8 tensor-core decode kernel (kernels/imm.cu `imv_T`, one launch per 8 tokens) rather
    /// than the dp4a matrix-vector kernels or qmm (`QUIVER_CUDA_IMV=MIN-MAX`, `0`: never).
    /// Default [`IMV_TOKENS`]. Without f16 copies only.
    pub imv_tokens: (usize, usize),
    /// The experts' products of MoE prompts on the tensor cores (`QUIVER_CUDA_MOE_QMM=0`: the
    /// CUDA-core grouped kernels): the (token, slot) pairs sorted by expert, each expert's rows
    /// one tile list of the qmm kernel (kernels/qmm.cu `qmm_g_T`). Qwen3-30B-A3B Q4_0 pp512
    /// 468 -> 14,132 t/s on the H200 (twelfth session, BENCHMARKS.md).
    pub moe_qmm: bool,
    /// The experts' products of MoE decode steps on int8 activations (kernels/mmvq.cu
    /// `moeq_*_T`, as the dense decode kernels; `QUIVER_CUDA_MOE_INT8=0`: f32 activations).
    /// Qwen3-30B-A3B Q4_0 tg128 159 -> 302 t/s (twelfth session).
    pub moe_int8: bool,
    /// qmm products whose tiles do not fill the GPU (batched decode: 9–128 tokens) split
    /// over the columns, the partials added by a second kernel (`QUIVER_CUDA_QMM_SPLIT=0`:
    /// one block per tile). Never in the batch-invariant mode.
    pub qmm_split: bool,
    /// The f16 activations of cuBLAS products rounded to the int8 grid of the weight's type
    /// first, as the CPU backend and the decode kernels see them (`QUIVER_CUDA_ACT_GRID=0`:
    /// plain f16).
    pub act_grid: bool,
    /// Prefill attention through the tensor-core flash kernel (`QUIVER_CUDA_FLASH=0`: the
    /// split-K kernel).
    pub flash: bool,
    /// Head dim 256 through the flash kernel too (`QUIVER_CUDA_FLASH_256=0` leaves it on
    /// split-K; 64 and 128 always take it when `flash` is on).
    pub flash_256: bool,
    /// Key ranges per (token, head) of the split-K attention when fixed (1 to 64; tests,
    /// batch-invariant runs); None: chosen by the step's shape. With a fixed count a token's
    /// ranges depend on its own keys only, so its result is the same whatever the batch around
    /// it (with the tensor cores and the flash kernel off, every op is then batch-invariant).
    /// No variable sets it.
    pub attention_splits: Option<usize>,
    /// Steps without flash tiles (decode), and a mixed step's decode rows, through the KV-group
    /// decode kernel (kvq.cu `kvd_attention`, launches of up to
    /// [`KVD_MAX_ROWS`](crate::kvq::KVD_MAX_ROWS) rows; `QUIVER_CUDA_KVD=0`: the split-K kernel
    /// per head): each block scores a KV group's query heads together, and a token's key ranges
    /// depend on its own key count only, whatever the step's rows. Off where `attention_splits`
    /// is fixed.
    pub kvd: bool,
    /// Kernels launched with programmatic dependent launch on sm_90+ (`QUIVER_CUDA_PDL=0`:
    /// off): a kernel's launch overlaps the previous one's tail.
    pub pdl: bool,
    /// Synchronize after every eager launch, so a failing kernel is named
    /// (`QUIVER_CUDA_SYNC=1`; debugging).
    pub sync_each: bool,
    /// Bytes of weights the caller will load: a progress bar on stderr while they do. No
    /// variable sets it.
    pub load_total: Option<u64>,
}

/// The cut-over to the tensor cores without f16 copies. A qmm launch costs about the same from
/// 2 to 16 tokens (its grid is the weight rows' tiles, split over the columns when they do not
/// fill the GPU); the matrix-vector kernels take 8 tokens per launch. On the H200, Qwen3-8B
/// Q4_K_M, S_TG at 2 / 4 / 8 / 16 sequences: matrix-vector 397 / 608 / 794 / 771 t/s, qmm
/// 191 / 377 / 742 / 1,423 (thirteenth session, BENCHMARKS.md): up to 8 tokens the
/// matrix-vector kernels, from 9 (where they would need a second launch) qmm.
pub const GEMM_MIN_TOKENS: usize = 9;
/// Token counts on imv by default. On the H200, 8B S_TG at 2 / 3 / 8 sequences, dp4a against
/// imv: Q4_K_M 423 / 478 / 829 against 360 / 493 / 1,117 t/s; Q4_0 467 / 501 / 851 against
/// 395 / 566 / 1,387; Q8_0 378 / 432 / 757 against 385 / 540 / 1,253. At 12 / 16 / 24 / 32,
/// qmm against imv: Q4_K_M 1,094 / 1,431 / 2,026 / 2,631 against 1,359 / 1,769 / 1,540 /
/// 2,010; Q4_0 1,310 / 1,719 / 2,395 / 3,092 against 1,347 / 1,755 / 1,892 / 2,451
/// (fourteenth session, BENCHMARKS.md): imv's 16-token form wins, a 32-token form (four n8 tiles) lost and is gone.
pub const IMV_TOKENS: (usize, usize) = (3, 16);
/// The cut-over with f16 copies (cuBLAS): from 3 tokens cuBLAS is faster (BENCHMARKS.md).
pub const GEMM_MIN_TOKENS_COPIES: usize = 3;

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            exact: false,
            graphs: true,
            cublas: true,
            f16_copies: false,
            tensor_cores: true,
            invariant: false,
            gemm_min_tokens: GEMM_MIN_TOKENS,
            int8: true,
            int8_mma: true,
            imv_tokens: IMV_TOKENS,
            moe_qmm: true,
            moe_int8: true,
            qmm_split: true,
            act_grid: true,
            flash: true,
            flash_256: true,
            attention_splits: None,
            kvd: true,
            pdl: true,
            sync_each: false,
            load_total: None,
        }
    }
}

/// `MIN-MAX` (or `N`: N..=N) as a token range; anything else (`0`) the empty range.
fn range(v: &str) -> (usize, usize) {
    let (a, b) = v.split_once('-').unwrap_or((v, v));
    match (a.trim().parse(), b.trim().parse()) {
        (Ok(a), Ok(b)) if a >= 1 && a <= b => (a, b),
        _ => (1, 0),
    }
}

impl CudaConfig {
    /// The defaults with the `QUIVER_CUDA_*` variables of the environment applied.
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The defaults with the variables `var` returns applied (`from_env` over a lookup).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let d = CudaConfig::default();
        // Switches that are on unless set to "0", off unless set to "1".
        let on = |name: &str| var(name).as_deref() != Some("0");
        let set = |name: &str| var(name).as_deref() == Some("1");
        let f16_copies = set("QUIVER_CUDA_F16_COPIES");
        let gemm_default = if f16_copies {
            GEMM_MIN_TOKENS_COPIES
        } else {
            d.gemm_min_tokens
        };
        CudaConfig {
            exact: set("QUIVER_CUDA_EXACT"),
            graphs: on("QUIVER_CUDA_GRAPHS"),
            cublas: on("QUIVER_CUDA_CUBLAS"),
            f16_copies,
            tensor_cores: on("QUIVER_CUDA_TENSOR_CORES"),
            invariant: set("QUIVER_CUDA_INVARIANT"),
            gemm_min_tokens: var("QUIVER_CUDA_GEMM_MIN_TOKENS")
                .and_then(|v| v.parse().ok())
                .unwrap_or(gemm_default)
                .max(1),
            int8: on("QUIVER_CUDA_INT8"),
            int8_mma: on("QUIVER_CUDA_INT8_MMA"),
            imv_tokens: var("QUIVER_CUDA_IMV").map_or(d.imv_tokens, |v| range(&v)),
            moe_qmm: on("QUIVER_CUDA_MOE_QMM"),
            moe_int8: on("QUIVER_CUDA_MOE_INT8"),
            qmm_split: on("QUIVER_CUDA_QMM_SPLIT"),
            act_grid: on("QUIVER_CUDA_ACT_GRID"),
            flash: on("QUIVER_CUDA_FLASH"),
            flash_256: on("QUIVER_CUDA_FLASH_256"),
            kvd: on("QUIVER_CUDA_KVD"),
            pdl: on("QUIVER_CUDA_PDL"),
            sync_each: set("QUIVER_CUDA_SYNC"),
            ..d
        }
    }

    /// Why serving a model whose products have weights of `types` (`experts`: and MoE
    /// experts) would not give each request the same answer alone and under any load, under
    /// this configuration (`None`: it would). Call it on the configuration in effect
    /// ([`CudaBackend::config`](crate::CudaBackend::config)). What the GPU tests show
    /// invariant: the parity mode, and the default path for the int8 types (`int8_mma`, with
    /// the KV-group attention or fixed key ranges).
    pub fn batch_variance(&self, types: &[quiver_gguf::GgmlType], experts: bool) -> Option<String> {
        if self.exact {
            return None;
        }
        if !self.int8_mma {
            return Some(if self.f16_copies {
                "f16 copies (QUIVER_CUDA_F16_COPIES=1): their cuBLAS products follow the batch"
                    .into()
            } else {
                "QUIVER_CUDA_INT8_MMA=0".into()
            });
        }
        if !self.tensor_cores {
            return Some("QUIVER_CUDA_TENSOR_CORES=0 (not the path the tests check)".into());
        }
        if !self.kvd && self.attention_splits.is_none() {
            return Some(
                "QUIVER_CUDA_KVD=0: the split-K attention's key ranges follow the step".into(),
            );
        }
        let mut other: Vec<String> = types
            .iter()
            .filter(|t| !crate::kernel_suffix(**t).is_some_and(crate::registry::int8_mma))
            .map(|t| t.to_string())
            .collect();
        other.sort();
        other.dedup();
        if !other.is_empty() && !self.invariant {
            return Some(format!(
                "{} weights have no exact-sum products (QUIVER_CUDA_INVARIANT=1 puts every product on qmv / qmm, at about half the decode speed)",
                other.join(", ")
            ));
        }
        if experts {
            return Some(
                "MoE experts: prompt rows take the grouped kernels, decode rows the per-pair ones"
                    .into(),
            );
        }
        None
    }

    /// The configuration in effect on a device of compute capability `arch` where cuBLAS did
    /// (`has_cublas`) or did not load: switches that need what is missing off (and batch
    /// invariance with f16 copies), the parity mode without graphs, counts in range.
    pub(crate) fn resolve(mut self, arch: u32, has_cublas: bool) -> Self {
        self.cublas = has_cublas;
        self.f16_copies &= has_cublas;
        // f16 copies are for speed: their cuBLAS products are not batch invariant.
        self.int8_mma &= !self.f16_copies;
        self.pdl &= arch >= 90;
        self.graphs &= !self.exact;
        self.gemm_min_tokens = self.gemm_min_tokens.max(1);
        self.attention_splits = self.attention_splits.map(|n| n.clamp(1, 64));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> CudaConfig {
        CudaConfig::from_vars(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn no_variables_give_the_defaults() {
        assert_eq!(with(&[]), CudaConfig::default());
        let d = CudaConfig::default();
        assert!(d.graphs && d.cublas && d.tensor_cores && d.int8 && !d.invariant && d.int8_mma);
        assert!(d.moe_qmm && d.moe_int8 && d.qmm_split);
        assert!(d.act_grid && d.flash && d.flash_256 && d.pdl);
        assert!(!d.exact && !d.sync_each && !d.f16_copies);
        assert_eq!((d.gemm_min_tokens, d.attention_splits), (9, None));
    }

    #[test]
    fn each_variable_sets_its_field_as_before() {
        for (name, field) in [
            (
                "QUIVER_CUDA_GRAPHS",
                (|c: &CudaConfig| c.graphs) as fn(&CudaConfig) -> bool,
            ),
            ("QUIVER_CUDA_CUBLAS", |c| c.cublas),
            ("QUIVER_CUDA_TENSOR_CORES", |c| c.tensor_cores),
            ("QUIVER_CUDA_INT8", |c| c.int8),
            ("QUIVER_CUDA_ACT_GRID", |c| c.act_grid),
            ("QUIVER_CUDA_FLASH", |c| c.flash),
            ("QUIVER_CUDA_FLASH_256", |c| c.flash_256),
            ("QUIVER_CUDA_PDL", |c| c.pdl),
            ("QUIVER_CUDA_MOE_QMM", |c| c.moe_qmm),
            ("QUIVER_CUDA_MOE_INT8", |c| c.moe_int8),
            ("QUIVER_CUDA_QMM_SPLIT", |c| c.qmm_split),
            ("QUIVER_CUDA_INT8_MMA", |c| c.int8_mma),
        ] {
            // On unless exactly "0".
            assert!(!field(&with(&[(name, "0")])), "{name}=0");
            for v in ["1", "", "no", "00"] {
                assert!(field(&with(&[(name, v)])), "{name}={v:?}");
            }
        }
        for (name, field) in [
            (
                "QUIVER_CUDA_EXACT",
                (|c: &CudaConfig| c.exact) as fn(&CudaConfig) -> bool,
            ),
            ("QUIVER_CUDA_SYNC", |c| c.sync_each),
            ("QUIVER_CUDA_F16_COPIES", |c| c.f16_copies),
            ("QUIVER_CUDA_INVARIANT", |c| c.invariant),
        ] {
            // Off unless exactly "1".
            assert!(field(&with(&[(name, "1")])), "{name}=1");
            for v in ["0", "", "yes", "true"] {
                assert!(!field(&with(&[(name, v)])), "{name}={v:?}");
            }
        }
        let g = |v: &str| with(&[("QUIVER_CUDA_GEMM_MIN_TOKENS", v)]).gemm_min_tokens;
        assert_eq!((g("8"), g("0"), g("x"), g("-2"), g("")), (8, 1, 9, 9, 9));
        // With f16 copies the default cut-over is cuBLAS's.
        let c = with(&[("QUIVER_CUDA_F16_COPIES", "1")]);
        assert_eq!(c.gemm_min_tokens, 3);
        let r = |v: &str| with(&[("QUIVER_CUDA_IMV", v)]).imv_tokens;
        assert_eq!((r("2-16"), r("3"), r(" 4 - 8 ")), ((2, 16), (3, 3), (4, 8)));
        for off in ["0", "", "x", "8-4", "0-8"] {
            assert_eq!(r(off), (1, 0), "{off:?}");
        }
        assert_eq!(with(&[]).imv_tokens, IMV_TOKENS);
    }

    #[test]
    fn batch_variance_names_what_breaks_it() {
        use quiver_gguf::GgmlType::*;
        let d = CudaConfig::default();
        assert_eq!(d.batch_variance(&[Q4_K, Q6_K, Q8_0], false), None);
        assert_eq!(d.batch_variance(&[Q4_1, Q5_0, IQ4_NL, Q4_0], false), None);
        let why = d.batch_variance(&[Q4_K, Q5_K, F16, Q5_K], false).unwrap();
        assert!(why.starts_with("F16, Q5_K weights"), "{why}");
        assert!(d.batch_variance(&[Q4_K], true).unwrap().contains("MoE"));
        let off = |c: CudaConfig| c.batch_variance(&[Q4_K], false).unwrap();
        assert!(off(CudaConfig {
            int8_mma: false,
            ..d.clone()
        })
        .contains("INT8_MMA=0"));
        let copies = CudaConfig {
            f16_copies: true,
            ..d.clone()
        }
        .resolve(90, true);
        assert!(off(copies).contains("f16 copies"));
        assert!(off(CudaConfig {
            kvd: false,
            ..d.clone()
        })
        .contains("KVD=0"));
        let fixed = CudaConfig {
            kvd: false,
            attention_splits: Some(4),
            ..d.clone()
        };
        assert_eq!(fixed.batch_variance(&[Q4_K], false), None);
        let exact = CudaConfig {
            exact: true,
            int8_mma: false,
            ..d.clone()
        };
        assert_eq!(exact.batch_variance(&[Q5_K], true), None);
    }

    #[test]
    fn resolving_turns_off_what_the_machine_lacks() {
        let c = CudaConfig {
            exact: true,
            attention_splits: Some(100),
            gemm_min_tokens: 0,
            ..CudaConfig::default()
        }
        .resolve(80, false);
        // The tensor cores need no cuBLAS (the qmm kernel); the copies do.
        assert!(!c.cublas && c.tensor_cores && !c.f16_copies && !c.pdl && !c.graphs);
        assert_eq!((c.attention_splits, c.gemm_min_tokens), (Some(64), 1));
        let c = CudaConfig {
            attention_splits: Some(0),
            f16_copies: true,
            ..CudaConfig::default()
        }
        .resolve(90, true);
        assert!(c.cublas && c.tensor_cores && c.f16_copies && c.pdl && c.graphs);
        assert_eq!(c.attention_splits, Some(1));
        // Copies give up batch invariance (cuBLAS); without cuBLAS there are none to take it.
        assert!(!c.int8_mma);
        let c = CudaConfig {
            f16_copies: true,
            ..CudaConfig::default()
        }
        .resolve(90, false);
        assert!(c.int8_mma && !c.f16_copies);
    }
}
