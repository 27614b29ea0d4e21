"""docs/sql.md cannot drift from the schema: every statement in its SQL blocks runs against the
migrated database (Postgres compiles each against the real tables and views, rows or none)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa

from rlpipe.storage.db import Database

pytestmark = [pytest.mark.stack]

SQL_DOC = Path(__file__).resolve().parents[2] / "docs" / "sql.md"


def psql_variables() -> dict[str, str]:
    """The `\\set NAME VALUE` lines of the page, as bind parameters (the run is one that does not exist)."""
    found = dict(re.findall(r"(?m)^\\set (\w+) '?([^'\n]*)'?$", SQL_DOC.read_text()))
    return found | {"run": "no-such-run"}


def documented_statements() -> list[str]:
    """The statements of every ```sql block, psql's meta-commands left out, its `:'name'` variables
    written as bind parameters."""
    blocks = re.findall(r"```sql\n(.*?)```", SQL_DOC.read_text(), flags=re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines() if not line.lstrip().startswith("\\")]
    text = re.sub(r":'(\w+)'", r":\1", "\n".join(lines))
    statements = [re.sub(r"(?m)^\s*--.*$", "", s).strip() for s in text.split(";")]
    return [s for s in statements if s]


def test_the_sql_doc_has_statements() -> None:
    assert len(documented_statements()) >= 20


@pytest.mark.parametrize("statement", documented_statements(), ids=lambda s: " ".join(s.split())[:60])
def test_every_documented_query_runs_on_the_current_schema(migrated_db: Database, statement: str) -> None:
    with migrated_db.begin() as s:
        query = sa.text(statement)
        s.execute(query, {name: value for name, value in psql_variables().items()
                          if name in query.compile().params}).all()
