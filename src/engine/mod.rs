//! Training engines behind one interface. The model definition (config, the architecture spec,
//! weights and their names, LoRA, attention layout) lives in [`crate::model`]; an engine computes
//! losses and gradients of that model on one kind of device and owns the trained parameters and
//! their optimizer state while a stage runs:
//!
//! - [`candle::CandleEngine`]: candle's ops and autograd — any candle device, dtype and
//!   trainable set (the reference the others are checked against);
//! - [`fused::FusedEngine`]: rtune's fused CPU engine, f32 on the CPU, built from the folder and
//!   the spec; its trained parameters step as candle's engine steps its own ([`params`]);
//! - [`gpu::GpuEngine`]: an explicit forward and backward pass of training (LoRA adapters, base
//!   weights, or both) over device buffers — fused kernels, matrix-unit attention that never
//!   stores probabilities, activation checkpointing, the LM head and loss in chunks, AdamW on
//!   device — on NVIDIA GPUs through CUDA (`--features cuda`) and on any GPU with a Vulkan
//!   driver (the default `vulkan` feature).
//!
//! [`build`] picks one for a device and trainable set; the training loop
//! ([`crate::train`]), evaluation and exports only talk to the [`Engine`] trait. The loop's
//! "gradients are ready" point is between [`Engine::accumulate`] and [`Engine::apply`], where a
//! data-parallel run would all-reduce.

pub mod candle;
pub mod fused;
pub mod gpu;
pub mod params;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::Tensor;

use crate::device::{DeviceClass, Resolution};
use crate::engine::params::AdamWConfig;
use crate::model::batch::{AttentionLayout, attention_layout};
use crate::model::{ModelConfig, ModelFolder, Trainable};

/// Where each projection sits in a decoder layer's list of linears, in both fused engines
/// (CPU and GPU): attention q, k, v, o, then the MLP's gate, up and down.
pub(crate) const Q: usize = 0;
pub(crate) const K: usize = 1;
pub(crate) const V: usize = 2;
pub(crate) const O: usize = 3;
pub(crate) const GATE: usize = 4;
pub(crate) const UP: usize = 5;
pub(crate) const DOWN: usize = 6;

/// One micro-batch as the host prepares it: padded token ids, the attention structure, and the
/// positions whose next token the loss counts. No device data: engines upload what they need
/// on the thread that runs them.
#[derive(Debug, Clone)]
pub struct HostBatch {
    pub b: usize,
    pub t: usize,
    /// `[b, t]` token ids, 0 after each row's end.
    pub ids: Vec<u32>,
    pub lens: Vec<usize>,
    pub layout: AttentionLayout,
    /// Flattened `[b·t]` positions whose next token is a target, ascending.
    pub select: Vec<u32>,
    pub targets: Vec<u32>,
    /// Real (non-padding) tokens.
    pub tokens: usize,
}

impl HostBatch {
    /// Rows of token ids with their packed-document indices and loss masks: position `j` is
    /// selected when token `j + 1` is a target (`mask[j + 1] == 1`) of the same document.
    pub fn new(rows: &[(&[u32], &[u16], &[u8])]) -> HostBatch {
        let b = rows.len();
        let t = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
        let mut ids = vec![0u32; b * t];
        let (mut select, mut targets) = (Vec::new(), Vec::new());
        for (r, (row, seg, mask)) in rows.iter().enumerate() {
            ids[r * t..r * t + row.len()].copy_from_slice(row);
            for j in 1..row.len() {
                if mask[j] == 1 && seg[j] == seg[j - 1] {
                    select.push((r * t + j - 1) as u32);
                    targets.push(row[j]);
                }
            }
        }
        let lens: Vec<usize> = rows.iter().map(|r| r.0.len()).collect();
        let segs: Vec<Vec<u16>> = rows.iter().map(|r| r.1.to_vec()).collect();
        let layout = attention_layout(t, &lens, Some(&segs));
        let tokens = lens.iter().sum();
        HostBatch { b, t, ids, lens, layout, select, targets, tokens }
    }

    /// A batch of padded rows with explicit selected positions (tests, self-checks).
    pub fn from_parts(
        rows: &[Vec<u32>],
        lens: &[usize],
        segments: Option<&[Vec<u16>]>,
        select: Vec<u32>,
        targets: Vec<u32>,
    ) -> HostBatch {
        let b = rows.len();
        let t = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = vec![0u32; b * t];
        for (r, row) in rows.iter().enumerate() {
            ids[r * t..r * t + row.len()].copy_from_slice(row);
        }
        let layout = attention_layout(t, lens, segments);
        HostBatch { b, t, ids, lens: lens.to_vec(), layout, select, targets, tokens: lens.iter().sum() }
    }

