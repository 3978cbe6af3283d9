//! The Hugging Face Hub: downloads into the standard HF cache (shared with Python tools),
//! offline resolution from that cache, and uploads through the Hub's commit API.
//!
//! The cache layout is `hf_hub`'s (`models--owner--name/{blobs,refs,snapshots}`); the HTTP
//! side is our own on `ureq` because rtune needs things the hf-hub crate does not do: checking
//! every downloaded file against its digest, refusing hostile file names, etags and refs before
//! they touch the disk, atomic ref and pointer writes, and the upload protocol. See
//! docs/interop.md for the environment variables and docs/reliability.md for the guarantees.

mod cache;
mod download;
mod http;
mod upload;

use std::path::PathBuf;

pub use crate::glob::fnmatch;
pub use cache::{CachedSnapshot, HubCache};
pub use download::{
    DownloadReport, FileReport, ListedFile, Listing, Wanted, download_command, list_files, resolve_commit, snapshot,
};
pub use http::Client;
pub use upload::{CommitFile, CommitReport, HubDigests, Ignored, commit, create_repo, git_blob_id};

/// The default Hub address; `HF_ENDPOINT` overrides it (mirrors, tests).
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// An access token. It is never printed: `Debug` and `Display` show only that one is set.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    pub fn new(s: &str) -> Option<Token> {
        let t = s.trim();
        (!t.is_empty()).then(|| Token(t.to_string()))
    }

    pub(crate) fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// Remove the token from a message (a server may echo it back).
    pub fn redact(&self, text: &str) -> String {
        text.replace(&self.0, "hf_***")
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Where the Hub is, where its cache is, and how rtune may use them.
#[derive(Debug, Clone)]
pub struct HubEnv {
    pub endpoint: String,
    pub cache_dir: PathBuf,
    pub token: Option<Token>,
    pub offline: bool,
    /// Attempts for a request that fails with a timeout, a dropped connection, 429 or 5xx.
    pub attempts: u32,
    /// First retry delay; doubles each time (capped at 16 s).
    pub backoff_ms: u64,
}

impl HubEnv {
    /// Read the standard variables: `HF_ENDPOINT`, `HF_HUB_CACHE` / `HF_HOME`, `HF_TOKEN` /
    /// `HF_TOKEN_PATH` / `$HF_HOME/token`, `HF_HUB_OFFLINE`. A token or offline flag from the
    /// command line wins.
    pub fn from_env(token: Option<&str>, offline: bool) -> HubEnv {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::home_dir().map(|h| h.join(".cache")))
                .unwrap_or_else(|| PathBuf::from(".cache"))
                .join("huggingface")
        });
        let cache_dir = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token = token
            .and_then(Token::new)
            .or_else(|| var("HF_TOKEN").and_then(|t| Token::new(&t)))
            .or_else(|| var("HUGGING_FACE_HUB_TOKEN").and_then(|t| Token::new(&t)))
            .or_else(|| {
                let path = var("HF_TOKEN_PATH").map(PathBuf::from).unwrap_or_else(|| hf_home.join("token"));
                std::fs::read_to_string(path).ok().and_then(|t| Token::new(&t))
            });
        let truthy = |v: Option<String>| {
            v.is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "on" | "yes" | "true"))
        };
        HubEnv {
            endpoint: var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.into()).trim_end_matches('/').to_string(),
            cache_dir,
            token,
            offline: offline || truthy(var("HF_HUB_OFFLINE")),
            attempts: var("RTUNE_HUB_ATTEMPTS").and_then(|v| v.parse().ok()).unwrap_or(5).max(1),
            backoff_ms: var("RTUNE_HUB_BACKOFF_MS").and_then(|v| v.parse().ok()).unwrap_or(500),
        }
    }
}

/// Model or dataset repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RepoKind {
    Model,
    Dataset,
}

impl RepoKind {
    /// `models` / `datasets`, as in `/api/models/...`.
    pub fn plural(self) -> &'static str {
        match self {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        }
    }

    /// The prefix of a repo's web and resolve URLs: none for models.
    pub fn url_prefix(self) -> &'static str {
        match self {
            RepoKind::Model => "",
            RepoKind::Dataset => "datasets/",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RepoKind::Model => "model",
            RepoKind::Dataset => "dataset",
        }
    }

    fn hf_hub(self) -> hf_hub::RepoType {
        match self {
            RepoKind::Model => hf_hub::RepoType::Model,
            RepoKind::Dataset => hf_hub::RepoType::Dataset,
        }
    }
}

/// A repository id and the revision asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRef {
    pub id: String,
    pub kind: RepoKind,
    pub revision: String,
}

