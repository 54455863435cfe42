// AVX512-BF16's product kernel, included twice by bf16_units.cpp, each time inside a namespace of its
// own: once over the instructions (the avx512_bf16 unit) and once over a plain C++ model of them (the
// avx512_bf16_model unit), so that the kernel's register tiles, their row tails and its skips
// (Combine::a_lower, c_lower) run and are tested on CPUs without AVX512-BF16 too. The includer
// defines KDA_LANES_FN (the functions' attributes) and, in its namespace, a type Lanes:
//   Sums, Pairs                     16 fp32 sums; 16 pairs of bf16 (32 words)
//   zero(), load(p), broadcast(pair), dpbf16ps(sums, a, b)   the instructions the kernel uses
//   combine_row(c, sums, combine)   16 sums into C's row c
// No include guard: included once per namespace.

// AVX512-BF16: a register tile of MR rows x NV vectors of 16 columns; each step takes one pair of A's
// row (broadcast) against one pair-row of B (16 pairs a vector).
template <int MR, int NV>
KDA_LANES_FN void avx512_tile(int64_t pairs, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                              float* C, int64_t ldc, int64_t n, const Combine& combine, int64_t row0) {
  Lanes::Sums acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Lanes::zero();
  for (int64_t p = 0; p < pairs; ++p) {
    Lanes::Pairs b[NV];
    for (int v = 0; v < NV; ++v) b[v] = Lanes::load(B + p * ldb + 32 * v);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, sizeof pair);
      const Lanes::Pairs a = Lanes::broadcast(pair);
      for (int v = 0; v < NV; ++v) acc[r][v] = Lanes::dpbf16ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      Lanes::combine_row(combine.row(C, ldc, row0 + r) + n + 16 * v, acc[r][v], combine);
}

template <int MR>
KDA_LANES_FN void avx512_rows(int nv, int64_t pairs, const uint16_t* A, int64_t lda, const uint16_t* B,
                              int64_t ldb, float* C, int64_t ldc, int64_t n, const Combine& combine,
                              int64_t row0) {
  switch (nv) {
    case 1: return avx512_tile<MR, 1>(pairs, A, lda, B, ldb, C, ldc, n, combine, row0);
    case 2: return avx512_tile<MR, 2>(pairs, A, lda, B, ldb, C, ldc, n, combine, row0);
    case 3: return avx512_tile<MR, 3>(pairs, A, lda, B, ldb, C, ldc, n, combine, row0);
    default: return avx512_tile<MR, 4>(pairs, A, lda, B, ldb, C, ldc, n, combine, row0);
  }
}

KDA_LANES_FN void avx512_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B, float* C,
                              int64_t ldc, const Combine& combine) {
  constexpr int kRows = 6;  // 6 x 4 accumulators, 4 B vectors and a broadcast: 29 of 32 registers
  const int64_t lda = packed_depth(K), ldb = 2 * packed_cols(N), pairs = packed_depth(K) / 2;
  for (int64_t n = 0; n < N; n += 64) {
    const int nv = static_cast<int>(std::min<int64_t>(4, (N - n) / 16));
    const uint16_t* Bn = B + 2 * n;
    int64_t m = 0;
    // The pairs rows [first, first + rows) need: all, or for a lower triangular A those up to the
    // last row's.
    const auto depth = [&](int64_t first, int64_t rows) {
      return combine.a_lower ? std::min(pairs, (first + rows + 1) / 2) : pairs;
    };
    // The vectors of columns rows [first, first + rows) need: all, or for a lower C those up to the
    // last row's column (none when it lies before n).
    const auto vectors = [&](int64_t first, int64_t rows) {
      return combine.c_lower ? static_cast<int>(std::clamp<int64_t>((first + rows - n + 15) / 16, 0, nv))
                             : nv;
    };
    for (; m + kRows <= M; m += kRows) {
      if (const int v = vectors(m, kRows); v > 0)
        avx512_rows<kRows>(v, depth(m, kRows), A + m * lda, lda, Bn, ldb, C, ldc, n, combine, m);
    }
    const uint16_t* Am = A + m * lda;
    const int64_t tail = depth(m, M - m);
    const int v = vectors(m, M - m);
    if (v == 0) continue;
    switch (M - m) {
      case 1: avx512_rows<1>(v, tail, Am, lda, Bn, ldb, C, ldc, n, combine, m); break;
      case 2: avx512_rows<2>(v, tail, Am, lda, Bn, ldb, C, ldc, n, combine, m); break;
      case 3: avx512_rows<3>(v, tail, Am, lda, Bn, ldb, C, ldc, n, combine, m); break;
      case 4: avx512_rows<4>(v, tail, Am, lda, Bn, ldb, C, ldc, n, combine, m); break;
      case 5: avx512_rows<5>(v, tail, Am, lda, Bn, ldb, C, ldc, n, combine, m); break;
      default: break;
    }
  }
}
