//! The typed conversation every client API decodes into and every upstream API encodes from:
//! turns with their role, their content (text, or parts: text, images, parts of other kinds),
//! the tool calls an assistant made and the call a tool turn answers. A turn that came in the
//! chat-completions shape keeps its text as it came, so a chat upstream is sent it unchanged
//! (nothing re-encoded); every other upstream, and turns of other APIs, are written from the
//! typed fields.

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::fmt;

/// Who wrote a turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Speaker {
    System,
    /// OpenAI's newer name for a system turn.
    Developer,
    User,
    Assistant,
    /// The result of a tool call (`tool_call_id` names it).
    Tool,
    /// Any other role a client named (`function`, ...): passed on to chat upstreams as it came.
    Other(Box<str>),
}

impl Speaker {
    pub(crate) fn named(name: &str) -> Speaker {
        match name {
            "system" => Speaker::System,
            "developer" => Speaker::Developer,
            "user" => Speaker::User,
            "assistant" => Speaker::Assistant,
            "tool" => Speaker::Tool,
            other => Speaker::Other(other.into()),
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        match self {
            Speaker::System => "system",
            Speaker::Developer => "developer",
            Speaker::User => "user",
            Speaker::Assistant => "assistant",
            Speaker::Tool => "tool",
            Speaker::Other(name) => name,
        }
    }

    /// A system or developer turn: instructions, not conversation.
    pub(crate) fn instructs(&self) -> bool {
        matches!(self, Speaker::System | Speaker::Developer)
    }
}

/// What a turn says.
#[derive(Clone, Debug)]
pub(crate) enum Content {
    /// Null or left out (an assistant turn that only calls tools).
    Absent,
    Text(String),
    Parts(Vec<Part>),
}

/// One part of a turn's content.
#[derive(Clone, Debug)]
pub(crate) enum Part {
    Text(String),
    /// An image by URL (a `data:` URL carries it inline), and the detail asked for.
    Image {
        url: String,
        detail: Option<String>,
    },
    /// A part of another kind (audio, a file, ...), as it came, and its `text` if it has one:
    /// only a chat upstream carries it.
    Other {
        raw: Box<RawValue>,
        text: Option<String>,
    },
}

/// A tool call an assistant turn made.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as the JSON text the model wrote.
    pub arguments: String,
}

/// One turn of a conversation.
#[derive(Clone, Debug)]
pub(crate) struct Turn {
    pub role: Speaker,
    pub content: Content,
    /// An assistant turn's tool calls.
    pub calls: Vec<ToolCall>,
    /// A tool turn: the id of the call it answers.
    pub answers: Option<String>,
    /// Its text in the chat shape, as the client sent it (written out unchanged to chat
    /// upstreams), when it came so.
    pub sent: Option<Box<RawValue>>,
    /// The first thing in it, as the client wrote it, that oam does not read (a member such as
    /// `name`, a tool call of another type or with arguments that are no JSON object): only a
    /// chat upstream carries it.
    pub unread: Option<String>,
}

impl Turn {
    /// A turn of plain text, written by oam (not sent by a client).
    pub(crate) fn text(role: Speaker, text: impl Into<String>) -> Turn {
        Turn {
            role,
            content: Content::Text(text.into()),
            calls: Vec::new(),
            answers: None,
            sent: None,
            unread: None,
        }
    }

    /// Its text: the text, or its parts' texts a line each.
    pub(crate) fn plain_text(&self) -> String {
        match &self.content {
            Content::Absent => String::new(),
            Content::Text(t) => t.clone(),
            Content::Parts(parts) => {
                let texts: Vec<&str> = parts
                    .iter()
                    .filter_map(|p| match p {
                        Part::Text(t) => Some(t.as_str()),
                        Part::Other { text, .. } => text.as_deref(),
                        Part::Image { .. } => None,
                    })
                    .collect();
                texts.join("\n")
            }
        }
    }

    /// A turn in the chat shape, read from its text (kept as `sent`). Lenient where chat
    /// servers are (a part or tool call of an unknown shape is kept, not refused); strict on
    /// `role` and on `content` being a string, parts or null.
    /// A refusal names where within the turn it lies.
    pub(crate) fn from_chat(
        raw: &RawValue,
    ) -> Result<Turn, serde_path_to_error::Error<serde_json::Error>> {
        let mut turn: Turn = match serde_json::from_str(raw.get()) {
            Ok(turn) => turn,
            // Read again to find where (rare: the fast read keeps no path).
            Err(_) => {
                let mut de = serde_json::Deserializer::from_str(raw.get());
                serde_path_to_error::deserialize(&mut de)?
            }
        };
        turn.sent = Some(raw.to_owned());
        Ok(turn)
    }
}

