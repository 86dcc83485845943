//! `oam reasons`: what a reason code means, for the person who just got one in a response.

use crate::core::reason::{Action, Phase, ReasonCode};
use crate::error::{Error, Result};
use serde::Serialize;
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Show only this code (e.g. CIRCUIT_NOT_AVAILABLE); case does not matter.
    pub code: Option<String>,
    /// Show only the codes of this phase (admission, loop, budget, routing, breaker, ...).
    #[arg(long)]
    pub phase: Option<String>,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Whole lines, however wide (by default the table wraps to the terminal).
    #[arg(long)]
    pub wide: bool,
}

#[derive(Serialize)]
struct CodeRow {
    code: ReasonCode,
    phase: Phase,
    meaning: &'static str,
}

#[derive(Serialize)]
struct ActionRow {
    action: Action,
    meaning: &'static str,
}

#[derive(Serialize)]
struct Doc {
    reason_codes: Vec<CodeRow>,
    actions: Vec<ActionRow>,
}

fn action_meaning(a: Action) -> &'static str {
    match a {
        Action::HumanReview => "A human should look at this; automation may continue meanwhile.",
        Action::HumanReviewBlockAutomaticAction => {
            "A human must look at this before anything automatic acts on the request's result."
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    let mut codes: Vec<ReasonCode> = ReasonCode::ALL.to_vec();
    if let Some(want) = &args.code {
        let code = ReasonCode::parse(&want.to_ascii_uppercase()).ok_or_else(|| {
            let close: Vec<&str> = ReasonCode::ALL
                .iter()
                .map(|c| c.as_str())
                .filter(|c| {
                    let w = want.to_ascii_uppercase();
                    c.contains(&w) || w.split('_').any(|part| part.len() > 3 && c.contains(part))
                })
                .collect();
            let hint = if close.is_empty() {
                "run `oam reasons` for the full list".to_string()
            } else {
                format!("did you mean {}?", close.join(", "))
            };
            Error::usage(format!("unknown reason code {want:?}; {hint}"))
        })?;
        codes = vec![code];
    }
    if let Some(want) = &args.phase {
        let phase = Phase::ALL
            .into_iter()
            .find(|p| p.as_str() == want.to_ascii_lowercase())
            .ok_or_else(|| {
                let all: Vec<&str> = Phase::ALL.iter().map(|p| p.as_str()).collect();
                Error::usage(format!(
                    "unknown phase {want:?}; phases are {}",
                    all.join(", ")
                ))
            })?;
        codes.retain(|c| c.phase() == phase);
    }
    let actions = [Action::HumanReview, Action::HumanReviewBlockAutomaticAction];
    let mut out = std::io::stdout().lock();
    if args.json {
        let doc = Doc {
            reason_codes: codes
                .iter()
                .map(|&code| CodeRow {
                    code,
                    phase: code.phase(),
                    meaning: code.meaning(),
                })
                .collect(),
            actions: actions
                .iter()
                .map(|&action| ActionRow {
                    action,
                    meaning: action_meaning(action),
                })
                .collect(),
        };
        serde_json::to_writer_pretty(&mut out, &doc).map_err(Error::failed)?;
        writeln!(out)?;
        return Ok(());
    }
    let lines = codes
        .iter()
        .map(|c| vec![c.as_str(), c.phase().as_str(), c.meaning()]);
    let header = ["code", "phase", "meaning"];
    writeln!(out, "{}", crate::cmd::table(&header, lines, args.wide))?;
    if args.code.is_none() && args.phase.is_none() {
        writeln!(out, "\nRecommended actions on escalations:")?;
        let lines = actions.iter().map(|&a| vec![a.as_str(), action_meaning(a)]);
        let header = ["action", "meaning"];
        writeln!(out, "{}", crate::cmd::table(&header, lines, args.wide))?;
    }
    Ok(())
}
