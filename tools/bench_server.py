#!/usr/bin/env python3
"""Aggregate generation throughput of `quiver serve` at several client counts.

Usage: tools/bench_server.py [--model smollm2-135m] [--clients 1,4,16] [--max-tokens 64]
                             [--requests-per-client 3] [--quiver target/release/quiver]
                             [--device cpu|cuda] [--guided-regex PATTERN | --guided-json]
`--guided-regex` constrains every request (vLLM's field) to measure constrained decoding; the
pattern must allow `--max-tokens` tokens (e.g. "[a-z ]+"). `--guided-json` constrains every
request to a JSON schema (a list of people too long to end within `--max-tokens`, so that
every request makes them all). Starts the server on a free loopback port, runs each width in
turn (every client sends its requests back to back, temperature 0, ignore_eos so each request makes max_tokens
tokens unless its constraint ends first), and prints a Markdown table: clients, requests,
generated tokens, seconds, tokens/s summed. Only the standard library: it runs on a machine
without the project's virtual environment (the GPU machine).
"""
import argparse, json, re, subprocess, sys, threading, time, urllib.request

def schema(max_tokens):
    """A list of people (name, age, tags, a flag), at least one per 8 tokens asked for: a
    realistic schema whose answer cannot end within max_tokens, so every request makes them all,
    as the plain ones do, and the throughputs compare. (A string's minLength would do that too,
    but llguidance's masks cost ~20x more under a long length count.)"""
    person = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "tags", "ok"]}
    return {"type": "object", "required": ["people"], "properties": {
        "people": {"type": "array", "items": person, "minItems": max(8, max_tokens // 8)}}}

def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--quiver", default="target/release/quiver")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--guided-regex", default=None)
    ap.add_argument("--guided-json", action="store_true")
    a = ap.parse_args()
    widths = [int(x) for x in a.clients.split(",")]
    srv = subprocess.Popen([a.quiver, "serve", "-m", a.model, "--port", "0", "--device", a.device,
                            "--max-seqs", str(max(widths))], stderr=subprocess.PIPE, text=True)
    port = None
    for line in srv.stderr:
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        sys.exit("the server did not start")
    # The server's log is drained; its profile lines (QUIVER_SERVE_PROFILE) are passed on.
    threading.Thread(target=lambda: [sys.stderr.write(l) for l in srv.stderr if "profile" in l],
                     daemon=True).start()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=600) as r:
        model = json.loads(r.read())["data"][0]["id"]
    extra = {"ignore_eos": True}
    if a.guided_regex:
        extra["guided_regex"] = a.guided_regex
    if a.guided_json:
        extra["guided_json"] = schema(a.max_tokens)
    print("| clients | requests | generated tokens | seconds | generated t/s (sum) |")
    print("|---|---|---|---|---|")
    try:
        for c in widths:
            tokens = [0] * c
            def work(i):
                for r in range(a.requests_per_client):
                    out = post(port, "/v1/completions", {
                        "model": model, "prompt": f"Story {i}-{r}: Once upon a time",
                        "max_tokens": a.max_tokens, "temperature": 0, **extra})
                    ch = out["choices"][0]
                    if a.guided_json and ch["finish_reason"] == "stop":
                        json.loads(ch["text"])  # a finished answer parses

                    tokens[i] += out["usage"]["completion_tokens"]
            t0 = time.time()
            ts = [threading.Thread(target=work, args=(i,)) for i in range(c)]
            for t in ts: t.start()
            for t in ts: t.join()
            dt = time.time() - t0
            print(f"| {c} | {c * a.requests_per_client} | {sum(tokens)} | {dt:.1f} | {sum(tokens) / dt:.1f} |", flush=True)
    finally:
        srv.terminate()
        srv.wait(timeout=30)

if __name__ == "__main__":
    main()
