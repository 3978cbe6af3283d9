//! Train-step throughput on random-weight Llama shapes, following the protocol of
//! docs/benchmarks.md: LoRA r=8, alpha=16, dropout 0 on q/k/v/o_proj, AdamW lr 2e-4, batch
//! 4 × 128 tokens, median seconds per step after 2 warm-up steps. Run:
//!
//!     cargo bench --bench train_step -- [tiny|small|135m] [steps] [f32|bf16|f16]
//!
//! (`small`: hidden 256, 8 layers, vocab 8000 — between the two protocol shapes.)
//!
//! It runs rtune's fused CPU engine, then candle's autograd (with rtune's frozen-weight matmul);
//! `RTUNE_BENCH_ENGINE=fused|candle|plain` runs one alone (peak RSS is per process, so compare
//! memory one engine per process; `plain` is candle's matmul with frozen-weight gradients).

mod common;

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use rtune::engine::candle::Transformer;
use rtune::engine::candle::linear::FROZEN_MATMUL;
use rtune::engine::fused;
use rtune::engine::params::{AdamW, AdamWConfig};
use rtune::model::{LoraSpec, Trainable};
use rtune::rng::Rng;

fn main() {
    if std::env::var_os("RTUNE_COMPOSED_CE").is_some() {
        rtune::engine::candle::ops::FUSED_CROSS_ENTROPY.store(false, std::sync::atomic::Ordering::Relaxed);
    }
    if std::env::var_os("RTUNE_NO_PROCESS_TUNING").is_none() {
        rtune::init_process();
    }
    let args = common::args(&["tiny", "1"]);
    let which = args.first().cloned().unwrap_or_else(|| "tiny".into());
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(if which == "tiny" { 30 } else { 5 });
    let dtype = match args.get(2).map(String::as_str) {
        Some("bf16") => DType::BF16,
        Some("f16") => DType::F16,
        _ => DType::F32,
    };
    let spec = common::shape(&which, 256);
    let raw = rtune::model::ModelConfig::scratch_raw(&spec, 1, 2, 0);
    let cfg = rtune::model::ModelConfig::from_raw(&serde_json::from_value(raw).unwrap()).unwrap();
    let weights: BTreeMap<String, Tensor> = rtune::model::scratch::init_weights(&cfg, 0.02, 0, &Device::Cpu).unwrap();
    let (b, t) = (4usize, 128usize);
    let mut rng = Rng::new(1);
    let rows: Vec<Vec<u32>> = (0..b).map(|_| (0..t).map(|_| rng.below(cfg.vocab_size) as u32).collect()).collect();
    let batch = rtune::model::Batch::new(&rows, &vec![t; b], None, &Device::Cpu).unwrap();
    let select: Vec<u32> = (0..b).flat_map(|r| (0..t - 1).map(move |i| (r * t + i) as u32)).collect();
    let targets: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    let select = Tensor::new(select.as_slice(), &Device::Cpu).unwrap();
    let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    println!("shape {which}: {steps} measured steps of {b}x{t} tokens, compute {dtype:?}");
    let flops = step_flops(&cfg, b, t, 8);
    let engines = match std::env::var("RTUNE_BENCH_ENGINE").as_deref() {
        Ok("fused") => vec![Engine::Fused],
        Ok("candle") => vec![Engine::Candle],
        Ok("plain") => vec![Engine::Plain],
        _ => vec![Engine::Fused, Engine::Candle],
    };
    let (select_v, targets_v): (Vec<u32>, Vec<u32>) = (select.to_vec1().unwrap(), targets.to_vec1().unwrap());
    for engine in engines {
        FROZEN_MATMUL.store(engine != Engine::Plain, std::sync::atomic::Ordering::Relaxed);
        let lora = LoraSpec {
            rank: 8,
            alpha: 16.0,
            rslora: false,
            dropout: 0.0,
            targets: ["q_proj", "k_proj", "v_proj", "o_proj"].map(String::from).to_vec(),
        };
        let model = Transformer::with_dtype(&cfg, &weights, &Trainable::lora(lora), &mut Rng::new(2), dtype).unwrap();
        if engine == Engine::Fused
            && let Some(why) = fused::unsupported(&model)
        {
            println!("  fused engine: not available ({why})");
            continue;
        }
        let mut opt =
            AdamW::new(AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }, &model.params).unwrap();
        let mut times = Vec::new();
        for i in 0..steps + 2 {
            let start = Instant::now();
            let grads = match engine {
                Engine::Fused => fused::loss_and_grads(&model, &batch, &select_v, &targets_v, 1.0, None).unwrap().1,
                Engine::Candle | Engine::Plain => {
                    let loss = model.loss(&batch, &select, &targets, None).unwrap();
                    let g = loss.backward().unwrap();
                    let _ = loss.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
                    model.params.iter().map(|p| (p.name.clone(), g.get(p.var.as_tensor()).unwrap().clone())).collect()
                }
            };
            opt.step(&model.params, &grads, 2e-4).unwrap();
            if i >= 2 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        println!(
            "  {:<22} median {:.4} s/step  {:>9.0} tokens/s  peak RSS {}  {:.1} GFLOP/s",
            engine.label(),
            median,
            (b * t) as f64 / median,
            peak_rss(),
            flops / median / 1e9,
        );
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Engine {
    /// rtune's fused CPU engine (the default for f32 LoRA training on the CPU).
    Fused,
    /// candle autograd with rtune's frozen-weight matmul.
    Candle,
    /// candle autograd with candle's plain matmul (weight gradients for frozen layers too).
    Plain,
}

impl Engine {
    fn label(self) -> &'static str {
        match self {
            Engine::Fused => "fused engine",
            Engine::Candle => "candle autograd",
            Engine::Plain => "plain candle matmul",
        }
    }
}

/// Floating-point operations of one LoRA train step that does not compute frozen-weight
/// gradients: forward and input-gradient matmuls of every projection and of the LM head (at
/// `t - 1` positions per row), the four attention matmuls' forward and backward (full `t × t`
/// scores), and the LoRA matmuls on q/k/v/o. Element-wise work is not counted.
fn step_flops(cfg: &rtune::model::ModelConfig, b: usize, t: usize, rank: usize) -> f64 {
    let (h, i, v) = (cfg.hidden_size as f64, cfg.intermediate_size as f64, cfg.vocab_size as f64);
    let (qd, kvd) = ((cfg.num_heads * cfg.head_dim) as f64, (cfg.num_kv_heads * cfg.head_dim) as f64);
    let n = (b * t) as f64;
    let layer_params = h * qd + 2.0 * h * kvd + qd * h + 3.0 * h * i;
    let linears = 2.0 * n * layer_params * cfg.num_layers as f64 * 2.0;
    let head = 2.0 * (b * (t - 1)) as f64 * h * v * 2.0;
    let attn = 2.0 * (b * cfg.num_heads) as f64 * (t * t) as f64 * cfg.head_dim as f64 * 6.0;
    // x·A, u·B forward; dB, du, dA, dx backward: 6 rank-r products per adapter.
    let lora = 2.0 * n * rank as f64 * (h + qd + 2.0 * (h + kvd) + qd + h) * 3.0 * cfg.num_layers as f64;
    linears + head + attn * cfg.num_layers as f64 + lora
}

fn peak_rss() -> String {
    rtune::device::host::peak_rss_bytes().map(rtune::ui::human_bytes).unwrap_or_else(|| "unknown".into())
}
