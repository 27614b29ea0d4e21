"""What a new user sees from the command line before the stack runs, and the database URL that
`rlpipe stack env` prints (issue #15, item 7). Each CLI test runs `rlpipe` in a subprocess with an
empty state directory, as a user's first command would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from rlpipe.infra.endpoints import libpq_url, normalise_database_url
from rlpipe.infra.postgres import PostgresService
from rlpipe.infra.seaweed import SeaweedService
from rlpipe.infra.settings import StackSettings
from rlpipe.storage.db import Database

REPO = Path(__file__).resolve().parents[2]
ADDRESS_VARIABLES = ("RLPIPE_CONFIG", "TEMPORAL_ADDRESS", "DATABASE_URL", "S3_ENDPOINT_URL", "INFERENCE_URLS")


def rlpipe(home: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`rlpipe ARGV` with state directory `home`, none of the caller's addresses, and a wide terminal
    (rich wraps at 80 columns otherwise, and the error must fit one line)."""
    environ = {k: v for k, v in os.environ.items() if k not in ADDRESS_VARIABLES}
    return subprocess.run([sys.executable, "-m", "rlpipe.cli.main", *argv], cwd=home.parent, capture_output=True,
                          text=True, timeout=120, env={**environ, "RLPIPE_HOME": str(home), "COLUMNS": "300", **env})


@pytest.mark.parametrize("argv", [["run", "start", str(REPO / "configs" / "tiny-arithmetic.toml")],
                                  ["run", "status", "my-run"]], ids=["start", "status"])
def test_run_commands_before_stack_up_say_to_start_the_stack(tmp_path: Path, argv: list[str]) -> None:
    done = rlpipe(tmp_path / "home", *argv)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output
    assert output.startswith("error: the stack is not running") and "start it with `rlpipe stack up`" in output
    assert "DATABASE_URL" in output and "TEMPORAL_ADDRESS" in output


def test_run_commands_with_temporal_down_name_its_address(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port that nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = rlpipe(tmp_path / "home", "run", "list", TEMPORAL_ADDRESS=f"127.0.0.1:{port}",
                  DATABASE_URL="postgresql://rlpipe:secret@127.0.0.1:1/rlpipe", S3_ENDPOINT_URL="")
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output, output
    assert f"error: cannot reach Temporal at 127.0.0.1:{port}" in output and "rlpipe stack up" in output


def test_stack_env_prints_a_database_url_that_libpq_accepts(tmp_path: Path) -> None:
    """`psql "$DATABASE_URL"` must work with what `stack env` prints: libpq rejects SQLAlchemy's
    `postgresql+psycopg://`. The stack's secrets are written as `stack up` would; nothing runs."""
    home = tmp_path / "home"
    settings = StackSettings(home=home)
    password = PostgresService(settings).password_file
    password.parent.mkdir(parents=True)
    password.write_text("s3cret-Pass_word\n")
    SeaweedService(settings).prepare()

    done = rlpipe(home, "stack", "env")
    assert done.returncode == 0, done.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in done.stdout.splitlines())
    url = exports["DATABASE_URL"].strip("'")
    assert url == "postgresql://rlpipe:s3cret-Pass_word@127.0.0.1:15432/rlpipe"
    assert psycopg.conninfo.conninfo_to_dict(url) == {  # libpq's own parser, as psql uses it
        "user": "rlpipe", "password": "s3cret-Pass_word", "host": "127.0.0.1", "port": "15432", "dbname": "rlpipe"}


@pytest.mark.parametrize("url", ["postgresql://u:p%40ss@db.example:5432/rl",
                                 "postgres://u:p%40ss@db.example:5432/rl",
                                 "postgresql+psycopg://u:p%40ss@db.example:5432/rl"])
def test_both_url_forms_make_the_same_engine(url: str) -> None:
    engine_url = Database(url).engine.url  # no connection is made until the first query
    assert engine_url == Database("postgresql+psycopg://u:p%40ss@db.example:5432/rl").engine.url
    assert engine_url.drivername == "postgresql+psycopg" and engine_url.password == "p@ss"


def test_libpq_url_round_trips_an_awkward_password() -> None:
    sqlalchemy_url = "postgresql+psycopg://u:p%40ss%2Fw%3Ard@db.example:5432/rl"
    plain = libpq_url(sqlalchemy_url)
    assert plain.startswith("postgresql://")
    assert psycopg.conninfo.conninfo_to_dict(plain)["password"] == "p@ss/w:rd"
    assert normalise_database_url(plain) == sqlalchemy_url
