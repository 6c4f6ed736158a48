//! Tool-call formats, grammars and parses (`super`), checked on made-up vocabularies and texts.

use super::*;

fn tools(format: Format, choice: Value) -> Tools {
    let m = json!({
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}}
        ],
        "tool_choice": choice,
    });
    Tools::parse(m.as_object().unwrap(), format)
        .unwrap()
        .unwrap()
}

#[test]
fn formats_follow_the_template() {
    assert_eq!(
        Format::of_template(Some("{{ '<tool_call>\\n' }}")),
        Format::Hermes
    );
    assert_eq!(Format::of_template(Some("[TOOL_CALLS]")), Format::Mistral);
    assert_eq!(Format::of_template(Some("<|python_tag|>")), Format::Llama3);
    assert_eq!(Format::of_template(None), Format::Hermes);
    assert_eq!(
        Format::of_template(Some("{{'<｜tool▁calls▁begin｜>'}}")),
        Format::DeepSeek
    );
}

#[test]
fn calls_are_parsed_in_each_format() {
    let t = tools(Format::Hermes, json!("auto"));
    let (c, calls) = t
        .extract("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"get_time\",\"arguments\":{}}\n</tool_call>")
        .unwrap();
    assert_eq!(c, "Let me check.");
    assert_eq!(
        calls,
        vec![
            ("get_weather".into(), "{\"city\":\"Paris\"}".into()),
            ("get_time".into(), "{}".into())
        ]
    );
    assert!(t.extract("Just text, no call.").is_none());
    let t = tools(Format::Mistral, json!("auto"));
    let (_, calls) = t
        .extract("[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}}]")
        .unwrap();
    assert_eq!(calls[0].0, "get_time");
    let t = tools(Format::Llama3, json!("auto"));
    let (_, calls) = t
        .extract("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}")
        .unwrap();
    assert_eq!(
        calls[0],
        ("get_weather".into(), "{\"city\":\"Oslo\"}".into())
    );
    // DeepSeek R1, as llama.cpp's test-chat.cpp has it (one ``` closing the block), and
    // V3.1's form with two calls.
    let t = tools(Format::DeepSeek, json!("auto"));
    let (c, calls) = t
        .extract("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Rome\"}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
        .unwrap();
    assert_eq!(
        (c.as_str(), &calls[..]),
        (
            "Sure.",
            &[("get_weather".to_string(), "{\"city\":\"Rome\"}".to_string())][..]
        )
    );
    let (_, calls) = t
        .extract("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\":\"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
        .unwrap();
    assert_eq!(
        calls.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
        ["get_time", "get_weather"]
    );
    assert!(tools(Format::Hermes, json!("none"))
        .extract("<tool_call>{\"name\":\"get_time\",\"arguments\":{}}</tool_call>")
        .is_none());
}

#[test]
fn choices_and_their_grammars() {
    assert!(tools(Format::Hermes, json!("auto")).constraint().is_none());
    let Some(ConstraintSpec::JsonLark(g)) = tools(
        Format::Hermes,
        json!({"type": "function", "function": {"name": "get_time"}}),
    )
    .constraint() else {
        panic!()
    };
    assert!(g.contains("get_time") && !g.contains("get_weather"), "{g}");
    let m = json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}});
    let e = Tools::parse(m.as_object().unwrap(), Format::Hermes)
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"g\""), "{e}");
    let m = json!({"tool_choice": "required"});
    assert!(Tools::parse(m.as_object().unwrap(), Format::Hermes).is_err());
}

