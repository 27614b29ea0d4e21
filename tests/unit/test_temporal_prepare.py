"""`prepare_cluster`'s answers to what a cluster refuses, over a fake of the two RPCs it calls (the
real dev server's happy path is tests/security/test_temporal_tls.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesResponse
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from rlpipe.infra.temporal import SEARCH_ATTRIBUTES
from rlpipe.infra.temporal_cluster import TOO_NEW, prepare_cluster


@dataclass
class FakeCluster:
    """A namespace that exists, holding `registered`; `add_fails` is what AddSearchAttributes raises."""

    registered: dict[str, int] = field(default_factory=dict)
    add_fails: RPCStatusCode | None = None
    added: list[str] = field(default_factory=list)

    async def describe_namespace(self, request: Any) -> None:
        return None

    async def list_search_attributes(self, request: Any) -> ListSearchAttributesResponse:
        return ListSearchAttributesResponse(custom_attributes=self.registered)

    async def add_search_attributes(self, request: AddSearchAttributesRequest) -> None:
        if self.add_fails is not None:
            raise RPCError("no", self.add_fails, b"")
        self.added += list(request.search_attributes)

    def client(self) -> Client:
        return cast(Client, type("C", (), {"workflow_service": self, "operator_service": self})())


def value_type(kind: str) -> int:
    return IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind.upper()}")


async def test_a_namespace_the_services_do_not_know_yet_is_reported_as_too_new() -> None:
    findings = await prepare_cluster(FakeCluster(add_fails=RPCStatusCode.NOT_FOUND).client(), "fresh")
    assert findings == [findings[0], TOO_NEW] and findings[0].ok


async def test_a_refused_registration_names_the_commands_that_do_it() -> None:
    findings = await prepare_cluster(FakeCluster(add_fails=RPCStatusCode.PERMISSION_DENIED).client(), "prod")
    assert [f.item for f in findings[1:]] == [f"search attribute {name}" for name in SEARCH_ATTRIBUTES]
    for f in findings[1:]:
        assert not f.ok and "not allowed for this identity" in f.detail
        assert "temporal operator search-attribute create --namespace prod" in f.detail and "tcld" in f.detail


async def test_only_missing_attributes_are_added_and_a_wrong_type_is_named() -> None:
    first, second, *rest = SEARCH_ATTRIBUTES.items()
    wrong = "Int" if second[1] != "Int" else "Keyword"
    cluster = FakeCluster(registered={first[0]: value_type(first[1]), second[0]: value_type(wrong)})
    findings = {f.item: f for f in await prepare_cluster(cluster.client(), "ns")}
    assert sorted(cluster.added) == sorted(name for name, _ in rest)
    assert findings[f"search attribute {first[0]}"].ok
    assert not findings[f"search attribute {second[0]}"].ok
    assert f"registered as {wrong} but rlpipe needs {second[1]}" in findings[f"search attribute {second[0]}"].detail
