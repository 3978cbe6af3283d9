//! Decoder-only transformers of the Llama family (Llama 2/3, SmolLM, TinyLlama, Mistral without
//! sliding window) and Qwen2/Qwen2.5, with LoRA adapters on any linear projection.
//!
//! Follows transformers' `modeling_llama.py` and `modeling_qwen2.py` (RMSNorm, rotary embeddings
//! with `rotate_half`, grouped-query attention, SiLU-gated MLP), so that logits and losses match
//! transformers for the same weights. Every op on the training path is one with a backward pass
//! in candle: candle's fused `rms_norm`, `softmax_last_dim` and `rope` kernels have none and
//! would silently drop gradients.

use std::collections::BTreeMap;

use candle_core::{D, DType, Device, IndexOp, Module, Result, Tensor, Var};

use super::config::ModelConfig;
use super::lora::{Linear, LoraSpec, Param};
use crate::rng::Rng;

/// A large negative number for masked attention scores; finite so rows with nothing to attend to
/// give a uniform distribution instead of NaN — also in f16, whose largest finite magnitude this
/// is (-1e9 became −inf there). exp(MASKED − max) is 0 in f32 for any realistic score.
pub(crate) const MASKED: f32 = -65504.0;

/// Which weights train.
#[derive(Debug, Clone)]
pub enum Trainable {
    /// Nothing trains (evaluation, generation).
    Nothing,
    /// LoRA adapters train; the base is frozen.
    Lora(LoraSpec),
    /// Base weights whose HF names match any of these patterns train (`*` is a wildcard;
    /// `["*"]` is a full fine-tune).
    Weights(Vec<String>),
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Layer {
    input_norm: Tensor,
    attn: Attention,
    post_norm: Tensor,
    mlp: Mlp,
}

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

/// Token ids plus the attention structure of a batch.
#[derive(Debug, Clone)]
pub struct Batch {
    /// `[b, t]` u32.
    pub ids: Tensor,
    /// `[b, t]` u32 positions for rotary embeddings.
    pub positions: Tensor,
    /// `[b, 1, t, t]` additive attention mask.
    pub mask: Tensor,
}

impl Batch {
    /// Build a batch from rows of tokens. `lens[i]` tokens of row i are real (the rest padding);
    /// `segments[i][j]` is the packed-document index of token j (attention and positions never
    /// cross documents). The mask is [`attention_layout`]'s, written out.
    pub fn new(rows: &[Vec<u32>], lens: &[usize], segments: Option<&[Vec<u16>]>, device: &Device) -> Result<Batch> {
        let b = rows.len();
        let t = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = vec![0u32; b * t];
        for (r, row) in rows.iter().enumerate() {
            ids[r * t..r * t + row.len()].copy_from_slice(row);
        }
        Batch::from_layout(&ids, b, t, &attention_layout(t, lens, segments), device)
    }

    /// A batch of `[b, t]` padded `ids` with a known layout.
    pub fn from_layout(ids: &[u32], b: usize, t: usize, layout: &AttentionLayout, device: &Device) -> Result<Batch> {
        let mut mask = vec![MASKED; b * t * t];
        for (i, (&lo, &hi)) in layout.lo.iter().zip(&layout.hi).enumerate() {
            for k in lo.max(0)..=hi {
                mask[i * t + k as usize] = 0.0;
            }
        }
        Ok(Batch {
            ids: Tensor::from_slice(ids, (b, t), device)?,
            positions: Tensor::from_slice(&layout.positions, (b, t), device)?,
            mask: Tensor::from_vec(mask, (b, 1, t, t), device)?,
        })
    }
}

/// Positions and attention structure of a `[b, t]` batch, per flattened token `i`: its rotary
/// position, and the inclusive range `lo[i] ..= hi[i]` of keys in its row that it attends to
/// (none when `lo > hi`). A packed document is a run of equal segment indices; a real token
/// (`j < len`) attends causally within its document and its positions restart there. A padding
/// token attends to the real tokens of the row's first document, as transformers' padding mask
/// has it; nothing reads its output. Every engine takes attention from here: candle's as a mask,
/// the GPU engine's kernels as the ranges.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionLayout {
    pub positions: Vec<u32>,
    pub lo: Vec<i32>,
    pub hi: Vec<i32>,
}

