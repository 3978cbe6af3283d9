//! The model engine against transformers and PEFT (golden values from
//! tests/fixtures/golden/make_golden.py), gradients against finite differences, and folder round trips.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rtune::engine::candle::Transformer;
use rtune::model::{Batch, ModelFolder, Trainable, peft};
use rtune::rng::Rng;

mod common;

use common::golden::{Golden, fixture, golden};

fn load(name: &str, trainable: &Trainable) -> Transformer {
    let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    Transformer::new(&folder.config, &weights, trainable, &mut Rng::new(0)).unwrap()
}

/// An engine's setup on the CPU for the golden batch (with AdamW, so that it takes gradients).
fn cpu_setup<'a>(
    folder: &'a ModelFolder,
    cpu: &'a rtune::device::Resolution,
    trainable: Trainable,
    trained: Option<&'a Path>,
    base_quant: Option<rtune::recipe::BaseQuant>,
) -> rtune::engine::Setup<'a> {
    rtune::engine::Setup {
        folder,
        trainable,
        seed: 0,
        device: cpu,
        optimizer: Some(rtune::engine::params::AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }),
        ema_decay: None,
        checkpointing: rtune::engine::Checkpointing::Off,
        trained,
        max_batch: (2, 8),
        tf32: false,
        engine: None,
        base_quant,
    }
}

fn check(model: &Transformer, g: &Golden, key: &str) {
    check_within(model, g, key, 1.0)
}

/// [`check`] with its tolerances times `slack`.
fn check_within(model: &Transformer, g: &Golden, key: &str, slack: f32) {
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
    assert!(max < 1e-4 * slack, "{key}: max |logit diff| = {max}");
    let select = Tensor::new(g.select.as_slice(), &Device::Cpu).unwrap();
    let targets = Tensor::new(g.targets.as_slice(), &Device::Cpu).unwrap();
    let loss = model.loss(&batch, &select, &targets, None).unwrap().to_scalar::<f32>().unwrap() as f64;
    let want = g.expected[key]["loss"].as_f64().unwrap();
    assert!(((loss - want) / want).abs() < 1e-5 * slack as f64, "{key}: loss {loss} vs transformers {want}");
}

/// candle's engine or (`fused`) the fused CPU engine, built from `setup`.
fn build_engine(setup: &rtune::engine::Setup<'_>, fused: bool) -> Box<dyn rtune::engine::Engine> {
    match fused {
        true => Box::new(rtune::engine::fused::FusedEngine::build(setup).unwrap()),
        false => Box::new(rtune::engine::candle::CandleEngine::build(setup).unwrap()),
    }
}

/// [`check_within`] through the engine interface: the loss of the golden batch, and each row's
/// last logits as generation computes them (`next_logits`), against transformers'.
fn check_engine(engine: &mut dyn rtune::engine::Engine, g: &Golden, key: &str, slack: f32) {
    let batch = rtune::engine::HostBatch::from_parts(&g.rows, &g.lens, None, g.select.clone(), g.targets.clone());
    let loss = engine.loss(&batch).unwrap();
    let want = g.expected[key]["loss"].as_f64().unwrap();
    assert!(((loss - want) / want).abs() < 1e-5 * slack as f64, "{key}: loss {loss} vs transformers {want}");
    let logits: Vec<Vec<Vec<f32>>> = serde_json::from_value(g.expected[key]["logits"].clone()).unwrap();
    for (r, row) in g.rows.iter().enumerate() {
        let got = engine.next_logits(&row[..g.lens[r]]).unwrap();
        let want = &logits[r][g.lens[r] - 1];
        let max = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(max < 1e-4 * slack, "{key}: row {r}'s last logits differ by {max}");
    }
}

#[test]
fn llama_matches_transformers() {
    let g = golden("tiny-llama");
    check(&load("tiny-llama", &Trainable::nothing()), &g, "base");
}

#[test]
fn qwen2_matches_transformers() {
    let g = golden("tiny-qwen2");
    check(&load("tiny-qwen2", &Trainable::nothing()), &g, "base");
}

/// Qwen3: heads wider than hidden / heads, and each query and key head RMS-normalised (with
/// random weights) before the rotary embedding.
#[test]
fn qwen3_matches_transformers() {
    let g = golden("tiny-qwen3");
    let model = load("tiny-qwen3", &Trainable::nothing());
    assert_eq!((model.cfg.head_dim, model.cfg.num_heads, model.cfg.hidden_size), (16, 4, 32));
    assert!(model.cfg.qk_norm);
    check(&model, &g, "base");
}

/// Gemma 2 and Gemma 3 (text): their layer in full (tests/fixtures/golden/make_golden.py `--gemma`: GELU
/// gate, random `1 + w` norms around attention and the MLP, scaled embeddings, scores scaled by
/// `query_pre_attn_scalar`, local layers whose window of 3 is shorter than the rows; Gemma 2's
/// tanh caps, Gemma 3's query/key norms and two rotary tables, the global one scaled linearly):
/// logits and loss of the base and the LoRA model, and the gradients of every adapter matrix and
/// of every base weight, against transformers and PEFT — on candle's autograd and on the fused
/// CPU engine (the one `rtune run` picks for them on the CPU).
#[test]
fn gemma_matches_transformers_forward_and_backward() {
    for name in ["tiny-gemma2", "tiny-gemma3"] {
        let g = golden(name);
        let base = load(name, &Trainable::nothing());
        let local = base.cfg.local_attention.as_ref().expect("local layers");
        assert_eq!(local.window, 3, "{name}");
        assert!(base.cfg.norm_offset && base.cfg.sandwich_norms && base.cfg.embed_scale.is_some());
        check(&base, &g, "base");
        check(&with_adapter(name), &g, "lora");
        let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
        let cpu = rtune::device::Resolution::cpu();
        let batch = rtune::engine::HostBatch::from_parts(&g.rows, &g.lens, None, g.select.clone(), g.targets.clone());
        let dir = fixture(name).join("adapter");
        let cases = [
            ("lora", Trainable::lora(peft::read_config(&dir).unwrap()), Some(dir.as_path())),
            ("full", Trainable::weights(vec!["*".into()]), None),
        ];
        for ((key, trainable, trained), fused) in cases.iter().flat_map(|c| [(c, false), (c, true)]) {
            let setup = cpu_setup(&folder, &cpu, trainable.clone(), *trained, None);
            assert_eq!(rtune::engine::build(&setup).unwrap().describe(), "fused CPU engine", "{name}");
            let mut engine = build_engine(&setup, fused);
            let key = *key;
            engine.accumulate(&batch, 1.0, 1.0, None).unwrap();
            let (loss, _) = engine.gradients().unwrap();
            let want_loss = g.expected[key]["loss"].as_f64().unwrap();
            assert!(
                ((loss - want_loss) / want_loss).abs() < 1e-5,
                "{name} {key} fused {fused}: loss {loss} vs {want_loss}"
            );
            let got = engine.gradient_values().unwrap();
            let want: BTreeMap<String, Vec<f32>> = serde_json::from_value(g.expected[key]["grads"].clone()).unwrap();
            assert_eq!(got.len(), want.len(), "{name} {key}: {:?}", got.keys().collect::<Vec<_>>());
            for (n, want) in &want {
                let got: Vec<f32> = got[&n.replace(".default", "")].flatten_all().unwrap().to_vec1().unwrap();
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(diff <= 1e-4 * scale, "{name} {key} fused {fused}: {n}: max |diff| {diff} of {scale}");
            }
        }
    }
}

fn with_adapter(name: &str) -> Transformer {
    let dir = fixture(name).join("adapter");
    let spec = peft::read_config(&dir).unwrap();
    let model = load(name, &Trainable::lora(spec));
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

#[test]
fn qwen3_lora_matches_peft() {
    check(&with_adapter("tiny-qwen3"), &golden("tiny-qwen3"), "lora");
}

/// bitsandbytes' 4-bit NF4 quantization of every linear of the tiny QLoRA model, as transformers
/// loads it with `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`
/// (tests/fixtures/golden/make_golden.py `--qlora`): the same packed bytes and block scales, bit for bit,
/// and no other weight quantized.
#[test]
fn nf4_quantization_matches_bitsandbytes() {
    use rtune::model::nf4;
    let want: BTreeMap<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture("tiny-qlora").join("nf4.json")).unwrap()).unwrap();
    let folder = ModelFolder::open(&fixture("tiny-qlora").join("model")).unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    let mut n = 0;
    for (name, w) in &weights {
        assert_eq!(nf4::quantizes(name), want.contains_key(name), "{name}");
        let Some(want) = want.get(name) else { continue };
        let q = nf4::quantize(&w.flatten_all().unwrap().to_vec1::<f32>().unwrap(), false);
        let hex: String = q.packed.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, want["packed"].as_str().unwrap(), "{name}: packed indices");
        let absmax: Vec<f32> = serde_json::from_value(want["absmax"].clone()).unwrap();
        assert_eq!(q.absmax, absmax, "{name}: block scales");
        n += 1;
    }
    assert_eq!(n, 14);
}

