//! Structural checks of a recipe tree against the JSON Schema generated from the recipe types.
//!
//! serde stops at the first error and knows no spans; this walks the whole tree, collects every
//! problem (unknown keys with "did you mean", wrong types, missing fields, out-of-range and
//! non-finite numbers, unknown enum values) and points each one at its origin.

use serde_json::Value as J;

use super::diag::{Problem, did_you_mean};
use super::tree::{Node, Value};

pub struct Checker<'a> {
    /// The schema whose `$defs` resolve `$ref`s.
    root: &'a J,
    pub problems: Vec<Problem>,
}

impl<'a> Checker<'a> {
    pub fn new(root: &'a J) -> Checker<'a> {
        Checker { root, problems: Vec::new() }
    }

    /// `schema` with `$ref`s followed.
    pub fn resolve<'s>(&self, schema: &'s J) -> &'s J
    where
        'a: 's,
    {
        resolve(self.root, schema)
    }

    /// Check `node` (found at `path`) against `schema`.
    pub fn check(&mut self, node: &Node, schema: &J, path: &str) {
        let root = self.root;
        let schema = resolve(root, schema);
        if let Some(branches) = schema.get("anyOf").or_else(|| schema.get("oneOf")).and_then(J::as_array) {
            let branches: Vec<&J> = branches
                .iter()
                .map(|b| resolve(root, b))
                .filter(|b| b.get("type").and_then(J::as_str) != Some("null"))
                .collect();
            if let Some(values) = enum_values(&branches) {
                return self.check_enum(node, &values, path);
            }
            if let [only] = branches.as_slice() {
                return self.check(node, only, path);
            }
            // Several real alternatives: accept the first that reports nothing, else report
            // the alternative whose type matches.
            for b in &branches {
                let mut sub = Checker::new(self.root);
                sub.check(node, b, path);
                if sub.problems.is_empty() {
                    return;
                }
            }
            let matching = branches.iter().find(|b| type_matches(node, b)).unwrap_or(&branches[0]);
            return self.check(node, matching, path);
        }
        if let Some(values) = schema.get("enum").and_then(J::as_array) {
            let values: Vec<String> = values.iter().filter_map(|v| v.as_str().map(String::from)).collect();
            return self.check_enum(node, &values, path);
        }
        if let Some(c) = schema.get("const").and_then(J::as_str) {
            return self.check_enum(node, &[c.to_string()], path);
        }
        if !type_matches(node, schema) {
            let expected = expected_type(schema);
            self.problems.push(
                Problem::new(
                    "rtune::recipe::wrong_type",
                    format!("`{path}` must be {expected}, found {}", node.type_name()),
                )
                .at(node.origin.as_ref(), format!("expected {expected}")),
            );
            return;
        }
        match &node.value {
            Value::Int(i) => self.check_range(node, *i as f64, schema, path),
            Value::Float(f) => {
                if f.is_finite() {
                    self.check_range(node, *f, schema, path)
                } else {
                    self.problems.push(
                        Problem::new(
                            "rtune::recipe::not_finite",
                            format!("`{path}` must be a finite number, found {f}"),
                        )
                        .at(node.origin.as_ref(), "not a finite number"),
                    );
                }
            }
            Value::Str(s) => {
                if let Some(min) = schema.get("minLength").and_then(J::as_u64)
                    && (s.chars().count() as u64) < min
                {
                    self.problems.push(
                        Problem::new("rtune::recipe::empty", format!("`{path}` must not be empty"))
                            .at(node.origin.as_ref(), "empty"),
                    );
                }
            }
            Value::Array(items) => self.check_array(node, items, schema, path),
            Value::Table(_) => self.check_table(node, schema, path, &[]),
            Value::Bool(_) | Value::Datetime(_) => {}
        }
    }

    fn check_enum(&mut self, node: &Node, values: &[String], path: &str) {
        let listed = values.iter().map(|v| format!("`{v}`")).collect::<Vec<_>>().join(", ");
        let Some(s) = node.as_str() else {
            self.problems.push(
                Problem::new(
                    "rtune::recipe::wrong_type",
                    format!("`{path}` must be a string, one of {listed}; found {}", node.type_name()),
                )
                .at(node.origin.as_ref(), "expected a string"),
            );
            return;
        };
        if values.iter().any(|v| v == s) {
            return;
        }
        let mut p =
            Problem::new("rtune::recipe::invalid_value", format!("`{path}` must be one of {listed}, found `{s}`"))
                .at(node.origin.as_ref(), "not a known value");
        if let Some(m) = did_you_mean(s, values.iter().map(String::as_str)) {
            p = p.help(format!("did you mean `{m}`?"));
        }
        self.problems.push(p);
    }

