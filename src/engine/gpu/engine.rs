//! The GPU engine's forward and backward pass (see the module docs of [`super`]). The layer
//! structure mirrors the fused CPU engine's: what each layer keeps for its backward pass, what
//! is recomputed there, and the order of every gradient.
// The layer and linear passes take the batch, the buffers and the pass's options explicitly.
#![allow(clippy::too_many_arguments)]

use std::collections::BTreeMap;
use std::rc::Rc;

use candle_core::Tensor;

use super::device::{Buf, Dt, Gpu, GpuError};
use super::ops::{AdamWCoefficients, AttnShape, Ops};
use crate::engine::params::AdamWConfig;
use crate::engine::{Checkpointing, Engine, EngineError, EngineState, HostBatch, Origin, Setup};
use crate::engine::{DOWN, GATE, K, O, Q, UP, V};
use crate::model::arch::{LayerSpec, Spec};
use crate::model::config::Activation;
use crate::model::lora::{dropout_key, param_name};
use crate::model::{FEEDFORWARD_NORMS, LAYER_LINEARS, ModelConfig, ModelError, QK_NORMS, nf4};
use crate::recipe::{BaseQuant, Dtype};
use crate::rng::Rng;

/// Logits per LM-head chunk: 64 Mi elements (128 MiB in bf16) bounds memory and keeps the
/// products large (151k-vocabulary models get 441 rows a chunk).
const LOGITS_PER_CHUNK: usize = 64 << 20;

/// An adapter's place in the flat parameter buffer.
#[derive(Debug, Clone, Copy)]
struct Adapter {
    /// Offsets of A `[rank, inp]` and B `[out, rank]`.
    a: usize,
    b: usize,
    rank: usize,
    scale: f32,
    dropout: f64,
}

/// A weight the passes read: frozen at its compute-dtype address, frozen in 4 bits (a decoder
/// linear's under `adapter.quantize_base`: packed NF4 indices and f32 block scales, dequantized
/// before each product that reads it), or trained (in full, alone or beside an adapter) at its
/// offset in the flat parameters, whose compute-dtype copy the passes read and whose gradient is
/// at the same offset of the flat gradients.
#[derive(Debug, Clone, Copy)]
enum W {
    Frozen(u64),
    Nf4 { packed: u64, scales: Scales },
    Trained(usize),
}

/// A 4-bit weight's block scales: f32 values, or under double quantization their 8-bit indices
/// into the dynamic code, an f32 scale per 256 of them and their offset.
#[derive(Debug, Clone, Copy)]
enum Scales {
    Plain(u64),
    Nested { codes: u64, scales: u64, offset: f32 },
}

struct Lin {
    /// Index in [`crate::engine::candle::Transformer::linears`] (keys the dropout mask).
    id: usize,
    /// `[out, inp]`.
    w: W,
    bias: Option<W>,
    inp: usize,
    out: usize,
    lora: Option<Adapter>,
}

struct Layer {
    input_norm: W,
    /// Llama's norm before the MLP; with Gemma's `sandwich_norms`, the attention output's.
    post_norm: W,
    /// Qwen3's and Gemma 3's RMSNorms of each query and key head (`[head_dim]` weights).
    qk_norm: Option<[W; 2]>,
    /// Gemma's norms before the MLP and on its output.
    feedforward_norms: Option<[W; 2]>,
    /// What the layer computes: its attention's scale, cap, window and rotary table, its gate.
    spec: LayerSpec,
    lin: [Lin; 7],
}

/// A trained tensor in the flat buffers.
#[derive(Debug, Clone)]
struct Slot {
    name: String,
    shape: Vec<usize>,
    off: usize,
    len: usize,
}

/// Named CPU tensors into `values` at their slots; every slot must be there (`missing` makes the
/// error for one that is not) with its shape.
fn fill_slots(
    slots: &[Slot],
    tensors: &BTreeMap<String, Tensor>,
    values: &mut [f32],
    missing: impl Fn(String) -> EngineError,
) -> Result<(), EngineError> {
    for s in slots {
        let t = tensors.get(&s.name).ok_or_else(|| missing(s.name.clone()))?;
        if t.dims() != s.shape.as_slice() {
            return Err(ModelError::ShapeMismatch {
                name: s.name.clone(),
                expected: s.shape.clone(),
                found: t.dims().to_vec(),
            }
            .into());
        }
        let v: Vec<f32> = t
            .to_dtype(candle_core::DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .map_err(EngineError::candle(format!("read `{}`", s.name)))?;
        values[s.off..s.off + s.len].copy_from_slice(&v);
    }
    Ok(())
}

/// Trained parameters with their optimizer state, flat f32.
struct Trained {
    slots: Vec<Slot>,
    params: Flat,
    /// Compute-dtype copy of `params` for the products (none in f32).
    params_c: Option<Flat>,
    grads: Option<Flat>,
    m: Option<Flat>,
    v: Option<Flat>,
    ema: Option<(f64, Flat)>,
    opt: Option<AdamWConfig>,
    opt_step: u64,
}

/// One flat array of trained values over one or more device buffers: where the device caps a
/// single allocation (`Gpu::max_alloc`, 4 GiB on some Vulkan drivers) below what the trained
/// weights take, the array is cut at slot boundaries into parts that each fit, so no weight
/// straddles two. Every flat array of one `Trained` is cut the same way (`bounds`).
struct Flat {
    parts: Vec<Buf>,
    /// Where each part starts, then the total length.
    bounds: Vec<usize>,
}

impl Flat {
    fn new(gpu: &Rc<dyn Gpu>, bounds: &[usize], dt: Dt, init: Option<&[f32]>) -> Result<Flat, GpuError> {
        let parts = bounds
            .windows(2)
            .map(|w| match init {
                Some(v) => Buf::from_f32(gpu, &v[w[0]..w[1]], dt),
                None => Buf::zeros(gpu, w[1] - w[0], dt),
            })
            .collect::<Result<_, _>>()?;
        Ok(Flat { parts, bounds: bounds.to_vec() })
    }

    fn len(&self) -> usize {
        *self.bounds.last().expect("bounds end with the length")
    }

    /// The address of element `off`.
    fn at(&self, off: usize) -> u64 {
        // (The end of the array is the end of its last part.)
        let p = (self.bounds.partition_point(|&b| b <= off) - 1).min(self.parts.len() - 1);
        self.parts[p].at(off - self.bounds[p])
    }

    /// Values `off .. off + len`, which lie in one part (a slot's: slots never straddle two).
    fn read(&self, off: usize, len: usize) -> Result<Vec<f32>, GpuError> {
        let p = self.bounds.partition_point(|&b| b <= off) - 1;
        debug_assert!(off + len <= self.bounds[p + 1], "a read across two parts");
        self.parts[p].read(off - self.bounds[p], len)
    }

    fn write(&self, all: &[f32]) -> Result<(), GpuError> {
        self.parts.iter().zip(self.bounds.windows(2)).try_for_each(|(p, w)| p.write(0, &all[w[0]..w[1]]))
    }

    /// Overwrite values `off .. off + v.len()`, which lie in one part.
    fn write_at(&self, off: usize, v: &[f32]) -> Result<(), GpuError> {
        let p = self.bounds.partition_point(|&b| b <= off) - 1;
        debug_assert!(off + v.len() <= self.bounds[p + 1], "a write across two parts");
        self.parts[p].write(off - self.bounds[p], v)
    }

    fn zero(&self, gpu: &dyn Gpu) -> Result<(), GpuError> {
        self.parts.iter().try_for_each(|p| gpu.zero(p.ptr(), p.len * p.dt.size()))
    }
}

/// Where to cut `slots` (laid out in order, `len` values in all) so that each part's f32 values
/// fit in one allocation of `max_bytes` and number at most 2³¹ − 1 (the kernels that sweep a
/// part — AdamW, EMA, norms, casts — count its elements in 32-bit integers); `Err` names a slot
/// too large for one part.
fn cut(slots: &[Slot], len: usize, max_bytes: u64) -> Result<Vec<usize>, &Slot> {
    let cap = part_values(max_bytes);
    let mut bounds = vec![0];
    for s in slots {
        if s.len > cap {
            return Err(s);
        }
        if s.off + s.len - bounds.last().unwrap() > cap {
            bounds.push(s.off);
        }
    }
    bounds.push(len);
    Ok(bounds)
}

/// The most values one part of a flat array holds, where one allocation may take `max_bytes`.
fn part_values(max_bytes: u64) -> usize {
    (max_bytes / 4).min(i32::MAX as u64) as usize
}

/// A batch on the device.
struct DevBatch {
    b: usize,
    t: usize,
    n: usize,
    ids: Buf,
    pos: Buf,
    lo: Buf,
    hi: Buf,
    /// The first keys of the local layers' queries, each window cut into `lo`.
    lo_windows: Vec<(usize, Buf)>,
    sel: Buf,
    tgt: Buf,
    select: usize,
    /// Each distinct token's rows, when the embedding table trains (see [`token_rows`]).
    token_rows: Option<TokenRows>,
    /// Where these rows start in the micro-batch they were cut from (data parallel), so that
    /// dropout masks are the whole micro-batch's.
    origin: Origin,
}

/// The rows of a batch grouped by token, for a trained embedding table's gradient: `rows`
/// lists the batch's row indices token by token (ascending within a token), `starts[u] ..
/// starts[u + 1]` are token `tokens[u]`'s.
struct TokenRows {
    rows: Buf,
    starts: Buf,
    tokens: Buf,
    uniq: usize,
}

/// `(rows, starts, tokens)` of [`TokenRows`] for `ids`.
fn token_rows(ids: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut rows: Vec<u32> = (0..ids.len() as u32).collect();
    rows.sort_by_key(|&r| (ids[r as usize], r));
    let (mut starts, mut tokens) = (Vec::new(), Vec::new());
    for (k, &r) in rows.iter().enumerate() {
        if tokens.last() != Some(&ids[r as usize]) {
            tokens.push(ids[r as usize]);
            starts.push(k as u32);
        }
    }
    starts.push(rows.len() as u32);
    (rows, starts, tokens)
}

/// How a training pass weighs its batch.
#[derive(Debug, Clone, Copy)]
struct Train {
    weight: f64,
    loss_scale: f64,
    dropout: Option<u64>,
}

/// A norm's input and its rows' inverse RMS, kept for the backward pass.
type Normed = (Buf, Buf);

/// What a layer's backward pass needs from its forward pass (besides its input).
struct Saved {
    inv1: Buf,
    q: Buf,
    k: Buf,
    v: Buf,
    /// Attention output, o_proj's input.
    attn: Buf,
    lse: Buf,
    h: Buf,
    inv2: Buf,
    gate: Buf,
    up: Buf,
    /// `x Aᵀ` of each adapter (LoRA layers only).
    u: [Option<Buf>; 7],
    /// With head norms: the query and key projections before them, and each head's inverse RMS.
    qk: Option<[(Buf, Buf); 2]>,
    /// With Gemma's norms after attention and the MLP: o_proj's and down_proj's outputs before
    /// them, with each row's inverse RMS.
    post: Option<[Normed; 2]>,
}

pub struct GpuEngine {
    gpu: Rc<dyn Gpu>,
    dt: Dt,
    cfg: ModelConfig,
    /// What the model computes.
    spec: Spec,
    /// Owns every frozen weight; the layers below hold their addresses.
    _weights: Vec<Buf>,
    /// With a 4-bit base: the NF4 code's 16 values, then double quantization's 256 (f32, as
    /// [`nf4::codes`] lays them out).
    codes: Option<u64>,
    embed: W,
    norm: W,
    layers: Vec<Layer>,
    lm_head: Lin,
    trained: Option<Trained>,
    /// `[loss, squared gradient norm]` accumulators, f64.
    acc: Buf,
    /// cos/sin `[positions, head_dim]` f32 of each of the spec's rotary tables, grown on demand,
    /// and how many positions they cover.
    rope: Option<(Vec<(Buf, Buf)>, usize)>,
    checkpointing: bool,
    describe: String,
    /// The last attention call's shape (for [`Engine::kernels`]).
    last_attn: std::cell::Cell<Option<AttnShape>>,
}

fn gerr(context: &str) -> impl FnOnce(GpuError) -> EngineError + '_ {
    move |source| EngineError::gpu(context, source)
}