impl<'de> Deserialize<'de> for Turn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Turn, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = Turn;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a message {role, content}")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Turn, A::Error> {
                let mut role = None;
                let mut turn = Turn::text(Speaker::User, "");
                turn.content = Content::Absent;
                while let Some(k) = m.next_key::<std::borrow::Cow<'de, str>>()? {
                    match k.as_ref() {
                        "role" => role = Some(Speaker::named(&m.next_value::<String>()?)),
                        "content" => turn.content = m.next_value::<ContentIn>()?.0,
                        "tool_call_id" => {
                            let id: Option<&RawValue> = m.next_value()?;
                            match id.map(|id| serde_json::from_str::<String>(id.get())) {
                                Some(Ok(id)) => turn.answers = Some(id),
                                Some(Err(_)) => {
                                    turn.unread.get_or_insert_with(|| "tool_call_id".into());
                                }
                                None => {}
                            }
                        }
                        "tool_calls" => {
                            let calls: Option<Vec<&RawValue>> = m.next_value()?;
                            for (j, raw) in calls.into_iter().flatten().enumerate() {
                                match serde_json::from_str::<CallIn>(raw.get()) {
                                    Ok(c) if c.function_with_object() => turn.calls.push(c.into()),
                                    _ => {
                                        let at = format!("tool_calls[{j}]");
                                        turn.unread.get_or_insert(at);
                                    }
                                }
                            }
                        }
                        other => {
                            turn.unread.get_or_insert_with(|| other.to_string());
                            m.next_value::<de::IgnoredAny>()?;
                        }
                    }
                }
                turn.role = role.ok_or_else(|| de::Error::missing_field("role"))?;
                Ok(turn)
            }
        }
        d.deserialize_map(Visit)
    }
}

/// `content` as chat writes it: a string, null, or an array of parts.
struct ContentIn(Content);

impl<'de> Deserialize<'de> for ContentIn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ContentIn, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = ContentIn;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of parts")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ContentIn, E> {
                Ok(ContentIn(Content::Text(s.to_string())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<ContentIn, E> {
                Ok(ContentIn(Content::Text(s)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<ContentIn, E> {
                Ok(ContentIn(Content::Absent))
            }
            fn visit_none<E: de::Error>(self) -> Result<ContentIn, E> {
                Ok(ContentIn(Content::Absent))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<ContentIn, A::Error> {
                let mut parts = Vec::new();
                while let Some(raw) = s.next_element::<&RawValue>()? {
                    parts.push(Part::from_chat(raw));
                }
                Ok(ContentIn(Content::Parts(parts)))
            }
        }
        d.deserialize_any(Visit)
    }
}

impl Part {
    /// A chat content part: text and image parts read, any other kept as it came.
    fn from_chat(raw: &RawValue) -> Part {
        #[derive(Deserialize)]
        struct PartIn {
            #[serde(rename = "type", default)]
            kind: Option<String>,
            #[serde(default)]
            text: Option<String>,
            #[serde(default)]
            image_url: Option<ImageIn>,
        }
        #[derive(Deserialize)]
        struct ImageIn {
            url: String,
            #[serde(default)]
            detail: Option<String>,
        }
        let read = serde_json::from_str::<PartIn>(raw.get()).ok();
        match read {
            Some(PartIn {
                kind: Some(k),
                text: Some(t),
                ..
            }) if k == "text" => Part::Text(t),
            Some(PartIn {
                kind: Some(k),
                image_url: Some(i),
                ..
            }) if k == "image_url" => Part::Image {
                url: i.url,
                detail: i.detail,
            },
            other => Part::Other {
                raw: raw.to_owned(),
                text: other.and_then(|p| p.text),
            },
        }
    }
}

/// A chat tool call as it came.
#[derive(Deserialize)]
struct CallIn {
    #[serde(default)]
    id: Option<String>,
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    function: Option<FunctionIn>,
}

#[derive(Deserialize)]
struct FunctionIn {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

impl CallIn {
    /// A function call whose arguments (if any) are a JSON object: what every API carries.
    fn function_with_object(&self) -> bool {
        let args = self.function.as_ref().and_then(|f| f.arguments.as_deref());
        let args = args.unwrap_or("{}");
        self.kind.as_deref() == Some("function")
            && args.trim_start().starts_with('{')
            && serde_json::from_str::<de::IgnoredAny>(args).is_ok()
    }
}

impl From<CallIn> for ToolCall {
    fn from(c: CallIn) -> ToolCall {
        let f = c.function.unwrap_or(FunctionIn {
            name: None,
            arguments: None,
        });
        ToolCall {
            id: c.id.unwrap_or_default(),
            name: f.name.unwrap_or_default(),
            arguments: f.arguments.unwrap_or_else(|| "{}".into()),
        }
    }
}

/// A turn in the chat shape: as it was sent when it came so, else written from its fields.
impl Serialize for Turn {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if let Some(raw) = &self.sent {
            return raw.serialize(s);
        }
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("role", self.role.as_str())?;
        if let Some(id) = &self.answers {
            m.serialize_entry("tool_call_id", id)?;
        }
        match &self.content {
            Content::Absent => m.serialize_entry("content", &())?,
            Content::Text(t) => m.serialize_entry("content", t)?,
            Content::Parts(parts) => m.serialize_entry("content", parts)?,
        }
        if !self.calls.is_empty() {
            m.serialize_entry("tool_calls", &self.calls)?;
        }
        m.end()
    }
}

impl Serialize for Part {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Part::Text(text) => {
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry("type", "text")?;
                m.serialize_entry("text", text)?;
                m.end()
            }
            Part::Image { url, detail } => {
                #[derive(Serialize)]
                struct Url<'a> {
                    url: &'a str,
                    #[serde(skip_serializing_if = "Option::is_none")]
                    detail: Option<&'a str>,
                }
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry("type", "image_url")?;
                let detail = detail.as_deref();
                m.serialize_entry("image_url", &Url { url, detail })?;
                m.end()
            }
            Part::Other { raw, .. } => raw.serialize(s),
        }
    }
}

