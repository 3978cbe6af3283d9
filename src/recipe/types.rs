//! The typed recipe: what a recipe file means once it has been checked.
//!
//! These types are the single source of truth for the recipe format: the JSON Schema in
//! `schemas/recipe.schema.json`, the structural checks in [`super::check`] and the reference in
//! `docs/recipe-reference.md` are all generated from them. Defaults live here, as serde defaults.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A whole recipe, after layering (file < `RTUNE_*` env < `--set`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Name, description and seed of the recipe.
    pub recipe: RecipeMeta,
    /// Where the base model comes from: exactly one of `repo`, `path` or `scratch`.
    pub model: ModelSource,
    /// Where the training data comes from and how it is turned into tokens.
    pub dataset: Dataset,
    /// What is trained: a LoRA adapter or the full model.
    #[serde(default)]
    pub adapter: Adapter,
    /// Ordered device and dtype preferences, with per-device stage overrides.
    #[serde(default)]
    pub device: DevicePolicy,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RecipeMeta {
    /// A short identifier, e.g. `smollm2-135m-lora`.
    #[schemars(length(min = 1))]
    pub name: String,
    /// One line saying what the recipe is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Seed for every random choice: scratch weights, data split, shuffling, LoRA init, dropout.
    #[serde(default = "default_seed")]
    pub seed: u64,
}

