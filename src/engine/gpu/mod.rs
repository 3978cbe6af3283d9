//! The GPU engine: training (LoRA adapters, base weights in a full or selective fine-tune, or
//! both) and evaluation as an explicit forward and backward pass over device buffers, the GPU
//! counterpart of the fused CPU engine ([`crate::engine::fused`]).
//!
//! - `kernels.cu` holds every kernel but the matrix products: RMSNorm, rotary embeddings,
//!   SiLU gating, dropout from a counter-based generator, cross-entropy, AdamW, and attention
//!   (FlashAttention-2's structure on tensor cores for bf16/f16 with head size 64 or 128, a scalar
//!   reference kernel otherwise). Attention keeps only each row's log-sum-exp; the backward pass
//!   recomputes probabilities. Where the tensor-core kernels do not run on a device whose products
//!   are fast (Vulkan GPUs), attention goes through batched products instead, chunk by chunk of
//!   query rows (`ops.rs`; the chunk's scores in memory, at most 64 MiB).
//! - Frozen and adapter products go to the device's GEMM (cuBLAS) with f32 accumulation; frozen
//!   weights get no gradient, residual adds and adapter outputs accumulate into the products'
//!   outputs. Trained base weights keep f32 master copies in the flat parameters and get their
//!   gradients from products (matrices) and column sums (norms, biases, the embedding table).
//! - Activation checkpointing per decoder layer ([`super::Checkpointing`]); the LM head and loss
//!   run in chunks of selected positions; trained parameters, gradients and AdamW moments are
//!   flat f32 buffers updated by one kernel per step.
//!
//! [`device::Gpu`] is the device seam: `cuda::CudaGpu` drives NVIDIA GPUs (feature `cuda`),
//! `vulkan::VulkanGpu` any GPU with a Vulkan 1.2 driver (feature `vulkan`, kernels in
//! `vulkan/kernels.comp`), and the tests drive the same engine on the CPU emulator of
//! `kernels.cu` (crates/gpu-emu) as well as on both.

pub mod check;
pub mod device;
mod engine;
pub mod ops;
mod parallel;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "vulkan")]
pub mod vulkan;

pub use device::{Arg, Buf, Dt, Gemm, GemmBatch, Gpu, GpuError, Memory};
pub use engine::{GpuEngine, compute_dtype};
pub use parallel::Replicas;

use crate::device::{DeviceClass, Resolution};
use crate::model::ModelConfig;
use crate::model::arch::{Feature, Spec};

/// Why the GPU engine cannot run this model on `device`, or `None` when it can.
pub fn unsupported(cfg: &ModelConfig, device: &Resolution) -> Option<String> {
    match device.class {
        DeviceClass::Cuda if !cfg!(feature = "cuda") => return Some("this build has no CUDA support".into()),
        DeviceClass::Vulkan if !cfg!(feature = "vulkan") => return Some("this build has no Vulkan support".into()),
        DeviceClass::Cuda | DeviceClass::Vulkan => {}
        other => return Some(format!("the GPU engine runs on CUDA and Vulkan devices, not {}", other.as_str())),
    }
    model_unsupported(cfg)
}

/// The parts of the architecture spec the GPU engine's kernels compute (CUDA and Vulkan alike):
/// all of them since Gemma 2's caps (2026-12-07). A feature added to the spec before its kernels
/// are here is left out of this list, and the engine refuses models that have it.
pub const FEATURES: &[Feature] = &Feature::ALL;

/// Why the GPU engine cannot run this model on any device (it trains LoRA adapters and base
/// weights alike).
pub fn model_unsupported(cfg: &ModelConfig) -> Option<String> {
    let spec = Spec::of(cfg);
    if let Some(why) = spec.unsupported("GPU engine", FEATURES) {
        return Some(why);
    }
    if !spec.head_dim.is_multiple_of(2) || spec.head_dim > 256 {
        return Some(format!("the GPU engine's attention takes even head sizes up to 256, not {}", spec.head_dim));
    }
    if spec.kv_heads == 0 || !spec.heads.is_multiple_of(spec.kv_heads) {
        return Some("the number of attention heads is not a multiple of the key/value heads".into());
    }
    None
}

/// The GPU engine on the device `setup` names, or on it and its peers in data parallel.
pub fn build(setup: &super::Setup<'_>) -> Result<Box<dyn super::Engine>, super::EngineError> {
    if setup.device.peers.is_empty() {
        return Ok(Box::new(GpuEngine::new(open(setup, setup.device.ordinal)?, setup)?));
    }
    // Each device takes its share of a micro-batch's rows (memory planning).
    let n = 1 + setup.device.peers.len();
    let share = super::Setup {
        max_batch: (setup.max_batch.0.div_ceil(n), setup.max_batch.1),
        trainable: setup.trainable.clone(),
        ..*setup
    };
    let engines = setup.device.ordinals().map(|o| GpuEngine::new(open(setup, o)?, &share)).collect::<Result<_, _>>()?;
    Ok(Box::new(Replicas::new(engines)))
}

/// GPU `ordinal` of `class` as the GPU engine opens it (CUDA with TF32 products where `tf32`).
pub fn open_device(class: DeviceClass, ordinal: usize, tf32: bool) -> Result<std::rc::Rc<dyn Gpu>, GpuError> {
    match class {
        #[cfg(feature = "cuda")]
        DeviceClass::Cuda => Ok(std::rc::Rc::new(cuda::CudaGpu::new(ordinal, tf32)?)),
        #[cfg(feature = "vulkan")]
        DeviceClass::Vulkan => Ok(std::rc::Rc::new(vulkan::VulkanGpu::new(ordinal)?)),
        other => {
            let _ = (ordinal, tf32);
            Err(GpuError::Device(format!("the GPU engine does not run on {} in this build", other.as_str())))
        }
    }
}

/// Device `ordinal` of the class `setup` names.
fn open(setup: &super::Setup<'_>, ordinal: usize) -> Result<std::rc::Rc<dyn Gpu>, super::EngineError> {
    let open = |what: &str| {
        let context = format!("cannot open the {what} device {}", setup.device.class.device_name(ordinal));
        move |source| super::EngineError::gpu(context, source)
    };
    Ok(match setup.device.class {
        #[cfg(feature = "cuda")]
        DeviceClass::Cuda => std::rc::Rc::new(cuda::CudaGpu::new(ordinal, setup.tf32).map_err(open("CUDA"))?),
        #[cfg(feature = "vulkan")]
        DeviceClass::Vulkan => {
            let gpu = vulkan::VulkanGpu::new(ordinal).map_err(open("Vulkan"))?;
            let dt = engine::compute_dtype(setup.device.dtype);
            if !gpu.supports(dt) {
                return Err(super::EngineError::Unsupported(format!(
                    "{} cannot compute in {} (it lacks 16-bit storage buffers or shaderFloat16); use f32",
                    gpu.name(),
                    setup.device.dtype.as_str()
                )));
            }
            std::rc::Rc::new(gpu)
        }
        other => {
            return Err(super::EngineError::Unsupported(format!(
                "this build's GPU engine cannot run on {} (build with `--features cuda` for NVIDIA GPUs)",
                other.as_str()
            )));
        }
    })
}
