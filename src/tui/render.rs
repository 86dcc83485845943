//! Drawing `oam watch`: a pure function of the app state and the clock. Wide terminals get
//! every panel side by side; down to 80x24 the same panels stack and shrink without garbling.

use super::state::{App, CHAOS_MENU, Focus, LineKind, MeshStatus};
use crate::core::breaker::Breaker;
use crate::core::bulkhead::Occupancy;
use crate::core::health::Verdict as Health;
use crate::core::reason::Action;
use crate::core::request::Priority;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{
    Block, Cell, Clear, Gauge, List, ListItem, Paragraph, Row, Sparkline, Table, Wrap,
};

/// A panel's title, with how many rows are scrolled out of view above.
fn titled(title: &str, offset: usize) -> String {
    if offset > 0 {
        format!("{title} (↓{offset})")
    } else {
        title.to_string()
    }
}

/// `titled`, and how many of `len` rows (from `offset`) do not fit in the `shown` lines there
/// are for them: `Providers (+1 more)`, so a hidden row is never silently missing.
fn titled_more(title: &str, offset: usize, len: usize, shown: u16) -> String {
    let below = len.saturating_sub(offset + usize::from(shown));
    if below > 0 {
        format!("{} (+{below} more)", titled(title, offset))
    } else {
        titled(title, offset)
    }
}

/// How many rows `panel` has now (what scrolling moves through).
pub(crate) fn panel_len(app: &App, panel: Focus, now_ms: u64) -> usize {
    match panel {
        Focus::Stream => app.visible().len(),
        Focus::Nodes => app.nodes.len(),
        Focus::Providers => app.reference(now_ms).map_or(0, |r| r.providers.len()),
        Focus::Attention => attention_lines(app, now_ms).len(),
        Focus::Agents => agent_lines(app, now_ms, false).len(),
    }
}

fn block(title: &str, focused: bool) -> Block<'static> {
    let b = Block::bordered().title(Span::styled(
        format!(" {title} "),
        Style::default().add_modifier(Modifier::BOLD),
    ));
    if focused {
        b.border_style(Style::default().fg(Color::Cyan))
    } else {
        b
    }
}

fn verdict_style(v: Health) -> Style {
    match v {
        Health::Healthy => Style::default().fg(Color::Green),
        Health::Degraded => Style::default().fg(Color::Yellow),
        Health::Unhealthy => Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
        Health::Unknown => Style::default().fg(Color::DarkGray),
    }
}

fn kind_style(k: LineKind) -> (Style, &'static str) {
    match k {
        LineKind::Accepted => (Style::default().fg(Color::Green), "ok  "),
        LineKind::Fallback => (Style::default().fg(Color::Yellow), "fall"),
        LineKind::Shed => (Style::default().fg(Color::Magenta), "shed"),
        LineKind::Escalated => (
            Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
            "esc ",
        ),
        LineKind::Refused => (Style::default().fg(Color::Red), "no  "),
    }
}

/// The smallest terminal the watch draws in; below it says so instead of garbling.
pub(crate) const MIN_WIDTH: u16 = 80;
pub(crate) const MIN_HEIGHT: u16 = 24;

/// What every symbol and short header means (the help popup; a line of its own when there is
/// room).
const LEGEND: &[&str] = &[
    "breakers  ● closed · ◐ half-open, one probe · ○ open, no traffic · - down",
    "votes     nodes that agree / cluster size; own = no quorum, local view",
    "avail     answers that succeeded · p95 latency · share: traffic, last 10 s",
    "broken    % of answers that broke the JSON contract",
    "beat      age of a node's last snapshot; silent for 3.5 s = down",
    "bulkheads active/limit per class, q queued, shed refused; strm streams",
    "attention ⚑ open escalation · ⟲ agent loop · ✝ agent death",
    "stream    ok accepted · fall rerouted · shed · esc escalated · no refused",
];

/// Wide and tall enough for the legend in two columns under the panels.
fn legend_fits(area: Rect) -> bool {
    area.width >= 156 && area.height >= 40
}

/// A table column: header, width (the least for the flexible one), and rank: when the panel is
/// too narrow, the highest ranks are dropped first; rank 0 is always kept.
struct Col {
    head: &'static str,
    width: u16,
    rank: u8,
    flex: bool,
}

const fn col(head: &'static str, width: u16, rank: u8) -> Col {
    Col {
        head,
        width,
        rank,
        flex: false,
    }
}

/// The columns of `cols` that fit in `width` (one space between columns), in display order.
fn fitting(cols: &[Col], width: u16) -> Vec<usize> {
    let mut by_rank: Vec<usize> = (0..cols.len()).collect();
    by_rank.sort_by_key(|&i| cols[i].rank);
    let mut used = 0u16;
    let mut keep = Vec::new();
    for i in by_rank {
        let need = cols[i].width + u16::from(!keep.is_empty());
        if cols[i].rank == 0 || used + need <= width {
            used += need;
            keep.push(i);
        }
    }
    keep.sort_unstable();
    keep
}

/// A table of the columns that fit in `area` (inside its border); `rows` hold a cell per column
/// and their height in lines.
fn fitted_table<'a>(cols: &[Col], rows: Vec<(Vec<Cell<'a>>, u16)>, area: Rect) -> Table<'a> {
    let keep = fitting(cols, area.width.saturating_sub(2));
    let widths: Vec<Constraint> = keep
        .iter()
        .map(|&i| {
            if cols[i].flex {
                Constraint::Min(cols[i].width)
            } else {
                Constraint::Length(cols[i].width)
            }
        })
        .collect();
    let rows = rows.into_iter().map(|(cells, height)| {
        let mut cells: Vec<Option<Cell>> = cells.into_iter().map(Some).collect();
        Row::new(
            keep.iter()
                .filter_map(|&i| cells.get_mut(i).and_then(Option::take))
                .collect::<Vec<_>>(),
        )
        .height(height.max(1))
    });
    Table::new(rows, widths).header(
        Row::new(keep.iter().map(|&i| cols[i].head)).style(Style::default().fg(Color::DarkGray)),
    )
}

/// The width the flexible column gets in `area` beside the other columns that fit.
fn flex_width(cols: &[Col], area: Rect) -> u16 {
    let inner = area.width.saturating_sub(2);
    let keep = fitting(cols, inner);
    let fixed: u16 = keep
        .iter()
        .filter(|&&i| !cols[i].flex)
        .map(|&i| cols[i].width + 1)
        .sum();
    inner.saturating_sub(fixed)
}

/// `words` packed into lines of at most `width` characters, joined by `sep` within a line; a
/// word longer than a line is split across lines rather than cut.
fn pack(words: &[&str], sep: &str, width: usize) -> Vec<String> {
    let width = width.max(1);
    let mut lines: Vec<String> = Vec::new();
    for w in words {
        match lines.last_mut() {
            Some(line) if line.chars().count() + sep.len() + w.chars().count() <= width => {
                line.push_str(sep);
                line.push_str(w);
            }
            _ => {
                let chars: Vec<char> = w.chars().collect();
                lines.extend(chars.chunks(width).map(|c| c.iter().collect::<String>()));
            }
        }
    }
    lines
}

/// From this many columns the reason-code stream stands beside the tables.
const WIDE: u16 = 180;

