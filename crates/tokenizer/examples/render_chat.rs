//! Renders a chat template: `render_chat TEMPLATE.jinja < request.json`, where the request
//! is `{"messages": [...], "add_generation_prompt": bool, "tools": [...]?, "bos_token": "...",
//! "eos_token": "..."}`. Prints the prompt, or the error.

use quiver_tokenizer::chat::{ChatTemplate, Message};
use std::io::Read;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: render_chat TEMPLATE.jinja < request.json")?;
    let source = std::fs::read_to_string(path)?;
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input)?;
    let req: serde_json::Value = serde_json::from_str(&input)?;
    let messages: Vec<Message> = serde_json::from_value(req["messages"].clone())?;
    let s = |k: &str| req[k].as_str().unwrap_or("").to_string();
    let tmpl = ChatTemplate::from_source(&source, &s("bos_token"), &s("eos_token"))?;
    let agp = req["add_generation_prompt"].as_bool().unwrap_or(true);
    let tools = req.get("tools").filter(|t| !t.is_null());
    print!("{}", tmpl.render(&messages, agp, tools)?);
    Ok(())
}
