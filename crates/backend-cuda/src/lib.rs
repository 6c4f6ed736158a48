//! The CUDA backend, the seed system's GPU context carried to CUDA: one context per loaded
//! model with its stream, a kernel registry (NVRTC → cubin for the device's architecture,
//! cached on disk), a graph executor that captures decode steps and replays them, weights
//! copied from the mapped GGUF straight to device memory, and cuBLAS for prefill products on
//! f16 copies of the weights.
//!
//! Everything is loaded at run time (cudarc's dynamic loading): the binary builds and runs on
//! machines without CUDA, where `probe` says why there is no GPU.

mod config;
mod dev;
mod graph;
pub mod libs;
pub mod registry;

use cudarc::driver::{result as dr, sys as ds};
use dev::{DevBuf, Device};
use quiver_backend::{
    Activation, AttnParams, Backend, BackendError, Batch, Result, RopeMode, RopeParams, Step,
    WeightBytes,
};
use quiver_gguf::GgmlType;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

pub use config::CudaConfig;
pub use dev::{probe, DeviceInfo};

/// Largest token count a captured decode step covers; buckets are powers of two up to it.
pub const MAX_GRAPH_TOKENS: usize = 64;
/// Tokens per matrix-vector launch (the kernels keep one accumulator per token).
const MMV_TOKENS: usize = 8;

pub struct CudaBuf {
    mem: DevBuf,
    len: usize,
}

impl CudaBuf {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    fn ptr(&self) -> u64 {
        self.mem.ptr
    }
}

pub struct CudaWeight {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    /// The GGUF bytes (vectors: f32).
    data: DevBuf,
    /// An f16 copy for the tensor-core (cuBLAS) path, when there is room.
    half: Option<DevBuf>,
    kernel: &'static str,
    /// Its module and kernel names, made once at load (no formatting per launch).
    names: Box<KernelNames>,
}

/// The kernels a weight's products and lookups launch: [general, single-token] variants, then
/// the same that prefetch their weights before waiting for the previous kernel (`mmv_name`).
struct KernelNames {
    module: String,
    embed: String,
    mmv: [String; 4],
    glu: [String; 4],
    /// The parity mode's product and gather (module "exact").
    x_mm: String,
    x_embed: String,
}

impl KernelNames {
    fn new(kernel: &str, int8: bool) -> Self {
        let base = if int8 { "mmvq" } else { "mmv" };
        let v = |pre: &str, post: &str| {
            [
                format!("{pre}{post}_{kernel}"),
                format!("{pre}1{post}_{kernel}"),
                format!("{pre}p{post}_{kernel}"),
                format!("{pre}p1{post}_{kernel}"),
            ]
        };
        KernelNames {
            module: format!("quant_{kernel}"),
            embed: format!("embed_{kernel}"),
            mmv: v(base, ""),
            glu: v(base, "_glu"),
            x_mm: format!("x_mm_{kernel}"),
            x_embed: format!("x_embed_{kernel}"),
        }
    }
}

/// Matrix-vector launches over at most this many weight bytes prefetch their rows into L2
/// before waiting for the previous kernel (quant.cu `MMV_BEGIN`): measured on the H200, tg128
/// +5% on the SmolLM2 shape and +2% on the Gemma3 shape, neutral on the 8B shapes, whose larger
/// launches lose with it (8B Q4_0 −12% with every launch prefetching, −4% with launches up to
/// 24 MiB doing it; BENCHMARKS.md).
const MMV_PREFETCH_MAX: usize = 4 << 20;

/// The variant of a matrix-vector kernel for `nt` tokens over `bytes` of weights.
fn mmv_name(names: &[String; 4], nt: usize, bytes: usize) -> &str {
    &names[usize::from(nt == 1) + 2 * usize::from(bytes <= MMV_PREFETCH_MAX)]
}

pub struct CudaKv {
    k: DevBuf,
    v: DevBuf,
    kv_dim: usize,
    n_slots: usize,
}

/// Counters of the graph executor (also in `--verbose` output and bench JSON).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub captures: u64,
    /// Captures that could not be kept (the step then ran eagerly; the key stays eager).
    pub failed_captures: u64,
    pub replays: u64,
    pub eager: u64,
}

/// Device memory held, by use.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemStats {
    pub weights: u64,
    pub f16_copies: u64,
    pub kv: u64,
    pub workspace: u64,
}

/// Scratch buffers the ops grow on demand (never during a capture: a key's first step runs
/// eagerly and sizes them).
#[derive(Default)]
struct Scratch {
    part: Option<DevBuf>,
    top_ids: Option<DevBuf>,
    top_vals: Option<DevBuf>,
    aq: Option<DevBuf>,
    ad: Option<DevBuf>,
    abs: Option<DevBuf>,
    xbf: Option<DevBuf>,
    gather: Option<DevBuf>,
    ids: Option<DevBuf>,
    thetas: HashMap<Vec<u32>, DevBuf>,
    /// The parity mode's rope sines and cosines of the step (and their host staging), and GELU
    /// table.
    sincos: Option<DevBuf>,
    sincos_host: Vec<f32>,
    gelu: Option<DevBuf>,
    gelu_filled: bool,
}

/// Where each region of the uploaded batch starts (u32 offsets), for `cap_t` tokens.
#[derive(Clone, Copy, Default)]
struct BatchLayout {
    cap_t: usize,
    cap_s: usize,
    cap_bt: usize,
}

impl BatchLayout {
    fn words(&self) -> usize {
        5 * self.cap_t + 2 * self.cap_s + self.cap_bt
    }
}

/// One matrix of an `mmv` launch (mirrors `MmvMat` in quant.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MmvMat {
    w: u64,
    y: u64,
    row_bytes: i64,
    rows: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct BatchView {
    tokens: u64,
    pos: u64,
    slot: u64,
    seq: u64,
    logit_rows: u64,
    kv_len: u64,
    bt_off: u64,
    block_tables: u64,
    block_size: u32,
}

/// The int8 grid the CPU backend (like ggml) quantizes activations to for products with weights
/// of type `ty`: blocks of 32 for the legacy quantized types, of 256 for the K-quants, none for
/// float weights. The tensor-core products round their f16 activations to the same grid.
pub fn act_grid(ty: GgmlType) -> Option<usize> {
    use GgmlType::*;
    match ty {
        F32 | F16 | BF16 => None,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS => Some(256),
        _ => Some(32),
    }
}

pub struct CudaBackend {
    dev: Device,
    reg: Mutex<registry::Registry>,
    blas: Option<dev::Blas>,
    /// The configuration in effect (`CudaConfig::resolve`).
    cfg: CudaConfig,
    /// This step's query tiles for the flash kernel ({seq, first token, tokens, 0}) and how
    /// many there are (0: the step uses the split-K kernel).
    tiles: Vec<[i32; 4]>,
    tile_buf: Option<DevBuf>,
    n_tiles: usize,
    /// Host staging of `top_k` (reused: no allocation per step).
    top_host: Mutex<(Vec<u32>, Vec<f32>)>,
    scratch: Mutex<Scratch>,
    mem: Mutex<MemStats>,
    batch_buf: Option<DevBuf>,
    layout: BatchLayout,
    host: Vec<u32>,
    view: BatchView,
    /// The current step: token rows (padded), real tokens, logits rows, whether logits rows are 0..rows.
    rows: usize,
    logit_rows: usize,
    logits_identity: bool,
    graphs: graph::Graphs,
    /// Bumped whenever a buffer the graphs use moves (part of every graph key).
    generation: std::sync::atomic::AtomicU64,
    load_progress: Mutex<Option<(quiver_hub::Progress, u64, u64)>>,
}

