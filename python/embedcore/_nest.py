"""Flattening nested dict / list / tuple structures, as ``tf.nest`` does:
dict keys in sorted order, lists and tuples in order, anything else a leaf."""
from __future__ import annotations

import collections
from typing import Any, Callable, List, Tuple


def is_nested(x) -> bool:
    return isinstance(x, (dict, list, tuple))


def _items(x):
    if isinstance(x, dict):
        try:
            keys = sorted(x)
        except TypeError:
            raise TypeError(f"dict keys must be sortable (flattening orders them, as tf.nest does), got keys "
                            f"{list(x)!r}") from None
        return [(k, x[k]) for k in keys]
    return list(enumerate(x))


def flatten_with_paths(x, path: str = "", is_leaf: Callable[[Any], bool] = lambda _: False) -> List[Tuple[str, Any]]:
    if is_nested(x) and not is_leaf(x):
        out = []
        for k, v in _items(x):
            out.extend(flatten_with_paths(v, f"{path}/{k}" if path else str(k), is_leaf))
        return out
    return [(path, x)]


def flatten_up_to(structure, values, where: str) -> list:
    """The leaves of `values` at the positions of `structure`'s leaves."""
    out: list = []

    def walk(s, v, path):
        if not is_nested(s):
            out.append(v)
            return
        label = path or "the top level"
        if isinstance(s, dict):
            if not isinstance(v, dict):
                raise ValueError(f"{where}: expected a dict at {label}, got {type(v).__name__}")
            if set(s) != set(v):
                missing, extra = sorted(map(str, set(s) - set(v))), sorted(map(str, set(v) - set(s)))
                raise ValueError(f"{where}: keys at {label} do not match the feature config "
                                 f"(missing {missing}, unknown {extra})")
        else:
            if not isinstance(v, (list, tuple)) or len(v) != len(s):
                got = f"{type(v).__name__} of length {len(v)}" if isinstance(v, (list, tuple)) else type(v).__name__
                raise ValueError(f"{where}: expected a sequence of length {len(s)} at {label}, got {got}")
        for k, sub in _items(s):
            walk(sub, v[k], f"{path}/{k}" if path else str(k))

    walk(structure, values, "")
    return out


def pack_like(structure, like, flat: list):
    """`like` (a caller's nest, matching `structure` down to its leaves, as
    ``flatten_up_to`` checked) rebuilt with the leaves taken in order from
    `flat`: its own types (a namedtuple, an OrderedDict, a defaultdict, a
    list where `structure` has a tuple) and dict order, as
    ``tf.nest.pack_sequence_as(features, outputs)`` packs TensorFlow's
    embedding outputs."""
    it = iter(flat)

    def build(s, v):
        if not is_nested(s):
            return next(it)
        if isinstance(s, dict):
            built = {k: build(s[k], v[k]) for k in sorted(s)}
            keys = list(v)  # (the caller's keys, in its order: equal to the config's)
            pairs = ((k, built[k]) for k in keys)
            if type(v) is dict:
                return dict(pairs)
            if isinstance(v, collections.defaultdict):
                return type(v)(v.default_factory, pairs)
            return type(v)(pairs)
        items = [build(sub, v[k]) for k, sub in enumerate(s)]
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)

    return build(structure, like)
