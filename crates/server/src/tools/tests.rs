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

/// DeepSeek V3.2 and V4's DSML calls: found in their templates (the lines that write them),
/// parsed with the content before them, forced and (with `auto`) held after the block's tag by
/// their grammars, which take the forms the templates write.
#[test]
fn dsml_calls_parse_and_follow_their_grammar() {
    use crate::dsml_call::Block;
    let v32 = "{%- set dsml_token = '｜DSML｜' -%}\n{{- '\\n\\n<' + dsml_token + 'function_calls>\\n' -}}\n{{- '<｜tool▁calls▁begin｜>' if false -}}";
    let v4 = "{%- set dsml_token = '｜DSML｜' -%}\n{{- '\\n\\n<' + dsml_token + 'tool_calls>\\n' -}}\n{{- '<tool_result>' -}}";
    assert_eq!(
        Format::of_template(Some(v32)),
        Format::Dsml(Block::FunctionCalls)
    );
    assert_eq!(
        Format::of_template(Some(v4)),
        Format::Dsml(Block::ToolCalls)
    );
    assert_eq!(
        Format::Dsml(Block::ToolCalls).marker(),
        Some("<｜DSML｜tool_calls>")
    );
    let cat = json!({"type": "function", "function": {"name": "Cat", "parameters": {
        "type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "unit": {"enum": ["C", "F"]}},
        "required": ["name", "age"]}}});
    let ping = json!({"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}});
    let req = |choice: Value| {
        let m = json!({"tools": [cat, ping], "tool_choice": choice});
        Tools::parse(m.as_object().unwrap(), Format::Dsml(Block::ToolCalls))
            .unwrap()
            .unwrap()
    };
    let p = |k: &str, s: bool, v: &str| {
        format!("<｜DSML｜parameter name=\"{k}\" string=\"{s}\">{v}</｜DSML｜parameter>\n")
    };
    let inv =
        |name: &str, ps: &str| format!("<｜DSML｜invoke name=\"{name}\">\n{ps}</｜DSML｜invoke>\n");
    let block = |invokes: &str| format!("<｜DSML｜tool_calls>\n{invokes}</｜DSML｜tool_calls>");
    let tom = inv(
        "Cat",
        &(p("name", true, "Tom 12") + &p("age", false, "3") + &p("unit", true, "C")),
    );
    // V4's invoke without arguments: a lone newline.
    let ping_call = inv("ping", "\n");
    let two = block(&(tom.clone() + &ping_call));
    // As the template writes content and calls: "\n\n" between them.
    let t = req(json!("auto"));
    let (content, calls) = t
        .extract(&format!("Let me call the function.\n\n{two}"))
        .unwrap();
    assert_eq!(content, "Let me call the function.");
    assert_eq!(
        calls,
        vec![
            (
                "Cat".into(),
                "{\"name\":\"Tom 12\",\"age\":3,\"unit\":\"C\"}".into()
            ),
            ("ping".into(), "{}".into())
        ]
    );
    // Cut short in its second call: the first stays.
    let cut = format!(
        "\n\n<｜DSML｜tool_calls>\n{tom}<｜DSML｜invoke name=\"Cat\">\n{}",
        p("name", true, "Al")
    );
    assert_eq!(t.extract(&cut).unwrap().1.len(), 1);
    assert!(t.extract("No call.").is_none());
    // V3.2's block is not V4's.
    assert!(t
        .extract(&format!(
            "<｜DSML｜function_calls>\n{tom}</｜DSML｜function_calls>"
        ))
        .is_none());

    let forced = req(json!("required")).constraint().unwrap();
    assert!(matches!(forced, ConstraintSpec::Lark(_)), "{forced:?}");
    follows(&forced, &two).unwrap();
    follows(&forced, &block(&ping_call)).unwrap();
    follows(&forced, &block(&inv("ping", ""))).unwrap();
    // The optional parameters, one as JSON spaced as tojson writes it.
    follows(
        &forced,
        &block(&inv(
            "Cat",
            &(p("name", true, "Al") + &p("age", false, "4") + &p("tags", false, "[\"a\", \"b\"]")),
        )),
    )
    .unwrap();
    // A string value over lines, with digits and tags in it.
    follows(
        &forced,
        &block(&inv(
            "Cat",
            &(p("name", true, "line 1\n<b>99999999999999999999</b>") + &p("age", false, "4")),
        )),
    )
    .unwrap();
    // Wrong: a required parameter left out, a string marked as JSON, an integer as text or not
    // an integer, an enum's other value, an unknown function or parameter, text before the
    // block, V3.2's block.
    let refused = [
        block(&inv("Cat", &p("age", false, "3"))),
        block(&inv("Cat", &p("name", false, "\"Tom\""))),
        block(&inv(
            "Cat",
            &(p("name", true, "Tom") + &p("age", true, "3")),
        )),
        block(&inv(
            "Cat",
            &(p("name", true, "Tom") + &p("age", false, "3.5")),
        )),
        block(&inv(
            "Cat",
            &(p("name", true, "Tom") + &p("age", false, "3") + &p("unit", true, "K")),
        )),
        block(&inv("Dog", "")),
        block(&inv(
            "Cat",
            &(p("name", true, "Tom") + &p("color", true, "red")),
        )),
        format!("Sure.{two}"),
        format!("<｜DSML｜function_calls>\n{tom}"),
    ];
    for text in &refused {
        assert!(follows(&forced, text).is_err(), "{text}");
    }
    // One call unless parallel calls are allowed.
    let m = json!({"tools": [cat, ping], "tool_choice": "required", "parallel_tool_calls": false});
    let single = Tools::parse(m.as_object().unwrap(), Format::Dsml(Block::ToolCalls))
        .unwrap()
        .unwrap()
        .constraint()
        .unwrap();
    follows(&single, &block(&tom)).unwrap();
    assert!(follows(&single, &two).is_err());
    // Named: only that function.
    let named = req(json!({"type": "function", "function": {"name": "ping"}}))
        .constraint()
        .unwrap();
    follows(&named, &block(&ping_call)).unwrap();
    assert!(follows(&named, &block(&tom)).is_err());

    let auto = t.auto_constraint(None).unwrap();
    follows(
        &auto,
        "No call: 12345678901234567890 and <｜DSML｜invoke name=\"x\">.",
    )
    .unwrap();
    follows(&auto, &format!("Let me call the function.\n\n{two}")).unwrap();
    for text in &refused[..7] {
        assert!(
            follows(&auto, &format!("Sure.\n\n{text}")).is_err(),
            "{text}"
        );
    }
    // V4 thinking: the prompt opened it, the calls come after `</think>`.
    let th = Thinking {
        tags: crate::reasoning::THINK,
        prompt_opened: true,
        calls: Format::Dsml(Block::ToolCalls).marker(),
    };
    let auto = t.auto_constraint(Some(th)).unwrap();
    follows(
        &auto,
        &format!("I could write <｜DSML｜tool_calls> here.</think>\n\n{two}"),
    )
    .unwrap();
    assert!(follows(&auto, &format!("Plan.</think>\n\n{}", refused[5])).is_err());

    // V3.2: its block, and no newline in an invoke without arguments.
    let m = json!({"tools": [cat, ping], "tool_choice": "required"});
    let t = Tools::parse(m.as_object().unwrap(), Format::Dsml(Block::FunctionCalls))
        .unwrap()
        .unwrap();
    let v32_two = format!(
        "<｜DSML｜function_calls>\n{tom}{}</｜DSML｜function_calls>",
        inv("ping", "")
    );
    let (_, calls) = t.extract(&v32_two).unwrap();
    assert_eq!(calls.len(), 2);
    let forced = t.constraint().unwrap();
    follows(&forced, &v32_two).unwrap();
    assert!(follows(&forced, &two).is_err());
}

/// llama.cpp's test-chat.cpp cases for DeepSeek-V3.2.jinja, DeepSeek-V4.jinja and
/// DeepSeek-V4-Flash-0731.jinja, whole: the answer split into reasoning (the prompt opened the
/// thinking where it is on) and the rest, then the calls read from it, against the expected
/// reasoning, content and calls. The V3.2 cases run in V4's block too (the same invokes).
#[test]
#[allow(clippy::approx_constant)] // The cases' 3.14, not π.
fn deepseek_v3_2_and_v4_answers_as_test_chat_cpp_reads_them() {
    use crate::dsml_call::Block;
    /// Thinking on, the answer, its reasoning, content and calls.
    type Case<'a> = (bool, String, &'a str, &'a str, Vec<(&'a str, Value)>);
    let one = |k: &str, t: &str| json!({"type": "object", "properties": {k: {"type": t}}, "required": [k]});
    let fs = [
        ("get_time", one("city", "string")),
        ("get_weather", one("city", "string")),
        ("special_function", one("arg1", "integer")),
        (
            "magic_int",
            json!({"type": "object", "properties": {"ref": {"type": "integer"}, "name": {"type": "string"}}, "required": ["ref"]}),
        ),
        ("amount", one("orig", "number")),
        ("toggle", one("enabled", "boolean")),
        ("todo_list", one("todos", "array")),
        ("set_config", one("config", "object")),
    ];
    let tools: Vec<Value> = fs
        .iter()
        .map(|(n, p)| json!({"type": "function", "function": {"name": n, "parameters": p}}))
        .collect();
    let inv = |name: &str, params: &[(&str, bool, &str)]| {
        let ps: String = params
            .iter()
            .map(|(k, s, v)| {
                format!("<｜DSML｜parameter name=\"{k}\" string=\"{s}\">{v}</｜DSML｜parameter>\n")
            })
            .collect();
        format!("<｜DSML｜invoke name=\"{name}\">\n{ps}</｜DSML｜invoke>\n")
    };
    for block in [Block::FunctionCalls, Block::ToolCalls] {
        let b = |invokes: &str| {
            let close = block.open().replacen('<', "</", 1);
            format!("{}\n{invokes}{close}", block.open())
        };
        let time = |city: &str| inv("get_time", &[("city", true, city)]);
        let special = b(&inv("special_function", &[("arg1", false, "1")]));
        let hello = "Hello, world!\nWhat's up?";
        let mut cases: Vec<Case> = vec![
            (false, hello.into(), "", hello, vec![]),
            (
                true,
                format!("I'm\nthinking</think>{hello}"),
                "I'm\nthinking",
                hello,
                vec![],
            ),
            (
                true,
                format!("Let me check the time</think>\n\n{}", b(&time("Tokyo"))),
                "Let me check the time",
                "",
                vec![("get_time", json!({"city": "Tokyo"}))],
            ),
            (
                false,
                special.clone(),
                "",
                "",
                vec![("special_function", json!({"arg1": 1}))],
            ),
            (
                true,
                format!(
                    "Calling both</think>\n\n{}",
                    b(&(time("Paris") + &inv("get_weather", &[("city", true, "Paris")])))
                ),
                "Calling both",
                "",
                vec![
                    ("get_time", json!({"city": "Paris"})),
                    ("get_weather", json!({"city": "Paris"})),
                ],
            ),
            (
                true,
                format!("Thinking about it</think>Let me call the function.\n\n{special}"),
                "Thinking about it",
                "Let me call the function.",
                vec![("special_function", json!({"arg1": 1}))],
            ),
            (
                true,
                format!("</think>\n\n{}", b(&time("XYZCITY"))),
                "",
                "",
                vec![("get_time", json!({"city": "XYZCITY"}))],
            ),
            (
                true,
                format!(
                    "Multi-arg call</think>\n\n{}",
                    b(&inv(
                        "magic_int",
                        &[("ref", false, "42"), ("name", true, "foo bar")]
                    ))
                ),
                "Multi-arg call",
                "",
                vec![("magic_int", json!({"ref": 42, "name": "foo bar"}))],
            ),
        ];
        for (reasoning, name, key, raw, value) in [
            ("Test negative", "magic_int", "ref", "-14", json!(-14)),
            ("Test decimal", "amount", "orig", "3.14", json!(3.14)),
            ("Test boolean", "toggle", "enabled", "true", json!(true)),
            (
                "Test array",
                "todo_list",
                "todos",
                "[\"buy milk\",\"walk dog\"]",
                json!(["buy milk", "walk dog"]),
            ),
            (
                "Test object",
                "set_config",
                "config",
                "{\"theme\":\"dark\",\"level\":2}",
                json!({"theme": "dark", "level": 2}),
            ),
        ] {
            cases.push((
                true,
                format!(
                    "{reasoning}</think>\n\n{}",
                    b(&inv(name, &[(key, false, raw)]))
                ),
                reasoning,
                "",
                vec![(name, json!({key: value}))],
            ));
        }
        if block == Block::ToolCalls {
            // V4: a call ends a thinking that never closed.
            cases.push((
                true,
                format!("Let me check the time\n\n{}", b(&time("Tokyo"))),
                "Let me check the time",
                "",
                vec![("get_time", json!({"city": "Tokyo"}))],
            ));
            // V4-Flash, not thinking: the separator belongs to the block.
            cases.push((
                false,
                format!("\n\n{special}"),
                "",
                "",
                vec![("special_function", json!({"arg1": 1}))],
            ));
        }
        let format = Format::Dsml(block);
        let m = json!({"tools": tools});
        let t = Tools::parse(m.as_object().unwrap(), format)
            .unwrap()
            .unwrap();
        for (thinking, answer, reasoning, content, calls) in cases {
            let th = Thinking {
                tags: crate::reasoning::THINK,
                prompt_opened: thinking,
                calls: format.marker(),
            };
            let (r, rest) = crate::reasoning::split(&answer, th);
            let (c, got) = t.extract(&rest).unwrap_or((rest, vec![]));
            let got: Vec<(String, Value)> = got
                .into_iter()
                .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
                .collect();
            let want: Vec<(String, Value)> =
                calls.into_iter().map(|(n, v)| (n.into(), v)).collect();
            assert_eq!(
                (r.unwrap_or_default().as_str(), c.as_str(), got),
                (reasoning, content, want),
                "{answer}"
            );
        }
    }
}

/// Streamed with tools, the text before a call goes out as it comes, but the whitespace just
/// before the call's marker is held with the call (V4-Flash's "\n\n" separator is not
/// content); whitespace followed by more text goes out with it.
#[test]
fn streamed_text_keeps_a_calls_separator_back() {
    let marker = Format::Dsml(crate::dsml_call::Block::ToolCalls).marker();
    let stream = |text: &str| {
        let (mut held, mut sent, mut in_call) = (String::new(), String::new(), false);
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(2) {
            held.extend(piece);
            let (emit, keep) = crate::stream::split_for_calls(&held, marker, &mut in_call);
            sent.push_str(emit);
            held = keep.to_string();
        }
        (sent, held)
    };
    let block = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    assert_eq!(
        stream(&format!("Let me call the function.\n\n{block}")),
        (
            "Let me call the function.".to_string(),
            format!("\n\n{block}")
        )
    );
    assert_eq!(
        stream(&format!("\n\n{block}")),
        (String::new(), format!("\n\n{block}"))
    );
    assert_eq!(
        stream("Two lines:\n\nthe second. "),
        ("Two lines:\n\nthe second.".to_string(), " ".to_string())
    );
}
