//! Importance matrices, as llama.cpp's `llama-imatrix` makes them and `llama-quantize --imatrix`
//! reads them: for each matrix of the decoder layers, the mean over calibration tokens of each
//! input column's squared activation. A column the model reads strongly is quantized more
//! carefully ([`super::quants`]' weighted quantizers); the token embeddings and the output
//! layer have none (llama-imatrix skips them by default).
//!
//! The file is llama.cpp's GGUF form of it (`general.type = "imatrix"`, each matrix's
//! `<name>.in_sum2` and `<name>.counts`), so that llama.cpp makes its other types — the IQ
//! types need one — from the same calibration.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Tensor};

use super::{Planned, Source};
use crate::model::{LAYER_LINEARS, ModelError};

/// The calibration tokens a chunk of llama-imatrix holds (its default context): what the
/// file's `imatrix.chunk_size` says, and how its chunks are counted.
pub const CHUNK: usize = 512;

/// Sums of squared activations per input column of each decoder matrix, under llama.cpp's
/// tensor names, and the tokens they came from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Imatrix {
    entries: BTreeMap<String, Entry>,
    /// What the calibration text was (`imatrix.datasets`).
    pub datasets: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Entry {
    sums: Vec<f64>,
    tokens: u64,
}

impl Imatrix {
    pub fn new(dataset: impl Into<String>) -> Imatrix {
        Imatrix { entries: BTreeMap::new(), datasets: vec![dataset.into()] }
    }

    /// Counts the activations `x` (`[..., in]`, every position a token) that the linears
    /// `linears` (indices into [`LAYER_LINEARS`]) of decoder layer `layer` read.
    pub fn add(&mut self, layer: usize, linears: &[usize], x: &Tensor) -> candle_core::Result<()> {
        let cols = x.dim(candle_core::D::Minus1)?;
        let x = x.to_dtype(DType::F32)?.reshape(((), cols))?;
        let tokens = x.dim(0)? as u64;
        let sums: Vec<f32> = x.sqr()?.sum(0)?.to_vec1()?;
        for &k in linears {
            // Linears have one name in every architecture.
            let name = super::tensor_name(&format!("model.layers.{layer}.{}.weight", LAYER_LINEARS[k]), false)
                .expect("every decoder linear has a llama.cpp name");
            let e = self.entries.entry(name).or_insert_with(|| Entry { sums: vec![0.0; cols], tokens: 0 });
            if e.sums.len() != cols {
                candle_core::bail!("layer {layer}: {} columns read where {} were before", cols, e.sums.len());
            }
            e.sums.iter_mut().zip(&sums).for_each(|(a, s)| *a += f64::from(*s));
            e.tokens += tokens;
        }
        Ok(())
    }

    /// The importance of each input column of matrix `name` (llama.cpp's name): the mean
    /// square, computed as llama-quantize computes it from the file (the f32 sum over the f32
    /// count), so that both quantize with the same weights.
    pub fn importance(&self, name: &str) -> Option<Vec<f32>> {
        let e = self.entries.get(name)?;
        let count = e.tokens as f32;
        Some(e.sums.iter().map(|s| if count > 0.0 { *s as f32 / count } else { 1.0 }).collect())
    }

    /// Matrices with an importance.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Calibration tokens (those the first matrix read: every matrix reads every token).
    pub fn tokens(&self) -> u64 {
        self.entries.values().map(|e| e.tokens).max().unwrap_or(0)
    }

    /// Whole chunks of [`CHUNK`] tokens, as llama.cpp counts them (`imatrix.chunk_count`).
    pub fn chunks(&self) -> u32 {
        (self.tokens() / CHUNK as u64) as u32
    }

    /// Writes llama.cpp's imatrix GGUF: the metadata llama-imatrix writes and, for each matrix
    /// in name order, `<name>.in_sum2` (the sums, f32) and `<name>.counts` (the tokens, f32).
    pub fn write(&self, path: &Path) -> Result<(), ModelError> {
        let md = vec![
            ("general.type".to_string(), Value::String("imatrix".into())),
            (
                "imatrix.datasets".to_string(),
                Value::Array(self.datasets.iter().map(|d| Value::String(d.clone())).collect()),
            ),
            ("imatrix.chunk_count".to_string(), Value::U32(self.chunks())),
            ("imatrix.chunk_size".to_string(), Value::U32(CHUNK as u32)),
        ];
        let mut plan = Vec::new();
        for (name, e) in &self.entries {
            let sums = e.sums.iter().map(|s| *s as f32).collect::<Vec<f32>>();
            let n = sums.len();
            let tensor = |name: String, values: Vec<f32>, shape: Vec<usize>| Planned {
                name,
                source: Source::Values(values),
                shape,
                ty: GgmlDType::F32,
            };
            plan.push(tensor(format!("{name}.in_sum2"), sums, vec![1, n]));
            plan.push(tensor(format!("{name}.counts"), vec![e.tokens as f32], vec![1, 1]));
        }
        super::write_file(path, &md, &plan, |p| match &p.source {
            Source::Values(v) => Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Source::Merged(_) => unreachable!("an imatrix holds values only"),
        })
    }

