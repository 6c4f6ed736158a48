//! Kernel launches: arguments packed on the stack, programmatic dependent launch, and the
//! optional synchronization after each launch that names a failing kernel.

use crate::{derr, CudaBackend};
use cudarc::driver::{result as dr, sys as ds};
use quiver_backend::{BackendError, Result};
use std::ffi::c_void;

/// Kernel arguments packed for cuLaunchKernel.
pub(crate) struct Args {
    words: [u64; ARG_WORDS],
    offs: [usize; MAX_ARGS],
    used: usize,
    n: usize,
}

/// Room for a launch's arguments, on the stack (no allocation per launch).
const ARG_WORDS: usize = 64;
const MAX_ARGS: usize = 24;

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
        // An argument type larger than the whole room is a build error, not a launch-time panic.
        const { assert!(std::mem::size_of::<T>() <= ARG_WORDS * 8) };
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

/// Packs kernel arguments: `args![ptr, n as i32, view]`.
macro_rules! args {
    ($($a:expr),* $(,)?) => {{
        let mut a = $crate::launch::Args::default();
        $(a.push($a);)*
        a
    }};
}

pub(crate) fn grid1(n: usize, block: usize, cap: usize) -> u32 {
    n.div_ceil(block).clamp(1, cap) as u32
}

impl CudaBackend {
    pub(crate) fn func(&self, module: &str, name: &str, smem: u32) -> Result<ds::CUfunction> {
        self.reg
            .lock()
            .unwrap()
            .func(module, name, smem)
            .map_err(BackendError::Device)
    }

    pub(crate) fn launch(
        &self,
        module: &str,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        a: Args,
    ) -> Result<()> {
        self.launch_smem(module, name, grid, block, 0, a)
    }

    /// [`launch`](Self::launch) with `smem` bytes of dynamic shared memory (above 48 KiB the
    /// kernel is allowed that much once, by the registry).
    pub(crate) fn launch_smem(
        &self,
        module: &str,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        mut a: Args,
    ) -> Result<()> {
        // Nothing to do (a step's rows of one kind can be none): no launch, which CUDA would
        // refuse as an invalid grid.
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let f = self.func(module, name, smem)?;
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
                sharedMemBytes: smem,
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
            unsafe { dr::launch_kernel(f, grid, block, smem, self.dev.stream, &mut p[..n]) }
                .map_err(|e| derr(format!("launching kernel {name}"), e))?;
        }
        if self.cfg.sync_each && !self.graphs.capturing() {
            // SAFETY: our stream.
            unsafe { dr::stream::synchronize(self.dev.stream) }
                .map_err(|e| derr(format!("kernel {name}"), e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::batch::BatchView;
    use crate::mmv::MmvMat;

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
            drows: 9,
            state_slot: 10,
            kept_slot: 11,
            seq_row: 12,
            seq_rows: 13,
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
            assert_eq!(
                (v.tokens, v.block_tables, v.drows, v.block_size),
                (1, 8, 9, 16)
            );
            let mm = &*(p[4] as *const MmvMat);
            assert_eq!((mm.w, mm.y, mm.row_bytes, mm.rows), (11, 12, 13, 14));
            assert_eq!(*(p[5] as *const i64), 7);
            // 8-byte aligned, as CUDA expects pointers and 64-bit values.
            assert!(p[..n].iter().all(|q| (*q as usize).is_multiple_of(8)));
        }
        // The widest launch (rope_kv_write with the q/k norms: 19 arguments) fits.
        let mut a = args![
            1u64, 2u64, 3u64, 4u64, 5u64, view, 7u64, 8u64, 9i32, 10i32, 11i32, 12i32, 13i32,
            14.0f32, 15.0f32, 16.0f32, 17u64, 18u64, 19.0f32
        ];
        assert_eq!(a.ptrs().1, 19);
    }
}
