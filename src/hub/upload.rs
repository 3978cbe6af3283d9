//! Upload files to a Hub repo in one commit, with the protocol huggingface_hub uses:
//! create the repo (if asked), `preupload` to learn which files go through LFS, the LFS batch
//! API (`basic` or `multipart` transfer) for those, then one NDJSON `commit` with small files
//! inline (base64) and LFS files by sha256.

use std::fs;
use std::io::{Read, Seek};
use std::path::PathBuf;

use base64::Engine as _;
use serde::Deserialize;
use serde_json::json;
use sha2::Digest as _;

use super::download::{encode, hex};
use super::http::header;
use super::{Client, HubError, RepoRef};
use crate::ui::{Ui, human_bytes};

/// One file of a commit: its path in the repo and where its bytes are.
#[derive(Debug, Clone)]
pub struct CommitFile {
    pub path: String,
    pub local: PathBuf,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct CommitReport {
    pub commit: String,
    pub url: String,
    pub lfs_files: usize,
    pub regular_files: usize,
    pub bytes_uploaded: u64,
    /// Files the repository's .gitignore excludes (the Hub's `shouldIgnore`), not committed.
    pub ignored: Vec<String>,
    /// What the Hub's listing will say of each committed file's bytes (path → digests).
    #[serde(skip)]
    pub digests: std::collections::BTreeMap<String, HubDigests>,
}

/// A committed file's digests as the Hub lists them (`?blobs=true`): every file's sha256 (an
/// LFS file's `lfs.sha256`) and, for a file sent inline, its git blob id (`blobId`, the sha1 of
/// `blob <len>\0<bytes>`; an LFS file's `blobId` is its pointer's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubDigests {
    pub sha256: String,
    pub git: Option<String>,
}

/// The git blob id of `bytes`.
pub fn git_blob_id(bytes: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    hex(&h.finalize())
}

/// What [`commit`] does with files the repository's .gitignore excludes: skip them with a
/// warning (`rtune upload`, as huggingface_hub does), or refuse the commit (an export, whose
/// record must name only files that are on the Hub).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    Skip,
    Refuse,
}

#[derive(Deserialize)]
struct Preupload {
    files: Vec<PreuploadFile>,
}

#[derive(Deserialize)]
struct PreuploadFile {
    path: String,
    #[serde(rename = "uploadMode")]
    upload_mode: String,
    #[serde(default, rename = "shouldIgnore")]
    should_ignore: bool,
}

#[derive(Deserialize)]
struct Batch {
    #[serde(default)]
    transfer: Option<String>,
    objects: Vec<BatchObject>,
}

