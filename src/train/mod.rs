//! The training loop: seeded shuffling, micro-batches with gradient accumulation (weighted so
//! that batch 8 × accum 1 equals batch 2 × accum 4), AdamW, warm-up + decay schedules, global
//! gradient-norm clipping, a loss guard, periodic evaluation with early stopping, EMA weights,
//! and resumable checkpoints.
//!
//! Multi-device data parallelism would all-reduce `grads` between "gradients are ready" and
//! "optimizer step" in [`Trainer::step`]; nothing else assumes a single device.

mod checkpoint;
mod curve;
pub mod optim;
pub mod schedule;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::data::{TokenStore, tokens::TokenRow};
use crate::model::{Batch, LoraSpec, ModelFolder, Trainable, Transformer};
use crate::recipe::{Adapter, AdapterKind, TrainSettings};
use crate::rng::Rng;
use crate::ui::Ui;
use optim::{AdamW, AdamWConfig};

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
    #[error("the training split is empty")]
    #[diagnostic(code(rtune::train::no_data), help("lower `dataset.eval_fraction` or add rows"))]
    NoData,
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
    pub device: Device,
    pub dtype: DType,
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
    /// Micro-batches consumed since the start of training.
    pub micro: u64,
    pub dropout_rng: Rng,
    pub lr_scale: f64,
    pub bad_steps: u32,
    pub recent_losses: Vec<f64>,
    pub best_eval: Option<f64>,
    pub evals_without_improvement: u32,
    pub tokens_seen: u64,
}

/// The LoRA spec a recipe's `[adapter]` describes.
pub fn lora_spec(a: &Adapter) -> LoraSpec {
    let mut targets: Vec<String> = a.targets.iter().map(|t| t.as_str().to_string()).collect();
    targets.sort();
    LoraSpec { rank: a.rank, alpha: a.alpha, dropout: a.dropout, targets }
}

/// Which weights train, from `[adapter]` and `stages.train.trainable`.
pub fn trainable(settings: &TrainSettings, adapter: &Adapter) -> Trainable {
    match (&settings.trainable, adapter.kind) {
        (Some(patterns), _) if !(patterns.len() == 1 && patterns[0] == "adapter") => {
            let pats = patterns.iter().map(|p| if p == "all" { "*".to_string() } else { p.clone() }).collect();
            Trainable::Weights(pats)
        }
        (_, AdapterKind::Lora) => Trainable::Lora(lora_spec(adapter)),
        (_, AdapterKind::None) => Trainable::Weights(vec!["*".into()]),
    }
}

/// Build the model for training from a model folder. Weights are read in f32 (so trained
/// master weights start exact); frozen ones are converted to the compute `dtype`.
pub fn build_model(
    model_dir: &Path,
    which: &Trainable,
    seed: u64,
    device: &Device,
    dtype: DType,
) -> Result<Transformer, TrainError> {
    let folder = ModelFolder::open(model_dir)?;
    let weights = folder.load_weights(device, DType::F32)?;
    let mut rng = Rng::derive(seed, "lora-init");
    Ok(Transformer::with_dtype(&folder.config, &weights, which, &mut rng, dtype)?)
}

/// One micro-batch: the batch tensors and where the loss counts.
pub struct MicroBatch {
    pub batch: Batch,
    pub select: Tensor,
    pub targets: Tensor,
    pub targets_count: usize,
    pub tokens: usize,
}

/// Pad rows to the longest and list the positions whose next token is a target.
pub fn micro_batch(rows: &[TokenRow], device: &Device) -> Result<MicroBatch, TrainError> {
    let t = rows.iter().map(|r| r.ids.len()).max().unwrap_or(0);
    let ids: Vec<Vec<u32>> = rows.iter().map(|r| r.ids.clone()).collect();
    let lens: Vec<usize> = rows.iter().map(|r| r.ids.len()).collect();
    let segs: Vec<Vec<u16>> = rows.iter().map(|r| r.seg.clone()).collect();
    let (mut select, mut targets) = (Vec::new(), Vec::new());
    for (r, row) in rows.iter().enumerate() {
        for j in 1..row.ids.len() {
            if row.mask[j] == 1 && row.seg[j] == row.seg[j - 1] {
                select.push((r * t + j - 1) as u32);
                targets.push(row.ids[j]);
            }
        }
    }
    let batch = Batch::new(&ids, &lens, Some(&segs), device).map_err(cerr("build a batch"))?;
    let n = select.len();
    Ok(MicroBatch {
        batch,
        select: Tensor::from_vec(select, n, device).map_err(cerr("build a batch"))?,
        targets: Tensor::from_vec(targets, n, device).map_err(cerr("build a batch"))?,
        targets_count: n,
        tokens: lens.iter().sum(),
    })
}

