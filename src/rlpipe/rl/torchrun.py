"""Trainer ranks launched by torchrun (`torch.distributed.run`), on the trainer's host and on
others, driven by the trainer worker as one controller.

    trainer host                                          another host
    ────────────                                          ────────────
    trainer worker: TorchrunGroup (the controller)
      command store (TCPStore, controller_port)  <────── ranks: commands, answers, heartbeats
      torchrun agent ── this host's ranks                 torchrun agent ── its ranks
                    └──── c10d rendezvous at `rendezvous` (host:port) ────┘
                                                          (`rlpipe worker ranks ...` keeps one there)

Each rank is `python -m rlpipe.rl.torchrun --controller HOST:PORT` under torchrun, which gives it
its RANK, LOCAL_RANK and WORLD_SIZE and the address of the process group's store (gloo on CPU,
NCCL with GPUs). The controller hosts a second, small store of its own for commands: a group
(one engine, until a restore) is a generation id; the controller writes what to build and then
one pickled command per rank and sequence number, and every rank answers each (rank 0 with the
result, as in rl/distributed.py). Values go in chunks (TCPStore refuses values over 8 MiB), except
large ones between processes that see the controller's directory (ranks on its host, or on a shared
filesystem): those go through a file there, named in the store (the full weights of a publish).

A rank beats (a counter in the store) every BEAT_S seconds from a thread; the controller fails the
command in flight, naming the rank and its host, when the rank has not beaten for `dead_after_s`
seconds, when this host's agent exits, or after `timeout_s`; it then kills this host's agent and
marks the generation aborted, which ends the other hosts' ranks (a rank blocked in a collective
with a dead peer gets gloo's or NCCL's error). The trainer's retry then opens a new group: this
host's agent is started again, and `rlpipe worker ranks` on the other hosts starts theirs again
as each generation ends. Every host needs the base model at the path the trainer gives (a shared
filesystem, or the same copy on each).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlpipe.rl.distributed import (
    Command,
    ModelFn,
    OptimizerFn,
    RankBuild,
    RankGroup,
    build_rank,
    serve,
)
from rlpipe.schemas.algorithm import Precision

RENDEZVOUS_ID = "rlpipe-trainer"
"""torchrun's --rdzv-id: one trainer per rendezvous endpoint, so the id is the same for every group."""
CHUNK_BYTES = 4 << 20
FILE_BYTES = 64 << 20
"""Values this large go through a file where both ends see the controller's directory."""
FILE_MARK = b"file:"
PR_SET_PDEATHSIG = 1
BEAT_S = 2.0
AGENT_STOP_S = 35.0
"""How long a SIGTERMed torchrun agent gets: it gives its ranks 30 s to stop."""
CURRENT = "group"
"""The store key naming the current generation ("aborted:<id>" once the controller gave it up)."""


class TorchrunRanks(BaseModel):
    """Where the trainer's ranks run: `nnodes` hosts (this one included) joined by torchrun's c10d
    rendezvous at `rendezvous`, world_size / nnodes ranks on each."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nnodes: int = Field(1, ge=1)
    """Hosts the ranks span; the other hosts run `rlpipe worker ranks` with the same rendezvous."""
    rendezvous: str = "127.0.0.1:29400"
    """host:port of the c10d rendezvous: this host's address as the other hosts reach it."""
    controller_port: int = Field(29401, ge=1, le=65535)
    """The command store's port, on the rendezvous host."""
    join_timeout_s: float = Field(600.0, gt=0)
    """How long every host's ranks have to join and build the model."""
    dead_after_s: float = Field(30.0, gt=0)
    """A rank silent (no heartbeat) this long is dead: the command in flight fails."""

    @field_validator("rendezvous")
    @classmethod
    def _host_and_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rendezvous {value!r}: use HOST:PORT (this host's address the other hosts reach)")
        return value

    @property
    def host(self) -> str:
        return self.rendezvous.rpartition(":")[0]

    @property
    def controller(self) -> str:
        return f"{self.host}:{self.controller_port}"

    def ranks_per_host(self, world_size: int) -> int:
        if world_size % self.nnodes:
            raise ValueError(f"batch.world_size {world_size} cannot be split over {self.nnodes} hosts: "
                             "use a multiple of the trainer's host count (RLPIPE_TRAINER_NNODES)")
        return world_size // self.nnodes

    def agent_command(self, ranks_per_host: int) -> list[str]:
        """The torchrun agent of one host (the same command on every host)."""
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}",
                f"--nproc-per-node={ranks_per_host}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.rendezvous}",
                f"--rdzv-id={RENDEZVOUS_ID}", f"--rdzv-conf=join_timeout={int(self.join_timeout_s)}",
                "--max-restarts=0", "-m", "rlpipe.rl.torchrun", f"--controller={self.controller}"]


