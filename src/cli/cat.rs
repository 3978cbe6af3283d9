//! `rtune cat`: print a recipe, resolved when `--set` overrides are given.

use super::*;
use rtune::Error;
use rtune::recipe::{self};
use rtune::ui::Ui;

/// Run `rtune cat` with its parsed arguments; the exit code on success.
pub fn run(args: RecipeArgs, ui: &Ui) -> Result<u8, Error> {
    if args.sets.is_empty() {
        let source = recipe::RecipeSource::find(&args.recipe)?;
        let text = source.text().map_err(Error::io(format!("cannot read `{}`", source.display_name())))?;
        ui.out(text);
    } else {
        let loaded = load(&args)?;
        ui.out(toml::to_string_pretty(&loaded.resolved()).unwrap_or_default());
    }
    Ok(0)
}
