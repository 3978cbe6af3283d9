//! The GPU engine (src/engine/gpu) on every device this machine has: always the CPU emulator of
//! its kernels (crates/gpu-emu); with `--features cuda` on a machine with an NVIDIA GPU the GPU
//! too; and a Vulkan device where the loader lists one (the `vulkan` feature, on by default; in
//! CI, Mesa's software driver lavapipe). Each kernel is checked against a plain Rust reference on random inputs, and the
//! engine against candle's autograd (the reference every engine answers to) on the model tests'
//! fixtures: loss, every gradient, AdamW steps, checkpoints and generation.
//! Unix only: the emulator runs CUDA threads as ucontext coroutines.
#![cfg(unix)]

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::rc::Rc;

use candle_core::{Device, Tensor};
use rtune::device::{DeviceClass, Resolution};
use rtune::engine::candle::CandleEngine;
use rtune::engine::gpu::ops::{AttnKernels, AttnShape, Ops};
use rtune::engine::gpu::{Arg, Buf, Dt, Gemm, GemmBatch, Gpu, GpuEngine, GpuError, Memory, Replicas};
use rtune::engine::params::AdamWConfig;
use rtune::engine::{Checkpointing, Engine, HostBatch, Setup};
use rtune::model::{LoraSpec, ModelFolder, Trainable, peft};
use rtune::recipe::{BaseQuant, Dtype};
use rtune::rng::Rng;

mod common;

use common::golden::{fixture, golden};
use common::gpu::{AttnBufs, rand_vec};
#[cfg(feature = "vulkan")]
use common::gpu::{vulkan_devices, vulkan_ordinal};

// ---------------------------------------------------------------------------------------------
// The emulator as a `Gpu`: host memory, kernels through rtune-gpu-emu, products in plain loops.

#[derive(Default)]
struct EmuGpu {
    allocs: RefCell<HashMap<u64, Vec<u64>>>,
    live: Cell<u64>,
    peak: Cell<u64>,
    /// Bytes the emulated device has (unlimited when None).
    limit: Cell<Option<u64>>,
    /// The largest allocation it allows (unlimited when None).
    max_alloc: Cell<Option<u64>>,
    /// Kernel launches left before the device is lost, as a driver reset loses it (never when
    /// None).
    launches_left: Cell<Option<usize>>,
}

fn load(dt: Dt, p: u64, i: usize) -> f32 {
    // SAFETY: `p` addresses a live emulator allocation holding element `i` (callers' shapes).
    unsafe {
        match dt {
            Dt::F32 => *(p as *const f32).add(i),
            Dt::Bf16 => half::bf16::from_bits(*(p as *const u16).add(i)).to_f32(),
            Dt::F16 => half::f16::from_bits(*(p as *const u16).add(i)).to_f32(),
            _ => unreachable!(),
        }
    }
}

fn store(dt: Dt, p: u64, i: usize, v: f32) {
    // SAFETY: as in `load`.
    unsafe {
        match dt {
            Dt::F32 => *(p as *mut f32).add(i) = v,
            Dt::Bf16 => *(p as *mut u16).add(i) = half::bf16::from_f32(v).to_bits(),
            Dt::F16 => *(p as *mut u16).add(i) = half::f16::from_f32(v).to_bits(),
            _ => unreachable!(),
        }
    }
}

impl Gpu for EmuGpu {
    fn name(&self) -> String {
        "CPU emulator".into()
    }

    fn max_alloc(&self) -> u64 {
        self.max_alloc.get().unwrap_or(u64::MAX)
    }

    fn alloc(&self, bytes: usize) -> Result<u64, GpuError> {
        if bytes as u64 > self.max_alloc() {
            return Err(GpuError::Device(format!("{bytes} bytes is more than one allocation may hold")));
        }
        if let Some(limit) = self.limit.get()
            && self.live.get() + bytes as u64 > limit
        {
            return Err(GpuError::OutOfMemory { requested: bytes as u64, free: limit - self.live.get(), total: limit });
        }
        let v = vec![0x7ff8_0000_7fc0_0000u64; bytes.div_ceil(8).max(1)]; // NaN-poisoned
        let p = v.as_ptr() as u64;
        self.allocs.borrow_mut().insert(p, v);
        self.live.set(self.live.get() + bytes as u64);
        self.peak.set(self.peak.get().max(self.live.get()));
        Ok(p)
    }

