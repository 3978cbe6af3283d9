//! Decoder-only transformers of the Llama family (Llama 2/3, SmolLM, TinyLlama, Mistral on
//! sequences within its sliding window), Qwen2/Qwen2.5, Qwen3, Gemma 2 and Gemma 3 (text), with
//! LoRA adapters on any linear projection.
//!
//! Follows transformers' `modeling_llama.py`, `modeling_qwen2.py`, `modeling_qwen3.py`,
//! `modeling_gemma2.py` and `modeling_gemma3.py` (RMSNorm, rotary embeddings with
//! `rotate_half`, grouped-query attention, Qwen3's and Gemma 3's RMSNorm of each query and key
//! head before the rotary embedding, SiLU- or GELU-gated MLP; Gemma's `(1 + w)` norms, scaled
//! embeddings, norms after attention and the MLP, local attention within a window and Gemma 2's
//! tanh caps), so that logits and losses match transformers for the same weights. Every op on
//! the training path is one with a backward pass in candle: candle's fused `rms_norm`,
//! `softmax_last_dim` and `rope` kernels have none and would silently drop gradients.

use std::collections::BTreeMap;

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor, Var};

use super::linear::{Linear, Lora};
use super::ops::{apply_rope, cross_entropy, repeat_kv, rms_norm, rms_norm_offset, rope_tables, softmax_last};
use crate::engine::params::{Param, load_params, new_adapter};
use crate::model::arch::{AttentionSpec, LayerSpec, NormSpec, Spec};
use crate::model::batch::{Batch, MASKED};
use crate::model::config::{Activation, ModelConfig};
use crate::model::lora::is_adapter_param;
use crate::model::{FEEDFORWARD_NORMS, LAYER_LINEARS, ModelError, QK_NORMS, Trainable};
use crate::rng::Rng;

/// Sees what a decoder layer's linears read while a forward runs: `(layer, linears, x)`, where
/// `linears` index [`LAYER_LINEARS`] (the linears that all read `x`, `[b, t, in]`: q, k and v
/// share theirs, as gate and up do). An importance matrix is made of these
/// ([`crate::export::gguf::imatrix`]).
pub type Observer<'o> = &'o mut dyn FnMut(usize, &[usize], &Tensor) -> Result<()>;

/// An [`Observer`] inside one decoder layer: `(linears, x)`.
type LayerObserver<'a, 'o> = &'a mut (dyn FnMut(&[usize], &Tensor) -> Result<()> + 'o);

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3's and Gemma 3's per-head RMSNorm weights of queries and keys (`[head_dim]` each).
    qk_norm: Option<(Tensor, Tensor)>,
    norm: Norm,
    /// Its scale, cap, window and rotary table.
    spec: AttentionSpec,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    activation: Activation,
}

struct Layer {
    input_norm: Tensor,
    attn: Attention,
    /// Llama's norm before the MLP; with `sandwich_norms`, the attention output's norm.
    post_norm: Tensor,
    /// With `sandwich_norms`: the norms before the MLP and on its output.
    feedforward_norms: Option<(Tensor, Tensor)>,
    norm: Norm,
    mlp: Mlp,
}

/// How a model's RMSNorms compute ([`Norm::apply`]).
#[derive(Debug, Clone, Copy)]
struct Norm(NormSpec);

impl Norm {
    fn apply(self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        if self.0.offset { rms_norm_offset(x, w, self.0.eps) } else { rms_norm(x, w, self.0.eps) }
    }
}

/// One decoder layer built on its own ([`Transformer::layer`]), for a forward that holds one
/// layer at a time ([`Transformer::hidden_streamed`]).
pub struct DecoderLayer(Layer);

/// Cached keys and values of earlier positions, one pair per layer (generation).
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.layers.first().and_then(|l| l.as_ref()).map(|(k, _)| k.dim(2).unwrap_or(0)).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub struct Transformer {
    pub cfg: ModelConfig,
    /// What it computes.
    pub spec: Spec,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// cos/sin tables `[max_positions, head_dim]` of each of the spec's rotary tables.
    ropes: Vec<(Tensor, Tensor)>,
    pub params: Vec<Param>,
    dtype: DType,
}

