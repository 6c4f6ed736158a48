"""The web chat page at `/`: its files and headers over HTTP, and the page itself in a real
headless Chromium (Playwright) against the running server and the real model: streamed text,
stop (and the server stopping), multi-turn, system prompt and sampling settings in the request
and in the answer, Markdown and code blocks, the API key in localStorage, and no request to any
other origin.

The browser is the system's Chromium (Debian's `chromium`, which scripts/test installs), else
$QUIVER_CHROMIUM, else Playwright's own; the browser tests are skipped, saying why, only when
no browser starts."""

import json
import os
import shutil
import time

import pytest

from conftest import KEY, Server

CHAT = "/v1/chat/completions"


# ---- over HTTP ----------------------------------------------------------------------------


def plain_get(server, path):
    """A GET with no API key, as a browser opening the page sends it."""
    return server.request("GET", path, headers={"Authorization": ""})


@pytest.mark.parametrize("path,ctype", [
    ("/", "text/html"),
    ("/index.html", "text/html"),
    ("/webui/app.js", "text/javascript"),
    ("/webui/markdown.js", "text/javascript"),
    ("/webui/style.css", "text/css"),
    ("/webui/icon.svg", "image/svg+xml"),
])
def test_page_files_are_served_without_the_key_with_their_types_and_a_strict_csp(server, path, ctype):
    status, headers, body = plain_get(server, path)
    assert status == 200, body
    h = {k.lower(): v for k, v in headers.items()}
    assert h["content-type"].startswith(ctype)
    csp = h["content-security-policy"]
    for directive in ["default-src 'none'", "script-src 'self'", "style-src 'self'",
                      "connect-src 'self'", "img-src 'self'", "frame-ancestors 'none'"]:
        assert directive in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "*" not in csp
    assert h["x-content-type-options"] == "nosniff"
    assert len(body) > 100


def test_the_api_still_needs_the_key_and_other_methods_get_json(server):
    assert plain_get(server, "/v1/models")[0] == 401
    assert plain_get(server, "/webui/nope.js")[0] == 401  # unknown paths stay behind the key
    assert server.request("GET", "/webui/nope.js")[0] == 404
    status, _, body = server.request("POST", "/", {"x": 1})
    assert status == 405
    assert "error" in json.loads(body)


def test_no_webui_leaves_the_page_out():
    s = Server("--no-webui", keys=())
    try:
        status, _, body = s.request("GET", "/")
        assert status == 404, body
        assert s.request("GET", "/webui/app.js")[0] == 404
        assert s.request("GET", "/v1/models")[0] == 200
    finally:
        s.stop()


# ---- in a browser -------------------------------------------------------------------------


def chromium_path():
    exe = os.environ.get("QUIVER_CHROMIUM")
    if exe:
        return exe
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None  # Playwright's own Chromium, if `playwright install chromium` fetched one


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import Error, sync_playwright  # in tools/requirements-test.txt

    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=chromium_path(), headless=True)
    except Error as e:
        pw.stop()
        pytest.skip(f"no Chromium starts here (scripts/test installs Debian's chromium): {e}".splitlines()[0])
    yield b
    b.close()
    pw.stop()