impl RepoRef {
    /// Check `id` and `revision` the way the Hub does, so neither can reach outside the cache
    /// when they become folder names.
    pub fn new(id: &str, kind: RepoKind, revision: Option<&str>) -> Result<RepoRef, HubError> {
        check_repo_id(id)?;
        let revision = revision.unwrap_or("main");
        check_revision(revision)?;
        Ok(RepoRef { id: id.to_string(), kind, revision: revision.to_string() })
    }

    pub fn with_revision(&self, revision: &str) -> RepoRef {
        RepoRef { revision: revision.to_string(), ..self.clone() }
    }

    /// `models--owner--name`, the repo's folder in the HF cache.
    pub fn folder_name(&self) -> String {
        hf_hub::Repo::new(self.id.clone(), self.kind.hf_hub()).folder_name()
    }

    pub fn display(&self) -> String {
        format!("{}{}@{}", self.kind.url_prefix(), self.id, self.revision)
    }
}

/// Parse the part after `hf://`: `owner/name[@revision]`, or `datasets/owner/name[@revision]`.
pub fn parse_hf_url(rest: &str) -> Result<RepoRef, HubError> {
    let (kind, rest) = match rest.strip_prefix("datasets/") {
        Some(r) => (RepoKind::Dataset, r),
        None => (RepoKind::Model, rest.strip_prefix("models/").unwrap_or(rest)),
    };
    let (id, rev) = match rest.split_once('@') {
        Some((id, rev)) => (id, Some(rev)),
        None => (rest, None),
    };
    RepoRef::new(id, kind, rev)
}

/// `owner/name` or `name`: letters, digits, `-`, `_`, `.`; no `--` or `..`; at most 96 chars.
pub fn check_repo_id(id: &str) -> Result<(), HubError> {
    let parts: Vec<&str> = id.split('/').collect();
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !p.starts_with(['-', '.'])
            && !p.ends_with(['-', '.'])
    };
    if id.len() > 96 || parts.len() > 2 || !parts.iter().all(|p| part_ok(p)) || id.contains("--") || id.contains("..") {
        return Err(HubError::BadRepoId { id: id.to_string() });
    }
    Ok(())
}

/// A branch, tag or commit: path-like, but without empty, `.` or `..` parts.
pub fn check_revision(rev: &str) -> Result<(), HubError> {
    let bad = rev.is_empty()
        || rev.len() > 255
        || rev.split('/').any(|p| p.is_empty() || p == "." || p == "..")
        || rev.chars().any(|c| c.is_control() || matches!(c, '\\' | ':' | '~' | '^' | '?' | '*' | '[' | ' '));
    if bad {
        return Err(HubError::BadRevision { revision: rev.to_string() });
    }
    Ok(())
}

/// A commit id: 40 lowercase hex digits.
pub fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A file name from a repo listing, checked before it becomes a path: relative, `/`-separated,
/// no empty, `.` or `..` parts, no backslashes, drive letters or control characters.
pub fn check_repo_path(p: &str) -> Result<(), HubError> {
    let bad = p.is_empty()
        || p.len() > 1024
        || p.starts_with('/')
        || p.contains('\\')
        || p.contains(':')
        || p.chars().any(char::is_control)
        || p.split('/').any(|c| c.is_empty() || c == "." || c == "..");
    if bad {
        return Err(HubError::UnsafePath { path: http::escape_controls(p) });
    }
    Ok(())
}

