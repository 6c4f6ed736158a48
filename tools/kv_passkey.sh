#!/usr/bin/env bash
# Passkey retrieval through each KV type (issue 17): about N tokens of filler with a five-digit
# pass key at DEPTH percent, then the question; greedy answer, checked for the key.
#   tools/kv_passkey.sh MODEL N...      (TYPES="f16 tq8 tq4", DEPTHS="10 50 90", DEVICE=cpu)
# Prints one line per (N, depth, type): found / missed and the answer's first words.
set -uo pipefail
Q=${QUIVER:-target/release/quiver}
m=$1
shift
for n in "$@"; do
  for d in ${DEPTHS:-10 50 90}; do
    key=$(( (n * 7 + d * 131) % 90000 + 10000 ))
    prompt=$(python3 - "$n" "$d" "$key" <<'PY'
import sys
n, d, key = (int(a) for a in sys.argv[1:])
filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
reps = max(1, n // 22)  # about 22 tokens a repetition
at = reps * d // 100
body = filler * at + f"The pass key is {key}. Remember it. {key} is the pass key. " + filler * (reps - at)
print("There is an important piece of information hidden inside a lot of irrelevant text. "
      "Find it and memorize it.\n" + body + "\nWhat is the pass key? The pass key is", end="")
PY
)
    for t in ${TYPES:-f16 tq8 tq4}; do
      out=$($Q run -m "$m" --raw --temp 0 -n 8 -c $((n * 5 / 4 + 512)) --kv-type "$t" --device "${DEVICE:-cpu}" -p "$prompt" 2>/tmp/kv_passkey.err) || out="error: $(tail -1 /tmp/kv_passkey.err)"
      if grep -q "$key" <<<"$out"; then r=found; else r=missed; fi
      echo "n $n depth $d% $t: $r (${out:0:24})"
    done
  done
done
