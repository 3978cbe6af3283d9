//! GGUF export in llama.cpp's conventions (gguf-py's constants and convert_hf_to_gguf.py):
//! `blk.N.attn_q.weight`-style tensor names, `general.*` and `<arch>.*` metadata, the tokenizer
//! embedded as `tokenizer.ggml.*` (byte-level BPE as `gpt2`, a SentencePiece model's pieces as
//! `llama`), Llama's q/k rows permuted for llama.cpp's interleaved rotary embedding, llama3 rope
//! factors as `rope_freqs.weight`, Gemma's norms stored as `1 + w`, and 1-D tensors kept in f32.
//! The container is GGUF v2, as candle's `gguf_file::write` writes it, but streamed: the header
//! first, then each tensor computed, quantized and written in turn (never the model in memory).

use std::path::Path;

use candle_core::Tensor;
use candle_core::quantized::{GgmlDType, gguf_file::Value};

use crate::model::{ModelConfig, ModelError};
use crate::recipe::{Arch, ExportFormat};

pub mod imatrix;
pub mod quants;
pub mod read;
pub mod spm;

pub use imatrix::Imatrix;

/// llama.cpp token types.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// One tensor of a GGUF export: which of the model's weights, its llama.cpp name and ggml type,
/// and why it is not in the type it would have had (a row that is not whole blocks).
#[derive(Debug, Clone, PartialEq)]
pub struct Typed {
    pub index: usize,
    pub name: String,
    pub ty: GgmlDType,
    pub fallback: Option<String>,
}

/// The tensors of a GGUF export of `cfg` in `target`: each of `weights` (Hugging Face names
/// and shapes) that llama.cpp reads, named as llama.cpp names it, matrices in the type
/// [`tensor_type`] chooses and vectors (norms, biases) in f32.
/// `imatrix`: whether the export has an importance matrix (llama.cpp then gives `q4_0`'s first
/// MLP down projections Q4_1).
pub fn tensor_types(cfg: &ModelConfig, weights: &[(String, Vec<usize>)], target: Target, imatrix: bool) -> Vec<Typed> {
    // `lm_head.weight` is among the weights only when the head is untied or carries a merged
    // adapter; llama.cpp then reads `output.weight`, otherwise it reuses `token_embd.weight`.
    let tied = !weights.iter().any(|(n, _)| n == "lm_head.weight");
    // llama.cpp's model size "70B": Llama with 80 layers and grouped-query attention (with as
    // many key/value heads as query heads it is "65B"), Qwen2 with 80.
    let is_70b = cfg.num_layers == 80
        && match cfg.arch {
            Arch::Llama => cfg.num_kv_heads != cfg.num_heads,
            Arch::Qwen2 => true,
            Arch::Qwen3 | Arch::Gemma2 | Arch::Gemma3 => false,
        };
    let gqa = cfg.num_heads / cfg.num_kv_heads.max(1);
    let mut out = Vec::new();
    for (index, (hf, shape)) in weights.iter().enumerate() {
        let Some(name) = tensor_name(hf, cfg.sandwich_norms) else { continue };
        let (ty, fallback) = match shape.as_slice() {
            [_, row] => {
                let site = Site { name: &name, row: *row, layers: cfg.num_layers, tied, is_70b, gqa, imatrix };
                tensor_type(target, &site)
            }
            _ => (GgmlDType::F32, None),
        };
        out.push(Typed { index, name, ty, fallback });
    }
    out
}

/// llama.cpp's name for `cfg`'s architecture, or why rtune writes no GGUF of it: a model that
/// llama.cpp would compute otherwise than transformers (it hard-codes parts of Gemma's config).
pub fn architecture(cfg: &ModelConfig) -> Result<&'static str, ModelError> {
    let arch = match cfg.arch {
        Arch::Llama => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
        Arch::Gemma2 => "gemma2",
        Arch::Gemma3 => "gemma3",
    };
    match llama_cpp_misreads(cfg) {
        Some(why) => Err(ModelError::NoGguf { arch: arch_title(cfg.arch).into(), why }),
        None => Ok(arch),
    }
}

fn arch_title(arch: Arch) -> &'static str {
    match arch {
        Arch::Llama => "Llama",
        Arch::Qwen2 => "Qwen2",
        Arch::Qwen3 => "Qwen3",
        Arch::Gemma2 => "Gemma 2",
        Arch::Gemma3 => "Gemma 3",
    }
}

/// What llama.cpp would read otherwise than the config says, for Gemma: llama.cpp derives the
/// attention scale from the head size (from hidden / heads for the 27B, which it knows by its
/// layer count), has no score cap in Gemma 3 and always caps Gemma 2, scales only Gemma 3's
/// global rotary embedding (linearly), and reads no LM head of Gemma 2.
fn llama_cpp_misreads(cfg: &ModelConfig) -> Option<String> {
    let name = arch_title(cfg.arch);
    let big = match cfg.arch {
        Arch::Gemma2 => cfg.num_layers == 46,
        Arch::Gemma3 => cfg.num_layers == 62,
        _ => return None,
    };
    let scalar = if big { (cfg.hidden_size / cfg.num_heads) as f64 } else { cfg.head_dim as f64 };
    if (cfg.attn_scale * scalar.sqrt() - 1.0).abs() > 1e-9 {
        let from = if big { "hidden size / heads, as for the 27B" } else { "the head size" };
        return Some(format!(
            "llama.cpp scales {name}'s attention scores by 1/√{scalar} ({from}), but config.json's \
             `query_pre_attn_scalar` gives 1/√{}",
            cfg.attn_scale.powi(-2)
        ));
    }
    match cfg.arch {
        Arch::Gemma3 if cfg.attn_softcap.is_some() => {
            return Some(
                "llama.cpp's Gemma 3 has no cap on attention scores (config.json `attn_logit_softcapping`)".into(),
            );
        }
        Arch::Gemma2 if cfg.attn_softcap.is_none() || cfg.final_softcap.is_none() => {
            return Some(
                "llama.cpp's Gemma 2 caps attention scores and logits (config.json `attn_logit_softcapping`, \
                 `final_logit_softcapping`)"
                    .into(),
            );
        }
        Arch::Gemma2 if !cfg.tie_word_embeddings => {
            return Some("llama.cpp's Gemma 2 reads no LM head of its own (an adapter on `lm_head` untied it)".into());
        }
        _ => {}
    }
    match (&cfg.rope_scaling, cfg.arch) {
        (None, _) => None,
        (Some(r), Arch::Gemma3) if r.rope_type.as_deref() == Some("linear") => None,
        (Some(r), _) => Some(format!(
            "llama.cpp reads no `{}` rotary scaling of {name}",
            r.rope_type.as_deref().unwrap_or("unnamed")
        )),
    }
}