impl Transformer {
    /// Build the model from HF-named weights. Trainable weights become variables (in `params`);
    /// LoRA adapters are created with `rng` as PEFT initialises them.
    pub fn new(
        cfg: &ModelConfig,
        weights: &BTreeMap<String, Tensor>,
        trainable: &Trainable,
        rng: &mut Rng,
    ) -> std::result::Result<Transformer, ModelError> {
        let dtype = weights.get("model.embed_tokens.weight").map(|t| t.dtype()).unwrap_or(DType::F32);
        Self::with_dtype(cfg, weights, trainable, rng, dtype)
    }

    /// Build the model computing in `dtype`. Frozen weights are converted to it; trained ones
    /// (LoRA adapters, trainable base weights) are kept in f32 as master weights and converted
    /// on use, so bf16/f16 training still accumulates its updates in f32.
    pub fn with_dtype(
        cfg: &ModelConfig,
        weights: &BTreeMap<String, Tensor>,
        trainable: &Trainable,
        rng: &mut Rng,
        dtype: DType,
    ) -> std::result::Result<Transformer, ModelError> {
        Self::build(cfg, weights, trainable, rng, dtype, true)
    }

    /// The model without its decoder layers: the embedding, the final norm and the LM head (with
    /// its adapter where `trainable` gives it one), from `weights` that need hold no layer's
    /// tensors. The layers come one at a time ([`Self::layer`]) to [`Self::hidden_streamed`].
    pub fn without_layers(
        cfg: &ModelConfig,
        weights: &BTreeMap<String, Tensor>,
        trainable: &Trainable,
        dtype: DType,
    ) -> std::result::Result<Transformer, ModelError> {
        Self::build(cfg, weights, trainable, &mut Rng::new(0), dtype, false)
    }

    fn build(
        cfg: &ModelConfig,
        weights: &BTreeMap<String, Tensor>,
        trainable: &Trainable,
        rng: &mut Rng,
        dtype: DType,
        with_layers: bool,
    ) -> std::result::Result<Transformer, ModelError> {
        let mut b = Builder { weights, trainable, rng, params: Vec::new(), dtype, next_id: 0 };
        let spec = Spec::of(cfg);
        let h = cfg.hidden_size;
        let embed = b.weight("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        if with_layers {
            for i in 0..cfg.num_layers {
                layers.push(b.layer(cfg, &spec, i)?);
            }
        }
        b.next_id = cfg.num_layers * LAYER_LINEARS.len();
        let norm = b.weight("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings || !weights.contains_key("lm_head.weight") {
            if !cfg.tie_word_embeddings {
                return Err(ModelError::MissingTensor { name: "lm_head.weight".into() });
            }
            b.linear_with("lm_head", "model.embed_tokens.weight", embed.clone(), None, h, cfg.vocab_size)?
        } else {
            b.linear("lm_head", h, cfg.vocab_size, false)?
        };
        let params = std::mem::take(&mut b.params);
        let ropes = spec
            .ropes
            .iter()
            .map(|r| rope_tables(r, cfg.head_dim, cfg.max_position_embeddings, embed.device(), dtype))
            .collect::<Result<_>>()
            .map_err(ModelError::candle("rotary tables"))?;
        Ok(Transformer { cfg: cfg.clone(), spec, embed, layers, norm, lm_head, ropes, params, dtype })
    }

