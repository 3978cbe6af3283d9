//! Learning-rate schedules: linear warm-up, then constant, linear or cosine decay to `min_lr`
//! (the shapes of transformers' `get_*_schedule_with_warmup`).

use crate::recipe::{Schedule, ScheduleKind};

/// Learning rate for optimizer step `step` (0-based) of `total`.
pub fn lr_at(s: &Schedule, peak: f64, step: u64, total: u64) -> f64 {
    let warmup = match s.warmup_ratio {
        Some(r) => (r * total as f64).ceil() as u64,
        None => s.warmup_steps,
    };
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    let factor = match s.kind {
        ScheduleKind::Constant => 1.0,
        ScheduleKind::Linear => 1.0 - progress,
        ScheduleKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
    };
    s.min_lr + (peak - s.min_lr).max(0.0) * factor
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_floor() {
        let s = Schedule { kind: ScheduleKind::Cosine, warmup_steps: 10, warmup_ratio: None, min_lr: 1e-5 };
        assert!((lr_at(&s, 1e-3, 0, 110) - 1e-4).abs() < 1e-12);
        assert!((lr_at(&s, 1e-3, 9, 110) - 1e-3).abs() < 1e-12);
        assert!((lr_at(&s, 1e-3, 10, 110) - 1e-3).abs() < 1e-12);
        assert!((lr_at(&s, 1e-3, 60, 110) - (1e-5 + (1e-3 - 1e-5) * 0.5)).abs() < 1e-12);
        assert!((lr_at(&s, 1e-3, 110, 110) - 1e-5).abs() < 1e-12);
    }

    #[test]
    fn linear_and_constant() {
        let lin = Schedule { kind: ScheduleKind::Linear, warmup_steps: 0, warmup_ratio: None, min_lr: 0.0 };
        assert!((lr_at(&lin, 1.0, 50, 100) - 0.5).abs() < 1e-12);
        let c = Schedule { kind: ScheduleKind::Constant, warmup_steps: 0, warmup_ratio: Some(0.1), min_lr: 0.0 };
        assert!((lr_at(&c, 2.0, 4, 100) - 1.0).abs() < 1e-12);
        assert!((lr_at(&c, 2.0, 50, 100) - 2.0).abs() < 1e-12);
    }
}
