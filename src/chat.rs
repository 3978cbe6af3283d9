//! `rtune chat`'s conversation: a model (a recipe's trained result, or a model folder) on an
//! engine, the chat template it trained with, and the turns so far. Each reply renders the whole
//! conversation with the template and its generation prompt, tokenizes it as training tokenized
//! its rows, and generates ([`crate::generate`]) until the turn's end token, EOS or the limit;
//! engines that keep keys and values (candle's) reuse them across turns.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::data::chat::{ChatTemplate, Shipped};
use crate::engine::Engine;
use crate::generate::{Sampling, Stop, generate};
use crate::model::ModelFolder;
use crate::plan::key::DeviceKey;
use crate::recipe::{DataFormat, Problem};
use crate::rng::Rng;

/// What to talk to.
pub struct Model {
    pub folder: ModelFolder,
    /// The train stage's output (a PEFT adapter, or trained weights) over `folder`.
    pub trained: Option<PathBuf>,
    pub device: DeviceKey,
    pub base_quant: Option<crate::recipe::BaseQuant>,
    /// The data format it trained on and `dataset.chat_template`: which template it speaks.
    pub format: DataFormat,
    pub chat_template: Option<String>,
    pub chat_template_kwargs: std::collections::BTreeMap<String, Value>,
    /// For people: `train stage `train` of recipe `x` (5cc9164a…)`.
    pub described: String,
}

/// One reply.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Reply {
    pub text: String,
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub stop: Stop,
}

pub struct Chat {
    engine: Box<dyn Engine>,
    tokenizer: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    /// Where the template came from (`the Alpaca prompt …`), or None for plain text.
    pub origin: Option<String>,
    /// BOS before a plain-text prompt, as `text` rows start.
    bos: Option<u32>,
    stops: Vec<u32>,
    limit: usize,
    system: Option<String>,
    messages: Vec<Value>,
}

fn problem(message: impl Into<String>) -> Problem {
    Problem::new("rtune::chat", message)
}

impl Chat {
    /// Open `model` on its device, with `system` as the conversation's first turn.
    pub fn open(model: &Model, system: Option<String>) -> Result<Chat, Problem> {
        let folder = &model.folder;
        let tokenizer = folder.tokenizer().map_err(|e| problem(format!("{e}")))?;
        let shipped: Option<Shipped> =
            crate::data::chat::shipped(folder, model.format, model.chat_template.as_deref(), &tokenizer)
                .map_err(|e| problem(format!("{e}")))?;
        let (template, origin, turn_end) = match shipped {
            Some(s) => {
                (Some(s.template.with_kwargs(&model.chat_template_kwargs)), Some(s.origin), s.turn_end.map(|t| t.1))
            }
            None => (None, None, None),
        };
        if template.is_none() && system.is_some() {
            return Err(problem("this model has no chat template, so it cannot take a system prompt")
                .help("it trained on `text` rows: each prompt is continued as it is; leave out `--system`"));
        }
        let limit = folder.config.max_positions();
        let engine = crate::stage::eval_engine(
            &model.device,
            folder,
            model.trained.as_deref(),
            model.base_quant,
            1,
            limit.min(8192),
        )
        .map_err(|e| problem(format!("cannot open the model on {}: {e}", model.device.resolution().device_name())))?;
        let mut stops = folder.config.eos_token_ids.clone();
        stops.extend(turn_end);
        let bos = folder.row_bos(&tokenizer);
        let mut chat = Chat { engine, tokenizer, template, origin, bos, stops, limit, system, messages: Vec::new() };
        chat.reset();
        Ok(chat)
    }

    /// Forget the turns (the system prompt stays).
    pub fn reset(&mut self) {
        self.messages.clear();
        if let Some(s) = &self.system {
            self.messages.push(json!({"role": "system", "content": s}));
        }
    }

    /// The engine, for people (`fused CPU engine, f32`).
    pub fn engine(&self) -> String {
        self.engine.describe()
    }

    /// The prompt's tokens for the conversation so far plus `user`, as the model trained on them.
    fn prompt(&self, user: &str) -> Result<(Vec<u32>, Vec<Value>), Problem> {
        let mut messages = self.messages.clone();
        messages.push(json!({"role": "user", "content": user}));
        let (text, bos) = match &self.template {
            Some(t) => (t.render(&messages, true).map_err(|e| problem(format!("the chat template: {e}")))?, None),
            None => (user.to_string(), self.bos),
        };
        let enc = self.tokenizer.encode(text.as_str(), false).map_err(|e| problem(format!("tokenizer: {e}")))?;
        let mut ids: Vec<u32> = bos.into_iter().collect();
        ids.extend(enc.get_ids());
        Ok((ids, messages))
    }

