//! `oam watch`: a live terminal view of the whole mesh, fed by NATS only (node state snapshots,
//! decisions, the escalation store, incidents, agent heartbeats and deaths, chaos events). `state` is the
//! pure model, `render` draws it, `cmd::watch` runs the terminal and the bus.

#[cfg(test)]
pub(crate) mod fixtures;
pub(crate) mod render;
pub(crate) mod state;
