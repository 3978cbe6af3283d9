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
    pub config: ModelConfig,
    /// config.json as written (kept whole for export).
    pub raw_config: serde_json::Value,
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
        let raw: RawConfig = serde_json::from_value(raw_config.clone())
            .map_err(|e| ModelError::BadFile { path: path.display().to_string(), source: Box::new(e) })?;
        let config = ModelConfig::from_raw(&raw)?;
        Ok(ModelFolder { dir: dir.to_path_buf(), config, raw_config })
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
        for file in self.weight_files()? {
            let bytes = std::fs::read(&file).map_err(ModelError::io(format!("cannot read `{}`", file.display())))?;
            let st = safetensors::SafeTensors::deserialize(&bytes)
                .map_err(|e| ModelError::BadFile { path: file.display().to_string(), source: Box::new(e) })?;
            for (name, view) in st.tensors() {
                let t = tensor_from_view(&name, &view, device)?;
                let t = t.to_dtype(dtype).map_err(ModelError::candle(format!("convert `{name}`")))?;
                out.insert(name, t);
            }
        }
        Ok(out)
    }

    pub fn tokenizer(&self) -> Result<tokenizers::Tokenizer, ModelError> {
        let path = self.dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(ModelError::MissingFile { dir: self.dir.display().to_string(), file: "tokenizer.json".into() });
        }
        tokenizers::Tokenizer::from_file(&path)
            .map_err(ModelError::tokenizer(format!("cannot load `{}`", path.display())))
    }

    /// tokenizer_config.json, if present.
    pub fn tokenizer_config(&self) -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(self.dir.join("tokenizer_config.json")).ok()?;
        serde_json::from_str(&text).ok()
    }
}

fn tensor_from_view(
    name: &str,
    view: &safetensors::tensor::TensorView<'_>,
    device: &Device,
) -> Result<Tensor, ModelError> {
    use safetensors::Dtype as S;
    let shape = view.shape().to_vec();
    let data = view.data();
    let t = match view.dtype() {
        S::F32 => Tensor::from_raw_buffer(data, DType::F32, &shape, device),
        S::F16 => Tensor::from_raw_buffer(data, DType::F16, &shape, device),
        S::BF16 => Tensor::from_raw_buffer(data, DType::BF16, &shape, device),
        other => return Err(ModelError::UnsupportedDtype { name: name.into(), dtype: format!("{other:?}") }),
    };
    t.map_err(ModelError::candle(format!("load `{name}`")))
}

/// Write tensors as one safetensors file with PEFT/transformers' `{"format": "pt"}` header.
pub fn save_safetensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<(), ModelError> {
    let mut bufs: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        let (dtype, bytes) = tensor_bytes(t).map_err(ModelError::candle(format!("read `{name}`")))?;
        bufs.push((name.clone(), dtype, t.dims().to_vec(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bufs
        .iter()
        .map(|(n, d, s, b)| {
            let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("consistent tensor view");
            (n.clone(), v)
        })
        .collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| ModelError::BadFile { path: path.display().to_string(), source: Box::new(e) })?;
    std::fs::write(path, bytes).map_err(ModelError::io(format!("cannot write `{}`", path.display())))
}

/// Raw little-endian bytes of a tensor and its safetensors dtype.
pub fn tensor_bytes(t: &Tensor) -> candle_core::Result<(safetensors::Dtype, Vec<u8>)> {
    let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
    Ok(match t.dtype() {
        DType::F16 => {
            (safetensors::Dtype::F16, flat.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
        DType::BF16 => {
            (safetensors::Dtype::BF16, flat.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
        _ => (
            safetensors::Dtype::F32,
            flat.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
    })
}