fn default_seed() -> u64 {
    42
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSource {
    /// A Hugging Face Hub model id, e.g. `HuggingFaceTB/SmolLM2-135M`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<String>,
    /// Branch, tag or commit of `repo`; resolved to a commit id and recorded in `rtune.lock`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// A local Hugging Face model folder (config.json, safetensors, tokenizer.json).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// A randomly initialised model of the given shape, with a tokenizer trained on the dataset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scratch: Option<ScratchModel>,
}

/// The shape of a randomly initialised model (seeded by `recipe.seed`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScratchModel {
    /// Architecture family of the model.
    #[serde(default)]
    pub arch: Arch,
    /// Width of the residual stream.
    #[schemars(range(min = 8, max = 16384))]
    pub hidden_size: usize,
    /// Decoder layers.
    #[schemars(range(min = 1, max = 256))]
    pub num_layers: usize,
    /// Attention heads (query heads).
    #[schemars(range(min = 1, max = 256))]
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to `num_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub num_kv_heads: Option<usize>,
    /// Width of each attention head [default: `hidden_size / num_heads`]. Qwen3 models use
    /// heads wider than that (Qwen3-0.6B: hidden 1024, 16 heads of 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2, max = 256))]
    pub head_dim: Option<usize>,
    /// Width of the SiLU-gated MLP.
    #[schemars(range(min = 1, max = 65536))]
    pub intermediate_size: usize,
    /// Size of the byte-level BPE tokenizer trained on the dataset (special tokens included).
    #[schemars(range(min = 300, max = 262144))]
    pub vocab_size: usize,
    /// Longest position the rotary tables cover.
    #[serde(default = "default_max_positions")]
    #[schemars(range(min = 16, max = 1048576))]
    pub max_position_embeddings: usize,
    /// Rotary embedding base.
    #[serde(default = "default_rope_theta")]
    #[schemars(range(min = 1.0))]
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    #[serde(default = "default_rms_eps")]
    #[schemars(extend("exclusiveMinimum" = 0.0), range(max = 0.1))]
    pub rms_norm_eps: f64,
    /// Share the input embedding with the LM head.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// Standard deviation of the normal initialisation, as transformers' `initializer_range`.
    #[serde(default = "default_init_range")]
    #[schemars(extend("exclusiveMinimum" = 0.0), range(max = 1.0))]
    pub initializer_range: f64,
}

fn default_max_positions() -> usize {
    2048
}
fn default_rope_theta() -> f64 {
    10000.0
}
fn default_rms_eps() -> f64 {
    1e-5
}
fn default_init_range() -> f64 {
    0.02
}
fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// `LlamaForCausalLM`: Llama 2/3, SmolLM, TinyLlama, Mistral-style.
    #[default]
    Llama,
    /// `Qwen2ForCausalLM`: Qwen2 and Qwen2.5 (q/k/v biases).
    Qwen2,
    /// `Qwen3ForCausalLM`: Qwen3 (RMSNorm on each query and key head, no biases).
    Qwen3,
    /// `Gemma2ForCausalLM`: Gemma 2 (GELU-gated MLP, RMSNorm before and after attention and the
    /// MLP, scaled embeddings, tanh-capped attention scores and logits, local attention in every
    /// other layer).
    Gemma2,
    /// `Gemma3ForCausalLM`: Gemma 3's text models (Gemma 2's layer with query/key norms instead
    /// of capped scores, five local-attention layers to a global one, each kind its own rotary
    /// base).
    Gemma3,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Dataset {
    /// A Hugging Face Hub dataset id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<String>,
    /// Branch, tag or commit of `repo`; resolved to a commit id and recorded in `rtune.lock`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// Which files of `repo` hold the rows (fnmatch patterns, `*` crosses folders).
    /// Default: every `*.jsonl`, `*.json`, `*.csv`, `*.tsv`, `*.txt` and `*.parquet` file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<Vec<String>>,
    /// A local file (jsonl, json, csv, tsv, parquet, txt) or folder, relative to the recipe, read
    /// as 🤗 datasets reads it. Text files are UTF-8 (a leading byte order mark is ignored); a CSV
    /// (tab-separated: .tsv) has a header row and RFC 4180 quoting, and quoted cells may span lines;
    /// a .json file holds a list of objects (or strings), or objects one after another. A folder's
    /// dataset card may set its config's `sep`, `field` and `sample_by` (docs/interop.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The split that trains, where `repo` or a `path` folder holds several. Files name their
    /// split as 🤗 datasets reads them: shards `data/{split}-00000-of-00001.*`, else
    /// `train`/`validation`/`test` (or `training`, `dev`, `val`, `eval`, …) in folder names, else in
    /// file names (`train.jsonl`, `test_0.csv`); with none of these every file is `train`. The
    /// other splits are not read (rtune names them). A single file is one split. [default: "train"]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// The config (subset) to read, where the dataset card (`README.md` of `repo` or of a `path`
    /// folder) names several in its `configs:` — as `load_dataset(repo, name)` does; the card then
    /// says which files each split of it holds [default: the card's default config].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    /// The CSV cell separator, over the dataset card's config (as `load_dataset(…, sep=…)`): one
    /// character, or a literal string (pandas reads a longer separator as a pattern, and then
    /// quotes are not special; a pattern is refused) [default: "," (a tab for .tsv files)].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sep: Option<String>,
    /// A JSON file is one object whose `field` holds the rows — a list of objects, a list of
    /// strings (`text` rows) or an object of equal-length lists — as
    /// `load_dataset("json", …, field=…)` reads it; over the dataset card's config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// How a text (.txt) file is cut into rows: a row per line, per paragraph (the text between
    /// blank lines) or per file, as datasets' text loader's `sample_by`; over the dataset card's
    /// config [default: "line"].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_by: Option<SampleBy>,
    /// Evaluate on every row of this split (e.g. "validation" or "test") instead of holding out
    /// `eval_fraction` of the training split; the two cannot both be set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_split: Option<String>,
    /// How rows become training text.
    pub format: DataFormat,
    /// Share of the training split's rows held out for evaluation (deterministic by seed), unless
    /// `eval_split` names a split for it. 0 holds none out: training reports its train loss, and
    /// what needs an eval split (early stopping, an evaluate stage without a `dataset` or
    /// `prompts`) is refused when the plan is made.
    #[serde(default = "default_eval_fraction")]
    #[schemars(range(min = 0.0), extend("exclusiveMaximum" = 1.0))]
    pub eval_fraction: f64,
    /// Longest sequence in tokens; longer rows are truncated (or rejected, see `truncate`).
    #[serde(default = "default_max_seq_len")]
    #[schemars(range(min = 8, max = 1048576))]
    pub max_seq_len: usize,
    /// Truncate rows longer than `max_seq_len`; when false such a row is a bad row.
    #[serde(default = "yes")]
    pub truncate: bool,
    /// Pack several rows into one sequence of `max_seq_len` tokens (each row its own segment:
    /// attention and positions never cross rows). To cut padding without changing the rows,
    /// `stages.train.group_by_length` does as well or better on the CPU (docs/benchmarks.md).
    #[serde(default)]
    pub packing: bool,
    /// Count prompt tokens in the loss too (alpaca and chat formats).
    #[serde(default)]
    pub train_on_prompt: bool,
    /// Skip malformed rows (they are counted and reported) instead of failing.
    #[serde(default)]
    pub skip_bad_rows: bool,
    /// Rename source columns to the names the format expects, e.g. `{ output = "response" }`
    /// (`chat`: `messages`, and `tools` for tool schemas).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub column_map: BTreeMap<String, String>,
    /// `chat` format: the template, `"chatml"` or a Jinja string [default: the model's
    /// `chat_template` from tokenizer_config.json].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// `chat` format: more variables for the chat template, as transformers'
    /// `apply_chat_template(…, **kwargs)` passes them, e.g. `{ enable_thinking = false }` for
    /// Qwen3's non-thinking mode. Used for the training rows and for chat prompts.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub chat_template_kwargs: BTreeMap<String, serde_json::Value>,
}

/// datasets' text loader's `sample_by`: how a text file is cut into rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SampleBy {
    /// One row per line (rtune skips blank lines).
    #[default]
    Line,
    /// One row per paragraph: the text between blank lines (`"\n\n"`), as `str.split` cuts it.
    Paragraph,
    /// One row per file.
    Document,
}

fn default_eval_fraction() -> f64 {
    0.05
}
fn default_max_seq_len() -> usize {
    1024
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// instruction / input / output, rendered with the Stanford Alpaca prompt.
    Alpaca,
    /// a `messages` list of {role, content} (or ShareGPT's `conversations` of {from, value}),
    /// rendered with the model's chat template.
    Chat,
    /// a `text` column; every token counts in the loss.
    Text,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Adapter {
    /// `lora` trains low-rank adapters on a frozen base; `none` trains every weight.
    #[serde(default)]
    pub kind: AdapterKind,
    /// LoRA rank r.
    #[serde(default = "default_rank")]
    #[schemars(range(min = 1, max = 4096))]
    pub rank: usize,
    /// LoRA alpha; the adapter output is scaled by alpha / rank (alpha / √rank with `rslora`).
    #[serde(default = "default_alpha")]
    #[schemars(extend("exclusiveMinimum" = 0.0))]
    pub alpha: f64,
    /// Rank-stabilized LoRA (Kalajdzievski 2023; PEFT's `use_rslora`): scale the adapter output
    /// by alpha / √rank, so that higher ranks keep learning instead of being scaled down.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    #[schemars(extend("default" = false))]
    pub rslora: bool,
    /// Dropout on the adapter input during training.
    #[serde(default)]
    #[schemars(range(min = 0.0), extend("exclusiveMaximum" = 1.0))]
    pub dropout: f64,
    /// Modules that get an adapter.
    #[serde(default = "default_targets")]
    #[schemars(length(min = 1))]
    pub targets: Vec<LoraTarget>,
    /// QLoRA: keep the frozen base model's linear weights (the attention and MLP projections of
    /// every layer) in 4 bits while the adapter trains — `"nf4"`, bitsandbytes' 4-bit
    /// NormalFloat in blocks of 64, as `BitsAndBytesConfig(load_in_4bit=True,
    /// bnb_4bit_quant_type="nf4")` loads them (4.5 bits a weight instead of 16), or `"nf4-dq"`
    /// with `bnb_4bit_use_double_quant=True` (the scales quantized too: 4.127 bits). A model of
    /// 8B parameters then trains in about 6 GB of weights. The adapter learns against the 4-bit
    /// weights (train and evaluate compute with them); exports merge it into the original ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize_base: Option<BaseQuant>,
}

/// How `adapter.quantize_base` stores the frozen base weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BaseQuant {
    /// 4-bit NormalFloat, blocks of 64 values with an f32 scale each
    /// (`bnb_4bit_use_double_quant=False`): 4.5 bits a weight.
    Nf4,
    /// NF4 with its block scales quantized again to 8 bits (`bnb_4bit_use_double_quant=True`,
    /// the QLoRA paper's setting): 4.127 bits a weight.
    #[serde(rename = "nf4-dq")]
    Nf4Dq,
}

