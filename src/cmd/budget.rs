//! `oam budget list|set|reset|remove`: the cluster's shared budgets, as every node enforces
//! them (the `oam-budgets` ledger, see `node::ledger`).

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
    /// Every budget: limit, spent, held by attempts under way (per node), remaining.
    List(ListArgs),
    /// Set a budget's limit (creating it): `oam budget set support-bot --limit 5`, or `--global`.
    Set(SetArgs),
    /// Forget what a budget has spent (holds of attempts under way stay).
    Reset(Which),
    /// Remove a budget: the agent (or everyone, `--global`) is no longer limited. A node
    /// whose `oam.toml` names it puts it back when it starts.
    Remove(Which),
}

#[derive(clap::Args, Debug)]
pub struct ListArgs {
    /// One JSON array: {agent (null: global), limit_usd, spent_usd, held_usd, remaining_usd,
    /// holds, refused (the exhaustion episode under way: at_ms, node, escalation,
    /// estimate_usd, remaining_usd; null when none)}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

#[derive(clap::Args, Debug)]
pub struct Which {
    /// The agent whose budget it is.
    #[arg(required_unless_present = "global")]
    pub agent: Option<String>,
    /// The global budget (every agent's spend together).
    #[arg(long, conflicts_with = "agent")]
    pub global: bool,
    /// The budget as it is afterwards, as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

#[derive(clap::Args, Debug)]
pub struct SetArgs {
    #[command(flatten)]
    pub which: Which,
    /// The limit in US dollars.
    #[arg(long, value_parser = parse_usd)]
    pub limit: f64,
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
            let limit = a.limit;
            change(a.which, true, move |l| l.limit_usd = limit).await
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
                e.context(format!(
                    "cannot open the budget ledger ({BUDGETS_BUCKET}); it needs JetStream on the \
                     NATS server, which `oam mesh up` starts with it"
                )),
            )
        })
}

fn row_json(l: &Ledger, now: u64) -> serde_json::Value {
    serde_json::json!({
        "agent": l.agent,
        "limit_usd": l.limit_usd,
        "spent_usd": l.spent_usd,
        "held_usd": l.held_usd(now, None),
        "remaining_usd": l.remaining_usd(now),
        "holds": l.holds.iter().filter(|(_, h)| h.until_ms > now).map(|(n, h)| (n.clone(), h.usd)).collect::<std::collections::BTreeMap<_, _>>(),
        "refused": l.refused,
    })
}

/// Every budget record by key (`global`, `agent.{name}`), and what health probes cost by UTC
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
    // The global budget first, then agents by name.
    ledgers.sort_by(|x, y| x.agent.cmp(&y.agent));
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
            "no budgets: nobody is limited (`oam budget set AGENT --limit 5` sets one)"
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
            vec![
                l.agent.clone().unwrap_or_else(|| "(global)".into()),
                usd(l.limit_usd),
                usd(l.spent_usd),
                usd(l.held_usd(now, None)),
                usd(l.remaining_usd(now)),
                holds.join(", "),
            ]
        })
        .collect();
    writeln!(
        out,
        "{}",
        super::table(
            &["budget", "limit", "spent", "held", "remaining", "held by"],
            rows,
            false
        )
    )?;
    // An exhaustion under way: why "remaining" is not enough, and what ends it.
    for l in &ledgers {
        if let Some(r) = &l.refused {
            let (name, which) = match &l.agent {
                Some(a) => (a.clone(), a.clone()),
                None => ("the global budget".into(), "--global".into()),
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
    let agent = if w.global { None } else { w.agent.clone() };
    let k = key(agent.as_deref());
    match crate::transport::store::ledger::change(&store, agent.as_deref(), create, f).await {
        Ok(ledger) => print_one(&ledger, w.json),
        Err(ChangeError::Missing) => Err(Error::new(
            Kind::Usage,
            anyhow::anyhow!(
                "there is no budget {}; `oam budget set` makes one",
                agent.as_deref().unwrap_or("(global)")
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
    let agent = if w.global { None } else { w.agent.clone() };
    let k = key(agent.as_deref());
    let exists = store
        .get(&k)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, anyhow::anyhow!("{k}: {e}")))?
        .is_some();
    let name = agent.as_deref().unwrap_or("(global)");
    if !exists {
        return Err(Error::new(
            Kind::Usage,
            anyhow::anyhow!("there is no budget {name}"),
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
            serde_json::json!({"removed": agent, "global": w.global})
        )?;
    } else {
        writeln!(out, "removed the budget {name}: no longer limited")?;
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
        writeln!(
            out,
            "{}: limit {}, spent {}, held {}, remaining {}",
            l.agent.as_deref().unwrap_or("(global)"),
            dollars(l.limit_usd, 4),
            dollars(l.spent_usd, 4),
            dollars(l.held_usd(now, None), 4),
            dollars(l.remaining_usd(now), 4)
        )?;
    }
    Ok(())
}
