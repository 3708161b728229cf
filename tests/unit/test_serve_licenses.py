"""Licence catalogue, acceptance records, and the serve gate: refusals, acceptance, persistence."""

from __future__ import annotations

import json

import pytest

from glmctl import paths
from glmctl.errors import ConfigError, LicenseError
from glmctl.hub import licenses
from glmctl.serving import launch_files, launch_licenses, preflight, profiles

NC = "dflash2-cc-by-nc-nd-4.0"
SHAPLEY = "shapleymcg-1.0"


def _launch(name: str, tmp_path, **paths_):
    prof = launch_files.with_paths(profiles.load(name), **paths_)
    return launch_files.render(prof, port=1)


def test_catalogue_entries_and_lookup():
    nc = licenses.get_license(NC)
    assert not nc.commercial_use and nc.requires_acceptance and nc.url.startswith("https://creativecommons.org")
    shapley = licenses.get_license("ShapleyMcg-License-1.0")  # by alias, any case
    assert shapley.id == SHAPLEY and shapley.commercial_use
    assert any("Brandon M. Music" in o for o in shapley.obligations)
    with pytest.raises(ConfigError, match="unknown licence id"):
        licenses.get_license("gpl-9")


@pytest.mark.parametrize(
    ("ident", "allowed"),
    [("cc-by-nc-4.0", False), ("CC-BY-NC-SA-4.0", False), (NC, False), ("mit", True),
     ("apache-2.0", True), (SHAPLEY, True), ("other", None), ("llama-community", None)],
)
def test_commercial_use_classification(ident, allowed):
    assert licenses.commercial_use_allowed(ident) is allowed


def test_store_records_and_a_changed_notice_needs_new_acceptance(tmp_path):
    store = licenses.LicenseStore(tmp_path)
    lic = licenses.get_license(NC)
    assert store.accepted(lic) is None
    rec = store.accept(lic, "flag", artifact="/models/d")
    on_disk = json.loads((tmp_path / f"{NC}.json").read_text())
    assert on_disk["license"] == NC and on_disk["text_sha256"] == lic.notice_sha256 and on_disk["via"] == "flag"
    assert store.accepted(lic) == rec and store.records() == [rec]
    changed = lic.model_copy(update={"notice": lic.notice + "\nA new clause."})
    assert store.accepted(changed) is None
    (tmp_path / f"{NC}.json").write_text("{not json")
    assert store.accepted(lic) is None  # a broken record never counts


def test_artifact_records_live_beside_fetchs_manifest(tmp_path):
    lic = licenses.get_license(NC)
    licenses.artifact_store(tmp_path).accept(lic, "flag")
    assert (tmp_path / ".glmctl" / f"license-{NC}.json").is_file()
    assert licenses.find_acceptance(lic, [tmp_path]) is not None
    assert licenses.artifact_license_ids(tmp_path) == [NC]