/// Double quantization (`bnb_4bit_use_double_quant=True`) of the tiny QLoRA model's weights and of
/// a larger probe tensor against bitsandbytes: the same packed 4-bit indices, offset (the scales'
/// mean) and scales of the scales; the 8-bit indices of the scales equal bitsandbytes' but where
/// its CPU lookup table picks a neighbour of the nearest value (rtune takes the nearest: never more
/// than 2% of them, each one step away), so the dequantized scales agree within one step.
#[test]
fn nf4_double_quantization_matches_bitsandbytes() {
    use rtune::model::nf4;
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(fixture("tiny-qlora").join(f)).unwrap()).unwrap()
    };
    let code = nf4::dynamic_code();
    let (mut differ, mut total) = (0, 0);
    let mut check = |what: &str, q: &nf4::Nf4, want: &serde_json::Value| {
        let n = q.nested.as_ref().unwrap();
        let codes: Vec<u8> = (0..want["codes"].as_str().unwrap().len() / 2)
            .map(|i| u8::from_str_radix(&want["codes"].as_str().unwrap()[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        assert_eq!(n.codes.len(), codes.len(), "{what}");
        let offset = want["offset"].as_f64().unwrap() as f32;
        assert!((n.offset - offset).abs() <= 1e-6 * offset.abs(), "{what}: offset {} vs {offset}", n.offset);
        let scales: Vec<f32> = serde_json::from_value(want["scales"].clone()).unwrap();
        for (a, b) in n.scales.iter().zip(&scales) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{what}: scale {a} vs {b}");
        }
        for (b, (ours, theirs)) in n.codes.iter().zip(&codes).enumerate() {
            total += 1;
            if ours != theirs {
                differ += 1;
                assert_eq!(ours.abs_diff(*theirs), 1, "{what}: scale {b}: index {ours} vs {theirs}");
                let x = q.absmax[b] - n.offset;
                let s = n.scales[b / nf4::SCALE_BLOCK];
                // Ours is the nearer of the two.
                let d = |i: u8| (x - code[i as usize] * s).abs();
                assert!(d(*ours) <= d(*theirs), "{what}: scale {b}");
            }
        }
    };
    let want = read("nf4-dq.json");
    let folder = ModelFolder::open(&fixture("tiny-qlora").join("model")).unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    for (name, w) in want.as_object().unwrap() {
        let q = nf4::quantize(&weights[name].flatten_all().unwrap().to_vec1::<f32>().unwrap(), true);
        let hex: String = q.packed.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, w["packed"].as_str().unwrap(), "{name}: packed indices");
        check(name, &q, w);
    }
    let v: Vec<f32> = (0..65536u64)
        .map(|i| (((i * 2654435761) % (1 << 32)) as f64 / 4294967296.0 - 0.5) * (1 + (i / 64) % 7) as f64)
        .map(|v| v as f32)
        .collect();
    check("probe", &nf4::quantize(&v, true), &read("nf4-dq-probe.json"));
    assert!(differ * 50 <= total, "{differ} of {total} 8-bit indices differ");
}

/// QLoRA against PEFT over bitsandbytes' 4-bit base (make_golden.py `--qlora`), without and with
/// double quantization: the 4-bit model's logits and loss, and with a LoRA adapter on every
/// linear its logits, loss and every adapter gradient, on candle's autograd and on the fused CPU
/// engine.
#[test]
fn qlora_matches_peft_over_a_bitsandbytes_base() {
    let g = golden("tiny-qlora");
    let dir = fixture("tiny-qlora").join("adapter");
    let folder = ModelFolder::open(&fixture("tiny-qlora").join("model")).unwrap();
    let cpu = rtune::device::Resolution::cpu();
    let setup = |trainable, trained, base_quant| cpu_setup(&folder, &cpu, trainable, trained, base_quant);
    let batch = rtune::engine::HostBatch::from_parts(&g.rows, &g.lens, None, g.select.clone(), g.targets.clone());
    let dq: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tiny-qlora").join("expected-dq.json")).unwrap())
            .unwrap();
    for (quant, expected) in
        [(rtune::recipe::BaseQuant::Nf4, g.expected.clone()), (rtune::recipe::BaseQuant::Nf4Dq, dq)]
    {
        let g = Golden { expected, ..golden("tiny-qlora") };
        let nf4 = Some(quant);
        // Double quantization: a few scales a step from bitsandbytes' (its CPU lookup table's
        // choice, `nf4_double_quantization_matches_bitsandbytes`) move the logits by up to 3e-4.
        let slack = if quant == rtune::recipe::BaseQuant::Nf4Dq { 10.0 } else { 1.0 };
        let want: BTreeMap<String, Vec<f32>> = serde_json::from_value(g.expected["lora"]["grads"].clone()).unwrap();
        let lora = || Trainable::lora(peft::read_config(&dir).unwrap());
        let candle = |trainable, trained, quant| {
            rtune::engine::candle::CandleEngine::build(&setup(trainable, trained, quant)).unwrap()
        };
        check_within(candle(Trainable::nothing(), None, nf4).model(), &g, "base", slack);
        check_within(candle(lora(), Some(&dir), nf4).model(), &g, "lora", slack);
        for fused in [false, true] {
            check_engine(&mut *build_engine(&setup(Trainable::nothing(), None, nf4), fused), &g, "base", slack);
            let mut tuned = build_engine(&setup(lora(), Some(&dir), nf4), fused);
            check_engine(&mut *tuned, &g, "lora", slack);
            tuned.accumulate(&batch, 1.0, 1.0, None).unwrap();
            let got = tuned.gradient_values().unwrap();
            assert_eq!(got.len(), want.len());
            for (name, want) in &want {
                let got: Vec<f32> = got[&name.replace(".default", "")].flatten_all().unwrap().to_vec1().unwrap();
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(diff <= 1e-4 * slack * scale, "fused {fused}: {name}: max |diff| {diff} of {scale}");
            }
            // The same adapter on the original weights is another model.
            let loss = build_engine(&setup(lora(), Some(&dir), None), fused).loss(&batch).unwrap();
            let qlora = g.expected["lora"]["loss"].as_f64().unwrap();
            assert!((loss - qlora).abs() > 1e-3, "the dense base's loss {loss} is QLoRA's {qlora}");
        }
    }
}

/// Central finite differences (in f64 on the loss) against autograd for a few LoRA entries.
/// A PEFT adapter with `modules_to_save`, made by PEFT (tests/fixtures/golden/make_golden.py
/// `--modules`: modules changed at random — an untied LM head, norms, a whole linear; in Qwen2 a
/// k_proj with its bias, and the embedding, which PEFT keeps tied to the LM head; in Qwen3 a
/// query and a key head norm), loads as PEFT
/// computes it: the path evaluation and exports take (`trained` = the folder), on candle and on
/// the fused engine.
#[test]
fn peft_adapters_with_modules_to_save_match_peft() {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        let dir = fixture(name).join("adapter-modules");
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected-modules.json")).unwrap())
                .unwrap();
        let g = Golden { expected, ..golden(name) };
        let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
        let cpu = rtune::device::Resolution::cpu();
        let setup =
            |trained| cpu_setup(&folder, &cpu, Trainable::lora(peft::read_config(&dir).unwrap()), trained, None);
        check(rtune::engine::candle::CandleEngine::build(&setup(Some(&dir))).unwrap().model(), &g, "modules");
        for fused in [false, true] {
            check_engine(&mut *build_engine(&setup(Some(&dir)), fused), &g, "modules", 1.0);
        }
        // The adapter matrices alone on the base (the saved modules ignored) are another model.
        let bare = load(name, &Trainable::lora(peft::read_config(&dir).unwrap()));
        bare.load_adapters(&peft::read_weights(&dir, &Device::Cpu).unwrap()).unwrap();
        let batch = Batch::new(&g.rows, &g.lens, None, &Device::Cpu).unwrap();
        let select = Tensor::new(g.select.as_slice(), &Device::Cpu).unwrap();
        let targets = Tensor::new(g.targets.as_slice(), &Device::Cpu).unwrap();
        let loss = bare.loss(&batch, &select, &targets, None).unwrap().to_scalar::<f32>().unwrap() as f64;
        assert!((loss - g.expected["modules"]["loss"].as_f64().unwrap()).abs() > 1e-3, "{name}: the modules matter");
    }
}

