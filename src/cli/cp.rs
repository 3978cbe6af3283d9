//! `rtune cp`: copy a built-in recipe (and its data files) to edit.

use std::path::PathBuf;

use rtune::Error;
use rtune::recipe::{self, Problem, builtin};
use rtune::ui::Ui;

/// Run `rtune cp` with its parsed arguments; the exit code on success.
pub fn run(name: String, dest: PathBuf, ui: &Ui) -> Result<u8, Error> {
    let b = builtin::find(&name).ok_or_else(|| {
        let mut p = Problem::new("rtune::recipe::not_found", format!("no built-in recipe `{name}`"));
        if let Some(m) = recipe::diag::did_you_mean(&name, builtin::all().iter().map(|b| b.name)) {
            p = p.help(format!("did you mean `{m}`?"));
        }
        p
    })?;
    let target = if dest.is_dir() { dest.join(format!("{}.toml", b.name)) } else { dest.clone() };
    if target.exists() {
        return Err(Problem::new("rtune::cp::exists", format!("`{}` already exists", target.display()))
            .help("choose another destination or remove the file first")
            .into());
    }
    std::fs::write(&target, b.text).map_err(Error::io(format!("cannot write `{}`", target.display())))?;
    let dir = target.parent().map(|p| p.to_path_buf()).unwrap_or_default();
    for (rel, bytes) in builtin::data_files(b) {
        let p = dir.join(rel);
        if !p.exists() {
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent).map_err(Error::io(format!("cannot create `{}`", parent.display())))?;
            }
            std::fs::write(&p, bytes).map_err(Error::io(format!("cannot write `{}`", p.display())))?;
            ui.status("copied", p.display().to_string());
        }
    }
    ui.status("copied", format!("{} → {}", b.name, target.display()));
    Ok(0)
}