impl Default for Adapter {
    fn default() -> Self {
        Adapter {
            kind: AdapterKind::default(),
            rank: default_rank(),
            alpha: default_alpha(),
            rslora: false,
            dropout: 0.0,
            targets: default_targets(),
            quantize_base: None,
        }
    }
}

fn default_rank() -> usize {
    8
}
fn default_alpha() -> f64 {
    16.0
}
fn default_targets() -> Vec<LoraTarget> {
    use LoraTarget::*;
    vec![QProj, KProj, VProj, OProj]
}

/// A decoder layer's linears, as their names continue `model.layers.<i>.` (the last part is
/// what `adapter.targets` names), in the order the engines keep them (attention q, k, v, o, then
/// the MLP's gate, up and down: `engine::Q` … `engine::DOWN`).
pub const LAYER_LINEARS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// `"adapter"` in `stages.<train>.trainable`: the LoRA adapter, not a weight pattern.
pub const ADAPTER: &str = "adapter";

/// Whether a train stage with `stages.<train>.trainable = patterns` and `adapter.kind = kind`
/// trains a LoRA adapter (saved as a PEFT folder, with any base weights that train beside it),
/// else base weights only (`weights.safetensors`).
pub fn trains_adapter(patterns: Option<&[String]>, kind: AdapterKind) -> bool {
    kind == AdapterKind::Lora && patterns.is_none_or(|p| p.iter().any(|p| p == ADAPTER))
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AdapterKind {
    #[default]
    Lora,
    /// Full fine-tuning: every weight trains.
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LoraTarget {
    QProj,
    KProj,
    VProj,
    OProj,
    GateProj,
    UpProj,
    DownProj,
    LmHead,
}

impl LoraTarget {
    pub fn as_str(self) -> &'static str {
        match self {
            LoraTarget::QProj => "q_proj",
            LoraTarget::KProj => "k_proj",
            LoraTarget::VProj => "v_proj",
            LoraTarget::OProj => "o_proj",
            LoraTarget::GateProj => "gate_proj",
            LoraTarget::UpProj => "up_proj",
            LoraTarget::DownProj => "down_proj",
            LoraTarget::LmHead => "lm_head",
        }
    }
}

/// Device policy. Besides the keys below, `[device.<name>]` tables (`cpu`, `cuda`, `cuda:N`,
/// `vulkan`, `vulkan:N`, `metal`, `rocm`, `directml`) hold stage overrides applied only when that device is chosen, e.g.
/// `[device.cpu] train.batch_size = 1`, and the device's own dtype preference, e.g.
/// `[device.rocm] dtype = ["f32"]`. Any other key is an error.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct DevicePolicy {
    /// Devices in order of preference; the first one available wins.
    #[serde(default = "default_prefer")]
    #[schemars(length(min = 1))]
    pub prefer: Vec<String>,
    /// Dtypes in order of preference; the first one the chosen device supports wins.
    #[serde(default = "default_dtypes")]
    #[schemars(length(min = 1))]
    pub dtype: Vec<Dtype>,
    /// CPU threads (default: all cores). Recorded, never part of a fingerprint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4096))]
    pub threads: Option<usize>,
    /// Let f32 matrix products on NVIDIA GPUs use TF32 tensor cores (about 1e-3 relative
    /// precision instead of f32's 1e-7, several times faster). Part of the fingerprint.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    #[schemars(extend("default" = false))]
    pub tf32: bool,
    /// How many GPUs train (and evaluate) together, data parallel: a number, or `"all"` for
    /// every GPU of the chosen one's kind (same API and vendor, supporting the chosen dtype).
    /// Each holds a copy of the model and takes a share of the rows of every micro-batch; their
    /// gradients are summed before each optimizer step, so the run trains as one device would
    /// (to the order of float sums) and no fingerprint depends on it. GPU engine only (CUDA,
    /// Vulkan); with fewer such GPUs than asked, the plan says so and uses those there are.
    #[serde(default, skip_serializing_if = "Gpus::is_one")]
    #[schemars(extend("default" = 1))]
    pub gpus: Gpus,
    /// Per-device stage overrides (`[device.<name>.<stage>]`), checked against each stage.
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub overrides: BTreeMap<String, serde_json::Value>,
}

