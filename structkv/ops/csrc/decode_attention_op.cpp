// structkv::cpu_decode_attention as a C++ op: the kernel of decode_attention.c behind PyTorch's
// dispatcher. Why: the op runs once per layer per token, and its earlier Python body (the tensors'
// pointers and strides packed for a ctypes call) cost ~30 us a call, about 1 ms of a 30-layer
// model's decode step; here the argument handling is a few C++ checks. The schema and the fake
// live in structkv/ops/cpu_decode.py, as the tiled kernels' do.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string_view>
#include <vector>

#include "decode_attention.c"  // the kernel's static functions, compiled as C++ here

namespace {

const char *kKinds[] = {"float32", "bfloat16", "int8", "int4"};  // csrc KIND_*: the entries' storage

int kind_of(std::string_view kind) {
  if (kind == "bf16") return KIND_BF16;  // the cache's kv_dtype name
  for (int i = 0; i < 4; i++)
    if (kind == kKinds[i]) return i;
  TORCH_CHECK_VALUE(false, "cpu_decode_attention: kind must be float32, bfloat16 (bf16), int8 or int4, got ", kind);
}

// A plane (B, H, T, last) with its last dimension contiguous: codes, scales and minimums' pointers
// and their (B, H, T) strides, as csrc's Plane holds them.
Plane plane(const std::vector<at::Tensor> &parts) {
  Plane p = {};
  const void **ptrs[] = {&p.codes, reinterpret_cast<const void **>(&p.scale),
                         reinterpret_cast<const void **>(&p.minimum)};
  int64_t *strides[] = {p.cs, p.ss, p.ms};
  for (size_t i = 0; i < parts.size() && i < 3; i++) {
    *ptrs[i] = parts[i].data_ptr();
    for (int d = 0; d < 3; d++) strides[i][d] = parts[i].stride(d);
  }
  return p;
}

std::vector<at::Tensor> last_contiguous(at::TensorList planes) {
  std::vector<at::Tensor> out;
  for (const auto &t : planes) {
    TORCH_CHECK(t.dim() == 4 && t.device().is_cpu(), "cpu_decode_attention: planes must be (B, H, T, last) on CPU, got ",
                t.sizes());
    out.push_back(t.stride(-1) == 1 ? t : t.contiguous());
  }
  return out;
}

// The most key ranges per (row, KV head) the kernel may use (its work buffer's size): enough tasks
// for every thread twice over; the kernel picks the number itself (csrc key_ranges).
int64_t max_splits(int64_t B, int64_t Hkv, int64_t threads) {
  int64_t splits = 1;
  while (B * Hkv * splits < 2 * threads) splits *= 2;
  return splits;
}

// What both ops check and hold: q (B, Hq, 1, D) as float32 (B, Hkv, G, D), the planes, the kind,
// the output and the kernel's work buffer.
struct Call {
  int kind;
  std::vector<at::Tensor> k, v;
  at::Tensor q32, out, work;
  int64_t B, Hq, D, Hkv, T, G, groups, splits;
};

Call prepare(const at::Tensor &q, at::TensorList k_in, at::TensorList v_in, c10::string_view kind_name,
             int64_t threads) {
  Call c;
  c.kind = kind_of(std::string_view(kind_name.data(), kind_name.size()));
  const size_t planes = c.kind == KIND_INT4 ? 3 : c.kind == KIND_INT8 ? 2 : 1;
  TORCH_CHECK(k_in.size() == planes && v_in.size() == planes, "cpu_decode_attention: ", kKinds[c.kind], " takes ",
              planes, " planes a side, got ", k_in.size(), " and ", v_in.size());
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "cpu_decode_attention: q must be (B, Hq, 1, D), got ", q.sizes());
  c.k = last_contiguous(k_in);
  c.v = last_contiguous(v_in);
  c.B = q.size(0), c.Hq = q.size(1), c.D = q.size(3), c.Hkv = c.k[0].size(1), c.T = c.k[0].size(2);
  TORCH_CHECK(c.Hkv > 0 && c.Hq % c.Hkv == 0, "cpu_decode_attention: ", c.Hq, " query heads over ", c.Hkv, " KV heads");
  c.G = c.Hq / c.Hkv, c.splits = max_splits(c.B, c.Hkv, threads);
  // (B, Hq, 1, D) contiguous is (B, Hkv, G, D) in memory: a KV head's G query rows together
  c.q32 = q.to(at::kFloat).contiguous();
  c.out = at::empty({c.B, c.Hq, 1, c.D}, q.options().dtype(at::kFloat));
  c.work = at::empty({c.splits * c.B * c.Hkv * c.G * (c.D + 2)}, q.options().dtype(at::kFloat));
  c.groups = c.kind == KIND_INT4 ? c.k[1].size(-1) : 1;
  return c;
}

