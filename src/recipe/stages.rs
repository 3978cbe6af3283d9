//! The stage graph of a recipe: kinds, default `needs`, implicit stages, cycles.
//!
//! Each kind reads and produces named kinds of artifact ([`Port`]). A stage's `needs` defaults
//! to the producers of what its kind reads; `download` and `tokenize` are added implicitly when
//! something needs them and the recipe does not list them.

use std::collections::{BTreeMap, BTreeSet};

use petgraph::graph::DiGraph;
use serde_json::Value as J;

use super::check::{Checker, unknown_key};
use super::diag::{Problem, did_you_mean};
use super::tree::{Node, Value};
use super::types::{DEVICE_DTYPE_KEY, EvalModel, StageKind, StageSettings};

/// A kind of artifact that flows between stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Port {
    Model,
    Dataset,
    Tokens,
    Weights,
    Exports,
}

impl Port {
    pub fn describe(self) -> &'static str {
        match self {
            Port::Model => "the base model",
            Port::Dataset => "the dataset",
            Port::Tokens => "tokenized data",
            Port::Weights => "trained weights",
            Port::Exports => "exported models",
        }
    }
}

pub fn produces(kind: StageKind) -> &'static [Port] {
    match kind {
        StageKind::Download => &[Port::Model, Port::Dataset],
        StageKind::Tokenize => &[Port::Tokens],
        StageKind::Train => &[Port::Weights],
        StageKind::Evaluate => &[],
        StageKind::Quantize => &[Port::Exports],
        StageKind::Upload => &[],
    }
}

/// What a stage reads; `evaluate` with `model = "base"` needs no trained weights.
pub fn reads(settings: &StageSettings) -> Vec<Port> {
    match settings {
        StageSettings::Download(_) => vec![],
        StageSettings::Tokenize(_) => vec![Port::Model, Port::Dataset],
        StageSettings::Train(_) => vec![Port::Model, Port::Tokens],
        StageSettings::Evaluate(e) => {
            // With its own `dataset`, an evaluate stage tokenizes that itself.
            let mut ports = vec![Port::Model];
            if e.dataset.is_none() {
                ports.push(Port::Tokens);
            }
            if e.model != EvalModel::Base {
                ports.push(Port::Weights);
            }
            ports
        }
        StageSettings::Quantize(_) => vec![Port::Model, Port::Tokens, Port::Weights],
        StageSettings::Upload(_) => vec![Port::Exports],
    }
}

fn default_producer(port: Port) -> Option<StageKind> {
    match port {
        Port::Model | Port::Dataset => Some(StageKind::Download),
        Port::Tokens => Some(StageKind::Tokenize),
        _ => None,
    }
}

#[derive(Debug, Clone)]
pub struct StageSpec {
    pub name: String,
    pub needs: Vec<String>,
    /// The settings as written (no device's overrides), typed when the recipe loads; their
    /// variant is the stage's kind.
    pub settings: StageSettings,
    /// Added by rtune because another stage needs it.
    pub implicit: bool,
    /// The table as written, without `kind` and `needs`: device overrides merge over it.
    table: serde_json::Map<String, J>,
    /// This stage's `[device.<name>.<stage>]` tables, by device name.
    device_tables: BTreeMap<String, serde_json::Map<String, J>>,
}

/// A stage's settings on one device: that device's override tables merged over the stage's
/// table as trees, then typed.
#[derive(Debug, Clone)]
pub struct Settled {
    pub settings: StageSettings,
    /// The keys the recipe writes (in the stage's table or an override), not left to defaults.
    pub written: BTreeSet<String>,
}

impl StageSpec {
    /// A stage added because another needs it: `download` and `tokenize` have no settings.
    fn implicit(kind: StageKind) -> Option<StageSpec> {
        let settings = match kind {
            StageKind::Download => StageSettings::Download(Default::default()),
            StageKind::Tokenize => StageSettings::Tokenize(Default::default()),
            _ => return None,
        };
        Some(StageSpec {
            name: kind.as_str().to_string(),
            needs: vec![],
            settings,
            implicit: true,
            table: serde_json::Map::new(),
            device_tables: BTreeMap::new(),
        })
    }

    pub fn kind(&self) -> StageKind {
        self.settings.kind()
    }

