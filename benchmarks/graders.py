"""Grader throughput: rule graders with the Postgres cache cold and warm, by concurrency (issue #8, item 5).

Each grader grades N responses (the environment's reference answer for half, a wrong one for the
other half, so both verdicts run) through `grade_with_cache` with the real `PostgresGradeCache` on a
private Postgres: first cold (every key new, so the grader runs and the grade is stored), then warm
(the same keys again, served from the cache). Concurrency is how many gradings run at once, as
`grader.concurrency` bounds them in the grader worker. code_tests runs the tests in the real
sandbox (sandbox/runner.py subprocesses), as the grader worker does.

The model-based `judge` grader is not measured: it needs a judge model server, and on this 2-core
machine a judge call is a vLLM generation whose cost is the inference benchmark's, not the grader's.

    .venv/bin/python -m benchmarks.graders [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

from benchmarks.common import private_stack, progress_bar, summarize, write_result

NAME = "graders"
CASES = {"final_number": ("arithmetic_plain", 200), "answer_match": ("arithmetic", 200), "code_tests": ("code", 24)}
CONCURRENCY = (1, 4, 16)


def responses(env_name: str, n: int, salt: str) -> list[tuple[Any, str]]:
    """(task, response) pairs: even ones right, odd ones wrong; `salt` makes every key new (cold cache)."""
    from rlpipe.envs.registry import build_environment
    from rlpipe.schemas.task import EnvConfig

    env = build_environment(EnvConfig(name=env_name))
    out = []
    for i in range(n):
        task = env.task("train", i)
        answer = task.reference if i % 2 == 0 else "0"
        body = f"<answer>{answer}</answer>" if env_name != "arithmetic_plain" else f"The answer is {answer}."
        out.append((task, f"{body}\n# {salt}" if env_name == "code" else f"{body} ({salt})"))
    return out


async def grade_all(grader, cache, items: list[tuple[Any, str]], concurrency: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Wall seconds to grade every item, at most `concurrency` at once; and the cache hits."""
    from rlpipe.graders.cache import grade_with_cache

    gate, hits = asyncio.Semaphore(concurrency), 0

    async def one(task, text: str) -> None:  # type: ignore[no-untyped-def]
        nonlocal hits
        async with gate:
            _, hit = await grade_with_cache(grader, cache, task, text)
            hits += hit

    t0 = time.perf_counter()
    await asyncio.gather(*(one(t, r) for t, r in items))
    return time.perf_counter() - t0, hits


async def measure(database_url: str, repeats: int) -> dict[str, Any]:
    from rlpipe.graders.base import GraderDeps
    from rlpipe.graders.registry import build_grader
    from rlpipe.sandbox.config import SandboxConfig
    from rlpipe.sandbox.executor import SandboxExecutor
    from rlpipe.sandbox.runner import Sandbox
    from rlpipe.schemas.task import GraderConfig
    from rlpipe.storage.db import Database
    from rlpipe.storage.grader_cache import PostgresGradeCache

    db, raw = Database(database_url), {}
    async with Sandbox(SandboxConfig()) as sandbox:
        deps = GraderDeps(executor=SandboxExecutor(sandbox))
        with progress_bar() as bar:
            task = bar.add_task("graders", total=repeats * len(CASES) * len(CONCURRENCY))
            for _ in range(repeats):
                for name, (env_name, n) in CASES.items():
                    for conc in CONCURRENCY:
                        bar.update(task, description=f"{name} x{n} @{conc}")
                        grader = build_grader(name, GraderConfig(concurrency=conc), deps)
                        cache = PostgresGradeCache(db, grader.name, grader.version)
                        items = responses(env_name, n, uuid.uuid4().hex)
                        cold, cold_hits = await grade_all(grader, cache, items, conc)
                        warm, warm_hits = await grade_all(grader, cache, items, conc)
                        assert warm_hits == n, "the warm pass must hit every key"
                        entry = raw.setdefault(f"{name}|{conc}", {"n": n, "cold": [], "warm": [], "cold_hits": []})
                        entry["cold_hits"].append(cold_hits)   # repeated questions in the set hit even cold
                        entry["cold"].append(n / cold)
                        entry["warm"].append(n / warm)
                        await grader.aclose()
                        bar.advance(task)
    db.dispose()
    table = {key: {"n": e["n"], "cold_per_s": summarize(e["cold"]), "warm_per_s": summarize(e["warm"]),
                   "warm_over_cold": summarize([w / c for w, c in zip(e["warm"], e["cold"])])}
             for key, e in raw.items()}
    return {"cases": table, "raw": raw}


def main() -> None:
    from rlpipe.infra.endpoints import resolve_endpoints

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with private_stack(only=["postgres", "seaweedfs"]) as stack:
        out = asyncio.run(measure(resolve_endpoints(stack.settings).database_url, args.repeats))
    print(write_result(NAME, {"params": {"repeats": args.repeats, "concurrency": CONCURRENCY,
                                         "cases": CASES}, **out}))


if __name__ == "__main__":
    main()
