// ---- Tensor-core products straight from the GGUF blocks (prefill, batched decode) ----
// y[t, r] = W[r, :] · x[t, :] for t < n, with x in f16 (xh [n, cols], as to_half writes it) and
// W in its GGUF type: each tile of weights is dequantized (deq_T, quant.cu) to f16 in shared
// memory and multiplied with mma.sync m16n8k16, f32 accumulate. Nothing is copied at load.
//
// One order of summation per output element, which depends on `cols` only: k ascending in
// steps of 16 (one mma each, with the fragments ldmatrix gives from row-major tiles), the sum
// restarting from zero every QMM_CHUNK columns and the chunk sums added left to right. The
// number of tokens, the tile a token falls in and its neighbours change nothing: a token's
// result is the same bits in any batch. (The chunks let a decode kernel split a row's columns
// over warps and still give these bits.)
//
// CTA: 128 weight rows × 64 tokens, 8 warps as 4 (rows) × 2 (tokens), 32 × 32 each; k tiles of
// 64 (two 32-value groups per row: thread i dequantizes group i % 2 of row i / 2).
//                                           grid (ceil(n / 64), ceil(rows / 128)), block 256
#define QMM_BM 128
#define QMM_BN 64
#define QMM_BK 64
#define QMM_CHUNK 1024
// Rows of a tile 72 halves (144 bytes) apart: ldmatrix and the 16-byte stores hit 32 banks.
#define QMM_LD 72

typedef void (*DeqFn)(const u8*, int, float*);

template <DeqFn DEQ>
__device__ __forceinline__ void qmm_impl(const u8* __restrict__ W, long long row_bytes, int rows,
                                         int cols, const u16* __restrict__ xh,
                                         float* __restrict__ y, int n) {
    __shared__ __align__(16) u16 As[QMM_BM * QMM_LD];
    __shared__ __align__(16) u16 Bs[QMM_BN * QMM_LD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3, wn = warp >> 2;
    const int n0 = blockIdx.x * QMM_BN, r0 = blockIdx.y * QMM_BM;
    const int ng = cols / 32;
    // This thread's share of a k tile: weight group `ag` of row `ar`; 16 activations of token `bt`.
    const int ar = tid >> 1, ag = tid & 1;
    const bool arow = r0 + ar < rows;
    const u8* wrow = W + (long long)(r0 + ar) * row_bytes;
    const int bt = tid >> 2, bk = (tid & 3) * 16;
    const bool btok = n0 + bt < n;
    const u16* xrow = xh + (long long)(n0 + bt) * cols;
    float acc[2][4][4], tot[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = tot[i][j][e] = 0.f;
    for (int k0 = 0; k0 < cols; k0 += QMM_BK) {
        {
            const int g = (k0 >> 5) + ag;
            uint4* dst = (uint4*)(As + ar * QMM_LD + ag * 32);
            if (arow && g < ng) {
                float v[32];
                DEQ(wrow, g, v);
#pragma unroll
                for (int i = 0; i < 4; i++)
                    dst[i] = make_uint4(pack_h2(v[8 * i], v[8 * i + 1]), pack_h2(v[8 * i + 2], v[8 * i + 3]),
                                        pack_h2(v[8 * i + 4], v[8 * i + 5]), pack_h2(v[8 * i + 6], v[8 * i + 7]));
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) dst[i] = make_uint4(0, 0, 0, 0);
            }
        }
        {
            uint4* dst = (uint4*)(Bs + bt * QMM_LD + bk);
            const int k = k0 + bk;
            if (btok && k < cols) {
                const uint4* src = (const uint4*)(xrow + k);
                dst[0] = src[0];
                dst[1] = src[1];
            } else {
                dst[0] = dst[1] = make_uint4(0, 0, 0, 0);
            }
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < QMM_BK / 16; ks++) {
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                ldsm_x4(a[mt], As + (wm * 32 + mt * 16 + (lane & 15)) * QMM_LD + ks * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < 2; np++) {
                u32 r[4];
                ldsm_x4(r, Bs + (wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3)) * QMM_LD + ks * 16 +
                               ((lane >> 3) & 1) * 8);
                b[2 * np][0] = r[0];
                b[2 * np][1] = r[1];
                b[2 * np + 1][0] = r[2];
                b[2 * np + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++) mma_16816(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
        }
        __syncthreads();
        if ((k0 + QMM_BK) % QMM_CHUNK == 0 || k0 + QMM_BK >= cols) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        tot[i][j][e] += acc[i][j][e];
                        acc[i][j][e] = 0.f;
                    }
        }
    }
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const int r = r0 + wm * 32 + mt * 16 + g;
            const int t = n0 + wn * 32 + nt * 8 + 2 * tq;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int rr = r + (e >> 1) * 8, tt = t + (e & 1);
                if (rr < rows && tt < n) y[(long long)tt * rows + rr] = tot[mt][nt][e];
            }
        }
}

#define QMM_K(T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                 \
        qmm_##T(const u8* __restrict__ W, long long row_bytes, int rows, int cols,                   \
                const u16* __restrict__ xh, float* __restrict__ y, int n) {                           \
        pdl_begin();                                                                                  \
        qmm_impl<deq_##T>(W, row_bytes, rows, cols, xh, y, n);                                        \
    }
