use super::*;
use crate::turn::End;
use axum::http::StatusCode;

fn chat(v: Value) -> Result<Value, ApiError> {
    to_chat(v.as_object().unwrap(), false).map(Value::Object)
}

#[test]
fn requests_become_chat_bodies() {
    let c = chat(json!({
        "model": "claude-x", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["\n\n"], "temperature": 0, "top_k": 5, "stream": true,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "And tomorrow?"}
            ]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": true}]}
        ],
        "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}
    }))
    .unwrap();
    assert_eq!(c["max_tokens"], 64);
    assert_eq!(c["stop"], json!(["\n\n"]));
    assert_eq!(
        (
            c["temperature"].clone(),
            c["top_k"].clone(),
            c["stream"].clone()
        ),
        (json!(0), json!(5), json!(true))
    );
    let m = c["messages"].as_array().unwrap();
    let roles: Vec<&str> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(
        roles,
        [
            "system",
            "user",
            "assistant",
            "tool",
            "user",
            "assistant",
            "tool"
        ]
    );
    assert_eq!(m[0]["content"], "Be brief.");
    assert_eq!(m[2]["content"], "Checking.");
    assert_eq!(m[2]["tool_calls"][0]["id"], "toolu_1");
    assert_eq!(
        m[2]["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Paris\"}"
    );
    assert_eq!(
        (m[3]["tool_call_id"].as_str(), m[3]["content"].as_str()),
        (Some("toolu_1"), Some("18C"))
    );
    assert_eq!(m[4]["content"], "And tomorrow?");
    assert_eq!(m[6]["content"], "Error: down");
    assert_eq!(
        c["tools"][0]["function"]["parameters"]["properties"]["city"]["type"],
        "string"
    );
    assert_eq!(c["tools"][0]["function"]["description"], "Weather.");
    assert_eq!(
        c["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    assert_eq!(c["parallel_tool_calls"], false);
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let c = chat(
        json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                        "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
    )
    .unwrap();
    assert_eq!(c["response_format"]["json_schema"]["schema"], schema);
    for (choice, want) in [
        ("auto", json!("auto")),
        ("any", json!("required")),
        ("none", json!("none")),
    ] {
        let c = chat(json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": {"type": choice}})).unwrap();
        assert_eq!(c["tool_choice"], want);
    }
}

#[test]
fn bad_requests_name_the_field() {
    let user = json!([{"role": "user", "content": "x"}]);
    for (body, param) in [
        (json!({"messages": user}), "max_tokens"),
        (json!({"max_tokens": 0, "messages": user}), "max_tokens"),
        (json!({"max_tokens": "8", "messages": user}), "max_tokens"),
        (json!({"max_tokens": 8}), "messages"),
        (json!({"max_tokens": 8, "messages": []}), "messages"),
        (
            json!({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}),
            "messages.0.role",
        ),
        (
            json!({"max_tokens": 8, "messages": [{"role": "user", "content": 5}]}),
            "messages.0.content",
        ),
        (
            json!({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "messages.0.content.0.type",
        ),
        (
            json!({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]}),
            "messages.0.content.0.type",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "system": 3}),
            "system",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "stop_sequences": "x"}),
            "stop_sequences",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "tools": [{"name": "f"}]}),
            "tools.0.input_schema",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "tools": [{"type": "bash_20250124", "name": "bash"}]}),
            "tools.0.type",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "tool_choice": {"type": "tool"}}),
            "tool_choice.name",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "tool_choice": {"type": "some"}}),
            "tool_choice.type",
        ),
    ] {
        let e = chat(body.clone()).unwrap_err();
        assert_eq!(
            (e.status, e.param.as_deref()),
            (StatusCode::BAD_REQUEST, Some(param)),
            "{body}"
        );
        let b = error_body(&e);
        assert_eq!(
            (b["type"].as_str(), b["error"]["type"].as_str()),
            (Some("error"), Some("invalid_request_error"))
        );
        assert!(
            b["error"]["message"].as_str().unwrap().contains(param),
            "{b}"
        );
    }
    // count_tokens needs no max_tokens.
    assert!(to_chat(json!({"messages": user}).as_object().unwrap(), true).is_ok());
    assert_eq!(error_type(401), "authentication_error");
    assert_eq!(error_type(404), "not_found_error");
    assert_eq!(error_type(429), "rate_limit_error");
    assert_eq!(error_type(500), "api_error");
    assert!(is_messages_path("/v1/messages") && is_messages_path("/messages/count_tokens"));
    assert!(!is_messages_path("/v1/messagesx") && !is_messages_path("/v1/chat/completions"));
}

fn end(stop: Stop) -> End {
    End {
        stop,
        prompt_tokens: 20,
        completion_tokens: 7,
        cached_tokens: 4,
    }
}

#[test]
fn whole_messages() {
    let w = Whole {
        reasoning: None,
        text: "Let me look.".into(),
        calls: vec![("get_weather".into(), "{\"city\":\"Oslo\"}".into())],
        end: end(Stop::ToolCalls),
    };
    let m = message_json("msg_ab", "m", &w);
    assert_eq!(m["stop_reason"], "tool_use");
    assert_eq!(
        m["content"][0],
        json!({"type": "text", "text": "Let me look."})
    );
    assert_eq!(m["content"][1]["type"], "tool_use");
    assert_eq!(m["content"][1]["id"], "toolu_ab_0");
    assert_eq!(m["content"][1]["input"], json!({"city": "Oslo"}));
    assert_eq!(
        m["usage"],
        json!({"input_tokens": 16, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4, "output_tokens": 7})
    );
    let w = Whole {
        reasoning: None,
        text: "a".into(),
        calls: vec![],
        end: end(Stop::Sequence("END".into())),
    };
    let m = message_json("msg_1", "m", &w);
    assert_eq!(
        (m["stop_reason"].as_str(), m["stop_sequence"].as_str()),
        (Some("stop_sequence"), Some("END"))
    );
    let w = Whole {
        reasoning: None,
        text: String::new(),
        calls: vec![],
        end: end(Stop::Length),
    };
    let m = message_json("msg_1", "m", &w);
    assert_eq!(
        (m["stop_reason"].as_str(), m["content"].clone()),
        (Some("max_tokens"), json!([]))
    );
}

#[test]
fn stream_events_in_order() {
    let mut ev = Events::new("msg_1".into(), "m".into(), 20);
    let mut all = Vec::new();
    for p in [
        Part::Started {
            prompt_tokens: 20,
            cached: 0,
        },
        Part::Reasoning("think".into()),
        Part::Text("Hi".into()),
        Part::Text(" there".into()),
        Part::Calls(vec![
            ("f".into(), "{\"a\":1}".into()),
            ("g".into(), "{}".into()),
        ]),
        Part::End(end(Stop::ToolCalls)),
    ] {
        all.extend(ev.on(p));
    }
    let names: Vec<&str> = all.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    for (n, d) in &all {
        assert_eq!(d["type"], *n);
    }
    assert_eq!(all[2].1["content_block"]["type"], "thinking");
    assert_eq!(all[5].1["index"], 1);
    assert_eq!(
        all[7].1["delta"],
        json!({"type": "text_delta", "text": " there"})
    );
    assert_eq!(all[9].1["content_block"]["input"], json!({}));
    assert_eq!(
        all[10].1["delta"],
        json!({"type": "input_json_delta", "partial_json": "{\"a\":1}"})
    );
    assert_eq!(all[12].1["index"], 3);
    assert_eq!(all[15].1["delta"]["stop_reason"], "tool_use");
    assert_eq!(all[15].1["usage"]["output_tokens"], 7);
}
