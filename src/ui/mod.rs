//! The only place that prints. stdout carries data (tables, JSON, paths); stderr carries
//! progress and messages for people. Progress bars appear only on a terminal and never when
//! `RTUNE_NO_PROGRESS` is set; otherwise long work logs a plain line every tenth of the way.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

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
        warn(msg);
    }

    /// Text for people on stderr, as is (a plan before a run), unless quiet.
    pub fn message(&self, text: impl AsRef<str>) {
        if !self.quiet {
            eprint!("{}", text.as_ref());
        }
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

/// Progress of a transfer of several files: an overall bar and one for the current file on a
/// terminal; otherwise a plain line as each file starts and every tenth of the total bytes.
pub struct Transfer {
    multi: Option<(MultiProgress, ProgressBar, ProgressBar)>,
    label: String,
    total: u64,
    quiet: bool,
    next_log: u64,
}

impl Ui {
    pub fn transfer(&self, label: &str, total_bytes: u64) -> Transfer {
        let multi = self.progress.then(|| {
            let mp = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(8));
            let style = |t: &str| ProgressStyle::with_template(t).expect("valid template").progress_chars("=> ");
            let overall = mp.add(ProgressBar::new(total_bytes));
            overall.set_style(style("{prefix:>10}  [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ({eta}) {msg}"));
            overall.set_prefix(label.to_string());
            let file = mp.add(ProgressBar::new(0));
            file.set_style(style("{prefix:>10}  [{bar:30}] {bytes}/{total_bytes} {msg}"));
            (mp, overall, file)
        });
        Transfer { multi, label: label.to_string(), total: total_bytes, quiet: self.quiet, next_log: 0 }
    }
}

impl Transfer {
    /// A new file of `size` bytes starts; `done` bytes of the whole transfer are behind.
    pub fn start_file(&mut self, name: &str, size: u64, index: usize, count: usize) {
        match &self.multi {
            Some((_, overall, file)) => {
                overall.set_message(format!("file {index}/{count}"));
                file.set_length(size);
                file.set_position(0);
                file.set_message(name.to_string());
            }
            None if !self.quiet => eprintln!("{:>10}  [{index}/{count}] {name} ({})", self.label, human_bytes(size)),
            None => {}
        }
    }

    /// Bytes of the current file so far, and of the whole transfer.
    pub fn set(&mut self, file_pos: u64, total_pos: u64) {
        match &self.multi {
            Some((_, overall, file)) => {
                file.set_position(file_pos);
                overall.set_position(total_pos);
            }
            None if !self.quiet && total_pos >= self.next_log && self.next_log <= self.total && total_pos > 0 => {
                eprintln!("{:>10}  {} of {}", self.label, human_bytes(total_pos), human_bytes(self.total));
                self.next_log = next_tenth(total_pos, self.total);
            }
            None => {}
        }
    }

    pub fn finish(&self) {
        if let Some((mp, overall, file)) = &self.multi {
            file.finish_and_clear();
            overall.finish_and_clear();
            let _ = mp.clear();
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        self.finish();
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
                self.next_log = next_tenth(pos, self.total);
            }
            None => {}
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// A status line printed above the bar (or as a plain line when there is none).
    pub fn status(&self, label: &str, msg: impl AsRef<str>) {
        match &self.inner {
            Some(pb) => pb.suspend(|| eprintln!("{label:>10}  {}", msg.as_ref())),
            None if !self.quiet => eprintln!("{label:>10}  {}", msg.as_ref()),
            None => {}
        }
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

/// Where the next plain progress line goes: a tenth of the way on, and the end exactly once.
fn next_tenth(pos: u64, total: u64) -> u64 {
    if pos >= total { u64::MAX } else { (pos + (total / 10).max(1)).min(total) }
}

/// A warning from code that holds no [`Ui`] (a device's first-use checks, a switch it ignores):
/// the same line as [`Ui::warn`], printed even when quiet, as warnings are.
pub fn warn(msg: impl AsRef<str>) {
    eprintln!("   warning  {}", msg.as_ref());
}

/// Lines for people on stderr from code that holds no [`Ui`], as they are: a report a switch
/// asked for (`RTUNE_PROFILE`'s kernel times), the interrupt notice.
pub fn note(text: impl AsRef<str>) {
    eprintln!("{}", text.as_ref());
}

/// A failed command's diagnostic on stderr: in colour on a terminal (unless `NO_COLOR`), at
/// `COLUMNS` wide; plain (as [`render_plain`]) otherwise.
pub fn report_error(e: &dyn miette::Diagnostic) {
    let color = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    if color {
        let width = std::env::var("COLUMNS").ok().and_then(|c| c.parse().ok()).unwrap_or(100);
        let handler = miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode()).with_width(width);
        let mut s = String::new();
        let _ = handler.render_report(&mut s, e);
        eprint!("{s}");
    } else {
        eprint!("{}", render_plain(e));
    }
}

/// `1 file`, `3 files`: a count with its noun (plural by an `s`).
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}s") }
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

/// `s` as one word for POSIX shells: as is when it holds only characters no shell treats
/// specially, else in single quotes (a quote inside becomes `'\''`). Suggested commands are
/// pasted into terminals, and names come from listings, lock files and recipes.
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-./:@=+,%".contains(&b));
    if plain { s.to_string() } else { format!("'{}'", s.replace('\'', r"'\''")) }
}

#[cfg(test)]
mod quote_tests {
    use super::shell_quote;

    #[test]
    fn suggested_commands_quote_for_posix_shells() {
        assert_eq!(shell_quote("org/model-1.5B"), "org/model-1.5B");
        assert_eq!(shell_quote("*.safetensors"), "'*.safetensors'");
        assert_eq!(shell_quote("a'; touch pwned; echo '"), r"'a'\''; touch pwned; echo '\'''");
        assert_eq!(shell_quote("$(touch pwned)"), "'$(touch pwned)'");
        assert_eq!(shell_quote(""), "''");
        // What a shell makes of the quoted word is the original string.
        for s in ["a'b", "$(x)", "`x`", "a b\tc", "'"] {
            let out = std::process::Command::new("sh").arg("-c").arg(format!("printf %s {}", shell_quote(s))).output();
            if let Ok(out) = out {
                assert_eq!(String::from_utf8_lossy(&out.stdout), s);
            }
        }
    }
}
