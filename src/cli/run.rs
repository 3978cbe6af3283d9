//! `rtune run`: run a recipe's plan, and say where every artifact is.

use super::*;
use rtune::plan::{self};
use rtune::ui::Ui;
use rtune::{Error, exec};

/// Run `rtune run` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, args: RecipeArgs, select: SelectArgs, locked: bool, ui: &Ui) -> Result<u8, Error> {
    let (loaded, store, lock, plan) = make_plan(g, &args, &select)?;
    if locked {
        exec::check_locked(&loaded, &plan, &lock)?;
    }
    ui.message(format!("{}\n", plan::render_text(&plan)));
    // Allocator and thread settings for compute, only for the command that computes.
    rtune::init_process();
    if let Some(n) = loaded.recipe.device.threads {
        // Before any thread pool starts (the first parallel work happens in a stage).
        rtune::set_threads(n);
    }
    let report = exec::run(&loaded, &plan, &store, ui)?;
    if g.json {
        ui.out(format!("{}\n", serde_json::to_string_pretty(&report).expect("json")));
    } else {
        ui.out(summary(&report));
    }
    Ok(0)
}

/// What `rtune run` prints on stdout at the end: every artifact, and eval losses.
fn summary(r: &exec::RunReport) -> String {
    let mut out = format!("\nrecipe `{}` done\n", r.recipe);
    let w = r.stages.iter().map(|s| s.name.len()).max().unwrap_or(0);
    for s in &r.stages {
        let path = s.artifact.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "-".into());
        out.push_str(&format!("  {:<w$}  {:<8}  {path}\n", s.name, s.outcome));
    }
    let evals: Vec<String> = r
        .stages
        .iter()
        .filter(|s| s.kind == "evaluate")
        .filter_map(|s| {
            let loss = s.metrics["eval_loss"].as_f64()?;
            let ppl = s.metrics["perplexity"].as_f64().unwrap_or(f64::NAN);
            Some(format!(
                "  {:<w$}  {} model: eval loss {loss:.4}, perplexity {ppl:.2}",
                s.name,
                s.metrics["model"].as_str().unwrap_or("?")
            ))
        })
        .collect();
    if !evals.is_empty() {
        out.push_str("\nevaluation:\n");
        for e in evals {
            out.push_str(&e);
            out.push('\n');
        }
    }
    out
}
