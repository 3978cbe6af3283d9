//! The one pattern matcher: Python's `fnmatch` semantics, which huggingface_hub uses for
//! `--include` / `--exclude` (and rtune for Hub `files`, and for `trainable` weight names):
//! `*` matches any run of characters including `/` and `.`, `?` one character, `[abc]` /
//! `[!abc]` / `[a-z]` a class.

/// A pattern that matches `name` only: `*`, `?` and `[` each in a class of its own.
pub fn escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '*' | '?' | '[' => {
                out.push('[');
                out.push(c);
                out.push(']');
            }
            c => out.push(c),
        }
    }
    out
}

/// Does `name` match `pattern`?
pub fn fnmatch(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // Iterative matcher with one backtrack point for the last `*` (linear for typical patterns).
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() {
            match p[pi] {
                '*' => {
                    star = Some((pi, ni));
                    pi += 1;
                    continue;
                }
                '?' => {
                    pi += 1;
                    ni += 1;
                    continue;
                }
                '[' => {
                    if let Some((matched, next)) = class(&p, pi, n[ni])
                        && matched
                    {
                        pi = next;
                        ni += 1;
                        continue;
                    } else if class(&p, pi, n[ni]).is_none() && n[ni] == '[' {
                        // An unclosed `[` is a literal.
                        pi += 1;
                        ni += 1;
                        continue;
                    }
                }
                c if c == n[ni] => {
                    pi += 1;
                    ni += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star {
            Some((sp, sn)) => {
                pi = sp + 1;
                ni = sn + 1;
                star = Some((sp, sn + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// Match `c` against the class starting at `p[start] == '['`: Some((matched, index after `]`)),
/// or None when the class is not closed.
fn class(p: &[char], start: usize, c: char) -> Option<(bool, usize)> {
    let mut i = start + 1;
    let negate = i < p.len() && p[i] == '!';
    if negate {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    while i < p.len() && (p[i] != ']' || first) {
        first = false;
        if i + 2 < p.len() && p[i + 1] == '-' && p[i + 2] != ']' {
            if p[i] <= c && c <= p[i + 2] {
                matched = true;
            }
            i += 3;
        } else {
            if p[i] == c {
                matched = true;
            }
            i += 1;
        }
    }
    if i >= p.len() {
        return None;
    }
    Some((matched != negate, i + 1))
}

#[cfg(test)]
mod tests {
    use super::{escape, fnmatch};

    #[test]
    fn an_escaped_name_matches_itself_only() {
        for name in ["data/train-*.jsonl", "a?b[1].csv", "x[!y]", "plain.json", "[", "*"] {
            let p = escape(name);
            assert!(fnmatch(&p, name), "{p} vs {name}");
        }
        assert!(!fnmatch(&escape("data/train-*.jsonl"), "data/train-0.jsonl"));
        assert!(!fnmatch(&escape("a?.csv"), "ab.csv"));
        assert!(!fnmatch(&escape("[ab].csv"), "a.csv"));
    }

    #[test]
    fn matches_like_python_fnmatch() {
        let cases = [
            ("*.json", "config.json", true),
            ("*.json", "sub/dir/config.json", true),
            ("*.safetensors", "model.safetensors.index.json", false),
            ("model-*.safetensors", "model-00001-of-00002.safetensors", true),
            ("?.txt", "a.txt", true),
            ("?.txt", "ab.txt", false),
            ("[ab].txt", "b.txt", true),
            ("[!ab].txt", "b.txt", false),
            ("[a-c]x", "bx", true),
            ("[a-c]x", "dx", false),
            ("data/*", "data/train.jsonl", true),
            ("data/*", "other/train.jsonl", false),
            ("*", "", true),
            ("", "", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxbyy", false),
            ("[", "[", true),
            ("tokenizer*", "tokenizer_config.json", true),
        ];
        for (p, n, want) in cases {
            assert_eq!(fnmatch(p, n), want, "fnmatch({p:?}, {n:?})");
        }
    }
}
