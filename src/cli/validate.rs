//! `rtune validate`: every problem of a recipe at once.

use serde_json::json;

use super::*;
use rtune::Error;
use rtune::plan::{self};
use rtune::recipe::{self};
use rtune::ui::Ui;

/// Run `rtune validate` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, args: RecipeArgs, ui: &Ui) -> Result<u8, Error> {
    let loaded = load(&args)?;
    plan::check_stages(&loaded).map_err(recipe::LoadError::Invalid)?;
    let names: Vec<String> = loaded.stages.list.iter().map(|s| s.name.clone()).collect();
    if g.json {
        ui.out(format!("{}\n", json!({"recipe": loaded.recipe.recipe.name, "valid": true, "stages": names})));
    } else {
        ui.out(format!("recipe `{}` is valid: {} stages ({})\n", loaded.name(), names.len(), names.join(" → ")));
    }
    Ok(0)
}