fn derr(what: impl std::fmt::Display, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("{what}: {e:?}"))
}

fn check(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(BackendError::Shape {
            op,
            detail: detail(),
        })
    }
}

/// Kernel arguments packed for cuLaunchKernel.
pub(crate) struct Args {
    words: [u64; ARG_WORDS],
    offs: [usize; MAX_ARGS],
    used: usize,
    n: usize,
}

/// Room for a launch's arguments, on the stack (no allocation per launch).
const ARG_WORDS: usize = 40;
const MAX_ARGS: usize = 16;

impl Default for Args {
    fn default() -> Self {
        Args {
            words: [0; ARG_WORDS],
            offs: [0; MAX_ARGS],
            used: 0,
            n: 0,
        }
    }
}

impl Args {
    pub(crate) fn push<T: Copy>(&mut self, v: T) -> &mut Self {
        let need = std::mem::size_of::<T>().div_ceil(8);
        assert!(
            self.n < MAX_ARGS && self.used + need <= ARG_WORDS,
            "kernel arguments exceed Args' room"
        );
        // SAFETY: words[used..used + need] holds size_of::<T>() bytes, 8-byte aligned.
        unsafe { std::ptr::write_unaligned(self.words.as_mut_ptr().add(self.used) as *mut T, v) };
        self.offs[self.n] = self.used;
        self.used += need;
        self.n += 1;
        self
    }
    /// Pointers to each argument, as cuLaunchKernel takes them (valid while `self` lives).
    fn ptrs(&mut self) -> ([*mut c_void; MAX_ARGS], usize) {
        let base = self.words.as_mut_ptr();
        let mut p = [std::ptr::null_mut(); MAX_ARGS];
        for (d, &o) in p.iter_mut().zip(&self.offs[..self.n]) {
            // SAFETY: offsets are within `words`.
            *d = unsafe { base.add(o) } as *mut c_void;
        }
        (p, self.n)
    }
}

macro_rules! args {
    ($($a:expr),* $(,)?) => {{
        let mut a = $crate::Args::default();
        $(a.push($a);)*
        a
    }};
}

mod exact;
pub use exact::requested as exact_requested;

fn grid1(n: usize, block: usize, cap: usize) -> u32 {
    n.div_ceil(block).clamp(1, cap) as u32
}

