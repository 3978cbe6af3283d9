//! GGUF export in llama.cpp's conventions (gguf-py's constants and convert_hf_to_gguf.py):
//! `blk.N.attn_q.weight`-style tensor names, `general.*` and `<arch>.*` metadata, the tokenizer
//! embedded as `tokenizer.ggml.*`, Llama's q/k rows permuted for llama.cpp's interleaved rotary
//! embedding, llama3 rope factors as `rope_freqs.weight`, and 1-D tensors kept in f32.
//! candle's `gguf_file::write` writes the container (GGUF v2).

use std::path::Path;

use candle_core::Tensor;
use candle_core::quantized::{GgmlDType, QTensor, gguf_file::Value};

use super::{ModelConfig, ModelError};
use crate::recipe::{Arch, ExportFormat};

/// llama.cpp token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// The ggml type and llama.cpp `general.file_type` of an export format.
pub fn target(format: ExportFormat) -> Option<(GgmlDType, u32)> {
    Some(match format {
        ExportFormat::GgufF32 => (GgmlDType::F32, 0),
        ExportFormat::GgufF16 => (GgmlDType::F16, 1),
        ExportFormat::GgufQ4_0 => (GgmlDType::Q4_0, 2),
        ExportFormat::GgufQ8_0 => (GgmlDType::Q8_0, 7),
        ExportFormat::GgufQ4K => (GgmlDType::Q4K, 15),
        _ => return None,
    })
}

/// What was written.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GgufReport {
    pub tensors: usize,
    /// Tensors stored in another type than asked (rows not a multiple of the block size).
    pub fallbacks: Vec<String>,
}

/// llama.cpp's name for an HF tensor name.
pub fn tensor_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let (module, kind) = tail.rsplit_once('.')?;
    let name = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{name}.{kind}"))
}

/// convert_hf_to_gguf's `permute`: HF's rotate-half layout of q/k rows → llama.cpp's interleaved.
fn permute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (out, inp) = w.dims2()?;
    w.reshape((heads, 2, out / heads / 2, inp))?.transpose(1, 2)?.contiguous()?.reshape((out, inp))
}

/// The chat template a GGUF carries and the token id that ends an assistant turn.
#[derive(Debug, Clone, Copy)]
pub struct ChatMetadata<'a> {
    pub template: &'a str,
    pub turn_end: Option<u32>,
}

