//! The training loop: seeded shuffling, micro-batches with gradient accumulation (weighted so
//! that batch 8 × accum 1 equals batch 2 × accum 4), AdamW, warm-up + decay schedules, global
//! gradient-norm clipping, a loss guard, periodic evaluation with early stopping, EMA weights,
//! and resumable checkpoints.
//!
//! The engine ([`crate::engine`]) computes losses and gradients and owns the trained parameters;
//! this loop decides what each step does. Data parallel training (`device.gpus`) lives behind
//! the same interface ([`crate::engine::gpu::Replicas`]): its `accumulate` shares each
//! micro-batch's rows among the devices and its `gradients` sums theirs, at the seam between
//! "gradients are ready" and the optimizer step in `Trainer::step`; nothing here assumes a
//! single device.

mod checkpoint;
mod curve;
pub mod schedule;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::data::{TokenStore, tokens::TokenRow};
use crate::device::Resolution;
use crate::engine::params::AdamWConfig;
use crate::engine::{Checkpointing, Engine, EngineError, EngineKind, HostBatch, Setup};
use crate::model::{LoraSpec, ModelFolder, Trainable};
use crate::recipe::{Adapter, GradientCheckpointing, TrainSettings};
use crate::rng::Rng;
use crate::ui::Ui;

/// Set by the binary's Ctrl-C handler; the loop saves a checkpoint and stops.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum TrainError {
    #[error("training stopped by the loss guard after {bad_steps} bad steps (last loss {last_loss})")]
    #[diagnostic(
        code(rtune::train::loss_guard),
        help(
            "the learning rate is probably too high: lower `stages.train.learning_rate`, add warm-up, or set `clip_grad_norm`; nothing was written to the cache"
        )
    )]
    LossGuard { bad_steps: u32, last_loss: f64, report: Vec<String> },
    #[error("training interrupted at step {step}; checkpoint saved in `{checkpoint}`")]
    #[diagnostic(code(rtune::train::interrupted), help("run the same command again to resume from the checkpoint"))]
    Interrupted { step: u64, checkpoint: String },
    #[error("{why}")]
    #[diagnostic(
        code(rtune::train::too_long),
        help(
            "set `dataset.max_seq_len` to {fit} or less (longer rows are truncated, or dropped with `truncate = false`)"
        )
    )]
    TooLong { why: String, fit: usize },
    #[error("the training split is empty")]
    #[diagnostic(code(rtune::train::no_data), help("lower `dataset.eval_fraction` or add rows"))]
    NoData,
    #[error("{message}")]
    #[diagnostic(code(rtune::train::out_of_memory), help("{help}"))]
    OutOfMemory { message: String, help: String },
    #[error(transparent)]
    #[diagnostic(transparent)]
    Engine(#[from] crate::engine::EngineError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Data(#[from] crate::data::DataError),
    #[error("{context}")]
    #[diagnostic(code(rtune::train::compute))]
    Candle {
        context: String,
        #[source]
        source: candle_core::Error,
    },
    #[error("{context}")]
    #[diagnostic(code(rtune::train::io))]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn cerr(context: &str) -> impl FnOnce(candle_core::Error) -> TrainError + '_ {
    move |source| TrainError::Candle { context: context.to_string(), source }
}

fn ioerr(context: String) -> impl FnOnce(std::io::Error) -> TrainError {
    move |source| TrainError::Io { context, source }
}

/// Everything a training run needs.
pub struct TrainJob<'a> {
    pub model_dir: &'a Path,
    pub tokens_dir: &'a Path,
    pub settings: &'a TrainSettings,
    pub adapter: &'a Adapter,
    pub seed: u64,
    /// The device and compute dtype the policy chose.
    pub device: &'a Resolution,
    /// Let f32 products use TF32 tensor cores (`device.tf32`).
    pub tf32: bool,
    /// The engine asked for (`RTUNE_ENGINE`); None: the default for the device.
    pub engine: Option<&'a str>,
    /// Checkpoints live here; a run finding one resumes from it.
    pub work: PathBuf,
    /// The artifact being built.
    pub out: &'a Path,
    pub ui: &'a Ui,
}

