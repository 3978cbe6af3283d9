//! PEFT LoRA adapter folders: `adapter_config.json` + `adapter_model.safetensors`, with the
//! tensor names and config fields `PeftModel.from_pretrained` expects.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::json;

use super::{LoraSpec, ModelError};

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
    if v["use_dora"].as_bool() == Some(true) || v["use_rslora"].as_bool() == Some(true) {
        return Err(ModelError::Unsupported { what: "DoRA / rsLoRA adapters".into() });
    }
    let rank = v["r"].as_u64().ok_or_else(|| bad("no integer `r`"))? as usize;
    let alpha = v["lora_alpha"].as_f64().ok_or_else(|| bad("no number `lora_alpha`"))?;
    let mut targets: Vec<String> = match &v["target_modules"] {
        serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_str().map(String::from)).collect(),
        _ => return Err(bad("`target_modules` is not a list")),
    };
    targets.sort();
    Ok(LoraSpec { rank, alpha, dropout: v["lora_dropout"].as_f64().unwrap_or(0.0), targets })
}

/// Load the adapter tensors (names as PEFT saves them).
pub fn read_weights(dir: &Path, device: &Device) -> Result<BTreeMap<String, Tensor>, ModelError> {
    let path = dir.join("adapter_model.safetensors");
    let tensors = candle_core::safetensors::load(&path, device)
        .map_err(ModelError::candle(format!("cannot read `{}`", path.display())))?;
    let mut out = BTreeMap::new();
    for (k, t) in tensors {
        out.insert(k, t.to_dtype(DType::F32).map_err(ModelError::candle("convert adapter"))?);
    }
    Ok(out)
}

/// Write a PEFT adapter folder for `spec` with `weights` named as PEFT names them.
pub fn write(
    dir: &Path,
    spec: &LoraSpec,
    weights: &BTreeMap<String, Tensor>,
    base_model: &str,
) -> Result<(), ModelError> {
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "auto_mapping": null,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": spec.targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "use_dora": false,
        "use_rslora": false,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null,
    });
    let path = dir.join("adapter_config.json");
    let mut text = serde_json::to_string_pretty(&config).expect("json");
    text.push('\n');
    std::fs::write(&path, text).map_err(ModelError::io(format!("cannot write `{}`", path.display())))?;
    super::folder::save_safetensors(&dir.join("adapter_model.safetensors"), weights)
}
