"""The inference fleet by name: where each server is reached (`inference_servers`).

A server's sync sidecar registers its name and URL when it starts. Workers started earlier (the
rollout and grader workers) resolve a name they were not configured with here, which is what
lets a server join a running run (`rlpipe run join`) without restarting them.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rlpipe.schemas.tables import InferenceServer


def register_server(s: Session, name: str, url: str) -> None:
    """Record that `name` is reached at `url` (idempotent; a new URL replaces the old one)."""
    stmt = insert(InferenceServer).values(name=name, url=url)
    s.execute(stmt.on_conflict_do_update(index_elements=[InferenceServer.name],
                                         set_={"url": stmt.excluded.url, "seen_at": sa.func.now()}))


def registered_servers(s: Session) -> dict[str, str]:
    """Server name -> URL, for every server a sidecar has registered."""
    query = sa.select(InferenceServer.name, InferenceServer.url).order_by(InferenceServer.name)
    return {name: url for name, url in s.execute(query)}
