//! Questions whose answers only the answerer can write. A question's reply subject is an answer
//! inbox under the answerer's token (`_OAM.re.{answerer}.{asker}.{conn}.{token}`,
//! `subjects::answer_inbox`), where the server lets only that answerer publish and only the
//! asker subscribe; an answer is believed only there, under the token asked of. One
//! subscription per asker carries all its answers, as async-nats' own request multiplexer
//! does. A client that is no role of oam's (it keeps the shared `_INBOX`) asks plainly.

use super::subjects;
use async_nats::{HeaderMap, Message};
use bytes::Bytes;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Where one asker hears its answerers: a connection token of its own under its answer
/// inboxes (`_OAM.re.*.{asker}.{conn}`), or for a client outside oam's roles its shared inbox
/// (`_INBOX.{conn}`).
#[derive(Clone, Debug)]
pub(crate) struct Inbox {
    /// The client's private inbox (`_OAM.caller`), or `None` for `_INBOX`.
    private: Option<String>,
    conn: String,
}

impl Inbox {
    /// A new inbox for `nats`'s answers, with a token of its own.
    pub fn new(nats: &async_nats::Client) -> Inbox {
        let inbox = nats.new_inbox();
        let private = inbox
            .rsplit_once('.')
            .map(|(prefix, _)| prefix)
            .filter(|p| subjects::answer_inbox("x", p).is_some())
            .map(str::to_string);
        Inbox {
            private,
            conn: crate::ids::unguessable(),
        }
    }

    /// Where answerer `tag` answers with `token`.
    pub fn at(&self, tag: &str, token: &str) -> String {
        match self
            .private
            .as_deref()
            .and_then(|p| subjects::answer_inbox(tag, p))
        {
            Some(base) => format!("{base}.{}.{token}", self.conn),
            None => format!("{}.{}.{token}", subjects::DEFAULT_INBOX, self.conn),
        }
    }

    /// What to subscribe to for every answer to this inbox (one token after it).
    pub fn every(&self) -> String {
        self.at("*", "*")
    }

    /// The token of an answer on `subject` from answerer `tag`; `None` when another answerer
    /// wrote it (the server let it publish under its own token only) or it is no answer here.
    pub fn token_of<'a>(&self, subject: &'a str, tag: &str) -> Option<&'a str> {
        let mine = match self.private.as_deref() {
            Some(private) => {
                let (by, rest) = subjects::answered_by(subject)?;
                let asker = private.strip_prefix("_OAM.")?;
                (by == tag).then_some(())?;
                rest.strip_prefix(asker)?.strip_prefix('.')?
            }
            None => subject
                .strip_prefix(subjects::DEFAULT_INBOX)?
                .strip_prefix('.')?,
        };
        let token = mine.strip_prefix(self.conn.as_str())?.strip_prefix('.')?;
        (!token.is_empty() && !token.contains('.')).then_some(token)
    }
}

/// Why a question got no answer.
#[derive(Debug, PartialEq, Eq)]
pub enum AskError {
    /// Nobody subscribes to the subject asked on.
    NoResponders,
    /// No answer within the time given.
    TimedOut,
    /// The question could not be sent.
    Failed(String),
}