/// The [`AttentionLayout`] of rows padded to `t`, with `lens[r]` real tokens each.
pub fn attention_layout(t: usize, lens: &[usize], segments: Option<&[Vec<u16>]>) -> AttentionLayout {
    let b = lens.len();
    let (mut positions, mut lo, mut hi) = (vec![0u32; b * t], vec![0i32; b * t], vec![0i32; b * t]);
    for (r, &len) in lens.iter().enumerate() {
        let len = len.min(t);
        let seg = |j: usize| segments.map(|s| s[r].get(j).copied().unwrap_or(0)).unwrap_or(0);
        let mut start = 0;
        for j in 0..t {
            if j > 0 && seg(j) != seg(j - 1) {
                start = j;
            }
            positions[r * t + j] = (j - start) as u32;
            if j < len {
                lo[r * t + j] = start as i32;
                hi[r * t + j] = j as i32;
            }
        }
        // Padding rows see the first document: from 0 up to where it ends (or the row does).
        let first_end = (1..len).find(|&j| seg(j) != seg(j - 1)).unwrap_or(len);
        for j in len..t {
            lo[r * t + j] = 0;
            hi[r * t + j] = first_end as i32 - 1;
        }
    }
    AttentionLayout { positions, lo, hi }
}

pub struct Transformer {
    pub cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    cos: Tensor,
    sin: Tensor,
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
    ) -> std::result::Result<Transformer, super::ModelError> {
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
    ) -> std::result::Result<Transformer, super::ModelError> {
        let mut b = Builder { weights, trainable, rng, params: Vec::new(), dtype, next_id: 0 };
        let h = cfg.hidden_size;
        let (qd, kvd) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
        let embed = b.weight("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let attn = Attention {
                q: b.linear(&format!("{p}.self_attn.q_proj"), h, qd, cfg.qkv_bias)?,
                k: b.linear(&format!("{p}.self_attn.k_proj"), h, kvd, cfg.qkv_bias)?,
                v: b.linear(&format!("{p}.self_attn.v_proj"), h, kvd, cfg.qkv_bias)?,
                o: b.linear(&format!("{p}.self_attn.o_proj"), qd, h, cfg.o_bias)?,
                heads: cfg.num_heads,
                kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
            };
            let mlp = Mlp {
                gate: b.linear(&format!("{p}.mlp.gate_proj"), h, cfg.intermediate_size, cfg.mlp_bias)?,
                up: b.linear(&format!("{p}.mlp.up_proj"), h, cfg.intermediate_size, cfg.mlp_bias)?,
                down: b.linear(&format!("{p}.mlp.down_proj"), cfg.intermediate_size, h, cfg.mlp_bias)?,
            };
            layers.push(Layer {
                input_norm: b.weight(&format!("{p}.input_layernorm.weight"), &[h])?,
                attn,
                post_norm: b.weight(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                mlp,
            });
        }
        let norm = b.weight("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings || !weights.contains_key("lm_head.weight") {
            if !cfg.tie_word_embeddings {
                return Err(super::ModelError::MissingTensor { name: "lm_head.weight".into() });
            }
            b.linear_with("lm_head", embed.clone(), None, h, cfg.vocab_size)?
        } else {
            b.linear("lm_head", h, cfg.vocab_size, false)?
        };
        let params = std::mem::take(&mut b.params);
        let (cos, sin) = rope_tables(cfg, embed.device(), dtype).map_err(super::ModelError::candle("rotary tables"))?;
        Ok(Transformer { cfg: cfg.clone(), embed, layers, norm, lm_head, cos, sin, params, dtype })
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

    /// The rotary cos/sin tables, `[max_positions, head_dim]` each.
    pub fn rope_tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// Hidden states after the final norm: `[b, t, hidden]`.
    pub fn hidden(&self, batch: &Batch, dropout: Option<u64>, mut cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (b, t) = batch.ids.dims2()?;
        let embed = self.embed.to_dtype(self.dtype)?;
        let mut x = embed.index_select(&batch.ids.flatten_all()?, 0)?.reshape((b, t, self.cfg.hidden_size))?;
        let pos = batch.positions.flatten_all()?;
        let cos = self.cos.index_select(&pos, 0)?.reshape((b, 1, t, self.cfg.head_dim))?;
        let sin = self.sin.index_select(&pos, 0)?.reshape((b, 1, t, self.cfg.head_dim))?;
        let mask = batch.mask.to_dtype(self.dtype)?;
        if let Some(c) = cache.as_deref_mut()
            && c.layers.len() != self.layers.len()
        {
            c.layers = vec![None; self.layers.len()];
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let residual = &x;
            let h = rms_norm(&x, &layer.input_norm, self.cfg.rms_norm_eps)?;
            let slot = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            let h = layer.attn.forward(&h, &cos, &sin, &mask, dropout, slot)?;
            x = (residual + h)?;
            let residual = &x;
            let h = rms_norm(&x, &layer.post_norm, self.cfg.rms_norm_eps)?;
            let gate = layer.mlp.gate.forward_t(&h, dropout)?.silu()?;
            let up = layer.mlp.up.forward_t(&h, dropout)?;
            let h = layer.mlp.down.forward_t(&(gate * up)?, dropout)?;
            x = (residual + h)?;
        }
        rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)
    }

    /// Logits for every position: `[b, t, vocab]` (f32).
    pub fn logits(&self, batch: &Batch) -> Result<Tensor> {
        let h = self.hidden(batch, None, None)?;
        self.lm_head.forward_t(&h, None)?.to_dtype(DType::F32)
    }

    /// Mean cross-entropy of `targets` at the flattened positions `select` (indices into
    /// `b * t`): the LM head runs only where the loss counts. Equals transformers' loss with
    /// `labels` (shifted, -100 ignored) when `select`/`targets` come from those labels.
    pub fn loss(&self, batch: &Batch, select: &Tensor, targets: &Tensor, dropout: Option<u64>) -> Result<Tensor> {
        let h = self.hidden(batch, dropout, None)?;
        let h = h.flatten_to(1)?.index_select(select, 0)?;
        let logits = self.lm_head.forward_t(&h, dropout)?.to_dtype(DType::F32)?;
        cross_entropy(&logits, targets)
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
        self.lm_head.forward_t(&last, None)?.to_dtype(DType::F32)?.squeeze(0)
    }

    /// Every named linear layer (HF prefix without `.weight`), for merging and export.
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            for (n, lin) in [
                ("self_attn.q_proj", &l.attn.q),
                ("self_attn.k_proj", &l.attn.k),
                ("self_attn.v_proj", &l.attn.v),
                ("self_attn.o_proj", &l.attn.o),
                ("mlp.gate_proj", &l.mlp.gate),
                ("mlp.up_proj", &l.mlp.up),
                ("mlp.down_proj", &l.mlp.down),
            ] {
                out.push((format!("{p}.{n}"), lin));
            }
        }
        out.push(("lm_head".into(), &self.lm_head));
        out
    }
}

