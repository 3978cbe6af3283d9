//! Hugging Face `config.json`: the raw form as transformers writes it, and the resolved form
//! the model code uses (defaults applied, architecture decided, head size computed).

use serde::{Deserialize, Serialize};

use super::ModelError;
use crate::recipe::{Arch, ScratchModel};

/// The fields of `config.json` rtune reads, as transformers writes them.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct RawConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    /// transformers ≥ 5 writes `rope_theta` and the scaling here instead.
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    #[serde(default)]
    pub initializer_range: Option<f64>,
    #[serde(default)]
    pub sliding_window: Option<serde_json::Value>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// transformers ≥ 4.53: each layer's attention kind (`full_attention`, `sliding_attention`).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
}

fn default_max_pos() -> usize {
    2048
}
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}

/// `eos_token_id` is an integer or a list in the wild.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(x) => vec![*x],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// `rope_scaling` (transformers < 5) or `rope_parameters` (≥ 5, which also carries the theta).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default, alias = "type")]
    pub rope_type: Option<String>,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

/// The resolved configuration the model code uses.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    /// Mistral's `sliding_window` (v0.1: 4096): each token attends to that many before it.
    /// rtune attends over whole sequences, which is the same only for sequences no longer than
    /// the window; [`ModelConfig::max_positions`] keeps them there.
    pub sliding_window: Option<usize>,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// llama3 frequency scaling, when configured.
    pub rope_scaling: Option<RopeParameters>,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2, or Llama and Qwen3 with `attention_bias`).
    pub qkv_bias: bool,
    /// o_proj carries a bias (Llama and Qwen3 with `attention_bias`).
    pub o_bias: bool,
    /// Each query and key head is RMS-normalised (weights `self_attn.q_norm` / `k_norm`, one
    /// value per head dimension) before the rotary embedding (Qwen3).
    pub qk_norm: bool,
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

