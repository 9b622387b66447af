"""structkv.compiling.compiled: one compiled callable per function, and a call past dynamo's
recompile limit runs eager instead of failing (a long evaluation meets hundreds of cache shapes)."""
import pytest
import torch

from structkv import compiling


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