/// The state a checkpoint restores (besides weights and optimizer moments).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LoopState {
    pub step: u64,
    /// Micro-batches consumed since the start of training (it also keys dropout masks).
    pub micro: u64,
    pub lr_scale: f64,
    pub bad_steps: u32,
    pub recent_losses: Vec<f64>,
    pub best_eval: Option<f64>,
    pub evals_without_improvement: u32,
    pub tokens_seen: u64,
    /// Dynamic loss scale of f16 training (1 in other dtypes), and the steps since it changed.
    pub loss_scale: f64,
    pub scale_steps: u32,
}

/// The LoRA spec a recipe's `[adapter]` describes.
pub fn lora_spec(a: &Adapter) -> LoraSpec {
    let mut targets: Vec<String> = a.targets.iter().map(|t| t.as_str().to_string()).collect();
    targets.sort();
    LoraSpec { rank: a.rank, alpha: a.alpha, rslora: a.rslora, dropout: a.dropout, targets }
}

/// Which weights train, from `[adapter]` and `stages.train.trainable`: `"adapter"` (the default
/// with LoRA) trains the adapter, and weight patterns beside it (`"all"` is `"*"`) train those
/// base weights in full, alone or with the adapter. (`plan` refuses `"adapter"` without one.)
pub fn trainable(settings: &TrainSettings, adapter: &Adapter) -> Trainable {
    let patterns = settings.trainable.as_deref();
    let lora = trains_adapter(patterns, adapter.kind).then(|| lora_spec(adapter));
    let mut weights: Vec<String> = patterns
        .unwrap_or_default()
        .iter()
        .filter(|p| *p != ADAPTER)
        .map(|p| if p == "all" { "*".to_string() } else { p.clone() })
        .collect();
    if lora.is_none() && weights.is_empty() {
        weights.push("*".into());
    }
    Trainable { lora, weights }
}

pub use crate::recipe::{ADAPTER, trains_adapter};

/// The first loss scale of f16 training and the good steps after which it doubles
/// (`torch.amp.GradScaler`'s defaults).
const F16_LOSS_SCALE: f64 = 65536.0;
const LOSS_SCALE_GROWTH_STEPS: u32 = 2000;

/// Build `rows` into a micro-batch.
fn host_batch(rows: &[TokenRow]) -> HostBatch {
    let parts: Vec<(&[u32], &[u16], &[u8])> =
        rows.iter().map(|r| (r.ids.as_slice(), r.seg.as_slice(), r.mask.as_slice())).collect();
    HostBatch::new(&parts)
}

/// Token-weighted mean loss over (at most `max_batches` batches of) a split.
pub fn evaluate(
    engine: &mut dyn Engine,
    store: &TokenStore,
    batch_size: usize,
    max_batches: u64,
) -> Result<(f64, usize), TrainError> {
    Ok(crate::engine::evaluate(engine, store, batch_size, max_batches)?)
}

/// How an epoch's rows are ordered into micro-batches.
#[derive(Debug, Clone, Copy)]
struct Batching {
    seed: u64,
    batch_size: usize,
    group_by_length: bool,
}

/// Prepare micro-batches from number `start` on, in order, on a background thread; it stops
/// when the receiver is dropped. The bounded channel keeps it at most four batches ahead. The
/// batches are host data: the engine moves them to its device on the training thread, so no
/// device work is ever issued from this thread (on a GPU it would run on another stream,
/// unordered with the training thread's).
fn prefetch(
    train: std::sync::Arc<TokenStore>,
    batching: Batching,
    micro_per_epoch: u64,
    start: u64,
) -> std::sync::mpsc::Receiver<HostBatch> {
    let Batching { batch_size, .. } = batching;
    let (tx, rx) = std::sync::mpsc::sync_channel(4);
    std::thread::spawn(move || {
        let mut epoch = u64::MAX;
        let mut order = Vec::new();
        for micro in start.. {
            let e = micro / micro_per_epoch;
            if e != epoch {
                order = epoch_order(&train, batching, e);
                epoch = e;
            }
            let index = (micro % micro_per_epoch) as usize;
            let rows: Vec<TokenRow> = order[index * batch_size..((index + 1) * batch_size).min(order.len())]
                .iter()
                .map(|&i| train.row(i))
                .collect();
            if tx.send(host_batch(&rows)).is_err() {
                break;
            }
        }
    });
    rx
}

/// Rows per length group with `group_by_length`, in batches (transformers' "megabatch").
const LENGTH_GROUP_BATCHES: usize = 50;