def test_model_card_licence_is_detected(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: cc-by-nc-4.0\ntags: [x]\n---\n# card\n")
    assert licenses.artifact_license_ids(tmp_path) == ["cc-by-nc-4.0"]


def test_noncommercial_refused_without_acceptance_names_the_flag(tmp_path):
    with pytest.raises(LicenseError) as err:
        preflight.run(_launch("noncommercial", tmp_path, model=tmp_path / "m", drafter=tmp_path / "d"))
    assert f"--accept-license {NC}" in err.value.message
    assert "DFlash2" in err.value.message and err.value.exit_code == 2
    assert not paths.licenses().exists()  # nothing recorded by a refusal


def test_acceptance_by_flag_is_recorded_and_remembered(tmp_path):
    prof = launch_files.with_paths(profiles.load("noncommercial"), model=tmp_path / "m", drafter=tmp_path / "d")
    gate = launch_licenses.evaluate(prof, accept=[NC, SHAPLEY])
    assert gate.ok and set(gate.accepted) == {NC, SHAPLEY}
    assert (paths.licenses() / f"{NC}.json").is_file()
    again = launch_licenses.evaluate(prof)  # no flag the second time
    assert again.ok and again.accepted[NC].via == "flag"


def test_an_acceptance_is_recorded_only_beside_the_artifacts_under_that_licence(tmp_path):
    """The drafter's licence must not be recorded next to the checkpoint: a record beside an
    artifact reads as the artifact's own declaration, so the same checkpoint would then be refused
    by every commercial profile (seen in CI: the DFlash2 serving test marked the tiny checkpoint)."""
    model, drafter = tmp_path / "m", tmp_path / "d"
    model.mkdir()
    drafter.mkdir()
    prof = launch_files.with_paths(profiles.load("noncommercial"), model=model, drafter=drafter)
    declared = {lic_id: [a.role for a in launch_licenses.artifacts(prof) if lic_id in a.declared] for lic_id in (NC, SHAPLEY)}
    gate = launch_licenses.evaluate(prof, accept=[NC, SHAPLEY])
    assert gate.ok
    assert NC in licenses.artifact_license_ids(drafter)
    assert NC not in licenses.artifact_license_ids(model), declared
    commercial = launch_files.with_paths(profiles.load("latency"), model=model)
    assert not any("forbids commercial use" in r for r in launch_licenses.evaluate(commercial, accept=[SHAPLEY]).refusals)


def test_acceptance_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GLMCTL_ACCEPT_LICENSES", f"{NC}, {SHAPLEY}")
    prof = launch_files.with_paths(profiles.load("noncommercial"), model=tmp_path / "m", drafter=tmp_path / "d")
    gate = launch_licenses.evaluate(prof)
    assert gate.ok and gate.accepted[NC].via == "env"


def test_confirm_is_asked_only_for_what_is_missing(tmp_path):
    asked = []
    prof = launch_files.with_paths(profiles.load("noncommercial"), model=tmp_path / "m", drafter=tmp_path / "d")
    gate = launch_licenses.evaluate(prof, accept=[SHAPLEY], confirm=lambda lic: asked.append(lic.id) or False)
    assert asked == [NC] and [lic.id for lic in gate.missing] == [NC]
    gate = launch_licenses.evaluate(prof, confirm=lambda lic: asked.append(lic.id) or True)
    assert gate.ok and gate.accepted[NC].via == "prompt" and asked == [NC, NC]


def test_commercial_refuses_a_noncommercial_drafter_whatever_else_is_set(tmp_path, monkeypatch):
    root = paths.user_profiles()
    root.mkdir(parents=True)
    (root / "sneaky.yaml").write_text(
        f"extends: commercial\nspeculative:\n  method: dflash2\n  tokens: 5\n  drafter:\n    licenses: [{NC}]\n"
    )
    licenses.user_store().accept(licenses.get_license(NC), "flag")  # even with a record
    monkeypatch.setenv("GLMCTL_ACCEPT_LICENSES", NC)  # and the environment
    launch = _launch("sneaky", tmp_path, model=tmp_path / "m", drafter=tmp_path / "d")
    with pytest.raises(LicenseError, match="forbids commercial use"):
        preflight.run(launch, accept=[NC, SHAPLEY], confirm=lambda lic: True)


def test_commercial_refuses_a_checkpoint_whose_card_is_noncommercial(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: cc-by-nc-sa-4.0\n---\n")
    prof = launch_files.with_paths(profiles.load("latency"), model=tmp_path)
    gate = launch_licenses.evaluate(prof, accept=[SHAPLEY])
    assert not gate.ok and "cc-by-nc-sa-4.0" in gate.refusals[0]


def test_serve_without_a_terminal_exits_2_and_names_the_flag(run_cli, tmp_path):
    proc = run_cli("serve", "--profile", "noncommercial", "--model", str(tmp_path), "--drafter", str(tmp_path),
                   input="")  # stdin is a pipe: never prompt
    assert proc.returncode == 2
    assert f"--accept-license {NC}" in proc.stderr and "Type the licence id" not in proc.stdout + proc.stderr


def test_fetch_and_serve_share_one_record(tmp_path):
    from glmctl.hub.fetch_license_gate import require_license

    require_license(NC, accept=[NC], artifact="dflash2", record_dir=tmp_path)
    prof = launch_files.with_paths(profiles.load("noncommercial"), model=tmp_path / "m", drafter=tmp_path)
    gate = launch_licenses.evaluate(prof, accept=[SHAPLEY])
    assert NC in gate.accepted and not gate.missing


def test_one_acceptance_order_for_fetch_and_serve(tmp_path, monkeypatch):
    """Flag, then GLMCTL_ACCEPT_LICENSES, then an earlier record, then the operator's answer."""
    monkeypatch.delenv("GLMCTL_ACCEPT_LICENSES", raising=False)
    nc = licenses.get_license(NC)
    asked = []

    def ask(lic):
        asked.append(lic.id)
        return True

    assert licenses.acceptance(nc, [NC], [tmp_path], confirm=ask) == ("flag", None)
    monkeypatch.setenv("GLMCTL_ACCEPT_LICENSES", NC)
    assert licenses.acceptance(nc, [], [tmp_path], confirm=ask) == ("env", None)
    monkeypatch.delenv("GLMCTL_ACCEPT_LICENSES")
    assert licenses.acceptance(nc, [], [tmp_path]) == (None, None) and not asked
    assert licenses.acceptance(nc, [], [tmp_path], confirm=ask) == ("prompt", None) and asked == [NC]
    licenses.record_acceptance(nc, "prompt", [tmp_path], artifact="dflash2")
    via, earlier = licenses.acceptance(nc, [], [tmp_path], confirm=ask)
    assert via is None and earlier.via == "prompt" and asked == [NC]


def test_fetch_asks_through_its_callback_and_refuses_a_no(tmp_path):
    from glmctl.feedback import Feedback
    from glmctl.hub.fetch_license_gate import decide_license

    notes = []
    no = Feedback(note=notes.append, confirm=lambda lic: False)
    with pytest.raises(LicenseError, match="not accepted; nothing was downloaded"):
        decide_license(NC, accept=[], artifact="dflash2", record_dir=tmp_path, feedback=no)
    assert any("dflash2 is licensed under" in n for n in notes)
    with pytest.raises(LicenseError, match="must be accepted before download"):
        decide_license(NC, accept=[], artifact="dflash2", record_dir=tmp_path)  # nobody to ask
    yes = Feedback(confirm=lambda lic: True)
    decision = decide_license(NC, accept=[], artifact="dflash2", record_dir=tmp_path, feedback=yes)
    assert decision.via == "prompt" and not paths.licenses().exists()  # recorded only by `record`
    decision.record(artifact="dflash2", record_dir=tmp_path)
    assert (paths.licenses() / f"{NC}.json").is_file() and (tmp_path / ".glmctl" / f"license-{NC}.json").is_file()


def test_on_a_terminal_serve_asks_and_records_the_acceptance(tmp_path):
    """stdin is a pseudo-terminal: serve shows each licence and asks for its id to be typed."""
    import os
    import pty
    import subprocess
    import sys

    from tests.conftest import REPO

    home = tmp_path / "home"
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "glmctl", "serve", "--profile", "noncommercial", "--model", str(tmp_path / "m"),
         "--drafter", str(tmp_path / "d")],
        stdin=secondary, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "GLMCTL_HOME": str(home)},
    )
    os.close(secondary)
    os.write(primary, f"{SHAPLEY}\n{NC}\n".encode())
    _, err = proc.communicate(timeout=120)
    os.close(primary)
    assert "Brandon M. Music" in err and "non-commercial" in err  # the notices were shown
    assert (home / "licenses" / f"{NC}.json").is_file() and (home / "licenses" / f"{SHAPLEY}.json").is_file()
    assert json.loads((home / "licenses" / f"{NC}.json").read_text())["via"] == "prompt"
    assert proc.returncode == 2 and "does not exist" in err  # then the missing checkpoint stops it
