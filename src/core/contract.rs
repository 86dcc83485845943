//! Semantic contract validation: a provider's HTTP 200 is only a success if its content is a JSON
//! object with the required fields, a confidence in [0, 1] above the contract's floor, a bounded
//! length, and was not cut off.
//!
//! The default contract requires `answer` and `confidence`. A request may bring its own, either as
//! oam's `contract` object or as OpenAI's `response_format` (`json_object`, or a `json_schema`,
//! validated in full by the `jsonschema` crate, its `required` and `properties.*.type` also
//! reported as the specific codes below). A request that declares tools has every tool call's
//! arguments checked: JSON, a declared tool, and fitting that tool's parameter schema.
//!
//! Schemas are compiled once per content (`compiled`): an agent declares the same tools request
//! after request, and compiling one costs ~20 µs. The cache is bounded and only saves time: the
//! same schema gives the same verdicts from it or compiled afresh.

use super::reason::ReasonCode;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

pub(crate) const DEFAULT_MIN_CONFIDENCE: f64 = 0.3;
pub(crate) const DEFAULT_MAX_CHARS: usize = 16_000;

/// A JSON type a field must have.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
pub enum JsonType {
    String,
    Number,
    Integer,
    Boolean,
    Object,
    Array,
    Null,
}

impl JsonType {
    fn parse(s: &str) -> Option<JsonType> {
        serde_json::from_value(Value::String(s.to_string())).ok()
    }
}

/// A contract as a request states it; every field falls back to the default contract.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ContractSpec {
    pub required: Option<Vec<String>>,
    pub properties: BTreeMap<String, JsonType>,
    /// The field holding the model's confidence; `""` turns the confidence checks off.
    pub confidence_field: Option<String>,
    pub min_confidence: Option<f64>,
    pub max_chars: Option<usize>,
}

/// The contract an answer is checked against.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Contract {
    pub required: Vec<String>,
    pub properties: BTreeMap<String, JsonType>,
    pub confidence_field: Option<String>,
    pub min_confidence: f64,
    pub max_chars: usize,
    /// A `json_schema` response format's schema, which the whole answer must fit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Value>,
}

impl Default for Contract {
    fn default() -> Self {
        Contract {
            required: vec!["answer".into(), "confidence".into()],
            properties: BTreeMap::new(),
            confidence_field: Some("confidence".into()),
            min_confidence: DEFAULT_MIN_CONFIDENCE,
            max_chars: DEFAULT_MAX_CHARS,
            schema: None,
        }
    }
}

/// One thing wrong with an answer.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Defect {
    pub code: ReasonCode,
    pub detail: String,
}

fn defect(code: ReasonCode, detail: impl Into<String>) -> Defect {
    Defect {
        code,
        detail: detail.into(),
    }
}

/// Why a request's contract cannot be used: the part of the request at fault, and what is
/// wrong with it (the message names the path within it).
#[derive(Clone, Debug, PartialEq)]
pub enum ContractError {
    /// Its `response_format` (`response_format.json_schema.schema.type must be "object"`).
    ResponseFormat(String),
    /// oam's own `contract` form (`contract.min_confidence must be in [0, 1]`).
    Contract(String),
}

impl ContractError {
    /// The request field at fault.
    pub fn field(&self) -> &'static str {
        match self {
            ContractError::ResponseFormat(_) => "response_format",
            ContractError::Contract(_) => "contract",
        }
    }
}

