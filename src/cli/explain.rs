//! `rtune explain`: a stage's fingerprint inputs, and what changed since the last run.

use super::*;
use rtune::ui::Ui;
use rtune::{Error, exec};

/// Run `rtune explain` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, args: RecipeArgs, stage: String, diff: bool, ui: &Ui) -> Result<u8, Error> {
    let (loaded, _store, lock, plan) = make_plan(g, &args, &SelectArgs::default())?;
    let Some(s) = plan.stage(&stage) else {
        return Err(rtune::plan::unknown_stage(&loaded, &stage).into());
    };
    let mut out = format!(
        "stage `{}` ({}) fingerprint {}\nstatus: {}{}\n\nfingerprint inputs:\n{}\n",
        s.name,
        s.kind,
        s.fingerprint,
        s.action.as_str(),
        if s.reason.is_empty() { String::new() } else { format!(" — {}", s.reason) },
        serde_json::to_string_pretty(&s.doc).expect("json")
    );
    if diff {
        match lock.recipes.get(&plan.recipe).and_then(|r| r.stages.get(&stage)) {
            None => out.push_str(&format!(
                "\nno earlier run of `{stage}` is recorded in {}\n",
                exec::lock_path(&loaded).display()
            )),
            Some(old) if old.fingerprint == s.fingerprint => out.push_str("\nunchanged since the last run\n"),
            Some(old) => {
                out.push_str(&format!(
                    "\nchanges since the last run ({} → {}):\n",
                    rtune::fingerprint::short(&old.fingerprint),
                    s.short()
                ));
                for line in rtune::fingerprint::diff(&old.inputs, &s.doc) {
                    out.push_str(&format!("  {line}\n"));
                }
            }
        }
    }
    ui.out(out);
    Ok(0)
}
