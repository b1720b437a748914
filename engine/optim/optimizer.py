"""Optimiser base: parameter groups, per-parameter state, and a state dict that needs no pickle."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from leaflens.engine.backend import array_module, to_device
from leaflens.engine.nn.module import Parameter


class Optimizer:
    """Updates parameters in place from their ``.grad``.

    ``params`` is an iterable of Parameters, or of dicts ``{"params": [...], "lr": ...}`` to give
    groups their own hyper-parameters (for example a lower learning rate for a pretrained backbone).
    Gradient accumulation is simply not calling ``zero_grad()`` between backward passes.
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]):
        items = list(params)
        if not items:
            raise ValueError(f"{type(self).__name__} got no parameters to optimise")
        groups = items if isinstance(items[0], dict) else [{"params": items}]
        self.param_groups: list[dict[str, Any]] = []
        seen: set[int] = set()
        for g in groups:
            # a weight shared by two modules comes twice from their parameters(): one group keeps it once
            ps = list({id(p): p for p in g["params"]}.values())
            for p in ps:
                if not isinstance(p, Parameter):
                    raise TypeError(f"{type(self).__name__} optimises Parameters, got {type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("a parameter appears in more than one parameter group")
                seen.add(id(p))
            group = {**defaults, **{k: v for k, v in g.items() if k != "params"}, "params": ps}
            group.setdefault("initial_lr", group["lr"])
            self.param_groups.append(group)
        self.state: dict[int, dict[str, Any]] = {}

    def _all_params(self) -> Iterator[Parameter]:
        for g in self.param_groups:
            yield from g["params"]

    def zero_grad(self) -> None:
        for p in self._all_params():
            p.grad = None

    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.shape != p.data.shape:
                    raise RuntimeError(f"gradient of shape {p.grad.shape} for parameter of shape {p.data.shape}")
                self.update(p, p.grad, group, self.state.setdefault(id(p), {}))

    def update(self, p: Parameter, grad: Any, group: dict[str, Any], state: dict[str, Any]) -> None:
        raise NotImplementedError

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"meta": JSON-able hyper-parameters, "arrays": {"<param index>.<name>": ndarray}}."""
        arrays: dict[str, np.ndarray] = {}
        for i, p in enumerate(self._all_params()):
            for k, v in self.state.get(id(p), {}).items():
                arrays[f"{i}.{k}"] = np.array(to_device(v, "cpu"), copy=True)
        groups = [{k: v for k, v in g.items() if k != "params"} | {"num_params": len(g["params"])}
                  for g in self.param_groups]
        return {"meta": {"type": type(self).__name__, "groups": groups}, "arrays": arrays}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta, arrays = state["meta"], state["arrays"]
        if meta.get("type") != type(self).__name__:
            raise ValueError(f"optimiser state is for {meta.get('type')}, not {type(self).__name__}")
        if [g["num_params"] for g in meta["groups"]] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("optimiser state has a different number of parameters per group than this optimiser")
        params = list(self._all_params())
        loaded: dict[int, dict[str, Any]] = {}  # built whole before anything changes: a bad state changes nothing
        for key, value in arrays.items():
            index, name = key.split(".", 1)
            if not index.isdigit() or int(index) >= len(params):
                raise ValueError(f"optimiser state {key!r} names no parameter of this optimiser ({len(params)})")
            p = params[int(index)]
            if name != "step" and value.shape != p.data.shape:
                raise ValueError(f"optimiser state {key!r} has shape {value.shape}, parameter has {p.data.shape}")
            if name == "step":  # a step counter stays on the host (see Adam.update)
                loaded.setdefault(id(p), {})[name] = int(value)
                continue
            xp = array_module(p.data)
            loaded.setdefault(id(p), {})[name] = xp.asarray(value).copy()
        for g, saved in zip(self.param_groups, meta["groups"]):
            g.update({k: v for k, v in saved.items() if k != "num_params"})
        self.state = loaded
