#!/usr/bin/env python3
"""How sharp and how stable the architecture fixtures' log-probabilities are.

    tools/parity/fixture_stats.py DIR [DIR2]

For each fixture in DIR (make_arch_fixtures.sh's JSON): the median probability of llama.cpp's
top-1 token, the median lead of its top-1 over its second (nat), and how many positions lead
by more than 0.1 (those whose top-1 the tests check). With DIR2 (the same presets written
otherwise, e.g. with `--weights flat`), the same for its files. Within each DIR, F32 against
Q8_0 of the same preset: how many positions have the same top-1 and the largest |Δ logprob|
of a token both list: Q8_0's weights are F32's within 0.4% (relative), so a well-conditioned
model moves little, an ill-conditioned one (rounding amplified layer by layer) a lot.
"""
import glob
import json
import math
import os
import statistics
import sys


def load(d):
    out = {}
    for p in sorted(glob.glob(os.path.join(d, "*.json"))):
        v = json.load(open(p))
        out[(v["preset"], v["type"])] = v
    return out


def sharp(v):
    rows = v["top"]
    p1 = statistics.median(math.exp(r[0][1]) for r in rows)
    lead = [r[0][1] - r[1][1] for r in rows]
    clear = sum(x > 0.1 for x in lead)
    return p1, statistics.median(lead), clear, len(rows)


def stable(a, b):
    same, worst = 0, 0.0
    for ra, rb in zip(a["top"], b["top"]):
        same += ra[0][0] == rb[0][0]
        lb = dict((i, lp) for i, lp in rb)
        for i, lp in ra:
            if i in lb:
                worst = max(worst, abs(lp - lb[i]))
    return same, worst


def main():
    dirs = sys.argv[1:]
    if not dirs or len(dirs) > 2:
        sys.exit("usage: fixture_stats.py DIR [DIR2]")
    sets = [load(d) for d in dirs]
    print("| preset | type | " + " | ".join(
        f"{os.path.basename(d.rstrip('/'))}: p(top-1) med, lead med, lead>0.1, F32~Q8_0 top-1, max|Δ|"
        for d in dirs) + " |")
    print("|---|---|" + "---|" * len(dirs))
    for key in sorted(sets[0]):
        preset, ty = key
        cells = []
        for s in sets:
            if key not in s:
                cells.append("–")
                continue
            p1, lead, clear, n = sharp(s[key])
            cell = f"{p1:.2f}, {lead:.2f}, {clear}/{n}"
            if ty == "F32" and (preset, "Q8_0") in s:
                same, worst = stable(s[key], s[(preset, "Q8_0")])
                cell += f", {same}/{n}, {worst:.3f}"
            cells.append(cell)
        print(f"| {preset} | {ty} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
