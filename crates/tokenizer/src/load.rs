//! Building a [`Tokenizer`] from GGUF metadata, with llama.cpp's defaults and load-time fixes
//! (special-token detection by text, the end-of-generation set).

use crate::bpe::Merges;
use crate::pretok::PreTokenizer;
use crate::special::Specials;
use crate::unicode::ByteMap;
use crate::{attr, Tokenizer, TokenizerError, TokenizerKind};
use quiver_gguf::{Array, GgufFile};
use std::collections::{BTreeSet, HashMap};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";

/// Texts that llama.cpp treats as end-of-generation whatever their metadata says.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Special-token kinds that llama.cpp recognises by text only to mark them control.
const FIM_OTHER_TEXTS: &[&[&str]] = &[
    &[
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ],
    &[
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ],
    &[
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ],
];

fn bad(key: &str, why: impl Into<String>) -> TokenizerError {
    TokenizerError::BadMetadata {
        key: key.to_string(),
        why: why.into(),
    }
}

/// An optional token id key; values that are not valid u32 are treated as absent.
fn id_key(f: &GgufFile, key: &str) -> Option<u32> {
    f.get_u32(key).ok().flatten()
}

pub(crate) fn from_gguf(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
    let model = f
        .get_str(KEY_MODEL)?
        .ok_or_else(|| TokenizerError::MissingKey(KEY_MODEL.into()))?
        .to_string();
    let mut pre_name = f.get_str(KEY_PRE)?.map(str::to_string);
    if model == "gemma4" {
        // llama.cpp: the `gemma4` model always uses the `gemma4` pre-tokenizer.
        pre_name = Some("gemma4".into());
    }
    let kind = match model.as_str() {
        "none" | "no_vocab" => return none_vocab(f),
        "llama" => TokenizerKind::Spm,
        "bert" => TokenizerKind::Wpm,
        "gpt2" | "gemma4" => TokenizerKind::Bpe,
        other => return Err(TokenizerError::UnknownModel(other.to_string())),
    };

    // Defaults per model type.
    let (mut bos, mut eos, mut unk): (Option<u32>, Option<u32>, Option<u32>);
    let (mut sep, mut pad) = (None, None);
    let (mut add_bos, add_eos, mut add_space_prefix);
    let mut pre = None;
    let mut merges = None;
    match kind {
        TokenizerKind::Spm => {
            (bos, eos, unk) = (Some(1), Some(2), Some(0));
            (add_bos, add_eos, add_space_prefix) = (true, false, true);
        }
        TokenizerKind::Wpm => {
            (bos, eos, unk) = (Some(101), None, Some(100));
            (sep, pad) = (Some(102), Some(0));
            (add_bos, add_eos, add_space_prefix) = (true, false, false);
        }
        _ => {
            let p = PreTokenizer::from_name(pre_name.as_deref())?;
            (bos, eos, unk) = if model == "gemma4" {
                (None, None, None)
            } else {
                (
                    if p.no_default_bos { None } else { Some(11) },
                    Some(11),
                    None,
                )
            };
            (add_bos, add_eos, add_space_prefix) = (p.add_bos, false, false);
            let m = f
                .get_array(KEY_MERGES)?
                .ok_or_else(|| TokenizerError::MissingKey(KEY_MERGES.into()))?;
            let m = m
                .as_strings()
                .ok_or_else(|| bad(KEY_MERGES, "not an array of strings"))?;
            merges = Some(Merges::new(m));
            pre = Some(p);
        }
    }
    if let Some(v) = f.get_bool("tokenizer.ggml.add_space_prefix")? {
        add_space_prefix = v;
    }

    // The vocabulary.
    let tokens = f
        .get_array(KEY_TOKENS)?
        .ok_or_else(|| TokenizerError::MissingKey(KEY_TOKENS.into()))?;
    let tokens = tokens
        .as_strings()
        .ok_or_else(|| bad(KEY_TOKENS, "not an array of strings"))?;
    let n = tokens.len();
    if n > u32::MAX as usize {
        return Err(bad(KEY_TOKENS, "more than 2^32 tokens"));
    }
    let scores: Vec<f32> = match f.get_array(KEY_SCORES)? {
        None => vec![0.0; n],
        Some(a) => {
            let s: Vec<f32> = match a {
                Array::F32(v) => v.clone(),
                Array::I32(v) => v.iter().map(|&x| x as f32).collect(),
                _ => return Err(bad(KEY_SCORES, "not an array of f32 or i32")),
            };
            if s.len() < n {
                return Err(bad(
                    KEY_SCORES,
                    format!("{} scores for {n} tokens", s.len()),
                ));
            }
            s
        }
    };
    let mut attrs: Vec<u32> = match f.get_array(KEY_TYPES)? {
        None => vec![attr::NORMAL; n],
        Some(a) => {
            let Array::I32(t) = a else {
                return Err(bad(KEY_TYPES, "not an array of i32"));
            };
            if t.len() < n {
                return Err(bad(
                    KEY_TYPES,
                    format!("{} token types for {n} tokens", t.len()),
                ));
            }
            t[..n].iter().map(|&ty| attr::from_token_type(ty)).collect()
        }
    };
    let mut texts: Vec<String> = Vec::with_capacity(n);
    let mut token_to_id: HashMap<String, u32> = HashMap::with_capacity(n);
    for (i, t) in tokens.iter().enumerate() {
        let t = if t.is_empty() {
            format!("[EMPTY_{i}]")
        } else {
            t.clone()
        };
        token_to_id.insert(t.clone(), i as u32);
        texts.push(t);
    }

    // Special token ids: defaults out of range are dropped; metadata ids in range win.
    let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
    let read = |key: &str, default: Option<u32>| match id_key(f, key) {
        Some(id) if (id as usize) < n => Some(id),
        _ => in_range(default),
    };
    bos = read("tokenizer.ggml.bos_token_id", bos);
    eos = read("tokenizer.ggml.eos_token_id", eos);
    unk = read("tokenizer.ggml.unknown_token_id", unk);
    let mut eot = read("tokenizer.ggml.eot_token_id", None);
    let mut eom = read("tokenizer.ggml.eom_token_id", None);
    pad = read("tokenizer.ggml.padding_token_id", pad);
    sep = read("tokenizer.ggml.seperator_token_id", sep);
    let mut fim_pad = read("tokenizer.ggml.fim_pad_token_id", None);
    let mut fim_rep = read("tokenizer.ggml.fim_rep_token_id", None);
    let mut fim_sep = read("tokenizer.ggml.fim_sep_token_id", None);
    if let Some(v) = f.get_bool("tokenizer.ggml.add_bos_token")? {
        add_bos = v;
    }
    let add_eos = f
        .get_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(add_eos);
    if pre
        .as_ref()
        .is_some_and(|p| p.name == "gemma4" || p.name == "granite-embed-multi-311m")
    {
        // llama.cpp forces BOS on for Gemma 4.
        add_bos = true;
    }

    // Tokens found by text. Iterating in id order keeps this deterministic (llama.cpp walks
    // a hash map, so with several candidates its pick can differ).
    let canonical = |id: usize| token_to_id.get(&texts[id]) == Some(&(id as u32));
    let detect = |slot: &mut Option<u32>, list: &[&str], attrs: &mut Vec<u32>| {
        if slot.is_some() {
            return;
        }
        for (id, t) in texts.iter().enumerate() {
            if list.contains(&t.as_str()) && canonical(id) {
                *slot = Some(id as u32);
                attrs[id] |= attr::CONTROL;
                return;
            }
        }
    };
    detect(&mut eot, EOT_TEXTS, &mut attrs);
    detect(&mut eom, EOM_TEXTS, &mut attrs);
    detect(&mut fim_pad, FIM_PAD_TEXTS, &mut attrs);
    detect(&mut fim_rep, FIM_REP_TEXTS, &mut attrs);
    detect(&mut fim_sep, FIM_SEP_TEXTS, &mut attrs);
    for list in FIM_OTHER_TEXTS {
        detect(&mut None, list, &mut attrs);
    }
    // Control tokens named "unused…" are unused.
    for (id, t) in texts.iter().enumerate() {
        if attrs[id] & attr::CONTROL != 0 && t.contains("unused") {
            attrs[id] |= attr::UNUSED;
        }
    }

    // The end-of-generation set.
    let mut eog: BTreeSet<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
    for (id, t) in texts.iter().enumerate() {
        if canonical(id) && EOG_TEXTS.contains(&t.as_str()) {
            eog.insert(id as u32);
            attrs[id] |= attr::CONTROL;
        }
    }
    for (id, t) in texts.iter().enumerate() {
        // gpt-oss: these are always rendered.
        if canonical(id)
            && matches!(
                t.as_str(),
                "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>"
            )
        {
            attrs[id] = attr::USER_DEFINED;
        }
    }
    eog.extend([eos, eot, eom].into_iter().flatten());
    let has = |eog: &BTreeSet<u32>, names: &[&str]| {
        eog.iter()
            .find(|&&id| names.contains(&texts[id as usize].as_str()))
            .copied()
    };
    // o200k_harmony / solar-open: "<|end|>" ends a message, not the generation.
    if let Some(end) = has(&eog, &["<|end|>"]) {
        let ret = has(&eog, &["<|return|>"]).is_some();
        let call = has(&eog, &["<|call|>", "<|calls|>"]).is_some();
        let flush = has(&eog, &["<|flush|>"]).is_some();
        if call && (ret || flush) {
            eog.remove(&end);
            attrs[end as usize] = attr::USER_DEFINED;
        }
    }
    // Gemma 4 / PLaMo: "</s>" is an ordinary token there.
    if let (Some(s), Some(_)) = (
        has(&eog, &["</s>"]),
        has(&eog, &["<|tool_response>", "<|plamo:eos|>"]),
    ) {
        eog.remove(&s);
        attrs[s as usize] = attr::NORMAL;
    }

    if add_bos && bos.is_none() {
        return Err(TokenizerError::MissingSpecial("BOS (add_bos_token is set)"));
    }
    if add_eos && eos.is_none() {
        return Err(TokenizerError::MissingSpecial("EOS (add_eos_token is set)"));
    }

    let specials = Specials::new(
        (0..n)
            .filter(|&i| attrs[i] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0)
            .map(|i| {
                (
                    i as u32,
                    texts[i].as_str(),
                    attrs[i] & (attr::CONTROL | attr::UNKNOWN) != 0,
                )
            })
            .collect(),
    )
    .map_err(|e| {
        bad(
            KEY_TOKENS,
            format!("cannot build the special-token matcher: {e}"),
        )
    })?;

    let byte_map = ByteMap::new();
    let ascii = |b: usize| {
        if (1..0x80).contains(&b) {
            token_to_id.get(&(b as u8 as char).to_string())
        } else {
            None
        }
    };
    let mut byte_tokens = [None; 256];
    for (b, slot) in byte_tokens.iter_mut().enumerate() {
        *slot = match kind {
            TokenizerKind::Spm => token_to_id
                .get(&format!("<0x{b:02X}>"))
                .or_else(|| ascii(b))
                .copied(),
            // SentencePiece-style BPE falls back to `<0xNN>` tokens.
            _ if pre.as_ref().is_some_and(|p| p.escape_ws) => {
                token_to_id.get(&format!("<0x{b:02X}>")).copied()
            }
            // BPE falls back to the token spelled by one byte of the byte-level text, which
            // exists only for ASCII.
            _ => ascii(b).copied(),
        };
    }

    let wpm = if kind == TokenizerKind::Wpm {
        let lowercase = f
            .get_bool("tokenizer.ggml.normalizer.lowercase")?
            .unwrap_or(true);
        let strip_accents = f
            .get_bool("tokenizer.ggml.normalizer.strip_accents")?
            .unwrap_or(lowercase);
        let norm = crate::wpm::Normalizer {
            lowercase,
            strip_accents,
        };
        Some((norm, texts.iter().map(String::len).max().unwrap_or(0)))
    } else {
        None
    };

    let mut tok = Tokenizer {
        kind,
        n_vocab: n,
        model,
        texts,
        scores,
        attrs,
        token_to_id,
        pieces: Vec::new(),
        bos,
        eos,
        eot,
        eom,
        unk,
        pad,
        sep,
        add_bos,
        add_eos,
        add_space_prefix,
        eog,
        pre,
        merges,
        byte_map,
        byte_tokens,
        specials,
        wpm,
    };
    tok.pieces = (0..n as u32)
        .map(|id| tok.render_piece(id).into_boxed_slice())
        .collect();
    Ok(tok)
}

fn none_vocab(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
    let arch = f.arch()?;
    let key = format!("{arch}.vocab_size");
    let n = match f.get_u32(&key)? {
        Some(n) => n as usize,
        None => match f.get_array(KEY_TOKENS)? {
            Some(a) => a.len(),
            None => return Err(TokenizerError::MissingKey(key)),
        },
    };
    Ok(Tokenizer {
        kind: TokenizerKind::None,
        n_vocab: n,
        model: "none".into(),
        texts: Vec::new(),
        scores: Vec::new(),
        attrs: Vec::new(),
        token_to_id: HashMap::new(),
        pieces: Vec::new(),
        bos: None,
        eos: None,
        eot: None,
        eom: None,
        unk: None,
        pad: None,
        sep: None,
        add_bos: false,
        add_eos: false,
        add_space_prefix: false,
        eog: BTreeSet::new(),
        pre: None,
        merges: None,
        byte_map: ByteMap::new(),
        byte_tokens: [None; 256],
        specials: Specials::new(Vec::new()).map_err(|e| bad(KEY_TOKENS, e.to_string()))?,
        wpm: None,
    })
}
