"""Speculative decoding (`--spec-type ngram`, a draft model with `-md`, and a Qwen 3.5 model's
own multi-token-prediction block with `--spec-type mtp`): the same text as plain serving,
proposed and accepted tokens on /metrics, the per-request `speculative.*` fields, and its
flags' errors."""

import json
import subprocess

import pytest

from conftest import Server, model_path, quiver_exe

PROMPT = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n"
)


@pytest.fixture(scope="module")
def spec_server():
    # Proposals by acceptance alone (--spec-timing off): the counts below do not depend on this
    # machine's step times.
    s = Server("--ctx-size", "1024", "--max-seqs", "4", "--spec-type", "ngram", "--draft-max", "8", "--spec-timing", "off")
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


@pytest.fixture(scope="module")
def draft_server():
    # The model as its own draft: its greedy proposals are the model's own tokens.
    s = Server("--ctx-size", "1024", "--max-seqs", "4", "-md", str(model_path()), "--draft-max", "6", "--spec-timing", "off")
    yield s
    s.stop()


def test_a_draft_model_gives_plain_serving_text(server, draft_server):
    before = draft_server.metrics()
    for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
        for prompt in (PROMPT, "The capital of France is"):
            assert complete(draft_server, prompt, **kw) == complete(server, prompt, **kw), (prompt, kw)
    m = draft_server.metrics()
    proposed = m["quiver_spec_proposed_tokens_total"] - before["quiver_spec_proposed_tokens_total"]
    accepted = m["quiver_spec_accepted_tokens_total"] - before["quiver_spec_accepted_tokens_total"]
    # Greedy, every proposal is accepted; seeded, some.
    assert proposed > 40 and accepted > proposed // 2, (accepted, proposed)
    # The draft's KV is counted in the startup line.
    assert any("the draft model's, in the same blocks" in line for line in draft_server.stderr_lines)


def test_per_request_fields_apply_and_bad_values_are_400s(server, draft_server):
    # n_max 0: no proposal for this request, the same text.
    before = draft_server.metrics()["quiver_spec_proposed_tokens_total"]
    text = complete(draft_server, PROMPT, temperature=0, extra_body={"speculative.n_max": 0})
    assert text == complete(server, PROMPT, temperature=0)
    assert draft_server.metrics()["quiver_spec_proposed_tokens_total"] == before
    text = complete(draft_server, PROMPT, temperature=0, extra_body={"speculative": {"n_max": 2, "p_min": 0.5}})
    assert text == complete(server, PROMPT, temperature=0)
    assert draft_server.metrics()["quiver_spec_proposed_tokens_total"] > before
    for body, param in [
        ({"speculative.n_max": -1}, "speculative.n_max"),
        ({"speculative.n_min": 3, "speculative.n_max": 2}, "speculative.n_min"),
        ({"speculative.p_min": 2}, "speculative.p_min"),
        ({"speculative": "fast"}, "speculative"),
    ]:
        for path, extra in [
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ]:
            status, _, raw = draft_server.request("POST", path, {"model": draft_server.model, **extra, **body})
            r = json.loads(raw)
            assert status == 400, (path, body, r)
            assert r["error"]["param"] == param and r["error"]["type"] == "invalid_request_error", r


@pytest.fixture(scope="module")
def qwen35_mtp(tmp_path_factory):
    """A tiny Qwen 3.5 model with a multi-token-prediction block, reading SmolLM2's vocabulary."""
    out = tmp_path_factory.mktemp("mtp") / "tiny-qwen35-mtp.gguf"
    cmd = [str(quiver_exe()), "synth", "--preset", "tiny-qwen35-mtp", "--type", "Q8_0", "-o", str(out)]
    subprocess.run([*cmd, "--vocab-from", str(model_path())], check=True, capture_output=True, timeout=120)
    return out


def test_a_qwen35_models_own_block_gives_plain_serving_text(qwen35_mtp):
    plain = Server("--ctx-size", "512", "--max-seqs", "2", model=qwen35_mtp)
    mtp = Server("--ctx-size", "512", "--max-seqs", "2", "--spec-type", "draft-mtp", "--draft-max", "4", "--spec-timing", "off", model=qwen35_mtp)
    try:
        for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
            for prompt in (PROMPT, "The capital of France is"):
                assert complete(mtp, prompt, **kw) == complete(plain, prompt, **kw), (prompt, kw)
        assert mtp.metrics()["quiver_spec_proposed_tokens_total"] > 0
        # The block's KV and the recurrent state's kept rows are in the startup line.
        log = "".join(mtp.stderr_lines)
        assert "the draft model's, in the same blocks" in log and "speculative decoding's rollback" in log, log
    finally:
        plain.stop()
        mtp.stop()


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(tmp_path):
    other = model_path().parent / "gemma3-270m.gguf"
    if not other.is_file():
        pytest.skip(f"{other} is missing")
    cmd = [str(quiver_exe()), "serve", "-m", str(model_path()), "--port", "0", "-md", str(other)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "not the same vocabulary" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["--spec-type", "draft"], "needs a draft model (-md/--model-draft)"),
        (["--spec-type", "ngram", "-md", "x.gguf"], "-md/--model-draft goes with --spec-type draft"),
        (["--spec-type", "lookahead"], "unknown speculative decoding type"),
        (["--draft-p-min", "1.5"], "--draft-p-min"),
        (["--spec-type", "ngram", "--draft-min", "9", "--draft-max", "4"], "--draft-min 9 is above --draft-max 4"),
        (["--draft-max", "100000"], "--draft-max"),
    ],
)
def test_bad_speculation_flags_are_one_line_errors(args, says):
    r = subprocess.run([str(quiver_exe()), "serve", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert says in r.stderr and r.stderr.count("\n") == 1, r.stderr
