"""A Triton Inference Server model repository entry for an exported ONNX model.

Layout (Triton's): ``<repo>/<name>/config.pbtxt``, ``<repo>/<name>/1/model.onnx`` and
``<repo>/<name>/labels.txt`` (class names, one per line, for Triton's classification extension).
The config names the ONNX Runtime platform, the input/output names, element types and dims
(without the batch dimension, which Triton adds up to ``max_batch_size``), and turns on dynamic
batching with a bounded queue delay.

:func:`parse_pbtxt` reads the protobuf text format subset these configs use, and
:func:`check_config` compares a parsed config with the ONNX graph it serves, so a repository is
validated without Triton itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto

ONNX_TO_TRITON: dict[int, str] = {  # ONNX element type (TensorProto.DataType) -> Triton type
    TensorProto.FLOAT: "TYPE_FP32", TensorProto.FLOAT16: "TYPE_FP16", TensorProto.DOUBLE: "TYPE_FP64",
    TensorProto.INT64: "TYPE_INT64", TensorProto.INT32: "TYPE_INT32", TensorProto.INT8: "TYPE_INT8",
    TensorProto.UINT8: "TYPE_UINT8", TensorProto.BOOL: "TYPE_BOOL",
}
PLATFORM = "onnxruntime_onnx"
LABELS = "labels.txt"


class TritonConfigError(ValueError):
    """A config.pbtxt that cannot be parsed or does not match its model."""


def _io(value: onnx.ValueInfoProto, what: str) -> tuple[str, str, list[int], bool]:
    """(name, Triton type, dims without batch, batch is symbolic) of a graph input/output."""
    t = value.type.tensor_type
    if t.elem_type not in ONNX_TO_TRITON:
        raise TritonConfigError(f"{what} {value.name!r} has ONNX element type {t.elem_type}, unknown to "
                                "Triton")
    dims = list(t.shape.dim)
    if not dims:
        raise TritonConfigError(f"{what} {value.name!r} has no shape")
    rest = [d.dim_value if d.HasField("dim_value") else -1 for d in dims[1:]]
    return value.name, ONNX_TO_TRITON[t.elem_type], rest, not dims[0].HasField("dim_value")


def check_model_name(name: str) -> None:
    """Refuse a model name that is not a plain folder name: it becomes ``<repo>/<name>``, so "..", "." or a
    hidden name would write outside (or beside) the repository."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise TritonConfigError(f"Triton model name {name!r} must be letters, digits, '_', '.', '-', starting "
                                "with a letter, digit or '_'")


