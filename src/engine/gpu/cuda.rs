//! [`Gpu`] on an NVIDIA GPU: the CUDA driver API through cudarc (stream-ordered allocation from
//! the device's memory pool, one stream), cuBLAS for the products, and `kernels.cu` compiled to
//! PTX by build.rs.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{CudaContext, CudaStream, result as drv, sys};

use super::device::{Arg, Dt, Gemm, Gpu, GpuError, Memory, size_class};

/// kernels.cu as PTX (build.rs; `CUDA_COMPUTE_CAP`, default 80: runs on Ampere and later).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rtune_kernels.ptx"));

pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: blas_sys::cublasHandle_t,
    /// cuBLAS's workspace (allocated once: no allocation inside a product).
    workspace: u64,
    module: sys::CUmodule,
    functions: RefCell<HashMap<String, sys::CUfunction>>,
    pool: sys::CUmemoryPool,
    name: String,
    tf32: bool,
    /// Freed blocks by size class, reused before asking the driver (a step allocates the same
    /// sizes every time: this turns ~half of its driver calls into a hash lookup).
    cache: RefCell<HashMap<usize, Vec<u64>>>,
    /// Size class of every live block; bytes held by live blocks, and their high-water mark.
    sizes: RefCell<HashMap<u64, usize>>,
    live: std::cell::Cell<u64>,
    peak: std::cell::Cell<u64>,
}

/// cuBLAS's recommended workspace on Hopper.
const CUBLAS_WORKSPACE: usize = 32 << 20;

fn derr(context: &str) -> impl FnOnce(drv::DriverError) -> GpuError + '_ {
    move |e| match e.0 {
        // The display driver's watchdog stopped a kernel (a GPU that also drives a screen).
        sys::cudaError_enum::CUDA_ERROR_LAUNCH_TIMEOUT => GpuError::Lost(format!("{context}: {e}")),
        _ => GpuError::Device(format!("{context}: {e}")),
    }
}

