//! One module per subcommand: its clap `Args` and its `run`. Glue only; decisions live in `core`.

pub mod agent;
pub mod bench;
pub mod chaos;
pub mod completions;
pub mod decide;
pub mod demo;
pub mod escalation;
pub mod listen;
pub mod man;
pub mod mesh;
pub mod node;
pub mod reasons;
pub mod sim;
pub mod watch;

/// Fit a table to the terminal: cells wrap to its width (`$COLUMNS`, or the terminal's when
/// stdout is one), unless `wide`. Piped output without `$COLUMNS` keeps whole lines.
pub(crate) fn fit(t: &mut comfy_table::Table, wide: bool) {
    use std::io::IsTerminal;
    if wide {
        return;
    }
    let width = std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<u16>().ok())
        .or_else(|| {
            std::io::stdout()
                .is_terminal()
                .then(|| ratatui::crossterm::terminal::size().ok().map(|(w, _)| w))
                .flatten()
        });
    if let Some(w) = width {
        t.set_content_arrangement(comfy_table::ContentArrangement::Dynamic);
        t.set_width(w);
    }
}