    fn check_range(&mut self, node: &Node, x: f64, schema: &J, path: &str) {
        let bound = |k: &str| schema.get(k).and_then(J::as_f64);
        let fail = |what: String| {
            Problem::new("rtune::recipe::out_of_range", format!("`{path}` must be {what}, found {}", show_num(node)))
                .at(node.origin.as_ref(), "out of range")
        };
        if let Some(m) = bound("minimum").filter(|m| x < *m) {
            self.problems.push(fail(format!("at least {}", show(m))));
        } else if let Some(m) = bound("exclusiveMinimum").filter(|m| x <= *m) {
            self.problems.push(fail(format!("greater than {}", show(m))));
        } else if let Some(m) = bound("maximum").filter(|m| x > *m) {
            self.problems.push(fail(format!("at most {}", show(m))));
        } else if let Some(m) = bound("exclusiveMaximum").filter(|m| x >= *m) {
            self.problems.push(fail(format!("less than {}", show(m))));
        }
    }

    fn check_array(&mut self, node: &Node, items: &[Node], schema: &J, path: &str) {
        let len = items.len() as u64;
        let min = schema.get("minItems").and_then(J::as_u64);
        let max = schema.get("maxItems").and_then(J::as_u64);
        if min == Some(1) && len == 0 {
            self.problems.push(
                Problem::new("rtune::recipe::empty", format!("`{path}` must not be empty"))
                    .at(node.origin.as_ref(), "empty list"),
            );
        } else if min.is_some_and(|m| len < m) || max.is_some_and(|m| len > m) {
            let want = match (min, max) {
                (Some(a), Some(b)) if a == b => format!("exactly {a}"),
                (Some(a), _) if len < a => format!("at least {a}"),
                (_, Some(b)) => format!("at most {b}"),
                _ => String::from("a different number of"),
            };
            self.problems.push(
                Problem::new("rtune::recipe::wrong_length", format!("`{path}` must have {want} items, found {len}"))
                    .at(node.origin.as_ref(), format!("{len} item{}", if len == 1 { "" } else { "s" })),
            );
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                self.check(item, item_schema, &format!("{path}[{i}]"));
            }
        }
    }

    /// Check a table's keys. `allow` names keys handled elsewhere (skipped here).
    pub fn check_table(&mut self, node: &Node, schema: &J, path: &str, allow: &[&str]) {
        let root = self.root;
        let schema = resolve(root, schema);
        let Some(table) = node.as_table() else { return };
        let empty = serde_json::Map::new();
        let props = schema.get("properties").and_then(J::as_object).unwrap_or(&empty);
        let closed = schema.get("additionalProperties") == Some(&J::Bool(false));
        let extra = schema.get("additionalProperties").filter(|a| a.is_object());
        for (key, entry) in table {
            if allow.contains(&key.as_str()) {
                continue;
            }
            let child = join(path, key);
            if let Some(s) = props.get(key) {
                self.check(&entry.node, s, &child);
            } else if let Some(s) = extra {
                self.check(&entry.node, s, &child);
            } else if closed {
                let names = props.keys().map(String::as_str).chain(allow.iter().copied());
                self.problems.push(unknown_key(key, path, entry.key.as_ref(), names));
            }
        }
        if let Some(required) = schema.get("required").and_then(J::as_array) {
            for r in required.iter().filter_map(J::as_str) {
                if !table.contains_key(r) {
                    let what = if path.is_empty() { "the recipe".to_string() } else { format!("`[{path}]`") };
                    let hint = props.get(r).map(|s| self.describe(s)).unwrap_or_default();
                    self.problems.push(
                        Problem::new("rtune::recipe::missing_field", format!("{what} is missing `{r}`"))
                            .at(node.origin.as_ref(), format!("`{r}` is required here"))
                            .help(format!("add `{r} = …`{hint}")),
                    );
                }
            }
        }
    }

    /// A short description of what a schema accepts, for help lines.
    fn describe(&self, schema: &J) -> String {
        let s = self.resolve(schema);
        let branches: Vec<&J> = s
            .get("anyOf")
            .or_else(|| s.get("oneOf"))
            .and_then(J::as_array)
            .map(|b| b.iter().map(|x| self.resolve(x)).collect())
            .unwrap_or_else(|| vec![s]);
        if let Some(values) = enum_values(&branches).or_else(|| {
            s.get("enum").and_then(J::as_array).map(|v| v.iter().filter_map(|x| x.as_str().map(String::from)).collect())
        }) {
            return format!(" (one of {})", values.iter().map(|v| format!("`\"{v}\"`")).collect::<Vec<_>>().join(", "));
        }
        match s.get("description").and_then(J::as_str) {
            Some(d) => format!(": {}", d.lines().next().unwrap_or_default()),
            None => String::new(),
        }
    }
}

