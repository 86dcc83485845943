//! A Model Context Protocol server's tools (`[[mcp_server]]`), over streamable HTTP. An attempt
//! is one `tools/call`: the request's one message holds the call (`{"name", "arguments"}`), the
//! tool's result is the answer (`structuredContent` as its text when there is one, else its
//! text parts), and a result with `isError` is a failed attempt, as a 5xx is: the server's
//! health and breaker count it. Its free check is `tools/list`.
//!
//! The server is asked in protocol revision 2026-07-28 first (one self-contained POST per call,
//! no session: any node serves any call); a server that refuses it is spoken to in 2025-11-25,
//! with `initialize` once and its session id, if it gives one, on every call after.

use super::super::config::ProviderConfig;
use super::super::exchange::{Attempt, Reply};
use super::http::{error_chain, key, read_capped, secret};
use super::{ToolAsk, ToolListError, Upstream, UpstreamCall, failed, listed};
use crate::core::request::{Generation, GenerationStatus};
use crate::node::exchange::ToolDefinition;
use futures_util::future::BoxFuture;
use reqwest::header::{AUTHORIZATION, HeaderName, HeaderValue};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The stateless revision, asked first.
pub(crate) const MODERN: &str = "2026-07-28";
/// The revision with `initialize`, for servers that do not speak `MODERN`.
pub(crate) const LEGACY: &str = "2025-11-25";

/// `_meta` keys of a 2026-07-28 request.
const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
const META_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";
const META_CLIENT: &str = "io.modelcontextprotocol/clientInfo";

/// How a server is spoken to, once known.
#[derive(Clone, Debug, PartialEq)]
enum Era {
    Modern,
    /// 2025-11-25, with the session id the server gave at `initialize` (if any).
    Legacy {
        session: Option<String>,
    },
}

pub(super) struct McpServer {
    url: reqwest::Url,
    headers: Vec<(HeaderName, HeaderValue)>,
    http: crate::http::lanes::PerLane<reqwest::Client>,
    cap: usize,
    era: tokio::sync::Mutex<Option<Era>>,
}

/// What a server answered a JSON-RPC request: its result, or why there is none.
enum Answered {
    Result(Value),
    /// A JSON-RPC error (its code and message).
    Error(i64, String),
    /// No JSON-RPC answer: the attempt it makes.
    Failed(Box<Attempt>),
}

impl McpServer {
    pub(super) fn new(
        cfg: &ProviderConfig,
        http: crate::http::lanes::PerLane<reqwest::Client>,
        post: &crate::http::Poster,
    ) -> Result<McpServer, super::SetupError> {
        let url =
            reqwest::Url::parse(&cfg.base_url).map_err(|_| super::SetupError::bad_url(cfg))?;
        let headers = key(cfg)
            .and_then(|k| secret(AUTHORIZATION, &format!("Bearer {k}")))
            .into_iter()
            .collect();
        Ok(McpServer {
            url,
            headers,
            http,
            cap: post.max_answer_bytes(),
            era: tokio::sync::Mutex::new(None),
        })
    }