at::Tensor run(const Call &c, const Sight &sight, const at::Tensor &q, double scale, int64_t threads) {
  const int rc = decode_attention(c.kind, c.q32.data_ptr<float>(), plane(c.k), plane(c.v), sight,
                                  c.out.data_ptr<float>(), c.work.data_ptr<float>(), c.B, c.Hkv, c.G, c.T, c.D,
                                  c.groups, static_cast<float>(scale), c.splits, threads);
  TORCH_CHECK_VALUE(rc == 0, "cpu_decode_attention: G = ", c.G, ", D = ", c.D, " outside the kernel's limits (G <= ",
                    MAX_G, ", D <= ", MAX_D, " and a multiple of 16); check `fits` first");
  return q.scalar_type() == at::kFloat ? c.out : c.out.to(q.scalar_type());
}

// q (B, Hq, 1, D) over k, v planes (B, Hkv, T, last) of `kind` with a bool mask (B|1, 1|Hkv, 1, T)
// -> (B, Hq, 1, D) in q's dtype.
at::Tensor cpu_decode_attention(const at::Tensor &q, at::TensorList k_in, at::TensorList v_in, const at::Tensor &mask,
                                double scale, c10::string_view kind_name, int64_t threads) {
  const Call c = prepare(q, k_in, v_in, kind_name, threads);
  TORCH_CHECK(mask.dim() == 4 && mask.size(2) == 1 && mask.size(3) == c.T && (mask.size(0) == c.B || mask.size(0) == 1),
              "cpu_decode_attention: mask must be (B, 1|Hkv, 1, ", c.T, "), got ", mask.sizes());
  const int64_t Hm = mask.size(1);
  const auto m = mask.reshape({mask.size(0), Hm, c.T}).expand({c.B, Hm, c.T}).to(at::kBool).contiguous();  // (B, Hm, T)
  const Sight sight = {reinterpret_cast<const uint8_t *>(m.data_ptr<bool>()), nullptr, nullptr, Hm * c.T,
                       Hm > 1 ? c.T : 0, Hm, 0};
  return run(c, sight, q, scale, threads);
}

// The same with what each slot shows computed in the kernel: `pos` (B, Hkv, T) the slots' original
// positions (-1 empty), `at` (B, 1) each row's query position, `window` > 0 for a sliding layer:
// a key is seen iff 0 <= pos <= at and at - pos < window (structkv.ops.visible's rule).
at::Tensor cpu_decode_attention_at(const at::Tensor &q, at::TensorList k_in, at::TensorList v_in, const at::Tensor &pos,
                                   const at::Tensor &at_pos, int64_t window, double scale, c10::string_view kind_name,
                                   int64_t threads) {
  const Call c = prepare(q, k_in, v_in, kind_name, threads);
  TORCH_CHECK(pos.dim() == 3 && pos.size(0) == c.B && pos.size(1) == c.Hkv && pos.size(2) == c.T &&
                  pos.scalar_type() == at::kLong,
              "cpu_decode_attention_at: pos must be int64 (B, Hkv, T) = (", c.B, ", ", c.Hkv, ", ", c.T, "), got ",
              pos.scalar_type(), " ", pos.sizes());
  TORCH_CHECK(at_pos.numel() == c.B && at_pos.scalar_type() == at::kLong,
              "cpu_decode_attention_at: at must be int64 with one query position a row (", c.B, "), got ",
              at_pos.scalar_type(), " ", at_pos.sizes());
  const auto p = pos.contiguous(), a = at_pos.reshape({c.B}).contiguous();
  const Sight sight = {nullptr, p.data_ptr<int64_t>(), a.data_ptr<int64_t>(), c.Hkv * c.T, c.T, c.Hkv, window};
  return run(c, sight, q, scale, threads);
}

}  // namespace

TORCH_LIBRARY_IMPL(structkv, CPU, m) {
  m.impl("cpu_decode_attention", &cpu_decode_attention);
  m.impl("cpu_decode_attention_at", &cpu_decode_attention_at);
}