    fn free(&self, ptr: u64) {
        if let Some(v) = self.allocs.borrow_mut().remove(&ptr) {
            self.live.set(self.live.get().saturating_sub(v.len() as u64 * 8));
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        // SAFETY: `dst` is a live allocation of at least `src.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        // SAFETY: as in `upload`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: as in `upload`.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn zero(&self, dst: u64, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: as in `upload`.
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
        Ok(())
    }

    fn launch(&self, kernel: &str, grid: [u32; 3], block: u32, args: &[Arg]) -> Result<(), GpuError> {
        if let Some(left) = self.launches_left.get() {
            if left == 0 {
                return Err(GpuError::Lost("the emulated device was lost".into()));
            }
            self.launches_left.set(Some(left - 1));
        }
        let mut values: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) | Arg::U64(p) => p,
                Arg::I32(v) => v as u32 as u64,
                Arg::U32(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> = values.iter_mut().map(|v| v as *mut u64 as *mut _).collect();
        // SAFETY: ops.rs passes each kernel its signature's arguments; pointers are live.
        unsafe { rtune_gpu_emu::launch(kernel, grid, block, &mut params) }.map_err(GpuError::Device)
    }

    fn gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        let a = |i: usize, l: usize| load(g.ab, g.a, if g.a_trans { l * g.lda + i } else { i * g.lda + l });
        let b = |l: usize, j: usize| load(g.ab, g.b, if g.b_trans { j * g.ldb + l } else { l * g.ldb + j });
        for i in 0..g.m {
            for j in 0..g.n {
                let mut s = 0f32;
                for l in 0..g.k {
                    s += a(i, l) * b(l, j);
                }
                let c = i * g.ldc + j;
                let old = if g.beta != 0.0 { g.beta * load(g.c_dt, g.c, c) } else { 0.0 };
                store(g.c_dt, g.c, c, g.alpha * s + old);
            }
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<(), GpuError> {
        Ok(())
    }

    fn memory(&self) -> Memory {
        let total = self.limit.get().unwrap_or(1 << 40);
        Memory { peak_used: self.peak.get(), free: total.saturating_sub(self.live.get()), total }
    }

    fn reset_peak(&self) {
        self.peak.set(self.live.get());
    }
}

/// Whether the tests run on a kind of device (`emulator`, `cuda`, `vulkan`): all of them unless
/// `RTUNE_TEST_DEVICES` lists some (`RTUNE_TEST_DEVICES=vulkan` on a GPU machine whose minutes
/// are few: CI runs the emulator's).
fn testing(kind: &str) -> bool {
    std::env::var("RTUNE_TEST_DEVICES").map_or(true, |v| v.split(',').any(|k| k.trim() == kind))
}

/// The devices the tests run on: the emulator, and the CUDA GPU and Vulkan device when this build
/// and machine have them (`RTUNE_TEST_DEVICES` picks among them).
fn devices() -> Vec<Rc<dyn Gpu>> {
    #[allow(unused_mut)]
    let mut v: Vec<Rc<dyn Gpu>> = Vec::new();
    if testing("emulator") {
        v.push(Rc::new(EmuGpu::default()));
    }
    #[cfg(feature = "cuda")]
    match testing("cuda").then(|| rtune::engine::gpu::cuda::CudaGpu::new(0, false)) {
        None => {}
        Some(Ok(g)) => v.push(Rc::new(g)),
        // RTUNE_REQUIRE_CUDA: on a GPU machine, tests that found no GPU must not pass.
        Some(Err(e)) if std::env::var_os("RTUNE_REQUIRE_CUDA").is_some() => panic!("no CUDA device: {e}"),
        Some(Err(e)) => eprintln!("no CUDA device for the GPU engine tests: {e}"),
    }
    #[cfg(not(feature = "cuda"))]
    assert!(std::env::var_os("RTUNE_REQUIRE_CUDA").is_none(), "RTUNE_REQUIRE_CUDA is set but this build has no CUDA");
    #[cfg(feature = "vulkan")]
    match testing("vulkan").then(vulkan_devices) {
        None => {}
        Some(Ok(gpus)) => v.extend(gpus),
        // CI sets RTUNE_REQUIRE_VULKAN (it installs lavapipe), so the Vulkan kernels never go
        // untested there by accident.
        Some(Err(e)) if std::env::var_os("RTUNE_REQUIRE_VULKAN").is_some() => panic!("no Vulkan device: {e}"),
        Some(Err(e)) => eprintln!("no Vulkan device for the GPU engine tests: {e}"),
    }
    v
}

/// `RTUNE_REQUIRE_MATRIX_UNITS=f16,bf16`: the products of those types must run on the Vulkan
/// device's matrix units (`gemm_cm`), so that a driver that lists cooperative matrices (CI's
/// newer lavapipe, hardware) never tests only the tiled kernel by accident. Here once, not in
/// [`devices`]: the check compiles every tile, minutes on lavapipe, which tests that run no such
/// product would each pay.
#[cfg(feature = "vulkan")]
#[test]
fn vulkan_products_run_on_the_matrix_units_where_required() {
    if !testing("vulkan") || required_matrix_units().is_empty() {
        return;
    }
    let gpu = match rtune::engine::gpu::vulkan::VulkanGpu::new(vulkan_ordinal()) {
        Ok(g) if g.cpu_lanes().is_some() => g.with_gpu_kernels(),
        Ok(g) => g,
        Err(e) => panic!("RTUNE_REQUIRE_MATRIX_UNITS is set but there is no Vulkan device: {e}"),
    };
    for dt in required_matrix_units() {
        assert!(
            gpu.matrix_shape(dt).unwrap().is_some(),
            "{}: no matrix units for {dt:?} products, or they failed their check",
            gpu.name()
        );
        // The kernel's first form stands in for a failing current one in training; here that is
        // a failure to see.
        assert!(
            !gpu.first_form_products(dt),
            "{}: the {dt:?} product kernel failed its check (its first form stood in)",
            gpu.name()
        );
    }
}

/// The input types whose products (and, in the attention test, attention) must run on a Vulkan
/// device's matrix units: `RTUNE_REQUIRE_MATRIX_UNITS=f16,bf16`.
fn required_matrix_units() -> Vec<Dt> {
    let var = std::env::var("RTUNE_REQUIRE_MATRIX_UNITS").unwrap_or_default();
    var.split(',')
        .filter(|t| !t.is_empty())
        .map(|t| match t {
            "f16" => Dt::F16,
            "bf16" => Dt::Bf16,
            _ => panic!("RTUNE_REQUIRE_MATRIX_UNITS: unknown type {t}"),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// Values as `dt` stores them (what a kernel reads after an upload).
fn rounded(dt: Dt, v: &[f32]) -> Vec<f32> {
    dt.decode(&dt.encode(v))
}

/// max |a − b| / max(|b|, floor).
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite output");
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e} > {tol}");
}

/// [`assert_close`] for each tensor of `want` against `got`'s of the same name.
fn assert_named_close(what: &str, got: &BTreeMap<String, Tensor>, want: &BTreeMap<String, Tensor>, tol: f32) {
    for (name, w) in want {
        let w: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let g: Vec<f32> = got[name].flatten_all().unwrap().to_vec1().unwrap();
        assert_close(&format!("{what} {name}"), &g, &w, tol);
    }
}

fn tol(dt: Dt) -> f32 {
    match dt {
        Dt::F32 => 2e-5,
        _ => 2e-2,
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels against references.

/// `C = α·op(A)·op(B) + β·C` against an f64 product: both transposes of each operand, β = 0 and
/// β ≠ 0, C in f32 and in the compute dtype, row pitches wider than the rows, shapes that leave
/// partial tiles and shapes wider than tall (which the CPU-device kernel computes as Cᵀ).
#[test]
fn products_match_a_reference() {
    for gpu in devices() {
        check_products(
            &gpu,
            &[(Dt::F32, Dt::F32), (Dt::Bf16, Dt::F32), (Dt::Bf16, Dt::Bf16), (Dt::F16, Dt::F32), (Dt::F16, Dt::F16)],
        );
    }
}

/// [`products_match_a_reference`] on `gpu` for products of (input type, output type) `types`.
fn check_products(gpu: &Rc<dyn Gpu>, types: &[(Dt, Dt)]) {
    for &(dt, c_dt) in types {
        // Pitches past the rows' ends by a few values, or rounded up to 16 bytes (where the
        // kernels on the matrix units load 16 bytes at a time). The last is long and narrow
        // enough for the kernel on the matrix units to split its sums (`split_k`).
        for ((m, n, k), aligned) in
            [(37, 5, 19), (5, 70, 33), (70, 66, 17), (8, 9, 130), (130, 129, 70), (20, 30, 1100)]
                .into_iter()
                .zip([false, true, false, true, true, true])
        {
            for (a_trans, b_trans, beta) in
                [(false, false, 0.0), (false, true, 0.5), (true, false, 0.0), (true, true, -1.0)]
            {
                let mut rng = Rng::new((m * 1000 + n * 10 + k) as u64);
                let pitch = |v: usize, extra: usize| if aligned { v.next_multiple_of(8) } else { v + extra };
                let (lda, ldb, ldc) =
                    (pitch(if a_trans { m } else { k }, 3), pitch(if b_trans { k } else { n }, 2), n + 1);
                let a = rounded(dt, &rand_vec(&mut rng, (if a_trans { k } else { m }) * lda, 1.0));
                let b = rounded(dt, &rand_vec(&mut rng, (if b_trans { n } else { k }) * ldb, 1.0));
                let c0 = rounded(c_dt, &rand_vec(&mut rng, m * ldc, 1.0));
                let (bufs, g) = product(gpu, (dt, c_dt), [&a, &b, &c0], [m, n, k], [lda, ldb, ldc], (a_trans, b_trans));
                gpu.gemm(&Gemm { alpha: 1.5, beta, ..g }).unwrap();
                let cb = &bufs[2];
                let mut want = c0.clone();
                reference_product(&mut want, [&a, &b], [0; 3], &Gemm { alpha: 1.5, beta, ..g });
                let what = format!("{}: {dt:?}→{c_dt:?} {m}×{n}×{k} trans {a_trans}/{b_trans} β {beta}", gpu.name());
                assert_close(&what, &cb.to_vec().unwrap(), &want, if c_dt == Dt::F32 { 1e-5 } else { 1e-2 });
            }
        }
        check_batched_products(gpu, dt, c_dt);
    }
}

/// `g`'s product in f64 on the host, over `a` and `b` (its A and B) and into `c` (its C, whose
/// values β scales), the operands starting `offsets` elements in (a product of a batch).
fn reference_product(c: &mut [f32], [a, b]: [&[f32]; 2], [ao, bo, co]: [usize; 3], g: &Gemm) {
    for r in 0..g.m {
        for j in 0..g.n {
            let dot: f64 = (0..g.k)
                .map(|p| {
                    let x = a[ao + if g.a_trans { p * g.lda + r } else { r * g.lda + p }];
                    let y = b[bo + if g.b_trans { j * g.ldb + p } else { p * g.ldb + j }];
                    x as f64 * y as f64
                })
                .sum();
            let at = co + r * g.ldc + j;
            c[at] = (g.alpha as f64 * dot + g.beta as f64 * c[at] as f64) as f32;
        }
    }
}

/// A, B (in the input type) and C (in the output type) on `gpu`, and the product over them with
/// pitches `[lda, ldb, ldc]` (α = 1, β = 0).
fn product(
    gpu: &Rc<dyn Gpu>,
    (dt, c_dt): (Dt, Dt),
    [a, b, c]: [&[f32]; 3],
    [m, n, k]: [usize; 3],
    [lda, ldb, ldc]: [usize; 3],
    (a_trans, b_trans): (bool, bool),
) -> ([Buf; 3], Gemm) {
    let bufs = [(a, dt), (b, dt), (c, c_dt)].map(|(v, t)| Buf::from_f32(gpu, v, t).unwrap());
    let (a, b, c) = (bufs[0].ptr(), bufs[1].ptr(), bufs[2].ptr());
    let g = Gemm { m, n, k, a, a_trans, lda, b, b_trans, ldb, c, ldc, ab: dt, c_dt, alpha: 1.0, beta: 0.0 };
    (bufs, g)
}

/// A batch of 2 × 3 products in one call, as attention makes them: A per (row, head), B shared
/// by groups of 3 heads (`b_group`), C per (row, head) at pitches and strides wider than the
/// products, both transposes of each operand, β ≠ 0 — against the same products one at a time
/// in f64.
fn check_batched_products(gpu: &Rc<dyn Gpu>, dt: Dt, c_dt: Dt) {
    let (m, n, k, heads, outer) = (37, 70, 40, 3, 2);
    for (a_trans, b_trans) in [(false, true), (true, false), (false, false), (true, true)] {
        let (lda, ldb, ldc) = (if a_trans { m } else { k } + 3, if b_trans { k } else { n } + 5, n + 2);
        let (a_len, b_len, c_len) = ((if a_trans { k } else { m }) * lda, (if b_trans { n } else { k }) * ldb, m * ldc);
        // Products of one outer index lie `heads` (A, C) or 1 (B) apart, plus a gap.
        let batch = GemmBatch {
            count: outer * heads,
            heads,
            a: [heads * a_len + 11, a_len],
            a_group: 1,
            b: [b_len + 7, b_len],
            b_group: heads,
            c: [heads * c_len + 5, c_len],
        };
        let mut rng = Rng::new(4242 + a_trans as u64 * 2 + b_trans as u64);
        let a = rounded(dt, &rand_vec(&mut rng, outer * batch.a[0], 1.0));
        let b = rounded(dt, &rand_vec(&mut rng, outer * batch.b[0], 1.0));
        let c0 = rounded(c_dt, &rand_vec(&mut rng, outer * batch.c[0], 1.0));
        let (bufs, g) = product(gpu, (dt, c_dt), [&a, &b, &c0], [m, n, k], [lda, ldb, ldc], (a_trans, b_trans));
        gpu.gemm_batched(&Gemm { alpha: 0.75, beta: 0.5, ..g }, &batch).unwrap();
        let cb = &bufs[2];
        let mut want = c0.clone();
        for z in 0..batch.count {
            reference_product(&mut want, [&a, &b], batch.offsets(z), &Gemm { alpha: 0.75, beta: 0.5, ..g });
        }
        let what =
            format!("{}: {dt:?}→{c_dt:?} batch of {} {m}×{n}×{k} trans {a_trans}/{b_trans}", gpu.name(), batch.count);
        assert_close(&what, &cb.to_vec().unwrap(), &want, if c_dt == Dt::F32 { 1e-5 } else { 1e-2 });
    }
}

/// RMSNorm (ε = 1e-5) of rows of width `h`: output, inverse RMS per row, and the input's
/// gradient for output gradient `dy`.
fn rmsnorm_reference(x: &[f32], w: &[f32], dy: &[f32], h: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = x.len() / h;
    let (mut y, mut inv, mut dx) = (vec![0f32; n * h], vec![0f32; n], vec![0f32; n * h]);
    for r in 0..n {
        let row = &x[r * h..][..h];
        let iv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / h as f32 + 1e-5).sqrt();
        inv[r] = iv;
        let dot: f32 = (0..h).map(|j| row[j] * dy[r * h + j] * w[j]).sum::<f32>() / h as f32;
        for j in 0..h {
            y[r * h + j] = (row[j] * iv) * w[j];
            dx[r * h + j] = iv * dy[r * h + j] * w[j] - row[j] * iv * iv * iv * dot;
        }
    }
    (y, inv, dx)
}

/// Cross-entropy of logit rows of width `vocab`, capped as `c · tanh(z / c)` first where `cap`
/// is given: per-row loss and (softmax − onehot) · scale, through the cap.
fn cross_entropy_reference(
    z: &[f32],
    targets: &[u32],
    vocab: usize,
    scale: f32,
    cap: Option<f32>,
) -> (Vec<f32>, Vec<f32>) {
    let n = z.len() / vocab;
    let (mut loss, mut grad) = (vec![0f32; n], vec![0f32; n * vocab]);
    for r in 0..n {
        let row: Vec<f32> = z[r * vocab..][..vocab].iter().map(|&x| cap.map_or(x, |c| c * (x / c).tanh())).collect();
        let m = row.iter().copied().fold(f32::MIN, f32::max);
        let s: f32 = row.iter().map(|v| (v - m).exp()).sum();
        loss[r] = s.ln() - (row[targets[r] as usize] - m);
        for j in 0..vocab {
            let g = (row[j] - m).exp() / s * scale - if j == targets[r] as usize { scale } else { 0.0 };
            grad[r * vocab + j] = g * cap.map_or(1.0, |c| 1.0 - (row[j] / c).powi(2));
        }
    }
    (loss, grad)
}

/// The kernels that work one row per workgroup, on more rows than a grid holds on Vulkan
/// (65535 workgroups along x on Intel's GPUs, MoltenVK and lavapipe): ops launches them in parts.
/// Not on the emulator, which has no such limit and would take minutes to emulate every thread.
#[test]
fn row_kernels_take_more_rows_than_one_grid_holds() {
    for gpu in devices().into_iter().filter(|g| g.name() != "CPU emulator") {
        let o = Ops { gpu: &*gpu, dt: Dt::F32 };
        let mut rng = Rng::new(12);
        let (n, h, vocab) = (65_535 + 70, 4, 5);
        let (x, w, dy) = (rand_vec(&mut rng, n * h, 2.0), rand_vec(&mut rng, h, 1.0), rand_vec(&mut rng, n * h, 1.0));
        let (xb, wb, dyb) = (
            Buf::from_f32(&gpu, &x, Dt::F32).unwrap(),
            Buf::from_f32(&gpu, &w, Dt::F32).unwrap(),
            Buf::from_f32(&gpu, &dy, Dt::F32).unwrap(),
        );
        let (y, inv, dx) = (
            Buf::new(&gpu, n * h, Dt::F32).unwrap(),
            Buf::new(&gpu, n, Dt::F32).unwrap(),
            Buf::zeros(&gpu, n * h, Dt::F32).unwrap(),
        );
        o.rmsnorm_fwd(xb.ptr(), wb.ptr(), y.ptr(), inv.ptr(), n, h, 1e-5, false).unwrap();
        o.rmsnorm_bwd(xb.ptr(), inv.ptr(), wb.ptr(), dyb.ptr(), dx.ptr(), n, h, false, false).unwrap();
        let (want_y, want_inv, want_dx) = rmsnorm_reference(&x, &w, &dy, h);
        assert_close("rmsnorm", &y.to_vec().unwrap(), &want_y, tol(Dt::F32));
        assert_close("rmsnorm inv", &inv.to_vec().unwrap(), &want_inv, 1e-5);
        assert_close("rmsnorm backward", &dx.to_vec().unwrap(), &want_dx, tol(Dt::F32) * 4.0);
        let z = rand_vec(&mut rng, n * vocab, 5.0);
        let targets: Vec<u32> = (0..n as u32).map(|r| (r * 3) % vocab as u32).collect();
        let (zb, tb, loss) = (
            Buf::from_f32(&gpu, &z, Dt::F32).unwrap(),
            Buf::from_u32(&gpu, &targets).unwrap(),
            Buf::new(&gpu, n, Dt::F32).unwrap(),
        );
        o.cross_entropy(zb.ptr(), tb.ptr(), loss.ptr(), n, vocab, 0.5, None).unwrap();
        let (want_l, want_g) = cross_entropy_reference(&z, &targets, vocab, 0.5, None);
        assert_close("cross-entropy loss", &loss.to_vec().unwrap(), &want_l, 1e-5);
        assert_close("cross-entropy gradient", &zb.to_vec().unwrap(), &want_g, tol(Dt::F32));
    }
}

#[test]
fn row_kernels_match_references() {
    for gpu in devices() {
        for dt in [Dt::F32, Dt::Bf16, Dt::F16] {
            let o = Ops { gpu: &*gpu, dt };
            let mut rng = Rng::new(11);
            let (n, h) = (5, 48);
            let x = rounded(dt, &rand_vec(&mut rng, n * h, 2.0));
            let w = rounded(dt, &rand_vec(&mut rng, h, 1.0));
            let dy = rounded(dt, &rand_vec(&mut rng, n * h, 1.0));
            let (xb, wb, dyb) = (
                Buf::from_f32(&gpu, &x, dt).unwrap(),
                Buf::from_f32(&gpu, &w, dt).unwrap(),
                Buf::from_f32(&gpu, &dy, dt).unwrap(),
            );
            // RMSNorm forward, recompute and backward: `x̂ · w`, and Gemma's `x̂ · (1 + w)`.
            for offset in [false, true] {
                let (y, inv) = (Buf::new(&gpu, n * h, dt).unwrap(), Buf::new(&gpu, n, Dt::F32).unwrap());
                o.rmsnorm_fwd(xb.ptr(), wb.ptr(), y.ptr(), inv.ptr(), n, h, 1e-5, offset).unwrap();
                let w_eff: Vec<f32> = w.iter().map(|v| if offset { 1.0 + v } else { *v }).collect();
                let (want_y, want_inv, want_dx) = rmsnorm_reference(&x, &w_eff, &dy, h);
                let what = format!("{dt:?} rmsnorm (offset {offset})");
                assert_close(&what, &y.to_vec().unwrap(), &want_y, tol(dt));
                assert_close(&format!("{what} inv"), &inv.to_vec().unwrap(), &want_inv, 1e-5);
                let y2 = Buf::new(&gpu, n * h, dt).unwrap();
                o.rmsnorm_apply(xb.ptr(), inv.ptr(), wb.ptr(), y2.ptr(), n, h, offset).unwrap();
                assert_eq!(y2.to_vec().unwrap(), y.to_vec().unwrap(), "{what}: recomputed norm differs");
                let dx = Buf::from_f32(&gpu, &vec![0.5; n * h], dt).unwrap();
                o.rmsnorm_bwd(xb.ptr(), inv.ptr(), wb.ptr(), dyb.ptr(), dx.ptr(), n, h, true, offset).unwrap();
                let want_acc: Vec<f32> = want_dx.iter().map(|v| v + 0.5).collect();
                assert_close(&format!("{what} backward"), &dx.to_vec().unwrap(), &want_acc, tol(dt) * 4.0);
            }

            // SiLU and GELU (tanh approximation) gating and their derivatives.
            let g = rounded(dt, &rand_vec(&mut rng, n * h, 4.0));
            let gb = Buf::from_f32(&gpu, &g, dt).unwrap();
            let sig = |z: f32| 1.0 / (1.0 + (-z).exp());
            let silu = |z: f32| (z * sig(z), sig(z) * (1.0 + z * (1.0 - sig(z))));
            let gelu = |z: f64| {
                let (k, c) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
                let t = (k * (z + c * z * z * z)).tanh();
                (0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * c * z * z))
            };
            for is_gelu in [false, true] {
                let act = |z: f32| if is_gelu { (gelu(z as f64).0 as f32, gelu(z as f64).1 as f32) } else { silu(z) };
                let what = if is_gelu { format!("{dt:?} geglu") } else { format!("{dt:?} swiglu") };
                let a = Buf::new(&gpu, n * h, dt).unwrap();
                o.swiglu(gb.ptr(), xb.ptr(), a.ptr(), n * h, is_gelu).unwrap();
                let want: Vec<f32> = (0..n * h).map(|i| act(g[i]).0 * x[i]).collect();
                assert_close(&what, &a.to_vec().unwrap(), &want, tol(dt));
                let (dg, du) = (Buf::new(&gpu, n * h, dt).unwrap(), Buf::new(&gpu, n * h, dt).unwrap());
                o.swiglu_bwd(gb.ptr(), xb.ptr(), dyb.ptr(), dg.ptr(), du.ptr(), n * h, is_gelu).unwrap();
                let want_du: Vec<f32> = (0..n * h).map(|i| dy[i] * act(g[i]).0).collect();
                let want_dg: Vec<f32> = (0..n * h).map(|i| dy[i] * x[i] * act(g[i]).1).collect();
                assert_close(&format!("{what} du"), &du.to_vec().unwrap(), &want_du, tol(dt));
                assert_close(&format!("{what} dg"), &dg.to_vec().unwrap(), &want_dg, tol(dt));
            }

            // Dropout: the same mask as the CPU engines draw, from an offset into the input.
            let key = 0xfeed_beef;
            let m = Buf::new(&gpu, n * h, dt).unwrap();
            o.dropout(xb.ptr(), m.ptr(), key, 7, 0.3, n * h).unwrap();
            let factors = rtune::model::lora::dropout_factors(key, 7, n * h, 0.3);
            let want: Vec<f32> = rounded(dt, &x.iter().zip(&factors).map(|(v, f)| v * f).collect::<Vec<_>>());
            assert_eq!(m.to_vec().unwrap(), want, "{dt:?}: dropout mask");
            let dropped = factors.iter().filter(|f| **f == 0.0).count() as f64 / factors.len() as f64;
            assert!((dropped - 0.3).abs() < 0.08, "dropped {dropped}");

            // Cross-entropy: per-row loss and (softmax − onehot) · scale in place; and of logits
            // capped at 3 first (Gemma 2's cap, small enough here to bend most of them).
            let vocab = 37;
            let z = rounded(dt, &rand_vec(&mut rng, n * vocab, 5.0));
            let targets: Vec<u32> = (0..n as u32).map(|r| (r * 11) % vocab as u32).collect();
            let tb = Buf::from_u32(&gpu, &targets).unwrap();
            for cap in [None, Some(3.0)] {
                let zb = Buf::from_f32(&gpu, &z, dt).unwrap();
                let loss = Buf::new(&gpu, n, Dt::F32).unwrap();
                o.cross_entropy(zb.ptr(), tb.ptr(), loss.ptr(), n, vocab, 0.25, cap).unwrap();
                let (want_l, want_g) = cross_entropy_reference(&z, &targets, vocab, 0.25, cap);
                let what = format!("{dt:?} cross-entropy (cap {cap:?})");
                assert_close(&format!("{what} loss"), &loss.to_vec().unwrap(), &want_l, 1e-5);
                assert_close(&format!("{what} gradient"), &zb.to_vec().unwrap(), &want_g, tol(dt));
            }

            // Gather and scatter-add of rows.
            let idx = [3u32, 0, 4];
            let ib = Buf::from_u32(&gpu, &idx).unwrap();
            let gathered = Buf::new(&gpu, 3 * h, dt).unwrap();
            o.gather_rows(xb.ptr(), ib.ptr(), gathered.ptr(), 3, h).unwrap();
            let want: Vec<f32> = idx.iter().flat_map(|&i| x[i as usize * h..][..h].to_vec()).collect();
            assert_eq!(gathered.to_vec().unwrap(), want, "{dt:?}: gather");
            let acc = Buf::from_f32(&gpu, &vec![1.0; n * h], dt).unwrap();
            o.scatter_add_rows(gathered.ptr(), ib.ptr(), acc.ptr(), 3, h).unwrap();
            let mut want = vec![1.0f32; n * h];
            for (k, &i) in idx.iter().enumerate() {
                for j in 0..h {
                    want[i as usize * h + j] += x[idx[k] as usize * h + j];
                }
            }
            assert_close(&format!("{dt:?} scatter-add"), &acc.to_vec().unwrap(), &want, tol(dt));

            // Rotary embedding: inverse ∘ forward = identity (cos² + sin² = 1 per pair).
            let (heads, d) = (3, 16);
            let q = rounded(dt, &rand_vec(&mut rng, n * heads * d, 1.0));
            let qb = Buf::from_f32(&gpu, &q, dt).unwrap();
            let pos: Vec<u32> = (0..n as u32).map(|i| i * 3).collect();
            let pb = Buf::from_u32(&gpu, &pos).unwrap();
            let angles: Vec<f32> = (0..16 * d).map(|i| ((i / d) as f32) * 0.1 * ((i % (d / 2)) as f32 + 1.0)).collect();
            let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
            let (cb, sb) = (Buf::from_f32(&gpu, &cos, Dt::F32).unwrap(), Buf::from_f32(&gpu, &sin, Dt::F32).unwrap());
            o.rope(qb.ptr(), pb.ptr(), cb.ptr(), sb.ptr(), n, heads, d, false).unwrap();
            let mut want = q.clone();
            for r in 0..n {
                let p = pos[r] as usize;
                for hh in 0..heads {
                    for j in 0..d / 2 {
                        let (a, b) = (q[(r * heads + hh) * d + j], q[(r * heads + hh) * d + j + d / 2]);
                        want[(r * heads + hh) * d + j] = a * cos[p * d + j] - b * sin[p * d + j];
                        want[(r * heads + hh) * d + j + d / 2] =
                            b * cos[p * d + j + d / 2] + a * sin[p * d + j + d / 2];
                    }
                }
            }
            assert_close(&format!("{dt:?} rope"), &qb.to_vec().unwrap(), &want, tol(dt));
            o.rope(qb.ptr(), pb.ptr(), cb.ptr(), sb.ptr(), n, heads, d, true).unwrap();
            assert_close(&format!("{dt:?} rope inverse"), &qb.to_vec().unwrap(), &q, tol(dt) * 2.0);
        }
    }
}

/// The kernels of trained base weights' gradients that are not products: RMSNorm weights and
/// biases (column sums over more rows than one chunk, the last partial) and the embedding table
/// (tokens repeated across the batch, some absent), each added to what the gradient holds.
#[test]
fn weight_gradient_kernels_match_references() {
    for gpu in devices() {
        for dt in [Dt::F32, Dt::Bf16, Dt::F16] {
            let o = Ops { gpu: &*gpu, dt };
            let mut rng = Rng::new(5);
            let (n, w) = (150, 37);
            let x = rounded(dt, &rand_vec(&mut rng, n * w, 2.0));
            let dy = rounded(dt, &rand_vec(&mut rng, n * w, 1.0));
            let inv: Vec<f32> = rand_vec(&mut rng, n, 1.0).iter().map(|v| 0.5 + v.abs()).collect();
            let (xb, dyb) = (Buf::from_f32(&gpu, &x, dt).unwrap(), Buf::from_f32(&gpu, &dy, dt).unwrap());
            let ib = Buf::from_f32(&gpu, &inv, Dt::F32).unwrap();
            let partial = Buf::new(&gpu, Ops::col_partials(n, w), Dt::F32).unwrap();
            for norm in [true, false] {
                let out = Buf::from_f32(&gpu, &vec![0.25; w], Dt::F32).unwrap();
                let x_inv = norm.then_some((xb.ptr(), ib.ptr()));
                o.col_grad(dyb.ptr(), x_inv, partial.ptr(), out.ptr(), n, w).unwrap();
                let want: Vec<f32> = (0..w)
                    .map(|j| {
                        let s: f64 = (0..n)
                            .map(|r| {
                                let f = if norm { rounded(dt, &[x[r * w + j] * inv[r]])[0] } else { 1.0 };
                                dy[r * w + j] as f64 * f as f64
                            })
                            .sum();
                        (0.25 + s) as f32
                    })
                    .collect();
                let what = if norm { "RMSNorm weight" } else { "bias" };
                // Vulkan leaves the rounding of f32 → f16 conversions to the driver, so T(x · inv)
                // may be an ulp (2⁻¹¹) from round-to-nearest-even (Mesa 26's lavapipe: 1.4e-4
                // relative here); bf16 rounding is the kernels' own code, exact everywhere.
                let tol = if norm && dt == Dt::F16 { 1e-3 } else { 1e-5 };
                assert_close(&format!("{} {dt:?} {what} gradient", gpu.name()), &out.to_vec().unwrap(), &want, tol);
            }
            let (vocab, h) = (20, w);
            let ids: Vec<u32> = (0..n as u32).map(|i| (i * i + 3 * i) % 17).collect();
            let (rows, starts, tokens) = {
                let mut rows: Vec<u32> = (0..n as u32).collect();
                rows.sort_by_key(|&r| (ids[r as usize], r));
                let mut tokens: Vec<u32> = ids.clone();
                tokens.sort();
                tokens.dedup();
                let starts: Vec<u32> = tokens
                    .iter()
                    .map(|t| rows.iter().position(|&r| ids[r as usize] == *t).unwrap() as u32)
                    .chain([n as u32])
                    .collect();
                (rows, starts, tokens)
            };
            let grad = Buf::from_f32(&gpu, &vec![0.5; vocab * h], Dt::F32).unwrap();
            let bufs = [&rows, &starts, &tokens].map(|v| Buf::from_u32(&gpu, v).unwrap());
            // Scaled as Gemma's embeddings are (√hidden).
            let scale = 5.5f32;
            o.embed_bwd(dyb.ptr(), bufs[0].ptr(), bufs[1].ptr(), bufs[2].ptr(), grad.ptr(), tokens.len(), h, scale)
                .unwrap();
            let mut want = vec![0.5f64; vocab * h];
            for r in 0..n {
                for j in 0..h {
                    want[ids[r] as usize * h + j] += dy[r * h + j] as f64 * scale as f64;
                }
            }
            let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
            assert_close(&format!("{} {dt:?} embedding gradient", gpu.name()), &grad.to_vec().unwrap(), &want, 1e-5);
        }
    }
}

#[test]
fn adamw_and_reductions_match_the_cpu_optimizer() {
    use rtune::engine::gpu::ops::AdamWCoefficients;
    for gpu in devices() {
        let o = Ops { gpu: &*gpu, dt: Dt::F32 };
        let mut rng = Rng::new(5);
        let n = 1000;
        let (w, g) = (rand_vec(&mut rng, n, 1.0), rand_vec(&mut rng, n, 0.1));
        // The CPU optimizer, two steps.
        let var = candle_core::Var::from_slice(&w, n, &Device::Cpu).unwrap();
        let params = vec![rtune::engine::params::Param { name: "w".into(), var: var.clone() }];
        let cfg = AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
        let mut opt = rtune::engine::params::AdamW::new(cfg, &params).unwrap();
        let (wb, gb) = (Buf::from_f32(&gpu, &w, Dt::F32).unwrap(), Buf::from_f32(&gpu, &g, Dt::F32).unwrap());
        let (mb, vb) = (Buf::zeros(&gpu, n, Dt::F32).unwrap(), Buf::zeros(&gpu, n, Dt::F32).unwrap());
        for step in 1..=2 {
            let lr = 0.01;
            let grads = BTreeMap::from([("w".to_string(), Tensor::from_slice(&g, n, &Device::Cpu).unwrap())]);
            opt.step(&params, &grads, lr).unwrap();
            let (bc1, bc2) = (1.0 - 0.9f64.powi(step), 1.0 - 0.999f64.powi(step));
            let c = AdamWCoefficients {
                decay: (1.0 - lr * 0.1) as f32,
                one_minus_b1: (1.0 - 0.9f64) as f32,
                b2: 0.999,
                one_minus_b2: (1.0 - 0.999f64) as f32,
                step_size: (lr / bc1) as f32,
                bc2_sqrt: bc2.sqrt() as f32,
                eps: 1e-8,
                grad_scale: 1.0,
            };
            o.adamw(wb.ptr(), gb.ptr(), mb.ptr(), vb.ptr(), n, &c).unwrap();
        }
        let want: Vec<f32> = var.as_tensor().to_vec1().unwrap();
        assert_eq!(wb.to_vec().unwrap(), want, "{}: AdamW equals the CPU optimizer bit for bit", gpu.name());
        // Σx² and a weighted sum, into f64 accumulators.
        let acc = Buf::zeros(&gpu, 4, Dt::U32).unwrap();
        o.sum_squares(gb.ptr(), n, acc.ptr()).unwrap();
        o.sum_scaled(gb.ptr(), n, 0.5, acc.at(2)).unwrap();
        let mut bytes = [0u8; 16];
        gpu.download(acc.ptr(), &mut bytes).unwrap();
        let got =
            (f64::from_le_bytes(bytes[..8].try_into().unwrap()), f64::from_le_bytes(bytes[8..].try_into().unwrap()));
        let want = (g.iter().map(|v| (*v as f64).powi(2)).sum::<f64>(), 0.5 * g.iter().map(|v| *v as f64).sum::<f64>());
        assert!((got.0 - want.0).abs() < 1e-4 * want.0, "Σx² {} vs {}", got.0, want.0);
        assert!((got.1 - want.1).abs() < 1e-4 * want.1.abs().max(1.0), "weighted sum {} vs {}", got.1, want.1);
    }
}

/// Vulkan lets a driver divide within 2.5 ulp and take square roots through an approximate
/// reciprocal, so the AdamW kernel rounds both itself (kernels.comp's `div_fix`, `sqrt_fix`).
/// On lavapipe the driver's results are already correctly rounded and the corrections never
/// move, so the probe kernel starts them from estimates moved up to 9 ulp away: every result must
/// still be the correctly rounded one (Rust's f32 division and square root).
#[cfg(feature = "vulkan")]
#[test]
fn vulkan_division_and_square_root_round_correctly_from_estimates_ulps_away() {
    if !testing("vulkan") {
        return;
    }
    let gpu: Rc<dyn Gpu> = match rtune::engine::gpu::vulkan::VulkanGpu::new(vulkan_ordinal()) {
        Ok(g) => Rc::new(g),
        Err(e) if std::env::var_os("RTUNE_REQUIRE_VULKAN").is_some() => panic!("no Vulkan device: {e}"),
        Err(e) => return eprintln!("no Vulkan device: {e}"),
    };
    let mut rng = Rng::new(17);
    let mut a = Vec::new();
    let mut b = Vec::new();
    // Random significands, signs and exponents over ±2^40.
    let random = |rng: &mut Rng| {
        let bits = (rng.next_u64() as u32 & 0x807f_ffff) | (((rng.next_u64() % 81) as u32 + 87) << 23);
        f32::from_bits(bits)
    };
    for _ in 0..4000 {
        a.push(random(&mut rng));
        b.push(random(&mut rng));
    }
    // Binade edges: all-ones and all-zeros significands, exact quotients and roots, results
    // next to powers of two from either side.
    let edges = [1.0f32, 2.0, 4.0, 0.25, 3.0, 9.0, 2.25, 6.0, 1.5, 7.0];
    let near_one = [f32::from_bits(0x3f7f_ffff), f32::from_bits(0x3f80_0001), f32::from_bits(0x3fff_ffff)];
    for &x in edges.iter().chain(&near_one) {
        for &y in edges.iter().chain(&near_one) {
            a.push(x);
            b.push(y);
            a.push(-x * 1024.0);
            b.push(y / 64.0);
        }
    }
    let n = a.len();
    let (ab, bb) = (Buf::from_f32(&gpu, &a, Dt::F32).unwrap(), Buf::from_f32(&gpu, &b, Dt::F32).unwrap());
    let (qb, sb) = (Buf::zeros(&gpu, n, Dt::F32).unwrap(), Buf::zeros(&gpu, n, Dt::F32).unwrap());
    for nudge in [-9, -3, -1, 0, 1, 2, 9] {
        let args = [
            Arg::Ptr(ab.ptr()),
            Arg::Ptr(bb.ptr()),
            Arg::Ptr(qb.ptr()),
            Arg::Ptr(sb.ptr()),
            Arg::I32(n as i32),
            Arg::I32(nudge),
        ];
        gpu.launch("rounding_probe", [(n as u32).div_ceil(256), 1, 1], 256, &args).unwrap();
        let (q, s) = (qb.to_vec().unwrap(), sb.to_vec().unwrap());
        for i in 0..n {
            let (want_q, want_s) = (a[i] / b[i], a[i].abs().sqrt());
            assert_eq!(
                q[i].to_bits(),
                want_q.to_bits(),
                "{} / {} from {nudge} ulp off: {} vs {want_q}",
                a[i],
                b[i],
                q[i]
            );
            assert_eq!(s[i].to_bits(), want_s.to_bits(), "√{} from {nudge} ulp off: {} vs {want_s}", a[i].abs(), s[i]);
        }
    }
}

/// The f64 accumulators (a step's loss, the squared gradient norm) on long inputs whose sums
/// every backend can form exactly — per-block f32 sums on CUDA, float-float pairs added to the
/// f64's bits with integer arithmetic on Vulkan (no `shaderFloat64` there) — so the results must
/// be the exact sums rounded once; a sum held in plain f32 over thousands of elements per
/// invocation is far off. Then rounding at the last bit, and non-finite sums.
#[test]
fn sums_into_f64_accumulators_are_exact_and_keep_non_finite_values() {
    let f64_at = |gpu: &Rc<dyn Gpu>, acc: &Buf, i: usize| {
        let mut bytes = [0u8; 8];
        gpu.download(acc.at(2 * i), &mut bytes).unwrap();
        f64::from_le_bytes(bytes)
    };
    let set = |gpu: &Rc<dyn Gpu>, acc: &Buf, i: usize, v: f64| gpu.upload(acc.at(2 * i), &v.to_le_bytes()).unwrap();
    let n = 1 << 22;
    // Multiples of 2^-12 (a weighted sum) and 2^-4 (squares: multiples of 2^-8).
    let x: Vec<f32> = (0..n).map(|i| (i % 8 + 1) as f32 + 3.0 / 4096.0).collect();
    let y: Vec<f32> = (0..n).map(|i| (i % 64) as f32 / 16.0).collect();
    let weight = -0.3f32;
    let start = 1e6 + 0.1;
    let want_scaled = start + x.iter().map(|v| *v as f64).sum::<f64>() * weight as f64;
    let want_squares = start + y.iter().map(|v| (*v as f64).powi(2)).sum::<f64>();
    for gpu in devices() {
        let o = Ops { gpu: &*gpu, dt: Dt::F32 };
        let name = gpu.name();
        let (xb, yb) = (Buf::from_f32(&gpu, &x, Dt::F32).unwrap(), Buf::from_f32(&gpu, &y, Dt::F32).unwrap());
        let acc = Buf::zeros(&gpu, 8, Dt::U32).unwrap();
        set(&gpu, &acc, 0, start);
        set(&gpu, &acc, 1, start);
        o.sum_scaled(xb.ptr(), n, weight, acc.at(0)).unwrap();
        o.sum_squares(yb.ptr(), n, acc.at(2)).unwrap();
        let (got_scaled, got_squares) = (f64_at(&gpu, &acc, 0), f64_at(&gpu, &acc, 1));
        assert!((got_scaled - want_scaled).abs() <= 1e-13 * want_scaled.abs(), "{name}: {got_scaled} vs {want_scaled}");
        assert!((got_squares - want_squares).abs() <= 1e-13 * want_squares, "{name}: {got_squares} vs {want_squares}");

        // One rounding to nearest at f64's last bit, as the CPU adds (start + v·w is exact
        // before it); an empty sum changes nothing.
        let small = Buf::from_f32(&gpu, &[1e-3], Dt::F32).unwrap();
        let cases = Buf::zeros(&gpu, 16, Dt::U32).unwrap();
        for i in 0..8 {
            let (start, v, w) = (1e9 * (i + 1) as f64 / 7.0, (i as f32 + 0.37) * 1e-3, [1.0f32, -3.0][i % 2]);
            let one = Buf::from_f32(&gpu, &[v], Dt::F32).unwrap();
            set(&gpu, &cases, i, start);
            o.sum_scaled(one.ptr(), 1, w, cases.at(2 * i)).unwrap();
            assert_eq!(f64_at(&gpu, &cases, i), start + v as f64 * w as f64, "{name}: case {i}");
        }
        set(&gpu, &acc, 0, 0.1);
        o.sum_squares(small.ptr(), 0, acc.at(0)).unwrap();
        assert_eq!(f64_at(&gpu, &acc, 0), 0.1, "{name}");

        // An infinite or NaN element makes the sum non-finite, and a non-finite accumulator
        // stays non-finite (the trainer skips such a step).
        let bad = Buf::from_f32(&gpu, &[1.0, f32::INFINITY, 2.0, 3.0], Dt::F32).unwrap();
        let nan = Buf::from_f32(&gpu, &[1.0, f32::NAN], Dt::F32).unwrap();
        for i in 0..4 {
            set(&gpu, &acc, i, 1.0);
        }
        set(&gpu, &acc, 2, f64::INFINITY);
        o.sum_squares(bad.ptr(), 4, acc.at(0)).unwrap();
        o.sum_scaled(nan.ptr(), 2, 1.0, acc.at(2)).unwrap();
        o.sum_scaled(small.ptr(), 1, 1.0, acc.at(4)).unwrap();
        o.sum_scaled(small.ptr(), 1, 1.0, acc.at(6)).unwrap();
        o.sum_scaled(small.ptr(), 1, 1.0, acc.at(6)).unwrap();
        assert_eq!(f64_at(&gpu, &acc, 0), f64::INFINITY, "{name}");
        assert!(f64_at(&gpu, &acc, 1).is_nan(), "{name}");
        assert_eq!(f64_at(&gpu, &acc, 2), f64::INFINITY, "{name}");
        assert_eq!(f64_at(&gpu, &acc, 3), 1.0 + 1e-3f32 as f64 + 1e-3f32 as f64, "{name}");
    }
}

/// Attention in f64 from the kernels' inputs: O, lse and the gradients of Σ O ⊙ dO.
#[allow(clippy::type_complexity)]
fn attention_reference(
    s: &AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    lo: &[i32],
    hi: &[i32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnShape { b, t, hq, hk, d, scale, softcap, .. } = *s;
    let rep = hq / hk;
    let qi = |bi: usize, i: usize, h: usize, j: usize| ((bi * t + i) * hq + h) * d + j;
    let ki = |bi: usize, i: usize, g: usize, j: usize| ((bi * t + i) * hk + g) * d + j;
    let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; b * hq * t]);
    let (mut dq, mut dk, mut dv) = (vec![0f64; q.len()], vec![0f64; k.len()], vec![0f64; v.len()]);
    for bi in 0..b {
        for h in 0..hq {
            let g = h / rep;
            for i in 0..t {
                let keys: Vec<usize> =
                    (0..t).filter(|&kk| lo[bi * t + i] <= kk as i32 && kk as i32 <= hi[bi * t + i]).collect();
                // Scores, capped as `c · tanh(s / c)` where the shape caps them; `grad` is the cap's
                // derivative at each.
                let raw: Vec<f64> = keys
                    .iter()
                    .map(|&kk| {
                        (0..d).map(|j| q[qi(bi, i, h, j)] as f64 * k[ki(bi, kk, g, j)] as f64).sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let c = softcap.map(f64::from);
                let sc: Vec<f64> = raw.iter().map(|&x| c.map_or(x, |c| c * (x / c).tanh())).collect();
                let grad: Vec<f64> = sc.iter().map(|&y| c.map_or(1.0, |c| 1.0 - (y / c).powi(2))).collect();
                let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                lse[(bi * hq + h) * t + i] = if keys.is_empty() { f32::INFINITY } else { (m + z.ln()) as f32 };
                let p: Vec<f64> = sc.iter().map(|x| (x - m).exp() / z).collect();
                for j in 0..d {
                    o[qi(bi, i, h, j)] =
                        keys.iter().zip(&p).map(|(&kk, p)| p * v[ki(bi, kk, g, j)] as f64).sum::<f64>() as f32;
                }
                let dp: Vec<f64> = keys
                    .iter()
                    .map(|&kk| (0..d).map(|j| dout[qi(bi, i, h, j)] as f64 * v[ki(bi, kk, g, j)] as f64).sum())
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                for (n, &kk) in keys.iter().enumerate() {
                    let ds = p[n] * (dp[n] - delta) * grad[n];
                    for j in 0..d {
                        dq[qi(bi, i, h, j)] += ds * k[ki(bi, kk, g, j)] as f64 * scale as f64;
                        dk[ki(bi, kk, g, j)] += ds * q[qi(bi, i, h, j)] as f64 * scale as f64;
                        dv[ki(bi, kk, g, j)] += p[n] * dout[qi(bi, i, h, j)] as f64;
                    }
                }
            }
        }
    }
    let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect();
    (o, lse, f(dq), f(dk), f(dv))
}

#[test]
fn attention_kernels_match_a_reference_on_packed_and_padded_rows() {
    for gpu in devices() {
        // Where a device must have matrix units, attention runs there too (and has passed its
        // first-use check against the scalar kernels).
        if gpu.cpu_lanes().is_none() {
            for dt in required_matrix_units() {
                assert!(gpu.tensor_core_attention(dt), "{}: {dt:?} attention is not on the matrix units", gpu.name());
            }
        }
        // Products in chunks of 48 query rows: the row of 150 takes four, the last partial.
        let (tc, products, chunks) =
            (AttnKernels::TensorCores, AttnKernels::Products { rows: 0 }, AttnKernels::Products { rows: 48 });
        // Capped scores (Gemma 2's cap, here 2 so that it bends most of them): the scalar kernels
        // and products take the cap; asked for the tensor cores, capped attention runs elsewhere.
        let cap = Some(2.0);
        check_attention(
            &gpu,
            &[
                (Dt::F32, 16, AttnKernels::Scalar, None),
                (Dt::Bf16, 64, AttnKernels::Scalar, None),
                (Dt::Bf16, 64, tc, None),
                (Dt::F16, 64, tc, None),
                (Dt::F16, 128, tc, None),
                (Dt::Bf16, 128, tc, None),
                (Dt::F32, 16, products, None),
                (Dt::F32, 16, chunks, None),
                (Dt::Bf16, 64, chunks, None),
                (Dt::F16, 128, products, None),
                (Dt::F32, 16, AttnKernels::Scalar, cap),
                (Dt::Bf16, 64, AttnKernels::Scalar, cap),
                (Dt::F32, 16, chunks, cap),
                (Dt::Bf16, 64, products, cap),
                (Dt::F16, 64, tc, cap),
            ],
        );
    }
}

/// [`attention_kernels_match_a_reference_on_packed_and_padded_rows`] on `gpu` for (compute
/// type, head size, kernels) `cases`.
fn check_attention(gpu: &Rc<dyn Gpu>, cases: &[(Dt, usize, AttnKernels, Option<f32>)]) {
    // Two rows of 37: two packed documents, and one padded after 29 tokens; and one row longer
    // than the tensor-core kernels' blocks of 64 queries and tiles of 32 keys, padded after 140.
    let segs = vec![(0..37).map(|i| (i >= 15) as u16).collect::<Vec<_>>(), vec![0; 29]];
    let batches = [
        (37, rtune::model::batch::attention_layout(37, &[37, 29], Some(&segs))),
        (150, rtune::model::batch::attention_layout(150, &[140], None)),
    ];
    for (&(dt, d, kernels, softcap), (t, layout)) in cases.iter().flat_map(|c| batches.iter().map(move |b| (c, b))) {
        let t = *t;
        let b = layout.lo.len() / t;
        let s = AttnShape { b, t, hq: 4, hk: 2, d, scale: 1.0 / (d as f32).sqrt(), softcap, kernels };
        let o = Ops { gpu: &**gpu, dt };
        let mut rng = Rng::new(d as u64);
        let nq = s.b * t * s.hq * d;
        let nk = s.b * t * s.hk * d;
        let q = rounded(dt, &rand_vec(&mut rng, nq, 1.5));
        let k = rounded(dt, &rand_vec(&mut rng, nk, 1.5));
        let v = rounded(dt, &rand_vec(&mut rng, nk, 1.0));
        let dout = rounded(dt, &rand_vec(&mut rng, nq, 1.0));
        let bufs = AttnBufs::new(gpu, &s, dt, (&q, &k, &v, &dout), layout).unwrap();
        bufs.fwd(&o, &s).unwrap();
        let (want_o, want_lse, want_dq, want_dk, want_dv) =
            attention_reference(&s, &q, &k, &v, &dout, &layout.lo, &layout.hi);
        let what = format!("{}: {dt:?} d={d} t={t} {kernels:?} cap {softcap:?}", gpu.name());
        // The training log's account names the kernels asked for where they ran.
        let account = s.account(dt, &**gpu);
        match kernels {
            // 0: as many rows as fit (here all of them).
            AttnKernels::Products { rows } => assert_eq!(
                account,
                format!(
                    "attention through matrix products ({} query rows at a time)",
                    if rows == 0 { t } else { rows.min(t) }
                ),
                "{what}"
            ),
            AttnKernels::TensorCores if gpu.tensor_core_attention(dt) && softcap.is_none() => {
                assert_eq!(account, "attention on the matrix units", "{what}")
            }
            _ => assert!(
                account == "attention on the scalar kernels"
                    || account.starts_with("attention on the per-lane kernels"),
                "{what}: {account}"
            ),
        }
        assert_close(&format!("{what} O"), &bufs.out.to_vec().unwrap(), &want_o, tol(dt));
        assert_close(&format!("{what} lse"), &bufs.lse.to_vec().unwrap(), &want_lse, 1e-3);
        bufs.bwd(&o, &s).unwrap();
        let (dq, dk, dv) = (&bufs.dq, &bufs.dk, &bufs.dv);
        assert_close(&format!("{what} dQ"), &dq.to_vec().unwrap(), &want_dq, tol(dt) * 2.0);
        assert_close(&format!("{what} dK"), &dk.to_vec().unwrap(), &want_dk, tol(dt) * 2.0);
        assert_close(&format!("{what} dV"), &dv.to_vec().unwrap(), &want_dv, tol(dt) * 2.0);
    }
}

/// Products large enough to have their tile timed (here any: `with_tuning_from(0)`) time every
/// tile once per shape, into scratch memory, keep the fastest, and compute what the reference does
/// ([`check_products`]) — C's prior values (β ≠ 0) untouched by the timing runs. On a Vulkan
/// device with f16 matrix units (required where `RTUNE_REQUIRE_MATRIX_UNITS` names f16).
#[cfg(feature = "vulkan")]
#[test]
fn products_time_their_tile_once_per_shape_and_keep_c() {
    if !testing("vulkan") {
        return;
    }
    if std::env::var_os("RTUNE_VULKAN_GEMM_TILE").is_some() {
        return eprintln!("RTUNE_VULKAN_GEMM_TILE forces a tile: nothing is timed");
    }
    let gpu = match rtune::engine::gpu::vulkan::VulkanGpu::new(vulkan_ordinal()) {
        Ok(g) => g.with_gpu_kernels().with_tuning_from(0),
        Err(e) if std::env::var_os("RTUNE_REQUIRE_VULKAN").is_some() => panic!("no Vulkan device: {e}"),
        Err(e) => return eprintln!("no Vulkan device: {e}"),
    };
    if gpu.matrix_shape(Dt::F16).unwrap().is_none() {
        assert!(!required_matrix_units().contains(&Dt::F16), "{}: no f16 matrix units", gpu.name());
        return eprintln!("{}: no f16 matrix units", gpu.name());
    }
    let vk = Rc::new(gpu);
    check_products(&(vk.clone() as Rc<dyn Gpu>), &[(Dt::F16, Dt::F32), (Dt::F16, Dt::F16)]);
    // One of check_products' shapes, x·Wᵀ with β = 0.5.
    assert!(vk.product_tile(Dt::F16, Dt::F32, [130, 129, 70], false, true).is_some(), "{}: no tile kept", vk.name());
}

/// A Vulkan device whose f16 matrix units run with `shape`, a shape that GPUs list and CI's
/// lavapipe does not (it lists 8 × 8 × 8 but lowers any shape), set up by `how`, with its
/// products' first-use check run; `None` (said why) where there is none to test. Runs on a CPU
/// implementation of Vulkan with f16 matrix units (required where `RTUNE_REQUIRE_MATRIX_UNITS`
/// names f16); a GPU runs its own shape, in the tests above (and here too if it is this one).
#[cfg(feature = "vulkan")]
fn matrix_unit_device(
    shape: [u32; 3],
    how: impl FnOnce(rtune::engine::gpu::vulkan::VulkanGpu) -> rtune::engine::gpu::vulkan::VulkanGpu,
) -> Option<rtune::engine::gpu::vulkan::VulkanGpu> {
    if !testing("vulkan") {
        return None;
    }
    let gpu = match rtune::engine::gpu::vulkan::VulkanGpu::new(vulkan_ordinal()) {
        Ok(g) => how(g.with_gpu_kernels().with_matrix_shape(Dt::F16, shape)),
        Err(e) if std::env::var_os("RTUNE_REQUIRE_VULKAN").is_some() => panic!("no Vulkan device: {e}"),
        Err(e) => {
            eprintln!("no Vulkan device: {e}");
            return None;
        }
    };
    match gpu.matrix_shape(Dt::F16).unwrap() {
        Some(s) if s == shape => Some(gpu),
        Some(s) => {
            eprintln!("{} runs f16 matrix units with its own shape {s:?}, tested above", gpu.name());
            None
        }
        None if required_matrix_units().contains(&Dt::F16) => {
            panic!("{}: no f16 matrix units, or they failed their check with shape {shape:?}", gpu.name())
        }
        None => {
            eprintln!("{}: no f16 matrix units", gpu.name());
            None
        }
    }
}

/// The matrix-unit kernels (`gemm_cm`, `attn_*_mma`) with matrix shape `shape`
/// ([`matrix_unit_device`]): products (every tile the device offers) and attention in f16
/// against the references.
#[cfg(feature = "vulkan")]
fn matrix_unit_kernels_with_shape(shape: [u32; 3]) {
    let Some(gpu) = matrix_unit_device(shape, |g| g) else { return };
    assert!(
        !gpu.first_form_products(Dt::F16),
        "{}: the product kernel failed its check with shape {shape:?}",
        gpu.name()
    );
    // The matrix loads the attention kernels rely on, probed alone (what a failed attention check
    // on a driver reports): row-major, and column-major as QKᵀ reads K.
    assert_eq!(gpu.matrix_load_probe(Dt::F16).unwrap(), None, "{}: matrix loads with shape {shape:?}", gpu.name());
    let gpu: Rc<dyn Gpu> = Rc::new(gpu);
    assert!(gpu.tensor_core_attention(Dt::F16), "{}: f16 attention with shape {shape:?} failed its check", gpu.name());
    // The training log's account of what ran.
    let [m, n, k] = shape;
    assert_eq!(gpu.products_account(Dt::F16), format!("products on the matrix units (gemm_cm, {m}×{n}×{k} f16)"));
    assert!(gpu.products_account(Dt::F32).contains("(gemm: no f32 matrix units)"), "{}", gpu.products_account(Dt::F32));
    check_products(&gpu, &[(Dt::F16, Dt::F32), (Dt::F16, Dt::F16)]);
    let tc = AttnKernels::TensorCores;
    check_attention(
        &gpu,
        &[(Dt::F16, 64, tc, None), (Dt::F16, 128, tc, None), (Dt::F16, 64, AttnKernels::Products { rows: 48 }, None)],
    );
}

// Every matrix-unit kernel as written is a long compile on lavapipe (up to a minute and more
// each, nearly all of it in LLVM; CI compiles them with their loops rolled, seconds each:
// `RTUNE_VULKAN_ROLL_LOOPS`), so these tests are ordered for CI's two cores — libtest starts them
// in name order, so the Intel test starts beside NVIDIA's first, and the short ones follow — and
// the `_rows` test, which tests attention, runs the products with one tile.

/// Intel's shape: deeper than it is tall.
#[cfg(feature = "vulkan")]
#[test]
fn matrix_unit_kernels_match_references_with_intel_8x8x16_tiles() {
    matrix_unit_kernels_with_shape([8, 8, 16]);
}

/// NVIDIA's and AMD's shape, with every tile.
#[cfg(feature = "vulkan")]
#[test]
fn matrix_unit_kernels_match_references_with_nvidia_16x16x16_tiles() {
    matrix_unit_kernels_with_shape([16, 16, 16]);
}

/// The attention kernels' `_rows` form, which a driver whose column-major loads are wrong gets
/// (NVIDIA's shape; the form's staging does not depend on it); and where the direct form fails its
/// check for a reason the load probe does not see, the check tries the `_rows` form, which then
/// stands in. The products, which are not what this tests, with one tile.
#[cfg(feature = "vulkan")]
#[test]
fn matrix_unit_kernels_match_references_with_nvidia_16x16x16_tiles_in_the_rows_form() {
    let shape = [16, 16, 16];
    let Some(rows) = matrix_unit_device(shape, |g| g.with_row_loads().with_gemm_tile([32, 32])) else { return };
    let rows: Rc<dyn Gpu> = Rc::new(rows);
    let tc = AttnKernels::TensorCores;
    assert!(rows.tensor_core_attention(Dt::F16), "{}: the `_rows` attention failed its check", rows.name());
    check_attention(&rows, &[(Dt::F16, 64, tc, None), (Dt::F16, 128, tc, None)]);
    let Some(fallback) = matrix_unit_device(shape, |g| g.with_direct_attention_rejected().with_gemm_tile([32, 32]))
    else {
        return;
    };
    let fallback: Rc<dyn Gpu> = Rc::new(fallback);
    assert!(
        fallback.tensor_core_attention(Dt::F16),
        "{}: with the direct form rejected, the `_rows` form did not stand in",
        fallback.name()
    );
    check_attention(&fallback, &[(Dt::F16, 64, tc, None)]);
}

/// Where the products' current kernel fails its check, its first form stands in.
#[cfg(feature = "vulkan")]
#[test]
fn matrix_unit_kernels_match_references_with_nvidia_16x16x16_tiles_in_the_products_first_form() {
    let Some(first) = matrix_unit_device([16, 16, 16], |g| g.with_current_products_rejected()) else { return };
    assert!(first.first_form_products(Dt::F16), "{}: the products did not switch to the first form", first.name());
    assert!(first.products_account(Dt::F16).contains("first form (gemm_cm1"), "{}", first.products_account(Dt::F16));
    check_products(&(Rc::new(first) as Rc<dyn Gpu>), &[(Dt::F16, Dt::F32), (Dt::F16, Dt::F16)]);
}

// ---------------------------------------------------------------------------------------------
// The engine against candle's autograd.

fn resolution(dtype: Dtype, class: DeviceClass) -> Resolution {
    Resolution { class, ordinal: 0, dtype, ..Resolution::cpu() }
}

fn setup<'a>(
    folder: &'a ModelFolder,
    trainable: Trainable,
    device: &'a Resolution,
    trained: Option<&'a Path>,
) -> Setup<'a> {
    Setup {
        folder,
        trainable,
        seed: 1,
        device,
        optimizer: Some(AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }),
        ema_decay: None,
        checkpointing: Checkpointing::Off,
        trained,
        max_batch: (4, 32),
        tf32: false,
        engine: None,
        base_quant: None,
    }
}

fn golden_batch(name: &str) -> HostBatch {
    golden(name).host_batch()
}

/// Loss and every gradient of the GPU engine against candle autograd's, for the same batch,
/// weight, loss scale and dropout key, with the LoRA adapter of `adapter`.
fn assert_engine_matches(
    gpu: &Rc<dyn Gpu>,
    folder: &ModelFolder,
    adapter: &Path,
    batch: &HostBatch,
    dropout: Option<u64>,
    dt: Dtype,
    tol: f32,
) {
    let spec = peft::read_config(adapter).unwrap();
    assert_trainable_matches(gpu, folder, Trainable::lora(spec), Some(adapter), batch, dropout, dt, tol);
}

/// [`assert_engine_matches`] for what `trainable` names (`trained`: the folder it starts from).
#[allow(clippy::too_many_arguments)]
fn assert_trainable_matches(
    gpu: &Rc<dyn Gpu>,
    folder: &ModelFolder,
    trainable: Trainable,
    trained: Option<&Path>,
    batch: &HostBatch,
    dropout: Option<u64>,
    dt: Dtype,
    tol: f32,
) {
    assert_base_matches(gpu, folder, trainable, trained, None, batch, dropout, dt, tol);
}

/// [`assert_trainable_matches`] over a base held as `base_quant` says.
#[allow(clippy::too_many_arguments)]
fn assert_base_matches(
    gpu: &Rc<dyn Gpu>,
    folder: &ModelFolder,
    trainable: Trainable,
    trained: Option<&Path>,
    base_quant: Option<BaseQuant>,
    batch: &HostBatch,
    dropout: Option<u64>,
    dt: Dtype,
    tol: f32,
) {
    let cpu = Resolution::cpu();
    let reference_setup = Setup { base_quant, ..setup(folder, trainable.clone(), &cpu, trained) };
    let mut reference = CandleEngine::build(&reference_setup).unwrap();
    let dev = resolution(dt, DeviceClass::Cuda);
    let engine_setup = Setup { base_quant, ..setup(folder, trainable.clone(), &dev, trained) };
    let mut engine = GpuEngine::new(gpu.clone(), &engine_setup).unwrap();
    let what = format!("{} {dt:?} {trainable:?} {base_quant:?}", gpu.name());
    let (weight, scale) = (0.75, 4.0);
    reference.accumulate(batch, weight, scale, dropout).unwrap();
    engine.accumulate(batch, weight, scale, dropout).unwrap();
    let want = reference.gradient_values().unwrap();
    let got = engine.gradient_values().unwrap();
    let (want_loss, want_norm) = reference.gradients().unwrap();
    let (loss, norm) = engine.gradients().unwrap();
    assert!((loss - want_loss).abs() <= tol as f64 * want_loss.abs(), "{what}: loss {loss} vs autograd {want_loss}");
    assert!((norm - want_norm).abs() <= 4.0 * tol as f64 * want_norm, "{what}: gradient norm {norm} vs {want_norm}");
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{what}: the same parameters");
    for (name, w) in &want {
        let w: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let g: Vec<f32> = got[name].flatten_all().unwrap().to_vec1().unwrap();
        assert!(w.iter().any(|v| *v != 0.0), "{name}: zero gradient in the reference");
        assert_close(&format!("{what} gradient of {name}"), &g, &w, tol * 5.0);
    }
    let eval_want = reference.loss(batch).unwrap();
    let eval = engine.loss(batch).unwrap();
    assert!((eval - eval_want).abs() <= tol as f64 * eval_want.abs(), "{what}: eval loss {eval} vs {eval_want}");
}

#[test]
fn engine_matches_autograd_on_the_golden_models() {
    // Llama with llama3 rope scaling and GQA; Qwen2 with q/k/v biases and tied embeddings;
    // Qwen3 with head norms (one of each trained in its `modules_to_save`) and wide heads.
    for gpu in devices() {
        for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
            let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
            let batch = golden_batch(name);
            // PEFT's plain adapter, and one with `modules_to_save` (base weights replaced).
            for adapter in ["adapter", "adapter-modules"] {
                assert_engine_matches(&gpu, &folder, &fixture(name).join(adapter), &batch, None, Dtype::F32, 2e-5);
            }
        }
    }
}

