//! `oam sim`: simulated upstream providers behind a real OpenAI-compatible HTTP API (and
//! Anthropic's Messages API), with fault modes switchable at runtime. `model` is the pure part
//! (what a provider answers); `server` is the HTTP surface; `messages` its Messages shapes.

pub mod messages;
pub mod model;
pub mod server;