/// The order of training rows in `epoch`: a seeded shuffle, and with `group_by_length` each
/// group of 50 batches sorted longest first, so that a batch holds rows of similar length. The
/// order of groups stays random, and every row is seen once per epoch either way.
fn epoch_order(train: &TokenStore, batching: Batching, epoch: u64) -> Vec<usize> {
    let Batching { seed, batch_size, group_by_length } = batching;
    epoch_rows(train.len(), |i| train.row_len(i), seed, epoch, batch_size, group_by_length)
}

/// [`epoch_order`] for `n` rows whose lengths `len` gives (public for benchmarks).
pub fn epoch_rows(
    n: usize,
    len: impl Fn(usize) -> usize,
    seed: u64,
    epoch: u64,
    batch_size: usize,
    group_by_length: bool,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    Rng::derive(seed, &format!("shuffle:{epoch}")).shuffle(&mut order);
    if group_by_length {
        for group in order.chunks_mut(LENGTH_GROUP_BATCHES * batch_size.max(1)) {
            // Stable, so ties keep the shuffled order.
            group.sort_by_key(|&i| std::cmp::Reverse(len(i)));
        }
    }
    order
}

struct Trainer<'a> {
    job: &'a TrainJob<'a>,
    engine: Box<dyn Engine>,
    state: LoopState,
    train: std::sync::Arc<TokenStore>,
    eval: TokenStore,
    /// Micro-batches prepared ahead on a background thread.
    prefetch: Option<std::sync::mpsc::Receiver<HostBatch>>,
    micro_per_epoch: u64,
    total_steps: u64,
    metrics: std::fs::File,
    /// Steady-state throughput: seconds and tokens of the optimizer steps after the first of
    /// this run (the first pays one-time costs: kernel compilation, allocator growth).
    timed: (f64, u64),
    /// Seconds the host spent issuing those steps' forward and backward passes (before waiting
    /// for their results): near the step time, the host is the bottleneck.
    issued: f64,
    last_issue: f64,
    timed_steps: u64,
    /// The linear weights' bytes as they are and in 4 bits, when an adapter trains over a
    /// full-precision base on a GPU (what an out-of-memory error suggests).
    quantizable: Option<(u64, u64)>,
}

/// Run (or resume) training; writes the trained weights, metrics and curve into `job.out`.
/// The longest row of `stores`, or an error when rows are longer than the model computes
/// exactly (its positions, or Mistral's sliding window): before any engine runs, and naming the
/// setting that fixes it.
pub fn check_lengths(cfg: &crate::model::ModelConfig, stores: &[&TokenStore]) -> Result<usize, TrainError> {
    let longest = stores.iter().flat_map(|s| (0..s.len()).map(|i| s.row_len(i))).max().unwrap_or(0);
    match cfg.sequence_too_long(longest) {
        Some(why) => Err(TrainError::TooLong { why, fit: cfg.max_positions() }),
        None => Ok(longest),
    }
}

