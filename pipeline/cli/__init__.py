"""The `leaflens` command line: one subcommand per stage.

Each subcommand lives in its own module, which exposes ``add_parser(subparsers)`` returning the
parser it added, and sets ``func`` (taking the parsed namespace, returning an exit code) on it.
Modules are imported only when their subcommand is named, so ``leaflens --help`` stays fast and a
stage's optional dependencies (onnxruntime, gradio) are needed only by that stage.

Exit codes of the stages (data, preprocess, teacher, distill, export): ``EXIT_OK``; ``EXIT_REFUSED`` when the
input was refused or the job failed (a dataset, teacher, run or file that cannot be used, with the reason);
``EXIT_USAGE`` for options or configuration that cannot be run (argparse's own code for a bad flag);
``EXIT_STOPPED`` when training stopped on repeated numerical faults (resumable); 130 on Ctrl-C. The
commands that classify photos (predict, evaluate, serve) use 2 for anything that stops them starting and 1
when some photos could not be read. Every command exits quietly with ``EXIT_BROKEN_PIPE`` (141) when the
reader of its output goes away (``| head``).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from pathlib import Path

from leaflens.extras import install_command
from leaflens.pipeline.cli.runtime import configure_process, ignore_late_signals, stop_on_sigterm

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader closed the pipe


def path_arg(text: str) -> Path:
    """``type=`` for a path option: an empty one (an unset shell variable) is a usage error, not the current
    folder that ``Path("")`` would make of it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or folder")
    return Path(text)


