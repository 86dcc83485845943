//! NATS: connecting, and the one place subject names are spelled.

pub mod connect;
pub mod subjects;
