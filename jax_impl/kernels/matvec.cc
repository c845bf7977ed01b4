// y (M, N) = x (M, K) @ w (K, N) in fp32 for a few rows M (decode, verify, batches of them), split over XLA:CPU's
// thread pool; several w (N may differ) at once.
//
// Why: XLA:CPU runs a product this small on one thread, and a decode step is little but such products, so jax_impl
// used one of the machine's cores where llama.cpp uses all. The work goes in units to whichever thread claims them;
// the caller claims too, so it never waits on a thread that has not started.
//
// One sum for every output, however the work is split: w's rows go in chunks of CHUNK rows and those in groups of
// GROUP rows; a group's products are one chain of fused multiply-adds over k in order (acc = fma(x[m, k], w[k, n],
// acc) from 0), a chunk's groups are added in order, and the chunks are added in order. So the bits do not depend
// on the number of threads, which thread took what, the path below, how many rows there are or which tile a row or
// column fell in: a batch of requests' rows gets the bits of each request alone. (Short chains: one chain over a
// whole chunk was 5x further from the float64 product than numpy's float32 one on the tiny checkpoints.)
//
// Two ways to split, by the number of rows:
//   * a few rows (decode, verify: the weights' memory traffic is the cost): a unit is a chunk of w's rows, read from
//     memory front to back; its sums go into a partial (M, N), and the partials are added in chunk order at the end.
//   * more rows (a batch: arithmetic is the cost): a unit is a block of w's columns, its chunks in order, each
//     chunk's sums added to y straight away; nothing is left to add at the end.
// Within a unit, a tile of up to ROWS_PER_TILE rows x COLUMN_VECTORS vectors of columns keeps its chains in
// registers, each vector of w loaded once for the tile's rows (and from the L1 cache for the next tile's rows),
// while the next rows of w of the same columns are prefetched.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

constexpr int64_t CHUNK = 128;           // rows of w whose sums make one partial
constexpr int64_t GROUP = 16;            // rows of w whose products make one chain (a multiple of 16 divides CHUNK)
constexpr int64_t CHUNKED_ROWS = 4;      // rows up to which a unit is a chunk of w's rows (else a block of columns)
constexpr int64_t SERIAL_BELOW = 65536;  // multiply-adds under this: one thread (waking one costs more than it saves)
constexpr int64_t Y_BLOCK = 256 << 10;   // bytes of sums a block of columns may take (in the L2 cache while w streams)
constexpr int64_t BLOCKS_PER_THREAD = 1; // blocks of columns per thread, where the columns allow

// One vector of LANES floats and its fused multiply-add, by what the compiler targets (-march=native). Without FMA
// instructions every path (vector and scalar) multiplies and adds in two roundings (built with -ffp-contract=off),
// so the bits still do not depend on the path.
#if defined(__AVX512F__)
typedef __m512 vec;
constexpr int LANES = 16, ROWS_PER_TILE = 8, COLUMN_VECTORS = 3;  // 24 sums + 3 of w in 32 registers
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(float a, vec w, vec acc) { return _mm512_fmadd_ps(_mm512_set1_ps(a), w, acc); }
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline float sfma(float a, float w, float acc) { return std::fma(a, w, acc); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
constexpr int LANES = 8, ROWS_PER_TILE = 4, COLUMN_VECTORS = 3;   // 12 sums + 3 of w in 16 registers
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vfma(float a, vec w, vec acc) { return _mm256_fmadd_ps(_mm256_set1_ps(a), w, acc); }
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline float sfma(float a, float w, float acc) { return std::fma(a, w, acc); }
#else
typedef float vec __attribute__((vector_size(32)));  // GCC and Clang lower it on any target
constexpr int LANES = 8, ROWS_PER_TILE = 4, COLUMN_VECTORS = 2;
static inline vec vload(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
static inline void vstore(float* p, vec v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vec vfma(float a, vec w, vec acc) { return acc + a * w; }
static inline vec vzero() { return vec{}; }
static inline vec vadd(vec a, vec b) { return a + b; }
static inline float sfma(float a, float w, float acc) { return acc + a * w; }
#endif

// y (R rows, ldy apart)[:, :V * LANES] += a (R rows, lda apart)[:, :kn] @ w (kn rows, ldw apart)[:, :V * LANES],
// kn <= GROUP: R x V chains from 0 in registers, each vector of w loaded once for the R rows, then added to y.
template <int R, int V>
static inline void tile(const float* a, int64_t lda, const float* w, int64_t ldw, int64_t kn, float* y, int64_t ldy) {
  vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < kn; ++k) {
    vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = vload(w + k * ldw + v * LANES);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(a[r * lda + k], wv[v], acc[r][v]);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) vstore(y + r * ldy + v * LANES, vadd(vload(y + r * ldy + v * LANES), acc[r][v]));
}

// tile<R, V> for a run-time row count R <= ROWS_PER_TILE (the last tile of a batch's rows).
template <int V, int R = ROWS_PER_TILE>
static inline void tile_upto(int rows, const float* a, int64_t lda, const float* w, int64_t ldw, int64_t kn, float* y,
                             int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) return tile_upto<V, R - 1>(rows, a, lda, w, ldw, kn, y, ldy);
  }
  tile<R, V>(a, lda, w, ldw, kn, y, ldy);
}