impl std::fmt::Display for ContractError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ContractError::ResponseFormat(m) | ContractError::Contract(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for ContractError {}

impl Contract {
    /// The contract for a request: `contract` wins over `response_format`, which wins over the
    /// default. Errors say which of the two is unusable, and why.
    pub fn for_request(
        spec: Option<&ContractSpec>,
        response_format: Option<&Value>,
    ) -> Result<Contract, ContractError> {
        let base = match response_format {
            Some(rf) => Contract::from_response_format(rf)?,
            None => Contract::default(),
        };
        let Some(spec) = spec else { return Ok(base) };
        let confidence_field = match spec.confidence_field.as_deref() {
            Some("") => None,
            Some(f) => Some(f.to_string()),
            None => base.confidence_field,
        };
        let min_confidence = spec.min_confidence.unwrap_or(base.min_confidence);
        if !(0.0..=1.0).contains(&min_confidence) {
            return Err(ContractError::Contract(format!(
                "contract.min_confidence must be in [0, 1], got {min_confidence}"
            )));
        }
        Ok(Contract {
            required: spec.required.clone().unwrap_or(base.required),
            properties: if spec.properties.is_empty() {
                base.properties
            } else {
                spec.properties.clone()
            },
            confidence_field,
            min_confidence,
            max_chars: spec.max_chars.unwrap_or(base.max_chars),
            schema: base.schema,
        })
    }

    fn from_response_format(rf: &Value) -> Result<Contract, ContractError> {
        let bad = |why: &str| ContractError::ResponseFormat(why.to_string());
        let kind = rf.get("type").and_then(Value::as_str);
        match kind {
            Some("text") => Ok(Contract::default()),
            Some("json_object") => Ok(Contract {
                required: vec![],
                confidence_field: None,
                ..Contract::default()
            }),
            Some("json_schema") => {
                let schema = rf
                    .pointer("/json_schema/schema")
                    .ok_or_else(|| bad("response_format.json_schema.schema is missing"))?;
                if schema.get("type").and_then(Value::as_str) != Some("object") {
                    return Err(bad(
                        "response_format.json_schema.schema.type must be \"object\"",
                    ));
                }
                let required = match schema.get("required") {
                    None => vec![],
                    Some(Value::Array(items)) => items
                        .iter()
                        .map(|v| v.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| {
                            bad("response_format.json_schema.schema.required must list strings")
                        })?,
                    Some(_) => {
                        return Err(bad(
                            "response_format.json_schema.schema.required must be an array",
                        ));
                    }
                };
                let mut properties = BTreeMap::new();
                if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                    for (name, prop) in props {
                        if let Some(t) = prop.get("type").and_then(Value::as_str) {
                            let t = JsonType::parse(t).ok_or_else(|| {
                                bad(&format!(
                                    "response_format.json_schema.schema.properties.{name}.type: \
                                     unsupported type {t:?}"
                                ))
                            })?;
                            properties.insert(name.clone(), t);
                        }
                    }
                }
                compiled(schema)
                    .map_err(|e| bad(&format!("response_format.json_schema.schema: {e}")))?;
                let has_confidence = properties.contains_key("confidence")
                    || required.iter().any(|r| r == "confidence");
                Ok(Contract {
                    required,
                    properties,
                    confidence_field: has_confidence.then(|| "confidence".to_string()),
                    schema: Some(schema.clone()),
                    ..Contract::default()
                })
            }
            _ => Err(bad(&format!(
                "response_format.type must be \"text\", \"json_object\" or \"json_schema\", got {}",
                rf.get("type")
                    .map_or("nothing".to_string(), Value::to_string)
            ))),
        }
    }

    /// Check an answer. `Ok` carries the confidence (if the contract has one); `Err` every defect.
    pub fn check(
        &self,
        content: &str,
        finish_reason: Option<&str>,
    ) -> Result<Option<f64>, Vec<Defect>> {
        if finish_reason == Some("length") {
            return Err(vec![defect(
                ReasonCode::ContractTruncated,
                "finish_reason is \"length\": the answer was cut off",
            )]);
        }
        let body = strip_code_fence(content.trim());
        if body.is_empty() {
            return Err(vec![defect(ReasonCode::ContractEmpty, "content is empty")]);
        }
        let chars = content.chars().count();
        if chars > self.max_chars {
            return Err(vec![defect(
                ReasonCode::ContractTooLong,
                format!(
                    "content has {chars} characters, the limit is {}",
                    self.max_chars
                ),
            )]);
        }
        let top: Top<'_> = match serde_json::from_str(body) {
            Ok(v) => v,
            Err(e) if e.is_eof() => {
                return Err(vec![defect(
                    ReasonCode::ContractTruncated,
                    format!("JSON ends early: {e}"),
                )]);
            }
            Err(e) => return Err(vec![defect(ReasonCode::ContractNotJson, e.to_string())]),
        };
        let fields = match top {
            Top::Object(fields) => fields,
            Top::Other(shape) => {
                return Err(vec![defect(
                    ReasonCode::ContractNotObject,
                    format!("content is a JSON {}", shape.name()),
                )]);
            }
        };
        // Last occurrence wins, as in serde_json's own maps.
        let get = |name: &str| fields.iter().rev().find(|(k, _)| k.0 == name).map(|f| f.1);
        let mut defects = Vec::new();
        for field in &self.required {
            if get(field).is_none() {
                defects.push(defect(
                    ReasonCode::ContractMissingField,
                    format!("missing field `{field}`"),
                ));
            }
        }
        for (field, t) in &self.properties {
            if let Some(v) = get(field)
                && !v.is(*t)
                && Some(field) != self.confidence_field.as_ref()
            {
                defects.push(defect(
                    ReasonCode::ContractFieldType,
                    format!("`{field}` is a {}, the contract says {t:?}", v.name()),
                ));
            }
        }
        let mut confidence = None;
        if let Some(field) = &self.confidence_field
            && let Some(v) = get(field)
        {
            match v.number() {
                None => defects.push(defect(
                    ReasonCode::ContractConfidenceType,
                    format!("`{field}` is a {}, not a number", v.name()),
                )),
                Some(c) if !(0.0..=1.0).contains(&c) => defects.push(defect(
                    ReasonCode::ContractConfidenceRange,
                    format!("`{field}` is {c}, outside [0, 1]"),
                )),
                Some(c) if c < self.min_confidence => defects.push(defect(
                    ReasonCode::ContractConfidenceTooLow,
                    format!(
                        "`{field}` is {c}, below the contract floor {}",
                        self.min_confidence
                    ),
                )),
                Some(c) => confidence = Some(c),
            }
        }
        if defects.is_empty()
            && let Some(schema) = &self.schema
        {
            defects.extend(schema_defects(
                schema,
                body,
                ReasonCode::ContractSchemaViolation,
            ));
        }
        if defects.is_empty() {
            Ok(confidence)
        } else {
            Err(defects)
        }
    }
}

