//! The Hugging Face cache layout, as huggingface_hub writes it, so both tools share one copy:
//!
//! ```text
//! <cache>/models--owner--name/blobs/<etag>                      the bytes, named by etag
//! <cache>/models--owner--name/refs/<revision>                   the commit a branch/tag was at
//! <cache>/models--owner--name/snapshots/<commit>/<path> -> ../../blobs/<etag>
//! <cache>/.locks/models--owner--name/<etag>.lock                held while a blob is written
//! ```
//!
//! Every name that comes from the network (etag, commit, file path) is checked before it
//! becomes a path, and refs and pointers are replaced atomically.

use std::fs;
use std::path::{Path, PathBuf};

use super::{HubError, RepoRef, check_repo_path, is_commit};

#[derive(Debug, Clone)]
pub struct HubCache {
    root: PathBuf,
}

/// A revision as found in the cache.
#[derive(Debug, Clone)]
pub struct CachedSnapshot {
    pub commit: String,
    pub dir: PathBuf,
}

const CACHEDIR_TAG: &str = "Signature: 8a477f597d28d172789f06886806bc55\n\
# This file is a cache directory tag created by huggingface_hub.\n\
# For information about cache directory tags, see:\n\
#\thttps://bford.info/cachedir/\n";

/// One file of a repo listing.
#[derive(Debug, Clone)]
pub struct TreeEntry {
    pub path: String,
    pub size: u64,
    pub blob_id: String,
    /// (sha256, size) of an LFS file.
    pub lfs: Option<(String, u64)>,
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), HubError> {
    crate::store::write_atomic(path, bytes).map_err(|e| HubError::Io {
        context: format!("cannot write `{}`", path.display()),
        source: match e {
            crate::store::StoreError::Io { source, .. } => source,
            other => std::io::Error::other(other.to_string()),
        },
    })
}

/// An etag names a blob: a git blob id (40 hex) or an LFS sha256 (64 hex).
pub fn check_etag(etag: &str) -> bool {
    (etag.len() == 40 || etag.len() == 64) && etag.bytes().all(|b| b.is_ascii_hexdigit())
}

