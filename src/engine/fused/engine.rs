//! The fused CPU engine as an [`Engine`]: built from the model folder and the architecture spec
//! (not from candle's model), its weights f32 tensors by Hugging Face name, the trained ones
//! candle variables stepped by [`Params`] exactly as candle's engine steps its own.

use std::borrow::Cow;
use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};

use super::{FEATURES, LinearInfo, View, loss_and_grads_of, run, run_with};
use crate::engine::candle::ops::rope_tables;
use crate::engine::params::{Param, Params, load_params, new_adapter};
use crate::engine::{Engine, EngineError, EngineState, HostBatch, Setup};
use crate::model::{Batch, LAYER_LINEARS, ModelError, Spec};
use crate::rng::Rng;

pub struct FusedEngine {
    spec: Spec,
    /// Every tensor the passes read, by name: frozen weights, and the trained ones' and the
    /// adapters' variables (the tensors [`Params`] steps).
    tensors: BTreeMap<String, Tensor>,
    linears: Vec<LinearInfo>,
    /// cos/sin of each of the spec's rotary tables, `[positions, head_dim]`.
    ropes: Vec<(Tensor, Tensor)>,
    params: Params,
}

fn cerr(context: &str) -> impl FnOnce(candle_core::Error) -> EngineError + '_ {
    EngineError::candle(context)
}

impl FusedEngine {
    /// The engine for `setup` (on the CPU, in f32): the folder's weights with what its train
    /// stage replaced, LoRA adapters created as PEFT initialises them (one generator seeded from
    /// `setup.seed`, linear by linear as every engine does) or loaded from the train stage.
    pub fn build(setup: &Setup<'_>) -> Result<FusedEngine, EngineError> {
        let cfg = &setup.folder.config;
        let spec = Spec::of(cfg);
        if let Some(why) = spec.unsupported("fused CPU engine", FEATURES) {
            return Err(EngineError::Unsupported(why));
        }
        let (mut weights, adapters) = crate::engine::start_weights(setup, &Device::Cpu)?;
        let trainable = &setup.trainable;
        let (mut tensors, mut list) = (BTreeMap::new(), Vec::new());
        for (name, shape) in cfg.tensors() {
            let t = weights.remove(&name).ok_or_else(|| ModelError::MissingTensor { name: name.clone() })?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::ShapeMismatch { name, expected: shape, found: t.dims().to_vec() }.into());
            }
            let t = t.to_dtype(DType::F32).and_then(|t| t.contiguous()).map_err(cerr("read a weight"))?;
            if trainable.trains_weight(&name) {
                let var = Var::from_tensor(&t).map_err(cerr("make a weight trainable"))?;
                tensors.insert(name.clone(), var.as_tensor().clone());
                list.push(Param { name, var });
            } else {
                tensors.insert(name, t);
            }
        }
        if !trainable.weights.is_empty() && list.is_empty() {
            return Err(crate::engine::no_weight_matches(&trainable.weights));
        }
        let embed = "model.embed_tokens.weight";
        let mut rng = Rng::derive(setup.seed, "lora-init");
        let mut linears = Vec::new();
        let layers = (0..cfg.num_layers).flat_map(|i| {
            LAYER_LINEARS
                .iter()
                .zip(cfg.layer_linears())
                .map(move |(m, shape)| (format!("model.layers.{i}.{m}"), shape))
        });
        let head = ("lm_head".to_string(), (cfg.hidden_size, cfg.vocab_size, false));
        for (id, (name, (inp, out, bias))) in layers.chain(std::iter::once(head)).enumerate() {
            let weight = match name.as_str() {
                "lm_head" if cfg.tie_word_embeddings => embed.to_string(),
                _ => format!("{name}.weight"),
            };
            let lora = match trainable.adapter_for(&name, &weight, bias)? {
                Some(lora) => {
                    let params = new_adapter(lora, &name, (inp, out), DType::F32, &Device::Cpu, &mut rng)
                        .map_err(cerr(&format!("create LoRA adapter for `{name}`")))?;
                    for p in &params {
                        tensors.insert(p.name.clone(), p.var.as_tensor().clone());
                    }
                    list.extend(params);
                    Some((lora.rank, lora.scale(), lora.dropout))
                }
                None => None,
            };
            let bias = bias.then(|| format!("{name}.bias"));
            linears.push(LinearInfo { name, weight, bias, id, inp, out, lora });
        }
        if let (Some(_), Some(saved)) = (&trainable.lora, &adapters) {
            load_params(&list, saved, crate::model::lora::is_adapter_param)?;
        }
        let ropes = spec
            .ropes
            .iter()
            .map(|r| rope_tables(r, cfg.head_dim, cfg.max_position_embeddings, &Device::Cpu, DType::F32))
            .collect::<candle_core::Result<_>>()
            .map_err(cerr("rotary tables"))?;
        let params = Params::new(list, setup.optimizer, setup.ema_decay);
        Ok(FusedEngine { spec, tensors, linears, ropes, params })
    }

    /// What the passes read, borrowed from this engine.
    fn view(&self) -> View<'_> {
        View {
            spec: &self.spec,
            tensors: self.tensors.iter().map(|(k, v)| (k.clone(), v)).collect(),
            linears: Cow::Borrowed(&self.linears),
            ropes: &self.ropes,
            trained: self.params.list.iter().map(|p| p.name.clone()).collect(),
        }
    }
}

