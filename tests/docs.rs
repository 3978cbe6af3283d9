//! The commands in README.md and docs/*.md cannot drift from the CLI: every `rtune …` line in a
//! fenced code block must parse with rtune's own argument parser, and every `scripts/…` it
//! names must exist. (README's output blocks are also run and compared, in tests/pipeline.rs.)

mod common;

/// The binary's own command-line definition (clap only, no library types), compiled here.
#[allow(dead_code)]
#[path = "../src/cli/args.rs"]
mod cli;

use clap::Parser;
use common::root;

/// Split a command line as a POSIX shell would for the simple quoting docs use ('…' and "…").
fn words(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    for c in line.chars() {
        match (quote, c) {
            (None, '\'' | '"') => (quote, any) = (Some(c), true),
            (Some(q), c) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            (_, c) => (cur, any) = (cur + &c.to_string(), true),
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// `rtune …` lines (after an optional `$ ` prompt and environment assignments) in fenced code
/// blocks, without trailing comments, with their file and line.
fn documented_commands() -> Vec<(String, usize, Vec<String>)> {
    let mut files = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut fenced = false;
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                continue;
            }
            if !fenced {
                continue;
            }
            let line = line.trim().strip_prefix("$ ").unwrap_or(line.trim());
            let line = line.split(" # ").next().unwrap_or_default().trim_end();
            let mut w = words(line);
            while w.first().is_some_and(|x| x.contains('=') && !x.starts_with('-')) {
                w.remove(0);
            }
            let is_rtune = w.first().is_some_and(|x| x == "rtune" || x.ends_with("/rtune"));
            if is_rtune && !line.contains('…') && !line.contains('<') {
                let name = f.strip_prefix(root()).unwrap().display().to_string();
                out.push((name, i + 1, w));
            }
        }
    }
    out
}

#[test]
fn documented_commands_parse() {
    let commands = documented_commands();
    assert!(commands.len() >= 10, "found only {} commands: {commands:?}", commands.len());
    let mut bad = Vec::new();
    for (file, line, w) in &commands {
        if let Err(e) = cli::Cli::try_parse_from(w) {
            bad.push(format!("{file}:{line}: `{}`: {}", w.join(" "), e.kind()));
        }
    }
    assert!(bad.is_empty(), "documented commands the CLI rejects:\n{}", bad.join("\n"));
}

#[test]
fn documented_scripts_exist() {
    let mut missing = Vec::new();
    let mut files = vec![root().join("README.md")];
    files.extend(std::fs::read_dir(root().join("docs")).unwrap().map(|e| e.unwrap().path()));
    for f in files.iter().filter(|p| p.extension().is_some_and(|x| x == "md")) {
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in text.lines().enumerate() {
            for part in line.split(|c: char| c.is_whitespace() || "`()[],;:\"'".contains(c)) {
                let named = ["scripts/", "tests/fixtures/", "recipes/data/", "benches/reference/"].iter().any(|dir| {
                    part.strip_prefix(dir).is_some_and(|rest| [".py", ".sh", ".go"].iter().any(|e| rest.ends_with(e)))
                });
                if named && !root().join(part).exists() {
                    missing.push(format!("{}:{}: {part}", f.display(), i + 1));
                }
            }
        }
    }
    assert!(missing.is_empty(), "docs name scripts that do not exist:\n{}", missing.join("\n"));
}

/// `scripts/` is grouped by job, one naming style: `<group>/<kebab-case>.{sh,py}`, nothing loose.
/// (Fixture makers live beside their fixtures, not here: docs/architecture.md.)
#[test]
fn scripts_are_grouped_by_job_in_kebab_case() {
    let groups = ["bench", "gpu", "interop", "toolchain"];
    let mut bad = Vec::new();
    for e in std::fs::read_dir(root().join("scripts")).unwrap() {
        let e = e.unwrap();
        let group = e.file_name().to_string_lossy().into_owned();
        if !e.path().is_dir() || !groups.contains(&group.as_str()) {
            bad.push(format!("scripts/{group}: not one of the groups {groups:?}"));
            continue;
        }
        for s in std::fs::read_dir(e.path()).unwrap() {
            let name = s.unwrap().file_name().to_string_lossy().into_owned();
            if name == "__pycache__" {
                continue; // Python's own, ignored by git
            }
            let stem = [".sh", ".py", ".go"].iter().find_map(|ext| name.strip_suffix(ext));
            let kebab = stem.is_some_and(|s| {
                !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            });
            if !kebab {
                bad.push(format!("scripts/{group}/{name}: not <kebab-case>.sh, .py or .go"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn the_splitter_understands_quotes() {
    assert_eq!(
        words("rtune download a --include '*.json' --set \"x=1 2\""),
        ["rtune", "download", "a", "--include", "*.json", "--set", "x=1 2"]
    );
}
