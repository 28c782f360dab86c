"""Every code block marked runnable in README.md and docs/*.md runs.

The convention: an HTML comment ``<!-- runnable -->`` on the line right before a
```` ```python ```` fence marks the block as a complete program that runs on a CPU-only
machine in under a minute (no torchrun, GPU, Ray or second machine). Each marked block is
written to a file of its own and run with this interpreter from the repository root; a
block fails the test with its ``file:line`` and its output when it exits non-zero or
runs past the timeout. Unmarked blocks are fragments or need more than one machine.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
TIMEOUT = 90
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\S*)")


def runnable_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` of each marked block of ``path``.

    Raises:
        ValueError: a marker that is not right before a ```python fence (a typo would
            silently leave a block untested).
    """
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence.group(2) != "python":
            raise ValueError(f"{path.relative_to(ROOT)}:{i + 1}: {MARKER} must be followed by a ```python fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith(fence.group(1))), None)
        if end is None:
            raise ValueError(f"{path.relative_to(ROOT)}:{i + 2}: unclosed code block")
        blocks.append((i + 2, "\n".join(lines[i + 2:end]) + "\n"))
    return blocks


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


BLOCKS = [(path, line, code) for path in _documents() for line, code in runnable_blocks(path)]


def test_the_readme_and_getting_started_have_runnable_blocks():
    """The convention is in use where a new user starts (a renamed marker fails here)."""
    marked = {path.name for path, _, _ in BLOCKS}
    assert {"README.md", "getting-started.md"} <= marked, marked


@pytest.mark.parametrize("path, line, code", BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in BLOCKS])
def test_marked_block_runs(path: Path, line: int, code: str, tmp_path: Path):
    where = f"{path.relative_to(ROOT)}:{line}"
    # A file of its own: worker processes are started with "spawn", which re-imports the
    # main script by path (the block's `if __name__ == "__main__":` guard matters).
    script = tmp_path / f"{path.stem.replace('-', '_')}_{line}.py"
    script.write_text(code)
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                             timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x
                         for x in (exc.stdout or "", exc.stderr or ""))
        pytest.fail(f"{where}: still running after {TIMEOUT} s\n{output[-4000:]}")
    assert out.returncode == 0, f"{where}: exited with status {out.returncode}\n{(out.stdout + out.stderr)[-4000:]}"
