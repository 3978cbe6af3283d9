//! The fused CPU engine: training (LoRA adapters, base weights, or both) and evaluation over
//! plain f32 buffers, with a hand-written backward pass. [`FusedEngine`] is the engine, built from
//! the model folder and the architecture spec; the passes read any model through a `View` of
//! named tensors, so [`loss`] and [`loss_and_grads`] also run them over candle's [`Transformer`],
//! which is how the tests and benchmarks compare the two on the same weights.
//!
//! candle's autograd runs a LoRA step as a few thousand small ops, each allocating its output
//! and dispatching to the thread pool, and keeps every intermediate alive until the backward
//! pass. This engine computes the same function in a few dozen GEMM calls (the `gemm` crate
//! candle itself uses) and fused row loops:
//! - RMSNorm (Qwen3's per-head query and key norms too), rotary embeddings, softmax, SiLU-gating
//!   and cross-entropy are single passes, each with its derivative written out;
//! - attention runs per (sequence, head) on contiguous head-major blocks, one task per block;
//! - no gradient is computed for a frozen weight, nor for the input of the first layer unless
//!   the embedding trains;
//! - it keeps only what the backward pass cannot cheaply recompute (normalised activations and
//!   the gated MLP product are recomputed), and computes the LM head and loss in chunks of
//!   selected positions, so a 49k-vocabulary logits matrix never exists whole.
//!
//! It is used when the model computes in f32 on the CPU ([`crate::engine::choose`]); anything
//! else runs through candle or the GPU engine. Base weights that train get `dW = dyᵀ·x` from the products (a tied LM
//! head's adds to the embedding's), RMSNorm weights and biases column sums, and the embedding
//! each token's row of the first layer's input gradient, in a fixed order. Both give the same
//! loss and gradients to float rounding (`cargo test --test model fused_`), and draw the same
//! LoRA dropout masks (keyed per element, [`crate::model::lora::dropout_keep`]).

use std::collections::{BTreeMap, BTreeSet};

use candle_core::{CpuStorage, Device, Layout, Result, Storage, Tensor, bail};
use gemm::Parallelism;
use rayon::prelude::*;

use super::{DOWN, GATE, K, O, Q, UP, V};

mod attention;
mod engine;
mod linear;
mod matmul;
mod rows;

use crate::engine::candle::Transformer;
use crate::model::Batch;
use crate::model::arch::{Feature, LayerSpec, Spec};
use crate::model::config::Activation;
use crate::model::lora::param_name;
use attention::*;
pub use engine::FusedEngine;
use linear::*;
use matmul::*;
use rows::*;

/// The parts of the architecture spec the fused engine's row loops compute: all of them.
pub const FEATURES: &[Feature] = &Feature::ALL;

/// Why `model` cannot run on the fused engine, or `None` when it can.
pub fn unsupported(model: &Transformer) -> Option<String> {
    if !matches!(model.device(), Device::Cpu) {
        return Some("the model is not on the CPU".into());
    }
    if model.compute_dtype() != candle_core::DType::F32 {
        return Some(format!("the model computes in {:?}, not f32", model.compute_dtype()));
    }
    None
}

/// Mean cross-entropy at the selected positions (as [`Transformer::loss`]), without gradients,
/// of candle's model `model` computed by the fused passes (to compare them with autograd).
pub fn loss(model: &Transformer, batch: &Batch, select: &[u32], targets: &[u32]) -> Result<f64> {
    if let Some(why) = unsupported(model) {
        bail!("fused engine: {why}")
    }
    Ok(run(&View::of_transformer(model), batch, select, targets, None)?.0)
}

/// Mean cross-entropy at the selected positions and the gradient of `weight × loss` for every
/// trained parameter, by name. `dropout` is the micro-batch's dropout key.
pub fn loss_and_grads(
    model: &Transformer,
    batch: &Batch,
    select: &[u32],
    targets: &[u32],
    weight: f32,
    dropout: Option<u64>,
) -> Result<(f64, BTreeMap<String, Tensor>)> {
    if let Some(why) = unsupported(model) {
        bail!("fused engine: {why}")
    }
    loss_and_grads_of(&View::of_transformer(model), batch, select, targets, weight, dropout)
}

/// [`loss_and_grads`] of the model `view` shows: a gradient for every trained tensor.
fn loss_and_grads_of(
    view: &View<'_>,
    batch: &Batch,
    select: &[u32],
    targets: &[u32],
    weight: f32,
    dropout: Option<u64>,
) -> Result<(f64, BTreeMap<String, Tensor>)> {
    let (loss, mut grads) = run(view, batch, select, targets, Some((weight, dropout)))?;
    let mut out = BTreeMap::new();
    for name in &view.trained {
        let shape = view.tensors[name.as_str()].shape();
        let g = match grads.remove(name) {
            Some(g) => Tensor::from_vec(g, shape, &Device::Cpu)?,
            // No selected position reached it (an empty batch).
            None => Tensor::zeros(shape, candle_core::DType::F32, &Device::Cpu)?,
        };
        out.insert(name.clone(), g);
    }
    Ok((loss, out))
}

/// A weight matrix `[out, in]` or vector, borrowed from its tensor.
type W<'a> = &'a [f32];