    /// A POST to the server with its key, taking a JSON answer or a stream of events.
    fn post(&self) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .here()
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(
                reqwest::header::ACCEPT,
                "application/json, text/event-stream",
            );
        for (n, v) in &self.headers {
            req = req.header(n, v.clone());
        }
        req
    }

    /// Send `method` with `params` in `era`, bounded by `timeout`.
    async fn exchange(
        &self,
        era: &Era,
        method: &str,
        name: Option<&str>,
        mut params: Value,
        timeout: Duration,
        started: Instant,
    ) -> Answered {
        let mut req = self.post();
        match era {
            Era::Modern => {
                req = req
                    .header("mcp-protocol-version", MODERN)
                    .header("mcp-method", method);
                if let Some(name) = name {
                    req = req.header("mcp-name", name);
                }
                params["_meta"] = json!({
                    META_VERSION: MODERN,
                    META_CAPABILITIES: {},
                    META_CLIENT: {"name": "oam", "version": env!("CARGO_PKG_VERSION")},
                });
            }
            Era::Legacy { session } => {
                if method != "initialize" {
                    req = req.header("mcp-protocol-version", LEGACY);
                }
                if let Some(s) = session {
                    req = req.header("mcp-session-id", s.as_str());
                }
            }
        }
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let ms = || started.elapsed().as_millis() as u64;
        let sent = async {
            let resp = req.json(&body).send().await.map_err(|e| error_chain(&e))?;
            let status = resp.status();
            let session = resp
                .headers()
                .get("mcp-session-id")
                .and_then(|v| v.to_str().ok())
                .map(String::from);
            let bytes = read_capped(resp, self.cap)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((status, session, bytes))
        };
        let (status, session, bytes) = match tokio::time::timeout(timeout, sent).await {
            Err(_) => {
                let why = format!("no answer within {} ms", timeout.as_millis());
                return Answered::Failed(Box::new(failed(GenerationStatus::Timeout, why, ms())));
            }
            Ok(Err(why)) => {
                return Answered::Failed(Box::new(failed(GenerationStatus::Error, why, ms())));
            }
            Ok(Ok(parts)) => parts,
        };
        if method == "initialize"
            && let (Some(s), Era::Legacy { .. }) = (session, era)
        {
            *self.era.lock().await = Some(Era::Legacy { session: Some(s) });
        }
        match response_of(&bytes) {
            Some(v) => match (v.get("result"), v.get("error")) {
                (Some(r), _) => Answered::Result(r.clone()),
                (None, Some(e)) => Answered::Error(
                    e["code"].as_i64().unwrap_or(0),
                    e["message"].as_str().unwrap_or("").to_string(),
                ),
                (None, None) => Answered::Failed(Box::new(failed(
                    GenerationStatus::Error,
                    "a JSON-RPC answer with neither result nor error".into(),
                    ms(),
                ))),
            },
            None => {
                let status_of = match status.as_u16() {
                    401 | 403 => GenerationStatus::Unauthorized,
                    429 => GenerationStatus::RateLimited,
                    _ => GenerationStatus::Error,
                };
                let text = String::from_utf8_lossy(&bytes);
                let why = format!(
                    "HTTP {status}: {}",
                    text.chars().take(200).collect::<String>()
                );
                Answered::Failed(Box::new(failed(status_of, why, ms())))
            }
        }
    }

    /// The era this server speaks: asked once (`server/discover` in 2026-07-28; refused, it is
    /// initialized in 2025-11-25).
    async fn era(&self, timeout: Duration, started: Instant) -> Result<Era, Attempt> {
        if let Some(era) = self.era.lock().await.as_ref() {
            return Ok(era.clone());
        }
        let discover = self
            .exchange(
                &Era::Modern,
                "server/discover",
                None,
                json!({}),
                timeout,
                started,
            )
            .await;
        let modern = match discover {
            Answered::Result(r) => r["supportedVersions"]
                .as_array()
                .is_some_and(|v| v.iter().any(|v| v == MODERN)),
            Answered::Error(..) => false,
            // A 4xx without a JSON-RPC body is a refusal of the revision; no answer at all
            // is not: asked again next time.
            Answered::Failed(a) => {
                let refused = a.generation.status == GenerationStatus::Error
                    && (a.generation.error.as_deref()).is_some_and(|e| e.starts_with("HTTP 4"));
                if !refused {
                    return Err(*a);
                }
                false
            }
        };
        let era = if modern {
            Era::Modern
        } else {
            let legacy = Era::Legacy { session: None };
            let params = json!({
                "protocolVersion": LEGACY,
                "capabilities": {},
                "clientInfo": {"name": "oam", "version": env!("CARGO_PKG_VERSION")},
            });
            match self
                .exchange(&legacy, "initialize", None, params, timeout, started)
                .await
            {
                Answered::Result(_) => {}
                Answered::Error(code, message) => {
                    let why = format!("initialize refused ({code}): {message}");
                    return Err(failed(GenerationStatus::Error, why, 0));
                }
                Answered::Failed(a) => return Err(*a),
            }
            // Its session, if it gave one, was kept by `exchange`.
            let session = match self.era.lock().await.as_ref() {
                Some(Era::Legacy { session }) => session.clone(),
                _ => None,
            };
            let _ = self.notify_initialized(session.as_deref(), timeout).await;
            Era::Legacy { session }
        };
        *self.era.lock().await = Some(era.clone());
        Ok(era)
    }

    async fn notify_initialized(&self, session: Option<&str>, timeout: Duration) -> Option<()> {
        let mut req = self.post().header("mcp-protocol-version", LEGACY);
        if let Some(s) = session {
            req = req.header("mcp-session-id", s);
        }
        let body = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        tokio::time::timeout(timeout, req.json(&body).send())
            .await
            .ok()?
            .ok()?;
        Some(())
    }

    /// `method` asked in the server's era; a session the server forgot is made again once.
    async fn ask(
        &self,
        method: &str,
        name: Option<&str>,
        params: Value,
        timeout: Duration,
    ) -> Answered {
        let started = Instant::now();
        for _ in 0..2 {
            let era = match self.era(timeout, started).await {
                Ok(era) => era,
                Err(a) => return Answered::Failed(Box::new(a)),
            };
            let left = timeout.saturating_sub(started.elapsed());
            let answer = self
                .exchange(&era, method, name, params.clone(), left, started)
                .await;
            let expired = matches!(&answer, Answered::Failed(a)
                if a.generation.error.as_deref().is_some_and(|e| e.starts_with("HTTP 404")))
                && matches!(era, Era::Legacy { session: Some(_) });
            if !expired {
                return answer;
            }
            *self.era.lock().await = None;
        }
        Answered::Failed(Box::new(failed(
            GenerationStatus::Error,
            "the server forgot its session twice".into(),
            started.elapsed().as_millis() as u64,
        )))
    }

    /// The server's tools, as it lists them (every page).
    pub(super) async fn tools(
        &self,
        timeout: Duration,
    ) -> Result<Vec<ToolDefinition>, ToolListError> {
        /// One page of a `tools/list` result.
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Page {
            tools: Option<Vec<ToolDefinition>>,
            #[serde(default)]
            next_cursor: Option<String>,
        }
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let params = match &cursor {
                Some(c) => json!({"cursor": c}),
                None => json!({}),
            };
            match self.ask("tools/list", None, params, timeout).await {
                Answered::Result(r) => {
                    let Ok(Page {
                        tools: Some(page),
                        next_cursor,
                    }) = serde_json::from_value(r)
                    else {
                        return Err(ToolListError::NoList);
                    };
                    tools.extend(page);
                    match next_cursor {
                        Some(c) if !c.is_empty() => cursor = Some(c),
                        _ => return Ok(tools),
                    }
                }
                Answered::Error(code, message) => {
                    return Err(ToolListError::Refused { code, message });
                }
                Answered::Failed(a) => {
                    let why = a.generation.error.unwrap_or_else(|| "no answer".into());
                    return Err(ToolListError::Failed(why));
                }
            }
        }
        Err(ToolListError::TooManyPages(MAX_PAGES))
    }
}