impl CudaGpu {
    /// Open device `ordinal`; `tf32` lets f32 products use TF32 tensor cores.
    pub fn new(ordinal: usize, tf32: bool) -> Result<CudaGpu, GpuError> {
        let ctx = CudaContext::new(ordinal).map_err(derr("cannot open the CUDA device"))?;
        ctx.bind_to_thread().map_err(derr("cannot use the CUDA device"))?;
        let stream = ctx.new_stream().map_err(derr("cannot create a CUDA stream"))?;
        let blas = blas::create_handle().map_err(|e| GpuError::Device(format!("cannot start cuBLAS: {e:?}")))?;
        // SAFETY: the handle was just created and the stream belongs to the bound context.
        unsafe { blas::set_stream(blas, stream.cu_stream() as _) }
            .map_err(|e| GpuError::Device(format!("cuBLAS stream: {e:?}")))?;
        let ptx = CString::new(PTX).expect("PTX has no NUL");
        // SAFETY: a NUL-terminated PTX image, loaded into the bound context.
        let module = unsafe { drv::module::load_data(ptx.as_ptr() as *const c_void) }.map_err(derr(
            "cannot load rtune's GPU kernels (is the driver older than the CUDA 13.0 toolkit they were built with?)",
        ))?;
        let mut pool = std::mem::MaybeUninit::uninit();
        // SAFETY: the device handle comes from the live context.
        unsafe { sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device()) }
            .result()
            .map_err(derr("no stream-ordered allocator"))?;
        // SAFETY: written by the call above.
        let pool = unsafe { pool.assume_init() };
        // Keep freed memory in the pool (as PyTorch's caching allocator does) instead of
        // returning it to the driver at every synchronisation.
        let mut keep = u64::MAX;
        // SAFETY: a valid pool; the attribute takes a u64.
        unsafe {
            drv::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut c_void,
            )
        }
        .map_err(derr("memory pool"))?;
        let name = format!("{} (cuda:{ordinal})", ctx.name().unwrap_or_else(|_| "CUDA device".into()));
        // SAFETY: the stream is live; the workspace is freed in `drop`.
        let workspace = unsafe { drv::malloc_async(stream.cu_stream(), CUBLAS_WORKSPACE) }
            .map_err(derr("cannot allocate cuBLAS's workspace"))?;
        // SAFETY: a live handle and a device buffer of the given size.
        unsafe { blas_sys::cublasSetWorkspace_v2(blas, workspace as *mut c_void, CUBLAS_WORKSPACE) }
            .result()
            .map_err(|e| GpuError::Device(format!("cuBLAS workspace: {e:?}")))?;
        Ok(CudaGpu {
            ctx,
            stream,
            blas,
            workspace,
            module,
            functions: RefCell::new(HashMap::new()),
            pool,
            name,
            tf32,
            cache: RefCell::new(HashMap::new()),
            sizes: RefCell::new(HashMap::new()),
            live: std::cell::Cell::new(0),
            peak: std::cell::Cell::new(0),
        })
    }

    fn function(&self, name: &str) -> Result<sys::CUfunction, GpuError> {
        if let Some(f) = self.functions.borrow().get(name) {
            return Ok(*f);
        }
        let c = CString::new(name).expect("kernel names have no NUL");
        // SAFETY: the module is loaded for the life of `self`.
        let f = unsafe { drv::module::get_function(self.module, c) }
            .map_err(|e| GpuError::Device(format!("kernel `{name}`: {e}")))?;
        self.functions.borrow_mut().insert(name.to_string(), f);
        Ok(f)
    }

    fn pool_attr(&self, attr: sys::CUmemPool_attribute) -> u64 {
        let mut v = 0u64;
        // SAFETY: a valid pool; these attributes are u64s.
        let _ = unsafe { drv::mem_pool::get_attribute(self.pool, attr, &mut v as *mut u64 as *mut c_void) };
        v
    }

    /// Give every cached block and the pool's unused memory back to the driver (before retrying
    /// an allocation that ran out of memory).
    fn release_cache(&self) {
        for (_, ptrs) in self.cache.borrow_mut().drain() {
            for p in ptrs {
                // SAFETY: cached blocks are unused; freed in stream order.
                let _ = unsafe { drv::free_async(p, self.stream.cu_stream()) };
            }
        }
        let _ = self.stream.synchronize();
        // SAFETY: a valid pool; trimming only releases memory no allocation holds.
        let _ = unsafe { sys::cuMemPoolTrimTo(self.pool, 0) }.result();
    }

    /// Make this device's context current on the calling thread: with several GPUs in one
    /// process (data parallel) the driver calls below act on whichever context is current.
    /// Cheap when it already is (one query).
    fn bind(&self) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(derr("cannot use the CUDA device"))
    }

    fn driver_alloc(&self, bytes: usize) -> Result<u64, drv::DriverError> {
        // SAFETY: the stream is live; the memory is freed on the same stream.
        unsafe { drv::malloc_async(self.stream.cu_stream(), bytes) }
    }
}

fn cuda_dtype(dt: Dt) -> blas_sys::cudaDataType {
    match dt {
        Dt::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        Dt::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
        Dt::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        Dt::U32 | Dt::I32 => unreachable!("products take float types"),
    }
}