pub(crate) fn render(f: &mut Frame, app: &App, now_ms: u64) {
    let area = f.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        render_too_small(f, area);
        return;
    }
    let compact = area.height < 34 || area.width < 110;
    // A wide terminal puts the reason-code stream beside the tables, at full height, rather
    // than leaving the tables' right-hand side blank.
    let wide = area.width >= WIDE;
    let [banner, body, legend, footer] = Layout::vertical([
        Constraint::Length(4),
        Constraint::Min(10),
        Constraint::Length(if legend_fits(area) { 4 } else { 0 }),
        Constraint::Length(1),
    ])
    .areas(area);
    let (tables, stream_area) = if wide {
        let [tables, stream] =
            Layout::horizontal([Constraint::Percentage(55), Constraint::Min(60)]).areas(body);
        (tables, Some(stream))
    } else {
        (body, None)
    };
    let [top, middle, bottom] = Layout::vertical([
        Constraint::Length(if compact { 6 } else { 8 }),
        Constraint::Length(if compact { 6 } else { 8 }),
        Constraint::Min(5),
    ])
    .areas(tables);
    render_banner(f, banner, app, now_ms);
    // Cut off from NATS, the panels show the moment it was lost (greyed below), not a mesh
    // that looks dead for want of news.
    let now_ms = app.picture_ms(now_ms);
    let [nodes, providers] = Layout::horizontal([
        if compact {
            Constraint::Length(27)
        } else {
            Constraint::Percentage(28)
        },
        Constraint::Min(40),
    ])
    .areas(top);
    render_nodes(f, nodes, app, now_ms);
    render_providers(f, providers, app, now_ms);
    let [bulkheads, attention, agents] = Layout::horizontal([
        Constraint::Percentage(30),
        Constraint::Percentage(35),
        Constraint::Percentage(35),
    ])
    .areas(middle);
    render_bulkheads(f, bulkheads, app, now_ms);
    render_attention(f, attention, app, now_ms);
    render_agents(f, agents, app, now_ms);
    match stream_area {
        Some(stream) => {
            render_stream(f, stream, app);
            render_sparks(f, bottom, app, now_ms);
        }
        None => {
            let [stream, sparks] = Layout::horizontal([
                Constraint::Min(40),
                Constraint::Length(if compact { 18 } else { 30 }),
            ])
            .areas(bottom);
            render_stream(f, stream, app);
            render_sparks(f, sparks, app, now_ms);
        }
    }
    if !app.connected && app.lost_at_ms.is_some() {
        let stale = Rect {
            y: top.y,
            height: area.height.saturating_sub(top.y - area.y),
            ..area
        };
        f.buffer_mut().set_style(
            stale,
            Style::default()
                .fg(Color::DarkGray)
                .add_modifier(Modifier::DIM),
        );
    }
    if legend_fits(area) {
        let halves = Layout::horizontal([Constraint::Percentage(50); 2]).split(legend);
        for (half, lines) in halves.iter().zip(LEGEND.chunks(LEGEND.len().div_ceil(2))) {
            f.render_widget(
                Paragraph::new(
                    lines
                        .iter()
                        .map(|l| Line::from(format!(" {l}")))
                        .collect::<Vec<_>>(),
                )
                .style(Style::default().fg(Color::DarkGray)),
                *half,
            );
        }
    }
    let keys = if app.editing_filter {
        Line::styled(
            format!(" filter: {}▏  Enter apply · Esc cancel", app.filter),
            Style::default().fg(Color::DarkGray),
        )
    } else {
        let hints = format!(
            " q quit · Tab panel · ↑↓ scroll · / filter{} · p {} · c chaos · ? help & legend",
            if app.filter.is_empty() {
                String::new()
            } else {
                format!(" [{}]", app.filter)
            },
            if app.paused { "resume" } else { "pause" },
        );
        // What a key just did (or why it could not) comes first, where an 80-column terminal
        // still shows it; the hints follow as far as they fit.
        let mut spans = Vec::new();
        if !app.status.is_empty() {
            spans.push(Span::styled(
                format!(" {} │", app.status),
                Style::default().fg(Color::Yellow),
            ));
        }
        spans.push(Span::styled(hints, Style::default().fg(Color::DarkGray)));
        Line::from(spans)
    };
    f.render_widget(Paragraph::new(keys), footer);
    if app.help {
        render_help(f, area);
    }
    if let Some(sel) = app.chaos_menu {
        render_chaos_menu(f, area, sel);
    }
}

fn render_too_small(f: &mut Frame, area: Rect) {
    let text = vec![
        Line::styled(
            "terminal too small",
            Style::default().add_modifier(Modifier::BOLD),
        ),
        Line::from(format!(
            "{}x{} here; oam watch needs {MIN_WIDTH}x{MIN_HEIGHT}",
            area.width, area.height
        )),
        Line::from("enlarge the window, or q to quit"),
        Line::from("(oam listen --json streams the same events)"),
    ];
    let [_, middle, _] = Layout::vertical([
        Constraint::Fill(1),
        Constraint::Length(text.len() as u16),
        Constraint::Fill(1),
    ])
    .areas(area);
    f.render_widget(
        Paragraph::new(text)
            .alignment(ratatui::layout::Alignment::Center)
            .wrap(Wrap { trim: true }),
        middle,
    );
}

fn render_banner(f: &mut Frame, area: Rect, app: &App, now_ms: u64) {
    let (verdict, why) = app.banner(now_ms);
    let now_ms = app.picture_ms(now_ms);
    let (style, label) = match verdict {
        MeshStatus::Nominal => (
            Style::default().fg(Color::Black).bg(Color::Green),
            " ALL NOMINAL ",
        ),
        MeshStatus::Degraded => (
            Style::default().fg(Color::Black).bg(Color::Yellow),
            " DEGRADED ",
        ),
        MeshStatus::Rerouting => (
            Style::default().fg(Color::White).bg(Color::Red),
            " REROUTING ",
        ),
        MeshStatus::NoQuorum if !app.connected => (
            Style::default().fg(Color::White).bg(Color::DarkGray),
            " NATS LOST ",
        ),
        MeshStatus::NoQuorum => (
            Style::default().fg(Color::White).bg(Color::Magenta),
            " NO QUORUM ",
        ),
    };
    // The health verdicts, as the nodes agree on them, beside what requests experience.
    let mut health: Vec<Span> = vec![Span::styled(
        "health: ",
        Style::default().fg(Color::DarkGray),
    )];
    match app.reference(now_ms) {
        Some(state) if !state.providers.is_empty() => {
            for (i, p) in state.providers.iter().enumerate() {
                if i > 0 {
                    health.push(Span::raw(" · "));
                }
                health.push(Span::raw(format!("{} ", p.id)));
                health.push(Span::styled(
                    p.consensus.verdict.as_str().to_ascii_lowercase(),
                    verdict_style(p.consensus.verdict),
                ));
            }
        }
        _ => health.push(Span::raw("no provider verdicts yet")),
    }
    let mut chaos: Vec<Span> = vec![Span::styled(
        "chaos: ",
        Style::default().fg(Color::DarkGray),
    )];
    if app.chaos.is_empty() {
        chaos.push(Span::raw("none"));
    }
    for a in &app.chaos {
        chaos.push(Span::styled(
            format!(
                "{} {} ({} s left)  ",
                a.fault.name(),
                a.target,
                a.left_ms(now_ms).div_ceil(1_000)
            ),
            Style::default().fg(Color::Red),
        ));
    }
    let bus = if app.connected {
        Span::styled("NATS connected", Style::default().fg(Color::Green))
    } else {
        Span::styled(
            "NATS DOWN, reconnecting",
            Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
        )
    };
    let mut status = vec![bus, Span::raw(format!("  events {}", app.applied))];
    if app.dropped > 0 {
        status.push(Span::styled(
            format!("  dropped {} (falling behind)", app.dropped),
            Style::default().fg(Color::Yellow),
        ));
    }
    let undelivered: u64 = app
        .nodes
        .values()
        .map(|n| n.state.escalations_undelivered)
        .sum();
    if undelivered > 0 {
        status.push(Span::styled(
            format!("  escalations undelivered {undelivered} (webhook failing)"),
            Style::default().fg(Color::Red),
        ));
    }
    let unlogged: u64 = app.nodes.values().map(|n| n.state.decisions_unlogged).sum();
    if unlogged > 0 {
        status.push(Span::styled(
            format!("  decisions not logged {unlogged}"),
            Style::default().fg(Color::Red),
        ));
    }
    // What health probes cost the cluster: shown once one was billed.
    let billed: u64 = app
        .nodes
        .values()
        .map(|n| n.state.probes.total("chat"))
        .sum();
    if billed > 0 {
        let per_hour: f64 = app
            .nodes
            .values()
            .map(|n| n.state.probes.spend_usd_per_hour)
            .sum();
        // And the target that costs most, summed over the nodes that probe it.
        let mut by_target: std::collections::BTreeMap<&str, f64> = Default::default();
        for n in app.nodes.values() {
            for (t, usd) in &n.state.probes.spend_usd_per_hour_by_target {
                *by_target.entry(t).or_default() += usd;
            }
        }
        let most = by_target
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(t, usd)| format!("; most {t} {}/h", crate::core::request::dollars(*usd, 4)))
            .unwrap_or_default();
        status.push(Span::raw(format!(
            "  probes {}/h ({billed} billed{most})",
            crate::core::request::dollars(per_hour, 4)
        )));
    }
    if let Some(code) = app.nodes.values().find_map(|n| n.state.probes.stopped) {
        status.push(Span::styled(
            format!("  billed probes stopped: {code}"),
            Style::default().fg(Color::Red),
        ));
    }
    if app.unreadable > 0 {
        status.push(Span::styled(
            format!(
                "  unreadable {} (last on {})",
                app.unreadable, app.unreadable_subject
            ),
            Style::default().fg(Color::Yellow),
        ));
    }
    let text = vec![
        Line::from(vec![
            Span::styled(label, style.add_modifier(Modifier::BOLD)),
            Span::raw(" "),
            Span::raw(why),
        ]),
        Line::from(health),
        Line::from(chaos),
        Line::from(status),
    ];
    f.render_widget(Paragraph::new(text), area);
}

