//! PEFT LoRA adapter folders: `adapter_config.json` + `adapter_model.safetensors`, with the
//! tensor names and config fields `PeftModel.from_pretrained` expects.
//!
//! Base weights that trained in full beside the adapter are PEFT's `modules_to_save`: whole
//! modules (`lm_head`, `model.norm`, …) saved as `base_model.model.<module>.<param>`. In memory,
//! rtune names adapter matrices as PEFT does and such base weights by their Hugging Face names,
//! as the engines do ([`read_weights`] and [`write()`] translate).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::json;

use super::lora::is_adapter_param;
use super::{Layout, LoraSpec, ModelError};

/// Read `adapter_config.json`.
pub fn read_config(dir: &Path) -> Result<LoraSpec, ModelError> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path).map_err(ModelError::io(format!("cannot read `{}`", path.display())))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::BadFile { path: path.display().to_string(), source: Box::new(e) })?;
    let bad = |what: &str| ModelError::BadFile { path: path.display().to_string(), source: what.to_string().into() };
    if v["peft_type"].as_str() != Some("LORA") {
        return Err(bad("`peft_type` is not \"LORA\""));
    }
    if v["use_dora"].as_bool() == Some(true) {
        return Err(ModelError::Unsupported { what: "DoRA adapters".into() });
    }
    let rank = v["r"].as_u64().ok_or_else(|| bad("no integer `r`"))? as usize;
    let alpha = v["lora_alpha"].as_f64().ok_or_else(|| bad("no number `lora_alpha`"))?;
    let mut targets: Vec<String> = match &v["target_modules"] {
        serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_str().map(String::from)).collect(),
        serde_json::Value::String(re) => match re.strip_prefix(TEXT_MODEL_RE).and_then(|r| r.strip_prefix('(')) {
            Some(names) if names.ends_with(')') => names[..names.len() - 1].split('|').map(String::from).collect(),
            _ => {
                return Err(bad(&format!(
                    "`target_modules` is the regular expression `{re}`: rtune reads a list of module names, or \
                     the expression it writes for an image-text model's text model (`{TEXT_MODEL_RE}(q_proj|v_proj)`)"
                )));
            }
        },
        _ => return Err(bad("`target_modules` is not a list")),
    };
    targets.sort();
    let rslora = v["use_rslora"].as_bool().unwrap_or(false);
    Ok(LoraSpec { rank, alpha, rslora, dropout: v["lora_dropout"].as_f64().unwrap_or(0.0), targets })
}

/// PEFT's prefix of every saved tensor name.
const PREFIX: &str = "base_model.model.";

/// An image-text model's adapter targets its text model's linears alone: PEFT matches a list of
/// names against the vision tower's too (its `q_proj`, `v_proj`, …), so the targets are written
/// as this expression followed by `(name|name…)`, which PEFT matches against each module's path
/// (`model.language_model.layers.0.self_attn.q_proj`, and `lm_head`).
const TEXT_MODEL_RE: &str = r"(model\.language_model\..*\.)?";

/// PEFT's name of in-memory name `name` (an adapter matrix under PEFT's names for rtune's
/// modules, or a base weight under rtune's name) for a model of `layout`.
fn saved_name(layout: Layout, name: &str) -> String {
    format!("{PREFIX}{}", layout.module_path(name.strip_prefix(PREFIX).unwrap_or(name)))
}

/// Load the adapter's tensors in f32: adapter matrices under PEFT's names, the weights of
/// `modules_to_save` under their Hugging Face names (`lm_head.weight`).
pub fn read_weights(dir: &Path, device: &Device) -> Result<BTreeMap<String, Tensor>, ModelError> {
    let path = dir.join("adapter_model.safetensors");
    let tensors = candle_core::safetensors::load(&path, device)
        .map_err(ModelError::candle(format!("cannot read `{}`", path.display())))?;
    let mut out = BTreeMap::new();
    for (k, t) in tensors {
        let t = t.to_dtype(DType::F32).map_err(ModelError::candle("convert adapter"))?;
        let name = match k.strip_prefix(PREFIX) {
            Some(base) if !is_adapter_param(&k) => Layout::from_module_path(base),
            Some(module) => format!("{PREFIX}{}", Layout::from_module_path(module)),
            None => k,
        };
        out.insert(name, t);
    }
    Ok(out)
}

/// Write a PEFT adapter folder for `spec`. `weights` holds the adapter matrices under PEFT's
/// names and any base weights that trained in full under their Hugging Face names; each of
/// those makes its module a `modules_to_save` entry, saved whole: `base` (the model trained)
/// gives the module's parameters that did not train (a bias). Where the model ties `lm_head` to
/// the embedding and the embedding trained, the head is saved too and the config asks PEFT to
/// keep the two tied (`ensure_weight_tying`, PEFT ≥ 0.18), as rtune trained them.
pub fn write(
    dir: &Path,
    spec: &LoraSpec,
    weights: &BTreeMap<String, Tensor>,
    base_model: &str,
    base: &super::ModelFolder,
) -> Result<(), ModelError> {
    let layout = base.layout;
    let module = |name: &str| name.rsplit_once('.').map_or(name, |(m, _)| m).to_string();
    let mut saved: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut modules: Vec<String> = Vec::new();
    for (name, t) in weights {
        if !is_adapter_param(name) {
            modules.push(module(name));
        }
        saved.insert(saved_name(layout, name), t.clone());
    }
    modules.sort();
    modules.dedup();
    let tie = base.config.tie_word_embeddings && modules.iter().any(|m| m == "model.embed_tokens");
    if tie {
        if !weights.contains_key("lm_head.weight") {
            saved.insert(saved_name(layout, "lm_head.weight"), weights["model.embed_tokens.weight"].clone());
        }
        if !modules.iter().any(|m| m == "lm_head") {
            modules.insert(0, "lm_head".to_string());
        }
    }
    if !modules.is_empty() {
        // The saved modules' parameters that did not train, as the base has them (only those
        // are read).
        let missing = |name: &str| modules.contains(&module(name)) && !saved.contains_key(&saved_name(layout, name));
        let mut found = Vec::new();
        base.visit_weights_where(missing, |name, t| -> Result<(), ModelError> {
            found.push((saved_name(layout, name), t));
            Ok(())
        })?;
        saved.extend(found);
    }
    let modules: Vec<String> = modules.iter().map(|m| layout.module_path(m)).collect();
    let targets = match layout {
        Layout::CausalLm => json!(spec.targets),
        Layout::Gemma3Multimodal => json!(format!("{TEXT_MODEL_RE}({})", spec.targets.join("|"))),
    };
    let mut config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "auto_mapping": null,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": if modules.is_empty() { serde_json::Value::Null } else { json!(modules) },
        "use_dora": false,
        "use_rslora": spec.rslora,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null,
    });
    if tie {
        config["ensure_weight_tying"] = json!(true);
    }
    let path = dir.join("adapter_config.json");
    crate::json::write_file(&path, &config).map_err(ModelError::io(format!("cannot write `{}`", path.display())))?;
    super::folder::save_safetensors(&dir.join("adapter_model.safetensors"), &saved)
}
