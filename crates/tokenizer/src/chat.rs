//! Chat templates: `tokenizer.chat_template` rendered with minijinja the way Hugging Face
//! renders it (`trim_blocks`, `lstrip_blocks`, Python string methods, `raise_exception`,
//! Python-style `tojson`), and built-in formats for files without a template.
//!
//! Built-ins follow llama.cpp's: ChatML, and Gemma's `<start_of_turn>` turns with system
//! prompts folded into the first user turn. They leave BOS out, since the prompt is then
//! tokenized with `add_special = true`. `--chat-template NAME` also takes Jinja built-ins for
//! the other families quiver runs (llama3, mistral, mistral-v7, mistral-v7-tekken, phi3, qwen),
//! with tools where the family has a call format quiver reads.

use crate::{chat_py, TokenizerError};
use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, Value};
use quiver_gguf::GgufFile;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// `ChatTemplate::clock` value that means "read the system clock".
const REAL_CLOCK: u64 = u64::MAX;

/// One chat message. Fields that are `None` are absent from the template's view.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant turn's thinking, given back apart from its content (thinking models'
    /// templates, Qwen 3's, place it in the turns that need it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            ..Message::default()
        }
    }
}

/// Formats built into quiver for models whose file has no template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Builtin {
    /// `<|im_start|>role\ncontent<|im_end|>\n`
    ChatMl,
    /// `<start_of_turn>user\ncontent<end_of_turn>\n`, assistant as `model`.
    Gemma,
}

enum Inner {
    Jinja(Box<Environment<'static>>),
    Builtin(Builtin),
}

/// A chat template ready to render.
pub struct ChatTemplate {
    inner: Inner,
    source: Option<String>,
    bos_token: String,
    eos_token: String,
    /// What `strftime_now` reads: Unix seconds, or `REAL_CLOCK`.
    clock: Arc<AtomicU64>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Jinja(_) => f
                .debug_struct("ChatTemplate")
                .field("source_len", &self.source.as_ref().map(String::len))
                .finish(),
            Inner::Builtin(b) => f.debug_struct("ChatTemplate").field("builtin", b).finish(),
        }
    }
}

const TEMPLATE_NAME: &str = "chat_template";

fn template_error(e: Error) -> TokenizerError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    TokenizerError::Template(msg)
}

impl ChatTemplate {
    /// The file's `tokenizer.chat_template`, if it has one. `bos_token` / `eos_token` are the
    /// texts of the file's BOS and EOS tokens.
    pub fn from_gguf(f: &GgufFile) -> Result<Option<ChatTemplate>, TokenizerError> {
        let Some(source) = f.get_str("tokenizer.chat_template")? else {
            return Ok(None);
        };
        let (bos, eos) = special_texts(f)?;
        ChatTemplate::from_source(source, &bos, &eos).map(Some)
    }

    /// The file's template, or the built-in one for its architecture.
    pub fn for_model(f: &GgufFile) -> Result<ChatTemplate, TokenizerError> {
        match ChatTemplate::from_gguf(f)? {
            Some(t) => Ok(t),
            None => {
                let mut t = ChatTemplate::builtin(f.arch()?);
                (t.bos_token, t.eos_token) = special_texts(f)?;
                Ok(t)
            }
        }
    }

    /// A chat template given by the user (`--chat-template`, `--chat-template-file`) for the
    /// model in `f`: Jinja source, or the name of a built-in format ([`BUILTIN_NAMES`]).
    pub fn user(f: &GgufFile, template: &str) -> Result<ChatTemplate, TokenizerError> {
        let (bos, eos) = special_texts(f)?;
        ChatTemplate::named(template, &bos, &eos)
    }