    /// The stage's table with its defaults filled in: its settings, its `kind` where the name
    /// is not one, and its `needs`.
    pub fn resolved(&self) -> J {
        let mut table = serde_json::to_value(&self.settings).expect("settings serialise");
        if let Some(t) = table.as_object_mut() {
            if StageKind::parse(&self.name) != Some(self.kind()) {
                t.insert("kind".into(), J::from(self.kind().as_str()));
            }
            t.insert("needs".into(), J::from(self.needs.clone()));
        }
        table
    }

    /// The settings on a device whose override tables are `overrides`, merged in order (a
    /// device's `override_names`: the broadest first; none: the settings as written).
    pub fn on(&self, overrides: &[String]) -> serde_json::Result<Settled> {
        let mut applied = overrides.iter().filter_map(|d| self.device_tables.get(d)).peekable();
        if applied.peek().is_none() {
            return Ok(Settled { settings: self.settings.clone(), written: self.table.keys().cloned().collect() });
        }
        let mut table = self.table.clone();
        for over in applied {
            merge(&mut table, over);
        }
        Ok(Settled { settings: StageSettings::parse(self.kind(), &table)?, written: table.keys().cloned().collect() })
    }

    /// The port → producing stage map for this stage's needs.
    pub fn inputs<'a>(&self, stages: &'a Stages) -> BTreeMap<Port, &'a StageSpec> {
        let mut out = BTreeMap::new();
        for n in &self.needs {
            if let Some(s) = stages.get(n) {
                for p in produces(s.kind()) {
                    out.insert(*p, s);
                }
            }
        }
        out
    }
}

/// The stages of a recipe, in a stable topological order.
#[derive(Debug, Clone)]
pub struct Stages {
    pub list: Vec<StageSpec>,
}

impl Stages {
    pub fn get(&self, name: &str) -> Option<&StageSpec> {
        self.list.iter().find(|s| s.name == name)
    }

    /// Names of `name` and every stage downstream of it.
    pub fn downstream(&self, name: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::from([name.to_string()]);
        for s in &self.list {
            if s.needs.iter().any(|n| out.contains(n)) {
                out.insert(s.name.clone());
            }
        }
        out
    }

    /// Names of `name` and every stage it depends on.
    pub fn upstream(&self, name: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::from([name.to_string()]);
        for s in self.list.iter().rev() {
            if out.contains(&s.name) {
                out.extend(s.needs.iter().cloned());
            }
        }
        out
    }
}

