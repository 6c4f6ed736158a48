"""`n` choices of one prompt: each its own sample (choice i is the request with seed + i), usage
counting the prompt once and every choice's tokens; streamed, the choices' chunks interleave
with their `index`, one usage chunk and one `[DONE]` at the end."""


def test_n_choices_chat_and_completions(server, client):
    msgs = [{"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, n=4, max_tokens=12, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, texts
    # Choice i is what a single request with seed + i gives.
    for i in (0, 2):
        one = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=1.0, seed=11 + i)
        assert one.choices[0].message.content == texts[i]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens >= 4
    c = client.completions.create(model="smollm2-135m", prompt="Once upon a time", n=3, max_tokens=8, temperature=0)
    assert len(c.choices) == 3 and len({ch.text for ch in c.choices}) == 1  # greedy: all alike
    assert c.usage.completion_tokens == 24


def test_n_choices_streamed(server, client):
    msgs = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model="smollm2-135m", messages=msgs, n=3, max_tokens=12, temperature=1.0, seed=21)
    texts = {0: "", 1: "", 2: ""}
    finished, usage = {}, []
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=msgs, n=3, max_tokens=12, temperature=1.0, seed=21, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert sorted(finished) == [0, 1, 2]
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens
    assert usage[0].prompt_tokens == whole.usage.prompt_tokens
