//! One module per subcommand: its clap `Args` and its `run`. Glue only; decisions live in `core`.

pub mod agent;
pub mod audit;
pub mod bench;
pub mod budget;
pub mod chaos;
pub mod completions;
pub mod config;
pub mod creds;
pub mod decide;
pub mod demo;
pub mod escalation;
pub mod explain;
pub mod listen;
pub mod man;
pub mod mesh;
pub mod node;
pub mod reasons;
pub mod rehearse;
pub mod sim;
pub mod spend;
pub mod watch;

use crate::transport::connect::Refusal;

/// A flag value that does not read, and what to give instead (clap says which flag).
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BadValue(pub String);

impl From<String> for BadValue {
    fn from(why: String) -> BadValue {
        BadValue(why)
    }
}

/// The process's one [`Refusal`]: every connection a command makes reports to it, and a
/// long-running command stops on it (then exits as unreachable, saying why).
pub fn refused() -> &'static Refusal {
    static REFUSED: std::sync::OnceLock<Refusal> = std::sync::OnceLock::new();
    REFUSED.get_or_init(Refusal::default)
}

/// What ends a long-running command: Ctrl-C, SIGTERM, or the bus refusing this process's
/// credentials.
pub async fn terminated() {
    tokio::select! {
        () = crate::signal::terminated() => {}
        () = refused().wait() => {}
    }
}

/// A URL that does not read is a usage error; a mesh nobody answers for is unreachable.
impl From<crate::transport::connect::ReachError> for crate::error::Error {
    fn from(e: crate::transport::connect::ReachError) -> Self {
        use crate::transport::connect::ReachError;
        let kind = match &e {
            ReachError::BadUrl { .. } => crate::error::Kind::Usage,
            ReachError::Unreachable { .. } => crate::error::Kind::Unreachable,
        };
        crate::error::Error::new(kind, e)
    }
}

/// Connect for a command (see `transport::connect::reach`), refusals told to [`refused`].
pub async fn reach(
    url: &str,
    name: &str,
    wait_for_server: bool,
) -> crate::error::Result<async_nats::Client> {
    Ok(crate::transport::connect::reach(url, name, wait_for_server, refused()).await?)
}

/// Which mesh a command talks to, and as whom: the same flags, resolved the same way,
/// everywhere (`local::find_cluster`). In a mesh folder each command uses the credentials of its
/// role (`creds/{user}.json`).
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterArgs {
    /// The mesh's state folder (as given to `oam mesh up --dir`). Default: $OAM_DIR, then
    /// ./.oam (after $OAM_NATS_URL).
    #[arg(long, global = true)]
    pub dir: Option<std::path::PathBuf>,
    /// NATS URL of a mesh elsewhere (credentials may be in it).
    #[arg(long, global = true)]
    pub nats_url: Option<String>,
    /// Credentials file: one `oam creds issue` wrote (it names the mesh and the role), or a
    /// NATS credentials file (user JWT and NKey seed, as `nsc generate creds` writes it) for a
    /// mesh elsewhere; used by every connection of this command.
    #[arg(long, global = true, env = "OAM_NATS_CREDS", value_name = "FILE")]
    pub creds: Option<std::path::PathBuf>,
}

impl ClusterArgs {
    /// The NATS URL to use as `role`; exit 3 saying what to do when there is none.
    pub fn url(&self, role: &Role) -> crate::error::Result<String> {
        self.resolve(role).map(|(url, _)| url)
    }

    /// Connect to the mesh as `role`, naming the connection `name`; exit 3 naming the URL and
    /// where it came from when it cannot be reached.
    pub async fn connect(
        &self,
        role: &Role,
        name: &str,
    ) -> crate::error::Result<async_nats::Client> {
        let (url, from) = self.resolve(role)?;
        let reached =
            crate::transport::connect::reach_from(&url, Some(&from), name, false, refused());
        Ok(reached.await?)
    }

    /// The NATS URL and where it came from; the credentials file taken in on the way.
    pub fn resolve(&self, role: &Role) -> crate::error::Result<(String, String)> {
        use crate::error::Error;
        if let Some(path) = &self.creds
            && crate::local::is_role_file(path)
        {
            if self.nats_url.is_some() {
                return Err(Error::usage(format!(
                    "--creds {} names its mesh already: drop --nats-url",
                    path.display()
                )));
            }
            let file = crate::local::read_role_file(path).map_err(Error::usage)?;
            if let Some(ca) = &file.ca {
                crate::transport::connect::use_ca_file(ca);
            }
            return Ok((
                file.url,
                format!("--creds {} as {}", path.display(), file.user),
            ));
        }
        let (url, from) =
            crate::local::find_cluster(self.nats_url.clone(), self.dir.as_deref(), role)
                .map_err(|why| Error::new(crate::error::Kind::Unreachable, anyhow::anyhow!(why)))?;
        tracing::debug!("NATS {} ({from})", crate::transport::connect::redact(&url));
        if let Some(path) = &self.creds {
            if crate::transport::connect::split_credentials(&url)
                .1
                .is_some()
            {
                return Err(Error::usage(format!(
                    "--creds {} and a user:password in the NATS URL ({from}): give one of them",
                    path.display()
                )));
            }
            crate::transport::connect::use_credentials_file(path).map_err(Error::usage)?;
        }
        Ok((url, from))
    }

    /// The state folder meant: --dir, $OAM_DIR, ./.oam.
    pub fn dir(&self) -> std::path::PathBuf {
        crate::local::cluster_dir(self.dir.as_deref())
    }
}

pub use crate::local::roles::Role;

/// A table for the terminal: `header`, then `rows`, fitted to its width unless `wide` (`fit`).
pub(crate) fn table<R: Into<comfy_table::Row>>(
    header: &[&str],
    rows: impl IntoIterator<Item = R>,
    wide: bool,
) -> comfy_table::Table {
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::UTF8_FULL_CONDENSED);
    t.set_header(header.to_vec());
    for r in rows {
        t.add_row(r);
    }
    // The first column names the row (a code, an id, a name): it is never split.
    if let Some(c) = t.column_mut(0) {
        c.set_constraint(comfy_table::ColumnConstraint::ContentWidth);
    }
    fit(&mut t, wide);
    t
}

/// The terminal's width: `$COLUMNS`, or the terminal's when stdout is one; none when piped.
pub(crate) fn width() -> Option<u16> {
    use std::io::IsTerminal;
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<u16>().ok())
        .or_else(|| {
            std::io::stdout()
                .is_terminal()
                .then(|| ratatui::crossterm::terminal::size().ok().map(|(w, _)| w))
                .flatten()
        })
}

/// Fit a table to the terminal: cells wrap to its width (`$COLUMNS`, or the terminal's when
/// stdout is one), unless `wide`. Piped output without `$COLUMNS` keeps whole lines.
pub(crate) fn fit(t: &mut comfy_table::Table, wide: bool) {
    if wide {
        return;
    }
    if let Some(w) = width() {
        t.set_content_arrangement(comfy_table::ContentArrangement::Dynamic);
        t.set_width(w);
    }
}