class Page:
    """A fresh browser context on the server's page, recording every request the page makes,
    the chat requests' bodies, console errors and CSP violations."""

    def __init__(self, browser, server):
        self.server = server
        self.ctx = browser.new_context()
        self.page = self.ctx.new_page()
        self.requests = []
        self.bodies = []
        self.problems = []
        self.page.on("request", self._on_request)
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("console", self._on_console)
        self.page.set_default_timeout(90_000)
        self.page.goto(server.url + "/")
        # The page's first /v1/models has answered: the model's name, or the notice asking for a key.
        self.page.wait_for_function(
            "() => document.getElementById('model').textContent !== '' || !document.getElementById('notice').hidden")

    def _on_request(self, r):
        self.requests.append(r.url)
        if r.url.endswith(CHAT):
            self.bodies.append(json.loads(r.post_data))

    def _on_console(self, m):
        if "Content Security Policy" in m.text or (m.type == "error" and "401" not in m.text):
            self.problems.append(m.text)

    def set_key(self, key=KEY):
        if self.page.is_hidden("#settings"):
            self.page.click("#toggle-settings")
        self.page.fill("#api-key", key)
        self.page.dispatch_event("#api-key", "change")
        self.page.wait_for_function("() => document.getElementById('model').textContent !== ''")

    def setting(self, name, value):
        if self.page.is_hidden("#settings"):
            self.page.click("#toggle-settings")
        self.page.fill("#" + name, str(value))
        self.page.dispatch_event("#" + name, "change")

    def send(self, text):
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def wait_done(self):
        self.page.wait_for_selector("#send:not([hidden])")
        self.page.wait_for_selector(".msg.assistant:not(.streaming)")

    def answers(self):
        return self.page.eval_on_selector_all(".msg.assistant", "els => els.map(e => e.dataset.raw || '')")

    def close(self):
        # Nothing the page did went to another origin, and it broke no CSP rule.
        origin = self.server.url
        assert self.requests and all(u.startswith(origin + "/") for u in self.requests), self.requests
        assert not self.problems, self.problems
        self.ctx.close()


@pytest.fixture
def page(browser, server):
    p = Page(browser, server)
    yield p
    p.close()


def same_answer(client, server, messages, **kw):
    r = client.chat.completions.create(model=server.model, messages=messages, **kw)
    return r.choices[0].message.content


def test_the_page_asks_for_the_key_and_keeps_it(page, server):
    page.page.wait_for_selector("#notice:not([hidden])")
    assert "API key" in page.page.inner_text("#notice")
    page.set_key()
    assert page.page.inner_text("#model") == server.model
    assert page.page.is_hidden("#notice")
    page.page.reload()
    page.page.wait_for_function("() => document.getElementById('model').textContent !== ''")
    assert page.page.input_value("#api-key") == KEY
    stored = page.page.evaluate("localStorage.getItem('quiver.chat.apiKey')")
    assert stored == KEY