/// Write the merged model (its tensors computed, quantized and dropped one by one) and the
/// tokenizer of `model_dir` as GGUF.
pub fn write(
    path: &Path,
    merged: &crate::model::merged::Merged<'_>,
    model_dir: &Path,
    name: &str,
    format: ExportFormat,
    chat: Option<ChatMetadata<'_>>,
) -> Result<GgufReport, ModelError> {
    let cfg = merged.config();
    let (qtype, file_type) =
        target(format).ok_or_else(|| ModelError::Unsupported { what: format!("{format:?} as GGUF") })?;
    let arch = match cfg.arch {
        Arch::Llama => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
    };
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(name.into())),
        ("general.file_type".into(), Value::U32(file_type)),
        ("general.quantization_version".into(), Value::U32(2)),
    ];
    let a = |k: &str| format!("{arch}.{k}");
    md.push((a("context_length"), Value::U32(cfg.max_position_embeddings as u32)));
    md.push((a("embedding_length"), Value::U32(cfg.hidden_size as u32)));
    md.push((a("block_count"), Value::U32(cfg.num_layers as u32)));
    md.push((a("feed_forward_length"), Value::U32(cfg.intermediate_size as u32)));
    md.push((a("attention.head_count"), Value::U32(cfg.num_heads as u32)));
    md.push((a("attention.head_count_kv"), Value::U32(cfg.num_kv_heads as u32)));
    md.push((a("attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_norm_eps as f32)));
    md.push((a("rope.freq_base"), Value::F32(cfg.rope_theta as f32)));
    md.push((a("rope.dimension_count"), Value::U32(cfg.head_dim as u32)));
    md.push((a("vocab_size"), Value::U32(cfg.vocab_size as u32)));
    // llama.cpp derives the head size from these when they differ from hidden / heads; its
    // converter writes them for every Qwen3 (whose config names `head_dim`), and candle's
    // quantized Qwen3 requires them.
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size || cfg.arch == Arch::Qwen3 {
        md.push((a("attention.key_length"), Value::U32(cfg.head_dim as u32)));
        md.push((a("attention.value_length"), Value::U32(cfg.head_dim as u32)));
    }
    md.extend(tokenizer_metadata(cfg, model_dir, chat)?);

    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut fallbacks = Vec::new();
    let err = |n: &str| ModelError::candle(format!("convert `{n}` for GGUF"));
    // One merged tensor at a time: computed, quantized, dropped.
    for entry in merged.layout() {
        let hf = entry.name.as_str();
        let Some(gname) = tensor_name(hf) else { continue };
        let mut t = merged.tensor(hf)?;
        if cfg.arch == Arch::Llama && hf.ends_with("q_proj.weight") {
            t = permute(&t, cfg.num_heads).map_err(err(hf))?;
        } else if cfg.arch == Arch::Llama && hf.ends_with("k_proj.weight") {
            t = permute(&t, cfg.num_kv_heads).map_err(err(hf))?;
        }
        let ty = if t.rank() == 1 {
            GgmlDType::F32
        } else {
            let row = t.dim(1).map_err(err(hf))?;
            let fits = |q: GgmlDType| row % q.block_size() == 0;
            let chosen =
                [qtype, GgmlDType::Q8_0, GgmlDType::F16].into_iter().find(|q| fits(*q)).unwrap_or(GgmlDType::F32);
            if chosen != qtype {
                fallbacks
                    .push(format!("{gname}: {chosen:?} (rows of {row} are not a multiple of {})", qtype.block_size()));
            }
            chosen
        };
        let q = QTensor::quantize(&t, ty).map_err(err(hf))?;
        tensors.push((gname, q));
    }
    // `lm_head.weight` is among the weights only when the head is untied or carries a merged
    // adapter; llama.cpp then reads `output.weight`, otherwise it reuses `token_embd.weight`.
    if let Some(factors) = llama3_rope_factors(cfg) {
        let t = Tensor::new(factors.as_slice(), &candle_core::Device::Cpu).map_err(err("rope_freqs"))?;
        tensors.push(("rope_freqs.weight".into(), QTensor::quantize(&t, GgmlDType::F32).map_err(err("rope_freqs"))?));
    }
    tensors.sort_by_key(|(name, _)| tensor_order(name));
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file =
        std::fs::File::create(path).map_err(ModelError::io(format!("cannot create `{}`", path.display())))?;
    candle_core::quantized::gguf_file::write(&mut file, &md_refs, &t_refs)
        .map_err(ModelError::candle(format!("cannot write `{}`", path.display())))?;
    Ok(GgufReport { tensors: tensors.len(), fallbacks })
}

/// llama.cpp's usual order: embeddings, blocks in order, output norm and head.
fn tensor_order(name: &str) -> (usize, usize, String) {
    match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
        Some((n, rest)) => (1, n.parse().unwrap_or(0), rest.to_string()),
        None if name.starts_with("token_embd") || name.starts_with("rope_freqs") => (0, 0, name.to_string()),
        None => (2, 0, name.to_string()),
    }
}

/// The per-frequency divisors llama.cpp applies for llama3 rope scaling.
fn llama3_rope_factors(cfg: &ModelConfig) -> Option<Vec<f32>> {
    let rs = cfg.rope_scaling.as_ref()?;
    let factor = rs.factor.unwrap_or(8.0);
    let low = rs.low_freq_factor.unwrap_or(1.0);
    let high = rs.high_freq_factor.unwrap_or(4.0);
    let old = rs.original_max_position_embeddings.unwrap_or(8192) as f64;
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    let d = cfg.head_dim;
    Some(
        (0..d / 2)
            .map(|i| {
                let freq = 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let f = if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                f as f32
            })
            .collect(),
    )
}

/// `tokenizer.ggml.*` from tokenizer.json and tokenizer_config.json (byte-level BPE only).
fn tokenizer_metadata(
    cfg: &ModelConfig,
    model_dir: &Path,
    chat: Option<ChatMetadata<'_>>,
) -> Result<Vec<(String, Value)>, ModelError> {
    let path = model_dir.join("tokenizer.json");
    let bad = |what: String| ModelError::BadFile { path: path.display().to_string(), source: what.into() };
    let text = std::fs::read_to_string(&path).map_err(ModelError::io(format!("cannot read `{}`", path.display())))?;
    let tj: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::BadFile { path: path.display().to_string(), source: Box::new(e) })?;
    if tj["model"]["type"].as_str() != Some("BPE") {
        return Err(ModelError::Unsupported {
            what: format!("GGUF export of a `{}` tokenizer (only byte-level BPE)", tj["model"]["type"]),
        });
    }
    let vocab = tj["model"]["vocab"].as_object().ok_or_else(|| bad("no `model.vocab`".into()))?;
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; cfg.vocab_size];
    for (tok, id) in vocab {
        if let Some(slot) = id.as_u64().and_then(|i| tokens.get_mut(i as usize)) {
            *slot = Some((tok.clone(), NORMAL));
        }
    }
    for added in tj["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else { continue };
        if let Some(slot) = tokens.get_mut(id as usize) {
            let ty = if added["special"].as_bool() == Some(true) { CONTROL } else { USER_DEFINED };
            *slot = Some((content.to_string(), ty));
        }
    }
    let (names, types): (Vec<Value>, Vec<Value>) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| match t {
            Some((s, ty)) => (Value::String(s), Value::I32(ty)),
            None => (Value::String(format!("[PAD{i}]")), Value::I32(UNUSED)),
        })
        .unzip();
    let merges: Vec<Value> = tj["model"]["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| match m {
            serde_json::Value::String(s) => Some(Value::String(s.clone())),
            serde_json::Value::Array(pair) => {
                let parts: Vec<&str> = pair.iter().filter_map(|p| p.as_str()).collect();
                (parts.len() == 2).then(|| Value::String(parts.join(" ")))
            }
            _ => None,
        })
        .collect();
    // llama.cpp picks its pre-tokenizer regex by name; these are the families rtune trains.
    let pre = match (cfg.arch, cfg.vocab_size) {
        (Arch::Qwen2 | Arch::Qwen3, _) => "qwen2",
        (Arch::Llama, 128256) => "llama-bpe",
        (Arch::Llama, 49152) => "smollm",
        _ => "gpt-2",
    };
    let mut md = vec![
        ("tokenizer.ggml.model".to_string(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(names)),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types)),
        ("tokenizer.ggml.merges".to_string(), Value::Array(merges)),
    ];
    if let Some(b) = cfg.bos_token_id {
        md.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(b)));
    }
    if let Some(e) = cfg.eos_token_ids.first() {
        md.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(*e)));
    }
    if let Some(p) = cfg.pad_token_id {
        md.push(("tokenizer.ggml.padding_token_id".into(), Value::U32(p)));
    }
    let tc: Option<serde_json::Value> = std::fs::read_to_string(model_dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    if let Some(add_bos) = tc.as_ref().and_then(|tc| tc["add_bos_token"].as_bool()) {
        md.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos)));
    }
    // The template the model was trained with, and the token its turns end with: llama.cpp
    // stops generation at EOS and at `eot_token_id`.
    if let Some(chat) = chat {
        md.push(("tokenizer.chat_template".into(), Value::String(chat.template.to_string())));
        if let Some(id) = chat.turn_end
            && cfg.eos_token_ids.first() != Some(&id)
        {
            md.push(("tokenizer.ggml.eot_token_id".into(), Value::U32(id)));
        }
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_cpp_tensor_names() {
        assert_eq!(tensor_name("model.embed_tokens.weight").unwrap(), "token_embd.weight");
        assert_eq!(tensor_name("model.layers.3.self_attn.q_proj.weight").unwrap(), "blk.3.attn_q.weight");
        assert_eq!(tensor_name("model.layers.3.self_attn.k_proj.bias").unwrap(), "blk.3.attn_k.bias");
        assert_eq!(tensor_name("model.layers.0.post_attention_layernorm.weight").unwrap(), "blk.0.ffn_norm.weight");
        assert_eq!(tensor_name("model.layers.11.mlp.down_proj.weight").unwrap(), "blk.11.ffn_down.weight");
        assert_eq!(tensor_name("lm_head.weight").unwrap(), "output.weight");
        assert!(tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq").is_none());
    }

    /// The permutation moves HF's row i of each head half to llama.cpp's interleaved position.
    #[test]
    fn permute_interleaves_each_head() {
        // 1 head, head_dim 4, 1 input column: rows [0, 1, 2, 3] (halves [0, 1] and [2, 3]).
        let w = Tensor::new(&[[0f32], [1.], [2.], [3.]], &candle_core::Device::Cpu).unwrap();
        let p: Vec<Vec<f32>> = permute(&w, 1).unwrap().to_vec2().unwrap();
        assert_eq!(p, [[0.], [2.], [1.], [3.]]);
    }
}
