//! `oam budget list|set|reset|remove`: the cluster's shared budgets, as every node enforces
//! them (the `oam-budgets` ledger, see `node::ledger`). A budget covers a scope: `global`,
//! `team:NAME`, `agent:NAME` (a client key's id is its agent: `key:NAME` is the same budget),
//! or `task:NAME`; a bare name is an agent's.

use crate::core::budget::{OnExceeded, Override, Owner};
use crate::core::ledger::Ledger;
use crate::error::{Error, Kind, Result};
use crate::transport::store::ledger::key;
use crate::transport::subjects::BUDGETS_BUCKET;
use async_nats::jetstream::kv;
use std::collections::BTreeMap;
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Every budget: scope, limit (and an override under way), spent, held by attempts under
    /// way (per node), remaining, what it does when exceeded, and audit-mode would-refusals.
    List(ListArgs),
    /// Set a budget (creating it): `oam budget set team:support --limit 50`, a temporary
    /// `--override 80 --for 2h`, or `--on-exceeded audit` to try a limit without refusing.
    Set(SetArgs),
    /// Forget what a budget has spent (holds of attempts under way stay).
    Reset(Which),
    /// Remove a budget: what it covered is no longer limited by it. A node whose `oam.toml`
    /// names it puts it back when it starts.
    Remove(Which),
}

#[derive(clap::Args, Debug)]
pub struct ListArgs {
    /// One JSON array: {scope, agent|team|task (null for global), limit_usd, override
    /// ({limit_usd, until_ms}, while it stands), on_exceeded, would_refuse, spent_usd,
    /// held_usd, remaining_usd, holds, refused (the exhaustion episode under way: at_ms,
    /// node, escalation, estimate_usd, remaining_usd; null when none)}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

#[derive(clap::Args, Debug)]
pub struct Which {
    /// The budget: global, team:NAME, agent:NAME (or key:NAME, the same), task:NAME, or an
    /// agent's bare name.
    #[arg(required_unless_present_any = ["global", "scope"], value_parser = parse_owner)]
    pub budget: Option<Owner>,
    /// The same, named as a flag.
    #[arg(long, conflicts_with = "budget", value_parser = parse_owner)]
    pub scope: Option<Owner>,
    /// The global budget (every request's spend together): `global`.
    #[arg(long, conflicts_with_all = ["budget", "scope"])]
    pub global: bool,
    /// The budget as it is afterwards, as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

impl Which {
    fn owner(&self) -> Owner {
        match (&self.budget, &self.scope) {
            (Some(o), _) | (None, Some(o)) => o.clone(),
            (None, None) => Owner::global(),
        }
    }
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("change").multiple(true).required(true)
    .args(["limit", "override_usd", "no_override", "on_exceeded"])))]
pub struct SetArgs {
    #[command(flatten)]
    pub which: Which,
    /// The limit in US dollars (needed to make a budget).
    #[arg(long, value_parser = parse_usd)]
    pub limit: Option<f64>,
    /// A limit that stands in for the budget's own for `--for` (then the limit is its own
    /// again, with no one to remember to undo it).
    #[arg(long = "override", value_parser = parse_usd, requires = "override_for")]
    pub override_usd: Option<f64>,
    /// How long the override stands: e.g. 30m, 2h, 7d.
    #[arg(long = "for", value_parser = super::audit::parse_age, requires = "override_usd")]
    pub override_for: Option<u64>,
    /// End an override under way.
    #[arg(long, conflicts_with = "override_usd")]
    pub no_override: bool,
    /// What an attempt the budget cannot cover gets: refused (a high-risk one escalated),
    /// escalated (refused and escalated, whatever its risk), or audit (let through, recorded
    /// as BUDGET_WOULD_REFUSE and counted).
    #[arg(long, value_enum)]
    pub on_exceeded: Option<Mode>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Mode {
    Refuse,
    Escalate,
    Audit,
}

impl From<Mode> for OnExceeded {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Refuse => OnExceeded::Refuse,
            Mode::Escalate => OnExceeded::Escalate,
            Mode::Audit => OnExceeded::Audit,
        }
    }
}

fn parse_owner(s: &str) -> std::result::Result<Owner, super::BadValue> {
    Owner::parse(s).map_err(|e| super::BadValue(e.to_string()))
}

