"""StructKV added to a decoder that is not structkv's, through the public API only.

`Mini` is a small Llama written here from scratch: its own module names, its own RoPE (complex
rotation of the two halves of each head), its own attention (explicit masked softmax). It loads
the weights of a structkv model, and the glue that adds StructKV to it is the 7 lines marked
`# glue` (6 in prefill, 1 in decode: the cache is one call). The result must equal `structkv.generate` on the same
weights: pivot, kept positions per layer, logits, greedy tokens.
"""
import math

import pytest
import torch
from torch import nn

import structkv
from structkv import methods
from structkv.methods import Layout
from structkv.modules import LayerView


def norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Mini(nn.Module):
    """A Llama: weights in plain parameter lists, not HF's module tree."""

    def __init__(self, sd: dict, n_heads: int, n_kv: int, theta: float, eps: float):
        super().__init__()
        self.n_heads, self.n_kv, self.eps = n_heads, n_kv, eps
        self.emb = sd["model.embed_tokens.weight"]
        self.out_norm, self.head = sd["model.norm.weight"], sd["lm_head.weight"]
        names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
        n = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers."))
        self.blocks = [[sd[f"model.layers.{i}.{name}.weight"] for name in names] for i in range(n)]
        self.dim = self.emb.shape[1] // n_heads
        self.freq = theta ** (-torch.arange(0, self.dim, 2).float() / self.dim)  # (D/2,)

    def rotate(self, x, pos):
        """x (B, H, n, D) at positions (B, n): the halves as real and imaginary parts, turned."""
        half = x.shape[-1] // 2
        z = torch.complex(x[..., :half].float(), x[..., half:].float())
        z = z * torch.polar(torch.ones(()), pos[:, None, :, None].float() * self.freq)
        return torch.cat([z.real, z.imag], -1).to(x.dtype)

    def qkv(self, i, h, pos):
        wq, wk, wv, *_ = self.blocks[i]
        x = norm(h, self.blocks[i][7], self.eps)
        B, n, _ = x.shape
        split = lambda t, heads: t.view(B, n, heads, self.dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(x @ wq.T, self.n_heads), split(x @ wk.T, self.n_kv), split(x @ wv.T, self.n_kv)
        return self.rotate(q, pos), self.rotate(k, pos), v

    def attend(self, q, k, v, q_pos, k_pos):
        """Masked softmax attention by positions (B, Hkv, T) or (B, T); -1 = empty."""
        g = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        k_pos = k_pos.repeat_interleave(g, 1)[:, :, None, :] if k_pos.dim() == 3 else k_pos[:, None, None, :]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.dim)
        scores = scores.masked_fill((k_pos < 0) | (k_pos > q_pos[:, None, :, None]), float("-inf"))
        out = scores.softmax(-1) @ v  # (B, Hq, n, D)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def finish(self, i, h, attn):
        *_, wo, wg, wu, wd, _, n2 = self.blocks[i]
        h = h + attn @ wo.T
        x = norm(h, n2, self.eps)
        return h + (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T

    def logits(self, h):
        return norm(h, self.out_norm, self.eps) @ self.head.T


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-6, rope_theta=10000.0)
    path = tmp_path_factory.mktemp("mini")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    model = structkv.load(path)
    return model, Mini(dict(model.state_dict()), 4, 2, 10000.0, 1e-6)


@torch.inference_mode()
def run_mini(mini, ids, method, room):
    """Mini's own prefill and greedy decode, with StructKV added through the public API."""
    S, L = len(ids), len(mini.blocks)
    pos, tokens = torch.arange(S)[None], torch.tensor([ids])
    h = mini.emb[tokens]
    run = structkv.prepare(method, Layout(L, list(range(L))), torch.tensor([S]), mini.n_kv, mini.dim, room)  # glue
    cols = torch.arange(S)[None]  # glue
    for i in range(L):
        q, k, v = mini.qkv(i, h, pos)
        h = mini.finish(i, h, mini.attend(q, k, v, pos, pos))
        kept = run.layer(LayerView(i, q, k, v, pos, cols, 1 / math.sqrt(mini.dim)))  # glue
        if kept is not None:  # glue
            h, cols, pos = run.prop.pruner.gather(kept, h, cols, positions=pos)  # glue
    run.finish()  # glue
    cache, comp = run.cache, run.prop
    logits = mini.logits(h[:, -1])
    out, next_pos = [int(logits.argmax())], S
    for _ in range(room - 1):
        h = mini.emb[torch.tensor([[out[-1]]])]
        p = torch.tensor([[next_pos]])
        for i in range(L):
            q, k, v = mini.qkv(i, h, p)
            k, v, kv_pos = cache(i, k, v, p)  # glue
            h = mini.finish(i, h, mini.attend(q, k, v, p, kv_pos))
        out.append(int(mini.logits(h[:, -1]).argmax()))
        next_pos += 1
    return logits, out, comp, cache


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_structkv_in_a_foreign_decoder_equals_structkv_generate(pair, seed):
    model, mini = pair
    ids = torch.randint(3, 96, (300,), generator=torch.Generator().manual_seed(seed)).tolist()
    method = methods.get("structkv", kv_budget=0.2, struct_budget=0.3)
    logits, tokens, comp, cache = run_mini(mini, ids, method, room=8)
    ref = structkv.generate(model, ids, method=method, max_new_tokens=8, stop_at_eos=False, compile=False)
    state = structkv.prefill(model, ids, method, room=8)
    assert comp.pivots[0] == ref.stats["pivot_layer"] == state.stats.pivot_layer
    assert ref.stats["prefill_fraction"] < 1.0  # the skeleton really propagated
    for mine, theirs in zip(cache.layers, state.cache.layers):
        assert torch.equal(mine.pos[:, :, : int(theirs.cursor)], theirs.pos[:, :, : int(theirs.cursor)])
    torch.testing.assert_close(logits, state.logits, rtol=0, atol=1e-5)
    assert tokens == ref.token_ids


def test_glue_is_short():
    """The glue really is what the module docstring says: 7 lines through the public API."""
    import inspect

    assert sum("# glue" in line for line in inspect.getsource(run_mini).splitlines()) == 7