/// QLoRA: the decoder's linears in 4 bits, dequantized on the device before each product that
/// reads them (under double quantization, their block scales first), give the loss and every
/// adapter gradient of candle's autograd over the same 4-bit weights (itself checked against
/// PEFT over bitsandbytes in tests/model.rs), in f32, bf16 and f16, with PEFT's adapter and with
/// every linear and the (unquantized) LM head adapted.
#[test]
fn qlora_engine_matches_autograd_over_the_4bit_base() {
    let folder = ModelFolder::open(&fixture("tiny-qlora").join("model")).unwrap();
    let batch = golden_batch("tiny-qlora");
    let nf4 = Some(BaseQuant::Nf4);
    let every = all_targets_adapter(&folder, 0.0, false);
    for gpu in devices() {
        for adapter in [fixture("tiny-qlora").join("adapter"), every.path().to_path_buf()] {
            let lora = Trainable::lora(peft::read_config(&adapter).unwrap());
            // bf16 over a 4-bit base: the gradients' largest errors are 0.074 of their largest
            // values with the scalar attention kernels (layer 1's k_proj lora_B on lavapipe), 0.104
            // where attention goes through products, which round the probabilities to bf16 as
            // FlashAttention and the tensor-core kernels do (the attention test above finds
            // that rounding alone at 0.3–0.4%, twice the scalar kernels'): 2.5e-2 × 5 holds both.
            for (dt, tol) in [(Dtype::F32, 2e-5), (Dtype::Bf16, 2.5e-2), (Dtype::F16, 5e-3)] {
                for quant in [BaseQuant::Nf4, BaseQuant::Nf4Dq] {
                    assert_base_matches(
                        &gpu,
                        &folder,
                        lora.clone(),
                        Some(&adapter),
                        Some(quant),
                        &batch,
                        None,
                        dt,
                        tol,
                    );
                }
            }
        }
        // The step needs less memory with the packed 4-bit weights (and one dequantized at a time).
        let dev = resolution(Dtype::F16, DeviceClass::Cuda);
        let lora = || Trainable::lora(peft::read_config(&fixture("tiny-qlora").join("adapter")).unwrap());
        let dense = GpuEngine::new(gpu.clone(), &setup(&folder, lora(), &dev, None)).unwrap();
        let quantized = GpuEngine::new(gpu.clone(), &Setup { base_quant: nf4, ..setup(&folder, lora(), &dev, None) });
        let (dense, quantized) = (dense.memory_estimate(1, 1, false).unwrap().0, quantized.unwrap());
        let quantized = quantized.memory_estimate(1, 1, false).unwrap().0;
        assert!(quantized < dense, "{}: 4-bit base {quantized} bytes vs {dense}", gpu.name());
    }
}

