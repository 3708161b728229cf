"""glmctl fleet and plan --nodes on CPU: the fleet's capacity, the rendered files (vllm-router's own
parser reads the router's command; nothing secret is readable by others), and the real
vllm-router 0.1.17 in front of fake vLLM servers: a session's turns stay on one node
(X-Session-ID), the bench sums the nodes' counters, a node that dies mid-stream fails its
sessions (exit 1, each named), and `fleet status` reads every node."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
import yaml

from tests.fake_server import FakeEngine, FakeServer
from tests.unit.cli_inproc import run_glmctl

NODE = ("--gpus", "8xL40", "--kv-cache-dtype", "fp8", "--speculative", "mtp:3", "--experts", "exl3:4",
        "--max-num-seqs", "8")


# -- plan --nodes -----------------------------------------------------------------------------------

def test_plan_nodes_is_the_node_times_n_and_what_one_loss_leaves(capsys):
    node = json.loads(run_glmctl(capsys, "plan", *NODE, "--json").out)
    run = run_glmctl(capsys, "plan", *NODE, "--nodes", "4", "--json")
    assert run.code == 0, run.err
    fleet = json.loads(run.out)
    assert fleet["node"] == node  # the node's plan, unchanged
    per_node, tokens = node["sessions_that_fit"], node["kv_tokens"]
    assert per_node == 8 and tokens > 2_000_000
    assert (fleet["sessions_per_node"], fleet["kv_tokens_per_node"]) == (per_node, tokens)
    assert (fleet["fleet_sessions"], fleet["fleet_kv_tokens"]) == (4 * per_node, 4 * tokens)
    assert fleet["after_loss"] == {"nodes_left": 3, "sessions": 3 * per_node, "kv_tokens": 3 * tokens,
                                   "displaced_at_full_load": per_node, "resilient_sessions": 3 * per_node}
    human = run_glmctl(capsys, "plan", *NODE, "--nodes", "4")
    assert "after losing one (3 left)" in human.out and "through the loss of any one node: 24" in human.out


def test_plan_nodes_of_one_has_no_failover_and_a_node_that_does_not_fit_holds_nothing(capsys):
    one = json.loads(run_glmctl(capsys, "plan", *NODE, "--nodes", "1", "--json").out)
    assert one["after_loss"]["sessions"] == 0 and "no failover" in one["notes"][0]
    short = run_glmctl(capsys, "plan", "--gpus", "8xL40", "--nodes", "3", "--json")  # bf16 experts do not fit
    assert short.code == 1
    doc = json.loads(short.out)
    assert doc["fits"] is False and doc["fleet_sessions"] == 0 and doc["fleet_kv_tokens"] == 0


@pytest.mark.parametrize("args", [("--nodes", "0"), ("--nodes", "2", "--reproduce-report")])
def test_plan_nodes_usage_errors(capsys, args):
    assert run_glmctl(capsys, "plan", *args).code == 2


# -- fleet render -----------------------------------------------------------------------------------

SECRET_PROFILE = ("extends: tiny-cpu\nenv:\n  HF_TOKEN: hf_abcdef\nvllm_args:\n  api-key: sk-live-123\n")


def test_render_writes_the_router_and_each_nodes_plain_vllm_files(capsys, tmp_path):
    from vllm_router.launch_router import parse_router_args

    from glmctl.serving import launch_files, profiles

    profile = tmp_path / "p.yaml"
    profile.write_text(SECRET_PROFILE)
    out, model = tmp_path / "fleet", tmp_path / "ckpt"
    run = run_glmctl(capsys, "fleet", "render", "--profile", profile, "--model", model,
                     "--nodes", "gpu1:8000,10.0.0.2:8001", "--out", out, "--health-interval", "3", "--json")
    assert run.code == 0, run.err
    doc = yaml.safe_load((out / "fleet.yaml").read_text())
    assert doc["router"]["policy"] == "sticky_least_loaded" and doc["router"]["session_header"] == "X-Session-ID"
    assert [n["url"] for n in doc["nodes"]] == ["http://gpu1:8000", "http://10.0.0.2:8001"]
    assert json.loads(run.out)["router"] == doc["router"]

    # each node's directory is exactly what `glmctl profile render` writes for it
    prof = launch_files.with_paths(profiles.load(str(profile)), model=model)
    for name, port in (("gpu1-8000", 8000), ("10.0.0.2-8001", 8001)):
        node = out / "nodes" / name
        expected = launch_files.render(prof, host="0.0.0.0", port=port)
        assert (node / "vllm.yaml").read_text() == expected.config_yaml()
        assert (node / "vllm.env").read_text() == expected.env_file()
        assert (node / "command.sh").read_text() == expected.script()

    # vllm-router's own parser reads the rendered command
    script = (out / "router" / "command.sh").read_text()
    words = script.split("exec ", 1)[1].replace("\\\n", " ").split()
    assert words[0] == "vllm-router"
    args = parse_router_args(words[1:])
    assert args.policy == "sticky_least_loaded" and args.health_check_interval_secs == 3
    assert args.worker_urls == ["http://gpu1:8000", "http://10.0.0.2:8001"]
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert "VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S=7200" in (out / "router" / "router.env").read_text()

    # nothing secret where others may read it; env files are the owner's only
    for path in out.rglob("*"):
        if not path.is_file():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.name.endswith(".env") or path.name == "vllm.yaml":  # vllm.yaml holds the api-key here
            assert mode & 0o077 == 0, (path, oct(mode))
        if mode & 0o004:
            text = path.read_text()
            assert "sk-live-123" not in text and "hf_abcdef" not in text, path
    assert "sk-live-123" not in run.out and "hf_abcdef" not in run.out
    assert not list(out.rglob(".*.tmp*"))  # written through temporary names, none left


@pytest.mark.parametrize(("nodes", "said"), [
    ("gpu1:8000,gpu1:8000", "twice"), ("", "names no node"), ("ftp://x:1", "not HOST:PORT"),
    ("gpu1:99999", "cannot read"),
])
def test_render_refuses_bad_node_lists(capsys, tmp_path, nodes, said):
    run = run_glmctl(capsys, "fleet", "render", "--profile", "tiny-cpu", "--model", tmp_path, "--nodes", nodes,
                     "--out", tmp_path / "out")
    assert run.code == 2 and said in run.err, run.err


def test_fleet_up_refuses_a_gpu_profile_and_a_taken_port(capsys, tmp_path):
    import socket

    run = run_glmctl(capsys, "fleet", "up", "--profile", "commercial", "--model", tmp_path, "--nodes", "2")
    assert run.code == 2 and "fleet render" in run.err, run.err
    pytest.importorskip("vllm_router")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = run_glmctl(capsys, "fleet", "up", "--profile", "tiny-cpu", "--model", tmp_path, "--port", str(port))
    assert run.code == 2 and f"port {port} on 127.0.0.1 is already in use" in run.err and "--port" in run.err


# -- the real vllm-router in front of fake servers --------------------------------------------------

@pytest.fixture
def fleet(tmp_path):
    """Start `n` fake vLLM servers and the real vllm-router in front of them (as `fleet up` does)."""
    pytest.importorskip("vllm_router")
    from glmctl.fleet.local_fleet import LOCAL_ROUTER, _distinct_free_ports
    from glmctl.fleet.router import RouterSettings, supervised_command
    from glmctl.serving.launch import VllmProcess

    held = []

    def start(n: int, **engine_kw) -> tuple[str, list[FakeEngine], list[FakeServer]]:
        engines = [FakeEngine(**({"max_model_len": 4096, "decode_tok_s": 150.0} | engine_kw)) for _ in range(n)]
        servers = [FakeServer(e) for e in engines]
        urls = [s.__enter__() for s in servers]
        held.extend(servers)
        port, metrics = _distinct_free_ports(2, set())
        settings = RouterSettings(host="127.0.0.1", port=port, metrics_host="127.0.0.1", metrics_port=metrics,
                                  **LOCAL_ROUTER)
        proc = VllmProcess(settings.argv(urls, command=supervised_command()), settings.env(),
                           tmp_path / f"router-{port}.log", name="vllm-router")
        proc.start()
        held.append(proc)
        proc.wait_healthy(settings.url, 60)
        return settings.url, engines, servers

    yield start
    for item in reversed(held):
        if isinstance(item, FakeServer):
            try:
                item.__exit__(None, None, None)
            except OSError:
                pass
        else:
            item.stop(grace_s=5)


def _sessions_by_engine(engines: list[FakeEngine]) -> dict[str, set[int]]:
    """session id -> the engines (by index) that served one of its requests."""
    seen: dict[str, set[int]] = {}
    for i, engine in enumerate(engines):
        for body, headers in zip(engine.requests, engine.request_headers, strict=True):
            if body["path"] == "/v1/completions" and "x-session-id" in headers:
                seen.setdefault(headers["x-session-id"], set()).add(i)
    return seen


def test_bench_through_the_router_keeps_each_session_on_one_node_and_sums_their_counters(capsys, fleet, tmp_path):
    router, engines, _ = fleet(2)
    out = tmp_path / "bench.json"
    run = run_glmctl(capsys, "bench", "--url", router, "--sessions", "4", "--context", "300", "--turns", "3",
                     "--turn-tokens", "50", "--output-tokens", "60", "--poll-interval", "0.05", "--out", out)
    assert run.code == 0, run.text
    result = json.loads(out.read_text())
    assert len(result["nodes"]) == 2 and "behind vllm-router: 2 node(s)" in run.out
    cell = result["cells"][0]
    assert cell["steady"] is not None  # all 4 decode together only when the two nodes' gauges are summed
    sessions = {d["session_id"]: d for d in cell["sessions_detail"]}
    placed = _sessions_by_engine(engines)
    assert set(placed) == set(sessions) and all(len(nodes) == 1 for nodes in placed.values()), placed
    assert sorted(sum(1 for n in placed.values() if n == {i}) for i in (0, 1)) == [2, 2]  # least loaded first
    for sid, detail in sessions.items():
        assert detail["turns_done"] == 3 and len(detail["turn_ttft_s"]) == 3
        [node] = placed[sid]
        mine = [(b, h) for b, h in zip(engines[node].requests, engines[node].request_headers, strict=True)
                if h.get("x-session-id") == sid]
        assert [h["x-request-id"] for _, h in mine] == [f"{sid}-t1", f"{sid}-t2", f"{sid}-t3"]
        lengths = [len(b["prompt"]) for b, _ in mine]
        assert lengths == [300, 300 + 60 + 50, 300 + 2 * (60 + 50)]  # each turn resends the last one
        assert mine[1][0]["prompt"][:300] == mine[0][0]["prompt"]


def test_a_node_dying_mid_stream_fails_its_sessions_by_name_and_new_ones_go_to_the_survivor(capsys, fleet, tmp_path):
    router, engines, servers = fleet(2)
    engines[1].faults["stream"] = "cut"  # node 2 drops every stream halfway, as a node that dies does
    out = tmp_path / "bench.json"
    started = time.monotonic()
    run = run_glmctl(capsys, "bench", "--url", router, "--sessions", "4", "--context", "300", "--turns", "2",
                     "--output-tokens", "40", "--poll-interval", "0.05", "--out", out, "--deadline", "60")
    assert run.code == 1 and time.monotonic() - started < 60
    assert "2 of 4 session(s) failed" in run.err and "without a finish reason" in run.err, run.err
    lost = {sid for sid, nodes in _sessions_by_engine(engines).items() if nodes == {1}}
    assert len(lost) == 2 and not out.exists()
    for sid in lost:  # each lost session is named, by its number
        assert f"session {int(sid.rsplit('-s', 1)[1])}: turn 1 of 2" in run.err

    servers[1].__exit__(None, None, None)  # now node 2 is gone; the router notices within ~2 s
    status = _wait_status(capsys, router, lambda doc: _routed(doc, servers[1].url) is False)
    assert status.code == 1
    before = len(engines[0].requests)
    again = run_glmctl(capsys, "bench", "--url", router, "--sessions", "2", "--context", "300",
                       "--output-tokens", "40", "--poll-interval", "0.05", "--out", out)
    assert again.code == 0, again.text
    assert sum(1 for b in engines[0].requests[before:] if b["path"] == "/v1/completions") == 2


def _routed(doc: dict, url: str) -> bool:
    return {n["url"]: n for n in doc["nodes"]}[url]["routed"]


def _wait_status(capsys, router: str, done, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while True:
        run = run_glmctl(capsys, "fleet", "status", "--url", router, "--timeout", "2", "--json")
        if done(json.loads(run.out)) or time.monotonic() > end:
            return run
        time.sleep(0.3)


def test_fleet_status_reads_each_node_and_exits_1_while_one_is_down(capsys, fleet):
    router, engines, servers = fleet(2)
    engines[0].running, engines[0].waiting = 2, 1  # as a node with two sessions decoding and one queued
    engines[0].counters["vllm:request_success"] = 7
    run = run_glmctl(capsys, "fleet", "status", "--url", router, "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["all_healthy"] and doc["healthy_nodes"] == 2 and doc["sessions"] == 3
    by_url = {n["url"]: n for n in doc["nodes"]}
    first = by_url[servers[0].url]
    assert (first["running"], first["waiting"], first["sessions"], first["requests_finished"]) == (2, 1, 3, 7)
    assert first["kv_usage"] == pytest.approx(2 / 64)
    engines[0].running = engines[0].waiting = 0
    servers[1].__exit__(None, None, None)
    down = _wait_status(capsys, router, lambda d: _routed(d, servers[1].url) is False)
    assert down.code == 1
    gone = {n["url"]: n for n in json.loads(down.out)["nodes"]}[servers[1].url]
    assert gone["healthy"] is False and gone["error"] and gone["routed"] is False
    assert "not healthy" in down.err


def test_fleet_status_of_a_plain_server_is_a_usage_error(capsys):
    with FakeServer(FakeEngine()) as url:
        run = run_glmctl(capsys, "fleet", "status", "--url", url)
    assert run.code == 2 and "is not a vllm-router" in run.err


# -- bench --turns against one server ---------------------------------------------------------------

def test_a_stream_cut_before_its_finish_reason_is_a_failed_session(capsys, tmp_path):
    with FakeServer(FakeEngine(faults={"stream": "cut"})) as url:
        run = run_glmctl(capsys, "bench", "--url", url, "--sessions", "2", "--context", "300",
                         "--output-tokens", "40", "--out", tmp_path / "b.json")
    assert run.code == 1 and "2 of 2 session(s) failed" in run.err
    assert "ended after 20 token(s) without a finish reason" in run.err
    assert not (tmp_path / "b.json").exists()


def test_a_later_turn_that_fails_names_the_turn(capsys, tmp_path):
    engine = FakeEngine(faults={"stream": "half"})  # every second stream answers HTTP 500
    with FakeServer(engine) as url:
        run = run_glmctl(capsys, "bench", "--url", url, "--sessions", "1", "--context", "300", "--turns", "3",
                         "--output-tokens", "20", "--out", tmp_path / "b.json")
    assert run.code == 1 and "session 1: turn 2 of 3: HTTP 500" in run.err, run.err
    assert sum(1 for b in engine.requests if b["path"] == "/v1/completions") == 2  # no turn after the failed one


def test_turns_must_fit_the_context(capsys):
    with FakeServer(FakeEngine(max_model_len=1000)) as url:
        run = run_glmctl(capsys, "bench", "--url", url, "--sessions", "1", "--context", "600", "--turns", "3",
                         "--turn-tokens", "100", "--output-tokens", "100")
    assert run.code == 2 and "3 turns" in run.err and "1,100 by its last" in run.err, run.err


def test_router_files_are_private_where_they_hold_the_environment(tmp_path):
    from glmctl.fleet.fleet_render import NodeAddress, render_fleet, write_router_files
    from glmctl.fleet.router import RouterSettings
    from glmctl.serving import launch_files, profiles

    prof = launch_files.with_paths(profiles.load("tiny-cpu"), model=tmp_path)
    files = write_router_files(render_fleet(prof, [NodeAddress("127.0.0.1", 9)], RouterSettings()), tmp_path / "f")
    assert stat.S_IMODE(files.router_env.stat().st_mode) & 0o077 == 0
    assert os.access(files.router_command, os.X_OK)
    assert Path(files.fleet).read_text().startswith("# glmctl fleet")