impl std::fmt::Display for AskError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AskError::NoResponders => write!(f, "no responders"),
            AskError::TimedOut => write!(f, "no answer in time"),
            AskError::Failed(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for AskError {}

/// Asks questions and hears their answers (see the module).
pub struct Asker {
    nats: async_nats::Client,
    inbox: Inbox,
    waiting: Arc<Mutex<HashMap<String, Question>>>,
    route: tokio::task::JoinHandle<()>,
}

struct Question {
    tag: String,
    answer: tokio::sync::oneshot::Sender<Message>,
}

fn waiting(
    m: &Mutex<HashMap<String, Question>>,
) -> std::sync::MutexGuard<'_, HashMap<String, Question>> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Asker {
    pub async fn new(nats: async_nats::Client) -> Result<Asker, async_nats::SubscribeError> {
        let inbox = Inbox::new(&nats);
        // What a JetStream consumer copied here is nobody's answer (`transport::published`).
        let mut answers = super::published::subscribe(&nats, inbox.every()).await?;
        let pending: Arc<Mutex<HashMap<String, Question>>> = Arc::default();
        let (p, i) = (pending.clone(), inbox.clone());
        let route = tokio::spawn(async move {
            while let Some(m) = answers.next().await {
                let Some((_, token)) = m.subject.rsplit_once('.') else {
                    continue;
                };
                let mut w = waiting(&p);
                // Only the answerer asked may answer: anything else is dropped, and the
                // question still waits for its real answer.
                if w.get(token)
                    .is_some_and(|q| i.token_of(&m.subject, &q.tag) == Some(token))
                    && let Some(q) = w.remove(token)
                {
                    let _ = q.answer.send(m);
                }
            }
        });
        Ok(Asker {
            nats,
            inbox,
            waiting: pending,
            route,
        })
    }

    /// Ask answerer `tag` on `subject` and wait `within` for its answer.
    pub async fn ask(
        &self,
        tag: &str,
        subject: String,
        headers: HeaderMap,
        body: Bytes,
        within: Duration,
    ) -> Result<Message, AskError> {
        let token = crate::ids::unguessable();
        let (tx, rx) = tokio::sync::oneshot::channel();
        waiting(&self.waiting).insert(
            token.clone(),
            Question {
                tag: tag.to_string(),
                answer: tx,
            },
        );
        // Forgotten however the question ends, given up on included.
        struct Forget<'a>(&'a Mutex<HashMap<String, Question>>, &'a str);
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                waiting(self.0).remove(self.1);
            }
        }
        let _forget = Forget(&self.waiting, &token);
        let reply = self.inbox.at(tag, &token);
        self.nats
            .publish_with_reply_and_headers(subject, reply, headers, body)
            .await
            .map_err(|e| AskError::Failed(format!("cannot send the request: {e}")))?;
        match tokio::time::timeout(within, rx).await {
            Err(_) | Ok(Err(_)) => Err(AskError::TimedOut),
            Ok(Ok(m)) if m.status == Some(async_nats::StatusCode::NO_RESPONDERS) => {
                Err(AskError::NoResponders)
            }
            Ok(Ok(m)) => Ok(m),
        }
    }

    /// How many questions wait for an answer now.
    pub fn waiting(&self) -> usize {
        waiting(&self.waiting).len()
    }
}

impl Drop for Asker {
    fn drop(&mut self) {
        self.route.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_counts_only_under_the_token_asked_of_in_this_inbox() {
        let mine = Inbox {
            private: Some("_OAM.node.n1".into()),
            conn: "c1".into(),
        };
        let at = mine.at("ag-demo~echo", "t1");
        assert_eq!(at, "_OAM.re.ag-demo~echo.node.n1.c1.t1");
        assert_eq!(mine.token_of(&at, "ag-demo~echo"), Some("t1"));
        assert_eq!(mine.every(), "_OAM.re.*.node.n1.c1.*");
        for (subject, tag) in [
            (at.as_str(), "ag-other"),
            ("_OAM.re.ag-evil.node.n1.c1.t1", "ag-demo~echo"),
            ("_OAM.re.ag-demo~echo.node.n1.c2.t1", "ag-demo~echo"),
            ("_OAM.re.ag-demo~echo.node.n10.c1.t1", "ag-demo~echo"),
            ("_OAM.re.ag-demo~echo.node.n1.c1.t1.x", "ag-demo~echo"),
            ("_OAM.node.n1.c1.t1", "ag-demo~echo"),
        ] {
            assert_eq!(mine.token_of(subject, tag), None, "{subject} as {tag}");
        }
        let shared = Inbox {
            private: None,
            conn: "c1".into(),
        };
        assert_eq!(shared.at("nodes", "t2"), "_INBOX.c1.t2");
        assert_eq!(shared.token_of("_INBOX.c1.t2", "nodes"), Some("t2"));
        assert_eq!(shared.token_of("_INBOX.c9.t2", "nodes"), None);
    }
}