    /// Jinja source, or the name of a built-in format ([`BUILTIN_NAMES`]), with these BOS and
    /// EOS texts.
    pub fn named(template: &str, bos: &str, eos: &str) -> Result<ChatTemplate, TokenizerError> {
        let mut t = match template {
            "chatml" => ChatTemplate::builtin("chatml"),
            "gemma" => ChatTemplate::builtin("gemma"),
            src if ChatTemplate::is_source(src) => return ChatTemplate::from_source(src, bos, eos),
            name => match builtin_source(name) {
                Some(src) => return ChatTemplate::from_source(&src, bos, eos),
                None => {
                    return Err(TokenizerError::Template(format!(
                        "unknown chat template {name:?}: give Jinja source (or a file with \
                         --chat-template-file), or a built-in name: {}",
                        BUILTIN_NAMES.join(", ")
                    )))
                }
            },
        };
        (t.bos_token, t.eos_token) = (bos.to_string(), eos.to_string());
        Ok(t)
    }

    /// Whether `s` is Jinja source rather than a template's name.
    pub fn is_source(s: &str) -> bool {
        s.contains("{{") || s.contains("{%")
    }

    /// Compiles a Jinja chat template. A syntax error is reported here.
    pub fn from_source(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("raise_exception: {msg}"),
            ))
        });
        let clock = Arc::new(AtomicU64::new(REAL_CLOCK));
        let now = clock.clone();
        env.add_function("strftime_now", move |fmt: String| -> Result<Value, Error> {
            Ok(Value::from(match now.load(Ordering::Relaxed) {
                REAL_CLOCK => strftime_now(&fmt),
                secs => strftime(secs, &fmt),
            }))
        });
        env.add_filter("tojson", chat_py::tojson);
        // Python's str(): `{{ x }}` and `x|string` print None, True, lists and dicts as
        // Python does.
        env.set_formatter(|out, _state, v| match chat_py::py_str(v) {
            Some(s) => out.write_str(&s).map_err(Error::from),
            None => minijinja::escape_formatter(out, _state, v),
        });
        env.add_filter("string", |v: Value| match chat_py::py_str(&v) {
            Some(s) => Value::from(s),
            None if v.is_undefined() => Value::from(""),
            None => Value::from(v.to_string()),
        });
        // Python: None (and numbers, booleans) cannot be iterated; minijinja iterates none as
        // an empty sequence. Undefined stays iterable, as Jinja2's Undefined is.
        env.add_test("iterable", |v: &Value| match v.kind() {
            ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
            ValueKind::Undefined => true,
            _ => v.try_iter().is_ok(),
        });
        env.add_template_owned(TEMPLATE_NAME, chat_py::rewrite_generation_tags(source))
            .map_err(template_error)?;
        Ok(ChatTemplate {
            inner: Inner::Jinja(Box::new(env)),
            source: Some(source.to_string()),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            clock,
        })
    }

    /// The built-in format for an architecture: Gemma's for `gemma*`, ChatML otherwise.
    pub fn builtin(arch: &str) -> ChatTemplate {
        let b = if arch.starts_with("gemma") {
            Builtin::Gemma
        } else {
            Builtin::ChatMl
        };
        ChatTemplate {
            inner: Inner::Builtin(b),
            source: None,
            bos_token: String::new(),
            eos_token: String::new(),
            clock: Arc::new(AtomicU64::new(REAL_CLOCK)),
        }
    }

    /// Makes `strftime_now` read a fixed time (Unix seconds, UTC) instead of the clock, for
    /// reproducible prompts; `None` goes back to the clock.
    pub fn set_clock(&self, unix_secs: Option<u64>) {
        let v = unix_secs.map_or(REAL_CLOCK, |s| s.min(REAL_CLOCK - 1));
        self.clock.store(v, Ordering::Relaxed);
    }

    /// The Jinja source, for templates that came from a file or string.
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }

    /// Which built-in format this is, if it is one.
    pub fn builtin_kind(&self) -> Option<Builtin> {
        match self.inner {
            Inner::Builtin(b) => Some(b),
            Inner::Jinja(_) => None,
        }
    }

    /// Renders a conversation. `add_generation_prompt` opens the assistant's turn; `tools`
    /// (a JSON array of tool definitions) is passed to templates that use it.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        self.render_with(messages, add_generation_prompt, tools, None)
    }

    /// [`ChatTemplate::render`] with more variables for the template (`chat_template_kwargs`,
    /// such as Qwen 3's `enable_thinking`); the built-in formats take none. The standard ones
    /// (`messages`, `tools`, `add_generation_prompt`, the BOS and EOS texts) win over them.
    pub fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, TokenizerError> {
        match &self.inner {
            Inner::Builtin(Builtin::ChatMl) => Ok(render_chatml(messages, add_generation_prompt)),
            Inner::Builtin(Builtin::Gemma) => Ok(render_gemma(messages, add_generation_prompt)),
            Inner::Jinja(env) => {
                let tmpl = env.get_template(TEMPLATE_NAME).map_err(template_error)?;
                let mut ctx = kwargs.cloned().unwrap_or_default();
                ctx.insert(
                    "messages".into(),
                    serde_json::to_value(messages)
                        .map_err(|e| TokenizerError::Template(e.to_string()))?,
                );
                ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
                ctx.insert("bos_token".into(), self.bos_token.clone().into());
                ctx.insert("eos_token".into(), self.eos_token.clone().into());
                // Like Hugging Face's apply_chat_template, `tools` is always defined: none when
                // absent (templates test `tools is not none`).
                ctx.insert(
                    "tools".into(),
                    tools.cloned().unwrap_or(serde_json::Value::Null),
                );
                tmpl.render(Value::from_serialize(&ctx))
                    .map_err(template_error)
            }
        }
    }
}

