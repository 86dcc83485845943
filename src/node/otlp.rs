//! OpenTelemetry export: one span per request (kind SERVER) and one per attempt made on a target
//! (kind CLIENT, its child), sent over OTLP/HTTP (JSON, or protobuf: `protocol`) to
//! `[telemetry] otlp_endpoint`, else as the standard `OTEL_*` variables say (endpoint,
//! protocol, headers, service name, resource attributes; a key the file sets wins). Attributes follow the GenAI semantic conventions
//! (`gen_ai.*`: operation, provider, request and response model, usage, finish reasons, time to
//! first chunk on streams; `error.type`), with oam's own facts as `oam.*` (decision, phase,
//! reason codes, route, the targets tried, attempt number). Messages and answers are left out
//! unless `content = true`. A caller's `traceparent` makes the request's span a child of the
//! caller's. Off the request's path, as the decision log is: finished requests wait in a bounded
//! queue and go out in batches; what does not fit, or is not taken, is counted
//! (`oam_otlp_spans_total`). The conventions are still moving: the whole mapping is here.

use super::metrics::Registry;
use crate::core::pipeline::{Decision, DecisionOutcome};
use crate::core::request::{Generation, GenerationStatus, Request, Usage};
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Finished requests waiting to be exported at most; beyond, they are dropped and counted.
const WAITING: usize = 8_192;
/// Requests per export at most.
const BATCH: usize = 256;
/// How long a batch waits to fill before it goes.
const LINGER: Duration = Duration::from_millis(500);
/// On stop, how long what waits may take to go out.
const FLUSH: Duration = Duration::from_secs(2);

const SPAN_KIND_SERVER: u8 = 2;
const SPAN_KIND_CLIENT: u8 = 3;
const STATUS_OK: u8 = 1;
const STATUS_ERROR: u8 = 2;

/// `[telemetry]` in `oam.toml`.
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct Settings {
    /// Where an OTLP/HTTP receiver listens (`http://host:4318`; spans go to `/v1/traces` under
    /// it, unless it names that path itself). None: `$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (as
    /// it is) or `$OTEL_EXPORTER_OTLP_ENDPOINT`, else nothing is exported.
    pub otlp_endpoint: Option<String>,
    /// Headers sent with every export (a vendor's API key, say).
    pub headers: BTreeMap<String, String>,
    /// The `service.name` of the spans (else `$OTEL_SERVICE_NAME`, else `service.name` in
    /// `$OTEL_RESOURCE_ATTRIBUTES`, else `oam`).
    pub service_name: Option<String>,
    /// `http/json` or `http/protobuf` (else `$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` or
    /// `$OTEL_EXPORTER_OTLP_PROTOCOL`, else `http/json`).
    pub protocol: Option<Protocol>,
    /// Attributes of the resource every span comes from (with `$OTEL_RESOURCE_ATTRIBUTES`'
    /// beside them: a key given here wins).
    pub resource_attributes: BTreeMap<String, String>,
    /// Put each request's messages and the answer on its spans (`gen_ai.input.messages`,
    /// `gen_ai.output.messages`). Off by default: prompts are often what nobody may read.
    pub content: bool,
    /// One export's deadline.
    pub timeout_ms: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            otlp_endpoint: None,
            headers: BTreeMap::new(),
            service_name: None,
            protocol: None,
            resource_attributes: BTreeMap::new(),
            content: false,
            timeout_ms: 5_000,
        }
    }
}

impl Settings {
    /// The URL spans are posted to, if export is on (`env` reads a variable). Errors say what
    /// is wrong with the one given.
    pub(crate) fn traces_url(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, NotAnOtlpUrl> {
        let (url, from) = match (
            &self.otlp_endpoint,
            env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        ) {
            (Some(u), _) => (
                u.trim_end_matches('/').to_string(),
                "telemetry.otlp_endpoint",
            ),
            (None, Some(u)) if !u.is_empty() => {
                return checked(u, "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").map(Some);
            }
            _ => match env("OTEL_EXPORTER_OTLP_ENDPOINT").filter(|u| !u.is_empty()) {
                Some(u) => (
                    u.trim_end_matches('/').to_string(),
                    "$OTEL_EXPORTER_OTLP_ENDPOINT",
                ),
                None => return Ok(None),
            },
        };
        let url = if url.ends_with("/v1/traces") {
            url
        } else {
            format!("{url}/v1/traces")
        };
        checked(url, from).map(Some)
    }
}

/// How spans are encoded over OTLP/HTTP.
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum Protocol {
    #[default]
    #[serde(rename = "http/json")]
    Json,
    #[serde(rename = "http/protobuf")]
    Protobuf,
}

impl Protocol {
    fn content_type(self) -> &'static str {
        match self {
            Protocol::Json => "application/json",
            Protocol::Protobuf => "application/x-protobuf",
        }
    }
}

/// What the exporter sends and where, from `[telemetry]` and the `OTEL_*` variables.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Export {
    pub url: String,
    pub protocol: Protocol,
    pub headers: BTreeMap<String, String>,
    pub service_name: String,
    /// The resource's attributes besides `service.*`.
    pub resource: BTreeMap<String, String>,
}

