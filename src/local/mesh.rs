//! A whole mesh in one call, for tests, examples and notebooks: a private nats-server on a free
//! 127.0.0.1 port (its own folder, generated credentials) with the liveness monitor running in
//! this process, so agents served and called through it get the full liveness semantics (death
//! notices, fail-fast callers) with no set-up. Dropping it stops everything it started.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use oam::{local::mesh::LocalMesh, mesh::host::Handler};
//! let mesh = LocalMesh::start().await?;
//! let _agent = mesh
//!     .serve("demo.echo", Handler::call(|body| async move { Ok(body) }))
//!     .await?;
//! let reply = mesh
//!     .caller()
//!     .await?
//!     .call("demo.echo", "{}".into(), std::time::Duration::from_secs(5))
//!     .await?;
//! # Ok(()) }
//! ```

use super::natsd;
use crate::mesh::client::Caller;
use crate::mesh::host::{self, Handler, Instance};
use crate::mesh::protocol::CatalogEntry;
use crate::transport::connect::Refusal;
use anyhow::Context;
use std::path::PathBuf;
use std::time::Duration;

/// A running private mesh. Dropping it stops the monitor and the server and removes its folder.
pub struct LocalMesh {
    server: std::process::Child,
    dir: PathBuf,
    port: u16,
    creds: natsd::Credentials,
    monitor: tokio::task::JoinHandle<()>,
    /// Told when the server refuses this mesh's credentials; nothing else in the process is.
    refused: Refusal,
}

/// An agent served through `LocalMesh::serve`. `stop` leaves gracefully (drains, says so);
/// dropping it without `stop` is a crash: the connection closes and the monitor announces it.
pub struct ServedAgent {
    pub instance_id: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), crate::mesh::RunError>>,
}

impl ServedAgent {
    /// Leave gracefully: finish the requests in hand, deregister, and (as the last instance)
    /// publish a `graceful_shutdown` death notice.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        Ok((&mut self.task).await??)
    }
}

impl Drop for ServedAgent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LocalMesh {
    /// Start nats-server (found like `oam mesh up` finds it: `$OAM_NATS_SERVER`, the project's
    /// `.tools`, PATH) and the monitor. Returns when both are ready.
    pub async fn start() -> anyhow::Result<LocalMesh> {
        let (bin, _) = natsd::find(None)?;
        let creds = natsd::Credentials::generate()?;
        let dir = std::env::temp_dir().join(format!(
            "oam-local-mesh-{}-{}",
            std::process::id(),
            crate::ids::random_hex(4)?
        ));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let layout = natsd::Layout {
            port: 0,
            monitor_port: None,
            dir: dir.clone(),
            ..Default::default()
        };
        let log = dir.join("nats.log");
        let started = natsd::start(&bin, &layout, &creds, &log, Duration::from_secs(10)).await;
        match started {
            Ok(server) => LocalMesh::with_server(server.child, dir, server.port, creds).await,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    async fn with_server(
        server: std::process::Child,
        dir: PathBuf,
        port: u16,
        creds: natsd::Credentials,
    ) -> anyhow::Result<LocalMesh> {
        let mut mesh = LocalMesh {
            server,
            dir,
            port,
            creds,
            monitor: tokio::spawn(async {}),
            refused: Refusal::default(),
        };
        let app = mesh.connect("oam-monitor").await?;
        let sys = crate::transport::connect::connect(
            &natsd::sys_url(&natsd::loopback(&[port]), &mesh.creds),
            "oam-monitor-sys",
            false,
            &mesh.refused,
        )
        .await?;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        mesh.monitor = tokio::spawn(async move {
            let ready = move || {
                let _ = ready_tx.send(());
            };
            if let Err(e) = crate::mesh::monitor::run(app, sys, ready, std::future::pending()).await
            {
                tracing::warn!("the local mesh's monitor stopped: {e:#}");
            }
        });
        let _ = ready_rx.await;
        Ok(mesh)
    }

    /// The application account's URL (credentials included), for other processes or clients.
    pub fn url(&self) -> String {
        natsd::app_url(&natsd::loopback(&[self.port]), &self.creds)
    }

    /// Why the server refused this mesh's credentials, if it did.
    pub fn refused(&self) -> Option<&str> {
        self.refused.reason()
    }

    /// A new client connection named `name`.
    pub async fn connect(&self, name: &str) -> anyhow::Result<async_nats::Client> {
        crate::transport::connect::connect(&self.url(), name, false, &self.refused)
            .await
            .map_err(Into::into)
    }

    /// A fail-fast caller on its own connection.
    pub async fn caller(&self) -> anyhow::Result<Caller> {
        Ok(Caller::new(self.connect("oam-caller").await?).await?)
    }

    /// Serve `handler` as agent `name` (one instance, up to 16 requests at once), registered
    /// when this returns.
    pub async fn serve(&self, name: &str, handler: Handler) -> anyhow::Result<ServedAgent> {
        let entry = CatalogEntry {
            name: name.to_string(),
            description: format!("{name} (local mesh)"),
            version: "0.1.0".into(),
            tags: Vec::new(),
            invocable: true,
            streaming: handler.streams(),
            max_handling_ms: None,
        };
        self.serve_entry(entry, handler, 16).await
    }

    /// Serve `handler` under a full catalog entry, handling up to `concurrency` requests at once.
    pub async fn serve_entry(
        &self,
        entry: CatalogEntry,
        handler: Handler,
        concurrency: usize,
    ) -> anyhow::Result<ServedAgent> {
        let (instance, sub) = Instance::start(&self.url(), entry, &self.refused).await?;
        let instance_id = instance.id.clone();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(host::serve(
            instance,
            sub,
            handler,
            concurrency,
            crate::mesh::monitor::HEARTBEAT_EVERY,
            async move {
                let _ = stop_rx.await;
            },
        ));
        Ok(ServedAgent {
            instance_id,
            stop: Some(stop_tx),
            task,
        })
    }
}

impl Drop for LocalMesh {
    fn drop(&mut self) {
        self.monitor.abort();
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