#[derive(Deserialize)]
struct BatchObject {
    oid: String,
    #[serde(default)]
    actions: Option<Actions>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Actions {
    #[serde(default)]
    upload: Option<Action>,
    #[serde(default)]
    verify: Option<Action>,
}

#[derive(Deserialize)]
struct Action {
    href: String,
    #[serde(default)]
    header: serde_json::Map<String, serde_json::Value>,
}

struct Local {
    file: CommitFile,
    size: u64,
    sha256: String,
    sample: Vec<u8>,
}

/// Create `repo` if it does not exist (a 409 "already exists" is fine).
pub fn create_repo(client: &Client, repo: &RepoRef, private: bool) -> Result<(), HubError> {
    let (org, name) = match repo.id.split_once('/') {
        Some((o, n)) => (Some(o), n),
        None => (None, repo.id.as_str()),
    };
    let mut body = json!({ "name": name, "private": private });
    if let Some(o) = org {
        body["organization"] = json!(o);
    }
    if repo.kind != super::RepoKind::Model {
        body["type"] = json!(repo.kind.as_str());
    }
    let url = format!("{}/api/repos/create", client.env.endpoint);
    let what = format!("creating {}", repo.id);
    let body = serde_json::to_vec(&body).expect("json");
    let resp = client.send(&what, false, || {
        client.authorize(client.agent().post(&url).header("Content-Type", "application/json"), &url).send(&body[..])
    });
    match resp {
        Ok(_) | Err(HubError::Status { status: 409, .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The largest file sent inline (base64 in the commit body, held in memory); the Hub itself
/// sends files over 10 MB to LFS.
const MAX_REGULAR: u64 = 10 << 20;

/// Commit `files` to `repo` at `repo.revision` (a branch).
pub fn commit(
    client: &Client,
    repo: &RepoRef,
    files: &[CommitFile],
    message: &str,
    ignored_files: Ignored,
    ui: &Ui,
) -> Result<CommitReport, HubError> {
    let mut locals = Vec::new();
    for f in files {
        super::check_repo_path(&f.path)?;
        locals.push(describe(f)?);
    }
    let api = format!("{}/api/{}/{}", client.env.endpoint, repo.kind.plural(), repo.id);
    let rev = encode(&repo.revision);

    // 1. Which files must go through LFS?
    let body = json!({ "files": locals.iter().map(|l| json!({
        "path": l.file.path,
        "sample": base64::engine::general_purpose::STANDARD.encode(&l.sample),
        "size": l.size,
        "sha": l.sha256,
    })).collect::<Vec<_>>() });
    let pre: Preupload = client.post_json(
        &format!("preupload to {}", repo.display()),
        &format!("{api}/preupload/{rev}"),
        "application/json",
        &serde_json::to_vec(&body).expect("json"),
    )?;
    let mode = |path: &str| pre.files.iter().find(|p| p.path == path);
    let mut lfs = Vec::new();
    let mut regular = Vec::new();
    let mut ignored = Vec::new();
    for l in &locals {
        match mode(&l.file.path) {
            Some(p) if p.should_ignore => ignored.push(l.file.path.clone()),
            // Regular files travel base64-encoded inside one JSON commit held in memory: past
            // MAX_REGULAR a file goes through LFS whatever the server says.
            Some(p) if p.upload_mode == "lfs" || l.size > MAX_REGULAR => lfs.push(l),
            Some(_) => regular.push(l),
            None => {
                return Err(HubError::BadResponse {
                    what: "preupload".into(),
                    reason: format!("no upload mode for `{}`", l.file.path),
                });
            }
        }
    }

    if !ignored.is_empty() {
        let names = ignored.iter().map(|p| format!("`{p}`")).collect::<Vec<_>>().join(", ");
        if ignored_files == Ignored::Refuse {
            return Err(HubError::Ignored { repo: repo.display(), files: names });
        }
        ui.warn(format!("not uploaded: {names} (the .gitignore of {} excludes them)", repo.display()));
    }

    // 2. LFS objects the Hub does not have yet.
    let mut uploaded = 0u64;
    if !lfs.is_empty() {
        let total: u64 = lfs.iter().map(|l| l.size).sum();
        ui.status("upload", format!("{} LFS file(s), {}", lfs.len(), human_bytes(total)));
        let batch_url =
            format!("{}/{}{}.git/info/lfs/objects/batch", client.env.endpoint, repo.kind.url_prefix(), repo.id);
        let body = json!({
            "operation": "upload",
            "transfers": ["basic", "multipart"],
            "objects": lfs.iter().map(|l| json!({ "oid": l.sha256, "size": l.size })).collect::<Vec<_>>(),
            "hash_algo": "sha256",
            "ref": { "name": repo.revision },
        });
        let batch: Batch = client.post_json(
            "LFS batch",
            &batch_url,
            "application/vnd.git-lfs+json",
            &serde_json::to_vec(&body).expect("json"),
        )?;
        let mut bar = ui.transfer("upload", total);
        for (i, l) in lfs.iter().enumerate() {
            let obj = batch.objects.iter().find(|o| o.oid == l.sha256).ok_or_else(|| HubError::BadResponse {
                what: "LFS batch".into(),
                reason: format!("no answer for `{}`", l.file.path),
            })?;
            if let Some(err) = &obj.error {
                return Err(HubError::BadResponse {
                    what: format!("LFS upload of `{}`", l.file.path),
                    reason: client.sanitize(&err.to_string()),
                });
            }
            let Some(actions) = &obj.actions else { continue }; // already on the Hub
            if let Some(up) = &actions.upload {
                bar.start_file(&l.file.path, l.size, i + 1, lfs.len());
                let multipart = batch.transfer.as_deref() == Some("multipart") || up.header.contains_key("chunk_size");
                if multipart {
                    upload_multipart(client, l, up)?;
                } else {
                    upload_basic(client, l, up)?;
                }
                uploaded += l.size;
                bar.set(l.size, uploaded);
            }
            if let Some(v) = &actions.verify {
                let body = serde_json::to_vec(&json!({ "oid": l.sha256, "size": l.size })).expect("json");
                client.send(&format!("verifying `{}`", l.file.path), false, || {
                    let mut req = client.agent().post(&v.href).header("Content-Type", "application/vnd.git-lfs+json");
                    for (k, val) in &v.header {
                        req = req.header(k.as_str(), val.as_str().unwrap_or_default());
                    }
                    req = client.authorize(req, &v.href);
                    req.send(&body[..])
                })?;
            }
        }
        bar.finish();
    }

    // 3. The commit.
    let mut lines = vec![json!({ "key": "header", "value": { "summary": message, "description": "" } })];
    let mut digests = std::collections::BTreeMap::new();
    for l in &lfs {
        digests.insert(l.file.path.clone(), HubDigests { sha256: l.sha256.clone(), git: None });
    }
    for l in &regular {
        let bytes =
            fs::read(&l.file.local).map_err(HubError::io(format!("cannot read `{}`", l.file.local.display())))?;
        // The bytes sent are the ones described (a file changed since would commit bytes whose
        // digests no record holds).
        let sha256 = hex(&sha2::Sha256::digest(&bytes));
        if sha256 != l.sha256 {
            return Err(HubError::Io {
                context: format!("`{}` changed while it was uploaded", l.file.local.display()),
                source: std::io::Error::other("its sha256 differs from the one read first"),
            });
        }
        digests.insert(l.file.path.clone(), HubDigests { sha256, git: Some(git_blob_id(&bytes)) });
        lines.push(json!({ "key": "file", "value": {
            "content": base64::engine::general_purpose::STANDARD.encode(&bytes),
            "path": l.file.path,
            "encoding": "base64",
        }}));
        uploaded += l.size;
    }
    for l in &lfs {
        lines.push(json!({ "key": "lfsFile", "value": { "path": l.file.path, "algo": "sha256", "oid": l.sha256, "size": l.size } }));
    }
    let ndjson: String = lines.iter().map(|l| format!("{l}\n")).collect();
    #[derive(Deserialize)]
    struct Committed {
        #[serde(rename = "commitOid")]
        commit_oid: String,
        #[serde(rename = "commitUrl", default)]
        commit_url: String,
    }
    let c: Committed = client.post_json(
        &format!("committing to {}", repo.display()),
        &format!("{api}/commit/{rev}"),
        "application/x-ndjson",
        ndjson.as_bytes(),
    )?;
    Ok(CommitReport {
        commit: c.commit_oid,
        url: c.commit_url,
        lfs_files: lfs.len(),
        regular_files: regular.len(),
        bytes_uploaded: uploaded,
        ignored,
        digests,
    })
}

fn describe(f: &CommitFile) -> Result<Local, HubError> {
    let io = HubError::io(format!("cannot read `{}`", f.local.display()));
    let mut file = fs::File::open(&f.local).map_err(io)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    let mut sample = Vec::new();
    loop {
        let n = file.read(&mut buf).map_err(HubError::io(format!("cannot read `{}`", f.local.display())))?;
        if n == 0 {
            break;
        }
        if sample.len() < 512 {
            sample.extend_from_slice(&buf[..n.min(512 - sample.len())]);
        }
        h.update(&buf[..n]);
        size += n as u64;
    }
    Ok(Local { file: f.clone(), size, sha256: hex(&h.finalize()), sample })
}

fn upload_basic(client: &Client, l: &Local, up: &Action) -> Result<(), HubError> {
    client.send(&format!("uploading `{}`", l.file.path), false, || {
        let file = fs::File::open(&l.file.local).map_err(ureq::Error::Io)?;
        let mut req = client.agent().put(&up.href).header("Content-Length", l.size.to_string());
        for (k, v) in &up.header {
            req = req.header(k.as_str(), v.as_str().unwrap_or_default());
        }
        req = client.authorize(req, &up.href);
        req.send(ureq::SendBody::from_owned_reader(file))
    })?;
    Ok(())
}

/// Multipart: the header has `chunk_size` and one presigned URL per part, keyed `1`, `2`, ….
/// Each part's `ETag` goes into the completion request sent to the upload URL.
fn upload_multipart(client: &Client, l: &Local, up: &Action) -> Result<(), HubError> {
    let bad = |reason: String| HubError::BadResponse { what: format!("multipart upload of `{}`", l.file.path), reason };
    let chunk: u64 = match up.header.get("chunk_size") {
        Some(serde_json::Value::Number(n)) => n.as_u64().unwrap_or(0),
        Some(serde_json::Value::String(s)) => s.parse().unwrap_or(0),
        _ => 0,
    };
    if chunk == 0 {
        return Err(bad("no `chunk_size`".into()));
    }
    let mut parts: Vec<(u64, &str)> =
        up.header.iter().filter_map(|(k, v)| Some((k.parse::<u64>().ok()?, v.as_str()?))).collect();
    parts.sort();
    if parts.len() as u64 != l.size.div_ceil(chunk) || parts.iter().enumerate().any(|(i, (n, _))| *n != i as u64 + 1) {
        return Err(bad(format!("{} part URLs for {} bytes in {chunk}-byte parts", parts.len(), l.size)));
    }
    let mut etags = Vec::new();
    for (n, href) in &parts {
        let start = (n - 1) * chunk;
        let len = chunk.min(l.size - start);
        let resp = client.send(&format!("uploading part {n} of `{}`", l.file.path), false, || {
            let mut file = fs::File::open(&l.file.local).map_err(ureq::Error::Io)?;
            file.seek(std::io::SeekFrom::Start(start)).map_err(ureq::Error::Io)?;
            client
                .agent()
                .put(*href)
                .header("Content-Length", len.to_string())
                .send(ureq::SendBody::from_owned_reader(file.take(len)))
        })?;
        let etag = header(&resp, "etag").ok_or_else(|| bad(format!("part {n} has no ETag")))?.to_string();
        etags.push(json!({ "partNumber": n, "etag": etag }));
    }
    let body = serde_json::to_vec(&json!({ "oid": l.sha256, "parts": etags })).expect("json");
    client.send(&format!("completing `{}`", l.file.path), false, || {
        let req = client.agent().post(&up.href).header("Content-Type", "application/vnd.git-lfs+json");
        client.authorize(req, &up.href).send(&body[..])
    })?;
    Ok(())
}
