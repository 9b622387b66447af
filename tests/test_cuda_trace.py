"""The CUDA path traced on this CPU-only torch (tests/cuda_shim.py): tiny dense and hybrid models
loaded to "cuda" in bf16 run the prompt pass, every method family's compressed prefill, generate
with each KV kind, recall from archives in memory and on disk, and the KV bound. Each trace
asserts no op mixes devices, the answer equals the same run on the CPU, the decode step reads
nothing back to the host, and the prefill reads at most its stated budget.

The Triton kernels cannot launch here: their wrappers are swapped for the references they are
tested against (tests/test_triton_interpret.py, tests/test_triton_aot.py). Compiled graphs are not
traced (compile=False).
"""
import collections

import pytest
import torch
import torch.nn.functional as F
from cuda_shim import CpuOnlyOp, cuda_trace

import structkv
from structkv import methods

pytest.importorskip("triton", reason="triton is not installed")
triton_kernels = pytest.importorskip("structkv.ops.triton_kernels")

ARCHS = ["llama", "gemma3_text"]
FAMILIES = [  # one method of each family
    ("full", {}), ("snapkv", {"kv_budget": 0.2}), ("streaming_llm", {"kv_budget": 0.3}), ("h2o", {"kv_budget": 0.2}),
    ("fastkv", {"kv_budget": 0.2, "tsp_layer": 1}), ("gemfilter", {"kv_budget": 0.2}),
    ("structkv", {"kv_budget": 0.2}), ("structkv_paper", {"kv_budget": 0.2}), ("kvzip", {"kv_budget": 0.3}),
    ("structkv_agnostic_union", {"kv_budget": 0.2}),
]


@pytest.fixture(autouse=True)
def references_for_kernels(monkeypatch):
    """The ops' CUDA branches call the references (with any `splits` argument dropped)."""
    from structkv.ops import compact_kv_reference, window_scores_reference
    from structkv.ops.kv_quant import quantized_decode_attention_reference

    monkeypatch.setattr(triton_kernels, "window_scores_triton",
                        lambda q, k, qp, kp, scale, win, cap, entropy=True, splits=None:
                        window_scores_reference(q, k, qp, kp, scale, win, cap, entropy=entropy))
    monkeypatch.setattr(triton_kernels, "compact_kv_triton", compact_kv_reference)
    monkeypatch.setattr(triton_kernels, "quantized_decode_attention_triton",
                        lambda q, k, v, mask, scale, kind, splits=None:
                        quantized_decode_attention_reference(q, k, v, mask, scale, kind))


@pytest.fixture(autouse=True)
def cpu_runs_the_cuda_kernels(monkeypatch):
    """The CPU reference runs decode attention as CUDA does (SDPA or the quantized reference, one
    key range), not through the C decode kernel or split ranges, so answers compare exactly."""
    from structkv.ops import attention, cpu_decode

    monkeypatch.setattr(cpu_decode, "available", lambda: False)
    monkeypatch.setattr(attention, "decode_splits", lambda k, threads: 1)


