//! `quiver serve`'s flags in llama-server's and vLLM's spellings, so that their command lines
//! run unchanged: each is taken with its meaning there, or refused with one line naming
//! quiver's nearest flag (exit 2), never ignored in silence.

use serde_json::{json, Map, Value};

/// vLLM's tool-call parsers whose formats quiver reads (by the chat template's format, whatever
/// the name: a template that writes Hermes calls is read as Hermes).
pub const TOOL_CALL_PARSERS: &[&str] = &[
    "hermes",
    "mistral",
    "llama3_json",
    "deepseek_v3",
    "deepseek_v31",
    "gemma4",
];

#[derive(clap::Args, Clone, Debug, Default)]
pub struct ServeDropin {
    /// llama-server's -np/--parallel: the sequences running at once (as --max-seqs), and with
    /// -c, llama-server's meaning: -c is the total, each sequence gets -c / -np tokens.
    #[arg(long = "parallel", value_name = "N", conflicts_with = "max_seqs", value_parser = clap::value_parser!(u32).range(1..=crate::serve::MAX_SEQS))]
    pub parallel: Option<u32>,
    /// llama-server's -cb/--cont-batching: accepted (quiver always batches continuously;
    /// --no-cont-batching is refused).
    #[arg(long = "cont-batching")]
    pub cont_batching: bool,
    /// llama-server's -kvu/--kv-unified: the paged KV pool is always shared by the sequences;
    /// with -c and -np, each sequence may use all of -c instead of its share.
    #[arg(long = "kv-unified")]
    pub kv_unified: bool,
    /// llama-server's --embeddings: accepted (/v1/embeddings is always served).
    #[arg(long = "embeddings", visible_alias = "embedding")]
    pub embeddings: bool,
    /// llama-server's --no-warmup: accepted (the server does not warm up at load).
    #[arg(long = "no-warmup")]
    pub no_warmup: bool,
    /// llama-server's -ngld/--n-gpu-layers-draft: the draft model (-md) runs on the model's
    /// device; 0 (the draft on the CPU) is refused unless the model is on the CPU too.
    #[arg(long = "n-gpu-layers-draft", visible_aliases = ["gpu-layers-draft"], value_name = "N")]
    pub n_gpu_layers_draft: Option<String>,
    /// llama-server's -cd/--ctx-size-draft: accepted (the draft's KV cache is the model's pool,
    /// block for block).
    #[arg(long = "ctx-size-draft", value_name = "N")]
    pub ctx_size_draft: Option<u32>,
    /// llama-server's --cache-reuse N: accepted (prefix caching is always on, in whole KV
    /// blocks of 16 tokens).
    #[arg(long = "cache-reuse", value_name = "N")]
    pub cache_reuse: Option<u32>,
    /// llama-server's --reasoning-format: the default of requests' `reasoning_format`. auto and
    /// deepseek (quiver's default): a thinking model's thoughts come back as reasoning_content;
    /// none: left in content as the model wrote them.
    #[arg(long = "reasoning-format", value_name = "none|deepseek|auto", value_parser = parse_reasoning_format)]
    pub reasoning_format: Option<String>,
    /// Default max_tokens of requests that give none (llama-server's -n/--n-predict; -1: to the
    /// end of the context; default: the rest of the context for chat, 16 for completions).
    #[arg(short = 'n', long = "n-predict", visible_alias = "predict", value_name = "N", allow_negative_numbers = true, value_parser = parse_n_predict)]
    pub n_predict: Option<i64>,
    /// Default temperature of requests that give none (0..2; default 1.0).
    #[arg(long = "temp", visible_alias = "temperature", value_name = "T", value_parser = range_f32(0.0, 2.0, true))]
    pub temp: Option<f32>,
    /// Default seed of requests that give none (-1: a random one each, the default).
    #[arg(short = 's', long = "seed", value_name = "SEED", allow_negative_numbers = true, value_parser = parse_seed)]
    pub seed: Option<i64>,
    /// Default top_k of requests that give none (0 or less: off, the default).
    #[arg(long = "top-k", value_name = "K", allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    /// Default top_p of requests that give none ((0, 1]; default 1.0).
    #[arg(long = "top-p", value_name = "P", value_parser = range_f32(0.0, 1.0, false))]
    pub top_p: Option<f32>,
    /// Default min_p of requests that give none (0..1; default 0).
    #[arg(long = "min-p", value_name = "P", value_parser = range_f32(0.0, 1.0, true))]
    pub min_p: Option<f32>,
    /// vLLM's --max-model-len: each sequence's context in tokens (-c as quiver takes it
    /// without -np; llama-server's -c with -np is the total).
    #[arg(long = "max-model-len", value_name = "N", conflicts_with = "ctx_size", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_model_len: Option<u32>,
    /// vLLM's --enable-auto-tool-choice: accepted (tool_choice auto is always served).
    #[arg(long = "enable-auto-tool-choice")]
    pub enable_auto_tool_choice: bool,
    /// vLLM's --tool-call-parser: hermes, mistral, llama3_json, deepseek_v3, deepseek_v31 or
    /// gemma4 are accepted; quiver reads calls in the format the chat template writes.
    #[arg(long = "tool-call-parser", value_name = "NAME", value_parser = parse_tool_call_parser)]
    pub tool_call_parser: Option<String>,
}