/// Build and check the stage graph. Problems go to `problems`; `None` if no graph could be made.
/// `json` is `tree` as JSON, converted once for the whole recipe.
pub fn build(tree: &Node, json: &J, schema: &J, problems: &mut Vec<Problem>) -> Option<Stages> {
    let before = problems.len();
    let mut specs: Vec<StageSpec> = Vec::new();
    let mut needs_origin: BTreeMap<String, Vec<(String, Option<super::Origin>)>> = BTreeMap::new();
    let empty = BTreeMap::new();
    let table = match tree.get(&["stages"]) {
        None => &empty,
        Some(n) => match n.as_table() {
            Some(t) => t,
            None => {
                problems.push(
                    Problem::new(
                        "rtune::recipe::wrong_type",
                        format!("`stages` must be a table, found {}", n.type_name()),
                    )
                    .at(n.origin.as_ref(), "expected a table"),
                );
                return None;
            }
        },
    };
    if table.is_empty() {
        problems.push(
            Problem::new("rtune::recipe::no_stages", "the recipe has no stages")
                .at(tree.origin.as_ref(), "in this recipe")
                .help("add at least `[stages.train]`; `download` and `tokenize` are added when needed"),
        );
        return None;
    }
    let kind_names: Vec<&str> = StageKind::ALL.iter().map(|k| k.as_str()).collect();
    for (name, entry) in table {
        let path = format!("stages.{name}");
        if name == DEVICE_DTYPE_KEY {
            problems.push(
                Problem::new("rtune::recipe::reserved_name", format!("a stage cannot be named `{name}`"))
                    .at(entry.key.as_ref(), "reserved")
                    .help("`[device.<name>] dtype = [...]` sets a device's dtypes; name the stage otherwise"),
            );
            continue;
        }
        let Some(st) = entry.node.as_table() else {
            problems.push(
                Problem::new(
                    "rtune::recipe::wrong_type",
                    format!("`{path}` must be a table, found {}", entry.node.type_name()),
                )
                .at(entry.node.origin.as_ref(), "expected a table")
                .help(format!("write `[stages.{name}]` on its own line")),
            );
            continue;
        };
        let kind = match st.get("kind") {
            Some(k) => match k.node.as_str().and_then(StageKind::parse) {
                Some(kind) => kind,
                None => {
                    let shown = k.node.as_str().map(|s| format!("`{s}`")).unwrap_or_else(|| k.node.type_name().into());
                    let mut p = Problem::new(
                        "rtune::recipe::unknown_kind",
                        format!("`{path}.kind` is {shown}, not a stage kind"),
                    )
                    .at(k.node.origin.as_ref(), "unknown stage kind");
                    p = match k.node.as_str().and_then(|s| did_you_mean(s, kind_names.iter().copied())) {
                        Some(m) => p.help(format!("did you mean `{m}`?")),
                        None => p.help(format!("stage kinds: {}", kind_names.join(", "))),
                    };
                    problems.push(p);
                    continue;
                }
            },
            None => match StageKind::parse(name) {
                Some(kind) => kind,
                None => {
                    let mut p = Problem::new("rtune::recipe::unknown_kind", format!("stage `{name}` has no kind"))
                        .at(entry.key.as_ref(), "kind unknown");
                    p = match did_you_mean(name, kind_names.iter().copied()) {
                        Some(m) => p.help(format!("did you mean `[stages.{m}]`? or add `kind = \"…\"`")),
                        None => p.help(format!("add `kind = \"…\"`, one of {}", kind_names.join(", "))),
                    };
                    problems.push(p);
                    continue;
                }
            },
        };
        let mut checker = Checker::new(schema);
        let kind_schema = stage_schema(kind);
        checker.check_table(&entry.node, &kind_schema, &path, &["kind", "needs"]);
        let needs = match st.get("needs") {
            None => None,
            Some(n) => match &n.node.value {
                Value::Array(items) if items.iter().all(|i| i.as_str().is_some()) => {
                    let list: Vec<(String, Option<super::Origin>)> =
                        items.iter().map(|i| (i.as_str().unwrap_or_default().to_string(), i.origin.clone())).collect();
                    Some(list)
                }
                _ => {
                    checker.problems.push(
                        Problem::new(
                            "rtune::recipe::wrong_type",
                            format!("`{path}.needs` must be an array of stage names"),
                        )
                        .at(n.node.origin.as_ref(), "expected [\"stage\", …]"),
                    );
                    None
                }
            },
        };
        // A table that does not fit its kind is reported; its name still counts as a stage.
        if !checker.problems.is_empty() {
            problems.append(&mut checker.problems);
            continue;
        }
        let mut table = json["stages"][name].as_object().cloned().unwrap_or_default();
        table.remove("kind");
        table.remove("needs");
        let settings = match StageSettings::parse(kind, &table) {
            Ok(s) => s,
            Err(e) => {
                problems.push(
                    Problem::new("rtune::recipe::invalid", format!("`{path}` does not fit a {kind} stage: {e}"))
                        .at(entry.node.origin.as_ref(), "in this stage"),
                );
                continue;
            }
        };
        if let Some(n) = &needs {
            needs_origin.insert(name.clone(), n.clone());
        }
        specs.push(StageSpec {
            name: name.clone(),
            needs: needs.map(|n| n.into_iter().map(|(s, _)| s).collect()).unwrap_or_default(),
            settings,
            implicit: false,
            table,
            device_tables: BTreeMap::new(),
        });
    }
    // Stages whose kind is unknown were reported above; keep checking the rest, treating
    // their names as existing so they cause no second error.
    let broken: Vec<String> = table.keys().filter(|k| !specs.iter().any(|s| &s.name == *k)).cloned().collect();

    // Implicit upstream stages, then default needs.
    for port in [Port::Tokens, Port::Model] {
        let needed = specs.iter().any(|s| {
            !needs_origin.contains_key(&s.name) && reads(&s.settings).contains(&port)
                || (port == Port::Model && s.kind() == StageKind::Tokenize)
        });
        let producer = default_producer(port).expect("has a default producer");
        if needed
            && !specs.iter().any(|s| s.kind() == producer)
            && let Some(spec) = StageSpec::implicit(producer)
        {
            specs.push(spec);
        }
    }
    let names: BTreeSet<String> = specs.iter().map(|s| s.name.clone()).chain(broken.iter().cloned()).collect();
    let snapshot = specs.clone();
    for spec in &mut specs {
        let wanted = reads(&spec.settings);
        if let Some(explicit) = needs_origin.get(&spec.name) {
            let mut ok = true;
            for (n, origin) in explicit {
                if !names.contains(n) {
                    ok = false;
                    let mut p = Problem::new(
                        "rtune::recipe::unknown_stage",
                        format!("stage `{}` needs `{n}`, but there is no such stage", spec.name),
                    )
                    .at(origin.as_ref(), "unknown stage");
                    p = match did_you_mean(n, names.iter().map(String::as_str)) {
                        Some(m) => p.help(format!("did you mean `{m}`?")),
                        None => p.help(format!("stages: {}", names.iter().cloned().collect::<Vec<_>>().join(", "))),
                    };
                    problems.push(p);
                }
            }
            if ok {
                let have: BTreeSet<Port> = explicit
                    .iter()
                    .filter_map(|(n, _)| snapshot.iter().find(|s| &s.name == n))
                    .flat_map(|s| produces(s.kind()).iter().copied())
                    .collect();
                for port in wanted.iter().filter(|p| !have.contains(p)) {
                    let at = tree.get(&["stages", &spec.name, "needs"]).and_then(|n| n.origin.clone());
                    problems.push(
                        Problem::new(
                            "rtune::recipe::missing_input",
                            format!(
                                "stage `{}` reads {}, but none of its `needs` produce it",
                                spec.name,
                                port.describe()
                            ),
                        )
                        .at(at.as_ref(), "add the producing stage here"),
                    );
                }
            }
            continue;
        }
        let mut needs = Vec::new();
        for port in wanted {
            let producers: Vec<&StageSpec> = snapshot.iter().filter(|s| produces(s.kind()).contains(&port)).collect();
            match producers.as_slice() {
                [one] => {
                    if !needs.contains(&one.name) {
                        needs.push(one.name.clone());
                    }
                }
                [] => {
                    let at = tree.entry(&["stages", &spec.name]).and_then(|e| e.key.clone());
                    let hint = match port {
                        Port::Weights => "add a `[stages.train]` stage",
                        Port::Exports => "add a `[stages.quantize]` stage",
                        _ => "add the stage that produces it",
                    };
                    problems.push(
                        Problem::new(
                            "rtune::recipe::missing_input",
                            format!("stage `{}` reads {}, but no stage produces it", spec.name, port.describe()),
                        )
                        .at(at.as_ref(), "needs an input nobody produces")
                        .help(hint),
                    );
                }
                many => {
                    let at = tree.entry(&["stages", &spec.name]).and_then(|e| e.key.clone());
                    let list = many.iter().map(|s| format!("`{}`", s.name)).collect::<Vec<_>>().join(", ");
                    problems.push(
                        Problem::new(
                            "rtune::recipe::ambiguous_input",
                            format!("stage `{}` reads {}, which {list} all produce", spec.name, port.describe()),
                        )
                        .at(at.as_ref(), "which one?")
                        .help(format!("say which with `needs = [\"{}\"]`", many[0].name)),
                    );
                }
            }
        }
        spec.needs = needs;
    }
    if problems.len() > before {
        return None;
    }
    let checked = problems.len();
    check_device_overrides(tree, schema, &specs, problems);
    if problems.len() == checked {
        type_device_overrides(tree, json, &mut specs, problems);
    }

    // Cycles: report each strongly connected component once, with its path.
    let mut graph = DiGraph::<&str, ()>::new();
    let idx: BTreeMap<&str, _> = specs.iter().map(|s| (s.name.as_str(), graph.add_node(s.name.as_str()))).collect();
    for s in &specs {
        for n in &s.needs {
            graph.add_edge(idx[n.as_str()], idx[s.name.as_str()], ());
        }
    }
    for scc in petgraph::algo::tarjan_scc(&graph) {
        let self_loop = scc.len() == 1 && graph.contains_edge(scc[0], scc[0]);
        if scc.len() > 1 || self_loop {
            let mut members: Vec<&str> = scc.iter().map(|i| graph[*i]).collect();
            members.sort();
            let cycle = cycle_path(&specs, &members);
            let first = cycle[0].clone();
            let at = tree.get(&["stages", &first, "needs"]).and_then(|n| n.origin.clone());
            problems.push(
                Problem::new(
                    "rtune::recipe::cycle",
                    format!("stages depend on each other in a cycle: {}", cycle.join(" → ")),
                )
                .at(at.as_ref(), "part of the cycle")
                .help("remove one of these `needs` so the stages form a chain"),
            );
        }
    }
    if problems.len() > before {
        return None;
    }
    Some(Stages { list: topo_order(specs) })
}

