//! Asking the chaos warden over NATS (inject, list, restore) and reading its reply.

use crate::core::chaos::{Active, Reply};
use std::time::Duration;

/// Why the warden could not be asked, or said no.
#[derive(Debug)]
pub enum AskError {
    /// Nobody answers the chaos subjects.
    NoWarden,
    /// The warden refused, saying why.
    Refused(String),
    /// The bus failed, or the answer made no sense.
    Failed(String),
}

impl std::fmt::Display for AskError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AskError::NoWarden => write!(f, "no chaos warden answers"),
            AskError::Refused(w) | AskError::Failed(w) => write!(f, "{w}"),
        }
    }
}

/// Ask the warden on `subject`; the faults it injected, listed or restored.
pub async fn ask(
    nats: &async_nats::Client,
    subject: &'static str,
    body: Vec<u8>,
) -> Result<Vec<Active>, AskError> {
    let request = nats.request(subject, body.into());
    let msg = match tokio::time::timeout(Duration::from_secs(15), request).await {
        Ok(Ok(m)) => m,
        Ok(Err(e)) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {
            return Err(AskError::NoWarden);
        }
        Ok(Err(e)) => return Err(AskError::Failed(e.to_string())),
        Err(_) => {
            return Err(AskError::Failed(
                "the chaos warden did not answer within 15 s".into(),
            ));
        }
    };
    match serde_json::from_slice::<Reply>(&msg.payload) {
        Ok(Reply::Ok(faults)) => Ok(faults),
        Ok(Reply::Error(why)) => Err(AskError::Refused(why)),
        Err(e) => Err(AskError::Failed(format!(
            "the chaos warden's reply is not understood: {e}"
        ))),
    }
}
