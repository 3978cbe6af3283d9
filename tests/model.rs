//! The model engine against transformers and PEFT (golden values from
//! tests/fixtures/make_golden.py), gradients against finite differences, and folder round trips.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rtune::model::{Batch, ModelFolder, Trainable, Transformer, peft};
use rtune::rng::Rng;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden").join(name)
}

struct Golden {
    rows: Vec<Vec<u32>>,
    lens: Vec<usize>,
    select: Vec<u32>,
    targets: Vec<u32>,
    expected: serde_json::Value,
}

fn golden(name: &str) -> Golden {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected.json")).unwrap()).unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(expected["ids"].clone()).unwrap();
    let mask: Vec<Vec<u32>> = serde_json::from_value(expected["mask"].clone()).unwrap();
    let labels: Vec<Vec<i64>> = serde_json::from_value(expected["labels"].clone()).unwrap();
    let t = rows[0].len();
    let lens = mask.iter().map(|m| m.iter().sum::<u32>() as usize).collect();
    // transformers shifts: position i predicts labels[i + 1]; -100 is ignored.
    let (mut select, mut targets) = (Vec::new(), Vec::new());
    for (r, l) in labels.iter().enumerate() {
        for i in 0..t - 1 {
            if l[i + 1] >= 0 {
                select.push((r * t + i) as u32);
                targets.push(l[i + 1] as u32);
            }
        }
    }
    Golden { rows, lens, select, targets, expected }
}

fn load(name: &str, trainable: &Trainable) -> Transformer {
    let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    Transformer::new(&folder.config, &weights, trainable, &mut Rng::new(0)).unwrap()
}

fn check(model: &Transformer, g: &Golden, key: &str) {
    let batch = Batch::new(&g.rows, &g.lens, None, &Device::Cpu).unwrap();
    let logits: Vec<Vec<Vec<f32>>> = model.logits(&batch).unwrap().to_vec3().unwrap();
    let want: Vec<Vec<Vec<f32>>> = serde_json::from_value(g.expected[key]["logits"].clone()).unwrap();
    let mut max = 0f32;
    for (r, rows) in want.iter().enumerate() {
        for (p, v) in rows.iter().enumerate() {
            for (a, b) in v.iter().zip(&logits[r][p]) {
                max = max.max((a - b).abs());
            }
        }
    }
    assert!(max < 1e-4, "{key}: max |logit diff| = {max}");
    let select = Tensor::new(g.select.as_slice(), &Device::Cpu).unwrap();
    let targets = Tensor::new(g.targets.as_slice(), &Device::Cpu).unwrap();
    let loss = model.loss(&batch, &select, &targets, None).unwrap().to_scalar::<f32>().unwrap() as f64;
    let want = g.expected[key]["loss"].as_f64().unwrap();
    assert!(((loss - want) / want).abs() < 1e-5, "{key}: loss {loss} vs transformers {want}");
}

#[test]
fn llama_matches_transformers() {
    let g = golden("tiny-llama");
    check(&load("tiny-llama", &Trainable::Nothing), &g, "base");
}

#[test]
fn qwen2_matches_transformers() {
    let g = golden("tiny-qwen2");
    check(&load("tiny-qwen2", &Trainable::Nothing), &g, "base");
}

fn with_adapter(name: &str) -> Transformer {
    let dir = fixture(name).join("adapter");
    let spec = peft::read_config(&dir).unwrap();
    let model = load(name, &Trainable::Lora(spec));
    model.load_params(&peft::read_weights(&dir, &Device::Cpu).unwrap()).unwrap();
    model
}

#[test]
fn llama_lora_matches_peft() {
    check(&with_adapter("tiny-llama"), &golden("tiny-llama"), "lora");
}

#[test]
fn qwen2_lora_matches_peft() {
    check(&with_adapter("tiny-qwen2"), &golden("tiny-qwen2"), "lora");
}

