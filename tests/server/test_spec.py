"""Speculative decoding (`--spec-type ngram`): the same text as plain serving, proposed and
accepted tokens on /metrics, and its flags' errors."""

import subprocess

import pytest

from conftest import Server, quiver_exe

PROMPT = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n"
)


@pytest.fixture(scope="module")
def spec_server():
    s = Server("--ctx-size", "1024", "--max-seqs", "4", "--spec-type", "ngram", "--draft-max", "8")
    yield s
    s.stop()


def complete(server, prompt, **kw):
    r = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=48, **kw)
    return r.choices[0].text


def test_ngram_speculation_gives_plain_serving_text_and_counts_its_tokens(server, spec_server):
    before = spec_server.metrics()
    for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
        for prompt in (PROMPT, "The capital of France is"):
            assert complete(spec_server, prompt, **kw) == complete(server, prompt, **kw), (prompt, kw)
    m = spec_server.metrics()
    proposed = m["quiver_spec_proposed_tokens_total"] - before["quiver_spec_proposed_tokens_total"]
    accepted = m["quiver_spec_accepted_tokens_total"] - before["quiver_spec_accepted_tokens_total"]
    assert 0 < accepted <= proposed
    assert m['vllm:spec_decode_num_accepted_tokens_total{model_name="%s"}' % spec_server.model] == m[
        "quiver_spec_accepted_tokens_total"
    ]
    # Plain serving proposes nothing.
    assert server.metrics()["quiver_spec_proposed_tokens_total"] == 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--spec-type", "draft"], "none or ngram"),
        (["--spec-type", "ngram", "--draft-min", "9", "--draft-max", "4"], "--draft-min 9 is above --draft-max 4"),
        (["--draft-max", "100000"], "--draft-max"),
    ],
)
def test_bad_speculation_flags_are_one_line_errors(args, says):
    r = subprocess.run([str(quiver_exe()), "serve", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert says in r.stderr and r.stderr.count("\n") == 1, r.stderr
