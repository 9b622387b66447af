// Shared by the candidate kernels of int8_gemv.cpp and int4_gemv.cpp.
#pragma once
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

template <typename F>
void over_outputs(int64_t N, F f) {  // the output rows split over torch's thread count (OpenMP)
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t chunk = (N + T - 1) / T, n0 = t * chunk, n1 = std::min(N, n0 + chunk);
    if (n0 < n1) f(n0, n1);
  }
}
