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
    /// Default: 10000 (Gemma 3: 1e6).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    /// transformers ≥ 5 writes `rope_theta` and the scaling here instead: one set of
    /// [`RopeParameters`], or (Gemma 3) one for each kind of layer, keyed by `full_attention`
    /// and `sliding_attention`.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// Gemma 3 before transformers 5: the rotary base of its local-attention layers.
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Gemma's name for the MLP's activation (it wins over `hidden_act`).
    #[serde(default)]
    pub hidden_activation: Option<String>,
    /// Gemma: attention scores are scaled by `query_pre_attn_scalar^-½` instead of `head_dim^-½`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 2: attention scores become `c · tanh(scores / c)` before the mask and softmax.
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Gemma 2: logits become `c · tanh(logits / c)`.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Gemma 3 embedding models attend both ways.
    #[serde(default)]
    pub use_bidirectional_attention: Option<bool>,
    /// Gemma 3 before transformers 4.53 wrote no `layer_types`: every `n`-th layer is global
    /// (written under both names by some versions, so two fields, not an alias).
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    #[serde(default, rename = "_sliding_window_pattern")]
    pub sliding_window_pattern_: Option<usize>,
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

/// The config.json of the model rtune trains in a folder whose config.json is `raw`, and how its
/// checkpoint names that model's tensors. For `Gemma3ForConditionalGeneration` (Gemma 3 4B and
/// larger): its `text_config` with Gemma3TextConfig's defaults under what it leaves out — the
/// Hub's config.json writes only what differs from them — as a `Gemma3ForCausalLM`, with the
/// outer config's special tokens where the text config has none.
pub fn text_model(raw: &serde_json::Value) -> (serde_json::Value, super::Layout) {
    let arch = raw["architectures"].get(0).and_then(|a| a.as_str());
    let multimodal = arch == Some("Gemma3ForConditionalGeneration")
        || (arch.is_none() && raw["model_type"].as_str() == Some("gemma3") && raw["text_config"].is_object());
    if !multimodal {
        return (raw.clone(), super::Layout::CausalLm);
    }
    // transformers' Gemma3TextConfig defaults (those of Gemma 3 4B's text model, as released).
    let mut text = serde_json::json!({
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": true,
        "attention_bias": false, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    });
    if let Some(given) = raw["text_config"].as_object() {
        for (k, v) in given {
            text[k] = v.clone();
        }
    }
    for key in ["bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype"] {
        if raw.get(key).is_some_and(|v| !v.is_null()) && raw["text_config"].get(key).is_none() {
            text[key] = raw[key].clone();
        }
    }
    text["architectures"] = serde_json::json!(["Gemma3ForCausalLM"]);
    text["model_type"] = serde_json::json!("gemma3_text");
    (text, super::Layout::Gemma3Multimodal)
}

fn default_max_pos() -> usize {
    2048
}
fn default_eps() -> f64 {
    1e-6
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

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `silu`.
    Silu,
    /// `gelu_pytorch_tanh`: `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`.
    GeluTanh,
}

