"""Write docs/configuration.md from the metadata of ``rlinf.config.Settings``.

    .venv/bin/python scripts/gen_config_docs.py          # rewrite docs/configuration.md
    .venv/bin/python scripts/gen_config_docs.py --check  # exit 1 if docs/configuration.md is stale

``--out PATH`` writes (or checks) another file instead. The test suite runs ``--check``,
so the table never drifts from the code.
"""

from __future__ import annotations

import pathlib
import sys

from rlinf.config import Knob, knobs

OUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

INTRO = """\
# Configuration

Generated from `rlinf.config.Settings` by `scripts/gen_config_docs.py`; do not edit by hand.

Every `RLINF_*` environment variable is read once, when a process builds its settings
(`rlinf.config.Settings.from_env()`), into one frozen object that is passed down; no other
code reads the environment. A communicator builds them when it is constructed (so a
launcher may set variables after `import rlinf`), unless it is given its own:
`rlinf.connect(..., settings=Settings(...))`. A variable that is unset, empty or blank
takes its default. A bad value fails at once, with a `ValueError` naming the variable and
the value, e.g. `RLINF_SHM_CAP='4X': not a size (use bytes or 64K/16M/4G)`.

Kinds of value:

* **size**: bytes, or a number with `K`, `M`, `G` or `T` (also `KiB`, `KB`, any case;
  powers of 1024): `65536`, `64K`, `16M`, `4G`, `1.5G`.
* **bool**: `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`, in any case.
* **duration**: a plain number, in seconds unless the kind says microseconds (`us`); it
  must be finite and greater than 0, except where 0 turns the feature off.
* **int**: a whole number. **names**: separated by commas or blanks, e.g. `shm,nccl`.
  **str**: text, blanks around it removed.

Besides these, `rlinf.init()` reads what torchrun and Slurm set (`RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_*`, `SLURM_JOB_ID`: `rlinf.config.LaunchEnv`;
see [deployment.md](deployment.md)), and device discovery looks at `CUDA_VISIBLE_DEVICES`.
"""


def _kind(knob: Knob) -> str:
    if knob.kind == "duration":
        return "duration (us)" if knob.unit == "us" else "duration (s)"
    return knob.kind


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    lines = [INTRO, "| Variable | Default | Kind | Meaning |", "| --- | --- | --- | --- |"]
    for knob in knobs():
        text = _cell(knob.format(knob.default))
        default = text if knob.default is None else f"`{text}`"
        lines.append(f"| `{knob.env}` | {default} | {_kind(knob)} | {_cell(knob.meaning)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    out = OUT
    if "--out" in argv:
        out = pathlib.Path(argv[argv.index("--out") + 1])
    text = render()
    if "--check" in argv:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is stale: run scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
