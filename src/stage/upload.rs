//! `upload`: publishes the exported models with a generated model card (README.md: the recipe,
//! evaluation and training metrics, the loss curve).
//!
//! `dir://path` (relative to the recipe's folder) copies them there, each file written to a
//! temporary name and renamed. `hf://owner/name[@revision]` commits them to the Hub in one
//! commit (LFS for large files), creating the repo first when `create = true`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use serde_json::json;

use super::{StageCtx, StageError, write_json};
use crate::destination::{self, Record, Written};
use crate::plan::key::{Card, UploadKey, card_evaluations};
use crate::ui::human_bytes;

pub fn run(ctx: &StageCtx<'_>, key: &UploadKey) -> Result<serde_json::Value, StageError> {
    let s = &key.settings.upload;
    let exports = ctx.input("exports")?;
    let exports_fp = ctx.input_fingerprint("exports")?;
    // (destination path, store file, `<fingerprint>/<path>` it is restored from)
    let mut files: Vec<(String, PathBuf, String)> = crate::store::walk(&exports)
        .map_err(StageError::io("cannot list the exports"))?
        .into_iter()
        .map(|rel| {
            let rel_s = rel.to_string_lossy().replace('\\', "/");
            (rel_s.clone(), exports.join(rel), format!("{exports_fp}/{rel_s}"))
        })
        .collect();
    // The card and the loss curve travel with the models.
    let card_dir = ctx.out.join("card");
    std::fs::create_dir_all(&card_dir).map_err(StageError::io("cannot create the card folder"))?;
    if let Some(train) = train_stage(ctx) {
        let curve = ctx.store.artifact_dir(train).join("loss_curve.svg");
        if curve.exists() {
            files.push(("loss_curve.svg".into(), curve, format!("{train}/loss_curve.svg")));
        }
    }
    let card = model_card(ctx, &key.settings.card, &files);
    std::fs::write(card_dir.join("README.md"), card).map_err(StageError::io("cannot write the model card"))?;
    files.retain(|(p, _, _)| p != "README.md");
    files.push(("README.md".into(), card_dir.join("README.md"), format!("{}/card/README.md", ctx.fingerprint)));

    if let Some(rest) = s.to.strip_prefix("hf://") {
        let repo = crate::hub::parse_hf_url(rest)?;
        let env = crate::hub::HubEnv::from_env(None, ctx.offline);
        if env.offline {
            return Err(crate::recipe::Problem::new(
                "rtune::hub::offline",
                format!("cannot upload to `{}` offline", s.to),
            )
            .at(ctx.spans.origin(&["stages", ctx.name, "to"]), "needs the Hub")
            .help("run without --offline / HF_HUB_OFFLINE, or upload to `dir://…`")
            .into());
        }
        let client = crate::hub::Client::new(env);
        if s.create {
            crate::hub::create_repo(&client, &repo, s.private)?;
        }
        let commit_files: Vec<crate::hub::CommitFile> =
            files.iter().map(|(p, l, _)| crate::hub::CommitFile { path: p.clone(), local: l.clone() }).collect();
        let message = s.message.clone().unwrap_or_else(|| format!("Upload {} with rtune", key.settings.card.name));
        let report = crate::hub::commit(&client, &repo, &commit_files, &message, crate::hub::Ignored::Refuse, ctx.ui)?;
        let mut written = BTreeMap::new();
        for (rel, local, from) in &files {
            let (digest, size) =
                crate::store::hash_file(local).map_err(StageError::io(format!("cannot hash `{}`", local.display())))?;
            let hub = report.digests.get(rel);
            written.insert(
                rel.clone(),
                Written {
                    digest,
                    size,
                    from: from.clone(),
                    sha256: hub.map(|d| d.sha256.clone()),
                    git: hub.and_then(|d| d.git.clone()),
                },
            );
        }
        ctx.ui.status("upload", format!("{} files → {} (commit {})", files.len(), repo.display(), &report.commit));
        let record = Record {
            destination: s.to.clone(),
            commit: Some(report.commit.clone()),
            url: Some(report.url.clone()),
            files: written,
        };
        write_record(ctx, &record)?;
        return Ok(json!({ "destination": s.to, "commit": report.commit, "url": report.url, "files": files.len(),
            "lfs_files": report.lfs_files, "bytes_uploaded": report.bytes_uploaded }));
    }

    let dest = key.dir.as_ref().ok_or_else(|| StageError::Internal(format!("`{}` passed planning", s.to)))?;
    // The digests are the copies' (hashed once, as they are written).
    let written = destination::write_dir(ctx.store, dest, &files, None, ctx.ui)?;
    ctx.ui.status("upload", format!("{} files → {}", written.len(), dest.display()));
    let record = Record { destination: s.to.clone(), commit: None, url: None, files: written };
    write_record(ctx, &record)?;
    Ok(json!({ "destination": s.to, "path": dest, "files": record.files.len() }))
}

