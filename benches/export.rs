//! Evaluate throughput and export times on random-weight Llama shapes (as `train_step`), with
//! LoRA r=8 adapters on q/k/v/o_proj (random B, so merging does real work). Run:
//!
//!     cargo bench --bench export -- [tiny|135m]
//!
//! - evaluate: mean loss over 4 × 128-token batches, no gradients — rtune's fused engine and
//!   candle's ops (median of 5 batches, tokens/s);
//! - export: the merged model as safetensors and as GGUF f16, q8_0 and q4_k_m (each merged tensor
//!   computed, converted and written one at a time, as the quantize stage does), wall time and
//!   file size.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use rtune::engine::candle::Transformer;
use rtune::engine::fused;
use rtune::model::{Batch, LoraSpec, Trainable};
use rtune::recipe::ExportFormat;
use rtune::rng::Rng;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    rtune::init_process();
    let args = common::args(&["tiny"]);
    let smoke = common::smoke();
    let which = args.first().cloned().unwrap_or_else(|| "tiny".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-export").join(&which);
    let model_dir = root.join("model");
    std::fs::create_dir_all(&model_dir).unwrap();
    let texts: Vec<String> = (0..200).map(|i| format!("row {i}: the quick brown fox {}", i * 7)).collect();
    let cfg = rtune::model::scratch::create(&model_dir, &common::shape(&which, 256), texts.iter(), 0).unwrap();
    let weights = rtune::model::ModelFolder::open(&model_dir).unwrap().load_weights(&Device::Cpu, DType::F32).unwrap();
    let lora = LoraSpec {
        rank: 8,
        alpha: 16.0,
        rslora: false,
        dropout: 0.0,
        targets: ["q_proj", "k_proj", "v_proj", "o_proj"].map(String::from).to_vec(),
    };
    let model = Transformer::new(&cfg, &weights, &Trainable::lora(lora.clone()), &mut Rng::new(2)).unwrap();
    let mut rng = Rng::new(5);
    let values: BTreeMap<String, Tensor> = model
        .params
        .iter()
        .map(|p| {
            let v: Vec<f32> = (0..p.var.elem_count()).map(|_| (rng.next_f64() as f32 - 0.5) * 0.02).collect();
            (p.name.clone(), Tensor::from_vec(v, p.var.shape(), &Device::Cpu).unwrap())
        })
        .collect();
    model.load_params(&values).unwrap();
    println!("shape {which}: {} parameters", weights.values().map(|t| t.elem_count()).sum::<usize>());

    // Evaluate.
    let (b, t) = (4usize, 128usize);
    let rows: Vec<Vec<u32>> = (0..b).map(|_| (0..t).map(|_| rng.below(cfg.vocab_size) as u32).collect()).collect();
    let batch = Batch::new(&rows, &vec![t; b], None, &Device::Cpu).unwrap();
    let select: Vec<u32> = (0..b).flat_map(|r| (0..t - 1).map(move |i| (r * t + i) as u32)).collect();
    let targets: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    let (select_t, targets_t) =
        (Tensor::new(select.as_slice(), &Device::Cpu).unwrap(), Tensor::new(targets.as_slice(), &Device::Cpu).unwrap());
    let reps = if smoke { 1 } else { 5 };
    let time = |f: &dyn Fn() -> f64| -> (f64, f64) {
        let loss = f();
        (
            median(
                (0..reps)
                    .map(|_| {
                        let s = Instant::now();
                        f();
                        s.elapsed().as_secs_f64()
                    })
                    .collect(),
            ),
            loss,
        )
    };
    let (fused_s, fused_loss) = time(&|| fused::loss(&model, &batch, &select, &targets).unwrap());
    let (candle_s, candle_loss) =
        time(&|| model.loss(&batch, &select_t, &targets_t, None).unwrap().to_scalar::<f32>().unwrap() as f64);
    for (name, s, loss) in [("fused engine", fused_s, fused_loss), ("candle ops", candle_s, candle_loss)] {
        println!("  evaluate {name:<14} {:.4} s/batch  {:>8.0} tokens/s  (loss {loss:.5})", s, (b * t) as f64 / s);
    }

    // Export.
    let out = root.join("out");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    // The adapter as the train stage leaves it, merged from the mapped base as the quantize
    // stage merges it.
    let folder = rtune::model::ModelFolder::open(&model_dir).unwrap();
    let adapter = root.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    rtune::model::peft::write(&adapter, &lora, &values, "bench", &folder).unwrap();
    let merged = rtune::export::merged::Merged::open(&folder, Some(&adapter)).unwrap();
    let start = Instant::now();
    let files = merged.save_safetensors(&out, None, 5_000_000_000).unwrap().files;
    let size: u64 = files.iter().map(|f| std::fs::metadata(out.join(f)).unwrap().len()).sum();
    println!("  export safetensors-merged {:>6.2} s  {}", start.elapsed().as_secs_f64(), rtune::ui::human_bytes(size));
    for format in [ExportFormat::GgufF16, ExportFormat::GgufQ8_0, ExportFormat::GgufQ4KM] {
        let path = out.join(format!("{format:?}.gguf"));
        let start = Instant::now();
        rtune::export::gguf::write(&path, &merged, &model_dir, "bench", format, None, None).unwrap();
        let size = std::fs::metadata(&path).unwrap().len();
        println!(
            "  export {:<18} {:>6.2} s  {}",
            format!("{format:?}"),
            start.elapsed().as_secs_f64(),
            rtune::ui::human_bytes(size)
        );
    }
}