/// The stage schema of a kind, as used for checking a `[stages.*]` table.
pub fn stage_schema(kind: StageKind) -> J {
    serde_json::to_value(kind.settings_schema()).expect("schema serialises")
}

/// A readable cycle through `members`: a → b → … → a.
fn cycle_path(specs: &[StageSpec], members: &[&str]) -> Vec<String> {
    let start = members[0];
    let mut path = vec![start.to_string()];
    let mut cur = start;
    for _ in 0..members.len() {
        // Follow a `needs` edge backwards (cur needs next) that stays in the component.
        let next =
            specs.iter().find(|s| s.name == cur).and_then(|s| s.needs.iter().find(|n| members.contains(&n.as_str())));
        match next {
            Some(n) => {
                path.push(n.clone());
                if n == start {
                    break;
                }
                cur = n;
            }
            None => break,
        }
    }
    path
}

/// Kahn's algorithm with a stable tie-break: kind order, then name.
fn topo_order(specs: Vec<StageSpec>) -> Vec<StageSpec> {
    let mut remaining = specs;
    let mut done: BTreeSet<String> = BTreeSet::new();
    let mut out = Vec::new();
    while !remaining.is_empty() {
        let pos = remaining
            .iter()
            .enumerate()
            .filter(|(_, s)| s.needs.iter().all(|n| done.contains(n)))
            .min_by_key(|(_, s)| (s.kind(), s.name.clone()))
            .map(|(i, _)| i)
            .expect("no cycles remain");
        let s = remaining.remove(pos);
        done.insert(s.name.clone());
        out.push(s);
    }
    out
}