/// An rsLoRA adapter (PEFT's `use_rslora`: scale alpha / √r) reads as one: the golden adapter
/// re-saved with `use_rslora` and the alpha that gives PEFT's scale alpha / r the same value
/// (alpha / r = alpha' / √r) computes PEFT's logits, and a model written back says `use_rslora`.
#[test]
fn rslora_adapters_scale_by_alpha_over_the_root_of_the_rank() {
    let g = golden("tiny-llama");
    let src = fixture("tiny-llama").join("adapter");
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap()).unwrap();
    let (r, alpha) = (config["r"].as_f64().unwrap(), config["lora_alpha"].as_f64().unwrap());
    config["use_rslora"] = serde_json::json!(true);
    config["lora_alpha"] = serde_json::json!(alpha / r * r.sqrt());
    std::fs::write(dir.path().join("adapter_config.json"), config.to_string()).unwrap();
    std::fs::copy(src.join("adapter_model.safetensors"), dir.path().join("adapter_model.safetensors")).unwrap();
    let spec = peft::read_config(dir.path()).unwrap();
    assert!(spec.rslora && (spec.scale() - alpha / r).abs() < 1e-12, "{spec:?}");
    let model = load("tiny-llama", &Trainable::lora(spec.clone()));
    model.load_params(&peft::read_weights(dir.path(), &Device::Cpu).unwrap()).unwrap();
    check(&model, &g, "lora");
    let out = tempfile::tempdir().unwrap();
    let folder = rtune::model::ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    peft::write(out.path(), &spec, &model.param_values(), "", &folder).unwrap();
    assert_eq!(peft::read_config(out.path()).unwrap(), spec);
}

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
    for model in [with_adapter("tiny-qwen2"), load("tiny-qwen2", &Trainable::weights(vec!["*".into()]))] {
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

/// Merged weights are base + scale·B·A, and the merged model computes what the adapter does —
/// built whole from the merged tensors, and layer by layer as the quantize stage's checks run
/// it (the adapter model and the merged one, each against PEFT's logits).
#[test]
fn merged_weights_equal_base_plus_scaled_delta() {
    use rtune::export::merged::{Form, Merged};
    let folder = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let tuned = Merged::open(&folder, Some(&fixture("tiny-llama").join("adapter"))).unwrap();
    let merged: BTreeMap<String, Tensor> =
        tuned.layout().iter().map(|e| (e.name.clone(), tuned.tensor(&e.name).unwrap())).collect();
    let base = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    let adapter = peft::read_weights(&fixture("tiny-llama").join("adapter"), &Device::Cpu).unwrap();
    let name = "model.layers.1.self_attn.v_proj";
    let a = &adapter[&format!("base_model.model.{name}.lora_A.weight")];
    let b = &adapter[&format!("base_model.model.{name}.lora_B.weight")];
    let want = (&base[&format!("{name}.weight")] + (b.matmul(a).unwrap() * 2.0).unwrap()).unwrap();
    let diff = (&merged[&format!("{name}.weight")] - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff < 1e-6, "{diff}");
    assert_eq!(merged.keys().collect::<Vec<_>>(), base.keys().collect::<Vec<_>>(), "same tensor names as the base");
    let plain = Transformer::new(&folder.config, &merged, &Trainable::nothing(), &mut Rng::new(0)).unwrap();
    check(&plain, &golden("tiny-llama"), "lora");
    // One layer at a time: both models give PEFT's logits.
    let g = golden("tiny-llama");
    let batch = Batch::new(&g.rows, &g.lens, None, &Device::Cpu).unwrap();
    let want: Vec<Vec<Vec<f32>>> = serde_json::from_value(g.expected["lora"]["logits"].clone()).unwrap();
    for form in [Form::Adapter, Form::Merged] {
        let model = tuned.streamed(form, &Device::Cpu).unwrap();
        let h = model.hidden(std::slice::from_ref(&batch)).unwrap();
        let logits: Vec<Vec<Vec<f32>>> = model.logits(&h[0]).unwrap().to_vec3().unwrap();
        let max = want.iter().flatten().flatten().zip(logits.iter().flatten().flatten()).map(|(a, b)| (a - b).abs());
        let max = max.fold(0f32, f32::max);
        assert!(max < 1e-4, "{form:?}: max |logit diff| {max}");
    }
}

/// Give every trained parameter of `model` uniform values in ±0.1 from `seed`; returns them.
fn randomize(model: &Transformer, seed: u64) -> BTreeMap<String, Tensor> {
    let mut rng = Rng::new(seed);
    let values: BTreeMap<String, Tensor> = model
        .params
        .iter()
        .map(|p| {
            let v: Vec<f32> = (0..p.var.elem_count()).map(|_| (rng.next_f64() as f32 - 0.5) * 0.2).collect();
            (p.name.clone(), Tensor::from_vec(v, p.var.shape(), &Device::Cpu).unwrap())
        })
        .collect();
    model.load_params(&values).unwrap();
    values
}

/// The bits of a tensor's values, as f32 (bf16 and f16 widen exactly).
fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// A bf16 checkpoint merges into bf16 weights, as PEFT's `merge_and_unload` leaves a model
/// loaded in its own dtype: each the f32 merge rounded once. Asked for f32, the folder is f32
/// and its config.json says so.
#[test]
fn merged_exports_keep_the_base_dtype_unless_told_otherwise() {
    use rtune::export::merged::Merged;
    let src = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let bf16 = src.load_weights(&Device::Cpu, DType::BF16).unwrap();
    rtune::model::folder::save_safetensors(&dir.path().join("model.safetensors"), &bf16).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tiny-llama").join("model/config.json")).unwrap())
            .unwrap();
    config["dtype"] = "bfloat16".into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let folder = ModelFolder::open(dir.path()).unwrap();
    let tuned = Merged::open(&folder, Some(&fixture("tiny-llama").join("adapter"))).unwrap();
    assert!(tuned.layout().iter().all(|e| e.dtype == DType::BF16));
    for (asked, want, name) in [(None, DType::BF16, "bfloat16"), (Some(DType::F32), DType::F32, "float32")] {
        let out = tempfile::tempdir().unwrap();
        tuned.save_safetensors(out.path(), asked, u64::MAX).unwrap();
        let raw = tuned.raw_config(asked);
        assert_eq!((&raw["dtype"], raw.get("torch_dtype")), (&serde_json::json!(name), None));
        std::fs::write(out.path().join("config.json"), raw.to_string()).unwrap();
        let back = ModelFolder::open(out.path()).unwrap().stored().unwrap();
        assert_eq!(back.len(), tuned.layout().len());
        for e in tuned.layout() {
            let got = back.get(&e.name).unwrap();
            assert_eq!(got.dtype(), want, "{}", e.name);
            let merged = tuned.tensor(&e.name).unwrap();
            assert_eq!(bits(&got), bits(&merged.to_dtype(want).unwrap()), "{}", e.name);
        }
    }
    // The adapter survives the rounding: a merged bf16 projection is not the base's.
    let name = "model.layers.1.self_attn.v_proj.weight";
    let merged = tuned.tensor(name).unwrap().to_dtype(DType::BF16).unwrap();
    assert_ne!(bits(&merged), bits(&bf16[name]));
}

/// An adapter on a tied LM head unties it: the merged model has its own `lm_head.weight` (the
/// embedding plus the head's delta) and says `tie_word_embeddings: false`; run one layer at a
/// time, the adapter model and the merged one compute what the adapter model built whole does.
#[test]
fn an_adapter_on_a_tied_head_unties_it_in_the_merge() {
    use rtune::export::merged::{Form, Merged};
    let folder = ModelFolder::open(&fixture("tiny-qwen2").join("model")).unwrap();
    assert!(folder.config.tie_word_embeddings);
    let targets = ["q_proj", "lm_head"].map(String::from).to_vec();
    let spec = rtune::model::LoraSpec { rank: 4, alpha: 8.0, rslora: false, dropout: 0.0, targets };
    let model = load("tiny-qwen2", &Trainable::lora(spec.clone()));
    let values = randomize(&model, 3);
    let adapter = tempfile::tempdir().unwrap();
    peft::write(adapter.path(), &spec, &values, "t", &folder).unwrap();
    let tuned = Merged::open(&folder, Some(adapter.path())).unwrap();
    assert!(!tuned.config().tie_word_embeddings);
    assert_eq!(tuned.raw_config(None)["tie_word_embeddings"], false);
    assert_eq!(tuned.layout().last().unwrap().name, "lm_head.weight");
    let ids: Vec<Vec<u32>> = vec![vec![1, 17, 45, 99, 3, 64], vec![5, 6, 7, 8, 9, 10]];
    let batch = Batch::new(&ids, &[6, 4], None, &Device::Cpu).unwrap();
    let want = bits(&model.logits(&batch).unwrap());
    let want: Vec<f32> = want.iter().map(|b| f32::from_bits(*b)).collect();
    for form in [Form::Adapter, Form::Merged] {
        let m = tuned.streamed(form, &Device::Cpu).unwrap();
        let h = m.hidden(std::slice::from_ref(&batch)).unwrap();
        let got = m.logits(&h[0]).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d < 1e-4, "{form:?}: {d}");
    }
}

/// Adapter matrices the config's targets do not cover would be dropped by the adapter model and
/// added by a merge: that is an error naming one, never a silent difference.
#[test]
fn an_adapter_tensor_no_target_covers_is_an_error() {
    use rtune::export::merged::Merged;
    let folder = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for f in ["adapter_model.safetensors", "adapter_config.json"] {
        std::fs::copy(fixture("tiny-llama").join("adapter").join(f), dir.path().join(f)).unwrap();
    }
    let path = dir.path().join("adapter_config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["target_modules"] = serde_json::json!(["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]);
    std::fs::write(&path, cfg.to_string()).unwrap();
    let err = Merged::open(&folder, Some(dir.path())).err().expect("refused").to_string();
    assert!(err.contains("v_proj.lora_"), "{err}");
}

/// Logits of one unpadded sequence, position by position.
fn full_forward(model: &Transformer, ids: &[u32]) -> Vec<Vec<f32>> {
    let batch = Batch::new(&[ids.to_vec()], &[ids.len()], None, &Device::Cpu).unwrap();
    model.logits(&batch).unwrap().squeeze(0).unwrap().to_vec2().unwrap()
}

/// Generation with the KV cache gives the logits a full forward pass gives.
#[test]
fn kv_cache_steps_match_full_forward() {
    // Qwen3's cached keys are normalised per head before the rotary embedding, as in one pass.
    for name in ["tiny-qwen2", "tiny-qwen3"] {
        let model = load(name, &Trainable::nothing());
        let ids = [1u32, 17, 45, 99, 3, 64];
        let full = full_forward(&model, &ids);
        let mut cache = rtune::engine::candle::KvCache::default();
        let mut got = vec![model.step(&ids[..3], &mut cache).unwrap().to_vec1::<f32>().unwrap()];
        for id in &ids[3..] {
            got.push(model.step(&[*id], &mut cache).unwrap().to_vec1::<f32>().unwrap());
        }
        for (k, g) in got.iter().enumerate() {
            let row = &full[2 + k];
            let d = g.iter().zip(row).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d < 1e-5, "{name} position {}: {d}", 2 + k);
        }
    }
}

/// A sharded checkpoint (index + two files) loads to the same tensors.
#[test]
fn sharded_checkpoints_load() {
    let src = fixture("tiny-llama").join("model");
    let weights = ModelFolder::open(&src).unwrap().load_weights(&Device::Cpu, DType::F32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let (first, second): (BTreeMap<_, _>, BTreeMap<_, _>) =
        weights.clone().into_iter().partition(|(k, _)| k.contains("layers.0"));
    rtune::model::folder::save_safetensors(&dir.path().join("model-00001-of-00002.safetensors"), &first).unwrap();
    rtune::model::folder::save_safetensors(&dir.path().join("model-00002-of-00002.safetensors"), &second).unwrap();
    let map: serde_json::Map<String, serde_json::Value> = first
        .keys()
        .map(|k| (k.clone(), "model-00001-of-00002.safetensors".into()))
        .chain(second.keys().map(|k| (k.clone(), "model-00002-of-00002.safetensors".into())))
        .collect();
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let again = ModelFolder::open(dir.path()).unwrap().load_weights(&Device::Cpu, DType::F32).unwrap();
    assert_eq!(again.len(), weights.len());
}

/// Bad model folders give errors that name the problem.
#[test]
fn bad_model_folders_are_clear_errors() {
    let src = fixture("tiny-llama").join("model");
    let dir = tempfile::tempdir().unwrap();
    let err = ModelFolder::open(dir.path()).unwrap_err().to_string();
    assert_eq!(err, format!("model folder `{}` has no `config.json`", dir.path().display()));

    let cfg = std::fs::read_to_string(src.join("config.json")).unwrap();
    std::fs::write(dir.path().join("config.json"), cfg.replace("LlamaForCausalLM", "GPT2LMHeadModel")).unwrap();
    assert_eq!(
        ModelFolder::open(dir.path()).unwrap_err().to_string(),
        "architecture `GPT2LMHeadModel` is not supported"
    );

    std::fs::write(
        dir.path().join("config.json"),
        cfg.replace("\"intermediate_size\": 64", "\"intermediate_size\": 65"),
    )
    .unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let folder = ModelFolder::open(dir.path()).unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    let err =
        Transformer::new(&folder.config, &weights, &Trainable::nothing(), &mut Rng::new(0)).err().unwrap().to_string();
    assert_eq!(
        err,
        "tensor `model.layers.0.mlp.gate_proj.weight` has shape [64, 32], but config.json implies [65, 32]"
    );

    // Issue 21: absurd sizes are errors naming the field, not allocation aborts.
    for (field, value) in [("num_hidden_layers", "1000000000000000"), ("max_position_embeddings", "1099511627776")] {
        let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
        v[field] = serde_json::from_str(value).unwrap();
        std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
        let err = ModelFolder::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains(&format!("`{field}` = {value}")), "{err}");
    }

    std::fs::write(dir.path().join("config.json"), &cfg).unwrap();
    let bytes: Vec<u8> = [1u32, 2].iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![2], &bytes).unwrap();
    let file = safetensors::serialize(vec![("model.norm.weight".to_string(), view)], None).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), file).unwrap();
    let err = ModelFolder::open(dir.path()).unwrap().load_weights(&Device::Cpu, DType::F32).unwrap_err().to_string();
    assert_eq!(err, "tensor `model.norm.weight` has dtype U32, which rtune cannot load");

    std::fs::write(dir.path().join("model.safetensors"), b"not a safetensors file").unwrap();
    let err = ModelFolder::open(dir.path()).unwrap().load_weights(&Device::Cpu, DType::F32).unwrap_err().to_string();
    assert!(err.starts_with("cannot read `"), "{err}");
}

