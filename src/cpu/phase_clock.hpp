// The kernels' side of kda::profile: a lap clock that charges the time since its previous lap to a
// (kernel, phase) counter. Kernels create one per work item and call lap() after each phase.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace kda::cpu {

enum class Kernel : int { chunk_forward, recurrent_forward, chunk_backward, recurrent_backward, count };

// Phases, shared by the kernels (each uses the ones that apply). Names are in profile.cpp.
enum class Phase : int {
  gather,               // input rows into tiles, with the L2 norm, the fused gate and beta (in the
                        // recurrent forward also exp(g), done per slice as the rows arrive; in the
                        // chunked backward also the d_o rows)
  decay_factors,        // exp(g), exp(G), exp(G_last - G) and the decayed q / k rows
  intra_matrices,       // L and P of a chunk
  wy_solve,             // (I + L) [W | U] = [beta K e^G | beta V]
  state_products,       // the products with the state: W S, Qe S, K^T Vn (forward)
  intra_output,         // P Vn
  recurrent_sweep,      // the token-by-token update of the state
  state_io,             // state tiles and checkpoints: loads, stores, layout changes (the chunked
                        // backward's transposes of S and dS)
  store,                // output rows
  states_recompute,     // backward: the states entering every chunk (or segment)
  grad_state_products,  // backward: Vn, dVn, dS, dO S^T, Vn dS^T, dVn S^T
  grad_dP_dL,           // backward: dP = dO Vn^T and dL = -Y X^T
  grad_solve,           // backward: Y = (I + L)^-T [dW | dU]
  grad_pairs,           // backward: the intra-chunk terms through E_ij
  grad_gate,            // backward: the gate's cumulative sums, the fused gate, beta, dv / dg / dbeta stores
  grad_group,           // backward: dq, dk group sums, the L2 norm backward, dq / dk stores
  recurrent_backward_sweep,  // backward: the reverse token walk over state columns
  count
};

inline constexpr int kKernels = static_cast<int>(Kernel::count);
inline constexpr int kPhases = static_cast<int>(Phase::count);

extern std::atomic<bool> g_profile_enabled;
void add_phase_time(Kernel kernel, Phase phase, int64_t nanoseconds);

class PhaseClock {
 public:
  explicit PhaseClock(Kernel kernel)
      : kernel_(kernel), on_(g_profile_enabled.load(std::memory_order_relaxed)) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  // Charges the time since the previous lap (or the clock's creation) to `phase`, or to the phase of
  // the current Redirect.
  void lap(Phase phase) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    add_phase_time(kernel_, redirect_ == Phase::count ? phase : redirect_,
                   std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count());
    last_ = now;
  }

  // While it lives, every lap of the clock is charged to one phase: a pass that reuses code timed in
  // other phases (the backward's recomputation of the forward states) shows as itself.
  class Redirect {
   public:
    Redirect(PhaseClock& clock, Phase phase) : clock_(clock), saved_(clock.redirect_) {
      clock_.redirect_ = phase;
    }
    ~Redirect() { clock_.redirect_ = saved_; }
    Redirect(const Redirect&) = delete;
    Redirect& operator=(const Redirect&) = delete;

   private:
    PhaseClock& clock_;
    Phase saved_;
  };

 private:
  Kernel kernel_;
  bool on_;
  Phase redirect_ = Phase::count;  // none
  std::chrono::steady_clock::time_point last_;
};

}  // namespace kda::cpu