/// Central finite differences (in f64 on the loss) against autograd for a few LoRA entries.
#[test]
fn lora_gradients_match_finite_differences() {
    let g = golden("tiny-llama");
    let model = with_adapter("tiny-llama");
    let batch = Batch::new(&g.rows, &g.lens, None, &Device::Cpu).unwrap();
    let select = Tensor::new(g.select.as_slice(), &Device::Cpu).unwrap();
    let targets = Tensor::new(g.targets.as_slice(), &Device::Cpu).unwrap();
    let loss_of = |m: &Transformer| m.loss(&batch, &select, &targets, None).unwrap();
    let grads = loss_of(&model).backward().unwrap();
    let mut checked = 0;
    for p in model.params.iter().filter(|p| p.name.contains("layers.0") || p.name.contains("layers.1.mlp.down")) {
        let grad: Vec<f32> = grads
            .get(p.var.as_tensor())
            .expect("every LoRA parameter gets a gradient")
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let orig: Vec<f32> = p.var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        for idx in [0usize, orig.len() / 2, orig.len() - 1] {
            let eps = 1e-2f32;
            let mut plus = orig.clone();
            plus[idx] += eps;
            p.var.set(&Tensor::from_vec(plus, p.var.shape(), &Device::Cpu).unwrap()).unwrap();
            let lp = loss_of(&model).to_scalar::<f32>().unwrap() as f64;
            let mut minus = orig.clone();
            minus[idx] -= eps;
            p.var.set(&Tensor::from_vec(minus, p.var.shape(), &Device::Cpu).unwrap()).unwrap();
            let lm = loss_of(&model).to_scalar::<f32>().unwrap() as f64;
            p.var.set(&Tensor::from_vec(orig.clone(), p.var.shape(), &Device::Cpu).unwrap()).unwrap();
            let fd = (lp - lm) / (2.0 * eps as f64);
            let ad = grad[idx] as f64;
            assert!(
                (fd - ad).abs() < 2e-3 + 2e-2 * ad.abs(),
                "{} [{idx}]: finite difference {fd} vs autograd {ad}",
                p.name
            );
            checked += 1;
        }
    }
    assert!(checked >= 12, "checked {checked} entries");
}

/// Every trained parameter — LoRA or full — receives a non-zero gradient (candle's fused ops
/// without backward would leave some at zero or missing).
#[test]
fn every_trained_parameter_gets_a_gradient() {
    let g = golden("tiny-qwen2");
    let batch = Batch::new(&g.rows, &g.lens, None, &Device::Cpu).unwrap();
    let select = Tensor::new(g.select.as_slice(), &Device::Cpu).unwrap();
    let targets = Tensor::new(g.targets.as_slice(), &Device::Cpu).unwrap();
    for model in [with_adapter("tiny-qwen2"), load("tiny-qwen2", &Trainable::Weights(vec!["*".into()]))] {
        assert!(!model.params.is_empty());
        let grads = model.loss(&batch, &select, &targets, None).unwrap().backward().unwrap();
        for p in &model.params {
            let g = grads.get(p.var.as_tensor()).unwrap_or_else(|| panic!("no gradient for {}", p.name));
            let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(norm > 0.0, "zero gradient for {}", p.name);
        }
    }
}

#[test]
fn saved_folder_round_trips_bit_exactly() {
    let folder = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    rtune::model::folder::save_safetensors(&dir.path().join("model.safetensors"), &weights).unwrap();
    std::fs::copy(fixture("tiny-llama").join("model/config.json"), dir.path().join("config.json")).unwrap();
    let again = ModelFolder::open(dir.path()).unwrap().load_weights(&Device::Cpu, DType::F32).unwrap();
    assert_eq!(weights.keys().collect::<Vec<_>>(), again.keys().collect::<Vec<_>>());
    for (k, a) in &weights {
        let a: Vec<u32> = a.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
        let b: Vec<u32> =
            again[k].flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
        assert_eq!(a, b, "{k} changed");
    }
    let _: BTreeMap<String, Tensor> = again;
}