/// bf16 compute with f32 master weights: the loss stays close to f32's, and every LoRA
/// parameter is an f32 variable that receives an f32 gradient.
#[test]
fn bf16_compute_keeps_f32_master_weights() {
    let g = golden("tiny-llama");
    let folder = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    let dir = fixture("tiny-llama").join("adapter");
    let spec = peft::read_config(&dir).unwrap();
    let model =
        Transformer::with_dtype(&folder.config, &weights, &Trainable::lora(spec), &mut Rng::new(0), DType::BF16)
            .unwrap();
    model.load_params(&peft::read_weights(&dir, &Device::Cpu).unwrap()).unwrap();
    let batch = Batch::new(&g.rows, &g.lens, None, &Device::Cpu).unwrap();
    let select = Tensor::new(g.select.as_slice(), &Device::Cpu).unwrap();
    let targets = Tensor::new(g.targets.as_slice(), &Device::Cpu).unwrap();
    let loss = model.loss(&batch, &select, &targets, None).unwrap();
    let value = loss.to_scalar::<f32>().unwrap() as f64;
    let want = g.expected["lora"]["loss"].as_f64().unwrap();
    assert!(((value - want) / want).abs() < 2e-2, "bf16 loss {value} vs f32 {want}");
    let grads = loss.backward().unwrap();
    for p in &model.params {
        assert_eq!(p.var.dtype(), DType::F32, "{} master weight", p.name);
        assert_eq!(grads.get(p.var.as_tensor()).unwrap().dtype(), DType::F32);
    }
}

/// Logits of one token at `pos` from candle's quantized Qwen2 (llama.cpp's conventions).
fn qwen2_gguf_logits(
    q: &mut candle_transformers::models::quantized_qwen2::ModelWeights,
    id: u32,
    pos: usize,
) -> Vec<f32> {
    q.forward(&Tensor::new(&[[id]], &Device::Cpu).unwrap(), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// The tiny Qwen2 fixture with a stand-in byte-level BPE tokenizer.json (enough for the GGUF
/// tokenizer metadata).
fn qwen2_folder_for_gguf() -> tempfile::TempDir {
    let src = fixture("tiny-qwen2").join("model");
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let vocab: serde_json::Map<String, serde_json::Value> = (0..128).map(|i| (format!("t{i}"), i.into())).collect();
    let tj = serde_json::json!({"model": {"type": "BPE", "vocab": vocab, "merges": [["t1", "t2"]]}, "added_tokens": [{"id": 2, "content": "</s>", "special": true}]});
    std::fs::write(dir.path().join("tokenizer.json"), tj.to_string()).unwrap();
    dir
}

/// A Qwen2 model (q/k/v biases, tied embeddings) exported as f32 GGUF and run by candle's
/// llama.cpp-compatible quantized Qwen2 gives the logits rtune's model gives.
#[test]
fn gguf_export_runs_in_candles_llama_cpp_reader() {
    use candle_transformers::models::quantized_qwen2;
    let dir = qwen2_folder_for_gguf();
    let model = load("tiny-qwen2", &Trainable::nothing());
    let path = dir.path().join("m.gguf");
    let folder = ModelFolder::open(dir.path()).unwrap();
    let merged = rtune::export::merged::Merged::open(&folder, None).unwrap();
    let report =
        rtune::export::gguf::write(&path, &merged, dir.path(), "t", rtune::recipe::ExportFormat::GgufF32, None, None)
            .unwrap();
    let mut f = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    assert_eq!(content.metadata["general.architecture"].to_string().unwrap(), "qwen2");
    assert_eq!(content.metadata["tokenizer.ggml.model"].to_string().unwrap(), "gpt2");
    assert_eq!(content.metadata["qwen2.attention.head_count_kv"].to_u32().unwrap(), 2);
    assert!(content.tensor_infos.contains_key("blk.1.attn_q.bias"));
    assert!(!content.tensor_infos.contains_key("output.weight"), "tied head is not duplicated");
    assert_eq!(report.tensors, content.tensor_infos.len());
    let mut q = quantized_qwen2::ModelWeights::from_gguf(content, &mut f, &Device::Cpu).unwrap();
    let ids = [1u32, 17, 45, 99, 3, 64];
    let full = full_forward(&model, &ids);
    for (j, id) in ids.iter().enumerate() {
        let got = qwen2_gguf_logits(&mut q, *id, j);
        let d = got.iter().zip(&full[j]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d < 1e-3, "position {j}: max |logit diff| {d}");
    }
}

#[test]
fn merged_weights_stream_into_shards_with_an_index_that_loads_back() {
    let folder = ModelFolder::open(&fixture("tiny-llama").join("model")).unwrap();
    let tuned = rtune::export::merged::Merged::open(&folder, Some(&fixture("tiny-llama").join("adapter"))).unwrap();
    let merged: BTreeMap<String, Tensor> =
        tuned.layout().iter().map(|e| (e.name.clone(), tuned.tensor(&e.name).unwrap())).collect();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("tiny-llama").join("model/config.json"), dir.path().join("config.json")).unwrap();
    let files = tuned.save_safetensors(dir.path(), None, 30_000).unwrap().files;
    assert!(files.len() > 2, "{files:?}");
    assert_eq!(files.last().unwrap(), "model.safetensors.index.json");
    assert!(files[0].starts_with("model-00001-of-"), "{files:?}");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), merged.len());
    let back = ModelFolder::open(dir.path()).unwrap().load_weights(&Device::Cpu, DType::F32).unwrap();
    assert_eq!(back.keys().collect::<Vec<_>>(), merged.keys().collect::<Vec<_>>());
    for (name, t) in &merged {
        let d = (t - &back[name]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(d, 0.0, "{name}");
    }
    // One file when it fits.
    let one = tempfile::tempdir().unwrap();
    let files = tuned.save_safetensors(one.path(), None, u64::MAX).unwrap().files;
    assert_eq!(files, ["model.safetensors"]);
    assert_eq!(rtune::recipe::parse_size("5GB").unwrap(), 5_000_000_000);
    assert_eq!(rtune::recipe::parse_size("2 MiB").unwrap(), 2 * 1024 * 1024);
    assert!(rtune::recipe::parse_size("5 parsecs").is_err());
}

/// rtune streams a GGUF (header first, then each tensor as it is computed); the file is the one
/// candle's `gguf_file::write` makes of the same metadata and tensors, byte for byte.
#[test]
fn streamed_gguf_is_byte_identical_to_candles_writer() {
    use candle_core::quantized::gguf_file;
    let dir = qwen2_folder_for_gguf();
    let folder = ModelFolder::open(dir.path()).unwrap();
    let merged = rtune::export::merged::Merged::open(&folder, None).unwrap();
    for format in [rtune::recipe::ExportFormat::GgufQ8_0, rtune::recipe::ExportFormat::GgufQ4KM] {
        let path = dir.path().join("m.gguf");
        rtune::export::gguf::write(&path, &merged, dir.path(), "t", format, None, None).unwrap();
        let ours = std::fs::read(&path).unwrap();
        let mut f = std::io::Cursor::new(ours.clone());
        let content = gguf_file::Content::read(&mut f).unwrap();
        // The order rtune wrote: metadata keys by where they are in the file, tensors by offset.
        let at = |key: &str| ours.windows(key.len()).position(|w| w == key.as_bytes()).unwrap();
        let mut keys: Vec<&String> = content.metadata.keys().collect();
        keys.sort_by_key(|k| at(k));
        let mut names: Vec<&String> = content.tensor_infos.keys().collect();
        names.sort_by_key(|n| content.tensor_infos[*n].offset);
        let tensors: Vec<(&str, candle_core::quantized::QTensor)> =
            names.iter().map(|n| (n.as_str(), content.tensor(&mut f, n, &Device::Cpu).unwrap())).collect();
        let md: Vec<(&str, &gguf_file::Value)> = keys.iter().map(|k| (k.as_str(), &content.metadata[*k])).collect();
        let refs: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        let mut theirs = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut theirs, &md, &refs).unwrap();
        assert!(theirs.into_inner() == ours, "{format:?}: the files differ");
    }
}

