//! `docs/recipe-reference.md`, generated from the recipe schema (a test keeps it fresh).

use std::fmt::Write;

use serde_json::Value as J;

use super::types::{Recipe, StageKind};

pub fn markdown() -> String {
    let schema = Recipe::json_schema();
    let mut out = String::from(
        "# Recipe reference\n\nGenerated from the recipe types by `rtune schema` (see `schemas/recipe.schema.json`); \
         a test fails when this file is stale. Regenerate with `RTUNE_BLESS=1 cargo test --test cli`.\n\n\
         Settings are layered: built-in defaults < the recipe file < `RTUNE_<SECTION>__<KEY>` environment \
         variables < `--set key=value`. Unknown keys are errors.\n",
    );
    for (section, def) in [
        ("recipe", "RecipeMeta"),
        ("model", "ModelSource"),
        ("dataset", "Dataset"),
        ("adapter", "Adapter"),
        ("device", "DevicePolicy"),
    ] {
        let s = &schema["$defs"][def];
        let _ = write!(out, "\n## `[{section}]`\n\n");
        table(&mut out, &schema, s, "");
        if section == "model" {
            let _ = write!(out, "\n### `[model] scratch = {{ … }}`\n\n");
            table(&mut out, &schema, &schema["$defs"]["ScratchModel"], "");
        }
        if section == "device" {
            out.push_str(
                "\n`[device.<name>]` tables (`cpu`, `cuda`, `cuda:N`, `vulkan`, `vulkan:N`, `metal`, `rocm`, `directml`) override stage \
                 settings when that device is chosen, e.g. `[device.cpu]` then `train.batch_size = 1`, and may hold the device's own \
                 `dtype` list. Any other key in `[device]` is an error.\n",
            );
        }
    }
    out.push_str(
        "\n## `[stages.<name>]`\n\nA stage's kind is its name unless `kind = \"…\"` says otherwise; `needs = [\"…\"]` \
         lists the stages whose artifacts it reads (by default, the producers of what its kind reads). \
         `download` and `tokenize` are added when a stage needs them.\n",
    );
    for kind in StageKind::ALL {
        let name = kind.as_str();
        let def = format!("{}{}Stage", name[..1].to_uppercase(), &name[1..]);
        let s = &schema["$defs"][&def];
        let _ = write!(out, "\n### `{name}`\n\n");
        if let Some(d) = s.get("description").and_then(J::as_str) {
            let _ = writeln!(out, "{d}\n");
        }
        table(&mut out, &schema, s, "");
        for (key, nested) in
            [("schedule", "Schedule"), ("loss_guard", "LossGuard"), ("early_stopping", "EarlyStopping"), ("ema", "Ema")]
        {
            if kind == StageKind::Train {
                let _ = write!(out, "\n`{key} = {{ … }}`:\n\n");
                table(&mut out, &schema, &schema["$defs"][nested], key);
            }
        }
    }
    out
}

fn table(out: &mut String, root: &J, s: &J, prefix: &str) {
    let Some(props) = s.get("properties").and_then(J::as_object) else { return };
    let required: Vec<&str> =
        s.get("required").and_then(J::as_array).map(|r| r.iter().filter_map(J::as_str).collect()).unwrap_or_default();
    out.push_str("| key | type | default | meaning |\n|---|---|---|---|\n");
    for (k, p) in props {
        if k == "kind" || k == "needs" {
            continue;
        }
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        let default = match p.get("default") {
            Some(d) => format!("`{d}`"),
            None if required.contains(&k.as_str()) => "required".into(),
            None => "—".into(),
        };
        let desc = p.get("description").and_then(J::as_str).unwrap_or_default().replace('\n', " ");
        let _ = writeln!(out, "| `{key}` | {} | {default} | {desc} |", type_of(root, p));
    }
}

fn type_of(root: &J, p: &J) -> String {
    let resolve = |x: &J| -> J {
        match x.get("$ref").and_then(J::as_str) {
            Some(r) => root["$defs"][r.rsplit('/').next().unwrap_or_default()].clone(),
            None => x.clone(),
        }
    };
    let p = resolve(p);
    let branches: Vec<J> = p
        .get("anyOf")
        .or_else(|| p.get("oneOf"))
        .and_then(J::as_array)
        .map(|b| b.iter().map(resolve).collect())
        .unwrap_or_default();
    let consts: Vec<String> = branches
        .iter()
        .flat_map(|b| {
            b.get("const")
                .and_then(J::as_str)
                .map(|c| vec![c.to_string()])
                .or_else(|| {
                    b.get("enum")
                        .and_then(J::as_array)
                        .map(|e| e.iter().filter_map(|x| x.as_str().map(String::from)).collect())
                })
                .unwrap_or_default()
        })
        .collect();
    if !consts.is_empty() {
        // Words, and the other types a branch takes (`boolean \| "auto"`, `integer \| "all"`).
        let others = branches.iter().filter(|b| {
            b.get("const").is_none() && b.get("enum").is_none() && b.get("type").and_then(J::as_str) != Some("null")
        });
        let words = consts.iter().map(|c| format!("`\"{c}\"`"));
        return others.map(|b| type_of(root, b)).chain(words).collect::<Vec<_>>().join(" \\| ");
    }
    if let Some(real) = branches.iter().find(|b| b.get("type").and_then(J::as_str) != Some("null")) {
        return type_of(root, real);
    }
    let ty = match p.get("type") {
        Some(J::String(t)) => t.clone(),
        Some(J::Array(ts)) => ts.iter().filter_map(J::as_str).filter(|t| *t != "null").collect::<Vec<_>>().join(" or "),
        _ => {
            if p.get("properties").is_some() {
                "table".into()
            } else {
                "value".into()
            }
        }
    };
    match ty.as_str() {
        "array" => format!("list of {}", p.get("items").map(|i| type_of(root, i)).unwrap_or_else(|| "value".into())),
        "object" => "table".into(),
        "number" => "float".into(),
        other => other.to_string(),
    }
}
