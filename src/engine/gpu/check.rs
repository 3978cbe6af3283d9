//! `rtune doctor --check`: on each GPU, for each compute dtype it trains in, run the kernels
//! whose choice is made at run time — the products (on Vulkan: the matrix units, after their
//! first-use check against f64 products on the host) and attention (the matrix-unit kernels'
//! check against the scalar ones) — and say which run, with the products' measured rate.

use std::rc::Rc;
use std::time::Instant;

use serde::Serialize;

use super::ops::{AttnShape, attention_kernels};
use super::{Buf, Dt, Gemm, Gpu, GpuError};

/// What the check found for one dtype on one device.
#[derive(Debug, Clone, Serialize)]
pub struct KernelCheck {
    /// `f32`, `bf16`, `f16`.
    pub dtype: &'static str,
    /// Which kernels run the products ([`Gpu::products_account`]).
    pub products: String,
    /// Which kernels run attention at head size 64 ([`AttnShape::account`]).
    pub attention: String,
    /// The products' rate on a square product of `size` (TFLOP/s), timed after a warm-up.
    pub tflops: Option<f64>,
    pub size: Option<usize>,
    /// Why the check could not finish (a device error).
    pub error: Option<String>,
}

/// Longest a timed product may take before the size stops growing, and how long the rate is
/// measured.
const LONG_ENOUGH: f64 = 0.02;
const MEASURE: f64 = 0.2;
/// The largest square product timed (8192: 1.1 TFLOP, 400 MB in 16-bit types).
const MOST: usize = 8192;

/// Check `dtypes` on `gpu` (each one the device trains in).
pub fn check(gpu: &Rc<dyn Gpu>, dtypes: &[Dt]) -> Vec<KernelCheck> {
    dtypes
        .iter()
        .map(|&dt| {
            let mut c = KernelCheck {
                dtype: dt.suffix(),
                products: String::new(),
                attention: String::new(),
                tflops: None,
                size: None,
                error: None,
            };
            match rate(gpu, dt) {
                Ok((size, tflops)) => (c.size, c.tflops) = (Some(size), Some(tflops)),
                Err(e) => c.error = Some(e.to_string()),
            }
            c.products = gpu.products_account(dt);
            // Settles the matrix-unit attention's first-use check where it applies; the kernels
            // training would take (`RTUNE_GPU_ATTENTION` included).
            let kernels = attention_kernels();
            let shape = AttnShape { b: 1, t: 512, hq: 8, hk: 8, d: 64, scale: 0.125, softcap: None, kernels };
            c.attention = shape.account(dt, &**gpu);
            c
        })
        .collect()
}

/// The products' rate in `dt` (C in `dt`): square products from 256 on, doubled until one takes
/// [`LONG_ENOUGH`] (or [`MOST`], or a quarter of the free memory would not hold them), each run
/// once before it is timed (first-use checks, tile timing); then as many as [`MEASURE`] takes.
fn rate(gpu: &Rc<dyn Gpu>, dt: Dt) -> Result<(usize, f64), GpuError> {
    let mut n = 256;
    loop {
        let (a, b, c) = (operand(gpu, n, dt)?, operand(gpu, n, dt)?, Buf::new(gpu, n * n, dt)?);
        let g = Gemm {
            m: n,
            n,
            k: n,
            a: a.ptr(),
            a_trans: false,
            lda: n,
            b: b.ptr(),
            b_trans: true,
            ldb: n,
            c: c.ptr(),
            ldc: n,
            alpha: 1.0,
            beta: 0.0,
            ab: dt,
            c_dt: dt,
        };
        let once = || -> Result<f64, GpuError> {
            let t = Instant::now();
            gpu.gemm(&g)?;
            gpu.synchronize()?;
            Ok(t.elapsed().as_secs_f64())
        };
        once()?;
        let one = once()?;
        let bigger = 2 * n;
        let fits = 3 * bigger * bigger * dt.size() <= (gpu.memory().free / 4) as usize;
        if one >= LONG_ENOUGH || bigger > MOST || !fits {
            let reps = ((MEASURE / one.max(1e-6)).ceil() as usize).clamp(1, 1000);
            let t = Instant::now();
            for _ in 0..reps {
                gpu.gemm(&g)?;
            }
            gpu.synchronize()?;
            let flops = 2.0 * (n as f64).powi(3) * reps as f64;
            return Ok((n, flops / t.elapsed().as_secs_f64() / 1e12));
        }
        n = bigger;
    }
}

/// An `n × n` operand of small values (a product of them stays finite in f16).
fn operand(gpu: &Rc<dyn Gpu>, n: usize, dt: Dt) -> Result<Buf, GpuError> {
    let v: Vec<f32> = (0..n * n).map(|i| ((i * 7919) % 17) as f32 / 64.0 - 0.125).collect();
    Buf::from_f32(gpu, &v, dt)
}
