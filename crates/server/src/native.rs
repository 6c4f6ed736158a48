//! llama-server's own generation endpoints: `/completion` and `/infill` (fill-in-the-middle),
//! with its field names (`n_predict`, `repeat_penalty`, `input_prefix` …) and its response
//! shape (`content`, `stop`, `stop_type`, `tokens_predicted`, `timings` …; streamed as
//! `data: {"content": …, "stop": false}` lines, the last with `stop: true` and the totals, no
//! `[DONE]`). The request is translated to `/v1/completions`' fields and runs the same way.

use crate::app::{check_prompt_bytes, on_cpu, AppState, St};
use crate::error::ApiError;
use crate::generate::{submit, Gen};
use crate::params::{self, Prompt};
use crate::reqlog::ReqLog;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use quiver_engine::serve::{Event, FinishReason, TokenLogprob};
use quiver_tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

/// `/completion`'s fields as `/v1/completions` names them. Fields llama-server has and quiver
/// does not need (`cache_prompt`: the prefix cache is always on; `id_slot`, `n_keep`,
/// `samplers` …) are ignored.
fn translate(m: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let mut o = Map::new();
    for k in [
        "prompt",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "stop",
        "stream",
        "ignore_eos",
        "grammar",
        "json_schema",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "model",
        "cache_salt",
    ] {
        if let Some(v) = m.get(k).filter(|v| !v.is_null()) {
            o.insert(k.into(), v.clone());
        }
    }
    match m.get("n_predict").filter(|v| !v.is_null()) {
        None => {}
        Some(v) => match v.as_i64() {
            Some(n) if n < 0 => {}
            Some(n) if n > 0 => {
                o.insert("max_tokens".into(), json!(n));
            }
            _ => {
                return Err(ApiError::invalid(
                    "n_predict",
                    "`n_predict` must be -1 (no limit) or a positive integer",
                ))
            }
        },
    }
    if let Some(v) = m.get("repeat_penalty").filter(|v| !v.is_null()) {
        o.insert("repetition_penalty".into(), v.clone());
    }
    // llama-server's seed -1 is a random one.
    if let Some(v) = m
        .get("seed")
        .filter(|v| !v.is_null() && v.as_i64() != Some(-1))
    {
        o.insert("seed".into(), v.clone());
    }
    Ok(o)
}

/// `n_probs`: how many of the likeliest tokens each generated token's entry of
/// `completion_probabilities` lists (None: no probabilities). They are the model's
/// log-probabilities before sampling; llama-server's `post_sampling_probs` (the sampler's
/// probabilities) is refused.
fn n_probs(m: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    if m.get("post_sampling_probs").and_then(Value::as_bool) == Some(true) {
        return Err(ApiError::invalid(
            "post_sampling_probs",
            "`post_sampling_probs` is not supported: `n_probs` gives the model's log-probabilities before sampling",
        ));
    }
    match m.get("n_probs").filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(0) => Ok(None),
            Some(n) if n <= params::MAX_TOP_LOGPROBS as u64 => Ok(Some(n as usize)),
            _ => Err(ApiError::invalid(
                "n_probs",
                format!(
                    "`n_probs` must be an integer from 0 to {}, got {v}",
                    params::MAX_TOP_LOGPROBS
                ),
            )),
        },
    }
}

/// One generated token's entry of llama-server's `completion_probabilities`: its id, text,
/// bytes and log-probability, and the `n_probs` likeliest tokens' (`top_logprobs`).
fn prob_entry(tok: &Tokenizer, id: u32, lp: &TokenLogprob) -> Value {
    let one = |id: u32, logprob: f32| json!({"id": id, "token": tok.decode(&[id], false), "bytes": tok.token_piece_bytes(id).into_owned(), "logprob": logprob});
    let mut v = one(id, lp.logprob);
    v["top_logprobs"] = lp.top.iter().map(|&(t, l)| one(t, l)).collect();
    v
}

/// The FIM tokens of the vocabulary (prefix, suffix, middle; repository, file separator), by
/// the spellings the code models use.
struct Fim {
    pre: u32,
    suf: u32,
    mid: u32,
    rep: Option<u32>,
    sep: Option<u32>,
}

fn find(tok: &Tokenizer, names: &[&str]) -> Option<u32> {
    names.iter().find_map(|n| tok.token_id(n))
}

