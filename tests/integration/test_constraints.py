"""Every unique and check constraint of the schema rejects a row that violates it.

Each case starts from a small valid graph (a run with a published version, a group, a
trajectory with a turn and a grade, a step, a sync event, a failure, a cache entry) inside a
transaction that is rolled back, then executes one violating statement.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from rlpipe.schemas.tables import NUL_REPLACEMENT, Base
from rlpipe.storage.buffer import save_turn
from rlpipe.storage.runs import record_failure

pytestmark = pytest.mark.stack

SHA = "a" * 64
BASELINE = f"""
insert into runs (id, workflow_id, mode, config, config_sha256) values ('ck', 'wf-ck', 'async', '{{}}', '{SHA}');
insert into policy_versions (run_id, version, trained_steps, checkpoint_key, sha256, size_bytes)
    values ('ck', 0, 0, 'k0', '{SHA}', 10);
insert into rollout_groups (id, run_id, group_index, prompt_index, task_id, workflow_id, n_samples)
    overriding system value values (900001, 'ck', 0, 0, 't0', 'wf-g0', 2);
insert into trajectories (id, run_id, group_id, sample_index) overriding system value values (900001, 'ck', 900001, 0);
insert into turns (trajectory_id, turn_index, input_ids, output_ids, output_logprobs, output_text, generate_latency_s)
    values (900001, 0, '{{1,2}}', '{{3}}', '{{-0.5}}', 'x', 0.1);
insert into grades (trajectory_id, grader, grader_version, score, latency_s, cache_hit)
    values (900001, 'exact', '1', 1.0, 0.01, false);
insert into grader_cache (key, grader, grader_version, score) values ('{SHA}', 'exact', '1', 1.0);
insert into train_steps (run_id, step, policy_version, n_groups, n_trajectories, n_tokens, started_at, finished_at)
    values ('ck', 1, 0, 1, 2, 10, now(), now());
insert into sync_events (run_id, version, server, status, bytes, started_at, finished_at)
    values ('ck', 0, 's0', 'ok', 10, now(), now());
insert into inference_servers (name, url) values ('s0', 'http://10.0.0.2:8000');
insert into failures (run_id, kind, workflow_id, activity_id, attempt, error_type, message)
    values ('ck', 'grade', 'wf', 'a1', 1, 'ValueError', 'boom');
insert into activity_spans (run_id, box, activity, workflow_id, activity_id, attempt, worker, ok, started_at, finished_at)
    values ('ck', 'rollout', 'generate', 'wf', 'a1', 1, 'h:1', true, now(), now());