/// Which engine computes losses and gradients for `model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// rtune's fused CPU engine ([`crate::model::fused`]).
    Fused,
    /// candle's ops and autograd (any device, dtype and trainable set).
    Candle,
}

impl Engine {
    /// The fused engine where it supports the model (f32 on the CPU, LoRA or nothing training),
    /// unless `RTUNE_ENGINE=candle` asks for candle's autograd (to compare the two).
    pub fn for_model(model: &Transformer) -> Engine {
        let forced = std::env::var("RTUNE_ENGINE").is_ok_and(|v| v == "candle");
        if !forced && crate::model::fused::unsupported(model).is_none() { Engine::Fused } else { Engine::Candle }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Engine::Fused => "fused CPU engine",
            Engine::Candle => "candle autograd",
        }
    }
}

/// Mean loss of one micro-batch (no gradients).
fn batch_loss(model: &Transformer, mb: &MicroBatch, engine: Engine) -> Result<f64, TrainError> {
    match engine {
        Engine::Fused => {
            let select: Vec<u32> = mb.select.to_vec1().map_err(cerr("evaluate"))?;
            let targets: Vec<u32> = mb.targets.to_vec1().map_err(cerr("evaluate"))?;
            crate::model::fused::loss(model, &mb.batch, &select, &targets).map_err(cerr("evaluate"))
        }
        Engine::Candle => model
            .loss(&mb.batch, &mb.select, &mb.targets, None)
            .and_then(|l| l.to_scalar::<f32>())
            .map(f64::from)
            .map_err(cerr("evaluate")),
    }
}

/// Token-weighted mean loss over (at most `max_batches` batches of) a split.
pub fn evaluate(
    model: &Transformer,
    store: &TokenStore,
    batch_size: usize,
    max_batches: u64,
) -> Result<(f64, usize), TrainError> {
    let (mut sum, mut n) = (0f64, 0usize);
    let engine = Engine::for_model(model);
    let idx: Vec<usize> = (0..store.len()).collect();
    for (b, chunk) in idx.chunks(batch_size.max(1)).enumerate() {
        if max_batches > 0 && b as u64 >= max_batches {
            break;
        }
        let rows: Vec<TokenRow> = chunk.iter().map(|&i| store.row(i)).collect();
        let mb = micro_batch(&rows, model.device())?;
        if mb.targets_count == 0 {
            continue;
        }
        let loss = batch_loss(model, &mb, engine)?;
        sum += loss * mb.targets_count as f64;
        n += mb.targets_count;
    }
    Ok((if n > 0 { sum / n as f64 } else { f64::NAN }, n))
}

/// Peak resident memory of this process, where the OS tells it (Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// How an epoch's rows are ordered into micro-batches.
#[derive(Debug, Clone, Copy)]
struct Batching {
    seed: u64,
    batch_size: usize,
    group_by_length: bool,
}

