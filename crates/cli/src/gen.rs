//! `quiver run` and `quiver chat`.

use crate::engine::{self, LoadArgs};
use crate::spec::SpecArgs;
use anyhow::{bail, Context, Result};
use quiver_engine::spec::SpecConfig;
use quiver_engine::{generate_spec, FinishReason, GenOptions, Sampler, SamplerParams, Speculator};
use quiver_tokenizer::chat::{ChatTemplate, Message};
use quiver_tokenizer::Tokenizer;
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(clap::Args, Clone, Debug)]
pub struct SampleArgs {
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub n_predict: u32,
    /// Temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8, value_parser = non_negative)]
    pub temp: f32,
    /// Keep the K most likely tokens (0: off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability reaches P.
    #[arg(long = "top-p", default_value_t = 0.95, value_parser = unit)]
    pub top_p: f32,
    /// Drop tokens less likely than M times the most likely one.
    #[arg(long = "min-p", default_value_t = 0.05, value_parser = unit)]
    pub min_p: f32,
    /// Penalise repeated tokens (1.0: off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0, value_parser = positive)]
    pub repeat_penalty: f32,
    /// Seed of the sampler; the same seed gives the same text.
    #[arg(short = 's', long, default_value_t = 42)]
    pub seed: u64,
}

fn parse_f32(s: &str) -> Result<f32, String> {
    s.parse::<f32>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| format!("{s:?} is not a number"))
}

fn non_negative(s: &str) -> Result<f32, String> {
    parse_f32(s).and_then(|v| {
        if v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("{v} is negative"))
        }
    })
}

fn positive(s: &str) -> Result<f32, String> {
    parse_f32(s).and_then(|v| {
        if v > 0.0 {
            Ok(v)
        } else {
            Err(format!("{v} is not positive"))
        }
    })
}

pub(crate) fn unit(s: &str) -> Result<f32, String> {
    parse_f32(s).and_then(|v| {
        if (0.0..=1.0).contains(&v) {
            Ok(v)
        } else {
            Err(format!("{v} is not in [0, 1]"))
        }
    })
}

impl SampleArgs {
    pub fn params(&self) -> SamplerParams {
        SamplerParams {
            temperature: self.temp,
            top_k: self.top_k as usize,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            ..Default::default()
        }
    }
}

/// The target model (with logits rows to verify proposals) and, with `-md`, the draft model
/// (checked against the target's vocabulary, loaded on the same device with the target's
/// context), or an EAGLE-3 head, which the target's session holds.
fn load_spec(
    load: &LoadArgs,
    gguf: Arc<quiver_gguf::GgufFile>,
    spec: &SpecArgs,
) -> Result<(engine::Loaded, Option<engine::Loaded>, SpecConfig)> {
    let cfg = spec.config()?;
    let eagle = cfg.kind == quiver_engine::spec::SpecType::Eagle3;
    let mtp = cfg.kind == quiver_engine::spec::SpecType::Mtp;
    // (A head is checked against the target as it loads beside it.)
    if let Some(d) = cfg.draft_model.as_ref().filter(|_| !eagle && !mtp) {
        quiver_engine::draft::check_vocab(&gguf, &d.0).map_err(anyhow::Error::msg)?;
        quiver_engine::draft::check_rollback(&d.0).map_err(anyhow::Error::msg)?;
    }
    let draft = cfg.draft_model.clone();
    let ctx = engine::n_ctx(load, &gguf);
    // A power of two: a verification step of up to 64 rows then replays a CUDA graph.
    let rows = if cfg.on() {
        (cfg.draft_max + 1).next_power_of_two()
    } else {
        1
    };
    let target_file = gguf.clone();
    let mut target = engine::load(load, gguf, rows)?;
    if cfg.on() {
        // A recurrent state (Qwen 3.5) keeps the states proposals may roll back to.
        target.runner.keep_states(cfg.draft_max)?;
        let hp = target.runner.hparams();
        if hp.has_seq_state() {
            eprintln!(
                "quiver: speculative decoding keeps what the last {} rows change in the per-sequence state, to roll back ({})",
                cfg.draft_max,
                quiver_backend::human_bytes(hp.kept_state_bytes(cfg.draft_max))
            );
        }
    }
    let draft = match draft {
        Some(d) if mtp => {
            target
                .runner
                .attach_mtp(&d.0)
                .map_err(|e| anyhow::anyhow!("--spec-type mtp: {e}"))?;
            None
        }
        None if mtp => {
            target
                .runner
                .attach_mtp(&target_file)
                .map_err(|e| anyhow::anyhow!("--spec-type mtp: {e}"))?;
            None
        }
        Some(d) if eagle => {
            target.runner.attach_eagle3(&d.0, &target_file)?;
            None
        }
        Some(d) => {
            let args = LoadArgs {
                ctx_size: Some(ctx as u32),
                ..load.clone()
            };
            Some(engine::load(&args, d.0, 1)?)
        }
        None => None,
    };
    Ok((target, draft, cfg))
}

