"""The staleness budget (workflows/admission.py) on its own, without Temporal."""

from __future__ import annotations

import pytest

from rlpipe.workflows.admission import LauncherLimits, LauncherView, admitted_server, least_loaded_freshest

LIMITS = LauncherLimits(steps=10, groups_per_step=4, max_concurrent_groups=100)


def view(**changes: object) -> LauncherView:
    base: dict[str, object] = {"paused": False, "in_flight": 0, "consumed": 0, "fresh_ready": 0, "step": 0,
                               "max_staleness": 1, "server_steps": {"0": 0}, "next_group_index": 0}
    return LauncherView(**(base | changes))  # type: ignore[arg-type]


@pytest.mark.parametrize(("max_staleness", "admitted"), [(0, 4), (1, 8), (3, 16)])
def test_the_budget_admits_max_staleness_plus_one_batches_ahead_of_the_weights(max_staleness: int,
                                                                              admitted: int) -> None:
    under_way = [n for n in range(40) if admitted_server(view(in_flight=n, max_staleness=max_staleness), LIMITS)]
    assert len(under_way) == admitted  # (η + live + 1) · B with live = 0


def test_consumed_and_fresh_groups_count_against_the_budget() -> None:
    assert admitted_server(view(in_flight=3, consumed=4, fresh_ready=0), LIMITS) == "0"
    assert admitted_server(view(in_flight=3, consumed=4, fresh_ready=1), LIMITS) is None


def test_newer_weights_widen_the_budget() -> None:
    full = view(in_flight=8, step=1)
    assert admitted_server(full, LIMITS) is None
    assert admitted_server(view(in_flight=8, step=1, server_steps={"0": 1}), LIMITS) == "0"


def test_weights_too_old_for_the_next_step_admit_nothing() -> None:
    assert admitted_server(view(step=3, max_staleness=1, server_steps={"0": 1}), LIMITS) is None
    assert admitted_server(view(step=3, max_staleness=1, server_steps={"0": 2}), LIMITS) == "0"


def test_groups_go_round_robin_to_the_freshest_servers_only() -> None:
    servers = {"a": 2, "b": 2, "c": 1}
    picks = [admitted_server(view(step=2, server_steps=servers, next_group_index=i), LIMITS) for i in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_groups_go_to_the_least_loaded_of_the_freshest_servers() -> None:
    servers = {"a": 2, "b": 2, "c": 1}
    assert admitted_server(view(step=2, server_steps=servers, server_load={"a": 3, "b": 1}), LIMITS) == "b"
    # a stale server is not a candidate however idle it is
    assert admitted_server(view(step=2, server_steps=servers, server_load={"a": 3, "b": 3}), LIMITS) == "a"
    # a slow server keeps its groups longer and gets fewer: six groups, one finishing on "a" per start
    load, picks = {"a": 0, "b": 0}, []
    for i in range(6):
        pick = admitted_server(view(step=2, server_steps=servers, server_load=load, next_group_index=i), LIMITS)
        assert pick is not None
        picks.append(pick)
        load[pick] += 1
        load["a"] = max(0, load["a"] - 1)
    assert picks.count("a") > picks.count("b")


@pytest.mark.parametrize("changes", [{"paused": True}, {"in_flight": 100}, {"server_steps": {}},
                                     {"consumed": 36, "fresh_ready": 4}])
def test_no_group_while_paused_saturated_serverless_or_planned_out(changes: dict[str, object]) -> None:
    assert admitted_server(view(**changes), LIMITS) is None


def test_a_rerouted_group_goes_to_the_least_loaded_of_the_freshest_servers_up() -> None:
    assert least_loaded_freshest({}, {}, 0) is None, "no server up: the group stays where it is"
    steps = {"a": 2, "b": 3, "c": 3}
    assert least_loaded_freshest(steps, {"b": 2, "c": 1}, 0) == "c"
    assert least_loaded_freshest(steps, {"a": 0, "b": 5, "c": 5}, 0) in {"b", "c"}, "fresher beats less loaded"
    assert {least_loaded_freshest(steps, {}, i) for i in range(2)} == {"b", "c"}, "ties: round-robin"