impl CudaBackend {
    /// Opens CUDA device `ordinal`, creates its stream, loads cuBLAS if present and allowed,
    /// and compiles (or reads from the cache) the kernels every model needs, for `config`
    /// (usually `CudaConfig::from_env()`, adjusted).
    pub fn new(ordinal: usize, config: CudaConfig) -> Result<Self> {
        let dev = Device::open(ordinal).map_err(BackendError::Device)?;
        let mut reg = registry::Registry::new(dev.info.arch);
        for m in ["ops", "attn"] {
            reg.ensure(m).map_err(BackendError::Device)?;
        }
        if config.exact {
            reg.ensure("exact").map_err(BackendError::Device)?;
        }
        let blas = if config.cublas {
            dev::Blas::new(dev.stream).ok()
        } else {
            None
        };
        let cfg = config.resolve(dev.info.arch, blas.is_some());
        let load_progress = cfg
            .load_total
            .map(|total| (quiver_hub::Progress::bytes(total), 0, total));
        Ok(CudaBackend {
            dev,
            reg: Mutex::new(reg),
            tiles: Vec::new(),
            tile_buf: None,
            n_tiles: 0,
            top_host: Mutex::new((Vec::new(), Vec::new())),
            blas,
            scratch: Mutex::new(Scratch::default()),
            mem: Mutex::new(MemStats::default()),
            batch_buf: None,
            layout: BatchLayout::default(),
            host: Vec::new(),
            view: BatchView {
                tokens: 0,
                pos: 0,
                slot: 0,
                seq: 0,
                logit_rows: 0,
                kv_len: 0,
                bt_off: 0,
                block_tables: 0,
                block_size: 1,
            },
            rows: 0,
            logit_rows: 0,
            logits_identity: true,
            graphs: graph::Graphs::new(cfg.graphs),
            generation: Default::default(),
            cfg,
            load_progress: Mutex::new(load_progress),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.dev.info
    }

    /// Kernel modules compiled by NVRTC and read from the disk cache so far.
    pub fn kernel_counts(&self) -> (usize, usize) {
        let r = self.reg.lock().unwrap();
        (r.compiled, r.from_cache)
    }

    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }

    pub fn mem_stats(&self) -> MemStats {
        *self.mem.lock().unwrap()
    }

    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// The configuration in effect: what `new` was given, less what the machine lacks.
    pub fn config(&self) -> &CudaConfig {
        &self.cfg
    }

    /// A buffer holding `data` (tests, tools).
    pub fn buf_from(&self, data: &[f32]) -> Result<CudaBuf> {
        let b = self.buf(data.len())?;
        self.dev
            .htod_sync(b.ptr(), data)
            .map_err(BackendError::Device)?;
        Ok(b)
    }

    /// Overwrites a KV cache with f16 bit patterns (tests).
    pub fn write_kv(&self, kv: &mut CudaKv, k: &[u16], v: &[u16]) -> Result<()> {
        check(
            "write_kv",
            k.len() == kv.n_slots * kv.kv_dim && v.len() == k.len(),
            || "sizes".into(),
        )?;
        self.dev
            .htod_sync(kv.k.ptr, k)
            .map_err(BackendError::Device)?;
        self.dev
            .htod_sync(kv.v.ptr, v)
            .map_err(BackendError::Device)
    }

    /// The KV cache as f16 bit patterns (tests).
    pub fn read_kv(&self, kv: &CudaKv) -> Result<(Vec<u16>, Vec<u16>)> {
        let mut k = vec![0u16; kv.n_slots * kv.kv_dim];
        let mut v = k.clone();
        self.dev
            .dtoh(&mut k, kv.k.ptr)
            .map_err(BackendError::Device)?;
        self.dev
            .dtoh(&mut v, kv.v.ptr)
            .map_err(BackendError::Device)?;
        Ok((k, v))
    }

    fn alloc(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        self.dev.alloc(bytes).map_err(|e| {
            let (free, total) = self.dev.mem_info();
            BackendError::Device(format!(
                "out of device memory for {what}: needed {:.1} MiB, {:.1} MiB free of {:.1} MiB ({e}); try a smaller --ctx-size or --device cpu",
                bytes as f64 / 1048576.0,
                free as f64 / 1048576.0,
                total as f64 / 1048576.0
            ))
        })
    }

    fn func(&self, module: &str, name: &str) -> Result<ds::CUfunction> {
        self.reg
            .lock()
            .unwrap()
            .func(module, name)
            .map_err(BackendError::Device)
    }

    fn launch(
        &self,
        module: &str,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        mut a: Args,
    ) -> Result<()> {
        let f = self.func(module, name)?;
        let (mut p, n) = a.ptrs();
        if self.cfg.pdl {
            // Programmatic dependent launch: every kernel begins with pdl_begin() (common.cuh),
            // which waits for the previous kernel before it touches memory.
            // SAFETY: a zeroed attribute is a valid C union; we set the one field this id reads.
            let mut attr: ds::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                ds::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = ds::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: 0,
                hStream: self.dev.stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as below; `cfg` and `attr` outlive the call.
            unsafe { ds::cuLaunchKernelEx(&cfg, f, p.as_mut_ptr(), std::ptr::null_mut()).result() }
                .map_err(|e| derr(format!("launching kernel {name}"), e))?;
        } else {
            // SAFETY: the arguments match the kernel's signature (each call site mirrors its
            // .cu declaration) and point to live device buffers; `a` outlives the call.
            unsafe { dr::launch_kernel(f, grid, block, 0, self.dev.stream, &mut p[..n]) }
                .map_err(|e| derr(format!("launching kernel {name}"), e))?;
        }
        if self.cfg.sync_each && !self.graphs.capturing() {
            // SAFETY: our stream.
            unsafe { dr::stream::synchronize(self.dev.stream) }
                .map_err(|e| derr(format!("kernel {name}"), e))?;
        }
        Ok(())
    }

    /// Grows scratch buffer `slot` to at least `bytes`; a move invalidates captured graphs.
    fn scratch_ptr(
        &self,
        pick: fn(&mut Scratch) -> &mut Option<DevBuf>,
        bytes: usize,
        what: &str,
    ) -> Result<u64> {
        let mut s = self.scratch.lock().unwrap();
        let cur = pick(&mut s);
        if cur.as_ref().is_none_or(|b| b.bytes < bytes) {
            if self.graphs.capturing() {
                return Err(BackendError::Device(format!(
                    "{what}: scratch grew during a graph capture"
                )));
            }
            let nb = self.alloc(bytes.next_power_of_two(), what)?;
            let old = cur.replace(nb);
            let mut m = self.mem.lock().unwrap();
            m.workspace += cur.as_ref().unwrap().bytes as u64;
            if let Some(o) = old {
                m.workspace -= o.bytes as u64;
                // Graphs captured over the old buffer must never run again.
                self.generation
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                drop(o);
            }
        }
        Ok(cur.as_ref().unwrap().ptr)
    }

    fn theta_ptr(&self, rope: &RopeParams) -> Result<u64> {
        let th: Vec<f32> = (0..rope.n_dims / 2).map(|i| rope.theta(i)).collect();
        let key: Vec<u32> = th.iter().map(|t| t.to_bits()).collect();
        let mut s = self.scratch.lock().unwrap();
        if let Some(b) = s.thetas.get(&key) {
            return Ok(b.ptr);
        }
        if self.graphs.capturing() {
            return Err(BackendError::Device(
                "rope table made during a graph capture".into(),
            ));
        }
        let b = self.alloc(th.len().max(1) * 4, "rope table")?;
        self.dev
            .htod_sync(b.ptr, &th)
            .map_err(BackendError::Device)?;
        let p = b.ptr;
        s.thetas.insert(key, b);
        Ok(p)
    }

    /// y[t, r] = W[r, :] · x[t, :] for `n` rows of x at `x`, into `y`.
    fn mm(&self, w: &CudaWeight, x: u64, n: usize, y: u64) -> Result<()> {
        if self.cfg.exact {
            return self.x_mm(w, x, n, y);
        }
        if let Some(wh) = self.tensor_core_weight(w, n) {
            let xh = self.to_half(x, n, w.cols, w.ty)?;
            return self.gemm(w, wh, xh, n, y);
        }
        self.mmv(&[(w, y)], x, n)
    }

    /// The f16 weights of `w` when a product over `n` tokens goes to the tensor cores.
    fn tensor_core_weight(&self, w: &CudaWeight, n: usize) -> Option<u64> {
        if n < self.cfg.gemm_min_tokens || !self.cfg.tensor_cores || self.blas.is_none() {
            return None;
        }
        if w.ty == GgmlType::F16 {
            Some(w.data.ptr)
        } else {
            w.half.as_ref().map(|b| b.ptr)
        }
    }

    /// `rows` × `cols` f32 at `x` as f16 in the activation scratch, for products with weights
    /// of type `ty`: on the int8 grid of that type (see [`act_grid`]) when `act_grid` is on.
    fn to_half(&self, x: u64, rows: usize, cols: usize, ty: GgmlType) -> Result<u64> {
        let len = rows * cols;
        let xh = self.scratch_ptr(|s| &mut s.xbf, len * 2, "f16 activations")?;
        match act_grid(ty).filter(|b| self.cfg.act_grid && cols.is_multiple_of(*b)) {
            Some(block) => {
                let nb = len / block;
                let (name, grid, threads) = if block == 32 {
                    ("f32_to_f16_q32", len.div_ceil(1024), (256, 1, 1))
                } else {
                    ("f32_to_f16_q256", nb.div_ceil(8), (32, 8, 1))
                };
                self.launch(
                    "ops",
                    name,
                    (grid as u32, 1, 1),
                    threads,
                    args![x, xh, nb as i64],
                )?;
            }
            None => self.launch(
                "ops",
                "f32_to_f16",
                (grid1(len.div_ceil(4), 256, 8192), 1, 1),
                (256, 1, 1),
                args![x, xh, len as i64],
            )?,
        }
        Ok(xh)
    }

    /// y[n, w.rows] = xh[n, w.cols] (f16) · W (f16 at `wh`)ᵀ through cuBLAS.
    fn gemm(&self, w: &CudaWeight, wh: u64, xh: u64, n: usize, y: u64) -> Result<()> {
        let blas = self
            .blas
            .as_ref()
            .expect("tensor_core_weight checked cuBLAS");
        blas.gemm_f16(wh, xh, y, w.rows, n, w.cols)
            .map_err(|e| derr("cublasGemmEx", e))
    }

    /// Matrix-vector products of up to three matrices of one type over the same x, in one
    /// launch per 8 tokens.
    fn mmv(&self, mats: &[(&CudaWeight, u64)], x: u64, n: usize) -> Result<()> {
        let w0 = mats[0].0;
        let module = &w0.names.module;
        let int8 = self.int8_block(w0);
        let total_rows: usize = mats.iter().map(|(w, _)| w.rows).sum();
        let mut t = 0;
        while t < n {
            let nt = (n - t).min(MMV_TOKENS);
            let mut m = [MmvMat::default(); 3];
            for (i, (w, y)) in mats.iter().enumerate() {
                m[i] = MmvMat {
                    w: w.data.ptr,
                    y: y + (t * w.rows * 4) as u64,
                    row_bytes: w.row_bytes as i64,
                    rows: w.rows as i32,
                };
            }
            let xo = x + (t * w0.cols * 4) as u64;
            let grid = (total_rows.div_ceil(4) as u32, 1, 1);
            let bytes = mats.iter().map(|(w, _)| w.rows * w.row_bytes).sum();
            let name = mmv_name(&w0.names.mmv, nt, bytes);
            match int8 {
                Some(block) => {
                    let (q, d, bs) = self.quantize_act(xo, nt, w0.cols, block, w0.ty)?;
                    self.launch(
                        module,
                        name,
                        grid,
                        (32, 4, 1),
                        args![m[0], m[1], m[2], q, d, bs, w0.cols as i32, nt as i32],
                    )?;
                }
                None => self.launch(
                    module,
                    name,
                    grid,
                    (32, 4, 1),
                    args![m[0], m[1], m[2], xo, w0.cols as i32, nt as i32],
                )?,
            }
            t += nt;
        }
        Ok(())
    }

    /// The activation block size when `w`'s decode kernels take int8 activations.
    fn int8_block(&self, w: &CudaWeight) -> Option<usize> {
        if self.cfg.int8 {
            registry::int8_activations(w.kernel)
        } else {
            None
        }
    }

    /// Quantizes `n` rows of `cols` f32 at `x` to int8 blocks of `block` (32 or 256) in the
    /// activation scratch: (quants, scales, per-16 sums).
    /// The scales are rounded as the CPU backend (and ggml) rounds them for weights of type
    /// `ty`: per-32 `d` in f16, and for Q4_1/Q5_1 the offset sum `s` in f16 too.
    fn quantize_act(
        &self,
        x: u64,
        n: usize,
        cols: usize,
        block: usize,
        ty: GgmlType,
    ) -> Result<(u64, u64, u64)> {
        let q = self.scratch_ptr(|s| &mut s.aq, n * cols, "int8 activations")?;
        let nb = (n * cols / block) as i64;
        let grid = ((nb as usize).div_ceil(8) as u32, 1, 1);
        if block == 32 {
            let d = self.scratch_ptr(|s| &mut s.ad, n * cols / 32 * 8, "activation scales")?;
            let q8_1 = i32::from(matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1));
            self.launch(
                "ops",
                "quantize_a32",
                grid,
                (32, 8, 1),
                args![x, q, d, nb, q8_1],
            )?;
            Ok((q, d, 0))
        } else {
            let d = self.scratch_ptr(|s| &mut s.ad, n * cols / 256 * 4, "activation scales")?;
            let bs = self.scratch_ptr(|s| &mut s.abs, n * cols / 16 * 4, "activation sums")?;
            self.launch(
                "ops",
                "quantize_a256",
                grid,
                (32, 8, 1),
                args![x, q, d, bs, nb],
            )?;
            Ok((q, d, bs))
        }
    }