fn spec_report(s: &Speculator) {
    eprintln!(
        "quiver: speculative decoding: {}/{} proposed tokens accepted in {} steps",
        s.accepted, s.proposed, s.steps
    );
}

#[allow(clippy::too_many_arguments)]
pub fn run(
    load: &LoadArgs,
    s: &SampleArgs,
    spec: &SpecArgs,
    prompt: Option<String>,
    file: Option<std::path::PathBuf>,
    system: Option<String>,
    raw: bool,
) -> Result<()> {
    use std::io::{IsTerminal, Read};
    let stdin = || -> Result<String> {
        let mut t = String::new();
        std::io::stdin()
            .read_to_string(&mut t)
            .context("reading the prompt from stdin")?;
        if t.trim().is_empty() {
            bail!("the prompt on stdin is empty");
        }
        Ok(t)
    };
    let text = match (prompt, file) {
        (Some(p), None) => p,
        (None, Some(f)) if f.as_os_str() == "-" => stdin()?,
        (None, Some(f)) => {
            std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?
        }
        // A pipe (`echo hi | quiver run`): the prompt is what it sends.
        (None, None) if !std::io::stdin().is_terminal() => stdin()?,
        (None, None) => bail!("give a prompt with -p TEXT, -f FILE, -f - or a pipe"),
        (Some(_), Some(_)) => bail!("give either -p or -f, not both"),
    };
    let gguf = engine::open(load)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let ids = if raw {
        if system.is_some() {
            bail!("--system needs the chat template; it cannot be used with --raw");
        }
        tok.encode(&text, true, true)?
    } else {
        let tmpl = ChatTemplate::for_model(&gguf)?;
        let mut msgs = Vec::new();
        if let Some(sys) = system {
            msgs.push(Message::new("system", sys));
        }
        msgs.push(Message::new("user", text));
        tmpl.tokenize(&tok, &msgs, true, None)?
    };
    // Checked before loading so that the error is the only line on stderr.
    let ctx = engine::n_ctx(load, &gguf);
    if ids.len() + s.n_predict as usize > ctx {
        return Err(quiver_engine::EngineError::ContextOverflow {
            prompt: ids.len(),
            gen: s.n_predict as usize,
            ctx,
        }
        .into());
    }
    let (mut l, mut draft, cfg) = load_spec(load, gguf, spec)?;
    let d = draft
        .as_mut()
        .map(|d| d.runner.as_mut() as &mut dyn quiver_engine::Session);
    let mut spec = cfg.on().then(|| Speculator::new(cfg, d));
    let mut sampler = Sampler::new(s.params());
    let opts = GenOptions {
        max_tokens: s.n_predict as usize,
        ..Default::default()
    };
    let mut out = std::io::stdout().lock();
    let g = generate_spec(
        l.runner.as_mut(),
        spec.as_mut(),
        &tok,
        &ids,
        0,
        &mut sampler,
        &opts,
        |piece| {
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
            true
        },
    )?;
    let _ = writeln!(out);
    report(&g);
    if let Some(s) = &spec {
        spec_report(s);
    }
    l.report_counters(load);
    Ok(())
}

fn report(g: &quiver_engine::Generated) {
    eprintln!(
        "quiver: prompt {} tokens in {:.3}s ({:.1} t/s), generated {} tokens in {:.3}s ({:.1} t/s), stop: {}",
        g.prompt_tokens,
        g.prompt_secs,
        g.prompt_tokens as f64 / g.prompt_secs.max(1e-9),
        g.tokens.len(),
        g.gen_secs,
        g.tokens.len().saturating_sub(1) as f64 / g.gen_secs.max(1e-9),
        match g.finish {
            FinishReason::Stop => "end of generation",
            FinishReason::Length => "length",
            FinishReason::Abort => "interrupted",
        }
    );
}