fn parse_usd(s: &str) -> std::result::Result<f64, super::BadValue> {
    let v: f64 = s
        .trim_start_matches('$')
        .parse()
        .map_err(|_| format!("{s:?} is not an amount in dollars (e.g. 5 or 0.25)"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(super::BadValue(format!(
            "{s:?}: a limit is a finite amount, zero or more"
        )))
    }
}

pub async fn run(args: Args) -> Result<()> {
    match args.command {
        Command::List(a) => list(a).await,
        Command::Set(a) => {
            let now = crate::clock::now_ms();
            let (limit, mode, no_override) = (a.limit, a.on_exceeded, a.no_override);
            let lifted = a
                .override_usd
                .zip(a.override_for)
                .map(|(usd, ms)| Override {
                    limit_usd: usd,
                    until_ms: now.saturating_add(ms),
                });
            change(a.which, limit.is_some(), move |l| {
                if let Some(v) = limit {
                    l.limit_usd = v;
                }
                if let Some(m) = mode {
                    l.on_exceeded = m.into();
                }
                if lifted.is_some() || no_override {
                    l.overridden = lifted;
                }
            })
            .await
        }
        Command::Reset(w) => change(w, false, Ledger::reset_spent).await,
        Command::Remove(w) => remove(w).await,
    }
}

async fn open(cluster: &super::ClusterArgs, role: &super::Role, name: &str) -> Result<kv::Store> {
    open_on(&cluster.connect(role, name).await?).await
}

/// The ledger's bucket on a connection already made.
pub(crate) async fn open_on(nats: &async_nats::Client) -> Result<kv::Store> {
    crate::transport::store::bucket(nats, BUDGETS_BUCKET, std::time::Duration::ZERO)
        .await
        .map_err(|e| {
            Error::new(
                Kind::Unreachable,
                anyhow::Error::from(e).context(format!(
                    "cannot open the budget ledger ({BUDGETS_BUCKET}); it needs JetStream on the \
                     NATS server, which `oam mesh up` starts with it"
                )),
            )
        })
}

/// The override of `l` while it stands at `now`.
fn standing(l: &Ledger, now: u64) -> Option<Override> {
    l.overridden.filter(|o| now < o.until_ms)
}

fn row_json(l: &Ledger, now: u64) -> serde_json::Value {
    serde_json::json!({
        "scope": l.owner().to_string(),
        "agent": l.agent,
        "team": l.team,
        "task": l.task,
        "limit_usd": l.limit_usd,
        "override": standing(l, now),
        "on_exceeded": l.on_exceeded.as_str(),
        "would_refuse": l.would_refuse,
        "spent_usd": l.spent_usd,
        "held_usd": l.held_usd(now, None),
        "remaining_usd": l.remaining_usd(now),
        "holds": l.holds.iter().filter(|(_, h)| h.until_ms > now).map(|(n, h)| (n.clone(), h.usd)).collect::<std::collections::BTreeMap<_, _>>(),
        "refused": l.refused,
    })
}

/// Every budget record by key (`global`, `agent.{name}`, ...), and what health probes cost by UTC
/// day. A record that is not a budget is said on stderr and left out.
pub(crate) async fn read_all(
    store: &kv::Store,
) -> Result<(BTreeMap<String, Ledger>, Vec<(String, Ledger)>)> {
    let read = crate::transport::store::ledger::read_all(store, std::time::Duration::from_secs(5))
        .await
        .map_err(|e| {
            Error::new(
                Kind::Unreachable,
                anyhow::anyhow!("cannot read the budgets: {e:#}"),
            )
        })?;
    for (k, e) in &read.unreadable {
        eprintln!("oam: {BUDGETS_BUCKET} key {k} is not a budget ({e}); not listed");
    }
    Ok((read.budgets, read.probe_days))
}

async fn list(a: ListArgs) -> Result<()> {
    let store = open(&a.cluster, &super::Role::Viewer, "oam-budget-list").await?;
    let (ledgers, mut probe_days) = read_all(&store).await?;
    let mut ledgers: Vec<Ledger> = ledgers.into_values().collect();
    // Narrowest scope first (tasks, agents, teams, global), each by name.
    ledgers.sort_by_key(Ledger::owner);
    let now = crate::clock::now_ms();
    let mut out = std::io::stdout().lock();
    probe_days.sort_by(|x, y| y.0.cmp(&x.0));
    if a.json {
        let mut rows: Vec<_> = ledgers.iter().map(|l| row_json(l, now)).collect();
        rows.extend(probe_days.iter().map(|(day, l)| {
            serde_json::json!({"probes_day": day, "spent_usd": l.spent_usd,
                               "cap_usd": (l.limit_usd > 0.0).then_some(l.limit_usd)})
        }));
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&rows).map_err(Error::failed)?
        )?;
        return Ok(());
    }
    let usd = |v: f64| crate::core::request::dollars(v, 4);
    // The last few days of what probes cost, newest first.
    let probes_said = |out: &mut std::io::StdoutLock| -> std::io::Result<()> {
        for (day, l) in probe_days.iter().take(3) {
            let cap = if l.limit_usd > 0.0 {
                format!("of a {} cap", usd(l.limit_usd))
            } else {
                "(no cap: [probes] max_usd_per_day sets one)".into()
            };
            writeln!(
                out,
                "health probes on {day} (UTC): {} spent {cap}",
                usd(l.spent_usd)
            )?;
        }
        Ok(())
    };
    if ledgers.is_empty() {
        writeln!(
            out,
            "no budgets: nobody is limited (`oam budget set team:NAME --limit 5` sets one)"
        )?;
        probes_said(&mut out)?;
        return Ok(());
    }
    let rows: Vec<Vec<String>> = ledgers
        .iter()
        .map(|l| {
            let holds: Vec<String> = l
                .holds
                .iter()
                .filter(|(_, h)| h.until_ms > now)
                .map(|(n, h)| format!("{n} {}", usd(h.usd)))
                .collect();
            let limit = match standing(l, now) {
                Some(o) => format!(
                    "{} (own {}, until {})",
                    usd(o.limit_usd),
                    usd(l.limit_usd),
                    crate::core::date::rfc3339(o.until_ms / 1_000)
                ),
                None => usd(l.limit_usd),
            };
            let exceeded = match l.on_exceeded {
                OnExceeded::Audit => format!("audit ({} would refuse)", l.would_refuse),
                m => m.as_str().to_string(),
            };
            vec![
                l.owner().to_string(),
                limit,
                usd(l.spent_usd),
                usd(l.held_usd(now, None)),
                usd(l.remaining_usd(now)),
                exceeded,
                holds.join(", "),
            ]
        })
        .collect();
    writeln!(
        out,
        "{}",
        super::table(
            &[
                "budget",
                "limit",
                "spent",
                "held",
                "remaining",
                "when exceeded",
                "held by"
            ],
            rows,
            false
        )
    )?;
    // An exhaustion under way: why "remaining" is not enough, and what ends it.
    for l in &ledgers {
        if let Some(r) = &l.refused {
            let which = l.owner().to_string();
            let name = match l.owner().kind {
                crate::core::budget::Kind::Global => "the global budget".into(),
                _ => which.clone(),
            };
            writeln!(
                out,
                "{name}: refusing for {}: an attempt estimated at {} is more than the {} that was \
                 left (escalated once, {}); `oam budget set {which} --limit USD` or `oam budget \
                 reset {which}` ends it",
                super::audit::age(now.saturating_sub(r.at_ms)),
                usd(r.estimate_usd),
                usd(r.remaining_usd),
                r.escalation
            )?;
        }
    }
    probes_said(&mut out)?;
    Ok(())
}

