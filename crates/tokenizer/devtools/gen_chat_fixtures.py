#!/usr/bin/env python3
"""Renders llama.cpp's real chat templates with Python's Jinja2, set up the way Hugging Face's
`apply_chat_template` sets it up, into the expected outputs that
`tests/chat_templates.rs` compares quiver's renderer against.

    python3 gen_chat_fixtures.py LLAMA_SRC

LLAMA_SRC is llama.cpp's source tree (`tools/llama-src.sh` prints it). The templates are read
from LLAMA_SRC/models/templates/ and are not copied into the repository. Which templates and
which conversations: `../tests/fixtures/chat/llama/manifest.json`. For every template T and
request R it writes, next to the manifest, `T-R.expected` (the prompt); or `T-R.error` (the
message) where the template refuses the conversation with `raise_exception`; or `T-R.skip`
(why) where Jinja2 fails otherwise (a template that iterates `tools` when it is None, an
undefined attribute, a list method the sandbox forbids ...): Hugging Face cannot render those
either, and quiver is not held to any particular result there.

Needs jinja2 (`pip install jinja2`).
"""

import datetime
import json
import pathlib
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE.parent / "tests" / "fixtures" / "chat" / "llama"


class Raised(jinja2.exceptions.TemplateError):
    """What the templates' `raise_exception` raises."""


class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' AssistantTracker marks the
    assistant's text with it; the body renders unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def environment(now):
    """A Jinja2 environment configured like transformers' chat template compiler."""

    def raise_exception(message):
        raise Raised(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt):
        # A fixed clock (the manifest's "now"), so that the outputs do not depend on the day.
        return datetime.datetime.fromtimestamp(now, tz=datetime.timezone.utc).strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    templates_dir = pathlib.Path(sys.argv[1]) / "models" / "templates"
    manifest = json.loads((FIXTURES / "manifest.json").read_text(encoding="utf-8"))
    env = environment(manifest["now"])
    for ext in ("expected", "error", "skip"):
        for old in FIXTURES.glob(f"*.{ext}"):
            old.unlink()
    for t in manifest["templates"]:
        source = (templates_dir / t["file"]).read_text(encoding="utf-8")
        template = env.from_string(source)
        for req_name, req in manifest["requests"].items():
            stem = f"{t['name']}-{req_name}"
            try:
                text = template.render(
                    messages=req["messages"],
                    tools=req.get("tools"),
                    documents=None,
                    add_generation_prompt=req["add_generation_prompt"],
                    bos_token=t["bos_token"],
                    eos_token=t["eos_token"],
                )
            except Raised as e:
                (FIXTURES / f"{stem}.error").write_text(str(e), encoding="utf-8")
                print(f"{stem}: error: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - any Python failure inside the template
                why = f"{type(e).__name__}: {e}"
                (FIXTURES / f"{stem}.skip").write_text(why, encoding="utf-8")
                print(f"{stem}: skipped: {why}")
                continue
            # newline="" keeps \r and \n exactly as rendered.
            with open(FIXTURES / f"{stem}.expected", "w", encoding="utf-8", newline="") as f:
                f.write(text)
            print(f"{stem}: {len(text)} chars")


if __name__ == "__main__":
    main()