/// The buffer dtype of a recipe's compute dtype.
pub fn compute_dtype(d: Dtype) -> Dt {
    match d {
        Dtype::F32 => Dt::F32,
        Dtype::Bf16 => Dt::Bf16,
        Dtype::F16 => Dt::F16,
    }
}

impl GpuEngine {
    /// Upload `setup.folder`'s weights to `gpu` in the compute dtype and create (or load) the
    /// adapters `setup.trainable` names.
    pub fn new(gpu: Rc<dyn Gpu>, setup: &Setup<'_>) -> Result<GpuEngine, EngineError> {
        let cfg = setup.folder.config.clone();
        if let Some(why) = super::model_unsupported(&cfg) {
            return Err(EngineError::Unsupported(why));
        }
        let spec = Spec::of(&cfg);
        let dt = compute_dtype(setup.device.dtype);
        let trained = match setup.trained {
            Some(dir) => crate::model::read_trained(dir, &candle_core::Device::Cpu)?,
            None => Default::default(),
        };
        let overrides = &trained.base;
        // Base weights that train (fnmatch patterns as in the candle model) stay on the host in
        // f32 until the passes below name them: each becomes a slot of the flat parameters then,
        // so weights the model does not use (as candle's) never train.
        let trainable = &setup.trainable;
        let mut weights: BTreeMap<String, Buf> = BTreeMap::new();
        // 4-bit weights: how the passes read each, and the buffers that hold it.
        let mut quantized: BTreeMap<String, (W, Vec<Buf>)> = BTreeMap::new();
        let mut masters: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        let mut shapes: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        setup.folder.visit_weights(|name, t| -> Result<(), EngineError> {
            let t = overrides.get(name).cloned().unwrap_or(t);
            shapes.insert(name.to_string(), t.dims().to_vec());
            let v: Vec<f32> = t
                .to_dtype(candle_core::DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1())
                .map_err(EngineError::candle(format!("read `{name}`")))?;
            let upload = |e| oom_or(e, &format!("uploading `{name}`"), 0, 0);
            if let Some(quant) = nf4::stored(setup.base_quant, trainable, name)? {
                let q = nf4::quantize(&v, quant == BaseQuant::Nf4Dq);
                let packed = Buf::from_u32(&gpu, &q.words()).map_err(upload)?;
                let (scales, mut bufs) = match &q.nested {
                    None => {
                        let absmax = Buf::from_f32(&gpu, &q.absmax, Dt::F32).map_err(upload)?;
                        (Scales::Plain(absmax.ptr()), vec![absmax])
                    }
                    Some(n) => {
                        let codes = Buf::from_u32(&gpu, &n.words()).map_err(upload)?;
                        let scales = Buf::from_f32(&gpu, &n.scales, Dt::F32).map_err(upload)?;
                        let s = Scales::Nested { codes: codes.ptr(), scales: scales.ptr(), offset: n.offset };
                        (s, vec![codes, scales])
                    }
                };
                let w = W::Nf4 { packed: packed.ptr(), scales };
                bufs.push(packed);
                quantized.insert(name.to_string(), (w, bufs));
            } else if trainable.trains_weight(name) {
                masters.insert(name.to_string(), v);
            } else {
                let buf = Buf::from_f32(&gpu, &v, dt).map_err(upload)?;
                weights.insert(name.to_string(), buf);
            }
            Ok(())
        })?;
        let h = cfg.hidden_size;
        let masters = std::cell::RefCell::new(masters);
        let trained_weights = std::cell::RefCell::new((Vec::<Slot>::new(), Vec::<f32>::new()));
        let weight = |name: &str, shape: &[usize]| -> Result<W, ModelError> {
            let found = shapes.get(name).ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
            if found != shape {
                return Err(ModelError::ShapeMismatch {
                    name: name.into(),
                    expected: shape.to_vec(),
                    found: found.clone(),
                });
            }
            let (slots, values) = &mut *trained_weights.borrow_mut();
            if let Some(s) = slots.iter().find(|s| s.name == name) {
                return Ok(W::Trained(s.off));
            }
            match masters.borrow_mut().remove(name) {
                Some(v) => {
                    let off = values.len();
                    values.extend_from_slice(&v);
                    slots.push(Slot { name: name.to_string(), shape: shape.to_vec(), off, len: v.len() });
                    Ok(W::Trained(off))
                }
                None => Ok(quantized.get(name).map_or_else(|| W::Frozen(weights[name].ptr()), |q| q.0)),
            }
        };
        let next_id = std::cell::Cell::new(0);
        let lin = |prefix: &str, inp: usize, out: usize, bias: bool| -> Result<Lin, ModelError> {
            let id = next_id.replace(next_id.get() + 1);
            Ok(Lin {
                id,
                w: weight(&format!("{prefix}.weight"), &[out, inp])?,
                bias: if bias { Some(weight(&format!("{prefix}.bias"), &[out])?) } else { None },
                inp,
                out,
                lora: None,
            })
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let mut lins = Vec::with_capacity(7);
            for (m, (inp, out, bias)) in LAYER_LINEARS.iter().zip(cfg.layer_linears()) {
                lins.push(lin(&format!("{p}.{m}"), inp, out, bias)?);
            }
            let layer = spec.layers[i].clone();
            let qk_norm = match layer.attention.qk_norm {
                true => Some([
                    weight(&format!("{p}.{}.weight", QK_NORMS[0]), &[cfg.head_dim])?,
                    weight(&format!("{p}.{}.weight", QK_NORMS[1]), &[cfg.head_dim])?,
                ]),
                false => None,
            };
            let input_norm = weight(&format!("{p}.input_layernorm.weight"), &[h])?;
            let post_norm = weight(&format!("{p}.post_attention_layernorm.weight"), &[h])?;
            let feedforward_norms = match layer.sandwich_norms {
                true => Some([
                    weight(&format!("{p}.{}.weight", FEEDFORWARD_NORMS[0]), &[h])?,
                    weight(&format!("{p}.{}.weight", FEEDFORWARD_NORMS[1]), &[h])?,
                ]),
                false => None,
            };
            layers.push(Layer {
                input_norm,
                post_norm,
                qk_norm,
                feedforward_norms,
                spec: layer,
                lin: lins.try_into().map_err(|_| ()).expect("seven linears"),
            });
        }
        let embed = weight("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let norm = weight("model.norm.weight", &[h])?;
        let tied_head = cfg.tie_word_embeddings || !shapes.contains_key("lm_head.weight");
        let mut lm_head = if tied_head {
            if !cfg.tie_word_embeddings {
                return Err(ModelError::MissingTensor { name: "lm_head.weight".into() }.into());
            }
            Lin { id: next_id.get(), w: embed, bias: None, inp: h, out: cfg.vocab_size, lora: None }
        } else {
            lin("lm_head", h, cfg.vocab_size, false)?
        };
        // The trained values: base weights first (as the passes above named them), then the
        // adapters, one flat array cut into parts where one allocation cannot hold it (`Flat`).
        let (mut slots, mut values) = trained_weights.into_inner();
        if !trainable.weights.is_empty() && slots.is_empty() {
            return Err(crate::engine::no_weight_matches(&trainable.weights));
        }
        if trainable.lora.is_some() {
            let mut rng = Rng::derive(setup.seed, "lora-init");
            let first = slots.len();
            let linears = layers.iter_mut().enumerate().flat_map(|(i, l)| {
                l.lin.iter_mut().zip(LAYER_LINEARS).map(move |(lin, m)| (format!("model.layers.{i}.{m}"), lin))
            });
            for (prefix, l) in linears.chain(std::iter::once(("lm_head".to_string(), &mut lm_head))) {
                let weight = match prefix.as_str() {
                    "lm_head" if tied_head => "model.embed_tokens.weight".to_string(),
                    _ => format!("{prefix}.weight"),
                };
                let Some(spec) = trainable.adapter_for(&prefix, &weight, l.bias.is_some())? else { continue };
                let a = values.len();
                values.extend(spec.init_a(l.inp, &mut rng));
                let b = values.len();
                values.extend(std::iter::repeat_n(0.0, l.out * spec.rank));
                slots.push(Slot {
                    name: param_name(&prefix, "lora_A"),
                    shape: vec![spec.rank, l.inp],
                    off: a,
                    len: b - a,
                });
                slots.push(Slot {
                    name: param_name(&prefix, "lora_B"),
                    shape: vec![l.out, spec.rank],
                    off: b,
                    len: l.out * spec.rank,
                });
                l.lora = Some(Adapter { a, b, rank: spec.rank, scale: spec.scale() as f32, dropout: spec.dropout });
            }
            if let Some(saved) = &trained.adapters {
                fill_slots(&slots[first..], saved, &mut values, |name| ModelError::MissingTensor { name }.into())?;
            }
        }
        let trained = match trainable.is_nothing() {
            true => None,
            false => Some(Trained::new(&gpu, dt, slots, &values, setup.optimizer, setup.ema_decay)?),
        };

        let acc = Buf::zeros(&gpu, 4, Dt::U32).map_err(gerr("allocate accumulators"))?;
        let codes = match setup.base_quant {
            Some(_) => Some(Buf::from_f32(&gpu, &nf4::codes(), Dt::F32).map_err(gerr("upload the NF4 codes"))?),
            None => None,
        };
        let codes_ptr = codes.as_ref().map(Buf::ptr);
        let mut engine = GpuEngine {
            describe: format!("GPU engine ({}, {})", gpu.name(), setup.device.dtype.as_str()),
            gpu,
            dt,
            cfg,
            spec,
            _weights: weights.into_values().chain(quantized.into_values().flat_map(|q| q.1)).chain(codes).collect(),
            codes: codes_ptr,
            embed,
            norm,
            layers,
            lm_head,
            trained,
            acc,
            rope: None,
            checkpointing: false,
            last_attn: std::cell::Cell::new(None),
        };
        engine.checkpointing = match setup.checkpointing {
            Checkpointing::On => true,
            Checkpointing::Off => false,
            Checkpointing::Auto => {
                let (b, t) = setup.max_batch;
                let need = engine.activation_bytes(b * t, false);
                let free = engine.gpu.memory().free;
                // Without checkpointing, activations must fit in what is free now with room for
                // the transient buffers of a layer and the LM head.
                need + engine.transient_bytes(b * t) > free.saturating_mul(9) / 10
            }
        };
        if engine.checkpointing {
            engine.describe.push_str(", activation checkpointing");
        }
        Ok(engine)
    }

    fn ops(&self) -> Ops<'_> {
        Ops { gpu: &*self.gpu, dt: self.dt }
    }

