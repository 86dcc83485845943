//! `oam watch` for real: in a tmux pseudo-terminal beside a running mesh, it shows the panels,
//! sees a node die, and quits on `q`; without a terminal it refuses and points to `--json`
//! streams.

use crate::support::{LocalCluster, eventually};
use std::process::Command;
use std::time::Duration;

/// A tmux session, killed when the test ends.
struct Tmux(String);

impl Tmux {
    fn capture(&self) -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &self.0])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn alive(&self) -> bool {
        Command::new("tmux")
            .args(["has-session", "-t", &self.0])
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Tmux {
    /// `oam watch` on `mesh` (as its admin) in a detached tmux session of `width`x`height`.
    fn watch(mesh: &LocalCluster, tag: &str, width: u16, height: u16) -> Tmux {
        let bin = assert_cmd::cargo::cargo_bin!("oam");
        let cmd = format!("OAM_NATS_URL='{}' {} watch", mesh.app_url(), bin.display());
        Tmux::run(&cmd, tag, width, height)
    }

    /// `command` in a detached tmux session of `width`x`height`.
    fn run(command: &str, tag: &str, width: u16, height: u16) -> Tmux {
        let session = Tmux(format!("oam-{tag}-{}", std::process::id()));
        let status = Command::new("tmux")
            .args(["new-session", "-d", "-s", &session.0, "-x"])
            .arg(width.to_string())
            .arg("-y")
            .arg(height.to_string())
            .arg(command)
            .status()
            .expect("tmux; scripts/install-test-tools installs it");
        assert!(status.success());
        session
    }

    fn keys(&self, keys: &[&str]) {
        for k in keys {
            Command::new("tmux")
                .args(["send-keys", "-t", &self.0, k])
                .status()
                .unwrap();
        }
    }
}

/// The watch as shipped, pointed at a mesh folder: it reads as the viewer and still shows the
/// active faults, and its chaos menu injects with the operator's credentials from the folder;
/// without them, the menu says why it cannot.
#[tokio::test]
async fn the_watch_in_a_mesh_folder_shows_faults_and_injects_as_the_operator() {
    let mesh = LocalCluster::up("watch-dir").await;
    let bin = assert_cmd::cargo::cargo_bin!("oam");
    let cmd = format!(
        "env -u OAM_NATS_URL {} watch --dir '{}'",
        bin.display(),
        mesh.dir.0.display()
    );
    let session = Tmux::run(&cmd, "watch-dir", 140, 40);
    let fault = mesh
        .oam()
        .args([
            "chaos",
            "slow-provider",
            "secondary",
            "--ms",
            "500",
            "--for",
            "60s",
        ])
        .output()
        .unwrap();
    assert!(
        fault.status.success(),
        "{}",
        String::from_utf8_lossy(&fault.stderr)
    );
    let shown = eventually(Duration::from_secs(15), || async {
        session
            .capture()
            .contains("slow-provider secondary")
            .then_some(())
    })
    .await;
    assert!(
        shown.is_some(),
        "the viewer sees the active fault:\n{}",
        session.capture()
    );

    session.keys(&["c", "Enter"]);
    let injected = eventually(Duration::from_secs(10), || async {
        session
            .capture()
            .contains("kill-provider primary")
            .then_some(())
    })
    .await;
    assert!(
        injected.is_some(),
        "the menu injected as the operator:\n{}",
        session.capture()
    );
    let list = mesh
        .oam()
        .args(["chaos", "list", "--json"])
        .output()
        .unwrap();
    let active = String::from_utf8_lossy(&list.stdout);
    assert!(active.contains("kill-provider"), "{active}");

    // An open escalation: `a` acknowledges it and `r` resolves it, as the operator.
    let admin =
        oam::transport::connect::connect(&mesh.app_url(), "test-admin", false, &Default::default())
            .await
            .unwrap();
    let store = oam::transport::store::escalations::store(&admin)
        .await
        .unwrap();
    let e: oam::core::escalation::Escalation = serde_json::from_value(serde_json::json!({
        "id": "esc-watch-1", "request_id": "r-1", "agent": "watched-bot", "task": "t",
        "phase": "budget", "reason_codes": ["ESCALATED_BUDGET_EXHAUSTED"],
        "recommended_action": "HUMAN_REVIEW", "created_at_ms": oam::clock::now_ms()
    }))
    .unwrap();
    assert!(
        oam::transport::store::escalations::open(&store, "n1", &e)
            .await
            .unwrap()
    );
    let record = || async {
        let all = oam::transport::store::escalations::all(&store)
            .await
            .unwrap();
        all.into_iter()
            .find(|r| r.escalation.id == "esc-watch-1")
            .unwrap()
    };
    let listed = eventually(Duration::from_secs(10), || async {
        session.capture().contains("watched-bot").then_some(())
    })
    .await;
    assert!(listed.is_some(), "{}", session.capture());
    session.keys(&["a"]);
    let acked = eventually(Duration::from_secs(10), || async {
        record().await.acknowledged_by
    })
    .await
    .unwrap_or_else(|| panic!("not acknowledged:\n{}", session.capture()));
    assert!(acked.contains("(oam watch)"), "{acked}");
    session.keys(&["r"]);
    let resolved = eventually(Duration::from_secs(10), || async {
        let r = record().await;
        (r.status == oam::transport::store::escalations::Status::Resolved).then_some(r)
    })
    .await;
    assert!(resolved.is_some(), "not resolved:\n{}", session.capture());

    // Without the operator's credentials the menu says what to do, and changes nothing.
    std::fs::remove_file(mesh.dir.0.join("creds").join("operator.json")).unwrap();
    let again = Tmux::run(&cmd, "watch-dir-2", 140, 40);
    let ready = eventually(Duration::from_secs(15), || async {
        again.capture().contains("Provider consensus").then_some(())
    })
    .await;
    assert!(ready.is_some(), "{}", again.capture());
    again.keys(&["c", "Down", "Enter"]);
    let said = eventually(Duration::from_secs(10), || async {
        again
            .capture()
            .contains("chaos needs the operator")
            .then_some(())
    })
    .await;
    assert!(said.is_some(), "the menu says why:\n{}", again.capture());
}

/// Cut off from NATS, the watch keeps the last picture, greyed and marked stale (the nodes were
/// serving: they are not aged into "down"); the mesh started again on another port, the watch
/// reads the folder again and follows it there.
#[tokio::test]
async fn a_watch_keeps_its_picture_when_nats_goes_and_follows_the_mesh_back() {
    let mesh = LocalCluster::up("watch-lost").await;
    let bin = assert_cmd::cargo::cargo_bin!("oam");
    let cmd = format!(
        "env -u OAM_NATS_URL {} watch --dir '{}'",
        bin.display(),
        mesh.dir.0.display()
    );
    let session = Tmux::run(&cmd, "watch-lost", 140, 40);
    let all_alive = |screen: &str| {
        ["n1", "n2", "n3"]
            .iter()
            .all(|n| node_shown(screen, n, "alive"))
    };
    let live = eventually(Duration::from_secs(15), || async {
        all_alive(&session.capture()).then_some(())
    })
    .await;
    assert!(live.is_some(), "{}", session.capture());

    let down = mesh
        .oam()
        .args(["mesh", "down", "--grace-ms", "500", "--dir"])
        .arg(&mesh.dir.0)
        .output()
        .unwrap();
    assert!(down.status.success());
    // Well past the 3.5 s after which a silent node counts as down.
    let stale = eventually(Duration::from_secs(20), || async {
        let screen = session.capture();
        let lost_for: u64 = screen
            .split("NATS unreachable for ")
            .nth(1)?
            .split(' ')
            .next()?
            .parse()
            .ok()?;
        (lost_for >= 6).then_some(screen)
    })
    .await
    .unwrap_or_else(|| panic!("the banner says since when:\n{}", session.capture()));
    assert!(
        stale.contains("NATS LOST") && stale.contains("oam mesh status"),
        "{stale}"
    );
    assert!(all_alive(&stale), "the last picture is kept:\n{stale}");

    let port = oam::local::natsd::free_ports(1).unwrap()[0];
    let up = mesh
        .oam()
        .args([
            "mesh",
            "up",
            "--sim-port",
            "0",
            "--http-port",
            "0",
            "--port",
        ])
        .arg(port.to_string())
        .arg("--dir")
        .arg(&mesh.dir.0)
        .output()
        .unwrap();
    assert!(
        up.status.success(),
        "{}",
        String::from_utf8_lossy(&up.stderr)
    );
    let back = eventually(Duration::from_secs(20), || async {
        let screen = session.capture();
        (screen.contains("NATS connected") && !screen.contains("NATS LOST") && all_alive(&screen))
            .then_some(())
    })
    .await;
    assert!(
        back.is_some(),
        "the watch follows the mesh to port {port}:\n{}",
        session.capture()
    );
}

/// Whether the nodes panel on `screen` shows `node` in `state` (whatever the column widths).
fn node_shown(screen: &str, node: &str, state: &str) -> bool {
    screen.lines().any(|l| {
        l.split('│').any(|cell| {
            let mut words = cell.split_whitespace();
            words.next() == Some(node) && words.next() == Some(state)
        })
    })
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .status();
    }
}