    /// Rows `rows` as a batch of their own, padded to the same length, and where they start in
    /// this one (data parallel: each device takes some of a micro-batch's rows, and counts its
    /// dropout masks from there, so the masks are the whole micro-batch's).
    pub fn part(&self, rows: std::ops::Range<usize>) -> (HostBatch, Origin) {
        assert!(rows.start <= rows.end && rows.end <= self.b, "rows {rows:?} of a batch of {}", self.b);
        let t = self.t;
        let (first, last) = (rows.start * t, rows.end * t);
        let from = self.select.partition_point(|&s| (s as usize) < first);
        let to = self.select.partition_point(|&s| (s as usize) < last);
        let lens = self.lens[rows.clone()].to_vec();
        let part = HostBatch {
            b: rows.len(),
            t,
            ids: self.ids[first..last].to_vec(),
            layout: AttentionLayout {
                positions: self.layout.positions[first..last].to_vec(),
                lo: self.layout.lo[first..last].to_vec(),
                hi: self.layout.hi[first..last].to_vec(),
            },
            select: self.select[from..to].iter().map(|&s| s - first as u32).collect(),
            targets: self.targets[from..to].to_vec(),
            tokens: lens.iter().sum(),
            lens,
        };
        (part, Origin { token: first, select: from })
    }

    /// The rows as candle's [`crate::model::Batch`] expects them (unpadded ids per row).
    pub fn rows(&self) -> Vec<Vec<u32>> {
        (0..self.b).map(|r| self.ids[r * self.t..r * self.t + self.lens[r].min(self.t)].to_vec()).collect()
    }
}

/// Where a [`HostBatch::part`] starts in its micro-batch: its first token (row × `t`) and its
/// first selected position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Origin {
    pub token: usize,
    pub select: usize,
}

/// Trained parameters and optimizer state, on the host, by parameter name (checkpoints).
#[derive(Debug, Clone)]
pub struct EngineState {
    pub params: BTreeMap<String, Tensor>,
    pub ema: Option<BTreeMap<String, Tensor>>,
    pub m: BTreeMap<String, Tensor>,
    pub v: BTreeMap<String, Tensor>,
    pub optimizer_step: u64,
}

/// What an engine does for training, evaluation and generation.
pub trait Engine {
    /// `fused CPU engine`, `candle autograd`, `GPU engine (NVIDIA H100 80GB HBM3, bf16)`.
    fn describe(&self) -> String;

    /// Trained values (parameters), 0 when nothing trains.
    fn trained_count(&self) -> usize;

    /// Forward and backward pass of one micro-batch: adds the gradients of
    /// `loss_scale × weight × loss` (the batch's mean loss) to the step's, and `weight × loss` to
    /// the step's loss. `loss_scale` keeps f16 gradients from underflowing (1 otherwise);
    /// `dropout` is the micro-batch's dropout key ([`crate::model::lora::batch_dropout_key`]).
    fn accumulate(
        &mut self,
        batch: &HostBatch,
        weight: f64,
        loss_scale: f64,
        dropout: Option<u64>,
    ) -> Result<(), EngineError>;

    /// The step's weighted loss and the global norm of its (loss-scaled) gradients, once its
    /// micro-batches are in.
    fn gradients(&mut self) -> Result<(f64, f64), EngineError>;

    /// AdamW with learning rate `lr` on the gradients times `grad_scale` (clipping over the loss
    /// scale), then the EMA update; clears the step's gradients.
    fn apply(&mut self, lr: f64, grad_scale: f64) -> Result<(), EngineError>;

    /// Clear the step's gradients without an update (a skipped step).
    fn discard(&mut self) -> Result<(), EngineError>;

    /// Mean loss of a batch's selected positions, no gradients.
    fn loss(&mut self, batch: &HostBatch) -> Result<f64, EngineError>;

    /// f32 logits of the token after `ids` (generation). Consecutive calls whose `ids` extend
    /// the previous call's may reuse work.
    fn next_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>, EngineError>;

    /// Parameters, EMA and optimizer state for a checkpoint.
    fn state(&self) -> Result<EngineState, EngineError>;

    /// Continue from a checkpoint's state.
    fn restore(&mut self, state: &EngineState) -> Result<(), EngineError>;

    /// The gradients accumulated since the last step, f32 by parameter name (tests and
    /// diagnostics).
    fn gradient_values(&self) -> Result<BTreeMap<String, Tensor>, EngineError>;

