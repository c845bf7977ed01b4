// y (M, N) = x (M, K) @ w (K, N) in fp32 for a few rows M (decode, verify), split over XLA:CPU's thread pool;
// several w (N may differ) at once.
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

// y[n0:] += a (8,) @ r[:, n0:] for r (8, N): the compiler vectorizes over n and keeps a's 8 values in registers.
static void rows8_one(const float* a, const float* r, int64_t N, float* y, int64_t n0 = 0) {
  for (int64_t n = n0; n < N; ++n)
    y[n] += sum8(a, r[n], r[N + n], r[2 * N + n], r[3 * N + n], r[4 * N + n], r[5 * N + n], r[6 * N + n], r[7 * N + n]);
}

// y (R, N) += a (R, 8; rows K apart) @ r (8, N): each vector of r is loaded once for all R rows (verify).
template <int R>
static void rows8_many(const float* a, int64_t K, const float* r, int64_t N, float* y) {
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    const v8 w0 = load8(r + n), w1 = load8(r + N + n), w2 = load8(r + 2 * N + n), w3 = load8(r + 3 * N + n),
             w4 = load8(r + 4 * N + n), w5 = load8(r + 5 * N + n), w6 = load8(r + 6 * N + n), w7 = load8(r + 7 * N + n);
    for (int m = 0; m < R; ++m) store8(y + m * N + n, load8(y + m * N + n) + sum8(a + m * K, w0, w1, w2, w3, w4, w5, w6, w7));
  }
  for (int m = 0; m < R; ++m) rows8_one(a + m * K, r, N, y + m * N, n);  // the last N % 8 columns
}

// y (M, N) += x[:, k:k+8] @ w[k:k+8, :]
static void rows8(const float* x, int64_t M, int64_t K, const float* r, int64_t N, float* y) {
  switch (M) {
    case 2: return rows8_many<2>(x, K, r, N, y);
    case 3: return rows8_many<3>(x, K, r, N, y);
    case 4: return rows8_many<4>(x, K, r, N, y);
    case 5: return rows8_many<5>(x, K, r, N, y);
    case 6: return rows8_many<6>(x, K, r, N, y);
    case 7: return rows8_many<7>(x, K, r, N, y);
    case 8: return rows8_many<8>(x, K, r, N, y);
    default:  // one row, or more than 8 (registers run out): row by row
      for (int64_t m = 0; m < M; ++m) rows8_one(x + m * K, r, N, y + m * N);
  }
}

// y (M, N) = x[:, k0:k1] @ w[k0:k1, :]
static void chunk_product(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                          int64_t k0, int64_t k1) {
  std::fill(y, y + M * N, 0.0f);
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8) rows8(x + k, M, K, w + k * N, N, y);  // one load and store of y per 8 rows of w
  for (; k < k1; ++k)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] += x[m * K + k] * w[k * N + n];
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