class Once(argparse.Action):
    """``action=`` for an option that may be given once (``--config``): a second one is a usage error, where
    argparse would keep the last and drop the first without a word."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice: one file is read, the other would be ignored; put the "
                         "settings in one file, or give single settings with --set key=value")
        setattr(namespace, self.dest, values)


def path_text_arg(text: str) -> str:
    """:func:`path_arg` for options read as text."""
    path_arg(text)
    return text

# Optional dependencies a command may need, and the extra of pyproject.toml that installs each on the CPU (on
# an NVIDIA machine the GPU extra that `leaflens doctor` names brings them too).
OPTIONAL_MODULES = {"onnx": "serve", "onnxruntime": "serve", "gradio": "serve", "gradio_client": "serve"}


def missing_optional(exc: ModuleNotFoundError, command: str) -> str | None:
    """What to say when ``command`` stopped on an optional dependency that is not installed; None for any
    other missing module (a broken install, which the traceback shows best)."""
    top = (exc.name or "").split(".")[0]
    extra = OPTIONAL_MODULES.get(top)
    if extra is None:
        return None
    return (f"leaflens {command}: needs {top}, which is not installed: {install_command(extra)} (on an NVIDIA "
            "machine, the GPU extra that `leaflens doctor` names instead)")

# subcommand -> (module, one-line help). Keep alphabetical within each group.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "data": ("leaflens.pipeline.cli.data", "built-in datasets (synthetic leaves)"),
    "preprocess": ("leaflens.pipeline.cli.preprocess", "photos in class folders -> memory-mapped arrays + manifest"),
    "teacher": ("leaflens.pipeline.cli.teacher", "fine-tuned teacher (default): features and logits for every image"),
    "distill": ("leaflens.pipeline.cli.distill",
                "students (distilled, from scratch); keep the best model within budget"),
    "export": ("leaflens.pipeline.cli.export",
               "kept model -> ONNX (FP32, FP16, INT8 within 1 point) + Triton repository"),
    "evaluate": ("leaflens.pipeline.cli.evaluate", "accuracy of an exported model on photo files in class folders"),
    "predict": ("leaflens.apps.cmd_predict", "classify image files and folders with an exported model"),
    "serve": ("leaflens.apps.cmd_serve", "start the local web app"),
    "doctor": ("leaflens.pipeline.cli.doctor", "report Python, NumPy, CuPy, GPU and BLAS facts"),
}
# Subcommands whose interrupted runs `--resume` continues (the interruption message says so).
RESUMABLE_COMMANDS = frozenset({"teacher", "distill"})
# Subcommands that SIGTERM stops as Ctrl-C does (exit 130, temporary folders removed, resumable ones resumable).
STAGE_COMMANDS = frozenset({"data", "preprocess", "teacher", "distill", "export"})
# Subcommands that run the training engine (the others serve with onnxruntime or only write files).
ENGINE_COMMANDS = frozenset({"teacher", "distill", "export", "doctor"})


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leaflens",
        description="Leaf disease and crop pest recognition: preprocess, teacher, distill, export, serve.",
    )
    from leaflens import __version__

    parser.add_argument("--version", action="version", version=f"leaflens {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # stage not built in this checkout
                sub.add_parser(name, help=help_text, add_help=False)
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    whole_process = argv is None  # the `leaflens` command itself, not a caller in Python
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        code = _run(argv, command)
        if whole_process:  # what is still buffered is written here, where a closed pipe is caught, not at exit
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:  # None: started with that stream closed (`>&-`)
                    stream.flush()
        return code
    except KeyboardInterrupt:  # Ctrl-C before the command began (while its modules were imported): nothing to undo
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`leaflens predict ... | head`): stop quietly
        if whole_process:  # as a command killed by SIGPIPE; no second error when Python flushes at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    os.dup2(devnull, stream.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        said = _disk_problem(exc, command)
        if said is None:
            raise
        print(said, file=sys.stderr)
        return EXIT_REFUSED
    finally:
        if whole_process:  # it only exits from here on
            ignore_late_signals()


def interrupted(checkpoints: Path | None, whose: str) -> int:
    """Say that a training command was interrupted, and whether ``--resume`` has an epoch to go on from (a
    ``last.npz`` under ``checkpoints``, None: nothing resumable); the exit code, 130."""
    if checkpoints is not None and any(checkpoints.rglob("last.npz")):
        print(f"interrupted: {whose} checkpoints are kept in {checkpoints}; the same command with --resume (with "
              "make: RESUME=1) goes on from the last finished epoch", file=sys.stderr)
    else:
        print("interrupted before a training epoch ended: nothing to resume; the same command starts over",
              file=sys.stderr)
    return 130


def _disk_problem(exc: OSError, command: str | None) -> str | None:
    """One line for an output the command could not write (a full disk, a read-only or someone else's folder, a
    file where a folder should be), instead of a traceback; None for any other error."""
    if command not in STAGE_COMMANDS:
        return None
    where = exc.filename if exc.filename is not None else "its output"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"leaflens {command}: no space left on the disk of {where}: free some space and run it again (what "
                "was there before is unchanged" + ("; with --resume a training goes on from its last finished epoch, "
                                                   "if one finished)" if command in RESUMABLE_COMMANDS else ")"))
    if exc.errno == errno.EROFS:
        return f"leaflens {command}: {where} is on a read-only disk: give an --out you can write in"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"leaflens {command}: {where}: {exc.strerror}: check that you may read and write it, or give an --out "
                "you can write in")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST) and exc.filename is not None and _file_in_the_way(exc.filename):
        return (f"leaflens {command}: {where}: {exc.strerror} (a file is where a folder should be): give another "
                "--out")
    return None


def _file_in_the_way(path: object) -> bool:
    """Whether ``path`` or a folder above it is a file (what makes ENOTDIR and EEXIST an output's problem)."""
    p = Path(str(path))
    return any(q.is_file() for q in (p, *p.parents))


def _run(argv: list[str], command: str | None) -> int:
    from leaflens.cpus import threads_override  # noqa: PLC0415

    asks_help = command is None or any(a in ("-h", "--help", "--version") for a in argv)
    try:  # a bad LEAFLENS_THREADS is a usage error, said once here, not a traceback from the first op to ask
        if not asks_help:  # help and the version need no threads
            threads_override()
    except ValueError as exc:
        print(f"leaflens{' ' + command if command else ''}: {exc}; unset it or give a whole number of threads, "
              "e.g. LEAFLENS_THREADS=2", file=sys.stderr)
        return EXIT_USAGE
    configure_process(engine=command in ENGINE_COMMANDS)
    parser = build_parser(only=command if command in SUBCOMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    if extra:  # said with the subcommand's own usage line, not the top-level one
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        owner = subparsers.choices.get(args.command, parser) if args.command else parser
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help(sys.stderr)  # a usage error (exit 2): on stderr, as argparse says its errors
        return 2
    func = getattr(args, "func", None)
    if func is None:
        parser.error(f"subcommand {args.command!r} is not available in this build")
    resumable = args.command in RESUMABLE_COMMANDS
    if args.command in STAGE_COMMANDS:  # their temporary folders are removed on the way out, as on Ctrl-C
        stop_on_sigterm()
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted" + ("; run the same command with --resume (with make: RESUME=1) to go on from the last "
                               "finished epoch"
                               if resumable else ""), file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        said = missing_optional(exc, args.command)
        if said is None:
            raise
        print(said, file=sys.stderr)
        return EXIT_USAGE

