//! The simulator's pure model: providers, fault modes, and what a provider answers to its k-th
//! request under a seed. No I/O and no clock (`now` is an argument), so the same seed, provider,
//! request number and fault give the same answer.

use crate::core::chaos::ContractBreak;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One simulated upstream.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub(crate) struct SimProvider {
    pub id: String,
    pub model: String,
    pub latency_ms: u64,
    /// Uniform extra latency in [0, jitter_ms).
    pub jitter_ms: u64,
}

/// The default providers: a paid `primary` and `secondary` at 150 ms + 0-49 ms (the reference
/// numbers' latency) and a zero-cost `local` model that answers faster, at 40 ms + 0-19 ms.
pub(crate) fn default_providers() -> Vec<SimProvider> {
    let p = |id: &str, model: &str, latency_ms, jitter_ms| SimProvider {
        id: id.into(),
        model: model.into(),
        latency_ms,
        jitter_ms,
    };
    vec![
        p("primary", "sim-large", 150, 50),
        p("secondary", "sim-medium", 150, 50),
        p("local", "sim-small", 40, 20),
    ]
}

/// Parse `NAME=LATENCY+JITTER` (e.g. `primary=150+50`, `local=0`).
pub(crate) fn parse_provider(spec: &str) -> Result<SimProvider, super::BadSetting> {
    let (id, timing) = spec
        .split_once('=')
        .ok_or_else(|| format!("provider {spec:?} must look like NAME=LATENCY_MS+JITTER_MS"))?;
    let (latency, jitter) = timing.split_once('+').unwrap_or((timing, "0"));
    let num = |s: &str, what: &str| {
        s.trim()
            .parse::<u64>()
            .map_err(|_| format!("provider {spec:?}: {what} {s:?} is not a whole number of ms"))
    };
    if id.is_empty()
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(super::BadSetting(format!(
            "provider {spec:?}: the name must be letters, digits, '-' or '_'"
        )));
    }
    Ok(SimProvider {
        id: id.to_string(),
        model: format!("sim-{id}"),
        latency_ms: num(latency, "latency")?,
        jitter_ms: num(jitter, "jitter")?,
    })
}

/// `POST /sim/faults`: set a fault on a provider for a while. Unknown keys are refused:
/// `FaultMode` denies whatever is left over.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub(crate) struct SetFault {
    /// A provider, or one model of it (`provider/model`).
    pub provider: String,
    pub duration_ms: u64,
    /// Only the next this many requests (within the duration) meet the fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub times: Option<u64>,
    #[serde(flatten)]
    pub mode: FaultMode,
}

/// A fault mode, switchable at runtime per provider.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
#[serde(tag = "mode", rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) enum FaultMode {
    /// Hard 5xx.
    Error {
        #[serde(default = "status_500")]
        status: u16,
    },
    /// HTTP 200 whose content breaks the contract.
    Contract {
        #[serde(default)]
        kind: ContractBreak,
    },
    /// Latency inflation.
    Slow { extra_ms: u64 },
    /// Accept and never answer (until the fault ends).
    Hang,
    /// 429 with Retry-After.
    RateLimit {
        #[serde(default = "one_second")]
        retry_after_ms: u64,
    },
    /// Drop the connection mid-response.
    Reset,
    /// A share of requests fail with 500.
    Flaky { error_rate: f64 },
    /// The request is refused as a real upstream refuses it.
    Refuse { reason: Refusal },
    /// A streamed answer breaks after `after_chunks` events (a request that does not stream is
    /// answered normally).
    Stream {
        kind: StreamBreak,
        #[serde(default = "two")]
        after_chunks: u32,
    },
}

fn two() -> u32 {
    2
}

pub(crate) use crate::core::chaos::StreamBreak;

/// How an upstream refuses a request.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Refusal {
    /// 400 `context_length_exceeded`.
    ContextLength,
    /// 400 `content_policy_violation`.
    ContentPolicy,
    /// 401 `invalid_api_key`.
    Auth,
}

fn status_500() -> u16 {
    500
}
fn one_second() -> u64 {
    1_000
}