    /// Decoder layer `i`, built on its own from Hugging Face-named `weights` (only layer `i`'s
    /// are read) in this model's compute dtype, with adapters where `trainable` puts them and
    /// their matrices from `adapters` (PEFT's names; every one the layer has must be there).
    pub fn layer(
        &self,
        i: usize,
        weights: &BTreeMap<String, Tensor>,
        trainable: &Trainable,
        adapters: &BTreeMap<String, Tensor>,
    ) -> std::result::Result<DecoderLayer, ModelError> {
        let mut rng = Rng::new(0);
        let mut b = Builder { weights, trainable, rng: &mut rng, params: Vec::new(), dtype: self.dtype, next_id: 0 };
        let layer = b.layer(&self.cfg, &self.spec, i)?;
        load_params(&b.params, adapters, is_adapter_param)?;
        Ok(DecoderLayer(layer))
    }

    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    /// The dtype activations are computed in.
    pub fn compute_dtype(&self) -> DType {
        self.dtype
    }

    /// `model.embed_tokens.weight`.
    pub fn embed_weight(&self) -> &Tensor {
        &self.embed
    }

    /// `model.norm.weight`.
    pub fn norm_weight(&self) -> &Tensor {
        &self.norm
    }

    /// Layer `i`'s input and post-attention RMSNorm weights.
    pub fn layer_norms(&self, i: usize) -> (&Tensor, &Tensor) {
        (&self.layers[i].input_norm, &self.layers[i].post_norm)
    }

    /// Layer `i`'s per-head query and key RMSNorm weights (Qwen3), `[head_dim]` each.
    pub fn qk_norms(&self, i: usize) -> Option<(&Tensor, &Tensor)> {
        self.layers[i].attn.qk_norm.as_ref().map(|(q, k)| (q, k))
    }

    /// Layer `i`'s norms before and after its MLP (Gemma's `sandwich_norms`).
    pub fn feedforward_norms(&self, i: usize) -> Option<(&Tensor, &Tensor)> {
        self.layers[i].feedforward_norms.as_ref().map(|(a, b)| (a, b))
    }

    /// The cos/sin tables of each of the spec's rotary tables, `[max_positions, head_dim]` each.
    pub fn rope_tables(&self) -> &[(Tensor, Tensor)] {
        &self.ropes
    }

    /// Hidden states after the final norm: `[b, t, hidden]`.
    pub fn hidden(&self, batch: &Batch, dropout: Option<u64>, mut cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (mut x, inputs) = self.inputs(batch)?;
        if let Some(c) = cache.as_deref_mut()
            && c.layers.len() != self.layers.len()
        {
            c.layers = vec![None; self.layers.len()];
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let slot = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = layer.forward(&x, &inputs, dropout, slot, None)?;
        }
        Norm(self.spec.norm).apply(&x, &self.norm)
    }

    /// Hidden states after the final norm of each of `batches`, the decoder layers built one at
    /// a time by `layer(i)` ([`Self::layer`]) and dropped once every batch has passed through:
    /// the model's layers are never in memory together. `self` is built
    /// [`Self::without_layers`].
    /// `observe`, where given, sees every linear's input ([`Observer`]).
    pub fn hidden_streamed(
        &self,
        batches: &[Batch],
        mut layer: impl FnMut(usize) -> std::result::Result<DecoderLayer, ModelError>,
        mut observe: Option<Observer<'_>>,
    ) -> std::result::Result<Vec<Tensor>, ModelError> {
        use ModelError as E;
        let mut states = Vec::with_capacity(batches.len());
        for batch in batches {
            states.push(self.inputs(batch).map_err(E::candle("embed a batch"))?);
        }
        for i in 0..self.cfg.num_layers {
            let DecoderLayer(l) = layer(i)?;
            for (x, inputs) in states.iter_mut() {
                let mut seen = observe.as_mut().map(|o| move |lin: &[usize], t: &Tensor| o(i, lin, t));
                let seen = seen.as_mut().map(|f| f as &mut dyn FnMut(&[usize], &Tensor) -> Result<()>);
                // Detached: the result must not keep the layer (its adapters are variables)
                // alive through candle's graph once the layer is dropped.
                *x = l.forward(x, inputs, None, None, seen).map_err(E::candle(format!("layer {i}")))?.detach();
            }
        }
        states
            .into_iter()
            .map(|(x, _)| Norm(self.spec.norm).apply(&x, &self.norm).map_err(E::candle("final norm")))
            .collect()
    }