    /// Whether layers recompute their activations in the backward pass.
    pub fn checkpointing(&self) -> bool {
        self.checkpointing
    }

    /// Bytes of activations kept between the forward and backward pass for `n` tokens.
    pub fn activation_bytes(&self, n: usize, checkpointing: bool) -> u64 {
        let c = &self.cfg;
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let s = self.dt.size();
        let ranks: usize = self.layers.first().map_or(0, |l| l.lin.iter().filter_map(|l| l.lora.map(|a| a.rank)).sum());
        let mut per_layer =
            s * (2 * c.hidden_size + 2 * qd + 2 * kvd + 2 * c.intermediate_size + ranks) + 4 * (2 + c.num_heads);
        if self.spec.layers.iter().any(|l| l.attention.qk_norm) {
            // The projections before the head norms, and each head's inverse RMS.
            per_layer += s * (qd + kvd) + 4 * (c.num_heads + c.num_kv_heads);
        }
        if self.spec.layers.iter().any(|l| l.sandwich_norms) {
            // o_proj's and down_proj's outputs before their norms, and their inverse RMS.
            per_layer += s * 2 * c.hidden_size + 4 * 2;
        }
        let input = s * c.hidden_size;
        let kept = if checkpointing { input * c.num_layers + per_layer } else { (per_layer + input) * c.num_layers };
        (kept * n) as u64
    }

    /// Bytes of the largest short-lived buffers of a step of `n` tokens (a layer's temporaries,
    /// the LM head's chunk, the hidden-state gradients).
    pub fn transient_bytes(&self, n: usize) -> u64 {
        let c = &self.cfg;
        let s = self.dt.size();
        let layer = s * n * (4 * c.hidden_size + 3 * c.intermediate_size);
        let chunk = s * LOGITS_PER_CHUNK.min(n * c.vocab_size);
        // A 4-bit weight dequantized for its product.
        let dequantized = self.layers.iter().flat_map(|l| &l.lin).filter(|l| matches!(l.w, W::Nf4 { .. }));
        let dequantized = s * dequantized.map(|l| l.out * l.inp).max().unwrap_or(0);
        // Attention's backward scratch: per-query-head dK and dV in f32, and where attention runs
        // through products a chunk's scores and probabilities.
        let qd = c.num_heads * c.head_dim;
        let scores = match self.gpu.product_attention() {
            true => {
                let capped = self.spec.layers.iter().any(|l| l.attention.softcap.is_some());
                AttnShape::most_scores_bytes(n, c.num_heads, self.dt, capped)
            }
            false => 0,
        };
        let attention = 8 * n * qd + scores;
        (layer + chunk + 2 * s * n * c.hidden_size + dequantized + attention) as u64
    }

    /// Bytes held whatever the batch: weights, trained parameters and their optimizer state.
    fn fixed_bytes(&self) -> u64 {
        let weights: usize = self._weights.iter().map(|b| b.len * b.dt.size()).sum();
        let trained = self.trained.as_ref().map_or(0, |t| {
            let n = t.len();
            let copies = 1 + t.grads.is_some() as usize * 3 + t.ema.is_some() as usize;
            n * 4 * copies + t.params_c.as_ref().map_or(0, |c| c.len() * self.dt.size())
        });
        (weights + trained) as u64
    }

    /// The compute-dtype address of trained element `off`.
    fn pc(&self, off: usize) -> u64 {
        let t = self.trained.as_ref().expect("an adapter or trained weight implies trained parameters");
        t.params_c.as_ref().unwrap_or(&t.params).at(off)
    }

    fn grad(&self, off: usize) -> u64 {
        self.trained.as_ref().and_then(|t| t.grads.as_ref()).expect("training").at(off)
    }

    /// The compute-dtype address of a weight.
    fn w(&self, w: W) -> u64 {
        match w {
            W::Frozen(p) => p,
            W::Trained(off) => self.pc(off),
            W::Nf4 { .. } => unreachable!("4-bit weights are read through `lin_weight`"),
        }
    }

    /// A linear's weight in the compute dtype: its address, with the buffer it was dequantized
    /// into for this product when it is kept in 4 bits.
    fn lin_weight(&self, l: &Lin) -> Result<(u64, Option<Buf>), GpuError> {
        match l.w {
            W::Nf4 { packed, scales } => {
                let n = l.out * l.inp;
                let code = self.codes.expect("a 4-bit base uploads its codes");
                // Under double quantization the block scales are dequantized first.
                let (absmax, _scales) = match scales {
                    Scales::Plain(p) => (p, None),
                    Scales::Nested { codes, scales, offset } => {
                        let blocks = n.div_ceil(nf4::BLOCK);
                        let b = self.buf(blocks, Dt::F32)?;
                        let dynamic = code + 4 * nf4::CODE.len() as u64;
                        self.ops().nf4_scales(codes, scales, dynamic, offset, b.ptr(), blocks)?;
                        (b.ptr(), Some(b))
                    }
                };
                let b = self.buf(n, self.dt)?;
                self.ops().nf4_dequant(packed, absmax, code, b.ptr(), n)?;
                Ok((b.ptr(), Some(b)))
            }
            w => Ok((self.w(w), None)),
        }
    }

    /// The f32 gradient of a trained weight, when the engine trains.
    fn wgrad(&self, w: W) -> Option<u64> {
        match w {
            W::Trained(off) => self.trained.as_ref().and_then(|t| t.grads.as_ref()).map(|g| g.at(off)),
            W::Frozen(_) | W::Nf4 { .. } => None,
        }
    }

    /// Whether a linear layer's backward pass reads its input (for its adapter's or its own
    /// weight's gradient).
    fn needs_input(&self, l: &Lin) -> bool {
        l.lora.is_some() || self.wgrad(l.w).is_some()
    }

    /// Backward of an RMSNorm `y = w · T(x · inv)` from `dy` `[n, h]`: the weight's gradient when
    /// it trains, and `dx (+)= ∂y/∂x · dy` when `dx` is given (with whether to accumulate).
    fn norm_bwd(
        &self,
        w: W,
        x: u64,
        inv: u64,
        dy: u64,
        dx: Option<(u64, bool)>,
        n: usize,
        h: usize,
    ) -> Result<(), GpuError> {
        if let Some(g) = self.wgrad(w) {
            self.col_grad(dy, Some((x, inv)), g, n, h)?;
        }
        match dx {
            Some((dx, accumulate)) => {
                self.ops().rmsnorm_bwd(x, inv, self.w(w), dy, dx, n, h, accumulate, self.spec.norm.offset)
            }
            None => Ok(()),
        }
    }

