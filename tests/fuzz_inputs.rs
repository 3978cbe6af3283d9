//! Fuzz-style property tests for the files rtune reads from disk and the network: a model
//! folder (config.json, safetensors, tokenizer.json, a PEFT adapter), dataset files of every
//! kind, GGUF (rtune's own exports, read back by the self-check) and Hub answers. Mutated or
//! random input gives an error or a value — never a panic, never an unbounded allocation.

mod common;

use std::path::Path;

use candle_core::{DType, Device};
use proptest::prelude::*;
use rtune::model::{ModelFolder, peft};

fn golden_model() -> std::path::PathBuf {
    common::root().join("tests/fixtures/golden/tiny-llama/model")
}

/// Flip one byte (or cut the file) of `file` inside a copy of `src`, then call `f` on the copy.
fn mutated<T>(src: &Path, file: &str, pos: usize, byte: u8, cut: bool, f: impl FnOnce(&Path) -> T) -> T {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let p = dir.path().join(file);
    let mut bytes = std::fs::read(&p).unwrap();
    let i = pos % bytes.len().max(1);
    if cut {
        bytes.truncate(i);
    } else if !bytes.is_empty() {
        bytes[i] = byte;
    }
    std::fs::write(&p, bytes).unwrap();
    f(dir.path())
}

fn open_and_load(dir: &Path) {
    if let Ok(folder) = ModelFolder::open(dir) {
        let _ = folder.load_weights(&Device::Cpu, DType::F32);
        let _ = folder.tokenizer();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    /// The safetensors header (its first bytes hold the header length and the JSON with shapes
    /// and offsets) is where hostile sizes live: mutate mostly there.
    #[test]
    fn mutated_safetensors_never_panic(pos in 0usize..600, byte in any::<u8>(), cut in prop::bool::weighted(0.2)) {
        mutated(&golden_model(), "model.safetensors", pos, byte, cut, open_and_load);
    }

    #[test]
    fn mutated_config_json_never_panics(pos in 0usize..900, byte in any::<u8>(), cut in prop::bool::weighted(0.2)) {
        mutated(&golden_model(), "config.json", pos, byte, cut, open_and_load);
    }

    #[test]
    fn mutated_tokenizer_json_never_panics(pos in 0usize..15000, byte in any::<u8>(), cut in prop::bool::weighted(0.2)) {
        let src = common::root().join("tests/fixtures/tokens");
        mutated(&src, "tokenizer.json", pos, byte, cut, |dir| {
            if let Ok(t) = rtune::model::folder::load_tokenizer(&dir.join("tokenizer.json")) {
                let _ = t.encode("Hello there, 🦀!", true);
            }
        });
    }

    #[test]
    fn mutated_peft_adapters_never_panic(pos in 0usize..4000, byte in any::<u8>(), file in 0usize..2) {
        let src = common::root().join("tests/fixtures/golden/tiny-llama/adapter");
        let name = ["adapter_config.json", "adapter_model.safetensors"][file];
        mutated(&src, name, pos, byte, false, |dir| {
            let _ = peft::read_config(dir);
            let _ = peft::read_weights(dir, &Device::Cpu);
        });
    }

    #[test]
    fn random_dataset_files_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400), ext in 0usize..6) {
        let dir = tempfile::tempdir().unwrap();
        let name = ["d.jsonl", "d.json", "d.csv", "d.txt", "d.parquet", "d.unknown"][ext];
        std::fs::write(dir.path().join(name), &bytes).unwrap();
        let _ = rtune::data::read_rows(&dir.path().join(name), false);
        let _ = rtune::data::read_rows(&dir.path().join(name), true);
    }

    #[test]
    fn mutated_parquet_never_panics(pos in 0usize..1500, byte in any::<u8>(), cut in prop::bool::weighted(0.2)) {
        let src = common::root().join("tests/fixtures/tokens");
        mutated(&src, "chat.parquet", pos, byte, cut, |dir| {
            let _ = rtune::data::read_rows(&dir.join("chat.parquet"), false);
        });
    }

    #[test]
    fn random_chat_templates_never_panic(src in "[{}%# a-z'()+\\[\\]=|.]{0,80}") {
        if let Ok(t) = rtune::data::chat::ChatTemplate::new(&src, "<s>", "</s>") {
            let msgs: Vec<serde_json::Value> = serde_json::from_str(r#"[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]"#).unwrap();
            let _ = t.spans(&msgs);
        }
    }

    /// Hub answers (repo listings, upload negotiation) arrive as JSON; any text is an error or a
    /// value, and names are checked before they become paths.
    #[test]
    fn random_repo_paths_are_checked_not_trusted(p in "[a-z./\\\\:~ ]{0,24}") {
        if rtune::hub::check_repo_path(&p).is_ok() {
            let joined = Path::new("/cache/snap").join(&p);
            prop_assert!(joined.starts_with("/cache/snap"));
            prop_assert!(!joined.components().any(|c| matches!(c, std::path::Component::ParentDir)));
        }
    }
}

/// A GGUF cut or corrupted anywhere is refused by the reader the self-check uses.
#[test]
fn damaged_gguf_files_are_errors() {
    use candle_core::quantized::gguf_file::Content;
    let dir = tempfile::tempdir().unwrap();
    // A tokenizer is needed for the metadata; the token fixture's will do.
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(golden_model().join(f), dir.path().join(f)).unwrap();
    }
    std::fs::copy(common::root().join("tests/fixtures/tokens/tokenizer.json"), dir.path().join("tokenizer.json"))
        .unwrap();
    let path = dir.path().join("m.gguf");
    let copy = ModelFolder::open(dir.path()).unwrap();
    let merged = rtune::export::merged::Merged::open(&copy, None).unwrap();
    rtune::export::gguf::write(&path, &merged, dir.path(), "t", rtune::recipe::ExportFormat::GgufQ8_0, None, None)
        .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let mut refused = 0;
    for cut in [0usize, 3, 8, 24, 100, 1000, bytes.len() / 2] {
        let mut f = std::io::Cursor::new(bytes[..cut.min(bytes.len())].to_vec());
        if Content::read(&mut f).is_err() {
            refused += 1;
        }
    }
    assert!(refused >= 5, "truncated GGUF headers must not parse ({refused} refused)");
}

/// Found by `mutated_tokenizer_json_never_panics`: a space written into the post-processor's
/// template leaves it naming a special token it does not define. The tokenizers crate loads
/// such a file and panics on the first encode; rtune's loader reports it instead.
#[test]
fn tokenizer_with_an_undefined_template_token_is_an_error() {
    let src = common::root().join("tests/fixtures/tokens");
    mutated(&src, "tokenizer.json", 1300, b' ', false, |dir| {
        let path = dir.join("tokenizer.json");
        let err = rtune::model::folder::load_tokenizer(&path).expect_err("an inconsistent tokenizer loads");
        let text = format!("{err:?}");
        assert!(text.contains("inconsistent") && text.contains("tokenizer.json"), "{text}");
    });
}
