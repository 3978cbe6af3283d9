//! Using rtune as a library: load a recipe with an override, plan it, print what would run, then
//! build one stage (`download`: for the default recipe, a scratch model and tokenizer) and show
//! where its artifact is.
//!
//!     cargo run --example library -- recipes/tiny-offline.toml

use rtune::device::Inventory;
use rtune::plan::{self, LockFile, Selection};
use rtune::recipe::{self, Overrides};
use rtune::store::Store;
use rtune::ui::Ui;

fn main() -> miette::Result<()> {
    let path = std::env::args().nth(1).unwrap_or_else(|| "recipes/tiny-offline.toml".into());
    let overrides = Overrides { sets: vec!["stages.train.epochs=2".into()], env: vec![] };
    let loaded = recipe::load(&path, &overrides)?;
    let store = Store::open(&Store::default_root()).map_err(|e| miette::miette!("{e}"))?;
    let lock = LockFile::read(&rtune::exec::lock_path(&loaded)).map_err(|e| miette::miette!("{e}"))?;
    let plan = plan::make(&loaded, &store, &lock, &Inventory::probe(false), &Selection::default())?;
    print!("{}", plan::render_text(&plan));

    // Build only the first stage; the others are skipped.
    let first = plan.stages.first().map(|s| s.name.clone()).ok_or_else(|| miette::miette!("no stages"))?;
    let only = Selection { only: Some(first.clone()), ..Selection::default() };
    let plan = plan::make(&loaded, &store, &lock, &Inventory::probe(false), &only)?;
    let report = rtune::exec::run(&loaded, &plan, &store, &Ui::new(false, false))?;
    let stage = report.stage(&first).ok_or_else(|| miette::miette!("`{first}` did not run"))?;
    println!(
        "\n`{first}`: {} → {}",
        stage.outcome,
        stage.artifact.as_ref().map(|p| p.display().to_string()).unwrap_or_default()
    );
    Ok(())
}
