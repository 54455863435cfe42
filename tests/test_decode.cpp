// Serving: batched decode on a state pool (kda::decode), pooled prefill (PooledStates), the decode
// kernel behind recurrent_forward for short sequences, and the execution context (thread pool).
// Everything against the float64 oracle per request and per token; slots a call does not touch are
// filled with a poison pattern and must stay bitwise identical; every rejected call leaves the pool
// unchanged. The pool suites run on every backend of the build ("cpu", and "reference", the oracle
// behind the same entry points); the short-sequence routing and the threads are the CPU's.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "cpu/backend.hpp"
#include "test_util.hpp"

namespace kda::test {
namespace {

constexpr uint8_t kPoison = 0xab;  // 0xabab...: a finite value in f32 and bf16, never a real state

// A pool of states [slots, HV, state] in f32 or bf16, poisoned at creation.
class Pool {
 public:
  Pool(DType dtype, int64_t slots, int64_t slot_elems)
      : dtype_(dtype),
        slots_(slots),
        elems_(slot_elems),
        bytes_(static_cast<size_t>(slots * slot_elems) * esize()) {
    std::memset(bytes_.data(), kPoison, bytes_.size());
  }
  StatePool view() {
    StatePool p;
    p.data = bytes_.data();
    p.dtype = dtype_;
    p.num_slots = slots_;
    return p;
  }
  // Writes one slot from fp32 values (rounded to bf16 for a bf16 pool).
  void set(int64_t slot, const float* x) {
    for (int64_t i = 0; i < elems_; ++i) {
      const size_t at = static_cast<size_t>(slot * elems_ + i);
      if (dtype_ == DType::bf16) {
        const float r = round_bf16(x[i]);
        uint32_t u;
        std::memcpy(&u, &r, 4);
        const uint16_t b = static_cast<uint16_t>(u >> 16);
        std::memcpy(bytes_.data() + at * 2, &b, 2);
      } else {
        std::memcpy(bytes_.data() + at * 4, x + i, 4);
      }
    }
  }
  std::vector<double> get(int64_t slot) const {
    std::vector<double> out(static_cast<size_t>(elems_));
    for (int64_t i = 0; i < elems_; ++i) {
      const size_t at = static_cast<size_t>(slot * elems_ + i);
      if (dtype_ == DType::bf16) {
        uint16_t b;
        std::memcpy(&b, bytes_.data() + at * 2, 2);
        const uint32_t u = static_cast<uint32_t>(b) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        out[static_cast<size_t>(i)] = f;
      } else {
        float f;
        std::memcpy(&f, bytes_.data() + at * 4, 4);
        out[static_cast<size_t>(i)] = f;
      }
    }
    return out;
  }
  bool slot_poisoned(int64_t slot) const {
    const size_t n = static_cast<size_t>(elems_) * esize();
    const uint8_t* p = bytes_.data() + static_cast<size_t>(slot) * n;
    return std::all_of(p, p + n, [](uint8_t b) { return b == kPoison; });
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  DType dtype() const { return dtype_; }

 private:
  size_t esize() const { return dtype_ == DType::bf16 ? 2 : 4; }
  DType dtype_;
  int64_t slots_, elems_;
  std::vector<uint8_t> bytes_;
};

// Row n of a [N, elems] vector.
std::vector<double> row(const std::vector<double>& x, int64_t n, int64_t elems) {
  return {x.begin() + n * elems, x.begin() + (n + 1) * elems};
}

// The oracle's states after the first `tokens` tokens of every request (B requests of T tokens).
std::vector<double> oracle_states_after(const Data& d, int64_t tokens) {
  Problem p = d.problem();
  p.seq_len = tokens;
  return reference::forward(p, reference::widen(p, d.inputs())).final_state;
}

// A decode case: a Case (its initial states are what the requests start from), the pool dtype, the
// slot columns (1: [N] indices) and the accepted counts.
struct DecodeCase {
  Case c;
  DType pool = DType::f32;
  bool spec = false;    // [N, C] indices, a different accepted count per request
  int64_t columns = 0;  // C when spec (0: T)
  std::string name() const {
    return c.name() + (pool == DType::bf16 ? "_bf16pool" : "_f32pool") + (spec ? "_spec" : "") +
           (columns ? "_C" + std::to_string(columns) : "");
  }
};

void PrintTo(const DecodeCase& dc, std::ostream* os) { *os << dc.name(); }

std::vector<DecodeCase> decode_cases() {
  std::vector<DecodeCase> cases;
  int i = 0;
  for (StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
    for (DType pool : {DType::f32, DType::bf16}) {
      for (bool spec : {false, true}) {
        DecodeCase dc;
        Case& c = dc.c;
        c.B = 5;
        c.T = spec ? 4 : 1 + i % 2;
        c.H = 2;
        c.HV = i % 2 ? 4 : 2;
        c.K = i % 3 == 0 ? 128 : 32;
        c.V = i % 3 == 1 ? 96 : 16;
        c.layout = layout;
        c.initial_state = true;
        c.regime = i % 2 ? Regime::unbounded : Regime::spike;
        if (c.regime == Regime::unbounded) {
          c.gate = i % 4 == 1 ? GateMode::softplus : GateMode::lower_bound;
          c.beta = BetaMode::sigmoid;
          c.qk_l2norm = true;
        }
        c.dtype = i % 4 == 3 ? DType::bf16 : DType::f32;
        c.seed = 100 + static_cast<uint64_t>(i);
        dc.pool = pool;
        dc.spec = spec;
        cases.push_back(dc);
        // The same request under the gated delta rule's per-head gate.
        c.gate_width = GateWidth::per_head;
        c.seed += 1000;
        dc.spec = spec;
        cases.push_back(dc);
        ++i;
      }
    }
  }
  // One token per request, rows of whole vectors: the slot kernels, under both gate widths. V-first:
  // 23 rows, no multiple of the groups of four, of 32, 56 or 48 keys: a bf16 pool's rows of whole
  // pairs of vectors (32), and of pairs and an odd vector on AVX2 (56 = 7 x 8) and AVX-512
  // (48 = 3 x 16). K-first: an odd row count in the first pass, and
  // rows of 240 or 56 values, which the column blocks split into every width: 8 + 4 + 2 + 1 vectors
  // of 16 lanes (240), 4 + 2 + 1 of 8 (56; 240 gives 4 x 7 + 2). The fourth case reads every odd
  // request's state from a second slot column (speculative indices, C = 2, two tokens accepted):
  // slot steps that write elsewhere than they read, the slot read left as it was.
  for (StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
    for (DType pool : {DType::f32, DType::bf16}) {
      for (int variant = 0; variant < 4; ++variant) {
        DecodeCase dc;
        Case& c = dc.c;
        const GateWidth width = variant % 2 ? GateWidth::per_head : GateWidth::per_key;
        c.B = 4;
        c.T = 1;
        c.H = 2;
        c.HV = 4;
        c.K = layout == StateLayout::k_first ? 23 : variant < 2 ? 32 : variant == 2 ? 56 : 48;
        c.V = layout == StateLayout::k_first ? (variant == 2 ? 56 : 240) : 23;
        if (variant == 3) dc.spec = true, dc.columns = 2;
        c.layout = layout;
        c.initial_state = true;
        c.regime = Regime::unbounded;
        c.gate = GateMode::softplus;
        c.beta = BetaMode::sigmoid;
        c.qk_l2norm = true;
        c.gate_width = width;
        c.seed = 300 + static_cast<uint64_t>(i++);
        dc.pool = pool;
        cases.push_back(dc);
      }
    }
  }
  return cases;
}

// A decode case on a backend (harness::OnBackend: named "<backend>_<case>").
class Decode : public ::testing::TestWithParam<OnBackend<DecodeCase>> {};

// Every request against the oracle: its outputs, the state written after every token (spec) or at
// the end, and every slot the call does not write left as it was.
TEST_P(Decode, MatchesOracleAndTouchesOnlyItsSlots) {
  const DecodeCase& dc = GetParam().c;
  Data d;
  make_data(dc.c, d);
  const Case& c = d.c;
  const int64_t N = c.B, T = c.T, C = dc.columns ? dc.columns : dc.spec ? T : 1;
  const int64_t slot_elems = c.HV * c.K * c.V;
  const int64_t slots = 3 * N * C + 1;
  // Slots: request n's columns take distinct slots; it starts from column acc[n] - 1.
  std::vector<int64_t> indices(static_cast<size_t>(N * C)), accepted(static_cast<size_t>(N));
  std::vector<int64_t> order(static_cast<size_t>(slots));
  std::iota(order.begin(), order.end(), 0);
  Rng rng(c.seed);
  for (int64_t i = slots - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  for (size_t i = 0; i < indices.size(); ++i) indices[i] = order[i];
  for (int64_t n = 0; n < N; ++n) accepted[n] = dc.spec ? 1 + n % C : 1;
  Pool pool(dc.pool, slots, slot_elems);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t start = indices[static_cast<size_t>(n * C + accepted[n] - 1)];
    pool.set(start, d.h0.data() + n * slot_elems);
    // The oracle starts from what the pool holds (bf16-rounded for a bf16 pool).
    const std::vector<double> held = pool.get(start);
    for (int64_t i = 0; i < slot_elems; ++i) d.h0[n * slot_elems + i] = static_cast<float>(held[i]);
  }
  const std::vector<uint8_t> before = pool.bytes();

  DecodeInputs in;
  in.fwd = d.inputs();
  in.fwd.initial_state = nullptr;
  in.state_indices = make_indices(indices.data(), N, C);
  if (dc.spec) in.num_accepted_tokens = make_indices(accepted.data(), N);
  Tensor o(c.dtype, N, T, c.HV, c.V, false);
  o.fill_bytes(0xff);
  DecodeOutputs out;
  out.o = o.output();
  StatePool view = pool.view();
  decode(d.problem(), in, view, out, GetParam().options());

  const reference::ForwardResult ref = oracle_forward(d);
  EXPECT_TRUE(o.all_finite());
  EXPECT_LE(rel_rms(ref.o, o.packed()), tolerance("decode", c.dtype, "o")) << "o";
  // Written states: fp32 limits for an fp32 pool; one bf16 rounding for a bf16 one.
  const double state_tol = tolerance("decode", dc.pool, "state");
  std::vector<bool> written(static_cast<size_t>(slots), false);
  for (int64_t t = 0; t < (dc.spec ? T : 1); ++t) {
    const std::vector<double> want = dc.spec ? oracle_states_after(d, t + 1) : ref.final_state;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t slot = indices[static_cast<size_t>(n * C + t)];
      written[static_cast<size_t>(slot)] = true;
      EXPECT_LE(rel_rms(row(want, n, slot_elems), pool.get(slot)), state_tol)
          << "request " << n << " token " << t << " slot " << slot;
    }
  }
  for (int64_t s = 0; s < slots; ++s) {
    if (written[static_cast<size_t>(s)]) continue;
    const size_t n = static_cast<size_t>(slot_elems) * (dc.pool == DType::bf16 ? 2 : 4);
    EXPECT_TRUE(
        std::equal(before.begin() + s * n, before.begin() + (s + 1) * n, pool.bytes().begin() + s * n))
        << "slot " << s << " changed";
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, Decode, ::testing::ValuesIn(on_backends(sized_for_this_run(decode_cases()))),
                         case_name);

// A common setup for the tests below: 4 requests of 2 tokens, K = V = 16, HV = 2, an fp32 pool of 10
// slots, request n in slot 2n + 1.
struct Small {
  Data d;
  std::vector<int64_t> indices;
  Pool pool;
  Tensor o;