# -- the store: chunked values, or files -------------------------------------------------------------
def put(store: dist.Store, key: str, value: Any, shared_dir: Path | None = None) -> None:
    """Pickle `value` into `key` in chunks (the count last, so that a reader never sees part of it);
    a large value goes into a file in `shared_dir` instead, when the reader sees that directory."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    if shared_dir is not None and len(data) >= FILE_BYTES:
        path = shared_dir / (key.replace("/", "-") + ".pkl")
        path.write_bytes(data)
        store.set(key, FILE_MARK + str(path).encode())  # type: ignore[arg-type]  # the stub says str
        return
    chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for i, chunk in enumerate(chunks):
        store.set(f"{key}/{i}", chunk)  # type: ignore[arg-type]  # the stub says str; bytes go as they are
    store.set(key, str(len(chunks)))


def ready(store: dist.Store, key: str) -> bool:
    return store.check([key])


def take(store: dist.Store, key: str, *, keep: bool = False) -> Any:
    """The value `put` wrote at `key` (which must be ready); deleted unless `keep`."""
    head = store.get(key)
    if head.startswith(FILE_MARK):
        path = Path(head[len(FILE_MARK):].decode())
        data = path.read_bytes()
        if not keep:
            path.unlink()
            store.delete_key(key)
        return pickle.loads(data)
    count = int(head)
    data = b"".join(store.get(f"{key}/{i}") for i in range(count))
    if not keep:
        for i in range(count):
            store.delete_key(f"{key}/{i}")
        store.delete_key(key)
    return pickle.loads(data)


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the controller's store (retried by torch until `timeout_s`)."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


# -- the controller -----------------------------------------------------------------------------------
class TorchrunGroup(RankGroup):
    """`world_size` ranks started by torchrun agents on `ranks.nnodes` hosts: this host's agent is
    started here, the other hosts' by `rlpipe worker ranks` (see the module docstring)."""

    def __init__(
        self,
        world_size: int,
        model_fn: ModelFn,
        optimizer_fn: OptimizerFn,
        *,
        ranks: TorchrunRanks,
        ref_model_fn: ModelFn | None = None,
        precision: Precision = "fp32",
        timeout_s: float = 1800.0,
    ) -> None:
        per_host = ranks.ranks_per_host(world_size)
        self.world_size, self._timeout_s, self._dead_after_s = world_size, timeout_s, ranks.dead_after_s
        self._store = dist.TCPStore(ranks.host, ranks.controller_port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60))
        self._gen, self._seq, self._closed = uuid.uuid4().hex[:12], 0, False
        self._beats: dict[int, tuple[int, float]] = {}
        self.places: dict[int, str] = {}   # rank -> "host H pid N", once it has joined
        self._dir = Path(tempfile.mkdtemp(prefix="rlpipe-torchrun-"))   # the agent's log, large values
        (self._dir / self._gen).touch()   # a rank that sees this file sees the directory
        self._log = self._dir / "agent.log"
        put(self._store, f"{self._gen}/build",
            RankBuild(world_size, model_fn, optimizer_fn, ref_model_fn, precision, timeout_s))
        self._store.set(f"{self._gen}/dir", str(self._dir))
        self._store.set(CURRENT, self._gen)
        with self._log.open("wb") as log:
            self._agent = subprocess.Popen(ranks.agent_command(per_host), stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        joined = self._collect(0, ranks.join_timeout_s)
        self.places = {rank: place for rank, (place, _) in joined.items()}
        self._sharing = {rank for rank, (_, sees_dir) in joined.items() if sees_dir}

    def close(self) -> None:
        """Stop the ranks (each host's agent then exits) and this host's agent; safe to call twice."""
        if self._closed:
            return
        try:
            self._seq += 1
            for rank in range(self.world_size):
                self._put_command(rank, Command("close"))
            self._collect(self._seq, 30.0)
        except RuntimeError:
            return  # _collect has aborted the group: nothing is left to stop
        self._stop_agent(grace_s=30.0)
        self._end()

    def _send(self, commands: Sequence[Command]) -> Any:
        if self._closed:
            raise RuntimeError("the torchrun rank group is closed")
        self._seq += 1
        for rank, cmd in enumerate(commands):
            self._put_command(rank, cmd)
        return self._collect(self._seq, self._timeout_s)[0]

    def _put_command(self, rank: int, cmd: Command) -> None:
        put(self._store, self._key("cmd", self._seq, rank), cmd, self._dir if rank in self._sharing else None)

    def _key(self, kind: str, seq: int, rank: int) -> str:
        return f"{self._gen}/{kind}/{seq}/{rank}"

    def _collect(self, seq: int, timeout_s: float) -> dict[int, Any]:
        """Every rank's answer to command `seq`; an error, a silent rank, this host's agent exiting or
        the timeout aborts the group and raises RuntimeError naming the rank."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        pause = 0.001
        while len(answers) < self.world_size:
            got = False
            for rank in range(self.world_size):
                key = self._key("ans", seq, rank)
                if rank in answers or not ready(self._store, key):
                    continue
                status, payload = take(self._store, key)
                if status == "error":
                    self._abort(f"data-parallel rank {rank}{self._where(rank)} failed:\n{payload}")
                answers[rank], got = payload, True
            if len(answers) == self.world_size:
                break
            if (why := self._why_stalled(set(range(self.world_size)) - set(answers), deadline)) is not None:
                self._abort(why)
            pause = 0.001 if got else min(0.05, pause * 2)
            time.sleep(pause)
        return answers

    def _why_stalled(self, waiting: set[int], deadline: float) -> str | None:
        if (code := self._agent.poll()) is not None:
            return (f"data-parallel ranks {sorted(waiting)} did not answer: the torchrun agent of this host's "
                    f"ranks exited with code {code} (a rank died)\n{self._log_tail()}")
        now = time.monotonic()
        for rank in sorted(waiting):
            beats = int(self._store.add(f"{self._gen}/beat/{rank}", 0))
            seen, since = self._beats.get(rank, (0, now))
            if beats != seen or rank not in self._beats:
                self._beats[rank] = (beats, now)
            elif beats and now - since > self._dead_after_s:
                return f"data-parallel rank {rank}{self._where(rank)} died: no heartbeat for {now - since:.0f} s"
        if now > deadline:
            missing = [r for r in sorted(waiting) if not self._beats.get(r, (0, 0))[0]]
            if missing:
                return (f"data-parallel ranks {missing} never joined: start `rlpipe worker ranks` on every other "
                        f"host of the trainer (see docs/multi-host.md)\n{self._log_tail()}")
            return f"data-parallel ranks {sorted(waiting)} timed out"
        return None

    def _where(self, rank: int) -> str:
        return f" ({self.places[rank]})" if rank in self.places else ""

    def _abort(self, why: str) -> None:
        """Give the generation up: the other hosts' ranks see it and exit; this host's agent is killed."""
        try:
            self._store.set(CURRENT, f"aborted:{self._gen}")
        except RuntimeError:
            pass
        self._stop_agent(grace_s=0.0)
        time.sleep(BEAT_S)   # the other hosts' ranks poll the generation about once a second
        self._end()
        raise RuntimeError(why)

    def _stop_agent(self, grace_s: float) -> None:
        """Let this host's agent exit (`grace_s`), else SIGTERM it (it stops its ranks, for up to
        30 s), else SIGKILL it; its ranks die with it (rank_main asks for that)."""
        try:
            self._agent.wait(timeout=grace_s) if grace_s else None
        except subprocess.TimeoutExpired:
            pass
        for sig, wait_s in ((signal.SIGTERM, AGENT_STOP_S), (signal.SIGKILL, 10.0)):
            if self._agent.poll() is not None:
                break
            try:
                os.killpg(self._agent.pid, sig)
                self._agent.wait(timeout=wait_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def _end(self) -> None:
        self._closed = True
        self.__dict__.pop("_store", None)   # its server stops: a rank still polling it exits
        shutil.rmtree(self._dir, ignore_errors=True)

    def _log_tail(self, chars: int = 3000) -> str:
        try:
            return self._log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


# -- a rank -------------------------------------------------------------------------------------------
class RankAbandoned(RuntimeError):
    """The controller has no group for this rank to join (it gave it up, or none started)."""


class _Channel:
    """A rank's end of the controller's store: the next command, answers, heartbeats."""

    def __init__(self, controller: str, rank: int) -> None:
        self.controller, self.rank = controller, rank
        self.store = connect(controller, timeout_s=300.0)
        deadline = time.monotonic() + 60.0
        while not ready(self.store, CURRENT):   # the controller sets it once the build is written
            if time.monotonic() > deadline:
                raise RankAbandoned(f"the trainer at {controller} started no group of ranks")
            time.sleep(0.1)
        self.gen = self.store.get(CURRENT).decode()
        if self.gen.startswith("aborted:"):
            raise RankAbandoned(f"the trainer at {controller} gave its group of ranks up")
        shared = Path(self.store.get(f"{self.gen}/dir").decode())
        self.shared_dir = shared if (shared / self.gen).exists() else None   # the controller's, seen from here
        self.seq = 0
        self._stopped = threading.Event()

    def build(self) -> RankBuild:
        build: RankBuild = take(self.store, f"{self.gen}/build", keep=True)
        return build

    def beat(self) -> None:
        """Beat from a thread with a store connection of its own, until the rank ends."""
        store = connect(self.controller, timeout_s=60.0)
        key = f"{self.gen}/beat/{self.rank}"

        def loop() -> None:
            while not self._stopped.is_set():
                try:
                    store.add(key, 1)
                except RuntimeError:
                    return   # the controller is gone
                self._stopped.wait(BEAT_S)

        threading.Thread(target=loop, name="rank-heartbeat", daemon=True).start()

    def next_command(self) -> Command:
        """The next command; 'close' once the controller gave this generation up or is gone."""
        self.seq += 1
        key, pause, checked = f"{self.gen}/cmd/{self.seq}/{self.rank}", 0.001, time.monotonic()
        try:
            while not ready(self.store, key):
                if time.monotonic() - checked > 1.0:
                    if self.store.get(CURRENT).decode() != self.gen:
                        return Command("close")
                    checked = time.monotonic()
                time.sleep(pause)
                pause = min(0.05, pause * 2)
            command: Command = take(self.store, key)
            return command
        except RuntimeError:   # torch's store errors (DistError) when the controller's store is gone
            return Command("close")

    def answer(self, status: str, payload: Any) -> None:
        try:
            put(self.store, f"{self.gen}/ans/{self.seq}/{self.rank}", (status, payload), self.shared_dir)
        except RuntimeError:
            pass   # the controller is gone: nobody to tell

    def stop(self) -> None:
        self._stopped.set()


def rank_main(controller: str) -> int:
    """One rank under torchrun: build from what the controller wrote, then serve its commands."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    _die_with_the_agent()
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    torch.set_num_threads(int(threads) if threads.isdigit() else max(1, (os.cpu_count() or 1) // local_world))
    try:
        channel = _Channel(controller, rank)
    except RankAbandoned as err:
        print(f"rank {rank}: {err}", file=sys.stderr)
        return 1
    channel.beat()
    place = f"host {socket.gethostname()} pid {os.getpid()}"
    try:
        build = channel.build()
        if build.world_size != world_size:
            raise ValueError(f"torchrun started {world_size} ranks in all, the trainer wants {build.world_size}: "
                             "give every host's `rlpipe worker ranks` the trainer's --nnodes")
        state = build_rank(rank, local_rank, build, "env://")
    except Exception:
        channel.seq = 0
        channel.answer("error", f"{place}: {traceback.format_exc()}")
        channel.stop()
        return 1
    channel.seq = 0
    channel.answer("ok", (place, channel.shared_dir is not None))
    serve(state, channel.next_command, channel.answer)
    channel.answer("ok", None)   # to the close
    channel.stop()
    return 0


def _die_with_the_agent() -> None:
    """Ask Linux to SIGKILL this rank when its agent dies: torchrun starts each rank in a session
    of its own, which a signal to the agent's session does not reach."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass   # not Linux: an orphaned rank still exits once the controller's store is gone


def keep_joining(ranks: TorchrunRanks, ranks_per_host: int, log: Callable[[str], None] = print) -> None:
    """Another host's part: run its torchrun agent, again as each group ends, until interrupted
    (Ctrl-C or SIGTERM, which stop the agent and its ranks first)."""
    command = ranks.agent_command(ranks_per_host)
    log(f"joining the trainer's ranks at {ranks.rendezvous}: {' '.join(command)}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)   # SIGTERM as Ctrl-C: stop the agent below
    while True:
        agent = subprocess.Popen(command)
        try:
            code = agent.wait()
        except KeyboardInterrupt:
            agent.terminate()   # torchrun stops its ranks
            try:
                agent.wait(timeout=AGENT_STOP_S)
            except subprocess.TimeoutExpired:
                agent.kill()   # its ranks die with it (_die_with_the_agent)
            raise
        log(f"the group ended (agent exit code {code}); joining the next one")
        time.sleep(2.0)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one trainer rank under torchrun (started by its agent)")
    parser.add_argument("--controller", required=True, help="HOST:PORT of the trainer's command store")
    sys.exit(rank_main(parser.parse_args(argv).controller))


if __name__ == "__main__":
    main()
