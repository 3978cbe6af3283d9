//! Where an upload's files live outside the store, and whether they are still what rtune wrote.
//!
//! An upload's artifact is only a record (`upload.json`): which files went where, with their
//! size, blake3 digest and the store artifact each was copied from. `plan` compares the
//! destination with that record, so a `dir://` folder that is missing, incomplete or edited,
//! or an `hf://` repo whose files are gone, makes the stage *restore* rather than count as
//! cached. Restoring copies from the store (the exports, the card and the loss curve are all
//! artifacts there) and never recomputes upstream stages.
//!
//! A file's digest is only recomputed when its size, modification time or inode differ from
//! the stamp rtune recorded when it wrote the file (`state/destinations.json` in the store),
//! as DVC and git do; a stamped file of the right size is taken as intact.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::hub::HubEnv;
use crate::recipe::LoadedRecipe;
use crate::recipe::Problem;
use crate::store::Store;
use crate::ui::Ui;

/// Why writing or restoring a destination failed.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum DestinationError {
    #[error("{context}")]
    #[diagnostic(code(rtune::upload::io))]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    #[diagnostic(transparent)]
    Hub(#[from] crate::hub::HubError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Problem(#[from] Problem),
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> DestinationError {
    let context = context.into();
    move |source| DestinationError::Io { context, source }
}

/// `upload.json`: what an upload wrote.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// `dir://…` or `hf://…`, as the recipe says.
    pub destination: String,
    /// The Hub commit the upload made (`hf://` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Destination path → what was written there.
    pub files: BTreeMap<String, Written>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Written {
    pub digest: String,
    pub size: u64,
    /// `<fingerprint>/<path>`: the store artifact file it is a copy of.
    pub from: String,
    /// `hf://` only: the file's sha256, which the Hub lists for an LFS file (records written
    /// before 2026-11-29 have none, and are checked by size alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// `hf://` only, for a file committed inline: its git blob id, which the Hub lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git: Option<String>,
}

impl Record {
    pub fn read(store: &Store, fp: &str) -> Option<Record> {
        let text = std::fs::read_to_string(store.artifact_dir(fp).join("upload.json")).ok()?;
        serde_json::from_str(&text).ok()
    }
}

/// The outcome of comparing a destination with its record.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Intact,
    /// The stage must restore its files; the reason says what differs.
    Stale(String),
    /// The destination could not be checked (offline, or the Hub did not answer).
    NotChecked(String),
}

/// Compare the destination of the upload artifact `fp` with what it recorded.
pub fn check(loaded: &LoadedRecipe, store: &Store, fp: &str, hub: &HubEnv) -> Verdict {
    let Some(record) = Record::read(store, fp) else {
        return Verdict::Stale("destination not recorded (an older rtune built this upload)".into());
    };
    if let Some(rel) = record.destination.strip_prefix("dir://") {
        return check_dir(&loaded.resolve_path(rel), &record, &Stamps::load(store));
    }
    if let Some(rest) = record.destination.strip_prefix("hf://") {
        return check_hub(rest, &record, hub);
    }
    Verdict::NotChecked(format!("`{}` is not checked", record.destination))
}

fn check_dir(dest: &Path, record: &Record, stamps: &Stamps) -> Verdict {
    if !dest.is_dir() {
        return Verdict::Stale("destination missing".into());
    }
    let (mut missing, mut changed) = (Vec::new(), Vec::new());
    for (rel, w) in &record.files {
        match file_state(&dest.join(rel), w, stamps) {
            FileState::Intact => {}
            FileState::Missing => missing.push(rel.as_str()),
            FileState::Changed => changed.push(rel.as_str()),
        }
    }
    let mut parts = Vec::new();
    if missing.len() == record.files.len() {
        parts.push("destination missing".to_string());
    } else if !missing.is_empty() {
        parts.push(format!("destination incomplete: {} missing", list(&missing)));
    }
    if !changed.is_empty() {
        parts.push(format!("destination changed: {}", list(&changed)));
    }
    if parts.is_empty() { Verdict::Intact } else { Verdict::Stale(parts.join("; ")) }
}

enum FileState {
    Intact,
    Missing,
    Changed,
}

fn file_state(path: &Path, w: &Written, stamps: &Stamps) -> FileState {
    let Ok(meta) = std::fs::symlink_metadata(path) else { return FileState::Missing };
    if !meta.is_file() || meta.len() != w.size {
        return FileState::Changed;
    }
    if stamps.matches(path, &meta, &w.digest) {
        return FileState::Intact;
    }
    match crate::store::hash_file(path) {
        Ok((digest, _)) if digest == w.digest => FileState::Intact,
        _ => FileState::Changed,
    }
}