impl DevicePolicy {
    /// The dtypes to try on `device` (`cuda:1`, `rocm`): its own `[device.<name>] dtype` list
    /// (the exact name first, then the class), else `dtype`.
    pub fn dtypes_for(&self, device: &str) -> Vec<Dtype> {
        let class = super::device_name_parts(device).0;
        [device, class]
            .iter()
            .find_map(|name| {
                let list = self.overrides.get(*name)?.get(DEVICE_DTYPE_KEY)?;
                serde_json::from_value(list.clone()).ok()
            })
            .unwrap_or_else(|| self.dtype.clone())
    }
}

impl Default for DevicePolicy {
    fn default() -> Self {
        DevicePolicy {
            prefer: default_prefer(),
            dtype: default_dtypes(),
            threads: None,
            tf32: false,
            gpus: Gpus::default(),
            overrides: BTreeMap::new(),
        }
    }
}

fn default_prefer() -> Vec<String> {
    vec!["cuda".into(), "metal".into(), "cpu".into()]
}
fn default_dtypes() -> Vec<Dtype> {
    vec![Dtype::Bf16, Dtype::F32]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }

    /// The candle dtype.
    pub fn candle(self) -> candle_core::DType {
        match self {
            Dtype::F32 => candle_core::DType::F32,
            Dtype::F16 => candle_core::DType::F16,
            Dtype::Bf16 => candle_core::DType::BF16,
        }
    }
}

/// Keys every stage table may hold besides its kind's settings.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StageCommon {
    /// The stage kind; defaults to the stage's name.
    #[serde(default)]
    pub kind: Option<StageKind>,
    /// Stages whose artifacts this one reads; defaults by kind.
    #[serde(default)]
    pub needs: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StageKind {
    Download,
    Tokenize,
    Train,
    Evaluate,
    Quantize,
    Upload,
}

impl StageKind {
    pub const ALL: [StageKind; 6] = [
        StageKind::Download,
        StageKind::Tokenize,
        StageKind::Train,
        StageKind::Evaluate,
        StageKind::Quantize,
        StageKind::Upload,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StageKind::Download => "download",
            StageKind::Tokenize => "tokenize",
            StageKind::Train => "train",
            StageKind::Evaluate => "evaluate",
            StageKind::Quantize => "quantize",
            StageKind::Upload => "upload",
        }
    }

    pub fn parse(s: &str) -> Option<StageKind> {
        StageKind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The JSON Schema of this kind's settings table.
    pub fn settings_schema(self) -> schemars::Schema {
        match self {
            StageKind::Download => schemars::schema_for!(DownloadSettings),
            StageKind::Tokenize => schemars::schema_for!(TokenizeSettings),
            StageKind::Train => schemars::schema_for!(TrainSettings),
            StageKind::Evaluate => schemars::schema_for!(EvaluateSettings),
            StageKind::Quantize => schemars::schema_for!(QuantizeSettings),
            StageKind::Upload => schemars::schema_for!(UploadSettings),
        }
    }
}

impl std::fmt::Display for StageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One stage's settings, typed by its kind with the defaults applied: what a `[stages.<name>]`
/// table means (without `kind` and `needs`), or that table with a device's overrides merged.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StageSettings {
    Download(DownloadSettings),
    Tokenize(TokenizeSettings),
    Train(TrainSettings),
    Evaluate(EvaluateSettings),
    Quantize(QuantizeSettings),
    Upload(UploadSettings),
}

