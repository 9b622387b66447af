"""Name -> method, with StructKV's ablation variants. A new method is one `register` line."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .base import Method
from .variants import H2O, FastKV, Full, GemFilter, PyramidKV, SnapKV, StreamingLLM, StructKV


@dataclass(frozen=True)
class Entry:
    """How a registry name builds its method: the class, options fixed by the name (an ablation),
    and whether R_struct is tied to R_KV (then the method has no separate structural budget)."""

    cls: type
    fixed: dict = field(default_factory=dict)
    couple_struct_to_kv: bool = False

    @property
    def struct_budget_option(self) -> str | None:
        return None if self.couple_struct_to_kv else self.cls.struct_budget_option


METHODS: dict[str, Entry] = {}


def register(name: str, cls: type, **fixed) -> None:
    """Make `cls` (a `Method` dataclass) available as `name`, with `fixed` options; the method
    reports itself under `name` in every table."""
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"register needs a Method subclass, got {cls!r}")
    couple = fixed.pop("couple_struct_to_kv", False)
    METHODS[name] = Entry(cls, fixed, couple)


register("full", Full)
register("streaming_llm", StreamingLLM)
register("snapkv", SnapKV)
register("pyramidkv", PyramidKV)
register("h2o", H2O)
register("gemfilter", GemFilter)
register("fastkv", FastKV)
register("structkv", StructKV)
# The paper's algorithm as written, with the faithful reading where it is silent (the detector's
# statistics over ranked columns, normalised changes, L* = argmax T + 1; lambda by layer distance).
register("structkv_paper", StructKV, pivot="dynamic", confirm=1, decay=0.9, skeleton="centrality",
         equal_compute=False, beta=0.0)
# Ablations of the default (docs/methods.md, "StructKV here"): each undoes one choice.
register("structkv_dynamic_pivot", StructKV, pivot="dynamic", equal_compute=True)
register("structkv_centrality", StructKV, skeleton="centrality")
register("structkv_no_guide", StructKV, beta=0.0)
register("structkv_no_decay", StructKV, skeleton="centrality", decay=1.0)
register("structkv_coupled", StructKV, couple_struct_to_kv=True)  # R_struct = R_KV


def names() -> list[str]:
    return list(METHODS)


def get(name: str, **options) -> Method:
    """A method by registry name, with options checked against its fields."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(METHODS)}")
    entry = METHODS[name]
    valid = {f.name for f in dataclasses.fields(entry.cls)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for method {name!r}; valid: {sorted(valid)}")
    if entry.couple_struct_to_kv:
        if "r_struct" in options:
            raise ValueError(f"{name} ties r_struct to kv_budget; pass only kv_budget")
        options = {**options, "kv_budget": options.get("kv_budget", 0.1)}
        options["r_struct"] = options["kv_budget"]
    method = entry.cls(**{**entry.fixed, **options})
    method.name = name  # reported under its registry name in every table
    return method


def struct_budget_option(name: str) -> str | None:
    """The option that carries R_struct for this registry name (StructKV's r_struct, FastKV's
    tsp_rate), or None."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(METHODS)}")
    return METHODS[name].struct_budget_option


def budget_options(name: str, kv_budget=None, struct_budget=None) -> dict:
    """`get` options for the budgets every harness speaks in: R_KV (none for `full`) and R_struct
    (dropped for methods without one)."""
    if name == "full":
        return {}
    options = {"kv_budget": kv_budget}
    option = struct_budget_option(name)
    if option is not None and struct_budget is not None:
        options[option] = struct_budget
    return options
