#!/usr/bin/env python3
"""How much a per-block key offset helps tq4 (issue 35, item 4): attention's KL divergence
from the exact scores, per layer and KV head, for the plain codec and for keys centred by
offsets of several granularities (the offset restored exactly in the score, as q·μ), and for
codebooks of 32 and 64 levels (5 and 6 bits) in place of tq4's 16.

Keys and queries come from quiver's dump of one step (post-rope `Kcur`, `Qcur_f16`):
  QUIVER_DUMP_DIR=/tmp/kd quiver perplexity -m smollm2-135m -f TEXT -c 512 -b 512 --device cpu
  tools/kv/tq4_offsets.py /tmp/kd --tokens 512 --heads 9 --kv-heads 3 --head-dim 64 --layers 30
The codec is the reference's (crates/backend/src/turboquant.rs: signs, Walsh–Hadamard rotation,
one RMS per 256 coordinates, Lloyd–Max levels read from turboquant_tables.rs).
"""
import argparse
import math
import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
M64 = (1 << 64) - 1


def levels(name):
    s = (ROOT / "crates/backend/src/turboquant_tables.rs").read_text()
    a = s.index(f"pub const {name}")
    return np.array([float(v) for v in re.findall(r"-?\d+\.\d+e-?\d+", s[a : s.index("];", a)])])


def signs(d):
    st, word, out = 0x5475_7262_6F51_7561, 0, []
    for i in range(d):
        if i % 64 == 0:
            st = (st + 0x9E37_79B9_7F4A_7C15) & M64
            z = st
            z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & M64
            z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & M64
            word = z ^ (z >> 31)
        out.append(-1.0 if (word >> (i % 64)) & 1 else 1.0)
    return np.array(out)


def fwht(x):
    x, n, h = x.copy(), x.shape[-1], 1
    while h < n:
        x = x.reshape(x.shape[:-1] + (n // (2 * h), 2, h))
        a, b = x[..., 0, :].copy(), x[..., 1, :].copy()
        x[..., 0, :], x[..., 1, :] = a + b, a - b
        x = x.reshape(x.shape[:-3] + (n,))
        h *= 2
    return x


def lloyd_max(n):
    """Lloyd-Max levels of N(0, 1) (turboquant::lloyd_max's fixed point, iterated in f64)."""
    phi = lambda x: np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    cdf = np.vectorize(lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2))))
    lv = np.linspace(-3, 3, n)
    for _ in range(5000):
        t = (lv[1:] + lv[:-1]) / 2
        a, b = np.concatenate([[-40.0], t]), np.concatenate([t, [40.0]])
        lv = (phi(a) - phi(b)) / np.maximum(cdf(b) - cdf(a), 1e-300)
    return lv


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--block", type=int, default=16, help="KV block size (tokens)")
    a = ap.parse_args()
    n, d, g, blk = a.tokens, a.head_dim, a.heads // a.kv_heads, a.block
    sg = signs(d)
    rot = lambda x: fwht(x * sg) / np.sqrt(d)
    unrot = lambda y: fwht(y) / np.sqrt(d) * sg

    def codec(x, lv, sub=256):
        y = rot(x)
        out = np.empty_like(y)
        for b0 in range(0, d, sub):
            yb = y[..., b0 : b0 + sub]
            r = np.sqrt((yb * yb).mean(-1, keepdims=True))
            z = yb / np.maximum(r, 1e-30)
            out[..., b0 : b0 + sub] = lv[np.searchsorted((lv[1:] + lv[:-1]) / 2, z)] * r
        return unrot(out)

    l4, l8 = levels("TQ4_LEVELS"), levels("TQ8_LEVELS")
    l5, l6 = lloyd_max(32), lloyd_max(64)
    mask = np.tril(np.ones((n, n), bool))[:, None, :]

    def kl(q, k, khat):
        ex = np.where(mask, np.einsum("tgd,sd->tgs", q, k), -np.inf) / np.sqrt(d)
        ap_ = np.where(mask, np.einsum("tgd,sd->tgs", q, khat), -np.inf) / np.sqrt(d)
        pa = np.exp(ex - ex.max(-1, keepdims=True))
        pa /= pa.sum(-1, keepdims=True)
        lb = ap_ - ap_.max(-1, keepdims=True)
        lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
        la = np.log(np.maximum(pa, 1e-30))
        return float(np.sum(np.where(mask, pa * (la - np.where(mask, lb, 0)), 0)) / (n * g))

    res = {}
    for layer in range(a.layers):
        K = np.fromfile(f"{a.dump}/s0_Kcur-{layer}.bin", np.float32).reshape(n, a.kv_heads, d)
        Q = np.fromfile(f"{a.dump}/s0_Qcur_f16-{layer}.bin", np.float32).reshape(n, a.heads, d)
        for h in range(a.kv_heads):
            k, q = K[:, h].astype(np.float64), Q[:, h * g : (h + 1) * g].astype(np.float64)
            first = np.repeat(k[::blk], blk, axis=0)[:n]
            first8 = codec(first, l8)
            nb = n // blk
            kb = k[: nb * blk].reshape(nb, blk, d)
            mean = np.repeat(kb.mean(1), blk, axis=0)
            if len(mean) < n:
                mean = np.concatenate([mean, np.repeat(k[len(mean) :].mean(0, keepdims=True), n - len(mean), 0)])
            # Causal offsets, fixed when a block starts: the previous block's mean, the mean of
            # every earlier key but the first (the first block: its first key).
            prev = np.concatenate([first[:blk], np.repeat(kb[:-1].mean(1), blk, axis=0)])[:n]
            csum = np.cumsum(kb.sum(1), 0) - k[0]
            run = np.repeat(np.array([k[0]] + [csum[b - 1] / (b * blk - 1) for b in range(1, nb)]), blk, 0)
            run = np.concatenate([run, np.repeat(run[-1:], n - len(run), 0)])
            seq1 = np.repeat(k[1:blk].mean(0, keepdims=True), n, 0)
            seq1[:blk] = first[:blk]
            glob = np.repeat(k[1:].mean(0, keepdims=True), n, 0)
            cases = {
                "tq4": codec(k, l4),
                "tq4, offset: the block's first key (exact)": first + codec(k - first, l4),
                "tq4, offset: the block's first key as tq8": first8 + codec(k - first8, l4),
                "tq4, offset: the block's mean (not causal)": mean + codec(k - mean, l4),
                "tq4, offset: the previous block's mean": prev + codec(k - prev, l4),
                "tq4, offset: the mean of all earlier keys": run + codec(k - run, l4),
                "tq4, offset: the first block's mean": seq1 + codec(k - seq1, l4),
                "tq4, offset: all keys' mean (oracle)": glob + codec(k - glob, l4),
                "tq4, RMS per 32": codec(k, l4, 32),
                "tq4, block's mean, RMS per 32": mean + codec(k - mean, l4, 32),
                "5-bit (32 levels)": codec(k, l5),
                "5-bit, offset: the block's first key": first + codec(k - first, l5),
                "6-bit (64 levels)": codec(k, l6),
                "tq8": codec(k, l8),
            }
            for name, khat in cases.items():
                res.setdefault(name, []).append(kl(q, k, khat))
    for name, v in res.items():
        print(f"{name:45s} attention KL mean {np.mean(v):.5f}, max {np.max(v):.4f}")


if __name__ == "__main__":
    main()
