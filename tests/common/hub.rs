//! A Hub on 127.0.0.1 for tests: serves repos the way huggingface.co does (API JSON, resolve
//! URLs with `X-Repo-Commit` / `ETag` / `X-Linked-Etag` headers, LFS files behind a redirect to
//! a "CDN" path with Range support) and accepts the upload protocol (create, preupload, LFS
//! batch with basic and multipart transfers, verify, NDJSON commit). Faults can be injected.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use serde_json::{Value, json};
use sha1::Digest as _;

/// Files at or above this size are LFS files (as `.gitattributes` would make `*.safetensors`).
pub const LFS_THRESHOLD: usize = 1024;
/// LFS uploads above this size are asked for in multipart, in parts of this size.
pub const MULTIPART_CHUNK: usize = 4096;

#[derive(Default)]
pub struct Repo {
    pub kind: String,
    pub private: bool,
    /// commit id → files
    pub commits: HashMap<String, BTreeMap<String, Vec<u8>>>,
    pub branches: HashMap<String, String>,
}

#[derive(Default)]
pub struct State {
    pub repos: HashMap<String, Repo>, // key: "model:owner/name"
    pub lfs: HashMap<String, Vec<u8>>,
    parts: HashMap<String, BTreeMap<u64, Vec<u8>>>,
    /// Statuses answered (in order) to the next requests instead of serving them.
    pub fail_next: Vec<u16>,
    /// (prefix of "METHOD path", status): the first request that matches each is answered
    /// with that status instead of being served.
    pub fail_matching: Vec<(String, u16)>,
    /// Extra names put into every listing (hostile input).
    pub extra_listing: Vec<String>,
    /// Paths served with wrong bytes.
    pub corrupt: Vec<String>,
    /// API answers are an HTML page.
    pub html_api: bool,
    /// API answers are plain text echoing the request's Authorization header, with a terminal
    /// escape sequence (a hostile or broken proxy).
    pub echo_auth: bool,
    /// Cut the body of the next file GET after this many bytes.
    pub cut_next_body: Option<usize>,
    /// Cut the body of the next API (JSON) answer after this many bytes.
    pub cut_next_json: Option<usize>,
    /// Answer the next ranged GET with a part that starts this many bytes before the one asked
    /// for (and says so in `Content-Range`).
    pub shift_next_range: Option<usize>,
    /// Token required for every request (401 without, 403 with another).
    pub require_token: Option<String>,
    /// Preupload answers `regular` for every file, however large (a hostile server).
    pub all_regular: bool,
    /// Paths preupload answers `shouldIgnore` for (as a repo's .gitignore would make it).
    pub ignored: Vec<String>,
    /// Listed sizes that differ from the real ones (path → size).
    pub listed_size: HashMap<String, u64>,
    /// "METHOD path" of every request, and whether it carried a token.
    pub log: Vec<(String, bool)>,
    /// Random damage to answers (fuzzing the client's HTTP layer).
    pub chaos: Option<Chaos>,
}

/// Seeded random damage to the Hub's answers: each answer is, with probability `percent`%,
/// changed in one way a broken server, proxy or network could change it (status, headers,
/// body, framing). `applied` records what was done, for a failing case's message.
pub struct Chaos {
    rng: u64,
    pub percent: u64,
    pub applied: Vec<String>,
}

impl Chaos {
    pub fn new(seed: u64, percent: u64) -> Chaos {
        Chaos { rng: seed | 1, percent, applied: Vec::new() }
    }

