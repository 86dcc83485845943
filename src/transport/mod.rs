//! NATS: connecting, the one place subject names are spelled, the KV stores, and the clients
//! of the services on the bus (the chaos warden). Reads no files and no `.oam` folder.

pub mod ask;
pub mod chaos;
pub mod connect;
pub mod published;
pub mod roles;
pub mod store;
pub mod subjects;