/// Every GGUF type round-trips: written, read back by candle's llama.cpp reader with the
/// declared tensor types and `general.file_type`, and its logits follow the f32 model's (as
/// closely as the type allows). The model is a Qwen2 (biases, tied embeddings) 64 wide with an
/// MLP of 256, so that K-quant files hold both K-quant blocks (the down projections) and
/// llama.cpp's fallbacks (rows of 64: Q5_0, Q5_1, Q8_0).
#[test]
fn every_gguf_type_round_trips() {
    use candle_core::quantized::GgmlDType;
    use candle_transformers::models::quantized_qwen2;
    use rtune::recipe::ExportFormat as F;
    let dir = tempfile::tempdir().unwrap();
    let spec: rtune::recipe::ScratchModel = toml::from_str(
        "arch = \"qwen2\"\nhidden_size = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nintermediate_size = 256\nvocab_size = 300\ntie_word_embeddings = true",
    )
    .unwrap();
    let texts: Vec<String> = (0..200).map(|i| format!("sample {i}: some words to train a tokenizer on")).collect();
    rtune::model::scratch::create(dir.path(), &spec, texts.iter(), 0).unwrap();
    let folder = ModelFolder::open(dir.path()).unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    let model = Transformer::new(&folder.config, &weights, &Trainable::nothing(), &mut Rng::new(0)).unwrap();
    let merged = rtune::export::merged::Merged::open(&folder, None).unwrap();
    let ids = [1u32, 17, 45, 99, 3, 64];
    let full = full_forward(&model, &ids);
    // (format, ggml type of the last layer's down projection — Q6_K in the `_M` mixes —,
    // llama.cpp file type, smallest cosine similarity of logits)
    for (format, ty, file_type, min_cos) in [
        (F::GgufF16, GgmlDType::F16, 1, 0.9999),
        (F::GgufQ8_0, GgmlDType::Q8_0, 7, 0.999),
        (F::GgufQ6K, GgmlDType::Q6K, 18, 0.999),
        (F::GgufQ5KM, GgmlDType::Q6K, 17, 0.99),
        (F::GgufQ5KS, GgmlDType::Q5K, 16, 0.99),
        (F::GgufQ4KM, GgmlDType::Q6K, 15, 0.95),
        (F::GgufQ4KS, GgmlDType::Q4K, 14, 0.95),
        (F::GgufQ4_0, GgmlDType::Q4_0, 2, 0.95),
        (F::GgufQ3KL, GgmlDType::Q5K, 13, 0.95),
        (F::GgufQ3KM, GgmlDType::Q4K, 12, 0.9),
        (F::GgufQ3KS, GgmlDType::Q3K, 11, 0.9),
        (F::GgufQ2K, GgmlDType::Q3K, 10, 0.8),
    ] {
        let path = dir.path().join(format!("{format:?}.gguf"));
        let report = rtune::export::gguf::write(&path, &merged, dir.path(), "t", format, None, None).unwrap();
        let mut f = std::fs::File::open(&path).unwrap();
        let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
        assert_eq!(content.metadata["general.file_type"].to_u32().unwrap(), file_type, "{format:?}");
        let down = content.tensor_infos["blk.1.ffn_down.weight"].ggml_dtype;
        assert_eq!(down, ty, "{format:?}: ffn_down, fallbacks {:?}", report.fallbacks);
        let fell_back = report.fallbacks.iter().any(|s| s.contains("blk.0.attn_q.weight"));
        let k_quant = matches!(ty, GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K);
        assert_eq!(fell_back, k_quant, "{format:?}: rows of 64 fall back from K-quants only: {:?}", report.fallbacks);
        assert_eq!(content.tensor_infos["blk.0.attn_norm.weight"].ggml_dtype, GgmlDType::F32, "norms stay f32");
        let mut q = quantized_qwen2::ModelWeights::from_gguf(content, &mut f, &Device::Cpu).unwrap();
        for (j, id) in ids.iter().enumerate() {
            let got = qwen2_gguf_logits(&mut q, *id, j);
            let dot: f32 = got.iter().zip(&full[j]).map(|(a, b)| a * b).sum();
            let na: f32 = got.iter().map(|a| a * a).sum::<f32>().sqrt();
            let nb: f32 = full[j].iter().map(|b| b * b).sum::<f32>().sqrt();
            let cos = dot / (na * nb);
            assert!(cos >= min_cos, "{format:?} position {j}: cosine {cos} < {min_cos}");
        }
    }
}

fn quant_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant").join(name)
}

/// rtune's quantizers write llama.cpp's bytes: rows that reach every branch of ggml's reference
/// quantizers (all zero, constant, one-signed, below ggml's zero threshold, rounding ties,
/// outliers, huge ranges, bf16-rounded and Gaussian weights), quantized to every type rtune
/// writes, equal what llama.cpp's `ggml_quantize_chunk` wrote for them
/// (tests/fixtures/quant/make_quant.py), byte for byte.
#[test]
fn quantizers_write_llama_cpps_bytes() {
    use candle_core::quantized::{GgmlDType, gguf_file};
    use rtune::export::gguf::quants;
    let path = quant_fixture("blocks.gguf");
    let mut f = std::fs::File::open(&path).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let input = content.tensor(&mut f, "input", &Device::Cpu).unwrap();
    let (rows, row) = input.shape().dims2().unwrap();
    let x: Vec<f32> = input.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let importance: Vec<f32> = content
        .tensor(&mut f, "importance", &Device::Cpu)
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(importance.len(), row);
    let types = [
        ("F16", GgmlDType::F16),
        ("Q8_0", GgmlDType::Q8_0),
        ("Q4_0", GgmlDType::Q4_0),
        ("Q4_1", GgmlDType::Q4_1),
        ("Q5_0", GgmlDType::Q5_0),
        ("Q5_1", GgmlDType::Q5_1),
        ("Q2_K", GgmlDType::Q2K),
        ("Q3_K", GgmlDType::Q3K),
        ("Q4_K", GgmlDType::Q4K),
        ("Q5_K", GgmlDType::Q5K),
        ("Q6_K", GgmlDType::Q6K),
    ];
    // Without an importance matrix, every type; with one, those that use it.
    let mut cases: Vec<(String, GgmlDType, Option<&[f32]>)> =
        types.iter().map(|(n, ty)| (n.to_string(), *ty, None)).collect();
    for (n, ty) in &types[2..] {
        cases.push((format!("{n}.imatrix"), *ty, Some(&importance)));
    }
    assert_eq!(content.tensor_infos.len(), cases.len() + 2, "a type in the fixture is not checked");
    for (name, ty, importance) in cases {
        let name = name.as_str();
        let theirs = content.tensor(&mut f, name, &Device::Cpu).unwrap();
        assert_eq!(theirs.dtype(), ty, "{name}");
        let theirs = theirs.data().unwrap();
        let ours = quants::quantize(ty, &x, importance).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}: size");
        let per_row = ours.len() / rows;
        for r in 0..rows {
            let (a, b) = (&ours[r * per_row..(r + 1) * per_row], &theirs[r * per_row..(r + 1) * per_row]);
            if let Some(i) = a.iter().zip(b).position(|(a, b)| a != b) {
                let block = i / ty.type_size();
                panic!(
                    "{name}: row {r} of {row} values differs from llama.cpp's at byte {i} (block {block}): {:?} vs {:?}",
                    &a[block * ty.type_size()..(block + 1) * ty.type_size()],
                    &b[block * ty.type_size()..(block + 1) * ty.type_size()]
                );
            }
        }
    }
    // The F32 "quantizer" is the values themselves; a row that is not whole blocks is refused.
    assert_eq!(
        quants::quantize(GgmlDType::F32, &x[..4], None).unwrap(),
        [&x[0].to_le_bytes()[..], &x[1].to_le_bytes(), &x[2].to_le_bytes(), &x[3].to_le_bytes()].concat()
    );
    assert!(quants::quantize(GgmlDType::Q4K, &x[..128], None).unwrap_err().contains("blocks of 256"));
    assert!(quants::quantize(GgmlDType::Q8K, &x[..256], None).unwrap_err().contains("does not write"));
    // Q8_0 ignores an importance matrix, as llama.cpp's does; one that is not whole rows of
    // whole blocks is refused.
    assert_eq!(
        quants::quantize(GgmlDType::Q8_0, &x, Some(&importance)).unwrap(),
        quants::quantize(GgmlDType::Q8_0, &x, None).unwrap()
    );
    assert!(quants::quantize(GgmlDType::Q4K, &x, Some(&importance[..128])).unwrap_err().contains("rows of whole"));
    assert!(quants::quantize(GgmlDType::Q4_0, &x[..96], Some(&importance[..64])).unwrap_err().contains("rows"));
}

/// Each GGUF file type gives every matrix the type llama.cpp's `llama-quantize` gives it, on
/// model shapes that reach its rules (tests/fixtures/quant/make_quant.py): Q6_K output layers and
/// tied embeddings, the `_M` mixes' value and down projections, `q4_k_s`'s first layers, the
/// "70B" value projections, and the fallbacks of rows that are not whole blocks.
#[test]
fn gguf_types_follow_llama_quantize() {
    use rtune::export::gguf::{target, tensor_types};
    use rtune::recipe::ExportFormat as F;
    let mixes: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(quant_fixture("mixes.json")).unwrap()).unwrap();
    let formats = [
        F::GgufF16,
        F::GgufQ8_0,
        F::GgufQ6K,
        F::GgufQ5KM,
        F::GgufQ5KS,
        F::GgufQ4KM,
        F::GgufQ4KS,
        F::GgufQ4_0,
        F::GgufQ3KL,
        F::GgufQ3KM,
        F::GgufQ3KS,
        F::GgufQ2K,
    ];
    let mut checked = 0;
    let cases = mixes["models"].as_object().unwrap().iter().flat_map(|(model, m)| {
        [("types", false), ("types_imatrix", true)].map(|(key, imatrix)| (model, m, key, imatrix))
    });
    for (model, m, key, imatrix) in cases {
        let raw: rtune::model::config::RawConfig = serde_json::from_value(m["config"].clone()).unwrap();
        let cfg = rtune::model::config::ModelConfig::from_raw(&raw).unwrap();
        let weights = cfg.tensors();
        assert_eq!(m[key].as_object().unwrap().len(), formats.len(), "{model}: a file type is not checked");
        for format in formats {
            let t = target(format).unwrap();
            let expected = &m[key][t.tag];
            let ours = tensor_types(&cfg, &weights, t, imatrix);
            let matrices: Vec<_> = ours.iter().filter(|x| weights[x.index].1.len() == 2).collect();
            assert_eq!(matrices.len() as u64, expected["matrices"].as_u64().unwrap(), "{model} {}", t.tag);
            for x in matrices {
                let want = expected["others"][&x.name].as_str().unwrap_or(expected["usual"].as_str().unwrap());
                let got = match format!("{:?}", x.ty) {
                    k if k.len() == 3 && k.ends_with('K') => format!("{}_K", &k[..2]),
                    other => other,
                };
                assert_eq!(got, want, "{model} {key} {}: {}", t.tag, x.name);
                if let Some(why) = &x.fallback {
                    assert!(why.starts_with(&format!("{}: ", x.name)) && why.contains("not a multiple"), "{why}");
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 10000, "{checked} tensors checked");
}

/// An importance matrix counts what every decoder linear reads, as transformers' forward of
/// the same LoRA model gives it (forward pre-hooks on the base layers,
/// `tests/fixtures/golden/make_golden.py --imatrix`): q, k and v the normed input, o the attention's
/// output, gate and up the normed residual, down the gated product — on Llama, Qwen2 (biases)
/// and Qwen3 (q/k norms, wide heads), each row run alone over its real tokens.
#[test]
fn imatrix_counts_what_each_linear_reads() {
    use rtune::export::gguf::{Imatrix, tensor_name};
    use rtune::export::merged::{Form, Merged};
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        let dir = fixture(name);
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("imatrix.json")).unwrap()).unwrap();
        let folder = ModelFolder::open(&dir.join("model")).unwrap();
        let merged = Merged::open(&folder, Some(&dir.join("adapter"))).unwrap();
        let rows: Vec<Vec<u32>> = serde_json::from_value(expected["rows"].clone()).unwrap();
        let batches: Vec<Batch> =
            rows.iter().map(|r| Batch::new(std::slice::from_ref(r), &[r.len()], None, &Device::Cpu).unwrap()).collect();
        let mut im = Imatrix::new("golden batch");
        let model = merged.streamed(Form::Adapter, &Device::Cpu).unwrap();
        model.observe(&batches, &mut |layer, linears, x| im.add(layer, linears, x)).unwrap();
        let sums = expected["sums"].as_object().unwrap();
        assert_eq!(im.len(), sums.len(), "{name}: every decoder linear, nothing else");
        assert_eq!(im.tokens(), rows.iter().map(Vec::len).sum::<usize>() as u64);
        for (hf, want) in sums {
            let gguf = tensor_name(&format!("{hf}.weight"), false).unwrap();
            let tokens = expected["tokens"][hf].as_f64().unwrap();
            let ours = im.importance(&gguf).unwrap();
            let want: Vec<f64> = want.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() / tokens).collect();
            assert_eq!(ours.len(), want.len(), "{name} {hf}");
            for (j, (a, b)) in ours.iter().zip(&want).enumerate() {
                let err = (*a as f64 - b).abs() / b.abs().max(1e-6);
                assert!(err < 1e-4, "{name} {hf} column {j}: {a} vs transformers' {b}");
            }
        }
    }
}

