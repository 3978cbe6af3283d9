//! Issue 20: what is hashed is what the stages get. For every key of the recipe schema, a
//! change either changes the fingerprint of some stage, or the key is listed below as not
//! affecting outputs, with the reason. The list of keys comes from `rtune schema`, so a new
//! setting cannot be added without deciding which it is.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;

/// Keys whose value does not reach any output, and why.
const NO_EFFECT: &[(&str, &str)] = &[
    ("device.threads", "CPU threads change speed, not results (sums are split the same way)"),
    ("device.prefer", "the device it resolves to is fingerprinted (its class), not the list"),
    (
        "device.dtype",
        "the dtype it resolves to is fingerprinted, not the list (tested: device_overrides_and_plan_explanation)",
    ),
    ("device.tf32", "fingerprinted only where it applies (on CUDA); on the CPU it changes nothing"),
    (
        "device.gpus",
        "GPUs that train together sum one device's gradients (tested: data_parallel_on_two_vulkan_devices_trains_as_one)",
    ),
    ("stages.train.keep_checkpoints", "how many resumable checkpoints stay in the work folder"),
    ("stages.train.checkpoint_every", "resumable state only; a resumed run equals an uninterrupted one"),
    ("stages.*.needs", "ordering; the inputs a stage reads are fingerprinted themselves"),
    ("stages.*.kind", "a stage's kind is part of the fingerprint; changing it is tested as a new stage"),
];

/// Keys that name a different source (a Hub repo, a revision, a file list, a local path): their
/// content, not their value, is fingerprinted, and tests/hub.rs and tests/pipeline.rs change it
/// (`imatrix_file`: `a_named_importance_matrix_calibrates`).
const SOURCES: &[&str] = &[
    "model.path",
    "model.repo",
    "model.revision",
    "dataset.path",
    "dataset.repo",
    "dataset.revision",
    "dataset.files",
    "stages.evaluate.dataset",
    "stages.quantize.imatrix_file",
];

/// A changed value for every other key, as `--set` arguments.
/// Keys that apply to a dataset folder's splits (a single file, as in tiny-offline, is one split),
/// and the stage each must change on a folder: checked by `split_keys_change_fingerprints`.
const FOLDER_SPLITS: &[(&str, &str, &str)] = &[
    ("dataset.split", "\"validation\"", "tokenize"),
    ("dataset.eval_split", "\"test\"", "tokenize"),
    ("stages.evaluate.split", "\"validation\"", "eval_base"),
    ("dataset.config", "\"b\"", "tokenize"),
    ("stages.evaluate.config", "\"b\"", "eval_base"),
];

const CHANGES: &[(&str, &str)] = &[
    ("recipe.name", "other-name"),
    ("dataset.sep", "\";\""),
    ("dataset.field", "\"data\""),
    ("dataset.sample_by", "\"paragraph\""),
    ("recipe.description", "\"another description\""),
    ("recipe.seed", "7"),
    ("model.scratch.arch", "\"qwen2\""),
    ("model.scratch.hidden_size", "32"),
    ("model.scratch.intermediate_size", "96"),
    ("model.scratch.num_layers", "3"),
    ("model.scratch.num_heads", "8"),
    ("model.scratch.num_kv_heads", "4"),
    ("model.scratch.head_dim", "32"),
    ("model.scratch.vocab_size", "600"),
    ("model.scratch.max_position_embeddings", "1024"),
    ("model.scratch.rms_norm_eps", "1e-4"),
    ("model.scratch.rope_theta", "500000.0"),
    ("model.scratch.initializer_range", "0.05"),
    ("model.scratch.tie_word_embeddings", "false"),
    ("dataset.format", "\"text\""),
    ("dataset.column_map", "{instruction=\"input\", input=\"instruction\"}"),
    ("dataset.chat_template", "\"chatml\""),
    ("dataset.chat_template_kwargs", "{enable_thinking=false}"),
    ("dataset.eval_fraction", "0.1"),
    ("dataset.max_seq_len", "128"),
    ("dataset.truncate", "false"),
    ("dataset.packing", "true"),
    ("dataset.train_on_prompt", "true"),
    ("dataset.skip_bad_rows", "true"),
    ("adapter.kind", "\"none\""),
    ("adapter.rank", "4"),
    ("adapter.alpha", "8"),
    ("adapter.rslora", "true"),
    ("adapter.quantize_base", "\"nf4\""),
    ("adapter.dropout", "0.1"),
    ("adapter.targets", "[\"q_proj\"]"),
    ("stages.train.epochs", "2"),
    ("stages.train.max_steps", "9"),
    ("stages.train.batch_size", "8"),
    ("stages.train.grad_accum", "2"),
    ("stages.train.learning_rate", "1e-3"),
    ("stages.train.weight_decay", "0.1"),
    ("stages.train.betas", "[0.8, 0.99]"),
    ("stages.train.adam_eps", "1e-6"),
    ("stages.train.clip_grad_norm", "0.5"),
    ("stages.train.schedule", "{kind = \"linear\", warmup_steps = 3}"),
    ("stages.train.eval_every", "50"),
    ("stages.train.eval_batches", "3"),
    ("stages.train.early_stopping", "{patience = 2}"),
    ("stages.train.ema", "{decay = 0.99}"),
    ("stages.train.loss_guard", "{max_bad_steps = 2}"),
    ("stages.train.group_by_length", "true"),
    ("stages.train.gradient_checkpointing", "true"),
    ("stages.train.trainable", "[\"*norm*\", \"lm_head.weight\"]"),
    ("stages.evaluate.model", "\"base\""),
    ("stages.evaluate.batch_size", "2"),
    ("stages.evaluate.prompts", "[\"Hi?\"]"),
    ("stages.evaluate.max_new_tokens", "8"),
    ("stages.evaluate.temperature", "0.5"),
    ("stages.evaluate.top_k", "5"),
    ("stages.evaluate.top_p", "0.9"),
    ("stages.quantize.formats", "[\"gguf-f16\"]"),
    ("stages.quantize.max_shard_size", "\"1MB\""),
    ("stages.quantize.merged_dtype", "\"bf16\""),
    ("stages.quantize.imatrix", "false"),
    ("stages.quantize.imatrix_tokens", "1000"),
    ("stages.upload.to", "\"dir://out/elsewhere\""),
    ("stages.upload.message", "\"a message\""),
    ("stages.upload.create", "true"),
    ("stages.upload.private", "false"),
];

