#!/usr/bin/env python3
"""The GPU bench of tools/gpu/bench.sh (usage there and in tools/gpu/README.md): a matrix file's
models x tests x configurations, quiver's binaries and llama.cpp alternated in one call, the
results table and the raw log under $OUT. Standard library only (the GPU machine's python3)."""

import argparse
import hashlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
T0 = time.time()
QUIVER_KV = ("f16", "bf16", "q8_0", "tq8", "tq4")
LLAMA_KV = ("f16", "bf16", "q8_0")  # the KV types llama.cpp has too
PEER = "llama.cpp"
CMD_LIMIT = 300  # seconds, one bench command
GRACE = 40  # seconds past the budget before a running command is stopped
STEPS = ("run", "prepare", "compare", "tests", "peer")
TEST_SETS = {
    # name: (title, binary, arguments)
    "compile": ("kernels compile", "test-kernels_compile", []),
    "ops": ("op tests", "test-gpu_ops", ["--include-ignored", "--test-threads=1"]),
    "engine": ("engine GPU tests", "test-gpu", ["--include-ignored", "--test-threads=1", "--skip", "real_models"]),
    "engine-real": ("engine GPU tests, real models too", "test-gpu", ["--include-ignored", "--test-threads=1"]),
    "archs": ("architectures on the GPU", "test-archs", ["--include-ignored", "--test-threads=1", "gpu_matches"]),
    "llama-archs": ("llama.cpp's test models on the GPU", "test-llama_archs", ["--include-ignored", "--test-threads=1", "gpu_matches"]),
    "spec": ("speculative decoding on the GPU", "test-gpu_spec", ["--include-ignored", "--test-threads=1", "--nocapture"]),
    "eagle3": ("EAGLE-3 heads against llama.cpp on the GPU", "test-eagle3", ["--include-ignored", "--test-threads=1", "--nocapture", "gpu_head"]),
    "mtp": ("multi-token-prediction blocks against llama.cpp on the GPU", "test-mtp", ["--include-ignored", "--test-threads=1", "--nocapture", "gpu_block"]),
    "tp": ("tensor parallelism on the GPU (through the host, and over NCCL on the GPUs there are)", "test-gpu_tp", ["--include-ignored", "--test-threads=1", "--nocapture"]),
}
DEFAULT_TESTS = ("compile", "ops", "engine", "archs", "llama-archs", "spec", "eagle3", "mtp", "tp")


def elapsed():
    return time.time() - T0


def say(*words):
    print(f"[{elapsed():4.0f}s]", *words, flush=True)