struct LoraW<'a> {
    /// `[r, in]`
    a: W<'a>,
    /// `[out, r]`
    b: W<'a>,
    rank: usize,
    scale: f32,
    dropout: f64,
}

struct LinW<'a> {
    /// The HF prefix (`model.layers.3.self_attn.q_proj`); adapter gradients are named after it.
    name: String,
    /// The weight's name where it trains in full (a tied LM head's is the embedding's).
    train_w: Option<String>,
    /// The bias's name where it trains.
    train_b: Option<String>,
    /// The layer's index in [`Transformer::linears`] (it keys its dropout mask).
    id: usize,
    w: W<'a>,
    bias: Option<W<'a>>,
    lora: Option<LoraW<'a>>,
    inp: usize,
    out: usize,
}

struct LayerW<'a> {
    input_norm: W<'a>,
    /// Llama's norm before the MLP; with Gemma's `sandwich_norms`, the attention output's.
    post_norm: W<'a>,
    /// The norm weights' names where they train.
    train_input_norm: Option<String>,
    train_post_norm: Option<String>,
    /// Qwen3's and Gemma 3's per-head query and key norms.
    qk_norm: Option<[NormW<'a>; 2]>,
    /// Gemma's norms before the MLP and on its output.
    feedforward_norms: Option<[NormW<'a>; 2]>,
    /// What the layer computes: its attention's scale, cap, window and rotary table, its gate.
    spec: &'a LayerSpec,
    /// q, k, v, o, gate, up, down.
    lin: [LinW<'a>; 7],
}

/// An RMSNorm's weights (over each head, or a layer's rows), and its name where it trains.
struct NormW<'a> {
    w: W<'a>,
    train: Option<String>,
}

struct Weights<'a> {
    embed: W<'a>,
    layers: Vec<LayerW<'a>>,
    norm: W<'a>,
    /// Whether the embedding and the final norm train.
    train_embed: bool,
    train_norm: bool,
    lm_head: LinW<'a>,
    /// cos/sin of each of the spec's rotary tables.
    ropes: Vec<(W<'a>, W<'a>)>,
    /// Gemma: embeddings times √hidden.
    embed_scale: Option<f32>,
    /// Gemma 2's cap on the logits.
    final_softcap: Option<f32>,
}

/// A linear layer as the passes find it: its tensors' names (adapter matrices under
/// [`param_name`]`(name, "lora_A" | "lora_B")`), its shape and its index.
#[derive(Debug, Clone)]
pub(crate) struct LinearInfo {
    /// The Hugging Face prefix (`model.layers.3.self_attn.q_proj`, `lm_head`).
    pub name: String,
    /// Its weight's name (a tied LM head's is the embedding's).
    pub weight: String,
    pub bias: Option<String>,
    /// Its index among the model's linears, layer by layer then the LM head (keys its dropout).
    pub id: usize,
    pub inp: usize,
    pub out: usize,
    /// An adapter: its rank, scale and dropout.
    pub lora: Option<(usize, f64, f64)>,
}

/// What the fused passes read, borrowed from whoever owns it: the spec, every tensor by name
/// (weights by their Hugging Face names, adapter matrices by PEFT's), the linears in order, the
/// rotary tables, and the names that train.
pub(crate) struct View<'m> {
    pub spec: &'m Spec,
    pub tensors: BTreeMap<String, &'m Tensor>,
    pub linears: std::borrow::Cow<'m, [LinearInfo]>,
    pub ropes: &'m [(Tensor, Tensor)],
    pub trained: BTreeSet<String>,
}

/// The RMSNorm weights of a model with `spec`, by name: the final norm and each layer's.
fn norm_names(spec: &Spec) -> Vec<String> {
    let mut out = vec!["model.norm.weight".to_string()];
    for (i, l) in spec.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        out.extend(["input_layernorm", "post_attention_layernorm"].map(|n| format!("{p}.{n}.weight")));
        if l.attention.qk_norm {
            out.extend(crate::model::QK_NORMS.map(|n| format!("{p}.{n}.weight")));
        }
        if l.sandwich_norms {
            out.extend(crate::model::FEEDFORWARD_NORMS.map(|n| format!("{p}.{n}.weight")));
        }
    }
    out
}

