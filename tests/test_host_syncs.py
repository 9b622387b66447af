"""The compressed prefill reads the device back only for decisions that depend on the data, and
its `host_syncs` statistic counts exactly those reads.

Every size the loop needs follows from the prompt's row lengths, read once before the first
layer; selection, compaction and a fixed propagation layer then need no read-back. StructKV's
pivot detector must read each observed layer's statistics (the pivot depends on them): those
reads are `host_syncs`. Counted by wrapping the tensor methods that copy to the host
(`tolist`, `item`, `__bool__`, `__int__`, `__float__`) while a layer is handled.
"""
import importlib

import pytest
import torch

import structkv
from structkv import methods
from structkv.runtime.compress import compress

engine = importlib.import_module("structkv.runtime.lanes")  # the shared pass, whose _layer runs each lane

READS = ("tolist", "item", "__bool__", "__int__", "__float__")


@pytest.fixture(scope="module")
def models(tiny_dir):
    return {arch: structkv.load(tiny_dir(arch)) for arch in ("llama", "gemma3_text")}


def _count_reads_per_layer(monkeypatch):
    """Patch the host reads to count them while `lanes._layer` runs; returns the counter."""
    counter = {"inside": False, "reads": 0}
    for name in READS:
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, _real=real, **k):
            if counter["inside"]:
                counter["reads"] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    layer = engine._layer

    def counted(*a, **k):
        counter["inside"] = True
        try:
            return layer(*a, **k)
        finally:
            counter["inside"] = False

    monkeypatch.setattr(engine, "_layer", counted)
    return counter


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("name, options, reads", [
    ("full", {}, 0), ("streaming_llm", {"kv_budget": 0.3}, 0), ("snapkv", {"kv_budget": 0.2}, 0),
    ("pyramidkv", {"kv_budget": 0.2}, 0), ("h2o", {"kv_budget": 0.2}, 0), ("keydiff", {"kv_budget": 0.2}, 0),
    ("expected_attention", {"kv_budget": 0.2}, 0), ("fastkv", {"kv_budget": 0.2, "tsp_layer": 1}, 0),
    ("structkv", {"kv_budget": 0.2}, 0), ("structkv", {"kv_budget": 0.2, "pivot": "dynamic"}, None),
    ("structkv_paper", {"kv_budget": 0.2}, None),
])
def test_layers_read_back_only_what_host_syncs_counts(models, monkeypatch, arch, name, options, reads):
    model = models[arch]
    tokens = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(60).expand(2, -1).clone()
    positions[1, :9] = -1  # a left-padded row
    counter = _count_reads_per_layer(monkeypatch)
    state = compress(model, tokens, positions, methods.get(name, **options))
    assert counter["reads"] == state.stats.host_syncs
    if reads is not None:
        assert state.stats.host_syncs == reads
    else:  # the detector reads each layer of its curve once, up to the last row's pivot
        assert 1 <= state.stats.host_syncs <= len(model.config.full_attention_layers)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("rule", ["centrality", "recent"])
def test_the_kv_bound_reads_the_host_only_when_it_evicts(models, monkeypatch, arch, rule):
    """A bounded decode reads the device back only at steps that evict (every few tokens) or fold
    the decode queries into the carried centrality (every QUERY_WINDOW tokens), plus once at its
    first step: it used to read each full-attention layer's cursor, and the fed positions, at every
    step (a GPU sync per layer per token)."""
    from structkv.modules import decode_bound

    model = models[arch]
    counter = {"inside": False, "reads": 0}
    for name in READS:
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, _real=real, **k):
            counter["reads"] += counter["inside"]
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    steps = []  # per step: (reads, evicted, folded)
    real_before, real_after = decode_bound.BoundedDecode.before_step, decode_bound.BoundedDecode.after_step

    def step(self):
        counter.update(inside=True, reads=0)
        evictions = self.evictions
        try:
            real_before(self)
        finally:
            counter["inside"] = False
        steps.append([counter["reads"], self.evictions > evictions, False])

    def after(self):
        counter.update(inside=True, reads=0)
        try:
            real_after(self)
        finally:
            counter["inside"] = False
        fed = getattr(self, "fed", None) or []
        steps[-1][0] += counter["reads"]
        steps[-1][2] = any((fed[r] + 1) % decode_bound.QUERY_WINDOW == 0 for r in self.carrying)

    monkeypatch.setattr(decode_bound.BoundedDecode, "before_step", step)
    monkeypatch.setattr(decode_bound.BoundedDecode, "after_step", after)
    ids = torch.randint(3, 90, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    structkv.generate(model, ids, max_new_tokens=120, stop_at_eos=False, compile=False,
                      max_kv_tokens=decode_bound.DecodeBound(48, rule))
    quiet = [reads for reads, evicted, folded in steps[1:] if not evicted and not folded]
    assert any(evicted for _, evicted, _ in steps) and len(quiet) > 60
    assert sum(quiet) == 0, f"{sum(quiet)} host reads over {len(quiet)} steps that neither evict nor fold"
