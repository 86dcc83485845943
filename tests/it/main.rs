//! The one integration-test binary: the real `oam` binary, driven as a user would.

mod cli;
mod sim;
mod support;
