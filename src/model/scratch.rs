//! Scratch models: a byte-level BPE tokenizer trained in code and randomly initialised weights
//! (seeded, as transformers' `_init_weights` does it), saved as a normal HF model folder.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::json;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

use super::config::{ModelConfig, RawConfig};
use super::{ModelError, folder};
use crate::recipe::ScratchModel;
use crate::rng::Rng;

pub const PAD: &str = "<pad>";
pub const BOS: &str = "<s>";
pub const EOS: &str = "</s>";

/// Train a byte-level BPE tokenizer (GPT-2 style, as SmolLM and Qwen use) of `vocab_size`
/// tokens, with `<pad>`, `<s>`, `</s>` as ids 0, 1, 2 and a post-processor that adds `<s>`.
/// `texts` is consumed as it comes (the trainer keeps word counts, not the texts).
pub fn train_tokenizer<I, S>(texts: I, vocab_size: usize) -> Result<Tokenizer, ModelError>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    let specials = [PAD, BOS, EOS].map(|t| AddedToken::from(t, true));
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.to_vec())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let mut trainer = TrainerWrapper::BpeTrainer(trainer);
    tokenizer.train(&mut trainer, texts).map_err(ModelError::tokenizer("cannot train the scratch tokenizer"))?;
    tokenizer.add_special_tokens(specials.clone()).map_err(ModelError::tokenizer("cannot add special tokens"))?;
    let bos_id = tokenizer.token_to_id(BOS).unwrap_or(1);
    let post = TemplateProcessing::builder()
        .try_single(format!("{BOS} $A"))
        .and_then(|b| b.try_pair(format!("{BOS} $A {BOS} $B")))
        .map_err(|e| ModelError::Tokenizer { context: "template".into(), source: e.into() })?
        .special_tokens(vec![(BOS, bos_id)])
        .build()
        .map_err(|e| ModelError::Tokenizer { context: "template".into(), source: Box::new(e) })?;
    tokenizer.with_post_processor(Some(post));
    Ok(tokenizer)
}

/// Random weights for `cfg`, named as transformers names them.
pub fn init_weights(
    cfg: &ModelConfig,
    init_range: f64,
    seed: u64,
    device: &Device,
) -> Result<BTreeMap<String, Tensor>, ModelError> {
    let normal = |name: &str, shape: &[usize]| -> Result<Tensor, ModelError> {
        let mut rng = Rng::derive(seed, &format!("scratch:{name}"));
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (rng.normal() * init_range) as f32).collect();
        Tensor::from_vec(v, shape, device).map_err(ModelError::candle(format!("init `{name}`")))
    };
    let mut out = BTreeMap::new();
    for (name, shape) in cfg.tensors() {
        let t = if name.ends_with("norm.weight") && cfg.norm_offset {
            // Gemma's norms hold offsets from one.
            Tensor::zeros(shape.as_slice(), candle_core::DType::F32, device).map_err(ModelError::candle("init norm"))?
        } else if name.ends_with("norm.weight") {
            Tensor::ones(shape.as_slice(), candle_core::DType::F32, device).map_err(ModelError::candle("init norm"))?
        } else if name.ends_with(".bias") {
            Tensor::zeros(shape.as_slice(), candle_core::DType::F32, device).map_err(ModelError::candle("init bias"))?
        } else if name == "model.embed_tokens.weight"
            && let Some(pad) = cfg.pad_token_id
        {
            // nn.Embedding(padding_idx=pad) keeps the padding row at zero.
            let mut rows: Vec<Vec<f32>> =
                normal(&name, &shape)?.to_vec2().map_err(ModelError::candle("init embeddings"))?;
            if let Some(r) = rows.get_mut(pad as usize) {
                r.iter_mut().for_each(|x| *x = 0.0);
            }
            Tensor::new(rows, device).map_err(ModelError::candle("init embeddings"))?
        } else {
            normal(&name, &shape)?
        };
        out.insert(name, t);
    }
    Ok(out)
}

/// Write a complete HF model folder for a scratch model: tokenizer trained on `texts`, config,
/// random weights, tokenizer_config.json and generation_config.json.
pub fn create<I, S>(dir: &Path, spec: &ScratchModel, texts: I, seed: u64) -> Result<ModelConfig, ModelError>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    let tokenizer = train_tokenizer(texts, spec.vocab_size)?;
    let id = |t: &str| tokenizer.token_to_id(t).unwrap_or(0);
    let (pad, bos, eos) = (id(PAD), id(BOS), id(EOS));
    let raw = ModelConfig::scratch_raw(spec, bos, eos, pad);
    let mut raw_cfg: RawConfig = serde_json::from_value(raw.clone()).expect("scratch config parses");
    // The trained vocabulary can be smaller than asked when the corpus is small.
    let real_vocab = tokenizer.get_vocab_size(true);
    raw_cfg.vocab_size = spec.vocab_size.max(real_vocab);
    let cfg = ModelConfig::from_raw(&raw_cfg)?;
    let mut raw = raw;
    raw["vocab_size"] = json!(cfg.vocab_size);
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(ModelError::io(format!("cannot write `{}`", p.display())))
    };
    write("config.json", pretty(&raw))?;
    tokenizer
        .save(dir.join("tokenizer.json"), true)
        .map_err(ModelError::tokenizer("cannot save the scratch tokenizer"))?;
    write(
        "tokenizer_config.json",
        pretty(&json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": null,
            "add_bos_token": true,
            "add_eos_token": false,
            "model_max_length": spec.max_position_embeddings,
            "clean_up_tokenization_spaces": false,
        })),
    )?;
    write("generation_config.json", pretty(&json!({ "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad })))?;
    let weights = init_weights(&cfg, spec.initializer_range, seed, &Device::Cpu)?;
    folder::save_safetensors(&dir.join("model.safetensors"), &weights)?;
    Ok(cfg)
}

fn pretty(v: &serde_json::Value) -> String {
    let mut s = crate::json::pretty_sorted(v);
    s.push('\n');
    s
}