/// An importance matrix file is llama.cpp's (read back by rtune here; by llama.cpp's
/// llama-quantize in `scripts/interop/gguf-quant-check.py`): the metadata llama-imatrix writes, and each
/// matrix's sums and count.
#[test]
fn imatrix_file_reads_back() {
    use rtune::export::gguf::Imatrix;
    let dev = Device::Cpu;
    let mut im = Imatrix::new("some text");
    let a = Tensor::new(&[[[1f32, -2., 3.], [0.5, 0., -1.]]], &dev).unwrap();
    im.add(0, &[0, 1, 2], &a).unwrap();
    im.add(0, &[0, 1, 2], &a.affine(2.0, 0.0).unwrap()).unwrap();
    let b = Tensor::new(&[[4f32, 4.], [0., 2.], [1., 1.]], &dev).unwrap();
    im.add(1, &[6], &b).unwrap();
    assert_eq!(im.len(), 4);
    assert_eq!(im.tokens(), 4, "q/k/v read 4 tokens (2 rows twice), down 3");
    // (1 + 4) + (0.25 + 1) over 4 tokens for column 0.
    assert_eq!(im.importance("blk.0.attn_q.weight").unwrap(), [6.25 / 4.0, 20.0 / 4.0, 50.0 / 4.0]);
    assert_eq!(im.importance("blk.1.ffn_down.weight").unwrap(), [17.0 / 3.0, 21.0 / 3.0]);
    assert!(im.importance("blk.0.ffn_down.weight").is_none());
    // Columns that change between calls are an error, not a silent mix.
    assert!(im.add(1, &[6], &a).is_err());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("imatrix.gguf");
    im.write(&path).unwrap();
    let back = Imatrix::read(&path).unwrap();
    assert_eq!(back, im);
    let mut f = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    assert_eq!(content.metadata["general.type"].to_string().unwrap(), "imatrix");
    assert_eq!(content.metadata["imatrix.chunk_size"].to_u32().unwrap(), 512);
    let shape = content.tensor_infos["blk.0.attn_v.weight.in_sum2"].shape.dims().to_vec();
    assert_eq!(shape, [1, 3], "GGUF dims (3, 1): the sums of one matrix");
    // A GGUF that is not an importance matrix is refused.
    let err = Imatrix::read(&quant_fixture("blocks.gguf")).unwrap_err().to_string();
    assert!(err.contains("blocks.gguf"), "{err}");
}

/// llama.cpp's two imatrix formats, as its own llama-imatrix wrote the same matrix in each
/// (`tests/fixtures/quant/make_llama_imatrix.sh`): rtune reads both to the importance llama-quantize
/// computes from them (the GGUF's sums over its counts; the `.dat`'s means times chunks over its
/// chunks), the same within f32 rounding, with their dataset's name.
#[test]
fn llama_imatrix_files_read_alike() {
    use rtune::export::gguf::Imatrix;
    let gguf = Imatrix::read(&quant_fixture("llama-imatrix.gguf")).unwrap();
    let dat = Imatrix::read(&quant_fixture("llama-imatrix.dat")).unwrap();
    assert_eq!(gguf.len(), 14, "two layers of seven linears");
    assert_eq!(gguf.columns().collect::<Vec<_>>(), dat.columns().collect::<Vec<_>>());
    assert_eq!(
        (gguf.datasets.as_slice(), dat.datasets.as_slice()),
        (&["text.txt".to_string()][..], &["text.txt".to_string()][..])
    );
    assert_eq!(gguf.tokens(), 40 * 64, "40 chunks of 64 tokens");
    for (name, _) in gguf.columns() {
        let (a, b) = (gguf.importance(name).unwrap(), dat.importance(name).unwrap());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1e-12), "{name}: {x} vs {y}");
        }
        assert!(a.iter().all(|v| *v > 0.0), "{name}");
    }
    // rtune's own file of a legacy matrix reads back to the same importance, bit for bit.
    let dir = tempfile::tempdir().unwrap();
    dat.write(&dir.path().join("m.gguf")).unwrap();
    let again = Imatrix::read(&dir.path().join("m.gguf")).unwrap();
    for (name, _) in dat.columns() {
        assert_eq!(again.importance(name), dat.importance(name), "{name}");
    }
    // A file of neither format is refused with its path.
    std::fs::write(dir.path().join("junk.dat"), [7u8; 10]).unwrap();
    let err = Imatrix::read(&dir.path().join("junk.dat")).unwrap_err();
    assert!(format!("{err}").contains("junk.dat"), "{err}");
}

/// The fused CPU cross-entropy gives the composed version's loss and logits gradient.
#[test]
fn fused_cross_entropy_matches_the_composed_one() {
    use rtune::engine::candle::ops::{composed_cross_entropy, cross_entropy};
    let logits = Tensor::randn(0f32, 3.0, (37, 101), &Device::Cpu).unwrap();
    let targets = Tensor::new((0..37u32).map(|i| (i * 13) % 101).collect::<Vec<_>>().as_slice(), &Device::Cpu).unwrap();
    let (a, b) = (candle_core::Var::from_tensor(&logits).unwrap(), candle_core::Var::from_tensor(&logits).unwrap());
    let fused = cross_entropy(a.as_tensor(), &targets).unwrap();
    let composed = composed_cross_entropy(b.as_tensor(), &targets).unwrap();
    let (lf, lc) = (fused.to_scalar::<f32>().unwrap(), composed.to_scalar::<f32>().unwrap());
    assert!((lf - lc).abs() < 1e-5 * lc.abs(), "{lf} vs {lc}");
    let gf = fused.backward().unwrap().get(a.as_tensor()).unwrap().clone();
    let gc = composed.backward().unwrap().get(b.as_tensor()).unwrap().clone();
    let d = (gf - gc).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(d < 1e-6, "max |gradient difference| {d}");
    assert!(cross_entropy(&logits, &Tensor::new(&[500u32; 37], &Device::Cpu).unwrap()).is_err(), "targets are checked");
}

/// Gradients of `weight × loss` from candle's autograd, by parameter name.
fn autograd(
    model: &Transformer,
    batch: &Batch,
    select: &[u32],
    targets: &[u32],
    weight: f64,
    dropout: Option<u64>,
) -> (f64, BTreeMap<String, Tensor>) {
    let select = Tensor::new(select, &Device::Cpu).unwrap();
    let targets = Tensor::new(targets, &Device::Cpu).unwrap();
    let loss = model.loss(batch, &select, &targets, dropout).unwrap();
    let grads = (&loss * weight).unwrap().backward().unwrap();
    let by_name =
        model.params.iter().map(|p| (p.name.clone(), grads.get(p.var.as_tensor()).unwrap().clone())).collect();
    (loss.to_scalar::<f32>().unwrap() as f64, by_name)
}

/// The fused engine's loss and gradients equal candle autograd's to float rounding.
fn assert_fused_matches(model: &Transformer, batch: &Batch, select: &[u32], targets: &[u32], dropout: Option<u64>) {
    assert_eq!(rtune::engine::fused::unsupported(model), None);
    let weight = 0.75;
    let (want_loss, want) = autograd(model, batch, select, targets, weight, dropout);
    let (loss, got) =
        rtune::engine::fused::loss_and_grads(model, batch, select, targets, weight as f32, dropout).unwrap();
    assert!((loss - want_loss).abs() < 1e-5 * want_loss.abs().max(1.0), "loss {loss} vs autograd {want_loss}");
    let eval = rtune::engine::fused::loss(model, batch, select, targets).unwrap();
    let select_t = Tensor::new(select, &Device::Cpu).unwrap();
    let targets_t = Tensor::new(targets, &Device::Cpu).unwrap();
    let eval_want = model.loss(batch, &select_t, &targets_t, None).unwrap().to_scalar::<f32>().unwrap() as f64;
    assert!((eval - eval_want).abs() < 1e-5 * eval_want.abs().max(1.0), "eval loss {eval} vs {eval_want}");
    if dropout.is_some() {
        // The masks are in effect: the training loss differs from the evaluation loss.
        assert!((loss - eval).abs() > 1e-4, "dropout changed nothing ({loss} vs {eval})");
    }
    assert_eq!(got.len(), want.len());
    for (name, w) in &want {
        let w: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let g: Vec<f32> = got[name].flatten_all().unwrap().to_vec1().unwrap();
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{name}: zero gradient");
        let diff = w.iter().zip(&g).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 1e-4 * scale, "{name}: max difference {diff} (largest gradient {scale})");
    }
}