// The same for all M rows, in tiles of rows: the kn x V vectors of w come from memory for the first tile and from
// the L1 cache for the others.
template <int V>
static void column_tile(const float* a, int64_t lda, int64_t M, const float* w, int64_t ldw, int64_t kn, float* y,
                        int64_t ldy) {
  for (int64_t m = 0; m < M; m += ROWS_PER_TILE)
    tile_upto<V>(static_cast<int>(std::min<int64_t>(ROWS_PER_TILE, M - m)), a + m * lda, lda, w, ldw, kn,
                 y + m * ldy, ldy);
}

// out (M rows, ldo apart)[:, :n1 - n0] = x[:, k0:k1] @ w[k0:k1, n0:n1] (w N columns wide): one chunk's sums, the
// chains of its groups of GROUP rows added in order; one group of w's rows at a time (the next group's rows of the
// same columns prefetched: 16 rows in flight streamed 10-25% faster than 32 for 8-16 rows on an AMD EPYC), in tiles of
// COLUMN_VECTORS vectors of columns, then single vectors, then one column at a time (the same sums on every path).
static void chunk_sums(const float* x, int64_t K, const float* w, int64_t N, int64_t M, int64_t k0, int64_t k1,
                       int64_t n0, int64_t n1, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) std::fill(out + m * ldo, out + m * ldo + (n1 - n0), 0.0f);
  for (int64_t k = k0; k < k1; k += GROUP) {
    const int64_t end = std::min(k + GROUP, k1), ahead = std::min(GROUP, K - end);
    int64_t n = n0;
    for (; n + COLUMN_VECTORS * LANES <= n1; n += COLUMN_VECTORS * LANES) {
      for (int64_t i = end; i < end + ahead; ++i)  // the next rows of these columns, into the L2 cache
        for (int v = 0; v < COLUMN_VECTORS * LANES; v += 16) __builtin_prefetch(w + i * N + n + v, 0, 1);
      column_tile<COLUMN_VECTORS>(x + k, K, M, w + k * N + n, N, end - k, out + (n - n0), ldo);
    }
    for (; n + LANES <= n1; n += LANES) column_tile<1>(x + k, K, M, w + k * N + n, N, end - k, out + (n - n0), ldo);
    for (; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t i = k; i < end; ++i) acc = sfma(x[m * K + i], w[i * N + n], acc);
        out[m * ldo + n - n0] += acc;
      }
  }
}

// y[:, n0:n1] = x (M, K) @ w[:, n0:n1]: chunk by chunk, each chunk's sums (in `scratch`) added to y in chunk order.
static void column_block(const float* x, int64_t K, const float* w, int64_t N, int64_t M, int64_t n0, int64_t n1,
                         float* y, std::vector<float>& scratch) {
  const int64_t width = n1 - n0;
  scratch.resize(M * width);
  for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
    chunk_sums(x, K, w, N, M, k0, std::min(K, k0 + CHUNK), n0, n1, scratch.data(), width);
    for (int64_t m = 0; m < M; ++m) {
      float* row = y + m * N + n0;
      const float* sums = scratch.data() + m * width;
      if (k0 == 0)
        std::copy(sums, sums + width, row);
      else
        for (int64_t n = 0; n < width; ++n) row[n] += sums[n];
    }
  }
}

