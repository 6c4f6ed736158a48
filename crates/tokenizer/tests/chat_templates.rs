//! Chat templates rendered by quiver against the same templates rendered by Python's Jinja2
//! the way Hugging Face's `apply_chat_template` sets it up (trim_blocks, lstrip_blocks, loop
//! controls, `tojson` as `json.dumps(ensure_ascii=False)`). The `.expected` files are
//! Jinja2's output.

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
