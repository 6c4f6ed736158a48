#!/usr/bin/env python3
"""Compares quiver's intermediate tensors (QUIVER_DUMP_DIR) with llama.cpp's (llama_dump).

    compare.py QUIVER_DIR LLAMA_DIR [STEPS]

For every step and layer prints each tensor's relative L2 difference, its largest difference
relative to the largest value, and the fraction of bit-identical elements; `exact` means all.
Where llama.cpp computed only the last row (the last layer, the output), the last row of
quiver's is compared.
"""
import collections
import glob
import os
import re
import sys

import numpy as np

qdir, ldir = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 1

index = collections.defaultdict(lambda: collections.defaultdict(list))
order = collections.defaultdict(list)
for line in open(os.path.join(ldir, "index.txt")):
    step, n, name, *_ = line.split()
    if name.endswith("(view)") or len(line.split()) > 7:
        continue
    index[int(step)][name].append(int(n))
    order[int(step)].append((int(n), name))


def llama(step, name, k=0):
    ns = index[step].get(name)
    if not ns or len(ns) <= k:
        return None
    return np.fromfile(os.path.join(ldir, f"s{step}_{ns[k]}.bin"), dtype=np.float32)


def after(step, name):
    """The tensor computed right after `name` (llama.cpp names wo's output only for llama)."""
    ns = index[step].get(name)
    if not ns:
        return None
    nxt = [n for n, _ in order[step] if n > ns[0]]
    return np.fromfile(os.path.join(ldir, f"s{step}_{min(nxt)}.bin"), dtype=np.float32) if nxt else None


def first(step, *names):
    for nm in names:
        v = llama(step, nm)
        if v is not None:
            return v
    return None


for step in range(steps):
    files = glob.glob(os.path.join(qdir, f"s{step}_*.bin"))
    layers = sorted({int(m.group(1)) for f in files if (m := re.search(r"-(\d+)\.bin$", f))})
    print(f"step {step}")
    rows = []
    for i in layers:
        rows += [
            (f"attn_norm-{i}", first(step, f"attn_norm-{i}")),
            (f"Vcur-{i}", first(step, f"Vcur-{i}")),
            (f"Kcur-{i}", llama(step, f"Kcur-{i}", 2)),
            (f"kqv_out-{i}", first(step, f"kqv_out-{i}")),
            (f"attn_out-{i}", after(step, f"kqv_out-{i}")),
            (f"ffn_inp-{i}", first(step, f"ffn_inp-{i}", f"sa_out-{i}")),
            (f"ffn_norm-{i}", first(step, f"ffn_norm-{i}")),
            (f"ffn_act-{i}", first(step, f"ffn_swiglu-{i}", f"ffn_geglu-{i}")),
            (f"ffn_out-{i}", first(step, f"ffn_out-{i}")),
            (f"l_out-{i}", first(step, f"l_out-{i}")),
        ]
    rows += [("result_norm", first(step, "result_norm")), ("result_output", first(step, "result_output"))]
    for name, want in rows:
        path = os.path.join(qdir, f"s{step}_{name}.bin")
        if want is None or not os.path.exists(path):
            continue
        got = np.fromfile(path, dtype=np.float32)
        if got.size > want.size and got.size % want.size == 0:
            got = got[-want.size:]
        if got.size != want.size:
            print(f"  {name:16s} sizes differ: {got.size} vs {want.size}")
            continue
        d = np.abs(got - want)
        same = float(np.mean(got == want))
        rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        tag = "exact" if same == 1.0 else f"rel_l2 {rel:.2e} max {d.max() / max(np.abs(want).max(), 1e-30):.2e} same {same:.3f}"
        print(f"  {name:16s} {tag}")