    fn next(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a>(&mut self, list: &[&'a str]) -> &'a str {
        list[self.below(list.len())]
    }

    /// A header value a broken or hostile answer could carry.
    fn garbage(&mut self) -> String {
        let zeros40 = "0".repeat(40);
        let zeros64 = "0".repeat(64);
        let list = [
            "",
            "-1",
            "0",
            "18446744073709551616",
            "99999999999999",
            "\"\"",
            "W/\"",
            "zz",
            "../../evil",
            "/etc/passwd",
            "http://127.0.0.1:1/x",
            "file:///etc/passwd",
            "//evil.example/x",
            "\u{1b}[2J",
            "Ω≈ç",
            "bytes 5-2/3",
            zeros40.as_str(),
            zeros64.as_str(),
        ];
        self.pick(&list).to_string()
    }

    /// Maybe damage `resp` (the answer to `what`).
    fn mutate(&mut self, what: &str, mut resp: Resp) -> Resp {
        if self.next() % 100 >= self.percent {
            return resp;
        }
        let kind = self.below(12);
        let note = match kind {
            0 => {
                let codes = [200, 201, 204, 206, 301, 302, 304, 307, 308, 400, 401, 403, 404, 409, 416, 429, 500, 503];
                resp.status = codes[self.below(codes.len())];
                format!("status {}", resp.status)
            }
            1 if !resp.headers.is_empty() => {
                let (k, _) = resp.headers.remove(self.below(resp.headers.len()));
                format!("dropped {k}")
            }
            2 if !resp.headers.is_empty() => {
                let i = self.below(resp.headers.len());
                resp.headers[i].1 = self.garbage();
                format!("{} = {:?}", resp.headers[i].0, resp.headers[i].1)
            }
            3 => {
                let names = [
                    "Location",
                    "Content-Length",
                    "Content-Encoding",
                    "Transfer-Encoding",
                    "Content-Range",
                    "X-Linked-Size",
                    "X-Linked-Etag",
                    "ETag",
                    "X-Repo-Commit",
                    "Content-Type",
                ];
                let k = self.pick(&names).to_string();
                let v = match k.as_str() {
                    "Content-Encoding" => self.pick(&["gzip", "br", "zstd", "x-bogus"]).to_string(),
                    "Transfer-Encoding" => "chunked".to_string(),
                    _ => self.garbage(),
                };
                resp.headers.retain(|(h, _)| !h.eq_ignore_ascii_case(&k));
                resp.headers.push((k.clone(), v.clone()));
                format!("set {k} = {v:?}")
            }
            4 if !resp.body.is_empty() => {
                let n = self.below(resp.body.len());
                resp.cut = Some(n);
                format!("cut after {n} of {} bytes", resp.body.len())
            }
            5 if !resp.body.is_empty() => {
                let i = self.below(resp.body.len());
                let bit = 1u8 << self.below(8);
                resp.body[i] ^= bit;
                format!("flipped a bit of byte {i}")
            }
            6 => {
                let n = self.below(3000);
                resp.body = (0..n).map(|_| self.next() as u8).collect();
                format!("{n} random bytes as the body")
            }
            7 => match serde_json::from_slice::<Value>(&resp.body) {
                Ok(mut v) => {
                    let path = self.mutate_json(&mut v);
                    resp.body = v.to_string().into_bytes();
                    format!("JSON {path}")
                }
                Err(_) => {
                    resp.body.clear();
                    "emptied the body".into()
                }
            },
            8 => {
                let n = self.below(200);
                resp.raw = Some((0..n).map(|_| self.next() as u8).collect());
                format!("{n} random bytes instead of an answer")
            }
            9 => {
                let len = resp.body.len();
                let lie = match self.below(3) {
                    0 => len.saturating_sub(1 + self.below(len.max(1))),
                    1 => len + 1 + self.below(5000),
                    _ => usize::MAX / 2,
                };
                resp.headers.retain(|(h, _)| !h.eq_ignore_ascii_case("content-length"));
                resp.headers.push(("Content-Length".into(), lie.to_string()));
                format!("Content-Length {lie} for {len} bytes")
            }
            10 => {
                let body = std::mem::take(&mut resp.body);
                resp.body = body.repeat(2);
                "the body twice".into()
            }
            _ => {
                resp.body.clear();
                "an empty body".into()
            }
        };
        self.applied.push(format!("{what}: {note}"));
        resp
    }

    /// Replace one node of `v` with a value of another shape; returns where.
    fn mutate_json(&mut self, v: &mut Value) -> String {
        let mut here = v;
        let mut path = String::new();
        loop {
            let children = match &*here {
                Value::Array(a) => a.len(),
                Value::Object(o) => o.len(),
                _ => 0,
            };
            if children == 0 || self.below(4) == 0 {
                break;
            }
            let i = self.below(children);
            here = match here {
                Value::Array(a) => {
                    path.push_str(&format!("[{i}]"));
                    &mut a[i]
                }
                Value::Object(o) => {
                    let (k, v) = o.iter_mut().nth(i).expect("in range");
                    path.push_str(&format!(".{k}"));
                    v
                }
                _ => unreachable!(),
            };
        }
        let choices = [
            json!(null),
            json!(-1),
            json!(0),
            json!(1e300),
            json!(u64::MAX),
            json!("../../evil"),
            json!(""),
            json!("0000000000000000000000000000000000000000"),
            json!([]),
            json!({}),
            json!(true),
            json!([{ "rfilename": "x" }]),
        ];
        *here = choices[self.below(choices.len())].clone();
        format!("{path} = {here}")
    }
}

#[derive(Clone)]
pub struct HubServer {
    pub url: String,
    pub state: Arc<Mutex<State>>,
}

pub fn blob_id(bytes: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    hex(&h.finalize())
}

pub fn sha256(bytes: &[u8]) -> String {
    hex(&sha2::Sha256::digest(bytes))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn key(kind: &str, id: &str) -> String {
    format!("{kind}:{id}")
}

impl HubServer {
    /// The Hub, and a second listener standing for the CDN / storage host that LFS downloads and
    /// uploads are redirected to (another host, so clients must not send the token there).
    pub fn start() -> HubServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let cdn = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let cdn_url = format!("http://{}", cdn.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        for l in [listener, cdn] {
            let (st, base, cdn_url) = (state.clone(), url.clone(), cdn_url.clone());
            std::thread::spawn(move || {
                for conn in l.incoming().flatten() {
                    let (st, base, cdn_url) = (st.clone(), base.clone(), cdn_url.clone());
                    std::thread::spawn(move || {
                        let _ = serve(conn, &st, &base, &cdn_url);
                    });
                }
            });
        }
        HubServer { url, state }
    }

    /// Forget every repo, fault and request (a fresh Hub on the same address).
    pub fn reset(&self) {
        *self.state.lock().unwrap() = State::default();
    }

    /// Add a commit with `files` on `main` of a repo (created if new); returns the commit id.
    pub fn add_commit(&self, kind: &str, id: &str, files: &[(&str, Vec<u8>)]) -> String {
        let mut guard = self.state.lock().unwrap();
        let st = &mut *guard;
        let repo = st.repos.entry(key(kind, id)).or_insert_with(|| Repo { kind: kind.into(), ..Default::default() });
        let parent = repo.branches.get("main").cloned().unwrap_or_default();
        let mut tree = repo.commits.get(&parent).cloned().unwrap_or_default();
        for (p, b) in files {
            tree.insert(p.to_string(), b.clone());
        }
        // Large files are LFS files, as `.gitattributes` would make them.
        for b in tree.values_mut() {
            if b.len() >= LFS_THRESHOLD && !b.starts_with(b"lfs:") {
                let oid = sha256(b);
                st.lfs.insert(oid.clone(), std::mem::replace(b, format!("lfs:{oid}").into_bytes()));
            }
        }
        let sha = commit_id(&parent, &tree);
        let repo = st.repos.get_mut(&key(kind, id)).expect("created above");
        repo.commits.insert(sha.clone(), tree);
        repo.branches.insert("main".into(), sha.clone());
        sha
    }

    /// Add a commit on `main` that deletes `paths`; returns the commit id.
    pub fn delete_files(&self, kind: &str, id: &str, paths: &[&str]) -> String {
        let mut st = self.state.lock().unwrap();
        let repo = st.repos.get_mut(&key(kind, id)).expect("repo exists");
        let parent = repo.branches.get("main").cloned().unwrap_or_default();
        let mut tree = repo.commits.get(&parent).cloned().unwrap_or_default();
        for p in paths {
            tree.remove(*p);
        }
        let sha = commit_id(&parent, &tree);
        repo.commits.insert(sha.clone(), tree);
        repo.branches.insert("main".into(), sha.clone());
        sha
    }

    pub fn files(&self, kind: &str, id: &str, rev: &str) -> Option<BTreeMap<String, Vec<u8>>> {
        let st = self.state.lock().unwrap();
        let repo = st.repos.get(&key(kind, id))?;
        let sha = repo.branches.get(rev).cloned().unwrap_or_else(|| rev.to_string());
        let tree = repo.commits.get(&sha)?.clone();
        let lfs = &st.lfs;
        Some(tree.into_iter().map(|(p, b)| (p, resolve_lfs(&b, lfs))).collect())
    }
}

/// Commits store LFS files as pointers `lfs:<oid>`; everything else inline.
fn resolve_lfs(b: &[u8], lfs: &HashMap<String, Vec<u8>>) -> Vec<u8> {
    match std::str::from_utf8(b).ok().and_then(|s| s.strip_prefix("lfs:")) {
        Some(oid) => lfs.get(oid).cloned().unwrap_or_default(),
        None => b.to_vec(),
    }
}

fn commit_id(parent: &str, tree: &BTreeMap<String, Vec<u8>>) -> String {
    let mut h = sha1::Sha1::new();
    h.update(parent.as_bytes());
    for (p, b) in tree {
        h.update(p.as_bytes());
        h.update(blob_id(b).as_bytes());
    }
    hex(&h.finalize())
}

struct Req {
    method: String,
    path: String,
    query: String,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Send only this many body bytes, then close.
    cut: Option<usize>,
    /// Send these bytes instead of the answer (chaos).
    raw: Option<Vec<u8>>,
}

impl Resp {
    fn json(status: u16, v: Value) -> Resp {
        Resp {
            status,
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: v.to_string().into_bytes(),
            cut: None,
            raw: None,
        }
    }
    fn status(status: u16, msg: &str) -> Resp {
        Resp::json(status, json!({ "error": msg }))
    }
}

fn read_req(conn: &mut TcpStream) -> std::io::Result<Req> {
    let mut r = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let target = parts.next().unwrap_or_default().to_string();
    let (path, query) =
        target.split_once('?').map(|(a, b)| (a.to_string(), b.to_string())).unwrap_or((target, String::new()));
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let mut body = Vec::new();
    if let Some(n) = headers.get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else if headers.get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk)?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
    Ok(Req { method, path: percent_decode(&path), query, headers, body })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).to_string()
}

fn serve(mut conn: TcpStream, st: &Mutex<State>, base: &str, cdn: &str) -> std::io::Result<()> {
    let req = read_req(&mut conn)?;
    let mut resp = handle(&req, st, base, cdn);
    if req.path.starts_with("/api/") && resp.status == 200 {
        resp.cut = resp.cut.or(st.lock().unwrap().cut_next_json.take());
    }
    if let Some(chaos) = st.lock().unwrap().chaos.as_mut() {
        resp = chaos.mutate(&format!("{} {}", req.method, req.path), resp);
    }
    if let Some(raw) = &resp.raw {
        conn.write_all(raw)?;
        return conn.flush();
    }
    let head_only = req.method == "HEAD";
    let mut out = format!("HTTP/1.1 {} X\r\n", resp.status);
    for (k, v) in &resp.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    if !resp.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-length")) {
        out.push_str(&format!("Content-Length: {}\r\n", resp.body.len()));
    }
    out.push_str("Connection: close\r\n\r\n");
    conn.write_all(out.as_bytes())?;
    if !head_only {
        let n = resp.cut.unwrap_or(resp.body.len()).min(resp.body.len());
        conn.write_all(&resp.body[..n])?;
    }
    conn.flush()
}

fn handle(req: &Req, st: &Mutex<State>, base: &str, cdn_base: &str) -> Resp {
    let mut s = st.lock().unwrap();
    let auth = req.headers.get("authorization").cloned();
    s.log.push((format!("{} {}", req.method, req.path), auth.is_some()));
    if !s.fail_next.is_empty() {
        let code = s.fail_next.remove(0);
        return Resp::status(code, "injected failure");
    }
    let line = format!("{} {}", req.method, req.path);
    if let Some(i) = s.fail_matching.iter().position(|(prefix, _)| line.starts_with(prefix.as_str())) {
        let (_, code) = s.fail_matching.remove(i);
        return Resp::status(code, "injected failure");
    }
    let cdn = req.path.starts_with("/cdn/") || req.path.starts_with("/lfs-");
    if let Some(tok) = s.require_token.clone()
        && !cdn
    {
        match auth.as_deref() {
            None => return Resp::status(401, "Invalid username or password."),
            Some(a) if a != format!("Bearer {tok}") => return Resp::status(403, "Access denied."),
            _ => {}
        }
    }
    let p = req.path.clone();
    let segs: Vec<&str> = p.trim_start_matches('/').split('/').collect();
    match (req.method.as_str(), segs.as_slice()) {
        (_, ["api", "repos", "create"]) => {
            let v: Value = serde_json::from_slice(&req.body).unwrap_or_default();
            let kind = v["type"].as_str().unwrap_or("model").to_string();
            let id = match v["organization"].as_str() {
                Some(o) => format!("{o}/{}", v["name"].as_str().unwrap_or_default()),
                None => v["name"].as_str().unwrap_or_default().to_string(),
            };
            if s.repos.contains_key(&key(&kind, &id)) {
                return Resp::status(409, "You already created this model repo");
            }
            let mut repo =
                Repo { kind: kind.clone(), private: v["private"].as_bool().unwrap_or(false), ..Default::default() };
            let sha = commit_id("", &BTreeMap::new());
            repo.commits.insert(sha.clone(), BTreeMap::new());
            repo.branches.insert("main".into(), sha);
            s.repos.insert(key(&kind, &id), repo);
            Resp::json(200, json!({ "url": format!("{base}/{id}") }))
        }
        ("GET", ["api", plural, owner, name, "revision", rev @ ..]) => {
            if s.echo_auth {
                let auth = req.headers.get("authorization").cloned().unwrap_or_default();
                return Resp {
                    status: 200,
                    headers: vec![("Content-Type".into(), "text/plain".into())],
                    body: format!("{auth}\x1b[2J").into_bytes(),
                    cut: None,
                    raw: None,
                };
            }
            if s.html_api {
                return Resp {
                    status: 200,
                    headers: vec![("Content-Type".into(), "text/html".into())],
                    body: b"<!DOCTYPE html><html><body>Sign in to the proxy</body></html>".to_vec(),
                    cut: None,
                    raw: None,
                };
            }
            let kind = plural.trim_end_matches('s');
            let id = format!("{owner}/{name}");
            let rev = rev.join("/");
            let Some(repo) = s.repos.get(&key(kind, &id)) else { return Resp::status(404, "Repository not found") };
            let sha = repo.branches.get(&rev).cloned().unwrap_or(rev.clone());
            let Some(tree) = repo.commits.get(&sha) else { return Resp::status(404, "Invalid rev id") };
            let blobs = req.query.contains("blobs=true");
            let mut siblings: Vec<Value> = tree
                .iter()
                .map(|(path, b)| {
                    let real = resolve_lfs(b, &s.lfs);
                    let mut e = json!({ "rfilename": path });
                    if blobs {
                        e["size"] = json!(s.listed_size.get(path).copied().unwrap_or(real.len() as u64));
                        e["blobId"] = json!(blob_id(b));
                        if b.starts_with(b"lfs:") {
                            e["lfs"] = json!({ "sha256": sha256(&real), "size": real.len(), "pointerSize": 134 });
                        }
                    }
                    e
                })
                .collect();
            for extra in &s.extra_listing {
                siblings.push(json!({ "rfilename": extra, "size": 3, "blobId": blob_id(b"bad") }));
            }
            Resp::json(200, json!({ "id": id, "sha": sha, "private": repo.private, "siblings": siblings }))
        }
        ("GET", ["api", plural, owner, name, "tree", rev @ ..]) => {
            // huggingface_hub ≥ 1.0 lists files with the tree API (one page here).
            let kind = plural.trim_end_matches('s');
            let rev = rev.join("/");
            let Some(repo) = s.repos.get(&key(kind, &format!("{owner}/{name}"))) else {
                return Resp::status(404, "Repository not found");
            };
            let sha = repo.branches.get(&rev).cloned().unwrap_or(rev.clone());
            let Some(tree) = repo.commits.get(&sha) else { return Resp::status(404, "Invalid rev id") };
            let mut dirs = std::collections::BTreeSet::new();
            let mut entries: Vec<Value> = Vec::new();
            for (path, b) in tree {
                let parts: Vec<&str> = path.split('/').collect();
                for i in 1..parts.len() {
                    dirs.insert(parts[..i].join("/"));
                }
                let real = resolve_lfs(b, &s.lfs);
                let mut e = json!({ "type": "file", "oid": blob_id(b), "size": real.len(), "path": path });
                if b.starts_with(b"lfs:") {
                    e["lfs"] = json!({ "oid": sha256(&real), "size": real.len(), "pointerSize": 134 });
                }
                entries.push(e);
            }
            for extra in &s.extra_listing {
                entries.push(json!({ "type": "file", "oid": blob_id(b"bad"), "size": 3, "path": extra }));
            }
            for d in dirs {
                entries.push(json!({ "type": "directory", "oid": blob_id(d.as_bytes()), "size": 0, "path": d }));
            }
            Resp::json(200, Value::Array(entries))
        }
        ("POST", ["api", plural, owner, name, "preupload", _rev @ ..]) => {
            let kind = plural.trim_end_matches('s');
            if !s.repos.contains_key(&key(kind, &format!("{owner}/{name}"))) {
                return Resp::status(404, "Repository not found");
            }
            let v: Value = serde_json::from_slice(&req.body).unwrap_or_default();
            let files: Vec<Value> = v["files"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|f| {
                    let lfs = !s.all_regular && f["size"].as_u64().unwrap_or(0) as usize >= LFS_THRESHOLD;
                    {
                    let ignore = s.ignored.iter().any(|p| f["path"] == p.as_str());
                    json!({ "path": f["path"], "uploadMode": if lfs { "lfs" } else { "regular" }, "shouldIgnore": ignore })
                }
                })
                .collect();
            Resp::json(200, json!({ "files": files }))
        }
        ("POST", ["api", plural, owner, name, "commit", rev @ ..]) => {
            let kind = plural.trim_end_matches('s').to_string();
            let id = format!("{owner}/{name}");
            let rev = rev.join("/");
            let text = String::from_utf8_lossy(&req.body).to_string();
            let mut adds: Vec<(String, Vec<u8>)> = Vec::new();
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let v: Value = match serde_json::from_str(line) {
                    Ok(v) => v,
                    Err(_) => return Resp::status(400, "bad ndjson"),
                };
                match v["key"].as_str() {
                    Some("header") => {}
                    Some("file") => {
                        let bytes = base64::engine::general_purpose::STANDARD
                            .decode(v["value"]["content"].as_str().unwrap_or_default())
                            .unwrap_or_default();
                        adds.push((v["value"]["path"].as_str().unwrap_or_default().into(), bytes));
                    }
                    Some("lfsFile") => {
                        let oid = v["value"]["oid"].as_str().unwrap_or_default().to_string();
                        if !s.lfs.contains_key(&oid) {
                            return Resp::status(422, "LFS object not uploaded");
                        }
                        adds.push((
                            v["value"]["path"].as_str().unwrap_or_default().into(),
                            format!("lfs:{oid}").into_bytes(),
                        ));
                    }
                    _ => return Resp::status(400, "unknown key"),
                }
            }
            let Some(repo) = s.repos.get_mut(&key(&kind, &id)) else {
                return Resp::status(404, "Repository not found");
            };
            let parent = repo.branches.get(&rev).cloned().unwrap_or_default();
            let mut tree = repo.commits.get(&parent).cloned().unwrap_or_default();
            tree.extend(adds);
            let sha = commit_id(&parent, &tree);
            repo.commits.insert(sha.clone(), tree);
            repo.branches.insert(rev, sha.clone());
            Resp::json(200, json!({ "commitOid": sha, "commitUrl": format!("{base}/{id}/commit/{sha}") }))
        }
        ("POST", [.., last]) if last.ends_with(".git") || req.path.ends_with("/info/lfs/objects/batch") => {
            let v: Value = serde_json::from_slice(&req.body).unwrap_or_default();
            let objects: Vec<Value> = v["objects"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|o| {
                    let oid = o["oid"].as_str().unwrap_or_default();
                    let size = o["size"].as_u64().unwrap_or(0) as usize;
                    if s.lfs.contains_key(oid) {
                        return json!({ "oid": oid, "size": size });
                    }
                    let upload = if size > MULTIPART_CHUNK {
                        let mut header = serde_json::Map::new();
                        header.insert("chunk_size".into(), json!(MULTIPART_CHUNK.to_string()));
                        for n in 1..=size.div_ceil(MULTIPART_CHUNK) {
                            header.insert(n.to_string(), json!(format!("{cdn_base}/lfs-part/{oid}/{n}")));
                        }
                        json!({ "href": format!("{cdn_base}/lfs-upload/{oid}"), "header": header })
                    } else {
                        json!({ "href": format!("{cdn_base}/lfs-upload/{oid}") })
                    };
                    json!({ "oid": oid, "size": size, "actions": {
                        "upload": upload,
                        "verify": { "href": format!("{cdn_base}/lfs-verify/{oid}") },
                    }})
                })
                .collect();
            let mut r = Resp::json(200, json!({ "transfer": "basic", "objects": objects }));
            r.headers = vec![("Content-Type".into(), "application/vnd.git-lfs+json".into())];
            r
        }
        ("PUT", ["lfs-upload", oid]) => {
            if sha256(&req.body) != *oid {
                return Resp::status(400, "sha256 mismatch");
            }
            s.lfs.insert(oid.to_string(), req.body.clone());
            Resp::json(200, json!({}))
        }
        ("PUT", ["lfs-part", oid, n]) => {
            let n: u64 = n.parse().unwrap_or(0);
            s.parts.entry(oid.to_string()).or_default().insert(n, req.body.clone());
            let mut r = Resp::json(200, json!({}));
            r.headers.push(("ETag".into(), format!("\"part-{n}-{}\"", blob_id(&req.body))));
            r
        }
        ("POST", ["lfs-upload", oid]) => {
            let v: Value = serde_json::from_slice(&req.body).unwrap_or_default();
            let parts = s.parts.remove(*oid).unwrap_or_default();
            let listed: Vec<u64> = v["parts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .filter_map(|p| p["partNumber"].as_u64())
                .collect();
            if listed != parts.keys().copied().collect::<Vec<_>>() {
                return Resp::status(400, "parts do not match");
            }
            let bytes: Vec<u8> = parts.into_values().flatten().collect();
            if sha256(&bytes) != *oid {
                return Resp::status(400, "sha256 mismatch");
            }
            s.lfs.insert(oid.to_string(), bytes);
            Resp::json(200, json!({}))
        }
        ("POST", ["lfs-verify", oid]) => {
            if s.lfs.contains_key(*oid) {
                Resp::json(200, json!({}))
            } else {
                Resp::status(404, "not found")
            }
        }
        ("GET" | "HEAD", ["cdn", oid]) => {
            let Some(bytes) = s.lfs.get(*oid).cloned() else { return Resp::status(404, "no such object") };
            file_response(req, &mut s, bytes, vec![])
        }
        ("GET" | "HEAD", rest) => {
            // [datasets/]owner/name/resolve/<rev>/<path...>
            let (kind, rest) = match rest {
                ["datasets", tail @ ..] => ("dataset", tail),
                tail => ("model", tail),
            };
            let [owner, name, "resolve", rev, path @ ..] = rest else { return Resp::status(404, "not found") };
            let id = format!("{owner}/{name}");
            let Some(repo) = s.repos.get(&key(kind, &id)) else { return Resp::status(404, "Repository not found") };
            let sha = repo.branches.get(*rev).cloned().unwrap_or(rev.to_string());
            let path = path.join("/");
            let Some(stored) = repo.commits.get(&sha).and_then(|t| t.get(&path)).cloned() else {
                let mut r = Resp::status(404, "Entry not found");
                r.headers.push(("X-Error-Code".into(), "EntryNotFound".into()));
                return r;
            };
            let real = resolve_lfs(&stored, &s.lfs);
            let corrupt = s.corrupt.contains(&path);
            if let Some(oid) = std::str::from_utf8(&stored).ok().and_then(|t| t.strip_prefix("lfs:")) {
                // LFS: redirect to the CDN, with the file's identity on this answer.
                let headers = vec![
                    ("X-Repo-Commit".into(), sha.clone()),
                    ("ETag".into(), format!("\"{}\"", blob_id(&stored))),
                    ("X-Linked-Etag".into(), format!("\"{oid}\"")),
                    ("X-Linked-Size".into(), real.len().to_string()),
                    ("Location".into(), format!("{cdn_base}/cdn/{oid}")),
                ];
                if corrupt {
                    let mut bad = real.clone();
                    bad[0] ^= 0xff;
                    return file_response(req, &mut s, bad, headers[..4].to_vec());
                }
                return Resp { status: 302, headers, body: vec![], cut: None, raw: None };
            }
            let mut body = real.clone();
            if corrupt {
                body[0] ^= 0xff;
            }
            let headers =
                vec![("X-Repo-Commit".into(), sha.clone()), ("ETag".into(), format!("\"{}\"", blob_id(&real)))];
            file_response(req, &mut s, body, headers)
        }
        _ => Resp::status(404, "not found"),
    }
}

/// 200 or 206 (with `Range: bytes=N-`), optionally cut short once.
fn file_response(req: &Req, s: &mut State, bytes: Vec<u8>, mut headers: Vec<(String, String)>) -> Resp {
    headers.push(("Accept-Ranges".into(), "bytes".into()));
    headers.push(("Content-Type".into(), "application/octet-stream".into()));
    let start = req
        .headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split('-').next())
        .and_then(|n| n.parse::<usize>().ok());
    let cut = match s.cut_next_body {
        Some(n) if req.method == "GET" && bytes.len() > n => s.cut_next_body.take(),
        _ => None,
    };
    let start = match (start, s.shift_next_range) {
        (Some(n), Some(shift)) if req.method == "GET" && n < bytes.len() => {
            s.shift_next_range = None;
            Some(n.saturating_sub(shift))
        }
        _ => start,
    };
    match start {
        Some(n) if n < bytes.len() => {
            headers.push(("Content-Range".into(), format!("bytes {n}-{}/{}", bytes.len() - 1, bytes.len())));
            Resp { status: 206, headers, body: bytes[n..].to_vec(), cut, raw: None }
        }
        _ => Resp { status: 200, headers, body: bytes, cut, raw: None },
    }
}
