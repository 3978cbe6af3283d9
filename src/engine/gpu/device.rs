//! The GPU engine's view of a device: raw memory, kernel launches by name and matrix products.
//! [`super::cuda::CudaGpu`] implements it with the CUDA driver and cuBLAS; tests implement it
//! with the CPU emulator of `kernels.cu` (crates/gpu-emu); [`super::vulkan::VulkanGpu`] runs the
//! same kernels written for Vulkan (`vulkan/kernels.comp`).

use std::rc::Rc;

/// Element types of device buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dt {
    F32,
    Bf16,
    F16,
    U32,
    I32,
}

impl Dt {
    pub fn size(self) -> usize {
        match self {
            Dt::F32 | Dt::U32 | Dt::I32 => 4,
            Dt::Bf16 | Dt::F16 => 2,
        }
    }

    /// The kernel-name suffix of a compute dtype.
    pub fn suffix(self) -> &'static str {
        match self {
            Dt::F32 => "f32",
            Dt::Bf16 => "bf16",
            Dt::F16 => "f16",
            Dt::U32 => "u32",
            Dt::I32 => "i32",
        }
    }

    /// f32 values in this dtype's bytes (little-endian), rounded to nearest even.
    pub fn encode(self, v: &[f32]) -> Vec<u8> {
        match self {
            Dt::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dt::Bf16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
            Dt::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
            Dt::U32 | Dt::I32 => panic!("encode: {self:?} is not a float type"),
        }
    }

    /// This dtype's bytes as f32 values.
    pub fn decode(self, b: &[u8]) -> Vec<f32> {
        match self {
            Dt::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dt::Bf16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dt::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dt::U32 | Dt::I32 => panic!("decode: {self:?} is not a float type"),
        }
    }
}

/// The size class of a device allocation: 512-byte steps below 1 MiB, 2 MiB steps above, so that
/// batches of nearby shapes reuse each other's cached blocks (the CUDA and Vulkan devices' caches).
pub fn size_class(bytes: usize) -> usize {
    if bytes < 1 << 20 { bytes.div_ceil(512).max(1) * 512 } else { bytes.div_ceil(2 << 20) * (2 << 20) }
}

/// One kernel argument.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    U32(u32),
    U64(u64),
    F32(f32),
}

/// `C = alpha · op(A) · op(B) + beta · C` on row-major matrices: C is `m × n` with row pitch
/// `ldc`; A is `m × k` (stored `k × m` when `a_trans`) with row pitch `lda`; B likewise `k × n`.
/// A and B are in `ab`, C in `c_dt` (the compute dtype or f32); accumulation is f32.
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub a_trans: bool,
    pub lda: usize,
    pub b: u64,
    pub b_trans: bool,
    pub ldb: usize,
    pub c: u64,
    pub ldc: usize,
    pub alpha: f32,
    pub beta: f32,
    pub ab: Dt,
    pub c_dt: Dt,
}

/// A batch of products of one shape ([`Gpu::gemm_batched`]): product `z = o · heads + h` of
/// `count` takes A at element `o · a[0] + (h / a_group) · a[1]` past [`Gemm::a`], B likewise, and
/// C at `o · c[0] + h · c[1]` — attention's products over a batch's rows (`o`) and heads (`h`),
/// `a_group` or `b_group` query heads sharing one key/value head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmBatch {
    pub count: usize,
    pub heads: usize,
    pub a: [usize; 2],
    pub a_group: usize,
    pub b: [usize; 2],
    pub b_group: usize,
    pub c: [usize; 2],
}

impl GemmBatch {
    /// One product.
    pub const ONE: GemmBatch =
        GemmBatch { count: 1, heads: 1, a: [0, 0], a_group: 1, b: [0, 0], b_group: 1, c: [0, 0] };

    /// Elements past the start of A, B and C of product `z`.
    pub fn offsets(&self, z: usize) -> [usize; 3] {
        let (o, h) = (z / self.heads, z % self.heads);
        [
            o * self.a[0] + h / self.a_group * self.a[1],
            o * self.b[0] + h / self.b_group * self.b[1],
            o * self.c[0] + h * self.c[1],
        ]
    }

    /// Product `z` of `g`'s batch as a product of its own.
    pub fn product(&self, g: &Gemm, z: usize) -> Gemm {
        let [a, b, c] = self.offsets(z);
        let at = |p: u64, i: usize, dt: Dt| p + (i * dt.size()) as u64;
        Gemm { a: at(g.a, a, g.ab), b: at(g.b, b, g.ab), c: at(g.c, c, g.c_dt), ..*g }
    }
}

/// Device memory as the allocator sees it, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    /// Most bytes held by live allocations since the last reset.
    pub peak_used: u64,
    pub free: u64,
    pub total: u64,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    #[error("out of GPU memory: {requested} bytes requested with {free} of {total} free")]
    OutOfMemory { requested: u64, free: u64, total: u64 },
    #[error("{0}")]
    Device(String),
    /// The device stopped: the driver reset it (a watchdog timeout, a fault) or it was removed.
    /// Nothing more runs on it in this process.
    #[error("{0}")]
    Lost(String),
}