/// Every leaf key of the schema (`stages.<kind>.<key>` for stage settings).
fn schema_keys() -> BTreeSet<String> {
    let cache = tempfile::tempdir().unwrap();
    let schema: serde_json::Value = serde_json::from_str(&stdout(&rtune(&root(), cache.path(), &["schema"]))).unwrap();
    let defs = &schema["$defs"];
    fn walk(node: &serde_json::Value, defs: &serde_json::Value, path: String, out: &mut BTreeSet<String>, depth: u32) {
        if depth > 8 {
            return;
        }
        if let Some(r) = node["$ref"].as_str() {
            return walk(&defs[r.rsplit('/').next().unwrap()], defs, path, out, depth + 1);
        }
        let mut nested = false;
        for k in ["allOf", "anyOf", "oneOf"] {
            for x in node[k].as_array().into_iter().flatten() {
                let before = out.len();
                walk(x, defs, path.clone(), out, depth + 1);
                nested |= out.len() > before;
            }
        }
        match node["properties"].as_object() {
            Some(props) if !props.is_empty() => {
                for (k, v) in props {
                    walk(v, defs, if path.is_empty() { k.clone() } else { format!("{path}.{k}") }, out, depth + 1);
                }
            }
            _ if !nested && !path.is_empty() && !path.starts_with("stages") => {
                out.insert(path);
            }
            _ => {}
        }
    }
    let mut keys = BTreeSet::new();
    for (name, def) in defs.as_object().unwrap() {
        if let Some(kind) = name.strip_suffix("Stage") {
            for k in def["properties"].as_object().unwrap().keys() {
                keys.insert(format!("stages.{}.{k}", kind.to_lowercase()));
            }
        }
    }
    for section in ["recipe", "model", "dataset", "adapter", "device"] {
        walk(&schema["properties"][section], defs, section.to_string(), &mut keys, 0);
    }
    // `model.scratch` is an object or null: its fields are the keys.
    keys.retain(|k| k != "model.scratch");
    keys
}

