//! Hugging Face model folders: `config.json`, `model.safetensors` or sharded
//! `model-0000N-of-0000M.safetensors` with `model.safetensors.index.json`, `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::{ModelConfig, ModelError, RawConfig};

#[derive(Debug, Clone)]
pub struct ModelFolder {
    pub dir: PathBuf,
    /// The model rtune trains: for an image-text checkpoint, its text model.
    pub config: ModelConfig,
    /// config.json as written (kept whole for export).
    pub raw_config: serde_json::Value,
    pub layout: Layout,
}

/// How a checkpoint's tensors are named. rtune names a model's tensors as a causal LM's
/// (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`); an image-text checkpoint holds
/// that model under a prefix of its own beside tensors rtune does not train (the vision tower
/// and its projector), which every export carries over unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `*ForCausalLM`: the names are rtune's.
    CausalLm,
    /// `Gemma3ForConditionalGeneration` (Gemma 3 4B, 12B, 27B): the text model's tensors are
    /// stored as `language_model.<name>` (as transformers saves them, every version), its
    /// modules are `model.language_model.*` and `lm_head` in transformers ≥ 4.52 (the names
    /// PEFT's adapters carry), and the rest is the vision tower.
    Gemma3Multimodal,
}

impl Layout {
    /// The name a checkpoint stores tensor `name` (rtune's) under.
    pub fn stored_name(self, name: &str) -> String {
        match self {
            Layout::CausalLm => name.to_string(),
            Layout::Gemma3Multimodal => format!("language_model.{name}"),
        }
    }

    /// rtune's name of stored tensor `stored`; `None`: not the text model's (carried over).
    pub fn name_of(self, stored: &str) -> Option<&str> {
        match self {
            Layout::CausalLm => Some(stored),
            Layout::Gemma3Multimodal => stored.strip_prefix("language_model."),
        }
    }

    /// The model's module path (as `named_modules` gives it, and PEFT's names carry) of rtune's
    /// module or parameter name `name`.
    pub fn module_path(self, name: &str) -> String {
        match (self, name.strip_prefix("model.")) {
            (Layout::Gemma3Multimodal, Some(rest)) => format!("model.language_model.{rest}"),
            _ => name.to_string(),
        }
    }

    /// rtune's name of module path `path` ([`Layout::module_path`]'s inverse); any layout's
    /// paths read back, so an adapter names its modules either way — also as transformers 4.50
    /// and 4.51 named Gemma 3's (`language_model.model.layers.0…`, `language_model.lm_head`).
    pub fn from_module_path(path: &str) -> String {
        if let Some(rest) = path.strip_prefix("model.language_model.") {
            return format!("model.{rest}");
        }
        path.strip_prefix("language_model.").unwrap_or(path).to_string()
    }
}