fn render_nodes(f: &mut Frame, area: Rect, app: &App, now_ms: u64) {
    let live = app.live_nodes(now_ms);
    let offset = app.offset(Focus::Nodes, app.nodes.len());
    let id_width = app
        .nodes
        .keys()
        .map(|k| k.chars().count())
        .max()
        .unwrap_or(0);
    let cols = [
        col("node", id_width.clamp(4, 12) as u16, 0),
        col("state", 5, 0),
        col("view", 8, 1),
        col("beat", 5, 2),
    ];
    let rows: Vec<(Vec<Cell>, u16)> = app
        .nodes
        .iter()
        .skip(offset)
        .map(|(id, v)| {
            let alive = live.contains(&id.as_str());
            let age = now_ms.saturating_sub(v.seen_ms);
            // A down node's last view is stale: it is not shown as if it still held.
            let view = if alive {
                format!("sees {}/{}", v.state.live_nodes.len(), v.state.cluster_size)
            } else {
                "-".to_string()
            };
            let cells = vec![
                Cell::from(truncate(id, 12)),
                Cell::from(if alive { "alive" } else { "down" }).style(if alive {
                    Style::default().fg(Color::Green)
                } else {
                    Style::default().fg(Color::Red).add_modifier(Modifier::BOLD)
                }),
                Cell::from(view),
                Cell::from(format!("{:.1}s", age as f64 / 1e3)),
            ];
            (cells, 1)
        })
        .collect();
    // Inside the border, under the header.
    let shown = area.height.saturating_sub(3);
    let title = titled_more("Nodes", offset, app.nodes.len(), shown);
    let t = fitted_table(&cols, rows, area).block(block(&title, app.focus == Focus::Nodes));
    f.render_widget(t, area);
}

fn render_providers(f: &mut Frame, area: Rect, app: &App, now_ms: u64) {
    let Some(reference) = app.reference(now_ms) else {
        f.render_widget(
            Paragraph::new("waiting for node state snapshots…")
                .block(block("Provider consensus", app.focus == Focus::Providers)),
            area,
        );
        return;
    };
    let offset = app.offset(Focus::Providers, panel_len(app, Focus::Providers, now_ms));
    let live = app.live_nodes(now_ms);
    let id_width = reference
        .providers
        .iter()
        .map(|p| shown_id(p).chars().count())
        .max()
        .unwrap_or(0);
    // "n1● n2● n3●": a node id, its mark and a space each.
    let breakers_width = app
        .nodes
        .keys()
        .fold(0u16, |w, k| {
            w.saturating_add(u16::try_from(k.chars().count()).unwrap_or(u16::MAX))
                .saturating_add(2)
        })
        .saturating_sub(1);
    let cols = [
        col("provider", id_width.clamp(8, 14) as u16, 0),
        col("verdict", 9, 0),
        col("votes", 7, 2),
        col("avail", 5, 3),
        col("broken", 6, 5),
        col("p95", 7, 4),
        col("breakers", breakers_width.max(8), 1),
        col("share", 5, 1),
        // Why a target is failing, where there is room: its last failure as this node saw it.
        Col {
            flex: true,
            ..col("last failure", 14, 6)
        },
    ];
    let why_width = usize::from(flex_width(&cols, area));
    let rows: Vec<(Vec<Cell>, u16)> = reference
        .providers
        .iter()
        .skip(offset)
        .map(|p| {
            let c = &p.consensus;
            let breakers: Vec<Span> = app
                .nodes
                .iter()
                .filter_map(|(node, v)| {
                    let b = v.state.provider(&p.id)?.breaker;
                    if !live.contains(&node.as_str()) {
                        // A down node's breaker is as stale as its view.
                        return Some(Span::styled(
                            format!("{node}- "),
                            Style::default().fg(Color::DarkGray),
                        ));
                    }
                    let (style, mark) = match b {
                        Breaker::Closed { .. } => (Style::default().fg(Color::Green), "●"),
                        Breaker::Open { .. } => (Style::default().fg(Color::Red), "○"),
                        Breaker::HalfOpen { .. } => (Style::default().fg(Color::Yellow), "◐"),
                    };
                    Some(Span::styled(format!("{node}{mark} "), style))
                })
                .collect();
            let cells = vec![
                Cell::from(truncate(&shown_id(p), 14)),
                Cell::from(c.verdict.as_str().to_ascii_lowercase()).style(verdict_style(c.verdict)),
                Cell::from(format!(
                    "{}/{}{}",
                    c.votes,
                    c.cluster_size,
                    if c.quorum { "" } else { " own" }
                )),
                Cell::from(format!("{:.0}%", c.availability * 100.0)),
                Cell::from(format!("{:.0}%", c.contract_failure_pct)),
                Cell::from(format!("{}ms", c.p95_ms)),
                Cell::from(Line::from(breakers)),
                Cell::from(format!("{:.0}%", app.share(&p.id, now_ms) * 100.0)),
                match p.last_failure.as_ref().filter(|l| l.failing > 0) {
                    Some(l) => Cell::from(truncate(&failure_brief(l, now_ms), why_width))
                        .style(Style::default().fg(Color::Yellow)),
                    None => Cell::from(""),
                },
            ];
            (cells, 1)
        })
        .collect();
    let title = titled_more(
        "Provider consensus",
        offset,
        reference.providers.len(),
        area.height.saturating_sub(3),
    );
    let t = fitted_table(&cols, rows, area).block(block(&title, app.focus == Focus::Providers));
    f.render_widget(t, area);
}

