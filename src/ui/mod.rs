//! The only place that prints. stdout carries data (tables, JSON, paths); stderr carries
//! progress and messages for people. Progress bars appear only on a terminal and never when
//! `RTUNE_NO_PROGRESS` is set; otherwise long work logs a plain line every tenth of the way.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Debug, Clone)]
pub struct Ui {
    pub quiet: bool,
    pub verbose: bool,
    pub progress: bool,
}

impl Ui {
    pub fn new(quiet: bool, verbose: bool) -> Ui {
        let no_progress = std::env::var_os("RTUNE_NO_PROGRESS").is_some_and(|v| !v.is_empty() && v != "0");
        Ui { quiet, verbose, progress: !quiet && !no_progress && std::io::stderr().is_terminal() }
    }

    /// A quiet UI for library use and tests.
    pub fn silent() -> Ui {
        Ui { quiet: true, verbose: false, progress: false }
    }

    /// A status line on stderr: `   tokenize  3000 rows → 2850 train / 150 eval`.
    pub fn status(&self, label: &str, msg: impl AsRef<str>) {
        if !self.quiet {
            eprintln!("{label:>10}  {}", msg.as_ref());
        }
    }

    pub fn detail(&self, msg: impl AsRef<str>) {
        if self.verbose && !self.quiet {
            eprintln!("            {}", msg.as_ref());
        }
    }

    pub fn warn(&self, msg: impl AsRef<str>) {
        eprintln!("   warning  {}", msg.as_ref());
    }

    /// Data for stdout.
    pub fn out(&self, text: impl AsRef<str>) {
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(text.as_ref().as_bytes());
        let _ = o.flush();
    }

    pub fn bar(&self, label: &str, total: u64) -> Bar {
        let inner = self.progress.then(|| {
            let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(8));
            pb.set_style(
                ProgressStyle::with_template("{prefix:>10}  [{bar:30}] {pos}/{len} {msg} ({eta})")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            pb.set_prefix(label.to_string());
            pb
        });
        Bar { inner, label: label.to_string(), total, quiet: self.quiet, next_log: 0, started: Instant::now() }
    }
}

/// Progress of one piece of long work.
pub struct Bar {
    inner: Option<ProgressBar>,
    label: String,
    total: u64,
    quiet: bool,
    next_log: u64,
    started: Instant,
}

impl Bar {
    pub fn set(&mut self, pos: u64, msg: &str) {
        match &self.inner {
            Some(pb) => {
                pb.set_position(pos);
                pb.set_message(msg.to_string());
            }
            None if !self.quiet && pos >= self.next_log && self.next_log <= self.total => {
                eprintln!("{:>10}  {pos}/{} {msg}", self.label, self.total);
                // Every tenth of the way, and the end once.
                self.next_log =
                    if pos >= self.total { u64::MAX } else { (pos + (self.total / 10).max(1)).min(self.total) };
            }
            None => {}
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn finish(&self) {
        if let Some(pb) = &self.inner {
            pb.finish_and_clear();
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.finish();
    }
}

/// `1.2 MiB`, `340 B`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{x:.1} {}", UNITS[u]) }
}

/// Render a miette diagnostic without colour, at a fixed width (tests and non-TTY output).
pub fn render_plain(d: &dyn miette::Diagnostic) -> String {
    let mut s = String::new();
    let handler = miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor()).with_width(100);
    let _ = handler.render_report(&mut s, d);
    s
}
