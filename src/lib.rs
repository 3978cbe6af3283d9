//! rtune: declarative, reproducible LLM fine-tuning.
//!
//! A TOML [`recipe`] compiles to a [`plan`] of stages whose outputs are content-addressed
//! artifacts in a [`store`]; [`exec`] runs the stages that are not cached. The model code
//! ([`model`]), data pipeline ([`data`]) and training loop ([`train`]) are candle-based;
//! planning, fingerprints and the store never touch candle.

// Diagnostics carry their source text and spans; they are built only on the failure path,
// so their size does not matter and boxing every one would only add noise.
#![allow(clippy::result_large_err)]

pub mod data;
pub mod device;
pub mod error;
pub mod exec;
pub mod fingerprint;
pub mod hub;
pub mod model;
pub mod plan;
pub mod recipe;
pub mod rng;
pub mod stage;
pub mod store;
pub mod train;
pub mod ui;

pub use error::Error;
