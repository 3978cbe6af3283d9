//! Go's `text/template`, the part of it chat templates use: what Ollama renders a Modelfile's
//! `TEMPLATE` with. rtune renders its translated templates here to check them against the Jinja
//! template the model trained with before it writes a Modelfile ([`super::ollama`]).
//!
//! What it covers, with Go's semantics: text and actions with `{{-`/`-}}` trimming, comments,
//! `if`/`else if`/`else`, `range` (with `$i, $x :=` and `else`), variables (`$x := …`,
//! `$x = …` assigning in the enclosing scope, `$` the data), fields (`.Role`, `$.Messages`,
//! `$m.Content`), string, raw-string, integer and boolean constants, parentheses, pipelines
//! (`a | f`), and the builtins `and`, `or` (short-circuit, returning an operand), `not`, `eq`
//! (against several values), `ne`, `lt`, `le`, `gt`, `ge`, `len`, `index` and `slice`. A
//! missing key of the data map is `<no value>`, as with Ollama's `missingkey=zero`. Anything
//! else (`with`, `define`, `block`, other functions, methods) is a parse error here, so a
//! template that uses it is never called checked.

use std::collections::BTreeMap;

/// A value the template sees: Ollama's data is a map of strings and lists of messages.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    Str(String),
    List(Vec<Value>),
    Map(BTreeMap<String, Value>),
}

impl Value {
    /// Go's truth: false, 0, nil and empty strings, lists and maps are false.
    fn truth(&self) -> bool {
        match self {
            Value::Nil => false,
            Value::Bool(b) => *b,
            Value::Int(i) => *i != 0,
            Value::Str(s) => !s.is_empty(),
            Value::List(l) => !l.is_empty(),
            Value::Map(m) => !m.is_empty(),
        }
    }

    fn print(&self, out: &mut String) {
        match self {
            Value::Nil => out.push_str("<no value>"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Int(i) => out.push_str(&i.to_string()),
            Value::Str(s) => out.push_str(s),
            Value::List(l) => {
                out.push('[');
                for (i, v) in l.iter().enumerate() {
                    if i > 0 {
                        out.push(' ');
                    }
                    v.print(out);
                }
                out.push(']');
            }
            Value::Map(m) => {
                out.push_str("map[");
                for (i, (k, v)) in m.iter().enumerate() {
                    if i > 0 {
                        out.push(' ');
                    }
                    out.push_str(k);
                    out.push(':');
                    v.print(out);
                }
                out.push(']');
            }
        }
    }
}

/// A parsed template.
#[derive(Debug, Clone)]
pub struct Template {
    nodes: Vec<Node>,
}

#[derive(Debug, Clone)]
enum Node {
    Text(String),
    Output(Pipe),
    Set { var: String, declare: bool, pipe: Pipe },
    If { branches: Vec<(Pipe, Vec<Node>)>, otherwise: Vec<Node> },
    Range { key: Option<String>, elem: Option<String>, pipe: Pipe, body: Vec<Node>, otherwise: Vec<Node> },
}

/// Commands joined by `|`: each result is the last argument of the next.
type Pipe = Vec<Cmd>;

#[derive(Debug, Clone)]
enum Cmd {
    Call(String, Vec<Arg>),
    Value(Arg),
}

#[derive(Debug, Clone)]
enum Arg {
    /// `.` or `.A.B`.
    Dot(Vec<String>),
    /// `$x` or `$x.A.B` (`$` is the data).
    Var(String, Vec<String>),
    Const(Value),
    Paren(Pipe, Vec<String>),
}

const FUNCS: &[&str] = &["and", "or", "not", "eq", "ne", "lt", "le", "gt", "ge", "len", "index", "slice"];

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Word(String),
    Field(Vec<String>),
    Var(String, Vec<String>),
    Const(Value),
    Open,
    Close(Vec<String>),
    Bar,
    Declare,
    Assign,
    Comma,
}

fn is_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n')
}

