//! One epoch of a real-looking instruction dataset, the third comparison of issue 11: rows of
//! varied length (prompt and response lengths drawn from log-normal distributions shaped like
//! Alpaca's, prompt tokens masked out of the loss), LoRA r=8 alpha=16 on q/k/v/o_proj, AdamW lr
//! 2e-4, batch 8, one pass, random-weight Llama shapes as in `train_step`. Run:
//!
//!     cargo bench --bench epoch -- [tiny|135m] [rows]
//!
//! It writes the rows to `target/bench-epoch/<shape>/rows.json` (for
//! benches/reference/peft_epoch.py, which trains on the same rows in the same order with
//! transformers' usual padding to the longest row of each batch), then runs rtune's real
//! training loop (`rtune::train::train`) three times: batches in shuffled order (padding as
//! PyTorch pads), with `group_by_length`, and with the rows packed (`dataset.packing`: the
//! tokenize stage's packer, sequences of up to 512 tokens, batch 2 — about the tokens of a batch
//! of 8 rows). Reported: the training loop's wall time, tokens, and the share of batch slots that
//! are padding.

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use rtune::data::tokens::TokenWriter;
use rtune::recipe::{Adapter, TrainSettings};
use rtune::rng::Rng;

const BATCH: usize = 8;
/// Packed sequences of up to `PACK` tokens, `PACKED_BATCH` of them a batch.
const PACK: usize = 512;
const PACKED_BATCH: usize = 2;

/// Prompt and response lengths: Alpaca rows through a Llama tokenizer and the Alpaca template
/// have a median of about 60 prompt and 90 response tokens with a long right tail.
fn lengths(rng: &mut Rng) -> (usize, usize) {
    let lognormal = |rng: &mut Rng, median: f64, sigma: f64| (median * (sigma * rng.normal()).exp()).round() as usize;
    let prompt = (24 + lognormal(rng, 36.0, 0.7)).min(300);
    let response = lognormal(rng, 90.0, 0.9).clamp(2, 512 - prompt);
    (prompt, response)
}

