"""Ask-time recall: the archive of evicted entries and a question's re-selection from it.

The reference is query-aware SnapKV on the whole prompt (context, then the question as its
observation window): with the archive in float, what a question recalls is exactly what SnapKV
keeps, and the question reads as it would with the full cache."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.models.archive import ArchiveError, open_archive
from structkv.modules.recall import KERNEL
from structkv.runtime.compress import compress
from structkv.runtime.generation import _extend_state
from structkv.text.prompts import encode_batch


def _ids(n, seed=0):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def model(request, tiny_dir):
    return structkv.load(tiny_dir(request.param))


def _state(model, ids, method, archive="float", room=32, recall=30):
    tokens, positions, _ = encode_batch(model, [ids])
    state = compress(model, tokens, positions, method, room=room, archive=archive)
    state.recall = recall
    return state


def _heads(pos, below):
    """Per KV head of row 0, the set of positions < below in pos (B, Hkv, C)."""
    return [set(h[(h >= 0) & (h < below)].tolist()) for h in pos[0]]


@pytest.mark.parametrize("name", ["keydiff", "structkv_agnostic_union", "streaming_llm"])
def test_recall_with_a_float_archive_equals_query_aware_snapkv(model, name):
    """Every layer up to the pivot (every layer without propagation) recalls exactly SnapKV's
    entries per KV head (SnapKV pooled as recall pools), and the answer's cache holds them plus the
    hot set."""
    from structkv.modules.recall import recall_extend

    ids, question, recall = _ids(120), torch.tensor([[7, 8, 9, 10, 11]]), 30
    state = _state(model, ids, methods.get(name, kv_budget=40), recall=recall)
    cache, _, done = recall_extend(model, state, question, state.next_positions + torch.arange(5), recall)
    tokens, positions, _ = encode_batch(model, [ids + question[0].tolist()])
    snap = compress(model, tokens, positions, methods.get("snapkv", kv_budget=recall + 5, window=5, kernel=KERNEL),
                    room=0)
    pivot = state.stats.pivot_layer if state.stats.pivot_layer is not None else model.config.num_layers
    assert set(state.archive.layers) == set(model.config.full_attention_layers)
    compared = [i for i in state.archive.layers if i <= pivot]
    assert compared
    for i in compared:
        chosen = _heads(done["chosen_positions"][i], len(ids))
        assert chosen == _heads(snap.cache.layers[i].pos, len(ids))  # the exact entries SnapKV keeps
        kept = _heads(state.cache.layers[i].pos, len(ids))
        assert _heads(cache.layers[i].pos, len(ids)) == [c | k for c, k in zip(chosen, kept)]  # hot + recalled
    assert done["recalled"] == sum(len(c - k) for i in state.archive.layers for c, k in zip(
        _heads(done["chosen_positions"][i], len(ids)), _heads(state.cache.layers[i].pos, len(ids))))


def test_the_question_reads_as_with_the_full_cache(model):
    """With a float archive and no propagation the question attends over every context entry at
    every layer: its next-token logits are the full prompt's."""
    ids, question = _ids(100, 2), [5, 6, 7]
    state = _state(model, ids, methods.get("keydiff", kv_budget=10))
    _, logits, _, _ = _extend_state(model, state, question, 4)
    full = model(torch.tensor([ids + question]), last=True)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    plain = _state(model, ids, methods.get("keydiff", kv_budget=10), archive=None, recall=None)
    _, without, _, _ = _extend_state(model, plain, question, 4)
    assert (without - full).abs().max() > 10 * (logits - full).abs().max()  # recall is what made them equal


@settings(max_examples=12, deadline=None)
@given(n=st.integers(20, 90), budget=st.integers(8, 19), seed=st.integers(0, 50),
       kind=st.sampled_from(["float", "bf16", "int8", "int4", "int4_token"]))
def test_hot_set_and_archive_partition_the_context(tiny_dir, n, budget, seed, kind):
    """Per layer and KV head: the hot set and the archive are disjoint and together every context
    token the layer computed; the archive's bytes are its planes' and positions'."""
    model = structkv.load(tiny_dir("llama"))
    state = _state(model, _ids(n, seed), methods.get("snapkv", kv_budget=budget, window=4), archive=kind)
    for i, layer in state.archive.layers.items():
        hot, arch = _heads(state.cache.layers[i].pos, n), _heads(layer.positions(), n)
        for h, a in zip(hot, arch):
            assert not h & a and h | a == set(range(n))
        assert layer.nbytes() == sum(p.numel() * p.element_size() for p in layer.planes) + layer.pos.numel() * 4
    assert state.archive.nbytes() == sum(layer.nbytes() for layer in state.archive.layers.values())
    assert state.archive.entries() == sum((n - min(budget, n)) * 2 for _ in state.archive.layers)  # 2 KV heads