pub fn chat(
    load: &LoadArgs,
    s: &SampleArgs,
    spec: &SpecArgs,
    system: Option<String>,
) -> Result<()> {
    let gguf = engine::open(load)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let tmpl = ChatTemplate::for_model(&gguf)?;
    let (mut l, mut draft, cfg) = load_spec(load, gguf, spec)?;
    let d = draft
        .as_mut()
        .map(|d| d.runner.as_mut() as &mut dyn quiver_engine::Session);
    let mut spec = cfg.on().then(|| Speculator::new(cfg, d));
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst))
            .context("installing the Ctrl-C handler")?;
    }
    let mut sampler = Sampler::new(s.params());
    let mut msgs: Vec<Message> = system
        .iter()
        .map(|s| Message::new("system", s.clone()))
        .collect();
    // Tokens whose K/V are in the cache, to reuse the shared prefix of the next turn.
    let mut cached: Vec<u32> = Vec::new();
    let mut input = Input::new();
    eprintln!("quiver chat: /help lists the commands; Ctrl-D quits, Ctrl-C stops an answer");
    loop {
        let Some(line) = input.line()? else {
            break;
        };
        let line = line.trim_end_matches(['\n', '\r']);
        let text = match ChatLine::parse(line) {
            ChatLine::Empty => continue,
            ChatLine::Text(t) => t,
            ChatLine::Command(c) => {
                match c {
                    Command::Exit => break,
                    Command::Help => eprintln!("{CHAT_HELP}"),
                    Command::Clear => {
                        msgs.retain(|m| m.role == "system");
                        cached.clear();
                        eprintln!("(conversation cleared)");
                    }
                    Command::Save(path) => match save_conversation(&path, &msgs) {
                        Ok(()) => eprintln!("(saved {} messages to {path})", msgs.len()),
                        Err(e) => eprintln!("(not saved: {e:#})"),
                    },
                    Command::Load(path) => match load_conversation(&path) {
                        Ok(m) => {
                            msgs = m;
                            cached.clear();
                            eprintln!("(loaded {} messages from {path})", msgs.len());
                        }
                        Err(e) => eprintln!("(not loaded: {e:#})"),
                    },
                    Command::Unknown(c) => eprintln!("(unknown command {c}; /help lists them)"),
                }
                continue;
            }
        };
        msgs.push(Message::new("user", text));
        let ids = tmpl.tokenize(&tok, &msgs, true, None)?;
        let mut keep = cached
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len() - 1);
        // A recurrent state (Qwen 3.5) holds every cached token: it continues only from the
        // end of the cache, else the conversation is computed again from its start.
        if l.runner.hparams().has_seq_state() && keep < cached.len() {
            keep = 0;
        }
        let room = l.runner.n_ctx().saturating_sub(ids.len());
        if room == 0 {
            eprintln!(
                "(the conversation fills the context of {} tokens; /reset to start over)",
                l.runner.n_ctx()
            );
            msgs.pop();
            continue;
        }
        stop.store(false, Ordering::SeqCst);
        let opts = GenOptions {
            max_tokens: (s.n_predict as usize).min(room),
            ..Default::default()
        };
        let mut out = std::io::stdout().lock();
        let g = generate_spec(
            l.runner.as_mut(),
            spec.as_mut(),
            &tok,
            &ids[keep..],
            keep,
            &mut sampler,
            &opts,
            |piece| {
                let _ = out.write_all(piece.as_bytes());
                let _ = out.flush();
                !stop.load(Ordering::SeqCst)
            },
        )?;
        let _ = writeln!(out);
        cached = ids;
        cached.extend_from_slice(&g.tokens[..g.kv_tokens]);
        msgs.push(Message::new("assistant", g.text.clone()));
        if g.finish == FinishReason::Abort {
            eprintln!("(stopped)");
        }
    }
    if let Some(s) = &spec {
        spec_report(s);
    }
    Ok(())
}