impl<'m> View<'m> {
    /// candle's model as the fused passes read it (the same tensors, not copies).
    fn of_transformer(model: &'m Transformer) -> View<'m> {
        let embed = "model.embed_tokens.weight";
        let mut tensors = BTreeMap::from([
            (embed.to_string(), model.embed_weight()),
            ("model.norm.weight".to_string(), model.norm_weight()),
        ]);
        for i in 0..model.cfg.num_layers {
            let p = format!("model.layers.{i}");
            let (input, post) = model.layer_norms(i);
            tensors.insert(format!("{p}.input_layernorm.weight"), input);
            tensors.insert(format!("{p}.post_attention_layernorm.weight"), post);
            for (names, pair) in [
                (crate::model::QK_NORMS, model.qk_norms(i)),
                (crate::model::FEEDFORWARD_NORMS, model.feedforward_norms(i)),
            ] {
                if let Some((a, b)) = pair {
                    tensors.insert(format!("{p}.{}.weight", names[0]), a);
                    tensors.insert(format!("{p}.{}.weight", names[1]), b);
                }
            }
        }
        let mut linears = Vec::new();
        for (name, l) in model.linears() {
            let (out, inp) = l.weight().dims2().expect("a linear's weight is a matrix");
            let weight = match l.weight().id() == model.embed_weight().id() {
                true => embed.to_string(),
                false => format!("{name}.weight"),
            };
            tensors.insert(weight.clone(), l.weight());
            let bias = l.bias().map(|b| {
                tensors.insert(format!("{name}.bias"), b);
                format!("{name}.bias")
            });
            let lora = l.lora.as_ref().map(|lo| {
                tensors.insert(param_name(&name, "lora_A"), &lo.a);
                tensors.insert(param_name(&name, "lora_B"), &lo.b);
                (lo.a.dims()[0], lo.scale, lo.dropout)
            });
            linears.push(LinearInfo { name, weight, bias, id: l.id, inp, out, lora });
        }
        View {
            spec: &model.spec,
            tensors,
            linears: std::borrow::Cow::Owned(linears),
            ropes: model.rope_tables(),
            trained: model.params.iter().map(|p| p.name.clone()).collect(),
        }
    }
}

fn f32_data<'g>(s: &'g Storage, l: &Layout) -> Result<&'g [f32]> {
    match (s, l.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(&v[a..b]),
        (Storage::Cpu(CpuStorage::F32(_)), None) => bail!("fused engine: a weight is not contiguous"),
        _ => bail!("fused engine: a weight is not f32 on the CPU"),
    }
}

impl<'a> Weights<'a> {
    /// The weights of `view`, their data in `data` by name (Gemma's norms already `1 + w`) and the
    /// rotary tables' in `ropes`.
    fn new(view: &View<'a>, data: &BTreeMap<&str, &'a [f32]>, ropes: Vec<(W<'a>, W<'a>)>) -> Result<Weights<'a>> {
        let get = |name: &str| -> Result<W<'a>> {
            match data.get(name) {
                Some(d) => Ok(*d),
                None => bail!("fused engine: the model has no `{name}`"),
            }
        };
        let trains = |name: String| view.trained.contains(&name).then_some(name);
        let mut lins = Vec::new();
        for l in view.linears.iter() {
            let lora = match l.lora {
                Some((rank, scale, dropout)) => Some(LoraW {
                    a: get(&param_name(&l.name, "lora_A"))?,
                    b: get(&param_name(&l.name, "lora_B"))?,
                    rank,
                    scale: scale as f32,
                    dropout,
                }),
                None => None,
            };
            lins.push(LinW {
                name: l.name.clone(),
                train_w: trains(l.weight.clone()),
                train_b: l.bias.clone().and_then(trains),
                w: get(&l.weight)?,
                bias: l.bias.as_deref().map(get).transpose()?,
                lora,
                inp: l.inp,
                out: l.out,
                id: l.id,
            });
        }
        let lm_head = lins.pop().expect("lm_head is the last linear");
        let mut lins = lins.into_iter();
        let mut layers = Vec::with_capacity(view.spec.layers.len());
        for (i, spec) in view.spec.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let norm = |name: &str| -> Result<NormW<'a>> {
                let full = format!("{p}.{name}.weight");
                Ok(NormW { w: get(&full)?, train: trains(full) })
            };
            let pair = |names: [&str; 2]| -> Result<[NormW<'a>; 2]> { Ok([norm(names[0])?, norm(names[1])?]) };
            let (input, post) = (norm("input_layernorm")?, norm("post_attention_layernorm")?);
            layers.push(LayerW {
                input_norm: input.w,
                post_norm: post.w,
                train_input_norm: input.train,
                train_post_norm: post.train,
                qk_norm: spec.attention.qk_norm.then(|| pair(crate::model::QK_NORMS)).transpose()?,
                feedforward_norms: spec.sandwich_norms.then(|| pair(crate::model::FEEDFORWARD_NORMS)).transpose()?,
                spec,
                lin: std::array::from_fn(|_| lins.next().expect("seven linears per layer")),
            });
        }
        Ok(Weights {
            embed: get("model.embed_tokens.weight")?,
            layers,
            norm: get("model.norm.weight")?,
            train_embed: view.trained.contains("model.embed_tokens.weight"),
            train_norm: view.trained.contains("model.norm.weight"),
            lm_head,
            ropes,
            embed_scale: view.spec.embed_scale.map(|s| s as f32),
            final_softcap: view.spec.final_softcap.map(|c| c as f32),
        })
    }
}

impl<'a> Weights<'a> {
    /// A layer's rotary tables.
    fn rope(&self, lw: &LayerW<'_>) -> (W<'a>, W<'a>) {
        self.ropes[lw.spec.attention.rope]
    }
}

impl<'a> LayerW<'a> {
    /// `dims` with this layer's attention scale and cap.
    fn dims(&self, dims: &Dims) -> Dims {
        let a = &self.spec.attention;
        Dims { scale: a.scale as f32, softcap: a.softcap.map(|c| c as f32), ..*dims }
    }

    /// Whether the MLP's gate is GELU (Gemma) rather than SiLU.
    fn gelu(&self) -> bool {
        self.spec.activation == Activation::GeluTanh
    }

    /// The norm the MLP reads (Llama's `post_attention_layernorm`, Gemma's
    /// `pre_feedforward_layernorm`) and its name where it trains.
    fn mlp_norm(&self) -> (W<'a>, &Option<String>) {
        match &self.feedforward_norms {
            Some([pre, _]) => (pre.w, &pre.train),
            None => (self.post_norm, &self.train_post_norm),
        }
    }
}

