//! A model's weights by name, and which of them train: the names every engine, checkpoint
//! reader and writer agree on, and the [`Trainable`] set a stage asks for.

pub use crate::recipe::LAYER_LINEARS;

use super::LoraSpec;

/// The per-head query and key RMSNorms of a layer with `qk_norm` (Qwen3, Gemma 3), as their
/// names continue `model.layers.<i>.` (each with a `.weight` of `head_dim` values).
pub const QK_NORMS: [&str; 2] = ["self_attn.q_norm", "self_attn.k_norm"];

/// Gemma's norms around the MLP in a layer with `sandwich_norms`, as their names continue
/// `model.layers.<i>.`: before it, and on its output (its `post_attention_layernorm` is then the
/// attention output's norm).
pub const FEEDFORWARD_NORMS: [&str; 2] = ["pre_feedforward_layernorm", "post_feedforward_layernorm"];

/// Which weights train: a LoRA adapter, base weights whose Hugging Face names match patterns,
/// both (the base weights are then what PEFT calls `modules_to_save`), or nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trainable {
    /// LoRA adapters on the linears the spec targets.
    pub lora: Option<LoraSpec>,
    /// fnmatch patterns of base weights that train in full (`*` is a wildcard; `["*"]` is a
    /// full fine-tune).
    pub weights: Vec<String>,
}

impl Trainable {
    /// Nothing trains (evaluation, generation).
    pub fn nothing() -> Trainable {
        Trainable::default()
    }

    /// A LoRA adapter trains; the base is frozen.
    pub fn lora(spec: LoraSpec) -> Trainable {
        Trainable { lora: Some(spec), weights: Vec::new() }
    }

    /// Base weights whose names match `patterns` train.
    pub fn weights(patterns: Vec<String>) -> Trainable {
        Trainable { lora: None, weights: patterns }
    }

    /// Nothing trains.
    pub fn is_nothing(&self) -> bool {
        self.lora.is_none() && self.weights.is_empty()
    }

    /// Whether the base weight `name` trains in full.
    pub fn trains_weight(&self, name: &str) -> bool {
        self.weights.iter().any(|p| crate::glob::fnmatch(p, name))
    }

    /// The adapter the linear `prefix` (`model.layers.0.self_attn.q_proj`, `lm_head`) gets,
    /// whose weight is named `weight` (`{prefix}.weight`; a tied LM head's is the embedding's)
    /// and which has a bias (`{prefix}.bias`) or not. A linear whose own parameters train in full
    /// cannot also carry an adapter (PEFT has no such module): that is an error naming both
    /// settings.
    pub fn adapter_for(
        &self,
        prefix: &str,
        weight: &str,
        bias: bool,
    ) -> std::result::Result<Option<&LoraSpec>, super::ModelError> {
        let Some(spec) = &self.lora else { return Ok(None) };
        let module = prefix.rsplit('.').next().unwrap_or(prefix);
        if !spec.targets.iter().any(|t| t == module) {
            return Ok(None);
        }
        let bias = bias.then(|| format!("{prefix}.bias"));
        match std::iter::once(weight).chain(bias.as_deref()).find(|p| self.trains_weight(p)) {
            Some(p) => Err(super::ModelError::AdapterOnTrainedWeight {
                weight: p.to_string(),
                linear: prefix.to_string(),
                module: module.to_string(),
            }),
            None => Ok(Some(spec)),
        }
    }
}