#[test]
fn fused_engine_matches_autograd_on_the_golden_models() {
    // Llama with llama3 rope scaling and GQA; Qwen2 with q/k/v biases and tied embeddings;
    // Qwen3 with head norms and wide heads; Gemma 2's and Gemma 3's layers (local windows shorter
    // than the rows; Gemma 2's tanh caps).
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3"] {
        let g = golden(name);
        let model = with_adapter(name);
        let batch = Batch::new(&g.rows, &g.lens, None, &Device::Cpu).unwrap();
        assert_fused_matches(&model, &batch, &g.select, &g.targets, None);
    }
}

#[test]
fn fused_engine_matches_autograd_with_packing_padding_dropout_and_lm_head() {
    // In row shards (one per thread; 3 rows split unevenly on 2 threads) with and without
    // dropout: masks are keyed by element, so shards draw what one pass would. Gemma 3's local
    // windows cut the packed documents too (and Gemma 2's caps bound their scores).
    for name in ["tiny-qwen2", "tiny-gemma2", "tiny-gemma3"] {
        for dropout in [0.1, 0.0] {
            packed_batch_matches(name, dropout);
        }
    }
}

/// Row 0: two packed documents; row 1: padded; row 2: one full document (tokens < 128), with
/// the selected positions and their targets.
fn packed_batch() -> (Batch, Vec<u32>, Vec<u32>) {
    let rows: Vec<Vec<u32>> = vec![
        (0..20).map(|i| (i * 7 + 3) % 128).collect(),
        (0..12).map(|i| (i * 5 + 1) % 128).chain([0; 8]).collect(),
        (0..20).map(|i| (i * 11 + 2) % 128).collect(),
    ];
    let lens = [20, 12, 20];
    let segs: Vec<Vec<u16>> = vec![(0..20).map(|i| (i >= 9) as u16).collect(), vec![0; 20], vec![0; 20]];
    let batch = Batch::new(&rows, &lens, Some(&segs), &Device::Cpu).unwrap();
    let (mut select, mut tgt) = (Vec::new(), Vec::new());
    for (r, row) in rows.iter().enumerate() {
        for j in 1..lens[r] {
            if segs[r][j] == segs[r][j - 1] && j % 3 != 0 {
                select.push((r * 20 + j - 1) as u32);
                tgt.push(row[j]);
            }
        }
    }
    (batch, select, tgt)
}

/// Base weights that train — in full, selectively, and beside an adapter — get autograd's loss
/// and every gradient from the fused engine: matrices, q/k/v biases, RMSNorm weights, the LM
/// head, the embedding (tied to the head in Qwen2, so its gradient sums both uses; packed rows
/// repeat tokens, whose rows sum), Qwen3's head norms, Gemma 3's four norms a layer (offsets from
/// one) and scaled embedding, in row shards and in one pass.
#[test]
fn fused_engine_matches_autograd_training_base_weights() {
    let (batch, select, tgt) = packed_batch();
    let patterns = |p: &[&str]| p.iter().map(|p| p.to_string()).collect::<Vec<_>>();
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"] {
        let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
        let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
        let adapter = fixture(name).join("adapter");
        let cases = [
            Trainable::weights(patterns(&["*"])),
            Trainable::weights(patterns(&[
                "*.input_layernorm.*",
                "*.1.self_attn.[qv]_proj.*",
                "*.0.self_attn.k_norm.*",
                "model.norm.weight",
                "lm_head.weight",
            ])),
            Trainable {
                lora: Some(peft::read_config(&adapter).unwrap()),
                weights: patterns(&["*norm*", "model.embed_tokens.weight", "lm_head.weight"]),
            },
        ];
        for trainable in cases {
            let model = Transformer::new(&folder.config, &weights, &trainable, &mut Rng::new(3)).unwrap();
            if trainable.lora.is_some() {
                model.load_adapters(&peft::read_weights(&adapter, &Device::Cpu).unwrap()).unwrap();
            }
            assert_fused_matches(&model, &batch, &select, &tgt, None);
            let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            one.install(|| assert_fused_matches(&model, &batch, &select, &tgt, None));
        }
    }
}

fn packed_batch_matches(name: &str, dropout: f64) {
    let folder = ModelFolder::open(&fixture(name).join("model")).unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    let targets: Vec<String> = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
        .map(String::from)
        .to_vec();
    let spec = rtune::model::LoraSpec { rank: 4, alpha: 8.0, rslora: false, dropout, targets };
    let model = Transformer::new(&folder.config, &weights, &Trainable::lora(spec), &mut Rng::new(3)).unwrap();
    // Random B matrices, so that every A gets a gradient.
    randomize(&model, 9);
    let (batch, select, tgt) = packed_batch();
    assert_fused_matches(&model, &batch, &select, &tgt, (dropout > 0.0).then_some(42));
    if dropout > 0.0 {
        // One pass over the whole batch draws the same masks as the shards.
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        one.install(|| assert_fused_matches(&model, &batch, &select, &tgt, Some(42)));
    }
}

/// A tiny model of tests/fixtures/gguf (made by make_spm_gguf.py, with a SentencePiece
/// `tokenizer.model` and transformers' tokenizer.json: `tiny-gemma3`, six layers with local
/// attention in five; `tiny-llama-spm`, Llama 2's tokenizer style) exported by rtune as an f32
/// GGUF.
fn spm_gguf(name: &str) -> (tempfile::TempDir, PathBuf, ModelFolder) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf").join(name);
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let folder = ModelFolder::open(dir.path()).unwrap();
    let path = dir.path().join("m.gguf");
    {
        let merged = rtune::export::merged::Merged::open(&folder, None).unwrap();
        rtune::export::gguf::write(&path, &merged, dir.path(), "t", rtune::recipe::ExportFormat::GgufF32, None, None)
            .unwrap();
    }
    (dir, path, folder)
}

fn gguf_fixture(name: &str, file: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf").join(name).join(file);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A GGUF metadata value as gguf-py's `contents()` gives it.
fn gguf_json(v: &candle_core::quantized::gguf_file::Value) -> serde_json::Value {
    use candle_core::quantized::gguf_file::Value as V;
    match v {
        V::U8(x) => (*x).into(),
        V::I8(x) => (*x).into(),
        V::U16(x) => (*x).into(),
        V::I16(x) => (*x).into(),
        V::U32(x) => (*x).into(),
        V::I32(x) => (*x).into(),
        V::U64(x) => (*x).into(),
        V::I64(x) => (*x).into(),
        V::F32(x) => f64::from(*x).into(),
        V::F64(x) => (*x).into(),
        V::Bool(x) => (*x).into(),
        V::String(x) => x.clone().into(),
        V::Array(a) => a.iter().map(gguf_json).collect(),
    }
}

/// rtune's GGUFs of a Gemma 3, a Gemma 2 and a Llama with Llama 2's SentencePiece tokenizer hold what
/// llama.cpp's own convert_hf_to_gguf.py writes of the same folders (converter.json): every
/// metadata key with its value — the SentencePiece pieces, scores and types, the special tokens,
/// Gemma's rotary bases, window and caps — and every tensor with its shape, type and bytes (Gemma's
/// norms stored as `1 + w`, Llama's q/k rows permuted), bit for bit. Only the converter's naming
/// guesses (`general.name`, `general.size_label`, `general.type`) are not compared.
#[test]
fn sentencepiece_ggufs_are_what_llama_cpps_converter_writes() {
    for fixture in ["tiny-gemma3", "tiny-gemma2", "tiny-llama-spm"] {
        converter_writes(fixture);
    }
}

fn converter_writes(fixture: &str) {
    use sha2::Digest;
    let (_dir, path, _) = spm_gguf(fixture);
    let reference = gguf_fixture(fixture, "converter.json");
    let bytes = std::fs::read(&path).unwrap();
    let mut f = std::io::Cursor::new(&bytes);
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let naming = ["general.name", "general.size_label", "general.type"];
    let theirs = reference["metadata"].as_object().unwrap();
    for (key, want) in theirs {
        if naming.contains(&key.as_str()) {
            continue;
        }
        let got = content.metadata.get(key).unwrap_or_else(|| panic!("{fixture}: rtune wrote no `{key}`"));
        assert_eq!(gguf_json(got), want["value"], "{fixture}: `{key}`");
    }
    for key in content.metadata.keys() {
        assert!(theirs.contains_key(key), "{fixture}: rtune wrote `{key}`, which the converter does not");
    }
    let tensors = reference["tensors"].as_array().unwrap();
    assert_eq!(content.tensor_infos.len(), tensors.len());
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        let info = &content.tensor_infos[name];
        let mut shape: Vec<usize> = info.shape.dims().to_vec();
        shape.reverse();
        assert_eq!(serde_json::json!(shape), t["shape"], "{fixture}: {name}");
        assert_eq!(format!("{:?}", info.ggml_dtype).to_uppercase(), t["type"].as_str().unwrap(), "{fixture}: {name}");
        let start = (content.tensor_data_offset + info.offset) as usize;
        let data = &bytes[start..start + info.shape.elem_count() * 4];
        let digest: String = sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(digest, t["sha256"].as_str().unwrap(), "{fixture}: {name}: its bytes differ from the converter's");
    }
}

/// The self-check's reading of a Gemma 3 and a Gemma 2 GGUF (llama.cpp's rules: the config from
/// the metadata and what llama.cpp hard-codes) computes the logits llama.cpp computes on the
/// converter's file of the same folder (llama_cpp.json, llama.cpp through llama-cpp-python) for a
/// sequence past the window, and those of rtune's model of the folder; and rtune's tokenizer (the
/// one training uses) splits text, special tokens and bytes as llama.cpp's SentencePiece
/// tokenizer does.
#[test]
fn gemma_ggufs_read_as_llama_cpp_computes_and_tokenizes() {
    for fixture in ["tiny-gemma3", "tiny-gemma2"] {
        gemma_reads_as_llama_cpp(fixture);
    }
}

