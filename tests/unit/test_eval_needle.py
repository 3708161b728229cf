"""Needle harness: placement at the intended depth in the rebuilt prompt, exact-match scoring,
resumable JSONL, baselines and the heatmap, against tests.fake_server (no vLLM)."""

from __future__ import annotations

import json
import sys

import pytest

from glmctl.errors import UsageError
from glmctl.evals import needle as nd
from glmctl.evals import needle_run
from glmctl.evals.client import OpenAIServer
from glmctl.evals.corpus import stdlib_text
from glmctl.evals.tokenizer import ServerTokenizer
from tests.fake_server import FakeEngine, FakeServer


@pytest.fixture
def fake():
    with FakeServer(FakeEngine(max_model_len=6000)) as url:
        server = OpenAIServer(url)
        server.connect()
        yield server
        server.close()


def _check_cell(tok, source, cell: needle_run.CellResult) -> None:
    """Rebuild the prompt from the recipe alone; the needle sits where the record says."""
    ids = nd.prompt_ids(tok, cell.recipe, source)
    assert nd.ids_digest(ids) == cell.layout.prompt_sha256
    assert len(ids) == cell.layout.prompt_tokens <= cell.recipe.length
    text = tok.decode(ids)
    line = cell.recipe.needle.line
    at = text.find(line)
    assert at > 0 and text[at - 1] == "\n", "the needle starts a line"
    assert tok.decode(ids[: cell.layout.needle_token_index]) == text[:at]
    # at the intended depth: within the needle line plus one haystack line of the target
    tolerance = 100.0 * (cell.layout.needle_tokens + 90) / cell.layout.haystack_tokens
    assert abs(cell.layout.actual_depth_percent - cell.recipe.depth_percent) <= tolerance
    for d in cell.recipe.distractors:
        assert text.count(d.line) == 1 and d.value != cell.recipe.needle.value


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_every_cell_has_its_needle_at_the_intended_depth(fake, tmp_path, api):
    tok, source = ServerTokenizer(fake), stdlib_text()
    out = tmp_path / "n.jsonl"
    report = needle_run.run_grid(fake, tok, source, lengths=[1500, 4000], depths=[0, 25, 50, 75, 100],
                                 out=out, api=api, kind="uuid" if api == "chat" else "number")
    header, cells = needle_run.read_results(out)
    assert header is not None and len(cells) == 10 and report.cells_run == 10
    for cell in cells.values():
        _check_cell(tok, source, cell)
    assert report.accuracy == 1.0  # the fake retrieves: the whole path from answer to score works
    assert {c.actual_depth_percent for c in report.cells if c.depth_percent == 0} == {0.0}
    assert {c.actual_depth_percent for c in report.cells if c.depth_percent == 100} == {100.0}


def _recipe(**kw) -> nd.CellRecipe:
    base = dict(length=1000, depth_percent=50, seed=0, kind="number", api="chat", template_kwargs=None,
                max_answer_tokens=16, source_sha256="x", source_repeats=1, haystack_chars=10,
                needle=nd.Placement(key="Kalo Renmi", value="4817023", depth_percent=50, char_offset=0),
                distractors=[nd.Placement(key="Sator Vel", value="5550123", depth_percent=20, char_offset=0)])
    return nd.CellRecipe(**(base | kw))


@pytest.mark.parametrize(("answer", "correct", "distractor"), [
    ("4817023", True, False),
    ("The secret code of Kalo Renmi is 4817023.", True, False),
    ("481702", False, False),  # a prefix is not the value
    ("4817 023", False, False),
    ("5550123", False, True),
    ("either 5550123 or 4817023", True, True),
    ("", False, False),
])
def test_scoring_is_exact_substring(answer, correct, distractor):
    score = nd.score_answer(answer, _recipe())
    assert (score.correct, score.distractor) == (correct, distractor)


def test_needles_are_generated_per_cell_and_reproducible(fake):
    tok, source = ServerTokenizer(fake), stdlib_text()
    stream = nd.HaystackStream(source, tok)
    stream.ensure_tokens(2000)
    kw = dict(seed=3, kind="uuid", api="chat", distractors=2, template_kwargs=None, max_answer_tokens=48,
              stream=stream, tokenizer=tok)
    a, _ = nd.plan_cell(2000, 50.0, **kw)
    b, _ = nd.plan_cell(2000, 50.0, **kw)
    c, _ = nd.plan_cell(2000, 10.0, **kw)
    assert a == b and a.needle.value != c.needle.value and a.needle.key != c.needle.key
    assert len(a.needle.value) == 36 and a.needle.value.count("-") == 4


def test_a_miss_is_scored_as_a_miss_and_baseline_shows_the_change(tmp_path):
    source = stdlib_text()
    results = {}
    for name, retrieve in (("good", True), ("bad", False)):
        with FakeServer(FakeEngine(max_model_len=3000, retrieve=retrieve)) as url, OpenAIServer(url) as server:
            server.connect()
            results[name] = needle_run.run_grid(server, ServerTokenizer(server), source, lengths=[1200],
                                                depths=[10, 90], out=tmp_path / f"{name}.jsonl")
    assert results["bad"].accuracy == 0.0 and not any(c.distractor for c in results["bad"].cells)
    cmp = needle_run.compare(results["bad"].cells, tmp_path / "good.jsonl")
    assert cmp.cells_compared == 2 and [(c.baseline_correct, c.correct) for c in cmp.changed] == [(True, False)] * 2


