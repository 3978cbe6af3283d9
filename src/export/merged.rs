//! The tuned model as exports write it: the base folder's weights with the train stage's result
//! applied — trained weights in place of the base's, LoRA adapters merged (`W + scale·B·A`,
//! [`lora::merge`]) — computed one tensor at a time from the mapped checkpoint, so that an export
//! never holds the model, on the export device or in host memory: the largest tensor (in f32) is
//! the most it holds.
//!
//! It also runs the two models an export checks against each other, one decoder layer at a
//! time ([`Transformer::hidden_streamed`]): the adapter model (the base weights, the adapter
//! applied in the forward pass, as the train stage computed it) and the merged model.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::engine::candle::{DecoderLayer, Observer, Transformer};
use crate::model::folder::{StoredWeights, file_element_size, tensor_bytes, write_safetensors};
use crate::model::lora::{self, LoraSpec};
use crate::model::{Batch, ModelConfig, ModelError, ModelFolder, Trainable, TrainedForm, peft};

/// One tensor of the merged model: its Hugging Face name, shape, and the dtype the base folder
/// stores it in (an export writes it so, unless told otherwise).
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// The tuned model, read lazily (see the module's documentation).
pub struct Merged<'a> {
    folder: &'a ModelFolder,
    stored: StoredWeights,
    /// Base weights the train stage replaced: a full fine-tune's `weights.safetensors`, mapped
    /// like the base, or a PEFT folder's `modules_to_save` (f32, on the CPU).
    trained: Trained,
    /// The adapter's matrices (f32, on the CPU) under PEFT's names.
    adapters: BTreeMap<String, Tensor>,
    /// The adapter's shape; `None` without one.
    lora: Option<LoraSpec>,
    /// For each weight that merges an adapter: its A and B names and the scale.
    merges: BTreeMap<String, (String, String, f64)>,
    /// The merged model's config: an adapter on a tied LM head unties it.
    config: ModelConfig,
    layout: Vec<Entry>,
    /// Told the name of each tensor [`Merged::tensor`] computes (an export's progress).
    progress: std::cell::RefCell<Option<Progress<'a>>>,
}

/// The base weights a train stage replaced.
enum Trained {
    None,
    Full(StoredWeights),
    Modules(BTreeMap<String, Tensor>),
}

impl Trained {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self {
            Trained::None => None,
            Trained::Full(s) => s.shape(name).map(<[usize]>::to_vec),
            Trained::Modules(m) => m.get(name).map(|t| t.dims().to_vec()),
        }
    }

    fn get(&self, name: &str) -> Result<Option<Tensor>, ModelError> {
        match self {
            Trained::Full(s) if s.contains(name) => s.get(name).map(Some),
            Trained::Modules(m) => Ok(m.get(name).cloned()),
            _ => Ok(None),
        }
    }
}

/// What [`Merged::on_tensor`] calls with each tensor's name.
pub type Progress<'a> = Box<dyn FnMut(&str) + 'a>;

/// Which of the two models a streamed forward computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// The base weights with the adapter applied in the forward pass.
    Adapter,
    /// The merged weights.
    Merged,
}