  // Request n in slot 2n + 1 of a pool of 2B + 2 fp32 slots (slot 0 and every even slot unused).
  explicit Small(StateLayout layout = StateLayout::k_first, int64_t T = 2,
                 std::string_view spec = "B=4 H=1 HV=2 regime=mild h0")
      : Small(with(parse_case(spec), layout, T)) {}
  explicit Small(const Case& c) : pool(DType::f32, 2 * c.B + 2, c.HV * c.K * c.V) {
    make_data(c, d);
    for (int64_t n = 0; n < c.B; ++n) {
      indices.push_back(2 * n + 1);
      pool.set(2 * n + 1, d.h0.data() + n * c.HV * c.K * c.V);
    }
    o = Tensor(DType::f32, c.B, c.T, c.HV, c.V, false);
  }
  static Case with(Case c, StateLayout layout, int64_t T) {
    c.layout = layout;
    c.T = T;
    return c;
  }
  DecodeInputs inputs(int64_t cols = 1) const {
    DecodeInputs in;
    in.fwd = d.inputs();
    in.fwd.initial_state = nullptr;
    in.state_indices = make_indices(indices.data(), d.c.B, cols);
    return in;
  }
  void run(const DecodeInputs& in, const RunOptions& opt = {}) {
    DecodeOutputs out;
    out.o = o.output();
    StatePool v = pool.view();
    decode(d.problem(), in, v, out, opt);
  }
};

class DecodePadding : public EachBackend {};
INSTANTIATE_TEST_SUITE_P(Backends, DecodePadding, each_backend(), backend_name);

TEST_P(DecodePadding, NegativeIndexReadsNothingWritesNothingAndZeroesItsRows) {
  Small s;
  s.indices[1] = -1;
  s.indices[3] = -7;
  s.o.fill_bytes(0xff);
  const std::vector<uint8_t> before = s.pool.bytes();
  s.run(s.inputs(), options());
  EXPECT_TRUE(
      std::equal(before.begin() + 3 * 2048, before.begin() + 4 * 2048, s.pool.bytes().begin() + 3 * 2048))
      << "padding row 1's slot (3) must not be written";
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 16; ++i) {
        EXPECT_EQ(s.o.get(1, t, h, i), 0.0);
        EXPECT_EQ(s.o.get(3, t, h, i), 0.0);
      }
  EXPECT_FALSE(
      std::equal(before.begin() + 1 * 2048, before.begin() + 2 * 2048, s.pool.bytes().begin() + 2048))
      << "request 0's slot was updated";
}

class DecodeVarlen : public EachBackend {};
INSTANTIATE_TEST_SUITE_P(Backends, DecodeVarlen, each_backend(), backend_name);

TEST_P(DecodeVarlen, EmptyRequestsAndUnevenLengths) {
  Data d;
  make_data(parse_case("lengths=1,0,3,2 HV=2 regime=strong h0"), d);
  const int64_t slot_elems = 2 * 16 * 16;
  Pool pool(DType::f32, 6, slot_elems);
  std::vector<int64_t> indices = {4, 0, 2, 5};
  for (int64_t n = 0; n < 4; ++n) pool.set(indices[n], d.h0.data() + n * slot_elems);
  DecodeInputs in;
  in.fwd = d.inputs();
  in.fwd.initial_state = nullptr;
  in.state_indices = make_indices(indices.data(), 4);
  Tensor o(DType::f32, 1, 6, 2, 16, false);
  DecodeOutputs out;
  out.o = o.output();
  StatePool view = pool.view();
  decode(d.problem(), in, view, out, options());
  const reference::ForwardResult ref = oracle_forward(d);
  EXPECT_LE(rel_rms(ref.o, o.packed()), tolerance("decode", DType::f32, "o"));
  for (int64_t n = 0; n < 4; ++n)
    EXPECT_LE(rel_rms(row(ref.final_state, n, slot_elems), pool.get(indices[n])),
              tolerance("decode", DType::f32, "state"))
        << n;
}

// Every bad input is rejected before anything is written: the pool and o stay bitwise unchanged.
class DecodeErrors : public EachBackend {};
INSTANTIATE_TEST_SUITE_P(Backends, DecodeErrors, each_backend(), backend_name);

TEST_P(DecodeErrors, RejectedBeforeAnyWrite) {
  Small s(StateLayout::v_first, 3);
  s.o.fill_bytes(0x5a);
  const std::vector<uint8_t> pool_before = s.pool.bytes();
  const std::vector<uint32_t> o_before = s.o.raw();
  auto rejected = [&](const DecodeInputs& in, const std::string& what, StatePool pool, const Problem& p) {
    DecodeOutputs out;
    out.o = s.o.output();
    try {
      decode(p, in, pool, out, options());
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.pool.bytes(), pool_before) << what;
    EXPECT_EQ(s.o.raw(), o_before) << what;
  };
  const Problem p = s.d.problem();
  std::vector<int64_t> idx = s.indices;
  DecodeInputs in = s.inputs();
  // An index past the pool.
  idx[2] = 10;
  in.state_indices = make_indices(idx.data(), 4);
  rejected(in, "past the pool's 10 slots", s.pool.view(), p);
  // The same slot written twice.
  idx = s.indices;
  idx[2] = idx[0];
  in.state_indices = make_indices(idx.data(), 4);
  rejected(in, "written twice", s.pool.view(), p);
  // [N, C]: a slot one request reads and another writes (one token per request, three columns:
  // request 3 starts from column 2, slot 1, which request 0 writes).
  {
    Small one(StateLayout::k_first, 1);
    std::vector<int64_t> wide = {1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 10, 1};
    std::vector<int64_t> acc = {1, 1, 1, 3};
    Pool big(DType::f32, 12, 2 * 16 * 16);
    DecodeInputs w = one.inputs();
    w.state_indices = make_indices(wide.data(), 4, 3);
    w.num_accepted_tokens = make_indices(acc.data(), 4);
    DecodeOutputs out;
    out.o = one.o.output();
    const std::vector<uint8_t> big_before = big.bytes();
    StatePool v = big.view();
    try {
      decode(one.d.problem(), w, v, out, options());
      ADD_FAILURE() << "accepted a slot read by one request and written by another";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is read by request 3 and written by request 0"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(big.bytes(), big_before);
  }
  Pool big(DType::f32, 12, 2 * 16 * 16);
  // num_accepted_tokens of 0 and above C; indices with too few columns for the tokens.
  std::vector<int64_t> cols3 = {1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 10, 11};
  for (int64_t bad : {0, 4}) {
    std::vector<int64_t> acc = {1, bad, 1, 1};
    DecodeInputs spec = s.inputs();
    spec.state_indices = make_indices(cols3.data(), 4, 3);
    spec.num_accepted_tokens = make_indices(acc.data(), 4);
    DecodeOutputs out;
    out.o = s.o.output();
    const std::vector<uint8_t> big_before = big.bytes();
    StatePool v = big.view();
    try {
      decode(p, spec, v, out, options());
      ADD_FAILURE() << "accepted num_accepted_tokens " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("num_accepted_tokens"), std::string::npos) << e.what();
    }
    EXPECT_EQ(big.bytes(), big_before);
  }
  std::vector<int64_t> cols2 = {1, 2, 3, 4, 5, 6, 7, 8};
  in.state_indices = make_indices(cols2.data(), 4, 2);
  rejected(in, "longest request", s.pool.view(), p);
  // Indices of the wrong shape or type; a pool of the wrong dtype, layout or size; inputs.
  in.state_indices = make_indices(s.indices.data(), 3);
  rejected(in, "expected 4 rows", s.pool.view(), p);
  in = s.inputs();
  in.state_indices.dtype = static_cast<IndexType>(7);
  rejected(in, "index type", s.pool.view(), p);
  in = s.inputs();
  StatePool bad_pool = s.pool.view();
  bad_pool.dtype = static_cast<DType>(9);
  rejected(in, "'pool'", bad_pool, p);
  bad_pool = s.pool.view();
  bad_pool.slot_stride = 100;
  rejected(in, "slot_stride", bad_pool, p);
  bad_pool = s.pool.view();
  bad_pool.data = nullptr;
  rejected(in, "null data", bad_pool, p);
  in.fwd.initial_state = s.d.h0.data();
  rejected(in, "initial_state", s.pool.view(), p);
  // o sharing memory with the pool.
  in = s.inputs();
  {
    DecodeOutputs out;
    out.o = s.o.output();
    StatePool v = s.pool.view();
    v.data = s.o.output().data;
    v.num_slots = 1;
    EXPECT_THROW(decode(p, in, v, out, options()), Error);
  }
}

// On the CPU backend: results do not depend on the thread count, on how often the pool was used, or on the
// callers.
TEST(DecodeThreads, BitwiseIdenticalOverThreadsRepeatsAndCallers) {
  auto run_once = [](int threads, Context* ctx) {
    Small s(StateLayout::k_first, 3);
    RunOptions opt;
    opt.num_threads = threads;
    opt.context = ctx;
    for (int step = 0; step < 5; ++step) s.run(s.inputs(), opt);  // five steps on the same slots
    return std::make_pair(s.pool.bytes(), s.o.raw());
  };
  const auto ref = run_once(1, nullptr);
  for (int threads : {2, 3, 8}) {
    const auto got = run_once(threads, nullptr);
    EXPECT_EQ(got.first, ref.first) << threads;
    EXPECT_EQ(got.second, ref.second) << threads;
  }
  // Several callers at once: on the global context (their calls take turns) and on their own.
  Context own[4];
  for (bool shared : {true, false}) {
    std::vector<std::thread> callers;
    std::atomic<int> mismatches{0};
    for (int i = 0; i < 4; ++i)
      callers.emplace_back([&, i] {
        for (int rep = 0; rep < 5; ++rep) {
          const auto got = run_once(1 + (i + rep) % 3, shared ? nullptr : &own[i]);
          if (got != ref) ++mismatches;
        }
      });
    for (auto& t : callers) t.join();
    EXPECT_EQ(mismatches.load(), 0) << (shared ? "global context" : "own contexts");
  }
}

// A step with enough state to be shared among workers (a worker per 4 MiB of fp32-sized state; the
// small cases above run on one): 16 requests x 8 heads x 64 KiB = 8 MiB, two workers. The same
// results on 1 to 8 threads, in both layouts.
TEST(DecodeThreads, LargeStepsSplitAmongWorkersBitwiseIdentical) {
  for (StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
    auto run_once = [&](int threads) {
      Small s(layout, 1, "B=16 H=8 HV=8 K=128 V=128 regime=strong h0");
      RunOptions opt;
      opt.num_threads = threads;
      for (int step = 0; step < 3; ++step) s.run(s.inputs(), opt);
      return std::make_pair(s.pool.bytes(), s.o.raw());
    };
    const auto ref = run_once(1);
    for (int threads : {2, 3, 8}) EXPECT_EQ(run_once(threads), ref) << threads << " threads";
  }
}

// The slot steps fetch the next state either as requests toward L2 or as a stream toward L1, by CPU
// (tuning.hpp: decode_next_state_to_l2); each CPU runs one of them, so both are run here, on both
// layouts and on two workers (each fetching its next items' states), and must agree bit for bit.
TEST(DecodeThreads, NextStateFetchChangesNoResult) {
  for (StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
    auto run_once = [&](int to_l2) {
      cpu::set_next_state_to_l2_for_testing(to_l2);
      Small s(layout, 1, "B=16 H=4 HV=8 K=128 V=128 regime=strong h0");
      RunOptions opt;
      opt.num_threads = 2;
      for (int step = 0; step < 3; ++step) s.run(s.inputs(), opt);
      cpu::set_next_state_to_l2_for_testing(-1);
      return std::make_pair(s.pool.bytes(), s.o.raw());
    };
    EXPECT_EQ(run_once(1), run_once(0)) << (layout == StateLayout::k_first ? "K-first" : "V-first");
  }
}

// Pooled prefill: the same outputs and final states as the plain call, bit for bit, with the states
// read from and written to slots; a negative index starts from zeros and stores nothing;
// has_initial_state = 0 starts from zeros and stores.
class PooledPrefill : public EachBackend {};
INSTANTIATE_TEST_SUITE_P(Backends, PooledPrefill, each_backend(), backend_name);

TEST_P(PooledPrefill, EqualsThePlainForward) {
  for (Kernel kernel : kKernels) {
    for (DType pool_dtype : {DType::f32, DType::bf16}) {
      for (StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
        SCOPED_TRACE(std::string(kernel_name(kernel)) + (pool_dtype == DType::bf16 ? " bf16" : " f32") +
                     (layout == StateLayout::v_first ? " v_first" : " k_first"));
        Case c =
            parse_case("lengths=70,1,0,130 HV=2 K=32 V=16 regime=unbounded softplus beta=sigmoid l2norm h0");
        c.layout = layout;
        Data d;
        make_data(c, d);
        const int64_t slot_elems = 2 * 32 * 16;
        Pool pool(pool_dtype, 8, slot_elems);
        const std::vector<int64_t> indices = {6, -1, 3, 0};
        const std::vector<uint8_t> has = {1, 1, 1, 0};
        for (int64_t n = 0; n < 4; ++n) {
          if (indices[n] >= 0) pool.set(indices[n], d.h0.data() + n * slot_elems);
          // The plain call starts from what the pooled one reads: the slot's (rounded) state, or zeros.
          for (int64_t i = 0; i < slot_elems; ++i) {
            const bool reads = indices[n] >= 0 && has[n];
            d.h0[n * slot_elems + i] = reads ? static_cast<float>(pool.get(indices[n])[i]) : 0.0f;
          }
        }
        const std::vector<uint8_t> before = pool.bytes();
        const ForwardRun plain = run_forward(kernel, d, options(), false);
        RunOptions opt = options();  // the kernel under test itself (run_forward does the same)
        opt.forward_kernel = kernel == Kernel::chunk ? ForwardKernel::chunked : ForwardKernel::recurrent;
        std::vector<float> plain_final(static_cast<size_t>(4 * slot_elems));
        {
          ForwardOutputs out;
          Tensor o(DType::f32, 1, 201, 2, 16, false);
          out.o = o.output();
          out.final_state = plain_final.data();
          if (kernel == Kernel::chunk)
            chunk_forward(d.problem(), d.inputs(), out, opt);
          else
            recurrent_forward(d.problem(), d.inputs(), out, opt);
        }
        PooledStates ps;
        ps.pool = pool.view();
        ps.indices = make_indices(indices.data(), 4);
        ps.has_initial_state = has.data();
        ForwardInputs in = d.inputs();
        in.initial_state = nullptr;
        in.pooled_states = &ps;
        Tensor o(DType::f32, 1, 201, 2, 16, false);
        ForwardOutputs out;
        out.o = o.output();
        if (kernel == Kernel::chunk)
          chunk_forward(d.problem(), in, out, opt);
        else
          recurrent_forward(d.problem(), in, out, opt);
        EXPECT_TRUE(bitwise_equal(o, plain.out.o)) << "o";
        for (int64_t n = 0; n < 4; ++n) {
          if (indices[n] < 0) continue;
          std::vector<float> want(plain_final.begin() + n * slot_elems,
                                  plain_final.begin() + (n + 1) * slot_elems);
          if (pool_dtype == DType::bf16)
            for (float& x : want) x = round_bf16(x);
          const std::vector<double> got = pool.get(indices[n]);
          EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin())) << "final state of sequence " << n;
        }
        for (int64_t slot : {1, 2, 4, 5, 7}) EXPECT_TRUE(pool.slot_poisoned(slot)) << slot;
        (void)before;
      }
    }
  }
}