pub fn train(job: &TrainJob<'_>) -> Result<serde_json::Value, TrainError> {
    let s = job.settings;
    let which = trainable(s, job.adapter);
    let folder = ModelFolder::open(job.model_dir)?;
    let train = TokenStore::open(job.tokens_dir, "train")?;
    let eval = TokenStore::open(job.tokens_dir, "eval")?;
    if train.is_empty() {
        return Err(TrainError::NoData);
    }
    let bs = s.batch_size as u64;
    let micro_per_epoch = (train.len() as u64).div_ceil(bs);
    let steps_per_epoch = micro_per_epoch.div_ceil(s.grad_accum as u64);
    let total_steps = s.max_steps.unwrap_or(steps_per_epoch * s.epochs as u64);
    let cfg = AdamWConfig { beta1: s.betas[0], beta2: s.betas[1], eps: s.adam_eps, weight_decay: s.weight_decay };
    let longest = check_lengths(&folder.config, &[&train, &eval])?;
    let on_gpu = matches!(job.device.class, crate::device::DeviceClass::Cuda | crate::device::DeviceClass::Vulkan);
    let quantizable = (on_gpu && which.lora.is_some() && job.adapter.quantize_base.is_none()).then(|| {
        let bytes = if job.device.dtype == crate::recipe::Dtype::F32 { 4 } else { 2 };
        crate::model::nf4::linear_bytes(&folder.config, bytes)
    });
    let setup = Setup {
        folder: &folder,
        trainable: which,
        seed: job.seed,
        device: job.device,
        optimizer: Some(cfg),
        ema_decay: s.ema.as_ref().map(|e| e.decay),
        checkpointing: match s.gradient_checkpointing {
            GradientCheckpointing::Auto(_) => Checkpointing::Auto,
            GradientCheckpointing::On(true) => Checkpointing::On,
            GradientCheckpointing::On(false) => Checkpointing::Off,
        },
        trained: None,
        max_batch: (s.batch_size as usize, longest),
        tf32: job.tf32,
        engine: job.engine,
        base_quant: job.adapter.quantize_base,
    };
    let engine = crate::engine::build(&setup).map_err(|e| out_of_memory(e, s, None, quantizable))?;
    if s.gradient_checkpointing == GradientCheckpointing::On(true) && !engine.checkpointing() {
        job.ui.warn(format!(
            "gradient_checkpointing applies to the GPU engine; the {} keeps every activation",
            engine.describe()
        ));
    }
    let packed = crate::engine::choose(&folder.config, job.device, job.engine).ok() == Some(EngineKind::Gpu);
    if job.adapter.quantize_base.is_some() && !packed {
        job.ui.warn(format!(
            "the {} computes with the 4-bit base's values but holds them dequantized: QLoRA's numbers \
             without its memory saving (the GPU engine keeps the packed weights)",
            engine.describe()
        ));
    }
    std::fs::create_dir_all(&job.work).map_err(ioerr(format!("cannot create `{}`", job.work.display())))?;
    let state = LoopState {
        step: 0,
        micro: 0,
        lr_scale: 1.0,
        bad_steps: 0,
        recent_losses: Vec::new(),
        best_eval: None,
        evals_without_improvement: 0,
        tokens_seen: 0,
        loss_scale: if job.device.dtype == crate::recipe::Dtype::F16 { F16_LOSS_SCALE } else { 1.0 },
        scale_steps: 0,
    };
    let metrics_path = job.work.join("metrics.jsonl");
    let mut t = Trainer {
        job,
        engine,
        state,
        train: std::sync::Arc::new(train),
        eval,
        prefetch: None,
        micro_per_epoch,
        total_steps,
        metrics: std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&metrics_path)
            .map_err(ioerr(format!("cannot open `{}`", metrics_path.display())))?,
        timed: (0.0, 0),
        issued: 0.0,
        last_issue: 0.0,
        timed_steps: 0,
        quantizable,
    };
    let resumed = checkpoint::latest(&job.work).map(|ck| t.restore(&ck)).transpose()?;
    let n_params = t.engine.trained_count();
    match resumed {
        Some(step) => job.ui.status("resume", format!("continuing from the checkpoint at step {step}/{total_steps}")),
        None => {
            checkpoint::truncate_metrics(&metrics_path, 0).map_err(ioerr("cannot reset metrics".into()))?;
            job.ui.status(
                "train",
                format!(
                    "{total_steps} steps, {} train sequences, batch {} × accum {}, {n_params} trained parameters, {}",
                    t.train.len(),
                    s.batch_size,
                    s.grad_accum,
                    t.engine.describe()
                ),
            );
            // `dataset.eval_fraction = 0` holds no rows out: there is nothing to evaluate.
            if !t.eval.is_empty() {
                let (loss, _) = t.evaluate()?;
                t.log(json!({"step": 0, "eval_loss": loss}))?;
                job.ui.status("eval", format!("step 0: eval loss {loss:.4}"));
            }
        }
    }
    let started = Instant::now();
    let first_step = t.state.step;
    let mut bar = job.ui.bar("train", total_steps);
    let mut stopped_early = false;
    while t.state.step < total_steps {
        if INTERRUPTED.load(Ordering::SeqCst) {
            let dir = t.save_checkpoint()?;
            return Err(TrainError::Interrupted { step: t.state.step, checkpoint: dir.display().to_string() });
        }
        let step_started = Instant::now();
        let tokens_before = t.state.tokens_seen;
        let (loss, lr) = t.step()?;
        if t.state.step > first_step + 1 {
            t.timed.0 += step_started.elapsed().as_secs_f64();
            t.timed.1 += t.state.tokens_seen - tokens_before;
            t.issued += t.last_issue;
            t.timed_steps += 1;
        }
        let step = t.state.step;
        if step == first_step + 1
            && let Some(k) = t.engine.kernels()
        {
            bar.status("kernels", k);
        }
        let rate = t.tokens_per_second().map(|r| format!(" {r:.0} tok/s")).unwrap_or_default();
        bar.set(step, &format!("loss {loss:.4} lr {lr:.2e}{rate}{}", t.memory_note()));
        let last = step == total_steps;
        if ((s.eval_every > 0 && step.is_multiple_of(s.eval_every)) || last) && !t.eval.is_empty() {
            let (ev, _) = t.evaluate()?;
            t.log(json!({"step": step, "eval_loss": ev}))?;
            job.ui.detail(format!("step {step}: eval loss {ev:.4}"));
            if let Some(es) = &s.early_stopping {
                match t.state.best_eval {
                    Some(best) if ev > best - es.min_delta => t.state.evals_without_improvement += 1,
                    _ => {
                        t.state.best_eval = Some(ev);
                        t.state.evals_without_improvement = 0;
                    }
                }
                if t.state.evals_without_improvement >= es.patience && !last {
                    job.ui.status("early stop", format!("eval loss has not improved for {} evaluations", es.patience));
                    stopped_early = true;
                    break;
                }
            }
        }
        if s.checkpoint_every > 0 && step.is_multiple_of(s.checkpoint_every) && !last {
            t.save_checkpoint()?;
        }
    }
    bar.finish();
    t.finish(started.elapsed().as_secs_f64(), stopped_early, &metrics_path)
}