impl ModelConfig {
    pub fn from_raw(raw: &RawConfig) -> Result<ModelConfig, ModelError> {
        let arch_name = raw.architectures.first().cloned().or_else(|| raw.model_type.clone()).unwrap_or_default();
        let mistral = matches!(arch_name.as_str(), "MistralForCausalLM" | "mistral");
        let arch = match arch_name.as_str() {
            "LlamaForCausalLM" | "llama" | "MistralForCausalLM" | "mistral" => Arch::Llama,
            "Qwen2ForCausalLM" | "qwen2" => Arch::Qwen2,
            "Qwen3ForCausalLM" | "qwen3" => Arch::Qwen3,
            other => {
                return Err(ModelError::UnsupportedArchitecture { name: other.to_string() });
            }
        };
        if let Some(act) = &raw.hidden_act
            && act != "silu"
        {
            return Err(ModelError::Unsupported { what: format!("activation `{act}` (only `silu`)") });
        }
        // transformers ≥ 5 moved the theta and the scaling into `rope_parameters`.
        let rope = raw.rope_parameters.clone().or_else(|| raw.rope_scaling.clone());
        let rope_theta = raw.rope_parameters.as_ref().and_then(|r| r.rope_theta).unwrap_or(raw.rope_theta);
        let rope_type = rope.as_ref().and_then(|r| r.rope_type.clone()).unwrap_or_else(|| "default".into());
        if rope_type != "llama3" && rope_type != "default" {
            return Err(ModelError::Unsupported { what: format!("rope scaling `{rope_type}`") });
        }
        let rope_scaling = rope.filter(|_| rope_type == "llama3");
        let sliding_layers = raw.layer_types.iter().flatten().any(|t| t != "full_attention");
        if raw.use_sliding_window == Some(true) || sliding_layers {
            return Err(ModelError::Unsupported { what: "sliding-window attention".into() });
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if raw.num_attention_heads == 0 || num_kv_heads == 0 || !raw.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(ModelError::Unsupported {
                what: format!("{} attention heads with {} key/value heads", raw.num_attention_heads, num_kv_heads),
            });
        }
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads);
        // A hostile or broken config.json must not size allocations: every dimension is bounded
        // well above any released model's (weights are then checked against these shapes).
        for (field, value, max) in [
            ("hidden_size", raw.hidden_size, 1 << 16),
            ("intermediate_size", raw.intermediate_size, 1 << 18),
            ("num_hidden_layers", raw.num_hidden_layers, 1 << 10),
            ("num_attention_heads", raw.num_attention_heads, 1 << 10),
            ("head_dim", head_dim, 1 << 10),
            ("vocab_size", raw.vocab_size, 1 << 22),
            ("max_position_embeddings", raw.max_position_embeddings, 1 << 24),
        ] {
            if value == 0 || value > max {
                return Err(ModelError::Unsupported {
                    what: format!("config.json `{field}` = {value} (expected 1 to {max})"),
                });
            }
        }
        if !head_dim.is_multiple_of(2) {
            return Err(ModelError::Unsupported { what: format!("config.json `head_dim` = {head_dim} (odd)") });
        }
        let attention_bias = raw.attention_bias.unwrap_or(false);
        Ok(ModelConfig {
            arch,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            max_position_embeddings: raw.max_position_embeddings,
            // Mistral applies a numeric `sliding_window` without a `use_sliding_window` switch.
            sliding_window: match (mistral, &raw.sliding_window) {
                (true, Some(serde_json::Value::Number(w))) => w.as_u64().map(|w| w as usize).filter(|&w| w > 0),
                _ => None,
            },
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta,
            rope_scaling,
            // LlamaConfig and Qwen2Config both default to untied embeddings.
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: arch != Arch::Qwen2 && attention_bias,
            qk_norm: arch == Arch::Qwen3,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            bos_token_id: raw.bos_token_id,
            eos_token_ids: raw.eos_token_id.as_ref().map(TokenIds::to_vec).unwrap_or_default(),
            pad_token_id: raw.pad_token_id,
        })
    }

    /// A decoder layer's linears in [`super::LAYER_LINEARS`]' order: inputs, outputs, and
    /// whether each has a bias.
    pub fn layer_linears(&self) -> [(usize, usize, bool); 7] {
        let (h, inter) = (self.hidden_size, self.intermediate_size);
        let (qd, kvd) = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim);
        [
            (h, qd, self.qkv_bias),
            (h, kvd, self.qkv_bias),
            (h, kvd, self.qkv_bias),
            (qd, h, self.o_bias),
            (h, inter, self.mlp_bias),
            (h, inter, self.mlp_bias),
            (inter, h, self.mlp_bias),
        ]
    }

    /// Every weight the model has, as transformers names it, with its shape, in the order of the
    /// model's `state_dict` (embeddings; each layer's norms, query/key norms and linears with their
    /// biases; the final norm; the LM head unless tied): what a checkpoint must hold and what a
    /// merged export writes.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden_size;
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab_size, h])];
        for i in 0..self.num_layers {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.input_layernorm.weight"), vec![h]));
            if self.qk_norm {
                for n in super::QK_NORMS {
                    out.push((format!("{p}.{n}.weight"), vec![self.head_dim]));
                }
            }
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            for (n, (inp, o, bias)) in super::LAYER_LINEARS.iter().zip(self.layer_linears()) {
                out.push((format!("{p}.{n}.weight"), vec![o, inp]));
                if bias {
                    out.push((format!("{p}.{n}.bias"), vec![o]));
                }
            }
        }
        out.push(("model.norm.weight".into(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".into(), vec![self.vocab_size, h]));
        }
        out
    }

    /// The longest sequence rtune computes exactly as transformers does: the rotary tables'
    /// reach, and within a sliding window (Mistral v0.1) only the window's length.
    pub fn max_positions(&self) -> usize {
        self.sliding_window.map_or(self.max_position_embeddings, |w| w.min(self.max_position_embeddings))
    }

    /// Why a sequence of `len` tokens cannot be computed exactly, or `None` when it can.
    pub fn sequence_too_long(&self, len: usize) -> Option<String> {
        (len > self.max_positions()).then(|| match self.sliding_window {
            Some(w) if w < self.max_position_embeddings => format!(
                "sequences of {len} tokens pass the model's sliding window of {w} (config.json `sliding_window`): \
                 rtune attends over whole sequences, which matches the model only within the window"
            ),
            _ => format!(
                "sequences of {len} tokens pass the model's {} positions (config.json `max_position_embeddings`)",
                self.max_position_embeddings
            ),
        })
    }

    /// The `config.json` transformers would write for a scratch model.
    pub fn scratch_raw(s: &ScratchModel, bos: u32, eos: u32, pad: u32) -> serde_json::Value {
        let (architectures, model_type) = match s.arch {
            Arch::Llama => ("LlamaForCausalLM", "llama"),
            Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
            Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        };
        let mut v = serde_json::json!({
            "architectures": [architectures],
            "model_type": model_type,
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_heads,
            "num_key_value_heads": s.num_kv_heads.unwrap_or(s.num_heads),
            "vocab_size": s.vocab_size,
            "max_position_embeddings": s.max_position_embeddings,
            "rms_norm_eps": s.rms_norm_eps,
            "rope_theta": s.rope_theta,
            "tie_word_embeddings": s.tie_word_embeddings,
            "hidden_act": "silu",
            "initializer_range": s.initializer_range,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "torch_dtype": "float32",
            "use_cache": true,
        });
        if let Some(d) = s.head_dim {
            v["head_dim"] = d.into();
        }
        match s.arch {
            Arch::Llama => {
                v["attention_bias"] = false.into();
                v["mlp_bias"] = false.into();
            }
            Arch::Qwen2 => v["use_sliding_window"] = false.into(),
            Arch::Qwen3 => {
                v["attention_bias"] = false.into();
                v["use_sliding_window"] = false.into();
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> Result<ModelConfig, ModelError> {
        ModelConfig::from_raw(&serde_json::from_value(v).unwrap())
    }

    fn base() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        })
    }

    #[test]
    fn rope_settings_in_both_transformers_layouts() {
        let mut old = base();
        old["rope_theta"] = 500000.0.into();
        old["rope_scaling"] =
            serde_json::json!({"type": "llama3", "factor": 32.0, "original_max_position_embeddings": 8192});
        let c = parse(old).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rope_scaling.unwrap().factor, Some(32.0));
        let mut new = base();
        new["rope_parameters"] = serde_json::json!({"rope_theta": 1e6, "rope_type": "default"});
        let c = parse(new).unwrap();
        assert_eq!((c.rope_theta, c.rope_scaling), (1e6, None));
        let mut yarn = base();
        yarn["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
        assert_eq!(parse(yarn).unwrap_err().to_string(), "rope scaling `yarn` is not supported");
    }

    /// Mistral v0.1's `sliding_window` bounds the sequences rtune computes exactly; a null
    /// window (v0.2+) or another architecture's unused field does not.
    #[test]
    fn a_mistral_sliding_window_bounds_the_sequence_length() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        v["max_position_embeddings"] = 32768.into();
        v["sliding_window"] = 4096.into();
        let c = parse(v.clone()).unwrap();
        assert_eq!((c.max_positions(), c.sequence_too_long(4096)), (4096, None));
        assert!(c.sequence_too_long(4097).unwrap().contains("sliding window of 4096"));
        v["sliding_window"] = serde_json::Value::Null;
        assert_eq!(parse(v.clone()).unwrap().max_positions(), 32768);
        v["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        v["sliding_window"] = 4096.into();
        let c = parse(v).unwrap();
        assert_eq!(c.max_positions(), 32768);
        assert!(c.sequence_too_long(40000).unwrap().contains("32768 positions"));
    }

    #[test]
    fn defaults_and_eos_lists() {
        let mut v = base();
        v["eos_token_id"] = serde_json::json!([2, 7]);
        let c = parse(v).unwrap();
        assert_eq!(c.eos_token_ids, [2, 7]);
        assert!(!c.tie_word_embeddings, "LlamaConfig defaults to untied embeddings");
        assert_eq!(c.head_dim, 8);
        let mut bad = base();
        bad["num_key_value_heads"] = 3.into();
        assert!(parse(bad).unwrap_err().to_string().contains("4 attention heads with 3 key/value heads"));
    }
}
