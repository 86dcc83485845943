//! The layering written in `src/lib.rs`, checked on the source: every failure names file:line.
//!
//! Each top-level module of `src/` may use only the modules its row of `ALLOWED` lists, and
//! the table is a DAG: the runtimes (`node`, `bench`, `chaos`, `sim`, `local`, `mesh`) use each
//! other only where listed, so `tui` cannot start using `node::Node` and stay green. The
//! node is used only by the commands that run one. `core` touches no runtime, bus, file,
//! process or clock; subject names are spelled only in `transport/subjects.rs`; `tui` never
//! talks to NATS itself; no library code stops the process.

use std::path::{Path, PathBuf};

/// Each top-level module of `src/` and the modules it may use.
const ALLOWED: &[(&str, &[&str])] = &[
    ("core", &[]),
    ("clock", &[]),
    ("ids", &[]),
    ("http", &[]),
    ("error", &[]),
    ("signal", &[]),
    ("transport", &["core", "ids"]),
    (
        "local",
        &["core", "clock", "ids", "http", "mesh", "transport"],
    ),
    ("mesh", &["core", "clock", "ids", "transport"]),
    ("sim", &["core"]),
    (
        "node",
        &["core", "clock", "ids", "http", "mesh", "transport"],
    ),
    (
        "bench",
        &[
            "core",
            "clock",
            "error",
            "http",
            "ids",
            "local",
            "mesh",
            "transport",
        ],
    ),
    (
        "chaos",
        &[
            "core",
            "clock",
            "http",
            "ids",
            "local",
            "mesh",
            "sim",
            "transport",
            "bench",
        ],
    ),
    ("tui", &["core", "mesh", "transport"]),
    (
        "cmd",
        &[
            "core",
            "clock",
            "ids",
            "http",
            "error",
            "signal",
            "transport",
            "local",
            "mesh",
            "sim",
            "node",
            "bench",
            "chaos",
            "tui",
            "cli",
        ],
    ),
    ("cli", &["cmd", "error", "signal"]),
];

/// The only files outside `src/node` that may use the node: the commands that run one (`oam
/// mesh up` checks the node configuration it starts nodes with), and `oam config check` and
/// `oam rehearse`, which read that configuration as a node would.
const RUN_A_NODE: &[&str] = &[
    "cmd/node.rs",
    "cmd/mesh/up.rs",
    "cmd/config.rs",
    "cmd/rehearse.rs",
];

fn allowed(module: &str) -> Option<&'static [&'static str]> {
    ALLOWED.iter().find(|(m, _)| *m == module).map(|(_, a)| *a)
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The top-level module a file of `src/` belongs to (`None` for lib.rs and the binary).
fn module_of(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src()).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "bin")).then(|| name.to_string())
}

/// `(line number, line)` of a file's production code: comments dropped, and its unit tests
/// (`#[cfg(test)] mod tests`, which may start what they test on a fixture from anywhere).
fn code_lines(file: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(file).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].starts_with("mod tests"))
        .unwrap_or(lines.len());
    lines[..end]
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect()
}