pub trait Gpu {
    /// `NVIDIA H100 80GB HBM3 (cuda:0)`, `CPU emulator`.
    fn name(&self) -> String;
    /// Bytes of uninitialised device memory; [`Gpu::free`] gives them back.
    fn alloc(&self, bytes: usize) -> Result<u64, GpuError>;
    fn free(&self, ptr: u64);
    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), GpuError>;
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), GpuError>;
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError>;
    fn zero(&self, dst: u64, bytes: usize) -> Result<(), GpuError>;
    /// Launch `kernel` from kernels.cu over `grid` blocks of `block` threads (1-D blocks).
    fn launch(&self, kernel: &str, grid: [u32; 3], block: u32, args: &[Arg]) -> Result<(), GpuError>;
    fn gemm(&self, g: &Gemm) -> Result<(), GpuError>;
    /// `batch.count` products of `g`'s shape ([`GemmBatch`]); C of one may not overlap another's.
    /// One product after another unless the device runs them as one launch.
    fn gemm_batched(&self, g: &Gemm, batch: &GemmBatch) -> Result<(), GpuError> {
        (0..batch.count).try_for_each(|z| self.gemm(&batch.product(g, z)))
    }
    /// Wait for all queued work; errors of earlier asynchronous work surface here.
    fn synchronize(&self) -> Result<(), GpuError>;
    /// Start the queued work without waiting for it, where the device holds work back until
    /// asked (Vulkan records commands into batches).
    fn flush(&self) -> Result<(), GpuError> {
        Ok(())
    }
    fn memory(&self) -> Memory;
    fn reset_peak(&self);
    /// `Some(n)` where the device runs `n` invocations as one SIMD vector on a CPU and a memory
    /// access costs far more than arithmetic (lavapipe): ops.rs then gives per-row reductions
    /// `n`-invocation workgroups and uses the attention kernels that keep a row per lane
    /// (`attn_*_sg`). `None` on GPUs.
    fn cpu_lanes(&self) -> Option<u32> {
        None
    }

    /// Whether the tensor-core attention kernels (`attn_*_mma_*`) run on this device for `dt`
    /// inputs; without them attention runs on the scalar kernels.
    fn tensor_core_attention(&self, _dt: Dt) -> bool {
        true
    }

    /// Whether attention runs through matrix products ([`super::ops::Ops::attn_fwd`]) where the
    /// tensor-core kernels do not run: on devices whose products are far faster than the scalar
    /// attention kernels (Vulkan GPUs, whose batched products are one launch each).
    fn product_attention(&self) -> bool {
        false
    }

    /// Which kernels run the products of `dt` inputs, in words, for the training log: where
    /// first-use checks decide it (Vulkan's matrix units), as they decided once they have run.
    fn products_account(&self, _dt: Dt) -> String {
        "products one at a time".to_string()
    }

    /// Bytes of the largest single allocation the device allows (Vulkan drivers may cap it
    /// below their memory, e.g. at 4 GiB).
    fn max_alloc(&self) -> u64 {
        u64::MAX
    }
}

/// A device buffer of `len` elements of `dt`, freed when dropped.
pub struct Buf {
    gpu: Rc<dyn Gpu>,
    ptr: u64,
    pub len: usize,
    pub dt: Dt,
}

impl Buf {
    pub fn new(gpu: &Rc<dyn Gpu>, len: usize, dt: Dt) -> Result<Buf, GpuError> {
        let ptr = gpu.alloc((len * dt.size()).max(16))?;
        Ok(Buf { gpu: gpu.clone(), ptr, len, dt })
    }

    pub fn zeros(gpu: &Rc<dyn Gpu>, len: usize, dt: Dt) -> Result<Buf, GpuError> {
        let b = Buf::new(gpu, len, dt)?;
        gpu.zero(b.ptr, len * dt.size())?;
        Ok(b)
    }

    /// f32 values converted to `dt` on the host, then uploaded.
    pub fn from_f32(gpu: &Rc<dyn Gpu>, v: &[f32], dt: Dt) -> Result<Buf, GpuError> {
        let b = Buf::new(gpu, v.len(), dt)?;
        gpu.upload(b.ptr, &dt.encode(v))?;
        Ok(b)
    }

    pub fn from_u32(gpu: &Rc<dyn Gpu>, v: &[u32]) -> Result<Buf, GpuError> {
        let b = Buf::new(gpu, v.len(), Dt::U32)?;
        gpu.upload(b.ptr, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())?;
        Ok(b)
    }

    pub fn from_i32(gpu: &Rc<dyn Gpu>, v: &[i32]) -> Result<Buf, GpuError> {
        let b = Buf::new(gpu, v.len(), Dt::I32)?;
        gpu.upload(b.ptr, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())?;
        Ok(b)
    }

    /// The device address of element `i`.
    pub fn at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len, "offset {i} past a buffer of {}", self.len);
        self.ptr + (i * self.dt.size()) as u64
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Elements `from .. from + len` as f32 (a float buffer).
    pub fn read(&self, from: usize, len: usize) -> Result<Vec<f32>, GpuError> {
        let mut bytes = vec![0u8; len * self.dt.size()];
        self.gpu.download(self.at(from), &mut bytes)?;
        Ok(self.dt.decode(&bytes))
    }

    pub fn to_vec(&self) -> Result<Vec<f32>, GpuError> {
        self.read(0, self.len)
    }

    /// Overwrite elements `from ..` with `v` (converted to this buffer's dtype).
    pub fn write(&self, from: usize, v: &[f32]) -> Result<(), GpuError> {
        assert!(from + v.len() <= self.len, "write past the end of a buffer");
        self.gpu.upload(self.at(from), &self.dt.encode(v))
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        self.gpu.free(self.ptr);
    }
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buf({:?} × {})", self.dt, self.len)
    }
}
