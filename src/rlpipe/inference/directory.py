"""Where each named inference server is reached, for the workers that send it requests.

A worker knows the servers it was configured with (INFERENCE_URLS, or the local stack's) and
asks the database for any other name: a server that joined a running run after the worker
started registered itself there through its sidecar (storage/servers.py).
"""

from __future__ import annotations

import asyncio
import logging

import sqlalchemy as sa

from rlpipe.storage.db import Database
from rlpipe.storage.servers import register_server, registered_servers

log = logging.getLogger(__name__)


class UnknownServer(LookupError):
    """No configured or registered inference server has this name."""


class ServerDirectory:
    def __init__(self, configured: dict[str, str], db: Database) -> None:
        self.configured = configured
        """Name -> URL given to this worker; these names win over registered ones."""
        self.db = db
        self._registered: dict[str, str] = {}

    async def url(self, name: str) -> str:
        """The URL of server `name`; a name not known yet is looked up in the registry again."""
        if name in self.configured:
            return self.configured[name]
        if name not in self._registered:
            await self._refresh()
        if name not in self._registered:
            known = ", ".join(sorted(self.configured.keys() | self._registered.keys())) or "none"
            raise UnknownServer(f"no inference server named {name!r} (known: {known}); start its sidecar with "
                                f"`rlpipe worker sidecar --server {name} --url URL` to register it")
        return self._registered[name]

    async def _refresh(self) -> None:
        def read() -> dict[str, str]:
            with self.db.begin() as s:
                return registered_servers(s)

        self._registered = await asyncio.to_thread(read)


async def announce(db: Database, name: str, url: str, every_s: float = 2.0) -> None:
    """Register server `name` at `url` for the workers that do not know it (its sidecar does this
    at start), retrying while the database is down or not yet migrated."""

    def register() -> None:
        with db.begin() as s:
            register_server(s, name, url)

    while True:
        try:
            return await asyncio.to_thread(register)
        except sa.exc.SQLAlchemyError as exc:
            log.warning("cannot register server %s at %s yet (retrying in %.0f s): %s", name, url, every_s, exc)
        await asyncio.sleep(every_s)
