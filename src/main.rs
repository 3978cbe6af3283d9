//! The `rtune` binary: parses the command line, runs a command, maps errors to exit codes.

#![allow(clippy::result_large_err)] // see lib.rs

mod cli;

use std::process::ExitCode;

use clap::Parser;

use cli::{Cli, Command};
use rtune::Error;
use rtune::ui::Ui;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let ui = Ui::new(cli.global.quiet, cli.global.verbose);
    // First Ctrl-C: the training loop checkpoints and stops. Second: exit at once.
    let _ = ctrlc::set_handler(|| {
        if rtune::train::INTERRUPTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            std::process::exit(130);
        }
        rtune::ui::note("\ninterrupted: saving a checkpoint (press Ctrl-C again to quit at once)");
    });
    match run(cli, &ui) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            rtune::ui::report_error(&e);
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

fn run(cli: Cli, ui: &Ui) -> Result<u8, Error> {
    let g = &cli.global;
    match cli.command {
        Command::Ls => cli::ls::run(g, ui),
        Command::Cp { name, dest } => cli::cp::run(name, dest, ui),
        Command::Cat { recipe } => cli::cat::run(recipe, ui),
        Command::Validate { recipe } => cli::validate::run(g, recipe, ui),
        Command::Plan { recipe, select, format } => cli::plan::run(g, recipe, select, format, ui),
        Command::Run { recipe, select, locked } => cli::run::run(g, recipe, select, locked, ui),
        Command::Explain { recipe, stage, diff } => cli::explain::run(g, recipe, stage, diff, ui),
        Command::Chat(a) => cli::chat::run(g, a, ui),
        Command::Download(a) => cli::download::run(g, a, ui),
        Command::Upload(a) => cli::upload::run(g, a, ui),
        Command::Cache { command } => cli::cache::run(g, command, ui),
        Command::Schema => cli::schema::run(ui),
        Command::Doctor { check } => cli::doctor::run(g, check, ui),
    }
}
