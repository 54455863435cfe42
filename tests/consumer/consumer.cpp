// Calls an installed kda through its C++ API: a forward checked against the float64 oracle, and a
// kda::Error (its type must cross the shared library's boundary).
#include <cmath>
#include <cstdio>
#include <kda/kda.hpp>
#include <kda/reference.hpp>
#include <vector>

int main() {
  const int64_t T = 70, K = 8, V = 6;
  std::vector<float> q(T * K), k(T * K, 0.3f), v(T * V), g(T * K, -0.05f), beta(T, 0.4f), o(T * V);
  for (int64_t i = 0; i < T * K; ++i) q[i] = 0.01f * static_cast<float>(i % 13);
  for (int64_t i = 0; i < T * V; ++i) v[i] = 0.1f * static_cast<float>(i % 9) - 0.4f;
  kda::Problem p;
  p.seq_len = T, p.heads = 1, p.value_heads = 1, p.key_dim = K, p.value_dim = V;
  kda::ForwardInputs in;
  in.q = kda::make_input(q.data(), kda::DType::f32, p, 1, K);
  in.k = kda::make_input(k.data(), kda::DType::f32, p, 1, K);
  in.v = kda::make_input(v.data(), kda::DType::f32, p, 1, V);
  in.g = kda::make_input(g.data(), kda::DType::f32, p, 1, K);
  in.beta = kda::make_input(beta.data(), kda::DType::f32, p, 1, 1);
  kda::ForwardOutputs out;
  out.o = kda::make_output(o.data(), kda::DType::f32, p, 1, V);
  kda::chunk_forward(p, in, out);
  const kda::reference::ForwardResult ref = kda::reference::forward(p, kda::reference::widen(p, in));
  double err = 0, norm = 0;
  for (int64_t i = 0; i < T * V; ++i)
    err += (o[i] - ref.o[i]) * (o[i] - ref.o[i]), norm += ref.o[i] * ref.o[i];
  const double rel = std::sqrt(err / norm);
  if (!(rel < 2e-6)) {
    std::fprintf(stderr, "relative error %.3e against the oracle\n", rel);
    return 1;
  }
  try {
    p.key_dim = 300;
    kda::chunk_forward(p, in, out);
    return 1;
  } catch (const kda::Error& e) {
    std::printf("C++ consumer: SIMD target %s, error %.2e against the oracle; K = 300 says: %s\n",
                kda::simd_target(), rel, e.what());
  }
  return 0;
}
