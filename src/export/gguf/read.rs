//! A Gemma GGUF read back as llama.cpp reads it, for the quantize stage's self-check: the config
//! llama.cpp derives from the metadata (with what it hard-codes for Gemma: the GELU gate, the
//! norms' `1 + w` stored whole, √hidden embeddings, the attention scale from the head size, the
//! local layers' pattern), and the tensors dequantized under Hugging Face's names, run by rtune's
//! model one decoder layer at a time.
//!
//! candle's own reader (`quantized_gemma3`) computes another model — it gates the MLP with SiLU,
//! lets each local query see one key more than the window, and reads the local rotary base under
//! a key llama.cpp does not write — so it cannot check a Gemma file. Llama and Qwen files are
//! checked by candle's readers, which compute what llama.cpp does.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};

use super::tensor_name;
use crate::engine::candle::{DecoderLayer, Transformer};
use crate::model::config::{Activation, LocalAttention, RopeParameters};
use crate::model::{Batch, ModelConfig, ModelError, Trainable};
use crate::recipe::Arch;

/// A Gemma GGUF as llama.cpp computes it.
pub struct GgufModel {
    pub config: ModelConfig,
    path: PathBuf,
    content: Content,
    /// The embedding, final norm and LM head.
    head: Transformer,
    device: Device,
}

impl GgufModel {
    /// The model in the GGUF at `path`; `base` gives what llama.cpp's forward pass does not
    /// read (special token ids).
    pub fn open(path: &Path, base: &ModelConfig, device: &Device) -> Result<GgufModel, ModelError> {
        let mut f = std::fs::File::open(path).map_err(ModelError::io(format!("cannot open `{}`", path.display())))?;
        let content = Content::read(&mut f).map_err(ModelError::candle(format!("read `{}`", path.display())))?;
        Self::with_content(path, content, base, device)
    }

    /// [`GgufModel::open`] with the file's header already read (`content`).
    pub fn with_content(
        path: &Path,
        content: Content,
        base: &ModelConfig,
        device: &Device,
    ) -> Result<GgufModel, ModelError> {
        let rows = |name: &str| content.tensor_infos.get(name).map(|t| t.shape.dims()[0]);
        let config = llama_cpp_config(&content.metadata, base, rows("token_embd.weight"), rows("output.weight"))?;
        let layers = "model.layers.";
        let tensors = config.tensors();
        let head_tensors = tensors.iter().filter(|(n, _)| !n.starts_with(layers));
        let weights = dequantized(path, &content, device, head_tensors)?;
        let head = Transformer::without_layers(&config, &weights, &Trainable::nothing(), DType::F32)?;
        Ok(GgufModel { config, path: path.to_path_buf(), content, head, device: device.clone() })
    }

    /// Final hidden states of `batches` (see [`Transformer::hidden_streamed`]).
    pub fn hidden(&self, batches: &[Batch]) -> Result<Vec<Tensor>, ModelError> {
        self.head.hidden_streamed(batches, |i| self.layer(i), None)
    }

    /// The LM head over hidden states (f32 logits).
    pub fn logits(&self, h: &Tensor) -> Result<Tensor, ModelError> {
        self.head.head(h).map_err(ModelError::candle("LM head"))
    }

    fn layer(&self, i: usize) -> Result<DecoderLayer, ModelError> {
        let prefix = format!("model.layers.{i}.");
        let tensors = self.config.tensors();
        let layer = tensors.iter().filter(|(n, _)| n.starts_with(&prefix));
        let weights = dequantized(&self.path, &self.content, &self.device, layer)?;
        self.head.layer(i, &weights, &Trainable::nothing(), &BTreeMap::new())
    }
}

/// Hugging Face-named weights `tensors` (name and shape, as [`ModelConfig::tensors`] gives
/// them) on `device`, dequantized from the tensors of the GGUF at `path` (norms as Gemma's
/// offsets from one), each checked against its shape.
fn dequantized<'n>(
    path: &Path,
    content: &Content,
    device: &Device,
    tensors: impl Iterator<Item = &'n (String, Vec<usize>)>,
) -> Result<BTreeMap<String, Tensor>, ModelError> {
    let mut f = std::fs::File::open(path).map_err(ModelError::io(format!("cannot open `{}`", path.display())))?;
    let mut out = BTreeMap::new();
    for (hf, shape) in tensors {
        let missing = || ModelError::MissingTensor { name: hf.to_string() };
        let name = tensor_name(hf, true).ok_or_else(missing)?;
        let q = content.tensor(&mut f, &name, &Device::Cpu).map_err(|_| missing())?;
        let mut t = q.dequantize(&Device::Cpu).map_err(ModelError::candle(format!("dequantize `{name}`")))?;
        if name.ends_with("norm.weight") {
            t = t.affine(1.0, -1.0).map_err(ModelError::candle(format!("`{name}` less one")))?;
        }
        if t.dims() != shape.as_slice() {
            return Err(ModelError::ShapeMismatch { name, expected: shape.clone(), found: t.dims().to_vec() });
        }
        out.insert(hf.to_string(), t.to_device(device).map_err(ModelError::candle(format!("load `{name}`")))?);
    }
    Ok(out)
}

