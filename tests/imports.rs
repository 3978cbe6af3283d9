//! No import cycles between modules (issue 20): for every module, the dependency graph between
//! its child modules (each standing for everything inside it) must be acyclic. A child may use
//! its parent's items and a parent its children's — that is how a folder presents its parts —
//! but two siblings that need each other are one concern split in two, or two concerns
//! tangled. The graph is read from the source: every `crate::…`, `super::…` and `self::…` path
//! in code (use trees expanded; comments ignored), resolved to the deepest module it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path (e.g. `["model", "lora"]`) → the source of the file that holds it.
fn modules(src: &Path) -> BTreeMap<Vec<String>, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> =
                rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            if parts.last().is_some_and(|l| l == "mod") || parts == ["lib"] {
                parts.pop();
            }
            if parts == ["main"] {
                continue; // the binary crate: it only uses the library
            }
            out.insert(parts, std::fs::read_to_string(&p).unwrap());
        }
    }
    out
}

/// The code of `text` without comments and string literals (doc links are not dependencies).
fn code(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            if !in_str && c == '/' && chars.peek() == Some(&'/') {
                break;
            }
            if c == '"' && prev != '\\' && prev != '\'' {
                in_str = !in_str;
                prev = c;
                continue;
            }
            if !in_str {
                out.push(c);
            }
            prev = if prev == '\\' && c == '\\' { ' ' } else { c };
        }
        out.push('\n');
    }
    out
}

/// Expand a use tree (`a::{b, c::{d, e}}`) into its paths.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else { return vec![tree.to_string()] };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').unwrap()];
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(|p| expand(p).into_iter().map(move |x| format!("{prefix}{x}")))
        .collect()
}

/// The module paths `text` (the module `at`) refers to: `crate::`, `super::` and `self::` paths
/// in use trees and in code.
fn references(at: &[String], text: &str) -> Vec<Vec<String>> {
    let code = code(text);
    let mut paths = Vec::new();
    // Use statements (possibly spanning lines), expanded.
    let mut rest = code.as_str();
    while let Some(i) = rest.find("use ") {
        let before = rest[..i].chars().last();
        rest = &rest[i + 4..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let end = rest.find(';').unwrap_or(rest.len());
        paths.extend(expand(&rest[..end]).into_iter().map(|p| p.split(" as ").next().unwrap().trim().to_string()));
    }
    // Inline paths.
    let bytes = code.as_bytes();
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let i = from + i;
            from = i + start.len();
            if i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':') {
                continue;
            }
            let end =
                code[i..].find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).map_or(code.len(), |e| i + e);
            paths.push(code[i..end].trim_end_matches(':').to_string());
        }
    }
    paths
        .into_iter()
        .filter_map(|p| {
            let segs: Vec<&str> = p.split("::").map(str::trim).filter(|s| !s.is_empty()).collect();
            let mut abs: Vec<String> = match segs.first()? {
                &"crate" => vec![],
                &"super" | &"self" => at.to_vec(),
                _ => return None,
            };
            for (k, s) in segs.iter().enumerate() {
                match *s {
                    "crate" if k == 0 => {}
                    "self" => {}
                    "super" => {
                        abs.pop();
                    }
                    s => abs.push(s.to_string()),
                }
            }
            Some(abs)
        })
        .collect()
}

/// The cycles among the children of each module, as `parent: a -> b -> a`.
fn cycles(mods: &BTreeMap<Vec<String>, String>) -> Vec<String> {
    // Every (from module, to module) edge, `to` being the deepest module the path names.
    let mut edges: BTreeSet<(Vec<String>, Vec<String>)> = BTreeSet::new();
    for (at, text) in mods {
        for r in references(at, text) {
            let to = (0..=r.len()).rev().map(|n| r[..n].to_vec()).find(|m| mods.contains_key(m)).unwrap_or_default();
            edges.insert((at.clone(), to));
        }
    }
    let mut found = Vec::new();
    let parents: BTreeSet<Vec<String>> =
        mods.keys().filter(|m| !m.is_empty()).map(|m| m[..m.len() - 1].to_vec()).collect();
    for parent in parents {
        let n = parent.len();
        // Child of `parent` that `m` lies in, if any.
        let child = |m: &Vec<String>| (m.len() > n && m[..n] == parent[..]).then(|| m[n].clone());
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in &edges {
            if let (Some(x), Some(y)) = (child(a), child(b))
                && x != y
            {
                graph.entry(x).or_default().insert(y);
            }
        }
        // Depth-first search for a back edge.
        fn visit(
            v: &str,
            g: &BTreeMap<String, BTreeSet<String>>,
            state: &mut BTreeMap<String, u8>,
            path: &mut Vec<String>,
            out: &mut Vec<String>,
        ) {
            state.insert(v.to_string(), 1);
            path.push(v.to_string());
            for w in g.get(v).into_iter().flatten() {
                match state.get(w.as_str()) {
                    Some(1) => {
                        let k = path.iter().position(|p| p == w).unwrap();
                        out.push(format!("{} -> {w}", path[k..].join(" -> ")));
                    }
                    Some(_) => {}
                    None => visit(w, g, state, path, out),
                }
            }
            path.pop();
            state.insert(v.to_string(), 2);
        }
        let mut state = BTreeMap::new();
        let mut out = Vec::new();
        for v in graph.keys() {
            if !state.contains_key(v.as_str()) {
                visit(v, &graph, &mut state, &mut Vec::new(), &mut out);
            }
        }
        let name = if parent.is_empty() { "crate".to_string() } else { parent.join("::") };
        found.extend(out.into_iter().map(|c| format!("{name}: {c}")));
    }
    found
}