def fail(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------
# The matrix file


class Model:
    """`model: FILE.gguf`, or `model: PRESET TYPE [--layers N]` made by `quiver synth` (the
    first N blocks of the preset with --layers: a model too big for one GPU, DeepSeek-V4-Flash)."""

    def __init__(self, words, where, models_dir):
        self.layers = None
        if len(words) == 4 and words[2] == "--layers" and words[3].isdigit():
            self.layers = int(words[3])
            words = words[:2]
        if len(words) == 1 and words[0].endswith(".gguf"):
            self.path, self.preset, self.ftype = words[0], None, None
            self.name = os.path.basename(words[0])[: -len(".gguf")]
        elif len(words) == 2:
            self.preset, self.ftype = words
            self.name = f"{self.preset}-{self.ftype}" + (f"-l{self.layers}" if self.layers else "")
            self.path = os.path.join(models_dir, self.name + ".gguf")
        else:
            raise ValueError(f"{where}: model: PRESET TYPE [--layers N] (quiver synth) or FILE.gguf")


class Test:
    """One `quiver bench` call's shape, written with its flags."""

    FLAGS = {"-p": "p", "--n-prompt": "p", "-n": "n", "--n-gen": "n", "-d": "d", "--n-depth": "d",
             "--kv-type": "kv", "--kv-type-k": "k", "--kv-type-v": "v", "--parallel": "par"}

    def __init__(self, words, where):
        self.text = " ".join(words)
        self.p, self.n, self.d, self.k, self.v, self.par = 512, 128, 0, None, None, None
        i = 0
        while i < len(words):
            flag, _, value = words[i].partition("=") if words[i].startswith("--") else (words[i], "", "")
            if flag not in self.FLAGS:
                raise ValueError(f"{where}: test: unknown flag {flag} (known: {', '.join(self.FLAGS)})")
            if not value:
                i += 1
                if i == len(words):
                    raise ValueError(f"{where}: test: {flag} needs a value")
                value = words[i]
            i += 1
            key = self.FLAGS[flag]
            if key in ("kv", "k", "v"):
                if value not in QUIVER_KV:
                    raise ValueError(f"{where}: test: KV type {value} (known: {', '.join(QUIVER_KV)})")
                if key in ("kv", "k"):
                    self.k = value
                if key in ("kv", "v"):
                    self.v = value
            elif key == "par":
                try:
                    self.par = [int(x) for x in value.split(",")]
                except ValueError:
                    raise ValueError(f"{where}: test: --parallel takes counts like 1,8,64") from None
                if not self.par or min(self.par) < 1:
                    raise ValueError(f"{where}: test: --parallel takes counts of 1 or more")
            else:
                try:
                    setattr(self, key, int(value))
                except ValueError:
                    raise ValueError(f"{where}: test: {flag} takes a number") from None
                if getattr(self, key) < 0:
                    raise ValueError(f"{where}: test: {flag} takes a number of 0 or more")
        if self.par and self.d:
            raise ValueError(f"{where}: test: --parallel with -d (quiver bench refuses it)")
        if self.par and not (self.p and self.n):
            raise ValueError(f"{where}: test: --parallel needs -p and -n above 0")
        if not (self.p or self.n):
            raise ValueError(f"{where}: test: -p and -n are both 0")

    def kv_suffix(self):
        if self.k is None and self.v is None:
            return ""
        k, v = self.k or "f16", self.v or "f16"
        return f" kv {k}" if k == v else f" kv {k}/{v}"

    def metrics(self):
        """The (kind, sequences) keys this test yields, in table order."""
        if self.par:
            return [(kind, b) for b in self.par for kind in ("pp", "tg")]
        return [(kind, None) for kind, size in (("pp", self.p), ("tg", self.n)) if size]

    def label(self, key):
        kind, b = key
        size = self.p if kind == "pp" else self.n
        where = f" B={b}" if b else (f" @ d{self.d}" if self.d else "")
        return f"{kind}{size}{where}{self.kv_suffix()}"

    def quiver_args(self, model, reps):
        a = ["bench", "-m", model, "--device", "cuda", "-p", str(self.p), "-n", str(self.n)]
        if self.par:
            a += ["--parallel", ",".join(map(str, self.par))]
        else:
            a += ["-r", str(reps)] + (["-d", str(self.d)] if self.d else [])
        if self.k is not None and self.k == self.v:
            a += ["--kv-type", self.k]
        else:
            a += (["--kv-type-k", self.k] if self.k else []) + (["--kv-type-v", self.v] if self.v else [])
        return a + ["--json"]

    def peer_argv(self, bindir, model, reps):
        """llama.cpp's command for the same measurement, or None where it has no such KV type."""
        k, v = self.k or "f16", self.v or "f16"
        if k not in LLAMA_KV or v not in LLAMA_KV:
            return None
        kv = [] if self.k is None and self.v is None else ["-ctk", k, "-ctv", v]
        if self.par:
            ctx = -(-max(self.par) * (self.p + self.n) // 1024) * 1024
            return [os.path.join(bindir, "llama-batched-bench"), "-m", model, "-c", str(ctx), "-b", "2048",
                    "-ub", "512", "-npp", str(self.p), "-ntg", str(self.n), "-npl", ",".join(map(str, self.par)),
                    "-ngl", "99", "-fa", "on", "--output-format", "jsonl"] + kv
        return ([os.path.join(bindir, "llama-bench"), "-m", model, "-ngl", "99", "-fa", "1", "-p", str(self.p),
                 "-n", str(self.n), "-r", str(reps), "-o", "jsonl"]
                + (["-d", str(self.d)] if self.d else []) + kv)


class Config:
    def __init__(self, words, where):
        if len(words) < 2:
            raise ValueError(f"{where}: config: NAME BINARY [FLAG...] [VAR=VALUE...]")
        self.name, self.binary = words[0], words[1]
        if self.name == PEER:
            raise ValueError(f"{where}: config: {PEER} names the peer (peer: {PEER})")
        self.flags, self.env = [], {}
        for w in words[2:]:
            if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w):
                key, _, value = w.partition("=")
                self.env[key] = value
            else:
                self.flags.append(w)

    def describe(self):
        extra = " ".join([shlex.quote(f) for f in self.flags] + [f"{k}={shlex.quote(v)}" for k, v in self.env.items()])
        return f"{self.binary}{' ' + extra if extra else ''}"


class Matrix:
    def __init__(self, path, models_dir):
        with open(path, encoding="utf-8") as f:
            self.path, self.text = path, f.read()
        self.models, self.tests, self.configs = [], [], []
        self.peer, self.rounds, self.reps = False, 3, 3
        for ln, raw in enumerate(self.text.splitlines(), 1):
            where = f"{path}:{ln}"
            line = re.sub(r"(^|\s)#.*$", "", raw).strip()
            if not line:
                continue
            key, sep, value = line.partition(":")
            key = key.strip().lower()
            try:
                words = shlex.split(value)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            if not sep or not words:
                raise ValueError(f"{where}: expected `key: value`")
            if key == "model":
                self.models.append(Model(words, where, models_dir))
            elif key == "test":
                self.tests.append(Test(words, where))
            elif key == "config":
                self.configs.append(Config(words, where))
            elif key == "peer":
                if words[0] not in (PEER, "off"):
                    raise ValueError(f"{where}: peer: {PEER} or off")
                self.peer = words[0] == PEER
            elif key in ("rounds", "reps"):
                if len(words) != 1 or not words[0].isdigit() or int(words[0]) < 1:
                    raise ValueError(f"{where}: {key}: a count of 1 or more")
                setattr(self, key, int(words[0]))
            else:
                raise ValueError(f"{where}: unknown key {key} (model, test, config, peer, rounds, reps)")
        for what, items in (("model", self.models), ("config", self.configs)):
            if not items:
                raise ValueError(f"{path}: no {what}: line")
        for what, names in (("model", [m.name for m in self.models]), ("config", [c.name for c in self.configs])):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{path}: {what} names twice: {', '.join(dup)}")

    def select(self, only):
        """--only model=NAME / config=NAME / test=TEXT (a word of the test line): several values of
        one key widen the selection, several keys narrow it."""
        want = {}
        for o in only:
            key, sep, value = o.partition("=")
            if not sep or key not in ("model", "config", "test"):
                fail(f"--only {o}: model=NAME, config=NAME or test=TEXT")
            want.setdefault(key, []).append(value)
        if "model" in want:
            self.models = [m for m in self.models if m.name in want["model"]]
        if "test" in want:
            self.tests = [t for t in self.tests if any(v in t.text for v in want["test"])]
        if "config" in want:
            self.configs = [c for c in self.configs if c.name in want["config"]]
            self.peer = self.peer and PEER in want["config"]
        if not self.models or not (self.configs or self.peer):
            fail(f"--only {' '.join(only)} leaves nothing to run")


# ---------------------------------------------------------------------------------------------
# Running


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def shown(argv, env=None):
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()] + [shlex.quote(a) for a in argv])


