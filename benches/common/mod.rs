//! What the benchmarks share: the model shapes of issue 11's protocol.
//!
//! Each benchmark is its own crate and uses part of this module.
#![allow(dead_code)]

use rtune::recipe::{Arch, ScratchModel};

/// `tiny` (hidden 64, 2 layers, vocab 1000), `small` (hidden 256, 8 layers, vocab 8000) or `135m`
/// (SmolLM2-135M's shape: hidden 576, 30 layers, vocab 49152, tied embeddings), as random-weight
/// The benchmarks' shapes (Llamas, the Qwen3-0.6B and the Gemma 3 270M shapes) with room for
/// `max_positions` tokens.
pub fn shape(name: &str, max_positions: usize) -> ScratchModel {
    if name == "qwen3-0.6b" {
        // Qwen/Qwen3-0.6B-Base: heads of 128 in a hidden size of 1024, q/k head norms.
        return ScratchModel {
            arch: Arch::Qwen3,
            hidden_size: 1024,
            num_layers: 28,
            num_heads: 16,
            num_kv_heads: Some(8),
            head_dim: Some(128),
            intermediate_size: 3072,
            vocab_size: 151936,
            max_position_embeddings: max_positions,
            rope_theta: 1000000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            initializer_range: 0.02,
        };
    }
    if name == "gemma3-270m" {
        // google/gemma-3-270m: heads of 256, a 262k vocabulary, Gemma 3's layer (scratch Gemma 3
        // models take its local window of 512 and one global layer in six).
        return ScratchModel {
            arch: Arch::Gemma3,
            hidden_size: 640,
            num_layers: 18,
            num_heads: 4,
            num_kv_heads: Some(1),
            head_dim: Some(256),
            intermediate_size: 2048,
            vocab_size: 262144,
            max_position_embeddings: max_positions,
            rope_theta: 1000000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            initializer_range: 0.02,
        };
    }
    let (hidden, layers, heads, kv, inter, vocab, tied) = match name {
        "135m" => (576, 30, 9, 3, 1536, 49152, true),
        "small" => (256, 8, 4, 2, 768, 8000, false),
        _ => (64, 2, 4, 2, 128, 1000, false),
    };
    ScratchModel {
        arch: Arch::Llama,
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: Some(kv),
        head_dim: None,
        intermediate_size: inter,
        vocab_size: vocab,
        max_position_embeddings: max_positions,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tied,
        initializer_range: 0.02,
    }
}

/// `RTUNE_BENCH_SMOKE=1` (CI): a tiny run that proves a benchmark still works, measuring nothing.
pub fn smoke() -> bool {
    std::env::var_os("RTUNE_BENCH_SMOKE").is_some()
}

/// The benchmark's arguments (cargo's own `--bench` flag left out), or `smoke_args` in a smoke
/// run.
pub fn args(smoke_args: &[&str]) -> Vec<String> {
    if smoke() {
        return smoke_args.iter().map(|a| a.to_string()).collect();
    }
    std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect()
}