/// Layers that attend to at most `window` positions: each query to itself and the
/// `window − 1` before it, as transformers' `sliding_attention` layers do.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LocalAttention {
    pub window: usize,
    /// Which layers are local (the rest attend to every earlier position).
    pub layers: Vec<bool>,
    /// The local layers' rotary base (Gemma 3: 10000; the global layers keep `rope_theta`).
    pub rope_theta: f64,
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
    /// llama3 or linear frequency scaling, when configured.
    pub rope_scaling: Option<RopeParameters>,
    pub tie_word_embeddings: bool,
    /// The MLP's gate activation: SiLU (Llama, Qwen), or GELU's tanh approximation (Gemma).
    pub activation: Activation,
    /// Gemma's RMSNorm: `x̂ · (1 + w)` computed in f32, its weights stored as offsets from one
    /// (zeros at initialisation), instead of `x̂ · w`.
    pub norm_offset: bool,
    /// Gemma 2 and 3: the attention's and the MLP's outputs are RMS-normalised before they join
    /// the residual stream (`post_attention_layernorm`, `post_feedforward_layernorm`), and the
    /// MLP reads `pre_feedforward_layernorm` — where Llama's MLP reads `post_attention_layernorm`.
    pub sandwich_norms: bool,
    /// Embeddings are multiplied by this (Gemma: √hidden, rounded to the weights' dtype).
    pub embed_scale: Option<f64>,
    /// Attention scores' scale: `head_dim^-½`, or Gemma's `query_pre_attn_scalar^-½`.
    pub attn_scale: f64,
    /// Gemma 2's tanh caps: attention scores and final logits become `c · tanh(x / c)`.
    pub attn_softcap: Option<f64>,
    pub final_softcap: Option<f64>,
    /// Gemma 2 and 3: the layers that attend only within a window of earlier positions, computed
    /// exactly at every length (unlike [`ModelConfig::sliding_window`]).
    pub local_attention: Option<LocalAttention>,
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
            "Gemma2ForCausalLM" | "gemma2" => Arch::Gemma2,
            "Gemma3ForCausalLM" | "gemma3_text" => Arch::Gemma3,
            other => {
                return Err(ModelError::UnsupportedArchitecture { name: other.to_string() });
            }
        };
        let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
        let act = raw.hidden_activation.as_deref().or(raw.hidden_act.as_deref());
        let activation = match (act, gemma) {
            (Some("silu") | None, false) => Activation::Silu,
            (Some("gelu_pytorch_tanh") | None, true) => Activation::GeluTanh,
            (Some(act), _) => {
                return Err(ModelError::Unsupported {
                    what: format!("activation `{act}` (only `silu`, and `gelu_pytorch_tanh` for Gemma)"),
                });
            }
        };
        if raw.use_bidirectional_attention == Some(true) {
            return Err(ModelError::Unsupported {
                what: "bidirectional attention (config.json `use_bidirectional_attention`)".into(),
            });
        }
        let rope = Rope::read(raw, arch)?;
        let local_attention = match arch {
            Arch::Gemma2 | Arch::Gemma3 => local_layers(raw, arch, rope.local_theta)?,
            _ => {
                let sliding_layers = raw.layer_types.iter().flatten().any(|t| t != "full_attention");
                if raw.use_sliding_window == Some(true) || sliding_layers {
                    return Err(ModelError::Unsupported { what: "sliding-window attention".into() });
                }
                None
            }
        };
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
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            // LlamaConfig and Qwen2Config default to untied embeddings, Gemma's configs to tied.
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(gemma),
            activation,
            norm_offset: gemma,
            sandwich_norms: gemma,
            embed_scale: gemma.then(|| (raw.hidden_size as f64).sqrt()),
            // Gemma2Config and Gemma3TextConfig default the scalar to 256.
            attn_scale: match (raw.query_pre_attn_scalar, gemma) {
                (Some(s), true) if s > 0.0 => s.powf(-0.5),
                (None, true) => 256f64.powf(-0.5),
                (Some(s), true) => {
                    return Err(ModelError::Unsupported { what: format!("config.json `query_pre_attn_scalar` = {s}") });
                }
                (_, false) => (head_dim as f64).powf(-0.5),
            },
            // Gemma2Config caps scores at 50 and logits at 30 unless told otherwise; Gemma 3 does not.
            attn_softcap: match arch {
                Arch::Gemma2 => raw.attn_logit_softcapping.or(Some(50.0)),
                Arch::Gemma3 => raw.attn_logit_softcapping,
                _ => None,
            },
            final_softcap: match arch {
                Arch::Gemma2 => raw.final_logit_softcapping.or(Some(30.0)),
                Arch::Gemma3 => raw.final_logit_softcapping,
                _ => None,
            },
            local_attention,
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: arch != Arch::Qwen2 && attention_bias,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
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
            if self.sandwich_norms {
                for n in super::FEEDFORWARD_NORMS {
                    out.push((format!("{p}.{n}.weight"), vec![h]));
                }
            }
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
            Arch::Gemma2 => ("Gemma2ForCausalLM", "gemma2"),
            Arch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
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
            Arch::Gemma2 | Arch::Gemma3 => {
                // As Gemma's own configs: the GELU gate, scores scaled by the head size, and
                // transformers' default windows (every second layer local in Gemma 2, five of
                // six in Gemma 3, with its local rotary base).
                let o = v.as_object_mut().expect("an object");
                o.remove("hidden_act");
                let head_dim = s.head_dim.unwrap_or(s.hidden_size / s.num_heads.max(1));
                v["hidden_activation"] = "gelu_pytorch_tanh".into();
                v["attention_bias"] = false.into();
                v["query_pre_attn_scalar"] = head_dim.into();
                if s.arch == Arch::Gemma2 {
                    v["sliding_window"] = 4096.into();
                    v["attn_logit_softcapping"] = 50.0.into();
                    v["final_logit_softcapping"] = 30.0.into();
                } else {
                    v["sliding_window"] = 512.into();
                    v["rope_local_base_freq"] = 10000.0.into();
                }
                let every = if s.arch == Arch::Gemma2 { 2 } else { 6 };
                let kinds: Vec<&str> = (0..s.num_layers)
                    .map(|i| if (i + 1) % every != 0 { "sliding_attention" } else { "full_attention" })
                    .collect();
                v["layer_types"] = kinds.into();
            }
        }
        v
    }
}