fn parse_reasoning_format(s: &str) -> Result<String, String> {
    match s {
        "auto" | "deepseek" | "none" => Ok(s.into()),
        "deepseek-legacy" => Err(
            "deepseek-legacy is not supported: use deepseek (thoughts in reasoning_content) or none (thoughts left in content)".into(),
        ),
        _ => Err("use none, deepseek or auto".into()),
    }
}

fn parse_n_predict(s: &str) -> Result<i64, String> {
    match s.parse::<i64>() {
        Ok(n) if n == -1 || n == -2 || n >= 1 => Ok(n),
        _ => Err("a positive number of tokens, or -1 (to the end of the context)".into()),
    }
}

fn parse_seed(s: &str) -> Result<i64, String> {
    match s.parse::<i64>() {
        Ok(n) if n >= -1 => Ok(n),
        _ => Err("a seed of 0 or more, or -1 (a random one per request)".into()),
    }
}

fn parse_tool_call_parser(s: &str) -> Result<String, String> {
    if TOOL_CALL_PARSERS.contains(&s) {
        Ok(s.into())
    } else {
        Err(format!(
            "quiver reads the tool calls of these formats: {} (it reads the format the chat template writes)",
            TOOL_CALL_PARSERS.join(", ")
        ))
    }
}

/// A value parser for a float in [lo, hi] (`lo_in`: lo itself allowed).
fn range_f32(lo: f32, hi: f32, lo_in: bool) -> impl Fn(&str) -> Result<f32, String> + Clone {
    move |s: &str| {
        let x: f32 = s.parse().map_err(|_| "not a number".to_string())?;
        let above = if lo_in { x >= lo } else { x > lo };
        if x.is_finite() && above && x <= hi {
            Ok(x)
        } else if lo_in {
            Err(format!("between {lo} and {hi}"))
        } else {
            Err(format!("above {lo}, at most {hi}"))
        }
    }
}

impl ServeDropin {
    /// The server's defaults for requests that leave fields out.
    pub fn request_defaults(&self) -> quiver_server::RequestDefaults {
        let mut fields = Map::new();
        let mut put = |k: &str, v: Value| {
            fields.insert(k.into(), v);
        };
        if let Some(t) = self.temp {
            put("temperature", json!(t));
        }
        if let Some(k) = self.top_k {
            put("top_k", json!(k.max(0)));
        }
        if let Some(p) = self.top_p {
            put("top_p", json!(p));
        }
        if let Some(p) = self.min_p {
            put("min_p", json!(p));
        }
        if let Some(s) = self.seed.filter(|&s| s >= 0) {
            put("seed", json!(s));
        }
        if let Some(f) = &self.reasoning_format {
            put("reasoning_format", json!(f));
        }
        quiver_server::RequestDefaults {
            max_tokens: self.n_predict.map(|n| n.max(0) as usize),
            fields,
        }
    }
}