TEST_P(PooledPrefill, Errors) {
  Small s;
  PooledStates ps;
  ps.pool = s.pool.view();
  std::vector<int64_t> dup = {1, 3, 1, 5};
  ps.indices = make_indices(dup.data(), 4);
  ForwardInputs in = s.d.inputs();
  in.initial_state = nullptr;
  in.pooled_states = &ps;
  ForwardOutputs out;
  out.o = s.o.output();
  const std::vector<uint8_t> before = s.pool.bytes();
  EXPECT_THROW(chunk_forward(s.d.problem(), in, out, options()), Error);
  std::vector<int64_t> far = {1, 3, 10, 5};
  ps.indices = make_indices(far.data(), 4);
  EXPECT_THROW(chunk_forward(s.d.problem(), in, out, options()), Error);
  ps.indices = make_indices(s.indices.data(), 4);
  in.initial_state = s.d.h0.data();
  EXPECT_THROW(chunk_forward(s.d.problem(), in, out, options()), Error);
  in.initial_state = nullptr;
  std::vector<float> final_state(4 * 2 * 16 * 16);
  out.final_state = final_state.data();
  EXPECT_THROW(recurrent_forward(s.d.problem(), in, out, options()), Error);
  EXPECT_EQ(s.pool.bytes(), before);
}