    /// `out += ` the f32 gradient of an RMSNorm weight (`x`, `inv`: the norm's input and
    /// inverse RMS) or, with `x = None`, of a bias, from the output gradient `dy` `[n, w]`.
    fn col_grad(&self, dy: u64, x: Option<(u64, u64)>, out: u64, n: usize, w: usize) -> Result<(), GpuError> {
        let partial = self.buf(Ops::col_partials(n, w), Dt::F32)?;
        self.ops().col_grad(dy, x, partial.ptr(), out, n, w)
    }

    fn buf(&self, len: usize, dt: Dt) -> Result<Buf, GpuError> {
        Buf::new(&self.gpu, len, dt)
    }

    fn copy(&self, src: &Buf) -> Result<Buf, GpuError> {
        let b = self.buf(src.len, src.dt)?;
        self.gpu.copy(b.ptr(), src.ptr(), src.len * src.dt.size())?;
        Ok(b)
    }

    /// Rotary tables covering positions `0 .. need` (rounded to the compute dtype, as
    /// transformers casts them).
    fn ensure_rope(&mut self, need: usize) -> Result<(), GpuError> {
        if self.rope.as_ref().is_some_and(|r| r.1 >= need) {
            return Ok(());
        }
        let n = need.next_power_of_two().min(self.cfg.max_position_embeddings).max(need);
        let tables = |rope: &crate::model::arch::RopeSpec| -> Result<(Buf, Buf), GpuError> {
            let (mut cos, mut sin) = rope.values(self.spec.head_dim, n);
            if self.dt != Dt::F32 {
                for v in cos.iter_mut().chain(sin.iter_mut()) {
                    *v = self.dt.decode(&self.dt.encode(&[*v]))[0];
                }
            }
            Ok((Buf::from_f32(&self.gpu, &cos, Dt::F32)?, Buf::from_f32(&self.gpu, &sin, Dt::F32)?))
        };
        let tables = self.spec.ropes.iter().map(tables).collect::<Result<_, _>>()?;
        self.rope = Some((tables, n));
        Ok(())
    }

