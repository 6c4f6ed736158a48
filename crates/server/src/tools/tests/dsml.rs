//! DeepSeek V3.2 and V4's DSML calls (crate::dsml_call) through `Tools`: detection, parses
//! with the reasoning split, grammars, streaming.

use super::*;

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
    // A string holds no closing tag (the parse would end it there).
    assert!(follows(
        &forced,
        &block(&inv(
            "Cat",
            &(p("name", true, "a</｜DSML｜parameter>b") + &p("age", false, "4"))
        ))
    )
    .is_err());
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
