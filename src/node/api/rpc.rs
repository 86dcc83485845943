//! JSON-RPC 2.0 as the tool and agent doors speak it (`mcp`, `a2a`): a message's envelope read
//! once, its id kept as it came (never read, written back as is) and its params left for the
//! door to read into its own types; answers written from types, a result passed on as the bytes
//! it came in.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

pub(crate) const PARSE_ERROR: i64 = -32700;
pub(crate) const INVALID_REQUEST: i64 = -32600;
pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
pub(crate) const INVALID_PARAMS: i64 = -32602;
pub(crate) const INTERNAL_ERROR: i64 = -32603;

/// A request's id as it came: a string or a number (`null` where there was none).
pub(crate) type Id = Box<RawValue>;

/// The id of an answer to a message whose id could not be read.
pub(crate) fn no_id() -> Id {
    RawValue::NULL.to_owned()
}

/// Whether `id` is one a request may carry (a string or a number; not null, an object, ...).
pub(crate) fn is_request_id(id: &RawValue) -> bool {
    matches!(id.get().as_bytes().first(), Some(b'"' | b'-' | b'0'..=b'9'))
}

/// One message's envelope.
#[derive(Deserialize)]
struct Frame {
    #[serde(default)]
    id: Option<Box<RawValue>>,
    #[serde(default)]
    method: Option<Box<RawValue>>,
    #[serde(default)]
    params: Option<Box<RawValue>>,
}

/// A message received: its id (any JSON), its method if it names one as a string, its params
/// unread.
pub(crate) struct Received {
    pub id: Option<Id>,
    pub method: Option<String>,
    pub params: Option<Box<RawValue>>,
}

/// Read one JSON-RPC message; the error code and why when the body is not JSON (`PARSE_ERROR`)
/// or not one object (`INVALID_REQUEST`: batches are not served).
pub(crate) fn read(body: &[u8]) -> Result<Received, (i64, String)> {
    let not_json = |e: serde_json::Error| (PARSE_ERROR, format!("the body is not JSON: {e}"));
    if body.trim_ascii_start().first() != Some(&b'{') {
        // (Read as a struct, an array would fill its members in order.)
        serde_json::from_slice::<serde::de::IgnoredAny>(body).map_err(not_json)?;
        let why = "the body must be one JSON-RPC message (an object; batches are not served)";
        return Err((INVALID_REQUEST, why.into()));
    }
    let e: Frame = serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            (INVALID_REQUEST, format!("not a JSON-RPC message: {e}"))
        }
        _ => not_json(e),
    })?;
    Ok(Received {
        id: e.id,
        method: e
            .method
            .and_then(|m| serde_json::from_str::<String>(m.get()).ok()),
        params: e.params,
    })
}

/// Read a message's params into `T`; an object is required (none reads as `{}`).
pub(crate) fn params<'a, T: Deserialize<'a> + Default>(
    params: Option<&'a RawValue>,
) -> Result<T, String> {
    let Some(p) = params else {
        return Ok(T::default());
    };
    if !p.get().starts_with('{') {
        return Err("params must be an object".into());
    }
    serde_json::from_str(p.get()).map_err(|e| format!("params: {e}"))
}

/// The error of an answer.
#[derive(Serialize)]
pub(crate) struct Failure<'a, D: Serialize> {
    pub code: i64,
    pub message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<D>,
}

#[derive(Serialize)]
struct Outgoing<'a, R: Serialize, D: Serialize> {
    jsonrpc: &'static str,
    id: &'a RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<R>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<Failure<'a, D>>,
}

/// The answer to request `id` that carries `result`.
pub(crate) fn success(id: &RawValue, result: impl Serialize) -> Vec<u8> {
    let a = Outgoing::<_, ()> {
        jsonrpc: "2.0",
        id,
        result: Some(result),
        error: None,
    };
    serde_json::to_vec(&a).unwrap_or_default()
}

/// The error answer to request `id`.
pub(crate) fn failure<D: Serialize>(id: &RawValue, error: Failure<'_, D>) -> Vec<u8> {
    let a = Outgoing::<(), D> {
        jsonrpc: "2.0",
        id,
        result: None,
        error: Some(error),
    };
    serde_json::to_vec(&a).unwrap_or_default()
}

/// The error answer to request `id` with `code` and `message` and no data.
pub(crate) fn error(id: &RawValue, code: i64, message: &str) -> Vec<u8> {
    failure::<()>(
        id,
        Failure {
            code,
            message,
            data: None,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn an_envelope_is_read_once_and_its_id_written_back_as_it_came() {
        let m = read(br#"{"jsonrpc":"2.0","id":1.50,"method":"ping","params":{"a":[1]}}"#)
            .ok()
            .unwrap();
        assert_eq!(m.method.as_deref(), Some("ping"));
        let id = m.id.unwrap();
        assert!(is_request_id(&id));
        let answer: Value = serde_json::from_slice(&success(&id, json!({}))).unwrap();
        assert_eq!(answer, json!({"jsonrpc": "2.0", "id": 1.5, "result": {}}));
        assert_eq!(
            String::from_utf8(success(&id, ())).unwrap(),
            r#"{"jsonrpc":"2.0","id":1.50,"result":null}"#,
            "the id's own spelling"
        );
        let m = read(br#"{"method": 7, "id": null}"#).ok().unwrap();
        assert!(m.method.is_none() && m.id.is_none());
        let m = read(br#"{"method": "m", "id": {"a": 1}}"#).ok().unwrap();
        assert!(!is_request_id(&m.id.unwrap()));
        assert_eq!(read(b"[]").err().unwrap().0, INVALID_REQUEST);
        assert_eq!(read(b" [1]").err().unwrap().0, INVALID_REQUEST);
        assert_eq!(read(b"[1").err().unwrap().0, PARSE_ERROR);
        assert_eq!(read(b"{\"id\":").err().unwrap().0, PARSE_ERROR);
        let e: Value = serde_json::from_slice(&error(&no_id(), PARSE_ERROR, "no")).unwrap();
        assert_eq!(e["error"], json!({"code": PARSE_ERROR, "message": "no"}));
        assert_eq!(e["id"], Value::Null);
    }

    #[test]
    fn params_must_be_an_object_of_the_door_s_type() {
        #[derive(Deserialize, Default, Debug)]
        struct P {
            name: Option<String>,
        }
        let raw = |s: &str| serde_json::from_str::<Box<RawValue>>(s).unwrap();
        let p: P = params(Some(&raw(r#"{"name":"x","more":1}"#))).unwrap();
        assert_eq!(p.name.as_deref(), Some("x"));
        assert!(params::<P>(None).unwrap().name.is_none());
        assert_eq!(
            params::<P>(Some(&raw("[1]"))).unwrap_err(),
            "params must be an object"
        );
        assert!(
            params::<P>(Some(&raw(r#"{"name":3}"#)))
                .unwrap_err()
                .starts_with("params: ")
        );
    }
}
