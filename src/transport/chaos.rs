//! Asking the chaos warden over NATS (inject, list, restore) and reading its reply.

use crate::core::chaos::{Active, WardenReply};
use std::time::Duration;

/// Why the warden could not be asked, or said no.
#[derive(Debug)]
pub enum WardenError {
    /// Nobody answers the chaos subjects.
    NoWarden,
    /// The warden refused, saying why.
    Refused(String),
    /// The bus failed, or the answer made no sense.
    Failed(String),
}

impl std::fmt::Display for WardenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WardenError::NoWarden => write!(f, "no chaos warden answers"),
            WardenError::Refused(w) | WardenError::Failed(w) => write!(f, "{w}"),
        }
    }
}

/// Ask the warden on `subject`; the faults it injected, listed or restored.
pub async fn ask(
    nats: &async_nats::Client,
    subject: &'static str,
    body: Vec<u8>,
) -> Result<Vec<Active>, WardenError> {
    use super::ask::{self, Asker};
    let asker = Asker::new(nats.clone())
        .await
        .map_err(|e| WardenError::Failed(format!("cannot listen for the answer: {e}")))?;
    let within = Duration::from_secs(15);
    let (tag, h) = (super::subjects::ANSWERER_WARDEN, Default::default());
    let msg = match asker.ask(tag, subject.into(), h, body.into(), within).await {
        Ok(m) => m,
        Err(ask::AskError::NoResponders) => return Err(WardenError::NoWarden),
        Err(ask::AskError::TimedOut) => {
            return Err(WardenError::Failed(
                "the chaos warden did not answer within 15 s".into(),
            ));
        }
        Err(e) => return Err(WardenError::Failed(e.to_string())),
    };
    match serde_json::from_slice::<WardenReply>(&msg.payload) {
        Ok(WardenReply::Ok(faults)) => Ok(faults),
        Ok(WardenReply::Error(why)) => Err(WardenError::Refused(why)),
        Err(e) => Err(WardenError::Failed(format!(
            "the chaos warden's reply is not understood: {e}"
        ))),
    }
}
