//! The one integration-test binary: the real `oam` binary, driven as a user would.

mod agents;
mod chaos;
mod cli;
mod cluster;
mod mesh;
mod scenarios;
mod sim;
mod support;
mod watch;
