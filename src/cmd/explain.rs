//! `oam explain REQUEST_ID`: a decision from the decision log, replayed through the core and
//! told step by step in plain words; exit 1 if the replay does not give the recorded decision
//! byte for byte.

use crate::core::pipeline::{Attempt, Decision, Evaluation};
use crate::core::record::{Call, Record};
use crate::error::{Error, Findings, Result};
use std::fmt::Write as _;
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The request id (the `x-request-id` header of the answer, `oam.request_id` in its body).
    pub request_id: String,
    /// How far back to look for it: e.g. 30m, 2h, 7d.
    #[arg(long, default_value = "1d", value_parser = super::audit::parse_age)]
    pub since: u64,
    /// Of several records with this id (a client may send its own id twice), the one decided
    /// at this time (ms since the epoch, as the list of them shows). Default: the newest.
    #[arg(long, value_name = "MS")]
    pub at: Option<u64>,
    /// One JSON object: {record, replay: {identical, difference?}, records} (records: every
    /// record with this id, {node, decided_at_ms, outcome}).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

pub async fn run(a: Args) -> Result<Findings> {
    let this = |r: &Record| r.decision.request_id == a.request_id;
    // A node's own ids are `{node}-{run}-{n}`: that node's records alone are read first.
    let node = a
        .request_id
        .rsplitn(3, '-')
        .collect::<Vec<_>>()
        .as_slice()
        .try_into()
        .ok()
        .filter(|[serial, run, n]: &[&str; 3]| {
            !serial.is_empty()
                && serial.bytes().all(|b| b.is_ascii_digit())
                && run.len() == 6
                && run.bytes().all(|b| b.is_ascii_hexdigit())
                && crate::transport::subjects::valid_token(n)
        })
        .map(|[_, _, n]| n);
    let mut entries = Vec::new();
    if let Some(n) = node {
        entries = super::audit::read(&a.cluster, a.since, Some(n), this, usize::MAX)
            .await?
            .0;
    }
    if entries.is_empty() {
        entries = super::audit::read(&a.cluster, a.since, None, this, usize::MAX)
            .await?
            .0;
    }
    if entries.is_empty() {
        // What bounds the log says whether to search further or that the record is gone.
        let nats = a
            .cluster
            .connect(&super::Role::Viewer, "oam-explain")
            .await?;
        let why = match crate::transport::store::decisions::span(&nats).await {
            Ok(span) => span.why_missing(a.since, crate::clock::now_ms()),
            Err(_) => "try --since 7d".into(),
        };
        return Err(Error::usage(format!(
            "no decision for request {} in the decision log of the last {}: {why} (`oam audit` \
             lists what is there)",
            a.request_id,
            super::audit::age(a.since)
        )));
    }
    let when = |e: &crate::transport::store::decisions::Stored| e.record.decision.decided_at_ms;
    let entry = match a.at {
        None => entries.last(),
        Some(at) => entries.iter().find(|e| when(e) == at),
    };
    let Some(entry) = entry else {
        let times: Vec<String> = entries.iter().map(|e| when(e).to_string()).collect();
        return Err(Error::usage(format!(
            "no record of request {} was decided at {}; its records were decided at {}",
            a.request_id,
            a.at.unwrap_or_default(),
            times.join(", ")
        )));
    };
    let others: Vec<serde_json::Value> = entries
        .iter()
        .map(|e| {
            serde_json::json!({"node": e.record.node, "decided_at_ms": when(e),
                "outcome": e.record.decision.outcome})
        })
        .collect();
    let replay = entry.record.verify(&entry.config);
    let mut out = std::io::stdout().lock();
    if a.json {
        let doc = serde_json::json!({
            "record": entry.record,
            "replay": match &replay {
                Ok(()) => serde_json::json!({"identical": true}),
                Err(why) => {
                    serde_json::json!({"identical": false, "difference": why.to_string()})
                }
            },
            "records": others,
        });
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&doc).map_err(Error::failed)?
        )?;
    } else {
        if entries.len() > 1 {
            writeln!(
                out,
                "{} records have request id {} (the id was sent more than once):",
                entries.len(),
                a.request_id
            )?;
            for e in &entries {
                let chosen = if std::ptr::eq(e, entry) {
                    "  <- told below"
                } else {
                    ""
                };
                writeln!(
                    out,
                    "  decided at {} on {}: {:?}{chosen}",
                    when(e),
                    e.record.node,
                    e.record.decision.outcome
                )?;
            }
            let which = if a.at.is_some() {
                "the one asked for"
            } else {
                "the newest"
            };
            writeln!(out, "telling {which}; --at MS tells another\n")?;
        }
        write!(out, "{}", tell(&entry.record))?;
        match &replay {
            Ok(()) => writeln!(
                out,
                "replay: the core, given what it saw, decides the same, byte for byte"
            )?,
            Err(why) => writeln!(out, "replay: DIFFERS from the recorded decision\n{why}")?,
        }
    }
    Ok(match replay {
        Ok(()) => Findings::Ok,
        Err(_) => Findings::Failed(vec![format!(
            "{}: the replay does not give the recorded decision",
            a.request_id
        )]),
    })
}

