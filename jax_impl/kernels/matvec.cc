// y (M, N) = x (M, K) @ w (K, N) in fp32 for a few rows M (decode, verify, batches of them), split over XLA:CPU's
// thread pool; several w (N may differ) at once.
//
// Why: XLA:CPU runs a product this small on one thread, and a decode step is little but such products, so jax_impl
// used one of the machine's cores where llama.cpp uses all. Here the K rows of w go in fixed chunks of CHUNK rows to
// whichever thread claims them; the caller claims too, so it never waits on a thread that has not started.
//
// Same bits on any machine: each chunk's partial sum is taken in a fixed order (8 rows at a time) and the partials
// are added in chunk order, whatever the number of threads or which thread took which chunk.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

constexpr int64_t CHUNK = 128;           // rows of w per unit of work (a multiple of 8)
constexpr int64_t SERIAL_BELOW = 65536;  // multiply-adds under this: one thread (waking another costs more than it saves)
constexpr int64_t Y_BLOCK = 256 << 10;    // bytes of y a chunk's column block keeps in cache (half this CPU's L2)

typedef float v8 __attribute__((vector_size(32)));  // 8 lanes (GCC and Clang lower it on any target)

static inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline void store8(float* p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

// 8 rows of w weighted by a row's 8 values of x: one fixed shape of sum on every path, so the same bits.
template <typename T>
static inline T sum8(const float* a, T w0, T w1, T w2, T w3, T w4, T w5, T w6, T w7) {
  return ((a[0] * w0 + a[1] * w1) + (a[2] * w2 + a[3] * w3)) + ((a[4] * w4 + a[5] * w5) + (a[6] * w6 + a[7] * w7));
}

// y[n0:width] += a (8,) @ r[:, n0:width] for r (8 rows, ld apart): the compiler vectorizes over n and keeps a's 8
// values in registers.
static void rows8_one(const float* a, const float* r, int64_t ld, int64_t width, float* y, int64_t n0 = 0) {
  for (int64_t n = n0; n < width; ++n)
    y[n] += sum8(a, r[n], r[ld + n], r[2 * ld + n], r[3 * ld + n], r[4 * ld + n], r[5 * ld + n], r[6 * ld + n],
                 r[7 * ld + n]);
}

// y (R, width; rows ld apart) += a (R, 8; rows K apart) @ r (8, width; rows ld apart): each vector of r is loaded
// once for all R rows.
template <int R>
static void rows8_many(const float* a, int64_t K, const float* r, int64_t ld, int64_t width, float* y) {
  int64_t n = 0;
  for (; n + 8 <= width; n += 8) {
    const v8 w0 = load8(r + n), w1 = load8(r + ld + n), w2 = load8(r + 2 * ld + n), w3 = load8(r + 3 * ld + n),
             w4 = load8(r + 4 * ld + n), w5 = load8(r + 5 * ld + n), w6 = load8(r + 6 * ld + n),
             w7 = load8(r + 7 * ld + n);
    for (int m = 0; m < R; ++m)
      store8(y + m * ld + n, load8(y + m * ld + n) + sum8(a + m * K, w0, w1, w2, w3, w4, w5, w6, w7));
  }
  for (int m = 0; m < R; ++m) rows8_one(a + m * K, r, ld, width, y + m * ld, n);  // the last width % 8 columns
}

// y (M, width) += x[:, k:k+8] @ w[k:k+8, n0:n0+width] (r and y point at column n0, rows ld apart): rows in groups of
// at most 8 (registers run out past 8: a batch of requests, or a verify's K+1 rows), each group loading each vector
// of r once. Every row's sums take the same shape, however many rows there are.
static void rows8(const float* x, int64_t M, int64_t K, const float* r, int64_t ld, int64_t width, float* y) {
  int64_t m = 0;
  for (; M - m > 8; m += 8) rows8_many<8>(x + m * K, K, r, ld, width, y + m * ld);
  const float *a = x + m * K;
  float* out = y + m * ld;
  switch (M - m) {
    case 2: return rows8_many<2>(a, K, r, ld, width, out);
    case 3: return rows8_many<3>(a, K, r, ld, width, out);
    case 4: return rows8_many<4>(a, K, r, ld, width, out);
    case 5: return rows8_many<5>(a, K, r, ld, width, out);
    case 6: return rows8_many<6>(a, K, r, ld, width, out);
    case 7: return rows8_many<7>(a, K, r, ld, width, out);
    case 8: return rows8_many<8>(a, K, r, ld, width, out);
    default: return rows8_one(a, r, ld, width, out);  // one row
  }
}

// y (M, N) = x[:, k0:k1] @ w[k0:k1, :], a block of columns at a time: as many as keep the rows' block of y within
// Y_BLOCK bytes (in cache while the chunk's rows of w stream past; all columns for one row). The blocks change
// where each sum is taken, not its shape.
static void chunk_product(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                          int64_t k0, int64_t k1) {
  std::fill(y, y + M * N, 0.0f);
  const int64_t columns = std::max<int64_t>(64, Y_BLOCK / (4 * M)) / 8 * 8;
  for (int64_t n0 = 0; n0 < N; n0 += columns) {
    const int64_t width = std::min(columns, N - n0);
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) rows8(x + k, M, K, w + k * N + n0, N, width, y + n0);  // y loaded, stored per 8 rows
    for (; k < k1; ++k)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n0 + width; ++n) y[m * N + n] += x[m * K + k] * w[k * N + n];
  }
}

// The chunks of one call's products, claimed by the caller and the pool's threads; shared, so a late thread finds
// it alive (and nothing left to claim).
struct Products {
  struct Chunk {
    const float* w;
    int64_t N, k0, k1;
    float* partial;  // (M, N)
  };
  const float* x;
  int64_t M, K;
  std::vector<Chunk> chunks;
  std::vector<float> partials;
  std::atomic<int64_t> next{0}, done{0};

  void claim_chunks() {
    for (int64_t c; (c = next.fetch_add(1)) < static_cast<int64_t>(chunks.size());) {
      const Chunk& u = chunks[c];
      chunk_product(x, u.w, u.partial, M, K, u.N, u.k0, u.k1);
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
  std::vector<float*> outs;
  int64_t macs = 0, floats = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value() || w->dimensions().size() != 2 || w->dimensions()[0] != K)
      return ffi::Error::InvalidArgument("matvec: each w must be fp32 (K, N) with x's K");
    const int64_t N = w->dimensions()[1];
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK)
      products->chunks.push_back({w->typed_data(), N, k0, std::min(K, k0 + CHUNK), nullptr});
    outs.push_back((*y)->typed_data());
    macs += K * N, floats += ((K + CHUNK - 1) / CHUNK) * M * N;
  }
  products->partials.resize(floats);
  float* partial = products->partials.data();
  for (auto& c : products->chunks) c.partial = partial, partial += M * c.N;

  const int64_t chunks = products->chunks.size();
  const int64_t helpers = macs < SERIAL_BELOW ? 0 : std::min<int64_t>(pool.num_threads(), chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([products] { products->claim_chunks(); });
  products->claim_chunks();
  while (products->done.load(std::memory_order_acquire) < chunks) {
  }  // the chunks still out are running on other threads

  auto chunk = products->chunks.begin();
  for (float* out : outs) {  // each product's partials, added in chunk order
    const int64_t size = M * chunk->N;
    std::copy(chunk->partial, chunk->partial + size, out);
    for (++chunk; chunk != products->chunks.end() && chunk->k0 > 0; ++chunk)
      for (int64_t i = 0; i < size; ++i) out[i] += chunk->partial[i];
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(qwen35_matvec_f32, MatVec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