/// Compiled schemas (or why one does not compile), found by a keyed hash of the schema and
/// confirmed by comparing the whole schema: a hash only says where to look, so no crafted
/// schema can stand for another.
#[derive(Default)]
struct Schemas {
    by_hash: std::collections::HashMap<u64, Vec<Compiled>>,
    /// The schemas' sizes together (`fingerprint`).
    bytes: usize,
    /// Lookups so far: each entry's last use, for eviction.
    clock: u64,
}

struct Compiled {
    schema: Value,
    size: usize,
    validator: Result<std::sync::Arc<jsonschema::Validator>, InvalidSchema>,
    used: u64,
}

/// Schemas kept compiled at most, and their size in all.
const SCHEMAS_MAX: usize = 2_048;
const SCHEMA_BYTES_MAX: usize = 8 << 20;

static SCHEMAS: std::sync::LazyLock<std::sync::Mutex<Schemas>> =
    std::sync::LazyLock::new(Default::default);

/// The hash key, drawn by the standard library once per process: nobody outside can work out
/// two schemas that share a hash.
static SCHEMA_KEY: std::sync::LazyLock<std::hash::RandomState> =
    std::sync::LazyLock::new(std::hash::RandomState::new);

/// `v`'s keyed hash and its size (about its JSON text's length), in one walk and no allocation.
/// Equal values hash alike: an object's members are combined in any order, as they compare.
fn fingerprint(v: &Value) -> (u64, usize) {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut h = SCHEMA_KEY.build_hasher();
    let size = match v {
        Value::Null => {
            0u8.hash(&mut h);
            4
        }
        Value::Bool(b) => {
            (1u8, b).hash(&mut h);
            5
        }
        Value::Number(n) => {
            match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => (2u8, u).hash(&mut h),
                (None, Some(i)) => (3u8, i).hash(&mut h),
                _ => (4u8, n.as_f64().map(f64::to_bits)).hash(&mut h),
            }
            8
        }
        Value::String(t) => {
            (5u8, t).hash(&mut h);
            t.len() + 2
        }
        Value::Array(items) => {
            (6u8, items.len()).hash(&mut h);
            let mut size = 2;
            for item in items {
                let (hash, n) = fingerprint(item);
                hash.hash(&mut h);
                size += n + 1;
            }
            size
        }
        Value::Object(members) => {
            (7u8, members.len()).hash(&mut h);
            let (mut all, mut size) = (0u64, 2);
            for (k, item) in members {
                let (hash, n) = fingerprint(item);
                all = all.wrapping_add(SCHEMA_KEY.hash_one((k, hash)));
                size += k.len() + n + 4;
            }
            all.hash(&mut h);
            size
        }
    };
    (h.finish(), size)
}

