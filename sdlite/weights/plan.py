"""Conversion plans: how the tensors of one key layout are made from those of another, decided on names alone.

Converting works on key NAMES. Each direction produces a plan, ``{target_key: PlanEntry(source_keys,
transform)}``, without reading any tensor; applying a plan to a ``Mapping`` gives a lazy view that reads
and transforms one tensor at a time (so a multi-GB file never has to be materialised as a whole).

A key table is a :class:`RuleSet` of :class:`Rule` objects (an original module prefix and its canonical one);
:func:`build_plan` runs a table over a file's keys, in either direction. The tables themselves live with their
networks (:mod:`~sdlite.weights.unet_keys`, :mod:`~sdlite.weights.vae_keys`, :mod:`~sdlite.weights.text_keys`).
A transformer's table is a function from one name to its other name(s) instead: :func:`plan_names` runs it towards
the canonical names, :func:`plan_fused` back (fused tensors concatenated from their parts), and :class:`Layouts` tells
a network's layouts apart and plans, measures and loads any of them.

Reading key names fails in two ways: :class:`ConversionError` (keys that cannot be converted) and
:class:`UnsupportedModelError` (weights that are not a model sdlite runs, found while reading their structure).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from ..errors import CheckpointError

__all__ = [
    "ConversionError", "UnsupportedModelError", "Transform", "COPY", "TO_LINEAR", "TO_CONV", "CAT", "TRANSPOSE",
    "PlanEntry", "ConvertedMapping", "apply_plan", "ComponentPlan", "CheckpointPlan", "Rule", "RuleSet",
    "build_plan", "add_entry", "check_expected", "Shapes", "shape_of", "need_shape", "need_matrix", "load_planned",
    "plan_names", "same_names", "plan_fused", "add_fused", "names_back", "Layouts", "split_param", "block_key",
    "block_counts", "source_shapes", "listed",
]

Shapes = Mapping[str, Sequence[int]]

_MAX_LISTED = 5


class ConversionError(CheckpointError):
    """Keys or tensors that cannot be converted (the message names the key, shape or value at fault)."""


class UnsupportedModelError(CheckpointError):
    """The weights are not an SD 1.x/2.x/XL model sdlite can run; the message says what they look like."""


# --- per-key transforms ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transform:
    """How a target tensor is made from its source tensor(s).

    ``op`` is one of ``copy`` (one source, unchanged), ``to_linear`` (1x1 conv weight ``[O, I, 1, 1]`` ->
    Linear ``[O, I]``; a 2-D source passes unchanged), ``to_conv`` (Linear ``[O, I]`` -> ``[O, I, 1, 1]``),
    ``chunk`` (``args=(index, parts)``: part ``index`` of ``parts`` equal slices along dim 0), ``split``
    (``args=(index, sizes)``: part ``index`` of slices along dim 0 in the proportions ``sizes``, e.g. ``(1, 1, 1, 4)``
    for FLUX's fused q, k, v and MLP rows), ``cat``
    (the sources concatenated along dim 0) and ``transpose`` (a 2-D matrix transposed, as a view).
    """

    op: str = "copy"
    args: tuple = ()

    def __post_init__(self):
        if self.op not in ("copy", "to_linear", "to_conv", "chunk", "split", "cat", "transpose"):
            raise ValueError(f"unknown transform {self.op!r}")

    def apply(self, tensors: Sequence[Any], key: str = "?") -> Any:
        """The target tensor ``key`` from its source tensors (views where possible, no copies)."""
        self._check_shapes([tuple(t.shape) for t in tensors], key)
        if self.op == "copy":
            return tensors[0]
        t = tensors[0]
        if self.op == "to_linear":
            return t.reshape(t.shape[0], t.shape[1]) if t.ndim != 2 else t
        if self.op == "to_conv":
            return t.reshape(t.shape[0], t.shape[1], 1, 1) if t.ndim == 2 else t
        if self.op in ("chunk", "split"):
            start, stop = self._rows(t.shape[0])
            # a tensor that stays quantized (sdlite.weights.quants) splits by whole rows without dequantizing
            return t.rows(start, stop) if hasattr(t, "rows") else t[start:stop]
        if self.op == "transpose":
            return t.t()
        import torch

        return torch.cat(list(tensors), dim=0)

    def shape(self, shapes: Sequence[Sequence[int]], key: str = "?") -> tuple[int, ...]:
        """The target shape from the source shapes, without touching any tensor."""
        shapes = [tuple(int(d) for d in s) for s in shapes]
        self._check_shapes(shapes, key)
        s = shapes[0]
        if self.op == "copy":
            return s
        if self.op == "to_linear":
            return s[:2]
        if self.op == "to_conv":
            return s + (1, 1) if len(s) == 2 else s
        if self.op in ("chunk", "split"):
            start, stop = self._rows(s[0])
            return (stop - start,) + s[1:]
        if self.op == "transpose":
            return s[::-1]
        return (sum(x[0] for x in shapes),) + s[1:]

    def _check_shapes(self, shapes: list[tuple[int, ...]], key: str) -> None:
        if not shapes or (self.op != "cat" and len(shapes) != 1):
            raise ConversionError(f"transform {self.op} got {len(shapes)} source tensors", key=key)
        s = shapes[0]
        if self.op == "to_linear" and (len(s) < 2 or any(d != 1 for d in s[2:])):
            raise ConversionError(
                f"expected a 1x1 convolution or Linear weight [out, in(, 1, 1)], got shape {list(s)}", key=key)
        if self.op == "to_conv" and len(s) != 2 and not (len(s) == 4 and s[2:] == (1, 1)):
            raise ConversionError(f"expected a Linear weight [out, in], got shape {list(s)}", key=key)
        if self.op == "chunk" and (not s or s[0] % self.args[1]):
            raise ConversionError(
                f"cannot split shape {list(s)} into {self.args[1]} equal parts along dim 0", key=key)
        if self.op == "split" and (not s or s[0] % sum(self.args[1])):
            raise ConversionError(f"cannot split shape {list(s)} along dim 0 in the proportions "
                                  f"{list(self.args[1])}", key=key)
        if self.op == "transpose" and len(s) != 2:
            raise ConversionError(f"expected a 2-D matrix to transpose, got shape {list(s)}", key=key)
        if self.op == "cat" and any(x[1:] != s[1:] for x in shapes):
            raise ConversionError(
                f"cannot concatenate shapes {[list(x) for x in shapes]} along dim 0", key=key)


    def _rows(self, n: int) -> tuple[int, int]:
        """The rows [start, stop) of an ``n``-row source that a chunk or split takes."""
        index, parts = self.args
        sizes = (1,) * parts if self.op == "chunk" else tuple(parts)
        unit = n // sum(sizes)
        start = unit * sum(sizes[:index])
        return start, start + unit * sizes[index]


COPY = Transform("copy")
TO_LINEAR = Transform("to_linear")
TO_CONV = Transform("to_conv")
CAT = Transform("cat")
TRANSPOSE = Transform("transpose")


class PlanEntry(NamedTuple):
    """One target key: the source key(s) it is made from and how."""

    sources: tuple[str, ...]
    transform: Transform = COPY


class ConvertedMapping(Mapping):
    """A lazy, read-only view of ``source`` under a plan: each access reads and transforms one tensor."""

    def __init__(self, entries: Mapping[str, PlanEntry], source: Mapping):
        self._entries = entries
        self._source = source

    @property
    def source(self) -> Mapping:
        """The mapping the view reads (a TensorStore)."""
        return self._source

    def __getitem__(self, key: str):
        entry = self._entries[key]
        try:
            tensors = [self._source[s] for s in entry.sources]
        except KeyError as e:
            raise ConversionError(f"source key {e.args[0]!r} is not in the checkpoint", key=key) from None
        return entry.transform.apply(tensors, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries


def apply_plan(entries: Mapping[str, PlanEntry], source: Mapping) -> ConvertedMapping:
    """The lazy view of ``source`` under ``entries`` (a plan's ``entries`` dict or a whole plan)."""
    if isinstance(entries, ComponentPlan):
        entries = entries.entries
    return ConvertedMapping(entries, source)


def _listing(keys: Sequence[str]) -> str:
    first = ", ".join(repr(k) for k in keys[:_MAX_LISTED])
    return first + (", ..." if len(keys) > _MAX_LISTED else "")


@dataclass
class ComponentPlan:
    """The conversion of one component (or of a whole exported file).

    ``entries``: ``{target_key: PlanEntry}``. ``unexpected``: source keys nothing understood (or that map to
    names the model does not have). ``ignored``: source keys known and deliberately dropped (buffers, EMA
    copies, the unused OpenCLIP layer ...). ``missing``: expected target keys nothing maps to (only when the
    plan was built with ``expected``). ``notes``: anything else worth telling the user.
    """

    component: str
    entries: dict[str, PlanEntry] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def apply(self, source: Mapping) -> ConvertedMapping:
        """Lazy view of ``source`` (a name->tensor Mapping holding the source keys) under this plan."""
        return ConvertedMapping(self.entries, source)

    def materialize(self, source: Mapping) -> dict:
        """All target tensors at once (for small models and tests)."""
        view = self.apply(source)
        return {k: view[k] for k in view}

    def shapes(self, source_shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """Target shapes from source shapes (values may be shapes or anything with ``.shape``)."""
        return {k: e.transform.shape([shape_of(source_shapes[s]) for s in e.sources], k)
                for k, e in self.entries.items()}

    @property
    def source_keys(self) -> set[str]:
        return {s for e in self.entries.values() for s in e.sources}

    def report(self) -> str:
        """One line per problem: "N missing keys, first few: ..." and "N unexpected keys: ..."."""
        lines = []
        if self.missing:
            lines.append(f"{self.component}: {len(self.missing)} missing keys, first few: {_listing(self.missing)}")
        if self.unexpected:
            lines.append(f"{self.component}: {len(self.unexpected)} unexpected keys, first few: "
                         f"{_listing(self.unexpected)}")
        lines.extend(f"{self.component}: {n}" for n in self.notes)
        return "\n".join(lines)


def shape_of(value) -> tuple[int, ...]:
    """A shape as a tuple of ints, from a shape or from anything with a ``.shape``."""
    shape = getattr(value, "shape", value)
    return tuple(int(d) for d in shape)


def need_shape(shapes: Mapping[str, tuple[int, ...]], key: str, what: str) -> tuple[int, ...]:
    """The shape of ``key``, which the network ``what`` cannot do without."""
    if key not in shapes:
        raise UnsupportedModelError(f"{what}: key {key!r} is missing")
    return shapes[key]


def need_matrix(shapes: Mapping[str, tuple[int, ...]], key: str, what: str) -> tuple[int, int]:
    """The shape of ``key``, a matrix (2-D) that the network ``what`` cannot do without."""
    shape = need_shape(shapes, key, what)
    if len(shape) != 2:
        raise UnsupportedModelError(f"{what}: expected a matrix, got shape {list(shape)}", key=key)
    return shape


@dataclass
class CheckpointPlan:
    """The conversion of a whole single file: one :class:`ComponentPlan` per component found.

    For an import (``plan_from_original``) the components are ``unet``, ``vae`` and ``text_encoder`` and
    their sources are keys of the file; ``unexpected``/``ignored`` hold file keys outside every component.
    For an export (``plan_to_original``) each component's targets are original keys and its sources are
    canonical keys of that component.
    """

    components: dict[str, ComponentPlan] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def split(self, source: Mapping) -> dict[str, ConvertedMapping]:
        """Import: lazy canonical views per component of one original-layout Mapping."""
        return {name: plan.apply(source) for name, plan in self.components.items()}

    def merge(self, sources: Mapping[str, Mapping]) -> "_MergedMapping":
        """Export: one lazy original-layout Mapping from per-component canonical Mappings."""
        missing = [name for name in self.components if name not in sources]
        if missing:
            raise ConversionError(f"export needs the state dict of component(s) {missing}")
        return _MergedMapping([(p.entries, sources[n]) for n, p in self.components.items()])

    def report(self) -> str:
        lines = [p.report() for p in self.components.values()]
        if self.unexpected:
            lines.append(f"{len(self.unexpected)} unexpected keys outside the known components, first few: "
                         f"{_listing(self.unexpected)}")
        lines.extend(self.notes)
        return "\n".join(line for line in lines if line)


class _MergedMapping(Mapping):
    def __init__(self, parts: list[tuple[Mapping[str, PlanEntry], Mapping]]):
        self._where: dict[str, tuple[Mapping[str, PlanEntry], Mapping]] = {}
        for entries, source in parts:
            for k in entries:
                if k in self._where:
                    raise ConversionError(f"two components export the same key {k!r}", key=k)
                self._where[k] = (entries, source)

    def __getitem__(self, key):
        entries, source = self._where[key]
        return ConvertedMapping(entries, source)[key]

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def __contains__(self, key):
        return key in self._where


# --- renaming rules ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """Maps the module prefix ``orig`` (original layout) to ``canon`` (canonical layout).

    ``kind``: ``leaf`` (the rest of the key is one parameter name), ``subtree`` (the rest is copied as is),
    ``table`` (the rest is ``module.param`` with ``module`` renamed by ``table``) or ``exact`` (the whole key).
    ``indexed``: one numeric level (``.N``) follows the prefix and is kept. ``linear``: canonical modules
    (of a table) whose ``weight`` is Linear in canonical and a 1x1 conv in the original layout.
    ``reverse``: used for canonical->original (False for tolerated alternative spellings).
    """

    orig: str
    canon: str
    kind: str = "leaf"
    table: tuple[tuple[str, str], ...] = ()
    indexed: bool = False
    linear: frozenset = frozenset()
    reverse: bool = True

    @cached_property
    def _to_canon(self) -> dict[str, str]:
        return dict(self.table)

    @cached_property
    def _to_orig(self) -> dict[str, str]:
        return {c: o for o, c in self.table}

    def rename(self, rest: str, to_canon: bool) -> tuple[str, Transform] | None:
        index = ""
        if self.indexed:
            head, _, rest = rest.partition(".")
            if not head.isdigit() or not rest:
                return None
            index = head + "."
        if self.kind == "exact":
            return ("", COPY) if rest == "" and not index else None
        if self.kind == "subtree":
            return (index + rest, COPY) if rest else None
        if self.kind == "leaf":
            return (index + rest, COPY) if rest and "." not in rest else None
        module, _, param = rest.rpartition(".")
        if not module:
            return None
        new = (self._to_canon if to_canon else self._to_orig).get(module)
        if new is None:
            return None
        canon_module = new if to_canon else module
        transform = COPY
        if param == "weight" and canon_module in self.linear:
            transform = TO_LINEAR if to_canon else TO_CONV
        return f"{index}{new}.{param}", transform


class RuleSet:
    def __init__(self, rules: Iterable[Rule]):
        self.fwd: dict[str, Rule] = {}
        self.bwd: dict[str, Rule] = {}
        for r in rules:
            if r.orig in self.fwd:
                raise AssertionError(f"duplicate original prefix {r.orig!r}")
            self.fwd[r.orig] = r
            if r.reverse:
                if r.canon in self.bwd:
                    raise AssertionError(f"duplicate canonical prefix {r.canon!r}")
                self.bwd[r.canon] = r

    def map(self, key: str, to_canon: bool) -> tuple[str, Transform] | None:
        """The other layout's name (and transform) for ``key`` (prefix-free), by longest matching prefix."""
        index = self.fwd if to_canon else self.bwd
        prefix = key
        while True:
            rule = index.get(prefix)
            if rule is not None:
                rest = key[len(prefix) + 1:]
                out = rule.rename(rest, to_canon)
                if out is not None:
                    new_rest, transform = out
                    base = rule.canon if to_canon else rule.orig
                    return (f"{base}.{new_rest}" if new_rest else base), transform
            cut = prefix.rfind(".")
            if cut < 0:
                return None
            prefix = prefix[:cut]


def build_plan(component: str, keys: Iterable[str], rules: RuleSet, *, to_canon: bool, src_prefix: str,
           dst_prefix: str, ignore=None, expected: Iterable[str] | None = None) -> ComponentPlan:
    plan = ComponentPlan(component)
    for key in keys:
        if not key.startswith(src_prefix):
            continue
        name = key[len(src_prefix):]
        if ignore is not None and ignore(name):
            plan.ignored.append(key)
            continue
        out = rules.map(name, to_canon)
        if out is None:
            plan.unexpected.append(key)
            continue
        target = dst_prefix + out[0]
        add_entry(plan, target, PlanEntry((key,), out[1]))
    check_expected(plan, expected)
    return plan


def add_entry(plan: ComponentPlan, target: str, entry: PlanEntry) -> None:
    old = plan.entries.get(target)
    if old is not None:
        raise ConversionError(
            f"{plan.component}: keys {old.sources[0]!r} and {entry.sources[0]!r} both map to {target!r}", key=target)
    plan.entries[target] = entry


def check_expected(plan: ComponentPlan, expected: Iterable[str] | None) -> None:
    if expected is None:
        return
    expected = list(expected)
    wanted = set(expected)
    for target in [t for t in plan.entries if t not in wanted]:
        for source in plan.entries.pop(target).sources:
            if source not in plan.unexpected:
                plan.unexpected.append(source)
    plan.missing.extend(k for k in expected if k not in plan.entries)


# --- plans built name by name (a transformer's table as functions) ------------------------------------------


def plan_names(component: str, keys: Iterable[str], rename: Callable[[str], list[tuple[str, Transform]] | None], *,
               prefix: str = "", ignored: Iterable[str] = (), expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{target key: PlanEntry}`` for the keys under ``prefix``: ``rename(name)`` (a key without the prefix)
    gives its ``(target, transform)`` pairs (several for a fused tensor that is split) or None for a name outside
    the table (``unexpected``); names in ``ignored`` are known and dropped. ``expected``: the model's keys, to report
    missing and unknown names."""
    ignored = frozenset(ignored)
    plan = ComponentPlan(component)
    for key in keys:
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name in ignored:
            plan.ignored.append(key)
            continue
        made = rename(name)
        if made is None:
            plan.unexpected.append(key)
            continue
        for target, transform in made:
            add_entry(plan, target, PlanEntry((key,), transform))
    check_expected(plan, expected)
    return plan


def same_names(component: str, keys: Iterable[str], *, prefix: str = "",
               expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan for keys that have the canonical names already (a diffusers folder's weights, possibly sharded): each key
    under ``prefix`` as it is, without the prefix."""
    return plan_names(component, keys, lambda name: [(name, COPY)], prefix=prefix, expected=expected)


def plan_fused(component: str, keys: Iterable[str], rename: Callable[[str], tuple[str, Transform | None] | None],
               parts_of: Callable[[str], Sequence[str]], *, prefix: str = "") -> ComponentPlan:
    """Plan ``{key of another layout (with prefix): PlanEntry}`` from canonical keys, the way back of
    :func:`plan_names`. ``rename(key)`` is ``(name, transform)`` for a key that makes a tensor of its own,
    ``(fused name, None)`` for a part of a fused tensor, None outside the table (``unexpected``); ``parts_of(fused
    name)`` lists the fused tensor's canonical parts in order, concatenated by :func:`add_fused`."""
    plan = ComponentPlan(component)
    groups: dict[str, list[str]] = {}
    for key in keys:
        found = rename(key)
        if found is None:
            plan.unexpected.append(key)
        elif found[1] is None:
            groups.setdefault(found[0], []).append(key)
        else:
            add_entry(plan, prefix + found[0], PlanEntry((key,), found[1]))
    for name, present in groups.items():
        add_fused(plan, prefix + name, parts_of(name), present)
    return plan


def add_fused(plan: ComponentPlan, target: str, parts: Sequence[str], present: Sequence[str]) -> None:
    """``target`` as ``parts`` (canonical keys, in order) concatenated along dim 0 when ``present`` holds them all;
    otherwise the absent parts go to ``missing`` and the present ones to ``unexpected``."""
    if set(present) == set(parts):
        add_entry(plan, target, PlanEntry(tuple(parts), CAT))
    else:
        plan.missing.extend(p for p in parts if p not in present)
        plan.unexpected.extend(present)


def names_back(canonical: Iterable[str], rename: Callable[[str], tuple[str, Any] | None], prefix: str) -> list[str]:
    """The names canonical keys have in another layout under ``prefix`` (a fused part: the fused tensor's; a key
    ``rename`` does not know: as it is), each once, for error messages. ``rename`` as for :func:`plan_fused`."""
    names = []
    for key in canonical:
        found = rename(key)
        names.append(prefix + found[0] if found is not None else key)
    return list(dict.fromkeys(names))


def split_param(name: str) -> tuple[str, str]:
    """``(module, parameter)`` of a key: ``("attention.to_q", "weight")`` of ``"attention.to_q.weight"``."""
    module, _, param = name.rpartition(".")
    return module, param


def block_key(pattern, key: str) -> tuple[str, str, str, str] | None:
    """``(kind, number, module, parameter)`` of a block's key, which ``pattern`` (a compiled regex) fullmatches as
    (kind, number, the rest); None for a key outside the blocks."""
    m = pattern.fullmatch(key)
    if m is None:
        return None
    kind, index, rest = m.groups()
    return (kind, index, *split_param(rest))


def block_counts(keys: Iterable[str], pattern, kinds: Iterable[str], what: str) -> dict[str, int]:
    """How many blocks of each kind canonical ``keys`` hold: ``pattern`` (a compiled regex) fullmatches a block's key
    as (kind, number, rest). Each kind's numbers must run 0..n-1, else an :class:`UnsupportedModelError` naming
    ``what``."""
    keys = list(keys)
    counts = {}
    for kind in kinds:
        found = sorted({int(m.group(2)) for k in keys if (m := pattern.fullmatch(k)) and m.group(1) == kind})
        if found != list(range(len(found))):
            raise UnsupportedModelError(f"{what}: {kind} {found[:8]} are not numbered 0..n-1")
        counts[kind] = len(found)
    return counts


# --- loading -----------------------------------------------------------------------------------------------


def source_shapes(source: Mapping, keys: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of ``keys`` in ``source``, without reading tensor data where the source can tell (a TensorStore)."""
    return {k: _shape_in(source, k) for k in keys}


def listed(keys: Sequence[str], lead: str = "") -> str:
    """`` (<lead>'a', 'b', ...)``: the first few keys for a message, in brackets; empty for none."""
    return f" ({lead}{_listing(keys)})" if keys else ""


def _shape_in(source: Mapping, key: str) -> tuple[int, ...]:
    """A source tensor's shape without reading its data where the source can tell (a TensorStore)."""
    shape = getattr(source, "shape", None)
    return tuple(shape(key)) if callable(shape) else shape_of(source[key])


def load_planned(model, source: Mapping, plan: ComponentPlan, source_names) -> Any:
    """Load ``source`` (a name -> tensor Mapping) into ``model`` through ``plan`` (built with the model's keys as
    ``expected``), key for key; the model keeps its dtype and device (one built on the meta device gets the tensors,
    converted to its dtype). Every check comes before any tensor is read: missing keys (named in the source's layout
    by ``source_names(canonical keys)``), keys with no place and shape mismatches are a :class:`ConversionError`.
    Returns the model."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    what = plan.component
    if plan.missing:
        names = source_names(plan.missing)
        raise ConversionError(f"{len(names)} {what} keys are missing from the weights, first few: "
                              + ", ".join(repr(n) for n in names[:5]), key=names[0])
    if plan.unexpected:
        raise ConversionError(f"{len(plan.unexpected)} keys of the weights have no place in the {what}, first "
                              "few: " + ", ".join(repr(n) for n in plan.unexpected[:5]), key=plan.unexpected[0])
    for key, entry in plan.entries.items():
        got = entry.transform.shape([_shape_in(source, s) for s in entry.sources], entry.sources[0])
        if got != expected[key]:
            raise ConversionError(f"shape {list(_shape_in(source, entry.sources[0]))} gives {list(got)} for the "
                                  f"{what}'s {key!r}, which needs {list(expected[key])}", key=entry.sources[0])
    view = plan.apply(source)
    current = model.state_dict()
    meta = any(t.is_meta for t in current.values())
    state = {k: view[k].to(dtype=current[k].dtype) if meta else view[k] for k in expected}
    model.load_state_dict(state, strict=True, assign=meta)
    return model


@dataclass(frozen=True)
class Layouts:
    """The layouts a network's weights come in, and what is done with any of them.

    ``find(keys)`` is ``(layout, prefix)`` from key names (an :class:`UnsupportedModelError` for keys of no layout);
    ``planners[layout](keys, prefix=, expected=)`` plans that layout's keys to the canonical names; ``names(canonical
    keys, prefix)`` gives their names in a layout other than ``canonical`` (whose names are the model's), for error
    messages."""

    find: Callable[[list[str]], tuple[str, str]]
    planners: Mapping[str, Callable[..., ComponentPlan]]
    names: Callable[[list[str], str], list[str]]
    canonical: str = "diffusers"

    def plan(self, keys: Iterable[str], expected: Iterable[str] | None = None) -> ComponentPlan:
        """The plan to canonical names for weights of any layout (:attr:`find` decides which)."""
        keys = list(keys)
        layout, prefix = self.find(keys)
        return self.planners[layout](keys, prefix=prefix, expected=expected)

    def shapes(self, shapes: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """The canonical keys' shapes from the shapes (or tensors) of any layout, without reading data."""
        shapes = {k: shape_of(v) for k, v in shapes.items()}
        return self.plan(shapes).shapes(shapes)

    def load(self, model, source: Mapping[str, Any]):
        """Load weights of any layout (a name -> tensor Mapping) into ``model`` key for key (:func:`load_planned`: every
        check before any tensor is read, a missing key named in the source's own layout). Returns the model."""
        keys = list(source.keys())
        plan = self.plan(keys, expected=model.state_dict().keys())
        layout, prefix = self.find(keys)
        return load_planned(model, source, plan,
                            lambda missing: missing if layout == self.canonical else self.names(missing, prefix))
