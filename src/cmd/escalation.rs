//! `oam escalation list|resolve`: what waits for a human, and saying it has been seen to.

use crate::error::{Error, Kind, Result};
use crate::transport::store::escalations::{self, EscalationRecord, Mark, Resolved, Status};
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// The open escalations, oldest first (`--all`: resolved ones too).
    List(ListArgs),
    /// Mark escalations resolved: by id, every open one of an agent, or all open ones.
    Resolve(ResolveArgs),
    /// Say someone is on it (it stays open, and `list` says who): by id, agent, or all.
    Ack(ResolveArgs),
}

#[derive(clap::Args, Debug)]
pub struct ListArgs {
    /// Resolved escalations too.
    #[arg(long)]
    pub all: bool,
    /// Only this agent's.
    #[arg(long)]
    pub agent: Option<String>,
    /// Whole lines, however wide (by default the table wraps to the terminal).
    #[arg(long)]
    pub wide: bool,
    /// One JSON array of records.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

#[derive(clap::Args, Debug)]
pub struct ResolveArgs {
    /// Escalation ids (`oam escalation list` shows them).
    #[arg(required_unless_present_any = ["all", "agent"])]
    pub ids: Vec<String>,
    /// Every open escalation.
    #[arg(long, conflicts_with = "ids")]
    pub all: bool,
    /// Every open escalation of this agent.
    #[arg(long, conflicts_with = "ids")]
    pub agent: Option<String>,
    /// A name to record beside the NATS user the command connects as (the record always names
    /// that user: the server vouches for it, not for this flag).
    #[arg(long)]
    pub by: Option<String>,
    /// What was done about it.
    #[arg(long)]
    pub note: Option<String>,
    /// One JSON object: {resolved, already, unknown, failed} (`ack`: {acknowledged, already,
    /// unknown, failed}).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

pub async fn run(args: Args) -> Result<()> {
    match args.command {
        Command::List(a) => list(a).await,
        Command::Resolve(a) => resolve(a, Mark::Resolved).await,
        Command::Ack(a) => resolve(a, Mark::Acknowledged).await,
    }
}

async fn open_store(
    cluster: &super::ClusterArgs,
    role: &super::Role,
    name: &str,
) -> Result<async_nats::jetstream::kv::Store> {
    let nats = cluster.connect(role, name).await?;
    escalations::store(&nats).await.map_err(|e| {
        Error::new(
            Kind::Unreachable,
            anyhow::Error::from(e).context(format!(
                "cannot open the escalation store ({}); it needs JetStream on the NATS server, \
                 which `oam mesh up` starts with it",
                escalations::BUCKET
            )),
        )
    })
}

/// Who resolves: the NATS user this command connects as (what the server authenticated), and
/// the `--by` name beside it when one is given.
fn resolver(cluster: &super::ClusterArgs, by: Option<&str>) -> String {
    let user = cluster
        .url(&super::Role::Operator)
        .ok()
        .and_then(|url| crate::transport::connect::split_credentials(&url).1)
        .map_or_else(|| "a NATS credentials file's user".into(), |(user, _)| user);
    match by {
        Some(name) if name != user => format!("{user} ({name})"),
        _ => user,
    }
}

async fn list(a: ListArgs) -> Result<()> {
    let store = open_store(&a.cluster, &super::Role::Viewer, "oam-escalation-list").await?;
    let (records, unreadable) = escalations::all_checked(&store)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    if !unreadable.is_empty() {
        eprintln!(
            "oam: {} entries of {} are not escalation records and are not listed: {}",
            unreadable.len(),
            escalations::BUCKET,
            unreadable.join(", ")
        );
    }
    let records: Vec<EscalationRecord> = records
        .into_iter()
        .filter(|r| (a.all || r.status == Status::Open) && of_agent(r, a.agent.as_deref()))
        .collect();
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&records).map_err(Error::failed)?
        )?;
        return Ok(());
    }
    if records.is_empty() {
        let what = if a.all {
            "no escalations"
        } else {
            "no open escalations: nothing needs a human"
        };
        writeln!(out, "{what}")?;
        return Ok(());
    }
    let now = crate::clock::now_ms();
    // On a narrow terminal the node and task columns go (the id names both) and the reason
    // loses its `ESCALATED_` prefix; --wide shows everything whole.
    let full = a.wide || super::width().is_none_or(|w| w >= 110);
    let mut header = vec!["id", "age"];
    if full {
        header.extend(["node", "agent", "task"]);
    } else {
        header.push("agent");
    }
    header.extend(["reason", "action"]);
    if a.all {
        header.push("status");
    }
    let mut rows = Vec::new();
    for r in &records {
        let e = &r.escalation;
        let reason = e.reason_codes.last().map_or("", |c| c.as_str());
        let mut row = vec![e.id.clone(), age(now.saturating_sub(e.created_at_ms))];
        // A target's configuration fault is nobody's request: the target stands in.
        let who = match (&e.target, e.agent.is_empty()) {
            (Some(t), true) => format!("target {t}"),
            _ => e.agent.clone(),
        };
        if full {
            row.extend([r.node.clone(), who, e.task.clone()]);
        } else {
            row.push(who);
        }
        row.push(if full {
            reason.to_string()
        } else {
            reason.trim_start_matches("ESCALATED_").to_string()
        });
        row.push(if a.wide {
            e.recommended_action.as_str().to_string()
        } else {
            action_word(e.recommended_action).to_string()
        });
        if a.all {
            row.push(match (&r.status, &r.resolved_by) {
                (Status::Open, _) => match &r.acknowledged_by {
                    Some(by) => format!("open, {by} on it"),
                    None => "open".to_string(),
                },
                (Status::Resolved, Some(by)) => format!("resolved by {by}"),
                (Status::Resolved, None) => "resolved".to_string(),
            });
        }
        rows.push(row);
    }
    writeln!(out, "{}", super::table(&header, rows, a.wide))?;
    let open = records.iter().filter(|r| r.status == Status::Open).count();
    writeln!(
        out,
        "{open} open; `oam escalation resolve ID --note ...` once seen to"
    )?;
    Ok(())
}

