//! The content-addressed artifact store.
//!
//! Layout under the cache root (the layout version is part of the path, so an incompatible
//! rtune never misreads an older cache):
//!
//! ```text
//! CACHEDIR.TAG
//! store-v1/objects/ab/cdef…       file contents by blake3 digest (read-only)
//! store-v1/artifacts/<fp>/…       one folder per stage run, hard links into objects/
//! store-v1/manifests/<fp>.json    written last: an artifact exists iff its manifest does
//! store-v1/locks/<fp>.lock        one builder per fingerprint at a time
//! store-v1/work/<fp>/             resumable state of a stage (training checkpoints)
//! store-v1/tmp/                   staging; never read as an artifact
//! ```
//!
//! Every write goes to a temporary path first and is renamed into place, so a crash leaves
//! either nothing or a complete artifact; the manifest rename is the commit point.

mod manifest;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

pub use manifest::{FileEntry, MANIFEST_VERSION, Manifest};

pub const LAYOUT: &str = "store-v1";

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum StoreError {
    #[error("the cache `{root}` is in use by another rtune run")]
    #[diagnostic(
        code(rtune::store::busy),
        help(
            "`cache gc`, `cache rm` and `cache prune` remove files a run may be reading, so they wait for no run: \
             run them when the other rtune is done"
        )
    )]
    Busy { root: PathBuf },
    #[error("cannot {action} `{path}`")]
    #[diagnostic(code(rtune::store::io), help("check that the cache directory is writable and the disk is not full"))]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// Held (shared) by every `rtune run` for its whole length, and exclusively by `cache gc`: gc
/// never removes staging or objects a running build is about to commit.
#[derive(Debug)]
pub struct UseLock {
    _file: File,
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { action, path: path.to_path_buf(), source }
}

#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    base: PathBuf,
}

/// Holds the build lock of one fingerprint until dropped.
#[derive(Debug)]
pub struct BuildLock {
    _file: File,
}

impl Store {
    /// Open (creating if needed) a store under `root`.
    pub fn open(root: &Path) -> Result<Store> {
        let base = root.join(LAYOUT);
        for sub in ["objects", "artifacts", "manifests", "locks", "work", "tmp"] {
            let p = base.join(sub);
            fs::create_dir_all(&p).map_err(io_err("create", &p))?;
        }
        let tag = root.join("CACHEDIR.TAG");
        if !tag.exists() {
            write_atomic(
                &tag,
                b"Signature: 8a477f597d28d172789f06886806bc55\n# This directory is a cache created by rtune.\n# For information about cache directory tags see https://bford.info/cachedir/\n",
            )?;
        }
        Ok(Store { root: root.to_path_buf(), base })
    }