/// A GGUF export format: the ggml type most tensors take, llama.cpp's `general.file_type`
/// (`llama_ftype`) and the name in the file (`model-<tag>.gguf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub format: ExportFormat,
    pub ty: GgmlDType,
    pub file_type: u32,
    pub tag: &'static str,
}

/// The GGUF target of an export format (`None` for the folders).
pub fn target(format: ExportFormat) -> Option<Target> {
    use ExportFormat as F;
    let (ty, file_type, tag) = match format {
        F::GgufF32 => (GgmlDType::F32, 0, "f32"),
        F::GgufF16 => (GgmlDType::F16, 1, "f16"),
        F::GgufQ8_0 => (GgmlDType::Q8_0, 7, "q8_0"),
        F::GgufQ6K => (GgmlDType::Q6K, 18, "q6_k"),
        F::GgufQ5KM => (GgmlDType::Q5K, 17, "q5_k_m"),
        F::GgufQ5KS => (GgmlDType::Q5K, 16, "q5_k_s"),
        F::GgufQ4KM | F::GgufQ4K => (GgmlDType::Q4K, 15, "q4_k_m"),
        F::GgufQ4KS => (GgmlDType::Q4K, 14, "q4_k_s"),
        F::GgufQ4_0 => (GgmlDType::Q4_0, 2, "q4_0"),
        F::GgufQ3KL => (GgmlDType::Q3K, 13, "q3_k_l"),
        F::GgufQ3KM => (GgmlDType::Q3K, 12, "q3_k_m"),
        F::GgufQ3KS => (GgmlDType::Q3K, 11, "q3_k_s"),
        F::GgufQ2K => (GgmlDType::Q2K, 10, "q2_k"),
        F::PeftAdapter | F::SafetensorsMerged => return None,
    };
    Some(Target { format: format.canonical(), ty, file_type, tag })
}

/// Where a weight sits, for [`tensor_type`]: what llama.cpp's choice of type looks at.
#[derive(Debug, Clone, Copy)]
pub struct Site<'a> {
    /// llama.cpp's name of the tensor.
    pub name: &'a str,
    /// Values per row (GGUF's `ne[0]`).
    pub row: usize,
    pub layers: usize,
    /// The token embeddings are also the output layer (no `output.weight` in the file).
    pub tied: bool,
    /// llama.cpp takes the model for a 70B (80 layers, grouped-query attention) and gives its
    /// small value projections more bits.
    pub is_70b: bool,
    /// Query heads per key/value head (llama.cpp's `n_gqa`).
    pub gqa: usize,
    /// The export has an importance matrix.
    pub imatrix: bool,
}

/// The ggml type of a 2-D weight in `target`, as llama.cpp's `llama-quantize` chooses it
/// (`llama_tensor_get_type` for these architectures, without overrides): the output layer (or
/// tied embeddings) in Q6_K; for `q4_k_m`/`q5_k_m` the value projections and MLP down
/// projections of the first and last eighths of the layers and every third between in Q6_K, for
/// `q4_k_s` those of the first layers in Q5_K; the 3- and 2-bit mixes' wider value, output and
/// down projections (Q3_K to Q5_K by layer, head grouping and mix); then, where a row is not
/// whole blocks, llama.cpp's fallback (Q2_K/Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0,
/// else F16).
/// With an importance matrix, `q4_0` stores the first eighth's MLP down projections in Q4_1.
/// Returns the type and, when the row forced a fallback, why.
pub fn tensor_type(target: Target, site: &Site<'_>) -> (GgmlDType, Option<String>) {
    use ExportFormat as F;
    let mut ty = target.ty;
    if matches!(ty, GgmlDType::F32 | GgmlDType::F16) {
        return (ty, None);
    }
    let layer = || {
        let rest = site.name.strip_prefix("blk.")?;
        rest.split_once('.')?.0.parse::<usize>().ok()
    };
    // llama.cpp's `use_more_bits`.
    let more_bits = |i: usize, n: usize| i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64) % 3 == 2;
    let (n, part) = (site.layers, site.name.rsplit('.').nth(1).unwrap_or(""));
    if site.name == "output.weight" || (site.tied && site.name == "token_embd.weight") {
        ty = if !site.row.is_multiple_of(target.ty.block_size()) {
            GgmlDType::Q8_0
        } else if ty != GgmlDType::Q8_0 {
            GgmlDType::Q6K
        } else {
            ty
        };
    } else if let Some(i) = layer() {
        match (part, target.format) {
            ("attn_v", F::GgufQ2K) => ty = if site.gqa >= 4 { GgmlDType::Q4K } else { GgmlDType::Q3K },
            ("attn_v", F::GgufQ3KM) => ty = if i < 2 { GgmlDType::Q5K } else { GgmlDType::Q4K },
            ("attn_v", F::GgufQ3KL) => ty = GgmlDType::Q5K,
            ("attn_v", F::GgufQ4KM | F::GgufQ5KM) if more_bits(i, n) => ty = GgmlDType::Q6K,
            ("attn_v", F::GgufQ4KS) if i < 4 => ty = GgmlDType::Q5K,
            ("ffn_down", F::GgufQ2K) => ty = GgmlDType::Q3K,
            ("ffn_down", F::GgufQ3KM) => ty = if i < n / 16 { GgmlDType::Q5K } else { GgmlDType::Q4K },
            ("ffn_down", F::GgufQ3KL) => ty = GgmlDType::Q5K,
            ("ffn_down", F::GgufQ4KM | F::GgufQ5KM) if more_bits(i, n) => ty = GgmlDType::Q6K,
            ("ffn_down", F::GgufQ4KS) if i < n / 8 => ty = GgmlDType::Q5K,
            ("attn_output", F::GgufQ2K) => ty = GgmlDType::Q3K,
            ("attn_output", F::GgufQ3KM) => ty = GgmlDType::Q4K,
            ("attn_output", F::GgufQ3KL) => ty = GgmlDType::Q5K,
            // "Guard against craziness in the first few ffn_down layers" (llama.cpp), only
            // with an importance matrix, so that a file without one stays as it was.
            ("ffn_down", F::GgufQ4_0) if site.imatrix && i < n / 8 => ty = GgmlDType::Q4_1,
            _ => {}
        }
        if part == "attn_v" && site.is_70b && matches!(ty, GgmlDType::Q3K | GgmlDType::Q4K) {
            ty = GgmlDType::Q5K;
        }
    }
    if site.row.is_multiple_of(ty.block_size()) {
        return (ty, None);
    }
    let mut fallback = match ty {
        GgmlDType::Q2K | GgmlDType::Q3K => GgmlDType::Q4_0,
        GgmlDType::Q4K => GgmlDType::Q5_0,
        GgmlDType::Q5K => GgmlDType::Q5_1,
        GgmlDType::Q6K => GgmlDType::Q8_0,
        other => other,
    };
    if !site.row.is_multiple_of(fallback.block_size()) {
        fallback = GgmlDType::F16;
    }
    let why = format!(
        "{}: {fallback:?} (rows of {} are not a multiple of {ty:?}'s {})",
        site.name,
        site.row,
        ty.block_size()
    );
    (fallback, Some(why))
}