impl ModelFolder {
    pub fn open(dir: &Path) -> Result<ModelFolder, ModelError> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(ModelError::MissingFile { dir: dir.display().to_string(), file: "config.json".into() });
        }
        let text =
            std::fs::read_to_string(&path).map_err(ModelError::io(format!("cannot read `{}`", path.display())))?;
        let raw_config: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::BadFile { path: path.display().to_string(), source: Box::new(e) })?;
        let (text, layout) = super::config::text_model(&raw_config);
        let raw: RawConfig = serde_json::from_value(text)
            .map_err(|e| ModelError::BadFile { path: path.display().to_string(), source: Box::new(e) })?;
        let config = ModelConfig::from_raw(&raw)?;
        Ok(ModelFolder { dir: dir.to_path_buf(), config, raw_config, layout })
    }

    /// The safetensors files of the checkpoint (from the index when sharded).
    pub fn weight_files(&self) -> Result<Vec<PathBuf>, ModelError> {
        let index = self.dir.join("model.safetensors.index.json");
        if index.is_file() {
            let text = std::fs::read_to_string(&index)
                .map_err(ModelError::io(format!("cannot read `{}`", index.display())))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::BadFile { path: index.display().to_string(), source: Box::new(e) })?;
            let files: BTreeSet<String> = v["weight_map"]
                .as_object()
                .ok_or_else(|| ModelError::BadFile {
                    path: index.display().to_string(),
                    source: "no `weight_map` object".into(),
                })?
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            let mut out = Vec::new();
            for f in files {
                if f.contains("..") || f.contains('/') || f.contains('\\') {
                    return Err(ModelError::BadFile {
                        path: index.display().to_string(),
                        source: format!("shard name `{f}` leaves the folder").into(),
                    });
                }
                let p = self.dir.join(&f);
                if !p.is_file() {
                    return Err(ModelError::MissingFile { dir: self.dir.display().to_string(), file: f });
                }
                out.push(p);
            }
            return Ok(out);
        }
        let single = self.dir.join("model.safetensors");
        if single.is_file() {
            return Ok(vec![single]);
        }
        Err(ModelError::MissingFile { dir: self.dir.display().to_string(), file: "model.safetensors".into() })
    }

    /// Every tensor of the checkpoint, converted to `dtype`, on `device`.
    pub fn load_weights(&self, device: &Device, dtype: DType) -> Result<BTreeMap<String, Tensor>, ModelError> {
        let mut out = BTreeMap::new();
        self.visit_weights(|name, t| {
            let t = t.to_dtype(dtype).and_then(|t| t.to_device(device));
            out.insert(name.to_string(), t.map_err(ModelError::candle(format!("convert `{name}`")))?);
            Ok(())
        })?;
        Ok(out)
    }

    /// Each tensor of the checkpoint in turn, on the CPU in its stored dtype: a model never has
    /// to be in memory twice (the GPU engine uploads each and drops it).
    pub fn visit_weights<E: From<ModelError>>(&self, f: impl FnMut(&str, Tensor) -> Result<(), E>) -> Result<(), E> {
        self.visit_weights_where(|_| true, f)
    }

    /// [`Self::visit_weights`] for the tensors whose names `want` accepts: the others are never
    /// read (their pages of the mapped files are not touched).
    pub fn visit_weights_where<E: From<ModelError>>(
        &self,
        want: impl Fn(&str) -> bool,
        mut f: impl FnMut(&str, Tensor) -> Result<(), E>,
    ) -> Result<(), E> {
        let stored = self.stored()?;
        for name in stored.index.keys().filter(|n| want(n)) {
            f(name, stored.get(name)?)?;
        }
        Ok(())
    }

    /// The checkpoint's tensors, mapped and read by name one at a time (see [`StoredWeights`]).
    pub fn stored(&self) -> Result<StoredWeights, ModelError> {
        StoredWeights::open_as(self.weight_files()?, self.layout)
    }

    pub fn tokenizer(&self) -> Result<tokenizers::Tokenizer, ModelError> {
        let path = self.dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(ModelError::MissingFile { dir: self.dir.display().to_string(), file: "tokenizer.json".into() });
        }
        load_tokenizer(&path)
    }

    /// tokenizer_config.json, if present.
    pub fn tokenizer_config(&self) -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(self.dir.join("tokenizer_config.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// The BOS id that starts a row (an `alpaca` row, an evaluation prompt): the model's
    /// `bos_token_id` where its tokenizer puts one in front of encoded text, as transformers'
    /// `tokenizer(text)` does — its post-processor adds it (Llama 3's `<|begin_of_text|>`) or
    /// tokenizer_config.json says `add_bos_token: true` (Llama 2, Mistral, rtune's scratch
    /// models); `None` for tokenizers that add none (Qwen's, whose `bos_token` is null;
    /// GPT-2-style ones such as SmolLM2's), so that rows start as the model sees text at
    /// inference.
    pub fn row_bos(&self, tokenizer: &tokenizers::Tokenizer) -> Option<u32> {
        let bos = self.config.bos_token_id?;
        let flag = self.tokenizer_config().is_some_and(|c| c["add_bos_token"] == true);
        let added = tokenizer.encode("a", true).is_ok_and(|e| e.get_ids().first() == Some(&bos));
        (flag || added).then_some(bos)
    }
}

/// A checkpoint's safetensors files, mapped: each tensor is read (on the CPU, in its stored
/// dtype) only when asked for, so a model is never in memory whole — the pages of the mapped
/// files are the page cache's, not the process's.
pub struct StoredWeights {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    /// Each tensor of the model rtune trains, by rtune's name: its file (an index into `maps`),
    /// shape, stored dtype and stored name.
    index: BTreeMap<String, Stored>,
    /// The checkpoint's other tensors (an image-text model's vision tower), by stored name.
    others: BTreeMap<String, Stored>,
}

type Stored = (usize, Vec<usize>, safetensors::Dtype, String);

impl StoredWeights {
    /// Map safetensors `files` (a tensor in two of them is the later file's).
    pub fn open(files: Vec<PathBuf>) -> Result<StoredWeights, ModelError> {
        StoredWeights::open_as(files, Layout::CausalLm)
    }

    /// [`StoredWeights::open`] for a checkpoint of `layout`.
    pub fn open_as(files: Vec<PathBuf>, layout: Layout) -> Result<StoredWeights, ModelError> {
        let mut maps = Vec::new();
        let mut index = BTreeMap::new();
        let mut others = BTreeMap::new();
        for (k, file) in files.into_iter().enumerate() {
            let handle =
                std::fs::File::open(&file).map_err(ModelError::io(format!("cannot read `{}`", file.display())))?;
            // SAFETY: the file is only read, and only while this map lives.
            let bytes = unsafe { memmap2::Mmap::map(&handle) }
                .map_err(ModelError::io(format!("cannot map `{}`", file.display())))?;
            let st = safetensors::SafeTensors::deserialize(&bytes)
                .map_err(|e| ModelError::BadFile { path: file.display().to_string(), source: Box::new(e) })?;
            for (stored, view) in st.tensors() {
                let entry = (k, view.shape().to_vec(), view.dtype(), stored.clone());
                match layout.name_of(&stored) {
                    Some(name) => index.insert(name.to_string(), entry),
                    None => others.insert(stored, entry),
                };
            }
            maps.push((file, bytes));
        }
        Ok(StoredWeights { maps, index, others })
    }

    /// The stored names of the tensors that are not the model's (see [`Layout`]).
    pub fn others(&self) -> impl Iterator<Item = &str> {
        self.others.keys().map(String::as_str)
    }

    /// Other tensor `stored`'s (one of [`StoredWeights::others`]) shape and stored dtype.
    pub fn other_info(&self, stored: &str) -> Result<(Vec<usize>, DType), ModelError> {
        match self.others.get(stored) {
            Some((_, shape, dtype, _)) => Ok((shape.clone(), candle_dtype(stored, *dtype)?)),
            None => Err(ModelError::MissingTensor { name: stored.into() }),
        }
    }

    /// Other tensor `stored` on the CPU in its stored dtype.
    pub fn other(&self, stored: &str) -> Result<Tensor, ModelError> {
        self.with_entry(self.others.get(stored), stored, |view| tensor_from_view(stored, view, &Device::Cpu))
    }

    /// The blake3 of other tensor `stored`'s bytes as stored.
    pub fn other_digest(&self, stored: &str) -> Result<blake3::Hash, ModelError> {
        self.with_entry(self.others.get(stored), stored, |view| Ok(blake3::hash(view.data())))
    }

    /// Whether the files hold tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// How many tensors the checkpoint holds.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The shape of tensor `name`, if the checkpoint has it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.index.get(name).map(|(_, s, ..)| s.as_slice())
    }

    /// The dtype tensor `name` is stored in (f32, f16 or bf16; others are an error).
    pub fn dtype(&self, name: &str) -> Result<DType, ModelError> {
        let Some((_, _, dtype, _)) = self.index.get(name) else {
            return Err(ModelError::MissingTensor { name: name.into() });
        };
        candle_dtype(name, *dtype)
    }

    /// The blake3 of tensor `name`'s bytes as stored.
    pub fn digest(&self, name: &str) -> Result<blake3::Hash, ModelError> {
        self.with_view(name, |view| Ok(blake3::hash(view.data())))
    }

    /// Tensor `name` on the CPU in its stored dtype.
    pub fn get(&self, name: &str) -> Result<Tensor, ModelError> {
        self.with_view(name, |view| tensor_from_view(name, view, &Device::Cpu))
    }

    fn with_view<R>(
        &self,
        name: &str,
        f: impl FnOnce(&safetensors::tensor::TensorView<'_>) -> Result<R, ModelError>,
    ) -> Result<R, ModelError> {
        self.with_entry(self.index.get(name), name, f)
    }

    fn with_entry<R>(
        &self,
        entry: Option<&Stored>,
        name: &str,
        f: impl FnOnce(&safetensors::tensor::TensorView<'_>) -> Result<R, ModelError>,
    ) -> Result<R, ModelError> {
        let Some((k, _, _, stored)) = entry else {
            return Err(ModelError::MissingTensor { name: name.into() });
        };
        let (file, bytes) = &self.maps[*k];
        let bad = |e: safetensors::SafeTensorError| ModelError::BadFile {
            path: file.display().to_string(),
            source: Box::new(e),
        };
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(bad)?;
        f(&st.tensor(stored).map_err(bad)?)
    }
}

fn tensor_from_view(
    name: &str,
    view: &safetensors::tensor::TensorView<'_>,
    device: &Device,
) -> Result<Tensor, ModelError> {
    let dtype = candle_dtype(name, view.dtype())?;
    Tensor::from_raw_buffer(view.data(), dtype, view.shape(), device)
        .map_err(ModelError::candle(format!("load `{name}`")))
}

/// The candle dtype of a checkpoint's tensor `name` stored as `dtype` (f32, f16, bf16; others
/// are an error).
fn candle_dtype(name: &str, dtype: safetensors::Dtype) -> Result<DType, ModelError> {
    match dtype {
        safetensors::Dtype::F32 => Ok(DType::F32),
        safetensors::Dtype::F16 => Ok(DType::F16),
        safetensors::Dtype::BF16 => Ok(DType::BF16),
        other => Err(ModelError::UnsupportedDtype { name: name.into(), dtype: format!("{other:?}") }),
    }
}

/// Write tensors as one safetensors file with PEFT/transformers' `{"format": "pt"}` header,
/// one tensor's bytes at a time (a checkpoint's optimizer moments or a full fine-tune's weights
/// are never copied whole).
pub fn save_safetensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<(), ModelError> {
    let entries: Vec<(&String, &Tensor)> = tensors.iter().collect();
    let layout: Vec<(String, DType, Vec<usize>)> =
        entries.iter().map(|(n, t)| (n.to_string(), t.dtype(), t.dims().to_vec())).collect();
    write_safetensors(path, &layout, |i| {
        let (name, t) = entries[i];
        tensor_bytes(t).map(|(_, b)| b).map_err(ModelError::candle(format!("read `{name}`")))
    })
}

/// The bytes a tensor of `dtype` takes per element in a file (others are written as f32).
pub(crate) fn file_element_size(dtype: DType) -> u64 {
    if matches!(dtype, DType::F16 | DType::BF16) { 2 } else { 4 }
}

/// One safetensors file of the tensors `layout` names (in that order, with the dtype and shape
/// each has in memory), `{"format": "pt"}` metadata, each tensor's bytes from `bytes(i)` when
/// its turn comes; flushed and synced.
pub(crate) fn write_safetensors(
    path: &Path,
    layout: &[(String, DType, Vec<usize>)],
    mut bytes: impl FnMut(usize) -> Result<Vec<u8>, ModelError>,
) -> Result<(), ModelError> {
    use std::io::Write;
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0u64;
    for (name, dtype, shape) in layout {
        let n = shape.iter().product::<usize>() as u64 * file_element_size(*dtype);
        let dtype = match dtype {
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            _ => "F32",
        };
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n] }),
        );
        offset += n;
    }
    let mut text = serde_json::to_string(&header).expect("json");
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let io = |e| ModelError::Io { context: format!("cannot write `{}`", path.display()), source: e };
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    w.write_all(&(text.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(text.as_bytes()).map_err(io)?;
    for i in 0..layout.len() {
        w.write_all(&bytes(i)?).map_err(io)?;
    }
    w.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)
}