impl Serialize for ToolCall {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Function<'a> {
            name: &'a str,
            arguments: &'a str,
        }
        let mut m = s.serialize_map(Some(3))?;
        m.serialize_entry("id", &self.id)?;
        m.serialize_entry("type", "function")?;
        m.serialize_entry(
            "function",
            &Function {
                name: &self.name,
                arguments: &self.arguments,
            },
        )?;
        m.end()
    }
}

/// The sampling parameters oam reads, under chat's names (a Messages request's are put under
/// them): what every upstream is written from. Those not given are left out.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct Sampling {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// Who the end user is, for the upstream's abuse checks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Answers asked for at once (each is billed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
}

/// Where the model stops: one sequence, or several.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub(crate) fn sequences(&self) -> &[String] {
        match self {
            Stop::One(s) => std::slice::from_ref(s),
            Stop::Many(v) => v,
        }
    }
}

/// Which tool the model must call, if any.
#[derive(Clone, Debug)]
pub(crate) enum ToolChoice {
    /// `auto`, `required` or `none`.
    Mode(String),
    /// This function.
    Function(String),
    /// A choice of another shape (a newer API's), as it came: only a chat upstream carries it.
    Other(Box<RawValue>),
}

impl PartialEq for ToolChoice {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (ToolChoice::Mode(a), ToolChoice::Mode(b)) => a == b,
            (ToolChoice::Function(a), ToolChoice::Function(b)) => a == b,
            (ToolChoice::Other(a), ToolChoice::Other(b)) => a.get() == b.get(),
            _ => false,
        }
    }
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ToolChoice, D::Error> {
        #[derive(Deserialize)]
        struct FunctionIn {
            #[serde(rename = "type")]
            kind: String,
            function: Named,
        }
        #[derive(Deserialize)]
        struct Named {
            name: String,
        }
        let raw = Box::<RawValue>::deserialize(d)?;
        if let Ok(mode) = serde_json::from_str::<String>(raw.get()) {
            return Ok(ToolChoice::Mode(mode));
        }
        match serde_json::from_str::<FunctionIn>(raw.get()) {
            Ok(f) if f.kind == "function" => Ok(ToolChoice::Function(f.function.name)),
            _ => Ok(ToolChoice::Other(raw)),
        }
    }
}