    /// The LM head's logits (f32) for hidden states `[..., hidden]`.
    pub fn head(&self, h: &Tensor) -> Result<Tensor> {
        self.head_t(h, None)
    }

    /// The LM head's f32 logits, capped where the model caps them (Gemma 2).
    fn head_t(&self, h: &Tensor, dropout: Option<u64>) -> Result<Tensor> {
        let logits = self.lm_head.forward_t(h, dropout)?.to_dtype(DType::F32)?;
        match self.spec.final_softcap {
            Some(c) => softcap(&logits, c),
            None => Ok(logits),
        }
    }

    /// A batch's embedded tokens `[b, t, hidden]` and what every layer reads beside them.
    fn inputs(&self, batch: &Batch) -> Result<(Tensor, LayerInputs)> {
        let (b, t) = batch.ids.dims2()?;
        let embed = self.embed.to_dtype(self.dtype)?;
        let mut x = embed.index_select(&batch.ids.flatten_all()?, 0)?.reshape((b, t, self.cfg.hidden_size))?;
        if let Some(scale) = self.spec.embed_scale {
            // Gemma multiplies by √hidden rounded to the weights' dtype.
            let scale = Tensor::new(scale as f32, x.device())?.to_dtype(self.dtype)?;
            x = x.broadcast_mul(&scale)?;
        }
        let pos = batch.positions.flatten_all()?;
        let table = |t_: &Tensor| t_.index_select(&pos, 0)?.reshape((b, 1, t, self.cfg.head_dim));
        let ropes = self.ropes.iter().map(|(c, s)| Ok((table(c)?, table(s)?))).collect::<Result<_>>()?;
        let mask = batch.mask.to_dtype(self.dtype)?;
        let windows =
            self.spec.windows().into_iter().map(|w| Ok((w, window_mask(&mask, w)?))).collect::<Result<_>>()?;
        Ok((x, LayerInputs { ropes, mask, windows }))
    }

    /// Logits for every position: `[b, t, vocab]` (f32).
    pub fn logits(&self, batch: &Batch) -> Result<Tensor> {
        self.head(&self.hidden(batch, None, None)?)
    }

    /// Mean cross-entropy of `targets` at the flattened positions `select` (indices into
    /// `b * t`): the LM head runs only where the loss counts. Equals transformers' loss with
    /// `labels` (shifted, -100 ignored) when `select`/`targets` come from those labels.
    pub fn loss(&self, batch: &Batch, select: &Tensor, targets: &Tensor, dropout: Option<u64>) -> Result<Tensor> {
        let h = self.hidden(batch, dropout, None)?;
        let h = h.flatten_to(1)?.index_select(select, 0)?;
        cross_entropy(&self.head_t(&h, dropout)?, targets)
    }

    /// Next-token logits `[vocab]` after feeding `ids` at position `cache.len()` onwards.
    pub fn step(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let start = cache.len();
        let t = ids.len();
        let total = start + t;
        let device = self.device();
        let positions: Vec<u32> = (start as u32..total as u32).collect();
        let mut mask = vec![MASKED; t * total];
        for q in 0..t {
            for k in 0..=(start + q) {
                mask[q * total + k] = 0.0;
            }
        }
        let batch = Batch {
            ids: Tensor::from_slice(ids, (1, t), device)?,
            positions: Tensor::from_vec(positions, (1, t), device)?,
            mask: Tensor::from_vec(mask, (1, 1, t, total), device)?,
        };
        let h = self.hidden(&batch, None, Some(cache))?;
        let last = h.i((0, t - 1))?.unsqueeze(0)?;
        self.head(&last)?.squeeze(0)
    }

    /// Every named linear layer (HF prefix without `.weight`), for merging and export.
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let lins = [&l.attn.q, &l.attn.k, &l.attn.v, &l.attn.o, &l.mlp.gate, &l.mlp.up, &l.mlp.down];
            for (n, lin) in LAYER_LINEARS.iter().zip(lins) {
                out.push((format!("{p}.{n}"), lin));
            }
        }
        out.push(("lm_head".into(), &self.lm_head));
        out
    }
}