/// Pages of a tool list read at most.
const MAX_PAGES: usize = 20;

/// The JSON-RPC response in a body: JSON, or the first event of a stream that is one.
fn response_of(bytes: &[u8]) -> Option<Value> {
    if let Ok(v) = serde_json::from_slice::<Value>(bytes) {
        return v.is_object().then_some(v);
    }
    let mut parser = crate::http::sse::Parser::default();
    let events = parser.feed(bytes).ok()?;
    let mut tail = parser.feed(b"\n\n").unwrap_or_default();
    events
        .into_iter()
        .chain(tail.drain(..))
        .filter_map(|e| serde_json::from_str::<Value>(&e).ok())
        .find(|v| v.get("result").is_some() || v.get("error").is_some())
}

/// The text parts of a tool's result (`content`), one per line: what it says, for a reader.
fn text_of_content(result: &Value) -> String {
    result["content"]
        .as_array()
        .map(|parts| {
            parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

/// A tool's result as an attempt: its text (`structuredContent` as JSON, else its text parts),
/// failed when it says `isError`.
fn attempt_of(result: Value, latency_ms: u64) -> Attempt {
    let text = match result.get("structuredContent") {
        Some(s) if !s.is_null() => s.to_string(),
        _ => text_of_content(&result),
    };
    let generation = if result["isError"] == true {
        Generation {
            error: Some(format!(
                "the tool answered isError: {}",
                text.chars().take(200).collect::<String>()
            )),
            ..Generation::failed(GenerationStatus::Error, latency_ms)
        }
    } else {
        Generation::ok(&text, latency_ms)
    };
    Attempt {
        generation,
        body: Some(Reply::Json(result)),
        http_status: 200,
    }
}

impl Upstream for McpServer {
    fn generate<'a>(&'a self, ask: UpstreamCall<'a>, timeout: Duration) -> BoxFuture<'a, Attempt> {
        Box::pin(async move {
            let started = Instant::now();
            let ms = || started.elapsed().as_millis() as u64;
            let (name, arguments) = match ToolAsk::of(&ask, ms()) {
                Ok(ToolAsk::Call(call)) => (call.name, call.arguments),
                Ok(ToolAsk::Probe) => return listed(self.tools(timeout).await, ms()),
                Err(refused) => return *refused,
            };
            let params = json!({"name": name, "arguments": arguments});
            match self.ask("tools/call", Some(&name), params, timeout).await {
                Answered::Result(r) => attempt_of(r, ms()),
                // Invalid arguments, an unknown tool: the call's own fault.
                Answered::Error(code @ (-32602 | -32601), message) => failed(
                    GenerationStatus::Rejected,
                    format!("tools/call refused ({code}): {message}"),
                    ms(),
                ),
                Answered::Error(code, message) => failed(
                    GenerationStatus::Error,
                    format!("tools/call failed ({code}): {message}"),
                    ms(),
                ),
                Answered::Failed(a) => *a,
            }
        })
    }

    fn tool_list(
        &self,
        timeout: Duration,
    ) -> Option<BoxFuture<'_, Result<Vec<ToolDefinition>, ToolListError>>> {
        Some(Box::pin(self.tools(timeout)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_is_read_from_json_or_from_its_event() {
        let json = br#"{"jsonrpc":"2.0","id":1,"result":{"tools":[]}}"#;
        assert_eq!(response_of(json).unwrap()["result"]["tools"], json!([]));
        let sse = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"error\":{\"code\":-32602,\"message\":\"bad\"}}\n\n";
        assert_eq!(response_of(sse).unwrap()["error"]["code"], -32602);
        assert!(response_of(b"<html>").is_none());
    }

    #[test]
    fn a_result_is_its_structured_content_or_its_text_and_is_error_fails_it() {
        let a = attempt_of(
            json!({"content": [{"type": "text", "text": "5"}], "structuredContent": {"result": 5}}),
            3,
        );
        assert_eq!(a.generation.status, GenerationStatus::Ok);
        assert_eq!(a.generation.content, r#"{"result":5}"#);
        let a = attempt_of(
            json!({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            3,
        );
        assert_eq!(a.generation.content, "a\nb");
        let a = attempt_of(
            json!({"content": [{"type": "text", "text": "nope"}], "isError": true}),
            3,
        );
        assert_eq!(a.generation.status, GenerationStatus::Error);
        assert!(a.generation.error.unwrap().contains("nope"));
    }
}