/// A PEFT folder with every projection and the LM head adapted, random B (so every A gets a
/// gradient), dropout `p`, and rsLoRA's scale where `rslora`.
fn all_targets_adapter(folder: &ModelFolder, p: f64, rslora: bool) -> tempfile::TempDir {
    let targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
        .map(String::from)
        .to_vec();
    let spec = LoraSpec { rank: 4, alpha: 8.0, rslora, dropout: p, targets };
    let cpu = Resolution::cpu();
    let engine = CandleEngine::build(&setup(folder, Trainable::lora(spec.clone()), &cpu, None)).unwrap();
    let mut rng = Rng::new(9);
    let values: BTreeMap<String, Tensor> = engine
        .model()
        .params
        .iter()
        .map(|par| {
            let v = rand_vec(&mut rng, par.var.elem_count(), 0.1);
            (par.name.clone(), Tensor::from_vec(v, par.var.shape(), &Device::Cpu).unwrap())
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    peft::write(dir.path(), &spec, &values, "", folder).unwrap();
    dir
}

fn packed_batch() -> HostBatch {
    // Row 0: two packed documents; row 1: padded; row 2: one full document.
    let rows: Vec<Vec<u32>> = vec![
        (0..20).map(|i| (i * 7 + 3) % 128).collect(),
        (0..12).map(|i| (i * 5 + 1) % 128).chain([0; 8]).collect(),
        (0..20).map(|i| (i * 11 + 2) % 128).collect(),
    ];
    let lens = [20, 12, 20];
    let segs: Vec<Vec<u16>> = vec![(0..20).map(|i| (i >= 9) as u16).collect(), vec![0; 20], vec![0; 20]];
    let (mut select, mut tgt) = (Vec::new(), Vec::new());
    for (r, row) in rows.iter().enumerate() {
        for j in 1..lens[r] {
            if segs[r][j] == segs[r][j - 1] && j % 3 != 0 {
                select.push((r * 20 + j - 1) as u32);
                tgt.push(row[j]);
            }
        }
    }
    HostBatch::from_parts(&rows, &lens, Some(&segs), select, tgt)
}

#[test]
fn engine_matches_autograd_with_packing_padding_dropout_and_lm_head() {
    let folder = ModelFolder::open(&fixture("tiny-qwen2").join("model")).unwrap();
    let batch = packed_batch();
    for gpu in devices() {
        for (p, rslora) in [(0.0, false), (0.1, false), (0.0, true)] {
            let adapter = all_targets_adapter(&folder, p, rslora);
            assert_engine_matches(&gpu, &folder, adapter.path(), &batch, (p > 0.0).then_some(42), Dtype::F32, 2e-5);
        }
    }
}

#[test]
fn half_precision_engine_stays_within_its_rounding_of_autograd() {
    let folder = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let batch = golden_batch("tiny-llama");
    for gpu in devices() {
        // bf16 keeps 8 bits of mantissa: each rounding is within 2⁻⁹ relative, and a few dozen
        // roundings in a row stay within about 1% (the f32 reference has none of them); f16 keeps
        // 11 bits, 8× closer. (With cooperative matrices, the products run on matrix units.)
        for (dtype, tol) in [(Dtype::Bf16, 2e-2), (Dtype::F16, 5e-3)] {
            assert_engine_matches(&gpu, &folder, &fixture("tiny-llama").join("adapter"), &batch, None, dtype, tol);
        }
    }
}

/// Base weights that train (a full fine-tune, and a selective one) get the loss and every
/// gradient autograd gives them: matrices (the LM head's too), RMSNorm weights, q/k/v biases and
/// the embedding table, tied to the LM head in Qwen2 and Qwen3 (so its gradient sums both uses)
/// and not in Llama, Qwen3's head norms; packed rows repeat tokens, whose embedding rows sum
/// their gradients.
#[test]
fn engine_matches_autograd_training_base_weights() {
    let all = || Trainable::weights(vec!["*".into()]);
    let some = || {
        Trainable::weights(
            [
                "*.input_layernorm.*",
                "*.1.self_attn.[qv]_proj.*",
                "*.0.self_attn.k_norm.*",
                "model.norm.weight",
                "lm_head.weight",
            ]
            .map(String::from)
            .to_vec(),
        )
    };
    for gpu in devices() {
        for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
            let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
            let batch = golden_batch(name);
            for trainable in [all(), some()] {
                assert_trainable_matches(&gpu, &folder, trainable, None, &batch, None, Dtype::F32, 2e-5);
            }
        }
        let folder = ModelFolder::open(&fixture("tiny-qwen2").join("model")).unwrap();
        assert_trainable_matches(&gpu, &folder, all(), None, &packed_batch(), None, Dtype::F32, 2e-5);
        for name in ["tiny-llama", "tiny-qwen3"] {
            let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
            let batch = golden_batch(name);
            for (dtype, tol) in [(Dtype::Bf16, 2e-2), (Dtype::F16, 5e-3)] {
                assert_trainable_matches(&gpu, &folder, all(), None, &batch, None, dtype, tol);
            }
        }
    }
}

/// Gemma 3 on the GPU engine (the golden tiny-gemma3: GELU gate, `1 + w` norms after attention
/// and the MLP as well as before, √hidden embeddings, query/key norms, scores scaled by
/// `query_pre_attn_scalar` 12 (not the head size 16), local layers with a window of 3 and their own
/// rotary base, the global one scaled linearly): loss and every gradient against candle's
/// autograd (itself checked against transformers and PEFT in tests/model.rs) with PEFT's adapter,
/// in a full fine-tune (every norm and the scaled embedding tied to the LM head), on packed rows
/// whose documents the windows cut too, with an adapter on every linear and dropout, and in bf16
/// and f16 within their rounding.
#[test]
fn gemma3_engine_matches_autograd() {
    assert_gemma_matches("tiny-gemma3");
}

/// The Gemma checks of [`gemma3_engine_matches_autograd`] on the golden fixture `name`: PEFT's
/// adapter, a full fine-tune on the golden and on packed rows, an adapter on every linear with
/// dropout on packed rows, and bf16 and f16.
fn assert_gemma_matches(name: &str) {
    let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
    let adapter = fixture(name).join("adapter");
    let batch = golden_batch(name);
    let all = || Trainable::weights(vec!["*".into()]);
    for gpu in devices() {
        assert_engine_matches(&gpu, &folder, &adapter, &batch, None, Dtype::F32, 2e-5);
        assert_trainable_matches(&gpu, &folder, all(), None, &batch, None, Dtype::F32, 2e-5);
        assert_trainable_matches(&gpu, &folder, all(), None, &packed_batch(), None, Dtype::F32, 2e-5);
        let every = all_targets_adapter(&folder, 0.1, false);
        assert_engine_matches(&gpu, &folder, every.path(), &packed_batch(), Some(42), Dtype::F32, 2e-5);
        for (dtype, tol) in [(Dtype::Bf16, 2e-2), (Dtype::F16, 5e-3)] {
            assert_engine_matches(&gpu, &folder, &adapter, &batch, None, dtype, tol);
        }
    }
}

/// Gemma 2 on the GPU engine (the golden tiny-gemma2: every other layer local, its tanh caps on
/// attention scores and logits, GELU gate and `1 + w` norms around attention and the MLP):
/// loss and every gradient against candle's autograd (itself checked against transformers and
/// PEFT in tests/model.rs) with PEFT's adapter, in a full fine-tune, on packed rows (with an
/// adapter on every linear and dropout too), and in bf16 and f16 within their rounding — the caps
/// on the scalar kernels and, where the device prefers them, through products.
#[test]
fn gemma2_engine_matches_autograd() {
    let folder = ModelFolder::open(&fixture("tiny-gemma2").join("model")).unwrap();
    assert_eq!(rtune::engine::gpu::model_unsupported(&folder.config), None);
    let spec = rtune::model::Spec::of(&folder.config);
    assert!(spec.final_softcap.is_some() && spec.layers.iter().all(|l| l.attention.softcap.is_some()));
    assert_gemma_matches("tiny-gemma2");
}

/// A LoRA adapter and base weights together (PEFT's `modules_to_save`): the adapter of the
/// golden fixtures (every projection) and the weights no adapter sits on — norms, the LM head
/// (Llama), the embedding (tied to the LM head in Qwen2, so its gradient sums both uses) — get
/// autograd's loss and gradients, in f32 and bf16.
#[test]
fn engine_matches_autograd_training_an_adapter_and_base_weights() {
    for gpu in devices() {
        for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
            let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
            let adapter = fixture(name).join("adapter");
            let weights = ["*norm*", "lm_head.weight", "model.embed_tokens.weight"].map(String::from).to_vec();
            let trainable = Trainable { lora: Some(peft::read_config(&adapter).unwrap()), weights };
            let batch = golden_batch(name);
            for (dtype, tol) in [(Dtype::F32, 2e-5), (Dtype::Bf16, 2e-2)] {
                assert_trainable_matches(&gpu, &folder, trainable.clone(), Some(&adapter), &batch, None, dtype, tol);
            }
        }
    }
}