#[tokio::test]
async fn watch_shows_the_mesh_and_a_dead_node_in_a_real_terminal() {
    let mesh = LocalCluster::up("watch").await;
    let session = Tmux::watch(&mesh, "watch", 140, 40);

    let panels = eventually(Duration::from_secs(15), || async {
        let screen = session.capture();
        (screen.contains("Provider consensus")
            && screen.contains("ALL NOMINAL")
            && ["n1", "n2", "n3"]
                .iter()
                .all(|n| node_shown(&screen, n, "alive")))
        .then_some(screen)
    })
    .await;
    assert!(
        panels.is_some(),
        "panels and three live nodes:\n{}",
        session.capture()
    );

    // An escalation is shown until somebody resolves it.
    let drain = mesh
        .oam()
        .args(["chaos", "drain-budget", "support-bot", "--for", "60s"])
        .output()
        .unwrap();
    assert!(
        drain.status.success(),
        "{}",
        String::from_utf8_lossy(&drain.stderr)
    );
    let refused = crate::support::http(Duration::from_secs(10))
        .post(format!("{}/v1/chat/completions", mesh.node(0)))
        .json(&serde_json::json!({"model": "auto", "messages": [{"role": "user", "content": "refund"}],
            "oam": {"agent": "support-bot", "risk": "high", "task": "refund"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 402);
    let flagged = eventually(Duration::from_secs(10), || async {
        session
            .capture()
            .contains("⚑ support-bot BUDGET_EXHAUSTED → review+block")
            .then_some(())
    })
    .await;
    assert!(
        flagged.is_some(),
        "the open escalation is shown:\n{}",
        session.capture()
    );
    let resolve = mesh
        .oam()
        .args(["escalation", "resolve", "--agent", "support-bot"])
        .output()
        .unwrap();
    assert!(
        resolve.status.success(),
        "{}",
        String::from_utf8_lossy(&resolve.stderr)
    );
    let cleared = eventually(Duration::from_secs(10), || async {
        (!session.capture().contains("⚑ support-bot")).then_some(())
    })
    .await;
    assert!(
        cleared.is_some(),
        "a resolved escalation leaves the panel:\n{}",
        session.capture()
    );
    mesh.oam()
        .args(["chaos", "restore", "drain-budget"])
        .output()
        .unwrap();

    let out = mesh
        .oam()
        .args(["chaos", "kill-node", "n2", "--for", "60s"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dead = eventually(Duration::from_secs(15), || async {
        let screen = session.capture();
        (node_shown(&screen, "n2", "down") && screen.contains("kill-node n2")).then_some(())
    })
    .await;
    assert!(
        dead.is_some(),
        "n2 shown dead, the fault in the banner:\n{}",
        session.capture()
    );

    // Chaos from inside: the menu's first entry kills the primary provider.
    session.keys(&["c"]);
    session.keys(&["Enter"]);
    let injected = eventually(Duration::from_secs(10), || async {
        session
            .capture()
            .contains("kill-provider primary")
            .then_some(())
    })
    .await;
    assert!(
        injected.is_some(),
        "the menu injected the fault:\n{}",
        session.capture()
    );

    // NATS goes away: the watch says so and keeps the last picture; when the server is back (the
    // same config, so the same port and accounts) the picture comes back.
    let nats_pid = mesh.pid("nats-server");
    assert!(oam::local::signal(nats_pid, libc::SIGKILL));
    let said = eventually(Duration::from_secs(10), || async {
        session.capture().contains("NATS DOWN").then_some(())
    })
    .await;
    assert!(said.is_some(), "NATS down is shown:\n{}", session.capture());
    let conf = mesh.dir.0.join("nats.conf");
    let log = mesh.dir.0.join("nats-again.log");
    let bin = oam::local::natsd::find(None).unwrap().0;
    let mut again =
        oam::local::natsd::start_from(&bin, &conf, &mesh.dir.0, &log, Duration::from_secs(10))
            .await
            .unwrap()
            .child;
    let back = eventually(Duration::from_secs(20), || async {
        let screen = session.capture();
        (screen.contains("NATS connected") && node_shown(&screen, "n1", "alive")).then_some(())
    })
    .await;
    // The escalation store is watched again too: a record written now reaches the panel.
    let escalated = async {
        back?;
        let nc =
            oam::transport::connect::connect(&mesh.app_url(), "test", false, &Default::default())
                .await
                .ok()?;
        let store = oam::transport::store::escalations::store(&nc).await.ok()?;
        let e: oam::core::escalation::Escalation = serde_json::from_value(serde_json::json!({
            "id": "esc-after-restart", "request_id": "r-after", "agent": "after-bot", "task": "t",
            "phase": "budget", "reason_codes": ["ESCALATED_BUDGET_EXHAUSTED"],
            "recommended_action": "HUMAN_REVIEW", "created_at_ms": oam::clock::now_ms()
        }))
        .ok()?;
        oam::transport::store::escalations::open(&store, "n1", &e)
            .await
            .ok()?;
        eventually(Duration::from_secs(15), || async {
            session
                .capture()
                .contains("⚑ after-bot BUDGET_EXHAUSTED → review ")
                .then_some(())
        })
        .await
    }
    .await;
    let _ = again.kill();
    let _ = again.wait();
    assert!(
        back.is_some(),
        "the picture comes back:\n{}",
        session.capture()
    );
    assert!(
        escalated.is_some(),
        "an escalation after the restart is shown:\n{}",
        session.capture()
    );

    session.keys(&["q"]);
    let quit = eventually(Duration::from_secs(10), || async {
        (!session.alive()).then_some(())
    })
    .await;
    assert!(quit.is_some(), "q quits:\n{}", session.capture());
}

/// The banner follows what requests experience, with a real outage: traffic flows, the primary
/// is killed, and REROUTING appears within 2 s of the first rerouted decision on the bus; when
/// the traffic stops (the fault still on) it leaves within 2 s of the last one (plus a frame and
/// a capture), for DEGRADED, never ALL NOMINAL, with the health verdicts beside it.
#[tokio::test]
async fn the_banner_follows_a_real_outage_within_two_seconds() {
    use futures_util::StreamExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    let mesh = LocalCluster::up("watch-outage").await;
    let session = Tmux::watch(&mesh, "outage", 160, 48);
    let nominal = eventually(Duration::from_secs(15), || async {
        session.capture().contains("ALL NOMINAL").then_some(())
    })
    .await;
    assert!(nominal.is_some(), "nominal first:\n{}", session.capture());

    // Decisions as the watch receives them: when, and whether rerouted.
    let nc = oam::transport::connect::connect(&mesh.app_url(), "test", false, &Default::default())
        .await
        .unwrap();
    let mut sub = nc
        .subscribe(oam::transport::subjects::DECISIONS)
        .await
        .unwrap();
    let seen: Arc<Mutex<Vec<(Instant, bool)>>> = Arc::default();
    let recorder = {
        let seen = seen.clone();
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                let env: oam::core::wire::Envelope<Vec<oam::core::pipeline::Decision>> =
                    serde_json::from_slice(&m.payload).unwrap();
                for d in env.body {
                    let rerouted = d.fallback || d.attempts.len() > 1;
                    seen.lock().unwrap().push((Instant::now(), rerouted));
                }
            }
        })
    };
    // Traffic: one request after another until told to stop (at most 1,000 of them).
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (stop, url) = (
            stop.clone(),
            format!("{}/v1/chat/completions", mesh.node(0)),
        );
        tokio::spawn(async move {
            let client = crate::support::http(Duration::from_secs(10));
            for _ in 0..1_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let _ = client
                    .post(&url)
                    .json(&serde_json::json!({"model": "auto",
                        "messages": [{"role": "user", "content": "hello"}],
                        "oam": {"agent": "outage-bot"}}))
                    .send()
                    .await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let poll = |want: bool| {
        let session = &session;
        async move {
            eventually(Duration::from_secs(15), || async {
                let screen = session.capture();
                (screen.contains("REROUTING") == want).then(|| (Instant::now(), screen))
            })
            .await
        }
    };
    let kill = mesh
        .oam()
        .args(["chaos", "kill-provider", "primary", "--for", "60s"])
        .output()
        .unwrap();
    assert!(
        kill.status.success(),
        "{}",
        String::from_utf8_lossy(&kill.stderr)
    );
    let shown = poll(true).await;
    let first = seen
        .lock()
        .unwrap()
        .iter()
        .find(|(_, rerouted)| *rerouted)
        .map(|(at, _)| *at);
    let (Some((shown_at, _)), Some(first)) = (shown, first) else {
        panic!(
            "REROUTING shown after rerouted decisions:\n{}",
            session.capture()
        );
    };
    let on = shown_at.saturating_duration_since(first);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    traffic.await.unwrap();
    let cleared = poll(false).await;
    let last = seen
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|(_, rerouted)| *rerouted)
        .map(|(at, _)| *at);
    recorder.abort();
    mesh.oam()
        .args(["chaos", "restore", "kill-provider"])
        .output()
        .unwrap();
    let (Some((cleared_at, screen)), Some(last)) = (cleared, last) else {
        panic!(
            "REROUTING cleared after the traffic stopped:\n{}",
            session.capture()
        );
    };
    let off = cleared_at.saturating_duration_since(last);
    eprintln!(
        "REROUTING shown {on:?} after the first rerouted decision, cleared {off:?} after the last"
    );
    assert!(on <= Duration::from_secs(2), "shown {on:?} after the first");
    // The window is 2 s; a frame (100 ms at the default rate) and the capture poll come on top.
    assert!(
        off <= Duration::from_millis(3_000),
        "cleared {off:?} after the last"
    );
    assert!(
        screen.contains("DEGRADED") && !screen.contains("ALL NOMINAL"),
        "the fault is still on:\n{screen}"
    );
    // The health verdict beside it: the primary is no longer healthy (degraded or unhealthy,
    // by how far the windows have come).
    assert!(
        screen.contains("health: primary ") && !screen.contains("health: primary healthy"),
        "{screen}"
    );
    // The stream showed the rerouted requests, and every message on the bus was read.
    assert!(screen.contains("FALLBACK_USED"), "{screen}");
    assert!(!screen.contains("unreadable"), "{screen}");
}

#[test]
fn without_a_terminal_it_points_to_json_streams() {
    let out = assert_cmd::Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .arg("watch")
        .timeout(Duration::from_secs(10))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("oam listen"));
}