/// Each sequence's context and the KV pool's size in tokens (None: quiver's default, every
/// sequence's full context up to 2 GiB), from `-c`, `-np` (llama-server's spelling; quiver's
/// `--max-seqs` keeps `-c` per sequence), `-kvu` and `--max-model-len`, as llama-server and
/// vLLM mean them:
/// - `-c N -np P`: N is the total, each sequence gets N/P tokens and the pool holds N
///   (llama-server's slots); with `-kvu`, each sequence may use all N of the pool;
/// - `-c N` without `-np`, or `--max-model-len N`: each sequence's context (llama-server's
///   default, a unified cache; vLLM's), the pool quiver's default;
/// - neither: `default` (4096, or the model's training context if smaller).
///
/// Contexts are whole KV blocks (`block` tokens), at least one.
pub fn context(
    ctx: Option<u32>,
    np: Option<u32>,
    kv_unified: bool,
    max_model_len: Option<u32>,
    default: usize,
    block: usize,
) -> (usize, Option<usize>) {
    let blocks = |n: usize| n.max(1).div_ceil(block) * block;
    match (ctx, np, max_model_len) {
        (_, _, Some(m)) => (blocks(m as usize), None),
        (Some(c), Some(_), _) if kv_unified => (blocks(c as usize), Some(blocks(c as usize))),
        (Some(c), Some(p), _) => {
            let per = blocks(c as usize / p.max(1) as usize);
            (per, Some(blocks(c as usize).max(per)))
        }
        (Some(c), None, _) => (blocks(c as usize), None),
        (None, _, _) => (blocks(default), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctx_is_divided_among_the_slots_as_llama_server_divides_it() {
        let c = |ctx, np, kvu, mml| context(ctx, np, kvu, mml, 4096, 16);
        // -c 8192 -np 4: 2048 tokens each, a pool of 8192.
        assert_eq!(c(Some(8192), Some(4), false, None), (2048, Some(8192)));
        // Shares round up to whole blocks; the pool is never smaller than one share.
        assert_eq!(c(Some(1000), Some(3), false, None), (336, Some(1008)));
        assert_eq!(c(Some(8), Some(16), false, None), (16, Some(16)));
        // -kvu: each sequence may use the whole pool.
        assert_eq!(c(Some(8192), Some(4), true, None), (8192, Some(8192)));
        // -c alone: each sequence's context, the pool quiver's default.
        assert_eq!(c(Some(2048), None, false, None), (2048, None));
        // -np alone and neither: the default context each.
        assert_eq!(c(None, Some(8), false, None), (4096, None));
        assert_eq!(c(None, None, false, None), (4096, None));
        // vLLM's --max-model-len is per sequence.
        assert_eq!(c(None, Some(8), false, Some(1024)), (1024, None));
    }

    #[test]
    fn request_defaults_fill_only_the_fields_given() {
        let d = ServeDropin {
            temp: Some(0.0),
            top_k: Some(-1),
            seed: Some(-1),
            n_predict: Some(-1),
            ..ServeDropin::default()
        }
        .request_defaults();
        assert_eq!(d.max_tokens, Some(0));
        assert_eq!(json!(d.fields), json!({"temperature": 0.0, "top_k": 0}));
        let d = ServeDropin {
            seed: Some(7),
            n_predict: Some(64),
            min_p: Some(0.05),
            reasoning_format: Some("none".into()),
            ..ServeDropin::default()
        }
        .request_defaults();
        assert_eq!(d.fields["reasoning_format"], json!("none"));
        assert_eq!(d.max_tokens, Some(64));
        assert_eq!(d.fields["seed"], json!(7));
        assert!(d.fields.contains_key("min_p"));
        let none = ServeDropin::default().request_defaults();
        assert!(none.max_tokens.is_none() && none.fields.is_empty());
    }
}