impl Settings {
    /// Where and how spans go (None: export is off), from the file and then the standard
    /// variables (`env` reads one); errors name the setting and what is wrong with it.
    pub(crate) fn export(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Export>, ExportError> {
        let Some(url) = self.traces_url(&env)? else {
            return Ok(None);
        };
        let var = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        let protocol = match self.protocol {
            Some(p) => p,
            None => match var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                .map(|v| ("$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", v))
                .or_else(|| {
                    var("OTEL_EXPORTER_OTLP_PROTOCOL").map(|v| ("$OTEL_EXPORTER_OTLP_PROTOCOL", v))
                }) {
                None => Protocol::Json,
                Some((_, v)) if v.trim() == "http/json" => Protocol::Json,
                Some((_, v)) if v.trim() == "http/protobuf" => Protocol::Protobuf,
                Some((from, given)) => return Err(ExportError::Protocol { from, given }),
            },
        };
        let mut headers = self.headers.clone();
        for k in [
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
            "OTEL_EXPORTER_OTLP_HEADERS",
        ] {
            if let Some(v) = var(k) {
                for (name, value) in pairs(&v).map_err(|why| ExportError::Pairs { var: k, why })? {
                    headers.entry(name).or_insert(value);
                }
            }
        }
        let mut resource = self.resource_attributes.clone();
        if let Some(v) = var("OTEL_RESOURCE_ATTRIBUTES") {
            let var = "OTEL_RESOURCE_ATTRIBUTES";
            for (name, value) in pairs(&v).map_err(|why| ExportError::Pairs { var, why })? {
                resource.entry(name).or_insert(value);
            }
        }
        let service_name = self
            .service_name
            .clone()
            .or_else(|| var("OTEL_SERVICE_NAME"))
            .or_else(|| resource.get("service.name").cloned())
            .unwrap_or_else(|| "oam".into());
        resource.retain(|k, _| !k.starts_with("service."));
        Ok(Some(Export {
            url,
            protocol,
            headers,
            service_name,
            resource,
        }))
    }
}

/// `k1=v1,k2=v2` (the `OTEL_*_HEADERS` and `OTEL_RESOURCE_ATTRIBUTES` format: values
/// percent-encoded, blanks around items ignored).
fn pairs(text: &str) -> Result<Vec<(String, String)>, PairsError> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| PairsError::NotKeyValue(item.to_string()))?;
            let k = k.trim();
            if k.is_empty() {
                return Err(PairsError::NoKey(item.to_string()));
            }
            Ok((k.to_string(), percent_decoded(v.trim())?))
        })
        .collect()
}

fn percent_decoded(v: &str) -> Result<String, PairsError> {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = v
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| PairsError::BadPercent(v.to_string()))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| PairsError::NotUtf8(v.to_string()))
}

/// A telemetry setting oam cannot export with: which, and why.
#[derive(Debug, PartialEq, thiserror::Error)]
pub(crate) enum ExportError {
    #[error(transparent)]
    Url(#[from] NotAnOtlpUrl),
    #[error(
        "{from}: {given:?} is not a protocol oam exports with: give http/protobuf or http/json \
         (oam sends OTLP over HTTP, not gRPC)"
    )]
    Protocol { from: &'static str, given: String },
    #[error("${var}: {why}")]
    Pairs { var: &'static str, why: PairsError },
}

/// What is wrong with a `k1=v1,k2=v2` list (`pairs`).
#[derive(Debug, PartialEq, thiserror::Error)]
pub(crate) enum PairsError {
    #[error("{0:?} is not key=value")]
    NotKeyValue(String),
    #[error("{0:?} has no key")]
    NoKey(String),
    #[error("{0:?} has a % that is not %XX")]
    BadPercent(String),
    #[error("{0:?} is not UTF-8 once decoded")]
    NotUtf8(String),
}

/// An OTLP endpoint that is no HTTP address: where it was given, and what.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{from}: {url:?} is not an OTLP/HTTP address: give http://host:4318 (or https://)")]
pub(crate) struct NotAnOtlpUrl {
    pub from: &'static str,
    pub url: String,
}

fn checked(url: String, from: &'static str) -> Result<String, NotAnOtlpUrl> {
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(url)
    } else {
        Err(NotAnOtlpUrl { from, url })
    }
}

/// Nanoseconds since the Unix epoch, now.
fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A 16-byte trace id, or an 8-byte span id, as lowercase hex.
fn trace_id() -> String {
    crate::ids::unguessable()
}

fn span_id() -> String {
    crate::ids::unguessable()[..16].to_string()
}

/// A W3C `traceparent` (`00-{trace}-{parent}-{flags}`): its trace id and parent span id.
pub(crate) fn parse_traceparent(v: &str) -> Option<(String, String)> {
    let mut parts = v.trim().split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let zero = |s: &str| s.bytes().all(|b| b == b'0');
    (hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && hex(parent, 16)
        && hex(flags, 2)
        && !zero(trace)
        && !zero(parent))
    .then(|| (trace.to_ascii_lowercase(), parent.to_ascii_lowercase()))
}