/// What was written.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GgufReport {
    pub tensors: usize,
    /// Of which two-dimensional (the quantized ones).
    pub matrices: usize,
    /// Tensors stored in another type than asked (rows not a multiple of the block size).
    pub fallbacks: Vec<String>,
}

/// llama.cpp's name for an HF tensor name. `sandwich`: the model normalises the attention's and
/// the MLP's outputs (Gemma), where `post_attention_layernorm` is the attention's output norm and
/// `pre_feedforward_layernorm` the MLP's input norm (Llama's `post_attention_layernorm`).
pub fn tensor_name(hf: &str, sandwich: bool) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let (module, kind) = tail.rsplit_once('.')?;
    let name = match (module, sandwich) {
        ("input_layernorm", _) => "attn_norm",
        ("post_attention_layernorm", false) => "ffn_norm",
        ("post_attention_layernorm", true) => "post_attention_norm",
        ("pre_feedforward_layernorm", true) => "ffn_norm",
        ("post_feedforward_layernorm", true) => "post_ffw_norm",
        ("self_attn.q_proj", _) => "attn_q",
        ("self_attn.k_proj", _) => "attn_k",
        ("self_attn.v_proj", _) => "attn_v",
        ("self_attn.o_proj", _) => "attn_output",
        ("mlp.gate_proj", _) => "ffn_gate",
        ("mlp.up_proj", _) => "ffn_up",
        ("mlp.down_proj", _) => "ffn_down",
        ("self_attn.q_norm", _) => "attn_q_norm",
        ("self_attn.k_norm", _) => "attn_k_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{name}.{kind}"))
}

/// convert_hf_to_gguf's `permute`: HF's rotate-half layout of q/k rows → llama.cpp's interleaved.
fn permute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (out, inp) = w.dims2()?;
    w.reshape((heads, 2, out / heads / 2, inp))?.transpose(1, 2)?.contiguous()?.reshape((out, inp))
}

/// The chat template a GGUF carries and the token id that ends an assistant turn.
#[derive(Debug, Clone, Copy)]
pub struct ChatMetadata<'a> {
    pub template: &'a str,
    pub turn_end: Option<u32>,
}

