//! Chat templates rendered by quiver against the same templates rendered by Python's Jinja2
//! the way Hugging Face's `apply_chat_template` sets it up (trim_blocks, lstrip_blocks, loop
//! controls, `tojson` as `json.dumps(ensure_ascii=False)`). The `.expected` files are
//! Jinja2's output.

mod common;

use quiver_tokenizer::chat::{ChatTemplate, Message};
use std::path::PathBuf;

fn fixture(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn render(template: &str, request: &str) -> Result<String, quiver_tokenizer::TokenizerError> {
    let req: serde_json::Value = serde_json::from_str(&fixture(request)).unwrap();
    let messages: Vec<Message> = serde_json::from_value(req["messages"].clone()).unwrap();
    let s = |k: &str| req[k].as_str().unwrap_or("").to_string();
    let t = ChatTemplate::from_source(&fixture(template), &s("bos_token"), &s("eos_token"))?;
    t.render(
        &messages,
        req["add_generation_prompt"].as_bool().unwrap_or(true),
        req.get("tools"),
    )
}

#[test]
fn templates_render_like_jinja2() {
    for (t, r) in [
        ("gemma3", "req1"),
        ("qwen25", "req1"),
        ("qwen25", "req2"),
        ("misc", "req1"),
        ("misc", "req2"),
    ] {
        let got = render(&format!("{t}.jinja"), &format!("{r}.json")).unwrap();
        assert_eq!(got, fixture(&format!("{t}-{r}.expected")), "{t} with {r}");
    }
}

#[test]
fn raise_exception_is_an_error() {
    // Gemma's template refuses a tool turn after an assistant turn.
    let e = render("gemma3.jinja", "req2.json").unwrap_err();
    assert!(
        e.to_string().contains("Conversation roles must alternate"),
        "{e}"
    );
}

/// llama.cpp's copies of real models' templates (`models/templates/`, read from its source
/// tree) over the conversations of `fixtures/chat/llama/manifest.json`, against Jinja2's
/// output (`devtools/gen_chat_fixtures.py` writes it). A template that refuses a conversation
/// with `raise_exception` must refuse it here too, with the same message. Where Jinja2 fails
/// otherwise (`.skip`: a Python error inside the template) nothing is required.
///
/// Known differences, not checked:
/// - functionary v3.1 with tools: the template adds plain strings to `"..."|safe` strings,
///   and Python's Markup then HTML-escapes them (`"` becomes `&#34;` in the tool JSON).
///   minijinja concatenates without escaping: a Jinja2 quirk that only garbles the prompt.
const KNOWN_DIFFERENT: &[&str] = &[
    "meetkai-functionary-medium-v3.1-tools",
    "meetkai-functionary-medium-v3.1-tools-multi",
];

#[test]
fn llama_cpp_templates_render_like_jinja2() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/llama");
    let read =
        |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let manifest: serde_json::Value =
        serde_json::from_str(&read(&dir.join("manifest.json"))).expect("manifest is JSON");
    let templates = common::llama_src().join("models/templates");
    let now = manifest["now"].as_u64().expect("now");
    let requests = manifest["requests"].as_object().expect("requests");
    let mut fails = Vec::new();
    let (mut n, mut skipped) = (0, 0);
    for t in manifest["templates"].as_array().expect("templates") {
        let name = t["name"].as_str().expect("name");
        let source = read(&templates.join(t["file"].as_str().expect("file")));
        let tmpl = match ChatTemplate::from_source(
            &source,
            t["bos_token"].as_str().unwrap_or(""),
            t["eos_token"].as_str().unwrap_or(""),
        ) {
            Ok(x) => x,
            Err(e) => {
                fails.push(format!("{name}: does not compile: {e}"));
                continue;
            }
        };
        tmpl.set_clock(Some(now));
        for (req_name, req) in requests {
            n += 1;
            let messages: Vec<Message> =
                serde_json::from_value(req["messages"].clone()).expect("messages");
            let tools = req.get("tools");
            let agp = req["add_generation_prompt"]
                .as_bool()
                .expect("add_generation_prompt");
            let got = tmpl.render(&messages, agp, tools);
            let stem = format!("{name}-{req_name}");
            let expected = dir.join(format!("{stem}.expected"));
            let error = dir.join(format!("{stem}.error"));
            if dir.join(format!("{stem}.skip")).exists() || KNOWN_DIFFERENT.contains(&stem.as_str())
            {
                skipped += 1;
                continue;
            }
            match got {
                Ok(got) if expected.exists() => {
                    let want = read(&expected);
                    if got != want {
                        fails.push(format!(
                            "{stem}: differs from Jinja2\n--- want\n{want}\n--- got\n{got}\n---"
                        ));
                    }
                }
                Ok(got) if error.exists() => fails.push(format!(
                    "{stem}: Jinja2 raises {:?}, quiver rendered\n{got}",
                    read(&error)
                )),
                Err(e) if error.exists() => {
                    let want = read(&error);
                    if !e.to_string().contains(&want) {
                        fails.push(format!("{stem}: Jinja2 raises {want:?}, quiver: {e}"));
                    }
                }
                Err(e) => fails.push(format!("{stem}: {e}")),
                Ok(_) => fails.push(format!(
                    "{stem}: no fixture (run devtools/gen_chat_fixtures.py)"
                )),
            }
        }
    }
    eprintln!("{n} renders, {skipped} skipped, {} differ", fails.len());
    assert!(
        n - skipped >= 300,
        "only {} template renders checked",
        n - skipped
    );
    assert!(
        fails.is_empty(),
        "{} of {n} renders differ:\n{}",
        fails.len(),
        fails.join("\n")
    );
}