    /// The trained values to export: the EMA weights when kept, else the parameters.
    fn trained(&self) -> Result<BTreeMap<String, Tensor>, EngineError>;

    /// Peak device memory held by this engine's allocations, where the device reports it.
    fn peak_memory(&self) -> Option<u64> {
        None
    }

    /// Which kernels ran the last step's products and attention, in words, where the device
    /// decides at run time (the GPU engine: first-use checks of the matrix units).
    fn kernels(&self) -> Option<String> {
        None
    }

    /// Estimated device bytes of a training step of `rows × seq` tokens with or without
    /// activation checkpointing, and the device's total, where the engine models its memory.
    fn memory_estimate(&self, _rows: usize, _seq: usize, _checkpointing: bool) -> Option<(u64, u64)> {
        None
    }

    /// Whether decoder layers recompute their activations in the backward pass.
    fn checkpointing(&self) -> bool {
        false
    }
}

/// Why an engine failed.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum EngineError {
    #[error("{context}")]
    #[diagnostic(code(rtune::engine::compute))]
    Candle {
        context: String,
        #[source]
        source: candle_core::Error,
    },
    #[error("{context}: {source}")]
    #[diagnostic(code(rtune::engine::device))]
    Gpu {
        context: String,
        #[source]
        source: gpu::GpuError,
    },
    #[error("{context}: {why}")]
    #[diagnostic(
        code(rtune::engine::device_lost),
        help(
            "the driver reset the GPU, or it went away. The usual cause is a kernel running longer than \
             the driver's watchdog allows on a GPU that also drives a display (about 2 seconds on Windows): \
             a smaller `stages.train.batch_size` (with more `grad_accum`) or `dataset.max_seq_len` makes each \
             kernel shorter. Cached stages and training checkpoints are kept: run the same command again to \
             resume"
        )
    )]
    DeviceLost { context: String, why: String },
    #[error("the GPU ran out of memory while {context} (batch {batch} × {seq} tokens)")]
    #[diagnostic(code(rtune::engine::out_of_memory))]
    OutOfMemory { context: String, batch: usize, seq: usize, requested: u64, free: u64, total: u64 },
    #[error("{0}")]
    #[diagnostic(code(rtune::engine::unsupported))]
    Unsupported(String),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Model(#[from] crate::model::ModelError),
}

impl EngineError {
    /// A GPU engine's error in `context`: a lost device is its own error (it says what to do).
    pub fn gpu(context: impl Into<String>, source: gpu::GpuError) -> EngineError {
        match source {
            gpu::GpuError::Lost(why) => EngineError::DeviceLost { context: context.into(), why },
            source => EngineError::Gpu { context: context.into(), source },
        }
    }

    pub fn candle(context: impl Into<String>) -> impl FnOnce(candle_core::Error) -> EngineError {
        let context = context.into();
        move |source| EngineError::Candle { context, source }
    }
}

/// The error for `stages.train.trainable` patterns that name none of the model's weights (an
/// engine would train nothing).
pub fn no_weight_matches(patterns: &[String]) -> EngineError {
    EngineError::Unsupported(format!(
        "`stages.train.trainable` ({}) matches none of the model's weights, which are named like \
         `model.layers.0.self_attn.q_proj.weight` and `model.norm.weight`",
        patterns.iter().map(|p| format!("\"{p}\"")).collect::<Vec<_>>().join(", ")
    ))
}

/// Which engine runs a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// [`crate::engine::fused`] on the CPU.
    Fused,
    /// candle's ops and autograd.
    Candle,
    /// [`gpu::GpuEngine`].
    Gpu,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Fused => "fused",
            EngineKind::Candle => "candle",
            EngineKind::Gpu => "gpu",
        }
    }
}

/// Activation checkpointing (recompute each decoder layer's activations in the backward pass
/// instead of keeping them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkpointing {
    On,
    Off,
    /// On when the estimated activations would not fit in free device memory.
    Auto,
}

