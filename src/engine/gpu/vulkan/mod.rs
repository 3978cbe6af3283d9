//! [`Gpu`] on a Vulkan device: the GPU engine's kernels as SPIR-V compute shaders
//! (`kernels.comp`, compiled ahead of time by scripts/toolchain/build-spirv.sh into `spirv/`), reached
//! through the loader with `ash` (opened at run time; nothing is linked at build time).
//!
//! The engine's raw-pointer model maps onto Vulkan 1.2's buffer device addresses: every
//! allocation is one `VkBuffer` with its own memory and a 64-bit address, kernels take their
//! pointers and scalars as push constants, and copies and fills find the buffer that holds an
//! address. Work is recorded into command buffers on one queue, with a full memory barrier
//! after every command (the stream order CUDA gives), and submitted in batches; reading memory
//! back waits for it. Freed blocks are cached by size class and reused by later work, which the
//! barriers order after their last use, as the CUDA device's stream-ordered pool does.

mod index;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, VecDeque};

use ash::vk;

use super::device::{Arg, Dt, Gemm, GemmBatch, Gpu, GpuError, Memory, size_class};
use super::ops;

/// Commands recorded into one command buffer before it is submitted.
const BATCH: usize = 256;
/// Submitted command buffers in flight before the oldest is waited for.
const IN_FLIGHT: usize = 3;
/// Staged upload bytes after which a batch is submitted (bounds the host memory that loading a
/// model's weights holds), and the largest staging block kept for reuse.
const STAGED_PER_BATCH: usize = 256 << 20;
const STAGING_KEPT: usize = 16 << 20;
/// Push-constant bytes of every kernel (Vulkan guarantees 128; the longest argument list,
/// attention's backward pass, takes 100).
const PUSH_BYTES: u32 = 128;

struct Block {
    buf: vk::Buffer,
    mem: vk::DeviceMemory,
    addr: u64,
    size: usize,
    /// Host address of a mapped (staging) block.
    mapped: *mut u8,
}

struct Batch {
    cmd: vk::CommandBuffer,
    fence: vk::Fence,
    commands: usize,
    /// Staging blocks the batch's copies read or write, recycled when it completes.
    staging: Vec<Block>,
    staged: usize,
}

#[derive(Default)]
struct State {
    pipelines: HashMap<(String, u32), vk::Pipeline>,
    /// The tile each product shape on the matrix units runs with, once chosen
    /// ([`VulkanGpu::tuned_tile`]).
    tiles: HashMap<TileKey, [u32; 2]>,
    /// Two timestamps ([`VulkanGpu::gpu_seconds`]), made on first use.
    query_pool: Option<vk::QueryPool>,
    modules: HashMap<&'static str, vk::ShaderModule>,
    /// Live blocks by device address.
    live: BTreeMap<u64, Block>,
    /// Freed device blocks and idle staging blocks, by size class.
    cache: HashMap<usize, Vec<Block>>,
    staging: HashMap<usize, Vec<Block>>,
    recording: Option<Batch>,
    in_flight: VecDeque<Batch>,
    idle: Vec<(vk::CommandBuffer, vk::Fence)>,
    live_bytes: u64,
    peak: u64,
    /// Bytes of device memory held (live and cached).
    held: u64,
    /// Set once the device is lost: every later call fails with it.
    lost: Option<String>,
    /// `RTUNE_PROFILE=kernels`: seconds and calls per kernel (each dispatch waited for).
    profile: Option<BTreeMap<String, (f64, u64)>>,
}

/// A Vulkan device driven by the GPU engine.
pub struct VulkanGpu {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    queue: vk::Queue,
    pool: vk::CommandPool,
    layout: vk::PipelineLayout,
    memory: crate::device::vulkan::TensorMemory,
    physical: vk::PhysicalDevice,
    max_invocations: u32,
    max_groups: [u32; 3],
    /// 16-bit storage buffers (bf16 and f16 tensors; the kernels compute in f32).
    storage16: bool,
    /// Subgroup size where the device is a CPU implementation of Vulkan (lavapipe, SwiftShader)
    /// with subgroup ballot, vote and arithmetic in compute shaders: the kernels written for its
    /// cost model (`gemm_sg`, and through `Gpu::cpu_lanes` the `attn_*_sg` kernels and
    /// one-subgroup row reductions) run there. `None` on GPUs.
    cpu_subgroup: Option<u32>,
    /// A CPU implementation of Vulkan (lavapipe, SwiftShader).
    software: bool,
    /// The matrix-unit kernels' loops are compiled rolled (`RTUNE_VULKAN_ROLL_LOOPS=1`, for
    /// tests on lavapipe: see [`roll_loops`] and docs/devices.md).
    roll_loops: bool,
    /// The matrix units for bf16 and f16 inputs and the state of their kernels' first-use
    /// checks; `None` where the device has none for that type (see [`choose_shape`]).
    matrix: Cell<[Option<MatrixUnits>; 2]>,
    /// For tests: the attention's first-use check treats the kernels' direct form as failed
    /// ([`Self::with_direct_attention_rejected`]).
    reject_direct_attention: bool,
    /// For tests: the products' first-use check treats the current `gemm_cm` as failed
    /// ([`Self::with_current_products_rejected`]).
    reject_current_products: bool,
    /// The tile every product on the matrix units runs with, where one is forced
    /// (`RTUNE_VULKAN_GEMM_TILE`, [`Self::with_gemm_tile`]); else [`choose_gemm_tile`] picks per
    /// product.
    gemm_tile: Option<[u32; 2]>,
    /// Shared memory a workgroup may use, in bytes.
    max_shared: u32,
    /// The largest single allocation (`maxMemoryAllocationSize`, and `maxBufferSize` on Vulkan
    /// 1.3): 4 GiB on some drivers, so a large flat buffer can fail with memory to spare.
    max_alloc: u64,
    /// Compute units where the driver says ([`crate::device::vulkan::compute_units`]).
    compute_units: Option<u32>,
    /// Nanoseconds per timestamp tick where the compute queue writes timestamps.
    timestamp_ns: Option<f64>,
    /// Products of at least this many multiply-adds have their tile timed ([`Self::tuned_tile`]).
    tune_from: usize,
    /// The subgroup size `gemm_cm`'s workgroups of four subgroups are built for, and whether its
    /// pipelines must require it (where the device may choose among sizes).
    subgroup: u32,
    require_subgroup: bool,
    name: String,
    state: RefCell<State>,
}

/// The shape `gemm_cm` runs with among those the device lists for one input type: each side a
/// divisor of 32 (the smallest part of C a subgroup computes, and the tiles' depth), at most 16 × 16
/// (the staging of one accumulator in shared memory), 16 × 16 × 16 where listed, else the largest.
pub fn choose_shape(shapes: &[crate::device::vulkan::MatrixShape], ab: &str) -> Option<[u32; 3]> {
    let fits = |v: u32| [8, 16, 32].contains(&v);
    shapes
        .iter()
        .filter(|s| s.ab == ab && fits(s.m) && fits(s.n) && fits(s.k) && s.m * s.n <= 256)
        .max_by_key(|s| ((s.m, s.n, s.k) == (16, 16, 16), s.m * s.n * s.k))
        .map(|s| [s.m, s.n, s.k])
}

/// The arguments of the product kernels (`K_gemm`, `K_gemm_cm`; `K_gemm_sg` adds one).
fn gemm_args(g: &Gemm) -> Vec<Arg> {
    let i = |v: usize| Arg::I32(v as i32);
    vec![
        Arg::Ptr(g.a),
        Arg::Ptr(g.b),
        Arg::Ptr(g.c),
        i(g.m),
        i(g.n),
        i(g.k),
        i(g.lda),
        i(g.ldb),
        i(g.ldc),
        Arg::I32(g.a_trans as i32),
        Arg::I32(g.b_trans as i32),
        Arg::F32(g.alpha),
        Arg::F32(g.beta),
    ]
}

/// The push constants every product kernel ends with (kernels.comp, `BATCH`).
fn batch_args(b: &GemmBatch) -> Vec<Arg> {
    let i = |v: usize| Arg::I32(i32::try_from(v).expect("batch strides fit in i32 (attention's shapes)"));
    [b.heads, b.a_group, b.b_group, b.a[0], b.a[1], b.b[0], b.b[1], b.c[0], b.c[1]].map(i).to_vec()
}

/// One 64 × 64 tile of C per workgroup (`K_gemm`, `K_gemm_cm1`), a layer of them per product of
/// the batch.
fn gemm_grid(g: &Gemm, b: &GemmBatch) -> [u32; 3] {
    [g.n.div_ceil(64) as u32, g.m.div_ceil(64) as u32, b.count as u32]
}

/// The most products one batched launch takes: the workgroups along z that every Vulkan device
/// allows (a larger batch goes one product at a time).
const MAX_BATCH: usize = 65535;

/// The tiles `gemm_cm` can run with, largest first: each of its four subgroups computes
/// `WM` × `WN` of C, so a workgroup computes twice that each way (kernels.comp).
const GEMM_TILES: [[u32; 2]; 4] = [[64, 64], [64, 32], [32, 64], [32, 32]];

/// [`choose_gemm_tile`] takes a smaller tile where the larger would launch fewer workgroups than
/// this many per compute unit (each can hold about two of the largest tile's), so that no unit
/// idles for long; where the driver does not say how many units there are (Intel, Apple), it
/// assumes [`GEMM_UNITS_UNKNOWN`] (an H100's 132, rounded down). A first guess, to be settled by
/// measurement (docs/devices.md, *The owed GPU checks*).
const GEMM_GROUPS_PER_UNIT: usize = 2;
const GEMM_UNITS_UNKNOWN: usize = 128;

/// Products of fewer multiply-adds than this (LoRA's, a test's) take [`choose_gemm_tile`]'s tile
/// untimed: timing them would cost more than a better tile could save.
const TUNE_FROM: usize = 1 << 27;

/// A product whose output leaves compute units idle even with the smallest tile (LoRA's weight
/// gradients: 960 × 16 outputs summed over 2048 tokens, 15 workgroups) is split over its inner
/// dimension: into parts of at least [`SPLIT_MIN`] values, as many as bring it to two workgroups
/// per unit (at most [`SPLIT_MAX`]). `None`: not split. A function of the shape and the device
/// alone — not of the tile, which is timed — so a run's sums are the same every time.
fn split_k(m: usize, n: usize, k: usize, units: Option<u32>) -> Option<usize> {
    let units = units.map_or(GEMM_UNITS_UNKNOWN, |u| u as usize);
    let groups = m.div_ceil(64) * n.div_ceil(64);
    if groups >= units {
        return None;
    }
    let parts = (GEMM_GROUPS_PER_UNIT * units).div_ceil(groups).min(k / SPLIT_MIN).min(SPLIT_MAX);
    if parts < 2 {
        return None;
    }
    Some(k.div_ceil(parts).next_multiple_of(32))
}

/// The fewest inner-dimension values a part of a split product takes ([`split_k`]).
const SPLIT_MIN: usize = 256;
/// The most parts a product is split into.
const SPLIT_MAX: usize = 32;

/// The products that share a timed tile ([`VulkanGpu::tuned_tile`]): by input and output type,
/// [`shape_class`] and the transposes.
/// A batch's products share a tile by the batch's size rounded up to a power of two too.
type TileKey = (Dt, Dt, [usize; 3], bool, bool, usize);

fn tile_key(ab: Dt, c: Dt, mnk: [usize; 3], a_trans: bool, b_trans: bool, count: usize) -> TileKey {
    (ab, c, shape_class(mnk), a_trans, b_trans, count.next_power_of_two())
}

/// The sides of products that share a timed tile ([`VulkanGpu::tuned_tile`]): each rounded up to a
/// power of two, so that batches padded to their longest row (a new number of tokens each step)
/// are timed a handful of times, not at every step.
fn shape_class(mnk: [usize; 3]) -> [usize; 3] {
    mnk.map(usize::next_power_of_two)
}

/// Asks the driver to keep every loop of SPIR-V module `code` rolled: each `OpLoopMerge`'s loop
/// control loses `Unroll` and gains `DontUnroll`. Both are hints, so the program computes the
/// same; only how the driver compiles it changes ([`VulkanGpu::roll_loops`]).
fn roll_loops(code: &mut [u32]) {
    const OP_LOOP_MERGE: u32 = 246;
    const UNROLL: u32 = 0x1;
    const DONT_UNROLL: u32 = 0x2;
    // Past the five-word header, instructions: word count in the high half, opcode in the low.
    let mut i = 5;
    while i < code.len() {
        let (words, op) = ((code[i] >> 16) as usize, code[i] & 0xffff);
        if words == 0 {
            break;
        }
        // OpLoopMerge: merge block, continue target, loop control (then its parameters).
        if op == OP_LOOP_MERGE && words >= 4 && i + 3 < code.len() {
            code[i + 3] = (code[i + 3] & !UNROLL) | DONT_UNROLL;
        }
        i += words;
    }
}

/// The tile `RTUNE_VULKAN_GEMM_TILE` forces on device `name` (matrix shapes `matrix`), if any;
/// one that is not a tile, or that the device cannot run, is ignored with a word why.
fn forced_tile(name: &str, matrix: &[Option<[u32; 3]>], subgroup: u32, max_shared: u32) -> Option<[u32; 2]> {
    let v = crate::switches::Switches::get().vulkan_gemm_tile.clone()?;
    let Some(t) = parse_tile(&v) else {
        crate::ui::warn(format!("RTUNE_VULKAN_GEMM_TILE={v} is not one of 64x64, 64x32, 32x64, 32x32; ignored"));
        return None;
    };
    let runs = matrix.iter().flatten().any(|&shape| gemm_tiles(shape, subgroup, max_shared).contains(&t));
    if !runs && matrix.iter().any(Option::is_some) {
        crate::ui::warn(format!("{name}: cannot run products with tile {v} (RTUNE_VULKAN_GEMM_TILE); ignored"));
    }
    Some(t)
}