impl Attention {
    fn forward(
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
        let q = self.q.forward_t(x, dropout)?.reshape((b, t, self.heads, d))?.transpose(1, 2)?;
        let k = self.k.forward_t(x, dropout)?.reshape((b, t, self.kv_heads, d))?.transpose(1, 2)?;
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
        let scores = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
        let scores = scores.broadcast_add(mask)?;
        let probs = softmax_last(&scores)?;
        // [b, heads, t, d] → [b, t, heads*d]
        let out = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, self.heads * d))?;
        self.o.forward_t(&out, dropout)
    }
}

/// Keys/values for grouped-query attention: each kv head serves `n` query heads.
fn repeat_kv(x: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let (b, kvh, t, d) = x.dims4()?;
    x.unsqueeze(2)?.broadcast_as((b, kvh, n, t, d))?.reshape((b, kvh * n, t, d))
}

/// RMSNorm as transformers computes it: in f32, then cast back, then scaled.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps)?.sqrt()?.recip()?;
    xf.broadcast_mul(&inv)?.to_dtype(dtype)?.broadcast_mul(&weight.to_dtype(dtype)?)
}

/// Softmax over the last dimension from differentiable ops (in f32 as transformers does).
fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(dtype)
}

/// `x * cos + rotate_half(x) * sin`, where rotate_half(x) = cat(-x2, x1).
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// Mean cross-entropy of `[n, vocab]` logits against `[n]` targets.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if FUSED_CROSS_ENTROPY.load(std::sync::atomic::Ordering::Relaxed)
        && logits.device().is_cpu()
        && logits.dtype() == DType::F32
        && logits.is_contiguous()
        && logits.rank() == 2
    {
        let targets = targets.to_dtype(DType::U32)?.contiguous()?;
        return logits.apply_op2(&targets, FusedCrossEntropy { grad_scale: None });
    }
    composed_cross_entropy(logits, targets)
}

