//! `quiver run` and `quiver chat`.

use crate::engine::{self, LoadArgs};
use anyhow::{bail, Context, Result};
use quiver_engine::{generate, FinishReason, GenOptions, Sampler, SamplerParams};
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

fn unit(s: &str) -> Result<f32, String> {
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

pub fn run(
    load: &LoadArgs,
    s: &SampleArgs,
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
    let mut l = engine::load(load, gguf, 1)?;
    let mut sampler = Sampler::new(s.params());
    let opts = GenOptions {
        max_tokens: s.n_predict as usize,
        ..Default::default()
    };
    let mut out = std::io::stdout().lock();
    let g = generate(
        l.runner.as_mut(),
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

pub fn chat(load: &LoadArgs, s: &SampleArgs, system: Option<String>) -> Result<()> {
    let gguf = engine::open(load)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let tmpl = ChatTemplate::for_model(&gguf)?;
    let mut l = engine::load(load, gguf, 1)?;
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
    eprintln!("quiver chat: /reset clears the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer");
    loop {
        let Some(line) = input.line()? else {
            break;
        };
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "/exit" | "/quit" => break,
            "/reset" => {
                msgs.retain(|m| m.role == "system");
                cached.clear();
                eprintln!("(conversation cleared)");
                continue;
            }
            "" => continue,
            _ => {}
        }
        msgs.push(Message::new("user", line));
        let ids = tmpl.tokenize(&tok, &msgs, true, None)?;
        let keep = cached
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len() - 1);
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
        let g = generate(
            l.runner.as_mut(),
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
    Ok(())
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