#[test]
fn calls_cut_short_keep_the_whole_ones() {
    let w = (
        "get_weather".to_string(),
        "{\"city\":\"Paris\"}".to_string(),
    );
    let t = tools(Format::Hermes, json!("auto"));
    let two = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_ti";
    assert_eq!(t.extract(two), Some(("Sure.".into(), vec![w.clone()])));
    // Only a cut call: no calls, and its text is not content.
    assert_eq!(
        t.extract("Hi <tool_call>\n{\"name\": \"get"),
        Some(("Hi".into(), vec![]))
    );
    // Unclosed but whole (the model ended there): kept.
    let (_, c) = t
        .extract("<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}")
        .unwrap();
    assert_eq!(c, vec![w.clone()]);
    // A closed call that is not JSON is not a call: the text stays content.
    assert!(t.extract("<tool_call>{oops</tool_call>").is_none());
    let t = tools(Format::Mistral, json!("auto"));
    assert_eq!(
        t.extract("[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_"),
        Some((String::new(), vec![w.clone()]))
    );
    assert_eq!(t.extract("[TOOL_CALLS]"), Some((String::new(), vec![])));
    let t = tools(Format::Llama3, json!("auto"));
    assert_eq!(
        t.extract("{\"name\": \"get_weather\", \"parameters\": {\"ci"),
        Some((String::new(), vec![]))
    );
    assert!(t.extract("{not a call").is_none());
    let t = tools(Format::DeepSeek, json!("auto"));
    let ds = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{";
    assert_eq!(t.extract(ds), Some((String::new(), vec![w])));
}

#[test]
fn forced_calls_follow_the_templates_forms() {
    let cat = json!({
        "tools": [{"type": "function", "function": {"name": "Cat", "strict": true, "parameters": {
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]}}}],
        "tool_choice": "required",
    });
    let grammar = |format| {
        let t = Tools::parse(cat.as_object().unwrap(), format)
            .unwrap()
            .unwrap();
        match t.constraint() {
            Some(ConstraintSpec::JsonLark(g) | ConstraintSpec::Lark(g)) => g,
            other => panic!("{other:?}"),
        }
    };
    // The parameters are closed: the schema lists the only keys.
    let g = grammar(Format::Hermes);
    let schema = g
        .lines()
        .find_map(|l| l.strip_prefix("call: %json "))
        .unwrap();
    let schema: Value = serde_json::from_str(schema).unwrap();
    let args = &schema["anyOf"][0]["properties"]["arguments"];
    assert_eq!(args["additionalProperties"], json!(false), "{g}");
    // Parallel calls: Qwen's newline between blocks, R1's newline between calls.
    assert!(
        g.contains("(\"\\n<tool_call>\\n\" call \"\\n</tool_call>\")*"),
        "{g}"
    );
    assert!(grammar(Format::DeepSeek).contains("(\"\\n\" call)*"));
    // JSON spaced as the templates' tojson writes it.
    assert!(g.contains("\"item_separator\":\", \""), "{g}");
    assert!(grammar(Format::Mistral).contains("\"key_separator\":\": \""));
}

/// Every `$ref` in the grammar's JSON schemas resolves from its schema's root.
#[test]
fn definitions_resolve_in_forced_calls() {
    let params = |defs: &str| {
        json!({
            "type": "object",
            "properties": {"place": {"$ref": format!("#/{defs}/Place")}},
            "required": ["place"],
            defs: {
                "Place": {"type": "object", "properties": {"unit": {"$ref": format!("#/{defs}/Unit")}}, "required": ["unit"]},
                "Unit": {"enum": ["C", "F"]},
            },
        })
    };
    fn check_refs(v: &Value, root: &Value, n: &mut usize) {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get("$ref") {
                    assert!(root.pointer(&r[1..]).is_some(), "{r} in {root}");
                    *n += 1;
                }
                o.values().for_each(|x| check_refs(x, root, n));
            }
            Value::Array(a) => a.iter().for_each(|x| check_refs(x, root, n)),
            _ => {}
        }
    }
    for format in [
        Format::Hermes,
        Format::Mistral,
        Format::Llama3,
        Format::DeepSeek,
    ] {
        for defs in ["$defs", "definitions"] {
            let m = json!({
                "tools": [
                    {"type": "function", "function": {"name": "a", "parameters": params(defs)}},
                    {"type": "function", "function": {"name": "b", "parameters": params(defs)}},
                ],
                "tool_choice": "required",
            });
            let t = Tools::parse(m.as_object().unwrap(), format)
                .unwrap()
                .unwrap();
            let Some(ConstraintSpec::JsonLark(g)) = t.constraint() else {
                panic!()
            };
            let mut n = 0;
            for line in g.lines() {
                if let Some((_, schema)) = line.split_once("%json ") {
                    let root: Value = serde_json::from_str(schema).unwrap();
                    check_refs(&root, &root, &mut n);
                }
            }
            assert!(n >= 4, "{format:?} {defs}: {n} references in {g}");
        }
    }
    // Gemma 4's own syntax: the referenced enum shapes the value.
    let m = json!({
        "tools": [{"type": "function", "function": {"name": "a", "parameters": params("$defs")}}],
        "tool_choice": "required",
    });
    let t = Tools::parse(m.as_object().unwrap(), Format::Gemma4)
        .unwrap()
        .unwrap();
    let Some(ConstraintSpec::Lark(g)) = t.constraint() else {
        panic!()
    };
    assert!(g.contains("\"C\"") && g.contains("\"unit:\""), "{g}");
}

