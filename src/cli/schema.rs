//! `rtune schema`: the recipes' JSON Schema.

use rtune::Error;
use rtune::ui::Ui;

/// Run `rtune schema` with its parsed arguments; the exit code on success.
pub fn run(ui: &Ui) -> Result<u8, Error> {
    ui.out(schema_text());
    Ok(0)
}

/// The JSON Schema as checked in under schemas/.
fn schema_text() -> String {
    format!("{}\n", serde_json::to_string_pretty(&rtune::recipe::Recipe::json_schema()).expect("json"))
}