// Columns of a block: at most Y_BLOCK bytes of sums for the M rows, about BLOCKS_PER_THREAD blocks per thread where
// N allows, whole cache lines (threads never write the same line).
static int64_t block_columns(int64_t M, int64_t N, int64_t threads) {
  const int64_t most = std::max<int64_t>(Y_BLOCK / (4 * M), COLUMN_VECTORS * LANES);
  const int64_t even = (N + BLOCKS_PER_THREAD * threads - 1) / (BLOCKS_PER_THREAD * threads);
  return (std::min(most, std::max<int64_t>(even, COLUMN_VECTORS * LANES)) + 15) / 16 * 16;
}

// The units of one call's products, claimed by the caller and the pool's threads; shared, so a late thread finds
// it alive (and nothing left to claim).
struct Products {
  struct Unit {
    const float* w;
    float* y;        // a column block's output, or a chunk's partial (M, N)
    int64_t N, k0, k1, n0, n1;
  };
  const float* x;
  int64_t M, K;
  bool by_columns;
  std::vector<Unit> units;
  std::vector<float> partials;
  std::atomic<int64_t> next{0}, done{0};

  void claim() {
    thread_local std::vector<float> scratch;
    for (int64_t c; (c = next.fetch_add(1)) < static_cast<int64_t>(units.size());) {
      const Unit& u = units[c];
      if (by_columns)
        column_block(x, K, u.w, u.N, M, u.n0, u.n1, u.y, scratch);
      else
        chunk_sums(x, K, u.w, u.N, M, u.k0, u.k1, 0, u.N, u.y, u.N);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// ys[i] (M, N_i) = x (M, K) @ ws[i] (K, N_i): the products of one input, done in one call (one hand-off to the
// pool instead of one per matrix).
static ffi::Error MatVec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                         ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] == 0 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("matvec: expected x (M, K > 0) and as many ws as ys");
  auto products = std::make_shared<Products>();
  const int64_t M = products->M = xd[0], K = products->K = xd[1];
  products->x = x.typed_data();
  products->by_columns = M > CHUNKED_ROWS;
  int64_t macs = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !ys.get<ffi::Buffer<ffi::F32>>(i).has_value() || w->dimensions().size() != 2 ||
        w->dimensions()[0] != K)
      return ffi::Error::InvalidArgument("matvec: each w must be fp32 (K, N) with x's K");
    macs += K * w->dimensions()[1];
  }
  const int64_t threads = macs < SERIAL_BELOW ? 1 : std::max<int64_t>(pool.num_threads(), 1);
  std::vector<float*> outs;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    const int64_t N = w->dimensions()[1];
    float* y = (*ys.get<ffi::Buffer<ffi::F32>>(i))->typed_data();
    outs.push_back(y);
    if (products->by_columns) {
      const int64_t columns = block_columns(M, N, threads);
      for (int64_t n0 = 0; n0 < N; n0 += columns)
        products->units.push_back({w->typed_data(), y, N, 0, K, n0, std::min(N, n0 + columns)});
    } else {
      for (int64_t k0 = 0; k0 < K; k0 += CHUNK)
        products->units.push_back({w->typed_data(), nullptr, N, k0, std::min(K, k0 + CHUNK), 0, N});
    }
  }
  if (!products->by_columns) {
    int64_t floats = 0;
    for (auto& u : products->units) floats += M * u.N;
    products->partials.resize(floats);
    float* partial = products->partials.data();
    for (auto& u : products->units) u.y = partial, partial += M * u.N;
  }

  const int64_t units = products->units.size();
  const int64_t helpers = std::min(threads, units) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([products] { products->claim(); });
  products->claim();
  while (products->done.load(std::memory_order_acquire) < units) {
  }  // the units still out are running on other threads

  if (!products->by_columns) {
    auto unit = products->units.begin();
    for (float* out : outs) {  // each product's partials, added in chunk order
      const int64_t size = M * unit->N;
      std::copy(unit->y, unit->y + size, out);
      for (++unit; unit != products->units.end() && unit->k0 > 0; ++unit)
        for (int64_t i = 0; i < size; ++i) out[i] += unit->y[i];
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(qwen35_matvec_f32, MatVec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