def first_json(text):
    """The first JSON object in `text` (quiver prints one, pretty or on one line)."""
    i = text.find("{")
    while i >= 0:
        try:
            return json.JSONDecoder().raw_decode(text[i:])[0]
        except ValueError:
            i = text.find("{", i + 1)
    raise ValueError("no JSON object in the output")


def parse_quiver(test, out):
    j, got = first_json(out), {}
    for r in j["results"]:
        if test.par:
            b = int(r["parallel"])
            got[("pp", b)] = [r["pp_tokens_per_second"]]
            got[("tg", b)] = [r["tg_tokens_per_second"]]
        else:
            kind = "pp" if r["test"].startswith("pp") else "tg"
            got[(kind, None)] = list(r.get("samples") or [r["tokens_per_second"]])
    return got


def parse_peer(out):
    """llama-bench's and llama-batched-bench's JSON lines."""
    got = {}
    for line in out.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "samples_ts" in r:
            got[("tg" if r.get("n_gen", 0) else "pp", None)] = list(r["samples_ts"])
        elif "speed_tg" in r:
            got[("pp", int(r["pl"]))] = [r["speed_pp"]]
            got[("tg", int(r["pl"]))] = [r["speed_tg"]]
    if not got:
        raise ValueError("no result lines in the output")
    return got