/// The rotary embedding a config asks for: the base and scaling of its (global) layers, and
/// Gemma 3's base for its local layers.
struct Rope {
    theta: f64,
    scaling: Option<RopeParameters>,
    local_theta: f64,
}

impl Rope {
    fn read(raw: &RawConfig, arch: Arch) -> Result<Rope, ModelError> {
        let parse = |v: &serde_json::Value| {
            serde_json::from_value::<RopeParameters>(v.clone())
                .map_err(|e| ModelError::Unsupported { what: format!("config.json `rope_parameters` ({e})") })
        };
        // transformers ≥ 5 moved the theta and the scaling into `rope_parameters`; for Gemma 3,
        // one set per kind of layer.
        let per_kind = raw.rope_parameters.as_ref().filter(|v| v.get("full_attention").is_some());
        let (global, local) = match (per_kind, &raw.rope_parameters) {
            (Some(v), _) => (Some(parse(&v["full_attention"])?), v.get("sliding_attention").map(parse).transpose()?),
            (None, Some(v)) => (Some(parse(v)?), None),
            (None, None) => (raw.rope_scaling.clone(), None),
        };
        // Gemma 3's defaults (Gemma3TextConfig.default_theta): 1e6 globally, 1e4 locally.
        let default_theta = if arch == Arch::Gemma3 { 1e6 } else { 1e4 };
        let theta = global.as_ref().and_then(|r| r.rope_theta).or(raw.rope_theta).unwrap_or(default_theta);
        let rope_type = |r: &Option<RopeParameters>| {
            r.as_ref().and_then(|r| r.rope_type.clone()).unwrap_or_else(|| "default".into())
        };
        let kind = rope_type(&global);
        // Linear scaling (Gemma 3's larger models) for Gemma only: Llama's and Qwen's paths know
        // the llama3 form alone.
        let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
        if !(kind == "default" || kind == "llama3" || (gemma && kind == "linear")) {
            return Err(ModelError::Unsupported { what: format!("rope scaling `{kind}`") });
        }
        if rope_type(&local) != "default" {
            return Err(ModelError::Unsupported {
                what: format!("rope scaling `{}` of local layers", rope_type(&local)),
            });
        }
        let local_theta = match arch {
            Arch::Gemma3 => local.and_then(|r| r.rope_theta).or(raw.rope_local_base_freq).unwrap_or(1e4),
            _ => theta,
        };
        Ok(Rope { theta, scaling: global.filter(|_| kind != "default"), local_theta })
    }
}