fn usd(v: f64) -> String {
    crate::core::request::dollars(v, 6)
}

fn pct(v: f64) -> String {
    format!("{:.0}%", v * 100.0)
}

/// The record in plain words, one step per paragraph.
pub fn tell(r: &Record) -> String {
    let d = &r.decision;
    let q = &r.request;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "request {} from agent {} (task {:?}, risk {}, priority {}) on node {}, model {}",
        d.request_id,
        q.agent,
        q.task,
        serde_json::to_value(q.risk)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        serde_json::to_value(q.priority)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        r.node,
        q.model.as_deref().unwrap_or("auto"),
    );
    if r.content_hashed {
        let _ = writeln!(s, "  (its messages were kept as hashes only)");
    }
    // Admission.
    let class = q.priority;
    let (pool, kind) = if q.stream {
        (&r.begin.state.stream_bulkheads, "streams")
    } else {
        (&r.begin.state.bulkheads, "short requests")
    };
    let usage = pool.usage(class);
    let queued = r.calls.iter().any(|l| l.call == Call::Dequeue);
    let _ = writeln!(
        s,
        "\nadmission: {} ({} running and {} queued in its class of {kind} when it arrived){}",
        if d.phase == crate::core::reason::Phase::Admission {
            "refused"
        } else {
            "admitted"
        },
        usage.active,
        usage.queued,
        if queued {
            "; it waited in the queue for a slot"
        } else {
            ""
        }
    );
    // Loop check.
    let fp = crate::core::record::fingerprint(q);
    let entry = r.begin.state.loops.get(&fp);
    let _ = writeln!(
        s,
        "loop check: call {fp} had {} failure(s) in the window{}",
        entry.map_or(0, |e| e.failures.len()),
        match entry.and_then(|e| e.episode.as_ref()) {
            Some(ep) => format!("; its loop episode {} was open", ep.incident.id),
            None => String::new(),
        }
    );
    // Budgets.
    let b = &r.begin.state.budgets;
    let at = r.began_ms;
    for (kind, name, x) in b.covering(q) {
        let owner = crate::core::budget::Owner::new(kind, name);
        let mode = match x.on_exceeded {
            crate::core::budget::OnExceeded::Refuse => String::new(),
            m => format!(", on exceeding: {}", m.as_str()),
        };
        let lifted = match x.overridden {
            Some(o) if at < o.until_ms => format!(
                ", overridden to {} until {}",
                usd(o.limit_usd),
                crate::core::date::rfc3339(o.until_ms / 1_000)
            ),
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "budget {owner}: {} of {} remaining (spent or held elsewhere {}, held here {}){mode}{lifted}",
            usd(x.remaining_usd(at)),
            usd(x.limit_at(at)),
            usd(x.spent_usd),
            usd(x.reserved_usd)
        );
    }
    for a in &d.attempts {
        s.push_str(&attempt(a));
    }
    for l in &r.calls {
        let what = match &l.call {
            Call::CallerGone => Some("the caller went away"),
            Call::Abandon => Some("it gave up waiting for a slot"),
            Call::Withdraw => Some("the attempt waiting to start was not made"),
            Call::Interrupted => Some("the stream broke after part of the answer was delivered"),
            Call::RefuseReservation { .. } => {
                Some("the shared budget ledger would not hold the attempt")
            }
            _ => None,
        };
        if let Some(w) = what {
            let _ = writeln!(s, "  at +{} ms: {w}", l.at_ms.saturating_sub(r.began_ms));
        }
    }
    let served_by = d.served_by();
    if served_by.len() > 1 {
        let _ = writeln!(
            s,
            "\nthe answer was served by {} (continued after a cut), {} in all",
            served_by.join(" then "),
            usd(d.cost_usd)
        );
    }
    if let Some(sf) = &d.shortfall {
        let _ = writeln!(s, "\nbudget refused it: {}", sf.describe());
    }
    s.push_str(&verdict(d));
    s
}

