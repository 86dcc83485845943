//! The chaos warden: every failure mode oam claims to handle, as one command that restores itself.
//!
//! `oam chaos FAULT [TARGET] --for 30s` asks the mesh's chaos warden (started by `oam mesh up`)
//! over NATS. The warden applies the fault, publishes `oam.v1.chaos.event`, and restores the
//! target when the time is up, whether or not the `oam chaos` process is still there; restoration
//! state is kept in the mesh folder (`chaos.json`) so a restarted warden finishes the job.
//! Provider faults are the simulator's (which also ends them on time by itself); node faults
//! (`isolate-node`, `drain-budget`) are commands every node hears on `oam.v1.chaos.node.*` and
//! undoes at their expiry by itself; process faults are signals to PIDs the mesh recorded.

pub(crate) mod warden;