    /// The default cache root: `$RTUNE_CACHE_DIR`, else `$XDG_CACHE_HOME/rtune`, else
    /// `~/.cache/rtune`.
    pub fn default_root() -> PathBuf {
        if let Some(d) = std::env::var_os("RTUNE_CACHE_DIR").filter(|d| !d.is_empty()) {
            return PathBuf::from(d);
        }
        if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
            return PathBuf::from(d).join("rtune");
        }
        // The home folder: $HOME, else the account's (on Windows %USERPROFILE%, where HOME is
        // rarely set), as the Hugging Face cache finds `~/.cache` too.
        match std::env::home_dir().filter(|h| !h.as_os_str().is_empty()) {
            Some(h) => h.join(".cache").join("rtune"),
            None => PathBuf::from(".rtune-cache"),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn artifact_dir(&self, fp: &str) -> PathBuf {
        self.base.join("artifacts").join(fp)
    }

    /// Bookkeeping that is not an artifact (e.g. stamps of exported files); never collected.
    pub fn state_dir(&self) -> PathBuf {
        self.base.join("state")
    }

    pub fn work_dir(&self, fp: &str) -> PathBuf {
        self.base.join("work").join(fp)
    }

    fn manifest_path(&self, fp: &str) -> PathBuf {
        self.base.join("manifests").join(format!("{fp}.json"))
    }

    fn object_path(&self, digest: &str) -> PathBuf {
        self.base.join("objects").join(&digest[..2]).join(&digest[2..])
    }

    /// The manifest of `fp`, if the artifact was committed and the manifest parses.
    pub fn manifest(&self, fp: &str) -> Option<Manifest> {
        let text = fs::read_to_string(self.manifest_path(fp)).ok()?;
        serde_json::from_str::<Manifest>(&text)
            .ok()
            .filter(|m| m.format == MANIFEST_VERSION && m.fingerprint == fp && m.is_well_formed())
    }

    fn damage_marker(&self, fp: &str) -> PathBuf {
        self.base.join("manifests").join(format!("{fp}.damaged"))
    }

    /// Record that `rtune cache verify` found an artifact damaged; the next run rebuilds it.
    pub fn mark_damaged(&self, fp: &str, problems: &[String]) -> Result<()> {
        write_atomic(&self.damage_marker(fp), problems.join("\n").as_bytes())
    }

    /// Cheap check that every file of an artifact is present with the recorded size and that
    /// `cache verify` has not found it damaged.
    pub fn quick_check(&self, m: &Manifest) -> std::result::Result<(), String> {
        if self.damage_marker(&m.fingerprint).exists() {
            return Err("found damaged by `rtune cache verify`".into());
        }
        let dir = self.artifact_dir(&m.fingerprint);
        for (rel, f) in &m.files {
            match fs::metadata(dir.join(rel)) {
                Ok(md) if md.len() == f.size => {}
                Ok(md) => return Err(format!("`{rel}` has {} bytes, expected {}", md.len(), f.size)),
                Err(_) => return Err(format!("`{rel}` is missing")),
            }
        }
        Ok(())
    }

    /// Re-hash every file of an artifact. Returns the problems found.
    pub fn verify(&self, m: &Manifest) -> Vec<String> {
        let dir = self.artifact_dir(&m.fingerprint);
        let mut problems = Vec::new();
        for (rel, f) in &m.files {
            match hash_file(&dir.join(rel)) {
                Ok((d, size)) if d == f.digest && size == f.size => {}
                Ok(_) => problems.push(format!("`{rel}` does not match its digest")),
                Err(e) => problems.push(format!("`{rel}` cannot be read: {e}")),
            }
        }
        problems
    }

    /// Remove an artifact (manifest first, so it stops counting at once), and any of its objects
    /// whose content no longer matches its digest, so a rebuild writes them afresh.
    pub fn evict(&self, fp: &str) -> Result<()> {
        let manifest = self.manifest(fp);
        if let Some(manifest) = &manifest {
            for f in manifest.files.values() {
                let obj = self.object_path(&f.digest);
                if hash_file(&obj).map(|(d, _)| d != f.digest).unwrap_or(false) {
                    make_writable(&obj);
                    fs::remove_file(&obj).map_err(io_err("remove", &obj))?;
                }
            }
        }
        remove_if_present(&self.manifest_path(fp))?;
        let dir = self.artifact_dir(fp);
        if dir.exists() {
            let digests = manifest.map(|m| m.files.into_values().map(|f| f.digest).collect::<Vec<_>>());
            self.remove_view(&dir, digests.as_deref())?;
        }
        remove_if_present(&self.damage_marker(fp))
    }

    /// Wait for, then hold, the build lock of `fp`. `on_wait` is called once if another
    /// process holds it.
    pub fn lock(&self, fp: &str, on_wait: impl FnOnce()) -> Result<BuildLock> {
        let path = self.base.join("locks").join(format!("{fp}.lock"));
        let file =
            File::options().create(true).truncate(false).write(true).open(&path).map_err(io_err("open", &path))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                on_wait();
                file.lock().map_err(io_err("lock", &path))?;
            }
            Err(fs::TryLockError::Error(e)) => return Err(io_err("lock", &path)(e)),
        }
        Ok(BuildLock { _file: file })
    }

    fn use_lock_file(&self) -> Result<File> {
        let path = self.base.join("locks").join("store.lock");
        File::options().create(true).truncate(false).write(true).open(&path).map_err(io_err("open", &path))
    }

    /// Take the store's use lock shared, for a run (waits only while a gc holds it).
    pub fn use_shared(&self) -> Result<UseLock> {
        let file = self.use_lock_file()?;
        file.lock_shared().map_err(io_err("lock", &self.base.join("locks/store.lock")))?;
        Ok(UseLock { _file: file })
    }

    /// A fresh staging folder inside the store (same filesystem, so commits are renames).
    pub fn staging(&self) -> Result<tempfile::TempDir> {
        let tmp = self.base.join("tmp");
        tempfile::Builder::new().prefix("stage-").tempdir_in(&tmp).map_err(io_err("create a staging folder in", &tmp))
    }

    /// Move the files of `staged` into the store and commit `manifest` (whose `files` are
    /// filled in here). The caller holds the build lock of the fingerprint.
    pub fn commit(&self, staged: &Path, mut manifest: Manifest) -> Result<Manifest> {
        let fp = manifest.fingerprint.clone();
        let mut files = BTreeMap::new();
        let tmp_view = self.staging()?;
        for rel in walk(staged).map_err(io_err("read", staged))? {
            let src = staged.join(&rel);
            let (digest, size) = hash_file(&src).map_err(io_err("read", &src))?;
            let obj = self.object_path(&digest);
            if !obj.exists() {
                let parent = obj.parent().expect("objects have a parent");
                fs::create_dir_all(parent).map_err(io_err("create", parent))?;
                // The bytes reach the disk before anything can name them (and before the file
                // turns read-only: Windows flushes only through a handle that may write).
                sync_file(&src).map_err(io_err("sync", &src))?;
                set_readonly(&src).map_err(io_err("protect", &src))?;
                fs::rename(&src, &obj).map_err(io_err("store", &obj))?;
                sync_dir(parent);
            }
            let view = tmp_view.path().join(&rel);
            if let Some(parent) = view.parent() {
                fs::create_dir_all(parent).map_err(io_err("create", parent))?;
            }
            if fs::hard_link(&obj, &view).is_err() {
                fs::copy(&obj, &view).map_err(io_err("copy", &obj))?;
                sync_file(&view).map_err(io_err("sync", &view))?;
                set_readonly(&view).map_err(io_err("protect", &view))?;
            }
            files.insert(rel_string(&rel), FileEntry { digest, size });
        }
        let dir = self.artifact_dir(&fp);
        if dir.exists() {
            // A folder without a manifest is left over from a crash; we hold the lock.
            self.remove_view(&dir, None)?;
        }
        let view = tmp_view.keep();
        // The view's directory entries (links to the objects) reach the disk before it is named.
        sync_tree(&view).map_err(io_err("sync", &view))?;
        fs::rename(&view, &dir).map_err(io_err("commit", &dir))?;
        sync_dir(dir.parent().expect("artifacts have a parent"));
        manifest.files = files;
        let text = crate::json::pretty_sorted(&manifest).into_bytes();
        write_atomic(&self.manifest_path(&fp), &text)?;
        Ok(manifest)
    }

    /// Every committed manifest, sorted by fingerprint.
    pub fn manifests(&self) -> Vec<Manifest> {
        let dir = self.base.join("manifests");
        let mut out: Vec<Manifest> = fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                name.strip_suffix(".json").and_then(|fp| self.manifest(fp))
            })
            .collect();
        out.sort_by(|a, b| a.fingerprint.cmp(&b.fingerprint));
        out
    }

    /// Remove what no manifest reaches: orphan artifact folders, objects, stale staging and the
    /// work folders of stages that finished. Returns (files removed, bytes freed).
    pub fn gc(&self) -> Result<(u64, u64)> {
        self.remove(&BTreeSet::new())
    }

    /// The resumable work of stages that never finished (a training run stopped before its
    /// artifact was committed): each fingerprint with its folder's size.
    pub fn unfinished(&self) -> Vec<(String, u64)> {
        let dir = self.base.join("work");
        let mut out: Vec<(String, u64)> = fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|fp| !self.manifest_path(fp).exists())
            .map(|fp| {
                let size = dir_size(&self.work_dir(&fp));
                (fp, size)
            })
            .collect();
        out.sort();
        out
    }

    /// The fingerprints of every artifact and every stopped run's work: what `cache rm` and
    /// `cache prune` choose from.
    pub fn fingerprints(&self) -> Vec<String> {
        let artifacts = self.manifests().into_iter().map(|m| m.fingerprint);
        artifacts.chain(self.unfinished().into_iter().map(|(fp, _)| fp)).collect()
    }

    /// The bytes that removing the artifacts and unfinished work of `fps` would free: the
    /// objects no other manifest names (an object shared by two artifacts stays while one
    /// does), and the work folders.
    pub fn freed_by(&self, fps: &BTreeSet<String>) -> u64 {
        let (gone, kept): (Vec<Manifest>, Vec<Manifest>) =
            self.manifests().into_iter().partition(|m| fps.contains(&m.fingerprint));
        let kept: BTreeSet<&str> = kept.iter().flat_map(|m| m.files.values().map(|f| f.digest.as_str())).collect();
        let objects: BTreeMap<&str, u64> = gone
            .iter()
            .flat_map(|m| m.files.values())
            .filter(|f| !kept.contains(f.digest.as_str()))
            .map(|f| (f.digest.as_str(), f.size))
            .collect();
        objects.values().sum::<u64>() + fps.iter().map(|fp| dir_size(&self.work_dir(fp))).sum::<u64>()
    }

    /// Remove the artifacts of `fps` (each manifest first, so it stops counting at once) and
    /// their work folders, then what no manifest reaches, as [`Store::gc`]. Refuses while a run
    /// uses the store ([`StoreError::Busy`]): a run may be about to read any artifact. Returns
    /// (files removed, bytes freed).
    pub fn remove(&self, fps: &BTreeSet<String>) -> Result<(u64, u64)> {
        let lock = self.use_lock_file()?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Err(StoreError::Busy { root: self.root.clone() }),
            Err(fs::TryLockError::Error(e)) => return Err(io_err("lock", &self.base.join("locks/store.lock"))(e)),
        }
        let removed = self.forget(fps).and_then(|(files, bytes)| {
            let (more, freed) = self.collect()?;
            Ok((files + more, bytes + freed))
        });
        self.protect_objects();
        removed
    }

    /// Drop the manifests, damage markers and work folders of `fps`; their artifact folders and
    /// objects are left to [`Store::collect`]. Returns the work folders' (count, bytes).
    fn forget(&self, fps: &BTreeSet<String>) -> Result<(u64, u64)> {
        let (mut files, mut bytes) = (0, 0);
        for fp in fps {
            remove_if_present(&self.manifest_path(fp))?;
            remove_if_present(&self.damage_marker(fp))?;
            let work = self.work_dir(fp);
            if work.exists() {
                bytes += dir_size(&work);
                files += 1;
                make_writable(&work);
                fs::remove_dir_all(&work).map_err(io_err("remove", &work))?;
            }
        }
        Ok((files, bytes))
    }

    /// gc's work, under its lock.
    fn collect(&self) -> Result<(u64, u64)> {
        let manifests = self.manifests();
        let live_fps: BTreeSet<String> = manifests.iter().map(|m| m.fingerprint.clone()).collect();
        let live_objects: BTreeSet<String> =
            manifests.iter().flat_map(|m| m.files.values().map(|f| f.digest.clone())).collect();
        let (mut files, mut bytes) = (0u64, 0u64);
        let mut remove = |p: &Path| -> Result<()> {
            let size = dir_size(p);
            make_writable(p);
            if p.is_dir() {
                fs::remove_dir_all(p).map_err(io_err("remove", p))?;
            } else {
                fs::remove_file(p).map_err(io_err("remove", p))?;
            }
            files += 1;
            bytes += size;
            Ok(())
        };
        for sub in ["artifacts", "work"] {
            let dir = self.base.join(sub);
            for e in fs::read_dir(&dir).map_err(io_err("read", &dir))?.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let orphan = if sub == "artifacts" { !live_fps.contains(&name) } else { live_fps.contains(&name) };
                if orphan && self.is_unlocked(&name) {
                    remove(&e.path())?;
                }
            }
        }
        let objects = self.base.join("objects");
        for shard in fs::read_dir(&objects).map_err(io_err("read", &objects))?.flatten() {
            for obj in fs::read_dir(shard.path()).into_iter().flatten().flatten() {
                let digest = format!("{}{}", shard.file_name().to_string_lossy(), obj.file_name().to_string_lossy());
                if !live_objects.contains(&digest) {
                    remove(&obj.path())?;
                }
            }
        }
        let tmp = self.base.join("tmp");
        for e in fs::read_dir(&tmp).map_err(io_err("read", &tmp))?.flatten() {
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age.as_secs() > 24 * 3600);
            if old {
                remove(&e.path())?;
            }
        }
        Ok((files, bytes))
    }

    /// Remove an artifact's folder of links to objects, then re-protect the objects it linked to:
    /// those of `digests` (its manifest's), or every object where those are unknown.
    fn remove_view(&self, dir: &Path, digests: Option<&[String]>) -> Result<()> {
        make_writable(dir);
        let removed = fs::remove_dir_all(dir);
        match digests {
            Some(digests) => self.protect(digests.iter().map(|d| self.object_path(d))),
            None => self.protect_objects(),
        }
        removed.map_err(io_err("remove", dir))
    }

    /// Make every object read-only again after [`make_writable`] ran on artifact files that may
    /// link to any of them ([`Store::protect`]).
    fn protect_objects(&self) {
        if !cfg!(windows) {
            return;
        }
        let objects = self.base.join("objects");
        let shards = fs::read_dir(&objects).into_iter().flatten().flatten();
        self.protect(shards.flat_map(|s| fs::read_dir(s.path()).into_iter().flatten().flatten().map(|o| o.path())));
    }

    /// Make `objects` read-only again after [`make_writable`] ran on artifact files linked to
    /// them: on Windows those are hard links that share their object's attributes (Unix keeps
    /// permissions per file, so there nothing was lost).
    fn protect(&self, objects: impl Iterator<Item = PathBuf>) {
        if cfg!(windows) {
            for obj in objects {
                let _ = set_readonly(&obj);
            }
        }
    }

    fn is_unlocked(&self, fp: &str) -> bool {
        let path = self.base.join("locks").join(format!("{fp}.lock"));
        match File::options().write(true).open(&path) {
            Ok(f) => f.try_lock().is_ok(),
            Err(_) => true,
        }
    }
}