/// Read, change and write one budget with compare-and-swap (nodes write it concurrently).
async fn change(w: Which, create: bool, f: impl Fn(&mut Ledger)) -> Result<()> {
    use crate::transport::store::ledger::ChangeError;
    let store = open(&w.cluster, &super::Role::Operator, "oam-budget").await?;
    let owner = w.owner();
    let k = key(&owner);
    match crate::transport::store::ledger::change(&store, &owner, create, f).await {
        Ok(ledger) => print_one(&ledger, w.json),
        Err(ChangeError::Missing) => Err(Error::new(
            Kind::Usage,
            anyhow::anyhow!(
                "there is no budget {owner}; `oam budget set {owner} --limit USD` makes one"
            ),
        )),
        Err(ChangeError::Unreadable(e)) => Err(Error::new(
            Kind::Unreachable,
            anyhow::anyhow!("{k}: not a budget record ({e}); `oam budget remove` clears it"),
        )),
        Err(ChangeError::Store(e)) => {
            Err(Error::new(Kind::Unreachable, anyhow::anyhow!("{k}: {e}")))
        }
    }
}

async fn remove(w: Which) -> Result<()> {
    let store = open(&w.cluster, &super::Role::Operator, "oam-budget").await?;
    let owner = w.owner();
    let k = key(&owner);
    let exists = store
        .get(&k)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, anyhow::anyhow!("{k}: {e}")))?
        .is_some();
    if !exists {
        return Err(Error::new(
            Kind::Usage,
            anyhow::anyhow!("there is no budget {owner}"),
        ));
    }
    store
        .delete(&k)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, anyhow::anyhow!("{k}: {e}")))?;
    let mut out = std::io::stdout().lock();
    if w.json {
        writeln!(
            out,
            "{}",
            serde_json::json!({"removed": owner.to_string(), "agent": (owner.kind == crate::core::budget::Kind::Agent).then_some(&owner.name), "global": owner.kind == crate::core::budget::Kind::Global})
        )?;
    } else {
        writeln!(out, "removed the budget {owner}: no longer limited by it")?;
    }
    Ok(())
}

fn print_one(l: &Ledger, json: bool) -> Result<()> {
    use crate::core::request::dollars;
    let now = crate::clock::now_ms();
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", row_json(l, now))?;
    } else {
        let lifted = match standing(l, now) {
            Some(o) => format!(
                " (overridden to {} until {})",
                dollars(o.limit_usd, 4),
                crate::core::date::rfc3339(o.until_ms / 1_000)
            ),
            None => String::new(),
        };
        writeln!(
            out,
            "{}: limit {}{lifted}, spent {}, held {}, remaining {}, when exceeded: {}",
            l.owner(),
            dollars(l.limit_usd, 4),
            dollars(l.spent_usd, 4),
            dollars(l.held_usd(now, None), 4),
            dollars(l.remaining_usd(now), 4),
            l.on_exceeded.as_str()
        )?;
    }
    Ok(())
}