use quiver_engine::constraint::{special_word, Grammars};

/// A made-up vocabulary of single bytes (all but 0xFF, which UTF-8 never holds and which marks
/// the special token): the tokens of `text`, one by one, through the grammar; Err at the first
/// it refuses.
fn follows(spec: &ConstraintSpec, text: &str) -> Result<(), String> {
    let mut words: Vec<Vec<u8>> = (0u8..255).map(|b| vec![b]).collect();
    words.push(special_word(255));
    let g = Grammars::from_words(&words, vec![255], 255, None).unwrap();
    let mut c = g.constraint(spec)?;
    for (i, b) in text.bytes().enumerate() {
        let bits = c.next_mask(words.len())?;
        if bits[b as usize / 32] & (1 << (b % 32)) == 0 {
            return Err(format!(
                "refused at {i}: {:?}",
                String::from_utf8_lossy(&text.as_bytes()[..=i])
            ));
        }
        c.commit(b as u32)?;
    }
    Ok(())
}

#[test]
fn auto_calls_follow_the_schemas_after_the_marker() {
    let m = json!({"tools": [{"type": "function", "function": {"name": "Cat", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]}}}]});
    let t = Tools::parse(m.as_object().unwrap(), Format::Hermes)
        .unwrap()
        .unwrap();
    let spec = t.auto_constraint(None).unwrap();
    follows(&spec, "Just text, with <b>tags</b> and { braces }.").unwrap();
    // Digits are free in the text, bounded in the call.
    follows(&spec, "Call 12345678901234567890.").unwrap();
    let long = "<tool_call>\n{\"name\": \"Cat\", \"arguments\": {\"name\": \"Tom\", \"age\": 12345678901234567";
    let e = follows(&spec, long).unwrap_err();
    assert!(e.ends_with("4567\""), "{e}");
    follows(&spec, "Sure.\n<tool_call>\n{\"name\": \"Cat\", \"arguments\": {\"name\": \"Tom\", \"age\": 3}}\n</tool_call>").unwrap();
    let e = follows(&spec, "<tool_call>\n{\"name\": \"Tom\"").unwrap_err();
    assert!(e.contains("refused"), "{e}");
    let e = follows(
        &spec,
        "<tool_call>\n{\"name\": \"Cat\", \"arguments\": {\"name\": \"Tom\", \"age\": 3, \"x",
    )
    .unwrap_err();
    assert!(e.contains("refused"), "{e}");
    let t = Tools::parse(m.as_object().unwrap(), Format::Mistral)
        .unwrap()
        .unwrap();
    follows(
        &t.auto_constraint(None).unwrap(),
        "[TOOL_CALLS][{\"name\": \"Cat\", \"arguments\": {\"name\": \"Tom\", \"age\": 3}}]",
    )
    .unwrap();
    let t = Tools::parse(m.as_object().unwrap(), Format::Gemma4)
        .unwrap()
        .unwrap();
    let spec = t.auto_constraint(None).unwrap();
    follows(&spec, "Sure.<|tool_call>call:Cat{name:<|\"|>Tom<|\"|>,age:3}<tool_call|><|tool_call>call:Cat{name:<|\"|>Al<|\"|>,age:4}<tool_call|>").unwrap();
    follows(&spec, "No call, just call: text.").unwrap();
    assert!(follows(&spec, "<|tool_call>call:Dog{").is_err());
    assert!(follows(&spec, "<|tool_call>call:Cat{name:<|\"|>Tom<|\"|>,age:3,x").is_err());
    let t = Tools::parse(m.as_object().unwrap(), Format::Llama3)
        .unwrap()
        .unwrap();
    assert!(t.auto_constraint(None).is_none());
    // A thinking model: a marker in its thinking is not a call; after it, it is.
    let t = Tools::parse(m.as_object().unwrap(), Format::Hermes)
        .unwrap()
        .unwrap();
    let th = |prompt_opened| {
        Some(Thinking {
            tags: crate::reasoning::THINK,
            prompt_opened,
            calls: None,
        })
    };
    let spec = t.auto_constraint(th(false)).unwrap();
    follows(
        &spec,
        "<think>I could write <tool_call> here.</think>\n\nNo call.",
    )
    .unwrap();
    follows(&spec, "<think>Plan.</think><tool_call>\n{\"name\": \"Cat\", \"arguments\": {\"name\": \"Tom\", \"age\": 3}}\n</tool_call>").unwrap();
    follows(&spec, "No thinking at all.").unwrap();
    assert!(follows(&spec, "<think>x</think><tool_call>\n{\"name\": \"Dog\"").is_err());
    // The prompt opened the thinking (DeepSeek R1's): the answer starts inside it.
    let spec = t.auto_constraint(th(true)).unwrap();
    follows(&spec, "I could write <tool_call> here.</think>\n\nNo call.").unwrap();
    assert!(follows(&spec, "x</think><tool_call>\n{\"name\": \"Dog\"").is_err());
}