def test_archive_kinds_shrink_and_stay_close(model):
    ids = _ids(100, 4)
    sizes, tiles = {}, {}
    for kind in ("float", "bf16", "int8", "int4", "int4_token"):
        state = _state(model, ids, methods.get("keydiff", kv_budget=10), archive=kind)
        layer = next(iter(state.archive.layers.values()))
        sizes[kind], tiles[kind] = state.archive.nbytes(), layer.tile(0, layer.size, "k")
    assert sizes["float"] > sizes["bf16"] > sizes["int8"] > max(sizes["int4"], sizes["int4_token"])
    for kind, bound in (("bf16", 0.02), ("int8", 0.02), ("int4", 0.15), ("int4_token", 0.15)):  # of the keys' spread
        err = (tiles[kind] - tiles["float"]).abs().max() / tiles["float"].abs().max()
        assert err < bound, (kind, err)


def test_a_state_asked_twice_is_unchanged(model):
    ids = _ids(110, 5)
    state = _state(model, ids, methods.get("structkv_agnostic", kv_budget=15), archive="int4")
    before = [{n: b.clone() for n, b in layer.named_buffers()} for layer in state.cache.layers]
    archived = {i: [p.clone() for p in layer.planes] for i, layer in state.archive.layers.items()}
    first = structkv.generate(model, [3, 4, 5, 6], state=state, max_new_tokens=6, compile=False)
    second = structkv.generate(model, [3, 4, 5, 6], state=state, max_new_tokens=6, compile=False)
    assert first.token_ids == second.token_ids
    for layer, saved in zip(state.cache.layers, before):
        for n, b in layer.named_buffers():
            assert torch.equal(b, saved[n])
    for i, layer in state.archive.layers.items():
        assert all(torch.equal(a, b) for a, b in zip(layer.planes, archived[i]))
    assert first.stats["recalled_entries"] > 0 and first.stats["archive_bytes"] == state.archive.nbytes()
    off = structkv.generate(model, [3, 4, 5, 6], state=state, max_new_tokens=6, compile=False, recall=0)
    assert "recalled_entries" not in off.stats


def test_generate_states_recalls_per_state_like_generate_alone(model):
    ids = _ids(100, 6)
    states = [_state(model, ids, methods.get(n, kv_budget=12), archive="int8") for n in ("keydiff", "snapkv")]
    together = structkv.generate_states(model, states, question=[9, 8, 7], max_new_tokens=5, compile=False,
                                        recall=[20, 0])
    for state, r, got in zip(states, (20, 0), together):
        alone = structkv.generate(model, [9, 8, 7], state=state, max_new_tokens=5, compile=False, recall=r)
        assert got.token_ids == alone.token_ids
    assert together[0].stats["recall"] == 20 and "recall" not in together[1].stats