/// The template's text and actions, with `{{-` and `-}}` already applied to the text.
fn segments(src: &str) -> Result<Vec<Result<String, String>>, String> {
    let mut out: Vec<Result<String, String>> = Vec::new();
    let mut rest = src;
    let mut trim_next = false;
    while !rest.is_empty() {
        let Some(at) = rest.find("{{") else {
            let text = if trim_next { rest.trim_start_matches(is_space) } else { rest };
            out.push(Ok(text.to_string()));
            break;
        };
        let mut text = &rest[..at];
        if trim_next {
            text = text.trim_start_matches(is_space);
        }
        let mut inner = &rest[at + 2..];
        // `{{- ` trims the text before; the `-` must be followed by a space.
        if inner.starts_with('-') && inner[1..].starts_with(is_space) {
            text = text.trim_end_matches(is_space);
            inner = &inner[1..];
        }
        out.push(Ok(text.to_string()));
        let end = find_close(inner).ok_or_else(|| "an action `{{` is never closed".to_string())?;
        let mut action = &inner[..end];
        trim_next = false;
        if action.ends_with('-') && action[..action.len() - 1].ends_with(is_space) {
            action = &action[..action.len() - 1];
            trim_next = true;
        }
        let action = action.trim_matches(is_space);
        if !(action.starts_with("/*") && action.ends_with("*/")) {
            out.push(Err(action.to_string()));
        }
        rest = &inner[end + 2..];
    }
    Ok(out)
}

/// Where `}}` closes an action, skipping strings.
fn find_close(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            b'`' => {
                i += 1;
                while i < b.len() && b[i] != b'`' {
                    i += 1;
                }
            }
            b'}' if b.get(i + 1) == Some(&b'}') => return Some(i),
            _ => {}
        }
        i += 1;
    }
    None
}

fn fields_after(s: &str, mut i: usize) -> (Vec<String>, usize) {
    let b = s.as_bytes();
    let mut fields = Vec::new();
    while i < b.len() && b[i] == b'.' && b.get(i + 1).is_some_and(|c| c.is_ascii_alphabetic() || *c == b'_') {
        let start = i + 1;
        i = start;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        fields.push(s[start..i].to_string());
    }
    (fields, i)
}

fn lex(s: &str) -> Result<Vec<Tok>, String> {
    let b = s.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if is_space(c as char) {
            i += 1;
        } else if c == b'(' {
            toks.push(Tok::Open);
            i += 1;
        } else if c == b')' {
            let (f, j) = fields_after(s, i + 1);
            toks.push(Tok::Close(f));
            i = j;
        } else if c == b'|' {
            toks.push(Tok::Bar);
            i += 1;
        } else if c == b',' {
            toks.push(Tok::Comma);
            i += 1;
        } else if s[i..].starts_with(":=") {
            toks.push(Tok::Declare);
            i += 2;
        } else if c == b'=' {
            toks.push(Tok::Assign);
            i += 1;
        } else if c == b'.' {
            let (f, j) = fields_after(s, i);
            toks.push(Tok::Field(f));
            i = if j == i { i + 1 } else { j };
        } else if c == b'$' {
            let start = i;
            i += 1;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            let name = s[start..i].to_string();
            let (f, j) = fields_after(s, i);
            toks.push(Tok::Var(name, f));
            i = j;
        } else if c == b'"' {
            let mut v = String::new();
            i += 1;
            loop {
                let Some(&ch) = b.get(i) else { return Err("a string is never closed".into()) };
                match ch {
                    b'"' => break,
                    b'\\' => {
                        let e = *b.get(i + 1).ok_or("a string is never closed")?;
                        v.push(match e {
                            b'n' => '\n',
                            b't' => '\t',
                            b'r' => '\r',
                            b'\\' => '\\',
                            b'"' => '"',
                            _ => return Err(format!("the escape `\\{}` is not supported here", e as char)),
                        });
                        i += 2;
                    }
                    _ => {
                        let ch = s[i..].chars().next().expect("in bounds");
                        v.push(ch);
                        i += ch.len_utf8();
                    }
                }
            }
            toks.push(Tok::Const(Value::Str(v)));
            i += 1;
        } else if c == b'`' {
            let end = s[i + 1..].find('`').ok_or("a raw string is never closed")?;
            toks.push(Tok::Const(Value::Str(s[i + 1..i + 1 + end].to_string())));
            i += end + 2;
        } else if c.is_ascii_digit() || (c == b'-' && b.get(i + 1).is_some_and(u8::is_ascii_digit)) {
            let start = i;
            i += 1;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            toks.push(Tok::Const(Value::Int(s[start..i].parse().map_err(|_| "a number out of range")?)));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            toks.push(Tok::Word(s[start..i].to_string()));
        } else {
            return Err(format!("unexpected `{}`", c as char));
        }
    }
    Ok(toks)
}