impl StageSettings {
    /// A stage table of `kind` (without `kind` and `needs`), typed.
    pub fn parse(kind: StageKind, table: &serde_json::Map<String, serde_json::Value>) -> serde_json::Result<Self> {
        fn typed<T: serde::de::DeserializeOwned>(
            table: &serde_json::Map<String, serde_json::Value>,
        ) -> serde_json::Result<T> {
            serde_json::from_value(serde_json::Value::Object(table.clone()))
        }
        Ok(match kind {
            StageKind::Download => StageSettings::Download(typed(table)?),
            StageKind::Tokenize => StageSettings::Tokenize(typed(table)?),
            StageKind::Train => StageSettings::Train(typed(table)?),
            StageKind::Evaluate => StageSettings::Evaluate(typed(table)?),
            StageKind::Quantize => StageSettings::Quantize(typed(table)?),
            StageKind::Upload => StageSettings::Upload(typed(table)?),
        })
    }

    pub fn kind(&self) -> StageKind {
        match self {
            StageSettings::Download(_) => StageKind::Download,
            StageSettings::Tokenize(_) => StageKind::Tokenize,
            StageSettings::Train(_) => StageKind::Train,
            StageSettings::Evaluate(_) => StageKind::Evaluate,
            StageSettings::Quantize(_) => StageKind::Quantize,
            StageSettings::Upload(_) => StageKind::Upload,
        }
    }
}

/// `download`: materialises the model and dataset (Hub, local path or scratch).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DownloadSettings {}

/// `tokenize`: takes its settings from `[dataset]`; the table itself has none.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenizeSettings {}

/// `train`: the optimisation loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainSettings {
    /// Passes over the training split (ignored when `max_steps` is set).
    #[serde(default = "one_u32")]
    #[schemars(range(min = 1, max = 100000))]
    pub epochs: u32,
    /// Stop after this many optimizer steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_steps: Option<u64>,
    /// Sequences per micro-batch.
    #[serde(default = "default_batch")]
    #[schemars(range(min = 1, max = 65536))]
    pub batch_size: u32,
    /// Micro-batches per optimizer step.
    #[serde(default = "one_u32")]
    #[schemars(range(min = 1, max = 65536))]
    pub grad_accum: u32,
    /// Peak learning rate.
    #[serde(default = "default_lr")]
    #[schemars(extend("exclusiveMinimum" = 0.0), range(max = 10.0))]
    pub learning_rate: f64,
    /// Decoupled (AdamW) weight decay.
    #[serde(default)]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub weight_decay: f64,
    /// AdamW beta1 and beta2.
    #[serde(default = "default_betas")]
    pub betas: [f64; 2],
    /// AdamW epsilon.
    #[serde(default = "default_adam_eps")]
    #[schemars(extend("exclusiveMinimum" = 0.0))]
    pub adam_eps: f64,
    /// Learning-rate schedule.
    #[serde(default)]
    pub schedule: Schedule,
    /// Clip the global gradient norm to this value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0.0))]
    pub clip_grad_norm: Option<f64>,
    /// Evaluate on the eval split every N optimizer steps (0: only at the start and end).
    #[serde(default)]
    pub eval_every: u64,
    /// Stop when eval loss has not improved by `min_delta` for `patience` evaluations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
    /// Save a resumable checkpoint every N optimizer steps (0: never).
    #[serde(default = "default_checkpoint_every")]
    pub checkpoint_every: u64,
    /// Checkpoints kept in the work directory.
    #[serde(default = "default_keep")]
    #[schemars(range(min = 1, max = 1000))]
    pub keep_checkpoints: u32,
    /// Keep an exponential moving average of the trained weights and export it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ema: Option<Ema>,
    /// What to do when the loss is NaN/inf or spikes.
    #[serde(default)]
    pub loss_guard: LossGuard,
    /// Which parameters train: `["adapter"]` (the default with LoRA), `["all"]`, or patterns of
    /// weight names such as `["model.layers.10.*", "lm_head.weight", "*norm*"]` (selective
    /// fine-tuning; fnmatch patterns matched against whole names, as for Hub `files`).
    /// `"adapter"` needs `adapter.kind = "lora"`; beside patterns (`["adapter", "*norm*",
    /// "model.embed_tokens.weight"]`) the adapter and those base weights train together, saved as
    /// PEFT's `modules_to_save` — the patterns must leave the weights the adapter sits on alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub trainable: Option<Vec<String>>,
    /// Eval batches used for each periodic evaluation (0: the whole eval split).
    #[serde(default)]
    pub eval_batches: u64,
    /// Batch sequences of similar length: each epoch is shuffled, then sorted by length within
    /// groups of 50 batches (transformers' `group_by_length`). Far less padding, the same rows
    /// per epoch.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    #[schemars(extend("default" = false))]
    pub group_by_length: bool,
    /// Recompute each decoder layer's activations in the backward pass instead of keeping
    /// them: `true`, `false`, or `"auto"` (the default: on when they would not fit in free GPU
    /// memory). The trained weights are the same either way; memory and time change. The GPU
    /// engine implements it.
    #[serde(default, skip_serializing_if = "GradientCheckpointing::is_auto")]
    pub gradient_checkpointing: GradientCheckpointing,
}

