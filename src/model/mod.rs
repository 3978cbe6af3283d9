//! What a model is, whichever engine computes it: `config.json` read as transformers reads it
//! ([`config`]) and the architecture spec every engine builds its passes from ([`arch`]);
//! Hugging Face model folders, their checkpoint naming and weights ([`folder`], [`weights`]);
//! LoRA's adapter spec, names, merge and dropout masks ([`lora`]); PEFT adapter folders as the
//! train stage writes them and everything reads them back ([`peft`]); NF4, the codec the engines
//! compute QLoRA's frozen base with ([`nf4`]); batches ([`batch`]); and scratch models and
//! tokenizers made in code ([`scratch`]). The math itself is each engine's ([`crate::engine`]);
//! the export formats and their checks are [`crate::export`]'s.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

pub mod arch;
pub mod batch;
pub mod config;
pub mod folder;
pub mod lora;
pub mod nf4;
pub mod peft;
pub mod scratch;
pub mod weights;

pub use arch::Spec;
pub use batch::Batch;
pub use config::{ModelConfig, RawConfig};
pub use folder::{Layout, ModelFolder};
pub use lora::LoraSpec;
pub use weights::{FEEDFORWARD_NORMS, LAYER_LINEARS, QK_NORMS, Trainable};

/// Why a model could not be loaded, built or saved.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum ModelError {
    #[error("model folder `{dir}` has no `{file}`")]
    #[diagnostic(
        code(rtune::model::missing_file),
        help("a Hugging Face model folder holds config.json, *.safetensors and tokenizer.json")
    )]
    MissingFile { dir: String, file: String },
    #[error("cannot read `{path}`")]
    #[diagnostic(code(rtune::model::bad_file))]
    BadFile {
        path: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("architecture `{name}` is not supported")]
    #[diagnostic(
        code(rtune::model::architecture),
        help(
            "rtune trains LlamaForCausalLM (Llama, SmolLM, TinyLlama, Mistral-style), Qwen2ForCausalLM, \
             Qwen3ForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM (Gemma 3's text models)"
        )
    )]
    UnsupportedArchitecture { name: String },
    #[error("{what} is not supported")]
    #[diagnostic(code(rtune::model::unsupported))]
    Unsupported { what: String },
    #[error("rtune writes no GGUF of this {arch} model: {why}")]
    #[diagnostic(
        code(rtune::model::no_gguf),
        help(
            "llama.cpp would compute another model from the file; drop the `gguf-*` formats from \
             `stages.quantize.formats`: the `peft-adapter` and `safetensors-merged` exports are written"
        )
    )]
    NoGguf { arch: String, why: String },
    #[error("the adapter holds `{name}`, but its config targets no such linear of this model")]
    #[diagnostic(
        code(rtune::model::stray_adapter),
        help(
            "the adapter model would ignore it and a merge would add it: the folder was edited or belongs to another model"
        )
    )]
    StrayAdapter { name: String },
    #[error(
        "`{weight}` trains in full (`stages.train.trainable`) and also carries a LoRA adapter on `{linear}` \
         (`adapter.targets` has `{module}`)"
    )]
    #[diagnostic(
        code(rtune::model::adapter_on_trained_weight),
        help(
            "a weight trains either through an adapter or in full: leave `{module}` out of `adapter.targets`, or \
              `{weight}` out of the patterns (PEFT has no module that is both)"
        )
    )]
    AdapterOnTrainedWeight { weight: String, linear: String, module: String },
    #[error("the checkpoint has no tensor `{name}`")]
    #[diagnostic(
        code(rtune::model::missing_tensor),
        help("is config.json from the same model as the safetensors files?")
    )]
    MissingTensor { name: String },
    #[error("tensor `{name}` has shape {found:?}, but config.json implies {expected:?}")]
    #[diagnostic(code(rtune::model::shape_mismatch))]
    ShapeMismatch { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor `{name}` has dtype {dtype}, which rtune cannot load")]
    #[diagnostic(code(rtune::model::dtype), help("supported checkpoint dtypes: F32, F16, BF16"))]
    UnsupportedDtype { name: String, dtype: String },
    #[error("{context}")]
    #[diagnostic(code(rtune::model::compute))]
    Candle {
        context: String,
        #[source]
        source: candle_core::Error,
    },
    #[error("{context}")]
    #[diagnostic(code(rtune::model::tokenizer))]
    Tokenizer {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{context}")]
    #[diagnostic(code(rtune::model::io))]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl ModelError {
    pub fn candle(context: impl Into<String>) -> impl FnOnce(candle_core::Error) -> ModelError {
        let context = context.into();
        move |source| ModelError::Candle { context, source }
    }

    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ModelError {
        let context = context.into();
        move |source| ModelError::Io { context, source }
    }

    pub fn tokenizer(context: impl Into<String>) -> impl FnOnce(tokenizers::Error) -> ModelError {
        let context = context.into();
        move |source| ModelError::Tokenizer { context, source }
    }
}

/// What a train stage's output holds, f32 by name, read once.
#[derive(Debug, Default)]
pub struct TrainedOutput {
    /// The base weights it replaces, by Hugging Face name: all of `weights.safetensors` (base
    /// weights trained in full), or a PEFT folder's `modules_to_save` (trained beside the
    /// adapter); none for a plain adapter.
    pub base: BTreeMap<String, Tensor>,
    /// A PEFT folder's adapter matrices, under PEFT's names (None: no PEFT folder).
    pub adapters: Option<BTreeMap<String, Tensor>>,
}

/// What a train stage's output folder holds.
pub enum TrainedForm {
    /// Base weights trained in full: this `weights.safetensors`.
    Full(std::path::PathBuf),
    /// A PEFT folder (an adapter, and any `modules_to_save`).
    Peft,
    /// Neither.
    Nothing,
}

impl TrainedForm {
    pub fn of(dir: &Path) -> TrainedForm {
        let full = dir.join("weights.safetensors");
        if full.is_file() {
            TrainedForm::Full(full)
        } else if dir.join("adapter_config.json").is_file() {
            TrainedForm::Peft
        } else {
            TrainedForm::Nothing
        }
    }
}

/// A PEFT folder's tensors on `device`: the adapter's matrices, and the base weights it saves
/// (`modules_to_save`), each under its name.
pub type PeftParts = (BTreeMap<String, Tensor>, BTreeMap<String, Tensor>);

/// Read and split the PEFT folder `dir` ([`PeftParts`]).
pub fn read_peft_parts(dir: &Path, device: &Device) -> Result<PeftParts, ModelError> {
    Ok(peft::read_weights(dir, device)?.into_iter().partition(|(k, _)| lora::is_adapter_param(k)))
}

/// Read the train stage's output `dir` onto `device`.
pub fn read_trained(dir: &Path, device: &Device) -> Result<TrainedOutput, ModelError> {
    match TrainedForm::of(dir) {
        TrainedForm::Full(full) => {
            let t = candle_core::safetensors::load(&full, device)
                .map_err(ModelError::candle(format!("cannot read `{}`", full.display())))?;
            let base = t
                .into_iter()
                .map(|(k, v)| Ok((k, v.to_dtype(DType::F32).map_err(ModelError::candle("convert trained weights"))?)))
                .collect::<Result<_, ModelError>>()?;
            Ok(TrainedOutput { base, adapters: None })
        }
        TrainedForm::Peft => {
            let (adapters, base) = read_peft_parts(dir, device)?;
            Ok(TrainedOutput { base, adapters: Some(adapters) })
        }
        TrainedForm::Nothing => Ok(TrainedOutput::default()),
    }
}