/// An out-of-memory error of the engine as a train error that says what would fit (other errors
/// pass through).
pub fn out_of_memory(
    e: EngineError,
    s: &TrainSettings,
    engine: Option<&dyn Engine>,
    quantizable: Option<(u64, u64)>,
) -> TrainError {
    let EngineError::OutOfMemory { context, batch, seq, requested, free, total } = e else {
        return TrainError::Engine(e);
    };
    let (b, t) = (if batch > 0 { batch } else { s.batch_size as usize }, seq);
    let mut fits = Vec::new();
    let ckpt = engine.is_some_and(|e| e.checkpointing());
    // What the engine's memory model says fits, most similar settings first.
    if let Some(e) = engine.filter(|_| t > 0) {
        let fit = |rows: usize, seq: usize, ckpt: bool| {
            e.memory_estimate(rows, seq, ckpt).is_some_and(|(need, total)| need < total * 9 / 10)
        };
        if !ckpt && fit(b, t, true) {
            fits.push(
                "`stages.train.gradient_checkpointing = true` (keeps one layer's activations, not all)".to_string(),
            );
        }
        let mut rows = b / 2;
        while rows >= 1 {
            if fit(rows, t, true) {
                let accum = s.grad_accum as usize * b.div_ceil(rows);
                fits.push(format!(
                    "`stages.train.batch_size = {rows}` with `grad_accum = {accum}` (the same tokens per step){}",
                    if ckpt { "" } else { " and gradient checkpointing" }
                ));
                break;
            }
            rows /= 2;
        }
        let mut len = t / 2;
        while len >= 64 && fits.len() < 3 {
            if fit(b, len, true) {
                fits.push(format!("`dataset.max_seq_len = {len}`"));
                break;
            }
            len /= 2;
        }
    }
    // A 4-bit base frees most of the weights' memory: the first thing to try when they did not
    // fit (no batch yet), the last otherwise.
    let qlora = quantizable.map(|(dense, packed)| {
        format!(
            "`adapter.quantize_base = \"nf4\"` (QLoRA: the layers' linear weights in {} instead of {})",
            crate::ui::human_bytes(packed),
            crate::ui::human_bytes(dense)
        )
    });
    if fits.is_empty() && t > 0 {
        fits.push("a smaller `stages.train.batch_size` (with a larger `grad_accum`), `gradient_checkpointing = true`, or a shorter `dataset.max_seq_len`".into());
    }
    match (qlora, t) {
        (Some(q), 0) => fits.insert(0, q),
        (Some(q), _) => fits.push(q),
        (None, _) => {}
    }
    if fits.is_empty() {
        fits.push("a smaller model, or a device with more memory".into());
    }
    TrainError::OutOfMemory {
        message: format!(
            "the GPU ran out of memory while {context} (batch {b} × {t} tokens{}): {} requested with {} of {} free",
            if ckpt { ", activation checkpointing on" } else { "" },
            crate::ui::human_bytes(requested),
            crate::ui::human_bytes(free),
            crate::ui::human_bytes(total)
        ),
        help: format!("settings that would fit: {}; checkpoints and cached stages are kept", fits.join("; or ")),
    }
}