    fn upload(&mut self, b: &HostBatch) -> Result<DevBatch, EngineError> {
        let (vocab, max_pos) = (self.cfg.vocab_size, self.cfg.max_position_embeddings);
        let n = b.b * b.t;
        if let Some(id) = b.ids.iter().chain(&b.targets).find(|&&i| i as usize >= vocab) {
            return Err(EngineError::Unsupported(format!("token {id} is outside the vocabulary of {vocab}")));
        }
        let need = b.layout.positions.iter().max().map_or(0, |&p| p as usize + 1);
        if need > max_pos {
            return Err(EngineError::Unsupported(format!(
                "position {} is beyond the model's {max_pos} positions",
                need - 1
            )));
        }
        if let Some(&s) = b.select.iter().find(|&&s| s as usize >= n) {
            return Err(EngineError::Unsupported(format!("position {s} is outside the batch of {n} tokens")));
        }
        if i32::try_from(n * self.cfg.intermediate_size.max(self.cfg.hidden_size)).is_err() {
            return Err(EngineError::Unsupported(format!(
                "a batch of {n} tokens is too large for one step of the GPU engine (its MLP activations \
                 would pass 2³¹ elements): lower `stages.train.batch_size` (and raise `grad_accum`) or \
                 `dataset.max_seq_len`"
            )));
        }
        let ctx = |e| oom_or(e, "uploading a batch", b.b, b.t);
        self.ensure_rope(need).map_err(ctx)?;
        let g = &self.gpu;
        let token_rows = match self.wgrad(self.embed) {
            Some(_) => {
                let (rows, starts, tokens) = token_rows(&b.ids);
                let uniq = tokens.len();
                let (rows, starts, tokens) = (
                    Buf::from_u32(g, &rows).map_err(ctx)?,
                    Buf::from_u32(g, &starts).map_err(ctx)?,
                    Buf::from_u32(g, &tokens).map_err(ctx)?,
                );
                Some(TokenRows { rows, starts, tokens, uniq })
            }
            None => None,
        };
        // A local layer's query sees itself and the `window − 1` keys before it (a padding query,
        // whose range starts no later than its row's first document ends, keeps its range: nothing
        // reads its output, and an empty range would be all it had).
        let lo_windows = self
            .spec
            .windows()
            .into_iter()
            .map(|window| {
                let w = window.min(i32::MAX as usize) as i64;
                let lo: Vec<i32> = (0..n)
                    .map(|i| {
                        let (lo, hi, q) = (b.layout.lo[i], b.layout.hi[i], (i % b.t) as i64);
                        let cut = (q - w + 1).max(lo as i64);
                        if cut <= hi as i64 { cut as i32 } else { lo }
                    })
                    .collect();
                Ok((window, Buf::from_i32(g, &lo).map_err(ctx)?))
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(DevBatch {
            b: b.b,
            t: b.t,
            n,
            ids: Buf::from_u32(g, &b.ids).map_err(ctx)?,
            pos: Buf::from_u32(g, &b.layout.positions).map_err(ctx)?,
            lo: Buf::from_i32(g, &b.layout.lo).map_err(ctx)?,
            hi: Buf::from_i32(g, &b.layout.hi).map_err(ctx)?,
            lo_windows,
            sel: Buf::from_u32(g, &b.select).map_err(ctx)?,
            tgt: Buf::from_u32(g, &b.targets).map_err(ctx)?,
            select: b.select.len(),
            token_rows,
            origin: Origin::default(),
        })
    }

    /// The shape of layer `l`'s attention over `bt`.
    fn attn_shape(&self, bt: &DevBatch, l: &Layer) -> AttnShape {
        let c = &self.spec;
        let s = AttnShape {
            b: bt.b,
            t: bt.t,
            hq: c.heads,
            hk: c.kv_heads,
            d: c.head_dim,
            scale: l.spec.attention.scale as f32,
            softcap: l.spec.attention.softcap.map(|c| c as f32),
            kernels: super::ops::attention_kernels(),
        };
        self.last_attn.set(Some(s));
        s
    }

    /// The adapter's dropout key in this micro-batch, when it drops anything.
    fn mask(l: &Lin, dropout: Option<u64>) -> Option<(u64, f64)> {
        let a = l.lora?;
        (a.dropout > 0.0).then_some(())?;
        dropout.map(|batch| (dropout_key(batch, l.id), a.dropout))
    }

    /// `y [n, out] (+)= x Wᵀ + bias + scale · (x ⊙ mask) Aᵀ Bᵀ`; returns `(x ⊙ mask) Aᵀ` for the
    /// backward pass of an adapter. `first` is `x`'s first row in the layer's whole input.
    fn lin_fwd(
        &self,
        l: &Lin,
        x: u64,
        n: usize,
        y: u64,
        accumulate: bool,
        dropout: Option<u64>,
        first: usize,
    ) -> Result<Option<Buf>, GpuError> {
        let o = self.ops();
        let (w, dequantized) = self.lin_weight(l)?;
        o.gemm(y, self.dt, x, false, w, true, n, l.out, l.inp, 1.0, if accumulate { 1.0 } else { 0.0 })?;
        drop(dequantized);
        if let Some(bias) = l.bias {
            o.add_bias(y, self.w(bias), n, l.out)?;
        }
        let Some(a) = l.lora else { return Ok(None) };
        let masked = match Self::mask(l, dropout) {
            Some((key, p)) => {
                let m = self.buf(n * l.inp, self.dt)?;
                o.dropout(x, m.ptr(), key, first * l.inp, p, n * l.inp)?;
                Some(m)
            }
            None => None,
        };
        let xin = masked.as_ref().map_or(x, Buf::ptr);
        let u = self.buf(n * a.rank, self.dt)?;
        o.gemm(u.ptr(), self.dt, xin, false, self.pc(a.a), true, n, a.rank, l.inp, 1.0, 0.0)?;
        o.gemm(y, self.dt, u.ptr(), false, self.pc(a.b), true, n, l.out, a.rank, a.scale, 1.0)?;
        Ok(Some(u))
    }

    /// Backward of [`Self::lin_fwd`]: adapter (or trained weight and bias) gradients into the
    /// flat gradients, and `dx (+)= dy W (+ the adapter's share)` when `dx` is given. `x` is the
    /// layer's input (read only for an adapter's A gradient or a trained weight's).
    fn lin_bwd(
        &self,
        l: &Lin,
        u: Option<&Buf>,
        x: u64,
        n: usize,
        dy: u64,
        dx: Option<(u64, bool)>,
        dropout: Option<u64>,
        first: usize,
    ) -> Result<(), GpuError> {
        let o = self.ops();
        if let Some(g) = self.wgrad(l.w) {
            // dW += dyᵀ x
            o.gemm(g, Dt::F32, dy, true, x, false, l.out, l.inp, n, 1.0, 1.0)?;
        }
        if let Some(g) = l.bias.and_then(|b| self.wgrad(b)) {
            self.col_grad(dy, None, g, n, l.out)?;
        }
        let mut du = None;
        if let Some(a) = l.lora {
            let u = u.expect("an adapter's forward pass keeps x Aᵀ");
            // dB = s · dyᵀ u; du = s · dy B; dA = duᵀ (x ⊙ mask)
            o.gemm(self.grad(a.b), Dt::F32, dy, true, u.ptr(), false, l.out, a.rank, n, a.scale, 1.0)?;
            let d = self.buf(n * a.rank, self.dt)?;
            o.gemm(d.ptr(), self.dt, dy, false, self.pc(a.b), false, n, a.rank, l.out, a.scale, 0.0)?;
            let masked = match Self::mask(l, dropout) {
                Some((key, p)) => {
                    let m = self.buf(n * l.inp, self.dt)?;
                    o.dropout(x, m.ptr(), key, first * l.inp, p, n * l.inp)?;
                    Some(m)
                }
                None => None,
            };
            let xin = masked.as_ref().map_or(x, Buf::ptr);
            o.gemm(self.grad(a.a), Dt::F32, d.ptr(), true, xin, false, a.rank, l.inp, n, 1.0, 1.0)?;
            du = Some(d);
        }
        let Some((dx, accumulate)) = dx else { return Ok(()) };
        let (w, dequantized) = self.lin_weight(l)?;
        o.gemm(dx, self.dt, dy, false, w, false, n, l.inp, l.out, 1.0, if accumulate { 1.0 } else { 0.0 })?;
        drop(dequantized);
        if let (Some(a), Some(du)) = (l.lora, du) {
            match Self::mask(l, dropout) {
                None => o.gemm(dx, self.dt, du.ptr(), false, self.pc(a.a), false, n, l.inp, a.rank, 1.0, 1.0)?,
                Some((key, p)) => {
                    let tmp = self.buf(n * l.inp, self.dt)?;
                    o.gemm(tmp.ptr(), self.dt, du.ptr(), false, self.pc(a.a), false, n, l.inp, a.rank, 1.0, 0.0)?;
                    o.dropout_acc(tmp.ptr(), dx, key, first * l.inp, p, n * l.inp)?;
                }
            }
        }
        Ok(())
    }

    /// One decoder layer from its input `x`: the output, and with `save` what the backward
    /// pass needs.
    fn layer_fwd(
        &self,
        li: usize,
        x: &Buf,
        bt: &DevBatch,
        dropout: Option<u64>,
        save: bool,
    ) -> Result<(Buf, Option<Saved>), GpuError> {
        let c = &self.cfg;
        let (n, h, inter) = (bt.n, c.hidden_size, c.intermediate_size);
        // The first row of these rows in their micro-batch (dropout masks count from there).
        let row0 = bt.origin.token;
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let (o, dt, l) = (self.ops(), self.dt, &self.layers[li]);
        let (cos, sin, lo) = self.layer_attention(l, bt);
        let (eps, off) = (self.spec.norm.eps as f32, self.spec.norm.offset);
        let xn = self.buf(n * h, dt)?;
        let inv1 = self.buf(n, Dt::F32)?;
        o.rmsnorm_fwd(x.ptr(), self.w(l.input_norm), xn.ptr(), inv1.ptr(), n, h, eps, off)?;
        let mut u: [Option<Buf>; 7] = Default::default();
        let (mut q, mut k, v) = (self.buf(n * qd, dt)?, self.buf(n * kvd, dt)?, self.buf(n * kvd, dt)?);
        u[Q] = self.lin_fwd(&l.lin[Q], xn.ptr(), n, q.ptr(), false, dropout, row0)?;
        u[K] = self.lin_fwd(&l.lin[K], xn.ptr(), n, k.ptr(), false, dropout, row0)?;
        u[V] = self.lin_fwd(&l.lin[V], xn.ptr(), n, v.ptr(), false, dropout, row0)?;
        drop(xn);
        // Qwen3 and Gemma 3: each query and key head RMS-normalised before the rotary embedding.
        let qk = match l.qk_norm {
            Some([qn, kn]) => {
                let norm = |w: W, x: &mut Buf, heads: usize| -> Result<(Buf, Buf), GpuError> {
                    let (normed, inv) = (self.buf(x.len, dt)?, self.buf(n * heads, Dt::F32)?);
                    o.rmsnorm_fwd(x.ptr(), self.w(w), normed.ptr(), inv.ptr(), n * heads, c.head_dim, eps, off)?;
                    Ok((std::mem::replace(x, normed), inv))
                };
                let q_raw = norm(qn, &mut q, c.num_heads)?;
                Some([q_raw, norm(kn, &mut k, c.num_kv_heads)?]).filter(|_| save)
            }
            None => None,
        };
        o.rope(q.ptr(), bt.pos.ptr(), cos, sin, n, c.num_heads, c.head_dim, false)?;
        o.rope(k.ptr(), bt.pos.ptr(), cos, sin, n, c.num_kv_heads, c.head_dim, false)?;
        let attn = self.buf(n * qd, dt)?;
        let lse = self.buf(bt.b * c.num_heads * bt.t, Dt::F32)?;
        let s = self.attn_shape(bt, l);
        let scratch = self.buf(s.scratch_len(dt, &*self.gpu, false), Dt::F32)?;
        o.attn_fwd(&s, q.ptr(), k.ptr(), v.ptr(), attn.ptr(), lse.ptr(), lo, bt.hi.ptr(), scratch.ptr())?;
        drop(scratch);
        // The residual: o_proj accumulates into a copy of the layer's input — or, with Gemma's
        // norms after attention and the MLP, its normed output is added to that copy.
        let hid = self.copy(x)?;
        let post_norm = l.feedforward_norms.map(|_| l.post_norm);
        let post_attn;
        (u[O], post_attn) = self.residual_branch(&l.lin[O], attn.ptr(), n, &hid, post_norm, dropout, row0)?;
        let hn = self.buf(n * h, dt)?;
        let inv2 = self.buf(n, Dt::F32)?;
        o.rmsnorm_fwd(hid.ptr(), self.w(Self::mlp_norm(l)), hn.ptr(), inv2.ptr(), n, h, eps, off)?;
        let (gate, up) = (self.buf(n * inter, dt)?, self.buf(n * inter, dt)?);
        u[GATE] = self.lin_fwd(&l.lin[GATE], hn.ptr(), n, gate.ptr(), false, dropout, row0)?;
        u[UP] = self.lin_fwd(&l.lin[UP], hn.ptr(), n, up.ptr(), false, dropout, row0)?;
        drop(hn);
        let act = self.buf(n * inter, dt)?;
        o.swiglu(gate.ptr(), up.ptr(), act.ptr(), n * inter, Self::gelu(l))?;
        let next = self.copy(&hid)?;
        let post_norm = l.feedforward_norms.map(|[_, post]| post);
        let post_mlp;
        (u[DOWN], post_mlp) = self.residual_branch(&l.lin[DOWN], act.ptr(), n, &next, post_norm, dropout, row0)?;
        let post = post_attn.zip(post_mlp).map(|(a, m)| [a, m]);
        let saved = save.then_some(Saved { inv1, q, k, v, attn, lse, h: hid, inv2, gate, up, u, qk, post });
        Ok((next, saved))
    }

    /// A branch joining the residual `acc`: `acc += l(x)`, or with a norm on the branch's output
    /// (Gemma's after attention and the MLP) `acc += norm(l(x))`, keeping `l(x)` and its rows'
    /// inverse RMS for the backward pass; and the adapter's `x Aᵀ`.
    fn residual_branch(
        &self,
        l: &Lin,
        x: u64,
        n: usize,
        acc: &Buf,
        norm: Option<W>,
        dropout: Option<u64>,
        row0: usize,
    ) -> Result<(Option<Buf>, Option<Normed>), GpuError> {
        let Some(w) = norm else {
            return Ok((self.lin_fwd(l, x, n, acc.ptr(), true, dropout, row0)?, None));
        };
        let c = &self.cfg;
        let h = c.hidden_size;
        let y = self.buf(n * h, self.dt)?;
        let u = self.lin_fwd(l, x, n, y.ptr(), false, dropout, row0)?;
        let (normed, inv) = (self.buf(n * h, self.dt)?, self.buf(n, Dt::F32)?);
        let eps = self.spec.norm.eps as f32;
        self.ops().rmsnorm_fwd(y.ptr(), self.w(w), normed.ptr(), inv.ptr(), n, h, eps, self.spec.norm.offset)?;
        self.ops().add(acc.ptr(), normed.ptr(), n * h)?;
        Ok((u, Some((y, inv))))
    }

    /// The norm the MLP reads: Llama's `post_attention_layernorm`, Gemma's
    /// `pre_feedforward_layernorm`.
    fn mlp_norm(l: &Layer) -> W {
        l.feedforward_norms.map_or(l.post_norm, |[pre, _]| pre)
    }

    /// What embeddings are multiplied by: 1, or Gemma's √hidden rounded to the compute dtype
    /// (as transformers rounds it to the weights').
    fn embed_scale(&self) -> f32 {
        self.spec.embed_scale.map_or(1.0, |s| self.dt.decode(&self.dt.encode(&[s as f32]))[0])
    }

    /// Whether a layer's MLP gate is GELU (Gemma) rather than SiLU.
    fn gelu(l: &Layer) -> bool {
        l.spec.activation == Activation::GeluTanh
    }

    /// A layer's rotary tables and its queries' first keys (cut to its window where it has one).
    fn layer_attention(&self, l: &Layer, bt: &DevBatch) -> (u64, u64, u64) {
        let a = &l.spec.attention;
        let (cos, sin) = &self.rope.as_ref().expect("rope tables before a pass").0[a.rope];
        let lo = match a.window {
            Some(w) => bt.lo_windows.iter().find(|(x, _)| *x == w).expect("first keys per window").1.ptr(),
            None => bt.lo.ptr(),
        };
        (cos.ptr(), sin.ptr(), lo)
    }

    /// Backward of one decoder layer: `dx` holds the gradient of its output and becomes that
    /// of its input with `need_input_grad` (else it is left alone: the first layer's input is
    /// the embedding, which needs it only when it trains).
    fn layer_bwd(
        &self,
        li: usize,
        x: &Buf,
        s: Saved,
        dx: &Buf,
        bt: &DevBatch,
        dropout: Option<u64>,
        need_input_grad: bool,
    ) -> Result<(), GpuError> {
        let c = &self.cfg;
        let (n, h, inter) = (bt.n, c.hidden_size, c.intermediate_size);
        // The first row of these rows in their micro-batch (dropout masks count from there).
        let row0 = bt.origin.token;
        let qd = c.num_heads * c.head_dim;
        let (o, dt, l) = (self.ops(), self.dt, &self.layers[li]);
        let (cos, sin, lo) = self.layer_attention(l, bt);
        let (off, gelu, mlp_norm) = (self.spec.norm.offset, Self::gelu(l), Self::mlp_norm(l));
        // With Gemma's norms on the attention's and the MLP's outputs: the gradients of those
        // outputs, through their norms (the residual's gradient, dx, passes by them).
        let post = match (&s.post, l.feedforward_norms) {
            (Some([(a, a_inv), (m, m_inv)]), Some([_, post_mlp])) => {
                let (da, dm) = (self.buf(n * h, dt)?, self.buf(n * h, dt)?);
                self.norm_bwd(post_mlp, m.ptr(), m_inv.ptr(), dx.ptr(), Some((dm.ptr(), false)), n, h)?;
                Some((l.post_norm, a.ptr(), a_inv.ptr(), da, dm))
            }
            _ => None,
        };
        // MLP. A linear layer's input is only needed for its adapter's or its weight's gradients.
        let act = match self.needs_input(&l.lin[DOWN]) {
            true => {
                let a = self.buf(n * inter, dt)?;
                o.swiglu(s.gate.ptr(), s.up.ptr(), a.ptr(), n * inter, gelu)?;
                Some(a)
            }
            false => None,
        };
        let dact = self.buf(n * inter, dt)?;
        let act_ptr = act.as_ref().map_or(0, Buf::ptr);
        let d_down = post.as_ref().map_or(dx.ptr(), |p| p.4.ptr());
        self.lin_bwd(&l.lin[DOWN], s.u[DOWN].as_ref(), act_ptr, n, d_down, Some((dact.ptr(), false)), dropout, row0)?;
        drop(act);
        // Gate and up gradients replace the saved activations.
        o.swiglu_bwd(s.gate.ptr(), s.up.ptr(), dact.ptr(), s.gate.ptr(), s.up.ptr(), n * inter, gelu)?;
        drop(dact);
        let hn = match self.needs_input(&l.lin[GATE]) || self.needs_input(&l.lin[UP]) {
            true => {
                let b = self.buf(n * h, dt)?;
                o.rmsnorm_apply(s.h.ptr(), s.inv2.ptr(), self.w(mlp_norm), b.ptr(), n, h, off)?;
                Some(b)
            }
            false => None,
        };
        let hn_ptr = hn.as_ref().map_or(0, Buf::ptr);
        let dhn = self.buf(n * h, dt)?;
        self.lin_bwd(
            &l.lin[GATE],
            s.u[GATE].as_ref(),
            hn_ptr,
            n,
            s.gate.ptr(),
            Some((dhn.ptr(), false)),
            dropout,
            row0,
        )?;
        self.lin_bwd(&l.lin[UP], s.u[UP].as_ref(), hn_ptr, n, s.up.ptr(), Some((dhn.ptr(), true)), dropout, row0)?;
        drop(hn);
        self.norm_bwd(mlp_norm, s.h.ptr(), s.inv2.ptr(), dhn.ptr(), Some((dx.ptr(), true)), n, h)?;
        drop(dhn);
        // Attention; dx is now the gradient of the attention block's output too (through its
        // norm with Gemma's).
        let d_o = match &post {
            Some((w, a, a_inv, da, _)) => {
                self.norm_bwd(*w, *a, *a_inv, dx.ptr(), Some((da.ptr(), false)), n, h)?;
                da.ptr()
            }
            None => dx.ptr(),
        };
        let dattn = self.buf(n * qd, dt)?;
        self.lin_bwd(&l.lin[O], s.u[O].as_ref(), s.attn.ptr(), n, d_o, Some((dattn.ptr(), false)), dropout, row0)?;
        drop(post);
        let (mut dq, mut dk, dv) = (self.buf(s.q.len, dt)?, self.buf(s.k.len, dt)?, self.buf(s.v.len, dt)?);
        let delta = self.buf(s.lse.len, Dt::F32)?;
        let shape = self.attn_shape(bt, l);
        let scratch = self.buf(shape.scratch_len(dt, &*self.gpu, true), Dt::F32)?;
        o.attn_bwd(
            &shape,
            s.q.ptr(),
            s.k.ptr(),
            s.v.ptr(),
            s.attn.ptr(),
            dattn.ptr(),
            s.lse.ptr(),
            delta.ptr(),
            scratch.ptr(),
            dq.ptr(),
            dk.ptr(),
            dv.ptr(),
            lo,
            bt.hi.ptr(),
        )?;
        drop((dattn, delta, scratch));
        o.rope(dq.ptr(), bt.pos.ptr(), cos, sin, n, c.num_heads, c.head_dim, true)?;
        o.rope(dk.ptr(), bt.pos.ptr(), cos, sin, n, c.num_kv_heads, c.head_dim, true)?;
        if let (Some(norms), Some(raw)) = (l.qk_norm, &s.qk) {
            // Through the head norms to the projections' outputs.
            for ((w, (x, inv)), (dy, heads)) in
                norms.into_iter().zip(raw).zip([(&mut dq, c.num_heads), (&mut dk, c.num_kv_heads)])
            {
                let dx = self.buf(dy.len, dt)?;
                self.norm_bwd(w, x.ptr(), inv.ptr(), dy.ptr(), Some((dx.ptr(), false)), n * heads, c.head_dim)?;
                *dy = dx;
            }
        }
        let xn = match [Q, K, V].iter().any(|&i| self.needs_input(&l.lin[i])) {
            true => {
                let b = self.buf(n * h, dt)?;
                o.rmsnorm_apply(x.ptr(), s.inv1.ptr(), self.w(l.input_norm), b.ptr(), n, h, off)?;
                Some(b)
            }
            false => None,
        };
        let xn_ptr = xn.as_ref().map_or(0, Buf::ptr);
        if need_input_grad || self.wgrad(l.input_norm).is_some() {
            let dxn = self.buf(n * h, dt)?;
            self.lin_bwd(&l.lin[Q], s.u[Q].as_ref(), xn_ptr, n, dq.ptr(), Some((dxn.ptr(), false)), dropout, row0)?;
            self.lin_bwd(&l.lin[K], s.u[K].as_ref(), xn_ptr, n, dk.ptr(), Some((dxn.ptr(), true)), dropout, row0)?;
            self.lin_bwd(&l.lin[V], s.u[V].as_ref(), xn_ptr, n, dv.ptr(), Some((dxn.ptr(), true)), dropout, row0)?;
            let dx = need_input_grad.then_some((dx.ptr(), true));
            self.norm_bwd(l.input_norm, x.ptr(), s.inv1.ptr(), dxn.ptr(), dx, n, h)?;
        } else {
            for (i, dy) in [(Q, &dq), (K, &dk), (V, &dv)] {
                self.lin_bwd(&l.lin[i], s.u[i].as_ref(), xn_ptr, n, dy.ptr(), None, dropout, row0)?;
            }
        }
        Ok(())
    }

    /// Forward (and with `train` backward) over a batch: the selected positions' losses, times
    /// `weight / count` (or `1 / count` without training), are added to the loss accumulator;
    /// gradients of `loss_scale × weight × mean loss` to the flat gradients.
    fn pass(&self, bt: &DevBatch, train: Option<Train>) -> Result<(), GpuError> {
        let c = &self.cfg;
        let (n, h, vocab) = (bt.n, c.hidden_size, c.vocab_size);
        let (o, dt) = (self.ops(), self.dt);
        let dropout = train.and_then(|t| t.dropout);
        let training = train.is_some();
        let mut x = self.buf(n * h, dt)?;
        o.embed(bt.ids.ptr(), self.w(self.embed), x.ptr(), n, h, self.embed_scale())?;
        // Per layer: its input, and what its backward pass needs unless it is recomputed then.
        let mut kept: Vec<(Buf, Option<Saved>)> = Vec::with_capacity(self.layers.len());
        for li in 0..self.layers.len() {
            let save = training && !self.checkpointing;
            let (next, saved) = self.layer_fwd(li, &x, bt, dropout, save)?;
            if training {
                kept.push((x, saved));
            }
            x = next;
        }
        let hn = self.buf(n * h, dt)?;
        let inv = self.buf(n, Dt::F32)?;
        let (eps, off) = (self.spec.norm.eps as f32, self.spec.norm.offset);
        o.rmsnorm_fwd(x.ptr(), self.w(self.norm), hn.ptr(), inv.ptr(), n, h, eps, off)?;
        // LM head and loss in chunks of selected positions: each chunk's logits gradient goes
        // straight back through the head, so no [positions, vocabulary] matrix exists whole.
        let dhn = if training { Some(Buf::zeros(&self.gpu, n * h, dt)?) } else { None };
        let count = bt.select.max(1);
        let grad_scale = train.map_or(0.0, |t| (t.weight * t.loss_scale / count as f64) as f32);
        let loss_rows = self.buf(bt.select, Dt::F32)?;
        let chunk = (LOGITS_PER_CHUNK / vocab).clamp(1, 8192);
        for first in (0..bt.select).step_by(chunk) {
            let rows = chunk.min(bt.select - first);
            let hs = self.buf(rows * h, dt)?;
            o.gather_rows(hn.ptr(), bt.sel.at(first), hs.ptr(), rows, h)?;
            let logits = self.buf(rows * vocab, dt)?;
            let u =
                self.lin_fwd(&self.lm_head, hs.ptr(), rows, logits.ptr(), false, dropout, bt.origin.select + first)?;
            let cap = self.spec.final_softcap.map(|c| c as f32);
            o.cross_entropy(logits.ptr(), bt.tgt.at(first), loss_rows.at(first), rows, vocab, grad_scale, cap)?;
            if let Some(dhn) = &dhn {
                let dhs = self.buf(rows * h, dt)?;
                self.lin_bwd(
                    &self.lm_head,
                    u.as_ref(),
                    hs.ptr(),
                    rows,
                    logits.ptr(),
                    Some((dhs.ptr(), false)),
                    dropout,
                    bt.origin.select + first,
                )?;
                o.scatter_add_rows(dhs.ptr(), bt.sel.at(first), dhn.ptr(), rows, h)?;
            }
        }
        let factor = train.map_or(1.0, |t| t.weight) / count as f64;
        o.sum_scaled(loss_rows.ptr(), bt.select, factor as f32, self.acc.ptr())?;
        let Some(dhn) = dhn else { return Ok(()) };
        drop((hn, loss_rows));
        let dx = self.buf(n * h, dt)?;
        self.norm_bwd(self.norm, x.ptr(), inv.ptr(), dhn.ptr(), Some((dx.ptr(), false)), n, h)?;
        drop((x, inv, dhn));
        let embed_grad = self.wgrad(self.embed);
        for li in (0..self.layers.len()).rev() {
            let (input, saved) = kept.pop().expect("one kept input per layer");
            let saved = match saved {
                Some(s) => s,
                None => self.layer_fwd(li, &input, bt, dropout, true)?.1.expect("saved on request"),
            };
            self.layer_bwd(li, &input, saved, &dx, bt, dropout, li > 0 || embed_grad.is_some())?;
        }
        if let (Some(g), Some(tr)) = (embed_grad, &bt.token_rows) {
            let scale = self.embed_scale();
            o.embed_bwd(dx.ptr(), tr.rows.ptr(), tr.starts.ptr(), tr.tokens.ptr(), g, tr.uniq, h, scale)?;
        }
        Ok(())
    }

    /// [`Engine::accumulate`] of a part of a micro-batch that starts at `origin` in it (data
    /// parallel, [`super::parallel`]): queued, not waited for.
    pub(super) fn accumulate_part(
        &mut self,
        batch: &HostBatch,
        origin: Origin,
        weight: f64,
        loss_scale: f64,
        dropout: Option<u64>,
    ) -> Result<(), EngineError> {
        if self.trained.as_ref().and_then(|t| t.grads.as_ref()).is_none() {
            return Err(EngineError::Unsupported("this engine was built for evaluation".into()));
        }
        let bt = DevBatch { origin, ..self.upload(batch)? };
        self.pass(&bt, Some(Train { weight, loss_scale, dropout })).map_err(|e| oom_or(e, "training", bt.b, bt.t))
    }

    /// Queue the loss of `batch` ([`Engine::loss`] without waiting); [`Self::take_loss`] reads it.
    pub(super) fn queue_loss(&mut self, batch: &HostBatch) -> Result<(), EngineError> {
        let bt = self.upload(batch)?;
        self.gpu.zero(self.acc.ptr(), 16).map_err(gerr("evaluate"))?;
        self.pass(&bt, None).map_err(|e| oom_or(e, "evaluating", bt.b, bt.t))
    }

    /// The mean loss [`Self::queue_loss`] queued, once the device has computed it.
    pub(super) fn take_loss(&mut self) -> Result<f64, EngineError> {
        Ok(self.take_acc().map_err(gerr("evaluate"))?.0)
    }

    /// The device's name, `NVIDIA GeForce RTX 4090 (cuda:1)`.
    pub(super) fn device_name(&self) -> String {
        self.gpu.name()
    }

    /// Start the work queued so far without waiting for it (Vulkan records commands until a
    /// batch fills; data parallel devices should all be busy while the host waits on one).
    pub(super) fn flush(&self) -> Result<(), EngineError> {
        self.gpu.flush().map_err(gerr("submitting work"))
    }

    /// Where the flat gradients are cut into device buffers (`[0, …, len]`); a range of them
    /// read or written at once lies between two consecutive bounds.
    pub(super) fn gradient_bounds(&self) -> Result<&[usize], EngineError> {
        let grads = self.trained.as_ref().and_then(|t| t.grads.as_ref());
        let grads = grads.ok_or_else(|| EngineError::Unsupported("this engine was built for evaluation".into()))?;
        Ok(&grads.bounds)
    }

    /// The flat gradients `off .. off + len` (within one buffer, see [`Self::gradient_bounds`]).
    pub(super) fn read_gradients(&self, off: usize, len: usize) -> Result<Vec<f32>, EngineError> {
        let grads = self.trained.as_ref().and_then(|t| t.grads.as_ref()).expect("checked by gradient_bounds");
        grads.read(off, len).map_err(gerr("reading gradients"))
    }

    /// Overwrite the flat gradients from `off` (within one buffer).
    pub(super) fn write_gradients(&self, off: usize, values: &[f32]) -> Result<(), EngineError> {
        let grads = self.trained.as_ref().and_then(|t| t.grads.as_ref()).expect("checked by gradient_bounds");
        grads.write_at(off, values).map_err(gerr("writing gradients"))
    }

    /// The accumulators `[loss, squared gradient norm]`, then zeroed.
    fn take_acc(&self) -> Result<(f64, f64), GpuError> {
        let mut bytes = [0u8; 16];
        self.gpu.download(self.acc.ptr(), &mut bytes)?;
        self.gpu.zero(self.acc.ptr(), 16)?;
        let f = |i: usize| f64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        Ok((f(0), f(8)))
    }

    /// Logits of the last position of `ids` (one row, no gradients).
    fn last_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        let t = ids.len();
        let batch = HostBatch::from_parts(&[ids.to_vec()], &[t], None, vec![t as u32 - 1], vec![0]);
        let bt = self.upload(&batch)?;
        let ctx = |e| oom_or(e, "generating", 1, t);
        let c = &self.cfg;
        let (h, dt) = (c.hidden_size, self.dt);
        let o = self.ops();
        let run = || -> Result<Vec<f32>, GpuError> {
            let mut x = self.buf(t * h, dt)?;
            o.embed(bt.ids.ptr(), self.w(self.embed), x.ptr(), t, h, self.embed_scale())?;
            for li in 0..self.layers.len() {
                x = self.layer_fwd(li, &x, &bt, None, false)?.0;
            }
            let last = self.buf(h, dt)?;
            let inv = self.buf(1, Dt::F32)?;
            let (eps, off) = (self.spec.norm.eps as f32, self.spec.norm.offset);
            o.rmsnorm_fwd(x.at((t - 1) * h), self.w(self.norm), last.ptr(), inv.ptr(), 1, h, eps, off)?;
            let logits = self.buf(c.vocab_size, dt)?;
            self.lin_fwd(&self.lm_head, last.ptr(), 1, logits.ptr(), false, None, 0)?;
            let mut logits = logits.to_vec()?;
            if let Some(c) = self.spec.final_softcap {
                // Gemma 2's cap, as the loss applies it (in f32 here, on one row).
                let c = c as f32;
                logits.iter_mut().for_each(|z| *z = c * (*z / c).tanh());
            }
            Ok(logits)
        };
        run().map_err(ctx)
    }
}

/// An out-of-memory error with what was being done and the batch shape; other errors as they are.
fn oom_or(e: GpuError, context: &str, batch: usize, seq: usize) -> EngineError {
    match e {
        GpuError::OutOfMemory { requested, free, total } => {
            EngineError::OutOfMemory { context: context.to_string(), batch, seq, requested, free, total }
        }
        source => EngineError::gpu(context, source),
    }
}

impl Trained {
    fn new(
        gpu: &Rc<dyn Gpu>,
        dt: Dt,
        slots: Vec<Slot>,
        values: &[f32],
        opt: Option<AdamWConfig>,
        ema: Option<f64>,
    ) -> Result<Trained, EngineError> {
        let bounds = cut(&slots, values.len(), gpu.max_alloc()).map_err(|s| {
            let limit = part_values(gpu.max_alloc()) as u64 * 4;
            EngineError::Unsupported(format!(
                "`{}` ({} in f32) does not fit in one buffer of {}, which allows at most {}: train fewer weights \
                 or a LoRA adapter",
                s.name,
                crate::ui::human_bytes(s.len as u64 * 4),
                gpu.name(),
                crate::ui::human_bytes(limit)
            ))
        })?;
        let alloc = || -> Result<Trained, GpuError> {
            let params = Flat::new(gpu, &bounds, Dt::F32, Some(values))?;
            let params_c = if dt == Dt::F32 { None } else { Some(Flat::new(gpu, &bounds, dt, None)?) };
            let training = opt.is_some();
            let zeros = || if training { Flat::new(gpu, &bounds, Dt::F32, None).map(Some) } else { Ok(None) };
            let ema = match ema.filter(|_| training) {
                Some(d) => Some((d, Flat::new(gpu, &bounds, Dt::F32, Some(values))?)),
                None => None,
            };
            let t =
                Trained { slots, params, params_c, grads: zeros()?, m: zeros()?, v: zeros()?, ema, opt, opt_step: 0 };
            t.refresh(gpu, dt)?;
            Ok(t)
        };
        alloc().map_err(|e| oom_or(e, "allocating the trained parameters and their optimizer state", 0, 0))
    }

