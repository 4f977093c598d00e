"""The venvs ``kvfail matrix`` audits: one vLLM each, found by its package metadata.

Why a module of its own: one interpreter can import only one vLLM, so each release the
matrix reads lives in its own venv (``scripts/setup.sh --vllm VERSION`` builds
``.venv-VERSION/``; the default is ``.venv/``), or, for a release no venv here can hold,
in the sources unpacked from its wheel (:mod:`kvfail.audit.wheel`). Finding them imports
no vLLM.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvfail.audit.wheel import dist_version, unpack_sources

__all__ = [
    "Venv",
    "child_env",
    "discover_venvs",
    "unpacked_wheels",
    "venv_vllm_version",
    "version_key",
]


@dataclass(frozen=True)
class Venv:
    """One built venv and the vLLM installed in it."""

    version: str
    python: Path
    #: Sources unpacked from a wheel that cannot be installed here
    #: (:mod:`kvfail.audit.wheel`): first on the child's ``PYTHONPATH``, static tier only.
    source: Path | None = None

    @property
    def key(self) -> tuple[int, ...]:
        return version_key(self.version)


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version))


def venv_vllm_version(venv: Path) -> str | None:
    """The vLLM version installed in ``venv``, from its dist-info (no import)."""
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for entry in site.iterdir():
            version = dist_version(entry.name)
            if version:
                return version
    return None


def discover_venvs(root: Path, wanted: Sequence[str] = ()) -> list[Venv]:
    """``.venv`` and every ``.venv-*`` under ``root`` with a vLLM, oldest version first;
    ``wanted`` keeps only those versions (an unknown one is an error naming what exists)."""
    found: dict[str, Venv] = {}
    for path in sorted(root.glob(".venv*")):
        python = path / "bin" / "python"
        if not python.exists():
            continue
        version = venv_vllm_version(path)
        if version is None:
            continue
        # The default .venv wins a tie with a .venv-VERSION of the same release.
        if version not in found or path.name == ".venv":
            found[version] = Venv(version, python)
    if wanted:
        missing = [v for v in wanted if v not in found]
        if missing:
            have = ", ".join(sorted(found, key=version_key)) or "none"
            raise SystemExit(
                f"kvfail matrix: no venv with vLLM {', '.join(missing)} under {root} "
                f"(built: {have}); build one with scripts/setup.sh --vllm VERSION"
            )
        found = {v: found[v] for v in wanted}
    return sorted(found.values(), key=lambda v: v.key)


def child_env(venv: Venv, cwd: Path | None) -> dict[str, str]:
    """The audit child's environment: this one, without an activated venv; a wheel's
    sources first on ``PYTHONPATH``, then the checkout (so kvfail is this one)."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    if venv.source is not None:
        paths = [str(venv.source), str(cwd or Path.cwd()), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def unpacked_wheels(wheels: Sequence[Path], into: Path) -> list[Venv]:
    """Each wheel's sources, as a row the static tier reads with this Python."""
    rows = []
    for i, wheel in enumerate(wheels):
        try:
            version = unpack_sources(wheel, into / str(i))
        except ValueError as exc:
            raise SystemExit(f"kvfail matrix: --wheel {exc}") from None
        rows.append(Venv(version, Path(sys.executable), source=into / str(i)))
    return rows
