//! Data parallel training (and evaluation) on several GPUs in one process (`device.gpus`): each
//! device holds a copy of the model ([`GpuEngine`]) and takes a share of the rows of every
//! micro-batch (and evaluation batch); before each optimizer step their gradients are summed
//! through the host and written back to every device, which then takes the same AdamW step, so
//! the copies stay equal.
//!
//! One thread drives every device: work is queued (CUDA streams, Vulkan command batches) and
//! started on each device before the host waits on any, so the devices compute at once. The
//! sum goes through host memory rather than a collective library (NCCL is Linux- and
//! NVIDIA-only, and consumer GPUs have no peer-to-peer path): it moves the trained values'
//! gradients, a few megabytes for LoRA, once per optimizer step. A part of a micro-batch counts
//! its dropout masks from where its rows start in the whole, so a run trains as one device
//! would, to the order of float sums.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::Tensor;

use super::GpuEngine;
use crate::engine::{Engine, EngineError, EngineState, HostBatch, Origin};

/// Gradient values summed per host round trip (64 MiB of f32).
const CHUNK: usize = 16 << 20;

pub struct Replicas {
    engines: Vec<GpuEngine>,
    /// The replica that takes the first of a micro-batch's leftover rows: rows that do not
    /// divide evenly go round the devices in turn within a step, from replica 0 at each step
    /// (so a run resumed from a checkpoint sums as the uninterrupted one did).
    next: usize,
    /// Gradients accumulated since the last sum.
    pending: bool,
}

impl Replicas {
    /// Copies of one model on different devices, built from the same setup.
    pub fn new(engines: Vec<GpuEngine>) -> Replicas {
        assert!(!engines.is_empty(), "data parallel training needs a device");
        Replicas { engines, next: 0, pending: false }
    }

    /// The copies, the first one's device first (tests, diagnostics).
    pub fn replicas(&self) -> &[GpuEngine] {
        &self.engines
    }

    /// Sum the replicas' gradients into every replica, a chunk at a time, in replica order.
    fn reduce(&mut self) -> Result<(), EngineError> {
        if !self.pending {
            return Ok(());
        }
        for e in &self.engines {
            e.flush().map_err(on_device(e.device_name(), 0))?;
        }
        // Cut where any replica cuts its buffers (drivers differ in their allocation caps).
        let mut bounds: Vec<usize> = Vec::new();
        for e in &self.engines {
            bounds.extend_from_slice(e.gradient_bounds()?);
        }
        bounds.sort_unstable();
        bounds.dedup();
        for w in bounds.windows(2) {
            for off in (w[0]..w[1]).step_by(CHUNK) {
                let len = CHUNK.min(w[1] - off);
                let read = |e: &GpuEngine| e.read_gradients(off, len).map_err(on_device(e.device_name(), 0));
                let mut sum = read(&self.engines[0])?;
                for e in &self.engines[1..] {
                    for (s, v) in sum.iter_mut().zip(read(e)?) {
                        *s += v;
                    }
                }
                for e in &self.engines {
                    e.write_gradients(off, &sum).map_err(on_device(e.device_name(), 0))?;
                }
            }
        }
        self.pending = false;
        Ok(())
    }
}

/// An error of the replica on `device` while it worked on its rows of a batch of `rows` (0: no
/// batch): says which GPU, and counts an out-of-memory error's batch as the whole one (what the
/// recipe sets, and what the trainer's advice on what fits is about: the engine's memory model
/// takes each GPU's share of it).
fn on_device(device: String, rows: usize) -> impl FnOnce(EngineError) -> EngineError {
    move |e| match e {
        EngineError::OutOfMemory { context, seq, requested, free, total, .. } => EngineError::OutOfMemory {
            context: format!("{context} on {device}"),
            batch: rows,
            seq,
            requested,
            free,
            total,
        },
        EngineError::Gpu { context, source } => EngineError::Gpu { context: format!("{device}: {context}"), source },
        EngineError::DeviceLost { context, why } => {
            EngineError::DeviceLost { context: format!("{device}: {context}"), why }
        }
        other => other,
    }
}

/// Each of `n` replicas' rows of a batch of `b` rows: `b / n` each, the remainder one each to
/// the replicas from `next` on (which then moves past them). Empty shares are left out.
fn shares(n: usize, b: usize, next: &mut usize) -> Vec<(usize, Range<usize>)> {
    let (each, extra) = (b / n, b % n);
    let mut start = 0;
    let mut out = Vec::with_capacity(n);
    for k in 0..n {
        let r = (*next + k) % n;
        let len = each + usize::from(k < extra);
        if len > 0 {
            out.push((r, start..start + len));
        }
        start += len;
    }
    *next = (*next + extra) % n;
    out
}

/// Each replica's part of `batch` ([`shares`]) that has selected positions, with where it
/// starts in the batch.
fn parts(n: usize, batch: &HostBatch, next: &mut usize) -> Vec<(usize, HostBatch, Origin)> {
    let parts = shares(n, batch.b, next).into_iter().map(|(r, rows)| {
        let (part, origin) = batch.part(rows);
        (r, part, origin)
    });
    parts.filter(|(_, part, _)| !part.select.is_empty()).collect()
}