/// Shapes of one batch.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    /// b × t rows.
    n: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    inter: usize,
    vocab: usize,
    eps: f32,
    /// The layer's attention scores' scale (1/√d; Gemma's `query_pre_attn_scalar^-½`) and Gemma
    /// 2's cap ([`LayerW::dims`]).
    scale: f32,
    softcap: Option<f32>,
    /// The first token of this shard in the whole batch, and the index of its first selected
    /// position among the batch's (dropout masks are indexed by them).
    row0: usize,
    sel0: usize,
}

/// What the backward pass of one linear layer needs from its forward pass.
#[derive(Default)]
struct LinSave {
    /// `x Aᵀ` (`[n, r]`), LoRA only.
    u: Vec<f32>,
    /// The dropout mask applied to the LoRA input (`[n, in]`), when dropout is on.
    mask: Option<Vec<f32>>,
}

/// What one layer's backward pass needs.
struct LayerSave {
    x: Vec<f32>,
    inv1: Vec<f32>,
    /// Head-major `[b, heads, t, d]` queries and `[b, kv_heads, t, d]` keys after rotary
    /// embedding (and the head norms), and values.
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Log-sum-exp of each attention row, `[b, heads, t]`.
    lse: Vec<f32>,
    /// Attention output `[n, heads·d]` (o_proj's input).
    attn: Vec<f32>,
    h: Vec<f32>,
    inv2: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    lin: [LinSave; 7],
    /// With head norms: the query and key projections `[n, heads·d]`, `[n, kv_heads·d]`
    /// before them, and the inverse RMS of each head's row.
    qk: Option<[(Vec<f32>, Vec<f32>); 2]>,
    /// With Gemma's norms on the attention's and the MLP's outputs: o_proj's and down_proj's
    /// outputs before them, and each row's inverse RMS.
    post: Option<[(Vec<f32>, Vec<f32>); 2]>,
}

/// Gradient accumulators by parameter name.
type Grads = BTreeMap<String, Vec<f32>>;

fn run(
    view: &View<'_>,
    batch: &Batch,
    select: &[u32],
    targets: &[u32],
    train: Option<(f32, Option<u64>)>,
) -> Result<(f64, Grads)> {
    run_with(view, batch, select, targets, train, None)
}

