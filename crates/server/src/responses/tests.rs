use super::*;
use crate::turn::End;

fn chat(v: Value) -> Result<Value, ApiError> {
    to_chat(v.as_object().unwrap()).map(Value::Object)
}

#[test]
fn requests_become_chat_bodies() {
    let c = chat(json!({"model": "gpt-4o-mini", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0}))
        .unwrap();
    assert_eq!(
        c["messages"],
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    );
    assert_eq!(
        (c["max_tokens"].clone(), c["temperature"].clone()),
        (json!(9), json!(0))
    );
    let c = chat(json!({
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Oslo?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "3C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]}
        ],
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}, "strict": true}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": false,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
        "store": true, "metadata": {"a": "b"}
    }))
    .unwrap();
    let m = c["messages"].as_array().unwrap();
    let roles: Vec<&str> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "tool"]);
    assert_eq!(m[1]["content"], "Weather in Oslo?");
    assert_eq!(m[2]["content"], "Checking.");
    assert_eq!(m[2]["tool_calls"][1]["id"], "call_2");
    assert_eq!(
        m[2]["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Oslo\"}"
    );
    assert_eq!(
        (m[4]["tool_call_id"].as_str(), m[4]["content"].as_str()),
        (Some("call_2"), Some("noon"))
    );
    assert_eq!(
        c["tools"][0],
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}, "strict": true}})
    );
    assert_eq!(
        c["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    assert_eq!(c["parallel_tool_calls"], false);
    assert_eq!(
        c["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": true}})
    );
}

#[test]
fn bad_requests_name_the_field() {
    for (body, param) in [
        (json!({}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": 3}), "input"),
        (
            json!({"input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (json!({"input": "x", "conversation": "c"}), "conversation"),
        (json!({"input": "x", "background": true}), "background"),
        (json!({"input": "x", "top_logprobs": 2}), "top_logprobs"),
        (
            json!({"input": "x", "include": ["message.output_text.logprobs"]}),
            "include",
        ),
        (json!({"input": "x", "instructions": 1}), "instructions"),
        (
            json!({"input": [{"role": "tool", "content": "x"}]}),
            "input[0].role",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0].type",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "x"}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"type": "function_call", "name": "f"}]}),
            "input[0]",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function"}]}),
            "tools[0].name",
        ),
        (json!({"input": "x", "tool_choice": "any"}), "tool_choice"),
        (
            json!({"input": "x", "text": {"format": {"type": "xml"}}}),
            "text.format.type",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}),
            "text.format.schema",
        ),
    ] {
        let e = chat(body.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
    }
    let e = renamed(ApiError::invalid(
        "max_tokens",
        "`max_tokens` must be at least 1",
    ));
    assert_eq!(
        (e.param.as_deref(), e.message.as_str()),
        (
            Some("max_output_tokens"),
            "`max_output_tokens` must be at least 1"
        )
    );
}

fn end(stop: Stop) -> End {
    End {
        stop,
        prompt_tokens: 20,
        completion_tokens: 7,
        cached_tokens: 4,
    }
}

fn base_of(v: Value) -> Value {
    base(v.as_object().unwrap(), "resp_ab", "m", 5)
}

#[test]
fn whole_responses() {
    let b = base_of(
        json!({"input": "x", "max_output_tokens": 8, "tools": [{"type": "function", "name": "f"}]}),
    );
    assert_eq!(
        (
            b["status"].as_str(),
            b["max_output_tokens"].clone(),
            b["tools"][0]["name"].as_str()
        ),
        (Some("in_progress"), json!(8), Some("f"))
    );
    let w = Whole {
        reasoning: None,
        text: String::new(),
        calls: vec![("f".into(), "{\"a\":1}".into())],
        end: end(Stop::ToolCalls),
    };
    let r = response_json(b.clone(), &w);
    assert_eq!(r["status"], "completed");
    assert_eq!(
        r["output"],
        json!([{"type": "function_call", "id": "fc_ab_0", "call_id": "call_ab_0", "name": "f", "arguments": "{\"a\":1}", "status": "completed"}])
    );
    assert_eq!(r["usage"]["input_tokens"], 20);
    assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 4);
    assert_eq!(r["usage"]["total_tokens"], 27);
    let w = Whole {
        reasoning: Some("hm".into()),
        text: "Hello".into(),
        calls: vec![],
        end: end(Stop::Length),
    };
    let r = response_json(b, &w);
    assert_eq!(
        (
            r["status"].as_str(),
            r["incomplete_details"]["reason"].as_str()
        ),
        (Some("incomplete"), Some("max_output_tokens"))
    );
    assert_eq!(r["output"][0]["type"], "reasoning");
    assert_eq!(r["output"][1]["content"][0]["text"], "Hello");
    assert_eq!(r["output"][1]["id"], "msg_ab");
}

#[test]
fn stream_events_in_order_and_numbered() {
    let mut ev = Events::new(base_of(json!({"input": "x"})));
    let mut all = ev.begin();
    for p in [
        Part::Started {
            prompt_tokens: 20,
            cached: 0,
        },
        Part::Text("Hi".into()),
        Part::Text(" there".into()),
        Part::Calls(vec![("f".into(), "{}".into())]),
        Part::End(end(Stop::ToolCalls)),
    ] {
        all.extend(ev.on(p));
    }
    let names: Vec<&str> = all.iter().map(|v| v["type"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, v) in all.iter().enumerate() {
        assert_eq!(v["sequence_number"], i);
    }
    assert_eq!(all[6]["text"], "Hi there");
    assert_eq!(all[9]["output_index"], 1);
    assert_eq!(all[9]["item"]["arguments"], "");
    let done = &all[13]["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], "Hi there");
    assert_eq!(done["output"][1]["call_id"], "call_ab_0");
    assert_eq!(done["usage"]["output_tokens"], 7);
    // Cut by the limit: `response.incomplete`.
    let mut ev = Events::new(base_of(json!({"input": "x"})));
    ev.begin();
    let out = ev.on(Part::End(end(Stop::Length)));
    assert_eq!(out.last().unwrap()["type"], "response.incomplete");
    assert_eq!(
        out.last().unwrap()["response"]["output"][0]["type"],
        "message"
    );
}