struct Parser {
    segs: std::vec::IntoIter<Result<String, String>>,
}

enum Stop {
    End,
    Else(Option<Pipe>),
    Eof,
}

impl Template {
    pub fn parse(src: &str) -> Result<Template, String> {
        let mut p = Parser { segs: segments(src)?.into_iter() };
        let (nodes, stop) = p.list()?;
        match stop {
            Stop::Eof => Ok(Template { nodes }),
            Stop::End => Err("an `{{ end }}` closes nothing".into()),
            Stop::Else(_) => Err("an `{{ else }}` outside `if` or `range`".into()),
        }
    }

    /// Render with `data` as `.` and `$`.
    pub fn render(&self, data: &Value) -> Result<String, String> {
        let mut ex = Exec { scopes: vec![vec![("$".to_string(), data.clone())]], out: String::new() };
        ex.nodes(&self.nodes, data)?;
        Ok(ex.out)
    }
}

impl Parser {
    fn list(&mut self) -> Result<(Vec<Node>, Stop), String> {
        let mut nodes = Vec::new();
        while let Some(seg) = self.segs.next() {
            let action = match seg {
                Ok(text) => {
                    if !text.is_empty() {
                        nodes.push(Node::Text(text));
                    }
                    continue;
                }
                Err(a) => a,
            };
            let toks = lex(&action).map_err(|e| format!("in `{{{{ {action} }}}}`: {e}"))?;
            let mut it = toks.into_iter().peekable();
            let head = it.peek().cloned();
            let err = |e: String| format!("in `{{{{ {action} }}}}`: {e}");
            match head {
                Some(Tok::Word(w)) if w == "end" => return Ok((nodes, Stop::End)),
                Some(Tok::Word(w)) if w == "else" => {
                    it.next();
                    let rest: Vec<Tok> = it.collect();
                    if rest.is_empty() {
                        return Ok((nodes, Stop::Else(None)));
                    }
                    if rest[0] != Tok::Word("if".into()) {
                        return Err(err("only `else` and `else if` are supported".into()));
                    }
                    return Ok((nodes, Stop::Else(Some(pipe(&rest[1..]).map_err(err)?))));
                }
                Some(Tok::Word(w)) if w == "if" => {
                    let rest: Vec<Tok> = it.skip(1).collect();
                    let mut branches = vec![(pipe(&rest).map_err(err)?, Vec::new())];
                    let mut otherwise = Vec::new();
                    loop {
                        let (body, stop) = self.list()?;
                        branches.last_mut().expect("one branch").1 = body;
                        match stop {
                            Stop::End => break,
                            Stop::Else(Some(p)) => branches.push((p, Vec::new())),
                            Stop::Else(None) => {
                                let (body, stop) = self.list()?;
                                otherwise = body;
                                if !matches!(stop, Stop::End) {
                                    return Err(err("`if … else` needs an `{{ end }}`".into()));
                                }
                                break;
                            }
                            Stop::Eof => return Err(err("`if` needs an `{{ end }}`".into())),
                        }
                    }
                    nodes.push(Node::If { branches, otherwise });
                }
                Some(Tok::Word(w)) if w == "range" => {
                    let rest: Vec<Tok> = it.skip(1).collect();
                    let (key, elem, from) = match rest.as_slice() {
                        [Tok::Var(a, fa), Tok::Comma, Tok::Var(b, fb), Tok::Declare, ..]
                            if fa.is_empty() && fb.is_empty() =>
                        {
                            (Some(a.clone()), Some(b.clone()), 4)
                        }
                        [Tok::Var(a, fa), Tok::Declare, ..] if fa.is_empty() => (None, Some(a.clone()), 2),
                        _ => (None, None, 0),
                    };
                    let p = pipe(&rest[from..]).map_err(err)?;
                    let (body, stop) = self.list()?;
                    let otherwise = match stop {
                        Stop::End => Vec::new(),
                        Stop::Else(None) => {
                            let (body, stop) = self.list()?;
                            if !matches!(stop, Stop::End) {
                                return Err(err("`range … else` needs an `{{ end }}`".into()));
                            }
                            body
                        }
                        _ => return Err(err("`range` needs an `{{ end }}`".into())),
                    };
                    // Go's range with one variable binds the element; with two, index and element.
                    let (key, elem) = if key.is_some() { (key, elem) } else { (None, elem) };
                    nodes.push(Node::Range { key, elem, pipe: p, body, otherwise });
                }
                Some(Tok::Word(w))
                    if ["with", "define", "block", "template", "break", "continue"].contains(&w.as_str()) =>
                {
                    return Err(err(format!("`{w}` is not supported here")));
                }
                _ => {
                    let toks: Vec<Tok> = it.collect();
                    match toks.as_slice() {
                        [Tok::Var(v, f), op @ (Tok::Declare | Tok::Assign), rest @ ..] if f.is_empty() => {
                            nodes.push(Node::Set {
                                var: v.clone(),
                                declare: *op == Tok::Declare,
                                pipe: pipe(rest).map_err(err)?,
                            })
                        }
                        _ => nodes.push(Node::Output(pipe(&toks).map_err(err)?)),
                    }
                }
            }
        }
        Ok((nodes, Stop::Eof))
    }
}

