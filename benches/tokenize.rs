//! Tokenize throughput: 100k alpaca rows through rtune's reader and renderer (the tokenize
//! stage's path), with an 8k-vocab byte-level BPE trained on the data. Writes the data and the
//! tokenizer to target/bench-tokenize/ so the Python `tokenizers` library can do the same work:
//!
//!     cargo bench --bench tokenize
//!     python3 scripts/bench/tokenize-speed.py target/bench-tokenize

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

use rtune::data::{Renderer, read_rows};
use rtune::recipe::DataFormat;

fn main() {
    // `RTUNE_BENCH_SMOKE=1` (CI): a tiny run that proves the benchmark still works.
    let rows: usize = if std::env::var_os("RTUNE_BENCH_SMOKE").is_some() { 1_000 } else { 100_000 };
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-tokenize");
    std::fs::create_dir_all(&out).unwrap();
    let src = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/data/synthetic-alpaca.jsonl"),
    )
    .unwrap();
    let base: Vec<serde_json::Value> = src.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let data = out.join("alpaca-100k.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&data).unwrap());
    for i in 0..rows {
        let mut r = base[i % base.len()].clone();
        r["instruction"] = format!("{} (variant {i})", r["instruction"].as_str().unwrap()).into();
        writeln!(f, "{r}").unwrap();
    }
    drop(f);
    let texts: Vec<String> =
        base.iter().map(|r| format!("{} {} {}", r["instruction"], r["input"], r["output"])).collect();
    let tokenizer = rtune::model::scratch::train_tokenizer(texts.iter(), 8192).unwrap();
    tokenizer.save(out.join("tokenizer.json"), false).unwrap();
    let bos = tokenizer.token_to_id("<s>");
    let eos = tokenizer.token_to_id("</s>");
    let column_map = BTreeMap::new();
    let r = Renderer {
        tokenizer: &tokenizer,
        format: DataFormat::Alpaca,
        bos,
        eos,
        max_seq_len: 4096,
        truncate: true,
        train_on_prompt: false,
        column_map: &column_map,
        chat: None,
    };
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut times = Vec::new();
    let mut tokens = 0usize;
    for _ in 0..3 {
        let start = Instant::now();
        let (rows, _) = read_rows(&data, false).unwrap();
        tokens = 0;
        for chunk in rows.chunks(4096) {
            for e in r.encode(chunk).unwrap() {
                tokens += e.unwrap().ids.len();
            }
        }
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let med = times[1];
    println!(
        "rtune tokenize (alpaca, {rows} rows, {tokens} tokens, {threads} threads): median {med:.2} s of 3 = {:.0} rows/s, {:.0} tokens/s",
        rows as f64 / med,
        tokens as f64 / med
    );
    println!("data and tokenizer in {}", out.display());
}
