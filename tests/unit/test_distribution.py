"""The distribution name is ours (``aiorlinf``), and ``import rlinf`` refuses an
environment that also holds the RLinf framework (distribution ``rlinf``, same import name)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tomllib

import rlinf

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _site_with(tmp_path: pathlib.Path, name: str, version: str, summary: str) -> pathlib.Path:
    """A folder that looks like site-packages holding the metadata of one distribution."""
    info = tmp_path / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n")
    return tmp_path


def _import_rlinf(extra_path: pathlib.Path) -> subprocess.CompletedProcess:
    # the fake site holds metadata only (no package): first on the path, its metadata is
    # found before any other (also a stale rlinf.egg-info of an old editable install in
    # the source tree), while our rlinf still imports from the source tree
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(extra_path), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", "import rlinf; print('imported', rlinf.__file__)"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=extra_path)   # '' too


def test_pyproject_names_our_distribution_not_the_taken_one():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == rlinf._DISTRIBUTION == "aiorlinf"
    assert project["description"] == rlinf._SUMMARY
    assert f"pip install {rlinf._DISTRIBUTION}" in (ROOT / "README.md").read_text()


def test_import_fails_clearly_beside_the_rlinf_framework(tmp_path):
    site = _site_with(tmp_path, "rlinf", "0.3.0", "Reinforcement Learning Infrastructure for Embodied and Agentic AI")
    out = _import_rlinf(site)
    assert out.returncode == 1 and "imported" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and "RLinf framework" in last and "pip uninstall rlinf" in last, last
    assert "'aiorlinf'" in last and "0.3.0" in last


def test_import_accepts_our_own_install_made_under_the_old_name(tmp_path):
    site = _site_with(tmp_path, "rlinf", "0.1.0", rlinf._SUMMARY)
    out = _import_rlinf(site)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"imported {ROOT / 'rlinf' / '__init__.py'}"


def test_import_from_a_source_tree_with_no_rlinf_distribution(monkeypatch):
    """A fresh clone on PYTHONPATH, or ``pip install -e .`` under the new name: no
    distribution called ``rlinf`` at all."""
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    assert rlinf._refuse_the_other_rlinf() is None
