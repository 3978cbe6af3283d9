//! The GPU engine's kernels timed on their own, on every GPU this build and machine have (CUDA
//! through cuBLAS with `--features cuda`, Vulkan through the engine's own kernels): products and
//! attention at the benchmark's train-step shapes (`timings`), and the Vulkan products with each
//! of `gemm_cm`'s tiles beside the one the engine picks (`tiles`). Where a step's time goes, not
//! a benchmark of rtune (`rtune run` is: scripts/gpu/bench.sh, docs/benchmarks.md).
//!
//!     cargo bench --bench gpu_kernels                    # both
//!     cargo bench --bench gpu_kernels -- timings         # or tiles
//!     RTUNE_TIMING_TOKENS=32 cargo bench --bench gpu_kernels   # tiny shapes: a dry run on lavapipe
//!
//! `RTUNE_TEST_VULKAN=N` picks the Vulkan device, as in the engine's tests. On the GPU machine
//! scripts/gpu/session.sh runs the carried build of this (`.gpu/gpu_kernels timings`).

use std::rc::Rc;

use rtune::engine::gpu::ops::{AttnKernels, AttnShape, Ops};
use rtune::engine::gpu::{Buf, Dt, Gpu};
use rtune::rng::Rng;

#[allow(dead_code)]
#[path = "../tests/common/gpu.rs"]
mod gpu;
#[cfg(feature = "vulkan")]
use gpu::vulkan_ordinal;
use gpu::{AttnBufs, rand_vec};

fn main() {
    // `cargo bench` passes `--bench`; the words asked for are the others.
    let asked: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let wants = |what: &str| asked.is_empty() || asked.iter().any(|a| a == what);
    for a in &asked {
        if a != "timings" && a != "tiles" {
            eprintln!("gpu_kernels: unknown part `{a}` (timings, tiles)");
            std::process::exit(2);
        }
    }
    if wants("timings") {
        timings();
    }
    #[cfg(feature = "vulkan")]
    if wants("tiles") {
        tiles();
    }
    #[cfg(not(feature = "vulkan"))]
    if wants("tiles") {
        println!("tiles: this build has no Vulkan (the `vulkan` feature)");
    }
}

