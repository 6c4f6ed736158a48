//! The device: context, stream, raw allocations, copies, and cuBLAS.

use cudarc::cublas::{result as br, sys as bs};
use cudarc::driver::{result as dr, sys as ds};

/// What a usable CUDA device is.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability as major·10 + minor (90 on Hopper).
    pub arch: u32,
    pub sms: u32,
    pub total_mem: u64,
    pub driver_version: i32,
}

fn driver_err(what: &str, e: dr::DriverError) -> String {
    format!("{what}: {e:?}")
}

/// Checks for a usable GPU without panicking: the driver library, a device `ordinal`, and
/// NVRTC to compile kernels. Err says why not, in one line.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, String> {
    crate::libs::driver()?;
    // SAFETY: the library is loaded, so cudarc's lookup by name succeeds.
    if !unsafe { ds::is_culib_present() } {
        return Err("the CUDA driver library could not be loaded".into());
    }
    dr::init().map_err(|e| {
        driver_err(
            "the CUDA driver failed to start (no GPU, or a driver problem)",
            e,
        )
    })?;
    let mut ver = 0;
    // SAFETY: out-parameter.
    unsafe { ds::cuDriverGetVersion(&mut ver) }
        .result()
        .map_err(|e| driver_err("cuDriverGetVersion", e))?;
    if ver < 12000 {
        return Err(format!(
            "the NVIDIA driver supports CUDA {}.{}; quiver needs a driver for CUDA 12.0 or newer",
            ver / 1000,
            ver % 1000 / 10
        ));
    }
    let count = dr::device::get_count().map_err(|e| driver_err("counting CUDA devices", e))?;
    if count == 0 {
        return Err("the NVIDIA driver reports no CUDA device".into());
    }
    if ordinal >= count as usize {
        return Err(format!(
            "CUDA device {ordinal} does not exist ({count} present: 0..{})",
            count - 1
        ));
    }
    let d = dr::device::get(ordinal as i32).map_err(|e| driver_err("cuDeviceGet", e))?;
    use ds::CUdevice_attribute as A;
    // SAFETY: d is a valid device.
    let attr = |a| unsafe { dr::device::get_attribute(d, a) }.unwrap_or(0);
    let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    if major < 7 {
        return Err(format!("CUDA device {ordinal} has compute capability {major}.{minor}; quiver needs 7.0 or newer"));
    }
    let name = dr::device::get_name(d).unwrap_or_else(|_| "unknown GPU".into());
    // SAFETY: as above.
    let total_mem = unsafe { dr::device::total_mem(d) }.unwrap_or(0) as u64;
    crate::libs::nvrtc()?;
    Ok(DeviceInfo {
        ordinal,
        name,
        arch: (major * 10 + minor) as u32,
        sms: sms as u32,
        total_mem,
        driver_version: ver,
    })
}

/// A raw device allocation, freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: ptr came from malloc_sync and is freed once.
        let _ = unsafe { dr::free_sync(self.ptr) };
    }
}