fn main() {
    rtune::init_process();
    let args = common::args(&["tiny", "16"]);
    let which = args.first().cloned().unwrap_or_else(|| "tiny".into());
    let rows: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(if which == "tiny" { 1024 } else { 64 });
    let spec = common::shape(&which, 1024);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-epoch").join(&which);
    let model_dir = root.join("model");
    std::fs::create_dir_all(&model_dir).unwrap();
    let texts: Vec<String> = (0..200).map(|i| format!("row {i}: the quick brown fox {}", i * 7)).collect();
    let cfg = rtune::model::scratch::create(&model_dir, &spec, texts.iter(), 0).unwrap();

    // The rows: token ids, and how many of them are prompt.
    let mut rng = Rng::new(7);
    let data: Vec<(Vec<u32>, usize)> = (0..rows)
        .map(|_| {
            let (p, r) = lengths(&mut rng);
            let ids = (0..p + r).map(|_| 3 + rng.below(cfg.vocab_size - 3) as u32).collect();
            (ids, p)
        })
        .collect();
    // The shuffled order rtune's loop uses for epoch 0, so that PyTorch sees the same batches.
    let order = rtune::train::epoch_rows(data.len(), |i| data[i].0.len(), 42, 0, BATCH, false);
    let json = serde_json::json!({
        "rows": data.iter().map(|(ids, p)| serde_json::json!({"ids": ids, "prompt": p})).collect::<Vec<_>>(),
        "order": order,
        "batch_size": BATCH,
    });
    std::fs::write(root.join("rows.json"), serde_json::to_string(&json).unwrap()).unwrap();
    let tokens_dir = root.join("tokens");
    std::fs::create_dir_all(&tokens_dir).unwrap();
    let mut w = TokenWriter::create(&tokens_dir, "train").unwrap();
    for (ids, p) in &data {
        let mask: Vec<u8> = (0..ids.len()).map(|i| (i >= *p) as u8).collect();
        w.push(ids, &mask, &vec![0u16; ids.len()]).unwrap();
    }
    w.finish(&tokens_dir, "train").unwrap();
    // The same rows packed, as the tokenize stage packs them (`dataset.packing = true`).
    let packed_dir = root.join("tokens-packed");
    std::fs::create_dir_all(&packed_dir).unwrap();
    let mut w = TokenWriter::create(&packed_dir, "train").unwrap();
    let mut packer = rtune::data::tokens::Packer::new(PACK);
    let mut packed: Vec<usize> = Vec::new();
    for (ids, p) in &data {
        let mask: Vec<u8> = (0..ids.len()).map(|i| (i >= *p) as u8).collect();
        if let Some((ids, mask, seg)) = packer.add(ids, &mask) {
            packed.push(ids.len());
            w.push(&ids, &mask, &seg).unwrap();
        }
    }
    if let Some((ids, mask, seg)) = packer.flush() {
        packed.push(ids.len());
        w.push(&ids, &mask, &seg).unwrap();
    }
    w.finish(&packed_dir, "train").unwrap();
    for dir in [&tokens_dir, &packed_dir] {
        let mut w = TokenWriter::create(dir, "eval").unwrap();
        let (ids, p) = &data[0];
        w.push(ids, &(0..ids.len()).map(|i| (i >= *p) as u8).collect::<Vec<_>>(), &vec![0u16; ids.len()]).unwrap();
        w.finish(dir, "eval").unwrap();
    }
    let real: usize = data.iter().map(|(ids, _)| ids.len()).sum();
    let targets: usize = data.iter().map(|(ids, p)| ids.len() - p).sum();
    println!(
        "shape {which}: {rows} rows, {real} tokens ({targets} in the loss), batch {BATCH}, one epoch, engine {}",
        std::env::var("RTUNE_ENGINE").unwrap_or_else(|_| "default".into())
    );

    let adapter: Adapter = toml::from_str(
        r#"kind = "lora"
rank = 8
alpha = 16
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]"#,
    )
    .unwrap();
    for (name, group, pack) in [("shuffled", false, false), ("group_by_length", true, false), ("packed", false, true)] {
        let batch = if pack { PACKED_BATCH } else { BATCH };
        let settings: TrainSettings = toml::from_str(&format!(
            "batch_size = {batch}\nlearning_rate = 2e-4\nepochs = 1\neval_batches = 1\ncheckpoint_every = 0\ngroup_by_length = {group}"
        ))
        .unwrap();
        let out = root.join(format!("out-{name}"));
        let work = root.join(format!("work-{name}"));
        for d in [&out, &work] {
            let _ = std::fs::remove_dir_all(d);
            std::fs::create_dir_all(d).unwrap();
        }
        let ui = rtune::ui::Ui::new(true, false);
        let cpu = rtune::device::Resolution::cpu();
        let engine = rtune::engine::requested();
        let job = rtune::train::TrainJob {
            model_dir: &model_dir,
            tokens_dir: if pack { &packed_dir } else { &tokens_dir },
            settings: &settings,
            adapter: &adapter,
            seed: 42,
            device: &cpu,
            tf32: false,
            engine: engine.as_deref(),
            work: PathBuf::from(&work),
            out: &out,
            ui: &ui,
        };
        let start = Instant::now();
        let summary = rtune::train::train(&job).unwrap();
        let total = start.elapsed().as_secs_f64();
        let seconds = summary["seconds"].as_f64().unwrap();
        let lens: Vec<usize> = if pack { packed.clone() } else { data.iter().map(|(ids, _)| ids.len()).collect() };
        let padded = padded_slots(&lens, 42, group, batch);
        println!(
            "  {:<16} loop {:.2} s  ({:.2} s with model load and evals)  {:.0} tokens/s  {} sequences  padding {:.0}% of batch slots  peak RSS {}",
            name,
            seconds,
            total,
            real as f64 / seconds,
            lens.len(),
            100.0 * (padded - real) as f64 / padded as f64,
            rtune::device::host::peak_rss_bytes().map(rtune::ui::human_bytes).unwrap_or_default(),
        );
    }
}

/// Batch slots (sequences × longest sequence, summed over batches) in the epoch order rtune
/// uses, for sequences of lengths `lens`.
fn padded_slots(lens: &[usize], seed: u64, group: bool, batch: usize) -> usize {
    let order = rtune::train::epoch_rows(lens.len(), |i| lens[i], seed, 0, batch, group);
    order.chunks(batch).map(|b| b.len() * b.iter().map(|&i| lens[i]).max().unwrap_or(0)).sum()
}