/// Remove a file; one that is not there is already removed.
fn remove_if_present(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("remove", path)(e)),
        _ => Ok(()),
    }
}

/// blake3 hex digest and size of a file.
pub fn hash_file(path: &Path) -> io::Result<(String, u64)> {
    let mut f = File::open(path)?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        size += n as u64;
        h.update(&buf[..n]);
    }
    Ok((h.finalize().to_hex().to_string(), size))
}

/// Write `bytes` to `path` atomically: a temp file beside it, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new().prefix(".rtune-").tempfile_in(dir).map_err(io_err("write", path))?;
    tmp.write_all(bytes).map_err(io_err("write", path))?;
    tmp.as_file().sync_all().map_err(io_err("write", path))?;
    tmp.persist(path).map_err(|e| io_err("write", path)(e.error))?;
    // The rename is only durable once the directory entry is: a power loss must not leave a
    // manifest (or lock file) naming bytes that never reached the disk, or an old one back.
    sync_dir(dir);
    Ok(())
}

/// fsync every file and folder under `dir` (and `dir`), before a rename makes the tree visible
/// under its real name: after a power loss the name then never points at missing bytes.
/// Read-only files are the store's objects, each synced before it was made read-only; Windows
/// cannot flush them again (see [`sync_file`]), so there they are skipped.
pub fn sync_tree(dir: &Path) -> io::Result<()> {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            let meta = e.metadata()?;
            if meta.is_dir() {
                stack.push(e.path());
            } else if cfg!(unix) || !meta.permissions().readonly() {
                sync_file(&e.path())?;
            }
        }
        sync_dir(&d);
    }
    Ok(())
}

