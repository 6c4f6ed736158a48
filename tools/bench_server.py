#!/usr/bin/env python3
"""Aggregate generation throughput of `quiver serve` at several client counts.

Usage: tools/bench_server.py [--model smollm2-135m] [--clients 1,4,16] [--max-tokens 64]
                             [--requests-per-client 3] [--quiver target/release/quiver]
                             [--device cpu|cuda] [--guided-regex PATTERN | --guided-json]
                             [--invariance N] [--server-flags "FLAGS"] [--prompts FILE,...]
`--guided-regex` constrains every request (vLLM's field) to measure constrained decoding; the
pattern must allow `--max-tokens` tokens (e.g. "[a-z ]+"). `--guided-json` constrains every
request to a JSON schema (a list of people too long to end within `--max-tokens`, so that
every request makes them all). `--invariance N` then sends N different prompts (temperature
0) one at a time, then the same N together with the widest width's other clients loading the
server, and prints how many answers are identical (issue 18). `--server-flags` passes more
flags to `quiver serve` (e.g. "--spec ngram"); `--prompts` gives files whose texts the clients
send in turn (client i's request r takes file (i + r) mod n) instead of the short story prompts,
e.g. tools/gpu/spec/*.txt, tasks that quote their input; the table then also gives the tokens
speculation proposed and accepted (from /metrics) at each width. Starts the server on a free loopback port, runs each width in
turn (every client sends its requests back to back, temperature 0, ignore_eos so each request makes max_tokens
tokens unless its constraint ends first), and prints a Markdown table: clients, requests,
generated tokens, seconds, tokens/s summed, and the server's CPU time per generated token (user
and system, all its threads, from /proc: on a machine others load, a steadier measure of the
work than the wall clock). Only the standard library: it runs on a machine
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

def cpu_seconds(pid):
    """A process's user + system CPU time so far (Linux's /proc), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        import os
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")

def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())

def spec_counts(port):
    """Speculation's proposed and accepted token totals so far, from the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    def total(name):
        m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
    return total("quiver_spec_proposed_tokens_total"), total("quiver_spec_accepted_tokens_total")

SUBJECTS = ["the sea", "a small town", "winter", "bread", "a lighthouse keeper", "rivers",
            "the moon", "an old map", "trains", "a garden", "mountains", "a library", "rain",
            "a clock", "birds", "the desert"]

def invariance(port, model, a, extra, clients):
    """N prompts alone, then together under the load of `clients` − N other clients."""
    prompts = [f"Write {i + 2} sentences about {SUBJECTS[i % len(SUBJECTS)]}." + " Be plain." * (i % 5)
               for i in range(a.invariance)]
    def ask(p):
        return post(port, "/v1/completions", {"model": model, "prompt": p, "max_tokens": a.max_tokens,
                                              "temperature": 0, **extra})["choices"][0]["text"]
    alone = [ask(p) for p in prompts]
    together = [None] * len(prompts)
    stop = threading.Event()
    def load(i):
        while not stop.is_set():
            ask(f"Story {i}: Once upon a time")
    def probe(i):
        together[i] = ask(prompts[i])
    loaders = [threading.Thread(target=load, args=(i,)) for i in range(max(0, clients - len(prompts)))]
    for t in loaders: t.start()
    time.sleep(1.0)  # the load is running
    probes = [threading.Thread(target=probe, args=(i,)) for i in range(len(prompts))]
    for t in probes: t.start()
    for t in probes: t.join()
    stop.set()
    for t in loaders: t.join()
    same = sum(x == y for x, y in zip(alone, together))
    print(f"\ninvariance: {same}/{len(prompts)} answers identical alone and with {clients} clients", flush=True)

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
    ap.add_argument("--invariance", type=int, default=0)
    ap.add_argument("--server-flags", default="")
    ap.add_argument("--prompts", default="")
    a = ap.parse_args()
    widths = [int(x) for x in a.clients.split(",")]
    srv = subprocess.Popen([a.quiver, "serve", "-m", a.model, "--port", "0", "--device", a.device,
                            "--max-seqs", str(max(widths))] + a.server_flags.split(), stderr=subprocess.PIPE, text=True)
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
    texts = []
    for f in filter(None, a.prompts.split(",")):
        with open(f) as fh:
            texts.append(fh.read())
    def prompt(i, r):
        return texts[(i + r) % len(texts)] if texts else f"Story {i}-{r}: Once upon a time"
    print("| clients | requests | generated tokens | seconds | generated t/s (sum) | server CPU ms/token "
          "| proposed / accepted |")
    print("|---|---|---|---|---|---|---|")
    try:
        for c in widths:
            tokens = [0] * c
            def work(i):
                for r in range(a.requests_per_client):
                    out = post(port, "/v1/completions", {
                        "model": model, "prompt": prompt(i, r),
                        "max_tokens": a.max_tokens, "temperature": 0, **extra})
                    ch = out["choices"][0]
                    if a.guided_json and ch["finish_reason"] == "stop":
                        json.loads(ch["text"])  # a finished answer parses

                    tokens[i] += out["usage"]["completion_tokens"]
            spec0 = spec_counts(port)
            t0, cpu0 = time.time(), cpu_seconds(srv.pid)
            ts = [threading.Thread(target=work, args=(i,)) for i in range(c)]
            for t in ts: t.start()
            for t in ts: t.join()
            dt, cpu = time.time() - t0, cpu_seconds(srv.pid) - cpu0
            spec = [x - y for x, y in zip(spec_counts(port), spec0)]
            print(f"| {c} | {c * a.requests_per_client} | {sum(tokens)} | {dt:.1f} | {sum(tokens) / dt:.1f} "
                  f"| {1000 * cpu / max(1, sum(tokens)):.2f} | {spec[0]:.0f} / {spec[1]:.0f} |", flush=True)
        if a.invariance:
            invariance(port, model, a, extra, max(widths))
    finally:
        srv.terminate()
        srv.wait(timeout=30)

if __name__ == "__main__":
    main()