    /// The model's reply to `user`, streamed to `on_text` piece by piece as it is decoded; the
    /// turn is kept for the next reply.
    pub fn reply(
        &mut self,
        user: &str,
        s: &Sampling,
        rng: &mut Rng,
        mut on_text: impl FnMut(&str),
    ) -> Result<Reply, Problem> {
        let (ids, mut messages) = self.prompt(user)?;
        if ids.len() >= self.limit {
            return Err(problem(format!(
                "the conversation is {} tokens, and the model reads at most {}",
                ids.len(),
                self.limit
            ))
            .help("start over with `/reset` (or a shorter prompt)"));
        }
        let tokenizer = &self.tokenizer;
        let mut shown = String::new();
        let (tokens, stop) = generate(&mut *self.engine, &ids, s, &self.stops, self.limit, rng, |out| {
            // Print what decodes to whole characters; a token may end inside one.
            if let Ok(text) = tokenizer.decode(out, true)
                && text.len() > shown.len()
                && text.starts_with(shown.as_str())
                && !text.ends_with('\u{FFFD}')
            {
                on_text(&text[shown.len()..]);
                shown = text;
            }
        })
        .map_err(|e| problem(format!("generation failed: {e}")))?;
        let text = tokenizer.decode(&tokens, true).map_err(|e| problem(format!("tokenizer: {e}")))?;
        if text.len() > shown.len() && text.starts_with(shown.as_str()) {
            on_text(&text[shown.len()..]);
        }
        messages.push(json!({"role": "assistant", "content": text}));
        if self.template.is_some() {
            self.messages = messages;
        }
        Ok(Reply { text, tokens, prompt_tokens: ids.len(), stop })
    }
}

/// The model of a recipe's train stage (`stage`, or its only one), as `rtune run` built it, on
/// the device the plan picks; an error says what to run first.
pub fn from_plan(
    loaded: &crate::recipe::LoadedRecipe,
    plan: &crate::plan::Plan,
    store: &crate::store::Store,
    stage: Option<&str>,
    base: bool,
) -> Result<Model, Problem> {
    use crate::plan::key::StageKey;
    let trains: Vec<_> = plan.stages.iter().filter(|s| matches!(s.key, StageKey::Train(_))).collect();
    let s = match stage {
        Some(name) => {
            let s = plan.stage(name).ok_or_else(|| crate::plan::unknown_stage(loaded, name))?;
            if !matches!(s.key, StageKey::Train(_)) {
                return Err(problem(format!(
                    "stage `{name}` is not a train stage; chat talks to what a train stage made"
                ))
                .help(format!(
                    "train stages: {}",
                    trains.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
                )));
            }
            s
        }
        None => match trains.as_slice() {
            [one] => *one,
            [] => {
                return Err(
                    problem(format!("recipe `{}` has no train stage", plan.recipe)).help("give a model folder instead")
                );
            }
            _ => {
                return Err(problem(format!("recipe `{}` has several train stages", plan.recipe)).help(format!(
                    "pick one with `--stage`: {}",
                    trains.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
                )));
            }
        },
    };
    let StageKey::Train(key) = &s.key else { unreachable!("a train stage") };
    let not_built = |what: &str| {
        problem(format!("{what} is not built yet"))
            .help(format!("run `rtune run {}` first", loaded.source.display_name()))
    };
    let model_fp = s.inputs.get("model").ok_or_else(|| problem("the train stage has no model input"))?;
    if store.manifest(model_fp).is_none() {
        return Err(not_built("the model (stage `download`)"));
    }
    if !base && !matches!(s.action, crate::plan::Action::Cached) {
        return Err(not_built(&format!("stage `{}`", s.name)));
    }
    let folder = ModelFolder::open(&store.artifact_dir(model_fp).join("model")).map_err(|e| problem(format!("{e}")))?;
    let ds = &loaded.recipe.dataset;
    let described = match base {
        true => format!("the base model of recipe `{}`", plan.recipe),
        false => format!("stage `{}` of recipe `{}` ({})", s.name, plan.recipe, s.short()),
    };
    Ok(Model {
        folder,
        trained: (!base).then(|| store.artifact_dir(&s.fingerprint)),
        device: key.device.clone(),
        base_quant: loaded.recipe.adapter.quantize_base,
        format: ds.format,
        chat_template: ds.chat_template.clone(),
        chat_template_kwargs: ds.chat_template_kwargs.clone(),
        described,
    })
}

/// A model folder on the CPU: a Hugging Face model (a merged export), or a PEFT adapter folder
/// whose base is a folder beside it or named in `adapter_config.json`.
pub fn from_folder(dir: &Path, device: DeviceKey) -> Result<Model, Problem> {
    let (base_dir, trained) = if dir.join("adapter_config.json").is_file() {
        let cfg: Value = std::fs::read_to_string(dir.join("adapter_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null);
        let base = cfg["base_model_name_or_path"].as_str().unwrap_or_default();
        let candidates = [dir.join(base), PathBuf::from(base), dir.join("..").join("merged")];
        let found = candidates.into_iter().find(|c| !base.is_empty() && c.join("config.json").is_file());
        match found {
            Some(b) => (b, Some(dir.to_path_buf())),
            None => {
                return Err(problem(format!(
                    "`{}` is a PEFT adapter whose base `{base}` is not a model folder here",
                    dir.display()
                ))
                .help("chat with the merged folder of the same export, or with the recipe that trained it"));
            }
        }
    } else {
        (dir.to_path_buf(), None)
    };
    let folder = ModelFolder::open(&base_dir).map_err(|e| problem(format!("{e}")))?;
    // An exported folder's template is its own (the one it trained with): chat data. A PEFT
    // folder carries the trained template; it is preferred over the base's.
    let chat_template = trained.as_ref().and_then(|t| crate::data::chat::model_template(t)).map(|(t, _)| t);
    let format = match chat_template.is_some() || crate::data::chat::model_template(&folder.dir).is_some() {
        true => DataFormat::Chat,
        false => DataFormat::Text,
    };
    Ok(Model {
        folder,
        trained,
        device,
        base_quant: None,
        format,
        chat_template,
        chat_template_kwargs: Default::default(),
        described: format!("`{}`", dir.display()),
    })
}
