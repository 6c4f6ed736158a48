#!/usr/bin/env python3
"""Print a GGUF file as the `gguf` Python package reads it, as one JSON object:
{"version", "metadata": {key: {"type", "value"}}, "tensors": [{"name", "type", "ne", "offset", "sha256"}]}.
Used by quiver's tests to check that files quiver writes read back identically elsewhere."""
import hashlib, json, sys
import numpy as np
import gguf

T = gguf.GGUFValueType

def value(field, parts_idx, vtype):
    part = field.parts[parts_idx]
    if vtype == T.STRING:
        return bytes(part).decode("utf-8")
    if vtype == T.BOOL:
        return bool(part[0])
    v = part[0].item()
    if vtype in (T.FLOAT32, T.FLOAT64):
        return repr(float(v))  # exact text; JSON floats would round-trip loosely
    return int(v)

def decode(field):
    vtype = field.types[0]
    if vtype != T.ARRAY:
        return {"type": vtype.name.lower(), "value": value(field, field.data[0], vtype)}
    # Nested arrays: gguf-py flattens parts; rebuild from the raw types list.
    elems = [value(field, i, field.types[-1]) if field.types[-1] != T.ARRAY else None for i in field.data]
    return {"type": "array", "elem": [t.name.lower() for t in field.types[1:]], "value": elems}

def main():
    r = gguf.GGUFReader(sys.argv[1])
    meta = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = decode(field)
    tensors = [{
        "name": t.name,
        "type": int(t.tensor_type),
        "ne": [int(x) for x in t.shape],
        "offset": int(t.data_offset),
        "sha256": hashlib.sha256(np.ascontiguousarray(t.data).view(np.uint8).tobytes()).hexdigest(),
    } for t in r.tensors]
    print(json.dumps({"version": int(r.fields["GGUF.version"].parts[-1][0]), "metadata": meta, "tensors": tensors}))

if __name__ == "__main__":
    main()
