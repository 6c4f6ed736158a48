#!/usr/bin/env python3
"""Aggregate generation throughput of `quiver serve` at several client counts.

Usage: tools/bench_server.py [--model smollm2-135m] [--clients 1,4,16] [--max-tokens 64]
                             [--requests-per-client 3] [--quiver target/release/quiver]
                             [--guided-regex PATTERN]
`--guided-regex` constrains every request (vLLM's field) to measure constrained decoding; the
pattern must allow `--max-tokens` tokens (e.g. "[a-z ]+").
Starts the server on a free loopback port, runs each width in turn (every client sends its
requests back to back, temperature 0, ignore_eos so each request makes max_tokens tokens), and
prints a Markdown table: clients, requests, generated tokens, seconds, tokens/s summed.
"""
import argparse, re, subprocess, sys, threading, time
from openai import OpenAI

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--quiver", default="target/release/quiver")
    ap.add_argument("--guided-regex", default=None)
    a = ap.parse_args()
    widths = [int(x) for x in a.clients.split(",")]
    srv = subprocess.Popen([a.quiver, "serve", "-m", a.model, "--port", "0", "--max-seqs", str(max(widths))],
                           stderr=subprocess.PIPE, text=True)
    port = None
    for line in srv.stderr:
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        sys.exit("the server did not start")
    threading.Thread(target=lambda: [None for _ in srv.stderr], daemon=True).start()
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    model = client.models.list().data[0].id
    extra = {"ignore_eos": True}
    if a.guided_regex:
        extra["guided_regex"] = a.guided_regex
    print("| clients | requests | generated tokens | seconds | generated t/s (sum) |")
    print("|---|---|---|---|---|")
    try:
        for c in widths:
            tokens = [0] * c
            def work(i):
                for r in range(a.requests_per_client):
                    out = client.completions.create(model=model, prompt=f"Story {i}-{r}: Once upon a time",
                                                    max_tokens=a.max_tokens, temperature=0,
                                                    extra_body=extra)
                    tokens[i] += out.usage.completion_tokens
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