/// Whether `r` is `agent`'s (every record is, without an agent).
fn of_agent(r: &EscalationRecord, agent: Option<&str>) -> bool {
    agent.is_none_or(|x| x == r.escalation.agent)
}

/// The recommended action in a word or two, as `oam watch` shows it (`--wide` and `--json`
/// give the full name).
fn action_word(a: crate::core::reason::Action) -> &'static str {
    match a {
        crate::core::reason::Action::HumanReview => "review",
        crate::core::reason::Action::HumanReviewBlockAutomaticAction => "review+block",
    }
}

fn age(ms: u64) -> String {
    match ms / 1_000 {
        s if s < 120 => format!("{s}s"),
        s if s < 7_200 => format!("{}m", s / 60),
        s => format!("{}h", s / 3_600),
    }
}

async fn resolve(a: ResolveArgs, how: Mark) -> Result<()> {
    let verb = match how {
        Mark::Resolved => "resolved",
        Mark::Acknowledged => "acknowledged",
    };
    let store = open_store(&a.cluster, &super::Role::Operator, "oam-escalation-resolve").await?;
    let ids: Vec<String> = if a.ids.is_empty() {
        escalations::all(&store)
            .await
            .map_err(|e| Error::new(Kind::Unreachable, e))?
            .into_iter()
            .filter(|r| r.status == Status::Open && of_agent(r, a.agent.as_deref()))
            .map(|r| r.escalation.id)
            .collect()
    } else {
        a.ids.clone()
    };
    let by = resolver(&a.cluster, a.by.as_deref());
    let (mut resolved, mut already, mut unknown) = (Vec::new(), Vec::new(), Vec::new());
    let mut failed = Vec::new();
    for id in &ids {
        let now = crate::clock::now_ms();
        match escalations::mark(&store, id, how, &by, a.note.as_deref(), now).await {
            Ok(Resolved::Now(_)) => resolved.push(id.clone()),
            Ok(Resolved::Already(_)) => already.push(id.clone()),
            Ok(Resolved::Unknown) => unknown.push(id.clone()),
            Err(e) => failed.push(format!("{id}: {e:#}")),
        }
    }
    let mut out = std::io::stdout().lock();
    if a.json {
        let doc = serde_json::json!({
            verb: resolved, "already": already, "unknown": unknown, "failed": failed,
        });
        writeln!(out, "{doc}")?;
    } else {
        for id in &resolved {
            writeln!(out, "{verb} {id} (by {by})")?;
        }
        for id in &already {
            writeln!(out, "{id} was already {verb}")?;
        }
        if ids.is_empty() {
            writeln!(out, "no open escalations to mark {verb}")?;
        }
    }
    if !failed.is_empty() {
        return Err(Error::new(
            Kind::Unreachable,
            anyhow::anyhow!(
                "not {verb} (the others were): {}; run the command again",
                failed.join("; ")
            ),
        ));
    }
    if !unknown.is_empty() {
        return Err(Error::new(
            Kind::Usage,
            anyhow::anyhow!(
                "no escalation {} (they expire after {} h); `oam escalation list --all` shows what there is",
                unknown.join(", "),
                escalations::MAX_AGE.as_secs() / 3_600
            ),
        ));
    }
    Ok(())
}
