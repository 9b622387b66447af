"""Weight-only quantized linears (`weights=`): products against the dequantized weight, 4-bit GGUF
blocks kept as they are, the per-tensor policy, whole models against float32, and the doors."""
import json

import pytest
import torch
import torch.nn.functional as F

import structkv
from structkv.models.quantized import INT4_GROUP, QuantizedLinear, _int4_groups, int4_or_int8


def bf16_product(x, w):
    """The reference the packed kernels compute: bf16 input times the weight, in float32."""
    return x.to(torch.bfloat16).float() @ w.t()


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("lead", [(1,), (2, 5)])
def test_product_equals_the_dequantized_weight(kind, lead):
    torch.manual_seed(0)
    w, bias = torch.randn(48, 64), torch.randn(48)
    lin = QuantizedLinear.from_weight(w, kind, bias, layout="packed")  # tiled: tests/test_tiled_linear.py
    x = torch.randn(*lead, 64)
    out = lin(x)
    assert out.shape == (*lead, 48) and out.dtype == torch.float32
    ref = bf16_product(x, lin.dequantize()) + bias
    tol = ref.abs().max().item() * 2**-7  # the kernels' bf16 output
    torch.testing.assert_close(out, ref, rtol=0, atol=tol)
    # and the codes stand for the weight: per-row int8 within half a step, 4-bit within half a group step
    step = {"bf16": w.abs().max() / 128, "int8": w.abs().amax(1, keepdim=True) / 127,
            "int4": (w.view(48, -1, INT4_GROUP).amax(-1) - w.view(48, -1, INT4_GROUP).amin(-1)).repeat_interleave(
                INT4_GROUP, 1) / 15}[kind]
    rounding = w.abs() * 2**-7  # bf16 scales, zero points and (int4) the kernel's bf16 output
    assert ((lin.dequantize() - w).abs() <= step * 0.51 + rounding).all()