insert into eval_results (run_id, version, split, n_prompts, n_correct, accuracy) values ('ck', 0, 'eval', 10, 3, 0.3);
insert into tracker_cursors (run_id, tracker) values ('ck', 'tensorboard');
"""

RUN = "insert into runs (id, workflow_id, mode, config, config_sha256) values ({id}, {wf}, {mode}, '{{}}', '" + SHA + "')"
VERSION = ("insert into policy_versions (run_id, version, trained_steps, checkpoint_key, sha256, size_bytes) "
           "values ('ck', {v}, {steps}, 'k', {sha}, {size})")
GROUP = ("insert into rollout_groups (run_id, group_index, prompt_index, task_id, workflow_id, n_samples, "
         "n_completed, status, claimed_step, min_version, reward_mean) "
         "values ('ck', {gi}, 0, 't', 'wf', {n}, {done}, {status}, {claimed}, {minv}, {rmean})")
TRAJ = ("insert into trajectories (run_id, group_id, sample_index, status, completion_ids, loss_mask, "
        "sampler_logprobs, n_turns, reward, advantage) values ('ck', 900001, {si}, {status}, {ids}, {mask}, {lp}, "
        "{turns}, {reward}, {adv})")
TURN = ("insert into turns (trajectory_id, turn_index, input_ids, output_ids, output_logprobs, output_text, "
        "generate_latency_s) values (900001, {ti}, '{{1}}', {out}, {lp}, 'x', {lat})")
GRADE = ("insert into grades (trajectory_id, grader, grader_version, score, latency_s, cache_hit) "
         "values (900001, {grader}, '1', {score}, {lat}, false)")
CACHE = "insert into grader_cache (key, grader, grader_version, score, hits) values ({key}, 'g', '1', {score}, {hits})"
STEP = ("insert into train_steps (run_id, step, policy_version, n_groups, n_trajectories, n_tokens, loss, "
        "staleness_max, started_at, finished_at) values ('ck', {step}, 0, {ng}, 1, 1, {loss}, {smax}, now(), {fin})")
SYNC = ("insert into sync_events (run_id, version, server, status, bytes, attempts, started_at, finished_at) "
        "values ('ck', {v}, {server}, {status}, {bytes}, {attempts}, now(), now())")
SPAN = ("insert into activity_spans (run_id, box, activity, workflow_id, activity_id, attempt, worker, ok, "
        "started_at, finished_at) values ('ck', 'rollout', 'generate', 'wf', {act}, {attempt}, 'h:1', true, now(), {fin})")
EVAL = ("insert into eval_results (run_id, version, split, n_prompts, n_correct, accuracy) "
        "values ('ck', {v}, 'eval', {n}, {correct}, {acc})")
FAIL = ("insert into failures (run_id, kind, workflow_id, activity_id, attempt, error_type, message) "
        "values ('ck', 'grade', {wf}, {act}, {attempt}, 'E', 'm')")

SERVER = "insert into inference_servers (name, url) values ({name}, {url})"
CURSOR = "insert into tracker_cursors (run_id, tracker, step, batches) values ('ck', {tracker}, {step}, {batches})"


def ok_group(**kw: object) -> str:
    values = dict(gi=1, n=2, done=0, status="'running'", claimed="null", minv="null", rmean="null") | kw
    return GROUP.format(**values)


def ok_traj(**kw: object) -> str:
    values = dict(si=1, status="'generating'", ids="null", mask="null", lp="null", turns=0, reward="null",
                  adv="null") | kw
    return TRAJ.format(**values)


# (constraint name, violating statement)
CASES: list[tuple[str, str]] = [
    ("pk_runs", RUN.format(id="'ck'", wf="'wf-other'", mode="'async'")),
    ("uq_runs_workflow_id", RUN.format(id="'other'", wf="'wf-ck'", mode="'async'")),
    ("ck_runs_mode", RUN.format(id="'other'", wf="'wf-2'", mode="'turbo'")),
    ("ck_runs_status", "update runs set status = 'exploded' where id = 'ck'"),
    ("ck_runs_id_slug", RUN.format(id="'Bad Name!'", wf="'wf-3'", mode="'sync'")),
    ("uq_policy_versions_run_id_version", VERSION.format(v=0, steps=0, sha="'" + "b" * 64 + "'", size=1)),
    ("uq_policy_versions_run_id_trained_steps", VERSION.format(v=1, steps=0, sha="'" + "b" * 64 + "'", size=1)),
    ("ck_policy_versions_version_non_negative", VERSION.format(v=-1, steps=5, sha=f"'{SHA}'", size=1)),
    ("ck_policy_versions_trained_steps_non_negative",  # a run's first version passes the trigger
     RUN.format(id="'ck2'", wf="'wf-ck2'", mode="'async'") + "; "
     + VERSION.replace("'ck'", "'ck2'").format(v=0, steps=-1, sha=f"'{SHA}'", size=1)),
    ("ck_policy_versions_size_non_negative", VERSION.format(v=1, steps=1, sha=f"'{SHA}'", size=-1)),
    ("ck_policy_versions_sha256_hex", VERSION.format(v=1, steps=1, sha="'not-a-digest'", size=1)),
    ("policy_versions_contiguous", VERSION.format(v=2, steps=2, sha=f"'{SHA}'", size=1)),
    ("policy_versions_append_only", "update policy_versions set sha256 = '" + "c" * 64 + "' where run_id = 'ck'"),
    ("uq_rollout_groups_run_id_group_index", ok_group(gi=0)),
    ("ck_rollout_groups_status", ok_group(status="'lost'")),
    ("ck_rollout_groups_group_index_non_negative", ok_group(gi=-1)),
    ("ck_rollout_groups_n_samples_positive", ok_group(n=0)),
    ("ck_rollout_groups_n_completed_range", ok_group(n=2, done=3)),
    ("ck_rollout_groups_claim_valid", ok_group(status="'running'", claimed=1)),
    ("ck_rollout_groups_min_version_non_negative", ok_group(minv=-1)),
    ("ck_rollout_groups_reward_mean_finite", ok_group(rmean="'NaN'")),
    ("uq_trajectories_group_id_sample_index", ok_traj(si=0)),
    ("ck_trajectories_status", ok_traj(status="'vanished'")),
    ("ck_trajectories_sample_index_non_negative", ok_traj(si=-1)),
    ("ck_trajectories_n_turns_non_negative", ok_traj(turns=-1)),
    ("ck_trajectories_aligned_arrays", ok_traj(status="'completed'", ids="'{1,2}'", mask="'{1}'", lp="'{0,0}'")),
    ("ck_trajectories_reward_finite", ok_traj(reward="'Infinity'")),
    ("ck_trajectories_advantage_finite", ok_traj(adv="'NaN'")),
    ("uq_turns_trajectory_id_turn_index", TURN.format(ti=0, out="'{1}'", lp="'{0}'", lat=0)),
    ("ck_turns_turn_index_non_negative", TURN.format(ti=-1, out="'{1}'", lp="'{0}'", lat=0)),
    ("ck_turns_aligned_arrays", TURN.format(ti=1, out="'{1,2}'", lp="'{0}'", lat=0)),
    ("ck_turns_latency_non_negative", TURN.format(ti=1, out="'{1}'", lp="'{0}'", lat=-1)),
    ("uq_grades_trajectory_id_grader", GRADE.format(grader="'exact'", score=0, lat=0)),
    ("ck_grades_score_finite", GRADE.format(grader="'g2'", score="'NaN'", lat=0)),
    ("ck_grades_latency_non_negative", GRADE.format(grader="'g2'", score=0, lat=-1)),
    ("pk_grader_cache", CACHE.format(key=f"'{SHA}'", score=0, hits=0)),
    ("ck_grader_cache_key_sha256", CACHE.format(key="'short'", score=0, hits=0)),
    ("ck_grader_cache_score_finite", CACHE.format(key="'" + "d" * 64 + "'", score="'-Infinity'", hits=0)),
    ("ck_grader_cache_hits_non_negative", CACHE.format(key="'" + "d" * 64 + "'", score=0, hits=-1)),
    ("uq_train_steps_run_id_step", STEP.format(step=1, ng=1, loss=0, smax=0, fin="now()")),
    ("ck_train_steps_step_positive", STEP.format(step=0, ng=1, loss=0, smax=0, fin="now()")),
    ("ck_train_steps_counts_non_negative", STEP.format(step=2, ng=-1, loss=0, smax=0, fin="now()")),
    ("ck_train_steps_staleness_non_negative", STEP.format(step=2, ng=1, loss=0, smax=-1, fin="now()")),
    ("ck_train_steps_max_staleness_non_negative", "update train_steps set max_staleness = -1 where run_id = 'ck'"),
    ("ck_train_steps_loss_finite", STEP.format(step=2, ng=1, loss="'NaN'", smax=0, fin="now()")),
    ("ck_train_steps_time_order", STEP.format(step=2, ng=1, loss=0, smax=0, fin="now() - interval '1 hour'")),
    ("uq_sync_events_run_id_version_server", SYNC.format(v=0, server="'s0'", status="'ok'", bytes=1, attempts=1)),
    ("ck_sync_events_status", SYNC.format(v=0, server="'s1'", status="'maybe'", bytes=1, attempts=1)),
    ("ck_sync_events_bytes_non_negative", SYNC.format(v=0, server="'s1'", status="'ok'", bytes=-1, attempts=1)),
    ("ck_sync_events_attempts_positive", SYNC.format(v=0, server="'s1'", status="'ok'", bytes=1, attempts=0)),
    ("uq_failures_workflow_id_activity_id_attempt", FAIL.format(wf="'wf'", act="'a1'", attempt=1)),
    ("ck_failures_attempt_positive", FAIL.format(wf="'wf'", act="'a2'", attempt=0)),
    ("uq_activity_spans_workflow_id_activity_id_attempt", SPAN.format(act="'a1'", attempt=1, fin="now()")),
    ("ck_activity_spans_time_order", SPAN.format(act="'a2'", attempt=1, fin="now() - interval '1 second'")),
    ("ck_activity_spans_attempt_positive", SPAN.format(act="'a2'", attempt=0, fin="now()")),
    ("uq_eval_results_run_id_version_split", EVAL.format(v=0, n=10, correct=1, acc=0.1)),
    ("ck_eval_results_counts_valid", EVAL.format(v=1, n=10, correct=11, acc=1)),
    ("ck_eval_results_accuracy_range", EVAL.format(v=1, n=10, correct=5, acc=1.5)),
    ("uq_tracker_cursors_run_id_tracker", CURSOR.format(tracker="'tensorboard'", step=0, batches=0)),
    ("ck_tracker_cursors_step_non_negative", CURSOR.format(tracker="'mlflow'", step=-1, batches=0)),
    ("ck_tracker_cursors_batches_non_negative", CURSOR.format(tracker="'mlflow'", step=0, batches=-1)),
    ("pk_inference_servers", SERVER.format(name="'s0'", url="'http://10.0.0.3:8000'")),
    ("ck_inference_servers_name_not_empty", SERVER.format(name="''", url="'http://10.0.0.3:8000'")),
    ("ck_inference_servers_url_is_http", SERVER.format(name="'s1'", url="'10.0.0.3:8000'")),
    ("fk_trajectories_group_id_rollout_groups",
     "insert into trajectories (run_id, group_id, sample_index) values ('ck', 123456789, 0)"),
]

# The trigger stands in front of some constraints of policy_versions; its message is what the
# violating row meets first, so those cases look for the trigger's words.
TRIGGER_WORDS = {
    "uq_policy_versions_run_id_version": "already exists with other weights",
    "uq_policy_versions_run_id_trained_steps": "must have more trained steps",
    "ck_policy_versions_version_non_negative": "must be contiguous",
    "policy_versions_contiguous": "must be contiguous: expected 1, got 2",
    "policy_versions_append_only": "append-only",
}


@pytest.fixture
def baseline(migrated_db):  # type: ignore[no-untyped-def]
    with migrated_db.engine.connect() as conn:
        tx = conn.begin()
        conn.exec_driver_sql(BASELINE)
        yield conn
        tx.rollback()


@pytest.mark.parametrize(("name", "statement"), CASES, ids=[c[0] for c in CASES])
def test_constraint_rejects_violating_row(baseline, name: str, statement: str) -> None:  # type: ignore[no-untyped-def]
    savepoint = baseline.begin_nested()
    with pytest.raises(sa.exc.DBAPIError) as caught:
        baseline.exec_driver_sql(statement)
    savepoint.rollback()
    assert TRIGGER_WORDS.get(name, name) in str(caught.value)


def test_baseline_is_valid(baseline) -> None:  # type: ignore[no-untyped-def]
    """The cases are only meaningful if the same statements succeed on valid values."""
    savepoint = baseline.begin_nested()
    baseline.exec_driver_sql(ok_group())
    baseline.exec_driver_sql(ok_traj(status="'completed'", ids="'{1,2}'", mask="'{1,0}'", lp="'{-1,0}'"))
    baseline.exec_driver_sql(VERSION.format(v=1, steps=1, sha="'" + "b" * 64 + "'", size=1))
    baseline.exec_driver_sql(VERSION.format(v=1, steps=1, sha="'" + "b" * 64 + "'", size=1))  # retry: no-op
    baseline.exec_driver_sql(STEP.format(step=2, ng=1, loss=0.5, smax=1, fin="now()"))
    baseline.exec_driver_sql(CURSOR.format(tracker="'mlflow'", step=3, batches=1))
    baseline.exec_driver_sql(SERVER.format(name="'gpu-a.1'", url="'https://10.0.0.3:8000'"))
    savepoint.rollback()


def test_model_and_tool_text_with_nul_is_stored_with_a_replacement(baseline) -> None:  # type: ignore[no-untyped-def]
    """PostgreSQL's text and jsonb refuse NUL; a model's byte-fallback token or a tool's output can
    hold one. The turn and its failure are stored (NUL replaced) instead of failing the group."""
    with Session(bind=baseline, join_transaction_mode="create_savepoint") as s:
        turn = save_turn(s, {"trajectory_id": 900001, "turn_index": 1, "input_ids": [1], "output_ids": [0, 2],
                             "output_logprobs": [-0.1, -0.2], "output_text": "2+2\x00=4", "generate_latency_s": 0.1,
                             "tool_calls": [{"name": "calc", "arguments": {"expr\x00": "2+\x002"},
                                             "result": "4\x00", "error": None}]})
        record_failure(s, run_id="ck", kind="tool", error_type="E", message="tool wrote \x00",
                       workflow_id="wf", activity_id="nul", details={"stdout": ["\x00"]})
        s.flush()
        stored = s.execute(sa.text("select output_text, tool_calls from turns where id = :id"), {"id": turn.id}).one()
        failure = s.execute(sa.text("select message, details from failures where activity_id = 'nul'")).one()
        s.rollback()
    nul = NUL_REPLACEMENT
    assert stored.output_text == f"2+2{nul}=4"
    assert stored.tool_calls == [{"name": "calc", "arguments": {f"expr{nul}": f"2+{nul}2"}, "result": f"4{nul}",
                                  "error": None}]
    assert (failure.message, failure.details) == (f"tool wrote {nul}", {"stdout": [nul]})


def test_every_constraint_has_a_case() -> None:
    """Adding a constraint to the schema without a violating-row case here fails this test."""
    named = set()
    for table in Base.metadata.tables.values():
        for constraint in table.constraints:
            if isinstance(constraint, sa.UniqueConstraint | sa.CheckConstraint | sa.PrimaryKeyConstraint):
                named.add(str(constraint.name))
        for column in table.columns:
            if column.unique:
                named.add(f"uq_{table.name}_{column.name}")
    covered = {name for name, _ in CASES}
    pk_without_natural_meaning = {f"pk_{t}" for t in Base.metadata.tables} - {"pk_runs", "pk_grader_cache",
                                                                           "pk_inference_servers"}
    missing = named - covered - pk_without_natural_meaning
    assert not missing, f"constraints without a violating-row case: {sorted(missing)}"