/// A weight cannot train in full and carry an adapter at once (PEFT has no such module): both
/// engines say which weight and which target, for a linear's own weight and for the embedding
/// a tied LM head shares.
#[test]
fn an_adapter_on_a_weight_that_trains_in_full_is_an_error() {
    let gpu = devices().remove(0);
    let (cpu, dev) = (Resolution::cpu(), resolution(Dtype::F32, DeviceClass::Cuda));
    let spec = |targets: &[&str]| LoraSpec {
        rank: 2,
        alpha: 4.0,
        rslora: false,
        dropout: 0.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
    };
    let cases = [
        (
            "tiny-llama",
            spec(&["q_proj", "v_proj"]),
            "*.1.self_attn.v_proj.weight",
            "`model.layers.1.self_attn.v_proj.weight`",
            "`v_proj`",
        ),
        (
            "tiny-qwen2",
            spec(&["q_proj"]),
            "*.0.self_attn.q_proj.bias",
            "`model.layers.0.self_attn.q_proj.bias`",
            "`q_proj`",
        ),
        ("tiny-qwen2", spec(&["lm_head"]), "model.embed_tokens.weight", "`model.embed_tokens.weight`", "`lm_head`"),
    ];
    for (name, lora, pattern, weight, target) in cases {
        let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
        let trainable = Trainable { lora: Some(lora), weights: vec![pattern.to_string()] };
        let err = GpuEngine::new(gpu.clone(), &setup(&folder, trainable.clone(), &dev, None)).err().expect("an error");
        let candle = CandleEngine::build(&setup(&folder, trainable, &cpu, None)).err().expect("an error");
        for msg in [err.to_string(), candle.to_string()] {
            assert!(
                msg.contains(weight) && msg.contains(target) && msg.contains("trains in full"),
                "{name} {pattern}: {msg}"
            );
        }
    }
}