impl<'a> Merged<'a> {
    /// The model of `folder` with the train stage's output in `trained` (a PEFT folder or a
    /// full fine-tune's `weights.safetensors`; `None`: the base as it is). Every adapter in the
    /// output must find its linear, and every weight its shape.
    pub fn open(folder: &'a ModelFolder, trained: Option<&Path>) -> Result<Merged<'a>, ModelError> {
        let stored = folder.stored()?;
        // A full fine-tune's weights are mapped like the base's; a PEFT folder is small.
        let (trained_base, lora, adapters) = match trained.map(|dir| (dir, TrainedForm::of(dir))) {
            Some((_, TrainedForm::Full(file))) => {
                (Trained::Full(StoredWeights::open(vec![file])?), None, BTreeMap::new())
            }
            Some((dir, TrainedForm::Peft)) => {
                let (adapters, base) = crate::model::read_peft_parts(dir, &Device::Cpu)?;
                (Trained::Modules(base), Some(peft::read_config(dir)?), adapters)
            }
            _ => (Trained::None, None, BTreeMap::new()),
        };
        let cfg = &folder.config;
        let trainable = lora.clone().map(Trainable::lora).unwrap_or_default();
        let head_a = lora::param_name("lm_head", "lora_A");
        let unties = cfg.tie_word_embeddings && adapters.contains_key(&head_a);
        let mut config = cfg.clone();
        config.tie_word_embeddings &= !unties;
        let mut merged = Merged {
            folder,
            stored,
            trained: trained_base,
            adapters,
            lora,
            merges: BTreeMap::new(),
            config,
            layout: Vec::new(),
            progress: std::cell::RefCell::new(None),
        };
        let tensors = merged.config.tensors();
        let names: std::collections::BTreeSet<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
        for (name, shape) in tensors.iter().cloned() {
            let source = merged.source(&name);
            let found = match merged.trained.shape(source) {
                Some(s) => s,
                None => merged
                    .stored
                    .shape(source)
                    .ok_or_else(|| ModelError::MissingTensor { name: source.into() })?
                    .to_vec(),
            };
            if found != shape {
                return Err(ModelError::ShapeMismatch { name: source.into(), expected: shape, found });
            }
            let dtype = merged.stored.dtype(source)?;
            // The adapter this weight merges, by the rule that gives the linears their adapters.
            if let Some(prefix) = name.strip_suffix(".weight") {
                let bias = names.contains(format!("{prefix}.bias").as_str());
                if let Some(spec) = trainable.adapter_for(prefix, source, bias)? {
                    let (a, b) = (lora::param_name(prefix, "lora_A"), lora::param_name(prefix, "lora_B"));
                    for m in [&a, &b] {
                        if !merged.adapters.contains_key(m) {
                            return Err(ModelError::MissingTensor { name: m.clone() });
                        }
                    }
                    merged.merges.insert(name.clone(), (a, b, spec.scale()));
                }
            }
            merged.layout.push(Entry { name, shape, dtype });
        }
        let merging = |k: &String| merged.merges.values().any(|(a, b, _)| a == k || b == k);
        if let Some(stray) = merged.adapters.keys().find(|k| !merging(k)) {
            return Err(ModelError::StrayAdapter { name: stray.clone() });
        }
        Ok(merged)
    }

    /// The merged model's tensors in `state_dict` order.
    pub fn layout(&self) -> &[Entry] {
        &self.layout
    }

    /// How many values the merged model's tensors hold.
    pub fn params(&self) -> usize {
        self.layout.iter().map(|e| e.shape.iter().product::<usize>()).sum()
    }

    /// The merged model's config (an adapter on a tied LM head unties it).
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The base folder's config.json with what the merge changes: `tie_word_embeddings` where
    /// the head was untied, and `torch_dtype` (or transformers ≥ 4.56's `dtype`) where every
    /// tensor is written in `dtype`.
    pub fn raw_config(&self, dtype: Option<DType>) -> serde_json::Value {
        let mut raw = self.folder.raw_config.clone();
        if self.config.tie_word_embeddings != self.folder.config.tie_word_embeddings {
            raw["tie_word_embeddings"] = serde_json::json!(false);
            if raw["text_config"].is_object() {
                raw["text_config"]["tie_word_embeddings"] = serde_json::json!(false);
            }
        }
        if let Some(d) = dtype {
            let name = match d {
                DType::BF16 => "bfloat16",
                DType::F16 => "float16",
                _ => "float32",
            };
            // transformers ≥ 4.56 writes `dtype`, earlier ones `torch_dtype`: the key the base
            // has (or the old one, which every version reads).
            let keys: Vec<&str> = ["torch_dtype", "dtype"].into_iter().filter(|k| raw.get(*k).is_some()).collect();
            for key in if keys.is_empty() { vec!["torch_dtype"] } else { keys } {
                raw[key] = serde_json::json!(name);
            }
        }
        raw
    }

    /// Call `f` with the name of every tensor computed from now on (`None`: stop).
    pub fn on_tensor(&self, f: Option<Progress<'a>>) {
        *self.progress.borrow_mut() = f;
    }

    /// Merged tensor `name` in f32 on the CPU.
    pub fn tensor(&self, name: &str) -> Result<Tensor, ModelError> {
        if let Some(f) = self.progress.borrow_mut().as_mut() {
            f(name);
        }
        let w = self.unmerged(name)?;
        let Some((a, b, scale)) = self.merges.get(name) else { return Ok(w) };
        lora::merge(&w, &self.adapters[a], &self.adapters[b], *scale)
            .map_err(ModelError::candle(format!("merge `{name}`")))
    }

    /// Weight `name` as the adapter model holds it (the trained value, or the base's), in f32 on
    /// the CPU.
    fn unmerged(&self, name: &str) -> Result<Tensor, ModelError> {
        let source = self.source(name);
        let t = match self.trained.get(source)? {
            Some(t) => t,
            None => self.stored.get(source)?,
        };
        t.to_dtype(DType::F32).map_err(ModelError::candle(format!("convert `{name}`")))
    }

    /// The tensor weight `name` starts from: a head that an adapter unties starts from the
    /// embedding.
    fn source<'n>(&self, name: &'n str) -> &'n str {
        match name == "lm_head.weight" && self.folder.config.tie_word_embeddings {
            true => "model.embed_tokens.weight",
            false => name,
        }
    }

    /// The adapter model or the merged model on `device`, computing in f32, without its decoder
    /// layers: [`Streamed::hidden`] builds them one at a time.
    pub fn streamed(&self, form: Form, device: &Device) -> Result<Streamed<'_, 'a>, ModelError> {
        let (cfg, trainable) = self.form(form);
        let mut names = vec!["model.embed_tokens.weight", "model.norm.weight"];
        if !cfg.tie_word_embeddings {
            names.push("lm_head.weight");
        }
        let weights = self.weights(form, names.into_iter(), device)?;
        let head = Transformer::without_layers(cfg, &weights, &trainable, DType::F32)?;
        head.load_adapters(&self.adapters)?;
        Ok(Streamed { merged: self, form, head, device: device.clone() })
    }

    fn form(&self, form: Form) -> (&ModelConfig, Trainable) {
        match form {
            Form::Adapter => (&self.folder.config, self.lora.clone().map(Trainable::lora).unwrap_or_default()),
            Form::Merged => (&self.config, Trainable::nothing()),
        }
    }

    /// Weights `names` of model `form`, in f32 on `device`.
    fn weights<'n>(
        &self,
        form: Form,
        names: impl Iterator<Item = &'n str>,
        device: &Device,
    ) -> Result<BTreeMap<String, Tensor>, ModelError> {
        let mut out = BTreeMap::new();
        for name in names {
            let t = match form {
                Form::Adapter => self.unmerged(name)?,
                Form::Merged => self.tensor(name)?,
            };
            out.insert(name.to_string(), t.to_device(device).map_err(ModelError::candle(format!("load `{name}`")))?);
        }
        Ok(out)
    }
}