/// Everything an engine is built from.
pub struct Setup<'a> {
    pub folder: &'a ModelFolder,
    pub trainable: Trainable,
    /// Seeds LoRA initialisation.
    pub seed: u64,
    pub device: &'a Resolution,
    /// None: evaluation only.
    pub optimizer: Option<AdamWConfig>,
    pub ema_decay: Option<f64>,
    pub checkpointing: Checkpointing,
    /// A train stage's output to start from: a PEFT adapter folder (with a LoRA trainable), or
    /// a folder with `weights.safetensors` replacing base weights.
    pub trained: Option<&'a Path>,
    /// The largest batch the engine will see, `(rows, tokens per row)` (memory planning).
    pub max_batch: (usize, usize),
    /// Use TF32 tensor cores for f32 products (CUDA).
    pub tf32: bool,
    /// The engine asked for (`RTUNE_ENGINE`, fingerprinted by the plan); None: the default.
    pub engine: Option<&'a str>,
    /// Keep the decoder layers' linear weights in 4 bits (`adapter.quantize_base`,
    /// [`crate::model::nf4`]).
    pub base_quant: Option<crate::recipe::BaseQuant>,
}

/// The engine `RTUNE_ENGINE` asks for, if any ([`crate::switches`]). It changes the last bits of
/// results, so the plan reads it into the keys of the stages it affects, and engines are built
/// from those.
pub fn requested() -> Option<String> {
    crate::switches::Switches::get().engine.clone()
}

pub use crate::device::vulkan_engine_refused;

/// The engine for a model on `device`, whatever trains: the GPU engine on CUDA and Vulkan and the
/// fused engine on the CPU in f32 where they support the model, else candle's autograd (which
/// has no Vulkan backend: there the GPU engine's limits are an error). `requested`
/// (`RTUNE_ENGINE=candle|fused|gpu`) asks for one (to compare engines); asking for one that
/// cannot run the model is an error.
pub fn choose(cfg: &ModelConfig, device: &Resolution, requested: Option<&str>) -> Result<EngineKind, EngineError> {
    let spec = crate::model::Spec::of(cfg);
    let fused_why = spec.unsupported("fused CPU engine", fused::FEATURES);
    let fused_ok = device.class == DeviceClass::Cpu && device.dtype == crate::recipe::Dtype::F32 && fused_why.is_none();
    let candle_why = spec.unsupported("candle engine", candle::FEATURES);
    let gpu_why = gpu::unsupported(cfg, device);
    // candle has no Vulkan backend: on a Vulkan device the GPU engine is the only engine.
    if device.class == DeviceClass::Vulkan {
        return match (vulkan_engine_refused(requested), gpu_why) {
            (None, None) => Ok(EngineKind::Gpu),
            (Some(why), None) => Err(EngineError::Unsupported(why)),
            (_, Some(why)) => Err(EngineError::Unsupported(format!(
                "{}: on Vulkan devices rtune trains with its GPU engine only, and {why} (use `prefer = [\"cpu\"]` or a CUDA device for this)",
                device.device_name()
            ))),
        };
    }
    match requested {
        None => {}
        Some("candle") => {
            return match candle_why {
                None => Ok(EngineKind::Candle),
                Some(why) => Err(EngineError::Unsupported(format!("RTUNE_ENGINE=candle: {why}"))),
            };
        }
        Some("fused") if fused_ok => return Ok(EngineKind::Fused),
        Some("fused") => {
            return Err(EngineError::Unsupported(format!(
                "RTUNE_ENGINE=fused: {}",
                fused_why.unwrap_or_else(|| "the fused CPU engine computes in f32 on the CPU".into())
            )));
        }
        Some("gpu") => {
            return match gpu_why {
                None => Ok(EngineKind::Gpu),
                Some(why) => Err(EngineError::Unsupported(format!("RTUNE_ENGINE=gpu: {why}"))),
            };
        }
        Some(other) => {
            return Err(EngineError::Unsupported(format!(
                "RTUNE_ENGINE=`{other}` is not an engine (auto, candle, fused or gpu)"
            )));
        }
    }
    Ok(if gpu_why.is_none() {
        EngineKind::Gpu
    } else if fused_ok {
        EngineKind::Fused
    } else if let Some(why) = candle_why {
        return Err(EngineError::Unsupported(why));
    } else {
        EngineKind::Candle
    })
}

/// Build the engine [`choose`] picks.
pub fn build(setup: &Setup<'_>) -> Result<Box<dyn Engine>, EngineError> {
    match choose(&setup.folder.config, setup.device, setup.engine)? {
        EngineKind::Gpu => gpu::build(setup),
        _ if !setup.device.peers.is_empty() => Err(EngineError::Unsupported(format!(
            "data parallel training (`device.gpus`) runs on the GPU engine, which cannot run this model ({}): \
             without `device.gpus`, candle's engine runs it on one GPU",
            gpu::unsupported(&setup.folder.config, setup.device)
                .unwrap_or_else(|| "RTUNE_ENGINE asks for another".into())
        ))),
        EngineKind::Fused => Ok(Box::new(fused::FusedEngine::build(setup)?)),
        EngineKind::Candle => Ok(Box::new(candle::CandleEngine::build(setup)?)),
    }
}