fn check_hub(rest: &str, record: &Record, hub: &HubEnv) -> Verdict {
    if hub.offline {
        return Verdict::NotChecked("destination not checked (offline)".into());
    }
    let Ok(repo) = crate::hub::parse_hf_url(rest) else {
        return Verdict::NotChecked(format!("destination not checked: `hf://{rest}` does not parse"));
    };
    let client = crate::hub::Client::new(hub.clone());
    let listing = match crate::hub::list_files(&client, &repo) {
        Ok(Some(l)) => l,
        Ok(None) => return Verdict::Stale("destination missing on the Hub".into()),
        Err(e) => return Verdict::NotChecked(format!("destination not checked: {}", client.redact(&e.to_string()))),
    };
    let mut gone = Vec::new();
    for (path, w) in &record.files {
        if !listing.files.get(path).is_some_and(|listed| holds(listed, w)) {
            gone.push(path.as_str());
        }
    }
    if gone.is_empty() {
        return Verdict::Intact;
    }
    Verdict::Stale(format!("destination changed on the Hub: {}", list(&gone)))
}

/// Whether a file the Hub lists has the bytes `w` recorded: its size, and the digest the
/// listing gives where the record has it too — an LFS file's sha256, an inline file's git blob
/// id (a file committed through LFS and listed inline later, or a record without digests, is
/// compared by size alone).
fn holds(listed: &crate::hub::ListedFile, w: &Written) -> bool {
    if listed.size != w.size {
        return false;
    }
    match (&listed.lfs_sha256, &listed.blob_id) {
        (Some(sha), _) => w.sha256.as_ref().is_none_or(|s| s == sha),
        (None, Some(oid)) => w.git.as_ref().is_none_or(|g| g == oid),
        (None, None) => true,
    }
}

/// The first three paths, and how many more.
fn list(paths: &[&str]) -> String {
    let more = if paths.len() > 3 { format!(" (+{} more)", paths.len() - 3) } else { String::new() };
    format!("{}{more}", paths.iter().take(3).copied().collect::<Vec<_>>().join(", "))
}

/// Copy `files` (destination path → store file) into the folder `dest`, each through a
/// temporary name and a rename, recording digests and stamps. A file already there with other
/// bytes than `expected` (when given) is kept beside as `<name>.rtune-replaced` and reported.
pub fn write_dir(
    store: &Store,
    dest: &Path,
    files: &[(String, PathBuf, String)],
    expected: Option<&Record>,
    ui: &Ui,
) -> Result<BTreeMap<String, Written>, DestinationError> {
    let mut stamps = Stamps::load(store);
    let mut out = BTreeMap::new();
    for (rel, src, from) in files {
        let target = dest.join(rel);
        let parent = target.parent().unwrap_or(dest).to_path_buf();
        std::fs::create_dir_all(&parent).map_err(io(format!("cannot create `{}`", parent.display())))?;
        if let Some(w) = expected.and_then(|r| r.files.get(rel)) {
            match file_state(&target, w, &stamps) {
                FileState::Intact => {
                    out.insert(rel.clone(), w.clone());
                    continue;
                }
                FileState::Missing => {}
                FileState::Changed => {
                    let mut aside = target.clone().into_os_string();
                    aside.push(".rtune-replaced");
                    std::fs::rename(&target, &aside)
                        .map_err(io(format!("cannot move `{}` aside", target.display())))?;
                    ui.warn(format!(
                        "`{}` had changed since rtune wrote it; restored, and the changed file kept as `{}`",
                        target.display(),
                        Path::new(&aside).display()
                    ));
                }
            }
        }
        let tmp = tempfile::Builder::new()
            .prefix(".rtune-upload-")
            .tempfile_in(&parent)
            .map_err(io(format!("cannot write in `{}`", parent.display())))?;
        let mut reader = std::fs::File::open(src).map_err(io(format!("cannot read `{}`", src.display())))?;
        std::io::copy(&mut reader, &mut tmp.as_file()).map_err(io(format!("cannot write `{}`", target.display())))?;
        tmp.as_file().sync_all().map_err(io(format!("cannot write `{}`", target.display())))?;
        let tmp_path = tmp.into_temp_path();
        let (digest, size) = crate::store::hash_file(&tmp_path).map_err(io("cannot hash a copy"))?;
        if let Some(w) = expected.and_then(|r| r.files.get(rel))
            && w.digest != digest
        {
            return Err(Problem::new(
                "rtune::upload::source_changed",
                format!("`{}` in the store no longer has the digest the upload recorded", src.display()),
            )
            .help("run again with `--force upload` to upload what the store holds now")
            .into());
        }
        tmp_path.persist(&target).map_err(|e| DestinationError::Io {
            context: format!("cannot write `{}`", target.display()),
            source: e.error,
        })?;
        crate::store::sync_dir(&parent);
        if let Ok(meta) = std::fs::metadata(&target) {
            stamps.insert(&target, &meta, &digest);
        }
        out.insert(rel.clone(), Written { digest, size, from: from.clone(), sha256: None, git: None });
    }
    stamps.save(store);
    Ok(out)
}