/// A last failure as a table cell has room for it, what matters first: `HTTP 401
/// Unauthorized ... · 3 failing · 40s ago (probe)`.
fn failure_brief(l: &crate::core::wire::LastFailure, now_ms: u64) -> String {
    let what = l
        .error
        .clone()
        .unwrap_or_else(|| format!("{:?}", l.status).to_lowercase());
    let ago = now_ms.saturating_sub(l.at_ms) / 1_000;
    format!("{what} · {} failing · {ago}s ago ({})", l.failing, l.by)
}

/// A target as the providers panel names it: a tool server marked as one.
fn shown_id(p: &crate::core::wire::ProviderSnapshot) -> String {
    if p.tools {
        format!("{} (mcp)", p.id)
    } else {
        p.id.clone()
    }
}

fn render_bulkheads(f: &mut Frame, area: Rect, app: &App, now_ms: u64) {
    let b = block("Bulkheads (all nodes)", false);
    let inner = b.inner(area);
    f.render_widget(b, area);
    let live = app.live_nodes(now_ms);
    let live_states = || {
        app.nodes
            .iter()
            .filter(|(k, _)| live.contains(&k.as_str()))
            .map(|(_, v)| &v.state)
    };
    let sum = |class: Priority, field: fn(&Occupancy) -> u64| -> u64 {
        live_states().map(|s| field(s.bulkheads.usage(class))).sum()
    };
    let limit = |class: Priority| -> u64 {
        live_states()
            .map(|s| u64::from(s.bulkhead_limits.limits(class).concurrency))
            .sum()
    };
    let rows = Layout::vertical([Constraint::Length(1); 4]).split(inner);
    for (i, class) in Priority::ALL.into_iter().enumerate() {
        if i >= rows.len() {
            break;
        }
        let active = sum(class, |u| u64::from(u.active));
        let lim = limit(class).max(1);
        let (short, color) = match class {
            Priority::Critical => ("crit", Color::Cyan),
            Priority::Normal => ("norm", Color::Blue),
            Priority::Background => ("bg", Color::DarkGray),
        };
        let (queued, shed) = (sum(class, |u| u64::from(u.queued)), sum(class, |u| u.shed));
        let label = if inner.width >= 34 {
            format!("{short:<4} {active}/{lim} active, {queued} queued, {shed} shed")
        } else {
            format!("{short:<4} {active}/{lim} q{queued} shed {shed}")
        };
        f.render_widget(
            Gauge::default()
                .gauge_style(Style::default().fg(color))
                .ratio((active as f64 / lim as f64).clamp(0.0, 1.0))
                .label(label),
            rows[i],
        );
    }
    // Streams, every class together, on slots of their own.
    let streams = |field: fn(&Occupancy) -> u64| -> u64 {
        live_states()
            .map(|s| {
                Priority::ALL
                    .into_iter()
                    .map(|c| field(s.stream_bulkheads.usage(c)))
                    .sum::<u64>()
            })
            .sum()
    };
    let active = streams(|u| u64::from(u.active));
    let lim = live_states()
        .map(|s| u64::from(s.stream_bulkhead_limits.global_limit))
        .sum::<u64>()
        .max(1);
    let (queued, shed) = (streams(|u| u64::from(u.queued)), streams(|u| u.shed));
    let label = if inner.width >= 34 {
        format!("strm {active}/{lim} active, {queued} queued, {shed} shed")
    } else {
        format!("strm {active}/{lim} q{queued} shed {shed}")
    };
    f.render_widget(
        Gauge::default()
            .gauge_style(Style::default().fg(Color::Magenta))
            .ratio((active as f64 / lim as f64).clamp(0.0, 1.0))
            .label(label),
        rows[3],
    );
}

/// Budgets, open escalations (newest first) and loop incidents, a line each.
fn attention_lines(app: &App, now_ms: u64) -> Vec<Line<'static>> {
    let mut lines: Vec<Line> = Vec::new();
    if let Some(state) = app.reference(now_ms) {
        use crate::core::budget::OnExceeded;
        let usd = |v: f64| crate::core::request::dollars(v, 4);
        for (owner, b) in state.budgets.iter() {
            let left = b.remaining_usd(now_ms);
            let style = if left <= 0.0 && b.on_exceeded != OnExceeded::Audit {
                Style::default().fg(Color::Red)
            } else {
                Style::default()
            };
            let mut line = format!("budget {owner}: {} left", usd(left));
            if let Some(o) = b.overridden.filter(|o| now_ms < o.until_ms) {
                line += &format!(
                    " (override {} until {})",
                    usd(o.limit_usd),
                    crate::core::date::rfc3339(o.until_ms / 1_000)
                );
            }
            match b.on_exceeded {
                OnExceeded::Audit => {
                    line += &format!(", audit: {} would refuse", b.would_refuse);
                }
                OnExceeded::Escalate => line += ", escalates",
                OnExceeded::Refuse => {}
            }
            lines.push(Line::styled(line, style));
        }
    }
    let open = app.open_escalations();
    if open.len() > 1 {
        lines.push(Line::styled(
            format!("⚑ {} open escalations", open.len()),
            Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
        ));
    }
    for r in &open {
        let e = &r.escalation;
        let why = e.reason_codes.last().map_or("", |c| c.as_str());
        let action = match e.recommended_action {
            Action::HumanReview => "review",
            Action::HumanReviewBlockAutomaticAction => "review+block",
        };
        lines.push(Line::styled(
            format!(
                "⚑ {} {} → {action} {}s {}",
                e.agent,
                why.trim_start_matches("ESCALATED_"),
                now_ms.saturating_sub(e.created_at_ms) / 1_000,
                r.node,
            ),
            Style::default().fg(Color::Red),
        ));
    }
    for (at, node, i) in app.incidents.iter().rev().take(2) {
        lines.push(Line::styled(
            format!(
                "⟲ loop {}s ago {} {}/{}",
                now_ms.saturating_sub(*at) / 1_000,
                node,
                i.agent,
                i.task
            ),
            Style::default().fg(Color::Magenta),
        ));
    }
    if lines.is_empty() {
        lines.push(Line::styled(
            "nothing needs a human",
            Style::default().fg(Color::DarkGray),
        ));
    }
    lines
}

fn render_attention(f: &mut Frame, area: Rect, app: &App, now_ms: u64) {
    let lines = attention_lines(app, now_ms);
    let offset = app.offset(Focus::Attention, lines.len());
    // (Lines that wrap take more than one: the count is of lines at least.)
    let title = titled_more(
        "Budgets & attention",
        offset,
        lines.len(),
        area.height.saturating_sub(2),
    );
    f.render_widget(
        Paragraph::new(lines.into_iter().skip(offset).collect::<Vec<_>>())
            .wrap(Wrap { trim: true })
            .block(block(&title, app.focus == Focus::Attention)),
        area,
    );
}

/// The catalog with instance counts, then recent deaths, a line each; `wide` spells it out.
fn agent_lines(app: &App, now_ms: u64, wide: bool) -> Vec<Line<'static>> {
    let mut lines: Vec<Line> = Vec::new();
    for name in &app.catalog {
        let inst: Vec<_> = app
            .instances
            .values()
            .filter(|i| &i.agent == name)
            .collect();
        let fresh = inst
            .iter()
            .filter(|i| now_ms.saturating_sub(i.seen_ms) <= super::state::AGENT_STALE_MS)
            .count();
        let style = if fresh == 0 && !inst.is_empty() {
            Style::default().fg(Color::Yellow)
        } else {
            Style::default()
        };
        let busy: u64 = inst.iter().map(|i| i.in_flight).sum();
        let text = if wide {
            format!(
                "{name}: {fresh} of {} instances beating, {busy} in flight",
                inst.len()
            )
        } else {
            format!(
                "{} {fresh}/{} up, {busy} busy",
                truncate(name, 12),
                inst.len()
            )
        };
        lines.push(Line::styled(text, style));
    }
    for (at, n) in app.deaths.iter().rev().take(3) {
        lines.push(Line::styled(
            format!(
                "✝ {} {} ({}s ago)",
                n.agent,
                n.reason.as_str(),
                now_ms.saturating_sub(*at) / 1_000
            ),
            Style::default().fg(Color::Red),
        ));
    }
    if lines.is_empty() {
        lines.push(Line::styled(
            "no agents in the catalog",
            Style::default().fg(Color::DarkGray),
        ));
    }
    lines
}