/// `64x32` → `[64, 32]`, for a tile among [`GEMM_TILES`].
fn parse_tile(v: &str) -> Option<[u32; 2]> {
    let (m, n) = v.split_once('x')?;
    let t = [m.parse().ok()?, n.parse().ok()?];
    GEMM_TILES.contains(&t).then_some(t)
}

/// Shared-memory bytes of `gemm_cm` with tile `[wm, wn]` and matrix shape `shape`: A's tile
/// (2·wm rows of 32 + 8 values), B's (32 rows of 2·wn + 8) and four accumulators' staging.
fn gemm_cm_shared_bytes([wm, wn]: [u32; 2], shape: [u32; 3]) -> u32 {
    2 * wm * 40 * 2 + 32 * (2 * wn + 8) * 2 + 4 * shape[0] * shape[1] * 4
}

/// The tiles of [`GEMM_TILES`] `gemm_cm` can run with on a device: the matrix shape divides them,
/// they fit in `max_shared` bytes, and each invocation of the four subgroups of `subgroup` lanes
/// carries a whole, even number of 16-byte pieces of each operand's tile (a transposed operand
/// goes two rows at a time).
fn gemm_tiles(shape: [u32; 3], subgroup: u32, max_shared: u32) -> Vec<[u32; 2]> {
    GEMM_TILES
        .into_iter()
        .filter(|&[wm, wn]| {
            wm % shape[0] == 0
                && wn % shape[1] == 0
                && [wm, wn].iter().all(|&w| w % subgroup == 0)
                && gemm_cm_shared_bytes([wm, wn], shape) <= max_shared
        })
        .collect()
}

/// The tile of `tiles` for an `m` × `n` product on a device of `units` compute units (`None`:
/// unknown): the one doing the most useful work per workgroup (its area times the share of it
/// inside C) among those launching at least [`GEMM_GROUPS_PER_UNIT`] workgroups per unit, else
/// the one launching the most.
fn choose_gemm_tile(m: usize, n: usize, tiles: &[[u32; 2]], units: Option<u32>) -> Option<[u32; 2]> {
    choose_batch_tile(m, n, 1, tiles, units)
}

/// [`choose_gemm_tile`] for `count` products of a batch.
fn choose_batch_tile(m: usize, n: usize, count: usize, tiles: &[[u32; 2]], units: Option<u32>) -> Option<[u32; 2]> {
    let min_groups = GEMM_GROUPS_PER_UNIT * units.map_or(GEMM_UNITS_UNKNOWN, |u| u as usize);
    let groups = |[wm, wn]: [u32; 2]| count * m.div_ceil(2 * wm as usize) * n.div_ceil(2 * wn as usize);
    let useful = |t: [u32; 2]| (m * n) as f64 / groups(t) as f64;
    let enough: Vec<[u32; 2]> = tiles.iter().copied().filter(|&t| groups(t) >= min_groups).collect();
    if enough.is_empty() {
        return tiles.iter().copied().max_by_key(|&t| (groups(t), std::cmp::Reverse(t)));
    }
    enough.into_iter().max_by(|&a, &b| useful(a).total_cmp(&useful(b)))
}

/// The matrix units of one input type: the shape (`TM`, `TN`, `TK`) the cooperative-matrix
/// kernels run with, and whether the products (`gemm_cm`) and attention (`attn_*_mma_*`) have
/// passed their first-use checks.
#[derive(Debug, Clone, Copy)]
struct MatrixUnits {
    shape: [u32; 3],
    product: Check,
    attention: Check,
    /// The attention kernels run their `_rows` form, which stages the tiles a score product
    /// reads transposed and loads only row-major: chosen by the attention's first-use check
    /// where the direct form fails and this one passes (a driver whose column-major loads are
    /// wrong, [`VulkanGpu::matrix_load_probe`]), or by a test.
    rows: bool,
    /// The products run the kernel's first form (`gemm_cm1`, measured on an H200): chosen by
    /// the products' first-use check where the current form fails and this one passes.
    first_form: bool,
}

impl MatrixUnits {
    /// Units of `shape` whose kernels have not run yet. Attention needs a key tile the shape
    /// divides and `max_shared` bytes of shared memory hold, for both head sizes; without one it
    /// stays scalar.
    fn untried(shape: [u32; 3], max_shared: u32) -> MatrixUnits {
        let fits = [64, 128].iter().all(|&d| attention_tile(shape, d, max_shared).is_some());
        let attention = if fits { Check::Untried } else { Check::Failed };
        MatrixUnits { shape, product: Check::Untried, attention, rows: false, first_form: false }
    }
}

/// A first-use check of kernels that run on the matrix units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    Untried,
    /// Under way: the kernels run (for the check itself).
    Running,
    Passed,
    /// Failed, or the kernels cannot run here: others stand in (`first_use` says which).
    Failed,
}

/// The input type of a module that runs on the matrix units (`gemm_cm_<t>_<c>`,
/// `attn_<pass>_mma_<t>`).
fn matrix_module(module: &str) -> Option<Dt> {
    let t = module
        .strip_prefix("gemm_cm_")
        .or_else(|| module.strip_prefix("gemm_cm1_"))
        .or_else(|| module.strip_prefix("cm_probe_"))
        .or_else(|| Some(module.split_once("_mma_")?.1))?;
    [Dt::Bf16, Dt::F16].into_iter().find(|dt| t.starts_with(dt.suffix()))
}

/// Shared-memory bytes of the attention kernels on the matrix units for head size `d` and tiles
/// of `bc` keys, those of the backward passes (the larger; see kernels.comp): 64 staged rows of
/// `d` + 8 in the input type, per subgroup 16 × `bc` scores and gradients in f32 and 16 ×
/// (`bc` + 8) probabilities in the input type, and 1 KiB of per-row values.
pub fn attention_shared_bytes(d: u32, bc: u32) -> u32 {
    64 * (d + 8) * 2 + 2 * (4 * 16 * bc * 4) + 4 * 16 * (bc + 8) * 2 + 1024 + 8
}

/// The key tile of the attention kernels on the matrix units for head size `d` on a device with
/// `max_shared` bytes of shared memory per workgroup: 32 keys, or 16 where 32 do not fit
/// (lavapipe's 32 KiB for `d` = 128); `None` where neither fits or the matrix shape does not
/// divide a subgroup's 16 rows and the tile.
fn attention_tile(shape: [u32; 3], d: u32, max_shared: u32) -> Option<u32> {
    let [m, n, k] = shape;
    [32, 16].into_iter().find(|&bc| m <= 16 && n <= bc && k <= bc && attention_shared_bytes(d, bc) <= max_shared)
}

/// What [`VulkanGpu::matrix_loads`] found, in words: `None` when row- and column-major loads are
/// both right.
fn loads_report(dt: Dt, found: Option<[usize; 3]>) -> Option<String> {
    let Some([row, col, n]) = found else { return Some(format!("no matrix units for {dt:?} to probe")) };
    let wrong: Vec<String> = [("row-major", row), ("column-major", col)]
        .iter()
        .filter(|(_, bad)| *bad > 0)
        .map(|(how, bad)| format!("{how} matrix loads give {bad} of {n} values wrong"))
        .collect();
    (!wrong.is_empty()).then(|| wrong.join(", "))
}

/// Device memory for a first-use check, freed when dropped.
struct Scratch<'g> {
    gpu: &'g VulkanGpu,
    held: RefCell<Vec<u64>>,
}

impl Scratch<'_> {
    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        let p = self.gpu.alloc(bytes.max(16))?;
        self.held.borrow_mut().push(p);
        Ok(p)
    }

    fn upload(&self, bytes: &[u8]) -> Result<u64, GpuError> {
        let p = self.alloc(bytes.len())?;
        self.gpu.upload(p, bytes)?;
        Ok(p)
    }

    /// `n` values of `dt` at `p`, as f32.
    fn read(&self, p: u64, n: usize, dt: Dt) -> Result<Vec<f32>, GpuError> {
        let mut bytes = vec![0u8; n * dt.size()];
        self.gpu.download(p, &mut bytes)?;
        Ok(dt.decode(&bytes))
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        for p in self.held.take() {
            Gpu::free(self.gpu, p);
        }
    }
}

/// Test values for the first-use checks: exactly representable in bf16 and f16, spread over
/// [-0.75, 0.75].
fn check_value(seed: usize) -> f32 {
    ((seed * 2_654_435_761 % 4093) as f32 / 2046.0 - 1.0) * 0.75
}

fn matrix_slot(dt: Dt) -> Option<usize> {
    match dt {
        Dt::Bf16 => Some(0),
        Dt::F16 => Some(1),
        _ => None,
    }
}

fn verr(context: &str) -> impl FnOnce(vk::Result) -> GpuError + '_ {
    move |e| match e {
        vk::Result::ERROR_DEVICE_LOST => GpuError::Lost(format!("the Vulkan device was lost ({context})")),
        e => GpuError::Device(format!("{context}: {e}")),
    }
}

/// Push-constant bytes of `args`: each at an offset aligned to its size, as a std430 push-constant
/// block lays out the same members in the same order.
fn pack(args: &[Arg]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PUSH_BYTES as usize);
    for a in args {
        let bytes: Vec<u8> = match *a {
            Arg::Ptr(v) | Arg::U64(v) => v.to_le_bytes().to_vec(),
            Arg::I32(v) => v.to_le_bytes().to_vec(),
            Arg::U32(v) => v.to_le_bytes().to_vec(),
            Arg::F32(v) => v.to_le_bytes().to_vec(),
        };
        while !out.len().is_multiple_of(bytes.len()) {
            out.push(0);
        }
        out.extend_from_slice(&bytes);
    }
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
    out
}

impl VulkanGpu {
    /// Open Vulkan device `ordinal` (in the loader's order, as `rtune doctor` lists them). On a
    /// CPU implementation of Vulkan, `RTUNE_VULKAN_GPU_KERNELS=1` runs the kernels written for
    /// GPUs ([`Self::with_gpu_kernels`]), so that a run there goes through the matrix units.
    pub fn new(ordinal: usize) -> Result<VulkanGpu, GpuError> {
        // The instance is destroyed in `drop` (or below on failure).
        let crate::device::vulkan::Opened { entry, instance, .. } =
            crate::device::vulkan::instance().map_err(GpuError::Device)?;
        let gpu_kernels = crate::switches::Switches::get().vulkan_gpu_kernels;
        // SAFETY: `instance` is live; on failure it is destroyed before returning.
        match unsafe { Self::open(entry, instance.clone(), ordinal) } {
            Ok(gpu) if gpu_kernels => Ok(gpu.with_gpu_kernels()),
            Ok(gpu) => Ok(gpu),
            Err(e) => {
                // SAFETY: nothing created from the instance outlives a failed `open`.
                unsafe { instance.destroy_instance(None) };
                Err(e)
            }
        }
    }

