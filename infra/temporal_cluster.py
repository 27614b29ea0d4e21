"""`rlpipe temporal prepare`: make an external Temporal cluster ready for rlpipe, or say what is missing.

A run's workflows upsert the custom search attributes of `infra.temporal.SEARCH_ATTRIBUTES`; on a
namespace without them every workflow task of the run fails. The local dev server registers them at
each start; any other cluster needs them registered once, which is what this does. Running it again
changes nothing. What the caller may not do (Temporal Cloud registers search attributes through its
control plane, not through the namespace's API; a self-hosted cluster may deny it) is reported with
the command that does it, never skipped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from rlpipe.infra.temporal import SEARCH_ATTRIBUTES

REFUSED = (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNAUTHENTICATED, RPCStatusCode.UNIMPLEMENTED)
"""Answers meaning "not by you, not this way": the attribute is then registered by someone else."""


@dataclass(frozen=True)
class Finding:
    """One thing checked: what, whether it is ready, and what was done or must be done."""

    item: str
    ok: bool
    detail: str


TOO_NEW = Finding("search attributes", False, "the namespace is too new for the cluster's other services: "
                                              "run this again in a minute")
"""A namespace the frontend knows and the services behind it do not yet (their caches refresh)."""


async def prepare_cluster(client: Client, namespace: str) -> list[Finding]:
    """Check that `namespace` exists and holds every search attribute a run uses, registering the
    missing ones where allowed. Idempotent: a prepared namespace comes back all "already" ok."""
    try:
        await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=namespace))
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            detail = (f"does not exist: create it (`temporal operator namespace create --namespace {namespace}`, "
                      "or in Temporal Cloud's UI / `tcld namespace create`), then run this again")
        else:
            detail = f"cannot be read ({exc.status.name}: {exc.message}): this identity needs read access to it"
        return [Finding(f"namespace {namespace}", False, detail)]
    findings = [Finding(f"namespace {namespace}", True, "exists")]
    try:
        listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return [*findings, TOO_NEW]
        return [*findings, Finding("search attributes", False, f"cannot be listed ({exc.status.name}: {exc.message}); "
                                                               f"{_by_hand(namespace, SEARCH_ATTRIBUTES)}")]
    registered = dict(listed.custom_attributes)
    missing = {name: kind for name, kind in SEARCH_ATTRIBUTES.items() if name not in registered}
    for name, kind in SEARCH_ATTRIBUTES.items():
        if name in registered and registered[name] != _value_type(kind):
            have = IndexedValueType.Name(registered[name]).removeprefix("INDEXED_VALUE_TYPE_").title()
            findings.append(Finding(f"search attribute {name}", False, f"registered as {have} but rlpipe needs "
                                                                        f"{kind}: remove it or use another namespace"))
        elif name in registered:
            findings.append(Finding(f"search attribute {name}", True, f"already registered ({kind})"))
    if missing:
        findings += await _register(client, namespace, missing)
    return findings


async def _register(client: Client, namespace: str, missing: dict[str, str]) -> list[Finding]:
    request = AddSearchAttributesRequest(namespace=namespace,
                                         search_attributes={name: _value_type(kind) for name, kind in missing.items()})
    try:
        await client.operator_service.add_search_attributes(request)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:  # listed, then "not found": seen on a loaded dev server
            return [TOO_NEW]
        why = "not allowed for this identity" if exc.status in REFUSED else "refused"
        detail = (f"missing, and registering it was {why} ({exc.status.name}: {exc.message}); "
                  f"{_by_hand(namespace, missing)}")
        return [Finding(f"search attribute {name}", False, detail) for name in missing]
    return [Finding(f"search attribute {name}", True, f"registered now ({kind})") for name, kind in missing.items()]


def _value_type(kind: str) -> IndexedValueType.ValueType:
    return IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind.upper()}")


def _by_hand(namespace: str, attributes: dict[str, str]) -> str:
    """The commands that register `attributes` for someone who may: a cluster admin, or Temporal Cloud's tcld."""
    names = " ".join(f"--name {name} --type {kind}" for name, kind in attributes.items())
    cloud = " ".join(f"--search-attribute {name}={kind}" for name, kind in attributes.items())
    return (f"ask someone who may to run `temporal operator search-attribute create --namespace {namespace} {names}` "
            f"(Temporal Cloud: `tcld namespace search-attributes add --namespace {namespace} {cloud}`)")