/// What a run that trained an adapter and base weights saves — a PEFT folder whose
/// `modules_to_save` hold the base weights, whole (a bias that did not train too) and, for a tied
/// embedding, with the LM head beside it — is what evaluation, exports and later stages load: the
/// same loss on both engines as the engine that trained it.
#[test]
fn an_adapter_saved_with_base_weights_loads_as_it_trained() {
    let gpu = devices().remove(0);
    let batches = [golden_batch("tiny-qwen2"), packed_batch()];
    let folder = ModelFolder::open(&fixture("tiny-qwen2").join("model")).unwrap();
    let adapter = fixture("tiny-qwen2").join("adapter");
    let spec = peft::read_config(&adapter).unwrap();
    let weights =
        ["model.norm.weight", "model.embed_tokens.weight", "*.1.self_attn.k_proj.weight"].map(String::from).to_vec();
    let mut spec_no_k = spec.clone();
    spec_no_k.targets.retain(|t| t != "k_proj");
    let trainable = Trainable { lora: Some(spec_no_k.clone()), weights };
    let cpu = Resolution::cpu();
    let mut engine = CandleEngine::build(&setup(&folder, trainable, &cpu, None)).unwrap();
    train_steps(&mut engine, &batches, 3);
    let dir = tempfile::tempdir().unwrap();
    peft::write(dir.path(), &spec_no_k, &engine.trained().unwrap(), "base", &folder).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        config["modules_to_save"],
        serde_json::json!(["lm_head", "model.embed_tokens", "model.layers.1.self_attn.k_proj", "model.norm"])
    );
    assert_eq!(config["ensure_weight_tying"], true);
    let saved = candle_core::safetensors::load(dir.path().join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    let key = |n: &str| format!("base_model.model.{n}");
    let same = |a: &Tensor, b: &Tensor| (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(same(&saved[&key("lm_head.weight")], &saved[&key("model.embed_tokens.weight")]), 0.0);
    let trained_embed = &engine.trained().unwrap()["model.embed_tokens.weight"];
    assert_eq!(same(&saved[&key("model.embed_tokens.weight")], trained_embed), 0.0);
    // The k_proj module whole: its weight trained, its bias as the base has it.
    assert!(saved.contains_key(&key("model.layers.1.self_attn.k_proj.weight")));
    assert!(saved.contains_key(&key("model.layers.1.self_attn.k_proj.bias")));
    let want = engine.loss(&batches[1]).unwrap();
    let evaluation = Trainable::lora(peft::read_config(dir.path()).unwrap());
    let mut candle = CandleEngine::build(&setup(&folder, evaluation.clone(), &cpu, Some(dir.path()))).unwrap();
    let dev = resolution(Dtype::F32, DeviceClass::Cuda);
    let mut on_gpu = GpuEngine::new(gpu, &setup(&folder, evaluation, &dev, Some(dir.path()))).unwrap();
    let base = CandleEngine::build(&setup(&folder, Trainable::nothing(), &cpu, None)).unwrap().loss(&batches[1]);
    assert!((base.unwrap() - want).abs() > 1e-3, "training changed the loss");
    for (what, got) in
        [("candle", candle.loss(&batches[1]).unwrap()), ("GPU engine", on_gpu.loss(&batches[1]).unwrap())]
    {
        assert!((got - want).abs() <= 1e-5 * want, "{what}: {got} after loading vs {want} as trained");
    }
}

/// A pattern that names none of the model's weights is an error (on the GPU engine and candle's
/// autograd alike), not a run that trains nothing.
#[test]
fn training_no_weight_is_an_error() {
    let folder = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let dev = resolution(Dtype::F32, DeviceClass::Cuda);
    let gpu = devices().remove(0);
    let trainable = Trainable::weights(vec!["layers.0.*".into()]);
    let err = GpuEngine::new(gpu, &setup(&folder, trainable.clone(), &dev, None)).err().expect("an error");
    let cpu = Resolution::cpu();
    let candle = CandleEngine::build(&setup(&folder, trainable, &cpu, None)).err().expect("an error");
    for msg in [err.to_string(), candle.to_string()] {
        assert!(msg.contains("matches none of the model's weights") && msg.contains("\"layers.0.*\""), "{msg}");
    }
}

/// Trained weights beyond the device's largest allocation (4 GiB on some Vulkan drivers) are
/// cut at weight boundaries into buffers that each fit: a full fine-tune over several buffers
/// trains as over one (losses, weights, optimizer state; the gradient norm's partial sums only
/// group differently), and one weight larger than an allocation is a clear error naming it.
/// On the emulator with a small limit; a Vulkan driver's own refusal where its limit is below its
/// memory.
#[test]
fn trained_weights_beyond_the_largest_allocation_are_split_over_buffers() {
    let folder = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let dev = resolution(Dtype::F32, DeviceClass::Cuda);
    let emu = Rc::new(EmuGpu::default());
    let gpu: Rc<dyn Gpu> = emu.clone();
    let all = || setup(&folder, Trainable::weights(vec!["*".into()]), &dev, None);
    let batches = vec![golden_batch("tiny-llama")];
    let mut one = GpuEngine::new(gpu.clone(), &all()).unwrap();
    let n = one.trained_count() as u64;
    let (want_losses, want) = train_steps(&mut one, &batches, 3);
    let want_state = one.state().unwrap();
    let (largest, len) = want.iter().map(|(k, t)| (k.clone(), t.elem_count() as u64)).max_by_key(|x| x.1).unwrap();
    assert!(len * 4 < n * 4 / 2, "the largest weight is under half the total, so a limit at it cuts the array");
    emu.max_alloc.set(Some(len * 4));
    let mut split = GpuEngine::new(gpu.clone(), &all()).unwrap();
    let (losses, got) = train_steps(&mut split, &batches, 3);
    for (a, b) in losses.iter().zip(&want_losses) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "loss {a} over several buffers vs {b} over one");
    }
    let state = split.state().unwrap();
    assert_named_close("over several buffers, weight", &got, &want, 1e-5);
    assert_named_close("over several buffers, first moment", &state.m, &want_state.m, 1e-5);
    // The same through Vulkan (its own kernels: AdamW, the gradient norm's accumulator) on a
    // device whose limit is lowered to the largest weight, against the same device with one
    // buffer: a hardware driver runs other kernels than the emulator (another summation order),
    // and three AdamW steps at this rate turn those last bits into 4e-4 of a weight (seen on an
    // H200, 2026-11-27), which says nothing about the split.
    #[cfg(feature = "vulkan")]
    if testing("vulkan")
        && let Ok(vk) = rtune::engine::gpu::vulkan::VulkanGpu::new(vulkan_ordinal())
    {
        let name = vk.name();
        let mut whole = GpuEngine::new(Rc::new(vk), &all()).unwrap();
        let (want_losses, want) = train_steps(&mut whole, &batches, 3);
        drop(whole);
        let vk = rtune::engine::gpu::vulkan::VulkanGpu::new(vulkan_ordinal()).unwrap().with_max_alloc(len * 4);
        let mut split = GpuEngine::new(Rc::new(vk), &all()).unwrap();
        let (losses, got) = train_steps(&mut split, &batches, 3);
        for (a, b) in losses.iter().zip(&want_losses) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{name}: loss {a} over several buffers vs {b} over one");
        }
        assert_named_close(&format!("{name} over several buffers vs one,"), &got, &want, 1e-5);
    }
    emu.max_alloc.set(Some(len * 4 - 1));
    let msg = GpuEngine::new(gpu.clone(), &all()).err().expect("an error").to_string();
    assert!(msg.contains(&format!("`{largest}`")) && msg.contains("train fewer weights or a LoRA adapter"), "{msg}");
    for gpu in devices().into_iter().filter(|g| g.name().contains("(vulkan:")) {
        assert!(gpu.max_alloc() < u64::MAX, "{}: every Vulkan driver reports maxMemoryAllocationSize", gpu.name());
        if gpu.max_alloc() + (6 << 20) > gpu.memory().total {
            // The limit is the device's memory (lavapipe: 2 GiB both): beyond it is out of
            // memory (`memory_round_trips_and_out_of_memory_is_an_error`). This branch runs where
            // a driver's limit is below its memory (4 GiB on larger AMD GPUs).
            continue;
        }
        // (`max_alloc` is the driver's limit rounded down to whole 2 MiB size classes.)
        let e = gpu.alloc(gpu.max_alloc() as usize + (2 << 20) + 1).expect_err("refused").to_string();
        assert!(e.contains("maxMemoryAllocationSize") && e.contains(&gpu.name()), "{e}");
    }
}