/// Prepare micro-batches from number `start` on, in order, on a background thread; it stops
/// when the receiver is dropped. The bounded channel keeps it at most four batches ahead.
fn prefetch(
    train: std::sync::Arc<TokenStore>,
    batching: Batching,
    micro_per_epoch: u64,
    start: u64,
    device: Device,
) -> std::sync::mpsc::Receiver<Result<MicroBatch, TrainError>> {
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
            if tx.send(micro_batch(&rows, &device)).is_err() {
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
    model: Transformer,
    engine: Engine,
    opt: AdamW,
    ema: Option<BTreeMap<String, Tensor>>,
    state: LoopState,
    train: std::sync::Arc<TokenStore>,
    eval: TokenStore,
    /// Micro-batches prepared ahead on a background thread.
    prefetch: Option<std::sync::mpsc::Receiver<Result<MicroBatch, TrainError>>>,
    micro_per_epoch: u64,
    total_steps: u64,
    metrics: std::fs::File,
}

/// Run (or resume) training; writes the trained weights, metrics and curve into `job.out`.
pub fn train(job: &TrainJob<'_>) -> Result<serde_json::Value, TrainError> {
    let s = job.settings;
    let which = trainable(s, job.adapter);
    let model = build_model(job.model_dir, &which, job.seed, &job.device, job.dtype)?;
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
    let opt = AdamW::new(cfg, &model.params).map_err(cerr("create the optimizer"))?;
    let ema = s.ema.as_ref().map(|_| model.param_values());
    std::fs::create_dir_all(&job.work).map_err(ioerr(format!("cannot create `{}`", job.work.display())))?;
    let state = LoopState {
        step: 0,
        micro: 0,
        dropout_rng: Rng::derive(job.seed, "dropout"),
        lr_scale: 1.0,
        bad_steps: 0,
        recent_losses: Vec::new(),
        best_eval: None,
        evals_without_improvement: 0,
        tokens_seen: 0,
    };
    let metrics_path = job.work.join("metrics.jsonl");
    let engine = Engine::for_model(&model);
    let mut t = Trainer {
        job,
        engine,
        model,
        opt,
        ema,
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
    };
    let resumed = checkpoint::latest(&job.work).map(|ck| t.restore(&ck)).transpose()?;
    let n_params: usize = t.model.params.iter().map(|p| p.var.elem_count()).sum();
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
            let (loss, _) = evaluate(&t.model, &t.eval, s.batch_size as usize, s.eval_batches)?;
            t.log(json!({"step": 0, "eval_loss": loss}))?;
            job.ui.status("eval", format!("step 0: eval loss {loss:.4}"));
        }
    }
    let started = Instant::now();
    let tokens_at_start = t.state.tokens_seen;
    let mut bar = job.ui.bar("train", total_steps);
    let mut stopped_early = false;
    while t.state.step < total_steps {
        if INTERRUPTED.load(Ordering::SeqCst) {
            let dir = t.save_checkpoint()?;
            return Err(TrainError::Interrupted { step: t.state.step, checkpoint: dir.display().to_string() });
        }
        let (loss, lr) = t.step()?;
        let step = t.state.step;
        let rate = (t.state.tokens_seen - tokens_at_start) as f64 / started.elapsed().as_secs_f64().max(1e-9);
        let mem = peak_rss_bytes().map(|b| format!(" peak {}", crate::ui::human_bytes(b))).unwrap_or_default();
        bar.set(step, &format!("loss {loss:.4} lr {lr:.2e} {rate:.0} tok/s{mem}"));
        let last = step == total_steps;
        if (s.eval_every > 0 && step.is_multiple_of(s.eval_every)) || last {
            let (ev, _) = evaluate(&t.model, &t.eval, s.batch_size as usize, s.eval_batches)?;
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

impl Trainer<'_> {
    fn log(&mut self, v: serde_json::Value) -> Result<(), TrainError> {
        writeln!(self.metrics, "{v}").map_err(ioerr("cannot write metrics".into()))
    }

    /// The next micro-batch, prepared by a background thread that runs a few batches ahead.
    fn next_micro(&mut self) -> Result<MicroBatch, TrainError> {
        if self.prefetch.is_none() {
            let batching = Batching {
                seed: self.job.seed,
                batch_size: self.job.settings.batch_size as usize,
                group_by_length: self.job.settings.group_by_length,
            };
            self.prefetch = Some(prefetch(
                self.train.clone(),
                batching,
                self.micro_per_epoch,
                self.state.micro,
                self.job.device.clone(),
            ));
        }
        let rx = self.prefetch.as_ref().expect("started above");
        rx.recv().map_err(|_| TrainError::Io {
            context: "the data loader stopped".into(),
            source: std::io::Error::other("prefetch thread ended"),
        })?
    }

    /// One optimizer step over `grad_accum` micro-batches (fewer at the end of an epoch).
    fn step(&mut self) -> Result<(f64, f64), TrainError> {
        let s = self.job.settings;
        let epoch_end = (self.state.micro / self.micro_per_epoch + 1) * self.micro_per_epoch;
        let n_micro = (s.grad_accum as u64).min(epoch_end - self.state.micro);
        let micros: Vec<MicroBatch> = (0..n_micro).map(|_| self.next_micro()).collect::<Result<_, _>>()?;
        let total: usize = micros.iter().map(|m| m.targets_count).sum();
        let mut grads: BTreeMap<String, Tensor> = BTreeMap::new();
        let mut loss_sum = 0f64;
        for mb in micros.iter().filter(|m| m.targets_count > 0) {
            let weight = mb.targets_count as f64 / total as f64;
            let (loss, g) = self.loss_and_grads(mb, weight)?;
            loss_sum += loss * weight;
            for p in &self.model.params {
                if let Some(pg) = g.get(&p.name) {
                    let pg = pg.to_dtype(DType::F32).map_err(cerr("gradient"))?;
                    let acc = match grads.remove(&p.name) {
                        Some(a) => (a + pg).map_err(cerr("accumulate gradients"))?,
                        None => pg,
                    };
                    grads.insert(p.name.clone(), acc);
                }
            }
        }
        self.state.micro += n_micro;
        self.state.tokens_seen += micros.iter().map(|m| m.tokens as u64).sum::<u64>();
        let step = self.state.step;
        let lr = schedule::lr_at(&s.schedule, s.learning_rate, step, self.total_steps) * self.state.lr_scale;
        // Gradients are ready: a data-parallel run would all-reduce `grads` here.
        let mut norm_sq = 0f64;
        for g in grads.values() {
            norm_sq +=
                g.sqr().and_then(|x| x.sum_all()).and_then(|x| x.to_scalar::<f32>()).map_err(cerr("gradient norm"))?
                    as f64;
        }
        let norm = norm_sq.sqrt();
        let mean = if self.state.recent_losses.is_empty() {
            f64::NAN
        } else {
            self.state.recent_losses.iter().sum::<f64>() / self.state.recent_losses.len() as f64
        };
        let spike = self.state.recent_losses.len() >= 5 && loss_sum > s.loss_guard.spike_factor * mean;
        if !loss_sum.is_finite() || !norm.is_finite() || spike {
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
        if let Some(max) = s.clip_grad_norm {
            let coef = max / (norm + 1e-6);
            if coef < 1.0 {
                for g in grads.values_mut() {
                    *g = (&*g * coef).map_err(cerr("clip gradients"))?;
                }
            }
        }
        self.opt.step(&self.model.params, &grads, lr).map_err(cerr("optimizer step"))?;
        if let (Some(ema), Some(cfg)) = (&mut self.ema, &s.ema) {
            for p in &self.model.params {
                let cur = p.var.as_tensor();
                let e = ema.get_mut(&p.name).expect("ema per parameter");
                *e = ((&*e * cfg.decay).and_then(|a| a + (cur * (1.0 - cfg.decay))?)).map_err(cerr("update EMA"))?;
            }
        }
        self.state.recent_losses.push(loss_sum);
        if self.state.recent_losses.len() > 20 {
            self.state.recent_losses.remove(0);
        }
        self.state.step += 1;
        self.log(json!({"step": self.state.step, "loss": loss_sum, "lr": lr, "grad_norm": norm, "tokens": self.state.tokens_seen}))?;
        Ok((loss_sum, lr))
    }

    /// The mean loss of one micro-batch and the gradients of `weight × loss`, by parameter name.
    fn loss_and_grads(&mut self, mb: &MicroBatch, weight: f64) -> Result<(f64, BTreeMap<String, Tensor>), TrainError> {
        let rng = &mut self.state.dropout_rng;
        match self.engine {
            Engine::Fused => {
                let select: Vec<u32> = mb.select.to_vec1().map_err(cerr("forward pass"))?;
                let targets: Vec<u32> = mb.targets.to_vec1().map_err(cerr("forward pass"))?;
                crate::model::fused::loss_and_grads(&self.model, &mb.batch, &select, &targets, weight as f32, rng)
                    .map_err(cerr("forward and backward pass"))
            }
            Engine::Candle => {
                let loss =
                    self.model.loss(&mb.batch, &mb.select, &mb.targets, Some(rng)).map_err(cerr("forward pass"))?;
                let scaled = (&loss * weight).map_err(cerr("scale the loss"))?;
                let g = scaled.backward().map_err(cerr("backward pass"))?;
                let grads = self
                    .model
                    .params
                    .iter()
                    .filter_map(|p| Some((p.name.clone(), g.get(p.var.as_tensor())?.clone())))
                    .collect();
                Ok((loss.to_scalar::<f32>().map_err(cerr("read the loss"))? as f64, grads))
            }
        }
    }

    fn save_checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        self.metrics.flush().map_err(ioerr("cannot write metrics".into()))?;
        checkpoint::save(
            &self.job.work,
            &self.model,
            &self.opt,
            self.ema.as_ref(),
            &self.state,
            self.job.settings.keep_checkpoints as usize,
        )
    }

    fn restore(&mut self, dir: &Path) -> Result<u64, TrainError> {
        let state = checkpoint::load(dir, &self.model, &mut self.opt, self.ema.as_mut())?;
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
        let values = match &self.ema {
            Some(e) => e.clone(),
            None => self.model.param_values(),
        };
        match trainable(self.job.settings, self.job.adapter) {
            Trainable::Lora(spec) => crate::model::peft::write(out, &spec, &values, "")?,
            _ => crate::model::folder::save_safetensors(&out.join("weights.safetensors"), &values)?,
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
            "trainable": match trainable(self.job.settings, self.job.adapter) { Trainable::Lora(_) => "lora", _ => "weights" },
            "ema": self.ema.is_some(),
            "peak_rss_bytes": peak_rss_bytes(),
        });
        let settings = json!({ "train": self.job.settings, "adapter": self.job.adapter, "seed": self.job.seed, "dtype": format!("{:?}", self.job.dtype) });
        let mut text = serde_json::to_string_pretty(&settings).expect("json");
        text.push('\n');
        std::fs::write(out.join("settings.json"), text).map_err(ioerr("cannot write settings.json".into()))?;
        let mut s = serde_json::to_string_pretty(&summary).expect("json");
        s.push('\n');
        std::fs::write(out.join("metrics.json"), s).map_err(ioerr("cannot write metrics.json".into()))?;
        self.job
            .ui
            .status("train", format!("eval loss {first:.4} → {last:.4} in {} steps ({seconds:.1}s)", self.state.step));
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