/// What [`Merged::save_safetensors`] wrote.
#[derive(Debug)]
pub struct Written {
    /// The files, in order (the index last when sharded).
    pub files: Vec<String>,
    /// The blake3 of each tensor's bytes as written, by rtune's name (the base's other tensors,
    /// carried over, by the name it stores them under).
    pub digests: BTreeMap<String, blake3::Hash>,
}

impl Merged<'_> {
    /// Write the merged model's tensors, each computed only when its turn comes
    /// ([`Merged::tensor`]), as a Hugging Face model's weights, each in its [`Entry::dtype`] or in
    /// `dtype` where given: one `model.safetensors`, or — past `max_shard_bytes` — shards
    /// `model-00001-of-0000N.safetensors` and `model.safetensors.index.json`, named as
    /// transformers' `save_pretrained` names them. Peak memory is one tensor, not the model.
    /// Returns the files written and each tensor's digest.
    pub fn save_safetensors(
        &self,
        dir: &Path,
        dtype: Option<DType>,
        max_shard_bytes: u64,
    ) -> Result<Written, ModelError> {
        // The model's tensors under the names the base stores them by, then the base's other
        // tensors (an image-text model's vision tower), carried over; beside each, the model's
        // name of it (`None`: carried over).
        let layout = self.folder.layout;
        let mut tensors: Vec<(String, DType, Vec<usize>)> = Vec::new();
        let mut model_names: Vec<Option<&str>> = Vec::new();
        for e in &self.layout {
            tensors.push((layout.stored_name(&e.name), dtype.unwrap_or(e.dtype), e.shape.clone()));
            model_names.push(Some(&e.name));
        }
        for name in self.stored.others() {
            let (shape, stored) = self.stored.other_info(name)?;
            tensors.push((name.to_string(), dtype.unwrap_or(stored), shape));
            model_names.push(None);
        }
        let size_of = |t: &(String, DType, Vec<usize>)| t.2.iter().product::<usize>() as u64 * file_element_size(t.1);
        let mut shards: Vec<Vec<usize>> = vec![vec![]];
        let mut current = 0u64;
        for (i, t) in tensors.iter().enumerate() {
            let n = size_of(t);
            if current > 0 && current + n > max_shard_bytes {
                shards.push(vec![]);
                current = 0;
            }
            shards.last_mut().expect("one shard").push(i);
            current += n;
        }
        let count = shards.len();
        let name = |k: usize| {
            if count == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{count:05}.safetensors", k + 1)
            }
        };
        let mut weight_map = serde_json::Map::new();
        let mut total = 0u64;
        let mut files = Vec::new();
        let mut digests = BTreeMap::new();
        for (k, members) in shards.iter().enumerate() {
            let file = name(k);
            let layout: Vec<(String, DType, Vec<usize>)> = members.iter().map(|&i| tensors[i].clone()).collect();
            for (name, ..) in &layout {
                weight_map.insert(name.clone(), serde_json::json!(file));
            }
            total += members.iter().map(|&i| size_of(&tensors[i])).sum::<u64>();
            write_safetensors(&dir.join(&file), &layout, |j| {
                let (stored, dtype, _) = &layout[j];
                let (name, t) = match model_names[members[j]] {
                    Some(name) => (name.to_string(), self.tensor(name)?),
                    None => (stored.clone(), self.stored.other(stored)?),
                };
                let (_, bytes) = t
                    .to_dtype(*dtype)
                    .and_then(|t| tensor_bytes(&t))
                    .map_err(ModelError::candle(format!("convert `{name}`")))?;
                digests.insert(name, blake3::hash(&bytes));
                Ok(bytes)
            })?;
            files.push(file);
        }
        if count > 1 {
            let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
            let path = dir.join("model.safetensors.index.json");
            crate::json::write_file(&path, &index)
                .map_err(ModelError::io(format!("cannot write `{}`", path.display())))?;
            files.push("model.safetensors.index.json".into());
        }
        Ok(Written { files, digests })
    }
}