/// fsync a file by name. Windows flushes a file (`FlushFileBuffers`) only through a handle with
/// write access — one opened for reading fails with "Access denied" — so there it is opened for
/// writing, and a read-only file cannot be flushed.
pub fn sync_file(path: &Path) -> io::Result<()> {
    let file = if cfg!(windows) { fs::OpenOptions::new().write(true).open(path)? } else { File::open(path)? };
    file.sync_all()
}

/// fsync a directory, so renames and creations in it survive a power loss (best effort: some
/// file systems and platforms cannot open or sync a directory).
pub fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}

/// Relative paths of every file under `dir`, sorted.
pub fn walk(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for e in fs::read_dir(dir.join(&rel))? {
            let e = e?;
            let r = rel.join(e.file_name());
            if e.file_type()?.is_dir() {
                stack.push(r);
            } else {
                out.push(r);
            }
        }
    }
    out.sort();
    Ok(out)
}

fn rel_string(p: &Path) -> String {
    p.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/")
}

fn set_readonly(p: &Path) -> io::Result<()> {
    let mut perm = fs::metadata(p)?.permissions();
    perm.set_readonly(true);
    fs::set_permissions(p, perm)
}

/// Make `p` removable: on Unix folders need write permission for their entries to be removed;
/// Windows refuses to delete read-only files (wherever it cannot use POSIX delete semantics:
/// FAT and exFAT drives, network shares, Wine), so there files lose their read-only attribute —
/// which a hard link shares with its object: see [`Store::protect_objects`].
fn make_writable(p: &Path) {
    if p.is_dir() {
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = fs::set_permissions(p, fs::Permissions::from_mode(0o755));
        }
        for e in fs::read_dir(p).into_iter().flatten().flatten() {
            make_writable(&e.path());
        }
    } else if cfg!(windows)
        && let Ok(meta) = fs::metadata(p)
        && meta.permissions().readonly()
    {
        let mut perm = meta.permissions();
        #[allow(clippy::permissions_set_readonly_false)]
        perm.set_readonly(false);
        let _ = fs::set_permissions(p, perm);
    }
}