impl FaultMode {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            FaultMode::Error { .. } => "error",
            FaultMode::Contract { .. } => "contract",
            FaultMode::Slow { .. } => "slow",
            FaultMode::Hang => "hang",
            FaultMode::RateLimit { .. } => "rate-limit",
            FaultMode::Reset => "reset",
            FaultMode::Flaky { .. } => "flaky",
            FaultMode::Refuse { .. } => "refuse",
            FaultMode::Stream { .. } => "stream",
        }
    }

    pub(crate) fn validate(&self) -> Result<(), super::BadSetting> {
        match *self {
            FaultMode::Error { status } if !(500..=599).contains(&status) => Err(
                super::BadSetting(format!("status must be a 5xx, got {status}")),
            ),
            FaultMode::Flaky { error_rate } if !(0.0..=1.0).contains(&error_rate) => Err(
                super::BadSetting(format!("error_rate must be in [0, 1], got {error_rate}")),
            ),
            _ => Ok(()),
        }
    }
}

/// An active fault and when it ends (ms on the sim's clock).
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
pub(crate) struct ActiveFault {
    #[serde(flatten)]
    pub mode: FaultMode,
    pub until_ms: u64,
    /// Requests left that meet it (none: every request until `until_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub times: Option<u64>,
}

/// Active faults by provider. Expired faults are dropped on read, so a fault ends on time even
/// if nobody ever clears it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Faults {
    active: BTreeMap<String, ActiveFault>,
}

impl Faults {
    pub(crate) fn set(
        &mut self,
        provider: &str,
        mode: FaultMode,
        now_ms: u64,
        duration_ms: u64,
        times: Option<u64>,
    ) -> ActiveFault {
        let fault = ActiveFault {
            mode,
            until_ms: now_ms.saturating_add(duration_ms),
            times,
        };
        self.active.insert(provider.to_string(), fault);
        fault
    }

    pub(crate) fn clear(&mut self, provider: &str) -> bool {
        self.active.remove(provider).is_some()
    }

    pub(crate) fn clear_all(&mut self) -> usize {
        let n = self.active.len();
        self.active.clear();
        n
    }

    /// The fault a request to `provider` (a provider, or `provider/model`) meets at `now_ms`,
    /// if any; one with a count of requests is used up by it.
    pub(crate) fn get(&mut self, provider: &str, now_ms: u64) -> Option<ActiveFault> {
        self.expire(now_ms);
        let f = self.active.get_mut(provider)?;
        let met = *f;
        if let Some(left) = f.times.as_mut() {
            *left = left.saturating_sub(1);
            if *left == 0 {
                self.active.remove(provider);
            }
        }
        Some(met)
    }

    /// Every active fault at `now_ms`.
    pub(crate) fn active(&mut self, now_ms: u64) -> &BTreeMap<String, ActiveFault> {
        self.expire(now_ms);
        &self.active
    }

    fn expire(&mut self, now_ms: u64) {
        self.active.retain(|_, f| now_ms < f.until_ms);
    }
}

/// What the provider does with one request.
#[derive(Clone, PartialEq, Debug)]
pub(crate) enum Handling {
    /// HTTP 200 after `delay_ms`.
    Answer {
        delay_ms: u64,
        content: String,
        finish_reason: &'static str,
    },
    /// An HTTP error status after `delay_ms`.
    Fail {
        delay_ms: u64,
        status: u16,
    },
    RateLimited {
        retry_after_ms: u64,
    },
    /// Hold the request until `until_ms`, then answer normally.
    Hang {
        until_ms: u64,
    },
    Reset,
    Refuse(Refusal),
}

