"""N identical nodes behind a router with session affinity: sessions and KV per node and in all,
and what the loss of one node leaves (`glmctl plan --nodes N`).

A session lives on one node (its turns go there, so its prefix cache is reused there): the fleet
holds N times one node's sessions, never the pooled KV tokens divided by the session length. When
a node is lost, its sessions lose their KV cache; each is placed again on a surviving node by its
next request, and prefills its whole context there. They find room only in the survivors' free
slots: the most sessions that all stay resident through the loss of any one node is (N - 1) times
one node's.
"""

from __future__ import annotations

from pydantic import BaseModel

from glmctl.errors import UsageError
from glmctl.plan.capacity import CapacityPlan


class NodeLoss(BaseModel):
    nodes_left: int
    sessions: int  # what the survivors hold
    kv_tokens: int
    displaced_at_full_load: int  # one full node's sessions; the full survivors have no slot for them
    resilient_sessions: int  # the most sessions that all stay resident through one loss: (N - 1) x per node


class FleetPlan(BaseModel):
    nodes: int
    node: CapacityPlan  # one node's plan (every node is alike)
    sessions_per_node: int
    kv_tokens_per_node: int
    session_tokens: int
    fleet_sessions: int
    fleet_kv_tokens: int
    after_loss: NodeLoss
    fits: bool  # the node's plan fits (else the fleet holds nothing)
    notes: list[str]


def plan_fleet(node: CapacityPlan, nodes: int) -> FleetPlan:
    if nodes < 1:
        raise UsageError(f"--nodes {nodes}: a fleet has at least one node")
    per_node = node.sessions_that_fit
    tokens = node.kv_tokens
    left = nodes - 1
    notes = []
    if nodes == 1:
        notes.append("a fleet of one node has no failover: losing it loses every session")
    else:
        notes.append(f"at full load ({nodes * per_node} sessions) a lost node's {per_node} sessions find no free "
                     f"slot; run at most {left * per_node} to keep every session resident through one loss")
    notes.append("a session placed again on another node has lost its KV cache: its next turn prefills its "
                 f"whole context (up to {node.setup.session_tokens:,} tokens) there")
    return FleetPlan(
        nodes=nodes, node=node, sessions_per_node=per_node, kv_tokens_per_node=tokens,
        session_tokens=node.setup.session_tokens,
        fleet_sessions=nodes * per_node, fleet_kv_tokens=nodes * tokens,
        after_loss=NodeLoss(nodes_left=left, sessions=left * per_node, kv_tokens=left * tokens,
                            displaced_at_full_load=per_node, resilient_sessions=left * per_node),
        fits=node.fits, notes=notes,
    )