/// `schema` compiled, from the cache when the same schema was compiled before; a schema larger
/// than the cache's share of one entry is compiled every time.
/// Why a schema is no JSON Schema (the compiler's words).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidSchema(pub String);

pub fn compiled(schema: &Value) -> Result<std::sync::Arc<jsonschema::Validator>, InvalidSchema> {
    let (hash, size) = fingerprint(schema);
    let mut cache = SCHEMAS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    cache.clock += 1;
    let now = cache.clock;
    if let Some(c) = cache
        .by_hash
        .get_mut(&hash)
        .and_then(|same| same.iter_mut().find(|c| c.schema == *schema))
    {
        c.used = now;
        return c.validator.clone();
    }
    drop(cache);
    let validator = jsonschema::validator_for(schema)
        .map(std::sync::Arc::new)
        .map_err(|e| InvalidSchema(e.to_string()));
    if size > SCHEMA_BYTES_MAX / 64 {
        return validator;
    }
    let mut cache = SCHEMAS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let entries: usize = cache.by_hash.values().map(Vec::len).sum();
    if entries >= SCHEMAS_MAX || cache.bytes + size > SCHEMA_BYTES_MAX {
        // The least recently used half goes: one scan for many inserts.
        let mut uses: Vec<u64> = cache.by_hash.values().flatten().map(|c| c.used).collect();
        uses.sort_unstable();
        let cut = uses.get(uses.len() / 2).copied().unwrap_or(u64::MAX);
        cache.by_hash.retain(|_, same| {
            same.retain(|c| c.used > cut);
            !same.is_empty()
        });
        cache.bytes = cache.by_hash.values().flatten().map(|c| c.size).sum();
    }
    cache.bytes += size;
    cache.by_hash.entry(hash).or_default().push(Compiled {
        schema: schema.clone(),
        size,
        validator: validator.clone(),
        used: now,
    });
    validator
}

/// Where `text` (JSON) breaks `schema`: the first few places, each as a defect with `code`.
fn schema_defects(schema: &Value, text: &str, code: ReasonCode) -> Vec<Defect> {
    let instance = match serde_json::from_str::<Value>(text) {
        Ok(v) => v,
        Err(e) => return vec![defect(code, format!("not JSON: {e}"))],
    };
    let validator = match compiled(schema) {
        Ok(v) => v,
        Err(e) => return vec![defect(code, format!("the schema itself is invalid: {e}"))],
    };
    validator
        .iter_errors(&instance)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            let at = if at.is_empty() { "/".to_string() } else { at };
            defect(code, format!("{at}: {e}"))
        })
        .collect()
}

/// Why a value does not fit a schema (`fits_schema`).
#[derive(Debug, PartialEq, thiserror::Error)]
pub(crate) enum Unfit {
    #[error("the schema itself is invalid: {0}")]
    BadSchema(String),
    /// Where it does not fit (the first few places), `; `-separated.
    #[error("{0}")]
    At(String),
}

/// Whether `instance` fits `schema`: where it does not (the first few places), or why the
/// schema itself is unusable.
pub(crate) fn fits_schema(instance: &Value, schema: &Value) -> Result<(), Unfit> {
    let validator = compiled(schema).map_err(|e| Unfit::BadSchema(e.to_string()))?;
    let wrong: Vec<String> = validator
        .iter_errors(instance)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            let at = if at.is_empty() { "/".to_string() } else { at };
            format!("{at}: {e}")
        })
        .collect();
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(Unfit::At(wrong.join("; ")))
    }
}

/// A tool call an answer made: the tool's name and its arguments (JSON text, as sent).
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

/// Check an answer's tool calls against the tools the request declared (name -> parameter
/// schema; `null` when a tool declares none): each must name a declared tool, and its arguments
/// must be JSON that fits the schema.
pub(crate) fn check_tool_calls(
    tools: &BTreeMap<String, super::request::Schema>,
    calls: &[ToolCall],
) -> Vec<Defect> {
    let code = ReasonCode::ToolArgumentsInvalid;
    let mut defects = Vec::new();
    for call in calls {
        let Some(schema) = tools.get(&call.name) else {
            defects.push(defect(
                code,
                format!("`{}` is no tool the request declared", call.name),
            ));
            continue;
        };
        let found = match serde_json::from_str::<Value>(schema.get()) {
            Ok(Value::Null) => match serde_json::from_str::<Value>(&call.arguments) {
                Ok(_) => Vec::new(),
                Err(e) => vec![defect(code, format!("not JSON: {e}"))],
            },
            Ok(schema) => schema_defects(&schema, &call.arguments, code),
            Err(e) => vec![defect(code, format!("the schema is not JSON: {e}"))],
        };
        defects.extend(found.into_iter().map(|d| Defect {
            detail: format!("tool `{}`: {}", call.name, d.detail),
            ..d
        }));
    }
    defects
}

