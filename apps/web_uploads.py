"""One fix to Gradio's upload components, applied to a built app: no empty temporary file per photo.

Gradio 6.31's ``gr.File`` and ``gr.UploadButton`` (``type="filepath"``) open a ``NamedTemporaryFile`` in the
upload folder for every file they hand to an event and never use it: one empty ``tmpXXXXXXXX`` file per
photo, 1,590 of them after a minute of the load benchmark, which nothing deleted. :func:`no_empty_temp_files`
replaces that step on the app's own components with what it returns anyway (the uploaded file's path); a
file of a type the component does not accept still goes to Gradio's own step, which refuses it. The upload
folder's sweep (leaflens.apps.uploads) deletes such files too, a minute after they were made: this keeps
them from being made at all.
"""

from __future__ import annotations

import inspect
from typing import Any

import gradio as gr
import gradio_client.utils as client_utils
from gradio.utils import NamedString

__all__ = ["no_empty_temp_files"]


def _direct(component: Any) -> None:
    original = component._process_single_file

    def process_single_file(f: Any) -> Any:
        if component.type != "filepath" or (component.file_types
                                            and not client_utils.is_valid_file(f.path, component.file_types)):
            return original(f)  # bytes, or Gradio's own "invalid file type" error
        return NamedString(f.path)

    component._process_single_file = process_single_file


def _leaves_temp_file(cls: type) -> bool:
    """Whether this Gradio's step opens the unused temporary file (a version that fixed it is left alone)."""
    try:
        return "NamedTemporaryFile" in inspect.getsource(cls._process_single_file)  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return False


def no_empty_temp_files(demo: gr.Blocks) -> int:
    """Apply the fix to every File and UploadButton of ``demo``; returns how many were changed."""
    changed = 0
    for block in demo.blocks.values():
        if isinstance(block, (gr.File, gr.UploadButton)) and _leaves_temp_file(type(block)):
            _direct(block)
            changed += 1
    return changed
