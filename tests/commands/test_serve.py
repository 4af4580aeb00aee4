"""`specserve serve`'s printed hint is a command that runs as shown from the same directory in a new
terminal, where nothing has activated the venv (`make run` calls `.venv/bin/specserve`)."""
from __future__ import annotations

import sys

from cluster.commands import serve


def test_hint_names_the_venv_script_by_its_path(tmp_path, monkeypatch):
    script = tmp_path / ".venv" / "bin" / "specserve"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "serve"])
    assert serve._this_cli() == ".venv/bin/specserve"


def test_hint_outside_the_directory_is_absolute(tmp_path, monkeypatch):
    script = tmp_path / "elsewhere" / "specserve"
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    monkeypatch.setattr(sys, "argv", [str(script), "serve"])
    assert serve._this_cli() == str(script)


def test_hint_for_python_dash_m(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["/somewhere/cluster/cli.py", "serve"])
    assert serve._this_cli() == f"{sys.executable} -m cluster.cli"