/// A model of [`Merged`] run one decoder layer at a time.
pub struct Streamed<'m, 'a> {
    merged: &'m Merged<'a>,
    form: Form,
    /// The embedding, final norm and LM head.
    head: Transformer,
    device: Device,
}

impl Streamed<'_, '_> {
    /// Final hidden states of `batches` (see [`Transformer::hidden_streamed`]).
    pub fn hidden(&self, batches: &[Batch]) -> Result<Vec<Tensor>, ModelError> {
        let (_, trainable) = self.merged.form(self.form);
        self.head.hidden_streamed(batches, |i| self.layer(i, &trainable), None)
    }

    /// Runs `batches` through the decoder layers for what their linears read: `observe` sees
    /// each linear's input ([`Observer`]).
    pub fn observe(&self, batches: &[Batch], observe: Observer<'_>) -> Result<(), ModelError> {
        let (_, trainable) = self.merged.form(self.form);
        self.head.hidden_streamed(batches, |i| self.layer(i, &trainable), Some(observe)).map(drop)
    }

    /// The LM head over hidden states (f32 logits).
    pub fn logits(&self, h: &Tensor) -> Result<Tensor, ModelError> {
        self.head.head(h).map_err(ModelError::candle("LM head"))
    }

    fn layer(&self, i: usize, trainable: &Trainable) -> Result<DecoderLayer, ModelError> {
        let prefix = format!("model.layers.{i}.");
        let names = self.merged.layout.iter().map(|e| e.name.as_str()).filter(|n| n.starts_with(&prefix));
        let weights = self.merged.weights(self.form, names, &self.device)?;
        self.head.layer(i, &weights, trainable, &self.merged.adapters)
    }
}