/// Tokens per product: `RTUNE_TIMING_TOKENS`, else 32 under `RTUNE_BENCH_SMOKE` (CI: a tiny run
/// that proves the benchmark still works, on lavapipe), else 2048.
fn timing_tokens() -> usize {
    let smoke = std::env::var_os("RTUNE_BENCH_SMOKE").is_some();
    std::env::var("RTUNE_TIMING_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(if smoke { 32 } else { 2048 })
}

/// The GPUs this build and machine have: the CUDA GPU, and the Vulkan device (on a CPU
/// implementation such as lavapipe, both its per-lane kernels and the kernels written for GPUs,
/// as the engine's tests run them). Why one is missing goes to stderr.
fn gpus() -> Vec<Rc<dyn Gpu>> {
    #[allow(unused_mut)]
    let mut v: Vec<Rc<dyn Gpu>> = Vec::new();
    #[cfg(feature = "cuda")]
    match rtune::engine::gpu::cuda::CudaGpu::new(0, false) {
        Ok(g) => v.push(Rc::new(g)),
        Err(e) => eprintln!("no CUDA device: {e}"),
    }
    #[cfg(feature = "vulkan")]
    match gpu::vulkan_devices() {
        Ok(gpus) => v.extend(gpus),
        Err(e) => eprintln!("no Vulkan device: {e}"),
    }
    v
}

/// A rate in TFLOP/s, to three figures or so.
fn rate(t: f64) -> String {
    if t >= 10.0 {
        format!("{t:.0}")
    } else if t >= 1.0 {
        format!("{t:.1}")
    } else {
        format!("{t:.3}")
    }
}

/// Median seconds per call over 5 runs of `reps` calls each, after a warm-up call (first-use
/// checks, pipeline compilation); each run ends with a device sync.
fn median_secs(gpu: &Rc<dyn Gpu>, reps: usize, f: &dyn Fn() -> Result<(), String>) -> Result<f64, String> {
    f()?;
    gpu.synchronize().map_err(|e| e.to_string())?;
    let mut runs = Vec::new();
    for _ in 0..5 {
        let start = std::time::Instant::now();
        for _ in 0..reps {
            f()?;
        }
        gpu.synchronize().map_err(|e| e.to_string())?;
        runs.push(start.elapsed().as_secs_f64() / reps as f64);
    }
    runs.sort_by(f64::total_cmp);
    Ok(runs[2])
}

/// The products of a LoRA step of SmolLM2-135M and -360M over `tokens` tokens, as (what, m, n,
/// k, b_trans): forward x·Wᵀ, backward dy·W (the input's gradient).
fn product_shapes(tokens: usize) -> Vec<(String, usize, usize, usize, bool)> {
    let mut v = Vec::new();
    for (model, h, inter) in [("135M", 576, 1536), ("360M", 960, 2560)] {
        for (name, n, k, b_trans) in [
            ("q/o x·Wᵀ", h, h, true),
            ("gate/up x·Wᵀ", inter, h, true),
            ("down x·Wᵀ", h, inter, true),
            ("gate/up dy·W", h, inter, false),
            ("LM head chunk x·Wᵀ", 8192, h, true),
        ] {
            v.push((format!("{model} {name} {tokens}×{n}×{k}"), tokens, n, k, b_trans));
        }
    }
    v
}

/// TFLOP/s of one product `[m, n, k]` of `dt` inputs into `dt` on `gpu` (random inputs;
/// [`median_secs`] of `reps` calls).
fn product_rate(gpu: &Rc<dyn Gpu>, dt: Dt, [m, n, k]: [usize; 3], b_trans: bool, reps: usize) -> Result<f64, String> {
    let e = |e: rtune::engine::gpu::GpuError| e.to_string();
    let up = |n: usize, seed: u64| Buf::from_f32(gpu, &rand_vec(&mut Rng::new(seed), n, 1.0), dt);
    let (a, w, c) = (up(m * k, 1).map_err(e)?, up(n * k, 2).map_err(e)?, Buf::new(gpu, m * n, dt).map_err(e)?);
    let o = Ops { gpu: &**gpu, dt };
    let s = median_secs(gpu, reps, &|| {
        o.gemm(c.ptr(), dt, a.ptr(), false, w.ptr(), b_trans, m, n, k, 1.0, 0.0).map_err(e)
    })?;
    Ok(2.0 * (m * n * k) as f64 / s / 1e12)
}

/// The products of `product_shapes` on the Vulkan device's matrix units with each tile
/// `gemm_cm` has, beside the tile the engine picks (by timing each on the first product of a
/// shape) (`RTUNE_TIMING_TOKENS` tokens, default
/// 2048): which tile is fastest where, to settle `choose_gemm_tile` on hardware. Prints one table
/// and the tile fastest over all shapes (geometric mean, bf16), for `RTUNE_VULKAN_GEMM_TILE`.
#[cfg(feature = "vulkan")]
fn tiles() {
    use rtune::engine::gpu::vulkan::VulkanGpu;
    let tokens = timing_tokens();
    let reps = if tokens < 512 { 1 } else { 10 };
    let tiles: [Option<[u32; 2]>; 5] = [None, Some([64, 64]), Some([64, 32]), Some([32, 64]), Some([32, 32])];
    let mut log_sums = vec![(0.0f64, 0usize); tiles.len()];
    println!(
        "| product | type | picked (tile it ran; the guess) | 64×64 | 64×32 | 32×64 | 32×32 |\n|---|---|---|---|---|---|---|"
    );
    let show_tile = |t: Option<[u32; 2]>| t.map_or("—".to_string(), |[m, n]| format!("{m}×{n}"));
    for dt in [Dt::Bf16, Dt::F16] {
        // The engine's own pick, kept as a Vulkan device to ask which tile it took.
        let picked = Rc::new(VulkanGpu::new(vulkan_ordinal()).unwrap().with_gpu_kernels());
        let gpus: Vec<Option<Rc<dyn Gpu>>> = tiles
            .iter()
            .map(|t| {
                // No matrix units, or a forced tile the device cannot run: nothing to time.
                let Some(t) = t else {
                    picked.matrix_shape(dt).ok()??;
                    return Some(picked.clone() as Rc<dyn Gpu>);
                };
                let g = VulkanGpu::new(vulkan_ordinal()).ok()?.with_gpu_kernels().with_gemm_tile(*t);
                g.matrix_shape(dt).ok()??;
                g.gemm_tile(dt).is_some().then(|| Rc::new(g) as Rc<dyn Gpu>)
            })
            .collect();
        if gpus[0].is_none() {
            println!("no Vulkan device with {dt:?} matrix units");
            continue;
        }
        let probe = VulkanGpu::new(vulkan_ordinal()).unwrap().with_gpu_kernels();
        if probe.matrix_shape(dt).unwrap().is_some() && probe.first_form_products(dt) {
            println!("{dt:?}: the current product kernel failed its check; every column is its first form");
        }
        for (what, m, n, k, b_trans) in product_shapes(tokens) {
            let cells: Vec<String> = gpus
                .iter()
                .enumerate()
                .map(|(i, g)| match g.as_ref().map(|g| product_rate(g, dt, [m, n, k], b_trans, reps)) {
                    Some(Ok(t)) => {
                        if dt == Dt::Bf16 {
                            log_sums[i].0 += t.ln();
                            log_sums[i].1 += 1;
                        }
                        if i > 0 {
                            return rate(t);
                        }
                        let timed = picked.product_tile(dt, dt, [m, n, k], false, b_trans);
                        format!("{} ({}; {})", rate(t), show_tile(timed), show_tile(picked.guessed_tile(dt, m, n)))
                    }
                    Some(Err(e)) => format!("failed: {e}"),
                    None => "—".into(),
                })
                .collect();
            println!("| {what} | {dt:?} | {} |", cells.join(" | "));
        }
    }
    let best = (1..tiles.len())
        .filter(|&i| log_sums[i].1 > 0 && log_sums[i].1 == log_sums[0].1)
        .max_by(|&a, &b| log_sums[a].0.total_cmp(&log_sums[b].0));
    if let Some(i) = best {
        let [wm, wn] = tiles[i].unwrap();
        let mean = |i: usize| (log_sums[i].0 / log_sums[i].1 as f64).exp();
        println!(
            "fastest tile over the bf16 products: {wm}x{wn} ({} TFLOP/s geometric mean; picked per product: {})",
            rate(mean(i)),
            rate(mean(0))
        );
    }
}

/// Product and attention timings on every device this build and machine have (CUDA through
/// cuBLAS, Vulkan through the engine's own kernels), for each compute type, at the train-step
/// shapes of the benchmark: SmolLM2-135M and -360M at 4 × 512 tokens (the GEMM spike's shapes,
/// forward `x·Wᵀ` and backward `dy·W`), and attention at 135M's and 3B's head shapes.
/// `cargo bench --bench gpu_kernels -- timings`; a table of TFLOP/s per device comes last,
/// with each Vulkan rate as a fraction of CUDA's (issue 18's go/no-go: ¼ of cuBLAS bf16). Not a
/// benchmark of rtune (scripts/gpu/bench.sh is), a breakdown of where a step's time goes.
/// `RTUNE_TIMING_TOKENS=32` shrinks the shapes (and attention to 1 × 64) to dry-run it on lavapipe.
fn timings() {
    let gpus = gpus();
    if gpus.is_empty() {
        eprintln!("no GPU device");
        return;
    }
    // (what, dtype, device) → TFLOP/s, or why it did not run.
    let mut rates: Vec<(String, Dt, String, Result<f64, String>)> = Vec::new();
    for gpu in &gpus {
        let tokens = timing_tokens();
        let small = tokens < 512;
        let reps = if small { 1 } else { 10 };
        for dt in [Dt::Bf16, Dt::F16, Dt::F32] {
            let o = Ops { gpu: &**gpu, dt };
            for (what, m, n, k, b_trans) in product_shapes(tokens) {
                let r = product_rate(gpu, dt, [m, n, k], b_trans, reps);
                println!("{}: {dt:?} product {what}: {}", gpu.name(), show(&r));
                rates.push((what, dt, gpu.name(), r));
            }
            if dt == Dt::F32 {
                continue;
            }
            let kernels = [(AttnKernels::TensorCores, ""), (AttnKernels::Products { rows: 0 }, " through products")];
            for ((name, hq, hk, d), (kernels, how)) in
                [("135M", 9, 3, 64), ("3B", 16, 2, 128)].into_iter().flat_map(|s| kernels.map(|k| (s, k)))
            {
                let (b, t) = if small { (1, 64) } else { (4, 1024) };
                let what = format!("{name} attention {b}×{t} fwd+bwd{how}");
                let r = (|| -> Result<f64, String> {
                    let e = |e: rtune::engine::gpu::GpuError| e.to_string();
                    let s = AttnShape { b, t, hq, hk, d, scale: 1.0 / (d as f32).sqrt(), softcap: None, kernels };
                    let layout = rtune::model::batch::attention_layout(t, &vec![t; b], None);
                    let (nq, nk) = (b * t * hq * d, b * t * hk * d);
                    let r = |n: usize, seed: u64| rand_vec(&mut Rng::new(seed), n, 1.0);
                    let (q, k, v, dout) = (r(nq, 3), r(nk, 4), r(nk, 5), r(nq, 6));
                    let bufs = AttnBufs::new(gpu, &s, dt, (&q, &k, &v, &dout), &layout).map_err(e)?;
                    let secs = median_secs(gpu, reps, &|| {
                        bufs.fwd(&o, &s).map_err(e)?;
                        bufs.bwd(&o, &s).map_err(e)
                    })?;
                    // Causal: half the t² products; forward 2 of them, backward 4 (not counting
                    // the recomputed probabilities).
                    Ok(6.0 * (b * hq * t * t / 2 * d * 2) as f64 / secs / 1e12)
                })();
                println!(
                    "{}: {dt:?} {what}{}: {}",
                    gpu.name(),
                    if how.is_empty() && s_tc(&**gpu, dt, d) { " (matrix units)" } else { "" },
                    show(&r)
                );
                rates.push((what, dt, gpu.name(), r));
            }
        }
    }
    fn show(r: &Result<f64, String>) -> String {
        match r {
            Ok(t) => format!("{} TFLOP/s", rate(*t)),
            Err(e) => format!("did not run: {e}"),
        }
    }
    fn s_tc(gpu: &dyn Gpu, dt: Dt, d: usize) -> bool {
        AttnShape::has_tensor_cores(dt, d) && gpu.tensor_core_attention(dt)
    }
    // The table: one column per device, each rate also as a fraction of the first device's
    // (CUDA's, where this build has it) for the same work and type.
    let names: Vec<String> = gpus.iter().map(|g| g.name()).collect();
    println!("\n| work | type | {} |", names.join(" | "));
    println!("|---|---|{}", "---|".repeat(names.len()));
    let mut rows: Vec<(String, Dt)> = Vec::new();
    for (what, dt, _, _) in &rates {
        if !rows.contains(&(what.clone(), *dt)) {
            rows.push((what.clone(), *dt));
        }
    }
    for (what, dt) in rows {
        let get = |name: &str| rates.iter().find(|r| r.0 == what && r.1 == dt && r.2 == name).map(|r| r.3.clone());
        let first = get(&names[0]).and_then(Result::ok);
        let cells: Vec<String> = names
            .iter()
            .enumerate()
            .map(|(i, n)| match get(n) {
                Some(Ok(t)) if i > 0 && first.is_some() => format!("{} ({:.2}×)", rate(t), t / first.unwrap()),
                Some(Ok(t)) => rate(t),
                Some(Err(_)) => "—".into(),
                None => "".into(),
            })
            .collect();
        println!("| {what} | {dt:?} | {} |", cells.join(" | "));
    }
}