/// Use [`FusedCrossEntropy`] on the CPU (on by default; the train-step benchmark can turn it off
/// to measure what it saves).
pub static FUSED_CROSS_ENTROPY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Mean cross-entropy from composed ops (any device); [`FusedCrossEntropy`] computes the same
/// on the CPU.
pub fn composed_cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.gather(&targets.unsqueeze(1)?, 1)?;
    (lse - picked)?.mean_all()
}

/// Rows of the rotary tables: positions past this are never trained or evaluated (sequences
/// are bounded by `dataset.max_seq_len`), and a config claiming millions of positions must not
/// size a multi-gigabyte table.
pub const ROPE_TABLE_MAX: usize = 1 << 17;

/// cos/sin tables `[positions, head_dim]` (`max_position_embeddings`, at most
/// [`ROPE_TABLE_MAX`]), with llama3 frequency scaling when configured.
fn rope_tables(cfg: &ModelConfig, device: &Device, dtype: DType) -> Result<(Tensor, Tensor)> {
    let (n, d) = (cfg.max_position_embeddings.min(ROPE_TABLE_MAX), cfg.head_dim);
    let (cos, sin) = rope_values(cfg, n);
    let cos = Tensor::from_vec(cos, (n, d), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (n, d), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// The rotary tables' values for positions `0 .. n`, row-major `[n, head_dim]` each, in f32:
/// transformers' `rope_init_fn` (default or llama3 scaling) with `emb = cat(freqs, freqs)`.
pub fn rope_values(cfg: &ModelConfig, n: usize) -> (Vec<f32>, Vec<f32>) {
    let d = cfg.head_dim;
    let mut inv: Vec<f32> = (0..d / 2).map(|i| 1.0 / (cfg.rope_theta as f32).powf((2 * i) as f32 / d as f32)).collect();
    if let Some(rs) = &cfg.rope_scaling {
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
    fn weight(&mut self, name: &str, shape: &[usize]) -> std::result::Result<Tensor, super::ModelError> {
        let t = self.weights.get(name).ok_or_else(|| super::ModelError::MissingTensor { name: name.into() })?;
        if t.dims() != shape {
            return Err(super::ModelError::ShapeMismatch {
                name: name.into(),
                expected: shape.to_vec(),
                found: t.dims().to_vec(),
            });
        }
        if let Trainable::Weights(patterns) = self.trainable
            && patterns.iter().any(|p| crate::glob::fnmatch(p, name))
        {
            let master = t.to_dtype(DType::F32).map_err(super::ModelError::candle(format!("convert `{name}`")))?;
            let var =
                Var::from_tensor(&master).map_err(super::ModelError::candle(format!("make `{name}` trainable")))?;
            let out = var.as_tensor().clone();
            self.params.push(Param { name: name.to_string(), var });
            return Ok(out);
        }
        t.to_dtype(self.dtype).map_err(super::ModelError::candle(format!("convert `{name}`")))
    }

    fn linear(
        &mut self,
        prefix: &str,
        inp: usize,
        out: usize,
        bias: bool,
    ) -> std::result::Result<Linear, super::ModelError> {
        let w = self.weight(&format!("{prefix}.weight"), &[out, inp])?;
        let b = if bias { Some(self.weight(&format!("{prefix}.bias"), &[out])?) } else { None };
        self.linear_with(prefix, w, b, inp, out)
    }

    fn linear_with(
        &mut self,
        prefix: &str,
        w: Tensor,
        b: Option<Tensor>,
        inp: usize,
        out: usize,
    ) -> std::result::Result<Linear, super::ModelError> {
        let mut lin = Linear::new(w, b, self.next_id);
        self.next_id += 1;
        if let Trainable::Lora(spec) = self.trainable {
            let module = prefix.rsplit('.').next().unwrap_or(prefix);
            if spec.targets.iter().any(|t| t == module) {
                let (lora, params) = spec
                    .create(prefix, inp, out, DType::F32, lin.weight().device(), self.rng)
                    .map_err(super::ModelError::candle(format!("create LoRA adapter for `{prefix}`")))?;
                lin.lora = Some(lora);
                self.params.extend(params);
            }
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
    pub fn load_params(&self, tensors: &BTreeMap<String, Tensor>) -> std::result::Result<(), super::ModelError> {
        for p in &self.params {
            let t = tensors.get(&p.name).ok_or_else(|| super::ModelError::MissingTensor { name: p.name.clone() })?;
            if t.dims() != p.var.dims() {
                return Err(super::ModelError::ShapeMismatch {
                    name: p.name.clone(),
                    expected: p.var.dims().to_vec(),
                    found: t.dims().to_vec(),
                });
            }
            let t = t
                .to_dtype(p.var.dtype())
                .and_then(|t| t.to_device(p.var.device()))
                .map_err(super::ModelError::candle(format!("load `{}`", p.name)))?;
            p.var.set(&t).map_err(super::ModelError::candle(format!("load `{}`", p.name)))?;
        }
        Ok(())
    }

    /// Current values of the trained parameters, by name.
    pub fn param_values(&self) -> BTreeMap<String, Tensor> {
        self.params.iter().map(|p| (p.name.clone(), p.var.as_tensor().detach())).collect()
    }
}

impl Transformer {
    /// Every weight under its HF name with LoRA adapters merged in (`W + scale·B·A`), ready to
    /// save as a plain model folder. Tied embeddings stay tied (an adapter on a tied `lm_head`
    /// would untie them and is written as its own `lm_head.weight`).
    pub fn merged_weights(&self) -> Result<BTreeMap<String, Tensor>> {
        self.merged_tensors().into_iter().map(|m| Ok((m.name.clone(), m.tensor()?))).collect()
    }

    /// The tensors of the merged model, computed one at a time on demand (an export can write
    /// each and drop it, so a merge never holds a second copy of the model).
    pub fn merged_tensors(&self) -> Vec<MergedTensor<'_>> {
        let mut out = vec![MergedTensor::plain("model.embed_tokens.weight".into(), &self.embed)];
        for (i, l) in self.layers.iter().enumerate() {
            out.push(MergedTensor::plain(format!("model.layers.{i}.input_layernorm.weight"), &l.input_norm));
            out.push(MergedTensor::plain(format!("model.layers.{i}.post_attention_layernorm.weight"), &l.post_norm));
        }
        out.push(MergedTensor::plain("model.norm.weight".into(), &self.norm));
        for (name, lin) in self.linears() {
            if name == "lm_head" && self.cfg.tie_word_embeddings && lin.lora.is_none() {
                continue;
            }
            out.push(MergedTensor { name: format!("{name}.weight"), source: MergedSource::Linear(lin) });
            if let Some(b) = lin.bias() {
                out.push(MergedTensor::plain(format!("{name}.bias"), b));
            }
        }
        out
    }
}

/// One tensor of the merged model.
pub struct MergedTensor<'a> {
    pub name: String,
    source: MergedSource<'a>,
}

enum MergedSource<'a> {
    Plain(&'a Tensor),
    /// `W + scale · B · A`, computed when asked for.
    Linear(&'a Linear),
}

impl<'a> MergedTensor<'a> {
    fn plain(name: String, t: &'a Tensor) -> MergedTensor<'a> {
        MergedTensor { name, source: MergedSource::Plain(t) }
    }

    pub fn shape(&self) -> Vec<usize> {
        match &self.source {
            MergedSource::Plain(t) => t.dims().to_vec(),
            MergedSource::Linear(l) => l.weight().dims().to_vec(),
        }
    }

    pub fn dtype(&self) -> DType {
        match &self.source {
            MergedSource::Plain(t) => t.dtype(),
            MergedSource::Linear(l) => l.weight().dtype(),
        }
    }

    pub fn tensor(&self) -> Result<Tensor> {
        match &self.source {
            MergedSource::Plain(t) => Ok(t.detach()),
            MergedSource::Linear(l) => Ok(l.merged_weight()?.detach()),
        }
    }
}

/// Mean cross-entropy of `[N, V]` f32 logits against `[N]` u32 targets in one pass per row, and
/// its gradient `(softmax − onehot) / N` in one more (CPU). The composed version writes and keeps
/// several `[N, V]` temporaries (shifted, exp, their gradients): for a 49k vocabulary that is
/// ~100 MB each per 512 positions.
struct FusedCrossEntropy {
    /// Set for the backward op: the upstream gradient of the mean, divided by N.
    grad_scale: Option<f32>,
}

impl FusedCrossEntropy {
    fn rows<'a>(
        s1: &'a candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &'a candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(&'a [f32], &'a [u32], usize, usize)> {
        let (n, v) = l1.shape().dims2()?;
        let (candle_core::CpuStorage::F32(x), candle_core::CpuStorage::U32(t)) = (s1, s2) else {
            candle_core::bail!("cross-entropy: expected f32 logits and u32 targets")
        };
        let (Some((a, b)), Some((c, d))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("cross-entropy: inputs must be contiguous")
        };
        if d - c != n {
            candle_core::bail!("cross-entropy: {n} rows but {} targets", d - c)
        }
        Ok((&x[a..b], &t[c..d], n, v))
    }
}

impl candle_core::CustomOp2 for FusedCrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use rayon::prelude::*;
        let (x, t, n, v) = Self::rows(s1, l1, s2, l2)?;
        if let Some(t) = t.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("cross-entropy: target {t} outside the vocabulary of {v}")
        }
        let lse = |row: &[f32]| {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (m, row.iter().map(|&z| (z - m).exp()).sum::<f32>().ln())
        };
        match self.grad_scale {
            None => {
                let total: f64 = x
                    .par_chunks(v)
                    .zip(t.par_iter())
                    .map(|(row, &t)| {
                        let (m, l) = lse(row);
                        (l - (row[t as usize] - m)) as f64
                    })
                    .sum();
                let mean = if n == 0 { f32::NAN } else { (total / n as f64) as f32 };
                Ok((candle_core::CpuStorage::F32(vec![mean]), candle_core::Shape::from(())))
            }
            Some(scale) => {
                let mut g = vec![0f32; n * v];
                g.par_chunks_mut(v).zip(x.par_chunks(v)).zip(t.par_iter()).for_each(|((g, row), &t)| {
                    let (m, l) = lse(row);
                    for (g, &z) in g.iter_mut().zip(row) {
                        *g = (z - m - l).exp() * scale;
                    }
                    g[t as usize] -= scale;
                });
                Ok((candle_core::CpuStorage::F32(g), candle_core::Shape::from((n, v))))
            }
        }
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = logits.dim(0)?.max(1);
        let scale = grad.to_dtype(DType::F32)?.to_scalar::<f32>()? / n as f32;
        let g = logits.apply_op2_no_bwd(targets, &FusedCrossEntropy { grad_scale: Some(scale) })?;
        Ok((Some(g), None))
    }
}