/// What the layers read beside their input: each rotary table at a batch's positions, its
/// attention mask, and that mask cut to each local window.
struct LayerInputs {
    ropes: Vec<(Tensor, Tensor)>,
    mask: Tensor,
    windows: Vec<(usize, Tensor)>,
}

impl LayerInputs {
    /// The rotary tables and mask of a layer that attends as `a` says.
    fn of(&self, a: &AttentionSpec) -> (&Tensor, &Tensor, &Tensor) {
        let (cos, sin) = &self.ropes[a.rope];
        let mask = match a.window {
            Some(w) => &self.windows.iter().find(|(x, _)| *x == w).expect("a mask per window").1,
            None => &self.mask,
        };
        (cos, sin, mask)
    }
}

/// `mask` (`[b, 1, t, keys]`, the last `t` keys being the queries') with every key outside a
/// local layer's window masked too ([`crate::model::batch::outside_window`]).
fn window_mask(mask: &Tensor, window: usize) -> Result<Tensor> {
    let (_, _, t, keys) = mask.dims4()?;
    if window >= keys {
        return Ok(mask.clone());
    }
    let first = keys - t;
    let far: Vec<u8> = (0..t)
        .flat_map(|q| (0..keys).map(move |k| u8::from(crate::model::batch::outside_window(first + q, k, window))))
        .collect();
    let far = Tensor::from_vec(far, (1, 1, t, keys), mask.device())?.broadcast_as(mask.shape())?;
    // The masked value itself, not added again: a query whose keys are all hidden (padding)
    // gets an even softmax, never −inf or NaN.
    let masked = Tensor::full(MASKED, mask.shape(), mask.device())?.to_dtype(mask.dtype())?;
    far.where_cond(&masked, mask)
}

/// Gemma 2's cap: `c · tanh(x / c)`.
fn softcap(x: &Tensor, c: f64) -> Result<Tensor> {
    (x / c)?.tanh()? * c
}

impl Layer {
    fn forward(
        &self,
        x: &Tensor,
        inputs: &LayerInputs,
        dropout: Option<u64>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        mut observe: Option<LayerObserver<'_, '_>>,
    ) -> Result<Tensor> {
        let mut see = |linears: &[usize], t: &Tensor| observe.as_mut().map_or(Ok(()), |o| o(linears, t));
        let (cos, sin, mask) = inputs.of(&self.attn.spec);
        let norm = self.norm;
        let h = norm.apply(x, &self.input_norm)?;
        see(&[0, 1, 2], &h)?;
        let mixed = self.attn.mix(&h, cos, sin, mask, dropout, cache)?;
        see(&[3], &mixed)?;
        let attended = self.attn.o.forward_t(&mixed, dropout)?;
        let (x, h) = match &self.feedforward_norms {
            Some((pre, _)) => {
                let x = (x + norm.apply(&attended, &self.post_norm)?)?;
                let h = norm.apply(&x, pre)?;
                (x, h)
            }
            None => {
                let x = (x + attended)?;
                let h = norm.apply(&x, &self.post_norm)?;
                (x, h)
            }
        };
        see(&[4, 5], &h)?;
        let gate = self.mlp.gate.forward_t(&h, dropout)?;
        let gate = match self.mlp.activation {
            Activation::Silu => gate.silu()?,
            Activation::GeluTanh => gate.gelu()?,
        };
        let up = self.mlp.up.forward_t(&h, dropout)?;
        let act = (gate * up)?;
        see(&[6], &act)?;
        let out = self.mlp.down.forward_t(&act, dropout)?;
        match &self.feedforward_norms {
            Some((_, post)) => x + norm.apply(&out, post)?,
            None => x + out,
        }
    }
}