def test_four_bit_blocks_are_kept_as_the_file_has_them():
    """Q4_1-style groups (w = m + d * q, q in 0..15, d and m exact in bf16) come back exactly."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (32, 2, INT4_GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans its whole range, as Q4_1's min/max blocks do
    d = (torch.rand(32, 2, 1, generator=g) * 0.01 + 0.001).to(torch.bfloat16).float()
    m = (-8 * d).to(torch.bfloat16).float()
    w = (m + d * q).view(32, 2 * INT4_GROUP)
    codes, table = _int4_groups(w)  # what gets packed: the file's codes, its step, its offset
    assert torch.equal(codes.view(32, 2, INT4_GROUP).float(), q)
    assert torch.equal(table[..., 0].t().float(), d[..., 0])
    assert torch.equal(table[..., 1].t().float(), (m + 8 * d)[..., 0].to(torch.bfloat16).float())


def test_int4_policy_follows_the_file():
    assert int4_or_int8((64, 64), None) == "int4"  # a float checkpoint: quantized at load
    assert int4_or_int8((64, 64), "F32") == "int4"
    assert int4_or_int8((64, 64), "Q4_K") == "int4" and int4_or_int8((64, 64), "Q4_1") == "int4"
    assert int4_or_int8((64, 64), "Q5_0") == "int8" and int4_or_int8((64, 64), "Q8_0") == "int8"
    assert int4_or_int8((64, 48), None) == "int8"  # no whole groups of 32: int8
    assert int4_or_int8((40, 64), None) == "int8"  # rows not a multiple of 16


def test_bad_kinds_and_shapes_are_refused():
    with pytest.raises(ValueError, match="weights must be one of"):
        structkv.load("random:tiny", weights="int3")
    with pytest.raises(ValueError, match="out_features % 16"):
        QuantizedLinear.from_weight(torch.randn(40, 64), "int4")


@pytest.mark.parametrize("weights,max_rel", [("bf16", 0.02), ("int8", 0.1), ("int4", 0.5)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_model_logits_stay_close_to_float32(tiny_dir, arch, weights, max_rel):
    ref = structkv.load(tiny_dir(arch))
    model = structkv.load(tiny_dir(arch), weights=weights)
    assert model.weights == weights and ref.weights == "fp32"
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids), model(ids)
    assert torch.isfinite(b).all()
    assert ((a - b).abs().max() / a.abs().max()).item() < max_rel
    kl = F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean").item() / 24
    assert kl < {"bf16": 1e-4, "int8": 2e-3, "int4": 3e-2}[weights]
    stored = sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype != torch.float32)
    float_bytes = sum(p.numel() * 4 for n, p in ref.named_parameters() if "proj" in n or "lm_head" in n)
    assert stored < float_bytes * {"bf16": 0.55, "int8": 0.3, "int4": 0.3}[weights]


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])  # qwen2: q/k/v biases
def test_fused_projections_compute_the_parts_numbers(tiny_dir, arch, weights):
    """q/k/v and gate/up as one product each (`fuse_projections`): the logits of the separate
    products, on a prompt and through decode, and the same greedy tokens."""
    from structkv.models.quantized import quantize_model

    fused = structkv.load(tiny_dir(arch), weights=weights)
    apart = structkv.load(tiny_dir(arch))
    quantize_model(apart, weights, fuse=False)
    for block, ref in zip(fused.model.layers, apart.model.layers):
        assert block.self_attn.qkv_proj.sizes == tuple(getattr(ref.self_attn, n).out_features
                                                      for n in ("q_proj", "k_proj", "v_proj"))
        assert block.mlp.gate_up_proj.kind == ref.mlp.gate_proj.kind and not hasattr(block.mlp, "up_proj")
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), apart(ids), rtol=1e-5, atol=1e-5)
    prompt = ids[0].tolist()
    a = structkv.generate(fused, prompt, max_new_tokens=6, stop_at_eos=False, compile=False)
    b = structkv.generate(apart, prompt, max_new_tokens=6, stop_at_eos=False, compile=False)
    assert a.token_ids == b.token_ids
    assert sum(m.nbytes() for m in fused.modules() if isinstance(m, QuantizedLinear)) == \
        sum(m.nbytes() for m in apart.modules() if isinstance(m, QuantizedLinear))


def test_tied_embedding_reads_the_head(tiny_dir):
    model = structkv.load(tiny_dir("qwen2"), weights="int8")  # qwen2 tiny ties its embeddings
    assert model.model.embed_tokens.table is model.lm_head
    ref = structkv.load(tiny_dir("qwen2"))
    ids = torch.tensor([[1, 5, 9]])
    torch.testing.assert_close(model.embed(ids), ref.embed(ids), rtol=0, atol=ref.lm_head.weight.abs().max() / 127)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_generation_and_compression_run_on_quantized_weights(tiny_dir, weights, compile):
    model = structkv.load(tiny_dir("gemma3_text"), weights=weights)
    ids = torch.randint(3, 96, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    eager = structkv.generate(model, ids, max_new_tokens=8, stop_at_eos=False, compile=False)
    out = structkv.generate(model, ids, max_new_tokens=8, stop_at_eos=False, compile=compile)
    assert out.token_ids == eager.token_ids
    for method in ("structkv", "snapkv"):
        res = structkv.generate(model, ids, max_new_tokens=4, stop_at_eos=False, compile=False,
                                method=structkv.methods.build(method, kv=0.5, struct=0.5))
        assert len(res.token_ids) == 4


def test_quantize_once_and_not_with_the_int8_head(tiny_dir):
    model = structkv.load(tiny_dir("llama"), weights="int8")
    assert model.quantize("int8") is model and model.weights == "int8"  # a model loaded with them: as it is
    with pytest.raises(ValueError, match="already int8"):
        model.quantize("int4")
    with pytest.raises(ValueError, match="needs the float head"):
        model.use_int8_head()


def test_cli_and_configs_take_weights(tiny_dir, byte_model_dir, tmp_path):
    from structkv.cli import main
    from structkv.harness.eval.runner import EvalConfig

    with pytest.raises(ValueError, match="weights must be one of"):
        EvalConfig(benchmark="ruler", weights="fp8")
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny_dir("llama")), "--weights", "int3", "-p", "x"])
    out = tmp_path / "b"  # bench: the transformers twin is built from the float weights, then quantized
    assert main(["bench", "--model", str(tiny_dir("llama")), "--methods", "full", "--lengths", "64", "--repeats", "1",
                 "--warmup", "0", "--new-tokens", "2", "--eager", "--weights", "int8", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["model"]["weights"] == "int8" and result["config"]["weights"] == "int8"
    assert main(["generate", "--model", str(byte_model_dir), "--weights", "int4", "--eager",
                 "--max-new-tokens", "3", "hello"]) == 0


@pytest.mark.parametrize("rows", [1, 130])  # the packed kernel and the unpacked GEMM
def test_ops_registration_and_both_paths(rows):
    from structkv.ops import int4_linear, int8_linear

    torch.manual_seed(3)
    w = torch.randn(32, 64)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    q8 = QuantizedLinear.from_weight(w, "int8", layout="packed")
    q4 = QuantizedLinear.from_weight(w, "int4", layout="packed")
    torch.library.opcheck(int8_linear, (x, q8.codes, q8.scales))
    torch.library.opcheck(int4_linear, (x, q4.packed, q4.scale_zero, INT4_GROUP))
    for lin, out in ((q8, int8_linear(x, q8.codes, q8.scales)), (q4, int4_linear(x, q4.packed, q4.scale_zero,
                                                                                 INT4_GROUP))):
        ref = x.float() @ lin.dequantize().t()
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 2**-6)


def test_a_gguf_records_its_storage_types(tmp_path, monkeypatch):
    """The conversion keeps each tensor's GGUF type beside the converted weights (an older cache
    reads them from the file once), and int4 follows them."""
    pytest.importorskip("gguf")
    from conftest import write_tiny_gemma_gguf

    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gemma_gguf(tmp_path / "tiny.gguf")
    model = structkv.load(path)
    assert model.source_types["model.layers.0.self_attn.q_proj.weight"] == "F32"
    saved = next((tmp_path / "cache").glob("tiny-*/tensor_types.json"))
    saved.unlink()  # a cache made before the types were recorded
    assert structkv.load(path).source_types == model.source_types and saved.exists()
    model.source_types = {k: "Q5_0" if "mlp" in k else "Q4_K" for k in model.source_types}
    model.quantize("int4")
    kinds = {type(m).__name__ + ":" + m.kind for m in model.modules() if hasattr(m, "kind")}
    assert kinds >= {"QuantizedLinear:int8"}
    block = model.model.layers[0]
    assert block.mlp.gate_up_proj.kind == block.mlp.down_proj.kind == "int8"  # gate and up: one product
    assert block.mlp.gate_up_proj.sizes == (model.config.intermediate_size,) * 2
    attn = block.self_attn
    products = [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
    assert all(p.kind == ("int4" if p.out_features % 16 == 0 else "int8") for p in products)


@pytest.mark.parametrize("head", [False, True])
def test_compiled_one_row_int8_reads_the_codes_in_float32(head):
    """A compiled decode step's one int8 row runs `int8_row_fused` (the LM head: `int8_head_logits`,
    a graph of its own): the float32 product with the dequantized weight (no bf16 rounding of x)."""
    torch.manual_seed(4)
    lin = QuantizedLinear.from_weight(torch.randn(40, 96), "int8", torch.randn(40), head=head, layout="packed")
    x = torch.randn(1, 1, 96)
    step = torch.compile(lambda x: lin(x) * 2, fullgraph=True, dynamic=False)
    ref = (x.reshape(1, 96) @ lin.dequantize().t()).view(1, 1, 40) + lin.bias
    torch.testing.assert_close(step(x), ref * 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x), ref, rtol=0, atol=ref.abs().max().item() * 2**-7)  # eager: the packed kernel


@pytest.mark.parametrize("N,K", [(128, 64), (64, 96), (48, 64)])
def test_int4_weight_read_from_the_bytes_equals_the_kernel(N, K):
    """`int4_weight` reads the codes straight from the AVX-512 packing where this build uses it (48
    rows: not whole 64-row blocks, so the kernel on the identity): bit-equal to what the packed
    kernel multiplies by, which the identity product gives."""
    from structkv.ops import quantized_linear as Q

    w = torch.randn(N, K)
    lin = QuantizedLinear.from_weight(w, "int4", layout="packed")
    eye = torch.eye(K, dtype=torch.bfloat16)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, lin.packed, INT4_GROUP, lin.scale_zero).t()  # (N, K)
    assert torch.equal(Q.int4_weight(lin.packed, lin.scale_zero, INT4_GROUP, K), kernel)
    if Q.avx512_packing() and N % Q.AVX512_ROWS == 0:  # the direct read ran: its codes are the packed ones
        assert torch.equal(Q.avx512_codes(lin.packed, N, K).int(), _int4_groups(w)[0])


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_huge_page_arena_keeps_every_buffer_and_the_numbers(monkeypatch, tiny_dir, weights):
    """`place_on_huge_pages` (run by quantize_model on CPU where the kernel has transparent huge
    pages): the quantized buffers become views of one arena with their shapes, dtypes and values,
    a tied head and embedding stay one tensor, and greedy tokens equal those of a model left on
    its own allocations (STRUCTKV_HUGE_PAGES=0)."""
    from structkv.models import huge_pages
    from structkv.models.quantized import QuantizedLinear

    ids = torch.randint(3, 90, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    monkeypatch.setenv("STRUCTKV_HUGE_PAGES", "0")
    plain = structkv.load(tiny_dir("gemma3_text"), weights=weights)
    want = structkv.generate(plain, ids, max_new_tokens=6).token_ids
    assert huge_pages.place_on_huge_pages(plain, (QuantizedLinear,), minimum=0) == 0  # turned off: untouched
    monkeypatch.setenv("STRUCTKV_HUGE_PAGES", "1")
    if not huge_pages.enabled():
        pytest.skip(f"no transparent huge pages here (mode {huge_pages.thp_mode()})")
    model = structkv.load(tiny_dir("gemma3_text"), weights=weights)
    before = {n: b.clone() for n, b in model.named_buffers()}
    moved = huge_pages.place_on_huge_pages(model, (QuantizedLinear,), minimum=0)
    assert moved > 0
    storages = {b.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, QuantizedLinear)
                for b in m.buffers()}
    assert len(storages) == 1  # one arena
    for n, b in model.named_buffers():
        assert b.dtype == before[n].dtype and torch.equal(b, before[n]), n
    assert model.lm_head.tiles is model.model.embed_tokens.table.tiles  # tied: still one tensor
    assert structkv.generate(model, ids, max_new_tokens=6).token_ids == want
