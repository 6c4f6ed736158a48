#!/usr/bin/env python3
# Checks the index arithmetic of flash_impl (crates/backend-cuda/kernels/flash.cu) without a GPU:
# every lane of the 4 warps of one block is emulated with the PTX m16n8k16 fragment layouts
# (A row-major, B column-major, C as the ISA gives them), and the result is compared with
# direct masked softmax attention. Usage: python3 tools/gpu/flash_emu.py [HD] (numpy; HD 64
# (default) ~1 minute, 256 a few): the kernel's template parameters per head dim below.
import sys
import numpy as np
rng = np.random.default_rng(1)
HD = int(sys.argv[1]) if len(sys.argv) > 1 else 64
KT, RG, CS = {64: (64, 4, 1), 128: (64, 4, 1), 256: (32, 2, 2)}[HD]
LD = HD + 8; OC = HD // CS
ntok = 50; p_first = 30; kv_len = p_first + ntok; window = 20; scale = 1/np.sqrt(HD)
Q = rng.standard_normal((ntok, HD)).astype(np.float32) * 3
K = rng.standard_normal((kv_len, HD)).astype(np.float16)
V = rng.standard_normal((kv_len, HD)).astype(np.float16)

def f16(x): return np.float16(x)

# per-lane state
lanes = range(32)
out = np.zeros((ntok, HD), np.float32)
warps = [(z, w) for z in range(64 // (16 * RG)) for w in range(4) if z * 16 * RG < ntok]
for z, w in warps:
    row0 = z * 16 * RG; rg = w // CS; cb = (w % CS) * OC
    j_end = min(p_first + min(ntok, row0 + 16 * RG), kv_len)
    j_begin = max(0, p_first + row0 - window + 1) if window > 0 else 0
    j_begin -= j_begin % KT
    # fragments: qa[lane][ks][reg] = (lo, hi) f16 pairs
    def qval(r, col):
        return f16(Q[r, col]) if r < ntok else f16(0)
    qa = {}
    for lane in lanes:
        g, tq = lane >> 2, lane & 3
        r0, r1 = row0 + 16*rg + g, row0 + 16*rg + g + 8
        for ks in range(HD//16):
            for half in range(2):
                col = ks*16 + 2*tq + 8*half
                qa[(lane, ks, 2*half)] = (qval(r0, col), qval(r0, col+1))
                qa[(lane, ks, 2*half+1)] = (qval(r1, col), qval(r1, col+1))
    o = {(lane, dn, e): 0.0 for lane in lanes for dn in range(OC//8) for e in range(4)}
    m = {(lane, i): -1e30 for lane in lanes for i in range(2)}
    l = {(lane, i): 0.0 for lane in lanes for i in range(2)}
    for j0 in range(j_begin, j_end, KT):
        Ks = np.zeros((KT, LD), np.float16); Vs = np.zeros((KT, LD), np.float16)
        for kr in range(KT):
            j = j0 + kr
            if j < j_end:
                Ks[kr, :HD] = K[j]; Vs[kr, :HD] = V[j]
        # mma semantics: D[row][col] += sum_k A[row][k] B[k][col], reconstruct A, B from fragments
        def mma_warp(afrag, bfrag):
            # afrag[lane] = 4 regs of (lo,hi); bfrag[lane] = (b0, b1) each (lo,hi)
            A = np.zeros((16, 16), np.float32); B = np.zeros((16, 8), np.float32)
            for lane in lanes:
                g, tq = lane >> 2, lane & 3
                a = afrag[lane]
                A[g, 2*tq], A[g, 2*tq+1] = a[0]
                A[g+8, 2*tq], A[g+8, 2*tq+1] = a[1]
                A[g, 2*tq+8], A[g, 2*tq+9] = a[2]
                A[g+8, 2*tq+8], A[g+8, 2*tq+9] = a[3]
                b0, b1 = bfrag[lane]
                B[2*tq, g], B[2*tq+1, g] = b0
                B[2*tq+8, g], B[2*tq+9, g] = b1
            D = A @ B
            res = {}
            for lane in lanes:
                g, tq = lane >> 2, lane & 3
                res[lane] = (D[g, 2*tq], D[g, 2*tq+1], D[g+8, 2*tq], D[g+8, 2*tq+1])
            return res
        sc = {}
        for nt in range(KT//8):
            acc = {lane: [0.0]*4 for lane in lanes}
            for ks in range(HD//16):
                af = {lane: [qa[(lane, ks, r)] for r in range(4)] for lane in lanes}
                bf = {}
                for lane in lanes:
                    g, tq = lane >> 2, lane & 3
                    row = nt*8 + g; c = ks*16 + 2*tq
                    bf[lane] = ((Ks[row, c], Ks[row, c+1]), (Ks[row, c+8], Ks[row, c+9]))
                d = mma_warp(af, bf)
                for lane in lanes:
                    for e in range(4): acc[lane][e] += d[lane][e]
            for lane in lanes:
                for e in range(4): sc[(lane, nt, e)] = acc[lane][e]
        # mask, max
        mx = {}
        for lane in lanes:
            g, tq = lane >> 2, lane & 3
            r0, r1 = row0 + 16*rg + g, row0 + 16*rg + g + 8
            p0, p1 = p_first + r0, p_first + r1
            mx0, mx1 = m[(lane, 0)], m[(lane, 1)]
            for nt in range(KT//8):
                for e in range(4):
                    j = j0 + nt*8 + 2*tq + (e & 1)
                    p = p0 if e < 2 else p1
                    r = r0 if e < 2 else r1
                    ok = j <= p and j < kv_len and (window <= 0 or j > p - window) and r < ntok
                    v = sc[(lane, nt, e)] * scale
                    v = v if ok else -1e30
                    sc[(lane, nt, e)] = v
                    if e < 2: mx0 = max(mx0, v)
                    else: mx1 = max(mx1, v)
            mx[lane] = [mx0, mx1]
        for lane in lanes:  # shfl xor 1,2 within groups of 4
            base = lane & ~3
            mx[lane] = [max(mx[b][i] for b in range(base, base+4)) for i in range(2)]
        pa = {}
        for lane in lanes:
            c0 = np.exp(m[(lane,0)] - mx[lane][0]); c1 = np.exp(m[(lane,1)] - mx[lane][1])
            m[(lane,0)], m[(lane,1)] = mx[lane]
            l[(lane,0)] *= c0; l[(lane,1)] *= c1
            for dn in range(OC//8):
                o[(lane,dn,0)] *= c0; o[(lane,dn,1)] *= c0; o[(lane,dn,2)] *= c1; o[(lane,dn,3)] *= c1
            for nt in range(KT//8):
                es = []
                for e in range(4):
                    v = sc[(lane,nt,e)]
                    mm = m[(lane,0)] if e < 2 else m[(lane,1)]
                    es.append(0.0 if v <= -1e29 else np.exp(v - mm))
                l[(lane,0)] += es[0] + es[1]; l[(lane,1)] += es[2] + es[3]
                pa[(lane, nt>>1, (nt&1)*2)] = (f16(es[0]), f16(es[1]))
                pa[(lane, nt>>1, (nt&1)*2+1)] = (f16(es[2]), f16(es[3]))
        for dn in range(OC//8):
            for kk in range(KT//16):
                af = {lane: [pa[(lane, kk, r)] for r in range(4)] for lane in lanes}
                bf = {}
                for lane in lanes:
                    g, tq = lane >> 2, lane & 3
                    key = kk*16 + 2*tq; col = cb + dn*8 + g
                    bf[lane] = ((Vs[key, col], Vs[key+1, col]), (Vs[key+8, col], Vs[key+9, col]))
                d = mma_warp(af, bf)
                for lane in lanes:
                    for e in range(4): o[(lane,dn,e)] += d[lane][e]
    for lane in lanes:
        base = lane & ~3
    L = {}
    for lane in lanes:
        base = lane & ~3
        L[lane] = [sum(l[(b,i)] for b in range(base, base+4)) for i in range(2)]
    for lane in lanes:
        g, tq = lane >> 2, lane & 3
        r0, r1 = row0 + 16*rg + g, row0 + 16*rg + g + 8
        for dn in range(OC//8):
            col = cb + dn*8 + 2*tq
            if r0 < ntok:
                out[r0, col] = o[(lane,dn,0)] / L[lane][0]; out[r0, col+1] = o[(lane,dn,1)] / L[lane][0]
            if r1 < ntok:
                out[r1, col] = o[(lane,dn,2)] / L[lane][1]; out[r1, col+1] = o[(lane,dn,3)] / L[lane][1]
# reference
ref = np.zeros_like(out)
for r in range(ntok):
    p = p_first + r
    js = [j for j in range(kv_len) if j <= p and (window <= 0 or j > p - window)]
    s = np.array([Q[r] @ K[j].astype(np.float32) for j in js]) * scale
    pr = np.exp(s - s.max()); pr /= pr.sum()
    ref[r] = sum(pr[i] * V[j].astype(np.float32) for i, j in enumerate(js))
err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
print("rel err", err)
assert err < 1e-3, err
