//! HTTP to the Hub: one agent, retries with backoff for transient failures, status codes mapped
//! to clear errors, and bounded reads of JSON answers (an HTML page or a huge body is refused).

use std::time::Duration;

use ureq::Body;
use ureq::http::Response;

use super::{HubEnv, HubError};

/// Largest JSON answer rtune reads (a repo listing of ~100k files fits).
const MAX_JSON: u64 = 64 << 20;

pub struct Client {
    pub env: HubEnv,
    agent: ureq::Agent,
}

/// Why one attempt failed.
enum Attempt {
    /// Worth retrying: timeout, dropped connection, 429, 5xx.
    Transient(String),
    Fatal(HubError),
}

impl Client {
    pub fn new(env: HubEnv) -> Client {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(20)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .timeout_per_read(Some(Duration::from_secs(120)))
            .user_agent(format!("rtune/{}", env!("CARGO_PKG_VERSION")))
            // Presigned CDN URLs carry their own credentials; the token stays with the Hub.
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::Never)
            .build()
            .into();
        Client { env, agent }
    }

    pub fn agent(&self) -> &ureq::Agent {
        &self.agent
    }

    /// Add `Authorization` to a request for `url` if it goes to the Hub itself (never to other
    /// hosts, such as the CDN a download or upload is redirected to).
    pub fn authorize<B>(&self, req: ureq::RequestBuilder<B>, url: &str) -> ureq::RequestBuilder<B> {
        let to_hub = url.starts_with(&format!("{}/", self.env.endpoint));
        match self.env.token.as_ref().filter(|_| to_hub) {
            Some(t) => req.header("Authorization", t.bearer()),
            None => req,
        }
    }

    /// Send a request (built afresh for every attempt), retrying transient failures with
    /// exponential backoff. Returns a response with status < 400 (or 404 when `allow_404`).
    pub fn send(
        &self,
        what: &str,
        allow_404: bool,
        mut attempt: impl FnMut() -> Result<Response<Body>, ureq::Error>,
    ) -> Result<Response<Body>, HubError> {
        self.retry(what, || self.classify(what, allow_404, attempt()))
    }

    /// Run `attempt` until it succeeds, fails for good, or the attempts are spent (with
    /// exponential backoff between them).
    fn retry<T>(&self, what: &str, mut attempt: impl FnMut() -> Result<T, Attempt>) -> Result<T, HubError> {
        let mut last = String::new();
        for n in 0..self.env.attempts {
            if n > 0 {
                let ms = self.env.backoff_ms.saturating_mul(1 << (n - 1).min(5)).min(16_000);
                std::thread::sleep(Duration::from_millis(ms));
            }
            match attempt() {
                Ok(r) => return Ok(r),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Transient(why)) => last = why,
            }
        }
        Err(HubError::Unreachable {
            what: what.to_string(),
            endpoint: self.env.endpoint.clone(),
            attempts: self.env.attempts,
            reason: last,
        })
    }

    fn classify(
        &self,
        what: &str,
        allow_404: bool,
        res: Result<Response<Body>, ureq::Error>,
    ) -> Result<Response<Body>, Attempt> {
        let resp = match res {
            Ok(r) => r,
            Err(e @ (ureq::Error::Io(_) | ureq::Error::Timeout(_) | ureq::Error::ConnectionFailed)) => {
                return Err(Attempt::Transient(self.redact(&e.to_string())));
            }
            Err(e) => {
                return Err(Attempt::Fatal(HubError::Unreachable {
                    what: what.to_string(),
                    endpoint: self.env.endpoint.clone(),
                    attempts: 1,
                    reason: self.redact(&e.to_string()),
                }));
            }
        };
        let status = resp.status().as_u16();
        let what = what.to_string();
        match status {
            s if s < 400 => Ok(resp),
            404 if allow_404 => Ok(resp),
            401 => Err(Attempt::Fatal(HubError::Unauthorized { what })),
            403 => Err(Attempt::Fatal(HubError::Forbidden { what })),
            404 => Err(Attempt::Fatal(HubError::NotFound { what })),
            429 | 500 | 502 | 503 | 504 => Err(Attempt::Transient(format!("HTTP {status}"))),
            _ => {
                let body = self.error_text(resp);
                Err(Attempt::Fatal(HubError::Status { what, status, body }))
            }
        }
    }

    /// The Hub's `{"error": "..."}` message, or the start of the body.
    fn error_text(&self, mut resp: Response<Body>) -> String {
        let text = resp.body_mut().with_config().limit(64 << 10).read_to_string().unwrap_or_default();
        let msg = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or(text);
        let mut msg = self.redact(msg.trim());
        if msg.len() > 300 {
            let cut = (0..=300).rev().find(|&i| msg.is_char_boundary(i)).unwrap_or(0);
            msg.truncate(cut);
            msg.push('…');
        }
        msg
    }

    pub fn redact(&self, text: &str) -> String {
        match &self.env.token {
            Some(t) => t.redact(text),
            None => text.to_string(),
        }
    }

    /// A server-derived string made safe to print: the token redacted (a server may echo the
    /// Authorization header back) and control characters escaped (no terminal escapes).
    pub fn sanitize(&self, text: &str) -> String {
        escape_controls(&self.redact(text))
    }

    /// [`Client::sanitize`] applied to what a malformed answer put into an error.
    fn sanitize_error(&self, e: HubError) -> HubError {
        match e {
            HubError::BadResponse { what, reason } => {
                HubError::BadResponse { what: self.sanitize(&what), reason: self.sanitize(&reason) }
            }
            HubError::Status { what, status, body } => {
                HubError::Status { what: self.sanitize(&what), status, body: self.sanitize(&body) }
            }
            e => e,
        }
    }

    /// GET a JSON document from the Hub API.
    pub fn get_json<T: serde::de::DeserializeOwned>(&self, what: &str, url: &str) -> Result<T, HubError> {
        self.json_answer(what, || self.authorize(self.agent.get(url).header("Accept", "application/json"), url).call())
    }

    /// Send a request and read its JSON answer; a connection that drops or stalls while the
    /// answer's body is read is retried like one that fails before it (the request is sent
    /// again: every API call rtune makes may be repeated).
    fn json_answer<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        mut call: impl FnMut() -> Result<Response<Body>, ureq::Error>,
    ) -> Result<T, HubError> {
        let bytes = self
            .retry(what, || {
                let resp = self.classify(what, false, call())?;
                read_body(resp).map_err(|e| match e {
                    e @ (ureq::Error::Io(_) | ureq::Error::Timeout(_)) => {
                        Attempt::Transient(self.redact(&e.to_string()))
                    }
                    ureq::Error::BodyExceedsLimit(n) => Attempt::Fatal(HubError::BadResponse {
                        what: what.to_string(),
                        reason: format!("the answer is larger than {n} bytes"),
                    }),
                    e => Attempt::Fatal(HubError::BadResponse { what: what.to_string(), reason: e.to_string() }),
                })
            })
            .map_err(|e| self.sanitize_error(e))?;
        parse_json(what, &bytes).map_err(|e| self.sanitize_error(e))
    }

    /// POST JSON to the Hub API and read a JSON answer.
    pub fn post_json<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        url: &str,
        content_type: &str,
        body: &[u8],
    ) -> Result<T, HubError> {
        self.json_answer(what, || {
            let req = self.agent.post(url).header("Content-Type", content_type).header("Accept", "application/json");
            self.authorize(req, url).send(body)
        })
    }
}

