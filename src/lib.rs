//! rtune: declarative, reproducible LLM fine-tuning.
//!
//! A TOML [`recipe`] compiles to a [`plan`] of stages whose outputs are content-addressed
//! artifacts in a [`store`]; [`exec`] runs the stages that are not cached. What a model is
//! ([`model`]: its config, the architecture spec, folders and adapters), the engines that compute
//! it ([`engine`]: candle's autograd, the fused CPU engine, the GPU engine), the data pipeline
//! ([`data`]), the training loop ([`train`]) and the exports ([`export`]) sit below the stages
//! ([`stage`]); planning, fingerprints and the store never touch them (docs/architecture.md).

// Diagnostics carry their source text and spans; they are built only on the failure path,
// so their size does not matter and boxing every one would only add noise.
#![allow(clippy::result_large_err)]

pub mod chat;
pub mod data;
pub mod destination;
pub mod device;
pub mod engine;
pub mod error;
pub mod exec;
pub mod export;
pub mod fingerprint;
pub mod generate;
pub mod glob;
pub mod hub;
pub mod json;
pub mod model;
pub mod plan;
pub mod recipe;
pub mod rng;
pub mod stage;
pub mod store;
pub mod switches;
pub mod train;
pub mod ui;

pub use error::Error;

/// Process-wide settings for fast CPU compute; call once before the first compute thread pool
/// starts (the binary does it just before running stages, so `ls`/`plan` pay nothing).
///
/// - Keep freed memory for reuse instead of returning it to the OS after every tensor. candle
///   allocates a fresh buffer for each op's output; with glibc's defaults every buffer over
///   128 KiB is a new `mmap`, so a training step spent ~10% of its time in page faults zeroing
///   pages (perf: `clear_page_erms`).
/// - Fix the thread count once. Unless `RAYON_NUM_THREADS` is set, candle's
///   `get_num_threads` recomputes it for every parallel op by parsing /proc/cpuinfo (~90 times
///   per training step, ~4% of a small model's step; `CANDLE_NUM_THREADS` alone does not stop
///   it). The value is candle's own default (physical cores), so candle behaves as before; the
///   global rayon pool (tokenization) gets the same count.
///
/// Both measured in docs/benchmarks.md.
pub fn init_process() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocation thresholds; called before other threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        set_threads(candle_core::utils::get_num_threads());
    }
}

/// Use `n` compute threads (candle's pool and rayon's). Call before any thread pool starts.
pub fn set_threads(n: usize) {
    // SAFETY: called before any thread that reads the environment (compute pools) starts.
    unsafe {
        std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}
