//! The pure decision core that every runtime (node, bench, TUI, explain) shares.
//!
//! Nothing under `core` imports tokio, NATS, a terminal or a clock: time is always an argument
//! (`now_ms`), iteration that reaches output goes through ordered maps, and the same inputs give
//! the same outputs. Runtimes feed it events and execute the effects it returns.

pub mod books;
pub mod breaker;
pub mod budget;
pub mod bulkhead;
pub mod chaos;
pub mod contract;
pub mod date;
pub mod decision;
pub mod escalation;
pub mod health;
pub mod ledger;
pub mod loops;
pub mod pipeline;
pub mod quorum;
pub mod rates;
pub mod reason;
pub mod record;
pub mod rehearsal;
pub mod replay;
pub mod request;
pub mod scope;
pub mod score;
pub mod timeline;
pub mod validate;
pub mod wire;