def config_text(model: onnx.ModelProto, name: str, max_batch_size: int = 64, queue_delay_us: int = 2000,
                labels: bool = True, comment: str = "", parameters: bool = True) -> str:
    """config.pbtxt for serving ``model`` (one input, its outputs, symbolic batch) under ``name``; the class
    labels go with the first output (the logits). With ``parameters``, the model file's own ``leaflens.*``
    metadata (its thresholds, input size, resize rule, normalisation...) is repeated as the config's
    ``parameters``: Triton does not show ONNX metadata, but a client reads these from the model's config
    (``GET v2/models/<name>/config``)."""
    check_model_name(name)
    if max_batch_size < 1:
        raise TritonConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if queue_delay_us < 0:
        raise TritonConfigError(f"max_queue_delay_microseconds must be >= 0, got {queue_delay_us}")
    g = model.graph
    if len(g.input) != 1 or not g.output:
        raise TritonConfigError(f"expected one input and at least one output, got {len(g.input)} and "
                                f"{len(g.output)}")
    in_name, in_type, in_dims, in_batch = _io(g.input[0], "input")
    outs = [_io(o, "output") for o in g.output]
    if not (in_batch and all(o[3] for o in outs)):
        raise TritonConfigError("the model's batch dimension is fixed; Triton batching needs it symbolic")

    def dims(d: Sequence[int]) -> str:
        return "[ " + ", ".join(str(v) for v in d) + " ]"

    lines = [f"# {line}".rstrip() for line in comment.splitlines()] if comment else []
    lines += [
        f'name: "{name}"',
        f'platform: "{PLATFORM}"',
        f"max_batch_size: {int(max_batch_size)}",
        "input [",
        "  {",
        f'    name: "{in_name}"',
        f"    data_type: {in_type}",
        f"    dims: {dims(in_dims)}",
        "  }",
        "]",
        "output [",
    ]
    for i, (out_name, out_type, out_dims, _) in enumerate(outs):
        lines += ["  {", f'    name: "{out_name}"', f"    data_type: {out_type}"]
        if out_dims:
            lines.append(f"    dims: {dims(out_dims)}")
        else:  # one value per image (the out-of-domain score): Triton wants dims [1], reshaped away
            lines += ["    dims: [ 1 ]", "    reshape: { shape: [ ] }"]
        if labels and i == 0:
            lines.append(f'    label_filename: "{LABELS}"')
        lines.append("  }," if i + 1 < len(outs) else "  }")
    lines += [
        "]",
        "dynamic_batching {",
        f"  max_queue_delay_microseconds: {int(queue_delay_us)}",
        "}",
    ]
    if parameters:
        for prop in model.metadata_props:
            if prop.key.startswith("leaflens."):
                lines += ["parameters {", f"  key: {_quoted(prop.key)}",
                          f"  value: {{ string_value: {_quoted(prop.value)} }}", "}"]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    """A protobuf text-format string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def config_parameters(config: dict[str, list[Any]]) -> dict[str, str]:
    """The ``parameters`` of a parsed config.pbtxt, as key -> string value."""
    out = {}
    for entry in config.get("parameters", []):
        value = _one(entry, "value", "a parameter")
        out[str(_one(entry, "key", "a parameter"))] = str(_one(value, "string_value", "a parameter's value"))
    return out


def write_model_dir(root: str | os.PathLike[str], model_bytes: bytes, config: str,
                    classes: Sequence[str] | None) -> Path:
    """Fill ``root`` (the ``<repo>/<name>`` folder, which must not exist yet) with version 1."""
    root = Path(root)
    (root / "1").mkdir(parents=True)
    (root / "1" / "model.onnx").write_bytes(model_bytes)
    (root / "config.pbtxt").write_text(config, encoding="utf-8")
    if classes is not None:
        (root / LABELS).write_text("".join(f"{c}\n" for c in classes), encoding="utf-8")
    return root


# ---- reading ----------------------------------------------------------------------------------------
_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|[{}\[\]:,;]|[^\s{}\[\]:,;"#]+')


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise TritonConfigError(f"config.pbtxt: unexpected character {text[pos]!r} at offset {pos}")
        tok = m.group()
        pos = m.end()
        if not tok.isspace() and not tok.startswith("#"):
            out.append(tok)
    return out


def _scalar(tok: str) -> Any:
    if tok.startswith('"'):
        escapes = {"n": "\n", "t": "\t"}
        return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), m.group(1)), tok[1:-1])
    for kind in (int, float):
        try:
            return kind(tok)
        except ValueError:
            pass
    return tok  # an enum name such as TYPE_FP32, or true/false


def parse_pbtxt(text: str) -> dict[str, list[Any]]:
    """Parse protobuf text format into {field: [values...]} (every field a list; messages are dicts).

    Supports what model configs use: ``key: scalar``, ``key { ... }``, ``key [ {..}, {..} ]``,
    ``key: [ 1, 2 ]``, repeated keys, quoted strings and ``#`` comments.
    """
    toks = _tokens(text)
    pos = 0

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def take(expected: str | None = None) -> str:
        nonlocal pos
        if pos >= len(toks):
            raise TritonConfigError(f"config.pbtxt: unexpected end of text (expected {expected or 'more'})")
        tok = toks[pos]
        if expected is not None and tok != expected:
            raise TritonConfigError(f"config.pbtxt: expected {expected!r}, found {tok!r} (token {pos})")
        pos += 1
        return tok

    def value() -> Any:
        if peek() == "{":
            take("{")
            return message("}")
        tok = take()
        if tok in "{}[]:,;":
            raise TritonConfigError(f"config.pbtxt: expected a value, found {tok!r} (token {pos - 1})")
        return _scalar(tok)

    def message(end: str | None) -> dict[str, list[Any]]:
        fields: dict[str, list[Any]] = {}
        while peek() != end:
            key = take()
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise TritonConfigError(f"config.pbtxt: expected a field name, found {key!r} "
                                        f"(token {pos - 1})")
            if peek() == ":":
                take(":")
            items = fields.setdefault(key, [])
            if peek() == "[":
                take("[")
                while peek() != "]":
                    items.append(value())
                    if peek() == ",":
                        take(",")
                take("]")
            else:
                items.append(value())
            if peek() in (",", ";"):
                take()
        if end is not None:
            take(end)
        return fields

    return message(None)


def _one(msg: dict[str, list[Any]], key: str, where: str) -> Any:
    vals = msg.get(key, [])
    if len(vals) != 1:
        raise TritonConfigError(f"config.pbtxt: {where} needs exactly one {key!r}, found {len(vals)}")
    return vals[0]


def check_config(config: dict[str, list[Any]], model: onnx.ModelProto, name: str) -> None:
    """Raise :class:`TritonConfigError` unless ``config`` serves ``model`` correctly as ``name``."""
    problems = []
    if _one(config, "name", "the model") != name:
        problems.append(f"name is {config['name'][0]!r}, but the folder is {name!r}")
    if _one(config, "platform", "the model") != PLATFORM:
        problems.append(f"platform is {config['platform'][0]!r}, expected {PLATFORM!r}")
    mbs = _one(config, "max_batch_size", "the model")
    if not isinstance(mbs, int) or mbs < 1:
        problems.append(f"max_batch_size is {mbs!r}, expected a positive integer")
    batching = config.get("dynamic_batching", [])
    if len(batching) != 1 or not isinstance(_one(batching[0], "max_queue_delay_microseconds",
                                                 "dynamic_batching"), int):
        problems.append("dynamic_batching { max_queue_delay_microseconds: N } is missing")
    for key, values in (("input", model.graph.input), ("output", model.graph.output)):
        what = key
        entries = config.get(key, [])
        if len(entries) != len(values):
            problems.append(f"{len(entries)} {key} entries for {len(values)} graph {key}s")
            continue
        for entry, value in zip(entries, values):
            g_name, g_type, g_dims, batch = _io(value, what)
            c_name = _one(entry, "name", key)
            if c_name != g_name:
                problems.append(f"{key} name {c_name!r} != graph {what} {g_name!r}")
            c_type = _one(entry, "data_type", key)
            if c_type != g_type:
                problems.append(f"{key} {c_name!r} data_type {c_type} != graph {g_type}")
            c_dims = entry.get("dims", [])
            if not g_dims and c_dims == [1] and entry.get("reshape"):
                c_dims = [d for r in entry["reshape"] for d in r.get("shape", [])]  # [1] reshaped to []
            if c_dims != g_dims:
                problems.append(f"{key} {c_name!r} dims {c_dims} != graph dims without batch {g_dims}")
            if not batch:
                problems.append(f"graph {what} {g_name!r} has a fixed batch dimension")
    if problems:
        raise TritonConfigError(f"Triton config for {name!r} does not match the model: "
                                + "; ".join(problems))


def check_model_dir(root: str | os.PathLike[str]) -> dict[str, list[Any]]:
    """Parse ``<repo>/<name>/config.pbtxt`` and check it against ``1/model.onnx``; returns the config."""
    root = Path(root)
    cfg_path, model_path = root / "config.pbtxt", root / "1" / "model.onnx"
    for p in (cfg_path, model_path):
        if not p.is_file():
            raise TritonConfigError(f"{p} is missing")
    config = parse_pbtxt(cfg_path.read_text(encoding="utf-8"))
    model = onnx.load(str(model_path), load_external_data=False)
    check_config(config, model, root.name)
    for out in config.get("output", []):
        for label_file in out.get("label_filename", []):
            labels = root / label_file
            if not labels.is_file():
                raise TritonConfigError(f"{cfg_path}: label_filename {label_file!r} does not exist in {root}")
            n = len(labels.read_text(encoding="utf-8").splitlines())
            dims = out.get("dims", [])
            if dims and dims[-1] != n:
                raise TritonConfigError(f"{labels} has {n} labels but output {out['name'][0]!r} has "
                                        f"{dims[-1]}")
    return config
