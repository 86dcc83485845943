//! `oam sim`: simulated upstream providers behind a real OpenAI-compatible HTTP API, with fault
//! modes switchable at runtime. `model` is the pure part (what a provider answers); `server` is
//! the HTTP surface.

pub mod model;
pub mod server;