impl HubCache {
    pub fn new(root: &Path) -> HubCache {
        HubCache { root: root.to_path_buf() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Tag the cache for backup tools, with the text huggingface_hub writes.
    pub fn tag(&self) -> Result<(), HubError> {
        let path = self.root.join("CACHEDIR.TAG");
        if path.exists() {
            return Ok(());
        }
        fs::create_dir_all(&self.root).map_err(HubError::io(format!("cannot create `{}`", self.root.display())))?;
        write_atomic(&path, CACHEDIR_TAG.as_bytes())
    }

    /// `trees/<commit>.json`: the repo's full file listing at a commit (immutable), in
    /// huggingface_hub's format, so either tool can work offline from it.
    pub fn write_tree(&self, repo: &RepoRef, commit: &str, files: &[TreeEntry]) -> Result<(), HubError> {
        let path = self.repo_dir(repo).join("trees").join(format!("{commit}.json"));
        if path.exists() {
            return Ok(());
        }
        let mut sorted: Vec<&TreeEntry> = files.iter().collect();
        sorted.sort_by(|a, b| a.path.cmp(&b.path));
        // json.dump(data, indent=1), byte for byte.
        let q = |s: &str| serde_json::to_string(s).expect("string");
        let mut out = String::from("{\n \"format_version\": 1,\n \"files\": {");
        for (i, f) in sorted.iter().enumerate() {
            out.push_str(if i == 0 { "\n" } else { ",\n" });
            out.push_str(&format!("  {}: {{\n   \"size\": {},\n   \"blob_id\": {}", q(&f.path), f.size, q(&f.blob_id)));
            if let Some((sha, size)) = &f.lfs {
                out.push_str(&format!(",\n   \"lfs_sha256\": {},\n   \"lfs_size\": {size}", q(sha)));
            }
            out.push_str("\n  }");
        }
        out.push_str(if sorted.is_empty() { "}\n}" } else { "\n }\n}" });
        let parent = path.parent().expect("trees has a parent");
        fs::create_dir_all(parent).map_err(HubError::io(format!("cannot create `{}`", parent.display())))?;
        write_atomic(&path, out.as_bytes())
    }

    /// The listing saved by [`HubCache::write_tree`] (or by huggingface_hub).
    pub fn read_tree(&self, repo: &RepoRef, commit: &str) -> Option<Vec<String>> {
        let text = fs::read_to_string(self.repo_dir(repo).join("trees").join(format!("{commit}.json"))).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        if v["format_version"] != 1 {
            return None;
        }
        let files: Vec<String> = v["files"].as_object()?.keys().cloned().collect();
        files.iter().all(|f| check_repo_path(f).is_ok()).then_some(files)
    }

    pub fn repo_dir(&self, repo: &RepoRef) -> PathBuf {
        self.root.join(repo.folder_name())
    }

    /// The commit `repo.revision` resolves to in the cache, if it does.
    pub fn resolve(&self, repo: &RepoRef) -> Option<CachedSnapshot> {
        let dir = self.repo_dir(repo);
        let commit = if is_commit(&repo.revision) {
            repo.revision.clone()
        } else {
            let text = fs::read_to_string(dir.join("refs").join(&repo.revision)).ok()?;
            let c = text.trim().to_string();
            is_commit(&c).then_some(c)?
        };
        let snap = dir.join("snapshots").join(&commit);
        snap.is_dir().then_some(CachedSnapshot { commit, dir: snap })
    }

    /// Point `refs/<revision>` at `commit` (atomically; nothing to do for a commit id).
    pub fn write_ref(&self, repo: &RepoRef, commit: &str) -> Result<(), HubError> {
        if repo.revision == commit {
            return Ok(());
        }
        let path = self.repo_dir(repo).join("refs").join(&repo.revision);
        if fs::read_to_string(&path).is_ok_and(|t| t.trim() == commit) {
            return Ok(());
        }
        let parent = path.parent().expect("refs has a parent");
        fs::create_dir_all(parent).map_err(HubError::io(format!("cannot create `{}`", parent.display())))?;
        write_atomic(&path, commit.as_bytes())
    }

    pub fn blob_path(&self, repo: &RepoRef, etag: &str) -> PathBuf {
        debug_assert!(check_etag(etag));
        self.repo_dir(repo).join("blobs").join(etag)
    }

    pub fn pointer_path(&self, repo: &RepoRef, commit: &str, file: &str) -> PathBuf {
        debug_assert!(is_commit(commit) && check_repo_path(file).is_ok());
        self.repo_dir(repo).join("snapshots").join(commit).join(file)
    }

    /// The lock huggingface_hub also takes while writing a blob (`flock` on the same file).
    pub fn lock_blob(&self, repo: &RepoRef, etag: &str) -> Result<fs::File, HubError> {
        let path = self.root.join(".locks").join(repo.folder_name()).join(format!("{etag}.lock"));
        let parent = path.parent().expect("lock has a parent");
        fs::create_dir_all(parent).map_err(HubError::io(format!("cannot create `{}`", parent.display())))?;
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(HubError::io(format!("cannot open `{}`", path.display())))?;
        f.lock().map_err(HubError::io(format!("cannot lock `{}`", path.display())))?;
        Ok(f)
    }

    /// Make `snapshots/<commit>/<file>` point at `blobs/<etag>` with a relative symlink, as
    /// huggingface_hub does (a copy where symlinks are not allowed).
    pub fn link(&self, repo: &RepoRef, commit: &str, file: &str, etag: &str) -> Result<PathBuf, HubError> {
        check_repo_path(file)?;
        let pointer = self.pointer_path(repo, commit, file);
        let depth = file.split('/').count() + 1; // up through the path, then `<commit>`
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(etag);
        if fs::read_link(&pointer).is_ok_and(|t| t == target) {
            return Ok(pointer);
        }
        let parent = pointer.parent().expect("pointer has a parent");
        fs::create_dir_all(parent).map_err(HubError::io(format!("cannot create `{}`", parent.display())))?;
        let tmp = parent.join(format!(".rtune-link-{}", std::process::id()));
        let _ = fs::remove_file(&tmp);
        #[cfg(unix)]
        let made = std::os::unix::fs::symlink(&target, &tmp);
        #[cfg(windows)]
        let made = std::os::windows::fs::symlink_file(&target, &tmp);
        if made.is_err() {
            fs::copy(self.blob_path(repo, etag), &tmp)
                .map_err(HubError::io(format!("cannot copy to `{}`", tmp.display())))?;
        }
        fs::rename(&tmp, &pointer).map_err(HubError::io(format!("cannot write `{}`", pointer.display())))?;
        Ok(pointer)
    }

    /// Wanted files of the repo at `commit` that are not among `present`, by the saved tree
    /// listing; None when no listing was saved.
    pub fn missing(
        &self,
        repo: &RepoRef,
        commit: &str,
        wanted: &super::Wanted,
        present: &[String],
    ) -> Option<Vec<String>> {
        let listing = self.read_tree(repo, commit)?;
        Some(listing.into_iter().filter(|f| wanted.wants(f) && !present.contains(f)).collect())
    }

    /// The files of a cached snapshot (relative, `/`-separated), following pointers to blobs
    /// that exist.
    pub fn files(&self, snap: &CachedSnapshot) -> Vec<String> {
        crate::store::walk(&snap.dir)
            .unwrap_or_default()
            .into_iter()
            .map(|p| p.to_string_lossy().replace('\\', "/"))
            .filter(|p| snap.dir.join(p).is_file())
            .collect()
    }
}