fn pipe(toks: &[Tok]) -> Result<Pipe, String> {
    if toks.is_empty() {
        return Err("missing value".into());
    }
    let mut cmds = Vec::new();
    let mut i = 0;
    loop {
        let start = i;
        let mut depth = 0usize;
        while i < toks.len() {
            match &toks[i] {
                Tok::Open => depth += 1,
                Tok::Close(_) => depth = depth.checked_sub(1).ok_or("unmatched `)`")?,
                Tok::Bar if depth == 0 => break,
                _ => {}
            }
            i += 1;
        }
        cmds.push(command(&toks[start..i])?);
        if i == toks.len() {
            return Ok(cmds);
        }
        i += 1;
    }
}

fn command(toks: &[Tok]) -> Result<Cmd, String> {
    let mut args = Vec::new();
    let mut i = 0;
    let mut name = None;
    if let Some(Tok::Word(w)) = toks.first() {
        match w.as_str() {
            "true" | "false" | "nil" => {}
            w if FUNCS.contains(&w) => {
                name = Some(w.to_string());
                i = 1;
            }
            w => return Err(format!("function `{w}` is not supported here")),
        }
    }
    while i < toks.len() {
        let (a, next) = arg(toks, i)?;
        args.push(a);
        i = next;
    }
    match name {
        Some(n) => Ok(Cmd::Call(n, args)),
        None if args.len() == 1 => Ok(Cmd::Value(args.pop().expect("one"))),
        None if args.is_empty() => Err("empty command".into()),
        None => Err("a value cannot take arguments".into()),
    }
}

fn arg(toks: &[Tok], i: usize) -> Result<(Arg, usize), String> {
    Ok(match &toks[i] {
        Tok::Field(f) => (Arg::Dot(f.clone()), i + 1),
        Tok::Var(v, f) => (Arg::Var(v.clone(), f.clone()), i + 1),
        Tok::Const(c) => (Arg::Const(c.clone()), i + 1),
        Tok::Word(w) if w == "true" || w == "false" => (Arg::Const(Value::Bool(w == "true")), i + 1),
        Tok::Word(w) if w == "nil" => (Arg::Const(Value::Nil), i + 1),
        Tok::Open => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match toks.get(j) {
                    Some(Tok::Open) => depth += 1,
                    Some(Tok::Close(f)) => {
                        depth -= 1;
                        if depth == 0 {
                            return Ok((Arg::Paren(pipe(&toks[i + 1..j])?, f.clone()), j + 1));
                        }
                    }
                    None => return Err("unclosed `(`".into()),
                    _ => {}
                }
                j += 1;
            }
        }
        Tok::Word(w) => return Err(format!("`{w}` can only start a command; put it in parentheses")),
        t => return Err(format!("unexpected {t:?}")),
    })
}

