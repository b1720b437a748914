"""The pip command that installs an extra of leaflens where this leaflens came from.

leaflens is installed from a clone of its repository, not from a package index, so ``pip install
'leaflens[teacher]'`` fails for most people who are told to run it. The command names the clone instead:
``pip install -e '/home/me/leaflens[teacher]'`` for a source checkout or an editable install (the clone is
where the package's folder is), ``pip install '/home/me/leaflens[teacher]'`` for an install from a local
folder that pip recorded, and the package name only when neither is known.
"""

from __future__ import annotations

import functools
import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse


def install_command(extras: str) -> str:
    """``pip install ...`` for the comma-separated ``extras`` (e.g. ``"serve,teacher"``)."""
    editable, root = _origin()
    if root is None:
        return f"pip install 'leaflens[{extras}]'"
    return f"pip install {'-e ' if editable else ''}'{root}[{extras}]'"


@functools.cache
def _origin() -> tuple[bool, str | None]:
    """(editable, the folder leaflens was installed from), or (False, None) when it is not known."""
    here = Path(__file__).resolve().parents[1]
    if (here / "pyproject.toml").is_file() and (here / "leaflens" / "__init__.py").is_file():
        return True, str(here)  # the package's folder sits in its clone: a checkout or an editable install
    try:
        for dist in metadata.distributions(name="leaflens"):
            text = dist.read_text("direct_url.json")
            if not text:
                continue
            found = json.loads(text)
            url = urlparse(str(found.get("url", "")))
            if url.scheme == "file":
                return bool((found.get("dir_info") or {}).get("editable")), unquote(url.path)
    except (OSError, ValueError):
        pass
    return False, None