/// One attempt made on a target, as the driver saw it.
#[derive(Clone, Debug, Default)]
struct AttemptSpan {
    start_ns: u64,
    end_ns: u64,
    usage: Option<Usage>,
    finish: Option<String>,
    output: Option<String>,
    /// A failed call's `error.type`: the upstream's HTTP status, or what kept it from one.
    error_type: Option<String>,
}

/// The `error.type` of a call that failed with `g`, as OpenTelemetry's HTTP conventions name
/// one: the upstream's status code (`503`) when it answered, else what kept the call from an
/// answer (`timeout`, `connection_error`, `upstream_error` for an answer that could not be
/// read), else its status (`rate_limited`, `unauthorized`).
fn error_type(g: &Generation) -> Option<String> {
    if g.status == GenerationStatus::Ok {
        return None;
    }
    let said = g.error.as_deref().unwrap_or_default();
    if let Some(code) = said
        .strip_prefix("HTTP ")
        .and_then(|rest| rest.get(..3))
        .filter(|c| c.bytes().all(|b| b.is_ascii_digit()))
    {
        return Some(code.to_string());
    }
    let lower = said.to_ascii_lowercase();
    Some(match g.status {
        GenerationStatus::Error
            if ["connect", "dns", "refused", "reset"]
                .iter()
                .any(|w| lower.contains(w)) =>
        {
            "connection_error".into()
        }
        // An answer that could not be read, or a stream that broke off.
        GenerationStatus::Error => "upstream_error".into(),
        s => s.as_str().to_string(),
    })
}

/// A request's spans while it is under way (kept on its flight).
#[derive(Clone, Debug)]
pub(crate) struct OpenSpans {
    trace_id: String,
    parent: Option<String>,
    span_id: String,
    start_ns: u64,
    model: Option<String>,
    max_tokens: Option<u32>,
    embeddings: bool,
    stream: bool,
    input: Option<String>,
    first_chunk_ns: Option<u64>,
    attempts: Vec<AttemptSpan>,
}

impl OpenSpans {
    /// An attempt was dispatched; it starts after `delay_ms` (a retry's backoff).
    pub(crate) fn dispatched(&mut self, delay_ms: u64) {
        self.attempts.push(AttemptSpan {
            start_ns: unix_ns() + delay_ms * 1_000_000,
            ..AttemptSpan::default()
        });
    }

    /// The attempt under way ended with `g` (`content`: keep its answer).
    pub(crate) fn completed(&mut self, g: &Generation, content: bool) {
        if let Some(a) = self.attempts.last_mut() {
            a.end_ns = unix_ns().max(a.start_ns);
            a.usage = g.usage;
            a.finish = g.finish_reason.clone();
            a.output = content.then(|| g.content.clone());
            a.error_type = error_type(g);
        }
    }

    /// A live stream's first event reached oam (time to first chunk).
    pub(crate) fn first_chunk(&mut self) {
        self.first_chunk_ns.get_or_insert_with(unix_ns);
    }
}

/// What became of spans, for `/metrics`.
#[derive(Default)]
pub(crate) struct Counters {
    exported: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
}

/// A finished request, waiting to be exported.
struct Finished {
    spans: Vec<Span>,
}

/// The request path's handle: begins and finishes requests' spans (never waiting).
pub(crate) struct Telemetry {
    tx: Option<mpsc::Sender<Finished>>,
    content: bool,
    counters: Arc<Counters>,
    /// Target id -> (model, API) for the spans' provider and response model.
    targets: BTreeMap<String, (String, &'static str)>,
}

/// The exporter's half: it runs once, in `node::run`.
pub(crate) struct Exporter {
    rx: mpsc::Receiver<Finished>,
    export: Export,
    timeout: Duration,
    resource: Resource,
    counters: Arc<Counters>,
}

impl Telemetry {
    /// The handle and, when export is on (`export`), the exporter to run.
    pub(crate) fn new(
        node: &str,
        settings: &Settings,
        export: Option<Export>,
        targets: &[super::config::Target],
    ) -> (Telemetry, Option<Exporter>) {
        let counters = Arc::new(Counters::default());
        let targets = targets
            .iter()
            .map(|t| (t.id.clone(), (t.model.clone(), t.api.as_str())))
            .collect();
        let Some(export) = export else {
            let off = Telemetry {
                tx: None,
                content: false,
                counters,
                targets,
            };
            return (off, None);
        };
        let (tx, rx) = mpsc::channel(WAITING);
        let mut attributes = vec![
            attr("service.name", &export.service_name),
            attr("service.instance.id", node),
            attr("service.version", env!("CARGO_PKG_VERSION")),
        ];
        attributes.extend(export.resource.iter().map(|(k, v)| Attr {
            key: k.clone().into(),
            value: Any::Str(v.clone()),
        }));
        let resource = Resource { attributes };
        let exporter = Exporter {
            rx,
            timeout: Duration::from_millis(settings.timeout_ms),
            export,
            resource,
            counters: counters.clone(),
        };
        let on = Telemetry {
            tx: Some(tx),
            content: settings.content,
            counters,
            targets,
        };
        (on, Some(exporter))
    }