def fmt(x):
    return f"{x:,.1f}" if x < 100000 else f"{x:,.0f}"


class Bench:
    def __init__(self, args):
        self.args, self.dry = args, args.dry_run
        self.out = args.out
        self.deadline = T0 + args.budget
        self.skipped = 0
        self.records = []
        self.log = None
        self.peer_dir = args.peer_dir
        self.peer_bin = os.path.join(self.peer_dir, "build", "bin")
        if not self.dry:
            os.makedirs(self.out, exist_ok=True)

    def open_log(self, name):
        if not self.dry:
            self.log = open(os.path.join(self.out, name), "a", encoding="utf-8")

    def write(self, text):
        if self.log:
            self.log.write(text if text.endswith("\n") else text + "\n")
            self.log.flush()

    def time_left(self):
        """Seconds a command may still run: up to the budget's end plus the grace."""
        return self.deadline + GRACE - time.time()

    def execute(self, argv, env=None, limit=CMD_LIMIT):
        """Runs argv (env added); returns (exit code, stdout, stderr, seconds). -1: timed out."""
        self.write(f"\n[{elapsed():.0f}s] $ {shown(argv, env)}")
        t = time.time()
        full = dict(os.environ)
        full.update(env or {})
        try:
            p = subprocess.run(argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=max(1, limit), start_new_session=True)
            rc, so, se = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, so, se = -1, e.stdout or b"", (e.stderr or b"") + f"\n(stopped after {limit:.0f} s)".encode()
        except OSError as e:
            rc, so, se = 127, b"", str(e).encode()
        so, se = so.decode(errors="replace"), se.decode(errors="replace")
        secs = time.time() - t
        self.write(f"[exit {rc}, {secs:.1f} s]\n--- stdout\n{so}--- stderr\n{se}")
        return rc, so, se, secs

    def header_info(self):
        gpu = "no nvidia-smi"
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                                  "--format=csv,noheader"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 timeout=20).stdout.decode().strip().replace("\n", "; ")
        except (OSError, subprocess.SubprocessError):
            pass
        try:
            commit = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%h %cd", "--date=iso"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10).stdout.decode().strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
        if os.path.exists(".gpu/stage.txt"):  # tools/gpu/stage.sh's record (a call's tree has no .git)
            with open(".gpu/stage.txt", encoding="utf-8") as f:
                commit = "; ".join(f.read().split("\n")).strip("; ")
        return gpu, commit or "unknown"

    # -- models and the peer build ------------------------------------------------------------

    def synth_binary(self, m):
        return ".gpu/quiver" if os.path.exists(".gpu/quiver") or not m.configs else m.configs[0].binary

    def prepare(self, m):
        """Starts the peer build (in the background) and makes the missing models."""
        t = time.time()
        build = None
        if m.peer and not os.path.exists(os.path.join(self.peer_bin, "llama-batched-bench")):
            argv = ["bash", "tools/gpu/peer.sh", "build", self.peer_dir]
            say(f"peer: building llama.cpp (about 6 min), log in $OUT/peer.log: {shown(argv)}")
            if not self.dry:
                with open(os.path.join(self.out, "peer.log"), "a") as plog:
                    build = subprocess.Popen(argv, stdout=plog, stderr=subprocess.STDOUT, start_new_session=True)
        elif m.peer:
            say(f"peer: llama.cpp built in {self.peer_bin}")
        synth = self.synth_binary(m)
        for model in m.models:
            if not model.preset or os.path.exists(model.path):
                say(f"model {model.name}: {model.path}{'' if os.path.exists(model.path) else ' (missing)'}")
                continue
            argv = [synth, "synth", "--preset", model.preset, "--type", model.ftype, "-o", model.path + ".part"]
            if model.layers:
                argv[4:4] = ["--layers", str(model.layers)]
            say(f"model {model.name}: {shown(argv)}")
            if self.dry:
                continue
            os.makedirs(os.path.dirname(model.path), exist_ok=True)
            rc, _, se, secs = self.execute(argv, limit=min(600, self.time_left()))
            if rc == 0:
                os.replace(model.path + ".part", model.path)
                say(f"model {model.name}: made in {secs:.0f} s")
            else:
                say(f"model {model.name}: synth FAILED (exit {rc}): {' | '.join(se.strip().splitlines()[-2:])}")
        if build:
            try:
                build.wait(timeout=max(1, self.time_left()))
            except subprocess.TimeoutExpired:
                os.killpg(build.pid, signal.SIGTERM)
                build.wait()
            say(f"peer: build exit {build.returncode}" + ("" if build.returncode == 0 else " (see $OUT/peer.log)"))
        say(f"step prepare: {time.time() - t:.0f} s")

    # -- the bench ----------------------------------------------------------------------------

    def run(self, m):
        self.matrix = m
        self.open_log("bench.log")
        gpu, commit = self.header_info()
        self.gpu, self.commit = gpu, commit
        say(f"{m.path}: {len(m.models)} models x {len(m.tests)} tests x {len(m.configs)} configs"
            f"{' + ' + PEER if m.peer else ''}, {m.rounds} rounds, reps {m.reps}; GPU: {gpu}")
        self.write(f"matrix {m.path}\n{m.text}\nGPU: {gpu}\nbuilt from: {commit}")
        missing = [c for c in m.configs if not os.access(c.binary, os.X_OK)]
        for c in missing:
            say(f"config {c.name}: {c.binary} is missing (tools/gpu/stage.sh, then carry it)")
        if missing and not self.dry:
            fail("missing binaries")
        self.ids = {c.name: (sha(c.binary), os.path.getsize(c.binary)) for c in m.configs if c not in missing}
        self.prepare(m)
        peer = m.peer and (self.dry or os.access(os.path.join(self.peer_bin, "llama-bench"), os.X_OK))
        if m.peer and not peer:
            say("peer: no llama.cpp build, so no llama.cpp rows")
        entries = list(m.configs) + ([PEER] if peer else [])
        for model in m.models:
            if not self.dry and not os.path.exists(model.path):
                say(f"model {model.name}: no file, so no rows")
        t = time.time()
        n = 0
        for r in range(1, m.rounds + 1):
            # Each round reverses the order (A B, then B A): slow drift weighs on every entry alike.
            order = entries if r % 2 else entries[::-1]
            for model in m.models:
                if not self.dry and not os.path.exists(model.path):
                    continue
                for test in m.tests:
                    for e in order:
                        n += 1
                        self.one(r, model, test, e)
        say(f"step bench: {time.time() - t:.0f} s, {n - self.skipped} commands"
            + (f", {self.skipped} not run (budget)" if self.skipped else ""))
        if not self.dry:
            self.write_table()
            with open(os.path.join(self.out, "results.md"), encoding="utf-8") as f:
                print(f.read(), flush=True)

    def one(self, rnd, model, test, e):
        m = self.matrix
        if e == PEER:
            argv, env = test.peer_argv(self.peer_bin, model.path, m.reps), {}
            if argv is None:
                return
        else:
            argv, env = [e.binary] + test.quiver_args(model.path, m.reps) + e.flags, e.env
        name = e if e == PEER else e.name
        what = f"r{rnd} {model.name} [{test.text}] {name}"
        if self.dry:
            print(f"  {what}: {shown(argv, env)}", flush=True)
            return
        if time.time() > self.deadline or self.time_left() < 10:
            self.skipped += 1
            self.write(f"not run (budget): {shown(argv, env)}")
            return
        rc, so, se, secs = self.execute(argv, env, min(CMD_LIMIT, self.time_left()))
        try:
            if rc != 0:
                raise ValueError(f"exit {rc}")
            got = parse_peer(so + "\n" + se) if e == PEER else parse_quiver(test, so)
        except (ValueError, KeyError, TypeError) as err:
            tail = " | ".join(se.strip().splitlines()[-3:])
            say(f"{what}: FAILED ({err}; {secs:.0f} s): {tail}")
            self.records.append({"round": rnd, "model": model.name, "test": test.text, "config": name,
                                 "error": str(err)})
            return
        new = [{"round": rnd, "model": model.name, "test": test.label(key), "config": name, "samples": got[key]}
               for key in test.metrics() if key in got]
        self.records += new
        with open(os.path.join(self.out, "results.jsonl"), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in new)
        say(f"{what}: {self.brief(test, got)} ({secs:.0f} s)")
        self.write_table()

    @staticmethod
    def brief(test, got):
        """One line of figures: pp512 9,336.5, tg128 252.7; with --parallel, each kind's per count."""
        if test.par:
            kinds = [f"{kind}{test.p if kind == 'pp' else test.n} "
                     + " ".join(fmt(statistics.mean(got[(kind, b)])) if (kind, b) in got else "-" for b in test.par)
                     for kind in ("pp", "tg")]
            return ", ".join(kinds) + f" (B={','.join(map(str, test.par))})"
        return ", ".join(f"{test.label(k)} {fmt(statistics.mean(got[k]))}" for k in test.metrics() if k in got) or "no figures"

    def write_table(self):
        m = self.matrix
        names = [c.name for c in m.configs] + [PEER]
        first = m.configs[0].name if m.configs else None
        by = {}
        for rec in self.records:
            if "samples" in rec:
                by.setdefault((rec["model"], rec["test"], rec["config"]), []).append(rec)
        lines = [f"# quiver bench: {m.path}", ""]
        lines.append(f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(T0))}, {elapsed():.0f} s; "
                     f"GPU: {self.gpu}; built from {self.commit}")
        for c in m.configs:
            h, size = self.ids.get(c.name, ("?", 0))
            lines.append(f"- `{c.name}`: {c.describe()} (sha256 {h}, {size / 1e6:.1f} MB)")
        if m.peer:
            lines.append(f"- `{PEER}`: llama-bench -ngl 99 -fa 1, llama-batched-bench -fa on (CUDA, sm_90)")
        lines.append(f"- {m.rounds} rounds, the order reversed each round; -r {m.reps} per call; t/s: mean ± sd "
                     "over every sample; B=N: N sequences (--parallel, llama-batched-bench), t/s summed")
        if self.skipped:
            lines.append(f"- **{self.skipped} commands not run** (time budget): the table is partial")
        first = first if len(m.configs) > 1 else None  # a ratio column against the first config
        head = ("| model | test | config | t/s | n | per round |" + (f" vs {PEER} |" if m.peer else "")
                + (f" vs {first} |" if first else ""))
        lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
        for model in m.models:
            for test in m.tests:
                for key in test.metrics():
                    label = test.label(key)
                    stats = {}
                    for name in names:
                        recs = by.get((model.name, label, name))
                        if recs:
                            s = [x for rec in recs for x in rec["samples"]]
                            rounds = [statistics.mean(rec["samples"]) for rec in recs]
                            sd = statistics.stdev(s) if len(s) > 1 else 0.0
                            stats[name] = (statistics.mean(s), sd, len(s), rounds)
                    for i, name in enumerate(x for x in names if x in stats):
                        mean, sd, cnt, rounds = stats[name]
                        vs_peer = f"{mean / stats[PEER][0]:.3f}" if PEER in stats and name != PEER else ""
                        vs_first = f"{mean / stats[first][0]:.3f}" if first in stats and name != PEER else ""
                        row = (f"| {model.name if i == 0 else ''} | {label if i == 0 else ''} | {name} | "
                               f"{fmt(mean)} ± {fmt(sd)} | {cnt} | {' / '.join(fmt(x) for x in rounds)} |")
                        lines.append(row + (f" {vs_peer} |" if m.peer else "") + (f" {vs_first} |" if first else ""))
        failed = [r for r in self.records if "error" in r]
        if failed:
            lines += ["", "Failed (bench.log has the output):"]
            lines += [f"- r{r['round']} {r['model']} [{r['test']}] {r['config']}: {r['error']}" for r in failed]
        lines += ["", "The matrix:", "", "```", m.text.rstrip(), "```", ""]
        tmp = os.path.join(self.out, "results.md.part")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
        os.replace(tmp, os.path.join(self.out, "results.md"))

    # -- quiver compare, the GPU tests, the peer build alone ----------------------------------

    def compare(self, m):
        self.open_log("compare.log")
        m.peer = False
        self.prepare(m)
        rows = ["| model | config | numerics | prompt rel L2 | prompt max abs | prompt top-1 | decode rel L2 | "
                "decode max abs | decode top-1 |", "|---|---|---|---|---|---|---|---|---|"]
        for model in m.models:
            for c in m.configs:
                argv = [c.binary, "compare", "-m", model.path, "--device", "cuda", "-n", "64", "--decode", "32",
                        "--json"] + c.flags
                if self.dry:
                    print(f"  {model.name} {c.name}: {shown(argv, c.env)}", flush=True)
                    continue
                if self.time_left() < 10:
                    self.skipped += 1
                    continue
                rc, so, se, secs = self.execute(argv, c.env, min(CMD_LIMIT, self.time_left()))
                try:
                    j = first_json(so)
                    p, d = j["prompt"], j["decode"]
                    cells = [j.get("numerics", ""), f"{p['rel_l2']:.2e}", f"{p['max_abs']:.3g}",
                             f"{p['top1_agreement']:.3f}", f"{d['rel_l2']:.2e}", f"{d['max_abs']:.3g}",
                             f"{d['top1_agreement']:.3f}"]
                except (ValueError, KeyError, TypeError):
                    cells = [f"FAILED (exit {rc})"] + [""] * 6
                rows.append(f"| {model.name} | {c.name} | " + " | ".join(cells) + " |")
                say(f"compare {model.name} {c.name}: {' '.join(cells)} ({secs:.0f} s)")
        if not self.dry:
            with open(os.path.join(self.out, "compare.md"), "w", encoding="utf-8") as f:
                f.write(f"# quiver compare (GPU against the CPU): {m.path}\n\n" + "\n".join(rows) + "\n")
            print("\n".join(rows), flush=True)

    def tests(self, sets):
        self.open_log("tests.log")
        passed = failed = 0
        bad = []
        for s in sets:
            if s.partition(":")[0] not in TEST_SETS:
                fail(f"tests: unknown set {s} (known: {', '.join(TEST_SETS)}; ops:FILTER,FILTER)")
        for s in sets or DEFAULT_TESTS:
            name, _, filters = s.partition(":")
            title, binary, extra = TEST_SETS[name]
            argv = [os.path.join(".gpu", binary)] + extra + [f for f in filters.split(",") if f]
            say(f"{title}: {shown(argv)}")
            if self.dry:
                continue
            if not os.access(argv[0], os.X_OK):
                say(f"{title}: {argv[0]} is missing (tools/gpu/stage.sh, then carry it)")
                bad.append(name)
                continue
            t = time.time()
            self.write(f"\n[{elapsed():.0f}s] $ {shown(argv)}")
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            limit = max(1, min(900, self.time_left()))
            watchdog = threading.Timer(limit, os.killpg, (p.pid, signal.SIGTERM))
            watchdog.start()
            for raw in p.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                self.write(line)
                if re.search(r"^test result:|\.\.\. FAILED$|panicked|^error", line):
                    print("   ", line, flush=True)
                res = re.match(r"^test result: \w+\. (\d+) passed; (\d+) failed", line)
                if res:
                    passed += int(res.group(1))
                    failed += int(res.group(2))
            p.stdout.close()
            rc = p.wait()
            watchdog.cancel()
            if time.time() - t >= limit:
                say(f"{title}: stopped after {limit:.0f} s (time budget)")
            if rc != 0:
                bad.append(name)
            say(f"{title}: exit {rc}, {time.time() - t:.0f} s")
        if not self.dry:
            print(f"tests: {passed} passed, {failed} failed" + (f" (sets that did not pass: {', '.join(bad)})" if bad else ""))
        return 1 if bad else 0

    def peer_only(self):
        argv = ["bash", "tools/gpu/peer.sh", "build", self.peer_dir]
        say(f"peer: {shown(argv)}")
        if self.dry:
            return 0
        self.open_log("peer.log")
        rc, so, se, secs = self.execute(argv, limit=max(1, self.time_left()))
        print(so + se, end="", flush=True)
        say(f"step peer: exit {rc}, {secs:.0f} s")
        return 0 if rc == 0 else 1