/// A JSON answer's bytes, at most [`MAX_JSON`] of them.
fn read_body(mut resp: Response<Body>) -> Result<Vec<u8>, ureq::Error> {
    resp.body_mut().with_config().limit(MAX_JSON).read_to_vec()
}

/// Parse a JSON answer, refusing HTML error pages with a clear message.
fn parse_json<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, HubError> {
    let bad = |reason: String| HubError::BadResponse { what: what.to_string(), reason };
    let start = bytes.iter().position(|b| !b.is_ascii_whitespace()).map(|i| bytes[i]);
    if !matches!(start, Some(b'{' | b'[')) {
        let head: String =
            String::from_utf8_lossy(&bytes[..bytes.len().min(60)]).chars().filter(|c| !c.is_control()).collect();
        let kind = if start == Some(b'<') { "an HTML page" } else { "not JSON" };
        return Err(bad(format!("expected JSON, got {kind} (`{head}`)")));
    }
    serde_json::from_slice(bytes).map_err(|e| bad(format!("unexpected JSON: {e}")))
}

/// Control characters (ESC, CR, …) as `\u{1b}`-style escapes; everything else as is.
pub fn escape_controls(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_string();
    }
    text.chars().map(|c| if c.is_control() { c.escape_unicode().to_string() } else { c.to_string() }).collect()
}

/// A response header as text.
pub fn header<'a>(resp: &'a Response<Body>, name: &str) -> Option<&'a str> {
    resp.headers().get(name).and_then(|v| v.to_str().ok())
}
