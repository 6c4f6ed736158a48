//! NCCL, loaded at run time like the driver and NVRTC (`libs::nccl`): the one collective
//! tensor parallelism needs over several GPUs, the all-gather. A sum over the ranks is an
//! all-gather followed by a sum in rank order on each GPU (`tp_sum_ranks`, kernels/ops.cu), so
//! that every rank gets `((x_0 + x_1) + x_2) + …`, the bits of [`quiver_backend::LocalComm`]
//! whatever NCCL's algorithm: for two ranks it moves as many bytes as NCCL's own all-reduce.

use quiver_backend::Shard;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

type Result<T> = std::result::Result<T, String>;

/// `ncclUniqueId`: what every rank of a group is started from (made once, by any rank).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId([u8; 128]);

type CommPtr = *mut c_void;
/// `ncclFloat32`.
const NCCL_FLOAT32: c_int = 7;

struct Lib {
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut CommPtr, c_int, UniqueId, c_int) -> c_int,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        CommPtr,
        *mut c_void,
    ) -> c_int,
    comm_destroy: unsafe extern "C" fn(CommPtr) -> c_int,
    comm_abort: unsafe extern "C" fn(CommPtr) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
}

fn lib() -> Result<&'static Lib> {
    static LIB: OnceLock<Result<Lib>> = OnceLock::new();
    LIB.get_or_init(|| {
        let path = crate::libs::nccl()?;
        // SAFETY: NCCL is loaded already (libs::nccl keeps it); loading it again by the same
        // path returns that copy, kept for the life of the process below.
        let l = unsafe { libloading::Library::new(path) }.map_err(|e| format!("NCCL: {e}"))?;
        // SAFETY: the symbols' types are NCCL's C API (nccl.h, 2.x).
        let lib = unsafe {
            macro_rules! sym {
                ($n:literal) => {
                    *l.get($n).map_err(|e| format!("NCCL: {e}"))?
                };
            }
            Lib {
                get_unique_id: sym!(b"ncclGetUniqueId"),
                comm_init_rank: sym!(b"ncclCommInitRank"),
                all_gather: sym!(b"ncclAllGather"),
                comm_destroy: sym!(b"ncclCommDestroy"),
                comm_abort: sym!(b"ncclCommAbort"),
                error_string: sym!(b"ncclGetErrorString"),
            }
        };
        std::mem::forget(l);
        Ok(lib)
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn check(l: &Lib, what: &str, r: c_int) -> Result<()> {
    if r == 0 {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string for any result code.
    let msg = unsafe { CStr::from_ptr((l.error_string)(r)) };
    Err(format!("NCCL {what}: {} ({r})", msg.to_string_lossy()))
}

/// A new group's id, for [`NcclRank::init`] on every rank.
pub fn unique_id() -> Result<UniqueId> {
    let l = lib()?;
    let mut id = UniqueId([0; 128]);
    // SAFETY: id is a valid ncclUniqueId to write.
    check(l, "ncclGetUniqueId", unsafe { (l.get_unique_id)(&mut id) })?;
    Ok(id)
}

/// One rank's NCCL communicator.
pub struct NcclRank {
    comm: CommPtr,
    shard: Shard,
    /// Aborted ([`NcclRank::abort`]): the communicator is gone.
    aborted: AtomicBool,
}

// SAFETY: the communicator is used by its backend's thread, one call at a time (the backend is
// not Sync across launching ops); NCCL allows a communicator to move between threads.
unsafe impl Send for NcclRank {}
unsafe impl Sync for NcclRank {}

impl NcclRank {
    /// Rank `shard.rank` of the group `id`: collective, so every rank calls it at once, each
    /// on its own thread with its GPU's context current.
    pub fn init(id: UniqueId, shard: Shard) -> Result<NcclRank> {
        let l = lib()?;
        let mut comm: CommPtr = std::ptr::null_mut();
        // SAFETY: comm is written by NCCL; id came from ncclGetUniqueId.
        let r =
            unsafe { (l.comm_init_rank)(&mut comm, shard.size as c_int, id, shard.rank as c_int) };
        check(l, "ncclCommInitRank", r)?;
        Ok(NcclRank {
            comm,
            shard,
            aborted: AtomicBool::new(false),
        })
    }

    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// dst ← every rank's n floats at src, rank after rank, on `stream` (dst holds size · n).
    pub fn all_gather(&self, src: u64, dst: u64, n: usize, stream: *mut c_void) -> Result<()> {
        let l = lib()?;
        if self.aborted.load(Ordering::Acquire) {
            return Err("NCCL: this rank left its group after an error".into());
        }
        // SAFETY: src holds n floats and dst size · n on this rank's device; the stream is the
        // backend's.
        let r = unsafe {
            (l.all_gather)(
                src as *const c_void,
                dst as *mut c_void,
                n,
                NCCL_FLOAT32,
                self.comm,
                stream,
            )
        };
        check(l, "ncclAllGather", r)
    }

    /// Stops the communicator's work in progress: the other ranks' collectives fail.
    pub fn abort(&self) {
        if self.aborted.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Ok(l) = lib() {
            // SAFETY: a live communicator; NCCL allows abort while operations are pending.
            let _ = unsafe { (l.comm_abort)(self.comm) };
        }
    }
}

impl Drop for NcclRank {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::Acquire) {
            return;
        }
        if let Ok(l) = lib() {
            // SAFETY: a live communicator, destroyed once.
            let _ = unsafe { (l.comm_destroy)(self.comm) };
        }
    }
}