    /// Recompute the compute-dtype copy after the f32 parameters changed.
    fn refresh(&self, gpu: &Rc<dyn Gpu>, dt: Dt) -> Result<(), GpuError> {
        if let Some(c) = &self.params_c {
            for (p, c) in self.params.parts.iter().zip(&c.parts) {
                Ops { gpu: &**gpu, dt }.cast_from_f32(p.ptr(), c.ptr(), p.len)?;
            }
        }
        Ok(())
    }

    fn len(&self) -> usize {
        self.params.len()
    }

    /// A flat array as named CPU tensors, read one weight at a time (the host never holds the
    /// array twice: a full fine-tune's is the model's size).
    fn named(&self, flat: &Flat) -> Result<BTreeMap<String, Tensor>, EngineError> {
        self.slots
            .iter()
            .map(|s| {
                let v = flat.read(s.off, s.len).map_err(gerr("read parameters"))?;
                let t = Tensor::from_vec(v, s.shape.as_slice(), &candle_core::Device::Cpu)
                    .map_err(EngineError::candle(format!("read `{}`", s.name)))?;
                Ok((s.name.clone(), t))
            })
            .collect()
    }

    /// Named CPU tensors into a flat array; every slot must be present with its shape.
    fn load(&self, flat: &Flat, values: &BTreeMap<String, Tensor>, what: &str) -> Result<(), EngineError> {
        let mut all = vec![0f32; flat.len()];
        fill_slots(&self.slots, values, &mut all, |name| {
            EngineError::Unsupported(format!("the checkpoint has no {what} for `{name}`"))
        })?;
        flat.write(&all).map_err(gerr("restore a checkpoint"))
    }
}

impl Engine for GpuEngine {
    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn trained_count(&self) -> usize {
        self.trained.as_ref().map_or(0, Trained::len)
    }