/// A number of GPUs (1 or more) or `"all"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Gpus {
    Count(#[schemars(range(min = 1, max = 64))] u32),
    All(AllWord),
}

/// The word `all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AllWord {
    All,
}

impl Default for Gpus {
    fn default() -> Self {
        Gpus::Count(1)
    }
}

impl Gpus {
    pub fn is_one(&self) -> bool {
        *self == Gpus::Count(1)
    }

    /// The most devices this asks for.
    pub fn most(&self) -> usize {
        match self {
            Gpus::Count(n) => *n as usize,
            Gpus::All(_) => usize::MAX,
        }
    }
}

/// `true`, `false` or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum GradientCheckpointing {
    On(bool),
    Auto(AutoWord),
}

/// The word `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AutoWord {
    Auto,
}

impl Default for GradientCheckpointing {
    fn default() -> Self {
        GradientCheckpointing::Auto(AutoWord::Auto)
    }
}

impl GradientCheckpointing {
    pub fn is_auto(&self) -> bool {
        matches!(self, GradientCheckpointing::Auto(_))
    }
}

fn one_u32() -> u32 {
    1
}
fn default_batch() -> u32 {
    4
}
fn default_lr() -> f64 {
    1e-4
}
fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn default_adam_eps() -> f64 {
    1e-8
}
fn default_checkpoint_every() -> u64 {
    100
}
fn default_keep() -> u32 {
    2
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    #[serde(default)]
    pub kind: ScheduleKind,
    /// Linear warm-up steps from 0 to the peak learning rate.
    #[serde(default)]
    pub warmup_steps: u64,
    /// Warm-up as a share of all steps (instead of `warmup_steps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0), extend("exclusiveMaximum" = 1.0))]
    pub warmup_ratio: Option<f64>,
    /// Floor of the decaying schedules, as a learning rate.
    #[serde(default)]
    #[schemars(range(min = 0.0))]
    pub min_lr: f64,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule { kind: ScheduleKind::Cosine, warmup_steps: 0, warmup_ratio: None, min_lr: 0.0 }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    Constant,
    Linear,
    #[default]
    Cosine,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// Periodic evaluations (`eval_every`) in a row without an improvement before training stops.
    #[schemars(range(min = 1))]
    pub patience: u32,
    /// How far below the best eval loss so far a new one must be to count as an improvement.
    #[serde(default)]
    #[schemars(range(min = 0.0))]
    pub min_delta: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Ema {
    /// After each optimizer step, average = decay · average + (1 − decay) · weights (e.g.
    /// 0.999).
    #[schemars(extend("exclusiveMinimum" = 0.0, "exclusiveMaximum" = 1.0))]
    pub decay: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LossGuard {
    /// A loss above this multiple of the running mean counts as a spike.
    #[serde(default = "default_spike")]
    #[schemars(extend("exclusiveMinimum" = 1.0))]
    pub spike_factor: f64,
    /// Learning-rate multiplier applied after a bad step.
    #[serde(default = "default_backoff")]
    #[schemars(extend("exclusiveMinimum" = 0.0), range(max = 1.0))]
    pub lr_backoff: f64,
    /// Stop the stage (and fail) after this many bad steps.
    #[serde(default = "default_bad_steps")]
    #[schemars(range(min = 1))]
    pub max_bad_steps: u32,
}

impl Default for LossGuard {
    fn default() -> Self {
        LossGuard { spike_factor: default_spike(), lr_backoff: default_backoff(), max_bad_steps: default_bad_steps() }
    }
}

fn default_spike() -> f64 {
    5.0
}
fn default_backoff() -> f64 {
    0.5
}
fn default_bad_steps() -> u32 {
    5
}

/// `evaluate`: loss and perplexity on the eval split, and sample generations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EvaluateSettings {
    /// Which model to measure: the tuned one (needs a train stage) or the base model.
    #[serde(default)]
    pub model: EvalModel,
    /// Measure on every row of this local file or folder (relative to the recipe, read with
    /// `[dataset]`'s format and settings) instead of the eval split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset: Option<String>,
    /// Which split of a `dataset` folder to measure, named by its files as `dataset.split`
    /// says [default: the folder's one split; needed when its files name several].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// The config of a `dataset` folder's card (README.md `configs:`) whose splits to read, as
    /// `dataset.config` [default: the card's default config].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    /// Sequences per batch.
    #[serde(default = "default_batch")]
    #[schemars(range(min = 1, max = 65536))]
    pub batch_size: u32,
    /// Prompts to generate from (greedy unless `temperature` > 0), wrapped as the training data
    /// was: the Alpaca prompt for `alpaca`; for `chat`, a user turn rendered with the chat
    /// template and its generation prompt (generation then also stops at the token that ends
    /// the assistant's turn, and metrics.json records the rendered text); as they are for `text`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompts: Vec<String>,
    /// Most tokens generated for each prompt (generation stops earlier at an end-of-sequence
    /// token).
    #[serde(default = "default_new_tokens")]
    #[schemars(range(min = 1, max = 65536))]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    #[serde(default)]
    #[schemars(range(min = 0.0, max = 100.0))]
    pub temperature: f64,
    /// Sampling: draw only from the `top_k` most likely tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub top_k: Option<usize>,
    /// Sampling (nucleus): draw only from the most likely tokens whose probabilities sum to
    /// `top_p`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0.0), range(max = 1.0))]
    pub top_p: Option<f64>,
}

fn default_new_tokens() -> usize {
    32
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EvalModel {
    #[default]
    Tuned,
    Base,
    /// Both, side by side.
    Both,
}

/// `quantize`: merge and export the trained model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QuantizeSettings {
    /// What to export: `peft-adapter`, `safetensors-merged`, and GGUF files for llama.cpp and
    /// Ollama: `gguf-f32`, `gguf-f16`, `gguf-q8_0`, `gguf-q6_k`, `gguf-q5_k_m`, `gguf-q5_k_s`,
    /// `gguf-q4_k_m` (or its older name `gguf-q4_k`), `gguf-q4_k_s`, `gguf-q4_0`, `gguf-q3_k_l`,
    /// `gguf-q3_k_m`, `gguf-q3_k_s`, `gguf-q2_k` — each tensor in the type
    /// llama.cpp's `llama-quantize` gives it for that file type, with its bytes (GGUFs are checked
    /// by reading them back: perplexity against the unquantized model) [default without a LoRA
    /// adapter: the list without `peft-adapter`].
    #[serde(default = "default_formats")]
    #[schemars(length(min = 1))]
    pub formats: Vec<ExportFormat>,
    /// `safetensors-merged`: largest weights file, e.g. `"5GB"` or `"500MB"` (KB/MB/GB are
    /// powers of 1000, KiB/MiB/GiB of 1024, as in transformers); bigger models are written as
    /// shards plus `model.safetensors.index.json` [default: 5GB].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+)?\s*([KMGT]i?B|B)$"))]
    pub max_shard_size: Option<String>,
    /// `safetensors-merged`: the dtype the merged weights are written in, `"f32"`, `"bf16"` or
    /// `"f16"` (the merge itself is computed in f32 and rounded once) [default: each tensor as the
    /// base model stores it, as PEFT's `merge_and_unload` leaves a model loaded in its own dtype].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_dtype: Option<Dtype>,
    /// GGUF: calibrate the quantization with an importance matrix of the exported model on the
    /// train split (llama.cpp's `llama-imatrix`, then `llama-quantize --imatrix`): the types that
    /// search their scales (`q6_k` and below) weigh each weight by how strongly the model reads
    /// its input column, and the matrix is written beside the files as `gguf/imatrix.gguf` for
    /// llama.cpp's other types; `false` quantizes as plain `llama-quantize` [default: true;
    /// computed only when a listed format uses it].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imatrix: Option<bool>,
    /// GGUF: calibration tokens for the importance matrix, from train rows in a fixed shuffled
    /// order (the last one cut) [default: 16384, llama-imatrix's 32 chunks of 512; on the CPU no
    /// more than about 4·10¹² multiply-adds allow for the model's size, at least 512].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub imatrix_tokens: Option<u64>,
    /// GGUF: calibrate with this importance matrix instead of computing one — a file of
    /// llama.cpp's `llama-imatrix` (its GGUF, or the older `.dat`), such as one published beside
    /// the base model's GGUFs; a path relative to the recipe, hashed by content. Its matrices
    /// must have this model's shapes [default: computed from the train split].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imatrix_file: Option<String>,
}

impl QuantizeSettings {
    pub const DEFAULT_SHARD: u64 = 5_000_000_000;
    pub const DEFAULT_IMATRIX_TOKENS: u64 = 16_384;

    /// Whether GGUF exports are calibrated with an importance matrix (the default).
    pub fn uses_imatrix(&self) -> bool {
        self.imatrix.unwrap_or(true)
    }

    pub fn shard_bytes(&self) -> Result<u64, String> {
        self.max_shard_size.as_deref().map_or(Ok(Self::DEFAULT_SHARD), parse_size)
    }
}

/// `"5GB"` → 5·10⁹, `"512MiB"` → 512·2²⁰.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("`{s}` is not a size like \"5GB\""))?;
    let mult: f64 = match unit.trim() {
        "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024f64.powi(2),
        "GiB" => 1024f64.powi(3),
        "TiB" => 1024f64.powi(4),
        _ => return Err(format!("`{s}`: unknown unit (use B, KB, MB, GB, KiB, MiB or GiB)")),
    };
    let v = (n * mult).round();
    if v < 1.0 {
        return Err(format!("`{s}` is too small"));
    }
    Ok(v as u64)
}