def test_answers_cut_off_at_max_answer_tokens_are_counted(tmp_path):
    with FakeServer(FakeEngine(max_model_len=3000, retrieve=False)) as url, OpenAIServer(url) as server:
        server.connect()
        report = needle_run.run_grid(server, ServerTokenizer(server), stdlib_text(), lengths=[1000],
                                     depths=[50], out=tmp_path / "n.jsonl", max_answer_tokens=4)
    assert report.cells_cut_off == 1 and report.cells[0].answer == "I do"


def test_resume_skips_done_cells_ignores_a_cut_line_and_refuses_other_settings(fake, tmp_path):
    tok, source, out = ServerTokenizer(fake), stdlib_text(), tmp_path / "n.jsonl"
    needle_run.run_grid(fake, tok, source, lengths=[1000], depths=[20, 80], out=out)
    with out.open("a") as fh:
        fh.write('{"kind": "needle-cell", "recipe": {"len')  # a crash mid-write
    again = needle_run.run_grid(fake, tok, source, lengths=[1000, 1500], depths=[20, 80], out=out)
    assert (again.cells_resumed, again.cells_run) == (2, 2) and len(again.cells) == 4
    with pytest.raises(UsageError, match="other settings .*needle_kind"):
        needle_run.run_grid(fake, tok, source, lengths=[1000], depths=[20], out=out, kind="uuid")
    fresh = needle_run.run_grid(fake, tok, source, lengths=[1000], depths=[20], out=out, kind="uuid", restart=True)
    assert fresh.cells_run == 1 and len(needle_run.read_results(out)[1]) == 1


def test_a_corrupt_middle_line_is_an_error(tmp_path):
    out = tmp_path / "n.jsonl"
    out.write_text('{"kind": "needle-header"}\nnot json\n{"kind": "needle-cell"}\n')
    with pytest.raises(UsageError, match="n.jsonl:1"):
        needle_run.read_results(out)


def test_length_too_short_for_a_haystack_or_too_long_for_the_server(fake, tmp_path):
    tok, source = ServerTokenizer(fake), stdlib_text()
    with pytest.raises(UsageError, match="no room for a haystack"):
        needle_run.run_grid(fake, tok, source, lengths=[300], depths=[50], out=tmp_path / "a.jsonl")
    with pytest.raises(UsageError, match=r"7,048 tokens, more than the server's max_model_len of 6,000"):
        needle_run.run_grid(fake, tok, source, lengths=[7000], depths=[50], out=tmp_path / "b.jsonl")


def test_parse_grid():
    assert nd.parse_lengths("32k, 128k,250k,32000") == [32_000, 128_000, 250_000]
    assert nd.parse_depths("90,10,50") == [10.0, 50.0, 90.0]
    for bad in ("", "x", "-1"):
        with pytest.raises(UsageError):
            nd.parse_lengths(bad)
    with pytest.raises(UsageError):
        nd.parse_depths("10,101")
    assert max(nd.DEFAULT_LENGTHS) >= 250_000 and len(nd.DEFAULT_DEPTHS) >= 3


def test_heatmap_png_and_graceful_without_matplotlib(fake, tmp_path, monkeypatch):
    report = needle_run.run_grid(fake, ServerTokenizer(fake), stdlib_text(), lengths=[1000], depths=[50],
                                 out=tmp_path / "n.jsonl")
    png = tmp_path / "n.png"
    assert needle_run.write_heatmap(report, png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert needle_run.write_heatmap(report, tmp_path / "other.png") is False


def test_cli_needle_dry_run_and_json(run_cli, tmp_path):
    with FakeServer(FakeEngine(max_model_len=3000)) as url:
        dry = run_cli("eval", "needle", "--url", url, "--lengths", "1k,2k", "--depths", "10,90", "--dry-run",
                      "--out", str(tmp_path / "n.jsonl"))
        assert dry.returncode == 0, dry.stderr
        assert "dry run" in dry.stdout and not (tmp_path / "n.jsonl").exists()
        run = run_cli("eval", "needle", "--url", url, "--lengths", "1k", "--depths", "50", "--json",
                      "--out", str(tmp_path / "n.jsonl"))
        assert run.returncode == 0, run.stderr
        doc = json.loads(run.stdout)
        assert doc["kind"] == "needle" and doc["accuracy"] == 1.0 and doc["heatmap"].endswith("n.png")
        bad = run_cli("eval", "needle", "--url", url, "--lengths", "250k")
        assert bad.returncode == 2 and "max_model_len" in bad.stderr


def test_a_tokenizer_that_does_not_round_trip_is_a_server_error(fake, tmp_path, monkeypatch):
    from glmctl.evals.client import ServerError

    tok = ServerTokenizer(fake)
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids: real(ids).replace("secret code", "s3cr3t c0de"))
    with pytest.raises(ServerError, match="does not give back the prompt"):
        needle_run.run_grid(fake, tok, stdlib_text(), lengths=[2000], depths=[50.0], out=tmp_path / "n.jsonl")
    assert not (tmp_path / "n.jsonl").exists()