/// [`run`], and with `logits` the (capped) logits of the selected positions, `[select, vocab]`
/// (the batch is then one pass, not row shards).
fn run_with(
    view: &View<'_>,
    batch: &Batch,
    select: &[u32],
    targets: &[u32],
    train: Option<(f32, Option<u64>)>,
    logits: Option<&mut Vec<f32>>,
) -> Result<(f64, Grads)> {
    // Read-lock each storage once: a tied LM head shares the embedding's.
    let all: Vec<&Tensor> = view.tensors.values().copied().chain(view.ropes.iter().flat_map(|(c, s)| [c, s])).collect();
    let mut unique: Vec<&Tensor> = Vec::new();
    let slot: Vec<usize> = all
        .iter()
        .map(|t| match unique.iter().position(|u| u.id() == t.id()) {
            Some(i) => i,
            None => {
                unique.push(t);
                unique.len() - 1
            }
        })
        .collect();
    let held: Vec<_> = unique.iter().map(|t| t.storage_and_layout()).collect();
    let views: Vec<&[f32]> = held.iter().map(|(s, l)| f32_data(s, l)).collect::<Result<_>>()?;
    // Gemma's RMSNorms multiply by `1 + w`: in f32 throughout, so the sum is taken once here and
    // every norm (and its input gradient) uses it; the weight's own gradient is the same.
    let norms: BTreeSet<String> =
        if view.spec.norm.offset { norm_names(view.spec).into_iter().collect() } else { BTreeSet::new() };
    let shifted: BTreeMap<&str, Vec<f32>> = view
        .tensors
        .keys()
        .zip(&slot)
        .filter(|(name, _)| norms.contains(name.as_str()))
        .map(|(name, &i)| (name.as_str(), views[i].iter().map(|w| 1.0 + w).collect()))
        .collect();
    let data: BTreeMap<&str, &[f32]> = view
        .tensors
        .keys()
        .zip(&slot)
        .map(|(name, &i)| (name.as_str(), shifted.get(name.as_str()).map_or(views[i], Vec::as_slice)))
        .collect();
    let tables = &slot[view.tensors.len()..];
    let ropes: Vec<(W<'_>, W<'_>)> = tables.chunks(2).map(|c| (views[c[0]], views[c[1]])).collect();
    let w = Weights::new(view, &data, ropes)?;
    let (b, t) = batch.ids.dims2()?;
    let spec = view.spec;
    let dims = Dims {
        b,
        t,
        n: b * t,
        hidden: spec.hidden,
        heads: spec.heads,
        kv_heads: spec.kv_heads,
        d: spec.head_dim,
        inter: spec.intermediate,
        vocab: spec.vocab,
        eps: spec.norm.eps as f32,
        scale: 1.0,
        softcap: None,
        row0: 0,
        sel0: 0,
    };
    let ids: Vec<u32> = batch.ids.flatten_all()?.to_vec1()?;
    let positions: Vec<u32> = batch.positions.flatten_all()?.to_vec1()?;
    let mask: Vec<f32> = batch.mask.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?;
    if select.len() != targets.len() {
        bail!("fused engine: {} positions but {} targets", select.len(), targets.len())
    }
    if let Some(&s) = select.iter().find(|&&s| s as usize >= dims.n) {
        bail!("fused engine: position {s} outside the batch of {} tokens", dims.n)
    }
    if let Some(&id) = ids.iter().chain(targets).find(|&&i| i as usize >= dims.vocab) {
        bail!("fused engine: token {id} outside the vocabulary of {}", dims.vocab)
    }
    // Attention skips keys after each query block, which is exact only for causal masks.
    let causal = mask
        .chunks(t * t)
        .all(|m| (0..t).all(|q| m[q * t + q + 1..(q + 1) * t].iter().all(|&v| v <= crate::model::batch::MASKED)));
    if mask.len() != b * t * t || !causal {
        bail!("fused engine: the attention mask is not a causal [b, 1, t, t] mask")
    }
    let max_pos = w.ropes[0].0.len() / dims.d;
    if let Some(&p) = positions.iter().find(|&&p| p as usize >= max_pos) {
        bail!("fused engine: position {p} beyond the rotary table of {max_pos}")
    }
    let total = select.len();
    let (grad_scale, dropout) = match train {
        // Every shard scales by the whole batch's count of positions.
        Some((weight, dropout)) => (Some(weight / total.max(1) as f32), dropout),
        None => (None, None),
    };
    // Shards index LM-head dropout by their selected positions' place in `select`, which is
    // contiguous per shard when `select` ascends (as batches build it).
    let shards = if select.is_sorted() && logits.is_none() { shard_count(&dims) } else { 1 };
    let (loss_sum, grads) = if shards > 1 {
        let rows = b.div_ceil(shards);
        let ranges: Vec<(usize, usize)> = (0..b).step_by(rows).map(|r0| (r0, (r0 + rows).min(b))).collect();
        // Each shard's selected positions, relative to its first row, and their targets.
        let picks: Vec<(Vec<u32>, Vec<u32>)> = ranges
            .iter()
            .map(|&(r0, r1)| {
                let (lo, hi) = ((r0 * t) as u32, (r1 * t) as u32);
                select.iter().zip(targets).filter(|(s, _)| (lo..hi).contains(s)).map(|(s, t)| (s - lo, *t)).unzip()
            })
            .collect();
        let firsts: Vec<usize> =
            picks.iter().scan(0, |n, (sel, _)| Some(std::mem::replace(n, *n + sel.len()))).collect();
        let parts: Vec<(Dims, Shard<'_>)> = ranges
            .iter()
            .zip(&picks)
            .zip(&firsts)
            .map(|((&(r0, r1), (sel, tgt)), &sel0)| {
                let part = Shard {
                    ids: &ids[r0 * t..r1 * t],
                    positions: &positions[r0 * t..r1 * t],
                    mask: &mask[r0 * t * t..r1 * t * t],
                    select: sel,
                    targets: tgt,
                };
                (Dims { b: r1 - r0, n: (r1 - r0) * t, row0: r0 * t, sel0, ..dims }, part)
            })
            .collect();
        let results: Vec<(f64, Grads)> = std::thread::scope(|scope| {
            let handles: Vec<_> = parts
                .iter()
                .enumerate()
                .map(|(i, (d, part))| {
                    let w = &w;
                    scope.spawn(move || single_thread_pool(i).install(|| pass(w, d, part, grad_scale, dropout, None)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a shard of the fused engine panicked")).collect()
        });
        let mut total_loss = 0f64;
        let mut grads = Grads::new();
        for (l, g) in results {
            total_loss += l;
            for (name, g) in g {
                match grads.get_mut(&name) {
                    Some(acc) => add(acc, &g),
                    None => {
                        grads.insert(name, g);
                    }
                }
            }
        }
        (total_loss, grads)
    } else {
        let whole = Shard { ids: &ids, positions: &positions, mask: &mask, select, targets };
        pass(&w, &dims, &whole, grad_scale, dropout, logits)
    };
    let loss = if total == 0 { f64::NAN } else { loss_sum / total as f64 };
    Ok((loss, grads))
}

/// The token-level inputs of a batch, or of a shard of its rows.
#[derive(Clone, Copy)]
struct Shard<'a> {
    ids: &'a [u32],
    positions: &'a [u32],
    mask: &'a [f32],
    select: &'a [u32],
    targets: &'a [u32],
}

/// How many row shards to run side by side, one per thread, each running its kernels on that
/// thread alone. Whole sequences per thread beat splitting every product and row loop across
/// threads — the hand-offs between threads cost more than they save (measured on 2 cores, 4 ×
/// 128 tokens: −17% step time on the tiny shape, −10% at hidden 256, −3.5% on the 135M shape).
/// With fewer rows than threads, operations are threaded instead. Dropout masks are keyed by
/// element, so shards draw what one pass would.
fn shard_count(dims: &Dims) -> usize {
    let threads = rayon::current_num_threads();
    if threads < 2 || dims.b < threads { 1 } else { threads }
}

/// A one-thread rayon pool per shard, so that the kernels inside run sequentially.
fn single_thread_pool(i: usize) -> &'static rayon::ThreadPool {
    static POOLS: std::sync::OnceLock<Vec<rayon::ThreadPool>> = std::sync::OnceLock::new();
    let pools = POOLS.get_or_init(|| {
        (0..rayon::current_num_threads().max(1))
            .map(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a one-thread pool"))
            .collect()
    });
    &pools[i % pools.len()]
}

/// Forward (and with `grad_scale`, backward) over one batch or shard: the sum of the selected
/// positions' losses, and gradients of `grad_scale ×` that sum.
/// With `logits_out`, the selected positions' (capped) logits are appended to it.
fn pass(
    w: &Weights<'_>,
    dims: &Dims,
    inp: &Shard<'_>,
    grad_scale: Option<f32>,
    dropout: Option<u64>,
    mut logits_out: Option<&mut Vec<f32>>,
) -> (f64, Grads) {
    let dims = *dims;
    let Shard { ids, positions, mask, select, targets } = *inp;
    let training = grad_scale.is_some();
    let mut grads = Grads::new();

    // Forward.
    let mut x = vec![0f32; dims.n * dims.hidden];
    x.par_chunks_mut(dims.hidden).zip(ids.par_iter()).for_each(|(row, &id)| {
        row.copy_from_slice(&w.embed[id as usize * dims.hidden..][..dims.hidden]);
        if let Some(s) = w.embed_scale {
            scale(row, s);
        }
    });
    // The local layers' masks: the batch's with keys outside each window hidden too.
    let windows: Vec<(usize, Vec<f32>)> = w
        .layers
        .iter()
        .filter_map(|l| l.spec.attention.window)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|window| {
            let t = dims.t;
            let mut m = mask.to_vec();
            for (i, v) in m.iter_mut().enumerate() {
                if crate::model::batch::outside_window((i / t) % t, i % t, window) {
                    *v = crate::model::batch::MASKED;
                }
            }
            (window, m)
        })
        .collect();
    let layer_mask = |lw: &LayerW<'_>| match lw.spec.attention.window {
        Some(w) => windows.iter().find(|(x, _)| *x == w).map_or(mask, |(_, m)| m.as_slice()),
        None => mask,
    };
    let mut saves = Vec::with_capacity(w.layers.len());
    for lw in &w.layers {
        let (next, save) = layer_forward(lw, w, &dims, x, positions, layer_mask(lw), dropout, training);
        x = next;
        saves.extend(save);
    }
    let (hn, inv_f) = rms_norm(&x, w.norm, dims.hidden, dims.eps);

    // LM head and loss in chunks of selected positions; the gradient of each chunk's logits
    // goes straight back through the head, so no full logits matrix is ever kept.
    let mut dhn = if training { vec![0f32; dims.n * dims.hidden] } else { Vec::new() };
    // Up to 128 MiB of logits per chunk: large enough for the GEMMs to run at full rate (170
    // rows of a 49k vocabulary ran 15% slower than 508), small enough to bound memory.
    let chunk = ((32 << 20) / dims.vocab.max(1)).clamp(16, 4096);
    let mut loss_sum = 0f64;
    for (ci, (sel, tgt)) in select.chunks(chunk).zip(targets.chunks(chunk)).enumerate() {
        let c = sel.len();
        let mut hs = vec![0f32; c * dims.hidden];
        for (row, &s) in hs.chunks_mut(dims.hidden).zip(sel) {
            row.copy_from_slice(&hn[s as usize * dims.hidden..][..dims.hidden]);
        }
        let mut logits = vec![0f32; c * dims.vocab];
        let lsave = linear_forward(&w.lm_head, &hs, c, dropout, dims.sel0 + ci * chunk, &mut logits);
        // Gemma 2 caps the logits; the cap's derivative, 1 − tanh², needs tanh kept.
        let capped = w.final_softcap.map(|cap| {
            softcap(&mut logits, cap);
            logits.iter().map(|z| z / cap).collect::<Vec<f32>>()
        });
        if let Some(out) = logits_out.as_deref_mut() {
            out.extend_from_slice(&logits);
        }
        loss_sum += cross_entropy(&mut logits, tgt, dims.vocab, grad_scale);
        if let (Some(th), true) = (&capped, grad_scale.is_some()) {
            for (g, t) in logits.iter_mut().zip(th) {
                *g *= 1.0 - t * t;
            }
        }
        if grad_scale.is_some() {
            let mut dhs = vec![0f32; c * dims.hidden];
            linear_backward(&w.lm_head, &lsave, &hs, c, &logits, Some(&mut dhs), &mut grads);
            for (row, &s) in dhs.chunks(dims.hidden).zip(sel) {
                add_here(&mut dhn[s as usize * dims.hidden..][..dims.hidden], row);
            }
        }
    }
    if !training {
        return (loss_sum, grads);
    }

    // Backward.
    let mut dx = vec![0f32; dims.n * dims.hidden];
    rms_norm_backward(&x, &inv_f, w.norm, &dhn, &mut dx, false, dims.hidden);
    if w.train_norm {
        rms_norm_weight_grad(&x, &inv_f, &dhn, dims.hidden, grad_of(&mut grads, "model.norm.weight", dims.hidden));
    }
    drop((hn, dhn));
    for (i, (lw, save)) in w.layers.iter().zip(saves).enumerate().rev() {
        let need_input_grad = i > 0 || w.train_embed;
        layer_backward(lw, w, &dims, save, &mut dx, positions, layer_mask(lw), need_input_grad, &mut grads);
    }
    if w.train_embed {
        // Each token's row of the first layer's input gradient, in token order (times Gemma's
        // embedding scale).
        if let Some(s) = w.embed_scale {
            scale(&mut dx, s);
        }
        let g = grad_of(&mut grads, "model.embed_tokens.weight", dims.vocab * dims.hidden);
        for (row, &id) in dx.chunks(dims.hidden).zip(ids) {
            add_here(&mut g[id as usize * dims.hidden..][..dims.hidden], row);
        }
    }
    (loss_sum, grads)
}

#[allow(clippy::too_many_arguments)]
fn layer_forward(
    lw: &LayerW<'_>,
    w: &Weights<'_>,
    dims: &Dims,
    x: Vec<f32>,
    positions: &[u32],
    mask: &[f32],
    dropout: Option<u64>,
    training: bool,
) -> (Vec<f32>, Option<LayerSave>) {
    let dims = &lw.dims(dims);
    let Dims { b, t, n, hidden, heads, kv_heads, d, inter, .. } = *dims;
    let (qd, kvd) = (heads * d, kv_heads * d);
    let (xn, inv1) = rms_norm(&x, lw.input_norm, hidden, dims.eps);
    let mut lin: [LinSave; 7] = Default::default();
    let mut proj = |i: usize, input: &[f32], width: usize| {
        let mut y = vec![0f32; n * width];
        lin[i] = linear_forward(&lw.lin[i], input, n, dropout, dims.row0, &mut y);
        y
    };
    let mut q = proj(Q, &xn, qd);
    let mut k = proj(K, &xn, kvd);
    let v = proj(V, &xn, kvd);
    drop(xn);
    // Qwen3: each head's query and key RMS-normalised before the rotary embedding.
    let qk = lw.qk_norm.as_ref().map(|[qn, kn]| {
        let (normed, q_inv) = rms_norm(&q, qn.w, d, dims.eps);
        let q_raw = std::mem::replace(&mut q, normed);
        let (normed, k_inv) = rms_norm(&k, kn.w, d, dims.eps);
        let k_raw = std::mem::replace(&mut k, normed);
        [(q_raw, q_inv), (k_raw, k_inv)]
    });
    let (cos, sin) = w.rope(lw);
    let q = to_heads(&q, b, t, heads, d, Some((positions, cos, sin)));
    let k = to_heads(&k, b, t, kv_heads, d, Some((positions, cos, sin)));
    let v = to_heads(&v, b, t, kv_heads, d, None);
    let mut lse = if training { vec![0f32; b * heads * t] } else { Vec::new() };
    let mut out = vec![0f32; b * heads * t * d];
    attention_forward(&q, &k, &v, mask, dims, training.then_some(&mut lse[..]), &mut out);
    let attn = from_heads(&out, b, t, heads, d, None);
    drop(out);
    let o = proj(O, &attn, hidden);
    // The residual; with Gemma's norms after attention and the MLP, their normed outputs join it.
    let residual = |acc: &mut Vec<f32>, y: Vec<f32>, norm: Option<W<'_>>| match norm {
        None => {
            add(acc, &y);
            None
        }
        Some(w) => {
            let (normed, inv) = rms_norm(&y, w, hidden, dims.eps);
            add(acc, &normed);
            Some((y, inv))
        }
    };
    let mut h = x.clone();
    let post_attn = residual(&mut h, o, lw.feedforward_norms.as_ref().map(|_| lw.post_norm));
    let (hn, inv2) = rms_norm(&h, lw.mlp_norm().0, hidden, dims.eps);
    let gate = proj(GATE, &hn, inter);
    let up = proj(UP, &hn, inter);
    drop(hn);
    let act = swiglu(&gate, &up, lw.gelu());
    let down = proj(DOWN, &act, hidden);
    drop(act);
    let mut next = h.clone();
    let post_mlp = residual(&mut next, down, lw.feedforward_norms.as_ref().map(|[_, post]| post.w));
    let qk = qk.filter(|_| training);
    let post = post_attn.zip(post_mlp).map(|(a, m)| [a, m]).filter(|_| training);
    let save = training.then_some(LayerSave { x, inv1, q, k, v, lse, attn, h, inv2, gate, up, lin, qk, post });
    (next, save)
}

/// Backward of an RMSNorm by `w` over rows of `width` (`x` and its rows' inverse RMS as saved)
/// from its output's gradient `dy`: the weight's gradient where it trains (`train`), and the
/// input's gradient, returned.
fn norm_backward_new(
    w: W<'_>,
    train: &Option<String>,
    (x, inv): &(Vec<f32>, Vec<f32>),
    dy: &[f32],
    width: usize,
    grads: &mut Grads,
) -> Vec<f32> {
    if let Some(name) = train {
        rms_norm_weight_grad(x, inv, dy, width, grad_of(grads, name, width));
    }
    let mut dx = vec![0f32; dy.len()];
    rms_norm_backward(x, inv, w, dy, &mut dx, false, width);
    dx
}

#[allow(clippy::too_many_arguments)]
fn layer_backward(
    lw: &LayerW<'_>,
    w: &Weights<'_>,
    dims: &Dims,
    s: LayerSave,
    dx: &mut [f32],
    positions: &[u32],
    mask: &[f32],
    need_input_grad: bool,
    grads: &mut Grads,
) {
    let dims = &lw.dims(dims);
    let Dims { b, t, n, heads, kv_heads, d, inter, .. } = *dims;
    let qd = heads * d;
    let hidden = dims.hidden;
    // dx holds d(loss)/d(layer output); the residual makes it d/dh too, and we add into it.
    // A linear layer's input is only needed for its weight's or adapter's gradients. With Gemma's
    // norm on the MLP's output, the down projection's output gradient comes through it.
    let d_down = match (&lw.feedforward_norms, &s.post) {
        (Some([_, post]), Some([_, m])) => Some(norm_backward_new(post.w, &post.train, m, dx, hidden, grads)),
        _ => None,
    };
    let act = if lw.lin[DOWN].needs_input() { swiglu(&s.gate, &s.up, lw.gelu()) } else { Vec::new() };
    let mut dact = vec![0f32; n * inter];
    linear_backward(&lw.lin[DOWN], &s.lin[DOWN], &act, n, d_down.as_deref().unwrap_or(dx), Some(&mut dact), grads);
    drop((act, d_down));
    let (dgate, dup) = swiglu_backward(&s.gate, &s.up, &dact, lw.gelu());
    drop(dact);
    let (mlp_norm, mlp_norm_train) = lw.mlp_norm();
    let hn = if lw.lin[GATE].needs_input() || lw.lin[UP].needs_input() {
        rms_norm_with(&s.h, &s.inv2, mlp_norm, hidden)
    } else {
        Vec::new()
    };
    let mut dhn = vec![0f32; n * hidden];
    linear_backward(&lw.lin[GATE], &s.lin[GATE], &hn, n, &dgate, Some(&mut dhn), grads);
    linear_backward_acc(&lw.lin[UP], &s.lin[UP], &hn, n, &dup, &mut dhn, grads);
    drop((hn, dgate, dup));
    if let Some(name) = mlp_norm_train {
        rms_norm_weight_grad(&s.h, &s.inv2, &dhn, hidden, grad_of(grads, name, hidden));
    }
    rms_norm_backward(&s.h, &s.inv2, mlp_norm, &dhn, dx, true, hidden);
    // dx is now d/dh = d/d(layer input) through the residual, plus the attention branch below
    // (through the attention output's norm with Gemma's).
    let d_o = s.post.as_ref().map(|[a, _]| norm_backward_new(lw.post_norm, &lw.train_post_norm, a, dx, hidden, grads));
    let mut dattn = vec![0f32; n * qd];
    linear_backward(&lw.lin[O], &s.lin[O], &s.attn, n, d_o.as_deref().unwrap_or(dx), Some(&mut dattn), grads);
    drop(d_o);
    let dout = to_heads(&dattn, b, t, heads, d, None);
    drop(dattn);
    let mut dq = vec![0f32; b * heads * t * d];
    let mut dk = vec![0f32; b * kv_heads * t * d];
    let mut dv = vec![0f32; b * kv_heads * t * d];
    attention_backward(&s.q, &s.k, &s.v, mask, &s.lse, &dout, dims, &mut dq, &mut dk, &mut dv);
    drop(dout);
    let (cos, sin) = w.rope(lw);
    let mut dq = from_heads(&dq, b, t, heads, d, Some((positions, cos, sin)));
    let mut dk = from_heads(&dk, b, t, kv_heads, d, Some((positions, cos, sin)));
    if let (Some(norms), Some(raw)) = (&lw.qk_norm, &s.qk) {
        // Through the head norms to the projections' outputs.
        for ((norm, saved), dy) in norms.iter().zip(raw).zip([&mut dq, &mut dk]) {
            *dy = norm_backward_new(norm.w, &norm.train, saved, dy, d, grads);
        }
    }
    let dv = from_heads(&dv, b, t, kv_heads, d, None);
    let xn = if [Q, K, V].iter().any(|&i| lw.lin[i].needs_input()) {
        rms_norm_with(&s.x, &s.inv1, lw.input_norm, dims.hidden)
    } else {
        Vec::new()
    };
    if need_input_grad || lw.train_input_norm.is_some() {
        let mut dxn = vec![0f32; n * dims.hidden];
        linear_backward(&lw.lin[Q], &s.lin[Q], &xn, n, &dq, Some(&mut dxn), grads);
        linear_backward_acc(&lw.lin[K], &s.lin[K], &xn, n, &dk, &mut dxn, grads);
        linear_backward_acc(&lw.lin[V], &s.lin[V], &xn, n, &dv, &mut dxn, grads);
        if let Some(name) = &lw.train_input_norm {
            rms_norm_weight_grad(&s.x, &s.inv1, &dxn, dims.hidden, grad_of(grads, name, dims.hidden));
        }
        if need_input_grad {
            rms_norm_backward(&s.x, &s.inv1, lw.input_norm, &dxn, dx, true, dims.hidden);
        }
    } else {
        // The first layer's input is the (frozen) embedding: only the projections' own
        // parameters need gradients.
        for (i, dy) in [(Q, &dq), (K, &dk), (V, &dv)] {
            linear_backward(&lw.lin[i], &s.lin[i], &xn, n, dy, None, grads);
        }
    }
}