#[test]
fn no_module_needs_a_sibling_that_needs_it() {
    let mods = modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(mods.len() > 40 && mods.contains_key(&vec!["model".to_string(), "lora".to_string()]));
    let found = cycles(&mods);
    assert!(found.is_empty(), "import cycles between sibling modules:\n{}", found.join("\n"));
}

/// The checker finds a cycle through a use tree, a `super::` path and an inline path, and
/// ignores comments, strings and parent–child references.
#[test]
fn the_cycle_checker_sees_use_trees_super_and_inline_paths() {
    let m = |k: &[&str], text: &str| (k.iter().map(|s| s.to_string()).collect::<Vec<_>>(), text.to_string());
    let mods: BTreeMap<_, _> = [
        m(&[], "pub mod a; pub mod b; pub mod c;"),
        m(&["a"], "use crate::{b::{X, Y as Z}, a::inner};\n// crate::c::Never\nfn f() { let _ = \"crate::c::no\"; }"),
        m(&["a", "inner"], "use super::super::c::W;"),
        m(&["b"], "fn g() { crate::a::inner::h(); let _ = crate::b::g; }"),
        m(&["c"], "use crate::a::inner; fn k() { super::a::f() }"),
    ]
    .into_iter()
    .collect();
    let found = cycles(&mods);
    assert_eq!(found, ["crate: a -> b -> a", "crate: a -> c -> a"], "{found:?}");
    assert_eq!(expand("x::{a, b::{c, d}, e as f}"), ["x::a", "x::b::c", "x::b::d", "x::e as f"]);
}

/// Planning (the plan, its keys and sources) knows recipes, the store, the device policy and the
/// inputs it resolves (data files, the Hub), never what computes: no training loop, engine,
/// model code, export writer, stage executor or executor of plans — so `plan` stays fast to
/// test, and a stage's key cannot depend on how an engine happens to run (shared/STYLE.md:
/// planning never touches candle).
#[test]
fn planning_imports_no_compute_module() {
    let mods = modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let compute = ["train", "engine", "model", "export", "stage", "exec"];
    let mut found = Vec::new();
    for (at, text) in mods.iter().filter(|(m, _)| m.first().is_some_and(|m| m == "plan")) {
        for r in references(at, text) {
            if r.first().is_some_and(|m| compute.contains(&m.as_str())) {
                found.push(format!("{} uses {}", at.join("::"), r.join("::")));
            }
        }
    }
    assert!(found.is_empty(), "planning imports compute modules:\n{}", found.join("\n"));
}

/// All terminal output goes through `ui` (issue 58's thin CLI): no other file of the library or
/// the binary prints, so quiet mode, progress bars and the stdout/stderr split hold everywhere.
#[test]
fn only_ui_prints() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = modules(&src);
    files.insert(vec!["main".into()], std::fs::read_to_string(src.join("main.rs")).unwrap());
    let mut bad = Vec::new();
    for (path, text) in &files {
        if path.first().is_some_and(|m| m == "ui") {
            continue;
        }
        let code = code(text);
        for mac in ["println!", "eprintln!", "print!", "eprint!", "dbg!"] {
            let hit = code.match_indices(mac).any(|(i, _)| {
                // A whole word: not `eprintln!` found inside `println!`'s search, not `xprint!`.
                code[..i].chars().next_back().is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
            });
            if hit {
                bad.push(format!("src/{}: {mac}", path.join("/")));
            }
        }
    }
    assert!(bad.is_empty(), "printing outside src/ui (use rtune::ui):\n{}", bad.join("\n"));
}