fn gemma_reads_as_llama_cpp(fixture: &str) {
    let (_dir, path, folder) = spm_gguf(fixture);
    let expected = gguf_fixture(fixture, "llama_cpp.json");
    let model = rtune::export::gguf::read::GgufModel::open(&path, &folder.config, &Device::Cpu).unwrap();
    // The metadata holds the epsilon in f32, as llama.cpp computes with it.
    assert_eq!(model.config.rms_norm_eps, f64::from(folder.config.rms_norm_eps as f32));
    let read = rtune::model::ModelConfig { rms_norm_eps: folder.config.rms_norm_eps, ..model.config.clone() };
    assert_eq!(read, folder.config, "{fixture}: the config llama.cpp reads is the folder's");
    let ids: Vec<u32> = serde_json::from_value(expected["ids"].clone()).unwrap();
    let batch = Batch::new(std::slice::from_ref(&ids), &[ids.len()], None, &Device::Cpu).unwrap();
    let h = model.hidden(&[batch]).unwrap().remove(0).flatten_to(1).unwrap();
    let got: Vec<Vec<f32>> = model.logits(&h).unwrap().to_vec2().unwrap();
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    let ours = full_forward(
        &Transformer::new(&folder.config, &weights, &Trainable::nothing(), &mut Rng::new(0)).unwrap(),
        &ids,
    );
    // llama.cpp's CPU GELU reads a table of f16 values: its logits (up to ~14 here) are ~3e-3 off
    // transformers' at every position, the first too (make_gemma_gguf.py shows it); a misread
    // window, scale, norm or rotary base is off by far more.
    for (what, want, tolerance) in [
        ("llama.cpp", &expected["logits"]["llama_cpp"], 5e-3),
        ("transformers", &expected["logits"]["transformers"], 1e-4),
    ] {
        let want: Vec<Vec<f32>> = serde_json::from_value(want.clone()).unwrap();
        assert_eq!(want.len(), ids.len());
        for (j, (g, w)) in got.iter().zip(&want).enumerate() {
            let d = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d < tolerance, "{fixture}, position {j}: max |logit difference| from {what} {d}");
        }
    }
    let d = got.iter().flatten().zip(ours.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d < 1e-5, "{fixture}: the GGUF read back against rtune's model: {d}");
    tokenizes_as_llama_cpp(&folder, &expected);
}

/// rtune's tokenizer (the one training uses, on tokenizer.json) splits text as llama.cpp's
/// SentencePiece tokenizer does on the converter's GGUF (leading spaces, tabs and new lines,
/// digits, bytes, special tokens, with and without BOS).
fn tokenizes_as_llama_cpp(folder: &ModelFolder, expected: &serde_json::Value) {
    let tokenizer = folder.tokenizer().unwrap();
    for row in expected["tokenized"].as_array().unwrap() {
        let text = row["text"].as_str().unwrap();
        for (key, bos) in [("with_bos", true), ("without_bos", false)] {
            let want: Vec<u32> = serde_json::from_value(row[key]["llama_cpp"].clone()).unwrap();
            let got = tokenizer.encode(text, bos).unwrap().get_ids().to_vec();
            assert_eq!(got, want, "{key}: {text:?}");
        }
    }
}

/// The Llama with Llama 2's tokenizer: rtune's tokenizer splits as llama.cpp does on the
/// converter's file (the dummy prefix before text and after special tokens as SentencePiece
/// puts it), and candle's quantized Llama — the self-check's reader for Llama — computes
/// llama.cpp's logits from rtune's file.
#[test]
fn llama_sentencepiece_gguf_tokenizes_and_computes_as_llama_cpp() {
    let (_dir, path, folder) = spm_gguf("tiny-llama-spm");
    let expected = gguf_fixture("tiny-llama-spm", "llama_cpp.json");
    tokenizes_as_llama_cpp(&folder, &expected);
    let mut f = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut q =
        candle_transformers::models::quantized_llama::ModelWeights::from_gguf(content, &mut f, &Device::Cpu).unwrap();
    let ids: Vec<u32> = serde_json::from_value(expected["ids"].clone()).unwrap();
    let want: Vec<Vec<f32>> = serde_json::from_value(expected["logits"]["llama_cpp"].clone()).unwrap();
    for (j, id) in ids.iter().enumerate() {
        let x = Tensor::new(&[[*id]], &Device::Cpu).unwrap();
        let got: Vec<f32> = q.forward(&x, j).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let d = got.iter().zip(&want[j]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d < 1e-4, "position {j}: max |logit difference| from llama.cpp {d}");
    }
}

/// A GGUF llama.cpp would compute otherwise than the model is refused before anything is
/// written, saying why: Gemma whose attention scale is not the head size's (llama.cpp derives
/// it), Gemma 3 with score caps, and a SentencePiece tokenizer.json without its tokenizer.model
/// (the pieces' scores are not in tokenizer.json).
#[test]
fn ggufs_llama_cpp_would_misread_are_refused() {
    let why = |cfg: &rtune::model::ModelConfig, dir: &Path| match rtune::export::gguf::check(cfg, dir) {
        Err(e @ rtune::model::ModelError::NoGguf { .. }) => e.to_string(),
        other => panic!("not refused: {other:?}"),
    };
    let golden = ModelFolder::open(&fixture("tiny-gemma3").join("model")).unwrap();
    let e = why(&golden.config, &fixture("tiny-gemma3").join("model"));
    assert!(e.contains("1/√16") && e.contains("query_pre_attn_scalar") && e.contains("1/√12"), "{e}");
    let spm = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/tiny-gemma3");
    let gemma = ModelFolder::open(&spm).unwrap();
    rtune::export::gguf::check(&gemma.config, &spm).unwrap();
    let capped = rtune::model::ModelConfig { attn_softcap: Some(50.0), ..gemma.config.clone() };
    assert!(why(&capped, &spm).contains("no cap on attention scores"));
    let dir = tempfile::tempdir().unwrap();
    let src = spm.with_file_name("tiny-llama-spm");
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let llama = rtune::model::ModelConfig::from_raw(
        &serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap(),
    )
    .unwrap();
    assert!(why(&llama, dir.path()).contains("no tokenizer.model"));
}

/// An image-text Gemma 3 folder (`Gemma3ForConditionalGeneration`: Gemma 3 4B, 12B and 27B) is
/// its text model to rtune: config.json's `text_config` read with Gemma3TextConfig's defaults for
/// what it leaves out (as the Hub's are written), the tensors under `language_model.`, the vision
/// tower set aside. Its logits are transformers' text-only logits; a PEFT adapter on the text
/// model (targets as the regular expression rtune writes) reads back and computes as PEFT does,
/// and rtune writes that adapter under PEFT's names. tests/fixtures/gemma3-mm/make.py.
#[test]
fn an_image_text_gemma3_folder_is_its_text_model_as_transformers_and_peft_compute_it() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma3-mm");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let folder = ModelFolder::open(&dir).unwrap();
    assert_eq!(folder.layout, rtune::model::Layout::Gemma3Multimodal);
    let c = &folder.config;
    assert_eq!((c.arch, c.num_layers, c.vocab_size, c.head_dim), (rtune::recipe::Arch::Gemma3, 6, 512, 16));
    assert_eq!((c.max_position_embeddings, c.rms_norm_eps, c.tie_word_embeddings), (131072, 1e-6, true));
    assert_eq!(c.eos_token_ids, [1, 106], "the outer config's EOS, as the Hub's Gemma 3 4B has it");
    assert_eq!(c.rope_scaling.as_ref().and_then(|r| r.factor), Some(8.0));
    let local = c.local_attention.as_ref().unwrap();
    assert_eq!(
        (local.window, local.rope_theta, &local.layers[..]),
        (4, 10000.0, &[true, true, true, true, true, false][..])
    );
    let stored = folder.stored().unwrap();
    let others: Vec<&str> = stored.others().collect();
    assert_eq!(stored.len() + others.len(), expected["tensors"].as_u64().unwrap() as usize);
    assert!(
        others.iter().all(|n| n.starts_with("vision_tower.") || n.starts_with("multi_modal_projector.")),
        "{others:?}"
    );
    assert!(stored.contains("model.layers.5.self_attn.q_proj.weight") && !stored.contains("lm_head.weight"));

    let ids: Vec<u32> = serde_json::from_value(expected["ids"].clone()).unwrap();
    let close = |got: &[Vec<f32>], key: &str| {
        let want: Vec<Vec<f32>> = serde_json::from_value(expected[key].clone()).unwrap();
        let d = got.iter().flatten().zip(want.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d < 1e-4, "{key}: max |logit difference| from transformers {d}");
    };
    let weights = folder.load_weights(&Device::Cpu, DType::F32).unwrap();
    let base = Transformer::new(c, &weights, &Trainable::nothing(), &mut Rng::new(0)).unwrap();
    close(&full_forward(&base, &ids), "logits");

    let adapter = dir.join("peft");
    let spec = peft::read_config(&adapter).unwrap();
    assert_eq!(spec.targets, ["gate_proj", "q_proj", "v_proj"]);
    let tuned = Transformer::new(c, &weights, &Trainable::lora(spec.clone()), &mut Rng::new(0)).unwrap();
    let read = peft::read_weights(&adapter, &Device::Cpu).unwrap();
    assert!(read.keys().all(|k| k.starts_with("base_model.model.model.layers.")), "rtune's names in memory");
    tuned.load_params(&read).unwrap();
    close(&full_forward(&tuned, &ids), "peft_logits");

    let out = tempfile::tempdir().unwrap();
    peft::write(out.path(), &spec, &read, "gemma3-mm", &folder).unwrap();
    let written = candle_core::safetensors::load(out.path().join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    let keys: std::collections::BTreeSet<&String> = written.keys().collect();
    let want: Vec<String> = serde_json::from_value(expected["peft_keys"].clone()).unwrap();
    assert_eq!(keys, want.iter().collect(), "PEFT's names for the text model's modules");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("adapter_config.json")).unwrap()).unwrap();
    let theirs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap()).unwrap();
    let (ours, peft_re) = (config["target_modules"].as_str().unwrap(), theirs["target_modules"].as_str().unwrap());
    let sorted = |re: &str| {
        let (head, names) = re.rsplit_once('(').unwrap();
        let mut names: Vec<&str> = names.trim_end_matches(')').split('|').collect();
        names.sort();
        format!("{head}({})", names.join("|"))
    };
    assert_eq!(sorted(ours), sorted(peft_re), "the vision tower's q/v projections stay untargeted");
}
