//! Linear layers with LoRA: y = x Wᵀ + b + s · (x ⊙ mask) Aᵀ Bᵀ, forward and backward.

use super::*;

impl LinW<'_> {
    /// Whether the backward pass needs the layer's input (for its weight's or adapter's
    /// gradients).
    pub(super) fn needs_input(&self) -> bool {
        self.lora.is_some() || self.train_w.is_some()
    }
}

/// `first_row`: the index of `x`'s first row in the layer's whole input (dropout masks are
/// indexed by element of the whole input, so row shards and chunks draw what one pass would).
pub(super) fn linear_forward(
    l: &LinW<'_>,
    x: &[f32],
    n: usize,
    dropout: Option<u64>,
    first_row: usize,
    y: &mut [f32],
) -> LinSave {
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

/// Backward of a linear layer: the gradients of what trains (adapter, weight `dyᵀ x`, bias
/// column sums) into `grads`, and `dx = dy W (+ LoRA)` into `dx` (overwritten) when asked.
pub(super) fn linear_backward(
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
pub(super) fn linear_backward_acc(
    l: &LinW<'_>,
    s: &LinSave,
    x: &[f32],
    n: usize,
    dy: &[f32],
    dx: &mut [f32],
    grads: &mut Grads,
) {
    linear_backward_into(l, s, x, n, dy, Some((dx, true)), grads)
}

pub(super) fn linear_backward_into(
    l: &LinW<'_>,
    s: &LinSave,
    x: &[f32],
    n: usize,
    dy: &[f32],
    dx: Option<(&mut [f32], bool)>,
    grads: &mut Grads,
) {
    let dym = Mat::rm(dy, n, l.out);
    if let Some(name) = &l.train_w {
        let gw = grad_of(grads, name, l.out * l.inp);
        matmul(gw, dym.t(), Mat::rm(x, n, l.inp), 1.0, true);
    }
    if let Some(name) = &l.train_b {
        let gb = grad_of(grads, name, l.out);
        for row in dy.chunks(l.out) {
            add_here(gb, row);
        }
    }
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
pub(super) fn lora_input<'x>(x: &'x [f32], mask: Option<&[f32]>) -> std::borrow::Cow<'x, [f32]> {
    match mask {
        Some(m) => x.iter().zip(m).map(|(a, b)| a * b).collect::<Vec<f32>>().into(),
        None => x.into(),
    }
}

/// The gradient accumulator of adapter matrix `which` of `prefix`, created zeroed.
pub(super) fn grad_slot<'g>(grads: &'g mut Grads, prefix: &str, which: &str, len: usize) -> &'g mut [f32] {
    grad_of(grads, &crate::model::lora::param_name(prefix, which), len)
}

/// The gradient accumulator of parameter `name`, created zeroed.
pub(super) fn grad_of<'g>(grads: &'g mut Grads, name: &str, len: usize) -> &'g mut [f32] {
    if !grads.contains_key(name) {
        grads.insert(name.to_string(), vec![0f32; len]);
    }
    grads.get_mut(name).expect("just inserted")
}