/// A tool's parameter schema (JSON text), checked when the request arrives. A text seen to
/// compile before is not compiled again: the keyed hashes of such texts are kept (many more
/// than compiled schemas are), so an agent fleet's thousands of distinct tool lists cost one
/// compile per schema, not one per request.
pub(crate) fn check_tool_schema(schema: &serde_json::value::RawValue) -> Result<(), InvalidSchema> {
    use std::hash::BuildHasher;
    /// Texts known to compile, at most (8 bytes each).
    const KNOWN_MAX: usize = 1 << 16;
    static KNOWN: std::sync::LazyLock<std::sync::Mutex<std::collections::HashSet<u64>>> =
        std::sync::LazyLock::new(Default::default);
    let text = schema.get();
    if text == "null" {
        return Ok(());
    }
    let hash = SCHEMA_KEY.hash_one(text);
    let known = || {
        KNOWN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    if known().contains(&hash) {
        return Ok(());
    }
    let value: Value =
        serde_json::from_str(text).map_err(|e| InvalidSchema(format!("not JSON: {e}")))?;
    compiled(&value)?;
    let mut known = known();
    if known.len() >= KNOWN_MAX {
        known.clear();
    }
    known.insert(hash);
    Ok(())
}

/// Models often wrap JSON in a markdown fence; accept one fence around the whole answer.
fn strip_code_fence(s: &str) -> &str {
    let Some(rest) = s.strip_prefix("```") else {
        return s;
    };
    let rest = rest.strip_prefix("json").unwrap_or(rest);
    rest.strip_suffix("```").unwrap_or(rest).trim()
}

/// What the contract needs to know of one JSON value: its type, and its number if it is one.
/// Probing instead of building a `serde_json::Value` keeps the check nearly allocation-free.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Shape {
    Null,
    Boolean,
    Integer(f64),
    Number(f64),
    String,
    Array,
    Object,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Null => "null",
            Shape::Boolean => "boolean",
            Shape::Integer(_) | Shape::Number(_) => "number",
            Shape::String => "string",
            Shape::Array => "array",
            Shape::Object => "object",
        }
    }

    fn number(self) -> Option<f64> {
        match self {
            Shape::Integer(n) | Shape::Number(n) => Some(n),
            _ => None,
        }
    }

    fn is(self, t: JsonType) -> bool {
        matches!(
            (t, self),
            (JsonType::String, Shape::String)
                | (JsonType::Number, Shape::Integer(_) | Shape::Number(_))
                | (JsonType::Integer, Shape::Integer(_))
                | (JsonType::Boolean, Shape::Boolean)
                | (JsonType::Object, Shape::Object)
                | (JsonType::Array, Shape::Array)
                | (JsonType::Null, Shape::Null)
        )
    }
}

/// The probe's visitor: records the shape, skips the contents.
struct ShapeVisitor;

