#!/usr/bin/env python3
"""Speculative decoding's figures (issue 37), driven by tools/gpu/spec.sh: for each model and
each prompt of tools/gpu/spec/*.txt (tasks whose answer quotes the prompt), one sequence,
greedy, the same number of generated tokens everywhere:

  quiver plain decode and `--spec ngram`      (`quiver bench -f PROMPT --spec ngram --json`)
  llama.cpp plain decode and n-gram lookup    (`llama-speculative-simple -f PROMPT`)
  quiver with a random draft of the model's vocabulary (the cost floor: nothing is accepted)
  and with the model as its own draft (the ceiling: everything is), on the first prompt

The table goes to $OUT/spec.md (rewritten after every command: a call cut short still returns
it), every command's output to $OUT/spec.log, each measurement to $OUT/spec.jsonl.
"""

import argparse
import glob
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

# quiver synth's presets of the real models' shapes, by (architecture, vocabulary size).
PRESETS = {("llama", 49152): "smollm2-135m", ("gemma3", 262144): "gemma3-270m"}
# general.file_type ids, as quiver synth --type names them.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
              17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


class Run:
    def __init__(self, a):
        self.a = a
        self.t0 = time.time()
        self.out = a.out
        os.makedirs(self.out, exist_ok=True)
        self.log = open(os.path.join(self.out, "spec.log"), "a")
        self.jsonl = open(os.path.join(self.out, "spec.jsonl"), "a")
        self.rows = []  # dicts: model, prompt, n_prompt, engine, spec, tps, sd, acc, tps_step
        self.notes = []

    def left(self):
        return self.a.budget - (time.time() - self.t0)

    def say(self, msg):
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def cmd(self, argv, limit, env=None):
        """Runs argv under `timeout`, at most `limit` s and never past the budget; returns
        (rc, stdout, stderr), rc None when the budget left no room to start it."""
        limit = min(limit, int(self.left()))
        if limit < 5:
            self.say(f"skipped (budget spent): {shlex.join(argv)}")
            return None, "", ""
        full = ["timeout", str(limit)] + argv
        t = time.time()
        p = subprocess.run(full, capture_output=True, text=True, env=env)
        self.log.write(f"$ {shlex.join(full)}\n{p.stdout}{p.stderr}rc {p.returncode}, {time.time() - t:.1f}s\n\n")
        self.log.flush()
        self.say(f"rc {p.returncode} {time.time() - t:5.1f}s {shlex.join(argv)[:160]}")
        return p.returncode, p.stdout, p.stderr

    def add(self, **row):
        self.rows.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        self.table()

    def table(self):
        """spec.md: one row per model, prompt and engine × spec; each t/s against the same
        engine's plain decode, and quiver's against llama.cpp's of the same kind."""
        def find(r, engine, spec):
            for x in self.rows:
                if (x["model"], x["prompt"], x["engine"], x["spec"]) == (r["model"], r["prompt"], engine, spec):
                    return x
            return None

        def ratio(x, y):
            return f"{x['tps'] / y['tps']:.2f}×" if x and y and y["tps"] > 0 else ""

        lines = [f"# Speculative decoding, one sequence, greedy, {self.a.n} generated tokens",
                 "",
                 "; ".join(x for x in [self.a.stage, self.a.device_name or self.a.device] if x) +
                 f"; quiver `bench -f PROMPT --spec …` (mean ± sd of {self.a.reps} runs after a warm-up), "
                 f"llama.cpp `llama-speculative-simple -f PROMPT` (mean ± sd of {self.a.reps} processes, after one "
                 "untimed process per model). Acceptance: accepted / proposed tokens. "
                 "\"× plain\": against the same engine's plain decode on the prompt; "
                 "\"quiver / llama.cpp\": against llama.cpp's row of the same kind (plain, ngram).",
                 "",
                 "| model | prompt | engine | spec | t/s | × plain | acceptance | tokens/step | quiver / llama.cpp |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            plain = find(r, r["engine"], "plain")
            peer = None
            if r["engine"] == "quiver" and r["spec"] in ("plain", "ngram"):
                peer = find(r, "llama.cpp", "plain" if r["spec"] == "plain" else self.a.peer_ngram)
            sd = f" ± {r['sd']:.1f}" if r.get("sd") is not None else ""
            acc = f"{100 * r['acc']:.0f}% ({r['accepted']}/{r['proposed']})" if r.get("proposed") else "–"
            step = f"{r['step']:.2f}" if r.get("step") else ""
            lines.append(f"| {r['model']} | {r['prompt']} ({r['n_prompt']}) | {r['engine']} | {r['spec']} | "
                         f"{r['tps']:.1f}{sd} | {ratio(r, plain) if r['spec'] != 'plain' else ''} | {acc} | "
                         f"{step} | {ratio(r, peer)} |")
        # Per model and row kind: the geometric mean of "× plain" over the prompts.
        kinds = []
        for r in self.rows:
            k = (r["model"], r["engine"], r["spec"])
            if r["spec"] != "plain" and k not in kinds:
                kinds.append(k)
        if kinds:
            lines += ["", "| model | engine | spec | prompts | × plain (geometric mean) |", "|---|---|---|---|---|"]
            for m, e, s in kinds:
                xs = []
                for r in self.rows:
                    if (r["model"], r["engine"], r["spec"]) == (m, e, s):
                        p = find(r, e, "plain")
                        if p and p["tps"] > 0:
                            xs.append(r["tps"] / p["tps"])
                if xs:
                    lines.append(f"| {m} | {e} | {s} | {len(xs)} | {statistics.geometric_mean(xs):.2f}× |")
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        with open(os.path.join(self.out, "spec.md.part"), "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(os.path.join(self.out, "spec.md.part"), os.path.join(self.out, "spec.md"))


def last_line(text):
    lines = text.strip().splitlines()
    return lines[-1][:200] if lines else ""


def model_info(run, q, path):
    rc, so, se = run.cmd([q, "info", "-m", path, "--json"], 60)
    if rc != 0:
        raise SystemExit(f"spec: quiver info {path} failed (rc {rc}): {last_line(se)}")
    d = json.loads(so)
    rc, so, _ = run.cmd([q, "tokenize", "-m", path, "--parse-special", "--no-add-special", "<|im_start|>"], 60)
    chatml = rc == 0 and len(json.loads(so)) == 1 and bool(d["tokenizer"].get("chat_template"))
    return d, chatml


def prompt_file(run, model, chatml, src):
    """The prompt as both engines read it: for a chat model of the ChatML template (SmolLM2)
    the task as the user's turn and its last paragraph (the lead-in: "Here is the whole file
    …:") opening the assistant's; for a base model (Gemma 3 270M) the text as is."""
    text = open(src).read().rstrip()
    if chatml:
        task, lead = text.rsplit("\n\n", 1)
        text = f"<|im_start|>user\n{task}<|im_end|>\n<|im_start|>assistant\n{lead}\n\n"
    else:
        text += "\n\n"
    d = os.path.join(run.a.work, "prompts", model)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, os.path.basename(src))
    with open(path, "w") as f:
        f.write(text)
    return path


def quiver_bench(run, q, path, prompt, spec_args, base):
    argv = [q, "bench", "-m", path, "--device", run.a.device, "-f", prompt, "-n", str(run.a.n),
            "-r", str(run.a.reps), "--json"] + spec_args + run.a.quiver_flags
    rc, so, se = run.cmd(argv, run.a.cmd_limit)
    if rc != 0:
        why = "skipped, the budget spent" if rc is None else f"failed (rc {rc}): {last_line(se)}"
        run.notes.append(f"{base['model']} {base['prompt']}: quiver {' '.join(spec_args)} {why}")
        run.table()
        return []
    out = []
    for r in json.loads(so)["results"]:
        out.append(dict(base, n_prompt=r["n_prompt"], engine="quiver", tps=r["tokens_per_second"], sd=r["sd"],
                        proposed=r["proposed"], accepted=r["accepted"], acc=r["acceptance"],
                        step=r["tokens_per_step"], raw=r))
    return out


DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")


def llama_run(run, binary, path, prompt, extra, base, spec, reps=None, n=None):
    tps, predicted, drafted, accepted = [], 0, 0, 0
    argv = [binary, "-m", path, "-f", prompt, "-n", str(n or run.a.n), "--temp", "0", "--top-k", "1",
            "--ignore-eos", "-c", "4096", "-ngl", "99", "--seed", "42"] + extra
    if reps == 0:  # a warm-up: the file into the page cache, the driver's first start
        run.cmd(argv, 120)
        return
    for _ in range(reps or run.a.reps):
        rc, so, se = run.cmd(argv, 120)
        m = DECODED.search(se + so)
        if rc != 0 or not m:
            why = "skipped, the budget spent" if rc is None else f"failed (rc {rc}): {last_line(se)}"
            run.notes.append(f"{base['model']} {base['prompt']}: llama.cpp {spec} {why}")
            run.table()
            return
        tps.append(float(m.group(3)))
        predicted += int(m.group(1))
        drafted += int(re.search(r"n_drafted\s*=\s*(\d+)", se).group(1))
        accepted += int(re.search(r"n_accept\s*=\s*(\d+)", se).group(1))
    n_prompt = re.search(r"encoded\s+(\d+) tokens", se)
    run.add(**dict(base, n_prompt=int(n_prompt.group(1)) if n_prompt else 0, engine="llama.cpp", spec=spec,
                   tps=statistics.mean(tps), sd=statistics.stdev(tps) if len(tps) > 1 else None,
                   proposed=drafted, accepted=accepted, acc=accepted / drafted if drafted else None,
                   # Each of its target's decode calls gives the accepted proposals and one token.
                   step=predicted / max(predicted - accepted, 1), samples=tps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--quiver", default=".gpu/quiver")
    ap.add_argument("--llama", default="", help="folder of llama-speculative-simple; empty: no llama.cpp rows")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--device-name", default="")
    ap.add_argument("--prompts", default="tools/gpu/spec")
    ap.add_argument("--only", action="append", default=[], help="prompt names (file stems) to run")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-r", dest="reps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--cmd-limit", type=int, default=150)
    ap.add_argument("--drafts", default="first", choices=["first", "all", "none"],
                    help="the random and self drafts on the first prompt, on all, or none")
    ap.add_argument("--work", default="/tmp/quiver-spec")
    ap.add_argument("--out", default=os.environ.get("OUT") or "spec-out")
    ap.add_argument("--stage", default="")
    ap.add_argument("--quiver-flags", default="", help="more flags for every quiver bench call")
    a = ap.parse_args()
    a.quiver_flags = shlex.split(a.quiver_flags)
    # llama.cpp's n-gram lookup (ngram-simple): its lookup and draft lengths set to quiver's
    # (the last 3 tokens matched, at most 16 proposed; quiver matches 4, 3 or 2), then as llama.cpp
    # ships them (12, 48).
    ngrams = [("ngram n3 m16", ["--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16"]),
              ("ngram n12 m48", [])]
    a.peer_ngram = ngrams[0][0]
    run = Run(a)
    prompts = sorted(glob.glob(os.path.join(a.prompts, "*.txt")))
    if a.only:
        prompts = [p for p in prompts if os.path.splitext(os.path.basename(p))[0] in a.only]
    if not prompts:
        raise SystemExit(f"spec: no prompts (*.txt) in {a.prompts}" + (f" named {a.only}" if a.only else ""))
    spec_simple = os.path.join(a.llama, "llama-speculative-simple") if a.llama else ""
    if spec_simple and not os.access(spec_simple, os.X_OK):
        raise SystemExit(f"spec: no {spec_simple} (tools/gpu/peer.sh build)")
    if not spec_simple:
        run.notes.append("no llama.cpp rows (--cpu, or no llama.cpp build)")
    if a.drafts != "none":
        run.notes.append("draft random: `quiver synth --vocab-from MODEL` of the model's shape and type (its "
                         "forward as costly as the model's); draft random 1 layer: the same with `--layers 1`; "
                         "draft self: the model as its own draft (every proposal accepted; `--spec-timing off`, "
                         "since on time it never pays: it shows the machinery's ceiling in tokens a step); all with "
                         "quiver's defaults (`--draft-max 16 --draft-p-min 0`, its adaptive policy on). Their t/s "
                         "include the draft's pass over the prompt, which it makes at the first decode step "
                         "(llama.cpp makes it before its timing starts)")
    run.table()
    for path in a.models:
        info, chatml = model_info(run, a.quiver, path)
        model = os.path.basename(path).removesuffix(".gguf")
        run.say(f"model {model}: {info['architecture']}, {'ChatML user turn' if chatml else 'raw text'}")
        for i, src in enumerate(prompts):
            name = os.path.splitext(os.path.basename(src))[0]
            prompt = prompt_file(run, model, chatml, src)
            base = {"model": model, "prompt": name}
            for r in quiver_bench(run, a.quiver, path, prompt, ["--spec", "ngram"], base):
                run.add(**dict(r, spec="plain" if r["raw"]["spec"] == "none" else "ngram"))
            if spec_simple:
                # Plain decode through the same loop: a lookup of 1024 tokens never matches.
                plain = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024",
                         "--spec-ngram-simple-size-m", "1"]
                if i == 0:
                    llama_run(run, spec_simple, path, prompt, plain, base, "plain", reps=0, n=16)
                llama_run(run, spec_simple, path, prompt, plain, base, "plain")
                for label, extra in ngrams:
                    llama_run(run, spec_simple, path, prompt, ["--spec-type", "ngram-simple"] + extra, base, label)
            if a.drafts == "none" or (a.drafts == "first" and i > 0):
                continue
            # Random drafts of the model's vocabulary, its preset and type: of its shape (as
            # costly as the model), and of one layer (the draft's cost small beside the model's).
            drafts = []
            preset = PRESETS.get((info["architecture"], info["tokenizer"]["vocab_size"]))
            ty = FILE_TYPES.get(info["file_type"])
            for label, layers in (("draft random", []), ("draft random 1 layer", ["--layers", "1"])):
                rnd = os.path.join(a.work, f"random{'-1l' if layers else ''}-{model}.gguf")
                if preset and ty and not os.path.exists(rnd):
                    run.cmd([a.quiver, "synth", "--preset", preset, "--type", ty, "--vocab-from", path, "-o", rnd]
                            + layers, 120)
                if os.path.exists(rnd):
                    drafts.append((label, rnd))
                else:
                    run.notes.append(f"{model}: no {label} (preset {preset}, type {ty})")
            drafts.append(("draft self", path))
            for label, d in drafts:
                timing = ["--spec-timing", "off"] if label == "draft self" else []
                for r in quiver_bench(run, a.quiver, path, prompt, ["--spec", "draft", "-md", d] + timing, base):
                    if r["raw"]["spec"] != "none":
                        run.add(**dict(r, spec=label))
    run.table()
    run.say(f"done: {os.path.join(a.out, 'spec.md')}")
    print(open(os.path.join(a.out, "spec.md")).read())


if __name__ == "__main__":
    main()