struct Exec {
    scopes: Vec<Vec<(String, Value)>>,
    out: String,
}

fn field(mut v: Value, fields: &[String]) -> Result<Value, String> {
    for f in fields {
        v = match v {
            Value::Map(mut m) => m.remove(f).unwrap_or(Value::Nil),
            Value::Nil => return Err(format!("nil has no field `{f}`")),
            other => return Err(format!("{other:?} has no field `{f}`")),
        };
    }
    Ok(v)
}

fn int(v: &Value) -> Result<i64, String> {
    match v {
        Value::Int(i) => Ok(*i),
        other => Err(format!("{other:?} is not an integer")),
    }
}

fn compare(a: &Value, b: &Value) -> Result<std::cmp::Ordering, String> {
    match (a, b) {
        (Value::Int(x), Value::Int(y)) => Ok(x.cmp(y)),
        (Value::Str(x), Value::Str(y)) => Ok(x.as_bytes().cmp(y.as_bytes())),
        _ => Err(format!("cannot compare {a:?} with {b:?}")),
    }
}

fn equal(a: &Value, b: &Value) -> Result<bool, String> {
    match (a, b) {
        (Value::Bool(x), Value::Bool(y)) => Ok(x == y),
        (Value::Nil, Value::Nil) => Ok(true),
        (Value::Nil, _) | (_, Value::Nil) => Ok(false),
        (Value::Int(_), Value::Int(_)) | (Value::Str(_), Value::Str(_)) => Ok(compare(a, b)?.is_eq()),
        _ => Err(format!("incompatible types for comparison: {a:?} and {b:?}")),
    }
}

impl Exec {
    fn lookup(&self, name: &str) -> Result<Value, String> {
        for scope in self.scopes.iter().rev() {
            if let Some((_, v)) = scope.iter().rev().find(|(n, _)| n == name) {
                return Ok(v.clone());
            }
        }
        Err(format!("undefined variable `{name}`"))
    }

    fn nodes(&mut self, nodes: &[Node], dot: &Value) -> Result<(), String> {
        for n in nodes {
            match n {
                Node::Text(t) => self.out.push_str(t),
                Node::Output(p) => {
                    let v = self.pipe(p, dot)?;
                    v.print(&mut self.out);
                }
                Node::Set { var, declare, pipe } => {
                    let v = self.pipe(pipe, dot)?;
                    if *declare {
                        self.scopes.last_mut().expect("a scope").push((var.clone(), v));
                    } else {
                        let slot = self
                            .scopes
                            .iter_mut()
                            .rev()
                            .find_map(|s| s.iter_mut().rev().find(|(n, _)| n == var))
                            .ok_or_else(|| format!("undefined variable `{var}`"))?;
                        slot.1 = v;
                    }
                }
                Node::If { branches, otherwise } => {
                    let mut taken = None;
                    for (p, body) in branches {
                        if self.pipe(p, dot)?.truth() {
                            taken = Some(body);
                            break;
                        }
                    }
                    self.scoped(taken.unwrap_or(otherwise), dot)?;
                }
                Node::Range { key, elem, pipe, body, otherwise } => {
                    let items: Vec<(Value, Value)> = match self.pipe(pipe, dot)? {
                        Value::List(l) => l.into_iter().enumerate().map(|(i, v)| (Value::Int(i as i64), v)).collect(),
                        Value::Map(m) => m.into_iter().map(|(k, v)| (Value::Str(k), v)).collect(),
                        Value::Int(n) => (0..n).map(|i| (Value::Int(i), Value::Int(i))).collect(),
                        Value::Nil => Vec::new(),
                        other => return Err(format!("range cannot iterate over {other:?}")),
                    };
                    if items.is_empty() {
                        self.scoped(otherwise, dot)?;
                    }
                    for (k, v) in items {
                        let mut scope = Vec::new();
                        match (key, elem) {
                            (Some(k_name), Some(e_name)) => {
                                scope.push((k_name.clone(), k));
                                scope.push((e_name.clone(), v.clone()));
                            }
                            (None, Some(e_name)) => scope.push((e_name.clone(), v.clone())),
                            _ => {}
                        }
                        self.scopes.push(scope);
                        let r = self.nodes(body, &v);
                        self.scopes.pop();
                        r?;
                    }
                }
            }
        }
        Ok(())
    }