/// Whether the agents panel has room for the long form of its lines.
fn agents_wide(area: Rect) -> bool {
    area.width >= 50
}

fn render_agents(f: &mut Frame, area: Rect, app: &App, now_ms: u64) {
    let lines = agent_lines(app, now_ms, agents_wide(area));
    let offset = app.offset(Focus::Agents, lines.len());
    let title = titled_more("Agents", offset, lines.len(), area.height.saturating_sub(2));
    f.render_widget(
        Paragraph::new(lines.into_iter().skip(offset).collect::<Vec<_>>())
            .block(block(&title, app.focus == Focus::Agents)),
        area,
    );
}

fn render_stream(f: &mut Frame, area: Rect, app: &App) {
    let visible = app.visible();
    let node_width = app
        .nodes
        .keys()
        .map(|k| k.chars().count())
        .max()
        .unwrap_or(2);
    let cols = [
        col("time UTC", 12, 4),
        col("", 4, 0),
        col("request", 14, 6),
        col("node", node_width.clamp(4, 8) as u16, 3),
        col("agent", 12, 1),
        col("provider", 9, 1),
        col("latency", 7, 2),
        col("phase", 10, 5),
        Col {
            head: "reasons",
            width: 20,
            rank: 0,
            flex: true,
        },
    ];
    let reasons_width = usize::from(flex_width(&cols, area));
    // Newest at the bottom; the reasons wrap (at commas) rather than being cut, so a line may
    // take more than one row: fill the panel from the newest line up.
    let mut room = usize::from(area.height.saturating_sub(3));
    let end = visible.len().saturating_sub(app.scroll);
    let mut rows: Vec<(Vec<Cell>, u16)> = Vec::new();
    for l in visible[..end].iter().rev() {
        let (style, tag) = kind_style(l.kind);
        let codes: Vec<&str> = l
            .codes
            .iter()
            .map(String::as_str)
            .filter(|c| !["ROUTING_SELECTED", "ACCEPTED"].contains(c))
            .collect();
        let codes = if codes.is_empty() {
            vec!["ACCEPTED"]
        } else {
            codes
        };
        let reasons = pack(&codes, ",", reasons_width);
        let height = reasons.len().min(room.max(1));
        if height > room {
            break;
        }
        room -= height;
        let ms = l.at_ms % 86_400_000;
        let cells = vec![
            Cell::from(format!(
                "{:02}:{:02}:{:02}.{:03}",
                ms / 3_600_000,
                ms / 60_000 % 60,
                ms / 1_000 % 60,
                ms % 1_000
            )),
            Cell::from(tag).style(style),
            Cell::from(tail(&l.request_id, 14)),
            Cell::from(truncate(&l.node, 8)),
            Cell::from(truncate(&l.agent, 12)),
            Cell::from(if l.provider.is_empty() {
                "-".to_string()
            } else {
                truncate(&l.provider, 9)
            }),
            Cell::from(format!("{:>5}ms", l.latency_ms)),
            Cell::from(l.phase.clone()),
            Cell::from(ratatui::text::Text::from(
                reasons.into_iter().map(Line::from).collect::<Vec<_>>(),
            ))
            .style(style),
        ];
        rows.push((cells, height as u16));
        if room == 0 {
            break;
        }
    }
    rows.reverse();
    let title = format!(
        "Reason-code stream{}{}",
        if app.paused { " (paused)" } else { "" },
        if app.scroll > 0 {
            format!(" (↑{})", app.scroll)
        } else {
            String::new()
        }
    );
    f.render_widget(
        fitted_table(&cols, rows, area).block(block(&title, app.focus == Focus::Stream)),
        area,
    );
}

/// The first `n` characters of `s`, the last one an ellipsis when it is cut.
fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n.saturating_sub(1)).chain(['…']).collect()
    }
}

/// The last `n` characters of `s` (where ids differ), the first an ellipsis when it is cut.
fn tail(s: &str, n: usize) -> String {
    let len = s.chars().count();
    if len <= n {
        s.to_string()
    } else {
        ['…']
            .into_iter()
            .chain(s.chars().skip(len + 1 - n))
            .collect()
    }
}

fn render_sparks(f: &mut Frame, area: Rect, app: &App, now_ms: u64) {
    let (rate, p95) = app.history(now_ms);
    let [top, bottom] =
        Layout::vertical([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(area);
    let width = top.width.saturating_sub(2) as usize;
    let tail = |v: &[u64]| v[v.len().saturating_sub(width)..].to_vec();
    let last = |v: &[u64]| v.iter().rev().nth(1).copied().unwrap_or(0);
    f.render_widget(
        Sparkline::default()
            .block(Block::bordered().title(format!(" {}/s ", last(&rate))))
            .data(tail(&rate))
            .style(Style::default().fg(Color::Green)),
        top,
    );
    f.render_widget(
        Sparkline::default()
            .block(Block::bordered().title(format!(" p95 {}ms ", last(&p95))))
            .data(tail(&p95))
            .style(Style::default().fg(Color::Yellow)),
        bottom,
    );
}

fn centered(area: Rect, w: u16, h: u16) -> Rect {
    let w = w.min(area.width);
    let h = h.min(area.height);
    Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    )
}

const KEYS: &[&str] = &[
    "q / Ctrl-C     quit (the terminal is restored)",
    "Tab            next panel (its border turns cyan)",
    "↑ ↓ PgUp PgDn  scroll that panel; Home back to the top",
    "               (the stream: back in history; End = newest)",
    "/              filter the stream: code, agent, provider, node",
    "p              pause / resume the stream (rates go on)",
    "c              chaos menu: inject a fault or restore everything",
    "a / r          acknowledge / resolve the newest open escalation",
    "?              this help (any key closes it)",
];

fn render_help(f: &mut Frame, area: Rect) {
    let mut text: Vec<Line> = KEYS.iter().map(|k| Line::from(*k)).collect();
    text.push(Line::from(""));
    text.extend(LEGEND.iter().map(|l| Line::from(*l)));
    let width = KEYS
        .iter()
        .chain(LEGEND)
        .map(|l| l.chars().count())
        .max()
        .unwrap_or(0) as u16
        + 2;
    let r = centered(area, width, text.len() as u16 + 2);
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(text)
            .wrap(Wrap { trim: false })
            .block(block("Help & legend", true)),
        r,
    );
}

