//! The tools a chat request declares, read once per distinct list. An agent sends the same
//! tools request after request (128 of them are ~45 KB of JSON): the list is kept as the bytes
//! it came in (sent upstream as they are), and a list met before, byte for byte, gives the set
//! read from it then (`core::request::Tools`, shared, its schemas already checked) instead of
//! being parsed, checked and copied again. The cache is bounded and only saves work: a list
//! read afresh gives the same set.

use super::api::openai::{BadRequest, MAX_TOOLS, bad};
use crate::core::request::Tools;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

/// Distinct lists kept at most, and their bytes at most (a list is kept as its text, and its
/// set holds the schemas as text too: about twice the bytes in all).
const LISTS_MAX: usize = 1_024;
const BYTES_MAX: usize = 16 << 20;

struct CachedTools {
    raw: Box<str>,
    tools: Arc<Tools>,
    used: u64,
}

#[derive(Default)]
struct Cache {
    by_hash: HashMap<u64, Vec<CachedTools>>,
    bytes: usize,
    clock: u64,
}

static CACHE: Mutex<Option<Cache>> = Mutex::new(None);

/// The tools `raw` (the request's `tools` as sent) declares: name -> parameter schema (`null`
/// when a tool gives none).
pub(crate) fn declared(raw: Option<&RawValue>) -> Result<Arc<Tools>, BadRequest> {
    let Some(raw) = raw.filter(|r| r.get() != "null") else {
        return Ok(Arc::default());
    };
    let text = raw.get();
    let hash = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
    {
        let mut cache = CACHE.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = cache.get_or_insert_with(Cache::default);
        cache.clock += 1;
        let now = cache.clock;
        if let Some(k) = cache
            .by_hash
            .get_mut(&hash)
            .and_then(|same| same.iter_mut().find(|k| *k.raw == *text))
        {
            k.used = now;
            return Ok(k.tools.clone());
        }
    }
    let tools = Arc::new(read(raw)?);
    if text.len() <= BYTES_MAX / 64 {
        let mut cache = CACHE.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = cache.get_or_insert_with(Cache::default);
        let lists: usize = cache.by_hash.values().map(Vec::len).sum();
        if lists >= LISTS_MAX || cache.bytes + text.len() > BYTES_MAX {
            // The least recently used half goes: one scan for many inserts.
            let mut uses: Vec<u64> = cache.by_hash.values().flatten().map(|k| k.used).collect();
            uses.sort_unstable();
            let cut = uses.get(uses.len() / 2).copied().unwrap_or(u64::MAX);
            cache.by_hash.retain(|_, same| {
                same.retain(|k| k.used > cut);
                !same.is_empty()
            });
            cache.bytes = cache.by_hash.values().flatten().map(|k| k.raw.len()).sum();
        }
        cache.bytes += text.len();
        let used = cache.clock;
        cache.by_hash.entry(hash).or_default().push(CachedTools {
            raw: text.into(),
            tools: tools.clone(),
            used,
        });
    }
    Ok(tools)
}

#[derive(Deserialize)]
struct ToolIn<'a> {
    #[serde(borrow, default)]
    function: Option<FunctionIn<'a>>,
}

#[derive(Deserialize)]
struct FunctionIn<'a> {
    #[serde(borrow, default)]
    name: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    parameters: Option<&'a RawValue>,
}

/// `raw` read afresh: each tool's name and schema.
fn read(raw: &RawValue) -> Result<Tools, BadRequest> {
    let list: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| {
        bad(
            "tools",
            "tools must be an array of {\"type\": \"function\", \"function\": {...}}",
        )
    })?;
    // Every tool's schema is compiled to check the answer's calls against it: without a bound,
    // one request of 6,000 tools cost 0.1 s of CPU and 43 MB.
    if list.len() > MAX_TOOLS {
        return Err(bad(
            "tools",
            format!(
                "at most {MAX_TOOLS} tools per request (OpenAI's own limit); this one declares {}",
                list.len()
            ),
        ));
    }
    let mut out = BTreeMap::new();
    for (i, t) in list.iter().enumerate() {
        let unnamed = || {
            bad(
                format!("tools[{i}].function.name"),
                format!("tools[{i}].function.name must be a non-empty string"),
            )
        };
        let f = serde_json::from_str::<ToolIn>(t.get())
            .ok()
            .and_then(|t| t.function)
            .ok_or_else(unnamed)?;
        let name = f.name.filter(|n| !n.is_empty()).ok_or_else(unnamed)?;
        let schema = f.parameters.unwrap_or(RawValue::NULL).to_owned();
        out.insert(name.into_owned(), schema);
    }
    // Whether each schema compiles is the core's check (`Tools::checked`, once per set).
    Ok(Tools::new(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn raw(v: Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(&v).unwrap()
    }

    #[test]
    fn the_same_list_gives_the_same_set_and_another_its_own() {
        let list = |n: &str| {
            raw(serde_json::json!([
                {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "plain"}}
            ]))
        };
        let a = declared(Some(&list("look"))).unwrap();
        assert_eq!(a.len(), 2);
        assert_eq!(a["look"].get(), r#"{"type":"object"}"#);
        assert_eq!(a["plain"].get(), "null");
        let again = declared(Some(&list("look"))).unwrap();
        assert!(Arc::ptr_eq(&a, &again), "read once, shared after");
        let other = declared(Some(&list("find"))).unwrap();
        assert!(!Arc::ptr_eq(&a, &other));
        assert!(other.contains_key("find"));
        assert!(declared(None).unwrap().is_empty());
        assert!(declared(Some(&raw(Value::Null))).unwrap().is_empty());
    }

    #[test]
    fn a_bad_list_is_refused_every_time_naming_where() {
        let at = |v: Value| declared(Some(&raw(v))).unwrap_err().param.unwrap();
        for _ in 0..2 {
            assert_eq!(at(serde_json::json!({"a": 1})), "tools");
            assert_eq!(
                at(serde_json::json!([{"type": "function"}])),
                "tools[0].function.name"
            );
            assert_eq!(at(serde_json::json!([1])), "tools[0].function.name");
            let bad_schema = serde_json::json!([{"type": "function",
                "function": {"name": "x", "parameters": {"type": 7}}}]);
            let e = declared(Some(&raw(bad_schema)))
                .unwrap()
                .checked()
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("tools: x: its parameters are no JSON Schema"),
                "{e}"
            );
        }
    }
}