    /// The matrices, by llama.cpp's name, with how many input columns each has.
    pub fn columns(&self) -> impl Iterator<Item = (&str, usize)> {
        self.entries.iter().map(|(n, e)| (n.as_str(), e.sums.len()))
    }

    /// Reads an importance matrix file of llama.cpp's `llama-imatrix`: its GGUF (rtune's too), or
    /// the older binary format (`.dat`: each matrix's mean squares times the chunks it saw),
    /// turned into sums over chunks of [`CHUNK`] tokens as llama-imatrix turns one into the
    /// other, which keeps every importance bit for bit.
    pub fn read(path: &Path) -> Result<Imatrix, ModelError> {
        use std::io::{Read, Seek};
        let bad = |what: String| ModelError::BadFile { path: path.display().to_string(), source: what.into() };
        let io = |what: &str| ModelError::io(format!("cannot {what} `{}`", path.display()));
        let mut f = std::fs::File::open(path).map_err(io("open"))?;
        let mut magic = [0u8; 4];
        let gguf = f.read_exact(&mut magic).is_ok() && &magic == b"GGUF";
        f.rewind().map_err(io("read"))?;
        if gguf {
            return Self::from_gguf(&mut f).map_err(bad);
        }
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).map_err(io("read"))?;
        Self::from_legacy(&bytes).map_err(bad)
    }

    /// llama-imatrix's binary format: the entry count, then per entry its name (length-prefixed),
    /// its chunk count, its column count and the values; then, optionally, the chunks seen and
    /// the dataset's name. Every number little-endian, 32 bits.
    fn from_legacy(bytes: &[u8]) -> Result<Imatrix, String> {
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8], String> {
            let s = bytes.get(at..at + n).ok_or("neither an imatrix GGUF nor llama-imatrix's .dat: it ends early")?;
            at += n;
            Ok(s)
        };
        let int = |b: &[u8]| i32::from_le_bytes(b.try_into().expect("4 bytes"));
        let n = int(take(4)?);
        if !(1..=1 << 20).contains(&n) {
            return Err(format!("neither an imatrix GGUF nor llama-imatrix's .dat ({n} entries)"));
        }
        let mut entries = BTreeMap::new();
        for _ in 0..n {
            let len = int(take(4)?);
            let len = usize::try_from(len).ok().filter(|l| *l <= 4096).ok_or("an entry's name is not a name")?;
            let name = String::from_utf8(take(len)?.to_vec()).map_err(|_| "an entry's name is not UTF-8")?;
            let ncall = int(take(4)?);
            let nval =
                usize::try_from(int(take(4)?)).ok().filter(|n| *n >= 1).ok_or(format!("`{name}` has no values"))?;
            let values = take(4 * nval)?;
            let ncall = u64::try_from(ncall).map_err(|_| format!("`{name}`: {ncall} chunks"))?;
            let sums = values
                .chunks_exact(4)
                .map(|c| f64::from(f32::from_le_bytes(c.try_into().expect("4 bytes"))) * CHUNK as f64)
                .collect();
            entries.insert(name, Entry { sums, tokens: ncall * CHUNK as u64 });
        }
        let mut datasets = Vec::new();
        if let (Ok(_chunks), Ok(len)) = (take(4), take(4).map(int))
            && let Some(name) = usize::try_from(len).ok().and_then(|l| take(l).ok())
        {
            datasets.push(String::from_utf8_lossy(name).into_owned());
        }
        Ok(Imatrix { entries, datasets })
    }

    /// llama-imatrix's GGUF: `general.type = "imatrix"`, each matrix's `<name>.in_sum2` and its
    /// one `<name>.counts`.
    fn from_gguf(f: &mut std::fs::File) -> Result<Imatrix, String> {
        use candle_core::quantized::gguf_file::Content;
        let content = Content::read(f).map_err(|e| e.to_string())?;
        if content.metadata.get("general.type").and_then(|v| v.to_string().ok()).map(String::as_str) != Some("imatrix")
        {
            return Err("not an importance matrix (`general.type` is not `imatrix`)".into());
        }
        let datasets = match content.metadata.get("imatrix.datasets") {
            Some(Value::Array(a)) => a.iter().filter_map(|v| v.to_string().ok().cloned()).collect(),
            _ => Vec::new(),
        };
        let mut entries = BTreeMap::new();
        for name in content.tensor_infos.keys() {
            let Some(base) = name.strip_suffix(".in_sum2") else { continue };
            let mut values = |n: &str| -> Result<Vec<f32>, String> {
                let t = content.tensor(f, n, &candle_core::Device::Cpu).map_err(|e| format!("`{n}`: {e}"))?;
                t.dequantize(&candle_core::Device::Cpu)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1())
                    .map_err(|e| format!("`{n}`: {e}"))
            };
            let sums = values(name)?;
            let counts = values(&format!("{base}.counts"))?;
            let [tokens] = counts[..] else {
                return Err(format!("`{base}`: {} counts (rtune reads dense matrices only)", counts.len()));
            };
            let sums = sums.into_iter().map(f64::from).collect();
            entries.insert(base.to_string(), Entry { sums, tokens: tokens.round() as u64 });
        }
        Ok(Imatrix { entries, datasets })
    }
}
