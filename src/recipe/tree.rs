//! A TOML value tree in which every key and value remembers its [`Origin`].
//!
//! Layering (recipe file < `RTUNE_*` env < `--set`) merges trees, so a value keeps the origin of
//! the layer that set it, and every later error can point at the right text.

use std::collections::BTreeMap;
use std::sync::Arc;

use toml::de::{DeTable, DeValue};

use super::diag::{Origin, Problem, SourceText};

#[derive(Debug, Clone)]
pub enum Value {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Datetime(String),
    Array(Vec<Node>),
    Table(BTreeMap<String, Entry>),
}

#[derive(Debug, Clone)]
pub struct Node {
    pub value: Value,
    pub origin: Option<Origin>,
}

/// A table entry: the key's own origin (for "unknown key" labels) and its value.
#[derive(Debug, Clone)]
pub struct Entry {
    pub key: Option<Origin>,
    pub node: Node,
}

impl Node {
    pub fn table(origin: Option<Origin>) -> Node {
        Node { value: Value::Table(BTreeMap::new()), origin }
    }

    /// The name of this value's TOML type, as messages say it.
    pub fn type_name(&self) -> &'static str {
        match self.value {
            Value::Str(_) => "a string",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a float",
            Value::Bool(_) => "a boolean",
            Value::Datetime(_) => "a datetime",
            Value::Array(_) => "an array",
            Value::Table(_) => "a table",
        }
    }

    pub fn as_table(&self) -> Option<&BTreeMap<String, Entry>> {
        match &self.value {
            Value::Table(t) => Some(t),
            _ => None,
        }
    }

    pub fn as_table_mut(&mut self) -> Option<&mut BTreeMap<String, Entry>> {
        match &mut self.value {
            Value::Table(t) => Some(t),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match &self.value {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The node at a dotted path of table keys.
    pub fn get(&self, path: &[&str]) -> Option<&Node> {
        let mut node = self;
        for key in path {
            node = &node.as_table()?.get(*key)?.node;
        }
        Some(node)
    }

    /// The entry (key origin and node) at a path.
    pub fn entry(&self, path: &[&str]) -> Option<&Entry> {
        let (last, parents) = path.split_last()?;
        self.get(parents)?.as_table()?.get(*last)
    }

    /// Plain JSON, for deserialising into the typed recipe once the tree has been checked.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match &self.value {
            Value::Str(s) | Value::Datetime(s) => J::String(s.clone()),
            Value::Int(i) => J::from(*i),
            Value::Float(f) => serde_json::Number::from_f64(*f).map(J::Number).unwrap_or(J::Null),
            Value::Bool(b) => J::Bool(*b),
            Value::Array(items) => J::Array(items.iter().map(Node::to_json).collect()),
            Value::Table(t) => J::Object(t.iter().map(|(k, e)| (k.clone(), e.node.to_json())).collect()),
        }
    }

    /// Merge `other` into `self`: tables merge key by key, anything else replaces.
    pub fn merge(&mut self, other: Node) {
        match (&mut self.value, other.value) {
            (Value::Table(mine), Value::Table(theirs)) => {
                for (k, e) in theirs {
                    match mine.get_mut(&k) {
                        Some(existing) => existing.node.merge(e.node),
                        None => {
                            mine.insert(k, e);
                        }
                    }
                }
            }
            (_, value) => {
                self.value = value;
                self.origin = other.origin;
            }
        }
    }

    /// Set the value at a dotted path, creating tables on the way (with the setter's origin).
    pub fn set_path(&mut self, path: &[String], value: Node, origin: &Origin) -> Result<(), Problem> {
        let mut node = self;
        for (i, key) in path.iter().enumerate() {
            let type_name = node.type_name();
            let Some(table) = node.as_table_mut() else {
                return Err(Problem::new(
                    "rtune::recipe::bad_set",
                    format!("cannot set `{}`: `{}` is {}", path.join("."), path[..i].join("."), type_name),
                )
                .at(Some(origin), "this key"));
            };
            let last = i + 1 == path.len();
            let entry = table
                .entry(key.clone())
                .or_insert_with(|| Entry { key: Some(origin.clone()), node: Node::table(Some(origin.clone())) });
            if last {
                entry.node.merge(value);
                return Ok(());
            }
            node = &mut entry.node;
        }
        Ok(())
    }
}

/// Convert a parsed TOML document into a tree whose origins point into `source`.
pub fn from_toml(table: &toml::Spanned<DeTable<'_>>, source: &Arc<SourceText>) -> Node {
    Node {
        value: Value::Table(convert_table(table.get_ref(), source)),
        origin: Some(Origin::new(source, table.span())),
    }
}

fn convert_table(table: &DeTable<'_>, source: &Arc<SourceText>) -> BTreeMap<String, Entry> {
    table
        .iter()
        .map(|(k, v)| {
            let entry = Entry { key: Some(Origin::new(source, k.span())), node: convert(v, source) };
            (k.get_ref().to_string(), entry)
        })
        .collect()
}

pub fn convert(value: &toml::Spanned<DeValue<'_>>, source: &Arc<SourceText>) -> Node {
    let origin = Some(Origin::new(source, value.span()));
    let value = match value.get_ref() {
        DeValue::String(s) => Value::Str(s.to_string()),
        DeValue::Integer(i) => {
            let digits = i.as_str().replace('_', "");
            match i64::from_str_radix(&digits, i.radix()) {
                Ok(n) => Value::Int(n),
                // Out of i64 range: keep it as a float so the range check reports it.
                Err(_) => Value::Float(digits.parse().unwrap_or(f64::INFINITY)),
            }
        }
        DeValue::Float(f) => Value::Float(parse_float(f.as_str())),
        DeValue::Boolean(b) => Value::Bool(*b),
        DeValue::Datetime(d) => Value::Datetime(d.to_string()),
        DeValue::Array(items) => Value::Array(items.into_iter().map(|v| convert(v, source)).collect()),
        DeValue::Table(t) => Value::Table(convert_table(t, source)),
    };
    Node { value, origin }
}

fn parse_float(text: &str) -> f64 {
    let clean = text.replace('_', "");
    clean.parse().unwrap_or_else(|_| if clean.contains("nan") { f64::NAN } else { f64::INFINITY })
}
