// AMX's product kernel, included twice by bf16_units.cpp, each time inside a namespace of its own:
// once over the tile instructions (the amx unit) and once over a plain C++ model of them (the
// amx_model unit). So the kernel's blocking, its skips (Combine::a_lower, c_lower), its stage,
// its direct tile stores and its tile loads of C run and are tested on every CPU, and the sanitizers
// check its reads and writes, which they cannot see inside tile instructions. The includer defines
// KDA_TILE_FN (the functions' attributes) and, in its namespace, a type Tiles:
//   begin(), end()                  around one product (the tile configuration)
//   zero<t>(), load<t>(src, stride), store<t>(dst, stride), dpbf16ps<c, a, b>()
//                                   the four instructions, on tile registers t (strides in bytes)
//   combine_row(c, row, combine)    one row of 16 staged results into C's row c
// No include guard: included once per namespace.

// Tiles 0-3 hold a 2 x 2 block of 16 x 16 fp32 results, 4-5 two 16-row slices of A (16 rows x 32
// bf16), 6-7 two 16-column slices of B (16 pair-rows x 16 pairs); each TDPBF16PS is 16 x 16 x 32
// products. The result tiles start from zero and reach C through vector code (or, with load_c, from a
// C written long before): a tile load of C right after the vector stores that wrote it waits for
// those stores to drain, far longer than the arithmetic (docs/performance.md, 2026-12-06, later).

// One block of 1 or 2 row tiles x 1 or 2 column tiles over the whole depth; tile 2i + j goes to
// stage[2i + j], or, with `direct`, straight to its place in C (rows i, columns j of the block).
// With `load`, the result tiles start from C's block (at `direct`) instead of zero.
template <int RT, int CT>
KDA_TILE_FN void amx_block(Tiles& tiles, int64_t depth, const uint16_t* A, int64_t lda, const uint16_t* B,
                           int64_t ldb, float (*stage)[256], float* const* direct, int64_t ldc, bool load) {
  if (load) {
    tiles.template load<0>(direct[0], ldc * 4);
    if constexpr (CT == 2) tiles.template load<1>(direct[0] + 16, ldc * 4);
    if constexpr (RT == 2) tiles.template load<2>(direct[1], ldc * 4);
    if constexpr (RT == 2 && CT == 2) tiles.template load<3>(direct[1] + 16, ldc * 4);
  } else {
    tiles.template zero<0>();
    if constexpr (CT == 2) tiles.template zero<1>();
    if constexpr (RT == 2) tiles.template zero<2>();
    if constexpr (RT == 2 && CT == 2) tiles.template zero<3>();
  }
  for (int64_t k = 0; k < depth; k += 32) {
    tiles.template load<4>(A + k, lda * 2);
    tiles.template load<6>(B + k / 2 * ldb, ldb * 2);
    tiles.template dpbf16ps<0, 4, 6>();
    if constexpr (CT == 2) {
      tiles.template load<7>(B + k / 2 * ldb + 32, ldb * 2);
      tiles.template dpbf16ps<1, 4, 7>();
    }
    if constexpr (RT == 2) {
      tiles.template load<5>(A + 16 * lda + k, lda * 2);
      tiles.template dpbf16ps<2, 5, 6>();
      if constexpr (CT == 2) tiles.template dpbf16ps<3, 5, 7>();
    }
  }
  if (direct != nullptr) {
    tiles.template store<0>(direct[0], ldc * 4);
    if constexpr (CT == 2) tiles.template store<1>(direct[0] + 16, ldc * 4);
    if constexpr (RT == 2) tiles.template store<2>(direct[1], ldc * 4);
    if constexpr (RT == 2 && CT == 2) tiles.template store<3>(direct[1] + 16, ldc * 4);
    return;
  }
  tiles.template store<0>(stage[0], 64);
  if constexpr (CT == 2) tiles.template store<1>(stage[1], 64);
  if constexpr (RT == 2) tiles.template store<2>(stage[2], 64);
  if constexpr (RT == 2 && CT == 2) tiles.template store<3>(stage[3], 64);
}

KDA_TILE_FN void amx_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B, float* C,
                          int64_t ldc, const Combine& combine) {
  const int64_t depth = packed_depth(K), lda = depth, ldb = 2 * packed_cols(N);
  Tiles tiles;
  tiles.begin();
  alignas(64) float stage[4][256];
  for (int64_t m = 0; m < M; m += 32) {
    const int rt = M - m > 16 ? 2 : 1;
    // A lower triangular A's rows [m, m + 16 rt) end at depth m + 16 rt (Combine::a_lower).
    const int64_t block_depth = combine.a_lower ? std::min(depth, packed_depth(m + 16 * rt)) : depth;
    // A lower C (Combine::c_lower) needs the columns up to the block's last row, m + 16 rt - 1.
    const int64_t columns = combine.c_lower ? std::min(N, m + 16 * rt) : N;
    for (int64_t n = 0; n < columns; n += 32) {
      const int ct = columns - n > 16 ? 2 : 1;
      const uint16_t* Am = A + m * lda;
      const uint16_t* Bn = B + 2 * n;
      float* rows[2] = {combine.row(C, ldc, m) + n, rt == 2 ? combine.row(C, ldc, m + 16) + n : nullptr};
      // Whole tiles that overwrite C are stored in place, and so are those that add to a C its caller
      // wrote long enough ago (load_c: a tile load right after vector stores to the same lines waits
      // for them to drain); the rest pass through the stage.
      const bool whole = M - m >= 16 * rt;
      const bool load = whole && combine.accumulate && combine.load_c;
      float* const* direct = whole && (!combine.accumulate || load) ? rows : nullptr;
      if (rt == 2 && ct == 2)
        amx_block<2, 2>(tiles, block_depth, Am, lda, Bn, ldb, stage, direct, ldc, load);
      else if (rt == 2)
        amx_block<2, 1>(tiles, block_depth, Am, lda, Bn, ldb, stage, direct, ldc, load);
      else if (ct == 2)
        amx_block<1, 2>(tiles, block_depth, Am, lda, Bn, ldb, stage, direct, ldc, load);
      else
        amx_block<1, 1>(tiles, block_depth, Am, lda, Bn, ldb, stage, direct, ldc, load);
      if (direct != nullptr) continue;
      // Tile 2i + j holds rows m + 16i.., columns n + 16j..; rows past M go nowhere.
      for (int i = 0; i < rt; ++i)
        for (int64_t r = 0; r < std::min<int64_t>(16, M - m - 16 * i); ++r) {
          const int64_t row = m + 16 * i + r;
          for (int j = 0; j < ct; ++j)
            tiles.combine_row(combine.row(C, ldc, row) + n + 16 * j, stage[2 * i + j] + 16 * r, combine);
        }
    }
  }
  tiles.end();
}