/// Follow `$ref`s into the root schema's `$defs`.
fn resolve<'s>(root: &'s J, schema: &'s J) -> &'s J {
    let mut s = schema;
    while let Some(r) = s.get("$ref").and_then(J::as_str) {
        let name = r.rsplit('/').next().unwrap_or_default();
        match root.get("$defs").and_then(|d| d.get(name)) {
            Some(target) => s = target,
            None => break,
        }
    }
    s
}

pub fn unknown_key<'a>(
    key: &str,
    path: &str,
    origin: Option<&super::diag::Origin>,
    names: impl Iterator<Item = &'a str> + Clone,
) -> Problem {
    let where_ = if path.is_empty() { "the recipe".to_string() } else { format!("`[{path}]`") };
    let mut p = Problem::new("rtune::recipe::unknown_key", format!("unknown key `{key}` in {where_}"))
        .at(origin, "unknown key");
    if let Some(m) = did_you_mean(key, names.clone()) {
        p = p.help(format!("did you mean `{m}`?"));
    } else {
        let mut all: Vec<&str> = names.collect();
        all.sort();
        p = p.help(format!("known keys: {}", all.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")));
    }
    p
}

pub fn join(path: &str, key: &str) -> String {
    if path.is_empty() { key.to_string() } else { format!("{path}.{key}") }
}

/// If every branch is a string constant (or enum), the allowed strings.
fn enum_values(branches: &[&J]) -> Option<Vec<String>> {
    let mut out = Vec::new();
    for b in branches {
        if let Some(c) = b.get("const").and_then(J::as_str) {
            out.push(c.to_string());
        } else if let Some(vs) = b.get("enum").and_then(J::as_array) {
            out.extend(vs.iter().filter_map(|v| v.as_str().map(String::from)));
        } else {
            return None;
        }
    }
    (!out.is_empty()).then_some(out)
}

fn schema_types(schema: &J) -> Vec<&str> {
    match schema.get("type") {
        Some(J::String(t)) => vec![t.as_str()],
        Some(J::Array(ts)) => ts.iter().filter_map(J::as_str).collect(),
        _ => Vec::new(),
    }
}

fn type_matches(node: &Node, schema: &J) -> bool {
    let types = schema_types(schema);
    if types.is_empty() {
        return true;
    }
    types.iter().any(|t| {
        matches!(
            (*t, &node.value),
            ("string", Value::Str(_))
                | ("integer", Value::Int(_))
                | ("number", Value::Int(_) | Value::Float(_))
                | ("boolean", Value::Bool(_))
                | ("array", Value::Array(_))
                | ("object", Value::Table(_))
        )
    })
}

fn expected_type(schema: &J) -> String {
    let names: Vec<&str> = schema_types(schema)
        .into_iter()
        .filter(|t| *t != "null")
        .map(|t| match t {
            "string" => "a string",
            "integer" => "an integer",
            "number" => "a number",
            "boolean" => "a boolean (`true` or `false`)",
            "array" => "an array",
            "object" => "a table",
            _ => "a value",
        })
        .collect();
    names.join(" or ")
}

fn show(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 { format!("{}", x as i64) } else { format!("{x}") }
}

fn show_num(node: &Node) -> String {
    match node.value {
        Value::Int(i) => i.to_string(),
        Value::Float(f) => super::diag::show(&serde_json::json!(f)),
        _ => String::new(),
    }
}
