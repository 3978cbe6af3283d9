//! Command-line interface: the arguments (clap, in `args.rs`) and one module per command, each a thin
//! layer over the library that prints only through [`rtune::ui`].

use rtune::device::{self, Inventory};
use rtune::plan::{LockFile, Selection};
use rtune::recipe::{self, Overrides};
use rtune::store::Store;
use rtune::{Error, exec, hub};

mod args;
pub mod cache;
pub mod cat;
pub mod chat;
pub mod cp;
pub mod doctor;
pub mod download;
pub mod explain;
pub mod ls;
pub mod plan;
pub mod run;
pub mod schema;
pub mod upload;
pub mod validate;

pub use args::*;

pub fn repo_kind(t: RepoType) -> hub::RepoKind {
    match t {
        RepoType::Model => hub::RepoKind::Model,
        RepoType::Dataset => hub::RepoKind::Dataset,
    }
}

pub fn store(cli: &Global) -> Result<Store, Error> {
    let root = cli.cache_dir.clone().unwrap_or_else(Store::default_root);
    Ok(Store::open(&root)?)
}

pub fn load(args: &RecipeArgs) -> Result<recipe::LoadedRecipe, Error> {
    Ok(recipe::load(&args.recipe, &Overrides::from_env_and_args(args.sets.clone()))?)
}

pub fn selection(s: &SelectArgs) -> Selection {
    Selection {
        only: s.only.clone(),
        until: s.until.clone(),
        from: s.from.clone(),
        force: s.force.clone(),
        offline: s.offline,
    }
}

pub fn make_plan(
    g: &Global,
    args: &RecipeArgs,
    sel: &SelectArgs,
) -> Result<(recipe::LoadedRecipe, Store, LockFile, rtune::plan::Plan), Error> {
    let loaded = load(args)?;
    let store = store(g)?;
    let lock = LockFile::read(&exec::lock_path(&loaded))?;
    let inventory = Inventory::probe(device::served_through_vulkan(&loaded.recipe.device.prefer));
    let plan = rtune::plan::make(&loaded, &store, &lock, &inventory, &selection(sel))?;
    Ok((loaded, store, lock, plan))
}
