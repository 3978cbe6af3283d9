//! From a recipe's stage to its key: settings typed with defaults and `[device.<name>]`
//! overrides, the device where numbers depend on it, sources resolved (see [`super::key`]).

use serde_json::Value;

use super::key::{self, StageKey};
use super::sources::{dataset_source, hub_sources, loader_settings, local_source, local_split, resolve_hub};
use crate::device::Resolution;
use crate::hub::HubEnv;
use crate::recipe::{ExportFormat, LoadedRecipe, Problem, Settled, StageSettings, StageSpec};
use crate::switches::Switches;

/// A stage's key: its settings with defaults applied and `[device.<name>]` overrides merged,
/// the device where its numbers depend on it, and its sources resolved to digests and commits.
pub(super) fn resolve_key(
    spec: &StageSpec,
    loaded: &LoadedRecipe,
    device: &Resolution,
    hub: &HubEnv,
    locked_sources: Option<&Value>,
) -> Result<StageKey, Problem> {
    use key::*;
    let recipe = &loaded.recipe;
    let overrides = device.override_names();
    let settled = settled(spec, loaded, &overrides)?;
    let seed = recipe.recipe.seed;
    let m = &recipe.model;
    let d = &recipe.dataset;
    // The base model as the exports and the card name it: the Hub id, else the recipe's path.
    let base_named = || m.repo.clone().or_else(|| m.path.clone());
    // Chat rows' keys name how rtune renders templates (tokenize, evaluate's own data, a scratch corpus).
    let chat_rendering = (d.format == crate::recipe::DataFormat::Chat).then_some(key::CHAT_RENDERING);
    let rendering = || Rendering {
        format: d.format,
        column_map: d.column_map.clone(),
        chat_template: d.chat_template.clone(),
        chat_template_kwargs: d.chat_template_kwargs.clone(),
        chat_rendering,
        max_seq_len: d.max_seq_len,
        truncate: d.truncate,
        train_on_prompt: d.train_on_prompt,
        skip_bad_rows: d.skip_bad_rows,
    };
    let on_device = |engine_matters: bool| DeviceKey {
        class: device.class,
        dtype: device.dtype,
        tf32: recipe.device.tf32 && device.class == crate::device::DeviceClass::Cuda,
        engine: if engine_matters { Switches::get().engine.clone() } else { None },
        kernels: if engine_matters { Switches::get().kernels(device.class) } else { Vec::new() },
        ordinal: device.ordinal,
        peers: Vec::new(),
    };
    Ok(match settled.settings {
        StageSettings::Download(_) => {
            let model = match (&m.scratch, &m.path, &m.repo) {
                // The tokenizer is trained on the dataset's rows rendered with its format and
                // column map, so those shape this artifact too.
                (Some(s), _, _) => ModelKey::Scratch {
                    scratch: s.clone(),
                    seed,
                    vocab_from: "dataset",
                    corpus: Box::new(Corpus {
                        format: d.format,
                        column_map: d.column_map.clone(),
                        split: train_split(loaded),
                        config: d.config.clone(),
                        reading: loader_settings(d),
                        chat_rendering,
                    }),
                },
                (_, Some(_), _) => ModelKey::Path { path: BY_CONTENT },
                (_, _, Some(r)) => {
                    ModelKey::Repo { repo: r.clone(), revision: m.revision.clone().unwrap_or_else(|| "main".into()) }
                }
                _ => return Err(Problem::new("rtune::recipe::no_model", "the recipe names no model")),
            };
            let dataset = match &d.repo {
                Some(r) => DatasetKey::Repo { repo: r.clone(), config: d.config.clone() },
                None => DatasetKey::Path { path: BY_CONTENT },
            };
            let mut sources = Sources::default();
            if let Some(p) = &m.path {
                sources.model = Some(local_source(loaded, "model", p, &["model", "path"])?);
            }
            if let Some(p) = &d.path {
                sources.dataset = Some(dataset_source(loaded, p, &["dataset", "path"])?);
            }
            for (name, source) in hub_sources(loaded) {
                let commit = resolve_hub(loaded, hub, &source, locked_sources.and_then(|p| p.get(name)))?;
                let slot = if name == "model" { &mut sources.model } else { &mut sources.dataset };
                *slot = Some(Source::Hub { source, commit });
            }
            StageKey::Download(DownloadKey { settings: DownloadSettings { model, dataset }, sources })
        }
        StageSettings::Tokenize(_) => StageKey::Tokenize(TokenizeKey {
            settings: TokenizeSettings {
                rendering: rendering(),
                eval_fraction: d.eval_fraction,
                split: train_split(loaded),
                eval_split: d.eval_split.clone(),
                config: d.config.clone(),
                reading: loader_settings(d),
                packing: d.packing,
                seed,
            },
        }),
        StageSettings::Train(train) => StageKey::Train(TrainKey {
            settings: TrainKeySettings { train, adapter: recipe.adapter.clone(), seed },
            // Training and evaluation share their batches between GPUs (`device.gpus`).
            device: DeviceKey { peers: device.peers.clone(), ..on_device(true) },
        }),
        StageSettings::Evaluate(mut evaluate) => {
            // With its own dataset, the stage tokenizes it: how rows become tokens is part of
            // its output, and so is the file's content (and for a folder, the split it reads).
            let (data, sources) = match &evaluate.dataset {
                Some(rel) => {
                    let at = ["stages", spec.name.as_str(), "dataset"];
                    let own = dataset_source(loaded, rel, &at)?;
                    let split_at = ["stages", spec.name.as_str(), "split"];
                    let config_at = ["stages", spec.name.as_str(), "config"];
                    evaluate.split = local_split(
                        loaded,
                        rel,
                        &at,
                        (evaluate.split.as_deref(), &split_at),
                        (evaluate.config.as_deref(), &config_at),
                    )?;
                    (Some(rendering()), Some(Sources { dataset: Some(own), ..Sources::default() }))
                }
                None => (None, None),
            };
            StageKey::Evaluate(EvaluateKey {
                settings: EvaluateKeySettings {
                    prompt_template: (d.format == crate::recipe::DataFormat::Chat && !evaluate.prompts.is_empty())
                        .then(|| Template {
                            format: d.format,
                            chat_template: d.chat_template.clone(),
                            chat_template_kwargs: d.chat_template_kwargs.clone(),
                        }),
                    evaluate,
                    data,
                    prompt_format: d.format,
                    base_quant: recipe.adapter.quantize_base,
                    seed,
                },
                device: DeviceKey { peers: device.peers.clone(), ..on_device(true) },
                sources,
            })
        }
        StageSettings::Quantize(mut quantize) => {
            let explicit = settled.written.contains("formats");
            // The default formats export a PEFT folder only where an adapter trains (`plan`
            // refuses `peft-adapter` asked for without one).
            if !explicit && super::trained_from(spec, loaded, &overrides).is_some_and(|t| !t.adapter) {
                quantize.formats.retain(|f| *f != ExportFormat::PeftAdapter);
            }
            // Older names export (and hash) as the format they stand for, once.
            let mut seen = std::collections::BTreeSet::new();
            quantize.formats = quantize.formats.iter().map(|f| f.canonical()).filter(|f| seen.insert(*f)).collect();
            // An importance matrix file counts by content, not by where it lies.
            let sources = match quantize.imatrix_file.as_mut() {
                Some(rel) => {
                    let at = ["stages", spec.name.as_str(), "imatrix_file"];
                    let file = local_source(loaded, "importance matrix", rel, &at)?;
                    *rel = super::key::BY_CONTENT.to_string();
                    Some(Sources { imatrix: Some(file), ..Sources::default() })
                }
                None => None,
            };
            StageKey::Quantize(QuantizeKey {
                settings: QuantizeKeySettings {
                    quantize,
                    adapter: recipe.adapter.clone(),
                    name: recipe.recipe.name.clone(),
                    base_name: base_named().unwrap_or_default(),
                    template: Template {
                        format: d.format,
                        chat_template: d.chat_template.clone(),
                        chat_template_kwargs: std::collections::BTreeMap::new(),
                    },
                },
                // Exports are computed in f32 with candle, whatever dtype and engine trained;
                // candle has no Vulkan backend, so a Vulkan run merges on the CPU.
                device: {
                    let merge = DeviceKey { dtype: crate::recipe::Dtype::F32, tf32: false, ..on_device(false) };
                    match merge.class {
                        crate::device::DeviceClass::Vulkan => {
                            DeviceKey { class: crate::device::DeviceClass::Cpu, ordinal: 0, ..merge }
                        }
                        _ => merge,
                    }
                },
                sources,
            })
        }
        StageSettings::Upload(upload) => {
            let recipe_file = match &loaded.source {
                crate::recipe::RecipeSource::File(p) => {
                    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| loaded.name())
                }
                crate::recipe::RecipeSource::Builtin(b) => b.name.to_string(),
            };
            let card = Card {
                name: recipe.recipe.name.clone(),
                description: recipe.recipe.description.clone(),
                recipe_text: RecipeText(loaded.text.clone()),
                recipe_file,
                overrides: loaded.overrides.clone(),
                base: base_named().unwrap_or_else(|| "a scratch model".into()),
                base_repo: m.repo.clone(),
                dataset_repo: d.repo.clone(),
                // Whether the exports' train stage trained an adapter (not base weights).
                lora: spec
                    .inputs(&loaded.stages)
                    .get(&crate::recipe::stages::Port::Exports)
                    .and_then(|q| super::trained_from(q, loaded, &overrides))
                    .map_or(recipe.adapter.kind != crate::recipe::AdapterKind::None, |t| t.adapter),
                qlora: None,
            };
            let card = Card { qlora: recipe.adapter.quantize_base.filter(|_| card.lora), ..card };
            let dir = upload.to.strip_prefix("dir://").map(|rel| loaded.resolve_path(rel));
            // A file where the folder would go: said now, not after every stage before it ran.
            if let Some(d) = dir.as_ref().filter(|d| d.exists() && !d.is_dir()) {
                return Err(Problem::new(
                    "rtune::plan::bad_destination",
                    format!("`{}` is a file, not a folder to upload into", d.display()),
                )
                .at(loaded.origin(&["stages", spec.name.as_str(), "to"]), "names a file")
                .help("name a folder (it is created if missing), or move the file"));
            }
            StageKey::Upload(UploadKey { settings: UploadKeySettings { upload, card }, dir })
        }
    })
}

