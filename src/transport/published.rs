//! A subscription that yields only what was published on its subject. A JetStream push
//! consumer can copy a stream's messages onto any subject (nats-server does not check its
//! deliver subject against the creator's rights), so every control-plane loop reads through
//! this and never sees such a copy (`subjects::from_jetstream`).

use super::subjects::from_jetstream;
use futures_util::{Stream, StreamExt};
use std::pin::Pin;
use std::task::{Context, Poll};

/// `sub` with JetStream deliveries dropped; `.0` is the subscription (to drain or leave it).
pub struct Published(pub async_nats::Subscriber);

impl Stream for Published {
    type Item = async_nats::Message;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            match self.0.poll_next_unpin(cx) {
                Poll::Ready(Some(m)) if from_jetstream(&m) => {}
                other => return other,
            }
        }
    }
}

/// Subscribe to `subject`, reading only what was published on it.
pub async fn subscribe(
    nats: &async_nats::Client,
    subject: impl async_nats::subject::ToSubject,
) -> Result<Published, async_nats::SubscribeError> {
    nats.subscribe(subject).await.map(Published)
}