/// splitmix64: a tiny, well-mixed deterministic generator step.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn provider_salt(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// The reply of `provider` to its `k`-th request (0-based), under `seed`, given the active fault.
pub(crate) fn reply(
    seed: u64,
    provider: &SimProvider,
    k: u64,
    question: &str,
    fault: Option<ActiveFault>,
    now_ms: u64,
) -> Handling {
    let r = mix(seed ^ mix(provider_salt(&provider.id) ^ mix(k)));
    let jitter = if provider.jitter_ms == 0 {
        0
    } else {
        r % provider.jitter_ms
    };
    let delay_ms = provider.latency_ms + jitter;
    // Confidence in [0.86, 0.99]: a healthy answer passes every risk level's quality gate.
    let confidence = 0.86 + ((r >> 16) % 14) as f64 / 100.0;
    let snippet: String = question.chars().take(60).collect();
    let answer = serde_json::json!({
        "answer": format!("{} answer #{k} to: {snippet}", provider.id),
        "confidence": confidence,
    });
    let good = Handling::Answer {
        delay_ms,
        content: answer.to_string(),
        finish_reason: "stop",
    };
    let Some(fault) = fault else { return good };
    match fault.mode {
        FaultMode::Error { status } => Handling::Fail {
            delay_ms: jitter,
            status,
        },
        FaultMode::Contract { kind } => {
            let content = match kind {
                ContractBreak::NotJson => format!("Sure! The answer is: {snippet}"),
                ContractBreak::MissingField => {
                    serde_json::json!({ "answer": answer["answer"] }).to_string()
                }
                ContractBreak::LowConfidence => {
                    serde_json::json!({ "answer": answer["answer"], "confidence": 0.05 })
                        .to_string()
                }
                ContractBreak::Truncated => {
                    let mut full = answer.to_string();
                    let mut cut = full.len() / 2;
                    while !full.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    full.truncate(cut);
                    full
                }
            };
            let finish_reason = if kind == ContractBreak::Truncated {
                "length"
            } else {
                "stop"
            };
            Handling::Answer {
                delay_ms,
                content,
                finish_reason,
            }
        }
        FaultMode::Slow { extra_ms } => match good {
            Handling::Answer {
                content,
                finish_reason,
                ..
            } => Handling::Answer {
                delay_ms: delay_ms + extra_ms,
                content,
                finish_reason,
            },
            other => other,
        },
        FaultMode::Hang => Handling::Hang {
            until_ms: fault.until_ms.max(now_ms),
        },
        FaultMode::RateLimit { retry_after_ms } => Handling::RateLimited { retry_after_ms },
        FaultMode::Reset => Handling::Reset,
        FaultMode::Refuse { reason } => Handling::Refuse(reason),
        // Applied by the server as it streams.
        FaultMode::Stream { .. } => good,
        FaultMode::Flaky { error_rate } => {
            // An independent draw from the same request number, in [0, 1).
            let draw = (mix(r) >> 11) as f64 / (1u64 << 53) as f64;
            if draw < error_rate {
                Handling::Fail {
                    delay_ms: jitter,
                    status: 500,
                }
            } else {
                good
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::contract::Contract;
    use crate::core::reason::ReasonCode;

    fn primary() -> SimProvider {
        default_providers().remove(0)
    }

    fn fault(mode: FaultMode) -> Option<ActiveFault> {
        Some(ActiveFault {
            mode,
            until_ms: 10_000,
            times: None,
        })
    }

    #[test]
    fn healthy_answers_meet_the_default_contract_and_latency() {
        for k in 0..200 {
            match reply(7, &primary(), k, "What is 2+2?", None, 0) {
                Handling::Answer {
                    delay_ms, content, ..
                } => {
                    assert!((150..200).contains(&delay_ms), "{delay_ms}");
                    let c = Contract::default().check(&content, Some("stop")).unwrap();
                    assert!(c.unwrap() >= 0.86);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn same_seed_same_answers_other_seed_other_answers() {
        let a: Vec<Handling> = (0..20)
            .map(|k| reply(1, &primary(), k, "q", None, 0))
            .collect();
        let b: Vec<Handling> = (0..20)
            .map(|k| reply(1, &primary(), k, "q", None, 0))
            .collect();
        let c: Vec<Handling> = (0..20)
            .map(|k| reply(2, &primary(), k, "q", None, 0))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn every_contract_break_is_caught_by_the_core_with_its_code() {
        for (kind, code) in [
            (ContractBreak::NotJson, ReasonCode::ContractNotJson),
            (
                ContractBreak::MissingField,
                ReasonCode::ContractMissingField,
            ),
            (
                ContractBreak::LowConfidence,
                ReasonCode::ContractConfidenceTooLow,
            ),
            (ContractBreak::Truncated, ReasonCode::ContractTruncated),
        ] {
            let Handling::Answer {
                content,
                finish_reason,
                ..
            } = reply(
                3,
                &primary(),
                0,
                "q",
                fault(FaultMode::Contract { kind }),
                0,
            )
            else {
                panic!("contract faults answer 200")
            };
            let defects = Contract::default()
                .check(&content, Some(finish_reason))
                .unwrap_err();
            assert_eq!(defects[0].code, code, "{kind:?}: {content}");
            // Truncation is also detectable from the content alone, whatever the question's script.
            let Handling::Answer { content, .. } = reply(
                3,
                &primary(),
                0,
                "ñandú ✓ 漢字",
                fault(FaultMode::Contract { kind }),
                0,
            ) else {
                panic!()
            };
            if kind == ContractBreak::Truncated {
                let d = Contract::default().check(&content, None).unwrap_err();
                assert_eq!(d[0].code, ReasonCode::ContractTruncated);
            }
        }
    }

    #[test]
    fn fault_modes_map_to_replies() {
        assert!(matches!(
            reply(
                0,
                &primary(),
                0,
                "q",
                fault(FaultMode::Error { status: 503 }),
                0
            ),
            Handling::Fail { status: 503, .. }
        ));
        assert_eq!(
            reply(
                0,
                &primary(),
                0,
                "q",
                fault(FaultMode::RateLimit {
                    retry_after_ms: 2_000
                }),
                0
            ),
            Handling::RateLimited {
                retry_after_ms: 2_000
            }
        );
        assert_eq!(
            reply(0, &primary(), 0, "q", fault(FaultMode::Hang), 5),
            Handling::Hang { until_ms: 10_000 }
        );
        let Handling::Answer { delay_ms, .. } = reply(
            0,
            &primary(),
            0,
            "q",
            fault(FaultMode::Slow { extra_ms: 1_000 }),
            0,
        ) else {
            panic!()
        };
        assert!(delay_ms >= 1_150);
        assert_eq!(
            reply(0, &primary(), 0, "q", fault(FaultMode::Reset), 0),
            Handling::Reset
        );
    }

    #[test]
    fn flaky_fails_about_its_error_rate() {
        let flaky = fault(FaultMode::Flaky { error_rate: 0.3 });
        let failed = (0..2_000)
            .filter(|&k| {
                matches!(
                    reply(9, &primary(), k, "q", flaky, 0),
                    Handling::Fail { .. }
                )
            })
            .count();
        assert!((500..700).contains(&failed), "{failed} of 2000 at rate 0.3");
    }

    #[test]
    fn faults_expire_on_their_own() {
        let mut f = Faults::default();
        f.set("primary", FaultMode::Hang, 1_000, 500, None);
        assert!(f.get("primary", 1_499).is_some());
        assert!(f.get("primary", 1_500).is_none());
        assert!(f.active(1_500).is_empty());
        f.set("local", FaultMode::Reset, 0, 10, None);
        assert!(f.clear("local"));
        assert!(!f.clear("local"));
    }

    #[test]
    fn a_counted_fault_meets_that_many_requests_then_ends() {
        let mut f = Faults::default();
        f.set("primary/big", FaultMode::Reset, 0, 60_000, Some(2));
        assert!(
            f.get("primary", 1).is_none(),
            "another model is not affected"
        );
        assert!(f.get("primary/big", 1).is_some());
        assert_eq!(f.get("primary/big", 2).and_then(|x| x.times), Some(1));
        assert!(f.get("primary/big", 3).is_none(), "used up");
    }

    #[test]
    fn provider_specs_parse_or_say_why_not() {
        let p = parse_provider("edge=20+5").unwrap();
        assert_eq!((p.id.as_str(), p.latency_ms, p.jitter_ms), ("edge", 20, 5));
        assert_eq!(parse_provider("zero=0").unwrap().jitter_ms, 0);
        assert!(
            parse_provider("nope")
                .unwrap_err()
                .0
                .contains("NAME=LATENCY_MS+JITTER_MS")
        );
        assert!(parse_provider("x=fast").unwrap_err().0.contains("latency"));
        assert!(parse_provider("a b=1").unwrap_err().0.contains("name"));
    }

    #[test]
    fn fault_json_is_documented_shape() {
        let f: FaultMode =
            serde_json::from_str(r#"{"mode":"contract","kind":"missing-field"}"#).unwrap();
        assert_eq!(
            f,
            FaultMode::Contract {
                kind: ContractBreak::MissingField
            }
        );
        assert!(serde_json::from_str::<FaultMode>(r#"{"mode":"melt"}"#).is_err());
        assert!(FaultMode::Flaky { error_rate: 2.0 }.validate().is_err());
        assert!(FaultMode::Error { status: 404 }.validate().is_err());
    }
}

/// What `by` writes after `prefill` (the start of an answer another target wrote, given as the
/// assistant's last turn to continue): the JSON it began, completed (its open string, a value
/// its last key awaits, a number cut short, then every open object and array closed), saying
/// who continued it; after prose, a word of its own. A model that takes a prefill continues it;
/// it does not start a new answer after it.
pub(crate) fn continue_after(prefill: &str, by: &str) -> String {
    if !prefill.trim_start().starts_with(['{', '[']) {
        return format!(" (continued by {by})");
    }
    let mut open = Vec::new();
    let (mut in_string, mut escaped, mut hex_left) = (false, false, 0u8);
    // Whether the string open, or the last one closed, is an object's key.
    let mut key = false;
    let mut last = None;
    // The number or literal (`null`, `true`, `false`) being written, outside strings.
    let mut token = String::new();
    for c in prefill.chars() {
        if !in_string {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+') {
                token.push(c);
            } else {
                token.clear();
            }
        }
        if in_string {
            if hex_left > 0 {
                hex_left -= 1;
            } else if escaped {
                escaped = false;
                if c == 'u' {
                    hex_left = 4;
                }
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
                last = Some('"');
            }
            continue;
        }
        match c {
            '"' => {
                key = open.last() == Some(&'{') && matches!(last, Some('{' | ','));
                in_string = true;
            }
            '{' | '[' => {
                open.push(c);
                last = Some(c);
            }
            '}' | ']' => {
                open.pop();
                last = Some(c);
            }
            c if c.is_whitespace() => {}
            c => last = Some(c),
        }
    }
    let said = format!("continued by {by}");
    let mut out = String::new();
    if in_string {
        out.extend(std::iter::repeat_n('0', usize::from(hex_left)));
        if escaped {
            out.push('\\');
        }
        out.push_str(&if key {
            format!("\":\"{said}\"")
        } else {
            format!(" ({said})\"")
        });
    } else {
        match last {
            Some(':') => out.push_str(&format!("\"{said}\"")),
            Some(',') if open.last() == Some(&'{') => {
                out.push_str(&format!("\"continued_by\":\"{by}\""));
            }
            Some(',') => out.push('0'),
            Some('"') if key => out.push_str(&format!(":\"{said}\"")),
            // A number cut after its point, sign or exponent.
            _ if token.starts_with(|c: char| c.is_ascii_digit() || c == '-')
                && token.ends_with(['.', '-', '+', 'e', 'E']) =>
            {
                out.push('0');
            }
            _ if !token.is_empty() => {
                if let Some(rest) = ["null", "true", "false"]
                    .iter()
                    .find_map(|l| l.strip_prefix(token.as_str()))
                {
                    out.push_str(rest);
                }
            }
            _ => {}
        }
    }
    for o in open.iter().rev() {
        out.push(if *o == '{' { '}' } else { ']' });
    }
    out
}

#[cfg(test)]
mod continuing {
    use super::continue_after;

    #[test]
    fn every_cut_of_an_answer_is_completed_into_json_by_its_continuation() {
        let answers = [
            r#"{"answer":"primary answer #168 to: hi","confidence":0.91}"#,
            r#"{"answer":"a \"quoted\" \\ path \u00e9 é","items":[1,-2.5e3,{"k":"v"}],"n":null}"#,
        ];
        for answer in answers {
            for (cut, _) in answer.char_indices().skip(1) {
                let prefill = &answer[..cut];
                let whole = format!("{prefill}{}", continue_after(prefill, "local"));
                let v: serde_json::Value = serde_json::from_str(&whole)
                    .unwrap_or_else(|e| panic!("{whole:?} after {prefill:?}: {e}"));
                assert!(v.is_object(), "{whole}");
            }
        }
        // The whole answer is left as it is, and a cut string says who went on.
        assert_eq!(continue_after(answers[0], "local"), "");
        let cut = r#"{"answer":"primary answer #1"#;
        assert_eq!(continue_after(cut, "local"), r#" (continued by local)"}"#);
        // Prose is continued with prose.
        assert_eq!(
            continue_after("Sure! The", "local"),
            " (continued by local)"
        );
    }
}
