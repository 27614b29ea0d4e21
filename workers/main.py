"""`python -m rlpipe.workers.main KIND`: run one worker in the foreground (what `rlpipe workers up` starts)."""

from __future__ import annotations

import argparse
import asyncio

KINDS = ["rollout", "sandbox", "grader", "trainer", "sidecar", "ranks"]
"""`ranks`: the trainer's data-parallel ranks on another host (workers/ranks.py)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlpipe worker", description=__doc__)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--server", help="sidecar only: the name of the inference server it syncs")
    parser.add_argument("--url", help="sidecar only: the server's URL, for a server not in INFERENCE_URLS (one "
                                      "joining running runs); the sidecar registers the name and URL for the workers")
    parser.add_argument("--per-host", type=int, default=1,
                        help="ranks only: the trainer's ranks this host runs (the run's batch.world_size / hosts)")
    args = parser.parse_args(argv)
    if args.kind == "sidecar" and args.server is None:
        parser.error("the sidecar needs --server NAME (the inference server it syncs)")
    if args.url is not None and args.kind != "sidecar":
        parser.error("--url is for the sidecar only")
    # each worker imports only what it needs: the trainer pulls torch, the sidecar does not
    if args.kind == "rollout":
        from rlpipe.workers.rollout import run_rollout_worker

        asyncio.run(run_rollout_worker())
    elif args.kind == "sandbox":
        from rlpipe.workers.sandbox import run_sandbox_worker

        asyncio.run(run_sandbox_worker())
    elif args.kind == "grader":
        from rlpipe.workers.grader import run_grader_worker

        asyncio.run(run_grader_worker())
    elif args.kind == "trainer":
        from rlpipe.workers.trainer import run_trainer_worker

        asyncio.run(run_trainer_worker())
    elif args.kind == "ranks":
        from rlpipe.workers.ranks import run_ranks_worker

        run_ranks_worker(args.per_host)
    else:
        from rlpipe.workers.sidecar import run_sidecar_worker

        asyncio.run(run_sidecar_worker(args.server, args.url))


if __name__ == "__main__":
    main()