    pub(crate) fn content(&self) -> bool {
        self.content
    }

    /// The spans of `r` begin (none when export is off). `traceparent`: the caller's.
    pub(crate) fn begin(
        &self,
        r: &Request,
        stream: bool,
        traceparent: Option<&str>,
    ) -> Option<OpenSpans> {
        self.tx.as_ref()?;
        let (trace_id, parent) = match traceparent.and_then(parse_traceparent) {
            Some((t, p)) => (t, Some(p)),
            None => (trace_id(), None),
        };
        Some(OpenSpans {
            trace_id,
            parent,
            span_id: span_id(),
            start_ns: unix_ns(),
            model: r.model.clone(),
            max_tokens: r.max_tokens,
            embeddings: r.embeddings,
            stream,
            input: self.content.then(|| input_messages(r)),
            first_chunk_ns: None,
            attempts: Vec::new(),
        })
    }

    /// The request of `p` was decided `d`: its spans are queued for export.
    pub(crate) fn finish(&self, p: Option<OpenSpans>, d: &Decision) {
        let (Some(tx), Some(p)) = (&self.tx, p) else {
            return;
        };
        let spans = spans(&p, d, unix_ns(), &self.targets);
        let n = spans.len() as u64;
        if tx.try_send(Finished { spans }).is_err() {
            self.counters.dropped.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn register(&self, registry: &Registry) {
        let c = self.counters.clone();
        registry.register(
            "oam_otlp_spans_total",
            "Spans for OpenTelemetry, by what became of them (exported: the receiver took \
             them; dropped: the queue was full; failed: the receiver did not take them).",
            super::metrics::Kind::Counter,
            move |s| {
                for (result, n) in [
                    ("exported", &c.exported),
                    ("dropped", &c.dropped),
                    ("failed", &c.failed),
                ] {
                    s.put(&[("result", result)], n.load(Ordering::Relaxed));
                }
            },
        );
    }
}

impl Exporter {
    /// Export batches until `stop`, then what waits (within `FLUSH`).
    pub(crate) async fn run(mut self, stop: CancellationToken) {
        let http = match crate::http::http_client(Some(self.timeout)) {
            Ok(h) => h,
            Err(e) => {
                tracing::error!("OpenTelemetry export off: {e}");
                return;
            }
        };
        loop {
            let first = tokio::select! {
                f = self.rx.recv() => f,
                () = stop.cancelled() => break,
            };
            let Some(first) = first else { return };
            let mut batch = vec![first];
            let linger = tokio::time::sleep(LINGER);
            tokio::pin!(linger);
            while batch.len() < BATCH {
                tokio::select! {
                    f = self.rx.recv() => match f {
                        Some(f) => batch.push(f),
                        None => break,
                    },
                    () = &mut linger => break,
                }
            }
            self.export(&http, batch).await;
        }
        // Stopping: what waits goes out, briefly.
        let _ = tokio::time::timeout(FLUSH, async {
            let mut batch = Vec::new();
            while let Ok(f) = self.rx.try_recv() {
                batch.push(f);
            }
            if !batch.is_empty() {
                self.export(&http, batch).await;
            }
        })
        .await;
    }

    async fn export(&self, http: &reqwest::Client, batch: Vec<Finished>) {
        let spans: Vec<Span> = batch.into_iter().flat_map(|f| f.spans).collect();
        let n = spans.len() as u64;
        let body: bytes::Bytes = match self.export.protocol {
            Protocol::Json => json!({"resourceSpans": [{
                "resource": &self.resource,
                "scopeSpans": [{
                    "scope": {"name": "oam", "version": env!("CARGO_PKG_VERSION")},
                    "spans": spans,
                }],
            }]})
            .to_string()
            .into(),
            Protocol::Protobuf => pb::request(&self.resource, &spans).into(),
        };
        let url = &self.export.url;
        // One retry, after a second, when the receiver says to (429, 502-504) or is not there.
        for attempt in 0..2 {
            let mut req = http
                .post(url)
                .header("content-type", self.export.protocol.content_type())
                .body(body.clone());
            for (k, v) in &self.export.headers {
                req = req.header(k, v);
            }
            let retry = match req.send().await {
                Ok(r) if r.status().is_success() => {
                    self.counters.exported.fetch_add(n, Ordering::Relaxed);
                    return;
                }
                Ok(r) => {
                    let s = r.status().as_u16();
                    tracing::warn!(url = %url, status = s, "OpenTelemetry receiver refused spans");
                    matches!(s, 429 | 502..=504)
                }
                Err(e) => {
                    tracing::warn!(url = %url, "OpenTelemetry receiver: {e}");
                    true
                }
            };
            if !retry || attempt == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        self.counters.failed.fetch_add(n, Ordering::Relaxed);
    }
}

/// The request's messages as `gen_ai.input.messages` holds them.
fn input_messages(r: &Request) -> String {
    #[derive(serde::Serialize)]
    struct InputMessage<'a> {
        role: &'a str,
        parts: [TextPart<'a>; 1],
    }
    let msgs: Vec<InputMessage> = r
        .messages
        .iter()
        .map(|m| InputMessage {
            role: &m.role,
            parts: [TextPart::of(&m.content)],
        })
        .collect();
    serde_json::to_string(&msgs).unwrap_or_default()
}

/// A text part of a message on a span.
#[derive(serde::Serialize)]
struct TextPart<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    content: &'a str,
}

impl TextPart<'_> {
    fn of(content: &str) -> TextPart<'_> {
        TextPart {
            kind: "text",
            content,
        }
    }
}

/// An OTLP span (JSON encoding: 64-bit integers as strings).
#[derive(serde::Serialize, Debug)]
#[serde(rename_all = "camelCase")]
struct Span {
    trace_id: String,
    span_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_span_id: Option<String>,
    name: String,
    kind: u8,
    start_time_unix_nano: String,
    end_time_unix_nano: String,
    attributes: Vec<Attr>,
    status: SpanStatus,
}

#[derive(serde::Serialize, Debug)]
struct SpanStatus {
    code: u8,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
}

/// The resource every span of a node's comes from.
#[derive(serde::Serialize, Debug)]
struct Resource {
    attributes: Vec<Attr>,
}

/// An attribute: `{key, value: AnyValue}`.
#[derive(serde::Serialize, Debug)]
struct Attr {
    key: std::borrow::Cow<'static, str>,
    value: Any,
}

fn attr(key: &'static str, v: impl Into<Any>) -> Attr {
    Attr {
        key: key.into(),
        value: v.into(),
    }
}

/// OTLP's protobuf encoding of an export (`opentelemetry/proto/collector/trace/v1`): the few
/// messages and fields oam sends, written by hand rather than with a code generator.
mod pb {
    use super::{Any, Attr, Resource, Span};

