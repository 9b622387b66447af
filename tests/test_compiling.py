"""structkv.util.compiling.compiled: one compiled callable per function, and a call past dynamo's
recompile limit runs eager instead of failing (a long evaluation meets hundreds of cache shapes)."""
import pytest
import torch

from structkv.util import compiling


def _scaled_sum(x: torch.Tensor) -> torch.Tensor:
    return (2 * x).sum(-1)


def test_past_the_recompile_limit_runs_eager(monkeypatch):
    monkeypatch.setattr(compiling, "RECOMPILE_LIMIT", 2)
    monkeypatch.setattr(compiling, "_COMPILED", {})  # this test's own registry
    f = compiling.compiled(_scaled_sum, backend="eager", fullgraph=True, dynamic=False)
    assert compiling.compiled(_scaled_sum, backend="eager", fullgraph=True, dynamic=False) is f
    for n in range(1, 7):  # static shapes: every new length is a recompile, 4 past the limit
        x = torch.arange(float(n))
        torch.testing.assert_close(f(x), _scaled_sum(x))
    raw = torch.compile(lambda x: (2 * x).sum(-1), backend="eager", fullgraph=True, dynamic=False)  # own code
    with torch._dynamo.config.patch(recompile_limit=2):  # what the wrapper saves the caller from
        raw(torch.ones(1))
        raw(torch.ones(2))
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # else the fallback is dead code
            raw(torch.ones(3))


def test_model_guards_are_the_ones_dropped():
    """The decode step's guard filter drops what dynamo checks on the model argument (the cost that
    grows with the layer count) and keeps the cache's, the inputs' and the globals'."""
    on_model = ["model", "model._modules['model']._modules['layers']", "model._buffers['inv_freq']",
                "dict(type(model).__dict__)['forward'].__code__", "type(model)"]
    kept = ["cache._modules['layers']", "tokens", "positions", "G['__import_structkv_dot_models_dot_decoder']",
            "models", "model_2", ""]
    assert all(compiling._ON_MODEL.match(n) for n in on_model)
    assert not any(compiling._ON_MODEL.match(n) for n in kept)


def test_compiled_decode_per_model_structure(tiny_dir):
    """Without dynamo's guards on the model, two models of different structure in one process each
    get their own graph (their greedy tokens match eager decode), models of one structure share one, and
    an in-place conversion (quantize) changes the key."""
    import structkv
    from structkv.models.quantized import quantize_model
    from structkv.runtime.decoding import decode_step

    llama, qwen = structkv.load(str(tiny_dir("llama"))), structkv.load(str(tiny_dir("qwen2")))
    twin = structkv.load(str(tiny_dir("llama")))
    assert compiling.structure_key(llama) == compiling.structure_key(twin) != compiling.structure_key(qwen)
    ids = list(range(3, 40))
    for model in (llama, qwen, twin):
        eager = structkv.generate(model, ids, max_new_tokens=6, stop_at_eos=False, compile=False)
        done = structkv.generate(model, ids, max_new_tokens=6, stop_at_eos=False, compile="eager")
        assert done.token_ids == eager.token_ids
    copies = {tag for fn, tag in compiling._OWN_CODE if fn is decode_step}
    assert {compiling.structure_key(llama), compiling.structure_key(qwen)} <= copies  # twin: llama's
    before = compiling.structure_key(twin)
    quantize_model(twin, "int8")
    assert compiling.structure_key(twin) != before


def test_structure_key_sees_plain_attributes(tiny_dir):
    """A plain attribute a graph could bake in (a number, a flag, a dict's items) changes the key;
    forgetting is what an in-place change must do."""
    import structkv

    model = structkv.load(str(tiny_dir("llama")))
    key = compiling.structure_key(model)
    model.model.layers[0].self_attn.extra = {"window": 8}
    assert compiling.structure_key(model) == key  # cached until forgotten
    compiling.forget_structure(model)
    changed = compiling.structure_key(model)
    assert changed != key
    model.model.layers[0].self_attn.extra = {"window": 16}
    compiling.forget_structure(model)
    assert compiling.structure_key(model) not in (key, changed)


@pytest.mark.parametrize("device, graphs", [("cuda", True), ("cpu", False)])
def test_static_decode_step_replays_as_a_cuda_graph_on_cuda(monkeypatch, tiny_dir, device, graphs):
    """The static decode step is compiled with inductor's CUDA graphs on CUDA, not on CPU, and a
    batch whose rows come and go (its shapes vary) never is. Checked by the options torch.compile
    receives: no GPU here to replay one."""
    import structkv
    from structkv.runtime import decoding

    seen = []

    def record(fn, **kw):
        seen.append(kw.get("options", {}))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    monkeypatch.setattr(compiling, "_COMPILED", {})
    model = structkv.load(str(tiny_dir("llama")))
    cache = structkv.models.StaticKVCache(model.config, 1, 16, model.dtype, model.device)
    tokens, positions = torch.tensor([[5]]), torch.tensor([[0]])
    decoding.step_function("inductor", device=device)(model, tokens, positions, cache)
    assert bool(seen[-1].get("triton.cudagraphs")) is graphs
    decoding.step_function("inductor", rows_vary=True, device=device)(model, tokens, positions + 1, cache)
    assert not seen[-1].get("triton.cudagraphs")


@pytest.mark.parametrize("kv_dtype", [None, "bf16", "int8", "int4"])
def test_batch_step_sources_name_every_cache_buffer(tiny_dir, kv_dtype):
    """Serve's batch step marks the rows (dim 0) and capacity (dim 2) of the cache's buffers dynamic
    by name (`decoding.ROWS_AND_CAPACITY`): a buffer renamed or added with a capacity dimension and
    not named there would bring back a recompile per join and leave, silently."""
    import re

    import structkv
    from structkv.runtime import decoding

    model = structkv.load(str(tiny_dir("llama")))
    cache = structkv.models.StaticKVCache(model.config, 2, 64, model.dtype, model.device, kv_dtype)
    cache.layers[0].keep_queries(32, 4)  # the KV bound's query ring and carried centrality, when on
    cache.layers[0].carry_centrality(64)
    patterns = decoding.ROWS_AND_CAPACITY.split(",")

    def dynamic(source):
        return any(re.fullmatch(p, source) for p in patterns)

    for i, layer in enumerate(cache.layers):
        for name, buf in layer.named_buffers():
            source = f"L['cache']._modules['layers']._modules['{i}']._buffers['{name}']"
            if buf.dim() >= 1 and buf.shape[0] == 2:
                assert dynamic(f"{source}:0"), name
            if buf.dim() >= 3 and buf.shape[2] == 64:
                assert dynamic(f"{source}:2"), name
