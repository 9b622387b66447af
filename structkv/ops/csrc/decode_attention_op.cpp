// structkv::cpu_decode_attention as a C++ op: the kernel of decode_attention.c behind PyTorch's
// dispatcher. Why: the op runs once per layer per token, and its earlier Python body (the tensors'
// pointers and strides packed for a ctypes call) cost ~30 us a call, about 1 ms of a 30-layer
// model's decode step; here the argument handling is a few C++ checks. The schema and the fake
// live in structkv/ops/cpu_decode.py, as the tiled kernels' do.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string_view>

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

// q (B, Hq, 1, D) over k, v planes (B, Hkv, T, last) of `kind` with a bool mask (B|1, 1|Hkv, 1, T)
// -> (B, Hq, 1, D) in q's dtype.
at::Tensor cpu_decode_attention(const at::Tensor &q, at::TensorList k_in, at::TensorList v_in, const at::Tensor &mask,
                                double scale, c10::string_view kind_name, int64_t threads) {
  const int kind = kind_of(std::string_view(kind_name.data(), kind_name.size()));
  const size_t planes = kind == KIND_INT4 ? 3 : kind == KIND_INT8 ? 2 : 1;
  TORCH_CHECK(k_in.size() == planes && v_in.size() == planes, "cpu_decode_attention: ", kKinds[kind], " takes ",
              planes, " planes a side, got ", k_in.size(), " and ", v_in.size());
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "cpu_decode_attention: q must be (B, Hq, 1, D), got ", q.sizes());
  const auto k = last_contiguous(k_in), v = last_contiguous(v_in);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k[0].size(1), T = k[0].size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "cpu_decode_attention: ", Hq, " query heads over ", Hkv, " KV heads");
  TORCH_CHECK(mask.dim() == 4 && mask.size(2) == 1 && mask.size(3) == T && (mask.size(0) == B || mask.size(0) == 1),
              "cpu_decode_attention: mask must be (B, 1|Hkv, 1, ", T, "), got ", mask.sizes());
  const int64_t G = Hq / Hkv, Hm = mask.size(1), splits = max_splits(B, Hkv, threads);
  // (B, Hq, 1, D) contiguous is (B, Hkv, G, D) in memory: a KV head's G query rows together
  const auto q32 = q.to(at::kFloat).contiguous();
  const auto m = mask.reshape({mask.size(0), Hm, T}).expand({B, Hm, T}).to(at::kBool).contiguous();  // (B, Hm, T)
  auto out = at::empty({B, Hq, 1, D}, q.options().dtype(at::kFloat));
  auto work = at::empty({splits * B * Hkv * G * (D + 2)}, q.options().dtype(at::kFloat));
  const int64_t groups = kind == KIND_INT4 ? k[1].size(-1) : 1;
  const int rc = decode_attention(kind, q32.data_ptr<float>(), plane(k), plane(v),
                                  reinterpret_cast<const uint8_t *>(m.data_ptr<bool>()), Hm * T, Hm > 1 ? T : 0, Hm,
                                  out.data_ptr<float>(), work.data_ptr<float>(), B, Hkv, G, T, D, groups,
                                  static_cast<float>(scale), splits, threads);
  TORCH_CHECK_VALUE(rc == 0, "cpu_decode_attention: G = ", G, ", D = ", D, " outside the kernel's limits (G <= ", MAX_G,
              ", D <= ", MAX_D, " and a multiple of 16); check `fits` first");
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(structkv, CPU, m) { m.impl("cpu_decode_attention", &cpu_decode_attention); }
