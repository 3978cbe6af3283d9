//! The architecture spec: what a decoder-only model computes, decided once from its
//! [`ModelConfig`]. Every engine (candle's autograd, the fused CPU engine, the GPU engine's CUDA
//! and Vulkan kernels) builds its passes from a [`Spec`] and reads none of the config's
//! architecture fields itself, and every "this engine cannot run that model" is one question:
//! which [`Feature`]s of the spec an engine's kernels lack ([`Spec::unsupported`]).
//!
//! A layer computes, with `norm` an RMSNorm ([`NormSpec`]) and `act` the gate's activation:
//!
//! ```text
//! h   = norm(x)                                         input_layernorm
//! q,k = norm_head(q(h)), norm_head(k(h))                q_norm, k_norm   (qk_norm)
//! q,k = rope_r(q), rope_r(k)                            rotary table r = attention.rope
//! s   = cap(scale · q kᵀ) + mask_window                 attention.softcap, attention.window
//! a   = o(softmax(s) v)
//! x   = x + a            or  x + norm(a)                post_attention_layernorm (sandwich)
//! h   = norm(x)                                         post_attention / pre_feedforward
//! x   = x + down(act(gate(h)) · up(h))   or  x + norm(down(…))   post_feedforward (sandwich)
//! ```
//!
//! and the model `logits = cap_final(head(norm(layers(embed(ids) · embed_scale))))`.
//!
//! Adding a variant of this math is: the config reader ([`super::config`]), a field here and its
//! [`Feature`], and a kernel in each engine that lacks it (which until then refuses the model by
//! name through [`Spec::unsupported`]).

use std::collections::BTreeSet;

use serde::Serialize;

use super::config::{Activation, ModelConfig, RopeParameters};

/// What a model computes (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Spec {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    /// Every RMSNorm of the model: each layer's and the final one.
    pub norm: NormSpec,
    /// Embeddings are multiplied by this (Gemma: √hidden, which each engine rounds to its
    /// compute dtype as transformers rounds it to the weights').
    pub embed_scale: Option<f64>,
    /// The logits become `c · tanh(logits / c)` (Gemma 2).
    pub final_softcap: Option<f64>,
    /// The LM head is the embedding matrix.
    pub tied_head: bool,
    /// The distinct rotary tables; [`AttentionSpec::rope`] indexes them. The first is the
    /// model's (global layers); Gemma 3's local layers have a second of their own base.
    pub ropes: Vec<RopeSpec>,
    pub layers: Vec<LayerSpec>,
}

/// How a model's RMSNorms compute.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct NormSpec {
    pub eps: f64,
    /// Gemma's `x̂ · (1 + w)` in f32 (weights stored as offsets from one), instead of `x̂ · w`.
    pub offset: bool,
}

/// A rotary table: `rope_theta` and its frequency scaling (llama3 or linear), over the head size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RopeSpec {
    pub theta: f64,
    pub scaling: Option<RopeParameters>,
}

/// One decoder layer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerSpec {
    pub attention: AttentionSpec,
    /// Gemma 2 and 3: the attention's and the MLP's outputs are RMS-normalised before they join
    /// the residual (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP reads
    /// `pre_feedforward_layernorm` where Llama's reads `post_attention_layernorm`.
    pub sandwich_norms: bool,
    /// The MLP's gate activation.
    pub activation: Activation,
}

/// A layer's attention.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AttentionSpec {
    /// Scores' scale: `head_dim^-½`, or Gemma's `query_pre_attn_scalar^-½`.
    pub scale: f64,
    /// Scores become `c · tanh(scores / c)` before the mask (Gemma 2).
    pub softcap: Option<f64>,
    /// Each query sees itself and at most `window − 1` keys before it (Gemma's local layers);
    /// `None`: every earlier key of its document.
    pub window: Option<usize>,
    /// Which of [`Spec::ropes`] rotates its queries and keys.
    pub rope: usize,
    /// Each query and key head is RMS-normalised before the rotary embedding (Qwen3, Gemma 3).
    pub qk_norm: bool,
}

/// A part of the math that not every engine may have a kernel for. The engines list the
/// features they run ([`crate::engine::candle::FEATURES`] and its peers); a model whose spec has
/// one an engine lacks is refused by that engine, naming it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Feature {
    /// Per-head query and key RMSNorms.
    QkNorm,
    /// RMSNorms by `1 + w`.
    NormOffset,
    /// Norms on the attention's and the MLP's outputs.
    SandwichNorms,
    /// The GELU-tanh gate.
    GeluGate,
    /// Scaled embeddings.
    EmbedScale,
    /// Attention within a window of earlier keys.
    LocalWindow,
    /// A second rotary table for some layers.
    LayerRope,
    /// tanh caps on attention scores.
    AttentionSoftcap,
    /// A tanh cap on the logits.
    FinalSoftcap,
}