/// Where the store file a record entry was copied from lives.
pub fn source_path(store: &Store, from: &str) -> PathBuf {
    let (fp, rel) = from.split_once('/').unwrap_or((from, ""));
    store.artifact_dir(fp).join(rel)
}

/// Restore the destination of the upload artifact `fp` from the store. Returns a one-line
/// summary.
pub fn restore(
    loaded: &LoadedRecipe,
    store: &Store,
    fp: &str,
    hub: &HubEnv,
    ui: &Ui,
) -> Result<String, DestinationError> {
    let record = Record::read(store, fp).ok_or_else(|| {
        Problem::new("rtune::upload::no_record", format!("the upload artifact {fp} has no readable upload.json"))
            .help("run `rtune cache verify`, then run again with `--force upload`")
    })?;
    let mut files = Vec::new();
    for (rel, w) in &record.files {
        let src = source_path(store, &w.from);
        if !src.is_file() {
            return Err(Problem::new(
                "rtune::upload::source_gone",
                format!("cannot restore `{rel}`: its store copy `{}` is gone", src.display()),
            )
            .help("run again with `--force` on the upload stage (`rtune run <recipe> --force upload`)")
            .into());
        }
        files.push((rel.clone(), src, w.from.clone()));
    }
    if let Some(rel) = record.destination.strip_prefix("dir://") {
        let dest = loaded.resolve_path(rel);
        let written = write_dir(store, &dest, &files, Some(&record), ui)?;
        return Ok(format!("restored {} → {}", crate::ui::count(written.len(), "file"), dest.display()));
    }
    if let Some(rest) = record.destination.strip_prefix("hf://") {
        let repo = crate::hub::parse_hf_url(rest)?;
        let client = crate::hub::Client::new(hub.clone());
        let commit_files: Vec<crate::hub::CommitFile> =
            files.iter().map(|(p, l, _)| crate::hub::CommitFile { path: p.clone(), local: l.clone() }).collect();
        let message = format!("Restore {} with rtune", loaded.recipe.recipe.name);
        let report = crate::hub::commit(&client, &repo, &commit_files, &message, crate::hub::Ignored::Refuse, ui)?;
        return Ok(format!(
            "re-uploaded {} → {} (commit {})",
            crate::ui::count(files.len(), "file"),
            repo.display(),
            report.commit
        ));
    }
    Err(Problem::new("rtune::upload::bad_record", format!("`{}` cannot be restored", record.destination)).into())
}

/// Size, modification time and inode of files rtune wrote, with their digest: a file whose
/// stamp still matches is not re-hashed.
#[derive(Default, Serialize, Deserialize)]
struct Stamps {
    files: BTreeMap<String, Stamp>,
}

#[derive(PartialEq, Serialize, Deserialize)]
struct Stamp {
    size: u64,
    mtime_ns: i128,
    inode: u64,
    digest: String,
}

impl Stamps {
    fn path(store: &Store) -> PathBuf {
        store.state_dir().join("destinations.json")
    }

    fn load(store: &Store) -> Stamps {
        std::fs::read_to_string(Self::path(store)).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default()
    }

    fn stamp(meta: &std::fs::Metadata, digest: &str) -> Stamp {
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as i128)
            .unwrap_or(-1);
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(meta);
        #[cfg(not(unix))]
        let inode = 0;
        Stamp { size: meta.len(), mtime_ns, inode, digest: digest.to_string() }
    }

    fn key(path: &Path) -> String {
        std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()).to_string_lossy().into_owned()
    }

    fn matches(&self, path: &Path, meta: &std::fs::Metadata, digest: &str) -> bool {
        let now = Self::stamp(meta, digest);
        now.mtime_ns >= 0 && self.files.get(&Self::key(path)) == Some(&now)
    }

    fn insert(&mut self, path: &Path, meta: &std::fs::Metadata, digest: &str) {
        self.files.insert(Self::key(path), Self::stamp(meta, digest));
    }

    /// Best effort: a lost update only costs a re-hash on the next check. Entries whose file is
    /// gone are dropped.
    fn save(mut self, store: &Store) {
        let mut merged = Stamps::load(store);
        merged.files.append(&mut self.files);
        merged.files.retain(|p, _| Path::new(p).exists());
        if let Ok(text) = serde_json::to_string(&merged) {
            let _ = std::fs::create_dir_all(store.state_dir());
            let _ = crate::store::write_atomic(&Self::path(store), text.as_bytes());
        }
    }
}