/// Qwen3-Coder and Qwen 3.5's XML calls: found in their templates, parsed with the values typed
/// by the schemas, and forced (or, with `auto`, held after the marker) by their grammar.
#[test]
fn xml_function_calls_parse_and_follow_their_grammar() {
    let qwen35 = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}";
    assert_eq!(Format::of_template(Some(qwen35)), Format::XmlFunction);
    let m = json!({"tools": [{"type": "function", "function": {"name": "Cat", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age"]}}}], "tool_choice": "required"});
    let t = Tools::parse(m.as_object().unwrap(), Format::XmlFunction)
        .unwrap()
        .unwrap();
    let call = "<tool_call>\n<function=Cat>\n<parameter=name>\nTom\n12\n</parameter>\n<parameter=age>\n3\n</parameter>\n</function>\n</tool_call>";
    let (content, calls) = t.extract(&format!("Sure.\n{call}")).unwrap();
    assert_eq!(content, "Sure.");
    assert_eq!(
        calls,
        vec![("Cat".into(), "{\"name\":\"Tom\\n12\",\"age\":3}".into())]
    );
    let forced = t.constraint().unwrap();
    follows(&forced, call).unwrap();
    follows(&forced, &format!("{call}\n{call}")).unwrap();
    // The optional parameter, as JSON.
    follows(&forced, "<tool_call>\n<function=Cat>\n<parameter=name>\nAl\n</parameter>\n<parameter=age>\n4\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n</function>\n</tool_call>").unwrap();
    // A required parameter left out, a value not of its type, a function not among the tools.
    assert!(follows(&forced, "<tool_call>\n<function=Cat>\n<parameter=age>").is_err());
    assert!(follows(
        &forced,
        "<tool_call>\n<function=Cat>\n<parameter=name>\nAl\n</parameter>\n<parameter=age>\nfour"
    )
    .is_err());
    assert!(follows(&forced, "<tool_call>\n<function=Dog>").is_err());
    assert!(follows(&forced, "Sure.").is_err());
    let m = json!({"tools": m["tools"]});
    let t = Tools::parse(m.as_object().unwrap(), Format::XmlFunction)
        .unwrap()
        .unwrap();
    let auto = t.auto_constraint(None).unwrap();
    follows(&auto, "No call: 12345678901234567890 and <function=x>.").unwrap();
    follows(&auto, &format!("Sure.\n{call}")).unwrap();
    assert!(follows(&auto, "<tool_call>\n<function=Dog>").is_err());
}

mod dsml;