    /// out = rms_norm(x) · w over `rows` rows of `w.cols`, or with `residual`: residual += x
    /// first and the norm is taken of the sum. `out` may be `x`.
    #[allow(clippy::too_many_arguments)]
    fn norm(
        &self,
        residual: Option<(u64, usize)>,
        x: u64,
        x_len: usize,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
        out: u64,
        out_len: usize,
    ) -> Result<()> {
        let cols = w.cols;
        let n = rows * cols;
        let ok = x_len >= n
            && out_len >= n
            && residual.is_none_or(|(_, l)| l >= n)
            && cols.is_multiple_of(4);
        check("rms_norm", ok, || {
            format!("{rows}×{cols} over buffers of {x_len} / {out_len}")
        })?;
        if rows == 0 {
            return Ok(());
        }
        let r = residual.map(|(p, _)| p).unwrap_or(0);
        if self.cfg.exact {
            return self.x_norm(r, x, w, eps, rows, out);
        }
        self.launch(
            "ops",
            "rms_norm",
            (rows as u32, 1, 1),
            (norm_threads(cols), 1, 1),
            args![r, x, w.data.ptr, out, rows as i32, cols as i32, eps],
        )
    }

    /// Query tiles of up to 64 consecutive tokens per sequence for the flash kernel; none
    /// (split-K kernel) when a sequence's positions are not consecutive.
    fn upload_tiles(&mut self, batch: &Batch) -> Result<()> {
        if !query_tiles(batch, &mut self.tiles) {
            return Ok(());
        }
        let bytes = self.tiles.len() * 16;
        if self.tile_buf.as_ref().is_none_or(|b| b.bytes < bytes) {
            self.tile_buf =
                Some(self.alloc(bytes.next_power_of_two().max(4096), "attention tiles")?);
        }
        let flat: Vec<i32> = self.tiles.iter().flatten().copied().collect();
        self.dev
            .htod_async(self.tile_buf.as_ref().unwrap().ptr, &flat)
            .map_err(BackendError::Device)?;
        self.n_tiles = self.tiles.len();
        Ok(())
    }

