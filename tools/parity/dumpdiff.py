#!/usr/bin/env python3
"""Compares two steps of a QUIVER_DUMP_DIR op by op, in graph order, and prints for each tensor
how many elements differ (bitwise) and by how much: the first line with differences names the
first op whose floats part. Usage: dumpdiff.py DIR [STEP_A STEP_B] (default 0 1: `quiver
compare -n N --decode 0` dumps the CPU's prompt step as s0 and the device's as s1)."""
import os, re, struct, sys

ORDER = ["attn_norm", "Vcur", "Qcur_f16", "Kcur", "kqv_out", "attn_out", "ffn_inp", "ffn_norm",
         "ffn_act", "ffn_out", "l_out"]


def load(path):
    with open(path, "rb") as f:
        b = f.read()
    return struct.unpack(f"<{len(b) // 4}f", b), b


def main():
    d = sys.argv[1]
    a, b = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("0", "1")
    names = {}
    for f in os.listdir(d):
        m = re.match(rf"s{a}_(.+)\.bin$", f)
        if m and os.path.exists(os.path.join(d, f"s{b}_{m.group(1)}.bin")):
            names[m.group(1)] = f

    def key(n):
        m = re.match(r"(.+)-(\d+)$", n)
        if not m:
            return (10**9, 0)
        t, layer = m.group(1), int(m.group(2))
        return (layer, ORDER.index(t) if t in ORDER else 99)

    shown = 0
    for n in sorted(names, key=key):
        (x, xb), (y, yb) = load(os.path.join(d, f"s{a}_{n}.bin")), load(os.path.join(d, f"s{b}_{n}.bin"))
        k = min(len(x), len(y))
        diff = [i for i in range(k) if xb[4 * i:4 * i + 4] != yb[4 * i:4 * i + 4]]
        mx = max((abs(x[i] - y[i]) for i in diff), default=0.0)
        first = f" first at {diff[0]} ({x[diff[0]]!r} vs {y[diff[0]]!r})" if diff else ""
        print(f"{n:24s} {len(diff):8d} of {k:8d} differ, max |d| {mx:.3g}{first}")
        shown += 1
    if not shown:
        print(f"no tensors of both step {a} and step {b} in {d}")


if __name__ == "__main__":
    main()
