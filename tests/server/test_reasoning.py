"""A thinking model's chat: its `<think> … </think>` goes to `reasoning_content`, the rest to
`content`, whole and streamed. The test model does not think, so a thinking template
(`--chat-template-file`, its generation prompt opening `<think>` as Qwen 3's does) and a regex
(`guided_regex`) make it write that shape."""

import re

from conftest import Server

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    "{# thinking models close it: </think> #}"
)


def test_thinking_goes_to_reasoning_content(tmp_path):
    t = tmp_path / "think.jinja"
    t.write_text(TEMPLATE)
    s = Server("--chat-template-file", str(t), "-c", "512")
    try:
        c = s.client()
        kw = dict(
            model=c.models.list().data[0].id,
            messages=[{"role": "user", "content": "Is water wet?"}],
            max_tokens=40,
            temperature=0,
            extra_body={"guided_regex": r"[a-z ]{1,30}\n</think>\n\n[A-Z][a-z ]{1,20}\."},
        )
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        reasoning = m.model_extra.get("reasoning_content")
        assert reasoning and re.fullmatch(r"[a-z ]{1,30}", reasoning), m
        assert re.fullmatch(r"[A-Z][a-z ]{1,20}\.", m.content), m
        rs, cs = "", ""
        for ch in c.chat.completions.create(**kw, stream=True):
            if ch.choices:
                d = ch.choices[0].delta
                rs += (d.model_extra or {}).get("reasoning_content") or ""
                cs += d.content or ""
        assert (rs.strip(), cs) == (reasoning, m.content)
    finally:
        s.stop()
