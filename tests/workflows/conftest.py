"""The workflow-logic tests talk to their own namespace of the session's dev server (see
WORKFLOW_LOGIC_NAMESPACE): `temporal_client` here overrides the session one for this folder, and
`clean_workflows` then cleans that namespace."""

from __future__ import annotations

import dataclasses

import pytest

from infra.endpoints import Endpoints
from tests.conftest import WORKFLOW_LOGIC_NAMESPACE


@pytest.fixture(scope="session")
async def temporal_client(endpoints: Endpoints):  # type: ignore[no-untyped-def]
    from workers.common import connect

    return await connect(dataclasses.replace(endpoints, temporal_namespace=WORKFLOW_LOGIC_NAMESPACE))