/// Tensors by name.
type Named = BTreeMap<String, Tensor>;

/// The f32 base weights an engine on the host's side of `device` starts from, by Hugging Face
/// name: the folder's, a 4-bit base as the values it stands for (the math of the GPU engine's
/// packed weights, without their memory saving), and what the train stage's output
/// (`setup.trained`) replaces; with that output's adapter matrices, where it has them.
pub(crate) fn start_weights(
    setup: &Setup<'_>,
    device: &candle_core::Device,
) -> Result<(Named, Option<Named>), EngineError> {
    use crate::model::nf4;
    let trained = match setup.trained {
        Some(dir) => crate::model::read_trained(dir, device)?,
        None => Default::default(),
    };
    let mut weights = setup.folder.load_weights(device, candle_core::DType::F32)?;
    for (name, w) in weights.iter_mut() {
        if let Some(quant) = nf4::stored(setup.base_quant, &setup.trainable, name)? {
            let v: Vec<f32> =
                w.flatten_all().and_then(|t| t.to_vec1()).map_err(EngineError::candle("read a weight"))?;
            let v = nf4::round_trip(&v, quant);
            *w = Tensor::from_vec(v, w.dims(), device).map_err(EngineError::candle("dequantize a weight"))?;
        }
    }
    weights.extend(trained.base);
    Ok((weights, trained.adapters))
}

/// Token-weighted mean loss over (at most `max_batches` batches of) a split, and the number of
/// positions it counted.
pub fn evaluate(
    engine: &mut dyn Engine,
    store: &crate::data::TokenStore,
    batch_size: usize,
    max_batches: u64,
) -> Result<(f64, usize), EngineError> {
    let (mut sum, mut n) = (0f64, 0usize);
    let idx: Vec<usize> = (0..store.len()).collect();
    for (b, chunk) in idx.chunks(batch_size.max(1)).enumerate() {
        if max_batches > 0 && b as u64 >= max_batches {
            break;
        }
        let rows: Vec<_> = chunk.iter().map(|&i| store.row(i)).collect();
        let parts: Vec<(&[u32], &[u16], &[u8])> =
            rows.iter().map(|r| (r.ids.as_slice(), r.seg.as_slice(), r.mask.as_slice())).collect();
        let batch = HostBatch::new(&parts);
        if batch.select.is_empty() {
            continue;
        }
        let loss = engine.loss(&batch)?;
        sum += loss * batch.select.len() as f64;
        n += batch.select.len();
    }
    Ok((if n > 0 { sum / n as f64 } else { f64::NAN }, n))
}

#[cfg(test)]
mod tests {
    use super::HostBatch;

    /// A part of a batch is its rows, padded as they were, with the selected positions counted
    /// from the part's start, and its origin says where that is.
    #[test]
    fn a_batch_part_is_its_rows_with_where_they_start() {
        let rows: [(&[u32], &[u16], &[u8]); 3] = [
            (&[1, 2, 3, 4, 5], &[0, 0, 0, 1, 1], &[1, 1, 1, 1, 1]),
            (&[6, 7], &[0, 0], &[0, 1]),
            (&[8, 9, 10, 11], &[0, 0, 0, 0], &[1, 1, 0, 1]),
        ];
        let whole = HostBatch::new(&rows);
        assert_eq!(whole.t, 5);
        for (from, to) in [(0, 1), (1, 3), (0, 3), (2, 3), (1, 1)] {
            let (part, origin) = whole.part(from..to);
            let alone = HostBatch::new(&rows[from..to]);
            assert_eq!((part.b, part.t, origin.token), (to - from, 5, from * 5));
            assert_eq!(part.ids, whole.ids[from * 5..to * 5]);
            assert_eq!(part.lens, alone.lens);
            assert_eq!(part.tokens, alone.tokens);
            // The same positions and targets as the rows alone (padded to the whole batch's
            // length), and they are the whole batch's from `origin.select` on.
            let n = part.select.len();
            assert_eq!(part.targets, alone.targets);
            assert_eq!(
                part.select.iter().map(|&s| s as usize + origin.token).collect::<Vec<_>>(),
                whole.select[origin.select..origin.select + n].iter().map(|&s| s as usize).collect::<Vec<_>>()
            );
            assert_eq!(part.layout.positions, whole.layout.positions[from * 5..to * 5]);
            assert_eq!(part.layout.hi, whole.layout.hi[from * 5..to * 5]);
        }
    }
}