fn default_formats() -> Vec<ExportFormat> {
    vec![ExportFormat::PeftAdapter, ExportFormat::SafetensorsMerged, ExportFormat::GgufQ8_0]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
pub enum ExportFormat {
    #[serde(rename = "peft-adapter")]
    PeftAdapter,
    #[serde(rename = "safetensors-merged")]
    SafetensorsMerged,
    #[serde(rename = "gguf-f32")]
    GgufF32,
    #[serde(rename = "gguf-f16")]
    GgufF16,
    #[serde(rename = "gguf-q8_0")]
    GgufQ8_0,
    #[serde(rename = "gguf-q6_k")]
    GgufQ6K,
    #[serde(rename = "gguf-q5_k_m")]
    GgufQ5KM,
    #[serde(rename = "gguf-q5_k_s")]
    GgufQ5KS,
    #[serde(rename = "gguf-q4_k_m")]
    GgufQ4KM,
    #[serde(rename = "gguf-q4_k_s")]
    GgufQ4KS,
    #[serde(rename = "gguf-q4_0")]
    GgufQ4_0,
    #[serde(rename = "gguf-q3_k_l")]
    GgufQ3KL,
    #[serde(rename = "gguf-q3_k_m")]
    GgufQ3KM,
    #[serde(rename = "gguf-q3_k_s")]
    GgufQ3KS,
    #[serde(rename = "gguf-q2_k")]
    GgufQ2K,
    /// `gguf-q4_k_m`'s older name: a recipe that names it exports `gguf-q4_k_m`.
    #[serde(rename = "gguf-q4_k")]
    GgufQ4K,
}

impl ExportFormat {
    /// A GGUF whose quantizers search their scales and so use an importance matrix (`q6_k` and
    /// below; not f32, f16 or q8_0, which llama.cpp quantizes the same with or without one).
    pub fn calibrated(self) -> bool {
        use ExportFormat as F;
        !matches!(self, F::PeftAdapter | F::SafetensorsMerged | F::GgufF32 | F::GgufF16 | F::GgufQ8_0)
    }

    /// The format an older name stands for (`gguf-q4_k` → `gguf-q4_k_m`), else itself.
    pub fn canonical(self) -> ExportFormat {
        match self {
            ExportFormat::GgufQ4K => ExportFormat::GgufQ4KM,
            other => other,
        }
    }
}

/// `upload`: publish the exported artifacts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadSettings {
    /// `dir://path` (relative to the recipe) or `hf://owner/name[@revision]`
    /// (`hf://datasets/owner/name` for a dataset repo).
    #[schemars(length(min = 1))]
    pub to: String,
    /// `hf://` only: create the repo if it does not exist.
    #[serde(default)]
    pub create: bool,
    /// `hf://` with `create`: make the new repo private.
    #[serde(default = "yes")]
    pub private: bool,
    /// `hf://` only: the commit message [default: "Upload <recipe> with rtune"].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Recipe {
    /// The JSON Schema of a recipe file, with the per-kind stage schemas under `$defs`.
    pub fn json_schema() -> serde_json::Value {
        let mut root = serde_json::to_value(schemars::schema_for!(Recipe)).expect("schema");
        let defs = root.as_object_mut().expect("object schema").entry("$defs").or_insert_with(|| serde_json::json!({}));
        let mut kinds = Vec::new();
        for kind in StageKind::ALL {
            let mut s = serde_json::to_value(kind.settings_schema()).expect("schema");
            let obj = s.as_object_mut().expect("object schema");
            if let Some(serde_json::Value::Object(sub)) = obj.remove("$defs") {
                for (k, v) in sub {
                    defs[k] = v;
                }
            }
            obj.remove("$schema");
            let props = obj.entry("properties").or_insert_with(|| serde_json::json!({}));
            props["kind"] = serde_json::json!({ "const": kind.as_str() });
            props["needs"] = serde_json::json!({ "type": "array", "items": { "type": "string" } });
            defs[format!("{}Stage", capitalise(kind.as_str()))] = s;
            kinds.push(serde_json::json!({ "$ref": format!("#/$defs/{}Stage", capitalise(kind.as_str())) }));
        }
        root["properties"]["stages"] = serde_json::json!({
            "description": "The stages to run, by name. A stage's kind is its name unless `kind` says otherwise.",
            "type": "object",
            "additionalProperties": { "anyOf": kinds }
        });
        root["properties"]["device"]["additionalProperties"] = serde_json::json!({
            "description": "Stage overrides applied when this device is chosen (`[device.cpu] train.batch_size = 1`), and the device's own dtype preference (`[device.rocm] dtype = [\"f32\"]`).",
            "type": "object",
            "additionalProperties": { "type": "object" }
        });
        crate::json::sorted(root)
    }
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
}

/// The key of a `[device.<name>]` table that holds the device's dtype preference rather than a
/// stage's overrides.
pub const DEVICE_DTYPE_KEY: &str = "dtype";
