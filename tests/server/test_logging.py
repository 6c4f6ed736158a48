"""Structured logs: `quiver serve --log-format json` writes one JSON object a line on stderr,
one line per request (id, route, status, token counts, timings), errors with their cause."""

import json
import time

from conftest import Server

MSGS = [{"role": "user", "content": "Say hi."}]


def json_lines(s: Server):
    out = []
    for line in s.stderr_lines:
        line = line.strip()
        if line:
            out.append(json.loads(line))  # every line is JSON in this mode
    return out


def request_lines(s: Server, want: int, timeout=10.0):
    t0 = time.time()
    while True:
        lines = [l for l in json_lines(s) if l.get("target") == "quiver_server::request"]
        if len(lines) >= want or time.time() - t0 > timeout:
            return lines
        time.sleep(0.05)


def test_json_logs_one_line_per_request():
    s = Server("--ctx-size", "512", "--log-format", "json", keys=())
    try:
        st, h, body = s.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "temperature": 0})
        assert st == 200, body
        ok_id = h.get("x-request-id") or h.get("X-Request-Id")
        usage = json.loads(body)["usage"]
        st, h, body = s.request("POST", "/v1/chat/completions", {"messages": MSGS, "temperature": 5})
        assert st == 400
        bad_id = h.get("x-request-id") or h.get("X-Request-Id")
        st, h, body = s.request("POST", "/v1/chat/completions",
                                {"messages": MSGS, "max_tokens": 3, "temperature": 0, "stream": True})
        assert st == 200 and body.decode().rstrip().endswith("data: [DONE]")
        stream_id = h.get("x-request-id") or h.get("X-Request-Id")
        assert ok_id and bad_id and stream_id and len({ok_id, bad_id, stream_id}) == 3

        # /v1/models (the fixture's probe) and the three above.
        lines = request_lines(s, 4)
        by_id = {l["id"]: l for l in lines}
        assert {ok_id, bad_id, stream_id} <= set(by_id), lines

        ok = by_id[ok_id]
        assert ok["level"] == "INFO" and ok["message"] == "request"
        assert ok["method"] == "POST" and ok["route"] == "/v1/chat/completions" and ok["status"] == 200
        assert ok["prompt_tokens"] == usage["prompt_tokens"] > 0
        assert ok["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] >= 0
        assert ok["generated_tokens"] == usage["completion_tokens"] and 1 <= ok["generated_tokens"] <= 4
        assert 0 < ok["ttft_ms"] <= ok["total_ms"] < 60_000
        assert ok["finish_reason"] in ("stop", "length") and ok["completion_id"].startswith("chatcmpl-")
        assert "error" not in ok

        bad = by_id[bad_id]
        assert bad["level"] == "WARN" and bad["status"] == 400 and bad["route"] == "/v1/chat/completions"
        assert "temperature" in bad["error"] and bad["code"] == "invalid_parameter"
        assert "ttft_ms" not in bad and "generated_tokens" not in bad
        assert 0 <= bad["total_ms"] < 10_000

        # A stream's line is written when the stream ends: it has the token counts too.
        sl = by_id[stream_id]
        assert sl["level"] == "INFO" and sl["status"] == 200
        assert 1 <= sl["generated_tokens"] <= 3 and sl["prompt_tokens"] > 0
        assert 0 < sl["ttft_ms"] <= sl["total_ms"] < 60_000

        for l in lines:
            assert l["timestamp"] and l["level"] in ("INFO", "WARN", "ERROR")
            assert isinstance(l["total_ms"], (int, float)) and l["id"].startswith("req-")
        # The lifecycle lines are JSON too.
        msgs = [l.get("message", "") for l in json_lines(s)]
        assert any(m.startswith("serving ") for m in msgs) and any(m.startswith("listening on http://") for m in msgs)
    finally:
        assert s.stop() == 0
    assert any(l.get("message") == "stopped" for l in json_lines(s))


def test_text_logs_and_rust_log(monkeypatch):
    # Text format (the default); RUST_LOG keeps the lifecycle lines (info) but only the
    # request lines at warn and above.
    monkeypatch.setenv("RUST_LOG", "info,quiver_server::request=warn")
    s = Server("--ctx-size", "512", keys=())
    try:
        assert s.request("GET", "/health")[0] == 200
        assert s.request("GET", "/v1/nothing")[0] == 404
        t0 = time.time()
        while not any("status=404" in l for l in s.stderr_lines) and time.time() - t0 < 10:
            time.sleep(0.05)
        line = next(l for l in s.stderr_lines if "quiver_server::request" in l and "status=404" in l)
        assert " WARN " in line and "route=other" in line and "no route for /v1/nothing" in line
        assert not any("quiver_server::request" in l and "status=200" in l for l in s.stderr_lines)
    finally:
        assert s.stop() == 0
