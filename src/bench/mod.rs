//! Scripted load and scenarios: `load` is the load engine (HTTP, NATS or agent calls, HDR
//! percentiles), `scenario` the scenario files (schema, `--short` scaling, pure evaluation of
//! expectations), `runner` plays a scenario on a local cluster (load, chaos timeline through
//! the warden, agents) and returns what it measured. Presentation is the caller's.

pub(crate) mod load;
pub(crate) mod runner;
pub(crate) mod scenario;