    fn upload_batch(
        &mut self,
        batch: &Batch,
        rows: usize,
        logit_rows: usize,
        max_tokens: usize,
    ) -> Result<()> {
        let n = batch.n_tokens();
        let n_seqs = batch.seqs.len();
        let bt_total: usize = batch
            .seqs
            .iter()
            .map(|s| s.block_table.len())
            .sum::<usize>()
            + 1;
        let need = BatchLayout {
            cap_t: rows.max(max_tokens.min(4096)).max(logit_rows),
            cap_s: n_seqs + 1,
            cap_bt: bt_total,
        };
        let l = &mut self.layout;
        if self.batch_buf.is_none()
            || need.cap_t > l.cap_t
            || need.cap_s > l.cap_s
            || need.cap_bt > l.cap_bt
        {
            let grown = BatchLayout {
                cap_t: need.cap_t.max(l.cap_t),
                cap_s: need.cap_s.max(l.cap_s).next_power_of_two().max(64),
                cap_bt: need.cap_bt.max(l.cap_bt).next_power_of_two().max(1024),
            };
            let buf = self
                .dev
                .alloc(grown.words() * 4)
                .map_err(BackendError::Device)?;
            self.batch_buf = Some(buf);
            self.layout = grown;
            self.generation
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let l = self.layout;
        let (ct, cs) = (l.cap_t, l.cap_s);
        let h = &mut self.host;
        h.clear();
        h.resize(5 * ct + 2 * cs + bt_total, 0);
        let dummy = n_seqs as u32;
        for t in 0..rows {
            if t < n {
                h[t] = batch.tokens[t];
                h[ct + t] = batch.positions[t];
                h[2 * ct + t] = batch.slots[t];
                h[3 * ct + t] = batch.seq_of[t];
            } else {
                h[2 * ct + t] = u32::MAX;
                h[3 * ct + t] = dummy;
            }
        }
        for i in 0..logit_rows {
            h[4 * ct + i] = batch.logits.get(i).copied().unwrap_or(i as u32);
        }
        self.logits_identity = (0..logit_rows).all(|i| h[4 * ct + i] as usize == i);
        let mut off = 0u32;
        for (si, s) in batch.seqs.iter().enumerate() {
            h[5 * ct + si] = s.kv_len as u32;
            h[5 * ct + cs + si] = off;
            let b = 5 * ct + 2 * cs + off as usize;
            h[b..b + s.block_table.len()].copy_from_slice(&s.block_table);
            off += s.block_table.len() as u32;
        }
        // The padding sequence: no keys.
        h[5 * ct + n_seqs] = 0;
        h[5 * ct + cs + n_seqs] = off;
        let base = self.batch_buf.as_ref().unwrap().ptr;
        self.dev.htod_async(base, h).map_err(BackendError::Device)?;
        let at = |w: usize| base + 4 * w as u64;
        self.view = BatchView {
            tokens: at(0),
            pos: at(ct),
            slot: at(2 * ct),
            seq: at(3 * ct),
            logit_rows: at(4 * ct),
            kv_len: at(5 * ct),
            bt_off: at(5 * ct + cs),
            block_tables: at(5 * ct + 2 * cs),
            block_size: batch.block_size as u32,
        };
        Ok(())
    }

    fn n_split(&self, rows: usize, n_head: usize, n_slots: usize) -> usize {
        self.cfg
            .attention_splits
            .unwrap_or_else(|| attention_splits(rows * n_head, self.dev.info.sms as usize, n_slots))
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Weight = CudaWeight;
    type Kv = CudaKv;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn weight(
        &self,
        name: &str,
        ty: GgmlType,
        shape: &[u64],
        bytes: WeightBytes,
    ) -> Result<CudaWeight> {
        self.dev.bind().map_err(BackendError::Device)?;
        let cols = *shape.last().unwrap_or(&1) as usize;
        let rows = shape.iter().rev().skip(1).product::<u64>() as usize;
        let raw = bytes.bytes();
        let progress = |n: u64| {
            if let Some((p, done, total)) = self.load_progress.lock().unwrap().as_mut() {
                *done += n;
                p.update(*done, &mut std::io::stderr());
                if *done >= *total {
                    eprintln!();
                }
            }
        };
        if rows == 1 {
            let mut v = vec![0f32; cols];
            quiver_quant::dequantize(ty, raw, &mut v).map_err(|e| BackendError::Shape {
                op: "weight",
                detail: format!("{name}: {e}"),
            })?;
            let data = self.alloc(cols * 4, name)?;
            self.dev
                .htod_sync(data.ptr, &v)
                .map_err(BackendError::Device)?;
            self.mem.lock().unwrap().weights += data.bytes as u64;
            progress(raw.len() as u64);
            return Ok(CudaWeight {
                ty: GgmlType::F32,
                rows,
                cols,
                row_bytes: cols * 4,
                data,
                half: None,
                kernel: "f32",
                names: Box::new(KernelNames::new("f32", false)),
            });
        }
        let kernel = kernel_suffix(ty).ok_or(BackendError::Unsupported {
            op: "matmul",
            ty,
            backend: "cuda",
        })?;
        check("weight", cols.is_multiple_of(32), || {
            format!("{name}: {cols} columns is not a multiple of 32")
        })?;
        self.reg
            .lock()
            .unwrap()
            .ensure(&format!("quant_{kernel}"))
            .map_err(BackendError::Device)?;
        let row_bytes = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
        check("weight", row_bytes * rows == raw.len(), || {
            format!("{name}: {} bytes for {rows}×{cols} {ty}", raw.len())
        })?;
        let data = self.alloc(raw.len(), name)?;
        // Straight from the mapped file, in pieces so the progress bar moves.
        const PIECE: usize = 64 << 20;
        for (i, chunk) in raw.chunks(PIECE).enumerate() {
            self.dev
                .htod_sync(data.ptr + (i * PIECE) as u64, chunk)
                .map_err(BackendError::Device)?;
            progress(chunk.len() as u64);
        }
        self.mem.lock().unwrap().weights += data.bytes as u64;
        let mut w = CudaWeight {
            ty,
            rows,
            cols,
            row_bytes,
            data,
            half: None,
            kernel,
            names: Box::new(KernelNames::new(
                kernel,
                self.cfg.int8 && registry::int8_activations(kernel).is_some(),
            )),
        };
        // F16 weights are their own copy.
        if self.cfg.exact {
            // The parity mode's products read the GGUF bytes only.
            if exact::act_block(ty).is_none() {
                return Err(BackendError::Unsupported {
                    op: "matmul (QUIVER_CUDA_EXACT=1)",
                    ty,
                    backend: "cuda",
                });
            }
            return Ok(w);
        }
        if self.cfg.f16_copies && ty != GgmlType::F16 {
            let need = rows * cols * 2;
            let (free, total) = self.dev.mem_info();
            // Keep a tenth of the card (and 2 GiB) for the KV cache and workspace.
            if free > need as u64 + total / 10 + (2 << 30) {
                if let Ok(b) = self.dev.alloc(need) {
                    self.launch(
                        &format!("quant_{kernel}"),
                        &format!("dequant_f16_{kernel}"),
                        (rows as u32, 1, 1),
                        (128, 1, 1),
                        args![w.data.ptr, b.ptr, cols as i32, row_bytes as i64],
                    )?;
                    self.mem.lock().unwrap().f16_copies += b.bytes as u64;
                    w.half = Some(b);
                }
            }
        }
        Ok(w)
    }

    fn weight_rows(&self, w: &CudaWeight) -> usize {
        w.rows
    }

    fn buf(&self, n: usize) -> Result<CudaBuf> {
        self.dev.bind().map_err(BackendError::Device)?;
        let mem = self.alloc(n.max(1) * 4, "activations")?;
        self.dev
            .memset_zero(mem.ptr, mem.bytes)
            .map_err(BackendError::Device)?;
        self.mem.lock().unwrap().workspace += mem.bytes as u64;
        Ok(CudaBuf { mem, len: n })
    }

    fn kv(&self, n_slots: usize, kv_dim: usize) -> Result<CudaKv> {
        self.dev.bind().map_err(BackendError::Device)?;
        let bytes = n_slots.max(1) * kv_dim * 2;
        let k = self.alloc(bytes, "the KV cache")?;
        let v = self.alloc(bytes, "the KV cache")?;
        self.dev
            .memset_zero(k.ptr, bytes)
            .map_err(BackendError::Device)?;
        self.dev
            .memset_zero(v.ptr, bytes)
            .map_err(BackendError::Device)?;
        self.mem.lock().unwrap().kv += 2 * bytes as u64;
        Ok(CudaKv {
            k,
            v,
            kv_dim,
            n_slots,
        })
    }

    fn begin_step(
        &mut self,
        batch: &Batch,
        state: u64,
        max_tokens: usize,
        max_logits: usize,
    ) -> Result<Step> {
        self.dev.bind().map_err(BackendError::Device)?;
        let n = batch.n_tokens();
        let nl = batch.logits.len();
        // Decode-shaped steps (every token wants logits) pad to a bucket and run from a graph.
        let bucket = if self.graphs.enabled() {
            graph_bucket(n, nl, max_tokens, max_logits)
        } else {
            None
        };
        let graphable = bucket.is_some();
        let (rows, logit_rows) = match bucket {
            Some(b) => (b, b),
            None => (n, nl),
        };

        self.upload_batch(batch, rows, logit_rows, max_tokens)?;
        self.rows = rows;
        self.logit_rows = logit_rows;
        let step = Step {
            rows,
            logit_rows,
            replayed: false,
        };
        self.n_tiles = 0;
        // Flash attention for prefill-shaped steps only, decided by the batch's shape (not by
        // whether graphs are on), so that eager and replayed steps run the same kernels.
        let decode_shaped = graph_bucket(n, nl, max_tokens, max_logits).is_some();
        if self.cfg.flash && !decode_shaped && batch.seqs.iter().any(|s| s.len > 1) {
            self.upload_tiles(batch)?;
        }
        if !graphable {
            self.graphs.stats.eager += 1;
            return Ok(step);
        }
        let generation = self.generation.load(std::sync::atomic::Ordering::Relaxed);
        self.graphs.retain_generation(generation);
        let key = graph::Key {
            state,
            rows,
            generation,
        };
        match self
            .graphs
            .begin(key, self.dev.stream)
            .map_err(|e| derr("graph", e))?
        {
            graph::Begin::Replayed => Ok(Step {
                replayed: true,
                ..step
            }),
            graph::Begin::Capturing | graph::Begin::Eager => Ok(step),
        }
    }

    fn end_step(&mut self, ok: bool) -> Result<bool> {
        Ok(self.graphs.end(ok, self.dev.stream))
    }

    fn embed(&self, table: &CudaWeight, scale: f32, out: &mut CudaBuf) -> Result<()> {
        let n = self.rows;
        check("embed", out.len >= n * table.cols, || {
            format!("out holds {} < {n}×{}", out.len, table.cols)
        })?;
        let (module, name) = if self.cfg.exact {
            ("exact", &table.names.x_embed)
        } else {
            (table.names.module.as_str(), &table.names.embed)
        };
        self.launch(
            module,
            name,
            (n.max(1) as u32, 1, 1),
            (128, 1, 1),
            args![
                table.data.ptr,
                self.view.tokens,
                out.ptr(),
                table.cols as i32,
                table.row_bytes as i64,
                scale
            ],
        )
    }

    fn rms_norm(
        &self,
        x: &CudaBuf,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.norm(None, x.ptr(), x.len, w, eps, rows, out.ptr(), out.len)
    }

    fn rms_norm_inplace(
        &self,
        x: &mut CudaBuf,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
    ) -> Result<()> {
        self.norm(None, x.ptr(), x.len, w, eps, rows, x.ptr(), x.len)
    }

    fn add_rms_norm(
        &self,
        residual: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.norm(
            Some((residual.ptr(), residual.len)),
            x.ptr(),
            x.len,
            w,
            eps,
            rows,
            out.ptr(),
            out.len,
        )
    }

    fn add(&self, a: &mut CudaBuf, b: &CudaBuf, n: usize) -> Result<()> {
        check("add", a.len >= n && b.len >= n, || {
            format!("{n} over {} / {}", a.len, b.len)
        })?;
        self.launch(
            "ops",
            "add",
            (grid1(n, 256, 4096), 1, 1),
            (256, 1, 1),
            args![a.ptr(), b.ptr(), n as i64],
        )
    }

    fn matmul(&self, w: &CudaWeight, x: &CudaBuf, rows_x: usize, out: &mut CudaBuf) -> Result<()> {
        check(
            "matmul",
            x.len >= rows_x * w.cols && out.len >= rows_x * w.rows,
            || {
                format!(
                    "x {} for {rows_x}×{}, out {} for {rows_x}×{}",
                    x.len, w.cols, out.len, w.rows
                )
            },
        )?;
        self.mm(w, x.ptr(), rows_x, out.ptr())
    }

    fn matmul_qkv(
        &self,
        w: [&CudaWeight; 3],
        x: &CudaBuf,
        rows_x: usize,
        out: [&mut CudaBuf; 3],
    ) -> Result<()> {
        let fused = !self.cfg.exact
            && rows_x <= MMV_TOKENS
            && w.iter().all(|m| m.ty == w[0].ty && m.cols == w[0].cols);
        for (m, o) in w.iter().zip(&out) {
            check(
                "matmul",
                x.len >= rows_x * m.cols && o.len >= rows_x * m.rows,
                || format!("{rows_x} rows"),
            )?;
        }
        let halves: Vec<Option<u64>> = w
            .iter()
            .map(|m| self.tensor_core_weight(m, rows_x))
            .collect();
        if halves.iter().all(Option::is_some)
            && w.iter()
                .all(|m| m.cols == w[0].cols && act_grid(m.ty) == act_grid(w[0].ty))
        {
            // One f16 copy of x for the three products.
            let xh = self.to_half(x.ptr(), rows_x, w[0].cols, w[0].ty)?;
            for ((m, o), wh) in w.iter().zip(out).zip(halves) {
                self.gemm(m, wh.unwrap(), xh, rows_x, o.ptr())?;
            }
            return Ok(());
        }
        if !fused {
            for (m, o) in w.iter().zip(out) {
                self.mm(m, x.ptr(), rows_x, o.ptr())?;
            }
            return Ok(());
        }
        self.mmv(
            &[
                (w[0], out[0].ptr()),
                (w[1], out[1].ptr()),
                (w[2], out[2].ptr()),
            ],
            x.ptr(),
            rows_x,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul_glu(
        &self,
        act: Activation,
        gate: &CudaWeight,
        up: &CudaWeight,
        x: &CudaBuf,
        rows_x: usize,
        scratch: [&mut CudaBuf; 2],
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n_ff = gate.rows;
        if self.cfg.exact
            || rows_x > MMV_TOKENS
            || self.tensor_core_weight(gate, rows_x).is_some()
            || gate.ty != up.ty
            || gate.rows != up.rows
            || gate.cols != up.cols
        {
            let [g, u] = scratch;
            match (
                self.tensor_core_weight(gate, rows_x),
                self.tensor_core_weight(up, rows_x),
            ) {
                (Some(gh), Some(uh))
                    if gate.cols == up.cols && act_grid(gate.ty) == act_grid(up.ty) =>
                {
                    check(
                        "matmul_glu",
                        x.len >= rows_x * gate.cols
                            && g.len >= rows_x * n_ff
                            && u.len >= rows_x * up.rows,
                        || format!("{rows_x} rows"),
                    )?;
                    // One f16 copy of x for both products.
                    let xh = self.to_half(x.ptr(), rows_x, gate.cols, gate.ty)?;
                    self.gemm(gate, gh, xh, rows_x, g.ptr())?;
                    self.gemm(up, uh, xh, rows_x, u.ptr())?;
                }
                _ => {
                    self.matmul(gate, x, rows_x, g)?;
                    self.matmul(up, x, rows_x, u)?;
                }
            }
            return self.glu(act, g, u, rows_x * n_ff, out);
        }
        check(
            "matmul_glu",
            x.len >= rows_x * gate.cols && out.len >= rows_x * n_ff,
            || format!("{rows_x} rows"),
        )?;
        let a = match act {
            Activation::SwiGlu => 0i32,
            Activation::GeGlu => 1,
        };
        let module = &gate.names.module;
        let int8 = self.int8_block(gate);
        let grid = (n_ff.div_ceil(4) as u32, 1, 1);
        let mut t = 0;
        while t < rows_x {
            let nt = (rows_x - t).min(MMV_TOKENS);
            let xo = x.ptr() + (t * gate.cols * 4) as u64;
            let oo = out.ptr() + (t * n_ff * 4) as u64;
            let name = mmv_name(&gate.names.glu, nt, 2 * gate.rows * gate.row_bytes);
            match int8 {
                Some(block) => {
                    let (q, d, bs) = self.quantize_act(xo, nt, gate.cols, block, gate.ty)?;
                    self.launch(
                        module,
                        name,
                        grid,
                        (32, 4, 1),
                        args![
                            gate.data.ptr,
                            up.data.ptr,
                            gate.row_bytes as i64,
                            q,
                            d,
                            bs,
                            oo,
                            n_ff as i32,
                            gate.cols as i32,
                            nt as i32,
                            a
                        ],
                    )?;
                }
                None => self.launch(
                    module,
                    name,
                    grid,
                    (32, 4, 1),
                    args![
                        gate.data.ptr,
                        up.data.ptr,
                        gate.row_bytes as i64,
                        xo,
                        oo,
                        n_ff as i32,
                        gate.cols as i32,
                        nt as i32,
                        a
                    ],
                )?,
            }
            t += nt;
        }
        Ok(())
    }

    fn matmul_logits(&self, w: &CudaWeight, x: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        let n = self.logit_rows;
        check("matmul_logits", out.len >= n * w.rows, || {
            format!("out {} for {n}×{}", out.len, w.rows)
        })?;
        if n == 0 {
            return Ok(());
        }
        if self.logits_identity {
            return self.mm(w, x.ptr(), n, out.ptr());
        }
        let g = self.scratch_ptr(|s| &mut s.gather, n * w.cols * 4, "logits rows")?;
        self.launch(
            "ops",
            "gather_rows",
            (n as u32, 1, 1),
            (256, 1, 1),
            args![x.ptr(), self.view.logit_rows, g, w.cols as i32],
        )?;
        self.mm(w, g, n, out.ptr())
    }

    fn rope_kv_write(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        rope: &RopeParams,
        a: &AttnParams,
        kv: &mut CudaKv,
    ) -> Result<()> {
        let n = self.rows;
        let kv_dim = a.n_head_kv * a.head_dim;
        check("rope_kv_write", kv_dim == kv.kv_dim, || {
            format!("kv_dim {kv_dim} vs cache {}", kv.kv_dim)
        })?;
        check(
            "rope_kv_write",
            q.len >= n * a.n_head * a.head_dim && k.len >= n * kv_dim && v.len >= n * kv_dim,
            || "buffers too small".into(),
        )?;
        check(
            "rope_kv_write",
            rope.n_dims <= a.head_dim && rope.n_dims.is_multiple_of(2),
            || format!("{} rotated dims of {}", rope.n_dims, a.head_dim),
        )?;
        if self.cfg.exact {
            return self.x_rope_kv_write(q, k, v, rope, a, kv);
        }
        let th = self.theta_ptr(rope)?;
        let mode = i32::from(rope.mode == RopeMode::Neox);
        self.launch(
            "ops",
            "rope_kv_write",
            (n.max(1) as u32, (a.n_head + a.n_head_kv) as u32, 1),
            (64, 1, 1),
            args![
                q.ptr(),
                k.ptr(),
                v.ptr(),
                kv.k.ptr,
                kv.v.ptr,
                self.view.pos,
                self.view.slot,
                th,
                a.n_head as i32,
                a.n_head_kv as i32,
                a.head_dim as i32,
                rope.n_dims as i32,
                mode
            ],
        )
    }

    fn attention(&self, q: &CudaBuf, kv: &CudaKv, a: &AttnParams, out: &mut CudaBuf) -> Result<()> {
        let n = self.rows;
        let hd = a.head_dim;
        check("attention", matches!(hd, 64 | 128 | 256), || {
            format!("head dim {hd} (64, 128 and 256 are built)")
        })?;
        check(
            "attention",
            a.n_head.is_multiple_of(a.n_head_kv.max(1)) && a.n_head_kv * hd == kv.kv_dim,
            || "head counts".into(),
        )?;
        check(
            "attention",
            q.len >= n * a.n_head * hd && out.len >= n * a.n_head * hd,
            || "buffers too small".into(),
        )?;
        if n == 0 {
            return Ok(());
        }
        if self.cfg.exact {
            return self.x_attention(q, kv, a, out);
        }
        if self.n_tiles > 0 && (hd != 256 || self.cfg.flash_256) {
            let tiles = self.tile_buf.as_ref().unwrap().ptr;
            let (window, softcap) = (
                a.window.map(|w| w as i32).unwrap_or(0),
                a.softcap.unwrap_or(0.0),
            );
            // Head dim 256 runs 32 query rows per block: two blocks per 64-token tile.
            let (name, parts) = match hd {
                64 => ("flash_attention_64", 1),
                128 => ("flash_attention_128", 1),
                _ => ("flash_attention_256", 2),
            };
            return self.launch(
                "attn",
                name,
                (self.n_tiles as u32, a.n_head as u32, parts),
                (128, 1, 1),
                args![
                    q.ptr(),
                    kv.k.ptr,
                    kv.v.ptr,
                    out.ptr(),
                    tiles,
                    self.view,
                    a.n_head as i32,
                    a.n_head_kv as i32,
                    a.scale,
                    window,
                    softcap
                ],
            );
        }
        let ns = self.n_split(n, a.n_head, kv.n_slots);
        let part = if ns > 1 {
            self.scratch_ptr(
                |s| &mut s.part,
                n * a.n_head * ns * (hd + 2) * 4,
                "attention partials",
            )?
        } else {
            0
        };
        let window = a.window.map(|w| w as i32).unwrap_or(0);
        let softcap = a.softcap.unwrap_or(0.0);
        self.launch(
            "attn",
            match hd {
                64 => "attention_64",
                128 => "attention_128",
                _ => "attention_256",
            },
            (ns as u32, a.n_head as u32, n as u32),
            (32, 4, 1),
            args![
                q.ptr(),
                kv.k.ptr,
                kv.v.ptr,
                out.ptr(),
                part,
                self.view,
                a.n_head as i32,
                a.n_head_kv as i32,
                a.scale,
                window,
                softcap
            ],
        )?;
        if ns > 1 {
            self.launch(
                "attn",
                match hd {
                    64 => "attn_merge_64",
                    128 => "attn_merge_128",
                    _ => "attn_merge_256",
                },
                (a.n_head as u32, n as u32, 1),
                (hd as u32, 1, 1),
                args![part, out.ptr(), a.n_head as i32, ns as i32],
            )?;
        }
        Ok(())
    }

    fn glu(
        &self,
        act: Activation,
        gate: &CudaBuf,
        up: &CudaBuf,
        n: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        check("glu", gate.len >= n && up.len >= n && out.len >= n, || {
            format!("{n} elements")
        })?;
        if self.cfg.exact {
            return self.x_glu(act, gate, up, n, out);
        }
        let a = match act {
            Activation::SwiGlu => 0i32,
            Activation::GeGlu => 1,
        };
        self.launch(
            "ops",
            "glu",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![gate.ptr(), up.ptr(), out.ptr(), n as i64, a],
        )
    }

    fn softcap(&self, x: &mut CudaBuf, cap: f32, n: usize) -> Result<()> {
        check("softcap", x.len >= n, || format!("{n} > {}", x.len))?;
        self.launch(
            "ops",
            "softcap",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![x.ptr(), n as i64, cap],
        )
    }

    fn read(&self, x: &CudaBuf, n: usize, out: &mut Vec<f32>) -> Result<()> {
        check("read", n <= x.len, || format!("{n} > {}", x.len))?;
        out.resize(n, 0.0);
        self.dev.dtoh(out, x.ptr()).map_err(|e| {
            BackendError::Device(format!(
                "{e} (a kernel of this step failed; QUIVER_CUDA_SYNC=1 names it)"
            ))
        })
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let g = self.graphs.stats;
        let (compiled, cached) = self.kernel_counts();
        vec![
            ("graph_captures", g.captures),
            ("graph_failed_captures", g.failed_captures),
            ("graph_replays", g.replays),
            ("eager_steps", g.eager),
            ("kernels_compiled", compiled as u64),
            ("kernels_from_cache", cached as u64),
        ]
    }

    fn top_k(
        &self,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        k: usize,
        out: &mut Vec<(u32, f32)>,
    ) -> Result<()> {
        check("top_k", rows * cols <= x.len && k >= 1, || {
            format!("{rows}×{cols} > {} or k = {k}", x.len)
        })?;
        let n = rows * k;
        let ids = self.scratch_ptr(|s| &mut s.top_ids, n * 4, "top-k ids")?;
        let vals = self.scratch_ptr(|s| &mut s.top_vals, n * 4, "top-k values")?;
        self.launch(
            "ops",
            "topk_rows",
            (rows as u32, 1, 1),
            (1024, 1, 1),
            args![x.ptr(), ids, vals, cols as i32, k as i32],
        )?;
        let mut st = self.top_host.lock().unwrap();
        let (hi, hv) = &mut *st;
        hi.resize(n, 0);
        hv.resize(n, 0.0);
        self.dev.dtoh(hi, ids).map_err(BackendError::Device)?;
        self.dev.dtoh(hv, vals).map_err(BackendError::Device)?;
        out.clear();
        out.extend(hi.iter().copied().zip(hv.iter().copied()));
        Ok(())
    }

    fn argmax(&self, x: &CudaBuf, rows: usize, cols: usize, out: &mut Vec<u32>) -> Result<()> {
        check("argmax", rows * cols <= x.len, || {
            format!("{rows}×{cols} > {}", x.len)
        })?;
        let ids = self.scratch_ptr(|s| &mut s.ids, rows.max(1) * 4, "argmax ids")?;
        self.launch(
            "ops",
            "argmax_rows",
            (rows as u32, 1, 1),
            (1024, 1, 1),
            args![x.ptr(), ids, cols as i32],
        )?;
        out.resize(rows, 0);
        self.dev.dtoh(out, ids).map_err(BackendError::Device)
    }
}

/// The row count a step runs from a graph with, if it can: decode-shaped steps (every token
/// wants logits) pad to the next power of two up to `MAX_GRAPH_TOKENS`, within the state's
/// buffers.
pub(crate) fn graph_bucket(
    n: usize,
    n_logits: usize,
    max_tokens: usize,
    max_logits: usize,
) -> Option<usize> {
    let b = n.next_power_of_two();
    (n > 0 && n_logits == n && b <= MAX_GRAPH_TOKENS && b <= max_tokens && b <= max_logits)
        .then_some(b)
}

/// Threads of the one block per row of the norm kernel: one float4 per thread up to 256
/// threads (a row of 4096 is four loads per thread).
pub(crate) fn norm_threads(cols: usize) -> u32 {
    (cols / 4).div_ceil(32).clamp(1, 8) as u32 * 32
}

/// How many key ranges the split-K attention kernel cuts each (token, head) into: enough
/// blocks of 4 warps for about 16 per multiprocessor (each warp walks its keys one at a time, so
/// short walks on many warps hide the memory latency), each range at least 32 keys of the
/// `n_slots` the cache holds. Fixed by the shapes alone, so a captured graph stays valid.
pub(crate) fn attention_splits(blocks: usize, sms: usize, n_slots: usize) -> usize {
    let target = 16 * sms;
    target
        .div_ceil(blocks.max(1))
        .clamp(1, n_slots.div_ceil(32).clamp(1, 64))
}

/// The flash kernel's query tiles: up to 64 consecutive tokens of one sequence each,
/// `{sequence, first token, tokens, 0}`. False (and no tiles) when a sequence's positions are
/// not consecutive, which the kernel assumes.
pub(crate) fn query_tiles(batch: &Batch, tiles: &mut Vec<[i32; 4]>) -> bool {
    tiles.clear();
    for (si, sp) in batch.seqs.iter().enumerate() {
        let pos = &batch.positions[sp.start..sp.start + sp.len];
        if pos
            .iter()
            .enumerate()
            .any(|(i, &p)| p as usize != pos[0] as usize + i)
        {
            tiles.clear();
            return false;
        }
        for c in (0..sp.len).step_by(64) {
            tiles.push([
                si as i32,
                (sp.start + c) as i32,
                (sp.len - c).min(64) as i32,
                0,
            ]);
        }
    }
    true
}

/// The kernel-name suffix of a weight type with CUDA kernels.
pub fn kernel_suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use quiver_backend::SeqSpan;

    #[test]
    fn kernel_arguments_pack_each_value_at_its_pointer() {
        let view = BatchView {
            tokens: 1,
            pos: 2,
            slot: 3,
            seq: 4,
            logit_rows: 5,
            kv_len: 6,
            bt_off: 7,
            block_tables: 8,
            block_size: 16,
        };
        let m = MmvMat {
            w: 11,
            y: 12,
            row_bytes: 13,
            rows: 14,
        };
        let mut a = args![0xdead_beef_u64, -3i32, 1.5f32, view, m, 7i64];
        let (p, n) = a.ptrs();
        assert_eq!(n, 6);
        // SAFETY: each pointer points at the value pushed in that position, alive in `a`.
        unsafe {
            assert_eq!(*(p[0] as *const u64), 0xdead_beef);
            assert_eq!(*(p[1] as *const i32), -3);
            assert_eq!(*(p[2] as *const f32), 1.5);
            let v = &*(p[3] as *const BatchView);
            assert_eq!((v.tokens, v.block_tables, v.block_size), (1, 8, 16));
            let mm = &*(p[4] as *const MmvMat);
            assert_eq!((mm.w, mm.y, mm.row_bytes, mm.rows), (11, 12, 13, 14));
            assert_eq!(*(p[5] as *const i64), 7);
            // 8-byte aligned, as CUDA expects pointers and 64-bit values.
            assert!(p[..n].iter().all(|q| (*q as usize).is_multiple_of(8)));
        }
    }

    #[test]
    fn decode_steps_pad_to_graph_buckets_within_the_buffers() {
        assert_eq!(graph_bucket(1, 1, 512, 1), Some(1));
        assert_eq!(graph_bucket(3, 3, 512, 8), Some(4));
        assert_eq!(
            graph_bucket(3, 3, 512, 3),
            None,
            "the padded logits would not fit"
        );
        assert_eq!(
            graph_bucket(5, 5, 6, 8),
            None,
            "the padded tokens would not fit"
        );
        assert_eq!(graph_bucket(64, 64, 512, 64), Some(64));
        assert_eq!(graph_bucket(65, 65, 512, 128), None);
        assert_eq!(graph_bucket(12, 1, 512, 16), None, "a prefill chunk");
        assert_eq!(graph_bucket(0, 0, 512, 16), None);
    }

    #[test]
    fn norm_blocks_take_one_float4_per_thread_up_to_256_threads() {
        assert_eq!(norm_threads(4096), 256);
        assert_eq!(norm_threads(640), 160);
        assert_eq!(norm_threads(256), 64);
        assert_eq!(norm_threads(64), 32);
        assert_eq!(norm_threads(4), 32);
    }

    #[test]
    fn attention_splits_fill_the_device_and_keep_ranges_of_32_keys() {
        // One token, 32 heads on 132 SMs: 66 ranges, but no more than the cache's 32-key runs.
        assert_eq!(attention_splits(32, 132, 4096), 64);
        assert_eq!(attention_splits(32, 132, 640), 20);
        assert_eq!(attention_splits(32, 132, 16), 1);
        // 64 tokens × 32 heads nearly fill the device: two ranges; 128 tokens: one.
        assert_eq!(attention_splits(2048, 132, 4096), 2);
        assert_eq!(attention_splits(4096, 132, 4096), 1);
        assert_eq!(attention_splits(0, 132, 4096), 64);
    }

    #[test]
    fn query_tiles_cover_every_token_once_in_runs_of_64() {
        let mut b = Batch {
            block_size: 16,
            ..Default::default()
        };
        // A 150-token prefill from position 10, a 1-token decode, a 64-token chunk.
        for (len, p0) in [(150usize, 10u32), (1, 70), (64, 0)] {
            let start = b.tokens.len();
            let si = b.seqs.len() as u32;
            b.seqs.push(SeqSpan {
                start,
                len,
                kv_len: p0 as usize + len,
                block_table: vec![],
            });
            for i in 0..len {
                b.tokens.push(0);
                b.positions.push(p0 + i as u32);
                b.seq_of.push(si);
            }
        }
        let mut t = Vec::new();
        assert!(query_tiles(&b, &mut t));
        assert_eq!(
            t,
            vec![
                [0, 0, 64, 0],
                [0, 64, 64, 0],
                [0, 128, 22, 0],
                [1, 150, 1, 0],
                [2, 151, 64, 0]
            ]
        );
        let mut covered = vec![0; b.tokens.len()];
        for [_, first, n, _] in &t {
            for c in &mut covered[*first as usize..(*first + *n) as usize] {
                *c += 1;
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
        b.positions[3] = 99;
        assert!(
            !query_tiles(&b, &mut t) && t.is_empty(),
            "non-consecutive positions fall back"
        );
    }
}