def main():
    ap = argparse.ArgumentParser(prog="tools/gpu/bench.sh", description=__doc__)
    ap.add_argument("words", nargs="+", metavar="[STEP] MATRIX | tests [SET...] | peer")
    ap.add_argument("-n", "--dry-run", action="store_true", help="print the commands, run none")
    ap.add_argument("--only", action="append", default=[], metavar="KEY=VALUE",
                    help="model=NAME, config=NAME (llama.cpp: the peer), test=TEXT; repeatable")
    ap.add_argument("--budget", type=float, default=540, metavar="S",
                    help="start no command after S seconds from the start (default 540)")
    ap.add_argument("--rounds", type=int, help="override the matrix's rounds")
    ap.add_argument("--reps", type=int, help="override the matrix's reps")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/out", help="output folder (default $OUT)")
    ap.add_argument("--models", default="/tmp/quiver-models", help="where synth files go (default %(default)s)")
    ap.add_argument("--peer-dir", default="/tmp/quiver-peer", help="llama.cpp's build (default %(default)s)")
    args = ap.parse_intermixed_args()
    here = os.getcwd()
    args.out, args.models, args.peer_dir = (os.path.abspath(p) for p in (args.out, args.models, args.peer_dir))
    os.chdir(ROOT)
    words = args.words if args.words[0] in STEPS else ["run"] + args.words
    step, rest = words[0], words[1:]
    b = Bench(args)
    if step in ("tests", "peer"):
        rc = b.tests(rest) if step == "tests" else b.peer_only()
        if b.log:
            b.log.close()
        sys.exit(rc)
    if len(rest) != 1:
        fail(f"{step} takes one matrix file")
    try:
        m = Matrix(os.path.relpath(os.path.join(here, rest[0]), ROOT), args.models)
    except (OSError, ValueError) as e:
        fail(str(e))
    m.rounds = args.rounds or m.rounds
    m.reps = args.reps or m.reps
    m.select(args.only)
    if step == "run" and not m.tests:
        fail(f"{m.path}: no test: line")
    if step == "prepare":
        b.open_log("bench.log")
        b.prepare(m)
    elif step == "compare":
        b.compare(m)
    else:
        b.run(m)
    if b.log:
        b.log.close()


if __name__ == "__main__":
    main()