    /// A protobuf message being written.
    #[derive(Default)]
    struct Out(Vec<u8>);

    impl Out {
        fn varint(&mut self, mut v: u64) {
            while v >= 0x80 {
                self.0.push((v as u8) | 0x80);
                v >>= 7;
            }
            self.0.push(v as u8);
        }
        fn tag(&mut self, field: u64, wire: u64) {
            self.varint((field << 3) | wire);
        }
        fn bytes(&mut self, field: u64, b: &[u8]) {
            self.tag(field, 2);
            self.varint(b.len() as u64);
            self.0.extend_from_slice(b);
        }
        fn string(&mut self, field: u64, s: &str) {
            self.bytes(field, s.as_bytes());
        }
        fn uint(&mut self, field: u64, v: u64) {
            self.tag(field, 0);
            self.varint(v);
        }
        fn fixed64(&mut self, field: u64, v: u64) {
            self.tag(field, 1);
            self.0.extend_from_slice(&v.to_le_bytes());
        }
        fn message(&mut self, field: u64, write: impl FnOnce(&mut Out)) {
            let mut inner = Out::default();
            write(&mut inner);
            self.bytes(field, &inner.0);
        }
    }

    /// `ExportTraceServiceRequest { resource_spans: [{ resource, scope_spans: [{ scope, spans }] }] }`.
    pub(super) fn request(resource: &Resource, spans: &[Span]) -> Vec<u8> {
        let mut out = Out::default();
        out.message(1, |rs| {
            rs.message(1, |r| {
                for a in &resource.attributes {
                    r.message(1, |kv| key_value(kv, a));
                }
            });
            rs.message(2, |ss| {
                ss.message(1, |scope| {
                    scope.string(1, "oam");
                    scope.string(2, env!("CARGO_PKG_VERSION"));
                });
                for s in spans {
                    ss.message(2, |m| span(m, s));
                }
            });
        });
        out.0
    }

    fn span(m: &mut Out, s: &Span) {
        m.bytes(1, &hex(&s.trace_id));
        m.bytes(2, &hex(&s.span_id));
        if let Some(p) = &s.parent_span_id {
            m.bytes(4, &hex(p));
        }
        m.string(5, &s.name);
        m.uint(6, u64::from(s.kind));
        m.fixed64(7, s.start_time_unix_nano.parse().unwrap_or(0));
        m.fixed64(8, s.end_time_unix_nano.parse().unwrap_or(0));
        for a in &s.attributes {
            m.message(9, |kv| key_value(kv, a));
        }
        m.message(15, |st| {
            if let Some(msg) = &s.status.message {
                st.string(2, msg);
            }
            if s.status.code != 0 {
                st.uint(3, u64::from(s.status.code));
            }
        });
    }

    fn key_value(kv: &mut Out, a: &Attr) {
        kv.string(1, &a.key);
        kv.message(2, |v| any(v, &a.value));
    }

