//! How a backend may round: the one numerics choice every command takes (`--numerics`) and
//! hands to whichever backend runs it.

/// Whether a token's result may depend on the other tokens of its step, and whether a backend
/// must reproduce another's floats.
///
/// - [`Numerics::BatchInvariant`] (the default): a sequence's rows are computed in an order
///   that does not depend on the other rows of the step, so a request gets the same answer
///   alone and under any load, and a prompt the same logits however it is chunked.
/// - [`Numerics::Fast`]: each step takes its fastest kernels; a token's bits may follow the
///   batch (the CPU rounds as llama.cpp's CPU build does for the same batch).
/// - [`Numerics::Parity`]: the CUDA backend rounds as the CPU backend's batch-invariant path
///   does, operation for operation (the same logits bit for bit, far slower); on the CPU it is
///   that batch-invariant path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Numerics {
    Fast,
    #[default]
    BatchInvariant,
    Parity,
}

impl Numerics {
    pub const ALL: [Numerics; 3] = [Numerics::Fast, Numerics::BatchInvariant, Numerics::Parity];

    /// True when a token's result does not depend on its batch (batch-invariant and parity).
    pub fn is_batch_invariant(self) -> bool {
        self != Numerics::Fast
    }

    /// The name `--numerics` takes and the load log prints.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Fast => "fast",
            Numerics::BatchInvariant => "invariant",
            Numerics::Parity => "parity",
        }
    }

    /// The numerics named `s` (`fast`, `invariant`, `parity`; `batch-invariant` too).
    pub fn parse(s: &str) -> Option<Numerics> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fast" => Some(Numerics::Fast),
            "invariant" | "batch-invariant" => Some(Numerics::BatchInvariant),
            "parity" => Some(Numerics::Parity),
            _ => None,
        }
    }
}

impl std::fmt::Display for Numerics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for n in Numerics::ALL {
            assert_eq!(Numerics::parse(n.name()), Some(n));
        }
        assert_eq!(
            Numerics::parse(" Batch-Invariant "),
            Some(Numerics::BatchInvariant)
        );
        assert_eq!(Numerics::parse("exact"), None);
        assert_eq!(Numerics::default(), Numerics::BatchInvariant);
        assert!(!Numerics::Fast.is_batch_invariant());
        assert!(Numerics::Parity.is_batch_invariant());
    }
}
