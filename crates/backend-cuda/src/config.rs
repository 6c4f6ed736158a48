//! The backend's configuration, built once and handed to
//! [`CudaBackend::new`](crate::CudaBackend::new): the numerics (the caller's choice, from
//! `--numerics`), the bring-up kill switches and debug aids the environment may set, and two
//! fields for tests and progress. Which kernel runs what is not configured here: the kernel
//! table (src/plan.rs) derives it from the numerics and the device.

use quiver_backend::Numerics;

/// How a [`CudaBackend`](crate::CudaBackend) runs. [`CudaConfig::from_env`] reads the
/// `QUIVER_CUDA_*` variables (docs/ENV.md) over [`Default`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// How products and attention may round ([`Numerics::Parity`]: src/exact.rs, graphs off).
    pub numerics: Numerics,
    /// Decode steps captured as CUDA graphs and replayed (`QUIVER_CUDA_GRAPHS=0`: off). Always
    /// off with [`Numerics::Parity`].
    pub graphs: bool,
    /// Kernels launched with programmatic dependent launch on sm_90+ (`QUIVER_CUDA_PDL=0`:
    /// off): a kernel's launch overlaps the previous one's tail.
    pub pdl: bool,
    /// Synchronize after every eager launch, so a failing kernel is named
    /// (`QUIVER_CUDA_SYNC=1`; debugging).
    pub sync_each: bool,
    /// Tests: every product on this family wherever the weight's type has it, whatever the
    /// token count (the kernel table's other entries otherwise). No variable sets it.
    pub pin: Option<crate::plan::Product>,
    /// Tests: every wmm product in this tile (an index of [`crate::WMM_TILES`]) whatever its
    /// shape. No variable sets it.
    pub wmm_tile: Option<usize>,
    /// Tests: every attention call on the split-K kernel with this many key ranges per (token,
    /// head) (1 to 64). No variable sets it.
    pub attention_splits: Option<usize>,
    /// Bytes of weights the caller will load: a progress bar on stderr while they do. No
    /// variable sets it.
    pub load_total: Option<u64>,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            numerics: Numerics::default(),
            graphs: true,
            pdl: true,
            sync_each: false,
            pin: None,
            wmm_tile: None,
            attention_splits: None,
            load_total: None,
        }
    }
}

impl CudaConfig {
    /// `numerics` with the `QUIVER_CUDA_*` variables of the environment applied.
    pub fn from_env(numerics: Numerics) -> Self {
        Self::from_vars(numerics, |name| std::env::var(name).ok())
    }

    /// `numerics` with the variables `var` returns applied (`from_env` over a lookup).
    pub fn from_vars(numerics: Numerics, var: impl Fn(&str) -> Option<String>) -> Self {
        CudaConfig {
            numerics,
            graphs: var("QUIVER_CUDA_GRAPHS").as_deref() != Some("0"),
            pdl: var("QUIVER_CUDA_PDL").as_deref() != Some("0"),
            sync_each: var("QUIVER_CUDA_SYNC").as_deref() == Some("1"),
            ..CudaConfig::default()
        }
    }

    /// The configuration in effect on a device of compute capability `arch`: PDL only from
    /// sm_90, no graphs in the parity mode, key ranges in range.
    pub(crate) fn resolve(mut self, arch: u32) -> Self {
        self.pdl &= arch >= 90;
        self.graphs &= self.numerics != Numerics::Parity;
        self.attention_splits = self.attention_splits.map(|n| n.clamp(1, 64));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> CudaConfig {
        CudaConfig::from_vars(Numerics::BatchInvariant, |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn the_variables_set_their_switches() {
        assert_eq!(with(&[]), CudaConfig::default());
        for v in ["1", "", "no", "00"] {
            let c = with(&[("QUIVER_CUDA_GRAPHS", v), ("QUIVER_CUDA_PDL", v)]);
            assert!(c.graphs && c.pdl, "{v:?}");
        }
        let c = with(&[("QUIVER_CUDA_GRAPHS", "0"), ("QUIVER_CUDA_PDL", "0")]);
        assert!(!c.graphs && !c.pdl);
        assert!(with(&[("QUIVER_CUDA_SYNC", "1")]).sync_each);
        assert!(!with(&[("QUIVER_CUDA_SYNC", "yes")]).sync_each);
    }

    #[test]
    fn resolving_turns_off_what_the_machine_or_the_numerics_exclude() {
        let c = CudaConfig {
            numerics: Numerics::Parity,
            attention_splits: Some(100),
            ..CudaConfig::default()
        }
        .resolve(80);
        assert!(!c.pdl && !c.graphs);
        assert_eq!(c.attention_splits, Some(64));
        let c = CudaConfig {
            attention_splits: Some(0),
            ..CudaConfig::default()
        }
        .resolve(90);
        assert!(c.pdl && c.graphs);
        assert_eq!(c.attention_splits, Some(1));
    }
}