@pytest.fixture(autouse=True)
def sdpa_calls(monkeypatch):
    """Every SDPA call's (device, query heads, key heads, masked): CUDA runs a masked call with
    fewer key heads than query heads on the math kernel, which materialises the scores."""
    calls = []
    real = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, *a, **kw):
        calls.append((q.device.type, q.shape[1], k.shape[1], attn_mask is not None))
        return real(q, k, v, attn_mask, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    return calls


def _no_masked_gqa_on_cuda(calls):
    bad = [c for c in calls if c[0] == "cuda" and c[3] and c[2] != c[1]]
    assert not bad, f"{len(bad)} masked grouped-query SDPA calls on CUDA (math kernel): {bad[:3]}"


def _load(tiny_dir, arch, device, **kw):
    return structkv.load(tiny_dir(arch), device=device, dtype=torch.bfloat16, **kw)


def _tokens(device):
    return torch.randint(3, 96, (70,), generator=torch.Generator().manual_seed(1)).to(device)


def _run(tiny_dir, arch, device, method, max_new_tokens=6, kv_dtype=None, **kw):
    model = _load(tiny_dir, arch, device, kv_dtype=kv_dtype)
    out = structkv.generate(model, _tokens(device), max_new_tokens=max_new_tokens, method=method, compile=False,
                            stop_at_eos=False, **kw)
    return out.token_ids


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name, options", FAMILIES)
def test_compressed_generate_on_cuda(tiny_dir, sdpa_calls, arch, name, options):
    want = _run(tiny_dir, arch, "cpu", methods.get(name, **options))
    with cuda_trace():
        got = _run(tiny_dir, arch, "cuda", methods.get(name, **options))
    assert got == want
    _no_masked_gqa_on_cuda(sdpa_calls)


def _reads(counts, since=0):
    return collections.Counter(counts.host_reads[since:])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_dtype", [None, "bf16", "int8", "int4"])
def test_decode_steps_read_nothing_back(tiny_dir, arch, kv_dtype):
    """Twelve decoded tokens read the host exactly as often as four: the decode step itself reads
    nothing (no stop check without an end token; the stats after the loop are the same)."""
    method = methods.get("structkv", kv_budget=0.2)
    want = _run(tiny_dir, arch, "cpu", method, max_new_tokens=12, kv_dtype=kv_dtype)
    reads = {}
    for n in (4, 12):
        with cuda_trace() as counts:
            model = _load(tiny_dir, arch, "cuda", kv_dtype=kv_dtype)
            mark = counts.mark()
            out = structkv.generate(model, _tokens("cuda"), max_new_tokens=n, method=method, compile=False,
                                    stop_at_eos=False)
        reads[n] = _reads(counts, mark)
    assert reads[12] == reads[4]
    assert out.token_ids == want


PREFILL_READS = 12  # the prompt's ids and lengths, one per selection (budgets, kept counts), one per
# set of positions (`rows_in_order`), the stats (entries, lengths) and the timer's two synchronizes
EXTRA_READS = {"gemfilter": 8, "kvzip": 3}  # GemFilter runs a second pass; KVzip reads each row's tokens
PROPAGATION_READS = 5  # FastKV / StructKV select the tokens that go on: a second selection and order
# check, and StructKV seeds the decode's carried centrality


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name, options", FAMILIES)
def test_prefill_reads_within_budget(tiny_dir, arch, name, options):
    """A compressed prefill reads the host a fixed number of times whatever the depth, plus the
    reads its stats count (`host_syncs`: a dynamic pivot reads each observed layer's curve)."""
    with cuda_trace() as counts:
        model = _load(tiny_dir, arch, "cuda")
        mark = counts.mark()
        state = structkv.prefill(model, _tokens("cuda"), methods.get(name, **options))
    reads = _reads(counts, mark)
    propagates = name.startswith(("fastkv", "structkv"))
    budget = PREFILL_READS + EXTRA_READS.get(name, 0) + PROPAGATION_READS * propagates + state.stats.host_syncs
    assert sum(reads.values()) <= budget, reads


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("on_disk", [False, True])
def test_recall_from_archives_on_cuda(tiny_dir, tmp_path, arch, on_disk):
    """A context compressed once with an int4 archive (in memory, or a file written from host
    copies), then a question that recalls from it: each archived layer goes to the queries'
    device on a side stream (pinned host memory for a file's), and the question's stream waits
    for each copy, for every question (the first, and each one a step reads)."""
    method = methods.get("structkv_agnostic_union", kv_budget=0.2)

    def ask(device, folder):
        model = _load(tiny_dir, arch, device)
        state = structkv.prefill(model, _tokens(device), method, archive="int4", archive_dir=folder)
        question = torch.arange(5, 12).to(device)
        return structkv.generate(model, question, state=state, recall=0.3, max_new_tokens=4, compile=False,
                                 stop_at_eos=False).token_ids

    want = ask("cpu", tmp_path / "cpu" if on_disk else None)
    with cuda_trace() as counts:
        got = ask("cuda", tmp_path / "cuda" if on_disk else None)
    assert got == want
    archived = len(_load(tiny_dir, arch, "cpu").config.full_attention_layers)
    assert counts.stream_waits >= archived, counts.stream_waits


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_bound_reads_only_when_it_evicts_or_folds(tiny_dir, monkeypatch, arch):
    """`max_kv_tokens` on CUDA: a decode step reads the host only when the bound evicts (every few
    tokens) or folds the recent queries into the carried centrality (every QUERY_WINDOW positions),
    plus once at the first step; never once per layer per token."""
    from structkv.modules import decode_bound

    steps = []  # (host reads, evicted) per decode step
    before, after = decode_bound.BoundedDecode.before_step, decode_bound.BoundedDecode.after_step

    def step_before(self):
        self._mark, self._evictions = len(counts.host_reads), self.evictions
        before(self)

    def step_after(self):
        after(self)
        steps.append((len(counts.host_reads) - self._mark, self.evictions > self._evictions))

    monkeypatch.setattr(decode_bound.BoundedDecode, "before_step", step_before)
    monkeypatch.setattr(decode_bound.BoundedDecode, "after_step", step_after)
    with cuda_trace() as counts:
        model = _load(tiny_dir, arch, "cuda")
        structkv.generate(model, _tokens("cuda"), max_new_tokens=40, method=methods.get("structkv", kv_budget=0.2),
                          compile=False, stop_at_eos=False, max_kv_tokens=40)
    quiet = [reads for reads, evicted in steps if not evicted]
    assert sum(1 for e in steps if e[1]) >= 2  # the bound did evict
    assert sum(1 for r in quiet if r) <= 1 + len(steps) // decode_bound.QUERY_WINDOW + 1, steps


def test_every_structkv_op_has_a_fake_and_cpu_only_ones_are_caught(monkeypatch):
    """Every `structkv::` op has a fake implementation (a compiled graph or FakeTensorMode needs one),
    and the trace refuses a CPU-only kernel (the C++ decode and tiled products) given cuda:0 tensors."""
    from torch._library.simple_registry import singleton

    from structkv.ops import cpu_decode, tiled_linear

    monkeypatch.undo()  # the real `available`, not the fixture's stand-in
    cpu_decode.available(), tiled_linear.available()  # their C++ ops register on first use
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("structkv::")]
    assert len(names) >= 10, names
    assert [n for n in names if singleton.find(n).fake_impl.kernel is None] == []
    if not cpu_decode.available():
        pytest.skip("the C decode kernel did not build here")
    with cuda_trace():
        q, k = torch.zeros(1, 2, 1, 64, device="cuda"), torch.zeros(1, 1, 8, 64, device="cuda")
        mask = torch.ones(1, 1, 1, 8, dtype=torch.bool, device="cuda")
        with pytest.raises(CpuOnlyOp):
            torch.ops.structkv.cpu_decode_attention(q, [k], [k], mask, 0.125, "float", 1)
