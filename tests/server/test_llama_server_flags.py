"""A llama-server command line runs `quiver serve` unchanged: its short flags (`-ngl`, `-np`,
`-fa`, `-a`, `-to`, `-ctk`), `--jinja`, `--metrics`, `--no-webui` and `--chat-template` are
taken with llama-server's meaning (`-ctk`/`-ctv` choose quiver's KV types); what quiver cannot
do (an unknown KV type or template name) is a one-line error and a non-zero exit."""

import subprocess

from conftest import Server, model_path, quiver_exe


def test_a_llama_server_command_line_serves():
    s = Server(
        "-ngl", "0", "-np", "2", "-fa", "--jinja", "-a", "my-model", "--metrics", "--no-webui",
        "-to", "30", "-ctk", "f16", "-ctv", "f16", "--chat-template", "chatml", "-c", "512",
    )
    try:
        c = s.client()
        assert [m.id for m in c.models.list().data] == ["my-model"]
        r = c.chat.completions.create(model="my-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert r.choices[0].message.content
    finally:
        s.stop()


def test_ctk_and_ctv_choose_the_kv_types():
    s = Server("-ctk", "q8_0", "-ctv", "tq4", "-c", "512")
    try:
        c = s.client()
        r = c.chat.completions.create(
            model=c.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert r.choices[0].message.content
    finally:
        s.stop()


def run(*args):
    p = subprocess.run(
        [str(quiver_exe()), "serve", "-m", str(model_path()), "--port", "0", *args],
        capture_output=True, text=True, timeout=120,
    )
    return p.returncode, p.stderr.strip()


def test_what_quiver_cannot_do_yet_is_a_clear_error():
    code, err = run("-ctk", "q4_0")
    assert code != 0 and "unknown KV type" in err and "tq8" in err and len(err.splitlines()) == 1, err
    code, err = run("--chat-template", "llama2")
    assert code != 0 and "unknown chat template" in err and "llama3" in err, err
    code, err = run("-ngl", "many")
    assert code != 0 and "not a number" in err, err