/// Gemma's local-attention layers: `layer_types` where the config has it, else Gemma 2's every
/// other layer (the first local) or Gemma 3's `sliding_window_pattern` (every sixth global).
fn local_layers(raw: &RawConfig, arch: Arch, rope_theta: f64) -> Result<Option<LocalAttention>, ModelError> {
    let n = raw.num_hidden_layers;
    let layers: Vec<bool> = match &raw.layer_types {
        Some(types) => {
            if types.len() != n {
                return Err(ModelError::Unsupported {
                    what: format!("config.json `layer_types` with {} entries for {n} layers", types.len()),
                });
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(ModelError::Unsupported { what: format!("attention of kind `{other}`") }),
                })
                .collect::<Result<_, _>>()?
        }
        None => {
            let every = if arch == Arch::Gemma2 {
                2
            } else {
                raw.sliding_window_pattern.or(raw.sliding_window_pattern_).unwrap_or(6).max(1)
            };
            (0..n).map(|i| !(i + 1).is_multiple_of(every)).collect()
        }
    };
    let window = match &raw.sliding_window {
        Some(serde_json::Value::Number(w)) => match w.as_u64() {
            Some(w) if w > 0 => w as usize,
            _ => return Err(ModelError::Unsupported { what: format!("config.json `sliding_window` = {w}") }),
        },
        // A null window attends everywhere: local layers then differ only by their rotary base.
        None | Some(serde_json::Value::Null) => usize::MAX,
        Some(other) => return Err(ModelError::Unsupported { what: format!("config.json `sliding_window` = {other}") }),
    };
    Ok(layers.iter().any(|&l| l).then_some(LocalAttention { window, layers, rope_theta }))
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

    /// Gemma 3's and Gemma 2's configs as transformers 4 wrote them on the Hub (no
    /// `rope_parameters`; Gemma 2 without `layer_types`, Gemma 3 with both spellings of its
    /// pattern): the rotary bases, the local layers and window, the scale and the caps.
    #[test]
    fn gemma_configs_as_the_hub_has_them() {
        let gemma3 = serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
            "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": null, "sliding_window": 512,
            "sliding_window_pattern": 6, "_sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": null,
            "attn_logit_softcapping": null, "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0,
        });
        let c = parse(gemma3.clone()).unwrap();
        assert_eq!((c.arch, c.rope_theta, c.attn_scale, c.tie_word_embeddings), (Arch::Gemma3, 1e6, 1.0 / 16.0, true));
        assert_eq!(
            (c.activation, c.norm_offset, c.sandwich_norms, c.qk_norm),
            (Activation::GeluTanh, true, true, true)
        );
        assert_eq!((c.embed_scale, c.attn_softcap, c.final_softcap), (Some(640f64.sqrt()), None, None));
        let local = c.local_attention.clone().unwrap();
        assert_eq!((local.window, local.rope_theta), (512, 10000.0));
        let globals: Vec<usize> = (0..18).filter(|&i| !local.layers[i]).collect();
        assert_eq!(globals, [5, 11, 17]);
        assert_eq!(c.max_positions(), 32768, "the window is computed, not a bound");
        let gemma2 = serde_json::json!({
            "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
            "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192, "rope_theta": 10000.0,
            "sliding_window": 4096, "query_pre_attn_scalar": 256, "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        });
        let c = parse(gemma2).unwrap();
        assert_eq!((c.arch, c.qk_norm, c.attn_softcap, c.final_softcap), (Arch::Gemma2, false, Some(50.0), Some(30.0)));
        let local = c.local_attention.unwrap();
        assert_eq!(
            (local.window, local.rope_theta, &local.layers[..4]),
            (4096, 10000.0, &[true, false, true, false][..])
        );
        let mut vision = gemma3.clone();
        vision["architectures"] = serde_json::json!(["PaliGemmaForConditionalGeneration"]);
        assert!(matches!(parse(vision), Err(ModelError::UnsupportedArchitecture { .. })));
        let mut both = gemma3;
        both["use_bidirectional_attention"] = true.into();
        assert!(parse(both).unwrap_err().to_string().contains("bidirectional"));
    }

    /// Gemma 3 4B's config.json as the Hub ships it (google/gemma-3-4b-it, transformers
    /// 4.50.0.dev0): `text_config` holds only what differs from Gemma3TextConfig's defaults.
    #[test]
    fn an_image_text_gemma3_config_is_its_text_model_with_transformers_defaults() {
        let hub = serde_json::json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
            "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
            "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
            "text_config": {
                "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
            "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                "patch_size": 14, "vision_use_head": false},
        });
        let (text, layout) = text_model(&hub);
        assert_eq!(layout, crate::model::Layout::Gemma3Multimodal);
        let c = parse(text).unwrap();
        assert_eq!((c.arch, c.hidden_size, c.intermediate_size, c.num_layers), (Arch::Gemma3, 2560, 10240, 34));
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size), (8, 4, 256, 262208));
        assert_eq!((c.attn_scale, c.rope_theta, c.tie_word_embeddings), (1.0 / 16.0, 1e6, true));
        assert_eq!((c.max_position_embeddings, c.eos_token_ids.clone()), (131072, vec![1, 106]));
        let scaling = c.rope_scaling.clone().unwrap();
        assert_eq!((scaling.rope_type.as_deref(), scaling.factor), (Some("linear"), Some(8.0)));
        let local = c.local_attention.clone().unwrap();
        let globals: Vec<usize> = (0..34).filter(|&i| !local.layers[i]).collect();
        assert_eq!((local.window, local.rope_theta, globals), (1024, 10000.0, vec![5, 11, 17, 23, 29]));
        // A causal LM's config.json is read as it is.
        assert_eq!(text_model(&base()), (base(), crate::model::Layout::CausalLm));
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