// recurrent_forward hands short sequences (no chunk_states asked for) to the decode kernel: checked
// against the oracle here, with both layouts, in place (final_state == initial_state) or not.
TEST(RecurrentShortSequences, DecodeKernelMatchesOracle) {
  int i = 0;
  for (int64_t T : {1, 2, 7, 16}) {
    for (StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
      for (bool in_place : {false, true}) {
        Case c;
        c.B = 3;
        c.T = T;
        c.H = 2;
        c.HV = 4;
        c.K = i % 2 ? 128 : 21;  // 21: a tail of rows past the kernels' groups of four (K-first)
        c.V = i % 3 ? 64 : 9;
        c.layout = layout;
        c.initial_state = i % 4 != 3 || in_place;
        c.regime = i % 2 ? Regime::unbounded : Regime::spike;
        if (i % 2) {
          c.gate = GateMode::softplus;
          c.beta = BetaMode::sigmoid_x2;
          c.qk_l2norm = true;
        }
        c.strided = i % 3 == 0;
        c.seed = 500 + static_cast<uint64_t>(i++);
        SCOPED_TRACE(c.name() + (in_place ? " in place" : ""));
        Data d;
        make_data(c, d);
        const reference::ForwardResult ref = oracle_forward(d);
        std::vector<float> state = d.h0;
        if (state.empty()) state.assign(static_cast<size_t>(d.state_elems()), 0.0f);
        std::vector<float> final_state(state.size(), -1.0f);
        Tensor o(c.dtype, c.B, T, c.HV, c.V, c.strided);
        ForwardInputs in = d.inputs();
        if (in_place) in.initial_state = state.data();
        ForwardOutputs out;
        out.o = o.output();
        out.final_state = in_place ? state.data() : final_state.data();
        recurrent_forward(d.problem(), in, out);
        EXPECT_LE(rel_rms(ref.o, o.packed()), tolerance("forward", c.dtype, "o"));
        EXPECT_LE(rel_rms(ref.final_state, in_place ? state : final_state),
                  tolerance("forward", DType::f32, "state"));
      }
    }
  }
}

}  // namespace
}  // namespace kda::test
