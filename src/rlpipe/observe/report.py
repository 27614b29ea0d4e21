"""`write_report(session, run_id, out_dir)`: one run on one page, from Postgres. PNG plots, a
`report.md` that embeds them, and a self-contained `report.html` (images inlined) to mail around.

The page answers, in order: what the run did (key numbers), what is wrong with it (the doctor's
verdicts), and the curves and timelines behind both. A plot whose data is missing (no evals, no
syncs, a run that has not trained yet) is replaced by a note: a report of a broken run is exactly
when it is needed, so it never crashes on missing data.

    python -m rlpipe.observe.report RUN [--out reports/RUN] [--database-url URL]
"""

from __future__ import annotations

import argparse
import base64
import html
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from rlpipe.observe import plots
from rlpipe.observe import queries as q
from rlpipe.observe.doctor import Finding, diagnose
from rlpipe.storage.db import Database

log = logging.getLogger("rlpipe.report")


@dataclass(frozen=True)
class ReportData:
    """Everything the page shows, read in one transaction."""

    info: q.RunInfo
    window: q.RunWindow
    steps: list[q.StepRow]
    rewards: list[q.RewardDistribution]
    staleness: dict[int, int]
    depth: list[q.DepthPoint]
    usage: dict[str, q.BoxUsage]
    segments: list[q.Segment]
    syncs: list[q.SyncRow]
    sync: q.SyncShare | None
    grader_share: float | None
    groups: q.GroupCounts
    evals: list[q.EvalRow]
    failures: list[q.FailureCount]
    slow_tools: list[q.ToolCallRow]
    findings: list[Finding]


def read_report_data(s: Session, run_id: str) -> ReportData:
    return ReportData(
        info=q.run_info(s, run_id), window=q.run_window(s, run_id), steps=q.step_metrics(s, run_id),
        rewards=q.reward_distribution(s, run_id), staleness=q.staleness_histogram(s, run_id),
        depth=q.buffer_depth(s, run_id), usage=q.box_usage(s, run_id), segments=q.timeline(s, run_id),
        syncs=q.sync_timings(s, run_id), sync=q.sync_share(s, run_id), grader_share=q.grader_time_share(s, run_id),
        groups=q.group_counts(s, run_id), evals=q.eval_accuracy(s, run_id), failures=q.failures_by_kind(s, run_id),
        slow_tools=q.slowest_tool_calls(s, run_id, limit=5), findings=diagnose(s, run_id))


# -- plots ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlotResult:
    title: str
    path: Path | None
    note: str = ""
    """Why the plot is missing (when path is None)."""


@dataclass(frozen=True)
class PlotSpec:
    file: str
    title: str
    missing: str | None
    """Why there is nothing to draw, or None when there is."""
    draw: Callable[[Path], Path]


def _has(steps: list[q.StepRow], attribute: str) -> bool:
    return any(getattr(s, attribute) is not None for s in steps)


def plot_specs(d: ReportData) -> list[PlotSpec]:
    """The report's figures in page order, each with the reason it would be skipped."""
    no_steps = "no committed train steps yet"

    def series(attribute: str, title: str, ylabel: str) -> Callable[[Path], Path]:
        return lambda p: plots.plot_step_series(d.steps, attribute, title, ylabel, p)

    step_starts = [d.window.offset(s.started_at) for s in d.steps]
    return [
        PlotSpec("reward.png", "Reward per step", None if _has(d.steps, "reward_mean") or d.rewards else no_steps,
                 lambda p: plots.plot_reward(d.steps, d.rewards, p)),
        PlotSpec("response_length.png", "Response length", None if _has(d.steps, "response_length_mean") else
                 "no response lengths recorded", series("response_length_mean", "Mean response length per step",
                                                        "tokens")),
        PlotSpec("entropy.png", "Entropy", None if _has(d.steps, "entropy") else "no entropy recorded",
                 series("entropy", "Mean token entropy per step", "entropy (nats)")),
        PlotSpec("kl.png", "KL(sampler || trainer)", None if _has(d.steps, "kl_sampler") else "no KL recorded",
                 series("kl_sampler", "KL(sampler || trainer) per token", "KL (nats / token)")),
        PlotSpec("staleness.png", "Staleness", None if d.staleness else "no consumed trajectories yet",
                 lambda p: plots.plot_staleness(d.staleness, d.info.max_staleness, p)),
        PlotSpec("buffer_depth.png", "Buffer depth", None if d.depth else "no completed groups yet",
                 lambda p: plots.plot_buffer_depth(d.depth, d.window, step_starts, d.info.groups_per_step, p)),
        PlotSpec("idle.png", "Busy / idle per box", None if d.usage else "no activity spans recorded",
                 lambda p: plots.plot_idle(d.usage, p)),
        PlotSpec("sync.png", "Weight syncs", None if d.syncs and d.sync else "no weight syncs recorded",
                 lambda p: plots.plot_sync(d.syncs, d.sync.share if d.sync else 0.0, p)),
        PlotSpec("eval_accuracy.png", "Eval accuracy", None if d.evals else "no evals recorded",
                 lambda p: plots.plot_eval(d.evals, p)),
        PlotSpec("timeline.png", "Timeline of the boxes", None if d.segments else "no activity spans recorded",
                 lambda p: plots.plot_timeline(d.segments, d.window, p)),
    ]