def test_streams_multi_turn_with_system_prompt_and_sampling(page, server, client):
    page.set_key()
    system = "You are a pirate. Always answer like a pirate."
    page.setting("system", system)
    page.setting("temperature", 0)
    page.setting("seed", 7)
    page.setting("top_k", 30)
    page.setting("max_tokens", 60)
    # Snapshots of the answer while it streams: text must show before the answer ends.
    page.page.evaluate("""() => {
        window.__snaps = [];
        new MutationObserver(() => {
            const a = document.querySelector('.msg.assistant:last-of-type');
            if (a) window.__snaps.push([a.classList.contains('streaming'), a.querySelector('.body').textContent.length]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    page.send("Tell me about the sea in three sentences.")
    page.wait_done()
    snaps = page.page.evaluate("window.__snaps")
    final = page.page.eval_on_selector(".msg.assistant .body", "e => e.textContent.length")
    assert final > 20
    partial = [n for streaming, n in snaps if streaming and 0 < n < final]
    assert len(set(partial)) >= 2, snaps  # seen growing while it streamed
    stats = page.page.inner_text("#stats")
    assert "tokens/s" in stats and "tokens" in stats

    first = page.bodies[0]
    assert first["stream"] is True
    assert first["messages"] == [
        {"role": "system", "content": system},
        {"role": "user", "content": "Tell me about the sea in three sentences."},
    ]
    assert (first["temperature"], first["seed"], first["top_k"], first["max_tokens"]) == (0, 7, 30, 60)
    assert "top_p" not in first and "min_p" not in first  # empty fields: the server's defaults
    # The server got exactly that: greedy decoding gives the same answer to the same request.
    a1 = page.answers()[0]
    assert a1 == same_answer(client, server, first["messages"], temperature=0, max_tokens=60, extra_body={"top_k": 30})

    page.send("Now say it in one sentence.")
    page.wait_done()
    second = page.bodies[1]
    assert second["messages"] == first["messages"] + [
        {"role": "assistant", "content": a1},
        {"role": "user", "content": "Now say it in one sentence."},
    ]
    a2 = page.answers()[1]
    assert a2 and a2 == same_answer(client, server, second["messages"], temperature=0, max_tokens=60, extra_body={"top_k": 30})

    # New chat: the next request starts over.
    page.page.click("#new-chat")
    assert page.page.query_selector_all(".msg") == []
    page.send("Hi")
    page.wait_done()
    assert page.bodies[2]["messages"] == [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]


def test_stop_aborts_the_fetch_and_the_server_stops_generating(page, server):
    page.set_key()
    page.setting("temperature", 0)
    page.setting("max_tokens", 900)
    server.wait_idle()
    m0 = server.metrics()
    aborts = 'quiver_request_finished_total{finish_reason="abort"}'
    page.send("Repeat the word 'hello' 500 times.")
    page.page.wait_for_function(
        "() => (document.querySelector('.msg.assistant .body') || {}).textContent?.length > 10")
    assert page.page.is_visible("#stop")
    page.page.click("#stop")
    page.page.wait_for_selector("#send:not([hidden])")
    assert "Stopped." in page.page.inner_text(".msg.assistant .note")
    # The server saw the connection close: the request ends as an abort, long before 900
    # tokens, and nothing runs any more.
    m1 = server.wait_idle(timeout=10)
    assert m1["quiver_requests_running"] == 0
    assert m1.get(aborts, 0) == m0.get(aborts, 0) + 1
    generated = m1["quiver_generation_tokens_total"] - m0["quiver_generation_tokens_total"]
    assert 0 < generated < 600
    time.sleep(0.5)
    assert server.metrics()["quiver_generation_tokens_total"] == m1["quiver_generation_tokens_total"]
    # What came before the stop stays in the conversation. Esc stops too.
    stopped = page.answers()[0]
    assert stopped
    page.send("Write a very long essay about the history of the Roman Empire.")
    page.page.wait_for_function(
        "() => (document.querySelectorAll('.msg.assistant .body')[1] || {}).textContent?.length > 10")
    page.page.keyboard.press("Escape")
    page.page.wait_for_selector("#send:not([hidden])")
    assert page.bodies[1]["messages"][-2] == {"role": "assistant", "content": stopped}
    m2 = server.wait_idle(timeout=10)
    assert m2.get(aborts, 0) == m0.get(aborts, 0) + 2
    # New chat while an answer streams: it stops, and the next request starts over. (From a new
    # chat: the conversation so far holds answers cut at times the test does not choose.)
    page.page.click("#new-chat")
    page.send("Repeat the word 'hello' 500 times.")
    page.page.wait_for_function(
        "() => (document.querySelector('.msg.assistant .body') || {}).textContent?.length > 10")
    page.page.click("#new-chat")
    page.page.wait_for_selector("#send:not([hidden])")
    assert server.wait_idle(timeout=10).get(aborts, 0) == m0.get(aborts, 0) + 3
    page.setting("max_tokens", 8)
    page.send("Hi")
    page.wait_done()
    assert page.bodies[-1]["messages"] == [{"role": "user", "content": "Hi"}]


def test_a_code_block_from_the_model_is_rendered(page, server, client):
    page.set_key()
    page.setting("temperature", 0)
    page.setting("max_tokens", 120)
    prompt = "Write a Python function that adds two numbers, in a code block."
    page.send(prompt)
    page.wait_done()
    raw = page.answers()[0]
    assert "```" in raw, raw  # the model's greedy answer has a fenced block
    code = page.page.inner_text(".msg.assistant pre > code")
    fenced = raw.split("```", 2)[1].split("\n", 1)[1].rstrip("\n")
    assert code.strip() == fenced.strip()
    # Copy puts the block's code on the clipboard.
    page.ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page.page.click(".msg.assistant .code .copy")
    page.page.wait_for_selector(".msg.assistant .code .copy:text('Copied')")
    assert page.page.evaluate("() => navigator.clipboard.readText()") == fenced


def test_a_server_without_keys_asks_for_none(browser):
    s = Server(keys=())
    p = Page(browser, s)
    try:
        p.page.wait_for_function("() => document.getElementById('model').textContent !== ''")
        assert p.page.is_hidden("#notice") and p.page.is_hidden("#settings")
        p.setting("max_tokens", 16)
        p.send("Hi")
        p.wait_done()
        assert p.answers()[0]
        headers = []
        p.page.on("request", lambda r: headers.append(r.headers))
        p.send("Bye")
        p.wait_done()
        assert headers and all("authorization" not in h for h in headers)
        p.close()
    finally:
        s.stop()


MARKDOWN = """# Title
Some **bold**, *em*, `x < y` and a [link](https://example.com/a) and [bad](javascript:alert(1)).

<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>

- one
- two
  1. inner
3. three

```js
const a = "<b>not bold</b>";
```
> quoted"""


def test_markdown_is_rendered_safely(page):
    out = page.page.evaluate("""async (src) => {
        const md = await import('/webui/markdown.js');
        const div = document.createElement('div');
        md.render(src, div);
        document.body.appendChild(div);
        const q = (s) => [...div.querySelectorAll(s)];
        return {
            h1: q('h1').map(e => e.textContent),
            strong: q('strong').map(e => e.textContent),
            em: q('em').map(e => e.textContent),
            code: q(':not(pre) > code').map(e => e.textContent),
            links: q('a').map(e => [e.textContent, e.getAttribute('href'), e.rel]),
            imgs: q('img').length, scripts: q('script').length,
            lis: q('ul > li').length, inner: q('ul ol > li').map(e => e.textContent),
            pre: q('pre > code').map(e => [e.className, e.textContent]),
            quote: q('blockquote').map(e => e.textContent.trim()),
            text: div.textContent,
            pwned: window.__pwned || 0,
        };
    }""", MARKDOWN)
    assert out["h1"] == ["Title"]
    assert out["strong"] == ["bold"] and out["em"] == ["em"] and out["code"] == ["x < y"]
    assert out["links"] == [["link", "https://example.com/a", "noopener noreferrer nofollow"]]
    assert "[bad](javascript:alert(1))" in out["text"]  # a javascript: link stays text
    assert out["imgs"] == 0 and out["scripts"] == 0 and out["pwned"] == 0
    assert '<img src=x onerror="window.__pwned=1">' in out["text"]  # HTML shows as text
    assert out["lis"] == 2 and out["inner"] == ["inner"]
    assert out["pre"] == [["language-js", 'const a = "<b>not bold</b>";']]
    assert out["quote"] == ["quoted"]


def test_reasoning_is_collapsible_and_usage_gives_tokens_per_second(page):
    # A thinking model's stream, answered by the browser itself (SmolLM2 does not think): the
    # page's handling of reasoning_content and of the usage chunk.
    def chunk(delta=None, usage=None, finish=None):
        c = {"choices": [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
        if usage:
            c["usage"] = usage
        return "data: " + json.dumps(c) + "\n\n"

    sse = (chunk({"reasoning_content": "Let me think"}) + chunk({"reasoning_content": " hard."})
           + chunk({"content": "The answer is **42**."}) + chunk(finish="stop")
           + chunk(usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}) + "data: [DONE]\n\n")
    page.page.route("**" + CHAT, lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse))
    page.set_key()
    page.send("What is the answer?")
    page.wait_done()
    details = page.page.query_selector(".msg.assistant details.reasoning")
    assert details is not None
    assert details.get_attribute("open") is None  # collapsed
    assert details.inner_text().startswith("Reasoning")
    assert not page.page.is_visible(".msg.assistant details .reasoning-body")  # until opened
    page.page.click(".msg.assistant details summary")
    assert page.page.is_visible(".msg.assistant details .reasoning-body")
    assert page.page.inner_text(".msg.assistant details .reasoning-body") == "Let me think hard."
    assert page.page.inner_text(".msg.assistant .body strong") == "42"
    assert "9 tokens" in page.page.inner_text("#stats") and "finish: stop" in page.page.inner_text("#stats")