fn fingerprints(p: &Project, set: &[&str]) -> Result<BTreeMap<String, String>, String> {
    let mut args = vec!["plan", "tiny.toml", "--json"];
    args.extend_from_slice(set);
    let o = p.run(&args);
    if !o.status.success() {
        return Err(stderr(&o));
    }
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    Ok(plan["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap().to_string(), s["fingerprint"].as_str().unwrap().to_string()))
        .collect())
}

#[test]
fn every_recipe_key_changes_a_fingerprint_or_is_listed_as_not_affecting_outputs() {
    let listed = |k: &str| {
        let wild = k.split('.').enumerate().map(|(i, p)| if i == 1 && k.starts_with("stages.") { "*" } else { p });
        let wild = wild.collect::<Vec<_>>().join(".");
        NO_EFFECT.iter().any(|(n, _)| *n == k || *n == wild)
            || SOURCES.contains(&k)
            || CHANGES.iter().any(|(n, _)| *n == k)
            || FOLDER_SPLITS.iter().any(|(n, ..)| *n == k)
            || (k.starts_with("stages.download.") || k.starts_with("stages.tokenize."))
                && (k.ends_with(".kind") || k.ends_with(".needs"))
    };
    let unlisted: Vec<String> = schema_keys().into_iter().filter(|k| !listed(k)).collect();
    assert!(unlisted.is_empty(), "schema keys neither changed here nor listed: {unlisted:?}");

    let p = Project::tiny_offline();
    let base = fingerprints(&p, &[]).unwrap();
    // The importance matrix's settings apply to the GGUF types that use one.
    let calibrated = ["--set", "stages.quantize.formats=[\"gguf-q4_k_m\"]"];
    let base_calibrated = fingerprints(&p, &calibrated).unwrap();
    let mut silent = Vec::new();
    for (key, value) in CHANGES {
        let set = format!("{key}={value}");
        let mut args = vec!["--set", &set];
        // Base weights that train have no adapter to export.
        if *key == "adapter.kind" || *key == "stages.train.trainable" {
            args.extend(["--set", "stages.quantize.formats=[\"safetensors-merged\"]"]);
        }
        let mut base = &base;
        if key.starts_with("stages.quantize.imatrix") {
            args.extend(calibrated);
            base = &base_calibrated;
        }
        let changed = fingerprints(&p, &args).unwrap_or_else(|e| panic!("--set {set}: {e}"));
        if changed.iter().all(|(stage, fp)| base.get(stage) == Some(fp)) {
            silent.push(set);
        }
    }
    assert!(silent.is_empty(), "changing these changes no stage's fingerprint: {silent:?}");
}

/// On a dataset folder of three splits (and a dataset card with two configs), the split keys each
/// change the stage that reads them.
#[test]
fn split_keys_change_fingerprints() {
    let p = Project::tiny_offline();
    // `eval_split` and `eval_fraction` cannot both be written.
    let recipe = std::fs::read_to_string(p.path().join("tiny.toml")).unwrap();
    std::fs::write(p.path().join("tiny.toml"), recipe.replace("eval_fraction = 0.05\n", "")).unwrap();
    std::fs::create_dir(p.path().join("splits")).unwrap();
    for split in ["train", "validation", "test"] {
        std::fs::copy(p.path().join("data/synthetic-alpaca.jsonl"), p.path().join(format!("splits/{split}.jsonl")))
            .unwrap();
    }
    let card = "---\nconfigs:\n- config_name: a\n  default: true\n  data_files:\n  - {split: train, path: train.jsonl}\n  \
                - {split: validation, path: validation.jsonl}\n  - {split: test, path: test.jsonl}\n- config_name: b\n  \
                data_files:\n  - {split: train, path: validation.jsonl}\n  - {split: test, path: test.jsonl}\n---\n";
    std::fs::write(p.path().join("splits/README.md"), card).unwrap();
    let folder = ["--set", "dataset.path=\"splits\"", "--set", "stages.eval_base.dataset=\"splits\""];
    let base_args = [&folder[..], &["--set", "stages.eval_base.split=\"test\""]].concat();
    let base = fingerprints(&p, &base_args).unwrap();
    for (key, value, stage) in FOLDER_SPLITS {
        let set = format!("{}={value}", key.replace("stages.evaluate.", "stages.eval_base."));
        // A later `--set` of the same key wins.
        let changed =
            fingerprints(&p, &[&base_args[..], &["--set", &set]].concat()).unwrap_or_else(|e| panic!("{set}: {e}"));
        assert_ne!(changed.get(*stage), base.get(*stage), "--set {set} changes `{stage}`");
    }
}

/// `gguf-q4_k`, `gguf-q4_k_m`'s older name, exports (and hashes as) `gguf-q4_k_m`, once even
/// when both are named; another format hashes differently. (The upload's model card quotes
/// the recipe as written, so only its fingerprint follows the spelling.)
#[test]
fn an_older_format_name_is_the_format_it_stands_for() {
    let p = Project::tiny_offline();
    let with = |formats: &str| {
        let mut fps = fingerprints(&p, &["--set", &format!("stages.quantize.formats={formats}")]).unwrap();
        fps.remove("upload");
        fps
    };
    let new = with(r#"["peft-adapter", "gguf-q4_k_m"]"#);
    assert_eq!(with(r#"["peft-adapter", "gguf-q4_k"]"#), new);
    assert_eq!(with(r#"["peft-adapter", "gguf-q4_k", "gguf-q4_k_m"]"#), new);
    assert_ne!(with(r#"["peft-adapter", "gguf-q4_k_s"]"#)["quantize"], new["quantize"]);
}