impl Attention {
    /// The heads' attention-weighted values, `[b, t, heads·d]`: what the output projection
    /// (`o`) reads.
    fn mix(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        dropout: Option<u64>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let d = self.head_dim;
        // [b, t, heads*d] → [b, heads, t, d]
        let mut q = self.q.forward_t(x, dropout)?.reshape((b, t, self.heads, d))?;
        let mut k = self.k.forward_t(x, dropout)?.reshape((b, t, self.kv_heads, d))?;
        if let Some((qn, kn)) = &self.qk_norm {
            q = self.norm.apply(&q, qn)?;
            k = self.norm.apply(&k, kn)?;
        }
        let (q, k) = (q.transpose(1, 2)?, k.transpose(1, 2)?);
        let v = self.v.forward_t(x, dropout)?.reshape((b, t, self.kv_heads, d))?.transpose(1, 2)?;
        let q = apply_rope(&q.contiguous()?, cos, sin)?;
        let mut k = apply_rope(&k.contiguous()?, cos, sin)?;
        let mut v = v.contiguous()?;
        if let Some(slot) = cache {
            if let Some((pk, pv)) = slot.as_ref() {
                k = Tensor::cat(&[pk, &k], 2)?;
                v = Tensor::cat(&[pv, &v], 2)?;
            }
            *slot = Some((k.clone(), v.clone()));
        }
        let k = repeat_kv(&k, self.heads / self.kv_heads)?;
        let v = repeat_kv(&v, self.heads / self.kv_heads)?;
        let mut scores = (q.matmul(&k.t()?)? * self.spec.scale)?;
        if let Some(c) = self.spec.softcap {
            scores = softcap(&scores, c)?;
        }
        let scores = scores.broadcast_add(mask)?;
        let probs = softmax_last(&scores)?;
        // [b, heads, t, d] → [b, t, heads*d]
        probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, self.heads * d))
    }
}

/// Collects weights and trainable parameters while the model is built.
struct Builder<'a> {
    weights: &'a BTreeMap<String, Tensor>,
    trainable: &'a Trainable,
    rng: &'a mut Rng,
    params: Vec<Param>,
    /// Compute dtype; trained weights stay f32.
    dtype: DType,
    /// The index the next linear layer gets (its place in [`Transformer::linears`]).
    next_id: usize,
}

