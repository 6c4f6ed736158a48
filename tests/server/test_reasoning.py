"""A thinking model's chat: its `<think> … </think>` goes to `reasoning_content`, the rest to
`content`, whole and streamed. The test model does not think, so a thinking template
(`--chat-template-file`, its generation prompt opening `<think>` as Qwen 3's does) and a regex
(`guided_regex`) make it write that shape."""

import json
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


# Qwen 3's switch: `enable_thinking: false` closes an empty thinking block in the prompt.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def test_template_kwargs_and_reasoning_format(tmp_path):
    """`chat_template_kwargs` reach the template (Qwen 3's `enable_thinking`); a request's
    `reasoning_format: none`, or `--reasoning-format none`, leaves the thoughts in `content`."""
    t = tmp_path / "qwen3.jinja"
    t.write_text(QWEN3_LIKE)
    kw = dict(messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=12, temperature=0)
    s = Server("--chat-template-file", str(t), "-c", "512")
    try:
        c = s.client()
        kw["model"] = c.models.list().data[0].id
        # Thinking: the prompt opened it, the answer never closes it: all reasoning.
        m = c.chat.completions.create(**kw).choices[0].message
        thought = m.model_extra.get("reasoning_content")
        assert thought and not m.content, m
        # Thinking off: the answer is content, after the closed block.
        r = c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        off = r.choices[0].message
        assert off.content and not off.model_extra.get("reasoning_content"), off
        assert r.usage.prompt_tokens > c.chat.completions.create(**kw).usage.prompt_tokens
        _, _, body = s.request("POST", "/apply-template", {"messages": kw["messages"], "chat_template_kwargs": {"enable_thinking": False}})
        assert json.loads(body)["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), body
        # An earlier turn's thinking, given back as `reasoning_content`, reaches the template.
        turns = kw["messages"] + [{"role": "assistant", "content": "Yes.", "reasoning_content": "water <|im_end|> wets"},
                                  {"role": "user", "content": "Sure?"}]
        _, _, body = s.request("POST", "/apply-template", {"messages": turns})
        assert "<|im_start|>assistant\n<think>water <|im_end|> wets</think>Yes.<|im_end|>" in json.loads(body)["prompt"], body
        m = c.chat.completions.create(**kw, extra_body={"reasoning_format": "none"}).choices[0].message
        assert m.content.strip() == thought and not m.model_extra.get("reasoning_content"), m
    finally:
        s.stop()
    s = Server("--chat-template-file", str(t), "-c", "512", "--reasoning-format", "none")
    try:
        c = s.client()
        m = c.chat.completions.create(**kw).choices[0].message
        assert m.content.strip() == thought and not m.model_extra.get("reasoning_content"), m
        m = c.chat.completions.create(**kw, extra_body={"reasoning_format": "deepseek"}).choices[0].message
        assert m.model_extra.get("reasoning_content") == thought, m
    finally:
        s.stop()
