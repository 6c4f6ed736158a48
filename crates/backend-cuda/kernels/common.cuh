// Shared by every quiver kernel module. NVRTC compiles these with no headers at all: the
// conversions below are PTX, so nothing depends on the toolkit's include files.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NO_SLOT 0xffffffffu

// Programmatic dependent launch (sm_90+): every kernel starts with this. It waits until the
// kernel before it in the stream has finished and its writes are visible, then lets the next
// kernel's blocks be launched into the slots this grid frees, so a launch's latency and ramp
// overlap the previous kernel's tail. Without the launch attribute (or below sm_90) the wait
// returns at once and the trigger does nothing. Because each kernel waits before anything else,
// a kernel's completion implies every earlier kernel's.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The matrix-vector kernels begin with this instead: their warp's weight rows (which no kernel
// ever writes) are prefetched into L2 first, one 128-byte line per lane step, and only then does
// the kernel wait for its predecessor. With programmatic dependent launch the kernel's blocks
// are resident while the previous kernel still runs, so the weights' DRAM latency overlaps it.
// Everything else (activations, outputs) is touched only after the wait, as with pdl_begin.
__device__ __forceinline__ void pdl_begin_prefetch(const void* a, const void* b, long long bytes) {
    for (long long o = (long long)threadIdx.x * 128; o < bytes; o += 32 * 128) {
        if (a) asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)a + o));
        if (b) asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)b + o));
    }
    pdl_begin();
}

__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f2bf(float f) { u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// cp.async (sm_80+): `bytes` from global to shared memory without registers; `ok` false copies
// nothing and zero-fills the destination (src must still be a valid address).
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u64 d;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(d) : "l"(p));
    return (u32)d;
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 8 : 0));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Gated-activation function: act 0 silu, 1 gelu (tanh form, through f16 as ggml computes it).
__device__ __forceinline__ float act_fn(float g, int act) {
    if (act == 0) return g / (1.f + expf(-g));
    if (g <= -10.f) return 0.f;
    if (g >= 10.f) return g;
    float x = h2f(f2h(g));
    const float c = 0.7978845608f;
    return h2f(f2h(0.5f * x * (1.f + tanhf(c * x * (1.f + 0.044715f * x * x)))));
}

// A gated activation's output act(g)·u: act 0 silu, 1 gelu; any other value is the f32 bits of a
// positive limit L of the clamped SwiGLU silu(min(g, L))·clamp(u, −L, L) (DeepSeek-V4's experts;
// dsv4.cu swiglu_clamp's operations).
__device__ __forceinline__ float glu_fn(float g, float u, int act) {
    if (act > 1) {
        const float lim = __int_as_float(act);
        g = fminf(g, lim);
        u = u != u ? u : fminf(fmaxf(u, -lim), lim);
        return __fdiv_rn(g, 1.f + expf(-g)) * u;
    }
    return act_fn(g, act) * u;
}

// The flat batch as the backend uploads it (see batch.rs): per token id, position, KV slot,
// sequence; per sequence KV length and offset of its block table.
struct BatchView {
    const u32* tokens;
    const u32* pos;
    const u32* slot;
    const u32* seq;
    const u32* logit_rows;
    const u32* kv_len;
    const u32* bt_off;
    const u32* block_tables;
    // The rows a kernel over a subset of the step takes (kvd in a mixed step: row i of its grid
    // is drows[i]); null: rows 0.. .
    const u32* drows;
    // Per sequence: the slot of the model's recurrent state it reads and updates (delta.cu).
    const u32* state_slot;
    // Per sequence: where it keeps what a rollback needs (0xFFFFFFFF: nothing; delta.cu).
    const u32* kept_slot;
    // Per sequence: its first row and its rows, consecutive (0 past the step's sequences).
    const u32* seq_row;
    const u32* seq_rows;
    u32 block_size;
};

// ---- tensor cores (mma.sync m16n8k16: f16 in, f32 accumulate) ----
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// Four 8×8 f16 matrices from shared memory, lane l giving row l % 8 of matrix l / 8 (16 bytes):
// r[i] holds row l / 4, columns 2(l % 4), +1 of matrix i (ldsm4), or of its transpose (ldsm4_t).
__device__ __forceinline__ void ldsm4(u32* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}
__device__ __forceinline__ void ldsm4_t(u32* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}
__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