/// `quiver chat`'s commands, as `/help` prints them.
const CHAT_HELP: &str = "commands:
  /help          this list
  /clear         start the conversation over (the system prompt stays; also /reset)
  /save FILE     write the conversation to FILE (JSON: [{\"role\", \"content\"}, ...])
  /load FILE     continue a conversation /save wrote
  /bye           quit (also /exit, /quit, Ctrl-D)
  //TEXT         send TEXT starting with one /";

/// A command of `quiver chat`.
#[derive(Debug, PartialEq, Eq)]
enum Command {
    Help,
    Exit,
    Clear,
    Save(String),
    Load(String),
    Unknown(String),
}

/// A line typed to `quiver chat`.
#[derive(Debug, PartialEq, Eq)]
enum ChatLine<'a> {
    Empty,
    Text(&'a str),
    Command(Command),
}

impl<'a> ChatLine<'a> {
    /// A line starting with `/` is a command (`//` sends the rest with one slash); others are
    /// the user's turn.
    fn parse(line: &'a str) -> ChatLine<'a> {
        if line.trim().is_empty() {
            return ChatLine::Empty;
        }
        let Some(rest) = line.trim_start().strip_prefix('/') else {
            return ChatLine::Text(line);
        };
        if rest.starts_with('/') {
            return ChatLine::Text(rest);
        }
        let (word, arg) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        let arg = arg.trim().to_string();
        ChatLine::Command(match (word, arg.is_empty()) {
            ("help" | "?", _) => Command::Help,
            ("bye" | "exit" | "quit", _) => Command::Exit,
            ("clear" | "reset", _) => Command::Clear,
            ("save", false) => Command::Save(arg),
            ("load", false) => Command::Load(arg),
            _ => Command::Unknown(format!("/{}", rest.trim())),
        })
    }
}

fn save_conversation(path: &str, msgs: &[Message]) -> Result<()> {
    let v: Vec<serde_json::Value> = msgs
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    std::fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
        .with_context(|| format!("writing {path}"))
}

fn load_conversation(path: &str) -> Result<Vec<Message>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let v: Vec<serde_json::Value> = serde_json::from_str(&text)
        .with_context(|| format!("{path} is not a saved conversation"))?;
    v.iter()
        .map(|m| match (m["role"].as_str(), m["content"].as_str()) {
            (Some(r @ ("system" | "user" | "assistant")), Some(c)) => Ok(Message::new(r, c)),
            _ => anyhow::bail!(
                "{path}: each message needs a role (system, user, assistant) and a content"
            ),
        })
        .collect()
}

/// Where `quiver chat` reads its turns: a line editor with history (arrows, Home/End, Ctrl-R;
/// kept in `$QUIVER_HOME/chat_history`) on a terminal, plain lines from a pipe.
enum Input {
    Editor(Box<rustyline::DefaultEditor>, Option<std::path::PathBuf>),
    Plain(std::io::Stdin),
}

impl Input {
    fn new() -> Input {
        if std::io::IsTerminal::is_terminal(&std::io::stdin()) {
            if let Ok(mut ed) = rustyline::DefaultEditor::new() {
                let hist = Some(quiver_hub::cache_dir().join("chat_history"));
                if let Some(h) = &hist {
                    let _ = ed.load_history(h);
                }
                return Input::Editor(Box::new(ed), hist);
            }
        }
        Input::Plain(std::io::stdin())
    }

    /// The next turn; None at the end of input (Ctrl-D). Ctrl-C at the prompt clears the line.
    fn line(&mut self) -> Result<Option<String>> {
        match self {
            Input::Editor(ed, hist) => loop {
                match ed.readline("> ") {
                    Ok(l) => {
                        if !l.trim().is_empty() {
                            let _ = ed.add_history_entry(l.as_str());
                            if let Some(h) = hist {
                                let _ = ed.save_history(h);
                            }
                        }
                        return Ok(Some(l));
                    }
                    Err(rustyline::error::ReadlineError::Interrupted) => continue,
                    Err(rustyline::error::ReadlineError::Eof) => return Ok(None),
                    Err(e) => return Err(anyhow::anyhow!("reading the terminal: {e}")),
                }
            },
            Input::Plain(stdin) => {
                eprint!("> ");
                let mut line = String::new();
                if stdin.lock().read_line(&mut line)? == 0 {
                    return Ok(None);
                }
                Ok(Some(line))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_lines_are_commands_or_text() {
        use ChatLine as L;
        assert_eq!(L::parse("  "), L::Empty);
        assert_eq!(L::parse("hi /there"), L::Text("hi /there"));
        assert_eq!(L::parse("//etc/hosts?"), L::Text("/etc/hosts?"));
        for (line, c) in [
            ("/help", Command::Help),
            ("/bye", Command::Exit),
            (" /exit ", Command::Exit),
            ("/clear", Command::Clear),
            ("/reset", Command::Clear),
            ("/save a b.json", Command::Save("a b.json".into())),
            ("/load x.json", Command::Load("x.json".into())),
            ("/save", Command::Unknown("/save".into())),
            ("/frob it", Command::Unknown("/frob it".into())),
        ] {
            assert_eq!(L::parse(line), L::Command(c), "{line:?}");
        }
    }

    #[test]
    fn a_saved_conversation_loads_back() {
        let p = std::env::temp_dir().join(format!("quiver-chat-{}.json", std::process::id()));
        let p = p.to_str().unwrap();
        let msgs = vec![
            Message::new("system", "be brief"),
            Message::new("user", "hi \"you\""),
        ];
        save_conversation(p, &msgs).unwrap();
        let back = load_conversation(p).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(
            (back[1].role.as_str(), back[1].content.as_str()),
            ("user", "hi \"you\"")
        );
        std::fs::write(p, r#"[{"role": "robot", "content": "x"}]"#).unwrap();
        assert!(load_conversation(p)
            .unwrap_err()
            .to_string()
            .contains("role"));
        let _ = std::fs::remove_file(p);
    }
}
