//! Located recipe problems, rendered by miette.
//!
//! Every value in a recipe remembers where it came from ([`Origin`]): a byte span in the recipe
//! file, an `RTUNE_*` environment variable, or a `--set` argument. A [`Problem`] points at that
//! origin, so a mistake made on the command line is reported against the command line.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use miette::{Diagnostic, LabeledSpan, NamedSource, SourceCode};

/// Text a recipe value came from.
#[derive(Debug)]
pub struct SourceText {
    /// What the user sees as the file name: a path, `--set`, or `env RTUNE_…`.
    pub name: String,
    pub text: String,
}

/// Where a value or key came from.
#[derive(Debug, Clone)]
pub struct Origin {
    pub source: Arc<SourceText>,
    pub span: Range<usize>,
}

impl Origin {
    pub fn new(source: &Arc<SourceText>, span: Range<usize>) -> Origin {
        Origin { source: source.clone(), span }
    }
}

/// One problem in a recipe.
#[derive(Debug, Clone)]
pub struct Problem {
    pub code: &'static str,
    pub message: String,
    pub at: Option<Origin>,
    pub label: Option<String>,
    pub help: Option<String>,
    src: Option<Arc<NamedSource<String>>>,
}

impl Problem {
    pub fn new(code: &'static str, message: impl Into<String>) -> Problem {
        Problem { code, message: message.into(), at: None, label: None, help: None, src: None }
    }

    pub fn at(mut self, origin: Option<&Origin>, label: impl Into<String>) -> Problem {
        if let Some(o) = origin {
            self.src =
                Some(Arc::new(NamedSource::new(o.source.name.clone(), o.source.text.clone()).with_language("toml")));
            self.at = Some(o.clone());
            self.label = Some(label.into());
        }
        self
    }

    pub fn help(mut self, help: impl Into<String>) -> Problem {
        self.help = Some(help.into());
        self
    }

    /// A sort key that lists problems in file order.
    fn order(&self) -> (String, usize, String) {
        match &self.at {
            Some(o) => (o.source.name.clone(), o.span.start, self.message.clone()),
            None => (String::new(), 0, self.message.clone()),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Problem {}

impl Diagnostic for Problem {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new(self.code))
    }

    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help.as_ref().map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        self.src.as_deref().map(|s| s as &dyn SourceCode)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        let at = self.at.as_ref()?;
        let len = at.span.end.saturating_sub(at.span.start);
        Some(Box::new(std::iter::once(LabeledSpan::new(self.label.clone(), at.span.start, len))))
    }
}

/// Every problem found in one recipe, reported together.
#[derive(Debug, Clone)]
pub struct Problems {
    pub recipe: String,
    pub problems: Vec<Problem>,
}

impl Problems {
    pub fn new(recipe: impl Into<String>, mut problems: Vec<Problem>) -> Problems {
        problems.sort_by_key(|p| p.order());
        problems.dedup_by(|a, b| a.message == b.message && a.order() == b.order());
        Problems { recipe: recipe.into(), problems }
    }
}

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        write!(f, "recipe `{}` has {} problem{}", self.recipe, n, if n == 1 { "" } else { "s" })
    }
}

impl std::error::Error for Problems {}

impl Diagnostic for Problems {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new("rtune::recipe::invalid"))
    }

    fn related<'a>(&'a self) -> Option<Box<dyn Iterator<Item = &'a dyn Diagnostic> + 'a>> {
        Some(Box::new(self.problems.iter().map(|p| p as &dyn Diagnostic)))
    }
}

/// The closest candidate to `word`, if it is close enough to be a plausible typo.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|c| (levenshtein(word, c), c))
        .filter(|(d, c)| *d <= (word.len().max(c.len()) / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Optimal string alignment distance: edits, with a swap of neighbours counted as one.
fn levenshtein(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

/// A value as a recipe would write it (floats in short form: 1e-4 rather than 0.0001).
pub fn show(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or_default();
            let plain = format!("{f}");
            let sci = format!("{f:e}");
            if sci.len() < plain.len() { sci } else { plain }
        }
        serde_json::Value::String(s) => format!("\"{s}\""),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions_are_close_words_only() {
        let keys = ["learning_rate", "batch_size", "epochs"];
        assert_eq!(did_you_mean("learning_rat", keys), Some("learning_rate"));
        assert_eq!(did_you_mean("epoch", keys), Some("epochs"));
        assert_eq!(did_you_mean("zzz", keys), None);
        assert_eq!(did_you_mean("cdua", ["cuda", "cpu"]), Some("cuda"));
    }
}