fn dir_size(p: &Path) -> u64 {
    if p.is_dir() {
        fs::read_dir(p).into_iter().flatten().flatten().map(|e| dir_size(&e.path())).sum()
    } else {
        fs::metadata(p).map(|m| m.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_then_verify_then_detect_corruption() {
        let root = tempfile::tempdir().unwrap();
        let store = Store::open(root.path()).unwrap();
        assert!(root.path().join("CACHEDIR.TAG").exists());
        let staged = store.staging().unwrap();
        fs::create_dir_all(staged.path().join("sub")).unwrap();
        fs::write(staged.path().join("a.txt"), b"hello").unwrap();
        fs::write(staged.path().join("sub/b.bin"), b"world").unwrap();
        let m = store.commit(staged.path(), Manifest::new("fp1", "train", "train")).unwrap();
        assert_eq!(m.files.keys().collect::<Vec<_>>(), ["a.txt", "sub/b.bin"]);
        let loaded = store.manifest("fp1").unwrap();
        assert!(store.verify(&loaded).is_empty());
        assert!(store.quick_check(&loaded).is_ok());

        // Corrupt the object behind the hard link.
        let obj = store.object_path(&loaded.files["a.txt"].digest);
        let mut perm = fs::metadata(&obj).unwrap().permissions();
        #[allow(clippy::permissions_set_readonly_false)]
        perm.set_readonly(false);
        fs::set_permissions(&obj, perm).unwrap();
        fs::write(&obj, b"hellO").unwrap();
        assert_eq!(store.verify(&loaded), ["`a.txt` does not match its digest"]);

        store.evict("fp1").unwrap();
        assert!(store.manifest("fp1").is_none());
        assert!(!obj.exists(), "evict removes the damaged object so a rebuild writes it afresh");
        let (removed, _) = store.gc().unwrap();
        assert_eq!(removed, 1, "the intact object is unreachable now");
    }

    #[test]
    fn hand_edited_manifests_are_not_trusted() {
        let root = tempfile::tempdir().unwrap();
        let store = Store::open(root.path()).unwrap();
        let staged = store.staging().unwrap();
        fs::write(staged.path().join("x"), b"data").unwrap();
        let m = store.commit(staged.path(), Manifest::new("fp", "train", "train")).unwrap();
        for (rel, digest) in [("../../etc/passwd", m.files["x"].digest.clone()), ("x", "ab".to_string())] {
            let mut bad = m.clone();
            bad.files.clear();
            bad.files.insert(rel.to_string(), FileEntry { digest, size: 4 });
            fs::write(store.manifest_path("fp"), serde_json::to_vec(&bad).unwrap()).unwrap();
            assert!(store.manifest("fp").is_none(), "{rel} accepted");
            assert_eq!(store.manifests().len(), 0);
            store.gc().unwrap();
        }
    }

    /// Removing an artifact's folder makes its files writable, which on Windows its objects
    /// are too (hard links share attributes): they are read-only again afterwards, the objects
    /// another artifact shares included, whether or not the folder had a manifest.
    #[test]
    fn removing_artifacts_leaves_every_object_read_only() {
        let root = tempfile::tempdir().unwrap();
        let store = Store::open(root.path()).unwrap();
        let commit = |fp: &str, files: &[(&str, &[u8])]| {
            let staged = store.staging().unwrap();
            for (name, bytes) in files {
                fs::write(staged.path().join(name), bytes).unwrap();
            }
            store.commit(staged.path(), Manifest::new(fp, "train", "train")).unwrap()
        };
        commit("a", &[("shared", b"both"), ("own", b"a only")]);
        let b = commit("b", &[("same", b"both")]);
        commit("c", &[("c", b"c only")]);
        let read_only = || {
            let objects = fs::read_dir(store.base.join("objects")).unwrap().flatten();
            let objects: Vec<_> = objects.flat_map(|s| fs::read_dir(s.path()).unwrap().flatten()).collect();
            assert_eq!(objects.len(), 3);
            objects.iter().all(|o| o.metadata().unwrap().permissions().readonly())
        };
        assert!(read_only());
        store.evict("a").unwrap();
        assert!(read_only(), "after evicting an artifact");
        // A folder without a manifest (left by a crash) is replaced by the next commit.
        fs::remove_file(store.manifest_path("c")).unwrap();
        commit("c", &[("c", b"c only")]);
        assert!(read_only(), "after replacing a folder without a manifest");
        assert!(store.verify(&b).is_empty());
    }

    #[test]
    fn gc_keeps_live_objects_and_removes_orphans() {
        let root = tempfile::tempdir().unwrap();
        let store = Store::open(root.path()).unwrap();
        let staged = store.staging().unwrap();
        fs::write(staged.path().join("x"), b"live").unwrap();
        store.commit(staged.path(), Manifest::new("live", "train", "train")).unwrap();
        fs::create_dir_all(store.artifact_dir("orphan")).unwrap();
        fs::write(store.artifact_dir("orphan").join("y"), b"junk").unwrap();
        let (removed, _) = store.gc().unwrap();
        assert_eq!(removed, 1);
        assert!(store.verify(&store.manifest("live").unwrap()).is_empty());
    }
}
