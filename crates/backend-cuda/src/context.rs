//! The backend's context: the device and its stream, the kernel registry, cuBLAS, the
//! configuration in effect, and the state the ops share (the step's batch, scratch, graphs).

use crate::batch::StepState;
use crate::config::CudaConfig;
use crate::dev::{self, DevBuf, Device, DeviceInfo};
use crate::graph::{self, GraphStats};
use crate::memory::MemStats;
use crate::norm::{ActForm, NormOut};
use crate::registry;
use crate::scratch::Scratch;
use quiver_backend::{BackendError, Numerics, Result};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

/// One CUDA device's context running one model's ops (`Backend`, src/backend.rs).
pub struct CudaBackend {
    pub(crate) dev: Device,
    pub(crate) reg: Mutex<registry::Registry>,
    pub(crate) blas: Option<dev::Blas>,
    /// The configuration in effect (`CudaConfig::resolve`).
    pub(crate) cfg: CudaConfig,
    /// The current step's batch on the device and its shape.
    pub(crate) step: StepState,
    /// Host staging of `top_k` (reused: no allocation per step).
    pub(crate) top_host: Mutex<(Vec<u32>, Vec<f32>)>,
    pub(crate) scratch: Mutex<Scratch>,
    pub(crate) mem: Mutex<MemStats>,
    pub(crate) graphs: graph::Graphs,
    /// Bumped whenever a buffer the graphs use moves (part of every graph key).
    pub(crate) generation: AtomicU64,
    /// The load progress bar: (bar, bytes done, bytes in all).
    pub(crate) load_progress: Mutex<Option<(quiver_hub::Progress, u64, u64)>>,
    /// Kernels launched (and cuBLAS calls made) so far: what ran between two points.
    pub(crate) launches: AtomicU64,
    /// The last norm launched (src/norm.rs).
    pub(crate) norm_out: Mutex<Option<NormOut>>,
    /// The int8 copy the product after a norm reads, by the norm's weight and row count.
    pub(crate) norm_forms: Mutex<HashMap<(u64, usize), ActForm>>,
    /// The other ranks of a tensor-parallel group (src/tp.rs), and the host staging of the
    /// exchanges through the host (x's values, the ranks' gathered values).
    pub(crate) link: Option<crate::tp::Link>,
    pub(crate) tp_host: Mutex<(Vec<f32>, Vec<f32>)>,
}

impl CudaBackend {
    /// Opens CUDA device `ordinal`, creates its stream, loads cuBLAS if present, and compiles
    /// (or reads from the cache) the kernels every model needs, for `config` (usually
    /// `CudaConfig::from_env(numerics)`, adjusted).
    pub fn new(ordinal: usize, config: CudaConfig) -> Result<Self> {
        if config.numerics == Numerics::Parity {
            return Err(BackendError::Device(
                "the parity numerics run on ParityBackend, not CudaBackend".into(),
            ));
        }
        Self::open(ordinal, config)
    }

    /// [`new`](Self::new) for any numerics (the parity backend's context too).
    pub(crate) fn open(ordinal: usize, config: CudaConfig) -> Result<Self> {
        let dev = Device::open(ordinal).map_err(BackendError::Device)?;
        let mut reg = registry::Registry::new(dev.info.arch);
        reg.ensure("ops").map_err(BackendError::Device)?;
        if config.numerics == Numerics::Parity {
            reg.ensure("exact").map_err(BackendError::Device)?;
        }
        let blas = dev::Blas::new(dev.stream).ok();
        let cfg = config.resolve(dev.info.arch);
        let load_progress = cfg
            .load_total
            .map(|total| (quiver_hub::Progress::bytes(total), 0, total));
        Ok(CudaBackend {
            dev,
            reg: Mutex::new(reg),
            blas,
            graphs: graph::Graphs::new(cfg.graphs),
            cfg,
            step: StepState::default(),
            top_host: Mutex::new((Vec::new(), Vec::new())),
            scratch: Mutex::new(Scratch::default()),
            mem: Mutex::new(MemStats::default()),
            generation: AtomicU64::default(),
            load_progress: Mutex::new(load_progress),
            launches: AtomicU64::default(),
            norm_out: Mutex::new(None),
            norm_forms: Mutex::new(HashMap::new()),
            link: None,
            tp_host: Mutex::new((Vec::new(), Vec::new())),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.dev.info
    }

    /// The configuration in effect: what `new` was given, less what the machine lacks.
    pub fn config(&self) -> &CudaConfig {
        &self.cfg
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

    /// Kernels launched (and cuBLAS calls made) on this context so far.
    pub fn launch_count(&self) -> u64 {
        self.launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// The family the kernel table gives a product of `ty` weights of `cols` columns over `n`
    /// decode rows (None: a type without CUDA kernels).
    pub fn product_family(
        &self,
        ty: quiver_gguf::GgmlType,
        cols: usize,
        n: usize,
    ) -> Option<crate::plan::Product> {
        let kernel = crate::kernel_suffix(ty)?;
        Some(
            self.product_row(kernel, ty, cols)
                .get(crate::kinds::Kind::Decode, n),
        )
    }

    /// The kernel table of a model whose products have weights of these (type, columns) and
    /// attention these head dims, on this device.
    pub fn kernel_table(
        &self,
        weights: &[(quiver_gguf::GgmlType, usize)],
        head_dims: &[usize],
    ) -> crate::plan::Table {
        crate::plan::table(
            self.cfg.numerics,
            self.dev.info.arch,
            self.blas.is_some(),
            weights,
            head_dims,
        )
    }

    pub(crate) fn alloc(&self, bytes: usize, what: &str) -> Result<DevBuf> {
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

    /// Marks every captured graph stale (a buffer they use moved).
    pub(crate) fn bump_generation(&self) {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}