/// The crate modules a line uses (`crate::x...`).
fn uses(line: &str) -> Vec<String> {
    line.match_indices("crate::")
        .map(|(at, _)| {
            line[at + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

fn at(file: &Path, n: usize) -> String {
    format!("src/{}:{n}", file.strip_prefix(src()).unwrap().display())
}

#[test]
fn every_module_has_a_row() {
    let mut missing: Vec<String> = rust_files(&src())
        .iter()
        .filter_map(|f| module_of(f))
        .filter(|m| allowed(m).is_none())
        .collect();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "give these a row in ALLOWED: {missing:?}"
    );
}

#[test]
fn the_allowed_edges_form_a_dag() {
    // Depth-first from every module; a module met again on the path is a cycle. `cmd` and
    // `cli` use each other (the command tree and its dispatch), the one pair let through.
    fn visit(m: &str, path: &mut Vec<String>, cycles: &mut Vec<String>) {
        if let Some(at) = path.iter().position(|p| p == m) {
            cycles.push(format!("{} -> {m}", path[at..].join(" -> ")));
            return;
        }
        path.push(m.to_string());
        for to in allowed(m).unwrap_or(&[]) {
            if !(m == "cmd" && *to == "cli") {
                visit(to, path, cycles);
            }
        }
        path.pop();
    }
    let mut cycles = Vec::new();
    for (m, _) in ALLOWED {
        visit(m, &mut Vec::new(), &mut cycles);
    }
    cycles.sort();
    cycles.dedup();
    assert!(
        cycles.is_empty(),
        "cycles in ALLOWED:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn modules_use_only_the_modules_allowed_them() {
    let mut wrong = Vec::new();
    for file in rust_files(&src()) {
        let Some(from) = module_of(&file) else {
            continue;
        };
        let Some(may) = allowed(&from) else {
            continue;
        };
        for (n, line) in code_lines(&file) {
            for to in uses(&line) {
                if to != from && allowed(&to).is_some() && !may.contains(&to.as_str()) {
                    wrong.push(format!("{}: {from} uses {to}", at(&file, n)));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layering (or add the edge to ALLOWED, on purpose):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn only_the_commands_that_run_a_node_use_it() {
    let mut wrong = Vec::new();
    for file in rust_files(&src()) {
        let rel = file
            .strip_prefix(src())
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if rel.starts_with("node/") || RUN_A_NODE.contains(&rel.as_str()) {
            continue;
        }
        for (n, line) in code_lines(&file) {
            if uses(&line).iter().any(|m| m == "node") {
                wrong.push(at(&file, n));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the node is run by {RUN_A_NODE:?} only; these use it:\n{}",
        wrong.join("\n")
    );
}

/// The node's client APIs (`node/api/`, what callers speak) and its upstream APIs
/// (`node/upstream/`, what providers speak) meet in `node::exchange` only: neither uses the
/// other, so adding one of either is a sibling file that changes nothing on the other side.
#[test]
fn client_apis_and_upstream_apis_never_use_each_other() {
    let node = src().join("node");
    let mut wrong = Vec::new();
    for (folder, other) in [("upstream", "api"), ("api", "upstream")] {
        for file in rust_files(&node.join(folder)) {
            // From `{folder}/mod.rs` the node's modules are `super::x`; from its siblings,
            // `super::super::x`.
            let parent = if file.ends_with("mod.rs") {
                "super::"
            } else {
                "super::super::"
            };
            for (n, line) in code_lines(&file) {
                if [format!("node::{other}::"), format!("{parent}{other}::")]
                    .iter()
                    .any(|u| line.contains(u.as_str()))
                {
                    wrong.push(format!("{}: {folder} uses {other}", at(&file, n)));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "move what both need into node::exchange:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_library_code_stops_the_process() {
    // Stopping on a signal or a refused connection is the command's to decide: library code
    // takes a stop future (or a `Refused`) from its caller.
    let mut wrong = Vec::new();
    for file in rust_files(&src()) {
        let Some(m) = module_of(&file) else {
            continue;
        };
        if matches!(m.as_str(), "cmd" | "cli" | "signal") {
            continue;
        }
        for (n, line) in code_lines(&file) {
            let stops = line.contains("std::process::exit")
                || uses(&line).iter().any(|u| u == "signal" || u == "cmd");
            if stops {
                wrong.push(format!("{}: {}", at(&file, n), line.trim()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "take the stop from the caller:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn core_touches_no_runtime_bus_file_process_or_clock() {
    const FORBIDDEN: &[&str] = &[
        "tokio",
        "async_nats",
        "reqwest",
        "axum",
        "ratatui",
        "crossterm",
        "clap::",
        "std::fs",
        "std::net",
        "std::process",
        "std::thread",
        "SystemTime",
        "Instant::now",
        "std::env",
    ];
    let mut wrong = Vec::new();
    for file in rust_files(&src().join("core")) {
        for (n, line) in code_lines(&file) {
            for f in FORBIDDEN.iter().filter(|f| line.contains(*f)) {
                wrong.push(format!("{}: {f}", at(&file, n)));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "core must stay pure:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn subject_names_are_spelled_only_in_subjects_rs() {
    let spelled = |line: &str| {
        ["\"oam.v1", "\"$SYS", "\"_INBOX", "\"q."]
            .iter()
            .any(|p| line.contains(p))
            || line.match_indices("\"mesh.").any(|(at, _)| {
                // `"mesh.json"` is a file name, not a subject.
                let rest = &line[at + 6..];
                let token: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                rest[token.len()..].starts_with(['.', '>', '*'])
            })
    };
    let home = src().join("transport").join("subjects.rs");
    let mut wrong = Vec::new();
    for file in rust_files(&src()).into_iter().filter(|f| *f != home) {
        for (n, line) in code_lines(&file) {
            if spelled(&line) {
                wrong.push(format!("{}: {}", at(&file, n), line.trim()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "use transport::subjects for these:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_tui_never_talks_to_nats_itself() {
    let mut wrong = Vec::new();
    for file in rust_files(&src().join("tui")) {
        for (n, line) in code_lines(&file) {
            if line.contains("async_nats") {
                wrong.push(at(&file, n));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the live view gets events over a channel from cmd/watch.rs:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_checks_catch_what_they_claim_to() {
    assert_eq!(
        uses("use crate::node::Node; crate::core::x"),
        ["node", "core"]
    );
    assert_eq!(
        module_of(&src().join("cmd").join("mesh").join("up.rs")).as_deref(),
        Some("cmd")
    );
    assert_eq!(module_of(&src().join("clock.rs")).as_deref(), Some("clock"));
    assert_eq!(module_of(&src().join("lib.rs")), None);
}