    fn scoped(&mut self, nodes: &[Node], dot: &Value) -> Result<(), String> {
        self.scopes.push(Vec::new());
        let r = self.nodes(nodes, dot);
        self.scopes.pop();
        r
    }

    fn pipe(&mut self, p: &Pipe, dot: &Value) -> Result<Value, String> {
        let mut last: Option<Value> = None;
        for cmd in p {
            last = Some(match cmd {
                Cmd::Value(a) if last.is_none() => self.arg(a, dot)?,
                Cmd::Value(_) => return Err("a value cannot take a piped argument".into()),
                Cmd::Call(name, args) => self.call(name, args, last.take(), dot)?,
            });
        }
        last.ok_or_else(|| "empty pipeline".into())
    }

    fn arg(&mut self, a: &Arg, dot: &Value) -> Result<Value, String> {
        match a {
            Arg::Dot(f) => field(dot.clone(), f),
            Arg::Var(v, f) => field(self.lookup(v)?, f),
            Arg::Const(c) => Ok(c.clone()),
            Arg::Paren(p, f) => {
                let v = self.pipe(p, dot)?;
                field(v, f)
            }
        }
    }

    fn call(&mut self, name: &str, args: &[Arg], piped: Option<Value>, dot: &Value) -> Result<Value, String> {
        // `and` and `or` evaluate their operands only as far as needed (Go 1.18).
        if name == "and" || name == "or" {
            let n = args.len() + piped.is_some() as usize;
            if n == 0 {
                return Err(format!("`{name}` needs an argument"));
            }
            let mut v = Value::Nil;
            for i in 0..n {
                v = match args.get(i) {
                    Some(a) => self.arg(a, dot)?,
                    None => piped.clone().expect("the piped value is last"),
                };
                if v.truth() != (name == "and") {
                    return Ok(v);
                }
            }
            return Ok(v);
        }
        let mut vals = Vec::with_capacity(args.len() + 1);
        for a in args {
            vals.push(self.arg(a, dot)?);
        }
        vals.extend(piped);
        let need = |n: usize| {
            if vals.len() == n { Ok(()) } else { Err(format!("`{name}` takes {n} arguments, given {}", vals.len())) }
        };
        Ok(match name {
            "not" => {
                need(1)?;
                Value::Bool(!vals[0].truth())
            }
            "eq" => {
                if vals.len() < 2 {
                    return Err("`eq` needs at least two arguments".into());
                }
                let mut any = false;
                for b in &vals[1..] {
                    any |= equal(&vals[0], b)?;
                }
                Value::Bool(any)
            }
            "ne" => {
                need(2)?;
                Value::Bool(!equal(&vals[0], &vals[1])?)
            }
            "lt" | "le" | "gt" | "ge" => {
                need(2)?;
                let o = compare(&vals[0], &vals[1])?;
                Value::Bool(match name {
                    "lt" => o.is_lt(),
                    "le" => o.is_le(),
                    "gt" => o.is_gt(),
                    _ => o.is_ge(),
                })
            }
            "len" => {
                need(1)?;
                Value::Int(match &vals[0] {
                    Value::Str(s) => s.len(),
                    Value::List(l) => l.len(),
                    Value::Map(m) => m.len(),
                    other => return Err(format!("len of {other:?}")),
                } as i64)
            }
            "index" => {
                if vals.is_empty() {
                    return Err("`index` needs an argument".into());
                }
                let mut v = vals[0].clone();
                for k in &vals[1..] {
                    v = match (v, k) {
                        (Value::List(l), Value::Int(i)) => {
                            l.get(*i as usize).cloned().ok_or_else(|| format!("index {i} out of range"))?
                        }
                        (Value::Map(m), Value::Str(s)) => m.get(s).cloned().unwrap_or(Value::Nil),
                        (v, k) => return Err(format!("cannot index {v:?} with {k:?}")),
                    };
                }
                v
            }
            "slice" => {
                if vals.is_empty() || vals.len() > 3 {
                    return Err("`slice` takes one to three arguments".into());
                }
                let len = match &vals[0] {
                    Value::List(l) => l.len(),
                    Value::Str(s) => s.len(),
                    other => return Err(format!("cannot slice {other:?}")),
                };
                let lo = vals.get(1).map(int).transpose()?.unwrap_or(0) as usize;
                let hi = vals.get(2).map(int).transpose()?.map(|h| h as usize).unwrap_or(len);
                if lo > hi || hi > len {
                    return Err(format!("slice [{lo}:{hi}] out of range of {len}"));
                }
                match &vals[0] {
                    Value::List(l) => Value::List(l[lo..hi].to_vec()),
                    Value::Str(s) => Value::Str(s.get(lo..hi).ok_or("slice inside a character")?.to_string()),
                    _ => unreachable!("checked above"),
                }
            }
            other => return Err(format!("function `{other}` is not supported here")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> Value {
        let msgs = pairs
            .iter()
            .map(|(r, c)| {
                Value::Map(BTreeMap::from([
                    ("Role".to_string(), Value::Str(r.to_string())),
                    ("Content".to_string(), Value::Str(c.to_string())),
                ]))
            })
            .collect();
        Value::Map(BTreeMap::from([
            ("Messages".to_string(), Value::List(msgs)),
            ("System".to_string(), Value::Str(String::new())),
        ]))
    }

    fn render(t: &str, d: &Value) -> String {
        Template::parse(t).unwrap().render(d).unwrap()
    }

    #[test]
    fn trim_markers_eat_whitespace_on_their_side_only() {
        let d = data(&[]);
        assert_eq!(render("a \n {{- \"b\" -}} \n c", &d), "abc");
        assert_eq!(render("a \n {{ \"b\" -}} \n c", &d), "a \n bc");
        // `{{-3}}` is the number -3, not a trim marker.
        assert_eq!(render("a {{-3}}", &d), "a -3");
        assert_eq!(render("x{{/* a comment */}}y", &d), "xy");
    }

    #[test]
    fn range_variables_and_last_element_as_gemma3_writes_it() {
        let t = "{{- range $i, $_ := .Messages }}{{- $last := eq (len (slice $.Messages $i)) 1 }}[{{ $i }}:{{ .Role }}{{ if $last }}!{{ end }}]{{ end }}";
        assert_eq!(render(t, &data(&[("user", "a"), ("assistant", "b")])), "[0:user][1:assistant!]");
    }

    #[test]
    fn assignment_reaches_the_enclosing_scope_and_declaration_does_not() {
        let t = "{{ $s := \"\" }}{{ range .Messages }}{{ if eq .Role \"system\" }}{{ $s = .Content }}{{ $t := 1 }}{{ end }}{{ end }}{{ $s }}";
        assert_eq!(render(t, &data(&[("system", "S"), ("user", "u")])), "S");
        let t = "{{ if true }}{{ $t := 1 }}{{ end }}{{ $t }}";
        assert!(Template::parse(t).unwrap().render(&data(&[])).unwrap_err().contains("undefined variable"));
    }

    #[test]
    fn and_or_return_an_operand_and_eq_takes_several() {
        let d = data(&[]);
        assert_eq!(render("{{ or \"\" \"x\" }}|{{ and \"a\" \"\" }}|{{ and 1 2 }}", &d), "x||2");
        assert_eq!(render("{{ eq \"b\" \"a\" \"b\" }}{{ ne 1 2 }}{{ not 0 }}", &d), "truetruetrue");
        assert_eq!(render("{{ .Missing }}", &d), "<no value>");
        assert_eq!(
            render("{{ \"a\" | len }}{{ index .Messages 0 }}", &data(&[("user", "x")])),
            "1map[Content:x Role:user]"
        );
    }

    #[test]
    fn unsupported_parts_are_refused_not_guessed() {
        for t in ["{{ with .System }}x{{ end }}", "{{ json .System }}", "{{ if .A }}x", "{{ end }}", "{{ .A"] {
            assert!(Template::parse(t).is_err(), "{t}");
        }
    }
}
