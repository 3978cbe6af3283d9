//! Generation: the decode loop and the choice of each next token, as transformers' `generate`
//! makes it (greedy: the first maximum, as `torch.argmax`; sampling: repetition penalty, then
//! temperature, top-k and top-p, drawn from a seeded generator). The evaluate stage's samples and
//! `rtune chat` both generate here; each engine gives the next token's logits
//! ([`crate::engine::Engine::next_logits`]).

use crate::engine::{Engine, EngineError};
use crate::rng::Rng;

/// How the next token is chosen, named as transformers' `generate` names it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Most tokens generated (fewer at a stop token or at the model's last position).
    pub max_new_tokens: usize,
    /// 0 is greedy; above, the logits are divided by it before sampling.
    pub temperature: f64,
    /// Sample only from the `top_k` most likely tokens.
    pub top_k: Option<usize>,
    /// Sample only from the most likely tokens whose probabilities reach `top_p`.
    pub top_p: Option<f64>,
    /// transformers' `repetition_penalty`: the logit of every token already in the sequence
    /// (prompt included) is divided by it when positive and multiplied by it when negative;
    /// 1 leaves them be. It applies to greedy choice too.
    pub repetition_penalty: f64,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling { max_new_tokens: 256, temperature: 0.0, top_k: None, top_p: None, repetition_penalty: 1.0 }
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// A stop token (EOS or the template's turn end), not part of the output.
    StopToken,
    /// `max_new_tokens` were generated.
    MaxNewTokens,
    /// The sequence reached the model's last position.
    ContextFull,
}

/// Generate after `prompt` until a token of `stops`, `s.max_new_tokens` or position `limit`;
/// `on_token` sees each token as it is chosen (to stream it). The tokens, stop token excluded.
pub fn generate(
    engine: &mut dyn Engine,
    prompt: &[u32],
    s: &Sampling,
    stops: &[u32],
    limit: usize,
    rng: &mut Rng,
    mut on_token: impl FnMut(&[u32]),
) -> Result<(Vec<u32>, Stop), EngineError> {
    let mut ids = prompt.to_vec();
    let mut out = Vec::new();
    loop {
        if out.len() >= s.max_new_tokens {
            return Ok((out, Stop::MaxNewTokens));
        }
        if ids.len() >= limit {
            return Ok((out, Stop::ContextFull));
        }
        let mut logits = engine.next_logits(&ids)?;
        penalize(&mut logits, &ids, s.repetition_penalty);
        let next = pick(&logits, s, rng);
        if stops.contains(&next) {
            return Ok((out, Stop::StopToken));
        }
        out.push(next);
        ids.push(next);
        on_token(&out);
    }
}

/// transformers' `RepetitionPenaltyLogitsProcessor`, once per distinct token of `seen`.
fn penalize(logits: &mut [f32], seen: &[u32], penalty: f64) {
    if penalty == 1.0 {
        return;
    }
    let mut done = std::collections::BTreeSet::new();
    for &t in seen {
        if let Some(x) = logits.get_mut(t as usize).filter(|_| done.insert(t)) {
            *x = if *x < 0.0 { (*x as f64 * penalty) as f32 } else { (*x as f64 / penalty) as f32 };
        }
    }
}

/// The next token: the first maximum when greedy, else a draw after temperature, top-k, top-p.
pub fn pick(v: &[f32], s: &Sampling, rng: &mut Rng) -> u32 {
    if s.temperature <= 0.0 {
        // First maximum, as torch.argmax.
        let mut best = 0;
        for (i, x) in v.iter().enumerate() {
            if *x > v[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|a, b| v[*b].total_cmp(&v[*a]));
    if let Some(k) = s.top_k {
        idx.truncate(k.max(1));
    }
    let max = v[idx[0]] as f64;
    let mut probs: Vec<f64> = idx.iter().map(|&i| ((v[i] as f64 - max) / s.temperature).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(top_p) = s.top_p {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (j, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= top_p {
                keep = j + 1;
                break;
            }
        }
        probs.truncate(keep);
        let t: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= t);
    }
    let mut r = rng.next_f64();
    for (j, p) in probs.iter().enumerate() {
        if r < *p {
            return idx[j] as u32;
        }
        r -= p;
    }
    idx[probs.len() - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_once() {
        let mut l = vec![2.0, -2.0, 1.0];
        penalize(&mut l, &[0, 1, 0], 2.0);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
        // Greedy after the penalty: token 2 ties token 0 and the first maximum wins.
        assert_eq!(pick(&l, &Sampling::default(), &mut Rng::new(0)), 0);
    }

    #[test]
    fn sampling_with_a_seed_repeats_and_top_k_one_is_greedy() {
        let v: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let s = Sampling { temperature: 0.8, top_p: Some(0.9), ..Sampling::default() };
        let draw =
            |seed| (0..20).map(|_| 0).scan(Rng::new(seed), |r, _: i32| Some(pick(&v, &s, r))).collect::<Vec<_>>();
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let k1 = Sampling { temperature: 1.0, top_k: Some(1), ..Sampling::default() };
        assert_eq!(pick(&v, &k1, &mut Rng::new(3)), pick(&v, &Sampling::default(), &mut Rng::new(3)));
    }
}
