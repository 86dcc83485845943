//! The layering written in `src/lib.rs`, checked on the source: every failure names file:line.
//!
//!     core <- {clock, ids, http, error, signal} <- transport <- local <- {mesh, sim} <- node
//!          <- bench <- chaos <- watch <- cmd <- cli
//!
//! A module may use modules to its left only; modules of one rank do not use each other.
//! `core` touches no runtime, bus, file, process or clock; subject names are spelled only in
//! `transport/subjects.rs`; `watch` never talks to NATS itself.

use std::path::{Path, PathBuf};

/// Each top-level module of `src/` and its rank.
const RANKS: &[(&str, u8)] = &[
    ("core", 0),
    ("clock", 1),
    ("ids", 1),
    ("http", 1),
    ("error", 1),
    ("signal", 1),
    ("transport", 2),
    ("local", 3),
    ("mesh", 4),
    ("sim", 4),
    ("node", 5),
    ("bench", 6),
    ("chaos", 7),
    ("watch", 8),
    ("cmd", 9),
    ("cli", 10),
];

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

fn rank(module: &str) -> Option<u8> {
    RANKS.iter().find(|(m, _)| *m == module).map(|(_, r)| *r)
}

/// `(line number, line)` of a file, comments dropped.
fn code_lines(file: &Path) -> Vec<(usize, String)> {
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
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
fn every_module_has_a_rank() {
    let mut missing: Vec<String> = rust_files(&src())
        .iter()
        .filter_map(|f| module_of(f))
        .filter(|m| rank(m).is_none())
        .collect();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "give these a rank in RANKS: {missing:?}"
    );
}

#[test]
fn modules_use_only_modules_below_them() {
    let mut wrong = Vec::new();
    for file in rust_files(&src()) {
        let Some(from) = module_of(&file) else {
            continue;
        };
        let Some(from_rank) = rank(&from) else {
            continue;
        };
        for (n, line) in code_lines(&file) {
            for to in uses(&line) {
                let Some(to_rank) = rank(&to) else {
                    continue;
                };
                if to != from && to_rank >= from_rank {
                    wrong.push(format!("{}: {from} uses {to}", at(&file, n)));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layering:\n{}",
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
fn the_watch_never_talks_to_nats_itself() {
    let mut wrong = Vec::new();
    for file in rust_files(&src().join("watch")) {
        for (n, line) in code_lines(&file) {
            if line.contains("async_nats") {
                wrong.push(at(&file, n));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the watch gets events over a channel from cmd/watch.rs:\n{}",
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