/// Everything that can go wrong talking to the Hub or its cache.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum HubError {
    #[error("`{id}` is not a valid repository id")]
    #[diagnostic(
        code(rtune::hub::bad_repo_id),
        help("ids look like `owner/name`: letters, digits, `-`, `_` and `.`, without `--` or `..`")
    )]
    BadRepoId { id: String },
    #[error("`{revision}` is not a valid revision")]
    #[diagnostic(code(rtune::hub::bad_revision), help("use a branch (`main`), a tag, or a 40-digit commit id"))]
    BadRevision { revision: String },
    #[error("the Hub listed an unsafe file name `{path}`")]
    #[diagnostic(
        code(rtune::hub::unsafe_path),
        help("file names must be relative and stay inside the repository; nothing was written")
    )]
    UnsafePath { path: String },
    #[error("{what}: the Hub answered 401 Unauthorized")]
    #[diagnostic(
        code(rtune::hub::unauthorized),
        help("set HF_TOKEN (or run `huggingface-cli login`, or pass --token) with a token that can read this repo")
    )]
    Unauthorized { what: String },
    #[error("{what}: the Hub answered 403 Forbidden")]
    #[diagnostic(
        code(rtune::hub::forbidden),
        help(
            "the token lacks access: gated repos need their terms accepted on the website; uploads need a write token"
        )
    )]
    Forbidden { what: String },
    #[error("{what}: not found (404)")]
    #[diagnostic(
        code(rtune::hub::not_found),
        help(
            "check the repository id, the revision and the repo type (`--repo-type dataset`); private repos need a token"
        )
    )]
    NotFound { what: String },
    #[error("{what}: the Hub answered {status}: {body}")]
    #[diagnostic(code(rtune::hub::http))]
    Status { what: String, status: u16, body: String },
    #[error("{what}: cannot reach {endpoint} after {attempts} attempts: {reason}")]
    #[diagnostic(
        code(rtune::hub::unreachable),
        help(
            "check the network or HF_ENDPOINT; with the files already cached, run with --offline (or HF_HUB_OFFLINE=1)"
        )
    )]
    Unreachable { what: String, endpoint: String, attempts: u32, reason: String },
    #[error("{what}: the Hub sent a malformed answer: {reason}")]
    #[diagnostic(
        code(rtune::hub::bad_response),
        help("is HF_ENDPOINT a Hub (or a mirror of one)? A proxy or captive portal may have answered instead")
    )]
    BadResponse { what: String, reason: String },
    #[error("`{file}` from {repo} does not match its digest (expected {expected}, got {actual})")]
    #[diagnostic(
        code(rtune::hub::digest_mismatch),
        help("the download was corrupted or the server is misbehaving; nothing was kept, run again to retry")
    )]
    DigestMismatch { repo: String, file: String, expected: String, actual: String },
    #[error("{repo} would not keep {files}: the repository's .gitignore excludes them")]
    #[diagnostic(
        code(rtune::hub::ignored),
        help(
            "change the repository's .gitignore on the Hub, upload elsewhere, or leave those files out; nothing was committed"
        )
    )]
    Ignored { repo: String, files: String },
    #[error("offline: {count} file(s) of the recipe are not in the Hugging Face cache ({cache})")]
    #[diagnostic(code(rtune::hub::offline_missing))]
    OfflineMissing {
        count: usize,
        cache: String,
        #[help]
        commands: String,
    },
    #[error("{context}")]
    #[diagnostic(code(rtune::hub::io))]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl HubError {
    /// The diagnostic code, as a static string (for [`crate::recipe::Problem`]).
    pub fn static_code(&self) -> &'static str {
        match self {
            HubError::BadRepoId { .. } => "rtune::hub::bad_repo_id",
            HubError::BadRevision { .. } => "rtune::hub::bad_revision",
            HubError::UnsafePath { .. } => "rtune::hub::unsafe_path",
            HubError::Unauthorized { .. } => "rtune::hub::unauthorized",
            HubError::Forbidden { .. } => "rtune::hub::forbidden",
            HubError::NotFound { .. } => "rtune::hub::not_found",
            HubError::Status { .. } => "rtune::hub::http",
            HubError::Unreachable { .. } => "rtune::hub::unreachable",
            HubError::BadResponse { .. } => "rtune::hub::bad_response",
            HubError::DigestMismatch { .. } => "rtune::hub::digest_mismatch",
            HubError::Ignored { .. } => "rtune::hub::ignored",
            HubError::OfflineMissing { .. } => "rtune::hub::offline_missing",
            HubError::Io { .. } => "rtune::hub::io",
        }
    }

    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> HubError {
        let context = context.into();
        move |source| HubError::Io { context, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_revisions_and_paths_are_checked() {
        for ok in ["gpt2", "HuggingFaceTB/SmolLM2-135M", "a.b/c_d-1"] {
            assert!(check_repo_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/b/c", "../x", "a/..", "a--b/c", "/abs", "a/b c", "-a/b", "a/b."] {
            assert!(check_repo_id(bad).is_err(), "{bad}");
        }
        for ok in ["main", "v1.0", "refs/pr/1", "feature/x"] {
            assert!(check_revision(ok).is_ok(), "{ok}");
        }
        for bad in ["", "../main", "a//b", "/main", "a/./b", "x\\y", "a\nb"] {
            assert!(check_revision(bad).is_err(), "{bad:?}");
        }
        for ok in ["config.json", "sub/dir/model.safetensors", "..hidden.json", "a..b"] {
            assert!(check_repo_path(ok).is_ok(), "{ok}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "C:\\x", "c:/x", "a\\b", "a\0b"] {
            assert!(check_repo_path(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            RepoRef::new("HuggingFaceTB/SmolLM2-135M", RepoKind::Model, None).unwrap().folder_name(),
            "models--HuggingFaceTB--SmolLM2-135M"
        );
        assert_eq!(RepoRef::new("o/d", RepoKind::Dataset, Some("v1")).unwrap().folder_name(), "datasets--o--d");
    }

    #[test]
    fn tokens_never_print() {
        let t = Token::new(" hf_secret123 \n").unwrap();
        assert_eq!(format!("{t} {t:?}"), "*** Token(***)");
        assert_eq!(t.redact("bad token hf_secret123!"), "bad token hf_***!");
        assert!(Token::new("  ").is_none());
    }
}