impl Gpu for CudaGpu {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn products_account(&self, dt: Dt) -> String {
        let tf32 = if dt == Dt::F32 && self.tf32 { " with TF32" } else { "" };
        format!("products through cuBLAS{tf32}")
    }

    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        self.bind()?;
        let class = size_class(bytes);
        let cached = self.cache.borrow_mut().get_mut(&class).and_then(Vec::pop);
        let ptr = match cached {
            Some(p) => p,
            None => match self.driver_alloc(class) {
                Ok(p) => p,
                Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
                    self.release_cache();
                    self.driver_alloc(class).map_err(|_| {
                        let (free, total) = drv::mem_get_info().unwrap_or((0, 0));
                        GpuError::OutOfMemory { requested: bytes as u64, free: free as u64, total: total as u64 }
                    })?
                }
                Err(e) => return Err(GpuError::Device(format!("allocation of {bytes} bytes: {e}"))),
            },
        };
        self.sizes.borrow_mut().insert(ptr, class);
        self.live.set(self.live.get() + class as u64);
        self.peak.set(self.peak.get().max(self.live.get()));
        Ok(ptr)
    }

    fn free(&self, ptr: u64) {
        if let Some(class) = self.sizes.borrow_mut().remove(&ptr) {
            self.live.set(self.live.get() - class as u64);
            // Reused in stream order: the next user's work is queued after this block's last use.
            self.cache.borrow_mut().entry(class).or_default().push(ptr);
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: `dst` holds at least `src.len()` bytes; a pageable source is staged before the
        // call returns.
        unsafe { drv::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(derr("copy to the GPU"))
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: `src` holds at least `dst.len()` bytes; the stream is synchronised before `dst`
        // is read.
        unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.map_err(derr("copy from the GPU"))?;
        self.synchronize()
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: both ranges are live device allocations of at least `bytes`.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(derr("copy on the GPU"))
    }

    fn zero(&self, dst: u64, bytes: usize) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: `dst` holds at least `bytes`.
        unsafe { drv::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }.map_err(derr("clear GPU memory"))
    }

    fn launch(&self, kernel: &str, grid: [u32; 3], block: u32, args: &[Arg]) -> Result<(), GpuError> {
        self.bind()?;
        let f = self.function(kernel)?;
        let mut values: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) | Arg::U64(p) => p,
                Arg::I32(v) => v as u32 as u64,
                Arg::U32(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        // Each parameter is read at its own size from the start of its slot (little-endian).
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        // SAFETY: the parameters match the kernel's signature (ops.rs), each pointing at a value
        // that lives until the call returns.
        unsafe {
            drv::launch_kernel(f, (grid[0], grid[1], grid[2]), (block, 1, 1), 0, self.stream.cu_stream(), &mut params)
        }
        .map_err(|e| GpuError::Device(format!("kernel `{kernel}`: {e}")))
    }

    fn gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        self.bind()?;
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands.
        let op = |t: bool| {
            if t { blas_sys::cublasOperation_t::CUBLAS_OP_T } else { blas_sys::cublasOperation_t::CUBLAS_OP_N }
        };
        let compute = if g.ab == Dt::F32 && self.tf32 {
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let (alpha, beta) = (g.alpha, g.beta);
        // SAFETY: the pointers address device buffers of the sizes the shapes imply (ops.rs);
        // alpha and beta are host f32s, matching the f32 compute type.
        unsafe {
            blas::gemm_ex(
                self.blas,
                op(g.b_trans),
                op(g.a_trans),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                &alpha as *const f32 as *const c_void,
                g.b as *const c_void,
                cuda_dtype(g.ab),
                g.ldb as i32,
                g.a as *const c_void,
                cuda_dtype(g.ab),
                g.lda as i32,
                &beta as *const f32 as *const c_void,
                g.c as *mut c_void,
                cuda_dtype(g.c_dt),
                g.ldc as i32,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| GpuError::Device(format!("cuBLAS product {}×{}×{}: {e:?}", g.m, g.n, g.k)))
    }

    fn synchronize(&self) -> Result<(), GpuError> {
        self.bind()?;
        self.stream.synchronize().map_err(|e| {
            if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                let (free, total) = drv::mem_get_info().unwrap_or((0, 0));
                GpuError::OutOfMemory { requested: 0, free: free as u64, total: total as u64 }
            } else {
                GpuError::Device(format!("GPU work failed: {e}"))
            }
        })
    }

    fn memory(&self) -> Memory {
        let _ = self.bind();
        let (free, total) = drv::mem_get_info().unwrap_or((0, 0));
        // Free memory counts what the cache and the pool hold for reuse.
        let cached = self
            .pool_attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
            .saturating_sub(self.live.get());
        Memory { peak_used: self.peak.get(), free: free as u64 + cached, total: total as u64 }
    }

    fn reset_peak(&self) {
        self.peak.set(self.live.get());
    }
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        let _ = self.bind();
        self.release_cache();
        // SAFETY: nothing uses the workspace once the stream is idle.
        let _ = unsafe { drv::free_async(self.workspace, self.stream.cu_stream()) };
        let _ = self.stream.synchronize();
        // SAFETY: created in `new` and no longer used.
        unsafe {
            let _ = blas::destroy_handle(self.blas);
            let _ = drv::module::unload(self.module);
        }
        let _ = &self.ctx;
    }
}