impl ChatTemplate {
    /// Renders a conversation and tokenizes it for `tok`: special tokens come only from the
    /// template; the messages' text (content, role, names, tool calls) and the tool
    /// definitions are tokenized as plain text even where they spell a control token.
    pub fn tokenize(
        &self,
        tok: &crate::Tokenizer,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.tokenize_with(tok, messages, add_generation_prompt, tools, None, None)
    }

    /// [`ChatTemplate::tokenize`] with the template's extra variables (`kwargs`) and, with
    /// `prefill`, the start of the assistant's answer: the turn is opened (the generation
    /// prompt) and `prefill` follows it as plain text, for the model to continue.
    pub fn tokenize_with(
        &self,
        tok: &crate::Tokenizer,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
        prefill: Option<&str>,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut g = crate::guard::Guard::default();
        let messages = messages
            .iter()
            .map(|m| g.protect_message(tok, m))
            .collect::<Result<Vec<_>, _>>()?;
        let tools = match tools {
            Some(t) => {
                let mut t = t.clone();
                g.protect_json(tok, &mut t)?;
                Some(t)
            }
            None => None,
        };
        let agp = add_generation_prompt || prefill.is_some();
        let mut text = self.render_with(&messages, agp, tools.as_ref(), kwargs)?;
        if let Some(p) = prefill {
            text.push_str(&g.protect(tok, p)?);
        }
        tok.encode_chat_guarded(&text, Some(&g))
    }
}

/// Texts of the BOS and EOS tokens as the tokenizer resolves them ("" where there is none).
fn special_texts(f: &GgufFile) -> Result<(String, String), TokenizerError> {
    let model = f.get_str("tokenizer.ggml.model")?.unwrap_or("");
    let (bos, eos) = match model {
        "llama" => (Some(1), Some(2)),
        "gpt2" => (Some(11), Some(11)),
        _ => (None, None),
    };
    let bos = f
        .get_u32("tokenizer.ggml.bos_token_id")
        .ok()
        .flatten()
        .or(bos);
    let eos = f
        .get_u32("tokenizer.ggml.eos_token_id")
        .ok()
        .flatten()
        .or(eos);
    let tokens = f
        .get_array("tokenizer.ggml.tokens")?
        .and_then(|a| a.as_strings());
    let text = |id: Option<u32>| {
        id.and_then(|i| tokens.and_then(|t| t.get(i as usize)))
            .cloned()
            .unwrap_or_default()
    };
    Ok((text(bos), text(eos)))
}