impl Feature {
    /// Every feature, in order.
    pub const ALL: [Feature; 9] = [
        Feature::QkNorm,
        Feature::NormOffset,
        Feature::SandwichNorms,
        Feature::GeluGate,
        Feature::EmbedScale,
        Feature::LocalWindow,
        Feature::LayerRope,
        Feature::AttentionSoftcap,
        Feature::FinalSoftcap,
    ];

    /// The feature in words, as an error names it.
    pub fn describe(self) -> &'static str {
        match self {
            Feature::QkNorm => "RMSNorms of each query and key head",
            Feature::NormOffset => "RMSNorms by `1 + w`",
            Feature::SandwichNorms => "RMSNorms on the attention's and the MLP's outputs",
            Feature::GeluGate => "the GELU-tanh gate",
            Feature::EmbedScale => "scaled embeddings",
            Feature::LocalWindow => "attention within a window of earlier keys",
            Feature::LayerRope => "local layers' own rotary tables",
            Feature::AttentionSoftcap => "tanh caps on attention scores",
            Feature::FinalSoftcap => "a tanh cap on the logits",
        }
    }
}

impl Spec {
    /// The spec of the model `cfg` describes.
    pub fn of(cfg: &ModelConfig) -> Spec {
        let global = RopeSpec { theta: cfg.rope_theta, scaling: cfg.rope_scaling.clone() };
        let mut ropes = vec![global];
        // Gemma 3's local layers rotate by their own base, unscaled, where it differs.
        let local_rope = cfg.local_attention.as_ref().and_then(|l| {
            let own = RopeSpec { theta: l.rope_theta, scaling: None };
            (own != ropes[0]).then(|| {
                ropes.push(own);
                ropes.len() - 1
            })
        });
        let layers = (0..cfg.num_layers)
            .map(|i| {
                let local = cfg.local_attention.as_ref().filter(|l| l.layers.get(i) == Some(&true));
                LayerSpec {
                    attention: AttentionSpec {
                        scale: cfg.attn_scale,
                        softcap: cfg.attn_softcap,
                        // A null window (`usize::MAX`) attends everywhere: such a layer differs
                        // only by its rotary table.
                        window: local.map(|l| l.window).filter(|&w| w != usize::MAX),
                        rope: local.and(local_rope).unwrap_or(0),
                        qk_norm: cfg.qk_norm,
                    },
                    sandwich_norms: cfg.sandwich_norms,
                    activation: cfg.activation,
                }
            })
            .collect();
        Spec {
            hidden: cfg.hidden_size,
            intermediate: cfg.intermediate_size,
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            vocab: cfg.vocab_size,
            norm: NormSpec { eps: cfg.rms_norm_eps, offset: cfg.norm_offset },
            embed_scale: cfg.embed_scale,
            final_softcap: cfg.final_softcap,
            tied_head: cfg.tie_word_embeddings,
            ropes,
            layers,
        }
    }

    /// The features this model's math has.
    pub fn features(&self) -> BTreeSet<Feature> {
        let mut f = BTreeSet::new();
        let mut add = |on: bool, feature| {
            if on {
                f.insert(feature);
            }
        };
        add(self.norm.offset, Feature::NormOffset);
        add(self.embed_scale.is_some(), Feature::EmbedScale);
        add(self.final_softcap.is_some(), Feature::FinalSoftcap);
        add(self.ropes.len() > 1, Feature::LayerRope);
        for l in &self.layers {
            add(l.attention.qk_norm, Feature::QkNorm);
            add(l.attention.softcap.is_some(), Feature::AttentionSoftcap);
            add(l.attention.window.is_some(), Feature::LocalWindow);
            add(l.sandwich_norms, Feature::SandwichNorms);
            add(l.activation == Activation::GeluTanh, Feature::GeluGate);
        }
        f
    }

    /// Why `engine` (whose kernels run the features `runs`) cannot run this model, naming the
    /// first feature it lacks; `None` when it can.
    pub fn unsupported(&self, engine: &str, runs: &[Feature]) -> Option<String> {
        let missing: Vec<&str> =
            self.features().into_iter().filter(|f| !runs.contains(f)).map(Feature::describe).collect();
        (!missing.is_empty()).then(|| format!("the {engine} has no kernels for {} yet", missing.join(", ")))
    }

    /// The distinct attention windows of the local layers, ascending (engines build one mask or
    /// key range for each).
    pub fn windows(&self) -> Vec<usize> {
        let set: BTreeSet<usize> = self.layers.iter().filter_map(|l| l.attention.window).collect();
        set.into_iter().collect()
    }
}

/// Rows of the rotary tables: positions past this are never trained or evaluated (sequences
/// are bounded by `dataset.max_seq_len`), and a config claiming millions of positions must not
/// size a multi-gigabyte table.
pub const ROPE_TABLE_MAX: usize = 1 << 17;