impl Engine for Replicas {
    fn describe(&self) -> String {
        let each: Vec<String> = self.engines.iter().map(|e| e.describe()).collect();
        format!("data parallel on {} GPUs: {}", self.engines.len(), each.join("; "))
    }

    fn trained_count(&self) -> usize {
        self.engines[0].trained_count()
    }

    fn accumulate(
        &mut self,
        batch: &HostBatch,
        weight: f64,
        loss_scale: f64,
        dropout: Option<u64>,
    ) -> Result<(), EngineError> {
        let selected = batch.select.len().max(1) as f64;
        for (r, part, origin) in parts(self.engines.len(), batch, &mut self.next) {
            // The batch's loss is the mean over its selected positions: each part's mean
            // counts by its share of them.
            let w = weight * part.select.len() as f64 / selected;
            let e = &mut self.engines[r];
            let on = on_device(e.device_name(), batch.b);
            e.accumulate_part(&part, origin, w, loss_scale, dropout).and_then(|_| e.flush()).map_err(on)?;
            self.pending = true;
        }
        Ok(())
    }

    fn gradients(&mut self) -> Result<(f64, f64), EngineError> {
        self.reduce()?;
        self.next = 0;
        let mut loss = 0.0;
        let mut norm = 0.0;
        for (i, e) in self.engines.iter_mut().enumerate() {
            let (l, n) = e.gradients().map_err(on_device(e.device_name(), 0))?;
            loss += l;
            if i == 0 {
                norm = n;
            }
        }
        Ok((loss, norm))
    }

    fn apply(&mut self, lr: f64, grad_scale: f64) -> Result<(), EngineError> {
        self.reduce()?;
        self.engines.iter_mut().try_for_each(|e| e.apply(lr, grad_scale).map_err(on_device(e.device_name(), 0)))
    }

    fn discard(&mut self) -> Result<(), EngineError> {
        self.pending = false;
        self.next = 0;
        self.engines.iter_mut().try_for_each(|e| e.discard())
    }

    fn loss(&mut self, batch: &HostBatch) -> Result<f64, EngineError> {
        if batch.select.is_empty() {
            return self.engines[0].loss(batch);
        }
        let mut queued = Vec::new();
        for (r, part, _) in parts(self.engines.len(), batch, &mut 0) {
            let e = &mut self.engines[r];
            e.queue_loss(&part).and_then(|_| e.flush()).map_err(on_device(e.device_name(), batch.b))?;
            queued.push((r, part.select.len()));
        }
        let mut sum = 0.0;
        for (r, selected) in queued {
            let e = &mut self.engines[r];
            sum += e.take_loss().map_err(on_device(e.device_name(), batch.b))? * selected as f64;
        }
        Ok(sum / batch.select.len() as f64)
    }

    fn next_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.engines[0].next_logits(ids)
    }

    fn state(&self) -> Result<EngineState, EngineError> {
        self.engines[0].state()
    }

    fn restore(&mut self, state: &EngineState) -> Result<(), EngineError> {
        self.engines.iter_mut().try_for_each(|e| e.restore(state))
    }

    fn gradient_values(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        let mut sum = self.engines[0].gradient_values()?;
        if self.pending {
            for e in &self.engines[1..] {
                for (name, g) in e.gradient_values()? {
                    let s = sum.get_mut(&name).expect("replicas train the same values");
                    *s = (&*s + g)
                        .map_err(|source| EngineError::Candle { context: "summing gradients".into(), source })?;
                }
            }
        }
        Ok(sum)
    }

    fn trained(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        self.engines[0].trained()
    }

    fn peak_memory(&self) -> Option<u64> {
        self.engines.iter().filter_map(|e| e.peak_memory()).max()
    }

    fn kernels(&self) -> Option<String> {
        // One account where every device ran the same kernels, else each device's.
        let each: Vec<String> = self.engines.iter().filter_map(|e| e.kernels()).collect();
        let first = each.first()?;
        if each.iter().all(|k| k == first) { Some(first.clone()) } else { Some(each.join(" | ")) }
    }

    fn memory_estimate(&self, rows: usize, seq: usize, checkpointing: bool) -> Option<(u64, u64)> {
        // Each device takes its share of the rows.
        self.engines[0].memory_estimate(rows.div_ceil(self.engines.len()), seq, checkpointing)
    }

    fn checkpointing(&self) -> bool {
        self.engines[0].checkpointing()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rows_go_round_the_devices_evenly() {
        let mut next = 0;
        let mut shares = |n, b| super::shares(n, b, &mut next);
        assert_eq!(shares(2, 4), vec![(0, 0..2), (1, 2..4)]);
        assert_eq!(shares(2, 3), vec![(0, 0..2), (1, 2..3)]);
        // The leftover row went to device 0: the next one goes to device 1.
        assert_eq!(shares(2, 3), vec![(1, 0..2), (0, 2..3)]);
        assert_eq!(shares(2, 1), vec![(0, 0..1)]);
        assert_eq!(shares(2, 1), vec![(1, 0..1)]);
        assert_eq!(shares(3, 8), vec![(0, 0..3), (1, 3..6), (2, 6..8)]);
        assert_eq!(shares(3, 2), vec![(2, 0..1), (0, 1..2)]);
    }
}