/// Write the merged model (its tensors computed, quantized and dropped one by one) and the
/// tokenizer of `model_dir` as GGUF; with `imatrix`, each decoder matrix quantized as
/// `llama-quantize --imatrix` would with that importance matrix (written beside it as
/// `imatrix.gguf`, which the metadata names).
pub fn write(
    path: &Path,
    merged: &super::merged::Merged<'_>,
    model_dir: &Path,
    name: &str,
    format: ExportFormat,
    chat: Option<ChatMetadata<'_>>,
    imatrix: Option<&Imatrix>,
) -> Result<GgufReport, ModelError> {
    let cfg = merged.config();
    let target = target(format).ok_or_else(|| ModelError::Unsupported { what: format!("{format:?} as GGUF") })?;
    let arch = architecture(cfg)?;
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(name.into())),
        ("general.file_type".into(), Value::U32(target.file_type)),
        ("general.quantization_version".into(), Value::U32(2)),
    ];
    md.extend(model_metadata(cfg, arch));
    md.extend(tokenizer_metadata(cfg, model_dir, chat)?);
    // What llama-quantize records of an importance matrix.
    if let Some(im) = imatrix.filter(|_| target.ty != GgmlDType::F32 && target.ty != GgmlDType::F16) {
        md.push(("quantize.imatrix.file".into(), Value::String("imatrix.gguf".into())));
        if let Some(d) = im.datasets.first() {
            md.push(("quantize.imatrix.dataset".into(), Value::String(d.clone())));
        }
        md.push(("quantize.imatrix.entries_count".into(), Value::U32(im.len() as u32)));
        if im.chunks() > 0 {
            md.push(("quantize.imatrix.chunks_count".into(), Value::U32(im.chunks())));
        }
    }

    // What each tensor will be — its ggml type follows from its shape and place — so that the
    // header, with every tensor's offset, is written before any tensor is computed.
    let weights: Vec<(String, Vec<usize>)> =
        merged.layout().iter().map(|e| (e.name.clone(), e.shape.clone())).collect();
    let mut fallbacks = Vec::new();
    let mut plan: Vec<Planned> = tensor_types(cfg, &weights, target, imatrix.is_some())
        .into_iter()
        .map(|t| {
            fallbacks.extend(t.fallback);
            let (hf, shape) = &weights[t.index];
            Planned { name: t.name, source: Source::Merged(hf.clone()), shape: shape.clone(), ty: t.ty }
        })
        .collect();
    if let Some(factors) = llama3_rope_factors(cfg) {
        let shape = vec![factors.len()];
        plan.push(Planned {
            name: "rope_freqs.weight".into(),
            source: Source::Values(factors),
            shape,
            ty: GgmlDType::F32,
        });
    }
    plan.sort_by_key(|p| tensor_order(&p.name));
    let err = |n: &str| ModelError::candle(format!("convert `{n}` for GGUF"));
    // One merged tensor at a time: computed, quantized, written, dropped.
    write_file(path, &md, &plan, |p| {
        let mut t = match &p.source {
            Source::Merged(hf) => merged.tensor(hf)?,
            Source::Values(v) => Tensor::new(v.as_slice(), &candle_core::Device::Cpu).map_err(err(&p.name))?,
        };
        if cfg.arch == Arch::Llama && p.name.ends_with("attn_q.weight") {
            t = permute(&t, cfg.num_heads).map_err(err(&p.name))?;
        } else if cfg.arch == Arch::Llama && p.name.ends_with("attn_k.weight") {
            t = permute(&t, cfg.num_kv_heads).map_err(err(&p.name))?;
        } else if cfg.norm_offset && p.name.ends_with("norm.weight") {
            // llama.cpp's Gemma multiplies by the norm's weight: the `1 + w` Gemma computes.
            t = t.affine(1.0, 1.0).map_err(err(&p.name))?;
        }
        let values = t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(err(&p.name))?;
        drop(t);
        // The importance is per input column: the same for Llama's permuted q/k rows.
        let importance = imatrix.and_then(|im| im.importance(&p.name));
        quants::quantize(p.ty, &values, importance.as_deref())
            .map_err(|e| ModelError::Unsupported { what: format!("`{}` as GGUF: {e}", p.name) })
    })?;
    let matrices = plan.iter().filter(|p| p.shape.len() == 2).count();
    Ok(GgufReport { tensors: plan.len(), matrices, fallbacks })
}

/// Writes a GGUF v2 file of metadata `md` and the tensors `plan`: the header first (every
/// tensor's offset follows from its shape and type), then each tensor's bytes from `data` in
/// turn, checked against the size planned, and synced.
fn write_file(
    path: &Path,
    md: &[(String, Value)],
    plan: &[Planned],
    mut data: impl FnMut(&Planned) -> Result<Vec<u8>, ModelError>,
) -> Result<(), ModelError> {
    let io = |e| ModelError::Io { context: format!("cannot write `{}`", path.display()), source: e };
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = Counted { inner: std::io::BufWriter::new(file), written: 0 };
    write_header(&mut w, md, plan).map_err(io)?;
    for p in plan {
        let bytes = data(p)?;
        if bytes.len() != p.bytes() {
            return Err(ModelError::Unsupported {
                what: format!("`{}` quantized to {} bytes, not the {} planned", p.name, bytes.len(), p.bytes()),
            });
        }
        w.write_all(&bytes).map_err(io)?;
        w.pad().map_err(io)?;
    }
    let file = w.inner.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)
}

/// A tensor of the GGUF to be written: its llama.cpp name, where its values come from, its
/// shape (rows first, as candle's) and ggml type.
struct Planned {
    name: String,
    source: Source,
    shape: Vec<usize>,
    ty: GgmlDType,
}

enum Source {
    /// A merged model tensor, by its Hugging Face name.
    Merged(String),
    Values(Vec<f32>),
}

impl Planned {
    /// The tensor's bytes in the file (before padding).
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() / self.ty.block_size() * self.ty.type_size()
    }
}

/// GGUF aligns tensor data to 32 bytes.
const ALIGNMENT: u64 = 32;

/// A writer that counts its bytes, for GGUF's alignment padding.
struct Counted<W> {
    inner: W,
    written: u64,
}

impl<W: std::io::Write> Counted<W> {
    fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.written += b.len() as u64;
        self.inner.write_all(b)
    }

    fn pad(&mut self) -> std::io::Result<()> {
        let n = self.written.next_multiple_of(ALIGNMENT) - self.written;
        self.write_all(&vec![0u8; n as usize])
    }

    fn string(&mut self, s: &str) -> std::io::Result<()> {
        self.write_all(&(s.len() as u64).to_le_bytes())?;
        self.write_all(s.as_bytes())
    }

    fn value(&mut self, v: &Value) -> std::io::Result<()> {
        match v {
            Value::U8(x) => self.write_all(&x.to_le_bytes()),
            Value::I8(x) => self.write_all(&x.to_le_bytes()),
            Value::U16(x) => self.write_all(&x.to_le_bytes()),
            Value::I16(x) => self.write_all(&x.to_le_bytes()),
            Value::U32(x) => self.write_all(&x.to_le_bytes()),
            Value::I32(x) => self.write_all(&x.to_le_bytes()),
            Value::U64(x) => self.write_all(&x.to_le_bytes()),
            Value::I64(x) => self.write_all(&x.to_le_bytes()),
            Value::F32(x) => self.write_all(&x.to_le_bytes()),
            Value::F64(x) => self.write_all(&x.to_le_bytes()),
            Value::Bool(x) => self.write_all(&[u8::from(*x)]),
            Value::String(x) => self.string(x),
            Value::Array(items) => {
                // Every element has the first's type (the arrays rtune writes are uniform).
                self.write_all(&items.first().map_or(4, value_type).to_le_bytes())?;
                self.write_all(&(items.len() as u64).to_le_bytes())?;
                items.iter().try_for_each(|x| self.value(x))
            }
        }
    }
}

