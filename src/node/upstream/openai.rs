//! An OpenAI-compatible server (`api = "openai"`: `oam sim`, Ollama, vLLM, OpenAI): chat
//! completions sent and read as they are, embeddings, and `GET /models` as a free check.

use super::super::config::ProviderConfig;
use super::super::exchange::{Attempt, Passthrough, Reply};
use super::http::{Endpoint, error_chain, judge_failure, read_capped};
use super::{Opened, Upstream, UpstreamCall, chat, failed};
use crate::core::request::{Generation, GenerationStatus};
use futures_util::future::BoxFuture;
use reqwest::header::{AUTHORIZATION, HeaderMap};
use serde_json::Value;
use std::time::{Duration, Instant};

pub(super) struct OpenaiCompatible {
    at: Endpoint,
    /// `{base_url}/embeddings`.
    embeddings_url: reqwest::Url,
}

impl OpenaiCompatible {
    pub(super) fn new(
        cfg: &ProviderConfig,
        http: crate::http::lanes::PerLane<reqwest::Client>,
        post: crate::http::Poster,
    ) -> Result<OpenaiCompatible, super::SetupError> {
        let headers = super::http::key(cfg)
            .and_then(|k| super::http::secret(AUTHORIZATION, &format!("Bearer {k}")))
            .into_iter()
            .collect();
        let at = Endpoint::new(cfg, "chat/completions", headers, http, post)?;
        let embeddings_url = super::http::url(cfg, "embeddings")?;
        Ok(OpenaiCompatible { at, embeddings_url })
    }
}

/// A whole answer: a failure as `judge_failure` reads it, else the chat completion as it came.
fn judge(
    status: reqwest::StatusCode,
    headers: &HeaderMap,
    bytes: &bytes::Bytes,
    latency_ms: u64,
) -> Attempt {
    judge_failure(status, headers, bytes, latency_ms)
        .unwrap_or_else(|| chat::completion(bytes, latency_ms))
}

impl Upstream for OpenaiCompatible {
    fn generate<'a>(&'a self, ask: UpstreamCall<'a>, timeout: Duration) -> BoxFuture<'a, Attempt> {
        Box::pin(async move {
            let started = Instant::now();
            let json = match serde_json::to_vec(&chat::Body::whole(&ask)) {
                Ok(json) => json,
                Err(e) => {
                    let why = format!("cannot write the upstream request: {e}");
                    return failed(GenerationStatus::Error, why, 0);
                }
            };
            match self.at.call(json, timeout, started).await {
                Ok((status, headers, bytes)) => judge(
                    status,
                    &headers,
                    &bytes,
                    started.elapsed().as_millis() as u64,
                ),
                Err(a) => a,
            }
        })
    }

    fn open_stream<'a>(
        &'a self,
        model: &'a str,
        pass: &'a Passthrough,
        prefill: Option<&'a str>,
        max_tokens: u32,
        first_event: Duration,
    ) -> BoxFuture<'a, Opened> {
        Box::pin(async move {
            let mut body = chat::Body::streamed(model, pass, prefill, max_tokens);
            body.stream_options = Some(chat::StreamOptions {
                include_usage: true,
            });
            let json = serde_json::to_vec(&body).unwrap_or_default();
            self.at
                .open(json, first_event, None, pass.include_usage, judge)
                .await
        })
    }

    /// The client's request as it came (`pass.extra`: `input`, `dimensions`,
    /// `encoding_format`, `user`) with the target's model. An answer of 200 whose list does
    /// not hold one embedding per input is a failure of the target, not an answer.
    fn embed<'a>(
        &'a self,
        model: &'a str,
        pass: &'a Passthrough,
        timeout: Duration,
    ) -> BoxFuture<'a, Attempt> {
        Box::pin(async move {
            let started = Instant::now();
            let mut body = pass.extra.clone();
            body.insert("model".into(), Value::String(model.into()));
            let call = async {
                let resp = self
                    .at
                    .request(reqwest::Method::POST, &self.embeddings_url)
                    .json(&body)
                    .send()
                    .await
                    .map_err(|e| error_chain(&e))?;
                let (status, headers) = (resp.status(), resp.headers().clone());
                let bytes = read_capped(resp, self.at.post.max_answer_bytes())
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>((status, headers, bytes))
            };
            let result = tokio::time::timeout(timeout, call).await;
            let latency_ms = started.elapsed().as_millis() as u64;
            let (status, headers, bytes) = match result {
                Err(_) => {
                    let why = format!("no answer within {} ms", timeout.as_millis());
                    return failed(GenerationStatus::Timeout, why, latency_ms);
                }
                Ok(Err(e)) => return failed(GenerationStatus::Error, e, latency_ms),
                Ok(Ok(parts)) => parts,
            };
            let attempt = judge(status, &headers, &bytes, latency_ms);
            if attempt.generation.status != GenerationStatus::Ok {
                return attempt;
            }
            let inputs = match &pass.extra["input"] {
                Value::Array(items) if items.iter().all(Value::is_number) => 1,
                Value::Array(items) => items.len(),
                _ => 1,
            };
            let answered = attempt
                .body
                .as_ref()
                .and_then(Reply::value)
                .and_then(|v| v["data"].as_array().map(Vec::len));
            if answered != Some(inputs) {
                let why = format!(
                    "the answer holds {} embeddings for {inputs} inputs",
                    answered.map_or("no list of".to_string(), |n| n.to_string())
                );
                return failed(GenerationStatus::Error, why, latency_ms);
            }
            attempt
        })
    }

    fn free_check(&self, timeout: Duration) -> Option<BoxFuture<'_, Generation>> {
        Some(Box::pin(self.at.list_models(timeout)))
    }
}