impl Serialize for ToolChoice {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Named<'a> {
            name: &'a str,
        }
        match self {
            ToolChoice::Mode(mode) => s.serialize_str(mode),
            ToolChoice::Function(name) => {
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry("type", "function")?;
                m.serialize_entry("function", &Named { name })?;
                m.end()
            }
            ToolChoice::Other(raw) => raw.serialize(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn turn(v: Value) -> Turn {
        let raw = serde_json::value::to_raw_value(&v).unwrap();
        Turn::from_chat(&raw).expect("a turn")
    }

    /// `t` written from its fields (not as it came).
    fn rewritten(t: &Turn) -> Value {
        let mut t = t.clone();
        t.sent = None;
        serde_json::to_value(&t).unwrap()
    }

    #[test]
    fn a_chat_turn_reads_into_its_fields_and_writes_back_to_what_it_means() {
        let cases = [
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "what?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                "type": "function", "function": {"name": "look", "arguments": "{\"q\":1}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "a cat"}),
            json!({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
        ];
        for v in cases {
            let t = turn(v.clone());
            assert_eq!(t.unread, None, "{v}");
            assert_eq!(rewritten(&t), v, "written from its fields");
            assert_eq!(serde_json::to_value(&t).unwrap(), v, "sent as it came");
        }
        let t = turn(
            json!({"role": "user", "content": [{"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "u"}}, {"type": "input_text", "text": "b"}]}),
        );
        assert_eq!(t.plain_text(), "a\nb");
        assert!(
            matches!(turn(json!({"role": "assistant"})).content, Content::Absent),
            "no content is none"
        );
    }

    #[test]
    fn what_only_chat_carries_is_named_as_the_client_wrote_it() {
        let unread = |v: Value| turn(v).unread;
        assert_eq!(
            unread(json!({"role": "user", "name": "bob", "content": "a"})).as_deref(),
            Some("name")
        );
        let cut = json!({"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"type": "function", "function": {"name": "f", "arguments": "{cut"}}]});
        assert_eq!(unread(cut.clone()).as_deref(), Some("tool_calls[1]"));
        assert_eq!(turn(cut.clone()).calls.len(), 1);
        assert_eq!(
            serde_json::to_value(turn(cut.clone())).unwrap(),
            cut,
            "kept as sent"
        );
        let list = json!({"role": "assistant", "tool_calls": [{"type": "function",
            "function": {"name": "f", "arguments": "[1]"}}]});
        assert_eq!(unread(list).as_deref(), Some("tool_calls[0]"));
        let custom = json!({"role": "assistant", "tool_calls": [{"type": "custom"}]});
        assert_eq!(unread(custom).as_deref(), Some("tool_calls[0]"));
    }

    #[test]
    fn sampling_parameters_read_and_write_back_as_chat_wrote_them() {
        for v in [
            json!({"temperature": 0.2, "top_p": 0.9, "stop": "END", "user": "u",
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "parallel_tool_calls": false}),
            json!({"stop": ["a", "b"], "tool_choice": "required"}),
            json!({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}),
            json!({}),
        ] {
            let s: Sampling = serde_json::from_value(v.clone()).expect("sampling");
            assert_eq!(serde_json::to_value(&s).unwrap(), v);
        }
        let s: Sampling =
            serde_json::from_value(json!({"tool_choice": {"type": "custom", "name": "x"}}))
                .unwrap();
        assert!(
            matches!(s.tool_choice, Some(ToolChoice::Other(_))),
            "kept, not read"
        );
        let s: Sampling = serde_json::from_value(json!({"stop": "x"})).unwrap();
        assert_eq!(
            s.stop.as_ref().map(Stop::sequences),
            Some(&["x".to_string()][..])
        );
        assert!(serde_json::from_value::<Sampling>(json!({"temperature": "hot"})).is_err());
    }

    #[test]
    fn a_turn_of_another_shape_is_refused_with_its_path() {
        for (v, path) in [
            (json!({"role": "user", "content": 5}), "content"),
            (json!({"content": "x"}), "."),
            (json!({"role": 1, "content": "x"}), "role"),
        ] {
            let raw = serde_json::value::to_raw_value(&v).unwrap();
            let e = Turn::from_chat(&raw).expect_err("refused");
            assert_eq!(e.path().to_string(), path, "{v}: {e}");
        }
    }
}