/// GGUF's code of a metadata value's type.
fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// ggml's code of a tensor type.
fn ggml_type(t: GgmlDType) -> u32 {
    match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

/// The GGUF v2 header: magic, version, counts, metadata, and each tensor's name, dimensions
/// (innermost first), type and offset in the data section, which starts aligned.
fn write_header<W: std::io::Write>(
    w: &mut Counted<W>,
    md: &[(String, Value)],
    plan: &[Planned],
) -> std::io::Result<()> {
    w.write_all(&0x4655_4747u32.to_le_bytes())?;
    w.write_all(&2u32.to_le_bytes())?;
    w.write_all(&(plan.len() as u64).to_le_bytes())?;
    w.write_all(&(md.len() as u64).to_le_bytes())?;
    for (key, v) in md {
        w.string(key)?;
        w.write_all(&value_type(v).to_le_bytes())?;
        w.value(v)?;
    }
    let mut offset = 0u64;
    for p in plan {
        w.string(&p.name)?;
        w.write_all(&(p.shape.len() as u32).to_le_bytes())?;
        for d in p.shape.iter().rev() {
            w.write_all(&(*d as u64).to_le_bytes())?;
        }
        w.write_all(&ggml_type(p.ty).to_le_bytes())?;
        w.write_all(&offset.to_le_bytes())?;
        offset += (p.bytes() as u64).next_multiple_of(ALIGNMENT);
    }
    w.pad()
}

/// llama.cpp's usual order: embeddings, blocks in order, output norm and head.
fn tensor_order(name: &str) -> (usize, usize, String) {
    match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
        Some((n, rest)) => (1, n.parse().unwrap_or(0), rest.to_string()),
        None if name.starts_with("token_embd") || name.starts_with("rope_freqs") => (0, 0, name.to_string()),
        None => (2, 0, name.to_string()),
    }
}

/// The per-frequency divisors llama.cpp applies for llama3 rope scaling.
fn llama3_rope_factors(cfg: &ModelConfig) -> Option<Vec<f32>> {
    // Only llama3's: llama.cpp reads linear scaling from the metadata, and an architecture whose
    // tensors do not include `rope_freqs` refuses a file that has one.
    let rs = cfg.rope_scaling.as_ref().filter(|r| r.rope_type.as_deref() == Some("llama3"))?;
    let factor = rs.factor.unwrap_or(8.0);
    let low = rs.low_freq_factor.unwrap_or(1.0);
    let high = rs.high_freq_factor.unwrap_or(4.0);
    let old = rs.original_max_position_embeddings.unwrap_or(8192) as f64;
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    let d = cfg.head_dim;
    Some(
        (0..d / 2)
            .map(|i| {
                let freq = 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let f = if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                f as f32
            })
            .collect(),
    )
}

/// The `<arch>.*` metadata: what convert_hf_to_gguf.py writes for the architecture, and so what
/// llama.cpp reads (for Gemma, besides what it hard-codes: [`llama_cpp_misreads`]).
fn model_metadata(cfg: &ModelConfig, arch: &str) -> Vec<(String, Value)> {
    let a = |k: &str| format!("{arch}.{k}");
    let u = |x: usize| Value::U32(x as u32);
    let mut md = vec![
        (a("context_length"), u(cfg.max_position_embeddings)),
        (a("embedding_length"), u(cfg.hidden_size)),
        (a("block_count"), u(cfg.num_layers)),
        (a("feed_forward_length"), u(cfg.intermediate_size)),
        (a("attention.head_count"), u(cfg.num_heads)),
        (a("attention.head_count_kv"), u(cfg.num_kv_heads)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_norm_eps as f32)),
    ];
    if matches!(cfg.arch, Arch::Gemma2 | Arch::Gemma3) {
        md.push((a("attention.key_length"), u(cfg.head_dim)));
        md.push((a("attention.value_length"), u(cfg.head_dim)));
        // Gemma 2's converter writes no rotary base (llama.cpp's default is Gemma 2's 10000).
        if cfg.arch == Arch::Gemma3 || cfg.rope_theta != 10000.0 {
            md.push((a("rope.freq_base"), Value::F32(cfg.rope_theta as f32)));
        }
        if let Some(r) = &cfg.rope_scaling {
            md.push((a("rope.scaling.type"), Value::String("linear".into())));
            md.push((a("rope.scaling.factor"), Value::F32(r.factor.unwrap_or(1.0) as f32)));
        }
        if let Some(local) = &cfg.local_attention {
            if cfg.arch == Arch::Gemma3 {
                md.push((a("rope.freq_base_swa"), Value::F32(local.rope_theta as f32)));
            }
            md.push((a("attention.sliding_window"), u(local.window)));
        }
        // llama.cpp's layers of local attention unless told: five of six in Gemma 3 (the sixth
        // global), every other in Gemma 2 (the first local). Another pattern is written out.
        let every = if cfg.arch == Arch::Gemma3 { 6 } else { 2 };
        let local: Vec<bool> = (0..cfg.num_layers)
            .map(|i| cfg.local_attention.as_ref().is_some_and(|l| l.layers.get(i) == Some(&true)))
            .collect();
        let usual = (0..cfg.num_layers).all(|i| local[i] == (i % every < every - 1));
        if cfg.local_attention.is_some() && !usual || cfg.arch == Arch::Gemma2 && cfg.local_attention.is_none() {
            md.push((
                a("attention.sliding_window_pattern"),
                Value::Array(local.into_iter().map(Value::Bool).collect()),
            ));
        }
        if let Some(c) = cfg.attn_softcap {
            md.push((a("attn_logit_softcapping"), Value::F32(c as f32)));
        }
        if let Some(c) = cfg.final_softcap {
            md.push((a("final_logit_softcapping"), Value::F32(c as f32)));
        }
        return md;
    }
    md.push((a("rope.freq_base"), Value::F32(cfg.rope_theta as f32)));
    md.push((a("rope.dimension_count"), u(cfg.head_dim)));
    md.push((a("vocab_size"), u(cfg.vocab_size)));
    // The head size (llama.cpp derives it from hidden / heads otherwise): the converter writes it
    // where config.json names `head_dim`, as transformers 5 writes every config, and candle's
    // quantized Qwen3 requires it.
    md.push((a("attention.key_length"), u(cfg.head_dim)));
    md.push((a("attention.value_length"), u(cfg.head_dim)));
    md
}

