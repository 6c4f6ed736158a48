"""Builds tests/fixtures/llama_cpp_fuzz.jsonl from the harness outputs.

usage: make_fuzz_fixture.py TEXTS.hex OUTDIR   (OUTDIR holds fix-<name>.out for smollm2,
gemma3 and each pre-tokenizer variant, made with llama_harness)."""
import json, sys

hexfile, outdir = sys.argv[1], sys.argv[2]
texts = [bytes.fromhex(l.strip()).decode() for l in open(hexfile) if l.strip()]
def load(n): return [l.rstrip('\n').split('|') for l in open(f'{outdir}/fix-{n}.out')]
def ids(s): return [int(x) for x in s.split(',')] if s else []
full = {n: load(n) for n in ['smollm2', 'gemma3']}
bos = {'smollm2': [], 'gemma3': [2]}  # what add_special prepends
pres = ['llama-bpe', 'qwen2', 'gpt-2', 'deepseek-llm', 'deepseek-coder', 'falcon', 'default', 'starcoder']
pv = {p: load(p) for p in pres}
for i, t in enumerate(texts):
    rec = {'text': t}
    def d(h):
        s = bytes.fromhex(h).decode('utf-8', 'replace')
        return None if s == t else s
    for n in full:
        f = full[n][i]
        a00, a01, a10, a11 = [ids(f[j]) for j in range(4)]
        e = {'ids': a00}
        if a01 != a00: e['parse_special'] = a01
        if a10 != bos[n] + a00: e['add_special'] = a10
        if a11 != bos[n] + a01: e['both'] = a11
        for k, v in [('detok_keep', d(f[4])), ('detok_skip', d(f[5]))]:
            if v is not None: e[k] = v
        rec[n] = e
    pre = {}
    for p in pres:
        e = {'ids': ids(pv[p][i][0])}
        dd = d(pv[p][i][4])
        if dd is not None: e['detok'] = dd
        pre[p] = e
    rec['pre'] = pre
    print(json.dumps(rec, ensure_ascii=False, separators=(',', ':')))
