//! Using rtune as a library: load a recipe with an override, plan it, and print what would run.
//!
//!     cargo run --example library -- recipes/tiny-offline.toml

use rtune::device::Inventory;
use rtune::plan::{self, LockFile, Selection};
use rtune::recipe::{self, Overrides};
use rtune::store::Store;

fn main() -> miette::Result<()> {
    let path = std::env::args().nth(1).unwrap_or_else(|| "recipes/tiny-offline.toml".into());
    let overrides = Overrides { sets: vec!["stages.train.epochs=2".into()], env: vec![] };
    let loaded = recipe::load(&path, &overrides)?;
    let store = Store::open(&Store::default_root()).map_err(|e| miette::miette!("{e}"))?;
    let lock = LockFile::read(&rtune::exec::lock_path(&loaded)).map_err(|e| miette::miette!("{e}"))?;
    let plan = plan::make(&loaded, &store, &lock, &Inventory::probe(), &Selection::default())?;
    print!("{}", plan::render_text(&plan));
    Ok(())
}