impl<'de> Visitor<'de> for ShapeVisitor {
    type Value = Shape;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<Shape, E> {
        Ok(Shape::Null)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Shape, E> {
        Ok(Shape::Boolean)
    }
    fn visit_i64<E>(self, v: i64) -> Result<Shape, E> {
        Ok(Shape::Integer(v as f64))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Shape, E> {
        Ok(Shape::Integer(v as f64))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Shape, E> {
        Ok(Shape::Number(v))
    }
    fn visit_str<E>(self, _: &str) -> Result<Shape, E> {
        Ok(Shape::String)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Shape::Array)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Shape, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Shape::Object)
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Shape, D::Error> {
        d.deserialize_any(ShapeVisitor)
    }
}

/// An object key, borrowed from the content unless it had escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key<'de>, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

/// The answer's top level: an object's fields, or the shape of anything else.
enum Top<'a> {
    Object(Vec<(Key<'a>, Shape)>),
    Other(Shape),
}

impl<'de> Deserialize<'de> for Top<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Top<'de>, D::Error> {
        struct TopVisitor;
        impl<'de> Visitor<'de> for TopVisitor {
            type Value = Top<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON document")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Top<'de>, A::Error> {
                let mut fields = Vec::with_capacity(4);
                while let Some(entry) = map.next_entry::<Key<'de>, Shape>()? {
                    fields.push(entry);
                }
                Ok(Top::Object(fields))
            }
            fn visit_unit<E>(self) -> Result<Top<'de>, E> {
                Ok(Top::Other(Shape::Null))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Top<'de>, E> {
                Ok(Top::Other(Shape::Boolean))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Top<'de>, E> {
                Ok(Top::Other(Shape::Integer(v as f64)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Top<'de>, E> {
                Ok(Top::Other(Shape::Integer(v as f64)))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Top<'de>, E> {
                Ok(Top::Other(Shape::Number(v)))
            }
            fn visit_str<E>(self, _: &str) -> Result<Top<'de>, E> {
                Ok(Top::Other(Shape::String))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Top<'de>, A::Error> {
                ShapeVisitor.visit_seq(seq).map(Top::Other)
            }
        }
        d.deserialize_any(TopVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schema_is_compiled_once_per_content_and_the_cache_stays_bounded() {
        let schema = json!({"type": "object", "properties": {"q": {"type": "string"}}});
        let a = compiled(&schema).unwrap();
        let b = compiled(&schema.clone()).unwrap();
        assert!(
            std::sync::Arc::ptr_eq(&a, &b),
            "the same schema, the same validator"
        );
        let other = json!({"type": "object", "properties": {"q": {"type": "integer"}}});
        let c = compiled(&other).unwrap();
        assert!(!std::sync::Arc::ptr_eq(&a, &c));
        // Each judges by its own schema, cached or not.
        assert!(b.is_valid(&json!({"q": "x"})) && !b.is_valid(&json!({"q": 1})));
        assert!(c.is_valid(&json!({"q": 1})) && !c.is_valid(&json!({"q": "x"})));
        // An invalid schema's error is kept too, and said again.
        let bad = json!({"type": 12});
        assert_eq!(compiled(&bad).unwrap_err(), compiled(&bad).unwrap_err());
        // Many distinct schemas: the cache keeps at most its bound.
        for i in 0..SCHEMAS_MAX + 100 {
            compiled(&json!({"type": "object", "title": format!("t{i}")})).unwrap();
        }
        let cache = SCHEMAS.lock().unwrap();
        let entries: usize = cache.by_hash.values().map(Vec::len).sum();
        assert!(entries <= SCHEMAS_MAX, "{entries}");
        assert!(cache.bytes <= SCHEMA_BYTES_MAX);
        assert_eq!(
            cache.bytes,
            cache
                .by_hash
                .values()
                .flatten()
                .map(|c| c.size)
                .sum::<usize>()
        );
    }

    #[test]
    fn equal_schemas_share_a_fingerprint_and_different_ones_do_not() {
        let a: Value = serde_json::from_str(
            r#"{"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}"#,
        )
        .unwrap();
        let reordered: Value = serde_json::from_str(
            r#"{"required":["q"],"properties":{"q":{"type":"string"}},"type":"object"}"#,
        )
        .unwrap();
        assert_eq!(a, reordered);
        assert_eq!(fingerprint(&a).0, fingerprint(&reordered).0);
        let a_text = a.to_string().len();
        let (_, size) = fingerprint(&a);
        assert!(size >= a_text && size <= 2 * a_text, "{size} for {a_text}");
        // Members moved between objects, an array's order, a number's kind: all differ.
        for other in [
            json!({"type": "object", "properties": {"q": {"type": "string"}, "required": ["q"]}}),
            json!({"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q", "r"]}),
            json!([1, 2]),
            json!([2, 1]),
            json!(1),
            json!(1.0),
            json!(-1),
            json!("1"),
        ] {
            assert_ne!(fingerprint(&a).0, fingerprint(&other).0, "{other}");
        }
        assert_ne!(fingerprint(&json!([1, 2])).0, fingerprint(&json!([2, 1])).0);
        assert_ne!(fingerprint(&json!(1)).0, fingerprint(&json!(1.0)).0);
    }

