//! `rtune plan`: what would run, on which device, and why.

use super::*;
use rtune::Error;
use rtune::plan::{self};
use rtune::ui::Ui;

/// Run `rtune plan` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, args: RecipeArgs, select: SelectArgs, format: PlanFormat, ui: &Ui) -> Result<u8, Error> {
    let (_, _, _, plan) = make_plan(g, &args, &select)?;
    let text = match (format, g.json) {
        (PlanFormat::Json, _) | (_, true) => {
            format!("{}\n", serde_json::to_string_pretty(&plan).expect("json"))
        }
        (PlanFormat::Dot, _) => plan::render_dot(&plan),
        (PlanFormat::Text, _) => plan::render_text(&plan),
    };
    ui.out(text);
    Ok(0)
}