fn fim(tok: &Tokenizer) -> Option<Fim> {
    Some(Fim {
        pre: find(
            tok,
            &[
                "<|fim_prefix|>",
                "<fim-prefix>",
                "<fim_prefix>",
                "<PRE>",
                "▁<PRE>",
                "<｜fim▁begin｜>",
                "<|code_prefix|>",
            ],
        )?,
        suf: find(
            tok,
            &[
                "<|fim_suffix|>",
                "<fim-suffix>",
                "<fim_suffix>",
                "<SUF>",
                "▁<SUF>",
                "<｜fim▁hole｜>",
                "<|code_suffix|>",
            ],
        )?,
        mid: find(
            tok,
            &[
                "<|fim_middle|>",
                "<fim-middle>",
                "<fim_middle>",
                "<MID>",
                "▁<MID>",
                "<｜fim▁end｜>",
                "<|code_middle|>",
            ],
        )?,
        rep: find(tok, &["<|repo_name|>", "<repo_name>", "<reponame>"]),
        sep: find(tok, &["<|file_sep|>", "<file_sep>"]),
    })
}

/// `/infill`'s prompt: the extra files (repository form when the vocabulary has its tokens),
/// then `[PRE] prefix prompt [SUF] suffix [MID]`; the prefix keeps its end and the suffix its
/// start when they must be cut to fit the context.
fn infill_prompt(st: &AppState, m: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let tok = st.handle.tokenizer();
    let f = fim(tok).ok_or_else(|| {
        ApiError::invalid(
            "input_prefix",
            "this model has no fill-in-the-middle tokens",
        )
    })?;
    let text = |field: &'static str, required: bool| -> Result<String, ApiError> {
        match m.get(field) {
            None | Some(Value::Null) if !required => Ok(String::new()),
            None | Some(Value::Null) => {
                Err(ApiError::invalid(field, format!("`{field}` is required")))
            }
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(ApiError::invalid(
                field,
                format!("`{field}` must be a string"),
            )),
        }
    };
    let enc = |field: &'static str, s: &str| -> Result<Vec<u32>, ApiError> {
        check_prompt_bytes(st, s.len(), field)?;
        tok.encode(s, false, false)
            .map_err(|e| ApiError::invalid(field, format!("cannot tokenize: {e}")))
    };
    let prefix = enc("input_prefix", &text("input_prefix", true)?)?;
    let suffix = enc("input_suffix", &text("input_suffix", true)?)?;
    let prompt = enc("prompt", &text("prompt", false)?)?;
    let mut extra = Vec::new();
    let chunks = match m.get("input_extra") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                "input_extra",
                "`input_extra` must be an array of {\"filename\", \"text\"}",
            ))
        }
    };
    if let Some(rep) = f.rep {
        extra.push(rep);
        extra.extend(enc("input_extra", "myproject\n")?);
    }
    for c in &chunks {
        let (Some(t), name) = (c.get("text").and_then(Value::as_str), c.get("filename")) else {
            return Err(ApiError::invalid(
                "input_extra",
                "each `input_extra` chunk needs a string `text`",
            ));
        };
        let name = match name {
            None | Some(Value::Null) => "tmp",
            Some(Value::String(s)) => s,
            Some(_) => {
                return Err(ApiError::invalid(
                    "input_extra",
                    "a chunk's `filename` must be a string",
                ))
            }
        };
        match f.sep {
            Some(sep) => {
                extra.push(sep);
                extra.extend(enc("input_extra", &format!("{name}\n"))?);
            }
            None => extra.extend(enc("input_extra", "\n\n--- snippet ---\n\n")?),
        }
        extra.extend(enc("input_extra", t)?);
    }
    if let Some(sep) = f.sep {
        extra.push(sep);
        extra.extend(enc("input_extra", "filename\n")?);
    }
    let bos = tok.bos().filter(|_| tok.add_bos());
    Ok(layout(
        &f,
        &extra,
        &prefix,
        &prompt,
        &suffix,
        bos,
        st.handle.info().n_ctx,
    ))
}

