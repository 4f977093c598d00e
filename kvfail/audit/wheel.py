"""A vLLM wheel's sources for the static tier, unpacked, never installed or imported.

Why: a release can ship for an accelerator this machine lacks (vLLM 0.33.0 is published
for CUDA only), so no venv can hold it, yet its connectors are plain Python the static
tier reads with :mod:`ast`. Only the wheel's ``.py`` files and its ``.dist-info`` are
unpacked; :mod:`kvfail.audit.venvs` puts the folder first on the audit child's
``PYTHONPATH``, where :func:`kvfail.audit.source.find_module_file` finds them (it locates
files without running any package), and the report reads the version from the
dist-info. Nothing from the wheel is executed, and its compiled parts stay in the zip.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path, PurePosixPath

__all__ = ["dist_version", "unpack_sources"]

_DIST = re.compile(r"^vllm(?:[-_]cpu)?-(?P<version>[0-9][^-]*)\.dist-info$")


def dist_version(name: str) -> str | None:
    """The vLLM version a ``*.dist-info`` folder name gives (None for another package):
    a venv's installed vLLM and a wheel's are named the same way."""
    match = _DIST.match(name)
    return match.group("version") if match else None


def _wanted(name: str) -> bool:
    """A Python source or a dist-info file, at a safe relative path."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        return False
    return name.endswith(".py") or (len(path.parts) > 1 and path.parts[0].endswith(".dist-info"))


def unpack_sources(wheel: Path, dest: Path) -> str:
    """Unpack ``wheel``'s Python sources and dist-info into ``dest``; return the vLLM
    version its dist-info names. Raises ``ValueError`` for a file that is no vLLM wheel."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{wheel}: not a readable wheel ({exc})") from None
    with archive:
        names = [n for n in archive.namelist() if _wanted(n)]
        versions = {dist_version(PurePosixPath(n).parts[0]) for n in names} - {None}
        if len(versions) != 1:
            raise ValueError(f"{wheel}: no vLLM dist-info in it (found {sorted(versions)})")
        dest.mkdir(parents=True, exist_ok=True)
        archive.extractall(dest, members=names)
    (version,) = versions
    assert version is not None
    return version