/// `[device.<name>.<stage>]` tables: the stage must exist and the keys must fit its kind; and
/// `[device.<name>] dtype`, the device's own dtype preference.
fn check_device_overrides(tree: &Node, schema: &J, specs: &[StageSpec], problems: &mut Vec<Problem>) {
    let Some(device) = tree.get(&["device"]).and_then(Node::as_table) else { return };
    // The policy's own settings (`prefer`, `dtype`, `gpus`, …), as the schema lists them.
    let policy = &Checker::new(schema).resolve(&schema["properties"]["device"])["properties"];
    for (dev, entry) in device.iter().filter(|(k, _)| super::is_device_name(k)) {
        let Some(stages) = entry.node.as_table() else {
            problems.push(
                Problem::new("rtune::recipe::wrong_type", format!("`device.{dev}` must be a table of stage overrides"))
                    .at(entry.node.origin.as_ref(), "expected a table")
                    .help(format!("for example `[device.{dev}]` then `train.batch_size = 1`")),
            );
            continue;
        };
        for (stage, st) in stages {
            let path = format!("device.{dev}.{stage}");
            if stage == DEVICE_DTYPE_KEY {
                // This device's own dtype preference, checked as `device.dtype` is.
                let mut checker = Checker::new(schema);
                checker.check(&st.node, &policy["dtype"], &path);
                problems.append(&mut checker.problems);
                continue;
            }
            match specs.iter().find(|s| &s.name == stage) {
                // A setting of the whole policy, written in one device's table.
                None if policy.get(stage).is_some() => problems.push(
                    unknown_key(stage, &format!("device.{dev}"), st.key.as_ref(), std::iter::empty())
                        .with_message(format!("`{stage}` is not set per device: `device.{dev}.{stage}`"))
                        .help(format!(
                            "set `{stage}` in `[device]` itself; `[device.{dev}]` holds `dtype` and stage overrides"
                        )),
                ),
                None => problems.push(
                    unknown_key(
                        stage,
                        &format!("device.{dev}"),
                        st.key.as_ref(),
                        specs.iter().map(|s| s.name.as_str()),
                    )
                    .with_message(format!("`device.{dev}` overrides `{stage}`, but there is no such stage")),
                ),
                Some(spec) => {
                    let mut s = stage_schema(spec.kind());
                    s.as_object_mut().map(|o| o.remove("required"));
                    let mut checker = Checker::new(schema);
                    checker.check_table(&st.node, &s, &path, &[]);
                    problems.append(&mut checker.problems);
                }
            }
        }
    }
}