/// `extra [BOS] [PRE] prefix prompt [SUF] suffix [MID]` within three quarters of `ctx` (a
/// quarter stays for the answer): the suffix gets at most a quarter of that room, keeping its
/// start; the prefix the rest, keeping its end; the extra files what the two leave, keeping
/// their end.
fn layout(
    f: &Fim,
    extra: &[u32],
    prefix: &[u32],
    prompt: &[u32],
    suffix: &[u32],
    bos: Option<u32>,
    ctx: usize,
) -> Vec<u32> {
    let room = (ctx - ctx / 4).saturating_sub(prompt.len() + 4);
    let suf_take = suffix.len().min(room / 4);
    let pre_take = prefix.len().min(room - suf_take);
    let extra_take = extra.len().min(room - suf_take - pre_take);
    let mut ids = Vec::with_capacity(ctx);
    ids.extend_from_slice(&extra[extra.len() - extra_take..]);
    ids.extend(bos);
    ids.push(f.pre);
    ids.extend_from_slice(&prefix[prefix.len() - pre_take..]);
    ids.extend_from_slice(prompt);
    ids.push(f.suf);
    ids.extend_from_slice(&suffix[..suf_take]);
    ids.push(f.mid);
    ids
}

pub(crate) async fn completion(
    st: State<St>,
    log: Extension<Arc<ReqLog>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    native(st, log, body, false).await
}

pub(crate) async fn infill(
    st: State<St>,
    log: Extension<Arc<ReqLog>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    native(st, log, body, true).await
}

