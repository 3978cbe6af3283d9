//! `rtune ls`: the built-in recipes and those in `./recipes`.

use serde_json::json;

use super::*;
use rtune::Error;
use rtune::recipe::builtin;
use rtune::ui::Ui;

/// Run `rtune ls` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, ui: &Ui) -> Result<u8, Error> {
    if g.json {
        let list: Vec<_> = builtin::all()
            .iter()
            .map(|b| json!({"name": b.name, "description": b.description(), "builtin": true}))
            .collect();
        ui.out(format!("{}\n", serde_json::to_string_pretty(&list).expect("json")));
        return Ok(0);
    }
    let width = builtin::all().iter().map(|b| b.name.len()).max().unwrap_or(0);
    let mut out = String::from("built-in recipes:\n");
    for b in builtin::all() {
        out.push_str(&format!("  {:<width$}  {}\n", b.name, b.description()));
    }
    let mut local: Vec<String> = std::fs::read_dir("recipes")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .map(|p| p.display().to_string())
        .collect();
    local.sort();
    if !local.is_empty() {
        out.push_str("\nin ./recipes:\n");
        for p in local {
            out.push_str(&format!("  {p}\n"));
        }
    }
    ui.out(out);
    Ok(0)
}