impl Builder<'_> {
    /// Decoder layer `i` (its linears numbered from `i · 7`, as in [`Transformer::linears`]).
    fn layer(&mut self, cfg: &ModelConfig, spec: &Spec, i: usize) -> std::result::Result<Layer, ModelError> {
        let LayerSpec { attention, sandwich_norms, activation } = spec.layers[i].clone();
        self.next_id = i * LAYER_LINEARS.len();
        let p = format!("model.layers.{i}");
        let shapes = cfg.layer_linears();
        let lin = |b: &mut Self, k: usize| {
            let (inp, out, bias) = shapes[k];
            b.linear(&format!("{p}.{}", LAYER_LINEARS[k]), inp, out, bias)
        };
        // In the order their parameters always had: attention's linears, its norms, the MLP's.
        let (q, k, v, o) = (lin(self, 0)?, lin(self, 1)?, lin(self, 2)?, lin(self, 3)?);
        let qk_norm = match attention.qk_norm {
            true => Some((
                self.weight(&format!("{p}.{}.weight", QK_NORMS[0]), &[cfg.head_dim])?,
                self.weight(&format!("{p}.{}.weight", QK_NORMS[1]), &[cfg.head_dim])?,
            )),
            false => None,
        };
        let (gate, up, down) = (lin(self, 4)?, lin(self, 5)?, lin(self, 6)?);
        let norm = Norm(spec.norm);
        let attn = Attention {
            q,
            k,
            v,
            o,
            qk_norm,
            norm,
            spec: attention,
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        let h = cfg.hidden_size;
        let input_norm = self.weight(&format!("{p}.input_layernorm.weight"), &[h])?;
        let post_norm = self.weight(&format!("{p}.post_attention_layernorm.weight"), &[h])?;
        let feedforward_norms = match sandwich_norms {
            true => Some((
                self.weight(&format!("{p}.{}.weight", FEEDFORWARD_NORMS[0]), &[h])?,
                self.weight(&format!("{p}.{}.weight", FEEDFORWARD_NORMS[1]), &[h])?,
            )),
            false => None,
        };
        Ok(Layer { input_norm, attn, post_norm, feedforward_norms, norm, mlp: Mlp { gate, up, down, activation } })
    }

    fn weight(&mut self, name: &str, shape: &[usize]) -> std::result::Result<Tensor, ModelError> {
        let t = self.weights.get(name).ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        if t.dims() != shape {
            return Err(ModelError::ShapeMismatch {
                name: name.into(),
                expected: shape.to_vec(),
                found: t.dims().to_vec(),
            });
        }
        if self.trainable.trains_weight(name) {
            let master = t.to_dtype(DType::F32).map_err(ModelError::candle(format!("convert `{name}`")))?;
            let var = Var::from_tensor(&master).map_err(ModelError::candle(format!("make `{name}` trainable")))?;
            let out = var.as_tensor().clone();
            self.params.push(Param { name: name.to_string(), var });
            return Ok(out);
        }
        t.to_dtype(self.dtype).map_err(ModelError::candle(format!("convert `{name}`")))
    }

    fn linear(&mut self, prefix: &str, inp: usize, out: usize, bias: bool) -> std::result::Result<Linear, ModelError> {
        let w_name = format!("{prefix}.weight");
        let w = self.weight(&w_name, &[out, inp])?;
        let b = if bias { Some(self.weight(&format!("{prefix}.bias"), &[out])?) } else { None };
        self.linear_with(prefix, &w_name, w, b, inp, out)
    }

    /// `w_name`: the name of the linear's weight (the tied LM head's is the embedding's).
    fn linear_with(
        &mut self,
        prefix: &str,
        w_name: &str,
        w: Tensor,
        b: Option<Tensor>,
        inp: usize,
        out: usize,
    ) -> std::result::Result<Linear, ModelError> {
        let mut lin = Linear::new(w, b, self.next_id);
        self.next_id += 1;
        if let Some(spec) = self.trainable.adapter_for(prefix, w_name, lin.bias().is_some())? {
            let [a, b] = new_adapter(spec, prefix, (inp, out), DType::F32, lin.weight().device(), self.rng)
                .map_err(ModelError::candle(format!("create LoRA adapter for `{prefix}`")))?;
            let (ta, tb) = (a.var.as_tensor().clone(), b.var.as_tensor().clone());
            lin.lora = Some(Lora { a: ta, b: tb, scale: spec.scale(), dropout: spec.dropout });
            self.params.extend([a, b]);
        }
        Ok(lin)
    }
}

impl Module for Transformer {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let rows: Vec<Vec<u32>> = ids.to_vec2()?;
        let batch = Batch::new(&rows, &vec![t; b], None, ids.device())?;
        self.logits(&batch)
    }
}

impl Transformer {
    /// Overwrite trained parameters with saved values (a PEFT adapter, a checkpoint). Every
    /// parameter must be present with its shape.
    pub fn load_params(&self, tensors: &BTreeMap<String, Tensor>) -> std::result::Result<(), ModelError> {
        self.load_where(tensors, |_| true)
    }

    /// Overwrite the LoRA adapter matrices with saved values (a PEFT folder); base weights that
    /// train keep the values the model was built from.
    pub fn load_adapters(&self, tensors: &BTreeMap<String, Tensor>) -> std::result::Result<(), ModelError> {
        self.load_where(tensors, is_adapter_param)
    }

    fn load_where(
        &self,
        tensors: &BTreeMap<String, Tensor>,
        which: impl Fn(&str) -> bool,
    ) -> std::result::Result<(), ModelError> {
        load_params(&self.params, tensors, which)
    }

    /// Current values of the trained parameters, by name.
    pub fn param_values(&self) -> BTreeMap<String, Tensor> {
        self.params.iter().map(|p| (p.name.clone(), p.var.as_tensor().detach())).collect()
    }
}
