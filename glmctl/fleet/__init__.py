"""A fleet of glmctl nodes behind the vLLM project's router, `vllm-router` (the `[fleet]` extra).

Each node is one plain `vllm serve` of a serving profile (what `glmctl profile render` writes);
in front of them runs `vllm-router` 0.1.17 with its `sticky_least_loaded` policy: a session's
requests carry the `X-Session-ID` header, its first one goes to the node with the fewest
sessions, and every later turn to the same node, where its KV cache is. The router's health
checks take a node that stops answering out of rotation, and its sessions are placed again.

Modules: `router` (the router as data: policy, session header, command line; reading its
/workers), `fleet_render` (`glmctl fleet render`: the router's and every node's files),
`local_fleet` (`glmctl fleet up`: K local servers and the router, supervised as one tree),
`fleet_status` (`glmctl fleet status`: each node's health, sessions and KV use from its /metrics).
The fleet's capacity is the planner's (`glmctl.plan.fleet_capacity`).
"""
