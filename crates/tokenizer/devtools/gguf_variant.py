import gguf, sys
src, dst, pre = sys.argv[1], sys.argv[2], sys.argv[3]
bools = dict(a.split('=') for a in sys.argv[4:])
r = gguf.GGUFReader(src)
arch = bytes(r.fields['general.architecture'].parts[-1]).decode()
w = gguf.GGUFWriter(dst, arch)
for k, f in r.fields.items():
    if k.startswith('GGUF.') or k == 'general.architecture': continue
    t = f.types[0]
    if k == 'tokenizer.ggml.pre' or k in bools:
        continue
    if t == gguf.GGUFValueType.ARRAY:
        st = f.types[1]
        if st == gguf.GGUFValueType.STRING:
            val = [bytes(f.parts[i]).decode('utf-8') for i in f.data]
        else:
            val = [f.parts[i][0].item() for i in f.data]
        w.add_key_value(k, val, t, sub_type=st)
    elif t == gguf.GGUFValueType.STRING:
        w.add_key_value(k, bytes(f.parts[-1]).decode('utf-8'), t)
    else:
        w.add_key_value(k, f.parts[-1][0].item(), t)
if pre != '-':
    w.add_key_value('tokenizer.ggml.pre', pre, gguf.GGUFValueType.STRING)
for k,v in bools.items(): w.add_key_value(k, v=='1', gguf.GGUFValueType.BOOL)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