async fn native(
    State(st): State<St>,
    Extension(log): Extension<Arc<ReqLog>>,
    body: Result<Bytes, BytesRejection>,
    fill: bool,
) -> Response {
    let r = async {
        let (p, ids, text) = on_cpu(&st, body, move |s, mut m| {
            // Before the translation: a `seed` of -1 stays a random one.
            s.defaults.fill(&mut m);
            let mut t = translate(&m)?;
            let ids = if fill {
                let ids = infill_prompt(s, &m)?;
                t.insert("prompt".into(), json!(ids));
                Some(ids)
            } else {
                None
            };
            let req = params::parse_completion(&t, s.handle.info().n_vocab)?;
            let tok = s.handle.tokenizer();
            let (ids, text) = match (ids, req.prompt) {
                (Some(ids), _) => (ids, None),
                (None, Prompt::Text(text)) => {
                    check_prompt_bytes(s, text.len(), "prompt")?;
                    let ids = tok.encode(&text, true, true).map_err(|e| {
                        ApiError::invalid("prompt", format!("cannot tokenize the prompt: {e}"))
                    })?;
                    (ids, Some(text))
                }
                (None, Prompt::Tokens(ids)) => (ids, None),
            };
            let mut p = req.params;
            p.logprobs = n_probs(&m)?;
            Ok((p, ids, text))
        })
        .await?;
        let n_prompt = ids.len();
        let mut gens = submit(&st, &log, ids, &p, "prompt", None, 0).await?;
        let gen = gens.pop().expect("one generation");
        let run = Run {
            st: st.clone(),
            gen,
            t0: Instant::now(),
            first: None,
            n_prompt,
            cached: 0,
            n_gen: 0,
            last: None,
            prompt: text.unwrap_or_default(),
            probs: p.logprobs.map(|_| Vec::new()),
        };
        if p.stream {
            Ok(stream(run))
        } else {
            whole(run).await
        }
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

/// One `/completion` in flight: its events and what the final object reports.
struct Run {
    st: St,
    gen: Gen,
    t0: Instant,
    first: Option<Instant>,
    n_prompt: usize,
    cached: usize,
    n_gen: usize,
    last: Option<u32>,
    prompt: String,
    /// With `n_probs`: the entries of `completion_probabilities` not yet sent.
    probs: Option<Vec<Value>>,
}

impl Run {
    /// The next piece of text, or the end: Ok(None) with the finish reason in `end`.
    async fn next(&mut self, end: &mut Option<FinishReason>) -> Result<Option<String>, ApiError> {
        loop {
            match self.gen.next().await {
                Some(Event::Started { cached_tokens, .. }) => self.cached = cached_tokens,
                Some(Event::Token { id, text, logprob }) => {
                    if let (Some(probs), Some(lp)) = (self.probs.as_mut(), &logprob) {
                        probs.push(prob_entry(self.st.handle.tokenizer(), id, lp));
                    }
                    self.first.get_or_insert_with(Instant::now);
                    self.n_gen += 1;
                    self.last = Some(id);
                    return Ok(Some(text));
                }
                Some(Event::Finished { reason, .. }) => {
                    *end = Some(reason);
                    return Ok(None);
                }
                Some(Event::Error(e)) => {
                    return Err(ApiError::internal(format!("generation failed: {e}")))
                }
                Some(_) => {}
                None => return Err(ApiError::internal("the engine dropped the request")),
            }
        }
    }

    /// The final object's fields beside `content`.
    fn totals(&self, reason: FinishReason, content: &str) -> Value {
        let now = Instant::now();
        let first = self.first.unwrap_or(now);
        let prompt_ms = (first - self.t0).as_secs_f64() * 1e3;
        let gen_ms = (now - first).as_secs_f64() * 1e3;
        let evaluated = self.n_prompt - self.cached.min(self.n_prompt);
        let eos = self
            .last
            .is_some_and(|t| self.st.handle.tokenizer().is_eog(t));
        let stop_type = match reason {
            FinishReason::Length => "limit",
            FinishReason::Stop if eos => "eos",
            FinishReason::Stop => "word",
            FinishReason::Abort => "none",
        };
        let per = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
        let rate = |ms: f64, n: usize| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
        json!({
            "index": 0,
            "id_slot": 0,
            "stop": true,
            "model": self.st.model,
            "tokens_predicted": self.n_gen,
            "tokens_evaluated": self.n_prompt,
            "tokens_cached": self.cached,
            "prompt": self.prompt,
            "has_new_line": content.contains('\n'),
            "truncated": false,
            "stop_type": stop_type,
            "stopping_word": "",
            "timings": {
                "prompt_n": evaluated,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": per(prompt_ms, evaluated),
                "prompt_per_second": rate(prompt_ms, evaluated),
                "predicted_n": self.n_gen,
                "predicted_ms": gen_ms,
                "predicted_per_token_ms": per(gen_ms, self.n_gen),
                "predicted_per_second": rate(gen_ms, self.n_gen),
            },
        })
    }
}

async fn whole(mut run: Run) -> Result<Response, ApiError> {
    let mut content = String::new();
    let mut end = None;
    while let Some(t) = run.next(&mut end).await? {
        content.push_str(&t);
    }
    let mut v = run.totals(end.unwrap_or(FinishReason::Abort), &content);
    v["content"] = json!(content);
    if let Some(probs) = run.probs.take() {
        v["completion_probabilities"] = Value::Array(probs);
    }
    Ok(Json(v).into_response())
}

fn stream(run: Run) -> Response {
    struct S {
        run: Run,
        content: String,
        done: bool,
    }
    let s = S {
        run,
        content: String::new(),
        done: false,
    };
    let events = futures_util::stream::unfold(s, |mut s| async move {
        if s.done {
            return None;
        }
        let mut end = None;
        let mut data = match s.run.next(&mut end).await {
            Ok(Some(t)) => {
                s.content.push_str(&t);
                json!({"index": 0, "content": t, "stop": false, "id_slot": 0})
            }
            Ok(None) => {
                s.done = true;
                let mut v = s.run.totals(end.unwrap_or(FinishReason::Abort), &s.content);
                v["content"] = json!("");
                v
            }
            Err(e) => {
                s.done = true;
                e.body()
            }
        };
        if let (false, Some(probs)) = (s.done, s.run.probs.as_mut()) {
            data["completion_probabilities"] = Value::Array(std::mem::take(probs));
        }
        Some((
            Ok::<_, Infallible>(SseEvent::default().data(data.to_string())),
            s,
        ))
    });
    Sse::new(events).into_response()
}

#[cfg(test)]
mod tests {
    use super::{layout, Fim};

    #[test]
    fn the_fim_prompt_is_laid_out_and_cut_to_fit() {
        let f = Fim {
            pre: 900,
            suf: 901,
            mid: 902,
            rep: None,
            sep: None,
        };
        assert_eq!(
            layout(&f, &[7, 8], &[1, 2], &[3], &[4, 5], Some(99), 64),
            vec![7, 8, 99, 900, 1, 2, 3, 901, 4, 5, 902]
        );
        // ctx 24: room 18 − 5 = 13; suffix ≤ 3 (its start), prefix ≤ 10 (its end), extra 0.
        let pre: Vec<u32> = (100..120).collect();
        let suf: Vec<u32> = (200..210).collect();
        let ids = layout(&f, &[7, 8], &pre, &[3], &suf, None, 24);
        let mut want = vec![900];
        want.extend(110..120);
        want.extend([3, 901, 200, 201, 202, 902]);
        assert_eq!(ids, want);
    }
}