/// The split that trains: `dataset.split` (default `train`) for a Hub or folder dataset; None for
/// a single file, which is one split.
pub(super) fn train_split(loaded: &LoadedRecipe) -> Option<String> {
    let d = &loaded.recipe.dataset;
    let file = d.repo.is_none() && d.path.as_ref().is_some_and(|p| !loaded.resolve_path(p).is_dir());
    (!file).then(|| d.split.clone().unwrap_or_else(|| "train".into()))
}

/// A stage's settings with the `[device.<name>.<stage>]` tables of `overrides` merged over its
/// own, in order (a device's `override_names`: the broadest name first; none: as written).
pub(super) fn settled(spec: &StageSpec, loaded: &LoadedRecipe, overrides: &[String]) -> Result<Settled, Problem> {
    // Each table was typed alone when the recipe loaded; only a device matching several of
    // them can meet a combination that does not fit.
    spec.on(overrides).map_err(|e| {
        let tables: Vec<String> = overrides.iter().map(|d| format!("`[device.{d}]`")).collect();
        Problem::new(
            "rtune::plan::settings",
            format!("stage `{}` with the overrides of {}: {e}", spec.name, tables.join(" and ")),
        )
        .at(loaded.origin(&["stages", &spec.name]), "in this stage")
    })
}

/// Where a stage's setting `key` is written: the last of `overrides` that sets it, else the
/// stage itself.
pub(super) fn setting_origin<'a>(
    spec: &StageSpec,
    loaded: &'a LoadedRecipe,
    overrides: &[String],
    key: &str,
) -> Option<&'a crate::recipe::Origin> {
    overrides
        .iter()
        .rev()
        .find_map(|dev| loaded.origin(&["device", dev, &spec.name, key]))
        .or_else(|| loaded.origin(&["stages", &spec.name, key]))
}
