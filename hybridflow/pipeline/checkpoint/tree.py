"""A role's state as files: a state tree <-> `<name>.json` + `<name>.safetensors`.

A state (`Role.state_dict()`, a driver op's state, the process RNG) is a tree of dicts,
lists, tuples, scalars and tensors. `write_state` splits it into a flat tensor dict
(safetensors, keyed by dotted path) and a JSON tree in which each tensor is replaced by
{"__tensor__": key}; what JSON lacks is tagged (`__tuple__`, `__items__` for non-string
or reserved keys, `__float__` for NaN/inf). `read_state` puts it back together.

Invariants: nothing is pickled, and decoding refuses any JSON node it does not
recognise (an unknown tag, a tensor key the safetensors file lacks). A file is checked
before it is trusted (a damaged one is a ConfigError naming it), and a failed write is
an OSError with the errno (ENOSPC on a full disk) and the file's path (`writing`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.errors import ConfigError, PipelineError


def encode_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """Replace tensors by {"__tensor__": key} (filling `tensors`); tag what JSON lacks."""
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        while key in tensors:
            key += "_"
        # safetensors refuses shared storage and non-contiguous tensors: own copies.
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_tree(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_tree(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        plain = all(isinstance(k, str) and not k.startswith("__") for k in obj)
        if plain:
            return {k: encode_tree(v, tensors, _join(path, k)) for k, v in obj.items()}
        return {
            "__items__": [
                [
                    encode_tree(k, tensors, f"{path}.key"),
                    encode_tree(v, tensors, _join(path, str(k))),
                ]
                for k, v in obj.items()
            ]
        }
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {path or 'the top'}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def decode_tree(node: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(node, list):
        return [decode_tree(v, tensors, where) for v in node]
    if not isinstance(node, dict):
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise PipelineError(f"{where}: unexpected JSON value {node!r}")
    if len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "__tensor__":
            if value not in tensors:
                raise PipelineError(
                    f"{where}: tensor {value!r} is missing from the safetensors file"
                )
            return tensors[value]
        if tag == "__float__":
            if value not in ("nan", "inf", "-inf"):
                raise PipelineError(f"{where}: bad float tag {value!r}")
            return float(value)
        if tag == "__tuple__":
            return tuple(decode_tree(v, tensors, where) for v in value)
        if tag == "__items__":
            return {
                decode_tree(k, tensors, where): decode_tree(v, tensors, where) for k, v in value
            }
    for key in node:
        if key.startswith("__"):
            raise PipelineError(f"{where}: unknown tag {key!r}")
    return {k: decode_tree(v, tensors, where) for k, v in node.items()}


def write_state(state: Any, directory: Path, name: str) -> None:
    """`<name>.json` + `<name>.safetensors` (the latter only if there are tensors).
    A failed write is an OSError naming the file (`writing`)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = encode_tree(state, tensors)
    if tensors:
        blob = directory / f"{name}.safetensors"
        with writing(blob):
            save_file(tensors, str(blob))
    text = directory / f"{name}.json"
    with writing(text):
        text.write_text(json.dumps(tree, allow_nan=False))


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Write errors as an OSError that names `path` and keeps the errno (ENOSPC on a full
    disk): a write() fails with no file name, and safetensors reports its I/O errors as
    text ("... (os error 28)"), so the caller would otherwise learn neither."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except Exception as exc:
        if type(exc).__name__ != "SafetensorError":
            raise
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise OSError(f"cannot write {path}: {exc}") from exc
        num = int(code.group(1))
        raise OSError(num, os.strerror(num), str(path)) from exc


def read_state(directory: Path, name: str) -> Any:
    """What `write_state` wrote; each file checked before it is trusted (`read_json`,
    `check_file`): a damaged one is a ConfigError naming it."""
    from safetensors.torch import load_file

    from hybridflow.stages.parallel.checkpoint import check_file

    where = directory / f"{name}.json"
    tree = read_json(where)
    blob = directory / f"{name}.safetensors"
    tensors = {}
    if blob.is_file():
        check_file(blob)
        tensors = load_file(str(blob))
    return decode_tree(tree, tensors, str(where))


def read_json(path: Path) -> Any:
    """A JSON state file, parsed; unreadable or not JSON is a ConfigError naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: JSON, UTF-8
        raise ConfigError("resume_from", f"checkpoint file {path} is unreadable: {exc}") from exc