def draw_plots(d: ReportData, out_dir: Path) -> list[PlotResult]:
    """Draw every figure that has data. A figure that fails anyway is logged and noted, so one bad
    series never costs the rest of the report."""
    results = []
    for spec in plot_specs(d):
        if spec.missing is not None:
            results.append(PlotResult(spec.title, None, f"skipped: {spec.missing}"))
            continue
        try:
            results.append(PlotResult(spec.title, spec.draw(out_dir / spec.file)))
        except Exception as exc:  # noqa: BLE001 - see docstring
            log.exception("plot %s failed", spec.file)
            results.append(PlotResult(spec.title, None, f"failed: {type(exc).__name__}: {exc}"))
    return results


# -- key numbers ------------------------------------------------------------------------------------
def key_numbers(d: ReportData) -> list[tuple[str, str]]:
    """The table at the top of the page: what the run did, in numbers."""
    tokens = sum(s.n_tokens for s in d.steps)
    wall = d.window.wall_s
    n_stale = sum(d.staleness.values())
    rewards = [s.reward_mean for s in d.steps if s.reward_mean is not None]
    backlog = [q.depth_before(d.depth, s.started_at) for s in d.steps]
    rows = [
        ("run", f"{d.info.run_id} ({d.info.mode}, {d.info.status})"),
        ("steps", f"{len(d.steps)} of {d.info.steps}"),
        ("wall time", f"{wall:.1f} s"),
        ("trained tokens", f"{tokens} ({tokens / wall:.1f} tokens/s)" if wall > 0 else str(tokens)),
        ("groups", f"{d.groups.consumed} consumed, {d.groups.completed - d.groups.consumed} waiting, "
                   f"{d.groups.dropped} dropped ({d.groups.uninformative_dropped} as uninformative), "
                   f"{d.groups.failed} failed"),
        ("reward (first -> last step)", f"{rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else "-"),
        ("staleness (mean / max / bound)",
         f"{sum(k * v for k, v in d.staleness.items()) / n_stale:.2f} / {max(d.staleness)} / {d.info.max_staleness}"
         if n_stale else f"- / - / {d.info.max_staleness}"),
        ("buffer at step start (mean groups)", f"{statistics.fmean(backlog):.1f}" if backlog else "-"),
        ("grader share of busy time", f"{d.grader_share:.1%}" if d.grader_share is not None else "-"),
        ("sync share of wall time", f"{d.sync.share:.1%} ({d.sync.n_syncs} syncs)" if d.sync else "-"),
        ("servers paused for syncs", f"{d.sync.paused_share:.1%} of their time" if d.sync else "-"),
        ("failures", str(sum(f.failures for f in d.failures))),
    ]
    rows += [(f"{box} busy / idle", f"{u.busy_fraction:.0%} / {u.idle_fraction:.0%}")
             for box, u in sorted(d.usage.items())]
    return rows


# -- rendering --------------------------------------------------------------------------------------
def _md_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    def cell(x: str) -> str:
        return x.replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(c) for c in row) + " |" for row in rows), ""]


