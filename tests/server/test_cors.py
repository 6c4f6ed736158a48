"""CORS: a browser page may call the server. A preflight is answered before the API key is
checked; responses to an allowed origin carry `Access-Control-Allow-Origin`;
`--allowed-origins` narrows who is allowed."""

from conftest import Server


def test_preflight_and_allowed_origin(server):
    origin = "https://app.example"
    s, h, _ = server.request(
        "OPTIONS",
        "/v1/chat/completions",
        headers={"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type", "Authorization": ""},
    )
    h = {k.lower(): v for k, v in h.items()}
    assert s == 204, (s, h)
    assert h["access-control-allow-origin"] == origin
    assert "POST" in h["access-control-allow-methods"] and "authorization" in h["access-control-allow-headers"]
    s, h, _ = server.request("POST", "/tokenize", {"content": "hi"}, headers={"Origin": origin})
    assert s == 200 and {k.lower(): v for k, v in h.items()}["access-control-allow-origin"] == origin
    # No Origin, no CORS headers; a wrong key is still refused with an Origin.
    s, h, _ = server.request("POST", "/tokenize", {"content": "hi"})
    assert s == 200 and "access-control-allow-origin" not in {k.lower() for k in h}
    s, _, _ = server.request("POST", "/tokenize", {"content": "hi"}, headers={"Origin": origin, "Authorization": "Bearer nope"})
    assert s == 401


def test_allowed_origins_narrow_it():
    srv = Server("--cors", "https://a.example,https://b.example")
    try:
        s, h, _ = srv.request("POST", "/tokenize", {"content": "hi"}, headers={"Origin": "https://b.example"})
        assert s == 200 and {k.lower(): v for k, v in h.items()}["access-control-allow-origin"] == "https://b.example"
        s, h, _ = srv.request("POST", "/tokenize", {"content": "hi"}, headers={"Origin": "https://evil.example"})
        assert s == 200 and "access-control-allow-origin" not in {k.lower() for k in h}
        s, h, _ = srv.request("OPTIONS", "/v1/completions", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert s != 204 and "access-control-allow-origin" not in {k.lower() for k in h}
    finally:
        srv.stop()