/// Which vocabulary a GGUF of the model in `model_dir` carries.
enum Vocabulary {
    /// The pieces of this `tokenizer.model`.
    SentencePiece(std::path::PathBuf),
    /// This tokenizer.json's BPE (byte-level, as GPT-2's).
    ByteLevel(serde_json::Value),
}

/// The vocabulary a GGUF of the model in `model_dir` carries, as llama.cpp's converter chooses
/// it (Gemma's and Llama's `tokenizer.model` first), or why none: a tokenizer other than BPE,
/// or a SentencePiece tokenizer.json (byte fallback, `▁` for spaces) without its
/// `tokenizer.model`, whose pieces' scores llama.cpp's tokenizer needs.
fn vocabulary(cfg: &ModelConfig, model_dir: &Path) -> Result<Vocabulary, ModelError> {
    let spm = model_dir.join("tokenizer.model");
    if matches!(cfg.arch, Arch::Llama | Arch::Gemma2 | Arch::Gemma3) && spm.is_file() {
        return Ok(Vocabulary::SentencePiece(spm));
    }
    let tj = read_json(&model_dir.join("tokenizer.json"))?;
    let no = |why: String| Err(ModelError::NoGguf { arch: arch_title(cfg.arch).into(), why });
    if tj["model"]["type"] != "BPE" {
        let kind = tj["model"]["type"].as_str().unwrap_or("unknown");
        return no(format!("its tokenizer.json is a `{kind}` tokenizer, and rtune writes BPE and SentencePiece ones"));
    }
    // SentencePiece's marks: byte fallback, and `▁` for spaces (Metaspace, or a Replace).
    fn metaspace(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Object(o) => {
                o.get("type").is_some_and(|t| t == "Metaspace")
                    || o.get("content").is_some_and(|c| c == "\u{2581}")
                    || o.values().any(metaspace)
            }
            serde_json::Value::Array(a) => a.iter().any(metaspace),
            _ => false,
        }
    }
    if tj["model"]["byte_fallback"] == true || metaspace(&tj["normalizer"]) || metaspace(&tj["pre_tokenizer"]) {
        return no("its tokenizer.json is SentencePiece's (byte fallback, `▁` for spaces), and the folder has no \
             tokenizer.model, whose pieces and scores a GGUF carries for llama.cpp's SentencePiece tokenizer"
            .into());
    }
    Ok(Vocabulary::ByteLevel(tj))
}

/// Whether rtune writes a GGUF of the model in `model_dir` (config `cfg`): its architecture
/// as llama.cpp reads it ([`architecture`]) and a vocabulary llama.cpp tokenizes with as the
/// model was trained.
pub fn check(cfg: &ModelConfig, model_dir: &Path) -> Result<(), ModelError> {
    architecture(cfg)?;
    vocabulary(cfg, model_dir).map(drop)
}

/// `tokenizer.ggml.*`: a SentencePiece model's pieces where the folder has its
/// `tokenizer.model` and llama.cpp's converter reads it (Gemma, Llama), else tokenizer.json's
/// byte-level BPE.
fn tokenizer_metadata(
    cfg: &ModelConfig,
    model_dir: &Path,
    chat: Option<ChatMetadata<'_>>,
) -> Result<Vec<(String, Value)>, ModelError> {
    let mut md = match vocabulary(cfg, model_dir)? {
        Vocabulary::SentencePiece(spm) => sentencepiece_metadata(cfg, model_dir, &spm)?,
        Vocabulary::ByteLevel(tj) => byte_level_metadata(cfg, model_dir, &tj)?,
    };
    // The template the model was trained with, and the token its turns end with: llama.cpp
    // stops generation at EOS and at `eot_token_id`.
    if let Some(chat) = chat {
        md.push(("tokenizer.chat_template".into(), Value::String(chat.template.to_string())));
        if let Some(id) = chat.turn_end
            && cfg.eos_token_ids.first() != Some(&id)
        {
            md.push(("tokenizer.ggml.eot_token_id".into(), Value::U32(id)));
        }
    }
    Ok(md)
}

fn read_json(path: &Path) -> Result<serde_json::Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(ModelError::io(format!("cannot read `{}`", path.display())))?;
    serde_json::from_str(&text)
        .map_err(|e| ModelError::BadFile { path: path.display().to_string(), source: Box::new(e) })
}

