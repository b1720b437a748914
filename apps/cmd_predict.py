"""`leaflens predict`: classify image files and folders with an exported ONNX model.

Files named on the command line are classified whatever their extension; folders are searched
recursively for image files (leaflens.data_prep.scan.IMAGE_EXTENSIONS, hidden entries skipped). Images go
through the model in batches with a progress bar; each gets the Predictor's verdict (leaflens.apps.predictor:
``diagnosis``, ``ambiguous``, ``out_of_domain``; ``refused``: too small, one flat colour, too blurred to
judge, or black and white for a model trained on colour; ``error``: unreadable), and neither a refused nor
an unreadable image stops the run. Exit code: 0 every image was shown to the model, 1 some were refused or
could not be read, 2 usage or model errors (nothing classified).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from leaflens.apps.diagnosis import REFUSAL_REASONS
from leaflens.apps.model_arg import add_model_argument, missing_model
from leaflens.apps.model_card import ModelError
from leaflens.apps.predictor import Prediction, Predictor
from leaflens.apps.providers import add_provider_argument, requested_providers, unmet_request
from leaflens.data_prep.scan import IMAGE_EXTENSIONS, ScanError, walk_folder
from leaflens.files import csv_starting, results_file_problem, write_path_atomic

__all__ = ["add_parser", "collect_images", "csv_header", "csv_row", "run", "skipped_note", "write_csv",
           "write_csv_rows"]


class UsageError(ValueError):
    """A command-line problem (missing path, nothing to classify)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "predict",
        help="classify image files and folders with an exported model",
        description="Classify photos (files, or folders searched recursively) with an exported leaflens "
                    "ONNX model. Each image gets a verdict: diagnosis, ambiguous (between the top two "
                    "classes), out_of_domain (unlike the model's training photos; models exported with the "
                    "check), refused (too small, one flat colour, too blurred, or black and white for a model "
                    "trained on colour) or error (unreadable). Prints "
                    "one line per image, or writes --csv with the verdict, the top-k classes (none for an "
                    "out-of-domain photo), the out-of-domain score and an error column. Exit code 0: every "
                    "image was judged by the model; 1: some were refused or could not be read; 2: usage or "
                    "model error.",
    )
    p.add_argument("images", nargs="+", metavar="IMAGES", help="image files and/or folders")
    add_model_argument(p)
    p.add_argument("--csv", default=None, help="write the results to this CSV file (written atomically); "
                                                "- writes the CSV to standard output")
    p.add_argument("--top-k", type=int, default=3, help="classes to report per image (default 3)")
    p.add_argument("--batch-size", type=int, default=32, help="images per model call (default 32)")
    p.add_argument("--threads", type=int, default=None,
                   help="onnxruntime intra-op threads (default: the CPUs this process may use)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_provider_argument(p)
    p.set_defaults(func=run)
    return p


# the key of :func:`collect_images`'s ``skipped`` counting names of a photo already listed (no extension has it)
SAME_PHOTO = "\0same photo"
HIDDEN = "\0hidden"  # files and folders whose name starts with "." (.thumbnails/, macOS's ._ copies)


def collect_images(args: Sequence[str | os.PathLike], skipped: Counter[str] | None = None) -> list[str]:
    """Expand files and folders into a de-duplicated list of image paths, in a stable order. Files in the
    folders whose extension is not an image's are left out and, with ``skipped``, counted by extension
    (lower case; "" for none), so that the summary can say what was not looked at; so are further names of a
    photo already listed (a link to it in the same folder), under :data:`SAME_PHOTO`.

    Raises :class:`UsageError` naming a path that does not exist or a folder that cannot be read.
    """
    try:
        return _collect(args, skipped)
    except ScanError as exc:
        raise UsageError(shown(str(exc))) from exc


def shown(text: str) -> str:
    """``text`` as it can be printed and written to a UTF-8 file: a file name in another encoding keeps its
    bytes as ``\\udcXX`` escapes instead of failing the output after every photo was classified."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# control characters in a file name would split a line of the tab-separated output: written as escapes
_CONTROL = {c: f"\\x{c:02x}" for c in range(32)} | {9: "\\t", 10: "\\n", 13: "\\r", 127: "\\x7f"}


def shown_on_a_line(text: str) -> str:
    """:func:`shown`, with tabs, newlines and other control characters escaped (one photo, one line)."""
    return shown(text).translate(_CONTROL)


def csv_text(text: str | None) -> str | None:
    """A text cell as a spreadsheet cannot run it: one starting with = + - @ (or a tab or carriage return) is a
    formula to Excel and LibreOffice, so it gets a leading apostrophe (file and class names come from users,
    and the web page's uploads from anyone)."""
    if text and text[0] in "=+-@\t\r":
        return "'" + text
    return text


def _collect(args: Sequence[str | os.PathLike], skipped: Counter[str] | None) -> list[str]:
    found: list[str] = []
    passed_over: dict[str, str] = {}  # real path -> extension of each file the folders' walk skipped
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            for dirpath, dirnames, filenames in walk_folder(path):
                hidden = sum(d.startswith(".") for d in dirnames) + sum(f.startswith(".") for f in filenames)
                if skipped is not None and hidden:
                    skipped[HIDDEN] += hidden
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    if name.startswith("."):
                        continue
                    ext = os.path.splitext(name)[1].lower()
                    if ext in IMAGE_EXTENSIONS:
                        found.append(os.path.join(dirpath, name))
                    else:
                        passed_over[os.path.realpath(os.path.join(dirpath, name))] = ext
        elif path.exists() or path.is_symlink():  # a link to nothing (or a loop) gets its error row, as in a folder:
            found.append(os.fspath(path))     # `predict photos/*.jpg` must not lose the batch to one stale link
        else:
            raise UsageError(f"{shown(os.fspath(path))}: no such file or folder")
    seen: set[str] = set()
    unique = []
    for name in found:
        key = os.path.realpath(name)
        if key not in seen:
            seen.add(key)
            unique.append(name)
        elif skipped is not None:  # a link to a photo already listed, or a file named twice: answered once
            skipped[SAME_PHOTO] += 1
    if skipped is not None:  # a file the walk passed over but that was also named is not skipped
        skipped.update(ext for real, ext in passed_over.items() if real not in seen)
    return unique


_KINDS_SHOWN = 8  # extensions named in skipped_note, the most common first


def skipped_note(skipped: Counter[str]) -> str:
    """What :func:`collect_images` left out of the folders, e.g. "3 other files in the folders skipped, not
    images by their extension (.gif 2, .txt 1); name a file to classify it anyway"."""
    others = {ext: k for ext, k in skipped.items() if ext not in (SAME_PHOTO, HIDDEN) and k}
    n = sum(others.values())
    ranked = sorted(others.items(), key=lambda e: (-e[1], e[0]))
    kinds = ", ".join(f"{ext or 'no extension'} {k}" for ext, k in ranked[:_KINDS_SHOWN])
    if len(ranked) > _KINDS_SHOWN:  # a folder linking to /usr has hundreds of kinds: the line stays readable
        more = len(ranked) - _KINDS_SHOWN
        kinds += f" and {more} other extension{'s' if more != 1 else ''}"
    said = []
    if others:
        said.append(f"{n} other file{'s' if n != 1 else ''} in the folders skipped, not images by their extension "
                    f"({kinds}); name a file to classify it anyway")
    if skipped.get(HIDDEN):
        k = skipped[HIDDEN]
        said.append(f"{k} hidden file{'s' if k != 1 else ''} or folder{'s' if k != 1 else ''} skipped (names "
                    "starting with '.', such as .thumbnails/ or macOS's ._ copies)")
    if skipped.get(SAME_PHOTO):
        k = skipped[SAME_PHOTO]
        said.append(f"{k} name{'s' if k != 1 else ''} of a photo already listed (a link to it, or the same file "
                    "given twice) answered once")
    return "; ".join(said)


def verdict_of(p: Prediction) -> str:
    """The verdict shown for ``p``: a photo the decoder turned away as too small is ``refused`` like the
    ones the quality checks turn away (the decoder raises a plain ImageDecodeError for it)."""
    return "refused" if not p.ok and p.reason in REFUSAL_REASONS else p.verdict


def csv_header(top_k: int) -> list[str]:
    """The CSV columns: path, verdict, label, probability, uncertain, ood_score, class_i/prob_i (i = 1..top_k),
    error. The web page's results download (leaflens.apps.history) writes the same."""
    header = ["path", "verdict", "label", "probability", "uncertain", "ood_score"]
    for i in range(1, top_k + 1):
        header += [f"class_{i}", f"prob_{i}"]
    header.append("error")
    return header


def csv_row(p: Prediction, top_k: int) -> list[str | None]:
    """One image's row under :func:`csv_header` (None is written as an empty cell)."""
    row: list[str | None]
    if p.ok:
        named = p.verdict != "out_of_domain"  # no class is named for a photo unlike the training photos
        claimed = p.verdict == "diagnosis"  # an ambiguous photo's two classes are in class_1/class_2, neither claimed
        row = [csv_text(shown(p.source)), p.verdict, csv_text(p.label) if claimed else "",
               "" if p.confidence is None or not claimed else f"{p.confidence:.6f}",
               str(p.uncertain).lower(), "" if p.ood_score is None else f"{p.ood_score:.6g}"]
        ranked = [v for cls, prob in p.top[:top_k] for v in (csv_text(cls), f"{prob:.6f}")] if named else []
        return row + ranked + [""] * (2 * top_k - len(ranked)) + [""]
    return [csv_text(shown(p.source)), verdict_of(p), "", "", "", "", *[""] * (2 * top_k),
            csv_text(None if p.error is None else shown(p.error))]


def write_csv(path: str | os.PathLike, predictions: Iterable[Prediction], top_k: int,
              leading: tuple[list[str], list[list[str]]] | None = None) -> None:
    """Write one row per image: path, verdict, label, probability, uncertain, ood_score, class_i/prob_i, error.

    ``label`` and ``probability`` are the diagnosis: empty for an ambiguous photo (``uncertain`` "true"), whose
    likeliest classes are ``class_1`` and ``class_2`` (``top_k`` 2 or more) with neither claimed, as the web
    page says; ``class_i`` / ``prob_i`` are the model's ranking. An out-of-domain photo's row names no class,
    as the web page and its API do: only its verdict, ``uncertain`` and ``ood_score``. ``ood_score`` is empty
    for a model without the out-of-domain output. Refused and unreadable photos have only path, verdict and
    error.
    ``leading``: (names, one list of values per prediction) of columns written first (the web page's download
    says which diagnosis each row belongs to). Written to a temporary file beside ``path`` and renamed into
    place, so a reader never sees a half-written file.
    """
    target = Path(path)

    def write(tmp: Path) -> None:
        with open(tmp, "x", newline="", encoding="utf-8") as fh:
            write_csv_rows(csv.writer(fh), predictions, top_k, leading)

    write_path_atomic(target, write)


def write_csv_rows(writer: Any, predictions: Iterable[Prediction], top_k: int,
                   leading: tuple[list[str], list[list[str]]] | None = None) -> None:
    """The header and one row per prediction of :func:`write_csv`, through a ``csv.writer`` (a file's, or
    standard output's for ``--csv -``)."""
    names, values = leading if leading is not None else ([], None)
    writer.writerow([*names, *csv_header(top_k)])
    for i, p in enumerate(predictions):
        writer.writerow([*(values[i] if values is not None else []), *csv_row(p, top_k)])


def _line(p: Prediction, top_k: int) -> str:
    """``path <tab> verdict <tab> answer <tab> ranking``: the answer is the class for a diagnosis, "X or Y"
    for an ambiguous photo, "-" out of domain (no ranking: only its score, as in the CSV), the reason for a
    refused or unreadable one."""
    verdict = verdict_of(p)
    if not p.ok:
        return f"{shown_on_a_line(p.source)}\t{verdict}\t{p.reason}\t{shown_on_a_line(str(p.error))}"
    if verdict == "ambiguous":
        answer = " or ".join(cls for cls, _ in p.top[:2])
    elif verdict == "out_of_domain":
        answer = "-"
    else:
        answer = str(p.label)
    ranked = ", ".join(f"{cls} {prob:.3f}" for cls, prob in p.top[:top_k]) if verdict != "out_of_domain" else ""
    if p.ood_score is not None:
        ranked += f"{'; ' if ranked else ''}ood_score {p.ood_score:.3g}"
    return f"{shown_on_a_line(p.source)}\t{verdict}\t{shown_on_a_line(answer)}\t{shown_on_a_line(ranked)}"


def run(args: argparse.Namespace) -> int:
    prog = "leaflens predict"
    try:
        if args.top_k < 1:
            raise UsageError(f"--top-k must be >= 1, got {args.top_k}")
        if args.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.threads is not None and args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        to_stdout = args.csv == "-"
        if args.csv and not to_stdout and (problem := results_file_problem(
                args.csv, {"the model": args.model}, "results.csv", ours=csv_starting(csv_header(0)[:2]))):
            raise UsageError(f"--csv {problem}")
        skipped: Counter[str] = Counter()
        files = collect_images(args.images, skipped)
        if not files:
            raise UsageError(f"no image files found in {', '.join(map(str, args.images))}"
                             + (f" ({skipped_note(skipped)})" if skipped else ""))
        if args.csv and not to_stdout and os.path.realpath(args.csv) in {os.path.realpath(f) for f in files}:
            raise UsageError(f"--csv {args.csv} is one of the photos to classify; writing the results there "
                             "would replace it (give a .csv path)")
        if (missing := missing_model(args.model)) is not None:
            raise UsageError(missing)
        choice = getattr(args, "provider", "auto")
        predictor = Predictor(args.model, intra_op_threads=args.threads, providers=requested_providers(choice))
        if (unmet := unmet_request(choice, predictor.provider, predictor.provider_line)) is not None:
            raise UsageError(unmet)
    except (UsageError, ModelError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(predictor.provider_line, file=sys.stderr)

    from tqdm import tqdm

    top_k = min(args.top_k, len(predictor.classes))
    ranked_k = min(max(top_k, 2), len(predictor.classes))  # an ambiguous answer names two classes
    results: list[Prediction] = []
    with tqdm(total=len(files), unit="img", desc="predict", file=sys.stderr,
              disable=True if args.no_progress else None) as bar:
        for prediction in predictor.iter_predict_files(files, top_k=ranked_k, batch_size=args.batch_size):
            results.append(prediction)
            if not args.csv:
                bar.write(_line(prediction, top_k), file=sys.stdout)
            bar.update(1)
    if to_stdout:
        write_csv_rows(csv.writer(sys.stdout, lineterminator="\n"), results, top_k)
        sys.stdout.flush()
    elif args.csv:
        try:
            write_csv(args.csv, results, top_k)
        except OSError as exc:  # checked before the work; a disk filled meanwhile still gets one line
            print(f"{prog}: error: cannot write {args.csv}: {exc.strerror or exc}; the results, as lines:",
                  file=sys.stderr)
            for p in results:
                print(_line(p, top_k))
            return 1

    counts = Counter(verdict_of(p) for p in results)
    failed = counts["refused"] + counts["error"]
    images = f"{len(results)} image{'s' if len(results) != 1 else ''}"
    summary = (f"{images} with {predictor.model_path.name} on {predictor.provider}: "
               + ", ".join(f"{counts[v]} {v.replace('_', ' ') if v != 'error' else 'unreadable'}" for v in
                           ("diagnosis", "ambiguous", "out_of_domain", "refused", "error")))
    if not predictor.has_ood:
        summary += " (this model has no out-of-domain check)"
    if skipped:
        summary += f"; {skipped_note(skipped)}"
    if args.csv and not to_stdout:
        summary += f"; results in {args.csv}"
    print(summary, file=sys.stderr)
    return 1 if failed else 0
