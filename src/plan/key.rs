//! What each stage is given, which is exactly what its fingerprint hashes.
//!
//! The planner resolves every stage of a recipe into one typed key per stage kind: defaults and
//! `[device.<name>]` overrides applied, local sources reduced to content digests, Hub revisions
//! to commit ids. The key is hashed as canonical JSON (with the stage's input fingerprints and
//! the format versions, see [`document`]), and it is everything the stage's executor receives
//! from the recipe: what an executor can read is, by construction, in the fingerprint.
//!
//! A few fields are not hashed, and say so: where to find something whose *content* is hashed
//! (a local source's path beside its digest), where to point an error in the recipe file, and
//! which of several identical devices runs the stage. The doc comments on the fields are the
//! reference for what invalidates a stage; `rtune explain RECIPE STAGE` prints the key.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Serialize, Serializer};
use serde_json::{Value, json};

use super::HubSource;
use crate::device::{DeviceClass, Resolution};
use crate::fingerprint::{FINGERPRINT_VERSION, stage_version};
use crate::recipe::{
    Adapter, DataFormat, Dtype, EvaluateSettings, QuantizeSettings, ScratchModel, StageKind, TrainSettings,
    UploadSettings,
};

/// One stage's key, by kind.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum StageKey {
    Download(DownloadKey),
    Tokenize(TokenizeKey),
    Train(TrainKey),
    Evaluate(EvaluateKey),
    Quantize(QuantizeKey),
    Upload(UploadKey),
}

impl StageKey {
    pub fn kind(&self) -> StageKind {
        match self {
            StageKey::Download(_) => StageKind::Download,
            StageKey::Tokenize(_) => StageKind::Tokenize,
            StageKey::Train(_) => StageKind::Train,
            StageKey::Evaluate(_) => StageKind::Evaluate,
            StageKey::Quantize(_) => StageKind::Quantize,
            StageKey::Upload(_) => StageKind::Upload,
        }
    }

    /// The device the stage computes on, for the kinds whose numbers depend on it.
    pub fn device(&self) -> Option<&DeviceKey> {
        match self {
            StageKey::Train(k) => Some(&k.device),
            StageKey::Evaluate(k) => Some(&k.device),
            StageKey::Quantize(k) => Some(&k.device),
            _ => None,
        }
    }
}

/// The document a stage's fingerprint is the blake3 of: its key, its kind, the versions of the
/// fingerprint layout and of the kind's output, and its inputs' fingerprints by port (`model`,
/// `tokens`, …; an upload's card also reads `card:train` and `card:eval:<stage>`).
pub fn document(key: &StageKey, inputs: &BTreeMap<String, String>) -> Value {
    let mut doc = serde_json::to_value(key).expect("stage keys serialise");
    let kind = key.kind();
    doc["fingerprint_version"] = json!(FINGERPRINT_VERSION);
    doc["stage_version"] = json!(stage_version(kind));
    doc["kind"] = json!(kind.as_str());
    doc["inputs"] = json!(inputs);
    crate::json::sorted(doc)
}

/// `download`: the base model and the dataset.
#[derive(Debug, Clone, Serialize)]
pub struct DownloadKey {
    pub settings: DownloadSettings,
    /// What the recipe's sources hold (see [`Source`]).
    pub sources: Sources,
}

#[derive(Debug, Clone, Serialize)]
pub struct DownloadSettings {
    pub model: ModelKey,
    pub dataset: DatasetKey,
}

/// Where the base model comes from.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum ModelKey {
    /// A randomly initialised model of this shape, seeded by `recipe.seed`, with a BPE tokenizer
    /// trained on the dataset's rows as `corpus` renders them.
    Scratch { scratch: ScratchModel, seed: u64, vocab_from: &'static str, corpus: Box<Corpus> },
    /// A local folder, hashed by content (`sources.model`), not by its path.
    Path { path: &'static str },
    /// A Hub repo at a revision; the commit it resolved to is `sources.model`.
    Repo { repo: String, revision: String },
}

/// Where the dataset comes from; its content is `sources.dataset`.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum DatasetKey {
    /// A Hub dataset; where its card names configs, only `config`'s files (the default
    /// config's when None) and the card are fetched.
    Repo {
        repo: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        config: Option<String>,
    },
    Path {
        path: &'static str,
    },
}