/// A SentencePiece vocabulary as convert_hf_to_gguf.py writes it (`_set_vocab_sentencepiece`
/// and gguf-py's `SpecialVocab`): every piece with its score and type (user-defined pieces as
/// normal ones), ids past the model's `[PAD<id>]` and unused; `added_tokens.json` and
/// tokenizer_config.json's `added_tokens_decoder` over them (control tokens where special or
/// special-looking, else user-defined; score -1000); the special tokens' ids and whether BOS,
/// EOS and a separator are added; Gemma's no space prefix.
fn sentencepiece_metadata(cfg: &ModelConfig, model_dir: &Path, spm: &Path) -> Result<Vec<(String, Value)>, ModelError> {
    let pieces = spm::read(spm)?;
    let n = cfg.vocab_size;
    let mut tokens: Vec<String> = (0..n).map(|i| format!("[PAD{i}]")).collect();
    let mut scores = vec![-10000f32; n];
    let mut types = vec![UNUSED; n];
    for (i, p) in pieces.iter().enumerate().take(n) {
        tokens[i] = p.text.clone();
        scores[i] = p.score;
        types[i] = match p.kind {
            spm::Kind::Unknown => UNKNOWN,
            spm::Kind::Control => CONTROL,
            spm::Kind::Unused => UNUSED,
            spm::Kind::Byte => BYTE,
            spm::Kind::Normal | spm::Kind::UserDefined => NORMAL,
        };
    }
    let added = model_dir.join("added_tokens.json");
    if added.is_file() {
        for (text, id) in read_json(&added)?.as_object().into_iter().flatten() {
            if let Some(i) = id.as_u64().map(|i| i as usize).filter(|&i| i < n) {
                (tokens[i], scores[i], types[i]) = (text.clone(), -1000.0, USER_DEFINED);
            }
        }
    }
    let tc_path = model_dir.join("tokenizer_config.json");
    let tc = if tc_path.is_file() { Some(read_json(&tc_path)?) } else { None };
    for (id, t) in tc.iter().flat_map(|tc| tc["added_tokens_decoder"].as_object()).flatten() {
        let (Some(i), Some(text)) = (id.parse::<usize>().ok().filter(|&i| i < n), t["content"].as_str()) else {
            continue;
        };
        let special = t["special"].as_bool() == Some(true) || looks_special(text);
        (tokens[i], scores[i], types[i]) = match special {
            true => (text.to_string(), -1000.0, CONTROL),
            false => (text.replace('\u{2581}', " "), -1000.0, USER_DEFINED),
        };
    }
    let mut md = vec![
        ("tokenizer.ggml.model".to_string(), Value::String("llama".into())),
        ("tokenizer.ggml.pre".to_string(), Value::String("default".into())),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(tokens.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.scores".to_string(), Value::Array(scores.into_iter().map(Value::F32).collect())),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types.into_iter().map(Value::I32).collect())),
    ];
    md.extend(special_tokens(model_dir, tc.as_ref(), n)?);
    match cfg.arch {
        Arch::Gemma2 | Arch::Gemma3 => md.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false))),
        _ => {
            if let Some(b) = tc.as_ref().and_then(|tc| tc["add_prefix_space"].as_bool()) {
                md.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(b)));
            }
        }
    }
    Ok(md)
}

