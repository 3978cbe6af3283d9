//! The fused CPU engine: LoRA training and evaluation of [`Transformer`] models over plain f32
//! buffers, with a hand-written backward pass.
//!
//! candle's autograd runs a LoRA step as a few thousand small ops, each allocating its output
//! and dispatching to the thread pool, and keeps every intermediate alive until the backward
//! pass. This engine computes the same function in a few dozen GEMM calls (the `gemm` crate
//! candle itself uses) and fused row loops:
//! - RMSNorm, rotary embeddings, softmax, SiLU-gating and cross-entropy are single passes, each
//!   with its derivative written out;
//! - attention runs per (sequence, head) on contiguous head-major blocks, one task per block;
//! - no gradient is computed for a frozen weight, nor for the input of the first layer;
//! - it keeps only what the backward pass cannot cheaply recompute (normalised activations and
//!   the gated MLP product are recomputed), and computes the LM head and loss in chunks of
//!   selected positions, so a 49k-vocabulary logits matrix never exists whole.
//!
//! It is used when the model computes in f32 on the CPU and only LoRA adapters train (see
//! [`unsupported`]); anything else runs through candle. Both give the same loss and gradients
//! to float rounding (`cargo test --test model fused_`), and draw the same LoRA dropout masks
//! (keyed per element, [`crate::model::lora::dropout_keep`]).

use std::collections::BTreeMap;

use candle_core::{CpuStorage, Device, Layout, Result, Storage, Tensor, bail};
use gemm::Parallelism;
use rayon::prelude::*;

use super::{DOWN, GATE, K, O, Q, UP, V};
use crate::model::transformer::{Batch, Transformer};

/// Why `model` cannot run on the fused engine, or `None` when it can.
pub fn unsupported(model: &Transformer) -> Option<String> {
    if !matches!(model.device(), Device::Cpu) {
        return Some("the model is not on the CPU".into());
    }
    if model.compute_dtype() != candle_core::DType::F32 {
        return Some(format!("the model computes in {:?}, not f32", model.compute_dtype()));
    }
    if let Some(p) = model.params.iter().find(|p| !p.name.contains(".lora_A.") && !p.name.contains(".lora_B.")) {
        return Some(format!("base weight `{}` trains (only LoRA adapters are fused)", p.name));
    }
    None
}

/// Mean cross-entropy at the selected positions (as [`Transformer::loss`]), without gradients.
pub fn loss(model: &Transformer, batch: &Batch, select: &[u32], targets: &[u32]) -> Result<f64> {
    Ok(run(model, batch, select, targets, None)?.0)
}

/// Mean cross-entropy at the selected positions and the gradient of `weight × loss` for every
/// LoRA parameter, by name. `dropout` is the micro-batch's dropout key.
pub fn loss_and_grads(
    model: &Transformer,
    batch: &Batch,
    select: &[u32],
    targets: &[u32],
    weight: f32,
    dropout: Option<u64>,
) -> Result<(f64, BTreeMap<String, Tensor>)> {
    let (loss, mut grads) = run(model, batch, select, targets, Some((weight, dropout)))?;
    let mut out = BTreeMap::new();
    for p in &model.params {
        let g = match grads.remove(&p.name) {
            Some(g) => Tensor::from_vec(g, p.var.shape(), &Device::Cpu)?,
            // No selected position reached it (an empty batch).
            None => Tensor::zeros(p.var.shape(), candle_core::DType::F32, &Device::Cpu)?,
        };
        out.insert(p.name.clone(), g);
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
    /// The HF prefix (`model.layers.3.self_attn.q_proj`); gradients are named after it.
    name: String,
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
    post_norm: W<'a>,
    /// q, k, v, o, gate, up, down.
    lin: [LinW<'a>; 7],
}

struct Weights<'a> {
    embed: W<'a>,
    layers: Vec<LayerW<'a>>,
    norm: W<'a>,
    lm_head: LinW<'a>,
    cos: W<'a>,
    sin: W<'a>,
}

/// The model's tensors in the order [`Weights::new`] consumes them.
fn tensors(model: &Transformer) -> Vec<&Tensor> {
    let (cos, sin) = model.rope_tables();
    let mut out = vec![model.embed_weight(), model.norm_weight(), cos, sin];
    for i in 0..model.cfg.num_layers {
        let (a, b) = model.layer_norms(i);
        out.extend([a, b]);
    }
    for (_, l) in model.linears() {
        out.push(l.weight());
        out.extend(l.bias());
        if let Some(lo) = &l.lora {
            out.extend([&lo.a, &lo.b]);
        }
    }
    out
}

fn f32_data<'g>(s: &'g Storage, l: &Layout) -> Result<&'g [f32]> {
    match (s, l.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(&v[a..b]),
        (Storage::Cpu(CpuStorage::F32(_)), None) => bail!("fused engine: a weight is not contiguous"),
        _ => bail!("fused engine: a weight is not f32 on the CPU"),
    }
}