pub struct Device {
    pub info: DeviceInfo,
    pub ctx: ds::CUcontext,
    pub stream: ds::CUstream,
    dev: ds::CUdevice,
}
// SAFETY: the context is made current on whichever thread uses it (`bind`); the stream is used
// by one thread at a time (the backend is not Sync across ops that launch).
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    pub fn open(ordinal: usize) -> Result<Device, String> {
        let info = probe(ordinal)?;
        let dev = dr::device::get(ordinal as i32).map_err(|e| driver_err("cuDeviceGet", e))?;
        // SAFETY: dev is valid; the primary context is released in Drop.
        let ctx = unsafe { dr::primary_ctx::retain(dev) }
            .map_err(|e| driver_err("creating the CUDA context", e))?;
        // SAFETY: ctx is live.
        unsafe { dr::ctx::set_current(ctx) }.map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let stream = dr::stream::create(dr::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_err("creating a stream", e))?;
        Ok(Device {
            info,
            ctx,
            stream,
            dev,
        })
    }

    /// Makes the context current on this thread.
    pub fn bind(&self) -> Result<(), String> {
        // SAFETY: ctx is live for self's life.
        unsafe { dr::ctx::set_current(self.ctx) }.map_err(|e| driver_err("cuCtxSetCurrent", e))
    }

    pub fn alloc(&self, bytes: usize) -> Result<DevBuf, String> {
        self.bind()?;
        // SAFETY: plain allocation.
        let ptr = unsafe { dr::malloc_sync(bytes.max(1)) }.map_err(|e| format!("{e:?}"))?;
        Ok(DevBuf { ptr, bytes })
    }

    pub fn mem_info(&self) -> (u64, u64) {
        let _ = self.bind();
        dr::mem_get_info()
            .map(|(f, t)| (f as u64, t as u64))
            .unwrap_or((0, 0))
    }

    pub fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<(), String> {
        // SAFETY: ptr..ptr+bytes is one allocation; ordered on our stream.
        unsafe { dr::memset_d8_async(ptr, 0, bytes, self.stream) }
            .map_err(|e| driver_err("cuMemsetD8Async", e))
    }

    /// Host → device, finished when this returns.
    pub fn htod_sync<T>(&self, dst: u64, src: &[T]) -> Result<(), String> {
        // SAFETY: dst holds at least size_of_val(src) bytes; we wait for the copy.
        unsafe {
            dr::memcpy_htod_async(dst, src, self.stream)
                .map_err(|e| driver_err("copying to the device", e))?;
            dr::stream::synchronize(self.stream).map_err(|e| driver_err("copying to the device", e))
        }
    }

    /// Host → device, ordered on the stream. `src` is pageable memory, which the driver stages
    /// before returning, so the caller may reuse it at once.
    pub fn htod_async<T>(&self, dst: u64, src: &[T]) -> Result<(), String> {
        // SAFETY: as above.
        unsafe { dr::memcpy_htod_async(dst, src, self.stream) }
            .map_err(|e| driver_err("copying the batch to the device", e))
    }

    /// Device → host after everything queued before it.
    pub fn dtoh<T>(&self, dst: &mut [T], src: u64) -> Result<(), String> {
        // SAFETY: src holds at least size_of_val(dst) bytes.
        unsafe {
            dr::memcpy_dtoh_async(dst, src, self.stream)
                .map_err(|e| driver_err("copying from the device", e))?;
            dr::stream::synchronize(self.stream)
                .map_err(|e| driver_err("copying from the device", e))
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: stream and context were created in open.
        unsafe {
            let _ = dr::stream::synchronize(self.stream);
            let _ = dr::stream::destroy(self.stream);
            let _ = dr::primary_ctx::release(self.dev);
        }
    }
}

/// A cuBLAS handle on the backend's stream.
pub struct Blas {
    handle: bs::cublasHandle_t,
}
// SAFETY: used from one thread at a time, with the context current.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    pub fn new(stream: ds::CUstream) -> Result<Blas, String> {
        crate::libs::cublas()?;
        // SAFETY: the library is loaded.
        if !unsafe { bs::is_culib_present() } {
            return Err("cuBLAS could not be loaded".into());
        }
        let handle = br::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
        // SAFETY: handle and stream are live.
        unsafe { br::set_stream(handle, stream as _) }
            .map_err(|e| format!("cublasSetStream: {e:?}"))?;
        Ok(Blas { handle })
    }

    /// y[n, m] (row-major, f32) = x[n, k] (f16) · W[m, k]ᵀ (f16), accumulated in f32.
    pub fn gemm_f16(
        &self,
        w: u64,
        x: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), bs::cublasStatus_t> {
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the pointers hold the stated shapes (checked by the caller).
        let st = unsafe {
            bs::cublasGemmEx(
                self.handle,
                bs::cublasOperation_t::CUBLAS_OP_T,
                bs::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                bs::cudaDataType::CUDA_R_16F,
                k as i32,
                x as *const _,
                bs::cudaDataType::CUDA_R_16F,
                k as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                bs::cudaDataType::CUDA_R_32F,
                m as i32,
                bs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if st == bs::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(st)
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in new.
        let _ = unsafe { br::destroy_handle(self.handle) };
    }
}