impl RopeSpec {
    /// The rotary table's values for positions `0 .. n`, row-major `[n, d]` each, in f32:
    /// transformers' `rope_init_fn` (default, llama3 or linear scaling) with `emb = cat(freqs, freqs)`.
    pub fn values(&self, d: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let mut inv: Vec<f32> = (0..d / 2).map(|i| 1.0 / (self.theta as f32).powf((2 * i) as f32 / d as f32)).collect();
        if let Some(rs) = self.scaling.as_ref().filter(|rs| rs.rope_type.as_deref() == Some("linear")) {
            // transformers' `_compute_linear_scaling_rope_parameters`: every frequency divided.
            let factor = rs.factor.unwrap_or(1.0) as f32;
            inv.iter_mut().for_each(|f| *f /= factor);
        } else if let Some(rs) = &self.scaling {
            let factor = rs.factor.unwrap_or(8.0) as f32;
            let low = rs.low_freq_factor.unwrap_or(1.0) as f32;
            let high = rs.high_freq_factor.unwrap_or(4.0) as f32;
            let old = rs.original_max_position_embeddings.unwrap_or(8192) as f32;
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            for f in inv.iter_mut() {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                let scaled = if wavelen > low_wavelen { *f / factor } else { *f };
                // wavelengths are finite here, so `>=`/`<=` are the negations transformers writes
                let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                *f = if medium {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                } else {
                    scaled
                };
            }
        }
        let mut cos = Vec::with_capacity(n * d);
        let mut sin = Vec::with_capacity(n * d);
        for p in 0..n {
            // emb = cat(freqs, freqs): the table repeats each frequency in both halves.
            for _ in 0..2 {
                for f in &inv {
                    let a = p as f32 * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        }
        (cos, sin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RawConfig;

    fn spec(v: serde_json::Value) -> Spec {
        Spec::of(&ModelConfig::from_raw(&serde_json::from_value::<RawConfig>(v).unwrap()).unwrap())
    }

    fn config(arch: &str, extra: serde_json::Value) -> serde_json::Value {
        let mut v = serde_json::json!({
            "architectures": [arch], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    /// Llama is the plain layer; Gemma 3's config turns on its norms, gate, scale, local windows
    /// and their own rotary table on exactly the local layers; Gemma 2 adds its caps and keeps one
    /// rotary table.
    #[test]
    fn the_spec_says_per_layer_what_each_architecture_computes() {
        let llama = spec(config("LlamaForCausalLM", serde_json::json!({})));
        assert!(llama.features().is_empty());
        assert_eq!((llama.ropes.len(), llama.layers[0].attention.scale), (1, 8f64.powf(-0.5)));
        assert!(llama.windows().is_empty());

        let gemma3 = spec(config(
            "Gemma3ForCausalLM",
            serde_json::json!({"sliding_window": 3, "query_pre_attn_scalar": 12, "rope_local_base_freq": 10000.0}),
        ));
        let want: BTreeSet<Feature> = [
            Feature::QkNorm,
            Feature::NormOffset,
            Feature::SandwichNorms,
            Feature::GeluGate,
            Feature::EmbedScale,
            Feature::LocalWindow,
            Feature::LayerRope,
        ]
        .into();
        assert_eq!(gemma3.features(), want);
        assert_eq!(gemma3.ropes[1], RopeSpec { theta: 1e4, scaling: None });
        assert_eq!(gemma3.ropes[0].theta, 1e6);
        // Every sixth layer is global: the default table, no window.
        let kinds: Vec<(Option<usize>, usize)> =
            gemma3.layers.iter().map(|l| (l.attention.window, l.attention.rope)).collect();
        assert_eq!(kinds, [(Some(3), 1), (Some(3), 1), (Some(3), 1), (Some(3), 1), (Some(3), 1), (None, 0)]);
        assert_eq!((gemma3.windows(), gemma3.layers[0].attention.scale), (vec![3], 12f64.powf(-0.5)));

        let gemma2 = spec(config("Gemma2ForCausalLM", serde_json::json!({"sliding_window": 4096})));
        assert_eq!(gemma2.ropes.len(), 1, "Gemma 2's local layers share the model's rotary table");
        assert!(gemma2.features().is_superset(&[Feature::AttentionSoftcap, Feature::FinalSoftcap].into()));
        assert!(!gemma2.features().contains(&Feature::QkNorm));
        assert_eq!(gemma2.layers.iter().filter(|l| l.attention.window == Some(4096)).count(), 3);
        assert_eq!((gemma2.final_softcap, gemma2.layers[1].attention.softcap), (Some(30.0), Some(50.0)));
    }

    /// An engine that lacks a feature's kernels says which, in words; one with all of them runs
    /// the model.
    #[test]
    fn an_engine_without_a_features_kernels_refuses_the_model_by_name() {
        let gemma2 = spec(config("Gemma2ForCausalLM", serde_json::json!({})));
        let without_caps: Vec<Feature> = Feature::ALL
            .into_iter()
            .filter(|f| !matches!(f, Feature::AttentionSoftcap | Feature::FinalSoftcap))
            .collect();
        assert_eq!(
            gemma2.unsupported("test engine", &without_caps).as_deref(),
            Some("the test engine has no kernels for tanh caps on attention scores, a tanh cap on the logits yet")
        );
        assert_eq!(gemma2.unsupported("test engine", &Feature::ALL), None);
    }
}
