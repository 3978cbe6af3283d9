//! Peak memory of the tokenize stage (issue 21, item 11): rows stream from the file through the
//! tokenizer into the token store, so peak RSS does not grow with the dataset. Its own test
//! binary, so that the children's peak RSS (`getrusage(RUSAGE_CHILDREN)`, the largest of the
//! runs: JSON Lines, then the same rows as one JSON array, then a scratch model's tokenizer
//! trained on them) is only rtune's here.

mod common;

use common::*;

#[test]
fn tokenize_memory_does_not_grow_with_the_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let rows: Vec<String> = std::fs::read_to_string(root().join("recipes/data/synthetic-alpaca.jsonl"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let spec: rtune::recipe::ScratchModel = toml::from_str(
        "arch = \"llama\"\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 1\nintermediate_size = 64\nvocab_size = 400",
    )
    .unwrap();
    std::fs::create_dir_all(p.join("model")).unwrap();
    rtune::model::scratch::create(&p.join("model"), &spec, rows.iter(), 1).unwrap();
    // 16 MB of rows (the old reader held ~13× the file in memory: over 200 MB here).
    let mut data = String::new();
    let mut k = 0;
    while data.len() < 16 << 20 {
        for r in &rows {
            let mut v: serde_json::Value = serde_json::from_str(r).unwrap();
            v["instruction"] = format!("{} (#{k})", v["instruction"].as_str().unwrap()).into();
            data.push_str(&v.to_string());
            data.push('\n');
        }
        k += 1;
    }
    std::fs::create_dir_all(p.join("data")).unwrap();
    std::fs::write(p.join("data/big.jsonl"), &data).unwrap();
    // The same rows as one JSON array: streamed item by item too.
    let array = format!("[\n{}\n]\n", data.trim_end().replace('\n', ",\n"));
    std::fs::write(p.join("data/big.json"), array).unwrap();
    drop(data);
    for file in ["big.jsonl", "big.json"] {
        std::fs::write(
            p.join("bench.toml"),
            format!("[recipe]\nname = \"mem\"\n[model]\npath = \"model\"\n[dataset]\npath = \"data/{file}\"\nformat = \"alpaca\"\neval_fraction = 0.01\nmax_seq_len = 256\npacking = true\n[stages.train]\n"),
        )
        .unwrap();
        let cache = p.join(format!("cache-{file}"));
        let o = rtune(p, &cache, &["run", "bench.toml", "--only", "download"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let o = rtune(p, &cache, &["run", "bench.toml", "--only", "tokenize"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stderr(&o).contains("tokenize") && stderr(&o).contains("train /"), "{}", stderr(&o));
    }
    // A scratch model's tokenizer is trained by the download stage on the same 16 MB: rows
    // stream into the trainer, which keeps word counts, not texts.
    std::fs::write(
        p.join("scratch.toml"),
        "[recipe]\nname = \"mem-scratch\"\n[model]\nscratch = { arch = \"llama\", hidden_size = 32, num_layers = 1, num_heads = 2, num_kv_heads = 1, intermediate_size = 64, vocab_size = 400 }\n[dataset]\npath = \"data/big.jsonl\"\nformat = \"alpaca\"\n[stages.train]\n",
    )
    .unwrap();
    let o = rtune(p, &p.join("cache-scratch"), &["run", "scratch.toml", "--only", "download"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("tokenizer trained on"), "{}", stderr(&o));
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) }, 0);
    let peak_mb = usage.ru_maxrss / 1024; // kilobytes on Linux
    eprintln!("peak RSS of rtune: {peak_mb} MB");
    assert!(peak_mb < 120, "peak RSS {peak_mb} MB for a 16 MB dataset");
}