fn candidate(c: &Evaluation, chosen: bool) -> String {
    let mut line = format!(
        "    {:<14} {:<9} {}/{} votes{} availability {} p95 {} ms contract failures {:.1}% est {}",
        c.provider.to_string(),
        c.verdict.as_str(),
        c.votes,
        c.cluster_size,
        if c.quorum { "" } else { " (no quorum)" },
        pct(c.availability),
        c.p95_ms,
        c.contract_failure_pct,
        usd(c.est_cost_usd)
    );
    match (&c.excluded, &c.score) {
        (Some(why), _) => {
            let _ = write!(line, "  excluded: {}", why.as_str());
        }
        (None, Some(p)) => {
            let _ = write!(
                line,
                "  score {:.1} = availability {:.1} + latency {:.1} + health {:.1} + contract {:.1} + cost {:.1} + fallback {:.1}",
                p.total, p.availability, p.latency, p.health, p.contract, p.cost, p.fallback
            );
        }
        (None, None) => {}
    }
    if !c.notes.is_empty() {
        let notes: Vec<&str> = c.notes.iter().map(|n| n.as_str()).collect();
        let _ = write!(line, " [{}]", notes.join(", "));
    }
    if chosen {
        line.push_str("  <- chosen");
    }
    line.push('\n');
    line
}

fn attempt(a: &Attempt) -> String {
    let mut s = format!(
        "\nattempt {}{}: {} candidate(s)\n",
        a.n,
        if a.same_target {
            " (retry on the same target)"
        } else {
            ""
        },
        a.candidates.len()
    );
    for c in &a.candidates {
        s.push_str(&candidate(c, a.provider.as_ref() == Some(&c.provider)));
    }
    match (&a.provider, a.status) {
        (Some(p), Some(st)) => {
            let _ = writeln!(
                s,
                "  -> {p}{}{}{}: {} in {} ms, cost {}{}",
                if a.fallback { " (fallback)" } else { "" },
                if a.probe { " (breaker probe)" } else { "" },
                if a.delivered {
                    " (delivered part of the answer)"
                } else {
                    ""
                },
                serde_json::to_value(st)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default(),
                a.latency_ms,
                usd(a.cost_usd),
                a.confidence
                    .map(|c| format!(", confidence {c:.2}"))
                    .unwrap_or_default()
            );
        }
        (Some(p), None) => {
            let _ = writeln!(s, "  -> {p}: not called");
        }
        (None, _) => {
            let _ = writeln!(s, "  -> no target could serve it");
        }
    }
    if let Some(u) = &a.agent_usage {
        let count = |n: Option<u64>| n.map_or_else(|| "?".to_string(), |n| n.to_string());
        let _ = writeln!(
            s,
            "  the agent reported its model use (X-Mesh-Usage): {} tokens in, {} out{}; {}",
            count(u.input_tokens),
            count(u.output_tokens),
            u.model
                .as_deref()
                .map(|m| format!(" of {m}"))
                .unwrap_or_default(),
            match u.usd {
                Some(v) => format!("{} of the cost is its", usd(v)),
                None => "unpriced, nothing charged for it".into(),
            }
        );
    }
    for d in &a.defects {
        let _ = writeln!(s, "  validation: {} ({})", d.code.as_str(), d.detail);
    }
    if !a.codes.is_empty() {
        let codes: Vec<&str> = a.codes.iter().map(|c| c.as_str()).collect();
        let _ = writeln!(s, "  codes: {}", codes.join(", "));
    }
    s
}

fn verdict(d: &Decision) -> String {
    let codes: Vec<&str> = d.reason_codes.iter().map(|c| c.as_str()).collect();
    let mut s = format!(
        "\ndecision: {} in phase {}{}, cost {}\n  reason codes: {}\n",
        d.outcome.as_str().to_uppercase(),
        d.phase,
        d.provider
            .as_ref()
            .map(|p| format!(", answered by {p}"))
            .unwrap_or_default(),
        usd(d.cost_usd),
        codes.join(", ")
    );
    for c in &d.reason_codes {
        let _ = writeln!(s, "    {:<32} {}", c.as_str(), c.meaning());
    }
    if let Some(e) = &d.escalation {
        let _ = writeln!(
            s,
            "  escalated to a human: {} ({})",
            e.id,
            e.recommended_action.as_str()
        );
    }
    if let Some(i) = &d.incident {
        let _ = writeln!(s, "  loop incident: {} ({} failures)", i.id, i.failures);
    }
    s
}

#[cfg(test)]
mod tests {
    use crate::core::pipeline::tests::{engine, recorded_answer};

    #[test]
    fn a_confidence_is_told_as_people_write_it() {
        let mut e = engine();
        let answer = r#"{"answer":"42","confidence":0.9199999999999999}"#;
        let told = super::tell(&recorded_answer(&mut e, "r1", 10, answer));
        assert!(told.contains("confidence 0.92"), "{told}");
        assert!(!told.contains("0.9199"), "{told}");
        assert!(!told.contains("$-"), "{told}");
    }
}
