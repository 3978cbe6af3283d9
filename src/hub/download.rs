//! Download a repository snapshot into the HF cache: list the files at a revision, resolve the
//! revision to a commit, fetch what is missing (resuming partial blobs), check every file
//! against its digest, then link it into `snapshots/<commit>/`.

use std::fs;
use std::io::{Read, Seek, Write};
use std::path::PathBuf;

use serde::Deserialize;
use sha1::Digest as _;

use super::cache::{TreeEntry, check_etag};
use super::http::header;
use super::{Client, HubCache, HubError, RepoRef, check_repo_path, fnmatch, is_commit};
use crate::ui::{Ui, human_bytes};

/// Which files of a repo to fetch (fnmatch patterns; no `include` means every file).
#[derive(Debug, Clone, Default)]
pub struct Wanted {
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

impl Wanted {
    pub fn wants(&self, path: &str) -> bool {
        (self.include.is_empty() || self.include.iter().any(|p| fnmatch(p, path)))
            && !self.exclude.iter().any(|p| fnmatch(p, path))
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct FileReport {
    pub path: String,
    pub size: u64,
    /// Git blob id or LFS sha256 (the blob's name in the cache).
    pub etag: String,
    /// False when the file was already in the cache.
    pub fetched: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DownloadReport {
    pub repo: String,
    pub revision: String,
    pub commit: String,
    pub snapshot: PathBuf,
    pub files: Vec<FileReport>,
    pub bytes_fetched: u64,
}

#[derive(Deserialize)]
struct RepoInfo {
    sha: Option<String>,
    siblings: Option<Vec<Sibling>>,
}

#[derive(Deserialize)]
struct Sibling {
    rfilename: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default, rename = "blobId")]
    blob_id: Option<String>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

/// `{endpoint}/api/models/owner/name/revision/<rev>`.
fn info_url(client: &Client, repo: &RepoRef, revision: &str) -> String {
    format!("{}/api/{}/{}/revision/{}", client.env.endpoint, repo.kind.plural(), repo.id, encode(revision))
}

/// `{endpoint}/[datasets/]owner/name/resolve/<commit>/<path>`.
fn resolve_url(client: &Client, repo: &RepoRef, commit: &str, path: &str) -> String {
    let path: Vec<String> = path.split('/').map(encode).collect();
    format!("{}/{}{}/resolve/{}/{}", client.env.endpoint, repo.kind.url_prefix(), repo.id, commit, path.join("/"))
}

/// Percent-encode everything but RFC 3986 unreserved characters (as huggingface_hub's `quote`).
pub(crate) fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Ask the Hub which commit `repo.revision` is at (one request, no retries: callers fall back
/// to the cache when the Hub is unreachable).
pub fn resolve_commit(client: &Client, repo: &RepoRef) -> Result<String, HubError> {
    if is_commit(&repo.revision) {
        return Ok(repo.revision.clone());
    }
    let what = format!("resolving {}", repo.display());
    let info: RepoInfo = client.get_json(&what, &info_url(client, repo, &repo.revision))?;
    let sha = info.sha.unwrap_or_default();
    if !is_commit(&sha) {
        return Err(HubError::BadResponse { what, reason: format!("`sha` is not a commit id: `{sha}`") });
    }
    Ok(sha)
}

/// A repository's files at `repo.revision`: the commit and each file's size.
pub struct Listing {
    pub commit: String,
    pub files: std::collections::BTreeMap<String, ListedFile>,
}

/// One file of a [`Listing`]: its size and the digests the Hub gives for its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedFile {
    pub size: u64,
    /// An LFS file's sha256.
    pub lfs_sha256: Option<String>,
    /// The git blob id (for an LFS file, its pointer's).
    pub blob_id: Option<String>,
}

/// List `repo` at its revision; `None` when the repository or the revision does not exist.
pub fn list_files(client: &Client, repo: &RepoRef) -> Result<Option<Listing>, HubError> {
    let what = format!("listing {}", repo.display());
    let url = format!("{}?blobs=true", info_url(client, repo, &repo.revision));
    let info: RepoInfo = match client.get_json(&what, &url) {
        Ok(i) => i,
        Err(HubError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let files = info
        .siblings
        .unwrap_or_default()
        .into_iter()
        .map(|s| {
            let size = s.lfs.as_ref().map(|l| l.size).or(s.size).unwrap_or(0);
            let listed = ListedFile { size, lfs_sha256: s.lfs.map(|l| l.sha256), blob_id: s.blob_id };
            (s.rfilename, listed)
        })
        .collect();
    Ok(Some(Listing { commit: info.sha.unwrap_or_default(), files }))
}

/// Download the wanted files of `repo` into the cache (or, offline, find them there).
pub fn snapshot(
    client: &Client,
    cache: &HubCache,
    repo: &RepoRef,
    wanted: &Wanted,
    ui: &Ui,
) -> Result<DownloadReport, HubError> {
    if client.env.offline {
        return from_cache(cache, repo, wanted);
    }
    let what = format!("listing {}", repo.display());
    let url = format!("{}?blobs=true", info_url(client, repo, &repo.revision));
    let info: RepoInfo = client.get_json(&what, &url)?;
    let commit = info.sha.unwrap_or_default();
    if !is_commit(&commit) {
        return Err(HubError::BadResponse { what, reason: format!("`sha` is not a commit id: `{commit}`") });
    }
    let siblings = info
        .siblings
        .ok_or_else(|| HubError::BadResponse { what: what.clone(), reason: "no `siblings` file list".into() })?;
    // One bad name rejects the whole listing: nothing is written.
    for s in &siblings {
        check_repo_path(&s.rfilename)?;
    }
    cache.tag()?;
    let tree: Vec<TreeEntry> = siblings
        .iter()
        .map(|s| TreeEntry {
            path: s.rfilename.clone(),
            size: s.size.unwrap_or(0),
            blob_id: s.blob_id.clone().unwrap_or_default(),
            lfs: s.lfs.as_ref().map(|l| (l.sha256.clone(), l.size)),
        })
        .collect();
    if tree.iter().all(|t| check_etag(&t.blob_id)) {
        cache.write_tree(repo, &commit, &tree)?;
    }
    let chosen: Vec<&Sibling> = siblings.iter().filter(|s| wanted.wants(&s.rfilename)).collect();
    // Listed sizes are the server's word: a wrong one must not overflow the total.
    let total =
        chosen.iter().map(|s| s.lfs.as_ref().map(|l| l.size).or(s.size).unwrap_or(0)).fold(0, u64::saturating_add);
    ui.status(
        "download",
        format!(
            "{} at {} — {} of {} files, {}",
            repo.display(),
            &commit[..12],
            chosen.len(),
            siblings.len(),
            human_bytes(total)
        ),
    );
    let mut bar = ui.transfer("download", total);
    let mut done = 0u64;
    let mut files = Vec::new();
    let mut fetched_bytes = 0u64;
    for (i, s) in chosen.iter().enumerate() {
        let size = s.lfs.as_ref().map(|l| l.size).or(s.size).unwrap_or(0);
        bar.start_file(&s.rfilename, size, i + 1, chosen.len());
        let r = fetch_file(client, cache, repo, &commit, s, ui, &mut |n| {
            bar.set(n, done + n);
        })?;
        done += r.size;
        if r.fetched {
            fetched_bytes += r.size;
            ui.detail(format!("fetched {} ({})", r.path, human_bytes(r.size)));
        }
        bar.set(r.size, done);
        files.push(r);
    }
    bar.finish();
    cache.write_ref(repo, &commit)?;
    let snapshot = cache.repo_dir(repo).join("snapshots").join(&commit);
    fs::create_dir_all(&snapshot).map_err(HubError::io(format!("cannot create `{}`", snapshot.display())))?;
    Ok(DownloadReport {
        repo: repo.id.clone(),
        revision: repo.revision.clone(),
        commit,
        snapshot,
        files,
        bytes_fetched: fetched_bytes,
    })
}

/// Offline: the revision and the wanted files must already be in the cache.
fn from_cache(cache: &HubCache, repo: &RepoRef, wanted: &Wanted) -> Result<DownloadReport, HubError> {
    let snap = cache.resolve(repo).ok_or_else(|| HubError::OfflineMissing {
        count: 1,
        cache: cache.root().display().to_string(),
        commands: format!(
            "{} is not cached; on a connected machine run: {}",
            repo.display(),
            download_command(repo, &[])
        ),
    })?;
    let present = cache.files(&snap);
    if let Some(missing) = cache.missing(repo, &snap.commit, wanted, &present)
        && !missing.is_empty()
    {
        return Err(HubError::OfflineMissing {
            count: missing.len(),
            cache: cache.root().display().to_string(),
            commands: format!(
                "missing: {}; on a connected machine run: {}",
                missing.join(", "),
                download_command(&repo.with_revision(&snap.commit), &missing)
            ),
        });
    }
    let mut files = Vec::new();
    for path in present {
        if !wanted.wants(&path) {
            continue;
        }
        let target = fs::canonicalize(snap.dir.join(&path)).map_err(HubError::io(format!("cannot read `{path}`")))?;
        let etag = target.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let size = fs::metadata(&target).map(|m| m.len()).unwrap_or(0);
        files.push(FileReport { path, size, etag, fetched: false });
    }
    Ok(DownloadReport {
        repo: repo.id.clone(),
        revision: repo.revision.clone(),
        commit: snap.commit,
        snapshot: snap.dir,
        files,
        bytes_fetched: 0,
    })
}

/// The command that fetches `files` of `repo` (all files when empty).
pub fn download_command(repo: &RepoRef, files: &[String]) -> String {
    let mut cmd = format!("rtune download {}", crate::ui::shell_quote(&repo.id));
    if repo.kind == super::RepoKind::Dataset {
        cmd.push_str(" --repo-type dataset");
    }
    if repo.revision != "main" {
        cmd.push_str(&format!(" --revision {}", crate::ui::shell_quote(&repo.revision)));
    }
    for f in files {
        cmd.push_str(&format!(" --include {}", crate::ui::shell_quote(f)));
    }
    cmd
}

fn fetch_file(
    client: &Client,
    cache: &HubCache,
    repo: &RepoRef,
    commit: &str,
    s: &Sibling,
    ui: &Ui,
    progress: &mut dyn FnMut(u64),
) -> Result<FileReport, HubError> {
    let path = &s.rfilename;
    let expected_size = s.lfs.as_ref().map(|l| l.size).or(s.size);
    let pointer = cache.pointer_path(repo, commit, path);
    // Already linked, and the blob is whole and still has its digest (bit rot in a cache
    // must not become permanent by being reused): nothing to fetch.
    if let Ok(meta) = fs::metadata(&pointer)
        && expected_size.is_none_or(|n| n == meta.len())
        && let Ok(target) = fs::read_link(&pointer)
        && let Some(etag) = target.file_name().map(|n| n.to_string_lossy().to_string())
        && check_etag(&etag)
        && verify(&pointer, &etag).is_ok()
    {
        return Ok(FileReport { path: path.clone(), size: meta.len(), etag, fetched: false });
    }
    let url = resolve_url(client, repo, commit, path);
    let what = format!("{path} from {}", repo.display());
    let (etag, head_size) = head(client, &url, &what, commit)?;
    // The listing's size bounds the transfer; the headers must agree with it.
    let size = match (expected_size, head_size) {
        (Some(a), Some(b)) if a != b => {
            return Err(HubError::BadResponse {
                what,
                reason: format!("the listing says the file has {a} bytes but its headers say {b}"),
            });
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => {
            return Err(HubError::BadResponse {
                what,
                reason: "neither the listing nor the headers give a size".into(),
            });
        }
    };
    // The listing and the file's headers must agree on what the file is.
    let listed = s.lfs.as_ref().map(|l| l.sha256.as_str()).or(s.blob_id.as_deref());
    if let Some(listed) = listed
        && listed != etag
    {
        return Err(HubError::BadResponse {
            what,
            reason: format!("the listing says the file is `{listed}` but its headers say `{etag}`"),
        });
    }
    let blob = cache.blob_path(repo, &etag);
    let _lock = cache.lock_blob(repo, &etag)?;
    let mut fetched = false;
    let whole = fs::metadata(&blob).is_ok_and(|m| m.is_file() && m.len() == size);
    if !whole || verify(&blob, &etag).is_err() {
        if whole {
            ui.warn(format!("`{}` in the HF cache does not match its digest; downloading it again", blob.display()));
            fs::remove_file(&blob).map_err(HubError::io(format!("cannot remove `{}`", blob.display())))?;
        }
        // Bytes kept from an earlier answer (an interrupted run, a dropped connection) may not
        // be the file's if that answer was wrong: a resumed file that fails its digest is
        // fetched once more from its first byte before the download is called corrupt.
        if fetch_blob(client, &url, &what, &blob, Some(size), progress)? && verify(&blob, &etag).is_err() {
            ui.warn(format!(
                "{what}: the resumed download does not match its digest; downloading it again from the start"
            ));
            fs::remove_file(&blob).map_err(HubError::io(format!("cannot remove `{}`", blob.display())))?;
            fetch_blob(client, &url, &what, &blob, Some(size), progress)?;
        }
        verify(&blob, &etag).map_err(|actual| {
            let _ = fs::remove_file(&blob);
            HubError::DigestMismatch {
                repo: repo.display(),
                file: path.clone(),
                expected: etag.clone(),
                actual: actual.unwrap_or_else(|e| format!("unreadable: {e}")),
            }
        })?;
        fetched = true;
    }
    cache.link(repo, commit, path, &etag)?;
    let size = fs::metadata(&blob).map(|m| m.len()).unwrap_or(0);
    Ok(FileReport { path: path.clone(), size, etag, fetched })
}

/// HEAD the resolve URL without following redirects to other hosts: the Hub puts the file's
/// identity on its own answer (`X-Repo-Commit`, `X-Linked-Etag` for LFS files, else `ETag`).
fn head(client: &Client, url: &str, what: &str, commit: &str) -> Result<(String, Option<u64>), HubError> {
    let bad = |reason: String| HubError::BadResponse { what: what.to_string(), reason };
    let mut url = url.to_string();
    for _ in 0..5 {
        let resp = client.send(what, false, || {
            let req = client.agent().head(&url).header("Accept-Encoding", "identity").config().max_redirects(0).build();
            client.authorize(req, &url).call()
        })?;
        let status = resp.status().as_u16();
        // A renamed repo answers with a relative redirect to its new name: follow it.
        if (300..400).contains(&status)
            && header(&resp, "x-linked-etag").is_none()
            && let Some(loc) = header(&resp, "location").filter(|l| l.starts_with('/'))
        {
            url = format!("{}{loc}", client.env.endpoint);
            continue;
        }
        let etag = header(&resp, "x-linked-etag")
            .or_else(|| header(&resp, "etag"))
            .map(|e| e.trim().trim_start_matches("W/").trim_matches('"').to_string())
            .ok_or_else(|| bad("no ETag header".into()))?;
        if !check_etag(&etag) {
            return Err(bad(format!("the ETag `{etag}` is not a git or sha256 digest")));
        }
        let got_commit = header(&resp, "x-repo-commit").unwrap_or_default();
        if got_commit != commit {
            return Err(bad(format!("the file is at commit `{got_commit}`, expected `{commit}`")));
        }
        let size = header(&resp, "x-linked-size")
            .or_else(|| header(&resp, "content-length"))
            .and_then(|v| v.trim().parse::<u64>().ok());
        return Ok((etag.to_ascii_lowercase(), size));
    }
    Err(bad("too many redirects".into()))
}

/// Download into `<blob>.incomplete`, resuming what an interrupted run left, then rename.
/// Returns whether the file holds bytes from more than one answer (resumed), which a digest
/// mismatch then may blame on the earlier one.
fn fetch_blob(
    client: &Client,
    url: &str,
    what: &str,
    blob: &std::path::Path,
    size: Option<u64>,
    progress: &mut dyn FnMut(u64),
) -> Result<bool, HubError> {
    let part = blob.with_extension("incomplete");
    let parent = blob.parent().expect("blob has a parent");
    fs::create_dir_all(parent).map_err(HubError::io(format!("cannot create `{}`", parent.display())))?;
    // `.incomplete` is ours, but the folder may be shared: never follow a link planted there
    // (it would make the download overwrite the link's target), and only resume a plain file.
    if fs::symlink_metadata(&part).is_ok_and(|m| !m.is_file()) {
        fs::remove_file(&part).map_err(HubError::io(format!("cannot remove `{}`", part.display())))?;
    }
    let mut options = fs::OpenOptions::new();
    options.create(true).truncate(false).read(true).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
    let mut file = options.open(&part).map_err(HubError::io(format!("cannot write `{}`", part.display())))?;
    let io = |e| HubError::Io { context: format!("cannot write `{}`", part.display()), source: e };
    let mut resumed = false;
    for attempt in 0..client.env.attempts {
        let mut have = file.seek(std::io::SeekFrom::End(0)).map_err(io)?;
        if size.is_some_and(|n| have > n) {
            // A leftover longer than the file cannot be resumed: start over, in this attempt.
            file.set_len(0).map_err(io)?;
            have = file.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
        }
        if size == Some(have) && have > 0 {
            resumed = true;
            break;
        }
        let resp = client.send(what, false, || {
            let mut req = client.agent().get(url).header("Accept-Encoding", "identity");
            if have > 0 {
                req = req.header("Range", format!("bytes={have}-"));
            }
            req = client.authorize(req, url);
            req.call()
        })?;
        let partial = resp.status().as_u16() == 206;
        // A part must start where the kept bytes end: bytes appended anywhere else would make
        // a file that fails its digest, and the next run would resume from it again.
        let from = header(&resp, "content-range").map(content_range_start);
        if partial && from.is_some_and(|f| f != Some(have)) {
            file.set_len(0).map_err(io)?;
            file.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
            if attempt + 1 < client.env.attempts {
                continue;
            }
            return Err(HubError::BadResponse {
                what: what.to_string(),
                reason: format!(
                    "asked for the bytes from {have} on, the server sent `Content-Range: {}`",
                    header(&resp, "content-range").unwrap_or_default()
                ),
            });
        }
        if partial {
            resumed |= have > 0;
        } else {
            // The server sent the whole file: start over.
            file.set_len(0).map_err(io)?;
            file.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
        }
        let mut pos = file.stream_position().map_err(io)?;
        progress(pos);
        let mut reader = resp.into_body().into_reader();
        let mut buf = vec![0u8; 1 << 20];
        let streamed: Result<(), std::io::Error> = (|| {
            loop {
                let n = reader.read(&mut buf)?;
                if n == 0 {
                    return Ok(());
                }
                if size.is_some_and(|s| pos + n as u64 > s) {
                    return Err(std::io::Error::other("the server sent more bytes than the file has"));
                }
                file.write_all(&buf[..n])?;
                pos += n as u64;
                progress(pos);
            }
        })();
        match streamed {
            Ok(()) if size.is_none_or(|s| s == pos) => break,
            // A dropped connection: the bytes so far stay in `.incomplete`; resume from there.
            Ok(()) | Err(_) if attempt + 1 < client.env.attempts => {
                std::thread::sleep(std::time::Duration::from_millis(client.env.backoff_ms));
            }
            Ok(()) => {
                return Err(HubError::BadResponse {
                    what: what.to_string(),
                    reason: format!("the download stopped at {pos} of {} bytes", size.unwrap_or(0)),
                });
            }
            Err(e) => return Err(io(e)),
        }
    }
    file.sync_all().map_err(io)?;
    drop(file);
    fs::rename(&part, blob).map_err(HubError::io(format!("cannot write `{}`", blob.display())))?;
    Ok(resumed)
}

/// The first byte of a `Content-Range: bytes <first>-<last>/<total>` answer (`None` when the
/// header says something else).
fn content_range_start(v: &str) -> Option<u64> {
    v.trim().strip_prefix("bytes ")?.split('-').next()?.trim().parse().ok()
}

/// Check a blob against its name: sha256 for LFS files, the git blob id (sha1 of
/// `blob <len>\0<bytes>`) for the rest. Err(Ok(actual)) on a mismatch.
fn verify(blob: &std::path::Path, etag: &str) -> Result<(), Result<String, std::io::Error>> {
    let len = fs::metadata(blob).map_err(Err)?.len();
    let actual = if etag.len() == 64 {
        digest_file(sha2::Sha256::new(), blob)
    } else {
        let mut h = sha1::Sha1::new();
        h.update(format!("blob {len}\0").as_bytes());
        digest_file(h, blob)
    }
    .map_err(Err)?;
    if actual == etag { Ok(()) } else { Err(Ok(actual)) }
}

/// Feed a file into a hasher (sha256 or sha1, both `digest` 0.10) and return the hex digest.
fn digest_file<D: sha2::Digest>(mut h: D, path: &std::path::Path) -> std::io::Result<String> {
    let mut f = fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(hex(&h.finalize()));
        }
        h.update(&buf[..n]);
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
