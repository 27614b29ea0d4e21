"""The trainer's data-parallel ranks launched by torchrun, on the trainer's host and others
(rl/torchrun.py). The trainer worker and `rlpipe worker ranks` on every other host read the same
variables:

| variable | meaning |
|---|---|
| `RLPIPE_TRAINER_RANKS` | `fork` (default: ranks forked on the trainer's host) or `torchrun` |
| `RLPIPE_TRAINER_NNODES` | hosts the ranks span, the trainer's included (default 1) |
| `RLPIPE_TRAINER_RENDEZVOUS` | HOST:PORT of torchrun's c10d rendezvous, the trainer's host (default 127.0.0.1:29400) |
| `RLPIPE_TRAINER_CONTROLLER_PORT` | the port of the trainer's command store, on that host (default 29401) |
"""

from __future__ import annotations

import os

from pydantic import ValidationError

from rlpipe.rl.torchrun import TorchrunRanks, keep_joining
from rlpipe.workers.common import setup_logging

LAUNCHES = ("fork", "torchrun")


def ranks_from_env() -> TorchrunRanks | None:
    """The torchrun layout the variables describe; None where ranks are forked (the default)."""
    launch = os.environ.get("RLPIPE_TRAINER_RANKS", "fork").strip() or "fork"
    if launch not in LAUNCHES:
        raise SystemExit(f"RLPIPE_TRAINER_RANKS={launch!r}: use fork (ranks on this host) or torchrun")
    if launch == "fork":
        return None
    fields = {"nnodes": "RLPIPE_TRAINER_NNODES", "rendezvous": "RLPIPE_TRAINER_RENDEZVOUS",
              "controller_port": "RLPIPE_TRAINER_CONTROLLER_PORT"}
    given = {name: os.environ[var] for name, var in fields.items() if os.environ.get(var, "").strip()}
    try:
        return TorchrunRanks.model_validate(given)
    except ValidationError as err:
        problems = "; ".join(f"{fields[str(e['loc'][0])]}: {e['msg']}" for e in err.errors())
        raise SystemExit(f"the trainer's torchrun settings are invalid: {problems}") from None


def run_ranks_worker(ranks_per_host: int) -> None:
    """Keep this host's torchrun agent in the trainer's rendezvous, one group after another."""
    log = setup_logging("ranks")
    ranks = ranks_from_env()
    if ranks is None:
        raise SystemExit("set RLPIPE_TRAINER_RANKS=torchrun and the trainer's RLPIPE_TRAINER_RENDEZVOUS and "
                         "RLPIPE_TRAINER_NNODES: this host's ranks join the trainer's through them")
    if ranks_per_host < 1:
        raise SystemExit(f"--per-host {ranks_per_host}: a host runs at least one rank")
    try:
        keep_joining(ranks, ranks_per_host, log=log.info)
    except KeyboardInterrupt:
        log.info("stopped")
