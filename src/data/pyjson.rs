//! Python's `json.dumps` for template values: the `tojson` filter as transformers defines it for
//! chat templates (`json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`), where minijinja's own escapes `<`, `>`, `&` and `'` for HTML and writes
//! floats as Rust does (`0.00001` for Python's `1e-05`). Tool calls' arguments and tool
//! schemas go through it, so its bytes are the training rows'.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// How [`filter`] writes: `json.dumps`'s keyword arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Style {
    pub ensure_ascii: bool,
    /// `None`: one line; `Some(s)`: each item on its own line, `s` repeated per level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Style {
    /// `json.dumps`'s defaults for `indent`: `", "` between items on one line, `","` with
    /// an indent; `": "` after keys.
    pub fn new(ensure_ascii: bool, indent: Option<String>, sort_keys: bool) -> Style {
        let item_sep = if indent.is_some() { "," } else { ", " }.to_string();
        Style { ensure_ascii, indent, item_sep, key_sep: ": ".into(), sort_keys }
    }
}

/// The `tojson` filter: `x | tojson`, `x | tojson(indent=2)`, `tojson(x, ensure_ascii=True,
/// separators=(",", ":"), sort_keys=True)`; like transformers', a first positional argument is
/// `ensure_ascii`.
pub fn filter(value: &Value, ensure_ascii: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = match ensure_ascii {
        Some(v) => v.is_true(),
        None => kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: indent must be a number or a string")
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let mut style = Style::new(ensure_ascii, indent, sort_keys);
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")?.filter(|v| !v.is_none()) {
        let pair: Vec<Value> = seps.try_iter()?.collect();
        match pair.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                style.item_sep = a.as_str().unwrap_or_default().to_string();
                style.key_sep = b.as_str().unwrap_or_default().to_string();
            }
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
        }
    }
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write(value, &style, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write(v: &Value, style: &Style, depth: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => {
            let f = f64::try_from(v.clone())
                .map_err(|_| Error::new(ErrorKind::InvalidOperation, "tojson: a number that is not a float"))?;
            out.push_str(&float(f));
        }
        ValueKind::String => string(v.as_str().unwrap_or_default(), style.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            container(out, style, depth, '[', ']', items.len(), |i, out| write(&items[i], style, depth + 1, out))?;
        }
        ValueKind::Map => {
            let mut pairs = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                pairs.push((key(&k)?, val));
            }
            if style.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            container(out, style, depth, '{', '}', pairs.len(), |i, out| {
                string(&pairs[i].0, style.ensure_ascii, out);
                out.push_str(&style.key_sep);
                write(&pairs[i].1, style, depth + 1, out)
            })?;
        }
        // Python's json.dumps refuses what is not JSON (jinja2's Undefined included).
        other => {
            return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: a {other} value is not JSON")));
        }
    }
    Ok(())
}

/// A dict key as `json.dumps` writes it: strings as they are, numbers, booleans and None as
/// their JSON text.
fn key(k: &Value) -> Result<String, Error> {
    match k.kind() {
        ValueKind::String => Ok(k.as_str().unwrap_or_default().to_string()),
        ValueKind::None | ValueKind::Bool | ValueKind::Number => {
            let mut s = String::new();
            write(k, &Style::new(false, None, false), 0, &mut s)?;
            Ok(s)
        }
        other => Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: a {other} key is not JSON"))),
    }
}

fn container(
    out: &mut String,
    style: &Style,
    depth: usize,
    open: char,
    close: char,
    n: usize,
    mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..n {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(ind) = &style.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth + 1));
        }
        item(i, out)?;
    }
    if let Some(ind) = &style.indent {
        out.push('\n');
        out.push_str(&ind.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// A string as `json.dumps` quotes it: `"`, `\` and control characters escaped (the five
/// with short forms, the rest as `\u00xx`); with `ensure_ascii`, everything past `~` as
/// `\uxxxx` (UTF-16 surrogate pairs past U+FFFF).
fn string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            // Python's ASCII form escapes all but ' '..='~' (DEL too).
            c if ensure_ascii && c > '~' => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr` writes it (which `json.dumps` uses): the shortest digits that
/// read back the same, in positional notation for decimal exponents from -4 to 15 (with `.0`
/// when whole), else `d.ddde±XX`; `NaN`, `Infinity`, `-Infinity`.
pub fn float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sign = if f.is_sign_negative() { "-" } else { "" };
    // Rust's `{:e}` gives the same shortest digits: "1.2345e-5", "1e16", "0e0".
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e}'s exponent is an integer");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if f == 0.0 {
        return format!("{sign}0.0");
    }
    if (-4..16).contains(&exp) {
        let body = if exp < 0 {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        } else {
            let point = exp as usize + 1;
            if digits.len() > point {
                format!("{}.{}", &digits[..point], &digits[point..])
            } else {
                format!("{digits}{}.0", "0".repeat(point - digits.len()))
            }
        };
        format!("{sign}{body}")
    } else {
        let e_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{e_sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_python_writes_them() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (123456789.125, "123456789.125"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e100, "1.2345e+100"),
            (-2.5, "-2.5"),
            (-0.0, "-0.0"),
            (0.1 + 0.2, "0.30000000000000004"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(float(f), want, "{f:?}");
        }
    }
}