    fn accumulate(
        &mut self,
        batch: &HostBatch,
        weight: f64,
        loss_scale: f64,
        dropout: Option<u64>,
    ) -> Result<(), EngineError> {
        self.accumulate_part(batch, Origin::default(), weight, loss_scale, dropout)
    }

    fn gradients(&mut self) -> Result<(f64, f64), EngineError> {
        let t = self.trained.as_ref().ok_or_else(|| EngineError::Unsupported("nothing trains".into()))?;
        for g in &t.grads.as_ref().expect("training").parts {
            self.ops().sum_squares(g.ptr(), g.len, self.acc.at(2)).map_err(gerr("gradient norm"))?;
        }
        let (loss, norm_sq) = self.take_acc().map_err(|e| oom_or(e, "training", 0, 0))?;
        Ok((loss, norm_sq.sqrt()))
    }

    fn apply(&mut self, lr: f64, grad_scale: f64) -> Result<(), EngineError> {
        let (gpu, dt) = (self.gpu.clone(), self.dt);
        let t = self.trained.as_mut().ok_or_else(|| EngineError::Unsupported("nothing trains".into()))?;
        let c = t.opt.ok_or_else(|| EngineError::Unsupported("this engine was built for evaluation".into()))?;
        t.opt_step += 1;
        let step = t.opt_step as i32;
        let (bc1, bc2) = (1.0 - c.beta1.powi(step), 1.0 - c.beta2.powi(step));
        let coef = AdamWCoefficients {
            decay: (1.0 - lr * c.weight_decay) as f32,
            one_minus_b1: (1.0 - c.beta1) as f32,
            b2: c.beta2 as f32,
            one_minus_b2: (1.0 - c.beta2) as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: c.eps as f32,
            grad_scale: grad_scale as f32,
        };
        let o = Ops { gpu: &*gpu, dt };
        let (g, m, v) =
            (t.grads.as_ref().expect("training"), t.m.as_ref().expect("training"), t.v.as_ref().expect("training"));
        let run = || -> Result<(), GpuError> {
            for (i, p) in t.params.parts.iter().enumerate() {
                o.adamw(p.ptr(), g.parts[i].ptr(), m.parts[i].ptr(), v.parts[i].ptr(), p.len, &coef)?;
                if let Some((decay, e)) = &t.ema {
                    o.ema(e.parts[i].ptr(), p.ptr(), *decay, p.len)?;
                }
            }
            t.refresh(&gpu, dt)?;
            g.zero(&*gpu)
        };
        run().map_err(gerr("optimizer step"))
    }