impl<'a> Weights<'a> {
    fn new(model: &Transformer, data: &[&'a [f32]]) -> Result<Weights<'a>> {
        let mut it = data.iter().copied();
        let mut next = || it.next().expect("one slice per tensor");
        let (embed, norm, cos, sin) = (next(), next(), next(), next());
        let norms: Vec<(W<'a>, W<'a>)> = (0..model.cfg.num_layers).map(|_| (next(), next())).collect();
        let mut lins = Vec::new();
        for (name, l) in model.linears() {
            let (out, inp) = l.weight().dims2()?;
            let w = next();
            let bias = l.bias().map(|_| next());
            let lora = l.lora.as_ref().map(|lo| LoraW {
                a: next(),
                b: next(),
                rank: lo.a.dims()[0],
                scale: lo.scale as f32,
                dropout: lo.dropout,
            });
            lins.push(LinW { name, w, bias, lora, inp, out, id: l.id });
        }
        let lm_head = lins.pop().expect("lm_head is the last linear");
        let mut lins = lins.into_iter();
        let layers = norms
            .into_iter()
            .map(|(input_norm, post_norm)| LayerW {
                input_norm,
                post_norm,
                lin: std::array::from_fn(|_| lins.next().expect("seven linears per layer")),
            })
            .collect();
        Ok(Weights { embed, layers, norm, lm_head, cos, sin })
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
    /// embedding, and values.
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
}

/// Gradient accumulators by parameter name.
type Grads = BTreeMap<String, Vec<f32>>;

fn run(
    model: &Transformer,
    batch: &Batch,
    select: &[u32],
    targets: &[u32],
    train: Option<(f32, Option<u64>)>,
) -> Result<(f64, Grads)> {
    if let Some(why) = unsupported(model) {
        bail!("fused engine: {why}")
    }
    // Read-lock each storage once: a tied LM head shares the embedding's.
    let all = tensors(model);
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
    let data: Vec<&[f32]> = slot.iter().map(|&i| views[i]).collect();
    let w = Weights::new(model, &data)?;
    let (b, t) = batch.ids.dims2()?;
    let cfg = &model.cfg;
    let dims = Dims {
        b,
        t,
        n: b * t,
        hidden: cfg.hidden_size,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        d: cfg.head_dim,
        inter: cfg.intermediate_size,
        vocab: cfg.vocab_size,
        eps: cfg.rms_norm_eps as f32,
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
        .all(|m| (0..t).all(|q| m[q * t + q + 1..(q + 1) * t].iter().all(|&v| v <= crate::model::transformer::MASKED)));
    if mask.len() != b * t * t || !causal {
        bail!("fused engine: the attention mask is not a causal [b, 1, t, t] mask")
    }
    let max_pos = w.cos.len() / dims.d;
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
    let shards = if select.is_sorted() { shard_count(&dims) } else { 1 };
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
                    scope.spawn(move || single_thread_pool(i).install(|| pass(w, d, part, grad_scale, dropout)))
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
        pass(&w, &dims, &whole, grad_scale, dropout)
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
fn pass(w: &Weights<'_>, dims: &Dims, inp: &Shard<'_>, grad_scale: Option<f32>, dropout: Option<u64>) -> (f64, Grads) {
    let dims = *dims;
    let Shard { ids, positions, mask, select, targets } = *inp;
    let training = grad_scale.is_some();
    let mut grads = Grads::new();

    // Forward.
    let mut x = vec![0f32; dims.n * dims.hidden];
    x.par_chunks_mut(dims.hidden).zip(ids.par_iter()).for_each(|(row, &id)| {
        row.copy_from_slice(&w.embed[id as usize * dims.hidden..][..dims.hidden]);
    });
    let mut saves = Vec::with_capacity(w.layers.len());
    for lw in &w.layers {
        let (next, save) = layer_forward(lw, w, &dims, x, positions, mask, dropout, training);
        x = next;
        saves.extend(save);
    }
    let (hn, inv_f) = rms_norm(&x, w.norm, &dims);

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
        loss_sum += cross_entropy(&mut logits, tgt, dims.vocab, grad_scale);
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
    rms_norm_backward(&x, &inv_f, w.norm, &dhn, &mut dx, false, &dims);
    drop((hn, dhn));
    for (i, (lw, save)) in w.layers.iter().zip(saves).enumerate().rev() {
        layer_backward(lw, w, &dims, save, &mut dx, positions, mask, i > 0, &mut grads);
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
    let Dims { b, t, n, hidden, heads, kv_heads, d, inter, .. } = *dims;
    let (qd, kvd) = (heads * d, kv_heads * d);
    let (xn, inv1) = rms_norm(&x, lw.input_norm, dims);
    let mut lin: [LinSave; 7] = Default::default();
    let mut proj = |i: usize, input: &[f32], width: usize| {
        let mut y = vec![0f32; n * width];
        lin[i] = linear_forward(&lw.lin[i], input, n, dropout, dims.row0, &mut y);
        y
    };
    let q = proj(Q, &xn, qd);
    let k = proj(K, &xn, kvd);
    let v = proj(V, &xn, kvd);
    drop(xn);
    let q = to_heads(&q, b, t, heads, d, Some((positions, w.cos, w.sin)));
    let k = to_heads(&k, b, t, kv_heads, d, Some((positions, w.cos, w.sin)));
    let v = to_heads(&v, b, t, kv_heads, d, None);
    let mut lse = if training { vec![0f32; b * heads * t] } else { Vec::new() };
    let mut out = vec![0f32; b * heads * t * d];
    attention_forward(&q, &k, &v, mask, dims, training.then_some(&mut lse[..]), &mut out);
    let attn = from_heads(&out, b, t, heads, d, None);
    drop(out);
    let o = proj(O, &attn, hidden);
    let mut h = x.clone();
    add(&mut h, &o);
    drop(o);
    let (hn, inv2) = rms_norm(&h, lw.post_norm, dims);
    let gate = proj(GATE, &hn, inter);
    let up = proj(UP, &hn, inter);
    drop(hn);
    let act = swiglu(&gate, &up);
    let down = proj(DOWN, &act, hidden);
    drop(act);
    let mut next = h.clone();
    add(&mut next, &down);
    let save = training.then_some(LayerSave { x, inv1, q, k, v, lse, attn, h, inv2, gate, up, lin });
    (next, save)
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
    let Dims { b, t, n, heads, kv_heads, d, inter, .. } = *dims;
    let qd = heads * d;
    // dx holds d(loss)/d(layer output); the residual makes it d/dh too, and we add into it.
    // A linear layer's input is only needed for its adapter's gradients.
    let act = if lw.lin[DOWN].lora.is_some() { swiglu(&s.gate, &s.up) } else { Vec::new() };
    let mut dact = vec![0f32; n * inter];
    linear_backward(&lw.lin[DOWN], &s.lin[DOWN], &act, n, dx, Some(&mut dact), grads);
    drop(act);
    let (dgate, dup) = swiglu_backward(&s.gate, &s.up, &dact);
    drop(dact);
    let hn = if lw.lin[GATE].lora.is_some() || lw.lin[UP].lora.is_some() {
        rms_norm_with(&s.h, &s.inv2, lw.post_norm, dims)
    } else {
        Vec::new()
    };
    let mut dhn = vec![0f32; n * dims.hidden];
    linear_backward(&lw.lin[GATE], &s.lin[GATE], &hn, n, &dgate, Some(&mut dhn), grads);
    linear_backward_acc(&lw.lin[UP], &s.lin[UP], &hn, n, &dup, &mut dhn, grads);
    drop((hn, dgate, dup));
    rms_norm_backward(&s.h, &s.inv2, lw.post_norm, &dhn, dx, true, dims);
    // dx is now d/dh = d/d(layer input) through the residual, plus the attention branch below.
    let mut dattn = vec![0f32; n * qd];
    linear_backward(&lw.lin[O], &s.lin[O], &s.attn, n, dx, Some(&mut dattn), grads);
    let dout = to_heads(&dattn, b, t, heads, d, None);
    drop(dattn);
    let mut dq = vec![0f32; b * heads * t * d];
    let mut dk = vec![0f32; b * kv_heads * t * d];
    let mut dv = vec![0f32; b * kv_heads * t * d];
    attention_backward(&s.q, &s.k, &s.v, mask, &s.lse, &dout, dims, &mut dq, &mut dk, &mut dv);
    drop(dout);
    let dq = from_heads(&dq, b, t, heads, d, Some((positions, w.cos, w.sin)));
    let dk = from_heads(&dk, b, t, kv_heads, d, Some((positions, w.cos, w.sin)));
    let dv = from_heads(&dv, b, t, kv_heads, d, None);
    let xn = if [Q, K, V].iter().any(|&i| lw.lin[i].lora.is_some()) {
        rms_norm_with(&s.x, &s.inv1, lw.input_norm, dims)
    } else {
        Vec::new()
    };
    if need_input_grad {
        let mut dxn = vec![0f32; n * dims.hidden];
        linear_backward(&lw.lin[Q], &s.lin[Q], &xn, n, &dq, Some(&mut dxn), grads);
        linear_backward_acc(&lw.lin[K], &s.lin[K], &xn, n, &dk, &mut dxn, grads);
        linear_backward_acc(&lw.lin[V], &s.lin[V], &xn, n, &dv, &mut dxn, grads);
        rms_norm_backward(&s.x, &s.inv1, lw.input_norm, &dxn, dx, true, dims);
    } else {
        // The first layer's input is the (frozen) embedding: only the adapters need gradients.
        for (i, dy) in [(Q, &dq), (K, &dk), (V, &dv)] {
            linear_backward(&lw.lin[i], &s.lin[i], &xn, n, dy, None, grads);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Matrix products.

/// A read-only matrix view: element (i, j) is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// Row-major `rows × cols`.
    fn rm(data: &'a [f32], rows: usize, cols: usize) -> Mat<'a> {
        Mat { data, rows, cols, rs: cols, cs: 1 }
    }

    fn t(self) -> Mat<'a> {
        Mat { data: self.data, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }
}

/// Products smaller than this many multiply-adds run on the calling thread.
const PARALLEL_MIN: usize = 1 << 18;

/// `dst (row-major m × n) = [dst +] beta · a · b`, on all threads when it is large enough.
fn matmul(dst: &mut [f32], a: Mat<'_>, b: Mat<'_>, beta: f32, accumulate: bool) {
    product(dst, a, b, beta, accumulate, true)
}

/// [`matmul`] on the calling thread (inside a parallel task).
fn matmul_here(dst: &mut [f32], a: Mat<'_>, b: Mat<'_>, beta: f32, accumulate: bool) {
    product(dst, a, b, beta, accumulate, false)
}

fn product(dst: &mut [f32], a: Mat<'_>, b: Mat<'_>, beta: f32, accumulate: bool, parallel: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(k, b.rows, "inner dimensions");
    assert_eq!(dst.len(), m * n, "destination size");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    for v in [a, b] {
        assert!((v.rows - 1) * v.rs + (v.cols - 1) * v.cs < v.data.len(), "view within its buffer");
    }
    let parallelism = if parallel && m * n * k >= PARALLEL_MIN && rayon::current_num_threads() > 1 {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    };
    // SAFETY: the asserts above keep every element gemm reads inside `a.data`/`b.data` and
    // every element it writes inside `dst` (row-major, m × n); `dst` is borrowed mutably, so it
    // cannot alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Linear layers with LoRA: y = x Wᵀ + b + s · (x ⊙ mask) Aᵀ Bᵀ.

/// `first_row`: the index of `x`'s first row in the layer's whole input (dropout masks are
/// indexed by element of the whole input, so row shards and chunks draw what one pass would).
fn linear_forward(l: &LinW<'_>, x: &[f32], n: usize, dropout: Option<u64>, first_row: usize, y: &mut [f32]) -> LinSave {
    let w = Mat::rm(l.w, l.out, l.inp);
    matmul(y, Mat::rm(x, n, l.inp), w.t(), 1.0, false);
    if let Some(bias) = l.bias {
        y.par_chunks_mut(l.out).for_each(|row| add(row, bias));
    }
    let Some(lo) = &l.lora else { return LinSave::default() };
    let mask = match dropout {
        Some(batch) if lo.dropout > 0.0 => {
            let key = crate::model::lora::dropout_key(batch, l.id);
            Some(crate::model::lora::dropout_factors(key, first_row * l.inp, n * l.inp, lo.dropout))
        }
        _ => None,
    };
    let xin = lora_input(x, mask.as_deref());
    let mut u = vec![0f32; n * lo.rank];
    matmul(&mut u, Mat::rm(&xin, n, l.inp), Mat::rm(lo.a, lo.rank, l.inp).t(), 1.0, false);
    matmul(y, Mat::rm(&u, n, lo.rank), Mat::rm(lo.b, l.out, lo.rank).t(), lo.scale, true);
    LinSave { u, mask }
}

/// Backward of a linear layer: LoRA gradients into `grads`, and `dx = dy W (+ LoRA)` into `dx`
/// (overwritten) when asked.
fn linear_backward(
    l: &LinW<'_>,
    s: &LinSave,
    x: &[f32],
    n: usize,
    dy: &[f32],
    dx: Option<&mut [f32]>,
    grads: &mut Grads,
) {
    linear_backward_into(l, s, x, n, dy, dx.map(|d| (d, false)), grads)
}

/// As [`linear_backward`], adding the input gradient to `dx`.
fn linear_backward_acc(l: &LinW<'_>, s: &LinSave, x: &[f32], n: usize, dy: &[f32], dx: &mut [f32], grads: &mut Grads) {
    linear_backward_into(l, s, x, n, dy, Some((dx, true)), grads)
}

fn linear_backward_into(
    l: &LinW<'_>,
    s: &LinSave,
    x: &[f32],
    n: usize,
    dy: &[f32],
    dx: Option<(&mut [f32], bool)>,
    grads: &mut Grads,
) {
    let dym = Mat::rm(dy, n, l.out);
    let mut du = Vec::new();
    if let Some(lo) = &l.lora {
        // dB = s · dyᵀ u, du = s · dy B, dA = duᵀ (x ⊙ mask).
        let gb = grad_slot(grads, &l.name, "lora_B", l.out * lo.rank);
        matmul(gb, dym.t(), Mat::rm(&s.u, n, lo.rank), lo.scale, true);
        du = vec![0f32; n * lo.rank];
        matmul(&mut du, dym, Mat::rm(lo.b, l.out, lo.rank), lo.scale, false);
        let xin = lora_input(x, s.mask.as_deref());
        let ga = grad_slot(grads, &l.name, "lora_A", lo.rank * l.inp);
        matmul(ga, Mat::rm(&du, n, lo.rank).t(), Mat::rm(&xin, n, l.inp), 1.0, true);
    }
    let Some((dx, accumulate)) = dx else { return };
    matmul(dx, dym, Mat::rm(l.w, l.out, l.inp), 1.0, accumulate);
    if let Some(lo) = &l.lora {
        let a = Mat::rm(lo.a, lo.rank, l.inp);
        match &s.mask {
            None => matmul(dx, Mat::rm(&du, n, lo.rank), a, 1.0, true),
            Some(m) => {
                let mut tmp = vec![0f32; n * l.inp];
                matmul(&mut tmp, Mat::rm(&du, n, lo.rank), a, 1.0, false);
                for ((d, g), m) in dx.iter_mut().zip(&tmp).zip(m) {
                    *d += g * m;
                }
            }
        }
    }
}

/// The adapter's input: `x ⊙ mask` with dropout, else `x` itself.
fn lora_input<'x>(x: &'x [f32], mask: Option<&[f32]>) -> std::borrow::Cow<'x, [f32]> {
    match mask {
        Some(m) => x.iter().zip(m).map(|(a, b)| a * b).collect::<Vec<f32>>().into(),
        None => x.into(),
    }
}

/// The gradient accumulator of adapter matrix `which` of `prefix`, created zeroed.
fn grad_slot<'g>(grads: &'g mut Grads, prefix: &str, which: &str, len: usize) -> &'g mut [f32] {
    grads.entry(crate::model::lora::param_name(prefix, which)).or_insert_with(|| vec![0f32; len])
}

// ---------------------------------------------------------------------------------------------
// Row-wise kernels.

/// Defines a row kernel twice — for the baseline target and with AVX2 and FMA enabled — and
/// picks one at run time. rtune's binary targets baseline x86-64 (SSE2), where these loops get
/// 4-wide vectors; AVX2 machines get 8-wide ones (the `gemm` crate dispatches the same way). Both
/// versions compute the same operations in the same order.
macro_rules! row_kernel {
    ($(#[$m:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: this CPU has AVX2 and FMA (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}

/// Reductions keep eight partial results, so that they vectorise (a single running sum is a
/// chain of dependent scalar additions).
const LANES: usize = 8;

#[inline(always)]
fn reduce(x: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = f(acc[i], c[i]);
        }
    }
    tail.iter().fold(acc.into_iter().fold(init, &f), |a, &v| f(a, v))
}

#[inline(always)]
fn sum_generic(x: &[f32]) -> f32 {
    reduce(x, 0.0, |a, b| a + b)
}

row_kernel! {
    fn max(x: &[f32]) -> f32 {
        reduce(x, f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
    }
}

row_kernel! {
    /// `Σ a·b·c` (`c` may be empty: `Σ a·b`).
    fn dot3(a: &[f32], b: &[f32], c: Option<&[f32]>) -> f32 {
        dot3_generic(a, b, c)
    }
}

#[inline(always)]
fn dot3_generic(a: &[f32], b: &[f32], c: Option<&[f32]>) -> f32 {
    let mut acc = [0f32; LANES];
    let n = a.len() / LANES * LANES;
    match c {
        Some(c) => {
            for ((a, b), c) in
                a[..n].chunks_exact(LANES).zip(b[..n].chunks_exact(LANES)).zip(c[..n].chunks_exact(LANES))
            {
                for i in 0..LANES {
                    acc[i] += a[i] * b[i] * c[i];
                }
            }
        }
        None => {
            for (a, b) in a[..n].chunks_exact(LANES).zip(b[..n].chunks_exact(LANES)) {
                for i in 0..LANES {
                    acc[i] += a[i] * b[i];
                }
            }
        }
    }
    let mut total: f32 = acc.iter().sum();
    for i in n..a.len() {
        total += a[i] * b[i] * c.map_or(1.0, |c| c[i]);
    }
    total
}

row_kernel! {
    /// `x ← e^(x − m)`; returns the sum.
    fn exp_shifted(x: &mut [f32], m: f32) -> f32 {
        for v in x.iter_mut() {
            *v = exp(*v - m);
        }
        sum_generic(x)
    }
}

row_kernel! {
    /// `x ← x · c`.
    fn scale(x: &mut [f32], c: f32) {
        for v in x.iter_mut() {
            *v *= c;
        }
    }
}

row_kernel! {
    fn add_here(dst: &mut [f32], src: &[f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += s;
        }
    }
}

/// Rows per parallel task so that each task has a few thousand elements.
fn min_rows(width: usize) -> usize {
    (16384 / width.max(1)).max(1)
}

fn add(dst: &mut [f32], src: &[f32]) {
    if dst.len() >= 1 << 16 {
        dst.par_chunks_mut(1 << 14).zip(src.par_chunks(1 << 14)).for_each(|(d, s)| add_here(d, s));
        return;
    }
    add_here(dst, src)
}

/// RMSNorm as transformers computes it, `(x · inv) · w` with `inv = 1/√(mean(x²) + eps)`;
/// returns the output and `inv` per row.
fn rms_norm(x: &[f32], w: &[f32], dims: &Dims) -> (Vec<f32>, Vec<f32>) {
    let h = dims.hidden;
    let inv: Vec<f32> = x
        .par_chunks(h)
        .with_min_len(min_rows(h))
        .map(|row| {
            let ms = dot3(row, row, None) / h as f32;
            1.0 / (ms + dims.eps).sqrt()
        })
        .collect();
    (rms_norm_with(x, &inv, w, dims), inv)
}

/// RMSNorm with the per-row `inv` already known (the backward pass recomputes outputs).
fn rms_norm_with(x: &[f32], inv: &[f32], w: &[f32], dims: &Dims) -> Vec<f32> {
    let h = dims.hidden;
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(h).zip(x.par_chunks(h)).zip(inv.par_iter()).with_min_len(min_rows(h)).for_each(
        |((y, x), &inv)| {
            for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                *y = (x * inv) * w;
            }
        },
    );
    y
}

/// `dx [+]= inv·g − x·inv³·mean(g·x)` with `g = dy ⊙ w` (the weight is frozen).
fn rms_norm_backward(x: &[f32], inv: &[f32], w: &[f32], dy: &[f32], dx: &mut [f32], accumulate: bool, dims: &Dims) {
    let h = dims.hidden;
    dx.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .zip(dy.par_chunks(h))
        .zip(inv.par_iter())
        .with_min_len(min_rows(h))
        .for_each(|(((dx, x), dy), &inv)| {
            let dot = dot3(x, dy, Some(w)) / h as f32;
            let c = inv * inv * inv * dot;
            for (((dx, x), dy), w) in dx.iter_mut().zip(x).zip(dy).zip(w) {
                let g = inv * (dy * w) - x * c;
                if accumulate {
                    *dx += g;
                } else {
                    *dx = g;
                }
            }
        });
}

/// `eˣ` to within 2 ulp, branch-free so that loops over it vectorise (libm's `expf` is a call
/// per element and takes a slow path on underflow). Exactly 0 below the smallest normal result,
/// as `expf` is (to within subnormals).
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that k·LN2_HI is exact (Cephes).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let c = x.clamp(-87.3, 88.3);
    let k = (c * LOG2E + ROUND) - ROUND;
    let r = c - k * LN2_HI - k * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let scale = f32::from_bits((((k as i32) + 127) << 23) as u32);
    if x < -87.3 { 0.0 } else { e * scale }
}

#[inline(always)]
fn silu(z: f32) -> f32 {
    z / (1.0 + exp(-z))
}

/// `silu(gate) ⊙ up`.
fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    out.par_chunks_mut(1 << 14)
        .zip(gate.par_chunks(1 << 14))
        .zip(up.par_chunks(1 << 14))
        .for_each(|((o, g), u)| swiglu_chunk(o, g, u));
    out
}

row_kernel! {
    fn swiglu_chunk(out: &mut [f32], gate: &[f32], up: &[f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu(g) * u;
        }
    }
}

row_kernel! {
    fn swiglu_backward_chunk(dg: &mut [f32], du: &mut [f32], gate: &[f32], up: &[f32], da: &[f32]) {
        for ((((dg, du), &g), &u), &da) in dg.iter_mut().zip(du).zip(gate).zip(up).zip(da) {
            let sig = 1.0 / (1.0 + exp(-g));
            *du = da * g * sig;
            *dg = da * u * sig * (1.0 + g * (1.0 - sig));
        }
    }
}

/// Gradients of `silu(gate) ⊙ up` with respect to gate and up.
fn swiglu_backward(gate: &[f32], up: &[f32], da: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dg = vec![0f32; gate.len()];
    let mut du = vec![0f32; gate.len()];
    const C: usize = 1 << 14;
    dg.par_chunks_mut(C)
        .zip(du.par_chunks_mut(C))
        .zip(gate.par_chunks(C))
        .zip(up.par_chunks(C))
        .zip(da.par_chunks(C))
        .for_each(|((((dg, du), g), u), da)| swiglu_backward_chunk(dg, du, g, u, da));
    (dg, du)
}

type Rope<'a> = (&'a [u32], &'a [f32], &'a [f32]);

/// `[n, heads·d]` rows → head-major `[b, heads, t, d]`, applying rotary embeddings
/// (`x·cos + rotate_half(x)·sin`) when given.
fn to_heads(x: &[f32], b: usize, t: usize, heads: usize, d: usize, rope: Option<Rope<'_>>) -> Vec<f32> {
    let width = heads * d;
    let mut out = vec![0f32; b * heads * t * d];
    out.par_chunks_mut(t * d).enumerate().for_each(|(bh, dst)| {
        let (bi, h) = (bh / heads, bh % heads);
        for i in 0..t {
            let src = &x[(bi * t + i) * width + h * d..][..d];
            let dst = &mut dst[i * d..][..d];
            match rope {
                None => dst.copy_from_slice(src),
                Some((pos, cos, sin)) => {
                    let p = pos[bi * t + i] as usize;
                    let (cos, sin) = (&cos[p * d..][..d], &sin[p * d..][..d]);
                    let half = d / 2;
                    for j in 0..half {
                        dst[j] = src[j] * cos[j] - src[j + half] * sin[j];
                        dst[j + half] = src[j + half] * cos[j + half] + src[j] * sin[j + half];
                    }
                }
            }
        }
    });
    out
}

/// Head-major `[b, heads, t, d]` gradients → `[n, heads·d]` rows, through the transpose of the
/// rotary embedding when given.
fn from_heads(x: &[f32], b: usize, t: usize, heads: usize, d: usize, rope: Option<Rope<'_>>) -> Vec<f32> {
    let width = heads * d;
    let mut out = vec![0f32; b * t * width];
    out.par_chunks_mut(width).with_min_len(min_rows(width)).enumerate().for_each(|(row, dst)| {
        let (bi, i) = (row / t, row % t);
        for h in 0..heads {
            let src = &x[((bi * heads + h) * t + i) * d..][..d];
            let dst = &mut dst[h * d..][..d];
            match rope {
                None => dst.copy_from_slice(src),
                Some((pos, cos, sin)) => {
                    let p = pos[row] as usize;
                    let (cos, sin) = (&cos[p * d..][..d], &sin[p * d..][..d]);
                    let half = d / 2;
                    for j in 0..half {
                        dst[j] = src[j] * cos[j] + src[j + half] * sin[j + half];
                        dst[j + half] = src[j + half] * cos[j + half] - src[j] * sin[j];
                    }
                }
            }
        }
    });
    out
}

// ---------------------------------------------------------------------------------------------
// Attention.

/// Query rows per attention block: a block of queries only meets keys up to its last row (the
/// mask is causal), so the masked upper triangle is skipped block by block.
const QUERY_BLOCK: usize = 64;

/// The query blocks of a `t`-row sequence: `(first row, rows, keys it attends to)`.
fn query_blocks(t: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..t).step_by(QUERY_BLOCK).map(move |r0| {
        let r1 = (r0 + QUERY_BLOCK).min(t);
        (r0, r1 - r0, r1)
    })
}

/// `S = Q Kᵀ/√d + mask` for one query block, over its `keys`.
fn block_scores(s: &mut [f32], qh: &[f32], kg: &[f32], mask: &[f32], block: (usize, usize, usize), dims: &Dims) {
    let ((r0, rows, keys), t, d) = (block, dims.t, dims.d);
    let scale = 1.0 / (d as f32).sqrt();
    matmul_here(s, Mat::rm(&qh[r0 * d..][..rows * d], rows, d), Mat::rm(&kg[..keys * d], keys, d).t(), scale, false);
    for (i, row) in s.chunks_mut(keys).enumerate() {
        add(row, &mask[(r0 + i) * t..][..keys]);
    }
}

/// Per (sequence, head): `P = softmax(Q Kᵀ/√d + mask)`, `O = P V`. Keeps only each row's
/// log-sum-exp (`lse`, when given): the backward pass recomputes `P` from it, so memory does not
/// grow with t² per layer.
fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    dims: &Dims,
    lse: Option<&mut [f32]>,
    out: &mut [f32],
) {
    let Dims { t, heads, kv_heads, d, .. } = *dims;
    let rep = heads / kv_heads;
    let task = |bh: usize, o: &mut [f32], lse: Option<&mut [f32]>| {
        let (bi, h) = (bh / heads, bh % heads);
        let g = bi * kv_heads + h / rep;
        let qh = &q[bh * t * d..][..t * d];
        let kg = &k[g * t * d..][..t * d];
        let vg = &v[g * t * d..][..t * d];
        let m = &mask[bi * t * t..][..t * t];
        let mut s = vec![0f32; QUERY_BLOCK * t];
        let mut lse = lse;
        for (r0, rows, keys) in query_blocks(t) {
            let s = &mut s[..rows * keys];
            block_scores(s, qh, kg, m, (r0, rows, keys), dims);
            for (i, row) in s.chunks_mut(keys).enumerate() {
                let mx = max(row);
                let total = exp_shifted(row, mx);
                scale(row, 1.0 / total);
                if let Some(l) = lse.as_deref_mut() {
                    l[r0 + i] = mx + total.ln();
                }
            }
            matmul_here(
                &mut o[r0 * d..][..rows * d],
                Mat::rm(s, rows, keys),
                Mat::rm(&vg[..keys * d], keys, d),
                1.0,
                false,
            );
        }
    };
    match lse {
        Some(lse) => out
            .par_chunks_mut(t * d)
            .zip(lse.par_chunks_mut(t))
            .enumerate()
            .for_each(|(bh, (o, l))| task(bh, o, Some(l))),
        None => out.par_chunks_mut(t * d).enumerate().for_each(|(bh, o)| task(bh, o, None)),
    }
}

/// Gradients of attention with respect to (rotated) queries, keys and values, per (sequence,
/// kv head) so that the query heads sharing a kv head accumulate into it on one thread. `dq`,
/// `dk` and `dv` must start zeroed.
#[allow(clippy::too_many_arguments)]
fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    lse: &[f32],
    dout: &[f32],
    dims: &Dims,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let Dims { t, heads, kv_heads, d, .. } = *dims;
    let rep = heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    dq.par_chunks_mut(rep * t * d).zip(dk.par_chunks_mut(t * d)).zip(dv.par_chunks_mut(t * d)).enumerate().for_each(
        |(bg, ((dq, dk), dv))| {
            let bi = bg / kv_heads;
            let kg = &k[bg * t * d..][..t * d];
            let vg = &v[bg * t * d..][..t * d];
            let m = &mask[bi * t * t..][..t * t];
            let mut p = vec![0f32; QUERY_BLOCK * t];
            let mut dp = vec![0f32; QUERY_BLOCK * t];
            for (j, dq) in dq.chunks_mut(t * d).enumerate() {
                let bh = bi * heads + (bg % kv_heads) * rep + j;
                let qh = &q[bh * t * d..][..t * d];
                let doh = &dout[bh * t * d..][..t * d];
                let lse = &lse[bh * t..][..t];
                for (r0, rows, keys) in query_blocks(t) {
                    let (p, dp) = (&mut p[..rows * keys], &mut dp[..rows * keys]);
                    // P again, from the scores and the saved log-sum-exp.
                    block_scores(p, qh, kg, m, (r0, rows, keys), dims);
                    for (i, row) in p.chunks_mut(keys).enumerate() {
                        exp_shifted(row, lse[r0 + i]);
                    }
                    let dob = Mat::rm(&doh[r0 * d..][..rows * d], rows, d);
                    let pm = Mat::rm(p, rows, keys);
                    matmul_here(dp, dob, Mat::rm(&vg[..keys * d], keys, d).t(), 1.0, false);
                    matmul_here(&mut dv[..keys * d], pm.t(), dob, 1.0, true);
                    for (dp, p) in dp.chunks_mut(keys).zip(p.chunks(keys)) {
                        let dot = dot3(dp, p, None);
                        for (dp, p) in dp.iter_mut().zip(p) {
                            *dp = p * (*dp - dot);
                        }
                    }
                    let ds = Mat::rm(dp, rows, keys);
                    matmul_here(&mut dq[r0 * d..][..rows * d], ds, Mat::rm(&kg[..keys * d], keys, d), scale, false);
                    matmul_here(&mut dk[..keys * d], ds.t(), Mat::rm(&qh[r0 * d..][..rows * d], rows, d), scale, true);
                }
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Loss.

/// Sum of cross-entropies of `[c, vocab]` logits against `targets`; with `grad_scale`, the
/// logits are replaced by `(softmax − onehot) · grad_scale`.
fn cross_entropy(logits: &mut [f32], targets: &[u32], vocab: usize, grad_scale: Option<f32>) -> f64 {
    logits
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let m = max(row);
            let picked = row[t as usize] - m;
            // The row becomes eᶻ⁻ᵐ (the logits are not needed again).
            let total = exp_shifted(row, m);
            if let Some(g) = grad_scale {
                scale(row, g / total);
                row[t as usize] -= g;
            }
            (total.ln() - picked) as f64
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (want, got) = (x.exp(), exp(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        for x in [-1e9f32, -1e4, -88.0, f32::NEG_INFINITY] {
            assert_eq!(exp(x), 0.0, "exp({x})");
        }
        assert_eq!(exp(0.0), 1.0);
    }
}
