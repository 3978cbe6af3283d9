//! Train-step throughput on random-weight Llama shapes, following the protocol of
//! docs/benchmarks.md: LoRA r=8, alpha=16, dropout 0 on q/k/v/o_proj, AdamW lr 2e-4, batch
//! 4 × 128 tokens, median seconds per step after 2 warm-up steps. Run:
//!
//!     cargo bench --bench train_step -- [tiny|135m] [steps] [f32|bf16|f16]
//!
//! It runs each shape twice: with rtune's frozen-weight matmul (no weight gradients for frozen
//! layers) and with candle's plain matmul, to measure what the former saves.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use rtune::model::{LoraSpec, Trainable, Transformer, lora::FROZEN_MATMUL};
use rtune::recipe::{Arch, ScratchModel};
use rtune::rng::Rng;
use rtune::train::optim::{AdamW, AdamWConfig};

fn shape(name: &str) -> ScratchModel {
    let (hidden, layers, heads, kv, inter, vocab, tied) = match name {
        "135m" => (576, 30, 9, 3, 1536, 49152, true),
        _ => (64, 2, 4, 2, 128, 1000, false),
    };
    ScratchModel {
        arch: Arch::Llama,
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: Some(kv),
        intermediate_size: inter,
        vocab_size: vocab,
        max_position_embeddings: 256,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tied,
        initializer_range: 0.02,
    }
}

fn main() {
    if std::env::var_os("RTUNE_COMPOSED_CE").is_some() {
        rtune::model::transformer::FUSED_CROSS_ENTROPY.store(false, std::sync::atomic::Ordering::Relaxed);
    }
    if std::env::var_os("RTUNE_NO_PROCESS_TUNING").is_none() {
        rtune::init_process();
    }
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let which = args.first().cloned().unwrap_or_else(|| "tiny".into());
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(if which == "tiny" { 30 } else { 5 });
    let dtype = match args.get(2).map(String::as_str) {
        Some("bf16") => DType::BF16,
        Some("f16") => DType::F16,
        _ => DType::F32,
    };
    let spec = shape(&which);
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
    for frozen in [true, false] {
        FROZEN_MATMUL.store(frozen, std::sync::atomic::Ordering::Relaxed);
        let lora = LoraSpec {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            targets: ["q_proj", "k_proj", "v_proj", "o_proj"].map(String::from).to_vec(),
        };
        let model = Transformer::with_dtype(&cfg, &weights, &Trainable::Lora(lora), &mut Rng::new(2), dtype).unwrap();
        let mut opt =
            AdamW::new(AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }, &model.params).unwrap();
        let mut times = Vec::new();
        for i in 0..steps + 2 {
            let start = Instant::now();
            let loss = model.loss(&batch, &select, &targets, None).unwrap();
            let g = loss.backward().unwrap();
            let grads: BTreeMap<String, Tensor> =
                model.params.iter().map(|p| (p.name.clone(), g.get(p.var.as_tensor()).unwrap().clone())).collect();
            opt.step(&model.params, &grads, 2e-4).unwrap();
            let _ = loss.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
            if i >= 2 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        println!(
            "  {:<22} median {:.4} s/step  {:>9.0} tokens/s  peak RSS {}",
            if frozen { "frozen-weight matmul" } else { "plain candle matmul" },
            median,
            (b * t) as f64 / median,
            peak_rss()
        );
    }
}

fn peak_rss() -> String {
    rtune::train::peak_rss_bytes().map(rtune::ui::human_bytes).unwrap_or_else(|| "unknown".into())
}
