"""BusyTracker's fraction math on a fake clock, and the metrics as Prometheus scrapes them over HTTP."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from rlpipe.observe.metrics import (
    BusyTracker,
    PipelineMetrics,
    metrics_port,
    sdk_metrics_port,
    serve_metrics,
    temporal_runtime,
)

LOOPBACK = "127.0.0.1"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def run_overlapping(tracker: BusyTracker, clock: FakeClock) -> None:
    """Two grader activities: A over [0, 5], B over [2, 7]; busy 0..7 once, not 5 + 5 = 10."""
    tracker.start("grader")      # A at 0
    clock.now = 2
    tracker.start("grader")      # B at 2
    clock.now = 5
    tracker.stop("grader")       # A ends
    clock.now = 7
    tracker.stop("grader")       # B ends


def test_overlapping_activities_count_once(clock: FakeClock) -> None:
    tracker = BusyTracker(window_s=10, clock=clock)
    run_overlapping(tracker, clock)
    clock.now = 10
    assert tracker.busy_fraction("grader") == pytest.approx(0.7)
    assert tracker.busy_seconds_total("grader") == pytest.approx(7.0)


def test_window_slides_and_counts_a_running_activity(clock: FakeClock) -> None:
    tracker = BusyTracker(window_s=10, clock=clock)
    run_overlapping(tracker, clock)
    clock.now = 15                                   # window [5, 15]: busy 5..7
    assert tracker.busy_fraction("grader") == pytest.approx(0.2)
    clock.now = 14
    tracker.start("grader")                          # still running at 15
    clock.now = 15
    assert tracker.busy_fraction("grader") == pytest.approx(0.3)
    assert tracker.active("grader") == 1
    clock.now = 30                                   # running through the whole window
    assert tracker.busy_fraction("grader") == pytest.approx(1.0)
    assert tracker.busy_seconds_total("grader") == pytest.approx(7 + 16)


def test_a_young_tracker_divides_by_its_age_not_the_window(clock: FakeClock) -> None:
    tracker = BusyTracker(window_s=60, clock=clock)
    clock.now = 1
    with tracker.busy("trainer"):
        clock.now = 3
    assert tracker.busy_fraction("trainer") == pytest.approx(2 / 3)


def test_busy_block_ends_even_when_the_activity_raises(clock: FakeClock) -> None:
    tracker = BusyTracker(window_s=10, clock=clock)
    with pytest.raises(RuntimeError), tracker.busy("sandbox"):
        clock.now = 4
        raise RuntimeError("tool crashed")
    clock.now = 10
    assert tracker.active("sandbox") == 0
    assert tracker.busy_fraction("sandbox") == pytest.approx(0.4)


def test_declared_idle_box_reports_zero_and_unmatched_stop_fails(clock: FakeClock) -> None:
    tracker = BusyTracker(window_s=10, clock=clock, boxes=["trainer"])
    clock.now = 5
    assert tracker.boxes() == ["trainer"]
    assert tracker.busy_fraction("trainer") == 0.0
    with pytest.raises(ValueError, match="without a matching start"):
        tracker.stop("trainer")


def test_port_convention() -> None:
    assert [metrics_port(k) for k in ("rollout", "sandbox", "grader", "trainer")] == [9101, 9102, 9103, 9104]
    assert metrics_port("sidecar", server=2) == 9112
    assert sdk_metrics_port(metrics_port("trainer")) == 9204
    assert metrics_port("grader", base=19100) == 19103
    with pytest.raises(ValueError):
        metrics_port("sidecar")
    with pytest.raises(ValueError):
        metrics_port("judge")


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] as Prometheus would read http://host:port/metrics."""
    with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    matches = [v for lbls, v in samples[name] if all(lbls.get(k) == x for k, x in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def test_metrics_served_on_a_free_port_parse_as_prometheus(clock: FakeClock) -> None:
    metrics = PipelineMetrics(CollectorRegistry(), BusyTracker(window_s=10, clock=clock, boxes=["trainer"]))
    run_overlapping(metrics.tracker, clock)
    clock.now = 10
    metrics.observe_train_step("r1", step=3, duration_s=12.0, n_tokens=500, staleness=[0, 1, 1, 3],
                               reward_mean=0.4, entropy=1.2, kl_sampler=0.01, response_length=42.0)
    metrics.observe_sync("r1", "0", version=2, status="ok", timings={"reload": 0.8, "total": 1.5, "verify": None})
    metrics.observe_failure("tool", "run_tool")
    metrics.observe_failure("tool", "run_tool")
    metrics.observe_generation("r1", 64)
    metrics.observe_group("r1", "completed", ["completed", "completed", "discarded"])

    port = serve_metrics(0, addr=LOOPBACK, registry=metrics.registry)
    assert port > 0
    samples = scrape(port)

    assert value(samples, "rlpipe_box_busy_fraction", box="grader") == pytest.approx(0.7)
    assert value(samples, "rlpipe_box_busy_fraction", box="trainer") == 0.0
    assert value(samples, "rlpipe_box_busy_seconds_total", box="grader") == pytest.approx(7.0)
    assert value(samples, "rlpipe_staleness_steps_bucket", run="r1", le="0.0") == 1
    assert value(samples, "rlpipe_staleness_steps_bucket", run="r1", le="1.0") == 3
    assert value(samples, "rlpipe_staleness_steps_count", run="r1") == 4
    assert value(samples, "rlpipe_trained_tokens_total", run="r1") == 500
    assert value(samples, "rlpipe_train_step_duration_seconds_sum", run="r1") == 12.0
    assert value(samples, "rlpipe_train_entropy", run="r1") == 1.2
    assert value(samples, "rlpipe_sync_duration_seconds_sum", run="r1", server="0", phase="total") == 1.5
    assert "verify" not in {lbls["phase"] for lbls, _ in samples["rlpipe_sync_duration_seconds_count"]}
    assert value(samples, "rlpipe_server_policy_version", run="r1", server="0") == 2
    assert value(samples, "rlpipe_failures_total", kind="tool", activity="run_tool") == 2
    assert value(samples, "rlpipe_trajectories_total", run="r1", status="completed") == 2
    assert value(samples, "rlpipe_generated_tokens_total", run="r1") == 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def test_temporal_runtime_serves_sdk_metrics() -> None:
    port = free_port()
    runtime = temporal_runtime(port, addr=LOOPBACK, service="test")
    runtime.metric_meter.create_counter("rlpipe_probe", "a probe counter").add(1)
    samples = scrape(port)
    assert value(samples, "rlpipe_probe_total", service="test") == 1


def exposed_names(metrics: PipelineMetrics) -> set[str]:
    """Every name PromQL may use for the pipeline's metrics (families and their sample suffixes)."""
    names = set()
    for family in metrics.registry.collect():
        names |= {family.name + suffix for suffix in ("", "_total", "_bucket", "_sum", "_count")}
    return names


REPO = Path(__file__).resolve().parents[2]


def test_dashboard_and_runbook_name_only_defined_metrics() -> None:
    names = exposed_names(PipelineMetrics(CollectorRegistry()))
    dashboard = json.loads((REPO / "infra/grafana/rlpipe-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    used = {m for expr in exprs for m in re.findall(r"rlpipe_[a-z_]+", expr)}
    assert used and used <= names, used - names
    runbook = (REPO / "docs/runbook.md").read_text()
    documented = set(re.findall(r"`(rlpipe_[a-z_]+)`", runbook))
    assert documented <= names, documented - names
    families = {f.name for f in PipelineMetrics(CollectorRegistry()).registry.collect()}
    undocumented = {f for f in families if f not in documented and f + "_total" not in documented}
    assert not undocumented, undocumented
