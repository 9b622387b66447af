"""Name -> method factory, with the ablation variants of StructKV."""
from __future__ import annotations

import dataclasses

from .variants import FastKV, Full, GemFilter, H2O, PyramidKV, SnapKV, StreamingLLM, StructKV


def _structkv_variant(name: str, **overrides):
    def make(**kw):
        method = StructKV(**{**overrides, **kw})
        method.name = name  # reported under its own name in every table
        return method

    return make


METHODS = {
    "full": Full,
    "streaming_llm": StreamingLLM,
    "snapkv": SnapKV,
    "pyramidkv": PyramidKV,
    "h2o": H2O,
    "gemfilter": GemFilter,
    "fastkv": FastKV,
    "structkv": StructKV,
    "structkv_fixed_pivot": _structkv_variant("structkv_fixed_pivot", pivot=15 / 32),
    "structkv_no_decay": _structkv_variant("structkv_no_decay", decay=1.0),
    "structkv_coupled": None,  # filled below: R_struct = R_KV
}


def _coupled(**kw):
    budget = kw.pop("kv_budget", 0.1)
    if "r_struct" in kw:
        raise ValueError("structkv_coupled ties r_struct to kv_budget; pass only kv_budget")
    return _structkv_variant("structkv_coupled")(kv_budget=budget, r_struct=budget, **kw)


METHODS["structkv_coupled"] = _coupled


def names() -> list[str]:
    return list(METHODS)


def get(name: str, **options):
    """A method by registry name, with options checked against its fields."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(METHODS)}")
    factory = METHODS[name]
    cls = factory if isinstance(factory, type) else StructKV
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for method {name!r}; valid: {sorted(valid)}")
    return factory(**options)



# The option that carries the propagation (structural) budget, for the methods that have one.
STRUCT_BUDGET_OPTION = {"structkv": "r_struct", "structkv_fixed_pivot": "r_struct", "structkv_no_decay": "r_struct",
                        "fastkv": "tsp_rate"}


def budget_options(name: str, kv_budget=None, struct_budget=None) -> dict:
    """`get` options for the budgets every harness speaks in: R_KV (none for `full`) and R_struct
    (StructKV's r_struct, FastKV's tsp_rate; dropped for methods without one)."""
    if name == "full":
        return {}
    options = {"kv_budget": kv_budget}
    if name in STRUCT_BUDGET_OPTION and struct_budget is not None:
        options[STRUCT_BUDGET_OPTION[name]] = struct_budget
    return options