def test_file_archive_reads_like_memory_and_refuses_damage(model, tmp_path):
    ids, question = _ids(100, 7), [4, 5, 6]
    state = structkv.prefill(model, ids, methods.get("keydiff", kv_budget=12), archive="int4", recall=20,
                             archive_dir=tmp_path)
    path = state.archive.path
    assert path.parent == tmp_path and path.suffix == ".safetensors"
    memory = structkv.prefill(model, ids, methods.get("keydiff", kv_budget=12), archive="int4", recall=20)
    a = structkv.generate(model, question, state=state, max_new_tokens=5, compile=False)
    b = structkv.generate(model, question, state=memory, max_new_tokens=5, compile=False)
    assert a.token_ids == b.token_ids and a.stats["archive_file"] == str(path)
    reopened = open_archive(path)  # e.g. after a restart
    assert reopened.nbytes() == memory.archive.nbytes()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the last tensor
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(data))
    state.archive = open_archive(damaged)
    with pytest.raises(ArchiveError, match="corrupt"):
        structkv.generate(model, question, state=state, max_new_tokens=5, compile=False)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ArchiveError, match="corrupt or truncated"):
        open_archive(truncated)
    (tmp_path / "other.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ArchiveError):
        open_archive(tmp_path / "other.safetensors")
    with pytest.raises(ArchiveError, match="does not exist"):
        open_archive(tmp_path / "missing.safetensors")


def test_file_tensors_with_a_size_one_dimension_of_any_stride(tmp_path):
    """One KV head (Gemma 3 270M) leaves a size-1 dimension whose stride is not 1 in a contiguous
    tensor: such tensors are written, checked and read back exactly."""
    from structkv.models.archive import crc_check, read_file, write_file

    base = torch.arange(2 * 3541, dtype=torch.int32)
    odd = {"one": base[7:].as_strided((1, 1), (3541, 3541)), "planes": base[:6].as_strided((3, 1, 2), (2, 99, 1)),
           "bf16": torch.randn(2, 1, 4).to(torch.bfloat16)}
    write_file(tmp_path / "odd.safetensors", odd, {"format": "test"})
    meta, tensors = read_file(tmp_path / "odd.safetensors", "test", "test file")
    assert all(torch.equal(tensors[k], odd[k]) for k in odd)
    crc_check(tmp_path / "odd.safetensors", {k: (tensors[k], json.loads(meta["crc32"])[k]) for k in odd})()


def test_bad_recall_requests_are_refused(model):
    ids = _ids(60, 8)
    with pytest.raises(ValueError, match="re-encodes only the tokens it keeps"):
        structkv.prefill(model, ids, methods.get("gemfilter", kv_budget=10), archive="int4")
    with pytest.raises(ValueError, match="archive must be"):
        structkv.prefill(model, ids, methods.get("keydiff", kv_budget=10), archive="int3")
    with pytest.raises(ValueError, match="need an archive"):
        structkv.prefill(model, ids, methods.get("keydiff", kv_budget=10), recall=0.1)
    plain = structkv.prefill(model, ids, methods.get("keydiff", kv_budget=10))
    with pytest.raises(ValueError, match="needs a state with an archive"):
        structkv.generate(model, [4, 5], state=plain, recall=0.1, max_new_tokens=2, compile=False)
    with pytest.raises(ValueError, match="reads a compressed state's archive"):
        structkv.generate(model, [4, 5], recall=0.1, max_new_tokens=2, compile=False)
    archived = structkv.prefill(model, ids, methods.get("keydiff", kv_budget=10), archive="int8")
    with pytest.raises(ValueError, match="recall ratio must be in"):
        structkv.generate(model, [4, 5], state=archived, recall=1.5, max_new_tokens=2, compile=False)


def test_recall_past_the_pivot_holds_only_the_skeleton(tiny_dir):
    """StructKV's layers past the pivot computed only the skeleton: their archive holds skeleton
    tokens only, so recall there never brings back a token the skeleton dropped."""
    model = structkv.load(tiny_dir("llama"))
    ids = _ids(120, 9)
    method = methods.get("structkv_agnostic", kv_budget=10, struct_budget=40, pivot=1)
    state = _state(model, ids, method)
    skeleton = set(state.kept_columns[0][state.kept_columns[0] >= 0].tolist())
    for i, layer in state.archive.layers.items():
        archived = set().union(*_heads(layer.positions(), len(ids)))
        hot = set().union(*_heads(state.cache.layers[i].pos, len(ids)))
        if i > 1:
            assert archived | hot <= skeleton and len(archived | hot) == len(skeleton)
        else:
            assert archived | hot == set(range(len(ids)))


@settings(max_examples=30, deadline=None)
@given(A=st.integers(0, 100), heads=st.integers(1, 3), D=st.sampled_from([2, 16, 64]), seed=st.integers(0, 99),
       outlier=st.floats(1, 1000))
def test_int4_channel_keys_are_within_half_a_step_of_their_channel(A, heads, D, seed, outlier):
    """Keys per channel over blocks of 32 entries: every value within half its channel's step of
    the original (no code clipped, whatever a channel's scale next to the others), the tables one
    row per block, and the same bytes per entry as per-entry int4 when 32 divides D and A."""
    from structkv.ops.kv_quant import CHANNEL_BLOCK, dequantize_int4_channels, quantize_int4_channels

    x = torch.randn(A, 2, heads, D, generator=torch.Generator().manual_seed(seed))
    x[..., 0] *= outlier  # one outlier channel, as keys have
    codes, scale, lo = quantize_int4_channels(x)
    blocks = -(-A // CHANNEL_BLOCK)
    assert codes.shape == (A, 2, heads, D // 2) and scale.shape == lo.shape == (blocks, 2, heads, D)
    rows = torch.arange(A) // CHANNEL_BLOCK
    back = dequantize_int4_channels(codes, scale[rows], lo[rows])
    step = scale[rows].float()
    assert bool(((back - x).abs() <= step / 2 + 1e-6 * (1 + x.abs())).all())
    if A % CHANNEL_BLOCK == 0 and D % 32 == 0:
        from structkv.ops.kv_quant import quantize_kv

        per_entry = sum(t.numel() * t.element_size() for t in quantize_kv(x, "int4"))
        assert sum(t.numel() * t.element_size() for t in (codes, scale, lo)) == per_entry


def test_int4_archive_tiles_and_takes_agree_and_pad_rows_with_their_own_entries(tiny_dir):
    """Two rows of different lengths (the shorter padded): an entry read in a tile and read alone
    are the same, every archived key is within half its channel's step of the float archive's, and
    a tile that does not start at a block is refused."""
    from structkv.ops.kv_quant import CHANNEL_BLOCK

    model = structkv.load(tiny_dir("llama"))
    method = methods.get("snapkv", kv_budget=10, window=4)
    tokens, positions, _ = encode_batch(model, [_ids(90, 1), _ids(61, 2)])
    exact = compress(model, tokens, positions, method, room=8, archive="float").archive
    packed = compress(model, tokens, positions, method, room=8, archive="int4").archive
    for i, layer in packed.layers.items():
        assert torch.equal(layer.pos, exact.layers[i].pos)
        keys = layer.tile(0, layer.size, "k")  # (B, Hkv, A, D)
        B, H, A, D = keys.shape
        index = torch.randint(0, A, (B, H, 7), generator=torch.Generator().manual_seed(i))
        k, v = layer.take(index)
        torch.testing.assert_close(k, keys.gather(2, index[..., None].expand(B, H, 7, D)), rtol=0, atol=0)
        torch.testing.assert_close(v, layer.tile(0, A, "v").gather(2, index[..., None].expand(B, H, 7, D)),
                                   rtol=0, atol=0)
        step = layer.planes[1].float().repeat_interleave(CHANNEL_BLOCK, 0)[:A].permute(1, 2, 0, 3)
        real = (layer.positions() >= 0)[..., None]  # (B, Hkv, A, 1)
        err = (keys - exact.layers[i].tile(0, A, "k")).abs()
        assert bool((err <= step / 2 + 1e-5).logical_or(~real).all())
        assert torch.equal(layer.tile(CHANNEL_BLOCK, A, "k"), keys[:, :, CHANNEL_BLOCK:])
        with pytest.raises(ValueError, match="multiple of 32"):
            layer.tile(5, A, "k")


def test_an_archive_file_of_the_previous_format_is_refused(model, tmp_path):
    """Format 1 stored int4 keys per entry: read as per-channel codes they would be wrong entries."""
    from structkv.models.archive import write_file

    state = structkv.prefill(model, _ids(80, 3), methods.get("keydiff", kv_budget=12), archive="int4")
    write_file(tmp_path / "old.safetensors", state.archive.tensors(), {"format": "structkv-archive/1",
                                                                        **state.archive.meta()})
    with pytest.raises(ArchiveError, match="compress the context again"):
        open_archive(tmp_path / "old.safetensors")


def test_the_cli_names_every_archive_kind():
    from structkv.cli import ARCHIVE_KINDS
    from structkv.models.archive import KINDS

    assert ARCHIVE_KINDS == KINDS


CHANGED_IN_PLACE = """
import sys, torch, structkv
from structkv import methods
from structkv.models.archive import ArchiveError
model = structkv.load(sys.argv[1])
ids = torch.randint(3, 90, (100,), generator=torch.Generator().manual_seed(7)).tolist()
state = structkv.prefill(model, ids, methods.get("keydiff", kv_budget=12), archive="int4", recall=20,
                         archive_dir=sys.argv[2])
first = structkv.generate(model, [4, 5, 6], state=state, max_new_tokens=5, compile=False)  # read once: pages cached
path = state.archive.path
if sys.argv[3] == "truncate":
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
else:
    with open(path, "r+b") as f:  # every archived byte after the header changed in place
        size = path.stat().st_size
        f.seek(size - 4096)
        f.write(b"\\x11" * 4096)
try:
    structkv.generate(model, [4, 5, 6], state=state, max_new_tokens=5, compile=False)
    print("ANSWERED")
except ArchiveError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("change", ["truncate", "overwrite"])
def test_an_archive_file_changed_in_place_is_refused_never_read(tiny_dir, tmp_path, change):
    """A file under --archive-dir truncated in place used to kill the process with SIGBUS (its
    pages were mapped); bytes rewritten in place after the first read were used unchecked (the CRC
    ran once per mapping). Both are now refused with ArchiveError at the next question. Run in a
    child process: on the old code the first case is a signal, not an exception."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CHANGED_IN_PLACE, str(tiny_dir("llama")), str(tmp_path), change],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"the process died ({out.returncode}): {out.stderr[-1500:]}"
    assert out.stdout.startswith("REFUSED"), out.stdout[-500:]


def test_a_deleted_archive_file_is_a_clear_error(model, tmp_path):
    """The archive's file removed under a state: the next question says so (serve then compresses
    the context again), it never reads stale bytes."""
    state = structkv.prefill(model, _ids(100, 9), methods.get("keydiff", kv_budget=12), archive="int4", recall=20,
                             archive_dir=tmp_path)
    state.archive.path.unlink()
    with pytest.raises(ArchiveError, match="compress"):
        structkv.generate(model, [4, 5, 6], state=state, max_new_tokens=3, compile=False)


def test_an_archive_layer_goes_to_the_questions_device(model, tmp_path):
    """Recall reads a file's layer into host memory and copies it to the question's device, one
    layer at a time (a memory-mapped archive's CPU tiles used to meet CUDA queries); here the
    device is `meta`, which checks that every plane and the positions move and tiles follow."""
    state = structkv.prefill(model, _ids(100, 11), methods.get("keydiff", kv_budget=12), archive="int4", recall=20,
                             archive_dir=tmp_path)
    layer = next(iter(state.archive.layers.values())).opened()
    assert layer.to("cpu") is layer
    moved = layer.to("meta")
    assert all(p.device.type == "meta" for p in moved.planes) and moved.pos.device.type == "meta"
    assert moved.tile(0, min(32, moved.size), "k").device.type == "meta"


def test_a_question_reads_archived_layers_off_its_own_thread(model, tmp_path, monkeypatch):
    """A file's layers are read and checked on a worker thread (one layer ahead: the next test),
    never in the question's own thread, and the answer is the in-memory archive's."""
    import threading

    from structkv.models.archive import ArchiveLayer

    ids, question = _ids(100, 13), [4, 5, 6]
    state = structkv.prefill(model, ids, methods.get("keydiff", kv_budget=12), archive="int4", recall=20,
                             archive_dir=tmp_path)
    memory = structkv.prefill(model, ids, methods.get("keydiff", kv_budget=12), archive="int4", recall=20)
    readers, opened = [], ArchiveLayer.opened

    def logged(self):
        readers.append(threading.current_thread().name)
        return opened(self)

    monkeypatch.setattr(ArchiveLayer, "opened", logged)
    a = structkv.generate(model, question, state=state, max_new_tokens=4, compile=False)
    b = structkv.generate(model, question, state=memory, max_new_tokens=4, compile=False)
    assert a.token_ids == b.token_ids
    assert len(readers) == 2 * len(state.archive.layers)  # both states, every archived layer once
    assert all(name.startswith("structkv-archive") for name in readers), readers


class _SlowLayer:
    """An archived layer whose read waits for its test to let it finish."""

    def __init__(self, i, log):
        self.i, self.log, self.go = i, log, __import__("threading").Event()

    def opened(self):
        self.log.append(("read", self.i))
        assert self.go.wait(10)
        return self

    def to(self, device):
        return self


def test_archive_fetch_reads_one_layer_ahead_and_no_further():
    """Taking layer i starts layer i+1's read and only that one: the question's compute of layer
    i overlaps the next read, and at most two layers' entries are held at once."""
    from structkv.modules.archive_fetch import ArchiveFetch

    log = []
    layers = {i: _SlowLayer(i, log) for i in (0, 2, 5)}  # archived layers need not be adjacent
    with ArchiveFetch(layers, "cpu") as fetch:
        assert list(fetch.pending) == [0]  # the first read starts before the question needs it
        layers[0].go.set()
        assert fetch.take(0) is layers[0]
        assert list(fetch.pending) == [2]  # the next archived layer, read while layer 0 computes
        layers[2].go.set()
        assert fetch.take(2) is layers[2] and list(fetch.pending) == [5]
        layers[5].go.set()
        assert fetch.take(5) is layers[5] and not fetch.pending
    assert log == [("read", 0), ("read", 2), ("read", 5)]


def test_archive_fetch_raises_a_changed_file_in_the_questions_thread():
    from structkv.modules.archive_fetch import ArchiveFetch

    class Changed:
        def opened(self):
            raise ArchiveError("archive file x is corrupt or was changed")

    with ArchiveFetch({0: Changed()}, "cpu") as fetch, pytest.raises(ArchiveError, match="changed"):
        fetch.take(0)
