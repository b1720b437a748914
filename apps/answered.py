"""What this server answered, photo by photo: the record a correction is checked against.

A correction (``/correct``) arrives with files and the answer the client says ``/diagnose`` gave for them.
Both come from the client: a script can send another photo under the same name, or an answer edited to
call a refused photo "diagnosed", and the corrections folder would then take a photo the model never saw
under a prediction it never made. So the service records, for every photo it answers, the SHA-256 of the
file's bytes with its own per-photo verdict, and a correction saves a photo only when its bytes are ones
this server answered, logging what the server said rather than what the client claims.

Bounded (the last ``capacity`` photos; the oldest are forgotten first), thread-safe, in memory only: after
a restart a photo is diagnosed again before it can be corrected (its upload was deleted anyway).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_CAPACITY", "AnsweredPhotos"]

DEFAULT_CAPACITY = 4096  # photos remembered: a few hundred bytes each
_PHOTO_KEYS = ("ok", "verdict", "label", "confidence", "candidates")


class AnsweredPhotos:
    """SHA-256 of a photo's bytes -> what the server answered for it (its entry and the request's answer)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def record(self, digests: Sequence[str | None], result: Mapping[str, Any]) -> None:
        """Remember the photos of one answer (``result`` of :func:`leaflens.apps.diagnosis.summarise`);
        ``digests[i]`` is photo ``i``'s ``sha256:<hex>`` (None: its bytes could not be read)."""
        answer = result.get("answer") or {}
        said = {"verdict": answer.get("verdict", result.get("verdict")), "label": answer.get("label")}
        with self._lock:
            for digest, photo in zip(digests, result.get("photos") or []):
                if digest is None:
                    continue
                entry = {k: photo.get(k) for k in _PHOTO_KEYS}
                entry["candidates"] = list(entry["candidates"] or [])
                self._seen[digest] = {"photo": entry, "answer": dict(said)}
                self._seen.move_to_end(digest)
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)

    def lookup(self, digest: str) -> dict[str, Any] | None:
        """``{"photo": {ok, verdict, label, confidence, candidates}, "answer": {verdict, label}}`` of the
        latest answer for these bytes, or None when this server has not answered them (or forgot)."""
        with self._lock:
            found = self._seen.get(digest)
            return None if found is None else {"photo": dict(found["photo"]), "answer": dict(found["answer"])}

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
