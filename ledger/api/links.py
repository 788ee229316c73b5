"""OpenAPI links between operations (what a client, or a stateful test, may call next with
values from a response). Applied to the generated schema in ``create_app``.

Each :class:`Link` says: after ``source`` answered one of ``statuses``, ``target`` can be
called with these parameters (``location.name`` -> an OpenAPI runtime expression such as
``$response.body#/request_id``) and, for POST targets, this request body. Operations are
named by method and path; :func:`add_links` writes each link under the source response's
``links`` with the target's ``operationId``, and refuses a link whose operation or
parameter is not in the schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RID = "$response.body#/request_id"


@dataclass(frozen=True)
class Link:
    source: str                      # "METHOD /path"
    statuses: tuple[str, ...]
    name: str
    target: str                      # "METHOD /path"
    parameters: dict[str, Any] = field(default_factory=dict)
    request_body: Any = None
    description: str = ""


LINKS: tuple[Link, ...] = (
    # a stored envelope: read it back, prove it, dispute it, find its neighbours
    *(Link("POST /v1/envelopes", ("201", "200"), name, target, params, body, desc)
      for name, target, params, body, desc in (
          ("GetEnvelope", "GET /v1/envelopes/{request_id}", {"path.request_id": RID}, None,
           "The stored envelope"),
          ("GetEnvelopeProof", "GET /v1/envelopes/{request_id}/proof",
           {"path.request_id": RID}, None, "Its inclusion proof (404 until integrated)"),
          ("GetEntryProof", "GET /v1/log/proof",
           {"query.index": "$response.body#/log_index"}, None, "Proof of its log entry"),
          ("OpenDispute", "POST /v1/disputes", {}, {"request_id": RID},
           "Dispute it: a matching worker replays it"),
          ("SearchSameFingerprint", "GET /v1/envelopes",
           {"query.fingerprint_id": "$response.body#/fingerprint_id"}, None,
           "Envelopes recorded on the same runtime"),
          ("DisputesOfRequest", "GET /v1/disputes", {"query.request_id": RID}, None,
           "Disputes opened on it"),
          ("ExportRequest", "GET /v1/export", {"query.request_id": RID}, None,
           "An offline-verifiable bundle holding it"),
      )),
    Link("POST /v1/envelopes/batch", ("200",), "GetFirstEnvelope",
         "GET /v1/envelopes/{request_id}",
         {"path.request_id": "$response.body#/results/0/request_id"},
         description="The first item of the batch"),
    Link("POST /v1/envelopes/batch", ("200",), "DisputeFirstEnvelope", "POST /v1/disputes",
         request_body={"request_id": "$response.body#/results/0/request_id"},
         description="Dispute the first item of the batch"),
    Link("GET /v1/envelopes", ("200",), "GetFirstItem", "GET /v1/envelopes/{request_id}",
         {"path.request_id": "$response.body#/items/0/request_id"}),
    Link("GET /v1/envelopes", ("200",), "NextPage", "GET /v1/envelopes",
         {"query.cursor": "$response.body#/next_cursor"},
         description="The next page (a cursor is bound to the query that made it)"),
    # a dispute: read it, comment on it, try to resolve it
    *(Link("POST /v1/disputes", ("201", "200"), name, target,
           {"path.dispute_id": "$response.body#/id"})
      for name, target in (("GetDispute", "GET /v1/disputes/{dispute_id}"),
                           ("CommentOnDispute", "POST /v1/disputes/{dispute_id}/comments"),
                           ("ResolveDispute", "POST /v1/disputes/{dispute_id}/resolve"))),
    Link("GET /v1/disputes", ("200",), "GetFirstDispute", "GET /v1/disputes/{dispute_id}",
         {"path.dispute_id": "$response.body#/items/0/id"}),
    Link("POST /v1/disputes/{dispute_id}/comments", ("201",), "GetCommentProof",
         "GET /v1/log/proof", {"query.index": "$response.body#/log_index"},
         description="Proof of the signed comment event"),
    # keys, API keys, policies
    *(Link("POST /v1/keys", ("201", "200"), name, target,
           {"path.keyid": "$response.body#/keyid"})
      for name, target in (("GetKey", "GET /v1/keys/{keyid}"),
                           ("RevokeKey", "POST /v1/keys/{keyid}/revoke"))),
    Link("POST /v1/api-keys", ("201",), "RevokeApiKey", "POST /v1/api-keys/{key_id}/revoke",
         {"path.key_id": "$response.body#/id"}),
    Link("POST /v1/reverification-policies", ("201", "200"), "PolicyRuns",
         "GET /v1/reverification-runs", {"query.kind": "policy"},
         description="Runs of re-verification policies"),
    Link("GET /v1/reverification-runs", ("200",), "GetRun",
         "GET /v1/reverification-runs/{run_id}", {"path.run_id": "$response.body#/items/0/id"}),
    # the log: prove the latest checkpoint consistent with later ones
    Link("GET /v1/log/checkpoint", ("200",), "ConsistencyFromCheckpoint",
         "GET /v1/log/consistency", {"query.from": "$response.body#/tree_size"}),
    Link("GET /v1/log/checkpoint", ("200",), "ProofAtCheckpoint", "GET /v1/log/proof",
         {"query.tree_size": "$response.body#/tree_size"}),
)


def _operations(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{method.upper()} {path}": op for path, ops in schema.get("paths", {}).items()
            for method, op in ops.items() if isinstance(op, dict)}


def check_link(link: Link, operations: dict[str, dict[str, Any]]) -> None:
    """Raise ``ValueError`` unless the link's operations, statuses and parameters exist."""
    for end in (link.source, link.target):
        if end not in operations:
            raise ValueError(f"link {link.name}: no operation {end}")
    source, target = operations[link.source], operations[link.target]
    for status in link.statuses:
        if status not in source.get("responses", {}):
            raise ValueError(f"link {link.name}: {link.source} has no {status} response")
    declared = {f"{p['in']}.{p['name']}" for p in target.get("parameters", [])}
    for name in link.parameters:
        if name not in declared:
            raise ValueError(f"link {link.name}: {link.target} has no parameter {name}")
    if link.request_body is not None and "requestBody" not in target:
        raise ValueError(f"link {link.name}: {link.target} takes no request body")


def add_links(schema: dict[str, Any]) -> dict[str, Any]:
    operations = _operations(schema)
    for link in LINKS:
        check_link(link, operations)
        definition: dict[str, Any] = {"operationId": operations[link.target]["operationId"]}
        if link.parameters:
            definition["parameters"] = dict(link.parameters)
        if link.request_body is not None:
            definition["requestBody"] = link.request_body
        if link.description:
            definition["description"] = link.description
        responses = operations[link.source]["responses"]
        for status in link.statuses:
            # copy: generated response objects may be shared between operations
            response = responses[status] = dict(responses[status])
            response["links"] = {**response.get("links", {}), link.name: dict(definition)}
    return schema
