"""Module: a tree of layers with parameters, buffers, train/eval mode, state dicts and hooks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from leaflens.engine.backend import array_module, to_device
from leaflens.engine.tensor import Tensor


class Parameter(Tensor):
    """A Tensor that a Module owns and an optimiser updates."""

    __slots__ = ()

    def __init__(self, data: Any, name: str | None = None):
        super().__init__(data, requires_grad=True, name=name)


ForwardHook = Callable[["Module", tuple[Any, ...], Any], None]
_M = TypeVar("_M", bound="Module")  # train/eval/to return the module itself, with its own type


class Module:
    """Base class of every layer and model.

    Attributes that are Parameters, Modules or registered buffers (non-trained state such as
    BatchNorm's running statistics, kept apart from parameters) are found automatically.
    """

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_forward_hooks", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() before setting "
                               f"attributes (while setting {name!r})")
        if value is not None and (self._parameters.get(name) is value or self._modules.get(name) is value):
            return  # the same object put back (``layer.weight -= x`` ends so): keep its place in the order
        if name in self._parameters and value is not None and not isinstance(value, Parameter):
            raise TypeError(f"cannot put a {type(value).__name__} in {type(self).__name__}.{name}, a parameter: it "
                            "would leave the parameters (the optimiser and the checkpoints would lose it). Give a "
                            f"Parameter, None to remove it, or change its values in place ({name}.data[...] = ...)")
        for store in (self._parameters, self._modules, self._buffers):
            store.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        elif name in self.__dict__.get("_buffer_names", ()):
            self._buffers[name] = value
        else:
            object.__setattr__(self, name, value)
            return
        self.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for store in ("_parameters", "_modules", "_buffers"):
            if store in d and name in d[store]:
                return d[store][name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def register_buffer(self, name: str, value: Any) -> None:
        """Keep ``value`` (an array) in the state dict without training it."""
        names = self.__dict__.setdefault("_buffer_names", set())
        names.add(name)
        self._buffers[name] = value
        self.__dict__.pop(name, None)

    # ---- calling ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.forward(*args, **kwargs)
        for hook in list(self._forward_hooks.values()):
            hook(self, args, out)
        return out

    def register_forward_hook(self, hook: ForwardHook) -> Callable[[], None]:
        """Call ``hook(module, inputs, output)`` after every forward; returns a function that removes it."""
        key = id(hook)
        self._forward_hooks[key] = hook
        return lambda: self._forward_hooks.pop(key, None)

    # ---- walking the tree ---------------------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """Every module once, under the first name it is reached by (a module used twice, as in weight tying,
        is one module: its parameters and buffers have one name in the state dict)."""
        stack: list[tuple[str, Module]] = [(prefix, self)]
        seen: set[int] = set()
        while stack:
            name, mod = stack.pop()
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            yield name, mod
            children = [(f"{name}.{k}" if name else k, m) for k, m in mod._modules.items()]
            stack.extend(reversed(children))

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def children(self) -> Iterator[Module]:
        yield from self._modules.values()

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        for prefix, mod in self.named_modules():
            for k, p in mod._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{prefix}.{k}" if prefix else k), p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_buffers(self) -> Iterator[tuple[str, Any]]:
        for prefix, mod in self.named_modules():
            for k, b in mod._buffers.items():
                yield (f"{prefix}.{k}" if prefix else k), b

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # ---- modes ---------------------------------------------------------------------------------
    def train(self: _M, mode: bool = True) -> _M:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self: _M) -> _M:
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def to(self: _M, device: str) -> _M:
        """Move parameters and buffers to "cpu" or "cuda" in place."""
        for mod in self.modules():
            for p in mod._parameters.values():
                p.data = to_device(p.data, device)
                if p.grad is not None:
                    p.grad = to_device(p.grad, device)
            for k in list(mod._buffers):
                mod._buffers[k] = to_device(mod._buffers[k], device)
        return self

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> OrderedDict[str, np.ndarray]:
        """Parameters and buffers by dotted name, as NumPy arrays (copies)."""
        out: OrderedDict[str, np.ndarray] = OrderedDict()
        for name, p in self.named_parameters():
            out[name] = np.array(to_device(p.data, "cpu"), copy=True)
        for name, b in self.named_buffers():
            out[name] = np.array(to_device(b, "cpu"), copy=True)
        return out

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> list[str]:
        """Copy values in by name, refusing any shape mismatch; with ``strict``, names must match exactly.

        Returns the names that were not loaded (only possible with strict=False).
        """
        own: dict[str, tuple[Module, str, str]] = {}
        seen: set[int] = set()  # a parameter shared by two modules has the one name state_dict() gives it
        for prefix, mod in self.named_modules():
            for k, p in mod._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    own[f"{prefix}.{k}" if prefix else k] = (mod, k, "param")
            for k in mod._buffers:
                own[f"{prefix}.{k}" if prefix else k] = (mod, k, "buffer")
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing keys: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
            if unexpected:
                parts.append(f"unexpected keys: {', '.join(unexpected[:10])}"
                             f"{' ...' if len(unexpected) > 10 else ''}")
            raise KeyError(f"load_state_dict into {type(self).__name__}: " + "; ".join(parts))
        for key, value in state.items():
            if key not in own:
                continue
            mod, k, kind = own[key]
            current = mod._parameters[k].data if kind == "param" else mod._buffers[k]
            value = np.asarray(value)
            if tuple(value.shape) != tuple(current.shape):
                raise ValueError(f"load_state_dict: shape mismatch for {key!r}: checkpoint has "
                                 f"{tuple(value.shape)}, model has {tuple(current.shape)}")
            xp = array_module(current)
            new = xp.asarray(value.astype(current.dtype, copy=False))
            if kind == "param":
                mod._parameters[k].data = new.copy() if new is value else new
            else:
                mod._buffers[k] = new.copy() if new is value else new
        return missing

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, m in self._modules.items():
            sub = repr(m).replace("\n", "\n  ")
            lines.append(f"  ({name}): {sub}")
        return "\n".join(lines) + ("\n)" if len(lines) > 1 else ")")