/// The names `--chat-template` takes for built-in formats.
pub const BUILTIN_NAMES: &[&str] = &[
    "llama3",
    "mistral",
    "mistral-v3",
    "mistral-v7",
    "mistral-v7-tekken",
    "phi3",
    "qwen",
    "gemma",
    "chatml",
];

/// The Jinja source of a built-in format (not chatml and gemma, which render in Rust).
fn builtin_source(name: &str) -> Option<String> {
    Some(match name {
        "llama3" => LLAMA3.to_string(),
        "mistral" | "mistral-v3" => MISTRAL_V3.to_string(),
        // v7 puts a space after each opening tag; the Tekken vocabularies' form (Mistral Small
        // 3.x, Ministral 3) does not.
        "mistral-v7" => format!("{{%- set sp = ' ' -%}}\n{MISTRAL_V7}"),
        "mistral-v7-tekken" => format!("{{%- set sp = '' -%}}\n{MISTRAL_V7}"),
        "phi3" => PHI3.to_string(),
        "qwen" => QWEN.to_string(),
        _ => return None,
    })
}

/// Llama 3.x: header-delimited turns, each ended by `<|eot_id|>`; tools go into the system
/// turn and a call is the bare JSON `{"name", "parameters"}`; tool results are `ipython`
/// turns.
const LLAMA3: &str = r#"
{%- if messages and messages[0].role == 'system' -%}
  {%- set system = messages[0].content | trim -%}
  {%- set turns = messages[1:] -%}
{%- else -%}
  {%- set system = '' -%}
  {%- set turns = messages -%}
{%- endif -%}
{%- if system or tools -%}
  {{- '<|start_header_id|>system<|end_header_id|>\n\n' + system -}}
  {%- if tools -%}
    {{- ('\n\n' if system else '') + 'These functions are available. To call one, reply with nothing but a JSON object {"name": the name of the function, "parameters": an object of its arguments}.' -}}
    {%- for t in tools -%}{{- '\n\n' + (t | tojson) -}}{%- endfor -%}
  {%- endif -%}
  {{- '<|eot_id|>' -}}
{%- endif -%}
{%- for m in turns -%}
  {{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\n\n' -}}
  {%- if m.tool_calls -%}
    {%- for c in m.tool_calls -%}
      {%- set f = c.function if c.function is defined else c -%}
      {{- ('\n' if not loop.first else '') + '{"name": ' + (f.name | tojson) + ', "parameters": ' + (f.arguments | tojson) + '}' -}}
    {%- endfor -%}
  {%- else -%}
    {{- m.content | trim -}}
  {%- endif -%}
  {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"#;

/// Mistral 7B Instruct (v3 spacing): `[INST] … [/INST]` around user turns, the system text
/// folded into the first one, answers ended by EOS; tools listed before the last user turn in
/// `[AVAILABLE_TOOLS]`, calls as `[TOOL_CALLS] [{"name", "arguments"}]`, results in
/// `[TOOL_RESULTS]`.
const MISTRAL_V3: &str = r#"
{%- set ns = namespace(system='', last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = ns.system + m.content + '\n\n' -%}{%- endif -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
    {%- if tools and loop.index0 == ns.last_user -%}
      {{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}
    {%- endif -%}
    {{- '[INST] ' + ns.system + m.content + '[/INST]' -}}
    {%- set ns.system = '' -%}
  {%- elif m.role == 'assistant' and m.tool_calls -%}
    {{- '[TOOL_CALLS] [' -}}
    {%- for c in m.tool_calls -%}
      {%- set f = c.function if c.function is defined else c -%}
      {{- (', ' if not loop.first else '') + '{"name": ' + (f.name | tojson) + ', "arguments": ' + (f.arguments | tojson) + '}' -}}
    {%- endfor -%}
    {{- ']' + eos_token -}}
  {%- elif m.role == 'assistant' -%}
    {{- ' ' + (m.content | trim) + eos_token -}}
  {%- elif m.role == 'tool' -%}
    {{- '[TOOL_RESULTS] ' + ({'content': m.content} | tojson) + '[/TOOL_RESULTS]' -}}
  {%- endif -%}
{%- endfor -%}
"#;

/// Mistral v7 (Mistral Large 2411, Small 3.x, Ministral 3): `[SYSTEM_PROMPT]` turns of their
/// own, `[INST] … [/INST]`, answers ended by EOS; `sp` (set before it) is the space after each
/// opening tag. Tools and calls as in v3, without the spaces.
const MISTRAL_V7: &str = r#"
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    {{- '[SYSTEM_PROMPT]' + sp + m.content + '[/SYSTEM_PROMPT]' -}}
  {%- elif m.role == 'user' -%}
    {%- if tools and loop.index0 == ns.last_user -%}
      {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}
    {%- endif -%}
    {{- '[INST]' + sp + m.content + '[/INST]' -}}
  {%- elif m.role == 'assistant' and m.tool_calls -%}
    {{- '[TOOL_CALLS][' -}}
    {%- for c in m.tool_calls -%}
      {%- set f = c.function if c.function is defined else c -%}
      {{- (', ' if not loop.first else '') + '{"name": ' + (f.name | tojson) + ', "arguments": ' + (f.arguments | tojson) + '}' -}}
    {%- endfor -%}
    {{- ']' + eos_token -}}
  {%- elif m.role == 'assistant' -%}
    {{- sp + m.content + eos_token -}}
  {%- elif m.role == 'tool' -%}
    {{- '[TOOL_RESULTS]' + ({'content': m.content} | tojson) + '[/TOOL_RESULTS]' -}}
  {%- endif -%}
{%- endfor -%}
"#;

/// Phi-3 / 3.5 and Phi-4-mini: `<|role|>\n` turns ended by `<|end|>\n`.
const PHI3: &str = r#"
{%- for m in messages -%}
  {{- '<|' + m.role + '|>\n' + m.content + '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}
"#;

/// Qwen 2 / 2.5 (and QwQ, Qwen 3 without thinking): ChatML, with tools described in the
/// system turn inside `<tools>`, calls as `<tool_call>` JSON, results as `<tool_response>` in
/// a user turn (consecutive results share one).
const QWEN: &str = r#"
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages and messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou may call functions to answer. Their signatures are inside <tools></tools>:\n<tools>' -}}
  {%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nTo call one, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'system' and loop.first -%}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content -}}
    {%- for c in (m.tool_calls or []) -%}
      {%- set f = c.function if c.function is defined else c -%}
      {{- ('\n' if m.content or not loop.first else '') + '<tool_call>\n{"name": ' + (f.name | tojson) + ', "arguments": ' + (f.arguments | tojson) + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"#;

fn render_chatml(messages: &[Message], add_generation_prompt: bool) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m.role, m.content
        ));
    }
    if add_generation_prompt {
        s.push_str("<|im_start|>assistant\n");
    }
    s
}

fn render_gemma(messages: &[Message], add_generation_prompt: bool) -> String {
    let mut s = String::new();
    let mut system = String::new();
    for m in messages {
        if m.role == "system" {
            system.push_str(m.content.trim());
            continue;
        }
        let role = if m.role == "assistant" {
            "model"
        } else {
            m.role.as_str()
        };
        s.push_str("<start_of_turn>");
        s.push_str(role);
        s.push('\n');
        if !system.is_empty() && role != "model" {
            s.push_str(&system);
            s.push_str("\n\n");
            system.clear();
        }
        s.push_str(m.content.trim());
        s.push_str("<end_of_turn>\n");
    }
    if add_generation_prompt {
        s.push_str("<start_of_turn>model\n");
    }
    s
}

/// `strftime` on the current UTC time, for the specifiers chat templates use.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(secs, fmt)
}

fn strftime(unix_secs: u64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    let (h, mi, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Civil date from days since 1970-01-01 (proleptic Gregorian, 400-year eras).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let (month, weekday) = (
        MONTHS[(m - 1) as usize],
        DAYS[(days.rem_euclid(7)) as usize],
    );
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('-') if chars.clone().next() == Some('d') => {
                chars.next();
                out.push_str(&d.to_string());
            }
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv() -> Vec<Message> {
        vec![
            Message::new("system", "Be brief."),
            Message::new("user", "Hi!"),
            Message::new("assistant", "Hello. "),
            Message::new("user", "What is 2+2?"),
        ]
    }

    #[test]
    fn gemma_builtin() {
        let t = ChatTemplate::builtin("gemma3");
        assert_eq!(t.builtin_kind(), Some(Builtin::Gemma));
        assert_eq!(
            t.render(&conv(), true, None).unwrap(),
            "<start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn template_kwargs_reach_the_template() {
        let src = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{{ messages | length }}{{ add_generation_prompt }}";
        let t = ChatTemplate::from_source(src, "<s>", "</s>").unwrap();
        assert_eq!(t.render(&conv(), true, None).unwrap(), "4True");
        let kw = serde_json::json!({"enable_thinking": false, "add_generation_prompt": false});
        assert_eq!(
            t.render_with(&conv(), true, None, kw.as_object()).unwrap(),
            "<think></think>4True"
        );
    }

    #[test]
    fn reasoning_content_reaches_the_template() {
        let src = "{% for m in messages %}{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|{% endfor %}";
        let t = ChatTemplate::from_source(src, "<s>", "</s>").unwrap();
        let mut a = Message::new("assistant", "4.");
        a.reasoning_content = Some("2+2".into());
        let out = t
            .render(&[Message::new("user", "2+2?"), a], false, None)
            .unwrap();
        assert_eq!(out, "2+2?|<think>2+2</think>4.|");
    }

    #[test]
    fn chatml_builtin() {
        let t = ChatTemplate::builtin("llama");
        assert_eq!(
            t.render(&conv()[1..2], true, None).unwrap(),
            "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            ChatTemplate::builtin("some-new-arch").builtin_kind(),
            Some(Builtin::ChatMl)
        );
    }

    #[test]
    fn jinja_features() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.role | upper }}:{{ m.content.strip() }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}>{% endif %}";
        let t = ChatTemplate::from_source(src, "<s>", "</s>").unwrap();
        let mut m = Message::new("assistant", " x ");
        m.tool_calls = Some(serde_json::json!([{"name": "f", "arguments": {"a": 1, "b": "é"}}]));
        let tools = serde_json::json!([{"type": "function"}]);
        assert_eq!(
            t.render(&[Message::new("user", " hi "), m], true, Some(&tools)).unwrap(),
            // trim_blocks eats the newline after each block tag, as in Hugging Face's renderer.
            "<s>USER:hiASSISTANT:x[{\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\": \"é\"}}][{\"type\": \"function\"}]>"
        );
    }

    #[test]
    fn errors_are_errors() {
        let e = ChatTemplate::from_source("{% for m in messages %}", "", "").unwrap_err();
        assert!(matches!(e, TokenizerError::Template(_)), "{e}");
        let t = ChatTemplate::from_source("{{ raise_exception('roles must alternate') }}", "", "")
            .unwrap();
        let e = t.render(&[], false, None).unwrap_err();
        assert!(e.to_string().contains("roles must alternate"), "{e}");
        let t = ChatTemplate::from_source("{{ messages[0].content.no_such_method() }}", "", "")
            .unwrap();
        assert!(t.render(&[Message::new("user", "x")], false, None).is_err());
    }

    #[test]
    fn json_and_dates() {
        let v = serde_json::json!({"a": [1, 2], "b": {}});
        let mut s = String::new();
        chat_py::write_json(&v, &chat_py::JsonStyle::python(Some(2)), 0, &mut s);
        assert_eq!(s, "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {}\n}");
        // 2024-03-15 14:30:05 UTC was a Friday.
        assert_eq!(
            strftime(1_710_513_005, "%d %b %Y %H:%M:%S %A %-d%%"),
            "15 Mar 2024 14:30:05 Friday 15%"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
    }
}
