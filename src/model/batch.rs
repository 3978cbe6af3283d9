//! A batch as every engine sees it: token ids, rotary positions and which keys each token attends
//! to (causal within a packed document), and candle's additive mask written from that.

use candle_core::{Device, Result, Tensor};

/// A large negative number for masked attention scores; finite so rows with nothing to attend to
/// give a uniform distribution instead of NaN — also in f16, whose largest finite magnitude this
/// is (-1e9 became −inf there). exp(MASKED − max) is 0 in f32 for any realistic score.
pub(crate) const MASKED: f32 = -65504.0;

/// Whether the key at place `k` is too far before the query at place `q` (counted along the same
/// keys) for a local-attention layer with `window`: each query sees itself and the `window − 1`
/// keys before it, as transformers' sliding-window masks have it. Places, not rotary positions:
/// within a packed document they differ by the same amount, and across documents the mask already
/// hides every key.
pub fn outside_window(q: usize, k: usize, window: usize) -> bool {
    q >= k.saturating_add(window)
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
