//! Speculative decoding's flags, as llama-server spells them.

use quiver_engine::spec::{SpecConfig, SpecType};

/// The most tokens a step may propose per request.
const MAX_DRAFT: i64 = 256;

#[derive(clap::Args, Clone, Debug)]
pub struct SpecArgs {
    /// Speculative decoding: none (the default) or ngram (prompt lookup: the tokens that
    /// followed the latest earlier occurrence of the last 4, 3 or 2 tokens of the prompt and
    /// text so far are proposed, and checked in the step's one forward pass; the tokens are
    /// those of plain decoding, greedy or seeded).
    #[arg(long = "spec-type", value_name = "none|ngram", default_value = "none", value_parser = parse_spec_type)]
    pub spec_type: SpecType,
    /// Most tokens proposed per request and step (llama-server's --draft-max, --draft).
    #[arg(long = "draft-max", visible_aliases = ["draft", "draft-n"], value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(0..=MAX_DRAFT))]
    pub draft_max: u32,
    /// A proposal shorter than this is not made (llama-server's --draft-min).
    #[arg(long = "draft-min", visible_alias = "draft-n-min", value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=MAX_DRAFT))]
    pub draft_min: u32,
}

fn parse_spec_type(s: &str) -> Result<SpecType, String> {
    SpecType::parse(s).ok_or_else(|| format!("unknown speculative decoding type {s:?}: none or ngram (draft models are not supported)"))
}

impl SpecArgs {
    /// The engine's settings; Err names the flags that disagree.
    pub fn config(&self) -> Result<SpecConfig, String> {
        let c = SpecConfig {
            kind: self.spec_type,
            draft_max: self.draft_max as usize,
            draft_min: self.draft_min as usize,
            ..Default::default()
        };
        c.validate()?;
        Ok(c)
    }
}