impl Trainer<'_> {
    fn log(&mut self, v: serde_json::Value) -> Result<(), TrainError> {
        writeln!(self.metrics, "{v}").map_err(ioerr("cannot write metrics".into()))
    }

    fn evaluate(&mut self) -> Result<(f64, usize), TrainError> {
        let s = self.job.settings;
        crate::engine::evaluate(&mut *self.engine, &self.eval, s.batch_size as usize, s.eval_batches)
            .map_err(|e| out_of_memory(e, s, None, self.quantizable))
    }

    fn tokens_per_second(&self) -> Option<f64> {
        (self.timed.0 > 0.0).then(|| self.timed.1 as f64 / self.timed.0)
    }

    /// ` peak GPU 12.3 GiB` or ` peak 1.2 GiB` (process RSS), for the progress line.
    fn memory_note(&self) -> String {
        match (self.engine.peak_memory(), crate::device::host::peak_rss_bytes()) {
            (Some(gpu), _) => format!(" peak GPU {}", crate::ui::human_bytes(gpu)),
            (None, Some(rss)) => format!(" peak {}", crate::ui::human_bytes(rss)),
            (None, None) => String::new(),
        }
    }

    /// The next micro-batch, prepared by a background thread that runs a few batches ahead.
    fn next_micro(&mut self) -> Result<HostBatch, TrainError> {
        if self.prefetch.is_none() {
            let batching = Batching {
                seed: self.job.seed,
                batch_size: self.job.settings.batch_size as usize,
                group_by_length: self.job.settings.group_by_length,
            };
            self.prefetch = Some(prefetch(self.train.clone(), batching, self.micro_per_epoch, self.state.micro));
        }
        let rx = self.prefetch.as_ref().expect("started above");
        rx.recv().map_err(|_| TrainError::Io {
            context: "the data loader stopped".into(),
            source: std::io::Error::other("prefetch thread ended"),
        })
    }

    /// One optimizer step over `grad_accum` micro-batches (fewer at the end of an epoch).
    fn step(&mut self) -> Result<(f64, f64), TrainError> {
        let s = self.job.settings;
        let epoch_end = (self.state.micro / self.micro_per_epoch + 1) * self.micro_per_epoch;
        let n_micro = (s.grad_accum as u64).min(epoch_end - self.state.micro);
        let micros: Vec<HostBatch> = (0..n_micro).map(|_| self.next_micro()).collect::<Result<_, _>>()?;
        let total: usize = micros.iter().map(|m| m.select.len()).sum();
        let scale = self.state.loss_scale;
        let issue = Instant::now();
        for (i, mb) in micros.iter().enumerate().filter(|(_, m)| !m.select.is_empty()) {
            let weight = mb.select.len() as f64 / total as f64;
            let key = crate::model::lora::batch_dropout_key(self.job.seed, self.state.micro + i as u64);
            self.engine
                .accumulate(mb, weight, scale, Some(key))
                .map_err(|e| out_of_memory(e, s, Some(&*self.engine), self.quantizable))?;
        }
        self.last_issue = issue.elapsed().as_secs_f64();
        // Gradients are ready (a data-parallel engine sums its devices' here).
        let (loss_sum, scaled_norm) = self.engine.gradients()?;
        let norm = scaled_norm / scale;
        self.state.micro += n_micro;
        self.state.tokens_seen += micros.iter().map(|m| m.tokens as u64).sum::<u64>();
        let step = self.state.step;
        let lr = schedule::lr_at(&s.schedule, s.learning_rate, step, self.total_steps) * self.state.lr_scale;
        if scale != 1.0 {
            // f16: overflowing gradients halve the loss scale and skip the step (GradScaler).
            if !scaled_norm.is_finite() && loss_sum.is_finite() {
                self.engine.discard()?;
                self.state.loss_scale = (scale / 2.0).max(1.0);
                self.state.scale_steps = 0;
                self.log(
                    json!({"step": step + 1, "skipped": "f16 gradient overflow", "loss_scale": self.state.loss_scale}),
                )?;
                self.state.step += 1;
                return Ok((loss_sum, lr));
            }
            self.state.scale_steps += 1;
            if self.state.scale_steps >= LOSS_SCALE_GROWTH_STEPS {
                self.state.loss_scale = scale * 2.0;
                self.state.scale_steps = 0;
            }
        }
        let mean = if self.state.recent_losses.is_empty() {
            f64::NAN
        } else {
            self.state.recent_losses.iter().sum::<f64>() / self.state.recent_losses.len() as f64
        };
        let spike = self.state.recent_losses.len() >= 5 && loss_sum > s.loss_guard.spike_factor * mean;
        if !loss_sum.is_finite() || !norm.is_finite() || spike {
            self.engine.discard()?;
            self.state.bad_steps += 1;
            self.state.lr_scale *= s.loss_guard.lr_backoff;
            let why = if spike {
                format!("loss {loss_sum:.4} is over {}× the running mean {mean:.4}", s.loss_guard.spike_factor)
            } else {
                format!("loss {loss_sum} / gradient norm {norm} is not finite")
            };
            self.job.ui.warn(format!("step {}: {why}; skipped, learning rate × {}", step + 1, s.loss_guard.lr_backoff));
            self.log(json!({"step": step + 1, "bad_step": why, "lr_scale": self.state.lr_scale}))?;
            self.state.step += 1;
            if self.state.bad_steps >= s.loss_guard.max_bad_steps {
                return Err(TrainError::LossGuard {
                    bad_steps: self.state.bad_steps,
                    last_loss: loss_sum,
                    report: vec![why],
                });
            }
            return Ok((loss_sum, lr));
        }
        let clip = match s.clip_grad_norm {
            Some(max) if max / (norm + 1e-6) < 1.0 => max / (norm + 1e-6),
            _ => 1.0,
        };
        self.engine.apply(lr, clip / scale)?;
        self.state.recent_losses.push(loss_sum);
        if self.state.recent_losses.len() > 20 {
            self.state.recent_losses.remove(0);
        }
        self.state.step += 1;
        self.log(json!({"step": self.state.step, "loss": loss_sum, "lr": lr, "grad_norm": norm, "tokens": self.state.tokens_seen}))?;
        Ok((loss_sum, lr))
    }

    fn save_checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        self.metrics.flush().map_err(ioerr("cannot write metrics".into()))?;
        checkpoint::save(
            &self.job.work,
            &self.engine.state()?,
            &self.state,
            self.job.settings.keep_checkpoints as usize,
        )
    }

    fn restore(&mut self, dir: &Path) -> Result<u64, TrainError> {
        let (engine_state, state) = checkpoint::load(dir)?;
        self.engine.restore(&engine_state)?;
        self.state = state;
        checkpoint::truncate_metrics(&self.job.work.join("metrics.jsonl"), self.state.step)
            .map_err(ioerr("cannot rewind metrics".into()))?;
        Ok(self.state.step)
    }

    fn finish(
        mut self,
        seconds: f64,
        stopped_early: bool,
        metrics_path: &Path,
    ) -> Result<serde_json::Value, TrainError> {
        self.metrics.flush().map_err(ioerr("cannot write metrics".into()))?;
        let out = self.job.out;
        let values = self.engine.trained()?;
        let trainable = trainable(self.job.settings, self.job.adapter);
        match &trainable.lora {
            Some(spec) => {
                let base = crate::model::ModelFolder::open(self.job.model_dir)?;
                crate::model::peft::write(out, spec, &values, "", &base)?
            }
            None => crate::model::folder::save_safetensors(&out.join("weights.safetensors"), &values)?,
        }
        std::fs::copy(metrics_path, out.join("metrics.jsonl")).map_err(ioerr("cannot copy metrics".into()))?;
        let text = std::fs::read_to_string(metrics_path).map_err(ioerr("cannot read metrics".into()))?;
        let records: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        let evals: Vec<(f64, f64)> =
            records.iter().filter_map(|r| Some((r["step"].as_f64()?, r["eval_loss"].as_f64()?))).collect();
        let losses: Vec<(f64, f64)> =
            records.iter().filter_map(|r| Some((r["step"].as_f64()?, r["loss"].as_f64()?))).collect();
        std::fs::write(out.join("loss_curve.svg"), curve::svg(&losses, &evals))
            .map_err(ioerr("cannot write the loss curve".into()))?;
        let first = evals.first().map(|e| e.1).unwrap_or(f64::NAN);
        let last = evals.last().map(|e| e.1).unwrap_or(f64::NAN);
        let rate = self.tokens_per_second();
        let peak_gpu = self.engine.peak_memory();
        let summary = json!({
            "steps": self.state.step,
            "eval_loss_start": first,
            "eval_loss_end": last,
            "eval_loss_drop": if first > 0.0 { (first - last) / first } else { f64::NAN },
            "train_loss_end": losses.last().map(|l| l.1),
            "bad_steps": self.state.bad_steps,
            "stopped_early": stopped_early,
            "tokens_seen": self.state.tokens_seen,
            "seconds": seconds,
            "tokens_per_s": rate,
            "trainable": match (trainable.lora.is_some(), trainable.weights.is_empty()) {
                (true, true) => "lora",
                (true, false) => "lora+weights",
                _ => "weights",
            },
            "ema": self.job.settings.ema.is_some(),
            "engine": self.engine.describe(),
            "kernels": self.engine.kernels(),
            "peak_rss_bytes": crate::device::host::peak_rss_bytes(),
            "peak_gpu_bytes": peak_gpu,
        });
        let settings = json!({ "train": self.job.settings, "adapter": self.job.adapter, "seed": self.job.seed, "dtype": self.job.device.dtype.as_str() });
        crate::json::write_file(&out.join("settings.json"), &settings)
            .map_err(ioerr("cannot write settings.json".into()))?;
        crate::json::write_file(&out.join("metrics.json"), &summary)
            .map_err(ioerr("cannot write metrics.json".into()))?;
        let mut speed = format!("{seconds:.1}s");
        if let Some(r) = rate {
            speed.push_str(&format!(", {r:.0} tok/s"));
        }
        if let Some(p) = peak_gpu {
            speed.push_str(&format!(", peak GPU {}", crate::ui::human_bytes(p)));
        }
        if crate::switches::Switches::get().profile.is_some() && self.timed.0 > 0.0 {
            let steps = self.timed_steps.max(1) as f64;
            self.job.ui.status(
                "profile",
                format!(
                    "{:.2} ms per step, of which the host spent {:.2} ms issuing the passes",
                    1e3 * self.timed.0 / steps,
                    1e3 * self.issued / steps
                ),
            );
        }
        let losses = match (evals.is_empty(), losses.first(), losses.last()) {
            (true, Some(a), Some(b)) => format!("train loss {:.4} → {:.4} (no eval split)", a.1, b.1),
            _ => format!("eval loss {first:.4} → {last:.4}"),
        };
        self.job.ui.status("train", format!("{losses} in {} steps ({speed})", self.state.step));
        Ok(summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_by_length_keeps_every_row_once_and_batches_similar_lengths() {
        let lens: Vec<usize> = (0..1000).map(|i| (i * 7919) % 500 + 1).collect();
        let len = |i: usize| lens[i];
        let shuffled = epoch_rows(lens.len(), len, 5, 0, 4, false);
        let grouped = epoch_rows(lens.len(), len, 5, 0, 4, true);
        let mut sorted = grouped.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>(), "every row exactly once");
        assert_eq!(grouped, epoch_rows(lens.len(), len, 5, 0, 4, true), "deterministic by seed");
        assert_ne!(grouped, epoch_rows(lens.len(), len, 5, 1, 4, true), "another order each epoch");
        // Within a group of 50 batches, rows run longest first; groups keep the shuffle's rows.
        for (g, s) in grouped.chunks(200).zip(shuffled.chunks(200)) {
            assert!(g.windows(2).all(|w| lens[w[0]] >= lens[w[1]]));
            let (mut a, mut b) = (g.to_vec(), s.to_vec());
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b);
        }
        let padding = |order: &[usize]| -> usize {
            order
                .chunks(4)
                .map(|b| {
                    b.len() * b.iter().map(|&i| lens[i]).max().unwrap() - b.iter().map(|&i| lens[i]).sum::<usize>()
                })
                .sum()
        };
        assert!(padding(&grouped) * 10 < padding(&shuffled), "{} vs {}", padding(&grouped), padding(&shuffled));
    }
}
