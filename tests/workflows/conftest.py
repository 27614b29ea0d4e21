"""The workflow-logic tests need only the Temporal dev server, and talk to their own namespace of
it (see WORKFLOW_LOGIC_NAMESPACE): `temporal_client` here overrides the session one for this
folder, and `clean_workflows` then cleans that namespace."""

from __future__ import annotations

import pytest
from temporalio.client import Client

from rlpipe.infra.stack import Stack
from tests.conftest import WORKFLOW_LOGIC_NAMESPACE


@pytest.fixture(scope="session")
async def temporal_client(temporal_server: Stack) -> Client:
    from rlpipe.infra.temporal_client import TemporalConnection, connect_temporal
    from rlpipe.workers.common import data_converter

    conn = TemporalConnection(temporal_server.settings.temporal_address, WORKFLOW_LOGIC_NAMESPACE)
    return await connect_temporal(conn, data_converter=data_converter())