/// How a scratch tokenizer sees a row: `dataset.format` and `dataset.column_map`.
#[derive(Debug, Clone, Serialize)]
pub struct Corpus {
    pub format: DataFormat,
    pub column_map: BTreeMap<String, String>,
    /// The split whose rows it learns, for a folder or Hub dataset (a single file: None).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// `dataset.config`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    /// `dataset.sep`, `dataset.field`, `dataset.sample_by`.
    #[serde(flatten)]
    pub reading: crate::data::configs::Overrides,
    /// `chat` rows only: [`CHAT_RENDERING`] (since 2, rows whose replies hold only tool calls
    /// are read, their other messages' text learned).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_rendering: Option<u32>,
}

/// Shown instead of a local path: the content is hashed, not where it lies.
pub const BY_CONTENT: &str = "(by content)";

/// The sources a stage reads directly.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sources {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<Source>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset: Option<Source>,
    /// `quantize`'s `imatrix_file`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub imatrix: Option<Source>,
}

/// A source, hashed by what it holds.
#[derive(Debug, Clone)]
pub enum Source {
    /// A local file or folder: hashed as its content digest. `path` (where it is read, resolved
    /// against the recipe's folder), `shown` (as the recipe writes it) and `at` (the recipe key
    /// naming it) are not hashed; the executor checks the digest of what it read.
    Local { digest: String, path: PathBuf, shown: String, at: Vec<String> },
    /// A Hub repo: hashed as its id, the revision asked for, the commit it resolved to and the
    /// file patterns wanted.
    Hub { source: HubSource, commit: String },
}

impl Serialize for Source {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Source::Local { digest, .. } => s.serialize_str(digest),
            Source::Hub { source, commit } => {
                let mut v = json!({
                    "hub": source.repo.id,
                    "revision": source.repo.revision,
                    "commit": commit,
                    "include": source.wanted.include,
                });
                if !source.wanted.exclude.is_empty() {
                    v["exclude"] = json!(source.wanted.exclude);
                }
                v.serialize(s)
            }
        }
    }
}

/// The version of chat-template rendering, in the key of what renders `chat` rows (tokenize,
/// an evaluate stage's own data). History: 1 (unrecorded) — minijinja's `tojson` (HTML
/// escapes, Rust's float text), JSON floats read to within an ulp, messages cut to `role` and
/// `content`; 2 — `tojson` writes what transformers' does (Python's `json.dumps`), dicts a
/// template builds and those of the rows keep their order, JSON floats read exactly, messages
/// reach the template whole with the row's `tools` (and `documents` as none).
pub const CHAT_RENDERING: u32 = 2;

/// How dataset rows become token sequences (`tokenize`, and an `evaluate` stage with its own
/// dataset): the `[dataset]` keys that shape each row.
#[derive(Debug, Clone, Serialize)]
pub struct Rendering {
    pub format: DataFormat,
    pub column_map: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub chat_template_kwargs: BTreeMap<String, Value>,
    /// `chat` rows only: how rtune renders templates, [`CHAT_RENDERING`] (absent before 2, so
    /// other formats keep their fingerprints).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_rendering: Option<u32>,
    pub max_seq_len: usize,
    pub truncate: bool,
    pub train_on_prompt: bool,
    pub skip_bad_rows: bool,
}