    fn discard(&mut self) -> Result<(), EngineError> {
        if let Some(g) = self.trained.as_ref().and_then(|t| t.grads.as_ref()) {
            g.zero(&*self.gpu).map_err(gerr("discard gradients"))?;
        }
        self.take_acc().map_err(gerr("discard gradients"))?;
        Ok(())
    }

    fn loss(&mut self, batch: &HostBatch) -> Result<f64, EngineError> {
        self.queue_loss(batch)?;
        self.take_loss()
    }

    fn next_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        if ids.is_empty() {
            return Err(EngineError::Unsupported("generation needs at least one prompt token".into()));
        }
        self.last_logits(ids)
    }

    fn state(&self) -> Result<EngineState, EngineError> {
        let t = self.trained.as_ref().ok_or_else(|| EngineError::Unsupported("nothing trains".into()))?;
        let (m, v) = (t.m.as_ref(), t.v.as_ref());
        let (Some(m), Some(v)) = (m, v) else {
            return Err(EngineError::Unsupported("this engine was built for evaluation".into()));
        };
        Ok(EngineState {
            params: t.named(&t.params)?,
            ema: t.ema.as_ref().map(|(_, e)| t.named(e)).transpose()?,
            m: t.named(m)?,
            v: t.named(v)?,
            optimizer_step: t.opt_step,
        })
    }

    fn restore(&mut self, s: &EngineState) -> Result<(), EngineError> {
        let (gpu, dt) = (self.gpu.clone(), self.dt);
        let t = self.trained.as_mut().ok_or_else(|| EngineError::Unsupported("nothing trains".into()))?;
        t.load(&t.params, &s.params, "parameter")?;
        if let Some(m) = &t.m {
            t.load(m, &s.m, "optimizer state")?;
        }
        if let Some(v) = &t.v {
            t.load(v, &s.v, "optimizer state")?;
        }
        if let (Some((_, e)), Some(saved)) = (&t.ema, &s.ema) {
            t.load(e, saved, "EMA value")?;
        }
        t.opt_step = s.optimizer_step;
        t.refresh(&gpu, dt).map_err(gerr("restore a checkpoint"))
    }

    fn gradient_values(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        match self.trained.as_ref().and_then(|t| t.grads.as_ref().map(|g| (t, g))) {
            None => Ok(BTreeMap::new()),
            Some((t, g)) => t.named(g),
        }
    }

    fn trained(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        match &self.trained {
            None => Ok(BTreeMap::new()),
            Some(t) => t.named(t.ema.as_ref().map_or(&t.params, |(_, e)| e)),
        }
    }

    fn peak_memory(&self) -> Option<u64> {
        Some(self.gpu.memory().peak_used)
    }

    fn kernels(&self) -> Option<String> {
        let s = self.last_attn.get()?;
        Some(format!("{}; {}", self.gpu.products_account(self.dt), s.account(self.dt, &*self.gpu)))
    }

    fn memory_estimate(&self, rows: usize, seq: usize, checkpointing: bool) -> Option<(u64, u64)> {
        let n = rows * seq;
        let fixed = self.fixed_bytes();
        Some((fixed + self.activation_bytes(n, checkpointing) + self.transient_bytes(n), self.gpu.memory().total))
    }

    fn checkpointing(&self) -> bool {
        self.checkpointing
    }
}

#[cfg(test)]
mod tests {
    use super::{Slot, cut};

    fn slots(lens: &[usize]) -> Vec<Slot> {
        let mut off = 0;
        lens.iter()
            .enumerate()
            .map(|(i, &len)| {
                let s = Slot { name: format!("w{i}"), shape: vec![len], off, len };
                off += len;
                s
            })
            .collect()
    }

    /// Every part holds whole weights, fits the allocation limit and counts its values in 32
    /// bits: a 3B model's full fine-tune (3.1 billion values) on CUDA, which caps no allocation,
    /// is two parts, not refused.
    #[test]
    fn trained_values_are_cut_at_weights_into_parts_the_kernels_can_count() {
        let check = |lens: &[usize], max_bytes: u64, cap: usize| -> Vec<usize> {
            let s = slots(lens);
            let total = lens.iter().sum();
            let bounds = cut(&s, total, max_bytes).unwrap();
            assert_eq!((bounds[0], *bounds.last().unwrap()), (0, total));
            for w in bounds.windows(2) {
                assert!(w[0] < w[1] && w[1] - w[0] <= cap, "{bounds:?}");
            }
            for slot in &s {
                let p = bounds.partition_point(|&b| b <= slot.off) - 1;
                assert!(slot.off + slot.len <= bounds[p + 1], "`{}` straddles two parts: {bounds:?}", slot.name);
            }
            bounds
        };
        // Qwen2.5-3B's shapes: embedding, then 36 layers of ~77M values each.
        let mut qwen3b = vec![151_936 * 2048];
        qwen3b.extend(std::iter::repeat_n(77_070_336, 36));
        assert_eq!(check(&qwen3b, u64::MAX, i32::MAX as usize).len(), 3, "two parts");
        // A driver with a 4 GiB cap: a billion f32 values a part.
        assert_eq!(check(&qwen3b, 4 << 30, 1 << 30).len(), 5, "four parts");
        // Small enough for one: one part.
        assert_eq!(check(&[1000, 2000], u64::MAX, i32::MAX as usize), [0, 3000]);
        // A single weight past 2³¹ − 1 values cannot be one part.
        let s = slots(&[10, 1 << 31]);
        assert_eq!(cut(&s, 10 + (1 << 31), u64::MAX).err().map(|s| s.name.as_str()), Some("w1"));
    }
}