fn write_record(ctx: &StageCtx<'_>, record: &Record) -> Result<(), StageError> {
    write_json(&ctx.out.join("upload.json"), &serde_json::to_value(record).expect("record serialises"))
}

/// The fingerprint of the train stage the exports came from (the `card:train` input), if any.
fn train_stage<'a>(ctx: &StageCtx<'a>) -> Option<&'a str> {
    ctx.input_fingerprint("card:train").ok()
}

/// A Hugging Face model card: YAML front matter the Hub understands, then what was built and how.
fn model_card(ctx: &StageCtx<'_>, c: &Card, files: &[(String, PathBuf, String)]) -> String {
    let lora = c.lora;
    let mut tags = vec!["rtune"];
    if lora {
        tags.push("lora");
    }
    if c.qlora.is_some() {
        tags.push("qlora");
    }
    if files.iter().any(|(p, _, _)| p.ends_with(".gguf")) {
        tags.push("gguf");
    }
    let mut s = String::from("---\n");
    if let Some(repo) = &c.base_repo {
        let _ = writeln!(s, "base_model: {repo}");
    }
    if lora {
        let _ = writeln!(s, "library_name: peft");
    }
    let _ = writeln!(s, "tags:");
    for t in tags {
        let _ = writeln!(s, "- {t}");
    }
    if let Some(ds) = &c.dataset_repo {
        let _ = writeln!(s, "datasets:\n- {ds}");
    }
    s.push_str("---\n\n");
    let _ = writeln!(s, "# {}\n", c.name);
    if let Some(d) = &c.description {
        let _ = writeln!(s, "{d}\n");
    }
    let _ = writeln!(s, "Fine-tuned from {} with rtune (`{}`).\n", c.base, command(c));
    if let Some(q) = c.qlora {
        let double = q == crate::recipe::BaseQuant::Nf4Dq;
        let _ = writeln!(
            s,
            "QLoRA: the adapter trained over the base with its linear layers in 4-bit NF4 (bitsandbytes' \
             `load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", bnb_4bit_use_double_quant={}`), and the \
             evaluations below ran over that base; merged exports hold the adapter merged into the \
             original weights.\n",
            if double { "True" } else { "False" }
        );
    }
    s.push_str("## Files\n\n| file | size |\n|---|---|\n");
    for (p, local, _) in files {
        let size = std::fs::metadata(local).map(|m| m.len()).unwrap_or(0);
        let _ = writeln!(s, "| `{p}` | {} |", human_bytes(size));
    }
    // The evaluations are the `card:eval:<stage>` inputs.
    let evals: Vec<_> = card_evaluations(ctx.inputs())
        .into_iter()
        .filter_map(|(name, fp)| ctx.store.manifest(fp).map(|m| (name.to_string(), m.metrics)))
        .collect();
    if !evals.is_empty() {
        s.push_str("\n## Evaluation\n\n| stage | model | loss | perplexity | tokens |\n|---|---|---|---|---|\n");
        for (name, m) in evals {
            let num = |k: &str| m[k].as_f64().map(|v| format!("{v:.4}")).unwrap_or_else(|| "–".into());
            let _ = writeln!(
                s,
                "| {name} | {} | {} | {} | {} |",
                m["model"].as_str().unwrap_or("tuned"),
                num("eval_loss"),
                num("perplexity"),
                m["eval_tokens"].as_u64().map(|t| t.to_string()).unwrap_or_else(|| "–".into())
            );
        }
    }
    if let Some(m) = train_stage(ctx).and_then(|train| ctx.store.manifest(train)) {
        s.push_str("\n## Training\n\n");
        // Results only: timings would make the artifact differ between identical runs.
        for key in ["steps", "eval_loss_start", "eval_loss_end", "train_loss_end", "tokens_seen"] {
            if let Some(v) = m.metrics.get(key).filter(|v| !v.is_null()) {
                let _ = writeln!(s, "- {key}: {v}");
            }
        }
        if files.iter().any(|(p, _, _)| p == "loss_curve.svg") {
            s.push_str("\n![loss curve](loss_curve.svg)\n");
        }
    }
    let exports = ctx
        .input("exports")
        .ok()
        .and_then(|d| std::fs::read_to_string(d.join("exports.json")).ok())
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    if let Some(formats) = exports.as_ref().and_then(|e| e["formats"].as_object()) {
        gguf_section(&mut s, formats);
        if let Some(e) = &exports {
            try_it_section(&mut s, formats, &e["ollama"]);
        }
    }
    if let Some(chat) = exports.as_ref().map(|e| e["chat_template"].clone()).filter(|c| c.is_object()) {
        s.push_str("\n## Chat template\n\n");
        let _ = writeln!(
            s,
            "Trained with {}; every export carries it (`chat_template.jinja`, `tokenizer_config.json`, GGUF `tokenizer.chat_template`).",
            chat["origin"].as_str().unwrap_or("the model's template")
        );
        if let Some(end) = chat["turn_end"].as_str() {
            let _ = writeln!(s, "Assistant turns end with `{end}`, a stop token of every export.");
        }
        let _ = writeln!(s, "\n```jinja\n{}\n```", chat["source"].as_str().unwrap_or_default().trim_end());
    }
    s.push_str("\n## Recipe\n\n```toml\n");
    s.push_str(c.recipe_text.0.trim_end());
    s.push_str("\n```\n");
    if !c.overrides.is_empty() {
        s.push_str("\nRun with these settings over the file, in this order (environment variables, then `--set`):\n\n");
        for o in &c.overrides {
            let _ = writeln!(s, "- `{o}`");
        }
    }
    s
}

/// The GGUF files, each with the perplexity the quantize stage measured against the unquantized
/// model, how often its top token was the unquantized model's, and whether an importance matrix
/// calibrated it (and over how many tokens).
fn gguf_section(s: &mut String, formats: &serde_json::Map<String, serde_json::Value>) {
    let ggufs: Vec<&serde_json::Value> =
        formats.iter().filter(|(k, _)| k.starts_with("gguf-")).map(|(_, v)| v).collect();
    if ggufs.is_empty() {
        return;
    }
    s.push_str("\n## GGUF\n\nFor llama.cpp and Ollama; perplexity on the eval split as read back by rtune.\n\n");
    s.push_str("| file | perplexity vs unquantized | same top token | importance matrix |\n|---|---|---|---|\n");
    let imatrix = formats.get("imatrix").map(|i| match i["given"].as_bool() {
        Some(true) => "the recipe's file".to_string(),
        _ => format!("{} train tokens", i["tokens"].as_u64().unwrap_or(0)),
    });
    for g in ggufs {
        let ratio = g["perplexity_ratio"].as_f64().map(|r| format!("{:+.2}%", (r - 1.0) * 100.0));
        let calibrated = match (g["imatrix"].as_bool(), &imatrix) {
            (Some(true), Some(from)) => format!("`gguf/imatrix.gguf` ({from})"),
            _ => "–".to_string(),
        };
        let same = g["top_token_agreement"].as_f64().map(|a| format!("{:.1}%", a * 100.0));
        let _ = writeln!(
            s,
            "| `{}` | {} | {} | {calibrated} |",
            g["file"].as_str().unwrap_or("?"),
            ratio.as_deref().unwrap_or("–"),
            same.as_deref().unwrap_or("–")
        );
    }
}

/// How to talk to the GGUF files: llama.cpp's server (which applies the Jinja template the
/// file carries) and Ollama (through the Modelfile beside each file, or why there is none).
fn try_it_section(s: &mut String, formats: &serde_json::Map<String, serde_json::Value>, ollama: &serde_json::Value) {
    let Some(gguf) = formats.iter().filter(|(k, _)| k.starts_with("gguf-")).find_map(|(_, v)| v["file"].as_str())
    else {
        return;
    };
    s.push_str("\n## Try it\n\n");
    let _ = writeln!(
        s,
        "With llama.cpp's server, which chats with the template the file carries (`--jinja`):\n\n```sh\n\
         llama-server -m {gguf} --jinja\n```\n\nthen open http://127.0.0.1:8080, or POST OpenAI-style \
         messages to `http://127.0.0.1:8080/v1/chat/completions`."
    );
    let modelfiles: Vec<&str> =
        ollama["modelfiles"].as_array().into_iter().flatten().filter_map(|m| m.as_str()).collect();
    match (modelfiles.first(), ollama["untranslated"].as_str()) {
        (Some(first), _) => {
            let _ = writeln!(
                s,
                "\nWith Ollama, from this folder (each GGUF has its Modelfile, with the chat template in Ollama's \
                 syntax, rtune's `{}` template, checked against the trained one):\n\n```sh\n\
                 ollama create my-model -f {first}\nollama run my-model\n```",
                ollama["template"].as_str().unwrap_or("?")
            );
        }
        (None, Some(why)) => {
            let _ = writeln!(s, "\nNo Ollama Modelfile was written: {why}.");
        }
        (None, None) => {}
    }
}

/// The command that ran the recipe, overrides included, as one line for a POSIX shell.
fn command(c: &crate::plan::key::Card) -> String {
    let quote = crate::ui::shell_quote;
    // Variables are `RTUNE_…=value`; `--set` keys are recipe paths (lowercase sections).
    let (vars, sets): (Vec<&String>, Vec<&String>) = c.overrides.iter().partition(|o| o.starts_with("RTUNE_"));
    let mut words: Vec<String> =
        vars.iter().filter_map(|o| o.split_once('=')).map(|(k, v)| format!("{k}={}", quote(v))).collect();
    words.extend(["rtune".to_string(), "run".to_string(), quote(&c.recipe_file)]);
    for o in sets {
        words.extend(["--set".to_string(), quote(o)]);
    }
    words.join(" ")
}