    /// # Safety
    /// `instance` must be live; it is owned by the result.
    unsafe fn open(entry: ash::Entry, instance: ash::Instance, ordinal: usize) -> Result<VulkanGpu, GpuError> {
        // SAFETY (whole body): every handle comes from `instance`; structures chained through
        // `push_next` live across the calls that read or fill them.
        unsafe {
            let pds = instance.enumerate_physical_devices().map_err(verr("cannot list Vulkan devices"))?;
            let pd = *pds.get(ordinal).ok_or_else(|| {
                GpuError::Device(format!("there is no Vulkan device {ordinal} ({} listed)", pds.len()))
            })?;
            let props = instance.get_physical_device_properties(pd);
            let name = format!(
                "{} (vulkan:{ordinal})",
                props.device_name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
            );
            let support = crate::device::vulkan::engine_support(&instance, pd);
            if !support.missing.is_empty() {
                return Err(GpuError::Device(format!(
                    "{name} lacks Vulkan features the engine needs: {}",
                    support.missing.join(", ")
                )));
            }
            let families = instance.get_physical_device_queue_family_properties(pd);
            let qfi = families
                .iter()
                .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
                .ok_or_else(|| GpuError::Device(format!("{name} has no compute queue")))? as u32;
            let timestamp_ns = (families[qfi as usize].timestamp_valid_bits >= 36)
                .then_some(f64::from(props.limits.timestamp_period))
                .filter(|&ns| ns > 0.0);
            let prio = [1.0f32];
            let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(qfi).queue_priorities(&prio)];
            // The cooperative-matrix product: a shape per input type, and a workgroup of four
            // subgroups of a known size — fixed by the device, or required of the pipeline where
            // the device may choose (subgroup size control: VK_EXT_subgroup_size_control, which a
            // Vulkan 1.2 instance — rtune's — must enable even on a Vulkan 1.3 device).
            let sub = crate::device::vulkan::subgroups(&instance, pd);
            let max_alloc = crate::device::vulkan::max_allocation(&instance, pd);
            let compute_units = crate::device::vulkan::compute_units(&instance, pd);
            let size_ext = ash::ext::subgroup_size_control::NAME;
            let has_size_ext = crate::device::vulkan::has_extension(&instance, pd, size_ext);
            let mut size_control = vk::PhysicalDeviceSubgroupSizeControlFeatures::default();
            if has_size_ext {
                instance.get_physical_device_features2(
                    pd,
                    &mut vk::PhysicalDeviceFeatures2::default().push_next(&mut size_control),
                );
            }
            let varies = sub.range.is_some();
            let require_subgroup = varies && size_control.subgroup_size_control == vk::TRUE;
            let shapes = if (varies && !require_subgroup)
                || sub.size == 0
                || 4 * sub.size > props.limits.max_compute_work_group_invocations
            {
                Vec::new()
            } else {
                crate::device::vulkan::matrix_units(&entry, &instance, pd).shapes
            };
            let matrix = [choose_shape(&shapes, "bf16"), choose_shape(&shapes, "f16")];
            let gemm_tile = forced_tile(&name, &matrix, sub.size, props.limits.max_compute_shared_memory_size);
            let cm = matrix.iter().any(Option::is_some);
            let mut v11 = vk::PhysicalDeviceVulkan11Features::default().storage_buffer16_bit_access(support.storage16);
            let mut v12 = vk::PhysicalDeviceVulkan12Features::default()
                .buffer_device_address(true)
                .shader_float16(cm)
                .vulkan_memory_model(cm)
                .vulkan_memory_model_device_scope(cm);
            // Pipelines with cooperative-matrix instructions require full subgroups (see
            // `matrix_units`, which lists shapes only where the device supports this).
            let mut size_features = vk::PhysicalDeviceSubgroupSizeControlFeatures::default()
                .subgroup_size_control(require_subgroup)
                .compute_full_subgroups(true);
            let mut cm_features = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
            let mut bf16_features = crate::device::vulkan::Bf16Features {
                shader_bfloat16_type: vk::TRUE,
                shader_bfloat16_cooperative_matrix: vk::TRUE,
                ..Default::default()
            };
            let features = vk::PhysicalDeviceFeatures::default().shader_int64(true);
            // A driver on top of another API (MoltenVK) lists VK_KHR_portability_subset, and the
            // spec requires enabling it; the engine uses nothing the subset leaves out.
            let portability = ash::khr::portability_subset::NAME;
            let mut extensions = if crate::device::vulkan::has_extension(&instance, pd, portability) {
                vec![portability.as_ptr()]
            } else {
                Vec::new()
            };
            if cm {
                extensions.push(ash::khr::cooperative_matrix::NAME.as_ptr());
                // Listed: `matrix_units` finds no shape without it.
                extensions.push(size_ext.as_ptr());
            }
            if matrix[0].is_some() {
                extensions.push(c"VK_KHR_shader_bfloat16".as_ptr());
            }
            let mut create = vk::DeviceCreateInfo::default()
                .queue_create_infos(&queues)
                .enabled_extension_names(&extensions)
                .enabled_features(&features)
                .push_next(&mut v12)
                .push_next(&mut v11);
            if cm {
                create = create.push_next(&mut cm_features).push_next(&mut size_features);
            }
            if matrix[0].is_some() {
                create = create.push_next(&mut bf16_features);
            }
            let device = instance.create_device(pd, &create, None).map_err(verr("cannot open the Vulkan device"))?;
            let queue = device.get_device_queue(qfi, 0);
            let pool = device
                .create_command_pool(
                    &vk::CommandPoolCreateInfo::default()
                        .queue_family_index(qfi)
                        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                    None,
                )
                .map_err(verr("command pool"))?;
            let ranges = [vk::PushConstantRange::default()
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
                .offset(0)
                .size(PUSH_BYTES)];
            let layout = device
                .create_pipeline_layout(&vk::PipelineLayoutCreateInfo::default().push_constant_ranges(&ranges), None)
                .map_err(verr("pipeline layout"))?;
            let memory = crate::device::vulkan::TensorMemory::read(&instance, pd, &props);
            let cpu_subgroup = (props.device_type == vk::PhysicalDeviceType::CPU
                && sub.stages.contains(vk::ShaderStageFlags::COMPUTE)
                && sub.operations.contains(
                    vk::SubgroupFeatureFlags::BALLOT
                        | vk::SubgroupFeatureFlags::VOTE
                        | vk::SubgroupFeatureFlags::ARITHMETIC,
                )
                // llvmpipe's widths: 4 (SSE), 8 (AVX2; its default), 16 (LP_NATIVE_VECTOR_WIDTH=
                // 512). At 32 lanes (1024 bits, never a default) Mesa 22.3's lavapipe gives
                // wrong products and attention through gemm_sg and the `_sg` kernels — also with
                // subgroupShuffle in place of subgroupBroadcast, and Mesa 26.1 crashes at any
                // width above 256 — so such a device runs the GPU kernels, which pass there.
                && [4, 8, 16].contains(&sub.size))
            .then_some(sub.size);
            Ok(VulkanGpu {
                _entry: entry,
                instance,
                device,
                queue,
                pool,
                layout,
                memory,
                physical: pd,
                max_invocations: props.limits.max_compute_work_group_invocations,
                max_groups: props.limits.max_compute_work_group_count,
                storage16: support.storage16,
                cpu_subgroup,
                software: props.device_type == vk::PhysicalDeviceType::CPU,
                roll_loops: crate::switches::Switches::get().vulkan_roll_loops,
                reject_direct_attention: false,
                reject_current_products: false,
                gemm_tile,
                matrix: Cell::new(
                    matrix.map(|m| {
                        m.map(|shape| MatrixUnits::untried(shape, props.limits.max_compute_shared_memory_size))
                    }),
                ),
                max_shared: props.limits.max_compute_shared_memory_size,
                max_alloc,
                compute_units,
                timestamp_ns,
                tune_from: TUNE_FROM,
                subgroup: sub.size,
                require_subgroup,
                name,
                state: RefCell::new(State {
                    profile: (crate::switches::Switches::get().profile.as_deref() == Some("kernels"))
                        .then(BTreeMap::new),
                    ..State::default()
                }),
            })
        }
    }

    /// The same device running the kernels written for GPUs even where it is a CPU
    /// implementation of Vulkan (the tests run both sets on lavapipe).
    pub fn with_gpu_kernels(mut self) -> VulkanGpu {
        if self.cpu_subgroup.take().is_some() {
            self.name.push_str(" with GPU kernels");
        }
        self
    }

    /// For tests: the attention kernels on the matrix units in their `_rows` form (row-major
    /// loads only), as a driver whose column-major loads are wrong gets them.
    pub fn with_row_loads(self) -> VulkanGpu {
        for dt in [Dt::Bf16, Dt::F16] {
            self.set_units(dt, |u| u.rows = true);
        }
        self
    }

    /// For tests: the attention's first-use check counts the kernels' direct form as failed
    /// whatever it computes, so that the check goes on to their `_rows` form, as on a driver
    /// where the direct form is wrong.
    #[doc(hidden)]
    pub fn with_direct_attention_rejected(mut self) -> VulkanGpu {
        self.reject_direct_attention = true;
        self
    }

    /// For tests: a smaller single-allocation limit than the driver's, as drivers that cap
    /// allocations at 4 GiB impose, so that CI's lavapipe (whose limit is its memory) trains
    /// over several buffers (the engine's `Flat`). Lowering the limit is always within the
    /// driver's.
    #[doc(hidden)]
    pub fn with_max_alloc(mut self, bytes: u64) -> VulkanGpu {
        self.max_alloc = self.max_alloc.min(bytes);
        self
    }

    /// For tests: `dt`'s matrix-unit kernels run with `shape` (`TM` × `TN` × `TK`) on a CPU
    /// implementation of Vulkan that has matrix units for `dt`, whether or not it lists that
    /// shape, so that CI's lavapipe — which lists 8 × 8 × 8 but lowers any shape — runs the
    /// kernels with the shapes GPUs list (16 × 16 × 16 on NVIDIA and AMD, 8 × 8 × 16 on Intel).
    /// Using a shape a device does not list is outside the Vulkan specification, so anywhere else
    /// (a GPU) the device is returned unchanged.
    #[doc(hidden)]
    pub fn with_matrix_shape(self, dt: Dt, shape: [u32; 3]) -> VulkanGpu {
        if self.software && self.units(dt).is_some() {
            self.set_units(dt, |u| *u = MatrixUnits::untried(shape, self.max_shared));
        }
        self
    }

    /// The matrix-unit shape products of `dt` inputs run with (`gemm_cm`), once it has passed its
    /// first-use check (run here if it has not yet); `None` where they run on the tiled kernel
    /// (always on a CPU implementation of Vulkan unless [`VulkanGpu::with_gpu_kernels`]).
    pub fn matrix_shape(&self, dt: Dt) -> Result<Option<[u32; 3]>, GpuError> {
        if self.cpu_subgroup.is_some() || !self.matrix_units(dt)? {
            return Ok(None);
        }
        Ok(self.units(dt).map(|u| u.shape))
    }

    fn units(&self, dt: Dt) -> Option<MatrixUnits> {
        matrix_slot(dt).and_then(|i| self.matrix.get()[i])
    }

    /// Whether `dt`'s attention kernels on the matrix units run their `_rows` form.
    fn rows_form(&self, dt: Dt) -> bool {
        self.units(dt).is_some_and(|u| u.rows)
    }

    fn set_units(&self, dt: Dt, f: impl FnOnce(&mut MatrixUnits)) {
        let mut all = self.matrix.get();
        if let Some(u) = matrix_slot(dt).and_then(|i| all[i].as_mut()) {
            f(u);
        }
        self.matrix.set(all);
    }

    /// Runs the first-use check `check` of the matrix-unit kernels of `dt` (the products or
    /// attention, as `field` picks) if it has not run: `Ok(true)` if they pass. A device where
    /// they fail — a driver's bug — is reported once (naming `stand_in`, the kernels that run
    /// instead), so a wrong matrix unit can slow training down but never make it wrong.
    fn first_use(
        &self,
        dt: Dt,
        what: &str,
        stand_in: &str,
        field: fn(&mut MatrixUnits) -> &mut Check,
        check: impl FnOnce() -> Result<Option<String>, GpuError>,
    ) -> Result<bool, GpuError> {
        let Some(mut u) = self.units(dt) else { return Ok(false) };
        match *field(&mut u) {
            Check::Passed | Check::Running => return Ok(true),
            Check::Failed => return Ok(false),
            Check::Untried => {}
        }
        self.set_units(dt, |u| *field(u) = Check::Running);
        let outcome = check();
        let passed = matches!(outcome, Ok(None));
        self.set_units(dt, |u| *field(u) = if passed { Check::Passed } else { Check::Failed });
        let failure = match outcome {
            Ok(None) => return Ok(true),
            Ok(Some(why)) => why,
            // A lost device is not the kernel's fault: every later call reports it.
            Err(e) if self.state.borrow().lost.is_some() => return Err(e),
            Err(e) => e.to_string(),
        };
        let [m, n, k] = u.shape;
        let t = dt.suffix();
        crate::ui::warn(format!(
            "{}: {t} {what} on the matrix units ({m}×{n}×{k}) failed a check ({failure}); {stand_in}",
            self.name
        ));
        Ok(false)
    }

    /// Whether products of `dt` inputs run on the device's matrix units (`gemm_cm`). The first
    /// time, the kernel's results on small products with partial tiles are compared with f64
    /// products on the host ([`Self::first_use`], [`Self::matrix_check`]); where they differ,
    /// the kernel's first form (`gemm_cm1`) is checked and, if right, stands in (said once).
    fn matrix_units(&self, dt: Dt) -> Result<bool, GpuError> {
        self.first_use(
            dt,
            "products",
            "the tiled kernel stands in",
            |u| &mut u.product,
            || {
                // A kernel that cannot run here (a driver that fails to compile it) fails like a
                // wrong one; a lost device is not the kernel's doing.
                let checked = if self.reject_current_products {
                    Err(GpuError::Device("rejected by a test".to_string()))
                } else {
                    self.matrix_check(dt)
                };
                let current = match checked {
                    Ok(None) => return Ok(None),
                    Ok(Some(why)) => why,
                    Err(e) if self.state.borrow().lost.is_some() => return Err(e),
                    Err(e) => e.to_string(),
                };
                self.set_units(dt, |u| u.first_form = true);
                match self.matrix_check(dt)? {
                    None => {
                        crate::ui::warn(format!(
                            "{}: {} products on the matrix units failed a check ({current}); the kernel's \
                         first form passed and stands in",
                            self.name,
                            dt.suffix()
                        ));
                        Ok(None)
                    }
                    Some(first) => {
                        self.set_units(dt, |u| u.first_form = false);
                        Ok(Some(format!("{current}; its first form: {first}")))
                    }
                }
            },
        )
    }

    /// Whether products of `dt` inputs on the matrix units run the kernel's first form
    /// (`gemm_cm1`), which stands in where the current one fails its check.
    #[doc(hidden)]
    pub fn first_form_products(&self, dt: Dt) -> bool {
        self.units(dt).is_some_and(|u| u.first_form)
    }

    /// For tests: the products' first-use check counts the current `gemm_cm` as failed to run,
    /// so that the check goes on to its first form, as on a driver that cannot compile the
    /// current one or gets it wrong.
    #[doc(hidden)]
    pub fn with_current_products_rejected(mut self) -> VulkanGpu {
        self.reject_current_products = true;
        self
    }

    /// Whether attention with `dt` inputs runs on the device's matrix units (`attn_*_mma_*`):
    /// where the products do, the device's matrix shape is at most 16 rows (a subgroup's rows)
    /// and the kernels' shared memory fits (both decided when the device opens). The first time,
    /// the kernels' results on a small problem (two packed documents, both head sizes, grouped
    /// query heads, partial tiles) are compared with the scalar kernels' ([`Self::first_use`]).
    fn attention_units(&self, dt: Dt) -> Result<bool, GpuError> {
        if self.cpu_subgroup.is_some() || !self.matrix_units(dt)? {
            return Ok(false);
        }
        // What stands in: `ops.rs` takes products where the device prefers them.
        let stand_in = if self.product_attention() {
            "attention goes through the matrix products instead"
        } else {
            "the scalar kernels stand in"
        };
        self.first_use(dt, "attention", stand_in, |u| &mut u.attention, || self.attention_check(dt))
    }

    /// `None` when the attention kernels on the matrix units give what the scalar kernels give
    /// (within the rounding of the probabilities to `dt` that they add), else how they differ.
    /// The kernels read K (Q, dO) column-major to form QKᵀ; where the driver's column-major
    /// loads are wrong and its row-major ones right, or where the direct form fails for any
    /// other reason and the `_rows` form passes, the `_rows` form stands in.
    fn attention_check(&self, dt: Dt) -> Result<Option<String>, GpuError> {
        // A probe that cannot run decides nothing (the checks below still do), unless the device
        // is lost.
        let probe = self.matrix_loads(dt);
        if probe.is_err() && self.state.borrow().lost.is_some() {
            return probe.map(|_| None);
        }
        let rows_form = |rows| self.set_units(dt, |u| u.rows = rows);
        if let Ok(Some([0, col, n])) = &probe
            && *col > 0
            && !self.rows_form(dt)
        {
            crate::ui::warn(format!(
                "{}: {} column-major matrix loads give {col} of {n} values wrong; the attention kernels \
                 stage their tiles transposed and load row-major",
                self.name,
                dt.suffix()
            ));
            rows_form(true);
        }
        let loads = match &probe {
            Ok(found) => loads_report(dt, *found).unwrap_or("row- and column-major matrix loads are right".into()),
            Err(e) => format!("the matrix-load probe failed ({e})"),
        };
        let direct = !self.rows_form(dt);
        let first = match self.attention_compare(dt)? {
            None if direct && self.reject_direct_attention => Some("rejected by a test".to_string()),
            other => other,
        };
        let Some(why) = first else { return Ok(None) };
        if !direct {
            return Ok(Some(format!("the `_rows` kernels {why}; {loads}")));
        }
        // The direct form failed although the probe found its loads right (or could not tell):
        // the `_rows` form, whose loads are all row-major, may still be right on this driver.
        rows_form(true);
        match self.attention_compare(dt)? {
            None => {
                crate::ui::warn(format!(
                    "{}: {} attention on the matrix units failed a check ({why}; {loads}); their `_rows` \
                     form passed it and stands in",
                    self.name,
                    dt.suffix()
                ));
                Ok(None)
            }
            Some(again) => {
                rows_form(false);
                Ok(Some(format!("{why}; the `_rows` kernels too: {again}; {loads}")))
            }
        }
    }

    /// `None` when the attention kernels on the matrix units, in the form `dt`'s units are set
    /// to, give what the scalar kernels give on a small problem (two packed documents, both head
    /// sizes, grouped query heads, partial tiles), else every output's largest difference and
    /// where.
    fn attention_compare(&self, dt: Dt) -> Result<Option<String>, GpuError> {
        let (t, hq, hk) = (80usize, 2usize, 1usize);
        // Two packed documents, rows 0..40 and 40..80, each causal.
        let lo: Vec<i32> = (0..t as i32).map(|i| if i < 40 { 0 } else { 40 }).collect();
        let hi: Vec<i32> = (0..t as i32).collect();
        let scratch = Scratch { gpu: self, held: RefCell::default() };
        let ints = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (plo, phi) = (scratch.upload(&ints(&lo))?, scratch.upload(&ints(&hi))?);
        let ops = super::ops::Ops { gpu: self, dt };
        for d in [64usize, 128] {
            let (nq, nk) = (t * hq * d, t * hk * d);
            let values = |n: usize, seed: usize| {
                scratch.upload(&dt.encode(&(0..n).map(|i| check_value(i + seed)).collect::<Vec<_>>()))
            };
            let (q, k, v, dout) = (values(nq, d)?, values(nk, 7919)?, values(nk, 2 * 7919)?, values(nq, 3 * 7919)?);
            let mut results = Vec::new();
            for kernels in [ops::AttnKernels::TensorCores, ops::AttnKernels::Scalar] {
                let s = super::ops::AttnShape {
                    b: 1,
                    t,
                    hq,
                    hk,
                    d,
                    scale: 1.0 / (d as f32).sqrt(),
                    softcap: None,
                    kernels,
                };
                let (o, lse, delta) =
                    (scratch.alloc(nq * dt.size())?, scratch.alloc(t * hq * 4)?, scratch.alloc(t * hq * 4)?);
                let (dq, dk, dv) =
                    (scratch.alloc(nq * dt.size())?, scratch.alloc(nk * dt.size())?, scratch.alloc(nk * dt.size())?);
                let attn = scratch.alloc(s.scratch_len(dt, self, true).max(1) * 4)?;
                ops.attn_fwd(&s, q, k, v, o, lse, plo, phi, attn)?;
                ops.attn_bwd(&s, q, k, v, o, dout, lse, delta, attn, dq, dk, dv, plo, phi)?;
                let outputs = [(o, nq, dt), (lse, t * hq, Dt::F32), (dq, nq, dt), (dk, nk, dt), (dv, nk, dt)];
                results.push(outputs.iter().map(|&(p, n, dt)| scratch.read(p, n, dt)).collect::<Result<Vec<_>, _>>()?);
            }
            let (scalar, matrix) = (results.pop().expect("two runs"), results.pop().expect("two runs"));
            // Every output's error and where its worst is (position, head, column), so that one
            // failed check on a driver says which pass and which rows went wrong: the forward
            // pass's first walk (lse), its second (O), or a backward pass.
            let heads = [hq, hq, hq, hk, hk];
            let mut report = Vec::new();
            let mut failed = false;
            for (((name, got), want), h) in ["O", "lse", "dQ", "dK", "dV"].iter().zip(matrix).zip(scalar).zip(heads) {
                let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
                let (worst, at) = got.iter().zip(&want).enumerate().fold((0f32, 0), |(m, at), (i, (a, b))| {
                    let e = if (a - b).is_nan() { f32::INFINITY } else { (a - b).abs() };
                    if e > m { (e, i) } else { (m, at) }
                });
                let err = worst / scale;
                failed |= err > 0.05;
                // lse is [heads, t]; the others [t, heads, d].
                let (row, head, col) =
                    if *name == "lse" { (at % t, at / t, 0) } else { (at / (h * d), at / d % h, at % d) };
                report.push(format!("{name} {err:.3} (position {row}, head {head}, column {col})"));
            }
            if failed {
                return Ok(Some(format!(
                    "with head size {d}, largest differences from the scalar kernels' as a fraction of each output's \
                     largest value: {}",
                    report.join(", ")
                )));
            }
        }
        Ok(None)
    }

    /// Whether the device's matrix loads of `dt` (`cm_probe`) give what the attention kernels
    /// assume — row-major and column-major from shared memory (they read K column-major to form
    /// QKᵀ; `gemm_cm` reads row-major only): `None` when both do, else which are wrong. The
    /// attention's first-use check probes first (choosing the `_rows` form where only the
    /// column-major loads are wrong) and says what the probe found if it still fails; the tests
    /// probe at the shapes GPUs list.
    pub fn matrix_load_probe(&self, dt: Dt) -> Result<Option<String>, GpuError> {
        Ok(loads_report(dt, self.matrix_loads(dt)?))
    }

    /// `cm_probe`'s wrong values, row-major and column-major, of how many; `None` without
    /// matrix units for `dt`.
    fn matrix_loads(&self, dt: Dt) -> Result<Option<[usize; 3]>, GpuError> {
        let Some(u) = self.units(dt) else { return Ok(None) };
        let [tm, tn, _] = u.shape.map(|x| x as usize);
        // Integers of at most 127 in magnitude: exact in bf16 and f16, and through the product.
        let v: Vec<f32> = (0..32 * 32).map(|i| ((i * 7) % 255) as f32 - 127.0).collect();
        let scratch = Scratch { gpu: self, held: RefCell::default() };
        let pv = scratch.upload(&dt.encode(&v))?;
        let n = 4 * tm * tn;
        let mut bad = [0usize; 2];
        for (col, bad) in [false, true].into_iter().zip(&mut bad) {
            let pc = scratch.alloc(n * 4)?;
            let args = [Arg::Ptr(pv), Arg::Ptr(pc), Arg::I32(col as i32)];
            self.launch(&format!("cm_probe_{}", dt.suffix()), [1, 1, 1], 4 * self.subgroup, &args)?;
            let got = scratch.read(pc, n, Dt::F32)?;
            *bad = (0..n)
                .filter(|&e| {
                    let (m, j) = (e % (tm * tn) / tn, e % tn);
                    got[e] != if col { v[j * 32 + m] } else { v[m * 32 + j] }
                })
                .count();
        }
        Ok(Some([bad[0], bad[1], n]))
    }

    /// `None` when `gemm_cm` agrees with an f64 product with every tile the device can run (the
    /// forced one only, where one is: no other runs here), else how it differs. The sides are
    /// not multiples of 8, so tiles and the kernel's 16-byte pieces end inside the matrices;
    /// each product runs with the operands as given and both transposed, and aligned (16-byte
    /// loads; the pitches' padding holds values that must not leak into C) and 2 bytes off
    /// (loads value by value).
    fn matrix_check(&self, dt: Dt) -> Result<Option<String>, GpuError> {
        let (m, n, k) = (70usize, 78usize, 44usize);
        // Values exactly representable in bf16 and f16, so the host computes the same product;
        // the padding 512.
        let stored = |rows: usize, cols: usize, pitch: usize, seed: usize| -> Vec<f32> {
            let v: Vec<f32> =
                (0..rows * pitch).map(|i| if i % pitch < cols { check_value(seed + i) } else { 512.0 }).collect();
            dt.decode(&dt.encode(&v))
        };
        // (tile, split): the first form has one tile of its own; the current form runs every
        // tile it may run with, whole and with the inner dimension split in two (32 + 12).
        let runs: Vec<(Option<[u32; 2]>, Option<usize>)> = if self.units(dt).is_some_and(|u| u.first_form) {
            vec![(None, None)]
        } else {
            let tiles = self.gemm_tile(dt).map_or_else(|| self.gemm_cm_tiles(dt), |t| vec![t]);
            tiles.into_iter().flat_map(|t| [(Some(t), None), (Some(t), Some(32))]).collect()
        };
        if runs.is_empty() {
            return Ok(Some(format!(
                "no tile fits {} KiB of shared memory with {}-lane subgroups",
                self.max_shared / 1024,
                self.subgroup
            )));
        }
        let scratch = Scratch { gpu: self, held: RefCell::default() };
        let pc = scratch.alloc(m * n * 4)?;
        for trans in [false, true] {
            // op(A) is m × k and op(B) k × n; stored as given, or as their transposes.
            let ([ar, ac], [br, bc]) = if trans { ([k, m], [n, k]) } else { ([m, k], [k, n]) };
            let (lda, ldb) = (ac.next_multiple_of(8) + 8, bc.next_multiple_of(8) + 8);
            let (a, b) = (stored(ar, ac, lda, 0), stored(br, bc, ldb, 7919));
            let at = |r: usize, kk: usize| if trans { a[kk * lda + r] } else { a[r * lda + kk] };
            let bt = |kk: usize, c: usize| if trans { b[c * ldb + kk] } else { b[kk * ldb + c] };
            for off in [0usize, 1] {
                // `off` values in front: the operands start 2 bytes past a 16-byte boundary.
                let pad = |v: &[f32]| [vec![0.0; off], v.to_vec()].concat();
                let (pa, pb) = (scratch.upload(&dt.encode(&pad(&a)))?, scratch.upload(&dt.encode(&pad(&b)))?);
                let (pa, pb) = (pa + (off * dt.size()) as u64, pb + (off * dt.size()) as u64);
                for &(tile, split) in &runs {
                    let g = Gemm {
                        m,
                        n,
                        k,
                        a: pa,
                        a_trans: trans,
                        lda,
                        b: pb,
                        b_trans: trans,
                        ldb,
                        c: pc,
                        ldc: n,
                        alpha: 1.0,
                        beta: 0.0,
                        ab: dt,
                        c_dt: Dt::F32,
                    };
                    match (tile, split) {
                        (Some(t), Some(_)) => self.gemm_cm_split(&g, &GemmBatch::ONE, t, split)?,
                        _ => self.gemm_cm(&g, &GemmBatch::ONE, tile)?,
                    }
                    let out = scratch.read(pc, m * n, Dt::F32)?;
                    for r in 0..m {
                        for c in 0..n {
                            let (want, scale) = (0..k).fold((0.0f64, 0.0f64), |(s, t), kk| {
                                let p = at(r, kk) as f64 * bt(kk, c) as f64;
                                (s + p, t + p.abs())
                            });
                            let got = out[r * n + c] as f64;
                            if got.is_nan() || (got - want).abs() > 1e-5 * scale + 1e-30 {
                                let t = if trans { ", operands transposed" } else { "" };
                                let al = if off == 0 { "aligned" } else { "unaligned" };
                                let how =
                                    tile.map_or("first form".to_string(), |[wm, wn]| format!("{wm}×{wn} a subgroup"));
                                let how = if split.is_some() { format!("{how}, split") } else { how };
                                return Ok(Some(format!("C[{r}][{c}] = {got}, expected {want} ({how}, {al}{t})")));
                            }
                        }
                    }
                }
            }
        }
        Ok(None)
    }

    /// The product on the matrix units (`K_gemm_cm`), whose shape for `g.ab` [`VulkanGpu::open`]
    /// chose: workgroups of four subgroups, with the tile `tile` or else the one
    /// [`choose_gemm_tile`] picks for the product; `batch.count` of them in one launch.
    fn gemm_cm(&self, g: &Gemm, batch: &GemmBatch, tile: Option<[u32; 2]>) -> Result<(), GpuError> {
        if self.units(g.ab).is_some_and(|u| u.first_form) {
            let kernel = format!("gemm_cm1_{}_{}", g.ab.suffix(), g.c_dt.suffix());
            let args = [gemm_args(g), batch_args(batch)].concat();
            return self.dispatch(&kernel, gemm_grid(g, batch), 4 * self.subgroup, &args);
        }
        let tile = match tile.or_else(|| self.gemm_tile(g.ab)) {
            Some(t) => Some(t),
            None => self.tuned_tile(g, batch, &self.gemm_cm_tiles(g.ab))?,
        };
        let Some([wm, wn]) = tile else {
            return Err(GpuError::Device(format!(
                "no product tile fits this device's {} KiB of shared memory and {}-lane subgroups",
                self.max_shared / 1024,
                self.subgroup
            )));
        };
        // A batch fills the device by itself; only single products are split.
        let split = if batch.count == 1 { split_k(g.m, g.n, g.k, self.compute_units) } else { None };
        self.gemm_cm_split(g, batch, [wm, wn], split)
    }

    /// `g` on the matrix units with tile `[wm, wn]`, its inner dimension split in parts of
    /// `split` values (a multiple of 32; `None`: whole; a single product only): the parts go to
    /// scratch memory in f32 and `split_sum` adds them into C in order.
    fn gemm_cm_split(
        &self,
        g: &Gemm,
        batch: &GemmBatch,
        [wm, wn]: [u32; 2],
        split: Option<usize>,
    ) -> Result<(), GpuError> {
        let kernel = |c: Dt| format!("gemm_cm_{}_{}_{wm}x{wn}", g.ab.suffix(), c.suffix());
        let grid = |z: usize| [g.n.div_ceil(2 * wn as usize) as u32, g.m.div_ceil(2 * wm as usize) as u32, z as u32];
        debug_assert!(split.is_none() || batch.count == 1, "a batch is never split (gemm_cm)");
        let Some(ks) = split.filter(|&ks| ks < g.k) else {
            let args = [gemm_args(g), vec![Arg::I32(0)], batch_args(batch)].concat();
            return self.dispatch(&kernel(g.c_dt), grid(batch.count), 4 * self.subgroup, &args);
        };
        let parts = g.k.div_ceil(ks);
        let scratch = Scratch { gpu: self, held: RefCell::default() };
        let c = scratch.alloc(parts * g.m * g.n * 4)?;
        let pg = Gemm { c, ldc: g.n, alpha: 1.0, beta: 0.0, c_dt: Dt::F32, ..*g };
        let args = [gemm_args(&pg), vec![Arg::I32(ks as i32)], batch_args(&GemmBatch::ONE)].concat();
        self.dispatch(&kernel(Dt::F32), grid(parts), 4 * self.subgroup, &args)?;
        let i = |v: usize| Arg::I32(v as i32);
        let n = g.m * g.n;
        let sum_args =
            [Arg::Ptr(c), Arg::Ptr(g.c), i(g.m), i(g.n), i(g.ldc), i(parts), Arg::F32(g.alpha), Arg::F32(g.beta)];
        self.dispatch(&format!("split_sum_{}", g.c_dt.suffix()), ops::grid(n), ops::BLOCK, &sum_args)
    }

    /// The tile for product `g` (and its batch) among `tiles`: the first product of its shape
    /// ([`shape_class`], the batch's size) times each (into scratch memory, so C is untouched)
    /// and keeps the fastest for every later one, so the tile that suits a device is found on the
    /// device, whichever GPU it is — where the device writes timestamps and the work is large
    /// enough ([`TUNE_FROM`]); else, or if timing fails, [`choose_gemm_tile`]'s. Every tile sums
    /// each output over the inner dimension in the same order, so the choice changes the speed,
    /// not the result.
    fn tuned_tile(&self, g: &Gemm, batch: &GemmBatch, tiles: &[[u32; 2]]) -> Result<Option<[u32; 2]>, GpuError> {
        let key = tile_key(g.ab, g.c_dt, [g.m, g.n, g.k], g.a_trans, g.b_trans, batch.count);
        if let Some(t) = self.state.borrow().tiles.get(&key) {
            return Ok(Some(*t));
        }
        let guess = choose_batch_tile(g.m, g.n, batch.count, tiles, self.compute_units);
        let work = batch.count * g.m * g.n * g.k;
        let chosen = if tiles.len() < 2 || work < self.tune_from || self.timestamp_ns.is_none() {
            guess
        } else {
            match self.time_tiles(g, batch, tiles) {
                Ok(fastest) => fastest.or(guess),
                Err(e) if self.state.borrow().lost.is_some() => return Err(e),
                // No memory for the scratch C, say: the guess serves.
                Err(_) => guess,
            }
        };
        if let Some(t) = chosen {
            self.state.borrow_mut().tiles.insert(key, t);
        }
        Ok(chosen)
    }

    /// The fastest of `tiles` for product `g` and its batch (three runs each after one that
    /// compiles its pipeline, timed by the GPU's timestamps), writing into scratch memory in place
    /// of C.
    fn time_tiles(&self, g: &Gemm, batch: &GemmBatch, tiles: &[[u32; 2]]) -> Result<Option<[u32; 2]>, GpuError> {
        let scratch = Scratch { gpu: self, held: RefCell::default() };
        let last = batch.offsets(batch.count - 1)[2];
        let c = scratch.alloc((last + (g.m - 1) * g.ldc + g.n) * g.c_dt.size())?;
        let g = Gemm { c, beta: 0.0, ..*g };
        let mut best: Option<([u32; 2], f64)> = None;
        for &tile in tiles {
            self.gemm_cm(&g, batch, Some(tile))?;
            let secs = self.gpu_seconds(|| (0..3).try_for_each(|_| self.gemm_cm(&g, batch, Some(tile))))?;
            if let Some(secs) = secs
                && best.is_none_or(|(_, b)| secs < b)
            {
                best = Some((tile, secs));
            }
        }
        Ok(best.map(|(t, _)| t))
    }

    /// Seconds the GPU takes for the work `f` records, between two timestamps (`None` where the
    /// queue writes none). Waits for the device.
    fn gpu_seconds(&self, f: impl FnOnce() -> Result<(), GpuError>) -> Result<Option<f64>, GpuError> {
        let Some(tick_ns) = self.timestamp_ns else { return Ok(None) };
        let pool = {
            let st = &mut *self.state.borrow_mut();
            match st.query_pool {
                Some(p) => p,
                None => {
                    let info = vk::QueryPoolCreateInfo::default().query_type(vk::QueryType::TIMESTAMP).query_count(2);
                    // SAFETY: a live device; the pool is destroyed in `drop`.
                    let p = unsafe { self.device.create_query_pool(&info, None) }.map_err(verr("timestamp queries"))?;
                    st.query_pool = Some(p);
                    p
                }
            }
        };
        let stamp = |i: u32| {
            let st = &mut *self.state.borrow_mut();
            // SAFETY: a command buffer in the recording state; queries 0 and 1 of a live pool,
            // reset before the first is written.
            self.record(st, |d, cmd| unsafe {
                if i == 0 {
                    d.cmd_reset_query_pool(cmd, pool, 0, 2);
                }
                d.cmd_write_timestamp(cmd, vk::PipelineStageFlags::BOTTOM_OF_PIPE, pool, i);
            })
        };
        stamp(0)?;
        f()?;
        stamp(1)?;
        self.sync(&mut self.state.borrow_mut())?;
        let mut t = [0u64; 2];
        // SAFETY: both queries were written by work the sync above waited for.
        unsafe {
            self.device.get_query_pool_results(
                pool,
                0,
                &mut t,
                vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT,
            )
        }
        .map_err(verr("timestamp queries"))?;
        Ok(Some(t[1].wrapping_sub(t[0]) as f64 * tick_ns * 1e-9))
    }

    /// For tests: products of at least `work` multiply-adds have their tile timed ([`TUNE_FROM`]
    /// by default).
    #[doc(hidden)]
    pub fn with_tuning_from(mut self, work: usize) -> VulkanGpu {
        self.tune_from = work;
        self
    }

    /// The tile an `m` × `n` × `k` product of `dt` inputs into `c_dt` (`a_trans`, `b_trans`) ran
    /// with on the matrix units, once one has ([`Self::tuned_tile`]).
    #[doc(hidden)]
    pub fn product_tile(&self, dt: Dt, c_dt: Dt, mnk: [usize; 3], a_trans: bool, b_trans: bool) -> Option<[u32; 2]> {
        self.state.borrow().tiles.get(&tile_key(dt, c_dt, mnk, a_trans, b_trans, 1)).copied()
    }

    /// The tile [`choose_gemm_tile`] guesses for an `m` × `n` product of `dt` inputs here (what
    /// a product too small to time, or on a device without timestamps, runs with).
    #[doc(hidden)]
    pub fn guessed_tile(&self, dt: Dt, m: usize, n: usize) -> Option<[u32; 2]> {
        choose_gemm_tile(m, n, &self.gemm_cm_tiles(dt), self.compute_units)
    }

    /// The tiles `gemm_cm` can run with here for `dt` inputs ([`gemm_tiles`]).
    fn gemm_cm_tiles(&self, dt: Dt) -> Vec<[u32; 2]> {
        self.units(dt).map_or_else(Vec::new, |u| gemm_tiles(u.shape, self.subgroup, self.max_shared))
    }

    /// For tests and measurements: every product on the matrix units runs with tile `tile`
    /// (`[64, 32]`: each subgroup computes 64 × 32 of C), where the device can run it; as
    /// `RTUNE_VULKAN_GEMM_TILE=64x32` does. The products' first-use check then runs that tile
    /// only (on lavapipe, each tile is a compile of up to a minute).
    #[doc(hidden)]
    pub fn with_gemm_tile(mut self, tile: [u32; 2]) -> VulkanGpu {
        self.gemm_tile = Some(tile);
        self
    }

    /// The tile products of `dt` inputs on the matrix units run with where one is forced and the
    /// device can run it.
    #[doc(hidden)]
    pub fn gemm_tile(&self, dt: Dt) -> Option<[u32; 2]> {
        self.gemm_tile.filter(|t| self.gemm_cm_tiles(dt).contains(t))
    }

    /// Whether the device can run kernels of `dt` (bf16 and f16 need 16-bit storage buffers).
    pub fn supports(&self, dt: Dt) -> bool {
        match dt {
            Dt::Bf16 | Dt::F16 => self.storage16,
            _ => true,
        }
    }

    fn check(&self, st: &State) -> Result<(), GpuError> {
        match &st.lost {
            Some(why) => Err(GpuError::Lost(why.clone())),
            None => Ok(()),
        }
    }

    fn memory_type(&self, bits: u32, want: vk::MemoryPropertyFlags) -> Option<u32> {
        (0..self.memory.properties.memory_type_count).find(|&i| {
            bits & (1 << i) != 0 && self.memory.properties.memory_types[i as usize].property_flags.contains(want)
        })
    }

    /// A new block of `size` bytes (device-local, or host-visible and mapped for staging).
    fn create_block(&self, size: usize, staging: bool) -> Result<Block, vk::Result> {
        let usage = vk::BufferUsageFlags::STORAGE_BUFFER
            | vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS
            | vk::BufferUsageFlags::TRANSFER_SRC
            | vk::BufferUsageFlags::TRANSFER_DST;
        // SAFETY: handles of the live device; on failure everything created here is destroyed.
        unsafe {
            let buf =
                self.device.create_buffer(&vk::BufferCreateInfo::default().size(size as u64).usage(usage), None)?;
            let req = self.device.get_buffer_memory_requirements(buf);
            let host = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
            let types = if staging {
                let ty = self
                    .memory_type(req.memory_type_bits, host | vk::MemoryPropertyFlags::HOST_CACHED)
                    .or_else(|| self.memory_type(req.memory_type_bits, host));
                ty.into_iter().collect()
            } else {
                crate::device::vulkan::tensor_memory_types(
                    &self.memory.properties,
                    req.memory_type_bits,
                    self.memory.integrated,
                )
            };
            // The first type whose heap has room (an integrated GPU's second heap once the first
            // is full).
            let mut found = Err(vk::Result::ERROR_FEATURE_NOT_PRESENT);
            for ty in types {
                let mut flags = vk::MemoryAllocateFlagsInfo::default().flags(vk::MemoryAllocateFlags::DEVICE_ADDRESS);
                let info = vk::MemoryAllocateInfo::default()
                    .allocation_size(req.size)
                    .memory_type_index(ty)
                    .push_next(&mut flags);
                found = self.device.allocate_memory(&info, None);
                if !matches!(found, Err(vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY))
                {
                    break;
                }
            }
            let mem = match found {
                Ok(m) => m,
                Err(e) => {
                    self.device.destroy_buffer(buf, None);
                    return Err(e);
                }
            };
            if let Err(e) = self.device.bind_buffer_memory(buf, mem, 0) {
                self.device.destroy_buffer(buf, None);
                self.device.free_memory(mem, None);
                return Err(e);
            }
            let mapped = if staging {
                match self.device.map_memory(mem, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty()) {
                    Ok(p) => p as *mut u8,
                    Err(e) => {
                        self.device.destroy_buffer(buf, None);
                        self.device.free_memory(mem, None);
                        return Err(e);
                    }
                }
            } else {
                std::ptr::null_mut()
            };
            let addr = self.device.get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(buf));
            Ok(Block { buf, mem, addr, size, mapped })
        }
    }

    fn destroy_block(&self, b: Block) {
        // SAFETY: the block is unused by any pending work (callers wait first).
        unsafe {
            self.device.destroy_buffer(b.buf, None);
            self.device.free_memory(b.mem, None);
        }
    }

    /// A staging block of at least `bytes`.
    fn staging(&self, st: &mut State, bytes: usize) -> Result<Block, GpuError> {
        let class = size_class(bytes);
        if let Some(b) = st.staging.get_mut(&class).and_then(Vec::pop) {
            return Ok(b);
        }
        self.create_block(class, true).map_err(verr("cannot allocate host-visible staging memory"))
    }

    /// The buffer holding `addr .. addr + bytes`, and the offset of `addr` in it.
    fn find(st: &State, addr: u64, bytes: usize) -> Result<(vk::Buffer, u64), GpuError> {
        match st.live.range(..=addr).next_back() {
            Some((&start, b)) if addr + bytes as u64 <= start + b.size as u64 => Ok((b.buf, addr - start)),
            _ => Err(GpuError::Device(format!("address {addr:#x} (+{bytes} bytes) is not in a live Vulkan buffer"))),
        }
    }

    /// The command buffer being recorded, begun if needed.
    fn recording<'s>(&self, st: &'s mut State) -> Result<&'s mut Batch, GpuError> {
        if st.recording.is_none() {
            let (cmd, fence) = match st.idle.pop() {
                Some(x) => x,
                // SAFETY: the pool and device are live; both handles are destroyed in `drop`.
                None => unsafe {
                    let cmd = self
                        .device
                        .allocate_command_buffers(
                            &vk::CommandBufferAllocateInfo::default().command_pool(self.pool).command_buffer_count(1),
                        )
                        .map_err(verr("command buffer"))?[0];
                    let fence =
                        self.device.create_fence(&vk::FenceCreateInfo::default(), None).map_err(verr("fence"))?;
                    (cmd, fence)
                },
            };
            let begin = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: an idle command buffer (never submitted, or its fence has signalled).
            unsafe {
                self.device.reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty()).map_err(verr("reset"))?;
                self.device.begin_command_buffer(cmd, &begin).map_err(verr("begin"))?;
            }
            st.recording = Some(Batch { cmd, fence, commands: 0, staging: Vec::new(), staged: 0 });
        }
        Ok(st.recording.as_mut().expect("begun above"))
    }

    /// Record one command with `f`, then a barrier that orders it before everything after it.
    fn record(&self, st: &mut State, f: impl FnOnce(&ash::Device, vk::CommandBuffer)) -> Result<(), GpuError> {
        self.check(st)?;
        let batch = self.recording(st)?;
        f(&self.device, batch.cmd);
        let stages = vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER;
        let barrier = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(
                vk::AccessFlags::SHADER_READ
                    | vk::AccessFlags::SHADER_WRITE
                    | vk::AccessFlags::TRANSFER_READ
                    | vk::AccessFlags::TRANSFER_WRITE,
            );
        // SAFETY: a command buffer in the recording state.
        unsafe {
            self.device.cmd_pipeline_barrier(
                batch.cmd,
                stages,
                stages | vk::PipelineStageFlags::HOST,
                vk::DependencyFlags::empty(),
                &[barrier.dst_access_mask(barrier.dst_access_mask | vk::AccessFlags::HOST_READ)],
                &[],
                &[],
            )
        };
        batch.commands += 1;
        if batch.commands >= BATCH {
            self.submit(st)?;
        }
        Ok(())
    }

    /// Submit the batch being recorded (if any) without waiting for it.
    fn submit(&self, st: &mut State) -> Result<(), GpuError> {
        let Some(batch) = st.recording.take() else { return Ok(()) };
        let cmds = [batch.cmd];
        // SAFETY: a fully recorded command buffer and an unsignalled fence.
        let r = unsafe {
            self.device.end_command_buffer(batch.cmd).and_then(|_| {
                self.device.queue_submit(self.queue, &[vk::SubmitInfo::default().command_buffers(&cmds)], batch.fence)
            })
        };
        st.in_flight.push_back(batch);
        if let Err(e) = r {
            return Err(Self::fail(st, e, "submitting work"));
        }
        while st.in_flight.len() > IN_FLIGHT {
            self.retire_oldest(st)?;
        }
        Ok(())
    }

    /// Wait for the oldest submitted batch and recycle what it used.
    fn retire_oldest(&self, st: &mut State) -> Result<(), GpuError> {
        let Some(mut batch) = st.in_flight.pop_front() else { return Ok(()) };
        // SAFETY: the fence belongs to a submitted batch.
        let r = unsafe { self.device.wait_for_fences(&[batch.fence], true, u64::MAX) };
        if let Err(e) = r {
            return Err(Self::fail(st, e, "waiting for the GPU"));
        }
        // SAFETY: the fence has signalled, so it is no longer in use.
        unsafe { self.device.reset_fences(&[batch.fence]) }.map_err(verr("fence"))?;
        for b in batch.staging.drain(..) {
            if b.size <= STAGING_KEPT {
                st.staging.entry(b.size).or_default().push(b);
            } else {
                self.destroy_block(b);
            }
        }
        st.idle.push((batch.cmd, batch.fence));
        Ok(())
    }

    /// The error of a failed submission or wait; a lost device fails every later call.
    fn fail(st: &mut State, e: vk::Result, context: &str) -> GpuError {
        let err = verr(context)(e);
        if let GpuError::Lost(why) = &err {
            st.lost = Some(why.clone());
        }
        err
    }

    fn sync(&self, st: &mut State) -> Result<(), GpuError> {
        self.check(st)?;
        self.submit(st)?;
        while !st.in_flight.is_empty() {
            self.retire_oldest(st)?;
        }
        Ok(())
    }

    /// The pipeline of `kernel` with `block` invocations per workgroup (specialisation constant
    /// 0). `<module>_<n>` names module `<module>` specialised with constant 1 = n (a head size,
    /// a tile width), as kernels.cu names its templated kernels.
    fn pipeline(&self, st: &mut State, kernel: &str, block: u32) -> Result<vk::Pipeline, GpuError> {
        if let Some(p) = st.pipelines.get(&(kernel.to_string(), block)) {
            return Ok(*p);
        }
        let module_of = |k: &str| index::KERNELS.iter().find(|(n, _)| *n == k);
        // `_<a>x<b>` (gemm_cm's tiles) sets constants 1 and 6.
        let (&(name, spv), (variant, variant2)) = module_of(kernel)
            .map(|m| (m, (0, 0)))
            .or_else(|| {
                let (m, n) = kernel.rsplit_once('_')?;
                let v = match n.split_once('x') {
                    Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
                    None => (n.parse::<u32>().ok()?, 0),
                };
                Some((module_of(m)?, v))
            })
            .ok_or_else(|| GpuError::Device(format!("kernel `{kernel}` has no Vulkan version")))?;
        let module = match st.modules.get(name) {
            Some(m) => *m,
            None => {
                let mut code = ash::util::read_spv(&mut std::io::Cursor::new(spv))
                    .map_err(|e| GpuError::Device(format!("kernel `{kernel}`: bad SPIR-V ({e})")))?;
                if self.roll_loops && matrix_module(name).is_some() {
                    roll_loops(&mut code);
                }
                // SAFETY: valid SPIR-V words (checked by glslang when built).
                let m = unsafe {
                    self.device.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&code), None)
                }
                .map_err(verr("shader module"))?;
                st.modules.insert(name, m);
                m
            }
        };
        // Constants 2–4: the matrix-unit shape of the input type of a kernel on the matrix units
        // (see `matrix_module`); modules without them ignore them.
        // Constant 5: the attention kernels' key tile for their head size (constant 1).
        // Constant 6: the second number of a `_<a>x<b>` suffix.
        let cm = matrix_module(name);
        let shape = cm.and_then(|dt| self.units(dt)).map_or([16, 16, 16], |u| u.shape);
        let tile =
            if name.contains("_mma_") { attention_tile(shape, variant, self.max_shared).unwrap_or(32) } else { 0 };
        let data: Vec<u8> = [block, variant, shape[0], shape[1], shape[2], tile, variant2]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let entries: Vec<vk::SpecializationMapEntry> =
            (0..7).map(|i| vk::SpecializationMapEntry::default().constant_id(i).offset(4 * i).size(4)).collect();
        let info = vk::SpecializationInfo::default().map_entries(&entries).data(&data);
        let mut required =
            vk::PipelineShaderStageRequiredSubgroupSizeCreateInfo::default().required_subgroup_size(self.subgroup);
        let mut stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(c"main")
            .specialization_info(&info);
        if cm.is_some() {
            stage = stage.flags(vk::PipelineShaderStageCreateFlags::REQUIRE_FULL_SUBGROUPS);
            if self.require_subgroup {
                stage = stage.push_next(&mut required);
            }
        }
        // SAFETY: the module and layout are live; the pipeline is destroyed in `drop`.
        let p = unsafe {
            self.device.create_compute_pipelines(
                vk::PipelineCache::null(),
                &[vk::ComputePipelineCreateInfo::default().stage(stage).layout(self.layout)],
                None,
            )
        }
        .map_err(|(_, e)| verr("compiling a kernel")(e))?[0];
        st.pipelines.insert((kernel.to_string(), block), p);
        Ok(p)
    }

    fn dispatch(&self, kernel: &str, grid: [u32; 3], block: u32, args: &[Arg]) -> Result<(), GpuError> {
        if block > self.max_invocations {
            return Err(GpuError::Device(format!(
                "kernel `{kernel}`: {block} invocations per workgroup, the device allows {}",
                self.max_invocations
            )));
        }
        if grid.iter().zip(self.max_groups).any(|(g, max)| *g > max) || grid.contains(&0) {
            return Err(GpuError::Device(format!("kernel `{kernel}`: grid {grid:?} is outside the device's limits")));
        }
        let push = pack(args);
        if push.len() > PUSH_BYTES as usize {
            return Err(GpuError::Device(format!("kernel `{kernel}`: {} bytes of arguments", push.len())));
        }
        let st = &mut *self.state.borrow_mut();
        self.check(st)?;
        let pipeline = self.pipeline(st, kernel, block)?;
        let layout = self.layout;
        let start = st.profile.is_some().then(|| self.sync(st).map(|_| std::time::Instant::now())).transpose()?;
        self.record(st, |d, cmd| {
            // SAFETY: a recording command buffer, a compute pipeline of `layout`, and push
            // constants within its range.
            unsafe {
                d.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, pipeline);
                d.cmd_push_constants(cmd, layout, vk::ShaderStageFlags::COMPUTE, 0, &push);
                d.cmd_dispatch(cmd, grid[0], grid[1], grid[2]);
            }
        })?;
        if let Some(start) = start {
            self.sync(st)?;
            let e = st.profile.as_mut().expect("profiling").entry(kernel.to_string()).or_default();
            e.0 += start.elapsed().as_secs_f64();
            e.1 += 1;
        }
        Ok(())
    }

    /// Bytes tensors could still take: what `total` leaves beside the live blocks, and where the
    /// driver reports a budget, no more than it leaves (other programs' memory counted) plus the
    /// blocks cached here for reuse, which it counts as used.
    fn free(&self, st: &State) -> u64 {
        let own = self.memory.total.saturating_sub(st.live_bytes);
        // SAFETY: `physical` is the live instance's device the memory was read from.
        match unsafe { self.memory.free(&self.instance, self.physical) } {
            Some(left) => own.min(left + st.held.saturating_sub(st.live_bytes)),
            None => own,
        }
    }

    fn release_cache(&self, st: &mut State) {
        let _ = self.sync(st);
        for (_, blocks) in st.cache.drain().collect::<Vec<_>>() {
            for b in blocks {
                st.held -= b.size as u64;
                self.destroy_block(b);
            }
        }
    }
}