/// convert_hf_to_gguf's `does_token_look_special`: added tokens that models mark as not special
/// but llama.cpp must treat as control tokens.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// gguf-py's `SpecialVocab` for the common layouts: each special token's id (tokenizer_config's
/// `<kind>_token` found among tokenizer.json's added tokens, else config.json's
/// `<kind>_token_id`), and whether BOS/EOS/a separator are added (tokenizer.json's
/// TemplateProcessing first, then tokenizer_config's `add_<kind>_token`).
fn special_tokens(
    model_dir: &Path,
    tc: Option<&serde_json::Value>,
    n: usize,
) -> Result<Vec<(String, Value)>, ModelError> {
    const KINDS: [(&str, &str); 7] = [
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("sep", "seperator_token_id"),
        ("pad", "padding_token_id"),
        ("cls", "cls_token_id"),
        ("mask", "mask_token_id"),
    ];
    let tj = read_json(&model_dir.join("tokenizer.json"))?;
    let cfg_path = model_dir.join("config.json");
    let config = if cfg_path.is_file() { read_json(&cfg_path)? } else { serde_json::Value::Null };
    let null = serde_json::Value::Null;
    let tc = tc.unwrap_or(&null);
    let content = |kind: &str| -> Option<String> {
        let e = &tc[format!("{kind}_token")];
        e.as_str().or_else(|| e["content"].as_str()).map(str::to_string)
    };
    let added_id = |text: &str| {
        tj["added_tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| t["content"] == text)
            .and_then(|t| t["id"].as_u64())
    };
    let mut ids: Vec<(&str, u64)> = Vec::new();
    for (kind, _) in KINDS {
        let id = content(kind).and_then(|c| added_id(&c)).or_else(|| config[format!("{kind}_token_id")].as_u64());
        if let Some(id) = id.filter(|&i| (i as usize) < n) {
            ids.push((kind, id));
        }
    }
    // Which special tokens tokenizer.json's post-processor adds around a sequence.
    let mut add: Vec<(&str, bool)> = Vec::new();
    let pp = &tj["post_processor"];
    let processors = match pp["processors"].as_array() {
        Some(list) => list.iter().collect::<Vec<_>>(),
        None if pp.is_object() => vec![pp],
        None => vec![],
    };
    let (bos, eos) = (content("bos"), content("eos"));
    for p in processors {
        if p["type"] == "ByteLevel" {
            add.push(("bos", false));
            add.push(("eos", false));
        } else if p["type"] == "TemplateProcessing" {
            let special = |item: &serde_json::Value| item["SpecialToken"]["id"].as_str().map(str::to_string);
            let single = p["single"].as_array().cloned().unwrap_or_default();
            let (first, last) = match single.len() > 1 {
                true => (special(&single[0]), special(&single[single.len() - 1])),
                false => (None, None),
            };
            if let Some(f) = &first {
                add.push(("bos", bos.as_ref() == Some(f)));
            }
            if let Some(l) = &last {
                add.push(("eos", eos.as_ref() == Some(l)));
            }
            // A pair `A <token> B` adds no separator unless that token is the separator or EOS.
            let pair = p["pair"].as_array().cloned().unwrap_or_default();
            let start = usize::from(first.is_some() && pair.first().and_then(special) == first);
            let stop = pair.len() - usize::from(last.is_some() && pair.last().and_then(special) == last);
            if start < stop {
                let inner = &pair[start..stop];
                let seq = |item: &serde_json::Value| item["Sequence"]["id"].as_str().map(str::to_string);
                let (a, b) = (seq(&inner[0]), seq(&inner[inner.len() - 1]));
                if a.as_deref() == Some("A") && b.as_deref() == Some("B") && inner.len() > 2 {
                    let middle = &inner[1..inner.len() - 1];
                    let sep = content("sep");
                    let is_sep = |t: &Option<String>| t.is_some() && (t == &sep || t == &eos);
                    let mut add_sep = is_sep(&special(&middle[0])) && last.is_none();
                    if middle.len() == 2 && is_sep(&special(&middle[1])) {
                        add_sep = true;
                    }
                    add.push(("sep", add_sep));
                }
            }
        }
    }
    for kind in ["bos", "eos", "sep"] {
        if let Some(b) = tc[format!("add_{kind}_token")].as_bool()
            && !add.iter().any(|(k, _)| *k == kind)
        {
            add.push((kind, b));
        }
    }
    let mut md: Vec<(String, Value)> = Vec::new();
    for (kind, key) in KINDS {
        if let Some((_, id)) = ids.iter().find(|(k, _)| *k == kind) {
            md.push((format!("tokenizer.ggml.{key}"), Value::U32(*id as u32)));
        }
    }
    for kind in ["bos", "eos", "sep"] {
        // The post-processor's word wins, as in gguf-py.
        if let Some((_, b)) = add.iter().find(|(k, _)| *k == kind) {
            md.push((format!("tokenizer.ggml.add_{kind}_token"), Value::Bool(*b)));
        }
    }
    Ok(md)
}

/// `tokenizer.ggml.*` from tokenizer.json and tokenizer_config.json (byte-level BPE).
fn byte_level_metadata(
    cfg: &ModelConfig,
    model_dir: &Path,
    tj: &serde_json::Value,
) -> Result<Vec<(String, Value)>, ModelError> {
    let path = model_dir.join("tokenizer.json");
    let bad = |what: String| ModelError::BadFile { path: path.display().to_string(), source: what.into() };
    let vocab = tj["model"]["vocab"].as_object().ok_or_else(|| bad("no `model.vocab`".into()))?;
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; cfg.vocab_size];
    for (tok, id) in vocab {
        if let Some(slot) = id.as_u64().and_then(|i| tokens.get_mut(i as usize)) {
            *slot = Some((tok.clone(), NORMAL));
        }
    }
    for added in tj["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else { continue };
        if let Some(slot) = tokens.get_mut(id as usize) {
            let ty = if added["special"].as_bool() == Some(true) { CONTROL } else { USER_DEFINED };
            *slot = Some((content.to_string(), ty));
        }
    }
    let (names, types): (Vec<Value>, Vec<Value>) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| match t {
            Some((s, ty)) => (Value::String(s), Value::I32(ty)),
            None => (Value::String(format!("[PAD{i}]")), Value::I32(UNUSED)),
        })
        .unzip();
    let merges: Vec<Value> = tj["model"]["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| match m {
            serde_json::Value::String(s) => Some(Value::String(s.clone())),
            serde_json::Value::Array(pair) => {
                let parts: Vec<&str> = pair.iter().filter_map(|p| p.as_str()).collect();
                (parts.len() == 2).then(|| Value::String(parts.join(" ")))
            }
            _ => None,
        })
        .collect();
    // llama.cpp picks its pre-tokenizer regex by name; these are the families rtune trains.
    let pre = match (cfg.arch, cfg.vocab_size) {
        (Arch::Qwen2 | Arch::Qwen3, _) => "qwen2",
        (Arch::Llama, 128256) => "llama-bpe",
        (Arch::Llama, 49152) => "smollm",
        _ => "gpt-2",
    };
    let mut md = vec![
        ("tokenizer.ggml.model".to_string(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(names)),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types)),
        ("tokenizer.ggml.merges".to_string(), Value::Array(merges)),
    ];
    if let Some(b) = cfg.bos_token_id {
        md.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(b)));
    }
    if let Some(e) = cfg.eos_token_ids.first() {
        md.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(*e)));
    }
    if let Some(p) = cfg.pad_token_id {
        md.push(("tokenizer.ggml.padding_token_id".into(), Value::U32(p)));
    }
    let tc: Option<serde_json::Value> = std::fs::read_to_string(model_dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    if let Some(add_bos) = tc.as_ref().and_then(|tc| tc["add_bos_token"].as_bool()) {
        md.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos)));
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_cpp_tensor_names() {
        let name = |hf: &str| tensor_name(hf, false).unwrap();
        assert_eq!(name("model.embed_tokens.weight"), "token_embd.weight");
        assert_eq!(name("model.layers.3.self_attn.q_proj.weight"), "blk.3.attn_q.weight");
        assert_eq!(name("model.layers.3.self_attn.k_proj.bias"), "blk.3.attn_k.bias");
        assert_eq!(name("model.layers.0.post_attention_layernorm.weight"), "blk.0.ffn_norm.weight");
        assert_eq!(name("model.layers.11.mlp.down_proj.weight"), "blk.11.ffn_down.weight");
        assert_eq!(name("lm_head.weight"), "output.weight");
        assert!(tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq", false).is_none());
        // Gemma's four norms a layer (gguf-py's ATTN_POST_NORM, FFN_NORM, FFN_POST_NORM).
        let gemma = |hf: &str| tensor_name(hf, true).unwrap();
        assert_eq!(gemma("model.layers.2.input_layernorm.weight"), "blk.2.attn_norm.weight");
        assert_eq!(gemma("model.layers.2.post_attention_layernorm.weight"), "blk.2.post_attention_norm.weight");
        assert_eq!(gemma("model.layers.2.pre_feedforward_layernorm.weight"), "blk.2.ffn_norm.weight");
        assert_eq!(gemma("model.layers.2.post_feedforward_layernorm.weight"), "blk.2.post_ffw_norm.weight");
        assert!(tensor_name("model.layers.2.pre_feedforward_layernorm.weight", false).is_none());
    }

    /// The permutation moves HF's row i of each head half to llama.cpp's interleaved position.
    #[test]
    fn permute_interleaves_each_head() {
        // 1 head, head_dim 4, 1 input column: rows [0, 1, 2, 3] (halves [0, 1] and [2, 3]).
        let w = Tensor::new(&[[0f32], [1.], [2.], [3.]], &candle_core::Device::Cpu).unwrap();
        let p: Vec<Vec<f32>> = permute(&w, 1).unwrap().to_vec2().unwrap();
        assert_eq!(p, [[0.], [2.], [1.], [3.]]);
    }
}