    #[test]
    fn tool_calls_must_be_json_name_a_declared_tool_and_fit_its_schema() {
        let schema = serde_json::json!({"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"], "additionalProperties": false});
        let tools = crate::core::request::Tools::from([
            ("weather".to_string(), schema),
            ("ping".to_string(), Value::Null),
        ]);
        let call = |name: &str, args: &str| ToolCall {
            name: name.into(),
            arguments: args.into(),
        };
        assert!(
            check_tool_calls(
                &tools,
                &[call("weather", r#"{"city": "Paris", "days": 2}"#)]
            )
            .is_empty()
        );
        assert!(
            check_tool_calls(&tools, &[call("ping", "{}")]).is_empty(),
            "no schema: JSON is enough"
        );
        for (c, needle) in [
            (call("weather", r#"{"city": "Par"#), "not JSON"),
            (call("weather", r#"{"days": 2}"#), "city"),
            (call("weather", r#"{"city": "Paris", "days": 0}"#), "/days"),
            (call("weather", r#"{"city": "Paris", "unit": "F"}"#), "unit"),
            (call("ping", "nope"), "not JSON"),
            (call("launch", "{}"), "no tool the request declared"),
        ] {
            let d = check_tool_calls(&tools, std::slice::from_ref(&c));
            assert_eq!(d.len(), 1, "{c:?}: {d:?}");
            assert_eq!(d[0].code, ReasonCode::ToolArgumentsInvalid);
            assert!(d[0].detail.contains(needle), "{c:?}: {}", d[0].detail);
        }
    }

    #[test]
    fn a_json_schema_response_format_is_validated_in_full() {
        let rf = serde_json::json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "required": ["label"],
            "properties": {"label": {"type": "string", "enum": ["spam", "ham"]},
                           "score": {"type": "number", "maximum": 1}}}}});
        let c = Contract::for_request(None, Some(&rf)).unwrap();
        assert_eq!(
            c.check(r#"{"label": "spam", "score": 0.5}"#, Some("stop")),
            Ok(None)
        );
        let d = c
            .check(r#"{"label": "eggs", "score": 3}"#, Some("stop"))
            .unwrap_err();
        assert!(
            d.iter()
                .all(|d| d.code == ReasonCode::ContractSchemaViolation),
            "{d:?}"
        );
        assert_eq!(d.len(), 2, "{d:?}");
        let bad = serde_json::json!({"type": "json_schema", "json_schema": {"schema": {
            "type": "object", "properties": {"a": {"type": "object", "minProperties": "two"}}}}});
        let e = Contract::for_request(None, Some(&bad)).unwrap_err();
        assert_eq!(e.field(), "response_format");
        assert!(
            e.to_string()
                .starts_with("response_format.json_schema.schema:"),
            "{e}"
        );
    }
    use serde_json::json;

    fn codes(r: Result<Option<f64>, Vec<Defect>>) -> Vec<ReasonCode> {
        r.err()
            .unwrap_or_default()
            .into_iter()
            .map(|d| d.code)
            .collect()
    }

    #[test]
    fn default_contract_accepts_a_good_answer() {
        let c = Contract::default();
        assert_eq!(
            c.check(r#"{"answer":"42","confidence":0.9}"#, Some("stop")),
            Ok(Some(0.9))
        );
        assert_eq!(
            c.check("```json\n{\"answer\":\"42\",\"confidence\":0.8}\n```", None),
            Ok(Some(0.8)),
            "a single markdown fence is tolerated"
        );
    }

    #[test]
    fn each_defect_has_its_code() {
        use ReasonCode::*;
        let c = Contract::default();
        let cases: &[(&str, Option<&str>, ReasonCode)] = &[
            ("", None, ContractEmpty),
            ("   ", None, ContractEmpty),
            ("the answer is 42", None, ContractNotJson),
            ("[1,2]", None, ContractNotObject),
            (r#"{"answer":"x"}"#, None, ContractMissingField),
            (
                r#"{"answer":"x","confidence":"high"}"#,
                None,
                ContractConfidenceType,
            ),
            (
                r#"{"answer":"x","confidence":1.5}"#,
                None,
                ContractConfidenceRange,
            ),
            (
                r#"{"answer":"x","confidence":-0.1}"#,
                None,
                ContractConfidenceRange,
            ),
            (
                r#"{"answer":"x","confidence":0.1}"#,
                None,
                ContractConfidenceTooLow,
            ),
            (r#"{"answer":"x","confi"#, None, ContractTruncated),
            (
                r#"{"answer":"x","confidence":0.9}"#,
                Some("length"),
                ContractTruncated,
            ),
        ];
        for (content, finish, want) in cases {
            assert_eq!(
                codes(c.check(content, *finish)),
                vec![*want],
                "content {content:?}"
            );
        }
        let long = format!(
            r#"{{"answer":"{}","confidence":0.9}}"#,
            "x".repeat(DEFAULT_MAX_CHARS)
        );
        assert_eq!(codes(c.check(&long, None)), vec![ContractTooLong]);
    }

    #[test]
    fn the_probe_reads_json_as_serde_json_does() {
        let c = Contract::default();
        // Escaped keys, nested values, integers, and duplicate keys (the last one wins).
        assert_eq!(
            c.check(r#"{"answ\u0065r":"x","confidence":0.9}"#, None),
            Ok(Some(0.9))
        );
        assert_eq!(
            c.check(r#"{"answer":{"a":[1,{"b":null}]},"confidence":1}"#, None),
            Ok(Some(1.0))
        );
        assert_eq!(
            codes(c.check(r#"{"answer":"x","confidence":0.9,"confidence":"no"}"#, None)),
            vec![ReasonCode::ContractConfidenceType]
        );
        assert_eq!(
            codes(c.check(r#"{"answer":"x","confidence":0.9} trailing"#, None)),
            vec![ReasonCode::ContractNotJson]
        );
        for (doc, name) in [
            ("null", "null"),
            ("true", "boolean"),
            ("3", "number"),
            ("\"s\"", "string"),
        ] {
            let d = c.check(doc, None).unwrap_err();
            assert_eq!(d[0].code, ReasonCode::ContractNotObject);
            assert!(d[0].detail.ends_with(name), "{doc}: {}", d[0].detail);
        }
    }

    #[test]
    fn all_missing_fields_are_reported() {
        let d = Contract::default().check("{}", None).unwrap_err();
        assert_eq!(d.len(), 2);
        assert!(d[0].detail.contains("answer") && d[1].detail.contains("confidence"));
    }

    #[test]
    fn request_contract_overrides_default() {
        let spec = ContractSpec {
            required: Some(vec!["label".into()]),
            properties: [("label".to_string(), JsonType::String)].into(),
            confidence_field: Some(String::new()),
            ..ContractSpec::default()
        };
        let c = Contract::for_request(Some(&spec), None).unwrap();
        assert_eq!(c.check(r#"{"label":"spam"}"#, None), Ok(None));
        assert_eq!(
            codes(c.check(r#"{"label":3}"#, None)),
            vec![ReasonCode::ContractFieldType]
        );
        let bad = ContractSpec {
            min_confidence: Some(2.0),
            ..ContractSpec::default()
        };
        let e = Contract::for_request(Some(&bad), None).unwrap_err();
        assert_eq!(e.field(), "contract");
        assert!(e.to_string().contains("min_confidence"), "{e}");
    }

    #[test]
    fn json_schema_response_format_becomes_the_contract() {
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "required": ["city", "confidence"],
            "properties": {"city": {"type": "string"}, "confidence": {"type": "number"}}}}});
        let c = Contract::for_request(None, Some(&rf)).unwrap();
        assert_eq!(c.required, vec!["city", "confidence"]);
        assert_eq!(
            c.check(r#"{"city":"Oslo","confidence":0.7}"#, None),
            Ok(Some(0.7))
        );
        assert_eq!(
            codes(c.check(r#"{"city":1,"confidence":0.7}"#, None)),
            vec![ReasonCode::ContractFieldType]
        );
        let json_mode = Contract::for_request(None, Some(&json!({"type": "json_object"}))).unwrap();
        assert_eq!(json_mode.check(r#"{"anything": true}"#, None), Ok(None));
        assert_eq!(
            codes(json_mode.check("[]", None)),
            vec![ReasonCode::ContractNotObject]
        );
    }

    #[test]
    fn unusable_response_formats_are_errors_that_name_the_field() {
        for (rf, needle) in [
            (json!({"type": "yaml"}), "response_format.type"),
            (
                json!({"type": "json_schema"}),
                "json_schema.schema is missing",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {"type": "array"}}}),
                "schema.type",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {"type": "object",
                    "properties": {"a": {"type": "date"}}}}}),
                "properties.a.type",
            ),
        ] {
            let err = Contract::for_request(None, Some(&rf)).unwrap_err();
            assert_eq!(err.field(), "response_format", "{err}");
            assert!(err.to_string().contains(needle), "{err}");
        }
    }
}
