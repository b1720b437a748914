"""The web page's settings besides the model service (kept apart from leaflens.apps.web so that building
them, and checking the command line, never imports Gradio)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from leaflens.apps.corrections import CorrectionStore
from leaflens.apps.i18n import DEFAULT_LANG
from leaflens.apps.model_info import ServeContext

__all__ = ["AppConfig"]


@dataclass
class AppConfig:
    """Everything the page shows besides the service's answers, and Gradio's queue limits.

    ``concurrency``: diagnose requests running at once (each decodes its photos, then waits on the
    shared batcher); ``queue_size``: requests waiting beyond those before Gradio answers "busy".
    ``corrections``: where "Wrong? The right answer is ..." saves photos (None: no such control, no
    ``/correct`` endpoint); ``results_root``: where the session CSV downloads are written (None:
    leaflens.apps.history.default_results_root()).
    """

    context: ServeContext = field(default_factory=ServeContext)
    examples: list[Path] = field(default_factory=list)
    lang: str = DEFAULT_LANG
    concurrency: int = 4
    queue_size: int = 64
    corrections: CorrectionStore | None = None
    results_root: Path | None = None