impl Gpu for VulkanGpu {
    fn name(&self) -> String {
        self.name.clone()
    }

    /// The driver's limit rounded down to whole size classes (`size_class`: buffers of a MiB or
    /// more are 2 MiB multiples), so that a buffer the engine sizes to fit it never rounds up
    /// past it (some drivers report limits such as 4 GiB − 1).
    fn max_alloc(&self) -> u64 {
        let class = 2 << 20;
        if self.max_alloc >= class { self.max_alloc / class * class } else { self.max_alloc }
    }

    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        let class = size_class(bytes);
        // More than the device has is out of memory (below); less, but more than one allocation
        // may hold, is the driver's limit.
        if class as u64 > self.max_alloc && class as u64 <= self.memory.total {
            return Err(GpuError::Device(format!(
                "a buffer of {} is larger than {} allows in one allocation ({}: maxMemoryAllocationSize)",
                crate::ui::human_bytes(bytes as u64),
                self.name,
                crate::ui::human_bytes(self.max_alloc)
            )));
        }
        let st = &mut *self.state.borrow_mut();
        self.check(st)?;
        let oom = |st: &State| GpuError::OutOfMemory {
            requested: bytes as u64,
            free: self.free(st),
            total: self.memory.total,
        };
        let block = match st.cache.get_mut(&class).and_then(Vec::pop) {
            Some(b) => b,
            None => {
                if st.live_bytes + class as u64 > self.memory.total {
                    return Err(oom(st));
                }
                if st.held + class as u64 > self.memory.total {
                    self.release_cache(st);
                }
                let b = match self.create_block(class, false) {
                    Ok(b) => b,
                    Err(vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY) => {
                        self.release_cache(st);
                        self.create_block(class, false).map_err(|_| oom(st))?
                    }
                    Err(e) => return Err(verr("allocating GPU memory")(e)),
                };
                st.held += class as u64;
                b
            }
        };
        let addr = block.addr;
        st.live_bytes += class as u64;
        st.peak = st.peak.max(st.live_bytes);
        st.live.insert(addr, block);
        Ok(addr)
    }

    fn free(&self, ptr: u64) {
        let st = &mut *self.state.borrow_mut();
        if let Some(b) = st.live.remove(&ptr) {
            st.live_bytes -= b.size as u64;
            // Reused by later work only, which the barriers order after this block's last use.
            st.cache.entry(b.size).or_default().push(b);
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        if src.is_empty() {
            return Ok(());
        }
        let st = &mut *self.state.borrow_mut();
        self.check(st)?;
        let (buf, offset) = Self::find(st, dst, src.len())?;
        let stage = self.staging(st, src.len())?;
        // SAFETY: a mapped host-visible block of at least `src.len()` bytes, unused by the GPU.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), stage.mapped, src.len()) };
        let region = vk::BufferCopy::default().dst_offset(offset).size(src.len() as u64);
        let sbuf = stage.buf;
        let batch = self.recording(st)?;
        batch.staging.push(stage);
        batch.staged += src.len();
        let full = batch.staged >= STAGED_PER_BATCH;
        // SAFETY: both buffers are live; the region is inside both.
        self.record(st, |d, cmd| unsafe { d.cmd_copy_buffer(cmd, sbuf, buf, &[region]) })?;
        if full { self.submit(st) } else { Ok(()) }
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        if dst.is_empty() {
            return Ok(());
        }
        let st = &mut *self.state.borrow_mut();
        self.check(st)?;
        let (buf, offset) = Self::find(st, src, dst.len())?;
        let stage = self.staging(st, dst.len())?;
        let (sbuf, mapped) = (stage.buf, stage.mapped);
        let region = vk::BufferCopy::default().src_offset(offset).size(dst.len() as u64);
        // SAFETY: both buffers are live; the region is inside both.
        let done = self
            .record(st, |d, cmd| unsafe { d.cmd_copy_buffer(cmd, buf, sbuf, &[region]) })
            .and_then(|_| self.sync(st));
        if done.is_ok() {
            // SAFETY: the copy has completed (synchronised, with a host-read barrier) and the
            // staging block, held here rather than by the batch, is still mapped.
            unsafe { std::ptr::copy_nonoverlapping(mapped, dst.as_mut_ptr(), dst.len()) };
        }
        match done {
            Ok(()) if stage.size <= STAGING_KEPT => st.staging.entry(stage.size).or_default().push(stage),
            Ok(()) => self.destroy_block(stage),
            // On a failed device work may still reference the block: leaked, not freed under it.
            Err(_) => {}
        }
        done
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        if bytes == 0 {
            return Ok(());
        }
        let st = &mut *self.state.borrow_mut();
        let (sbuf, soff) = Self::find(st, src, bytes)?;
        let (dbuf, doff) = Self::find(st, dst, bytes)?;
        let region = vk::BufferCopy::default().src_offset(soff).dst_offset(doff).size(bytes as u64);
        // SAFETY: both buffers are live; the regions are inside them.
        self.record(st, |d, cmd| unsafe { d.cmd_copy_buffer(cmd, sbuf, dbuf, &[region]) })
    }

    fn zero(&self, dst: u64, bytes: usize) -> Result<(), GpuError> {
        if bytes == 0 {
            return Ok(());
        }
        if !dst.is_multiple_of(4) || !bytes.is_multiple_of(4) {
            if !dst.is_multiple_of(2) || !bytes.is_multiple_of(2) {
                return Err(GpuError::Device(format!("cannot clear {bytes} bytes at odd address {dst:#x}")));
            }
            let n = bytes / 2;
            return self.dispatch("zero16", ops::grid(n), ops::BLOCK, &[Arg::Ptr(dst), Arg::I32(n as i32)]);
        }
        let st = &mut *self.state.borrow_mut();
        let (buf, offset) = Self::find(st, dst, bytes)?;
        // SAFETY: a live buffer; offset and size are multiples of 4 inside it.
        self.record(st, |d, cmd| unsafe { d.cmd_fill_buffer(cmd, buf, offset, bytes as u64, 0) })
    }

    fn launch(&self, kernel: &str, grid: [u32; 3], block: u32, args: &[Arg]) -> Result<(), GpuError> {
        // The kernels on the matrix units run as four subgroups of the size their pipelines
        // assume (ops.rs asks for four warps).
        let block = if matrix_module(kernel).is_some() { 4 * self.subgroup } else { block };
        // `attn_<pass>_mma_<t>_<d>` → `attn_<pass>_mma_<t>_rows_<d>` (kernels.comp, ROW_LOADS).
        if kernel.contains("_mma_")
            && matrix_module(kernel).is_some_and(|dt| self.rows_form(dt))
            && let Some((module, d)) = kernel.rsplit_once('_')
        {
            return self.dispatch(&format!("{module}_rows_{d}"), grid, block, args);
        }
        self.dispatch(kernel, grid, block, args)
    }

    fn gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        self.gemm_batched(g, &GemmBatch::ONE)
    }

    fn gemm_batched(&self, g: &Gemm, batch: &GemmBatch) -> Result<(), GpuError> {
        let c = g.c_dt.suffix();
        if g.c_dt != Dt::F32 && g.c_dt != g.ab {
            return Err(GpuError::Device(format!("no product of {:?} inputs into {:?}", g.ab, g.c_dt)));
        }
        if batch.count == 0 || g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if batch.count > MAX_BATCH {
            return (0..batch.count).try_for_each(|z| self.gemm(&batch.product(g, z)));
        }
        let Some(sg) = self.cpu_subgroup.map(|s| s as usize) else {
            if self.matrix_units(g.ab)? {
                return self.gemm_cm(g, batch, None);
            }
            let args = [gemm_args(g), batch_args(batch)].concat();
            return self.dispatch(&format!("gemm_{}_{c}", g.ab.suffix()), gemm_grid(g, batch), 256, &args);
        };
        // On CPU devices gemm_sg computes 32 rows × (subgroup · GC) columns per workgroup: the
        // longer side of C goes across (Cᵀ = op(B)ᵀ·op(A)ᵀ when m < n), GC as small as the
        // columns allow.
        let swap = g.m < g.n;
        let (g, batch) = &if swap {
            let g = Gemm {
                a: g.b,
                a_trans: !g.b_trans,
                lda: g.ldb,
                b: g.a,
                b_trans: !g.a_trans,
                ldb: g.lda,
                m: g.n,
                n: g.m,
                ..*g
            };
            (g, GemmBatch { a: batch.b, a_group: batch.b_group, b: batch.a, b_group: batch.a_group, ..*batch })
        } else {
            (*g, *batch)
        };
        let (m, n) = (g.m, g.n);
        let args = [gemm_args(g), vec![Arg::I32(swap as i32)], batch_args(batch)].concat();
        let gc = n.div_ceil(sg).clamp(1, 4);
        let grid = [n.div_ceil(sg * gc) as u32, m.div_ceil(32) as u32, batch.count as u32];
        self.dispatch(&format!("gemm_sg_{}_{c}_{gc}", g.ab.suffix()), grid, sg as u32, &args)
    }

    fn synchronize(&self) -> Result<(), GpuError> {
        self.sync(&mut self.state.borrow_mut())
    }

    fn flush(&self) -> Result<(), GpuError> {
        let st = &mut *self.state.borrow_mut();
        self.check(st)?;
        self.submit(st)
    }

    fn memory(&self) -> Memory {
        let st = self.state.borrow();
        Memory { peak_used: st.peak, free: self.free(&st), total: self.memory.total }
    }

    fn reset_peak(&self) {
        let st = &mut *self.state.borrow_mut();
        st.peak = st.live_bytes;
    }

    fn cpu_lanes(&self) -> Option<u32> {
        self.cpu_subgroup
    }

    fn tensor_core_attention(&self, dt: Dt) -> bool {
        // A device lost during the first-use check shows in the next call's error.
        self.attention_units(dt).unwrap_or(false)
    }

    fn product_attention(&self) -> bool {
        // On CPU devices the per-lane attention kernels are faster than products.
        self.cpu_subgroup.is_none()
    }

    fn products_account(&self, dt: Dt) -> String {
        if self.cpu_subgroup.is_some() {
            return "products on the per-lane kernel (gemm_sg: a CPU device)".to_string();
        }
        let t = dt.suffix();
        let Some(u) = self.units(dt) else {
            return format!("products on the tiled kernel (gemm: no {t} matrix units)");
        };
        let [m, n, k] = u.shape;
        match (u.product, u.first_form) {
            (Check::Untried | Check::Running, _) => format!("{t} products not run yet"),
            (Check::Passed, false) => format!("products on the matrix units (gemm_cm, {m}×{n}×{k} {t})"),
            (Check::Passed, true) => format!(
                "products on the matrix units in the kernel's first form (gemm_cm1, {m}×{n}×{k} {t}: the current \
                 form failed its check)"
            ),
            (Check::Failed, _) => {
                format!("products on the tiled kernel (gemm: the {t} matrix-unit kernels failed their check)")
            }
        }
    }
}