/// Steps of accumulate → gradients → apply with gradient accumulation and clipping; returns the
/// losses and the final parameters.
fn train_steps(engine: &mut dyn Engine, batches: &[HostBatch], steps: usize) -> (Vec<f64>, BTreeMap<String, Tensor>) {
    let mut losses = Vec::new();
    for step in 0..steps {
        let micro = [&batches[(2 * step) % batches.len()], &batches[(2 * step + 1) % batches.len()]];
        let total: usize = micro.iter().map(|b| b.select.len()).sum();
        for (i, b) in micro.iter().enumerate() {
            let key = rtune::model::lora::batch_dropout_key(7, (2 * step + i) as u64);
            engine.accumulate(b, b.select.len() as f64 / total as f64, 1.0, Some(key)).unwrap();
        }
        let (loss, norm) = engine.gradients().unwrap();
        let clip = (0.5 / (norm + 1e-6)).min(1.0);
        engine.apply(1e-2, clip).unwrap();
        losses.push(loss);
    }
    (losses, engine.trained().unwrap())
}

#[test]
fn engine_trains_like_the_fused_cpu_engine_and_resumes_from_its_state() {
    let folder = ModelFolder::open(&fixture("tiny-qwen2").join("model")).unwrap();
    let adapter = all_targets_adapter(&folder, 0.1, false);
    let spec = peft::read_config(adapter.path()).unwrap();
    let golden = golden_batch("tiny-qwen2");
    let batches = vec![packed_batch(), golden.clone()];
    let cpu = Resolution::cpu();
    let mut fused = rtune::engine::fused::FusedEngine::build(&setup(
        &folder,
        Trainable::lora(spec.clone()),
        &cpu,
        Some(adapter.path()),
    ))
    .unwrap();
    let (want_losses, want) = train_steps(&mut fused, &batches, 6);
    for gpu in devices() {
        let dev = resolution(Dtype::F32, DeviceClass::Cuda);
        let mk = || {
            GpuEngine::new(gpu.clone(), &setup(&folder, Trainable::lora(spec.clone()), &dev, Some(adapter.path())))
                .unwrap()
        };
        let mut engine = mk();
        let (losses, got) = train_steps(&mut engine, &batches, 6);
        for (i, (a, b)) in losses.iter().zip(&want_losses).enumerate() {
            assert!((a - b).abs() < 1e-4 * b.abs(), "{}: step {i} loss {a} vs fused engine {b}", gpu.name());
        }
        assert!(losses[5] < losses[0], "the loss falls: {losses:?}");
        assert_named_close(&format!("{} trained", gpu.name()), &got, &want, 1e-3);
        // A fresh engine restored from the state continues exactly where this one is.
        let state = engine.state().unwrap();
        let mut resumed = mk();
        resumed.restore(&state).unwrap();
        let a = train_steps(&mut engine, &batches, 2).0;
        let b = train_steps(&mut resumed, &batches, 2).0;
        assert_eq!(a, b, "{}: resumed training differs", gpu.name());
    }
}

/// Pairs of devices for data parallel training: two emulators; with CUDA its first two GPUs (or
/// GPU 0 twice, two streams on one context); with Vulkan the device under test opened twice (two
/// logical devices, each with its own queue, as two GPUs would be).
fn device_pairs() -> Vec<[Rc<dyn Gpu>; 2]> {
    #[allow(unused_mut)]
    let mut v: Vec<[Rc<dyn Gpu>; 2]> = Vec::new();
    if testing("emulator") {
        v.push([Rc::new(EmuGpu::default()), Rc::new(EmuGpu::default())]);
    }
    #[cfg(feature = "cuda")]
    if let Some(Ok(a)) = testing("cuda").then(|| rtune::engine::gpu::cuda::CudaGpu::new(0, false)) {
        let b = rtune::engine::gpu::cuda::CudaGpu::new(1, false)
            .or_else(|_| rtune::engine::gpu::cuda::CudaGpu::new(0, false));
        v.push([Rc::new(a), Rc::new(b.unwrap())]);
    }
    #[cfg(feature = "vulkan")]
    if let Some((Ok(a), Ok(b))) = testing("vulkan").then(|| {
        (
            rtune::engine::gpu::vulkan::VulkanGpu::new(vulkan_ordinal()),
            rtune::engine::gpu::vulkan::VulkanGpu::new(vulkan_ordinal()),
        )
    }) {
        v.push([Rc::new(a), Rc::new(b)]);
    }
    v
}

/// Data parallel (`device.gpus`): two replicas that share each micro-batch's rows compute one
/// device's gradients (dropout on every linear and the LM head, so each part's masks must be
/// counted from where its rows start), train as it does step by step, stay equal to each
/// other, and evaluate the same loss.
#[test]
fn data_parallel_replicas_train_as_one_device() {
    let folder = ModelFolder::open(&fixture("tiny-qwen2").join("model")).unwrap();
    let adapter = all_targets_adapter(&folder, 0.1, false);
    let spec = peft::read_config(adapter.path()).unwrap();
    // Three rows (an uneven split), then four.
    let batches = vec![packed_batch(), golden_batch("tiny-qwen2")];
    let dev = resolution(Dtype::F32, DeviceClass::Cuda);
    let s = setup(&folder, Trainable::lora(spec), &dev, Some(adapter.path()));
    for [a, b] in device_pairs() {
        let on = format!("{} + {}", a.name(), b.name());
        let mut one = GpuEngine::new(a.clone(), &s).unwrap();
        let mut two =
            Replicas::new(vec![GpuEngine::new(a.clone(), &s).unwrap(), GpuEngine::new(b.clone(), &s).unwrap()]);
        // One micro-batch: gradients before and after they are summed across the replicas.
        for e in [&mut one as &mut dyn Engine, &mut two] {
            e.accumulate(&batches[0], 0.75, 1.0, Some(42)).unwrap();
        }
        let want = one.gradient_values().unwrap();
        assert_named_close(&format!("{on}: gradients"), &two.gradient_values().unwrap(), &want, 1e-5);
        let (loss1, norm1) = one.gradients().unwrap();
        let (loss2, norm2) = two.gradients().unwrap();
        assert!((loss1 - loss2).abs() <= 1e-6 * loss1, "{on}: loss {loss2} vs one device's {loss1}");
        assert!((norm1 - norm2).abs() <= 1e-5 * norm1, "{on}: gradient norm {norm2} vs one device's {norm1}");
        for r in two.replicas() {
            assert_named_close(&format!("{on}: summed gradients"), &r.gradient_values().unwrap(), &want, 1e-5);
        }
        for e in [&mut one as &mut dyn Engine, &mut two] {
            e.discard().unwrap();
        }
        // Steps with two micro-batches each and clipping.
        let (want_losses, want) = train_steps(&mut one, &batches, 4);
        let (losses, got) = train_steps(&mut two, &batches, 4);
        for (i, (x, y)) in losses.iter().zip(&want_losses).enumerate() {
            assert!((x - y).abs() <= 1e-5 * y.abs(), "{on}: step {i} loss {x} vs one device's {y}");
        }
        assert_named_close(&format!("{on}: trained"), &got, &want, 1e-4);
        let states: Vec<_> = two.replicas().iter().map(|r| r.state().unwrap()).collect();
        for (name, t) in &states[0].params {
            let (x, y): (Vec<f32>, Vec<f32>) = (
                t.flatten_all().unwrap().to_vec1().unwrap(),
                states[1].params[name].flatten_all().unwrap().to_vec1().unwrap(),
            );
            assert_eq!(x, y, "{on}: the replicas' {name} differ");
        }
        for b in &batches {
            let (x, y) = (two.loss(b).unwrap(), one.loss(b).unwrap());
            assert!((x - y).abs() <= 1e-5 * y, "{on}: evaluation loss {x} vs one device's {y}");
        }
        // Resuming: fresh replicas restored from the state continue exactly as these do.
        let mut resumed =
            Replicas::new(vec![GpuEngine::new(a.clone(), &s).unwrap(), GpuEngine::new(b.clone(), &s).unwrap()]);
        resumed.restore(&two.state().unwrap()).unwrap();
        let (x, y) = (train_steps(&mut two, &batches, 2).0, train_steps(&mut resumed, &batches, 2).0);
        assert_eq!(x, y, "{on}: resumed training differs");
    }
}

