"""The grader cache in Postgres (`grader_cache`), behind the same interface as the in-memory one:
a hit costs no grader call, and every grader worker shares it."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from rlpipe.graders.base import GradeResult
from rlpipe.schemas.tables import GraderCacheEntry
from rlpipe.storage.db import Database


class PostgresGradeCache:
    def __init__(self, db: Database, grader: str, grader_version: str) -> None:
        self.db, self.grader, self.grader_version = db, grader, grader_version

    async def get(self, key: str) -> GradeResult | None:
        return await asyncio.to_thread(self._get, key)

    async def put(self, key: str, result: GradeResult) -> None:
        await asyncio.to_thread(self._put, key, result)

    def _get(self, key: str) -> GradeResult | None:
        with self.db.begin() as s:
            row = s.execute(sa.update(GraderCacheEntry).where(GraderCacheEntry.key == key)
                            .values(hits=GraderCacheEntry.hits + 1)
                            .returning(GraderCacheEntry.score, GraderCacheEntry.details)).one_or_none()
        return None if row is None else GradeResult(row.score, row.details or {})

    def _put(self, key: str, result: GradeResult) -> None:
        with self.db.begin() as s:
            s.execute(insert(GraderCacheEntry).values(key=key, grader=self.grader, grader_version=self.grader_version,
                                                      score=result.score, details=result.details)
                      .on_conflict_do_nothing(index_elements=[GraderCacheEntry.key]))