/// Load a tokenizer.json. The file is checked to be JSON first, and a panic inside the
/// tokenizers crate (it unwraps on some malformed sections) becomes an error. The tokenizer then
/// encodes and decodes a sample with special tokens: the crate accepts some inconsistent files
/// (a post-processor template naming a special token it does not define) and panics only when
/// they are used, which would be mid-stage.
pub fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, ModelError> {
    let text = std::fs::read_to_string(path).map_err(ModelError::io(format!("cannot read `{}`", path.display())))?;
    serde_json::from_str::<serde_json::Value>(&text)
        .map_err(|e| ModelError::BadFile { path: path.display().to_string(), source: Box::new(e) })?;
    let bad = |what: &str| ModelError::BadFile { path: path.display().to_string(), source: what.to_string().into() };
    let parsed = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>())
        .map_err(|_| bad("the tokenizers library could not parse this file"))?;
    let tokenizer = parsed.map_err(ModelError::tokenizer(format!("cannot load `{}`", path.display())))?;
    let trial = std::panic::catch_unwind(|| {
        let encoding = tokenizer.encode("Hello there, 🦀!", true).ok()?;
        tokenizer.decode(encoding.get_ids(), false).ok()
    });
    match trial {
        Ok(_) => Ok(tokenizer),
        Err(_) => Err(bad(
            "the tokenizer is inconsistent: encoding a sample with special tokens fails inside the tokenizers library (check `post_processor` and `added_tokens`)",
        )),
    }
}