fn render_chaos_menu(f: &mut Frame, area: Rect, sel: usize) {
    let r = centered(area, 44, CHAOS_MENU.len() as u16 + 4);
    let items: Vec<ListItem> = CHAOS_MENU
        .iter()
        .enumerate()
        .map(|(i, (label, ..))| {
            let style = if i == sel {
                Style::default().fg(Color::Black).bg(Color::Cyan)
            } else {
                Style::default()
            };
            ListItem::new(Line::styled(format!(" {label}"), style))
        })
        .collect();
    f.render_widget(Clear, r);
    f.render_widget(
        List::new(items).block(block("Chaos: Enter inject · Esc close", true)),
        r,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::breaker::Breaker;
    use crate::core::chaos::{Active, Fault, Params};
    use crate::core::pipeline::DecisionOutcome;
    use crate::core::reason::{Phase, ReasonCode};
    use crate::core::wire::{NodeSnapshot, ProviderSnapshot};
    use crate::mesh::protocol::DeathReason;
    use crate::transport::store::escalations::Status;
    use crate::tui::fixtures;
    use crate::tui::state::Update;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    const NOW: u64 = 1_800_000_000_000;

    fn provider(
        id: &str,
        verdict: Health,
        votes: usize,
        quorum: bool,
        avail: f64,
        p95: u64,
        breaker: Breaker,
    ) -> ProviderSnapshot {
        fixtures::provider(id, verdict, votes, quorum, avail, p95, breaker)
    }

    fn node_state(
        live: &[&str],
        providers: Vec<ProviderSnapshot>,
        shed_bg: u64,
    ) -> Box<NodeSnapshot> {
        fixtures::node_state(live, providers, shed_bg)
    }

    fn decision(
        outcome: DecisionOutcome,
        phase: Phase,
        provider: &str,
        fallback: bool,
        codes: &[ReasonCode],
        agent: &str,
    ) -> Box<crate::core::pipeline::Decision> {
        let latency = if fallback { 48 } else { 176 };
        fixtures::decision(
            outcome, phase, provider, fallback, codes, agent, latency, NOW,
        )
    }

    fn healthy() -> App {
        let mut app = App::default();
        app.apply(Update::Connection(true), NOW);
        let ps = || {
            vec![
                provider(
                    "primary",
                    Health::Healthy,
                    3,
                    true,
                    1.0,
                    198,
                    Breaker::default(),
                ),
                provider(
                    "local",
                    Health::Healthy,
                    3,
                    true,
                    1.0,
                    59,
                    Breaker::default(),
                ),
                provider(
                    "secondary",
                    Health::Healthy,
                    3,
                    true,
                    1.0,
                    197,
                    Breaker::default(),
                ),
            ]
        };
        for n in ["n1", "n2", "n3"] {
            app.apply(
                Update::NodeState {
                    node: n.into(),
                    state: node_state(&["n1", "n2", "n3"], ps(), 0),
                },
                NOW - 400,
            );
        }
        app.apply(
            Update::Catalog(vec!["demo.echo".into(), "llm.chat".into()]),
            NOW,
        );
        for (id, agent) in [("a1", "demo.echo"), ("a2", "demo.echo"), ("b1", "llm.chat")] {
            app.apply(Update::AgentBeat(fixtures::beat(agent, id)), NOW - 500);
        }
        for i in 0..6 {
            let node = ["n1", "n2", "n3"][i % 3];
            app.apply(
                Update::Decision {
                    node: node.into(),
                    decision: decision(
                        DecisionOutcome::Accepted,
                        Phase::Accepted,
                        "primary",
                        false,
                        &[ReasonCode::RoutingSelected, ReasonCode::Accepted],
                        "support-bot",
                    ),
                },
                NOW - 1_000 + i as u64 * 100,
            );
        }
        app
    }

    fn outage() -> App {
        let mut app = healthy();
        let ps = || {
            let mut primary = provider(
                "primary",
                Health::Unhealthy,
                3,
                true,
                0.12,
                0,
                fixtures::open(),
            );
            primary.last_failure = Some(crate::core::wire::LastFailure {
                at_ms: NOW - 4_000,
                by: "request".into(),
                status: crate::core::request::GenerationStatus::Error,
                error: Some("HTTP 503 Service Unavailable".into()),
                failing: 7,
            });
            vec![
                primary,
                provider(
                    "local",
                    Health::Healthy,
                    3,
                    true,
                    1.0,
                    61,
                    Breaker::default(),
                ),
                provider(
                    "secondary",
                    Health::Healthy,
                    3,
                    true,
                    1.0,
                    199,
                    Breaker::default(),
                ),
            ]
        };
        for n in ["n1", "n2", "n3"] {
            app.apply(
                Update::NodeState {
                    node: n.into(),
                    state: node_state(&["n1", "n2", "n3"], ps(), 0),
                },
                NOW - 300,
            );
        }
        app.apply(
            Update::Chaos(vec![Active {
                id: "c1a2b3".into(),
                fault: Fault::KillProvider,
                target: "primary".into(),
                params: Params::default(),
                injected_at_ms: NOW - 10_000,
                expires_at_ms: NOW + 20_000,
                detail: "hard 500s".into(),
            }]),
            NOW,
        );
        for i in 0..8 {
            app.apply(
                Update::Decision {
                    node: ["n1", "n2", "n3"][i % 3].into(),
                    decision: decision(
                        DecisionOutcome::Accepted,
                        Phase::Accepted,
                        "local",
                        true,
                        &[
                            ReasonCode::RoutingSelected,
                            ReasonCode::FallbackUsed,
                            ReasonCode::Accepted,
                        ],
                        "support-bot",
                    ),
                },
                NOW - 500 + i as u64 * 50,
            );
        }
        app
    }

    fn draw(app: &App, w: u16, h: u16) -> String {
        let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
        t.draw(|f| render(f, app, NOW)).unwrap();
        t.backend().to_string()
    }

    #[test]
    fn healthy_mesh() {
        insta::assert_snapshot!(draw(&healthy(), 160, 48));
    }

    /// NATS lost: the picture stays as it was when the bus went (nodes up, bulkheads as they
    /// were), greyed, and the banner says since when and what to run; back, it is live again.
    #[test]
    fn a_lost_bus_keeps_the_last_picture_greyed() {
        let mut app = healthy();
        let live = draw(&app, 160, 48);
        app.apply(Update::Connection(false), NOW);
        let later = NOW + 30_000;
        let mut t = Terminal::new(TestBackend::new(160, 48)).unwrap();
        t.draw(|f| render(f, &app, later)).unwrap();
        let text = t.backend().to_string();
        assert!(
            text.contains("NATS LOST") && text.contains("NATS unreachable for 30 s"),
            "{text}"
        );
        assert!(text.contains("oam mesh status"), "{text}");
        let alive = |screen: &str| screen.matches(" alive ").count();
        assert_eq!(alive(&live), 3, "{live}");
        assert_eq!(alive(&text), 3, "nodes are not aged into down:\n{text}");
        let buf = t.backend().buffer();
        let greyed = (0..48u16)
            .filter(|&y| y >= 4)
            .all(|y| (0..160u16).all(|x| buf[(x, y)].fg == Color::DarkGray));
        assert!(greyed, "every panel is greyed");
        app.apply(Update::Connection(true), later);
        assert!(app.lost_at_ms.is_none());
        assert_eq!(app.picture_ms(later), later);
    }

    #[test]
    fn healthy_mesh_at_80x24() {
        insta::assert_snapshot!(draw(&healthy(), 80, 24));
    }

    #[test]
    fn outage_rerouting() {
        let text = draw(&outage(), 160, 48);
        assert!(text.contains("REROUTING") && text.contains("kill-provider primary (20 s left)"));
        // Everything the stream knows, and the legend, when there is room.
        for column in ["time UTC", "request", "phase", "reasons", "FALLBACK_USED"] {
            assert!(text.contains(column), "{column} missing at 160x48:\n{text}");
        }
        for entry in LEGEND {
            assert!(
                text.contains(entry),
                "legend line missing at 160x48:\n{text}"
            );
        }
        insta::assert_snapshot!(text);
    }

    #[test]
    fn escalations_the_webhook_did_not_take_are_shown() {
        let mut app = healthy();
        assert!(!draw(&app, 100, 30).contains("undelivered"));
        let mut state = app.nodes["n2"].state.clone();
        state.escalations_undelivered = 2;
        app.apply(
            Update::NodeState {
                node: "n2".into(),
                state: Box::new(state),
            },
            NOW,
        );
        let text = draw(&app, 100, 30);
        assert!(text.contains("escalations undelivered 2"), "{text}");
    }

    #[test]
    fn decisions_the_log_did_not_take_are_shown() {
        let mut app = healthy();
        assert!(!draw(&app, 120, 30).contains("not logged"));
        let mut state = app.nodes["n1"].state.clone();
        state.decisions_unlogged = 7;
        app.apply(
            Update::NodeState {
                node: "n1".into(),
                state: Box::new(state),
            },
            NOW,
        );
        let text = draw(&app, 120, 30);
        assert!(text.contains("decisions not logged 7"), "{text}");
    }

    #[test]
    fn what_probes_cost_is_shown_once_one_is_billed() {
        let mut app = healthy();
        assert!(!draw(&app, 140, 30).contains("probes"));
        for (node, usd, code) in [
            ("n1", 0.0012, None),
            (
                "n2",
                0.0008,
                Some(crate::core::reason::ReasonCode::ProbeBudgetExhausted),
            ),
        ] {
            let mut state = app.nodes[node].state.clone();
            state
                .probes
                .calls
                .insert("primary".into(), [("chat".to_string(), 3)].into());
            state
                .probes
                .calls
                .insert("local".into(), [("models".to_string(), 90)].into());
            state.probes.spend_usd_per_hour = usd;
            state.probes.spend_usd_per_hour_by_target = [("primary".to_string(), usd)].into();
            state.probes.stopped = code;
            app.apply(
                Update::NodeState {
                    node: node.into(),
                    state: Box::new(state),
                },
                NOW,
            );
        }
        let text = draw(&app, 160, 30);
        assert!(
            text.contains("probes $0.0020/h (6 billed; most primary $0.0020/h)"),
            "{text}"
        );
        assert!(
            text.contains("billed probes stopped: PROBE_BUDGET_EXHAUSTED"),
            "{text}"
        );
    }

    #[test]
    fn unreadable_messages_are_counted_on_screen() {
        let mut app = healthy();
        assert!(!draw(&app, 80, 24).contains("unreadable"));
        let subject = crate::transport::subjects::decision("n9");
        for _ in 0..2 {
            app.apply(Update::Unreadable(subject.clone()), NOW);
        }
        let text = draw(&app, 80, 24);
        assert!(
            text.contains(&format!("unreadable 2 (last on {subject})")),
            "{text}"
        );
    }

    #[test]
    fn reasons_wrap_at_commas_instead_of_being_cut() {
        let mut app = healthy();
        let codes = [
            ReasonCode::GenerationError,
            ReasonCode::CircuitOpened,
            ReasonCode::RetryScheduled,
            ReasonCode::FallbackUsed,
        ];
        app.apply(
            Update::Decision {
                node: "n1".into(),
                decision: decision(
                    DecisionOutcome::Accepted,
                    Phase::Accepted,
                    "local",
                    true,
                    &codes,
                    "support-bot",
                ),
            },
            NOW,
        );
        for (w, h) in [(80, 24), (160, 48)] {
            let text = draw(&app, w, h);
            for c in codes {
                assert!(text.contains(c.as_str()), "{c:?} cut at {w}x{h}:\n{text}");
            }
        }
    }

    /// What does not fit is counted in the panel's title, never silently missing: a fourth
    /// and fifth provider at 80x24.
    #[test]
    fn rows_that_do_not_fit_are_counted_in_the_title() {
        let mut app = App::default();
        app.apply(Update::Connection(true), NOW);
        let ps: Vec<_> = ["p1", "p2", "p3", "p4", "p5"]
            .into_iter()
            .map(|id| provider(id, Health::Healthy, 3, true, 1.0, 10, Breaker::default()))
            .collect();
        for n in ["n1", "n2", "n3"] {
            app.apply(
                Update::NodeState {
                    node: n.into(),
                    state: node_state(&["n1", "n2", "n3"], ps.clone(), 0),
                },
                NOW - 400,
            );
        }
        let small = draw(&app, 80, 24);
        assert!(!small.contains("│p4 "), "{small}");
        assert!(small.contains("Provider consensus (+2 more)"), "{small}");
        // Where every row fits, nothing is said.
        let big = draw(&app, 160, 48);
        assert!(big.contains("│p5 ") && !big.contains("more)"), "{big}");
    }

    /// A target's last failure, where the table has room for it: why it is down, in view.
    #[test]
    fn a_failing_target_says_why_beside_its_verdict() {
        let text = draw(&outage(), 160, 48);
        let row = text
            .lines()
            .find(|l| l.contains("│primary") && l.contains("unhealthy"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(
            row.contains("HTTP 503 Service Unavailable · 7 failing"),
            "{row}"
        );
        let healthy = text.lines().find(|l| l.contains("│secondary ")).unwrap();
        assert!(!healthy.contains("failing"), "{healthy}");
    }

    /// A wide terminal puts the reason-code stream beside the tables, at full height, instead
    /// of leaving the right side of the tables blank.
    #[test]
    fn a_wide_terminal_has_the_stream_beside_the_tables() {
        let text = draw(&outage(), 200, 50);
        let lines: Vec<&str> = text.lines().collect();
        let title = lines
            .iter()
            .position(|l| l.contains("Reason-code stream"))
            .unwrap_or_else(|| panic!("{text}"));
        let nodes = lines.iter().position(|l| l.contains(" Nodes ")).unwrap();
        assert_eq!(
            title, nodes,
            "the stream starts beside the first tables:\n{text}"
        );
        let col = lines[title].find("Reason-code stream").unwrap();
        assert!(col > 100, "on the right: {col}");
        // At 160 columns it stays below them.
        let narrow = draw(&outage(), 160, 48);
        let at = |t: &str, s: &str| t.lines().position(|l| l.contains(s)).unwrap();
        assert!(at(&narrow, "Reason-code stream") > at(&narrow, " Nodes "));
    }

    /// What a key did, or why it could not, is said where an 80-column terminal shows it.
    #[test]
    fn a_refused_key_is_said_in_view_at_80_columns() {
        let mut app = outage();
        app.status = "chaos needs the operator's credentials: none in the folder".into();
        let text = draw(&app, 80, 24);
        let last = text.lines().last().unwrap();
        assert!(
            last.contains("chaos needs the operator's credentials"),
            "{last}"
        );
    }

    #[test]
    fn a_tool_server_is_marked_as_one_beside_the_models() {
        let mut app = App::default();
        app.apply(Update::Connection(true), NOW);
        let ps = vec![
            provider(
                "primary",
                Health::Healthy,
                3,
                true,
                1.0,
                198,
                Breaker::default(),
            ),
            provider(
                "tools",
                Health::Unhealthy,
                3,
                true,
                0.0,
                3,
                Breaker::default(),
            ),
        ];
        for n in ["n1", "n2", "n3"] {
            app.apply(
                Update::NodeState {
                    node: n.into(),
                    state: node_state(&["n1", "n2", "n3"], ps.clone(), 0),
                },
                NOW - 400,
            );
        }
        let text = draw(&app, 120, 40);
        assert!(text.contains("tools (mcp)"), "{text}");
        assert!(!text.contains("primary (mcp)"), "{text}");
    }

    #[test]
    fn below_80x24_it_says_the_terminal_is_too_small() {
        for (w, h) in [(79, 24), (80, 23), (40, 10)] {
            let text = draw(&outage(), w, h);
            assert!(
                text.contains("terminal too small") && text.contains(&format!("{w}x{h} here")),
                "{w}x{h}:\n{text}"
            );
            assert!(!text.contains("Provider consensus"), "{w}x{h}:\n{text}");
        }
        assert!(!draw(&outage(), 80, 24).contains("too small"));
    }

    #[test]
    fn the_help_popup_fits_at_80x24_with_a_legend_for_every_symbol() {
        let mut app = outage();
        app.help = true;
        let text = draw(&app, 80, 24);
        for line in KEYS.iter().chain(LEGEND) {
            assert!(text.contains(line), "cut: {line}\n{text}");
        }
        // Every symbol and short header the panels use is explained.
        let legend = LEGEND.join(" ");
        for symbol in [
            "●", "◐", "○", "- down", "votes", "own", "avail", "broken", "p95", "share", "beat",
            "q ", "⚑", "⟲", "✝", "ok ", "fall", "shed", "esc", "no ",
        ] {
            assert!(legend.contains(symbol), "{symbol} not explained");
        }
        insta::assert_snapshot!(text);
    }

    #[test]
    fn budgets_say_their_scope_their_mode_and_an_override() {
        use crate::core::budget::{Budget, OnExceeded, Override};
        let mut app = healthy();
        let mut state = node_state(&["n1", "n2", "n3"], Vec::new(), 0);
        state.budgets.teams.insert(
            "support".into(),
            Budget {
                spent_usd: 21.0,
                on_exceeded: OnExceeded::Audit,
                would_refuse: 3,
                ..Budget::new(20.0)
            },
        );
        state.budgets.global = Some(Budget {
            overridden: Some(Override {
                limit_usd: 100.0,
                until_ms: NOW + 2 * 3_600_000,
            }),
            on_exceeded: OnExceeded::Escalate,
            ..Budget::new(50.0)
        });
        for n in ["n1", "n2", "n3"] {
            let state = state.clone();
            app.apply(
                Update::NodeState {
                    node: n.into(),
                    state,
                },
                NOW,
            );
        }
        let lines: Vec<String> = attention_lines(&app, NOW)
            .iter()
            .map(|l| l.spans.iter().map(|s| s.content.as_ref()).collect())
            .collect();
        let text = lines.join("\n");
        let until = crate::core::date::rfc3339((NOW + 2 * 3_600_000) / 1_000);
        for part in [
            "budget agent:support-bot: $3.7500 left",
            "budget team:support: $0.0000 left, audit: 3 would refuse",
            &format!("budget global: $100.0000 left (override $100.0000 until {until}), escalates"),
        ] {
            assert!(text.contains(part), "{part} in\n{text}");
        }
    }

    #[test]
    fn a_focused_panel_scrolls_what_does_not_fit_at_80x24() {
        let mut app = healthy();
        let names: Vec<String> = (0..12).map(|i| format!("agent.n{i:02}")).collect();
        app.apply(Update::Catalog(names), NOW);
        for i in 0..6 {
            let open = crate::transport::store::escalations::example(
                &format!("esc-{i}"),
                &format!("bot{i}"),
                NOW - 1_000 * i,
                Status::Open,
            );
            app.apply(Update::Escalation(Box::new(open)), NOW);
        }
        let before = draw(&app, 80, 24);
        assert!(
            before.contains("agent.n00") && !before.contains("agent.n11"),
            "{before}"
        );
        assert!(before.contains("⚑ 6 open escalations"), "{before}");
        app.focus = Focus::Agents;
        let len = panel_len(&app, Focus::Agents, NOW);
        assert_eq!(len, 12);
        app.scroll_by(100, len);
        app.focus = Focus::Attention;
        app.scroll_by(3, panel_len(&app, Focus::Attention, NOW));
        let after = draw(&app, 80, 24);
        assert!(
            after.contains("Agents (↓11)")
                && after.contains("agent.n11")
                && !after.contains("agent.n00"),
            "{after}"
        );
        assert!(
            after.contains("attention (↓3)") && !after.contains("⚑ 6 open"),
            "{after}"
        );
        insta::assert_snapshot!(after);
    }

    #[test]
    fn outage_at_80x24_keeps_every_panel() {
        let text = draw(&outage(), 80, 24);
        // Names and verdicts stay words; a dead node is "down" and shows no stale view.
        for word in [
            "primary",
            "secondary",
            "unhealthy",
            "healthy",
            "demo.echo 2/2 up",
        ] {
            assert!(text.contains(word), "{word} cut at 80x24:\n{text}");
        }
        for panel in [
            "Nodes",
            "Provider consensus",
            "Bulkheads",
            "Agents",
            "Reason-code stream",
        ] {
            assert!(text.contains(panel), "{panel} missing at 80x24:\n{text}");
        }
        insta::assert_snapshot!(text);
    }

    #[test]
    fn no_quorum_with_dead_nodes() {
        let mut app = healthy();
        let ps = vec![
            provider(
                "primary",
                Health::Healthy,
                1,
                false,
                1.0,
                199,
                Breaker::default(),
            ),
            provider(
                "local",
                Health::Healthy,
                1,
                false,
                1.0,
                60,
                Breaker::default(),
            ),
        ];
        // n2 and n3 went silent 10 s ago; n1 is on its own.
        app.nodes.get_mut("n2").unwrap().seen_ms = NOW - 10_000;
        app.nodes.get_mut("n3").unwrap().seen_ms = NOW - 10_000;
        app.apply(
            Update::NodeState {
                node: "n1".into(),
                state: node_state(&["n1"], ps, 0),
            },
            NOW - 200,
        );
        app.apply(
            Update::Decision {
                node: "n1".into(),
                decision: decision(
                    DecisionOutcome::Accepted,
                    Phase::Accepted,
                    "primary",
                    false,
                    &[ReasonCode::NoQuorumLocalView, ReasonCode::Accepted],
                    "support-bot",
                ),
            },
            NOW,
        );
        let text = draw(&app, 160, 48);
        assert!(text.contains("NO QUORUM") && text.contains("down"));
        insta::assert_snapshot!(text);
    }

    #[test]
    fn agent_death() {
        let mut app = healthy();
        app.apply(
            Update::Death(fixtures::death("llm.chat", DeathReason::Disconnect, "b1")),
            NOW - 2_000,
        );
        let text = draw(&app, 160, 48);
        assert!(text.contains("llm.chat disconnect"));
        insta::assert_snapshot!(text);
    }

    #[test]
    fn loop_escalation() {
        let mut app = healthy();
        app.apply(
            Update::Incident {
                node: "n1".into(),
                incident: fixtures::incident("loop-bot", "refund"),
            },
            NOW - 3_000,
        );
        let open = crate::transport::store::escalations::example(
            "esc-inc-1",
            "loop-bot",
            NOW - 3_000,
            Status::Open,
        );
        app.apply(Update::Escalation(Box::new(open)), NOW - 3_000);
        app.apply(
            Update::Decision {
                node: "n1".into(),
                decision: decision(
                    DecisionOutcome::Escalated,
                    Phase::Loop,
                    "",
                    false,
                    &[
                        ReasonCode::AgentLoopDetected,
                        ReasonCode::EscalatedAgentLoop,
                    ],
                    "loop-bot",
                ),
            },
            NOW - 3_000,
        );
        app.apply(
            Update::Decision {
                node: "n1".into(),
                decision: decision(
                    DecisionOutcome::Rejected,
                    Phase::Loop,
                    "",
                    false,
                    &[ReasonCode::RunawayRetryStopped],
                    "loop-bot",
                ),
            },
            NOW - 2_000,
        );
        let text = draw(&app, 160, 48);
        assert!(text.contains("loop-bot") && text.contains("ESCALATED_AGENT_LOOP"));
        insta::assert_snapshot!(text);
    }
}