impl Drop for VulkanGpu {
    fn drop(&mut self) {
        let st = &mut *self.state.borrow_mut();
        if let Some(profile) = st.profile.take() {
            let total: f64 = profile.values().map(|v| v.0).sum();
            let mut rows: Vec<_> = profile.into_iter().collect();
            rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
            let mut report = format!("{}: {total:.3} s in kernels", self.name);
            for (k, (secs, calls)) in rows {
                report += &format!("\n  {k:28} {secs:9.3} s {calls:8} calls {:9.1} µs/call", secs / calls as f64 * 1e6);
            }
            crate::ui::note(report);
        }
        // SAFETY: after the device is idle nothing uses any handle destroyed below.
        unsafe {
            let _ = self.device.device_wait_idle();
            let batches: Vec<Batch> = st.recording.take().into_iter().chain(st.in_flight.drain(..)).collect();
            let mut blocks: Vec<Block> = std::mem::take(&mut st.live)
                .into_values()
                .chain(st.cache.drain().flat_map(|(_, v)| v))
                .chain(st.staging.drain().flat_map(|(_, v)| v))
                .collect();
            for b in batches {
                blocks.extend(b.staging);
                st.idle.push((b.cmd, b.fence));
            }
            for b in blocks {
                self.device.destroy_buffer(b.buf, None);
                self.device.free_memory(b.mem, None);
            }
            for (_, p) in st.pipelines.drain() {
                self.device.destroy_pipeline(p, None);
            }
            if let Some(p) = st.query_pool.take() {
                self.device.destroy_query_pool(p, None);
            }
            for (_, m) in st.modules.drain() {
                self.device.destroy_shader_module(m, None);
            }
            for (_, f) in st.idle.drain(..) {
                self.device.destroy_fence(f, None);
            }
            self.device.destroy_command_pool(self.pool, None);
            self.device.destroy_pipeline_layout(self.layout, None);
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::index::KERNELS;
    use super::{Dt, matrix_module};

    /// A SPIR-V module's instructions: (opcode, operands).
    fn instructions(spv: &[u8]) -> Vec<(u32, Vec<u32>)> {
        let words: Vec<u32> = spv.chunks_exact(4).map(|w| u32::from_le_bytes(w.try_into().unwrap())).collect();
        assert_eq!(words[0], 0x0723_0203, "SPIR-V magic");
        let (mut out, mut i) = (Vec::new(), 5);
        while i < words.len() {
            let (len, op) = (((words[i] >> 16) as usize).max(1), words[i] & 0xffff);
            out.push((op, words[i + 1..(i + len).min(words.len())].to_vec()));
            i += len;
        }
        out
    }

    /// `roll_loops` turns every loop's `Unroll` hint into `DontUnroll` and changes nothing else:
    /// the matrix-unit kernels ask for unrolled loops, and after it no loop does.
    #[test]
    fn rolled_loops_change_only_the_loop_controls() {
        let mut unrolled = 0;
        for (name, spv) in KERNELS.iter().filter(|(n, _)| matrix_module(n).is_some()) {
            let before: Vec<u32> = spv.chunks_exact(4).map(|w| u32::from_le_bytes(w.try_into().unwrap())).collect();
            let mut after = before.clone();
            super::roll_loops(&mut after);
            let bytes: Vec<u8> = after.iter().flat_map(|w| w.to_le_bytes()).collect();
            let (old, new) = (instructions(spv), instructions(&bytes));
            assert_eq!(old.len(), new.len(), "{name}");
            let mut loops = 0;
            for ((op, a), (op2, b)) in old.iter().zip(&new) {
                assert_eq!(op, op2, "{name}");
                if *op == 246 {
                    loops += 1;
                    unrolled += usize::from(a[2] & 1 == 1);
                    assert_eq!((b[2] & 1, b[2] & 2), (0, 2), "{name}: loop control {:#x}", b[2]);
                    assert_eq!((&a[..2], a[2] & !3, &a[3..]), (&b[..2], b[2] & !3, &b[3..]), "{name}");
                } else {
                    assert_eq!(a, b, "{name}: only loop controls change");
                }
            }
            assert!(loops > 0, "{name} has no loops");
        }
        assert!(unrolled > 0, "no matrix-unit kernel asks for an unrolled loop");
    }

    /// The capabilities a SPIR-V module declares (`OpCapability` operands).
    fn capabilities(spv: &[u8]) -> Vec<u32> {
        instructions(spv).into_iter().filter(|(op, _)| *op == 17).map(|(_, a)| a[0]).collect()
    }

    /// The byte size of each shared (Workgroup) array of a module, by name, with specialisation
    /// constants `spec` (SpecId → value; others keep their defaults). Knows what kernels.comp
    /// declares: arrays of scalars whose lengths are constants or integer arithmetic on them.
    fn shared_bytes(spv: &[u8], spec: &[(u32, u32)]) -> Vec<(String, u64)> {
        let code = instructions(spv);
        let (mut names, mut spec_ids) = (HashMap::new(), HashMap::new());
        let (mut sizes, mut values, mut composites) = (HashMap::new(), HashMap::new(), HashMap::new());
        let (mut arrays, mut pointers, mut out) = (HashMap::new(), HashMap::new(), Vec::new());
        for (op, a) in &code {
            match op {
                // OpName: the id and a nul-terminated string.
                5 => {
                    let bytes: Vec<u8> = a[1..].iter().flat_map(|w| w.to_le_bytes()).take_while(|b| *b != 0).collect();
                    names.insert(a[0], String::from_utf8(bytes).unwrap());
                }
                // OpDecorate … SpecId n.
                71 if a[1] == 1 => {
                    spec_ids.insert(a[0], a[2]);
                }
                // OpTypeInt, OpTypeFloat: their width.
                21 | 22 => {
                    sizes.insert(a[0], u64::from(a[1] / 8));
                }
                // OpTypeVector: its components'.
                23 => {
                    sizes.insert(a[0], sizes[&a[1]] * u64::from(a[2]));
                }
                28 => {
                    arrays.insert(a[0], (a[1], a[2]));
                }
                32 => {
                    pointers.insert(a[0], (a[1], a[2]));
                }
                // OpConstant, OpSpecConstant (the value the engine specialises it to).
                43 | 50 => {
                    let given = spec_ids.get(&a[1]).and_then(|id| spec.iter().find(|(s, _)| s == id));
                    values.insert(a[1], given.map_or(a[2], |(_, v)| *v));
                }
                51 => {
                    composites.insert(a[1], a[2..].to_vec());
                }
                // OpSpecConstantOp: integer arithmetic, comparison and selection, and
                // gl_WorkGroupSize's components.
                52 => {
                    let v = |i: usize| values[&a[i]];
                    let r = match a[2] {
                        128 => v(3).wrapping_add(v(4)),
                        130 => v(3).wrapping_sub(v(4)),
                        132 => v(3).wrapping_mul(v(4)),
                        134 | 135 => v(3) / v(4),
                        169 => v(if v(3) != 0 { 4 } else { 5 }),
                        172 => u32::from(v(3) > v(4)),
                        81 => values[&composites[&a[3]][a[4] as usize]],
                        other => panic!("OpSpecConstantOp with opcode {other} is not evaluated here"),
                    };
                    values.insert(a[1], r);
                }
                // OpVariable in the Workgroup storage class.
                59 if a[2] == 4 => {
                    let (_, ty) = pointers[&a[0]];
                    let (elem, len) = arrays[&ty];
                    let bytes = sizes[&elem] * u64::from(values[&len]);
                    out.push((names.get(&a[1]).cloned().unwrap_or_else(|| format!("%{}", a[1])), bytes));
                }
                _ => {}
            }
        }
        out
    }

    /// Every shared array of the kernels on the matrix units is a whole number of 16 bytes, at
    /// every head size, matrix shape and key tile the engine specialises them to, so that each
    /// starts 16-byte aligned, as matrix loads and stores require
    /// (VUID-RuntimeSpirv-OpCooperativeMatrixLoadKHR-08986), in whatever order a driver lays the
    /// arrays out (kernels.comp, before `gemm_cm`).
    #[test]
    fn shared_arrays_of_the_matrix_kernels_keep_16_byte_alignment() {
        let shapes = [[16, 16, 16], [16, 8, 16], [16, 8, 8], [8, 8, 16], [8, 8, 8]];
        let mut checked = 0;
        for (name, spv) in KERNELS.iter().filter(|(name, _)| matrix_module(name).is_some()) {
            for [m, n, k] in shapes {
                // Constant 1 is the attention's head size or gemm_cm's tile height, 6 its width.
                for (d, bc, wn) in
                    [(64, 32, 64), (64, 16, 32), (128, 32, 32), (128, 16, 64), (32, 32, 64), (32, 16, 32)]
                {
                    let spec = [(0, 4 * 32), (1, d), (2, m), (3, n), (4, k), (5, bc), (6, wn)];
                    for (array, bytes) in shared_bytes(spv, &spec) {
                        assert!(
                            bytes % 16 == 0,
                            "{name}: shared array `{array}` takes {bytes} bytes with D or WM = {d}, key tile {bc}, \
                             WN = {wn}, shape {m}×{n}×{k}: not a multiple of 16, so a driver may place a later \
                             array unaligned"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 500, "only {checked} arrays checked: did the modules or their names change?");
    }

    /// `gemm_cm` takes 16 × 16 × 16 where a device lists it (NVIDIA, AMD), else the largest shape
    /// whose sides divide its 32 × 32 × 32 tiles (Intel's 8 × 8 × 16, lavapipe's 8 × 8 × 8), and
    /// only shapes of the input type asked for.
    #[test]
    fn the_product_takes_a_matrix_shape_its_tiles_hold() {
        use crate::device::vulkan::MatrixShape;
        let s = |m, n, k, ab| MatrixShape { m, n, k, ab };
        let nvidia = [s(16, 8, 16, "f16"), s(16, 16, 16, "f16"), s(16, 8, 8, "f16"), s(16, 16, 16, "bf16")];
        assert_eq!(super::choose_shape(&nvidia, "f16"), Some([16, 16, 16]));
        assert_eq!(super::choose_shape(&nvidia, "bf16"), Some([16, 16, 16]));
        assert_eq!(super::choose_shape(&[s(8, 8, 16, "f16"), s(8, 8, 8, "f16")], "f16"), Some([8, 8, 16]));
        assert_eq!(super::choose_shape(&[s(8, 8, 8, "f16")], "bf16"), None);
        // Sides that do not divide the tiles, or a 32 × 32 accumulator (4 KiB of staging).
        assert_eq!(
            super::choose_shape(&[s(16, 16, 24, "f16"), s(32, 32, 16, "f16"), s(64, 8, 16, "f16")], "f16"),
            None
        );
    }

    /// The product's tiles: the shape divides them, they fit the device's shared memory and its
    /// subgroups carry whole, even numbers of 16-byte pieces; per product the largest tile that
    /// still launches enough workgroups, else the one launching the most.
    #[test]
    fn products_take_the_largest_tile_that_fills_the_device() {
        use super::{choose_gemm_tile, gemm_tiles, parse_tile};
        let nvidia = gemm_tiles([16, 16, 16], 32, 49152);
        assert_eq!(nvidia, [[64, 64], [64, 32], [32, 64], [32, 32]]);
        // AMD in wave64: only the largest; 16 KiB of shared memory (the least Vulkan allows):
        // the smallest; 128-lane subgroups: none.
        assert_eq!(gemm_tiles([16, 16, 16], 64, 65536), [[64, 64]]);
        assert_eq!(gemm_tiles([16, 16, 16], 32, 16384), [[32, 32]]);
        assert_eq!(gemm_tiles([16, 16, 16], 128, 65536), Vec::<[u32; 2]>::new());
        // 360M at 4 × 512 tokens on 128 units (two workgroups each): gate/up (2048 × 2560) and
        // the LM head's chunks fill them with the largest tile; q/o (2048 × 960) with 64 × 128
        // (256; 128 × 64 would launch 240); k/v (2048 × 320) with none, so the smallest.
        let (h100, small_gpu) = (Some(128), Some(12));
        assert_eq!(choose_gemm_tile(2048, 2560, &nvidia, h100), Some([64, 64]));
        assert_eq!(choose_gemm_tile(2048, 8192, &nvidia, None), Some([64, 64]));
        assert_eq!(choose_gemm_tile(2048, 960, &nvidia, h100), Some([32, 64]));
        assert_eq!(choose_gemm_tile(2048, 320, &nvidia, h100), Some([32, 32]));
        // An integrated GPU of 12 units: the largest tile wherever it launches 24 workgroups.
        assert_eq!(choose_gemm_tile(2048, 320, &nvidia, small_gpu), Some([64, 64]));
        assert_eq!(choose_gemm_tile(70, 78, &[[64, 64]], h100), Some([64, 64]));
        assert_eq!(choose_gemm_tile(70, 78, &[], h100), None);
        // Split over the inner dimension: LoRA's weight gradients (15 workgroups), in parts of
        // 256 (8 parts, not the 18 that would fill 132 units); not q/o (480 workgroups) nor k/v
        // (160); not a short sum; at most 32 parts.
        use super::split_k;
        assert_eq!(split_k(960, 16, 2048, Some(132)), Some(256));
        assert_eq!(split_k(16, 960, 2048, None), Some(256));
        assert_eq!(split_k(2048, 960, 960, Some(132)), None);
        assert_eq!(split_k(2048, 320, 960, Some(132)), None);
        assert_eq!(split_k(960, 16, 300, Some(132)), None);
        assert_eq!(split_k(16, 16, 1 << 20, Some(132)), Some(32768));
        // Timed tiles are shared by products within a power of two of each other.
        assert_eq!(super::shape_class([2048, 960, 960]), [2048, 1024, 1024]);
        assert_eq!(super::shape_class([1500, 960, 960]), super::shape_class([1100, 1000, 1024]));
        assert_eq!(parse_tile("64x32"), Some([64, 32]));
        assert_eq!(parse_tile("48x32"), None);
        assert_eq!(parse_tile("64"), None);
    }

    /// Attention on the matrix units takes tiles of 32 keys where they fit in shared memory
    /// (NVIDIA's 48 KiB for both head sizes, lavapipe's 32 KiB for 64), else 16 (lavapipe, 128),
    /// and no shape taller than a subgroup's 16 rows or wider than the tile.
    #[test]
    fn attention_takes_the_widest_key_tile_that_fits() {
        use super::attention_tile;
        assert_eq!(attention_tile([16, 16, 16], 64, 49152), Some(32));
        assert_eq!(attention_tile([16, 16, 16], 128, 49152), Some(32));
        assert_eq!(attention_tile([8, 8, 8], 64, 32768), Some(32));
        assert_eq!(attention_tile([8, 8, 8], 128, 32768), Some(16));
        assert_eq!(attention_tile([8, 8, 8], 128, 16384), None);
        assert_eq!(attention_tile([32, 8, 16], 64, 65536), None);
        assert_eq!(attention_tile([16, 32, 16], 128, 32768), None);
    }

    /// Every module needs only what the engine enables on a device or checks before running it:
    /// a kernel that declared, say, Float64 would fail on Intel's Xe and Arc GPUs and on Apple's.
    #[test]
    fn modules_need_only_what_the_engine_enables() {
        for (name, spv) in KERNELS {
            for cap in capabilities(spv) {
                let ok = match cap {
                    // Shader; PhysicalStorageBufferAddresses (bufferDeviceAddress) and Int64
                    // (shaderInt64), both required of a device.
                    1 | 5347 | 11 => true,
                    // StorageBuffer16BitAccess: the bf16/f16 kernels, which run only where
                    // `supports` says the device has it, and the 16-bit clear.
                    4433 => name.contains("_bf16") || name.contains("_f16") || *name == "zero16",
                    // Subgroup operations: the CPU-device kernels, chosen only where
                    // `cpu_subgroup` found ballot, vote and arithmetic.
                    62..=64 => name.contains("_sg"),
                    // GroupNonUniform (subgroup ids and barriers): the same kernels and the
                    // kernels on the matrix units.
                    61 => name.contains("_sg") || matrix_module(name).is_some(),
                    // Float16, VulkanMemoryModel, CooperativeMatrixKHR: the kernels on the matrix
                    // units (products and attention), run only on a shape `matrix_units` found
                    // with `shaderFloat16` and `vulkanMemoryModel`, which `open` then enables.
                    9 | 5345 | 6022 => matrix_module(name).is_some(),
                    // BFloat16TypeKHR, BFloat16CooperativeMatrixKHR: their bf16 forms, run only
                    // where the device has both features (enabled by `open`).
                    5116 | 5118 => matrix_module(name) == Some(Dt::Bf16),
                    _ => false,
                };
                assert!(ok, "module {name} declares SPIR-V capability {cap}, which the engine does not enable");
            }
        }
    }
}