/// `tokenize`: the rendering, the seeded train/eval split and packing (the model's tokenizer
/// and the dataset are inputs).
#[derive(Debug, Clone, Serialize)]
pub struct TokenizeKey {
    pub settings: TokenizeSettings,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizeSettings {
    #[serde(flatten)]
    pub rendering: Rendering,
    pub eval_fraction: f64,
    /// The split that trains, for a folder or Hub dataset (a single file is one split: None).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// The split that evaluates, instead of `eval_fraction` of the train split.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_split: Option<String>,
    /// The dataset card's config the splits are of (`dataset.config`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    /// `dataset.sep`, `dataset.field`, `dataset.sample_by`.
    #[serde(flatten)]
    pub reading: crate::data::configs::Overrides,
    pub packing: bool,
    /// Seeds the split.
    pub seed: u64,
}

/// The device a stage computes on, where its numbers depend on it.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceKey {
    pub class: DeviceClass,
    pub dtype: Dtype,
    /// TF32 tensor cores for f32 products (`device.tf32`), only where it applies (CUDA).
    #[serde(skip_serializing_if = "is_false")]
    pub tf32: bool,
    /// The engine `RTUNE_ENGINE` asks for (engines sum in different orders).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// The switches that change which kernels compute on this device (`RTUNE_GPU_ATTENTION=scalar`,
    /// [`crate::switches::Switches::kernels`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kernels: Vec<String>,
    /// Which device of the class (`cuda:1`): not hashed, identical devices compute the same.
    #[serde(skip)]
    pub ordinal: usize,
    /// Devices that work alongside it (data parallel; train and evaluate stages): not hashed
    /// either, the sum of their gradients is one device's to the order of float sums.
    #[serde(skip)]
    pub peers: Vec<usize>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl DeviceKey {
    /// The CPU in f32, for what runs outside a plan (`rtune chat` of a model folder).
    pub fn cpu() -> DeviceKey {
        DeviceKey {
            class: crate::device::DeviceClass::Cpu,
            dtype: crate::recipe::Dtype::F32,
            tf32: false,
            engine: crate::switches::Switches::get().engine.clone(),
            kernels: crate::switches::Switches::get().kernels(crate::device::DeviceClass::Cpu),
            ordinal: 0,
            peers: Vec::new(),
        }
    }

    /// The device to build an engine on.
    pub fn resolution(&self) -> Resolution {
        Resolution {
            class: self.class,
            ordinal: self.ordinal,
            dtype: self.dtype,
            peers: self.peers.clone(),
            ..Resolution::cpu()
        }
    }
}

/// `train`: the training settings, the adapter and the seed (LoRA initialisation, dropout
/// masks, data order), on a device.
#[derive(Debug, Clone, Serialize)]
pub struct TrainKey {
    pub settings: TrainKeySettings,
    pub device: DeviceKey,
}

#[derive(Debug, Clone, Serialize)]
pub struct TrainKeySettings {
    pub train: TrainSettings,
    pub adapter: Adapter,
    pub seed: u64,
}

/// `evaluate`: what is measured and generated, on a device.
#[derive(Debug, Clone, Serialize)]
pub struct EvaluateKey {
    pub settings: EvaluateKeySettings,
    pub device: DeviceKey,
    /// The stage's own dataset, by content, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sources: Option<Sources>,
}

#[derive(Debug, Clone, Serialize)]
pub struct EvaluateKeySettings {
    pub evaluate: EvaluateSettings,
    /// How the stage's own dataset is tokenized (only with `dataset`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Rendering>,
    /// `prompts` are wrapped as the data was (the Alpaca prompt for `alpaca`).
    pub prompt_format: DataFormat,
    /// `chat` data with `prompts`: each prompt is a user turn rendered with the template the
    /// data was (`dataset.chat_template`, else the model's) and its generation prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_template: Option<Template>,
    /// The base model computes with its linears in 4 bits, as the adapter trained
    /// (`adapter.quantize_base`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_quant: Option<crate::recipe::BaseQuant>,
    /// Seeds sampling.
    pub seed: u64,
}

/// `quantize`: the export formats and what the exported files name, on a device (in f32).
#[derive(Debug, Clone, Serialize)]
pub struct QuantizeKey {
    pub settings: QuantizeKeySettings,
    pub device: DeviceKey,
    /// The importance matrix file, by content, when the recipe names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sources: Option<Sources>,
}

#[derive(Debug, Clone, Serialize)]
pub struct QuantizeKeySettings {
    pub quantize: QuantizeSettings,
    pub adapter: Adapter,
    /// The GGUF's `general.name` (`recipe.name`).
    pub name: String,
    /// PEFT's `base_model_name_or_path`: the Hub id, else the folder as the recipe names it.
    pub base_name: String,
    /// The chat template the exports ship: the data's format and `dataset.chat_template`.
    pub template: Template,
}

#[derive(Debug, Clone, Serialize)]
pub struct Template {
    pub format: DataFormat,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// `dataset.chat_template_kwargs` where prompts are rendered (not what an export ships).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub chat_template_kwargs: BTreeMap<String, Value>,
}

/// `upload`: where to, and the model card written beside the exports.
#[derive(Debug, Clone, Serialize)]
pub struct UploadKey {
    pub settings: UploadKeySettings,
    /// Where a `dir://` destination lies (resolved against the recipe's folder): not hashed;
    /// `plan` checks the files there and copies them again from the store when they are missing
    /// or changed.
    #[serde(skip)]
    pub dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct UploadKeySettings {
    pub upload: UploadSettings,
    pub card: Card,
}

/// What the model card says besides the evaluations and training metrics (inputs).
#[derive(Debug, Clone, Serialize)]
pub struct Card {
    /// `recipe.name`.
    pub name: String,
    /// `recipe.description`.
    pub description: Option<String>,
    /// The recipe file's text (shown in the card), hashed by its blake3.
    pub recipe_text: RecipeText,
    /// The recipe as `rtune run` is told to run it: its file name, or the built-in's name.
    pub recipe_file: String,
    /// What was layered over the file ([`crate::recipe::LoadedRecipe::overrides`]): `RTUNE_…`
    /// variables and `--set` arguments, so the card's command reproduces the run.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<String>,
    /// The base model as named: Hub id, local path, or a scratch model.
    pub base: String,
    /// The Hub id of the base model, for the card's `base_model`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_repo: Option<String>,
    /// The Hub id of the dataset, for the card's `datasets`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset_repo: Option<String>,
    /// A LoRA adapter (`library_name: peft` and the `lora` tag).
    pub lora: bool,
    /// The adapter trained over a 4-bit base (`adapter.quantize_base`; the `qlora` tag).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qlora: Option<crate::recipe::BaseQuant>,
}

/// A text that is hashed by its digest.
#[derive(Debug, Clone)]
pub struct RecipeText(pub String);

impl Serialize for RecipeText {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(blake3::hash(self.0.as_bytes()).to_hex().as_str())
    }
}

/// The input ports of a planned stage, by name, to their producers' fingerprints.
pub type Inputs = BTreeMap<String, String>;

/// The evaluations an upload's card reads, as (stage name, fingerprint), by name.
pub fn card_evaluations(inputs: &Inputs) -> Vec<(&str, &str)> {
    inputs.iter().filter_map(|(port, fp)| Some((port.strip_prefix("card:eval:")?, fp.as_str()))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::{RepoKind, RepoRef, Wanted};

    fn device() -> DeviceKey {
        DeviceKey {
            class: DeviceClass::Cuda,
            dtype: Dtype::Bf16,
            tf32: false,
            engine: None,
            kernels: Vec::new(),
            ordinal: 1,
            peers: vec![2],
        }
    }

    fn rendering() -> Rendering {
        Rendering {
            format: DataFormat::Alpaca,
            column_map: BTreeMap::from([("output".into(), "response".into())]),
            chat_template: None,
            chat_template_kwargs: BTreeMap::new(),
            chat_rendering: None,
            max_seq_len: 256,
            truncate: true,
            train_on_prompt: false,
            skip_bad_rows: false,
        }
    }

    fn typed<T: serde::de::DeserializeOwned>(v: Value) -> T {
        serde_json::from_value(v).unwrap()
    }

    /// One key of every kind, as the canonical JSON its fingerprint hashes. A change here is a
    /// change of fingerprint semantics: bump FINGERPRINT_VERSION and write down why.
    #[test]
    fn every_kind_hashes_this_document() {
        let local = |digest: &str| Source::Local {
            digest: digest.into(),
            path: PathBuf::from("/not/hashed"),
            shown: "not hashed".into(),
            at: vec!["not".into(), "hashed".into()],
        };
        let hub = Source::Hub {
            source: HubSource {
                repo: RepoRef::new("owner/data", RepoKind::Dataset, Some("v1")).unwrap(),
                wanted: Wanted { include: vec!["*.jsonl".into()], exclude: vec![".*".into()] },
                at: ["dataset", "repo"],
            },
            commit: "c".repeat(40),
        };
        let inputs = |ports: &[&str]| -> Inputs { ports.iter().map(|p| (p.to_string(), format!("fp-{p}"))).collect() };
        let cases = [
            (
                StageKey::Download(DownloadKey {
                    settings: DownloadSettings {
                        model: ModelKey::Path { path: BY_CONTENT },
                        dataset: DatasetKey::Repo { repo: "owner/data".into(), config: None },
                    },
                    sources: Sources { model: Some(local("m")), dataset: Some(hub), imatrix: None },
                }),
                inputs(&[]),
                r#"{"fingerprint_version":3,"inputs":{},"kind":"download","settings":{"dataset":{"repo":"owner/data"},"model":{"path":"(by content)"}},"sources":{"dataset":{"commit":"cccccccccccccccccccccccccccccccccccccccc","exclude":[".*"],"hub":"owner/data","include":["*.jsonl"],"revision":"v1"},"model":"m"},"stage_version":3}"#,
            ),
            (
                StageKey::Tokenize(TokenizeKey {
                    settings: TokenizeSettings {
                        rendering: rendering(),
                        eval_fraction: 0.05,
                        split: None,
                        eval_split: None,
                        config: None,
                        reading: Default::default(),
                        packing: true,
                        seed: 7,
                    },
                }),
                inputs(&["dataset", "model"]),
                r#"{"fingerprint_version":3,"inputs":{"dataset":"fp-dataset","model":"fp-model"},"kind":"tokenize","settings":{"column_map":{"output":"response"},"eval_fraction":0.05,"format":"alpaca","max_seq_len":256,"packing":true,"seed":7,"skip_bad_rows":false,"train_on_prompt":false,"truncate":true},"stage_version":4}"#,
            ),
            (
                StageKey::Train(TrainKey {
                    settings: TrainKeySettings {
                        train: typed(json!({ "max_steps": 3 })),
                        adapter: Adapter::default(),
                        seed: 7,
                    },
                    device: DeviceKey {
                        tf32: true,
                        engine: Some("gpu".into()),
                        kernels: vec!["RTUNE_GPU_ATTENTION=scalar".into()],
                        ..device()
                    },
                }),
                inputs(&["model", "tokens"]),
                r#"{"device":{"class":"cuda","dtype":"bf16","engine":"gpu","kernels":["RTUNE_GPU_ATTENTION=scalar"],"tf32":true},"fingerprint_version":3,"inputs":{"model":"fp-model","tokens":"fp-tokens"},"kind":"train","settings":{"adapter":{"alpha":16.0,"dropout":0.0,"kind":"lora","rank":8,"targets":["q_proj","k_proj","v_proj","o_proj"]},"seed":7,"train":{"adam_eps":1e-8,"batch_size":4,"betas":[0.9,0.999],"checkpoint_every":100,"epochs":1,"eval_batches":0,"eval_every":0,"grad_accum":1,"keep_checkpoints":2,"learning_rate":0.0001,"loss_guard":{"lr_backoff":0.5,"max_bad_steps":5,"spike_factor":5.0},"max_steps":3,"schedule":{"kind":"cosine","min_lr":0.0,"warmup_steps":0},"weight_decay":0.0}},"stage_version":5}"#,
            ),
            (
                StageKey::Evaluate(EvaluateKey {
                    settings: EvaluateKeySettings {
                        evaluate: typed(json!({ "dataset": "held-out.jsonl", "prompts": ["hi"] })),
                        data: Some(rendering()),
                        prompt_format: DataFormat::Alpaca,
                        prompt_template: None,
                        base_quant: None,
                        seed: 7,
                    },
                    device: device(),
                    sources: Some(Sources { dataset: Some(local("d")), ..Sources::default() }),
                }),
                inputs(&["model", "weights"]),
                r#"{"device":{"class":"cuda","dtype":"bf16"},"fingerprint_version":3,"inputs":{"model":"fp-model","weights":"fp-weights"},"kind":"evaluate","settings":{"data":{"column_map":{"output":"response"},"format":"alpaca","max_seq_len":256,"skip_bad_rows":false,"train_on_prompt":false,"truncate":true},"evaluate":{"batch_size":4,"dataset":"held-out.jsonl","max_new_tokens":32,"model":"tuned","prompts":["hi"],"temperature":0.0},"prompt_format":"alpaca","seed":7},"sources":{"dataset":"d"},"stage_version":5}"#,
            ),
            (
                StageKey::Quantize(QuantizeKey {
                    settings: QuantizeKeySettings {
                        quantize: typed(json!({ "formats": ["gguf-q4_k_m"], "imatrix_file": BY_CONTENT })),
                        adapter: Adapter::default(),
                        name: "r".into(),
                        base_name: "owner/model".into(),
                        template: Template {
                            format: DataFormat::Chat,
                            chat_template: Some("chatml".into()),
                            chat_template_kwargs: BTreeMap::new(),
                        },
                    },
                    device: DeviceKey { dtype: Dtype::F32, ..device() },
                    sources: Some(Sources { imatrix: Some(local("i")), ..Sources::default() }),
                }),
                inputs(&["model", "tokens", "weights"]),
                r#"{"device":{"class":"cuda","dtype":"f32"},"fingerprint_version":3,"inputs":{"model":"fp-model","tokens":"fp-tokens","weights":"fp-weights"},"kind":"quantize","settings":{"adapter":{"alpha":16.0,"dropout":0.0,"kind":"lora","rank":8,"targets":["q_proj","k_proj","v_proj","o_proj"]},"base_name":"owner/model","name":"r","quantize":{"formats":["gguf-q4_k_m"],"imatrix_file":"(by content)"},"template":{"chat_template":"chatml","format":"chat"}},"sources":{"imatrix":"i"},"stage_version":10}"#,
            ),
            (
                StageKey::Upload(UploadKey {
                    settings: UploadKeySettings {
                        upload: typed(json!({ "to": "dir://out" })),
                        card: Card {
                            name: "r".into(),
                            description: None,
                            recipe_text: RecipeText("[recipe]\n".into()),
                            recipe_file: "r.toml".into(),
                            overrides: Vec::new(),
                            base: "a scratch model".into(),
                            base_repo: None,
                            dataset_repo: Some("owner/data".into()),
                            lora: true,
                            qlora: None,
                        },
                    },
                    dir: Some(PathBuf::from("/not/hashed")),
                }),
                inputs(&["card:eval:evaluate", "card:train", "exports"]),
                r#"{"fingerprint_version":3,"inputs":{"card:eval:evaluate":"fp-card:eval:evaluate","card:train":"fp-card:train","exports":"fp-exports"},"kind":"upload","settings":{"card":{"base":"a scratch model","dataset_repo":"owner/data","description":null,"lora":true,"name":"r","recipe_file":"r.toml","recipe_text":"988a6e910b06428699de6ae11ce030a0f4da9c5486c43810270b8fb4f85a1bf3"},"upload":{"create":false,"private":true,"to":"dir://out"}},"stage_version":5}"#,
            ),
        ];
        for (key, inputs, want) in cases {
            let got = serde_json::to_string(&document(&key, &inputs)).unwrap();
            assert!(!got.contains("hashed"), "a field marked `not hashed` was hashed: {got}");
            assert_eq!(got, want, "{:?}", key.kind());
        }
    }
}
