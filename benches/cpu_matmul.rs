//! Is bf16 or f16 worth training in on this CPU? Times candle's CPU matmul for a
//! SmolLM2-135M-sized projection (512 tokens × 576 → 1536) in f32, bf16 and f16. Then the GEMM
//! ceiling of a train step: the `gemm` crate alone (what candle and the fused engine call) on the
//! products of a 135M step, on all threads, with the weight as stored (`[out, in]`, read
//! transposed) and plain. Run:
//!
//!     cargo bench --bench cpu_matmul

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

fn main() {
    // `RTUNE_BENCH_SMOKE=1` (CI): a tiny run that proves the benchmark still works.
    let reps = if std::env::var_os("RTUNE_BENCH_SMOKE").is_some() { 2 } else { 12 };
    let (m, k, n) = (512usize, 576usize, 1536usize);
    let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
    let reference = x.matmul(&w.t().unwrap()).unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let (xd, wd) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
        let mut times = Vec::new();
        let mut out = None;
        for _ in 0..reps {
            let start = Instant::now();
            out = Some(xd.matmul(&wd.t().unwrap()).unwrap());
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        let err = (out.unwrap().to_dtype(DType::F32).unwrap() - &reference)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        println!(
            "{dtype:?}: median {:.2} ms, {:.1} GFLOP/s, max |error| vs f32 {err:.3}",
            med * 1e3,
            2.0 * (m * k * n) as f64 / med / 1e9
        );
    }
    gemm_shapes(reps);
}

/// GFLOP/s of `gemm` on the products of a 135M-shape train step (4 × 128 tokens).
fn gemm_shapes(reps: usize) {
    let shapes: &[(usize, usize, usize, &str)] = &[
        (512, 576, 576, "q/o projection"),
        (512, 576, 192, "k/v projection"),
        (512, 576, 960, "q+k+v in one product"),
        (512, 576, 1536, "gate/up projection"),
        (512, 576, 3072, "gate+up in one product"),
        (512, 1536, 576, "down / gate input gradient"),
        (512, 3072, 576, "gate+up input gradient in one"),
        (170, 576, 49152, "LM head, 170-row chunk"),
        (508, 576, 49152, "LM head, 508 rows"),
        (508, 49152, 576, "LM head input gradient"),
    ];
    let threads = rayon::current_num_threads();
    println!("gemm alone, {threads} threads:");
    for &(m, k, n, name) in shapes {
        for transposed in [true, false] {
            let a = vec![0.01f32; m * k];
            let w = vec![0.02f32; n * k];
            let mut c = vec![0f32; m * n];
            let mut times = Vec::new();
            for _ in 0..reps.max(3) {
                let start = Instant::now();
                // rhs (k × n): element (i, j) at w[i·rs + j·cs].
                let (cs, rs) = if transposed { (k as isize, 1) } else { (1, n as isize) };
                // SAFETY: a is m × k, w holds n × k elements, c is m × n; the strides stay inside.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        a.as_ptr(),
                        1,
                        k as isize,
                        w.as_ptr(),
                        cs,
                        rs,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::Rayon(threads),
                    )
                };
                times.push(start.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let t = times[times.len() / 2];
            println!(
                "  {name:<30} {m:>4} × {k:>5} × {n:>5} {}: {:>7.2} ms {:>6.1} GFLOP/s",
                if transposed { "Wᵀ" } else { "W " },
                t * 1e3,
                2.0 * (m * k * n) as f64 / t / 1e9
            );
        }
    }
}