/// Data parallel needs the GPU engine: where another engine would run the model (here a build
/// without CUDA, whose CUDA device candle would drive), building it is an error that says so.
#[cfg(not(feature = "cuda"))]
#[test]
fn data_parallel_without_the_gpu_engine_is_an_error() {
    let folder = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let dev = Resolution { peers: vec![1], ..resolution(Dtype::F32, DeviceClass::Cuda) };
    let e =
        rtune::engine::build(&setup(&folder, Trainable::nothing(), &dev, None)).err().expect("an error").to_string();
    assert!(e.starts_with("data parallel training (`device.gpus`) runs on the GPU engine"), "{e}");
    assert!(e.contains("this build has no CUDA support") && e.contains("without `device.gpus`"), "{e}");
}

/// A full fine-tune trains like autograd's (AdamW on every weight through the f32 master copies),
/// with and without activation checkpointing (the same gradients bit for bit), and what it trains
/// is what a fresh engine evaluates when it starts from the trained weights.
#[test]
fn full_fine_tuning_trains_like_autograd() {
    let folder = ModelFolder::open(&fixture("tiny-qwen2").join("model")).unwrap();
    let all = Trainable::weights(vec!["*".into()]);
    let batches = vec![packed_batch(), golden_batch("tiny-qwen2")];
    let cpu = Resolution::cpu();
    let mut reference = CandleEngine::build(&setup(&folder, all.clone(), &cpu, None)).unwrap();
    let (want_losses, want) = train_steps(&mut reference, &batches, 4);
    for gpu in devices() {
        let dev = resolution(Dtype::F32, DeviceClass::Cuda);
        let mut s = setup(&folder, all.clone(), &dev, None);
        let mut engine = GpuEngine::new(gpu.clone(), &s).unwrap();
        let (losses, got) = train_steps(&mut engine, &batches, 4);
        for (i, (a, b)) in losses.iter().zip(&want_losses).enumerate() {
            assert!((a - b).abs() < 1e-4 * b.abs(), "{}: step {i} loss {a} vs autograd {b}", gpu.name());
        }
        assert!(losses[3] < losses[0], "the loss falls: {losses:?}");
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
        assert_named_close(&format!("{} trained", gpu.name()), &got, &want, 1e-3);
        s.checkpointing = Checkpointing::On;
        let mut ckpt = GpuEngine::new(gpu.clone(), &s).unwrap();
        assert_eq!(train_steps(&mut ckpt, &batches, 4).0, losses, "{}: checkpointing changed training", gpu.name());
        // Evaluating from the trained weights (as the evaluate stage does) gives the trained loss.
        let dir = tempfile::tempdir().unwrap();
        rtune::model::folder::save_safetensors(&dir.path().join("weights.safetensors"), &got).unwrap();
        let mut fresh =
            GpuEngine::new(gpu.clone(), &setup(&folder, Trainable::nothing(), &dev, Some(dir.path()))).unwrap();
        let (a, b) = (fresh.loss(&batches[1]).unwrap(), engine.loss(&batches[1]).unwrap());
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{}: {a} from the saved weights vs {b}", gpu.name());
    }
}

#[test]
fn generation_logits_match_candle_and_checkpointing_changes_nothing() {
    // Qwen3 recomputes its head norms with the rest of a layer under checkpointing.
    for name in ["tiny-llama", "tiny-qwen3"] {
        let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
        let adapter = fixture(name).join("adapter");
        let spec = peft::read_config(&adapter).unwrap();
        let cpu = Resolution::cpu();
        let mut reference =
            CandleEngine::build(&setup(&folder, Trainable::lora(spec.clone()), &cpu, Some(&adapter))).unwrap();
        let ids = [1u32, 17, 33, 90, 4, 5];
        let want = reference.next_logits(&ids).unwrap();
        let batch = golden_batch(name);
        for gpu in devices() {
            let dev = resolution(Dtype::F32, DeviceClass::Cuda);
            let mut s = setup(&folder, Trainable::lora(spec.clone()), &dev, Some(&adapter));
            let mut engine = GpuEngine::new(gpu.clone(), &s).unwrap();
            assert_close(
                &format!("{name} on {}: next-token logits", gpu.name()),
                &engine.next_logits(&ids).unwrap(),
                &want,
                1e-5,
            );
            engine.accumulate(&batch, 1.0, 1.0, Some(3)).unwrap();
            let plain = engine.gradient_values().unwrap();
            s.checkpointing = Checkpointing::On;
            let mut ckpt = GpuEngine::new(gpu.clone(), &s).unwrap();
            assert!(ckpt.checkpointing());
            ckpt.accumulate(&batch, 1.0, 1.0, Some(3)).unwrap();
            for (param, g) in ckpt.gradient_values().unwrap() {
                let (a, b): (Vec<f32>, Vec<f32>) = (
                    g.flatten_all().unwrap().to_vec1().unwrap(),
                    plain[&param].flatten_all().unwrap().to_vec1().unwrap(),
                );
                assert_eq!(a, b, "{name} on {}: recomputed activations give other gradients for {param}", gpu.name());
            }
        }
    }
}

#[test]
fn running_out_of_gpu_memory_is_a_clear_error_that_says_what_would_fit() {
    use miette::Diagnostic;
    // An 8-layer model, and an emulated GPU that holds a step with activation checkpointing but
    // not one without.
    let dir = tempfile::tempdir().unwrap();
    let spec: rtune::recipe::ScratchModel =
        toml::from_str("hidden_size = 32\nnum_layers = 8\nnum_heads = 4\nintermediate_size = 64\nvocab_size = 300")
            .unwrap();
    let texts: Vec<String> = (0..200).map(|i| format!("sample {i}: some words to train a tokenizer on")).collect();
    rtune::model::scratch::create(dir.path(), &spec, texts.iter(), 0).unwrap();
    let folder = ModelFolder::open(dir.path()).unwrap();
    let lora =
        LoraSpec { rank: 4, alpha: 8.0, rslora: false, dropout: 0.0, targets: vec!["q_proj".into(), "v_proj".into()] };
    let dev = resolution(Dtype::F32, DeviceClass::Cuda);
    let emu = Rc::new(EmuGpu::default());
    let gpu: Rc<dyn Gpu> = emu.clone();
    let mut s = setup(&folder, Trainable::lora(lora), &dev, None);
    let mut engine = GpuEngine::new(gpu.clone(), &s).unwrap();
    let (b, t) = (4, 32);
    let with = engine.memory_estimate(b, t, true).unwrap().0;
    let without = engine.memory_estimate(b, t, false).unwrap().0;
    assert!(with < without, "{with} vs {without}");
    emu.limit.set(Some((with + without) / 2 * 10 / 9));
    let mut rng = Rng::new(4);
    let rows: Vec<Vec<u32>> = (0..b).map(|_| (0..t).map(|_| (rng.next_u64() % 300) as u32).collect()).collect();
    let select: Vec<u32> = (0..(b * t) as u32).filter(|i| i % t as u32 != t as u32 - 1).collect();
    let targets = select.iter().map(|&i| rows[i as usize / t][i as usize % t + 1]).collect();
    let batch = HostBatch::from_parts(&rows, &vec![t; b], None, select, targets);
    let err = engine.accumulate(&batch, 1.0, 1.0, None).unwrap_err();
    assert!(matches!(err, rtune::engine::EngineError::OutOfMemory { .. }), "{err}");
    let settings: rtune::recipe::TrainSettings = toml::from_str("batch_size = 4\ngrad_accum = 2").unwrap();
    let e = rtune::train::out_of_memory(err, &settings, Some(&engine), None);
    let (message, help) = (e.to_string(), e.help().map(|h| h.to_string()).unwrap_or_default());
    assert!(message.starts_with("the GPU ran out of memory while training (batch 4 × 32 tokens)"), "{message}");
    assert!(help.contains("`stages.train.gradient_checkpointing = true`"), "{help}");
    assert!(help.contains("checkpoints and cached stages are kept"), "{help}");
    // Data parallel on two such GPUs, each taking 4 of 8 rows: the error names the GPU and the
    // whole batch (the recipe's `batch_size`), and the advice counts each GPU's share.
    let two_emus = [Rc::new(EmuGpu::default()), Rc::new(EmuGpu::default())];
    let mut two = Replicas::new(two_emus.iter().map(|g| GpuEngine::new(g.clone(), &s).unwrap()).collect());
    for g in &two_emus {
        g.limit.set(emu.limit.get());
    }
    let rows8: Vec<Vec<u32>> = rows.iter().chain(&rows).cloned().collect();
    let select8: Vec<u32> = (0..(2 * b * t) as u32).filter(|i| i % t as u32 != t as u32 - 1).collect();
    let targets8 = select8.iter().map(|&i| rows8[i as usize / t][i as usize % t + 1]).collect();
    let batch8 = HostBatch::from_parts(&rows8, &vec![t; 2 * b], None, select8, targets8);
    let err = two.accumulate(&batch8, 1.0, 1.0, None).unwrap_err();
    let settings8: rtune::recipe::TrainSettings = toml::from_str("batch_size = 8\ngrad_accum = 2").unwrap();
    let e = rtune::train::out_of_memory(err, &settings8, Some(&two), None);
    let (message, help) = (e.to_string(), e.help().map(|h| h.to_string()).unwrap_or_default());
    assert!(
        message.starts_with("the GPU ran out of memory while training on CPU emulator (batch 8 × 32 tokens)"),
        "{message}"
    );
    assert!(help.contains("`stages.train.gradient_checkpointing = true`"), "{help}");
    // Weights that do not fit: a 4-bit base is the first suggestion, with what it saves.
    let (dense, packed) = rtune::model::nf4::linear_bytes(&folder.config, 4);
    assert_eq!(dense, 8 * 4 * (4 * 32 * 32 + 3 * 32 * 64));
    assert!(packed * 7 < dense, "{packed} of {dense}");
    let weights = GpuEngine::new(Rc::new(EmuGpu { limit: Cell::new(Some(1000)), ..Default::default() }), &s)
        .err()
        .expect("1000 bytes hold no model");
    let e = rtune::train::out_of_memory(weights, &settings, None, Some((dense, packed)));
    let help = e.help().map(|h| h.to_string()).unwrap_or_default();
    assert!(help.starts_with("settings that would fit: `adapter.quantize_base = \"nf4\"` (QLoRA"), "{help}");
    // And the suggestion holds: the same step with checkpointing fits.
    drop(engine);
    s.checkpointing = Checkpointing::On;
    let mut engine = GpuEngine::new(gpu, &s).unwrap();
    engine.accumulate(&batch, 1.0, 1.0, None).unwrap();
    // A device lost mid-step (a driver reset) is its own error, which says what to do.
    emu.launches_left.set(Some(10));
    let lost = engine.accumulate(&batch, 1.0, 1.0, None).unwrap_err();
    let e = rtune::train::out_of_memory(lost, &settings, Some(&engine), None);
    assert_eq!(e.code().map(|c| c.to_string()).as_deref(), Some("rtune::engine::device_lost"), "{e}");
    assert!(e.to_string().ends_with(": the emulated device was lost"), "{e}");
    let help = e.help().map(|h| h.to_string()).unwrap_or_default();
    assert!(help.contains("watchdog") && help.contains("run the same command again to resume"), "{help}");
}

/// Large transfers (beyond the Vulkan device's staging-block cache) round-trip exactly, a
/// device-to-device copy at an offset and an unaligned 16-bit clear land where they should,
/// and asking for more than the device has is an out-of-memory error, not a crash.
#[test]
fn memory_round_trips_and_out_of_memory_is_an_error() {
    for gpu in devices() {
        let n = 10 << 20; // 40 MiB of f32
        let v: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5).collect();
        let a = Buf::from_f32(&gpu, &v, Dt::F32).unwrap();
        assert_eq!(a.to_vec().unwrap(), v, "{}: 40 MiB upload and download", gpu.name());
        let b = Buf::zeros(&gpu, 1000, Dt::F32).unwrap();
        gpu.copy(b.at(10), a.at(100), 20 * 4).unwrap();
        let got = b.to_vec().unwrap();
        assert_eq!(&got[10..30], &v[100..120], "{}: copy at offsets", gpu.name());
        assert!(got[..10].iter().chain(&got[30..]).all(|x| *x == 0.0), "{}: copy stays in range", gpu.name());
        let h = Buf::from_f32(&gpu, &[1.0; 9], Dt::Bf16).unwrap();
        gpu.zero(h.at(3), 3 * 2).unwrap();
        assert_eq!(h.to_vec().unwrap(), [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0], "{}: 16-bit clear", gpu.name());
        let total = gpu.memory().total;
        if gpu.name().contains("(vulkan:") {
            match gpu.alloc(total as usize + (1 << 20)) {
                Err(GpuError::OutOfMemory { requested, .. }) => assert!(requested > total),
                other => panic!("{}: allocating more than the device has gave {other:?}", gpu.name()),
            }
            // The device is still usable afterwards.
            assert_eq!(b.to_vec().unwrap(), got);
        }
    }
}
