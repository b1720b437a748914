"""The page's privacy note: what is kept of a person's photos, where, and for how long.

Written from the server's actual settings, never from fixed text: the upload folder and its retention
(:class:`leaflens.apps.uploads.UploadFolder`; without one, which only tests and hand-built apps have, the note
says the photos stay in the temporary folder) and the corrections folder, where a photo is kept only when the
person corrects its answer. Every string comes from leaflens.apps.i18n.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from leaflens.apps.i18n import t
from leaflens.apps.uploads import UploadFolder

__all__ = ["privacy_markdown"]


def privacy_markdown(uploads: UploadFolder | None, corrections: str | os.PathLike | None, lang: str) -> str:
    """The note in ``lang``: where uploads are kept and when they are deleted; whether corrections keep photos
    (``corrections``: their folder, None when the page offers none)."""
    if uploads is None:
        kept = t("privacy_unmanaged", lang)
    else:
        pol = uploads.policy
        if pol.keep_s > pol.grace_s:
            when = t("privacy_when_keep", lang, minutes=f"{pol.keep_s / 60:g}")
        else:
            when = t("privacy_when_grace", lang, seconds=f"{math.ceil(pol.grace_s + pol.sweep_every_s):d}")
        kept = t("privacy_kept", lang, folder=str(uploads.root), when=when,
                 unanswered=f"{max(pol.unanswered_s, pol.keep_s) / 60:g}")
    if corrections is not None:
        extra = t("privacy_corrections", lang, folder=str(Path(corrections)))
    else:
        extra = t("privacy_no_corrections", lang)
    return t("privacy", lang, kept=kept, corrections=extra)
