//! Is bf16 or f16 worth training in on this CPU? Times candle's CPU matmul for a
//! SmolLM2-135M-sized projection (512 tokens × 576 → 1536) in f32, bf16 and f16. Run:
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
}