def _finding_rows(findings: list[Finding]) -> list[tuple[str, ...]]:
    return [(f.check, f.status.upper() if f.status != "ok" else "ok", f.verdict, f.remedy) for f in findings]


def render_markdown(d: ReportData, figures: list[PlotResult]) -> str:
    lines = [f"# Run report: {d.info.run_id}", "", "## Key numbers", ""]
    lines += _md_table(("metric", "value"), key_numbers(d))
    lines += ["## Doctor", ""] + _md_table(("check", "status", "verdict", "remedy"), _finding_rows(d.findings))
    if d.slow_tools:
        lines += ["## Slowest tool calls", ""] + _md_table(
            ("trajectory", "turn", "tool", "latency (s)", "status"),
            [(str(t.trajectory_id), str(t.turn_index), t.tool or "-", f"{t.latency_s:.2f}", t.status or "-")
             for t in d.slow_tools])
    if d.failures:
        lines += ["## Failures", ""] + _md_table(
            ("kind", "activity", "error", "count", "last message"),
            [(f.kind, f.activity or "-", f.error_type, str(f.failures), f.last_message[:120]) for f in d.failures[:10]])
    lines += ["## Plots", ""]
    for fig in figures:
        lines += [f"### {fig.title}", "", f"![{fig.title}]({fig.path.name})" if fig.path else f"_{fig.note}_", ""]
    return "\n".join(lines)


HTML_STYLE = """body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}
table{border-collapse:collapse;margin-bottom:1.5em}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}
.ok{color:#2a7d2a}.warn{color:#b58900;font-weight:bold}.problem{color:#c0392b;font-weight:bold}
img{max-width:100%}.note{color:#777;font-style:italic}"""


def _html_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], status_column: int | None = None) -> str:
    def row_html(row: tuple[str, ...]) -> str:
        cells = [f'<td class="{html.escape(c.lower())}">{html.escape(c)}</td>' if i == status_column
                 else f"<td>{html.escape(c)}</td>" for i, c in enumerate(row)]
        return "<tr>" + "".join(cells) + "</tr>"

    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
    return "<table>" + head + "".join(row_html(r) for r in rows) + "</table>"


def render_html(d: ReportData, figures: list[PlotResult]) -> str:
    """The same page as the markdown, with the PNGs inlined so the file stands alone."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Run report: {html.escape(d.info.run_id)}"
             f"</title><style>{HTML_STYLE}</style></head><body>",
             f"<h1>Run report: {html.escape(d.info.run_id)}</h1>", "<h2>Key numbers</h2>",
             _html_table(("metric", "value"), key_numbers(d)), "<h2>Doctor</h2>",
             _html_table(("check", "status", "verdict", "remedy"),
                         [(f.check, f.status, f.verdict, f.remedy) for f in d.findings], status_column=1),
             "<h2>Plots</h2>"]
    for fig in figures:
        parts.append(f"<h3>{html.escape(fig.title)}</h3>")
        if fig.path:
            data = base64.b64encode(fig.path.read_bytes()).decode()
            parts.append(f'<img alt="{html.escape(fig.title)}" src="data:image/png;base64,{data}">')
        else:
            parts.append(f'<p class="note">{html.escape(fig.note)}</p>')
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(s: Session, run_id: str, out_dir: Path) -> Path:
    """Write the plots, report.md and report.html of one run into `out_dir` (created if needed);
    returns the path of report.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = read_report_data(s, run_id)
    figures = draw_plots(data, out_dir)
    (out_dir / "report.html").write_text(render_html(data, figures))
    report = out_dir / "report.md"
    report.write_text(render_markdown(data, figures))
    return report


# -- command line -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlpipe.observe.report", description="Write one run's report.")
    parser.add_argument("run", help="run name")
    parser.add_argument("--out", type=Path, help="output directory (default reports/RUN)")
    parser.add_argument("--database-url", help="default: DATABASE_URL or the local stack's database")
    args = parser.parse_args(argv)
    from rlpipe.infra.endpoints import database_url  # the command line's default: where the workers write

    db = Database(database_url(args.database_url))
    try:
        with db.begin() as s:
            path = write_report(s, args.run, args.out or Path("reports") / args.run)
    finally:
        db.dispose()
    print(f"report: {path} (and {path.with_suffix('.html').name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