fn host_batch(b: &HostBatch) -> Result<Batch, EngineError> {
    Batch::from_layout(&b.ids, b.b, b.t, &b.layout, &Device::Cpu).map_err(cerr("build a batch"))
}

impl Engine for FusedEngine {
    fn describe(&self) -> String {
        "fused CPU engine".into()
    }

    fn trained_count(&self) -> usize {
        self.params.count()
    }

    fn accumulate(
        &mut self,
        b: &HostBatch,
        weight: f64,
        loss_scale: f64,
        dropout: Option<u64>,
    ) -> Result<(), EngineError> {
        let batch = host_batch(b)?;
        let grad_weight = (weight * loss_scale) as f32;
        let (loss, g) = loss_and_grads_of(&self.view(), &batch, &b.select, &b.targets, grad_weight, dropout)
            .map_err(cerr("forward and backward pass"))?;
        self.params.add(loss, weight, g)
    }

    fn gradients(&mut self) -> Result<(f64, f64), EngineError> {
        self.params.gradients()
    }

    fn apply(&mut self, lr: f64, grad_scale: f64) -> Result<(), EngineError> {
        self.params.apply(lr, grad_scale)
    }

    fn discard(&mut self) -> Result<(), EngineError> {
        self.params.discard();
        Ok(())
    }

    fn loss(&mut self, b: &HostBatch) -> Result<f64, EngineError> {
        let batch = host_batch(b)?;
        Ok(run(&self.view(), &batch, &b.select, &b.targets, None).map_err(cerr("evaluate"))?.0)
    }

    /// The whole sequence each call (no cache of keys and values, as the GPU engine).
    fn next_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        if ids.is_empty() {
            return Err(EngineError::Unsupported("generation needs at least one prompt token".into()));
        }
        let t = ids.len();
        let batch = Batch::new(&[ids.to_vec()], &[t], None, &Device::Cpu).map_err(cerr("generate"))?;
        let mut logits = Vec::with_capacity(self.spec.vocab);
        let last = [t as u32 - 1];
        run_with(&self.view(), &batch, &last, &[0], None, Some(&mut logits)).map_err(cerr("generate"))?;
        Ok(logits)
    }

    fn state(&self) -> Result<EngineState, EngineError> {
        self.params.state()
    }

    fn restore(&mut self, s: &EngineState) -> Result<(), EngineError> {
        self.params.restore(s, &Device::Cpu)
    }

    fn gradient_values(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        Ok(self.params.gradient_values())
    }

    fn trained(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        self.params.trained()
    }
}