/// Each stage's `[device.<name>.<stage>]` tables, kept beside it and typed merged over its own
/// table one device at a time (a device that resolves to several names merges them in order
/// when planning).
fn type_device_overrides(tree: &Node, json: &J, specs: &mut [StageSpec], problems: &mut Vec<Problem>) {
    let Some(device) = json.get("device").and_then(J::as_object) else { return };
    for spec in specs.iter_mut() {
        for (dev, tables) in device.iter().filter(|(k, _)| super::is_device_name(k)) {
            if let Some(table) = tables.get(&spec.name).and_then(J::as_object) {
                spec.device_tables.insert(dev.clone(), table.clone());
            }
        }
        for dev in spec.device_tables.keys() {
            if let Err(e) = spec.on(std::slice::from_ref(dev)) {
                let at = tree.get(&["device", dev, &spec.name]).and_then(|n| n.origin.clone());
                problems.push(
                    Problem::new(
                        "rtune::recipe::invalid",
                        format!("stage `{}` with `[device.{dev}]`'s overrides: {e}", spec.name),
                    )
                    .at(at.as_ref(), "these overrides"),
                );
            }
        }
    }
}

/// `over` merged into `base` as trees: tables key by key, anything else replaced.
fn merge(base: &mut serde_json::Map<String, J>, over: &serde_json::Map<String, J>) {
    for (k, v) in over {
        match (base.get_mut(k), v) {
            (Some(J::Object(b)), J::Object(o)) => merge(b, o),
            _ => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

impl Problem {
    fn with_message(mut self, m: String) -> Problem {
        self.message = m;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Overrides, RecipeSource, load_text};
    use super::*;

    #[test]
    fn device_overrides_merge_as_trees_in_order_then_type() {
        let text = r#"
            [recipe]
            name = "r"
            [model]
            repo = "o/m"
            [dataset]
            path = "d.jsonl"
            format = "alpaca"
            [stages.train]
            batch_size = 8
            schedule = { kind = "cosine", warmup_steps = 5 }
            [device.cuda.train]
            batch_size = 4
            schedule = { warmup_steps = 2 }
            [device."cuda:1".train]
            batch_size = 2
        "#;
        let loaded = load_text(RecipeSource::File("r.toml".into()), text.into(), &Overrides::default()).unwrap();
        let train = loaded.stages.get("train").unwrap();
        let on = |names: &[&str]| {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            match train.on(&names).unwrap() {
                Settled { settings: StageSettings::Train(t), written } => (t, written),
                other => panic!("{other:?}"),
            }
        };
        // As written, typed at load; a device without tables of its own sees the same.
        let (t, written) = on(&["cpu"]);
        assert_eq!((t.batch_size, t.schedule.warmup_steps), (8, 5));
        assert_eq!(t.learning_rate, 1e-4, "defaults filled in");
        assert_eq!(written, BTreeSet::from(["batch_size".to_string(), "schedule".to_string()]));
        assert_eq!(StageSettings::Train(t), train.settings);
        // The class, then the exact device: the later wins, a table merges key by key.
        let (t, _) = on(&["cuda"]);
        assert_eq!((t.batch_size, t.schedule.warmup_steps), (4, 2));
        assert_eq!(t.schedule.kind, crate::recipe::ScheduleKind::Cosine, "kept from the stage's table");
        let (t, _) = on(&["cuda", "cuda:1"]);
        assert_eq!((t.batch_size, t.schedule.warmup_steps), (2, 2));
    }

    #[test]
    fn a_bad_device_override_and_a_cycle_are_reported_together() {
        let text = r#"
            [recipe]
            name = "r"
            [model]
            repo = "o/m"
            [dataset]
            path = "d.jsonl"
            format = "alpaca"
            [stages.download]
            [stages.tokenize]
            [stages.train]
            needs = ["tokenize", "download", "evaluate"]
            [stages.evaluate]
            needs = ["tokenize", "download", "train"]
            [device.cpu.train]
            batch_sise = 4
        "#;
        let Err(super::super::LoadError::Invalid(found)) =
            load_text(RecipeSource::File("r.toml".into()), text.into(), &Overrides::default())
        else {
            panic!("the recipe is invalid")
        };
        let codes: Vec<&str> = found.problems.iter().map(|p| p.code).collect();
        assert!(codes.contains(&"rtune::recipe::cycle"), "{codes:?}");
        assert!(codes.len() >= 2, "the override's unknown key too: {codes:?}");
    }
}