/// The Gemma config llama.cpp computes from a GGUF's metadata (`llama_model_gemma2/3::
/// load_arch_hparams` and the graph's constants); `vocab` and `head` are the rows of
/// `token_embd.weight` and `output.weight` (`None`: the head is the embedding).
pub fn llama_cpp_config(
    md: &HashMap<String, Value>,
    base: &ModelConfig,
    vocab: Option<usize>,
    head: Option<usize>,
) -> Result<ModelConfig, ModelError> {
    let bad = |what: String| ModelError::Unsupported { what: format!("a GGUF whose {what}") };
    let arch_name = md.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
    let arch = match arch_name.as_str() {
        "gemma2" => Arch::Gemma2,
        "gemma3" => Arch::Gemma3,
        other => return Err(bad(format!("architecture `{other}` is not Gemma 2 or 3"))),
    };
    let key = |k: &str| md.get(&format!("{arch_name}.{k}"));
    let u = |k: &str| -> Result<Option<usize>, ModelError> {
        key(k).map(|v| v.to_u32().map(|x| x as usize)).transpose().map_err(|_| bad(format!("`{k}` is not a u32")))
    };
    let f = |k: &str| -> Result<Option<f64>, ModelError> {
        key(k).map(|v| v.to_f32().map(f64::from)).transpose().map_err(|_| bad(format!("`{k}` is not an f32")))
    };
    let need = |k: &str| -> Result<usize, ModelError> { u(k)?.ok_or_else(|| bad(format!("metadata has no `{k}`"))) };
    let hidden = need("embedding_length")?;
    let layers = need("block_count")?;
    let heads = need("attention.head_count")?;
    let head_dim = u("attention.key_length")?.unwrap_or(hidden / heads.max(1));
    let rope_theta = f("rope.freq_base")?.unwrap_or(10000.0);
    let big = layers == if arch == Arch::Gemma3 { 62 } else { 46 };
    let scalar = if big { hidden / heads.max(1) } else { head_dim };
    let gemma3 = arch == Arch::Gemma3;
    let window = u("attention.sliding_window")?.filter(|&w| w > 0).or((!gemma3).then_some(4096));
    let pattern: Vec<bool> = match key("attention.sliding_window_pattern") {
        Some(Value::Array(a)) => a.iter().map(|v| v.to_bool().unwrap_or(false)).collect(),
        other => {
            let every = match other {
                Some(v) => {
                    v.to_u32().map_err(|_| bad("`attention.sliding_window_pattern` is unreadable".into()))? as usize
                }
                None if gemma3 => 6,
                None => 2,
            };
            (0..layers).map(|i| every == 0 || i % every < every - 1).collect()
        }
    };
    let local_theta = f("rope.freq_base_swa")?.unwrap_or(if gemma3 { 10000.0 } else { rope_theta });
    let rope_scaling = match f("rope.scaling.factor")?.or(f("rope.scale_linear")?) {
        Some(factor) if factor != 0.0 && factor != 1.0 => Some(RopeParameters {
            rope_theta: None,
            rope_type: Some("linear".into()),
            factor: Some(factor),
            low_freq_factor: None,
            high_freq_factor: None,
            original_max_position_embeddings: None,
        }),
        _ => None,
    };
    let final_softcap = f("final_logit_softcapping")?.or((!gemma3).then_some(30.0)).filter(|&c| c != 0.0);
    Ok(ModelConfig {
        arch,
        hidden_size: hidden,
        intermediate_size: need("feed_forward_length")?,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: u("attention.head_count_kv")?.unwrap_or(heads),
        head_dim,
        vocab_size: vocab.ok_or_else(|| bad("tensors have no `token_embd.weight`".into()))?,
        max_position_embeddings: u("context_length")?.unwrap_or(base.max_position_embeddings),
        sliding_window: None,
        rms_norm_eps: f("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| bad("metadata has no RMS epsilon".into()))?,
        rope_theta,
        rope_scaling,
        // Gemma 2's graph reads the embedding as its head, whatever else the file holds.
        tie_word_embeddings: head.is_none() || !gemma3,
        activation: Activation::GeluTanh,
        norm_offset: true,
        sandwich_norms: true,
        embed_scale: Some((hidden as f64).sqrt()),
        attn_scale: (scalar as f64).powf(-0.5),
        attn_softcap: if gemma3 { None } else { f("attn_logit_softcapping")?.or(Some(50.0)) },
        final_softcap,
        local_attention: window.map(|window| LocalAttention { window, layers: pattern, rope_theta: local_theta }),
        qkv_bias: false,
        o_bias: false,
        qk_norm: gemma3,
        mlp_bias: false,
        ..base.clone()
    })
}
