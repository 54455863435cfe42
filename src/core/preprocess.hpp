// Scalar definitions of the fused pre-processing (gate, beta, q/k L2 norm) and their derivatives.
// The oracle evaluates them in double; kernels use them where a scalar form is enough and must
// agree with their own vectorised forms.
#pragma once

#include <cmath>
#include <cstdint>

#include "kda/kda.hpp"

namespace kda::core {

inline constexpr double kL2NormEps = 1e-6;       // inside the square root
inline constexpr double kSoftplusLinear = 20.0;  // softplus(x) = x above this, as torch does

// min(x, 0) and max(x, lo) that keep a NaN x a NaN (std::min(T(0), x) returns 0 for one): a NaN
// in a gate must reach the outputs it touches, as in the float64 oracle and in torch, not pass for
// "no decay" or "total decay".
template <typename T>
T nonpositive(T x) {
  return x > T(0) ? T(0) : x;
}
template <typename T>
T at_least(T x, T lo) {
  return x < lo ? lo : x;
}

template <typename T>
T sigmoid(T x) {
  // Two branches so neither exp can overflow.
  if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
  T e = std::exp(x);
  return e / (T(1) + e);
}

template <typename T>
T softplus(T x) {
  if (x > T(kSoftplusLinear)) return x;
  return std::log1p(std::exp(x));
}

// Log decay of one element from the raw gate input x (GateMode::softplus / lower_bound).
// a = exp(A_log[hv]), bias = dt_bias[hv*K + d] (0 when absent).
template <typename T>
T gate_forward(GateMode mode, T x, T a, T bias, T lower_bound) {
  switch (mode) {
    case GateMode::log_decay: return x;
    case GateMode::softplus: return -a * softplus(x + bias);
    case GateMode::lower_bound: return lower_bound * sigmoid(a * (x + bias));
  }
  return x;
}

// d(log decay)/dx of gate_forward; d/dA_log = d/dx * (x + bias) for lower_bound, = g itself for softplus.
template <typename T>
T gate_derivative(GateMode mode, T x, T a, T bias, T lower_bound) {
  switch (mode) {
    case GateMode::log_decay: return T(1);
    case GateMode::softplus: return -a * sigmoid(x + bias);
    case GateMode::lower_bound: {
      T s = sigmoid(a * (x + bias));
      return lower_bound * s * (T(1) - s) * a;
    }
  }
  return T(1);
}

// d(log decay)/dA_log for one element.
template <typename T>
T gate_derivative_A_log(GateMode mode, T x, T a, T bias, T lower_bound) {
  switch (mode) {
    case GateMode::log_decay: return T(0);
    case GateMode::softplus: return gate_forward(mode, x, a, bias, lower_bound);
    case GateMode::lower_bound: return gate_derivative(mode, x, a, bias, lower_bound) * (x + bias);
  }
  return T(0);
}

template <typename T>
T beta_forward(BetaMode mode, T b) {
  switch (mode) {
    case BetaMode::given: return b;
    case BetaMode::sigmoid: return sigmoid(b);
    case BetaMode::sigmoid_x2: return T(2) * sigmoid(b);
  }
  return b;
}

template <typename T>
T beta_derivative(BetaMode mode, T b) {
  switch (mode) {
    case BetaMode::given: return T(1);
    case BetaMode::sigmoid: {
      T s = sigmoid(b);
      return s * (T(1) - s);
    }
    case BetaMode::sigmoid_x2: {
      T s = sigmoid(b);
      return T(2) * s * (T(1) - s);
    }
  }
  return T(1);
}

// y = x * rsqrt(sum(x^2) + eps), in place; returns rstd (needed by the backward).
template <typename T>
T l2norm_forward(T* x, int64_t n) {
  T ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  T rstd = T(1) / std::sqrt(ss + T(kL2NormEps));
  for (int64_t i = 0; i < n; ++i) x[i] *= rstd;
  return rstd;
}

// dx = rstd * (dy - (dy . y) y), in place over dy.
template <typename T>
void l2norm_backward(const T* y, T rstd, T* dy, int64_t n) {
  T dot = 0;
  for (int64_t i = 0; i < n; ++i) dot += dy[i] * y[i];
  for (int64_t i = 0; i < n; ++i) dy[i] = rstd * (dy[i] - dot * y[i]);
}

}  // namespace kda::core
