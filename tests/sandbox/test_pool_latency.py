"""The warm pool (faster, and exactly as isolated as a cold start), injected latency, and the config."""

import asyncio
import os
import signal
import statistics
import time
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from rlpipe.sandbox import (
    ConstantLatency,
    LatencyInjector,
    LatencyModel,
    LognormalLatency,
    NoLatency,
    Sandbox,
    SandboxConfig,
    SandboxLimits,
    TraceLatency,
)

LATENCY_RUNS = 20  # per mode, enough for a stable median; the medians are printed with pytest -s


def sandbox_pids(config: SandboxConfig) -> list[int]:
    """Pids of live processes whose real uid is in the config's sandbox uid range."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            uid_line = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):  # not a pid, or exited while we looked
            continue
        if config.uid_range_start <= int(uid_line.split()[1]) < config.uid_range_start + config.uid_range_size:
            pids.append(int(entry.name))
    return pids


async def until(condition, timeout: float = 10.0) -> None:
    """Poll condition() every 5 ms; fail the test when it stays false for `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def pool_config(tmp_path: Path, pool_size: int) -> SandboxConfig:
    return SandboxConfig(scratch_root=tmp_path / "scratch", pool_size=pool_size,
                         limits=SandboxLimits(wall_seconds=5, cpu_seconds=2),
                         uid_range_start=1_710_000, uid_range_size=256)  # this file's own: pid checks see only ours


# --- warm pool --------------------------------------------------------------------------------------


async def test_pooled_runs_are_warm_and_share_nothing(tmp_path: Path) -> None:
    config = pool_config(tmp_path, pool_size=2)
    leave_traces = ("import os\nopen('left.txt', 'w').write('x')\nos.environ['LEFT'] = '1'\n"
                    "import builtins\nbuiltins.LEFT = 1\nprint(os.getuid())")
    look_for_traces = ("import builtins, os\n"
                       "print(os.listdir('.'), os.environ.get('LEFT'), hasattr(builtins, 'LEFT'), os.getuid())")
    async with Sandbox(config) as sandbox:
        assert sandbox.pool.ready_count == 2
        first = await sandbox.run(leave_traces)
        second = await sandbox.run(look_for_traces)
        await until(lambda: sandbox.pool.ready_count == 2)  # each sandbox used is replaced
    assert first.status == second.status == "ok" and first.warm and second.warm
    files, env, builtin, uid = second.stdout.rsplit(" ", 3)
    assert (files, env, builtin) == ("['main.py']", "None", "False")
    assert uid.strip() != first.stdout.strip()  # a fresh uid too
    assert sandbox_pids(config) == [] and list((config.scratch_root / "roots").iterdir()) == []


async def test_a_sandbox_that_dies_idle_is_replaced(tmp_path: Path) -> None:
    config = pool_config(tmp_path, pool_size=1)
    async with Sandbox(config) as sandbox:
        [victim] = sandbox_pids(config)
        os.kill(victim, signal.SIGKILL)  # the waiting interpreter dies from outside (OOM killer, admin)
        await until(lambda: sandbox_pids(config) not in ([], [victim]) and sandbox.pool.ready_count == 1)
        result = await sandbox.run("print('fresh')")
    assert (result.status, result.stdout, result.warm) == ("ok", "fresh\n", True)


async def test_closing_the_pool_kills_idle_sandboxes(tmp_path: Path) -> None:
    config = pool_config(tmp_path, pool_size=3)
    sandbox = Sandbox(config)
    await sandbox.start()
    assert len(sandbox_pids(config)) == 3  # one waiting interpreter per pooled sandbox
    await sandbox.close()
    assert sandbox_pids(config) == [] and list((config.scratch_root / "roots").iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        await sandbox.run("print(1)")


async def measure(sandbox: Sandbox, runs: int) -> tuple[float, float]:
    """Median end-to-end run() time and median startup (waiting for a ready sandbox), in ms.
    With a pool, each run waits for a full pool first: this measures the warm path, not a refill race."""
    total, startup = [], []
    for _ in range(runs):
        if sandbox.pool is not None:
            await until(lambda: sandbox.pool.ready_count == sandbox.config.pool_size)
        started = time.perf_counter()
        result = await sandbox.run("print(6 * 7)")
        total.append(time.perf_counter() - started)
        startup.append(result.startup_seconds)
        assert result.stdout == "42\n" and result.warm == (sandbox.pool is not None)
    return statistics.median(total) * 1000, statistics.median(startup) * 1000


async def test_warm_pool_cuts_start_latency(tmp_path: Path) -> None:
    async with Sandbox(pool_config(tmp_path / "cold", pool_size=0)) as cold_box:
        cold_total, cold_startup = await measure(cold_box, LATENCY_RUNS)
    async with Sandbox(pool_config(tmp_path / "warm", pool_size=2)) as warm_box:
        warm_total, warm_startup = await measure(warm_box, LATENCY_RUNS)
    print(f"\nsandbox latency, median of {LATENCY_RUNS} runs of print(6 * 7): "
          f"cold run {cold_total:.1f} ms (startup {cold_startup:.1f} ms), "
          f"warm run {warm_total:.1f} ms (startup {warm_startup:.2f} ms)")
    assert warm_startup < cold_startup / 10
    assert warm_total < cold_total


# --- injected latency -------------------------------------------------------------------------------


def test_latency_models_give_their_documented_delays() -> None:
    assert [LatencyInjector(NoLatency()).next_delay() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert [LatencyInjector(ConstantLatency(seconds=0.25)).next_delay() for _ in range(2)] == [0.25, 0.25]
    trace = LatencyInjector(TraceLatency(seconds=(0.1, 0.0, 2.5)))
    assert [trace.next_delay() for _ in range(7)] == [0.1, 0.0, 2.5, 0.1, 0.0, 2.5, 0.1]  # cyclic
    flat = LatencyInjector(LognormalLatency(median_seconds=0.2, sigma=0))
    assert [flat.next_delay() for _ in range(3)] == pytest.approx([0.2, 0.2, 0.2])


def test_lognormal_latency_is_seeded_and_long_tailed() -> None:
    def draws(seed: int, n: int = 4001, cap: float | None = None) -> list[float]:
        injector = LatencyInjector(LognormalLatency(median_seconds=0.1, sigma=1.0, seed=seed, max_seconds=cap))
        return [injector.next_delay() for _ in range(n)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    sample = sorted(draws(7))
    assert statistics.median(sample) == pytest.approx(0.1, rel=0.1)
    assert sample[int(0.99 * len(sample))] == pytest.approx(0.1 * 10.24, rel=0.25)  # p99 = median * e^(2.326 sigma)
    assert max(draws(7, cap=0.5)) == 0.5


async def test_injected_delays_overlap_instead_of_queueing() -> None:
    injector = LatencyInjector(ConstantLatency(seconds=0.2))
    started = time.perf_counter()
    slept = await asyncio.gather(*(injector.sleep() for _ in range(50)))
    assert slept == [0.2] * 50
    assert time.perf_counter() - started < 1.0  # 50 x 0.2 s sequentially would be 10 s


async def test_runs_record_their_injected_latency(tmp_path: Path) -> None:
    config = pool_config(tmp_path, pool_size=0).model_copy(
        update={"latency": TraceLatency(seconds=(0.15, 0.0))})
    async with Sandbox(config) as sandbox:
        started = time.perf_counter()
        delayed = await sandbox.run("print(1)")
        assert time.perf_counter() - started >= 0.15
        undelayed = await sandbox.run("print(1)")
    assert (delayed.injected_latency_seconds, undelayed.injected_latency_seconds) == (0.15, 0.0)


# --- config -----------------------------------------------------------------------------------------


def test_config_defaults_validate_and_reject_unknown_fields() -> None:
    config = SandboxConfig()
    assert config.pool_size == 2 and config.limits.wall_seconds == 10 and isinstance(config.latency, NoLatency)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        SandboxConfig(pool_sise=3)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        SandboxLimits(memory=1)
    with pytest.raises(ValidationError, match="uid_range_size must be >= pool_size"):
        SandboxConfig(uid_range_size=4, pool_size=2, max_concurrent_runs=4)


def test_latency_model_is_chosen_by_kind() -> None:
    parse = TypeAdapter(LatencyModel).validate_python
    model = parse({"kind": "lognormal", "median_seconds": 0.3, "sigma": 0.8, "seed": 1})
    assert model == LognormalLatency(median_seconds=0.3, sigma=0.8, seed=1)
    assert SandboxConfig(latency={"kind": "trace", "seconds": [0.1, 0.2]}).latency == TraceLatency(seconds=(0.1, 0.2))
    with pytest.raises(ValidationError):
        parse({"kind": "gaussian", "seconds": 1})
    with pytest.raises(ValidationError):
        parse({"kind": "trace", "seconds": []})