/// Raw little-endian bytes of a tensor and its safetensors dtype.
pub fn tensor_bytes(t: &Tensor) -> candle_core::Result<(safetensors::Dtype, Vec<u8>)> {
    let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
    Ok(match t.dtype() {
        DType::F16 => (safetensors::Dtype::F16, le_bytes(&flat.to_vec1::<half::f16>()?, |x| x.to_le_bytes())),
        DType::BF16 => (safetensors::Dtype::BF16, le_bytes(&flat.to_vec1::<half::bf16>()?, |x| x.to_le_bytes())),
        _ => (safetensors::Dtype::F32, le_bytes(&flat.to_dtype(DType::F32)?.to_vec1::<f32>()?, |x| x.to_le_bytes())),
    })
}

/// Values as little-endian bytes, into a buffer sized once.
fn le_bytes<T: Copy, const N: usize>(values: &[T], bytes: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * N];
    for (chunk, v) in out.chunks_exact_mut(N).zip(values) {
        chunk.copy_from_slice(&bytes(*v));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{Layout, ModelFolder};

    /// An image-text Gemma 3's names, each way; module paths read back whichever layout or
    /// transformers version named them.
    #[test]
    fn layouts_name_tensors_and_modules() {
        let mm = Layout::Gemma3Multimodal;
        assert_eq!(mm.stored_name("model.norm.weight"), "language_model.model.norm.weight");
        assert_eq!(mm.name_of("language_model.lm_head.weight"), Some("lm_head.weight"));
        assert_eq!(mm.name_of("vision_tower.encoder.layers.0.mlp.fc1.weight"), None);
        assert_eq!(mm.module_path("model.layers.0.self_attn.q_proj"), "model.language_model.layers.0.self_attn.q_proj");
        assert_eq!(mm.module_path("lm_head"), "lm_head");
        assert_eq!(Layout::CausalLm.module_path("model.layers.0.mlp.up_proj"), "model.layers.0.mlp.up_proj");
        for path in [
            "model.language_model.layers.3.mlp.down_proj",
            "language_model.model.layers.3.mlp.down_proj",
            "model.layers.3.mlp.down_proj",
        ] {
            assert_eq!(Layout::from_module_path(path), "model.layers.3.mlp.down_proj", "{path}");
        }
        assert_eq!(Layout::from_module_path("language_model.lm_head"), "lm_head");
        assert_eq!(Layout::from_module_path("lm_head"), "lm_head");
    }

    /// Rows start with BOS where the tokenizer puts one in front of text, as transformers'
    /// `tokenizer(text)` does: through its post-processor (Llama 3) or `add_bos_token: true`
    /// (Llama 2); not for Qwen's (`add_bos_token: false`, `bos_token: null`) or GPT-2-style ones.
    #[test]
    fn rows_start_with_bos_only_where_the_tokenizer_adds_one() {
        use tokenizers::processors::template::TemplateProcessing;
        let vocab = [("<unk>", 0), ("<s>", 1), ("</s>", 2), ("a", 3)].map(|(t, i)| (t.to_string(), i));
        let tokenizer = |prepends: bool| {
            let model = tokenizers::models::wordlevel::WordLevel::builder()
                .vocab(vocab.iter().cloned().collect())
                .unk_token("<unk>".into())
                .build()
                .unwrap();
            let mut t = tokenizers::Tokenizer::new(model);
            t.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::WhitespaceSplit));
            if prepends {
                let p = TemplateProcessing::builder()
                    .try_single("<s> $A")
                    .unwrap()
                    .special_tokens(vec![("<s>", 1)])
                    .build()
                    .unwrap();
                t.with_post_processor(Some(p));
            }
            t
        };
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "vocab_size": 4, "bos_token_id": 1, "eos_token_id": 2,
        });
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let folder = ModelFolder::open(dir.path()).unwrap();
        let with_config = |tc: serde_json::Value| {
            std::fs::write(dir.path().join("tokenizer_config.json"), tc.to_string()).unwrap();
        };
        with_config(serde_json::json!({ "bos_token": "<s>" }));
        assert_eq!(folder.row_bos(&tokenizer(true)), Some(1), "post-processor (Llama 3)");
        assert_eq!(folder.row_bos(&tokenizer(false)), None, "GPT-2 style");
        with_config(serde_json::json!({ "bos_token": "<s>", "add_bos_token": true }));
        assert_eq!(folder.row_bos(&tokenizer(false)), Some(1), "add_bos_token (Llama 2)");
        with_config(serde_json::json!({ "bos_token": null, "add_bos_token": false }));
        assert_eq!(folder.row_bos(&tokenizer(false)), None, "Qwen");
    }
}
