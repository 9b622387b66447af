"""The design-card modules stand alone: each an nn.Module with a forward, tensor state in buffers
that move with `.to()` (also through the compressor that composes them), explicit sizes for the
cache, their own conventions, one validated StructKV config."""
import torch
from torch import nn

from structkv.modules import CentralityTracker, LayerView, PivotDetector, SkeletonPruner, pooled_saliency
from structkv.modules.budgeted_cache import BudgetedKVCache
from structkv.ops import window_scores


def test_tracker_state_is_a_buffer_that_moves():
    tr = CentralityTracker(decay=0.5).to(torch.float64)
    tr.reset(2, 6)
    tr.to(torch.float64)
    assert tr.value.dtype == torch.float64 and "value" in dict(tr.named_buffers())
    assert "value" not in tr.state_dict()  # per-prompt state: not part of a checkpoint


def test_every_module_is_an_nn_module_composed_by_the_compressor():
    from structkv.modules import StructKVCompressor, StructKVConfig

    for module in (CentralityTracker(), PivotDetector(10, list(range(10))), SkeletonPruner(4),
                   BudgetedKVCache(1, 2, 8, [16], [None], torch.float32, "cpu")):
        assert isinstance(module, nn.Module) and type(module).forward is not nn.Module.forward
    comp = StructKVCompressor(10, list(range(10)), [6], StructKVConfig(window=4)).begin(12)
    assert {name for name, _ in comp.named_children()} == {"pruner", "tracker", "detector"}
    comp.to(torch.float64)
    assert comp.tracker.value.dtype == torch.float64  # the tracker's C moves with the compressor


def test_forward_is_the_modules_one_call():
    """tracker(s, cols) = observe, pruner(scores, valid, keep) = select, detector(layer, ...) = observe_scores."""
    g = torch.Generator().manual_seed(3)
    sal, cols = torch.rand(2, 2, 20, generator=g), torch.arange(20).expand(2, -1)
    a, b = CentralityTracker(window=4), CentralityTracker(window=4)
    a.reset(2, 20)
    b.reset(2, 20)
    assert torch.equal(a(sal, cols, layer=1), b.observe(sal, cols, layer=1))
    valid = torch.ones(2, 20, dtype=torch.bool)
    scores = sal.sum(1)  # (B, n)
    assert torch.equal(SkeletonPruner(4)(scores, valid, [8, 10]), SkeletonPruner(4).select(scores, valid, [8, 10]))
    d, e = PivotDetector(8, list(range(8))), PivotDetector(8, list(range(8)))
    d.reset(2)
    e.reset(2)
    assert d(3, sal, cols, 4, [20, 20]) == e.observe_scores(3, sal, cols, 4)
    assert d.traces[0].stats == e.traces[0].stats  # the known lengths give the statistics read back


def test_structkv_config_is_validated_once_for_method_and_compressor():
    import pytest

    from structkv import methods
    from structkv.modules import StructKVConfig

    method = methods.get("structkv", decay=0.5, skeleton="union")
    assert method.settings() == StructKVConfig(decay=0.5, skeleton="union", guide=method.guide,
                                               window=method.window, kernel=method.kernel, pooling=method.pooling)
    for bad, message in (({"decay": 2.0}, "decay must be in"), ({"skeleton": "x"}, "skeleton must be"),
                         ({"confirm": 0}, "confirm must be"), ({"weights": (0, 0, 0)}, "weights must be")):
        with pytest.raises(ValueError, match=message):
            StructKVConfig(**bad)
        with pytest.raises(ValueError, match="structkv: " + message):
            methods.get("structkv", **bad)


def test_structkv_settings_are_declared_once():
    """The method's structural options are `Structure`'s fields, inherited, not redeclared; the
    config built from them is a read-only value (lists from JSON become tuples)."""
    import dataclasses

    import pytest

    from structkv import methods
    from structkv.modules.structkv_config import STRUCTURE, StructKVConfig, Structure

    own = set(methods.StructKV.__annotations__)
    assert not own & set(STRUCTURE), "StructKV redeclares a Structure field"
    assert issubclass(methods.StructKV, Structure) and issubclass(StructKVConfig, Structure)
    method = methods.get("structkv_agnostic", weights=[1, 0, 0])
    config = method.settings(3)
    assert {n: getattr(config, n) for n in STRUCTURE} == {n: getattr(method, n) for n in STRUCTURE} | {
        "weights": (1, 0, 0)}
    assert config.pivot == 3 and config.signal == "novelty"
    with pytest.raises(dataclasses.FrozenInstanceError, match="read-only"):
        config.decay = 0.1
    assert dataclasses.replace(config, decay=0.1).decay == 0.1 and hash(config) == hash(method.settings(3))
    with pytest.raises(ValueError, match="decay must be in"):
        dataclasses.replace(config, decay=-1)


def test_tracker_observe_owns_structkvs_convention():
    """observe(saliency) = update(pooled saliency over non-window tokens, summed over KV heads, / w)."""
    g = torch.Generator().manual_seed(0)
    sal = torch.rand(1, 2, 20, generator=g)
    cols = torch.arange(20)[None]
    a, b = CentralityTracker(0.9, window=4, kernel=3, pooling="max"), CentralityTracker(0.9)
    a.reset(1, 20)
    b.reset(1, 20)
    a.observe(sal, cols)
    b.update(pooled_saliency(sal, 4, 3, "max").sum(1) / 4, cols)
    assert torch.equal(a.value, b.value) and (a.value[0, -4:] == 0).all()  # window columns never ranked


def test_detector_computes_its_own_statistics_from_window_scores():
    from structkv.modules.pivot import ranked_mask

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 30, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g)
    pos = torch.arange(30)[None]
    sal = window_scores(q[:, :, -6:], k, pos[:, -6:].contiguous(), pos, scale=0.35)
    a, b = PivotDetector(8, list(range(8))), PivotDetector(8, list(range(8)))
    a.reset(1)
    b.reset(1)
    a.observe_scores(3, sal, pos, window=6)
    b.observe(3, PivotDetector.statistics(sal, ranked_mask(pos, 6, b.sinks), b.topk_ratio))
    assert a.traces[0].stats == b.traces[0].stats


def test_budgeted_cache_takes_explicit_sizes():
    cache = BudgetedKVCache(2, 3, 16, [64, 128, 8], [None, None, 8], torch.float32, "cpu")
    assert [layer.capacity for layer in cache.layers] == [64, 128, 8]
    assert [layer.sliding_window for layer in cache.layers] == [None, None, 8]
    k = torch.randn(2, 3, 10, 16)
    pos = torch.arange(10).expand(2, 10)
    idx = torch.tensor([[0, 4, 9]]).expand(2, 3, 3)
    cache.fill(0, k, k, pos, idx)
    assert cache.entries()[0] == 2 * 3 * 3 and cache.nbytes()[0] == 2 * 3 * 3 * 2 * 16 * 4
    assert cache.nbytes(used=False)[0] == 2 * 3 * 64 * 2 * 16 * 4


def test_layer_view_memoises_scores():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 4, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    view = LayerView(0, q, k, k, torch.arange(12)[None], torch.arange(12)[None], 0.35)
    first = view.window_scores(4)
    again = view.window_scores(4)
    assert first is again and view.used == {("window", 4)}