    /// An `AnyValue`: its one field is written even when it holds the default, since which
    /// field is set is the value's type.
    fn any(v: &mut Out, a: &Any) {
        match a {
            Any::Str(s) => v.string(1, s),
            Any::Bool(b) => v.uint(2, u64::from(*b)),
            Any::Int(n) => v.uint(3, n.parse::<i64>().unwrap_or(0) as u64),
            Any::Double(x) => v.fixed64(4, x.to_bits()),
            Any::Array { values } => v.message(5, |arr| {
                for x in values {
                    arr.message(1, |item| any(item, x));
                }
            }),
        }
    }

    /// Lowercase hex (trace and span ids) as bytes; what is not hex is left out.
    fn hex(h: &str) -> Vec<u8> {
        (0..h.len() / 2)
            .filter_map(|i| u8::from_str_radix(h.get(2 * i..2 * i + 2)?, 16).ok())
            .collect()
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn varints_and_fields_are_written_as_protobuf_writes_them() {
            let mut o = super::Out::default();
            o.uint(1, 150);
            assert_eq!(o.0, [0x08, 0x96, 0x01]);
            let mut o = super::Out::default();
            o.string(2, "testing");
            assert_eq!(o.0, b"\x12\x07testing");
            assert_eq!(super::hex("0aff"), [0x0a, 0xff]);
        }
    }
}

/// An OTLP `AnyValue`.
#[derive(serde::Serialize, Debug)]
enum Any {
    #[serde(rename = "stringValue")]
    Str(String),
    #[serde(rename = "intValue")]
    Int(String),
    #[serde(rename = "doubleValue")]
    Double(f64),
    #[serde(rename = "boolValue")]
    Bool(bool),
    #[serde(rename = "arrayValue")]
    Array { values: Vec<Any> },
}

impl From<&str> for Any {
    fn from(s: &str) -> Any {
        Any::Str(s.to_string())
    }
}
impl From<&String> for Any {
    fn from(s: &String) -> Any {
        Any::Str(s.clone())
    }
}
impl From<u64> for Any {
    fn from(n: u64) -> Any {
        Any::Int(n.to_string())
    }
}
impl From<f64> for Any {
    fn from(x: f64) -> Any {
        Any::Double(x)
    }
}
impl From<bool> for Any {
    fn from(b: bool) -> Any {
        Any::Bool(b)
    }
}
impl From<Vec<String>> for Any {
    fn from(v: Vec<String>) -> Any {
        Any::Array {
            values: v.into_iter().map(Any::Str).collect(),
        }
    }
}

/// The spans of a decided request: its own, then one per attempt made on a target.
fn spans(
    p: &OpenSpans,
    d: &Decision,
    end_ns: u64,
    targets: &BTreeMap<String, (String, &'static str)>,
) -> Vec<Span> {
    let operation = if p.embeddings { "embeddings" } else { "chat" };
    let asked = p.model.as_deref().unwrap_or("auto");
    let target = d.provider.as_deref();
    let (response_model, provider) = target
        .and_then(|t| targets.get(t))
        .map_or((None, None), |(m, api)| (Some(m.as_str()), Some(*api)));
    // The attempts made (dispatched and called), in order, with the driver's times.
    let made: Vec<(&crate::core::decision::Attempt, &AttemptSpan)> = d
        .attempts
        .iter()
        .filter(|a| a.provider.is_some())
        .zip(&p.attempts)
        .filter(|(a, _)| a.status.is_some())
        .collect();
    let answering = made
        .last()
        .filter(|_| d.outcome == DecisionOutcome::Accepted);
    let codes = |c: &[crate::core::reason::ReasonCode]| -> Vec<String> {
        c.iter().map(|c| c.as_str().to_string()).collect()
    };

    let mut a = vec![
        attr("gen_ai.operation.name", operation),
        attr("gen_ai.request.model", asked),
        attr("oam.request_id", &d.request_id),
        attr("oam.decision", d.outcome.as_str()),
        attr("oam.phase", d.phase.as_str()),
        attr("oam.reason_codes", codes(&d.reason_codes)),
        attr("oam.agent", &d.agent),
        attr("oam.attempts", d.attempts.len() as u64),
        attr("oam.cost_usd", d.cost_usd),
        attr("oam.fallback", d.fallback),
        attr("oam.stream", p.stream),
        attr(
            "oam.fallback_chain",
            made.iter()
                .filter_map(|(a, _)| a.provider.as_ref().map(ToString::to_string))
                .collect::<Vec<_>>(),
        ),
    ];
    if let Some(n) = p.max_tokens {
        a.push(attr("gen_ai.request.max_tokens", u64::from(n)));
    }
    if let Some(r) = &d.route {
        a.push(attr("oam.route", r));
    }
    if let Some(t) = target {
        a.push(attr("oam.target", t));
    }
    if let Some(m) = response_model {
        a.push(attr("gen_ai.response.model", m));
    }
    if let Some(api) = provider {
        a.push(attr("gen_ai.provider.name", api));
    }
    if let Some(e) = &d.escalation {
        a.push(attr("oam.escalation_id", &e.id));
    }
    if let Some((_, s)) = answering {
        usage_attrs(&mut a, s);
        if let Some(out) = &s.output {
            a.push(attr(
                "gen_ai.output.messages",
                &output_messages(out, s.finish.as_deref()),
            ));
        }
    }
    if let Some(input) = &p.input {
        a.push(attr("gen_ai.input.messages", input));
    }
    if let (true, Some(at)) = (p.stream, p.first_chunk_ns) {
        let s = at.saturating_sub(p.start_ns) as f64 / 1e9;
        a.push(attr("gen_ai.response.time_to_first_chunk", s));
    }
    let status = if d.outcome == DecisionOutcome::Accepted {
        SpanStatus {
            code: STATUS_OK,
            message: None,
        }
    } else {
        // The error class a client sees: the answer's error code, its last reason.
        let class = d.reason_codes.last().map_or("error", |c| c.as_str());
        a.push(attr("error.type", class));
        let why = format!("{} in phase {}", d.outcome.as_str(), d.phase.as_str());
        SpanStatus {
            code: STATUS_ERROR,
            message: Some(why),
        }
    };
    let request = Span {
        trace_id: p.trace_id.clone(),
        span_id: p.span_id.clone(),
        parent_span_id: p.parent.clone(),
        name: format!("{operation} {asked}"),
        kind: SPAN_KIND_SERVER,
        start_time_unix_nano: p.start_ns.to_string(),
        end_time_unix_nano: end_ns.max(p.start_ns).to_string(),
        attributes: a,
        status,
    };
    let mut out = vec![request];
    for (attempt, s) in made {
        let Some(t) = attempt.provider.as_deref() else {
            continue;
        };
        let (model, api) = targets
            .get(t)
            .map_or((t, "openai"), |(m, api)| (m.as_str(), *api));
        let mut a = vec![
            attr("gen_ai.operation.name", operation),
            attr("gen_ai.provider.name", api),
            attr("gen_ai.request.model", model),
            attr("oam.target", t),
            attr("oam.attempt", u64::from(attempt.n)),
            attr("oam.reason_codes", codes(&attempt.codes)),
            attr("oam.fallback", attempt.fallback),
            attr("oam.same_target", attempt.same_target),
            attr("oam.cost_usd", attempt.cost_usd),
        ];
        let ok = attempt.status == Some(GenerationStatus::Ok);
        if ok {
            a.push(attr("gen_ai.response.model", model));
        }
        usage_attrs(&mut a, s);
        let status = match attempt.status {
            Some(GenerationStatus::Ok) if attempt.defects.is_empty() => SpanStatus {
                code: STATUS_OK,
                message: None,
            },
            Some(st) => {
                // Answered but held to fail (a contract, the quality gate): the reason it failed.
                let class = if st == GenerationStatus::Ok {
                    attempt
                        .codes
                        .last()
                        .map_or("rejected", |c| c.as_str())
                        .to_string()
                } else {
                    s.error_type
                        .clone()
                        .unwrap_or_else(|| st.as_str().to_string())
                };
                a.push(attr("error.type", &class));
                SpanStatus {
                    code: STATUS_ERROR,
                    message: Some(class),
                }
            }
            None => continue,
        };
        out.push(Span {
            trace_id: p.trace_id.clone(),
            span_id: span_id(),
            parent_span_id: Some(p.span_id.clone()),
            name: format!("{operation} {model}"),
            kind: SPAN_KIND_CLIENT,
            start_time_unix_nano: s.start_ns.to_string(),
            end_time_unix_nano: s.end_ns.max(s.start_ns).to_string(),
            attributes: a,
            status,
        });
    }
    out
}

fn usage_attrs(a: &mut Vec<Attr>, s: &AttemptSpan) {
    if let Some(u) = s.usage {
        a.push(attr("gen_ai.usage.input_tokens", u.prompt_tokens));
        a.push(attr("gen_ai.usage.output_tokens", u.completion_tokens));
    }
    if let Some(f) = &s.finish {
        a.push(attr("gen_ai.response.finish_reasons", vec![f.clone()]));
    }
}

/// The answer as `gen_ai.output.messages` holds it.
fn output_messages(text: &str, finish: Option<&str>) -> String {
    #[derive(serde::Serialize)]
    struct Answered<'a> {
        role: &'static str,
        parts: [TextPart<'a>; 1],
        finish_reason: &'a str,
    }
    let answered = [Answered {
        role: "assistant",
        parts: [TextPart::of(text)],
        finish_reason: finish.unwrap_or("stop"),
    }];
    serde_json::to_string(&answered).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_variables_fill_what_the_file_leaves() {
        let vars = |k: &str| {
            Some(match k {
                "OTEL_EXPORTER_OTLP_ENDPOINT" => "http://c:4318".into(),
                "OTEL_EXPORTER_OTLP_PROTOCOL" => "http/protobuf".into(),
                "OTEL_EXPORTER_OTLP_HEADERS" => "x-key=a%20b, x-file=from-env".into(),
                "OTEL_RESOURCE_ATTRIBUTES" => {
                    "deployment.environment=prod,service.name=from-attrs,team=ai".into()
                }
                _ => return None,
            })
        };
        let e = Settings::default().export(vars).unwrap().expect("on");
        assert_eq!(e.url, "http://c:4318/v1/traces");
        assert_eq!(e.protocol, Protocol::Protobuf);
        assert_eq!(e.headers["x-key"], "a b");
        assert_eq!(e.service_name, "from-attrs");
        assert_eq!(
            e.resource.keys().collect::<Vec<_>>(),
            ["deployment.environment", "team"]
        );
        // What the file says wins; $OTEL_SERVICE_NAME beats the resource attribute.
        let file = Settings {
            protocol: Some(Protocol::Json),
            headers: [("x-file".to_string(), "from-file".to_string())].into(),
            resource_attributes: [("team".to_string(), "core".to_string())].into(),
            ..Settings::default()
        };
        let named = |k: &str| match k {
            "OTEL_SERVICE_NAME" => Some("checkout".into()),
            _ => vars(k),
        };
        let e = file.export(named).unwrap().expect("on");
        assert_eq!(e.protocol, Protocol::Json);
        assert_eq!(e.headers["x-file"], "from-file");
        assert_eq!(e.resource["team"], "core");
        assert_eq!(e.service_name, "checkout");
        // Without an endpoint, export is off whatever else is set.
        let off = |k: &str| (k == "OTEL_SERVICE_NAME").then(|| "x".to_string());
        assert_eq!(Settings::default().export(off), Ok(None));
        // What oam cannot do is said, naming the variable.
        let grpc = |k: &str| match k {
            "OTEL_EXPORTER_OTLP_PROTOCOL" => Some("grpc".into()),
            _ => vars(k),
        };
        let err = Settings::default().export(grpc).unwrap_err().to_string();
        assert!(
            err.contains("$OTEL_EXPORTER_OTLP_PROTOCOL") && err.contains("gRPC"),
            "{err}"
        );
        let bad = |k: &str| match k {
            "OTEL_RESOURCE_ATTRIBUTES" => Some("novalue".into()),
            _ => vars(k),
        };
        let err = Settings::default().export(bad).unwrap_err().to_string();
        assert!(err.contains("$OTEL_RESOURCE_ATTRIBUTES"), "{err}");
    }

    #[test]
    fn a_failed_call_is_classed_by_its_status_code_or_what_kept_it_from_one() {
        let failed = |status, error: &str| Generation {
            error: Some(error.to_string()),
            ..Generation::failed(status, 0)
        };
        let class = |g: Generation| error_type(&g);
        assert_eq!(class(Generation::ok("", 0)), None);
        assert_eq!(
            class(failed(
                GenerationStatus::Error,
                "HTTP 503 Service Unavailable busy"
            ))
            .as_deref(),
            Some("503")
        );
        assert_eq!(
            class(failed(
                GenerationStatus::Unauthorized,
                "HTTP 401 Unauthorized no"
            ))
            .as_deref(),
            Some("401")
        );
        assert_eq!(
            class(failed(
                GenerationStatus::Error,
                "error sending request: connection refused"
            ))
            .as_deref(),
            Some("connection_error")
        );
        assert_eq!(
            class(failed(GenerationStatus::Error, "the body was not JSON")).as_deref(),
            Some("upstream_error")
        );
        assert_eq!(
            class(failed(GenerationStatus::Timeout, "")).as_deref(),
            Some("timeout")
        );
    }

    #[test]
    fn a_traceparent_gives_the_callers_trace_and_a_bad_one_is_ignored() {
        let t = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            parse_traceparent(t),
            Some((
                "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                "00f067aa0ba902b7".into()
            ))
        );
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473x-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_endpoint_comes_from_the_file_then_the_environment_and_must_be_http() {
        let none = |_: &str| None;
        let s = Settings::default();
        assert_eq!(s.traces_url(none), Ok(None));
        let base = |k: &str| (k == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "http://c:4318/".into());
        assert_eq!(
            s.traces_url(base),
            Ok(Some("http://c:4318/v1/traces".into()))
        );
        let exact =
            |k: &str| (k == "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").then(|| "http://t/x".into());
        assert_eq!(s.traces_url(exact), Ok(Some("http://t/x".into())));
        let file = Settings {
            otlp_endpoint: Some("http://127.0.0.1:4318/v1/traces".into()),
            ..Settings::default()
        };
        assert_eq!(
            file.traces_url(base),
            Ok(Some("http://127.0.0.1:4318/v1/traces".into()))
        );
        let bad = Settings {
            otlp_endpoint: Some("127.0.0.1:4318".into()),
            ..Settings::default()
        };
        let e = bad.traces_url(none).unwrap_err();
        assert_eq!(e.from, "telemetry.otlp_endpoint");
        let e = e.to_string();
        assert!(
            e.contains("telemetry.otlp_endpoint") && e.contains("http://host:4318"),
            "{e}"
        );
    }
}
