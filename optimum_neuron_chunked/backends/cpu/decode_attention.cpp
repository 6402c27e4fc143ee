// Decode attention over each row's own blocks and length, fp32 (see decode_attention.py). A pool
// of whole-sequence blocks: its rows' tables hold one entry each.
//
// A decode step is bound by reading the live K/V once. Per (row, KV head) this reads the keys
// once for all G query heads of the group (scores into a G x length buffer that stays in
// cache), takes the softmax, then reads the values once, where ATen's bmm runs a G-row GEMM
// per head (G = 2 on the bench model) and the softmax between two passes over the scores.
//
// With AVX2 + FMA (the hosts the op is chosen on, kernels.py) the two products are written with
// intrinsics: the portable loops (scores, weighted_values) ran at ~12 GFLOP/s a core with the
// K/V in cache, so the op could not keep up with memory (a decode step read its K/V at about
// half the host's read stream).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ONC_AVX2 1
#endif

namespace {

constexpr int64_t kLanes = 8;  // one AVX2 register of floats: the compiler vectorizes these loops
constexpr int64_t kKeys = 4;   // keys per step of the score loop: independent accumulators
static_assert(kKeys == 4, "weighted_values unrolls four value rows by hand");

// s[g * stride + j] = scale * <q_g, k_j> for the G query heads q (G x D) and j < length; each
// block of keys is read from memory once for all G heads.
void scores(const float* q, int64_t G, const float* k, int64_t length, int64_t D, float scale, float* s,
            int64_t stride) {
  const int64_t body = D - D % kLanes;
  auto dot = [&](const float* qg, const float* kj) {  // one key: the tail of the blocks below
    float sum = 0.f;
    for (int64_t d = 0; d < D; ++d) sum += qg[d] * kj[d];
    return sum;
  };
  int64_t j = 0;
  for (; j + kKeys <= length; j += kKeys) {
    const float* kj = k + j * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float acc[kKeys][kLanes] = {};
      for (int64_t d = 0; d < body; d += kLanes)
        for (int64_t l = 0; l < kLanes; ++l)
          for (int64_t r = 0; r < kKeys; ++r) acc[r][l] += qg[d + l] * kj[r * D + d + l];
      for (int64_t r = 0; r < kKeys; ++r) {
        float sum = 0.f;
        for (int64_t d = body; d < D; ++d) sum += qg[d] * kj[r * D + d];
        for (int64_t l = 0; l < kLanes; ++l) sum += acc[r][l];
        s[g * stride + j + r] = sum * scale;
      }
    }
  }
  for (; j < length; ++j)
    for (int64_t g = 0; g < G; ++g) s[g * stride + j] = dot(q + g * D, k + j * D) * scale;
}

#ifdef ONC_AVX2
// The eight horizontal sums of a[0..7], in order, as one vector.
inline __m256 horizontal_sums(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

inline float horizontal_sum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// The hardware prefetcher alone left the score loop reading keys below the host's read stream
// (the value loop, reading the same bytes, ran ~1.4x faster): keys this far ahead are requested
// explicitly, across into the row's next block (a paged row's blocks lie apart in the pool).
constexpr int64_t kPrefetchKeys = 16;

inline void prefetch(const float* from, int64_t count) {
  for (int64_t f = 0; f < count; f += 64 / sizeof(float))
    _mm_prefetch(reinterpret_cast<const char*>(from + f), _MM_HINT_T0);
}

// scores() for heads g0 .. g0 + HB - 1 and D % 8 == 0: 8 accumulators, one per (head, key) of
// a block of 8 / HB keys, reduced together; the keys' vectors are loaded once for the HB heads.
// `next`: the keys of the row's next block, or nullptr.
template <int HB>
void scores_avx2(const float* q, int64_t g0, const float* k, const float* next, int64_t length, int64_t D,
                 float scale, float* s, int64_t stride) {
  constexpr int KB = 8 / HB;
  const __m256 factor = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + KB <= length; j += KB) {
    const int64_t ahead = j + kPrefetchKeys;
    if (ahead + KB <= length)
      prefetch(k + ahead * D, KB * D);
    else if (next != nullptr && ahead >= length)
      prefetch(next + (ahead - length) * D, KB * D);
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 keys[KB];
      for (int r = 0; r < KB; ++r) keys[r] = _mm256_loadu_ps(k + (j + r) * D + d);
      for (int h = 0; h < HB; ++h) {
        const __m256 qv = _mm256_loadu_ps(q + (g0 + h) * D + d);
        for (int r = 0; r < KB; ++r) acc[h * KB + r] = _mm256_fmadd_ps(qv, keys[r], acc[h * KB + r]);
      }
    }
    const __m256 sums = _mm256_mul_ps(horizontal_sums(acc), factor);
    if constexpr (HB == 2) {
      _mm_storeu_ps(s + g0 * stride + j, _mm256_castps256_ps128(sums));
      _mm_storeu_ps(s + (g0 + 1) * stride + j, _mm256_extractf128_ps(sums, 1));
    } else {
      _mm256_storeu_ps(s + g0 * stride + j, sums);
    }
  }
  for (; j < length; ++j)
    for (int h = 0; h < HB; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g0 + h) * D + d), _mm256_loadu_ps(k + j * D + d), acc);
      s[(g0 + h) * stride + j] = horizontal_sum(acc) * scale;
    }
}

// out[g] += sum_j p[g * stride + j] * v_j for D % (8 * NV) == 0: blocks of value rows small
// enough for L1, read from memory once and then once per head from cache; NV accumulators
// hold 8 * NV output dims of one head.
template <int NV>
void weighted_values_avx2(const float* p, int64_t G, const float* v, int64_t length, int64_t D, float* out,
                          int64_t stride) {
  constexpr int64_t kBlock = 64;  // value rows per block: 16 KB at D = 64
  for (int64_t j0 = 0; j0 < length; j0 += kBlock) {
    const int64_t j1 = std::min(length, j0 + kBlock);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d0 = 0; d0 < D; d0 += 8 * NV) {
        float* og = out + g * D + d0;
        __m256 acc[NV];
        for (int i = 0; i < NV; ++i) acc[i] = _mm256_loadu_ps(og + 8 * i);
        for (int64_t j = j0; j < j1; ++j) {
          const __m256 pj = _mm256_broadcast_ss(p + g * stride + j);
          for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * D + d0 + 8 * i), acc[i]);
        }
        for (int i = 0; i < NV; ++i) _mm256_storeu_ps(og + 8 * i, acc[i]);
      }
  }
}
#endif

// A weight below exp(kNegligible) is 0: it changes no fp32 output (the weights sum to >= 1), and
// kept it would be near or below fp32's normal range (exp(-87)), where x86 computes products with
// denormal operands ~100x slower: trained and random models alike put most weights of long rows
// there (a 32-row paged decode step ran 2x slower).
constexpr float kNegligible = -69.f;  // exp(-69) ~ 1e-30

// s <- softmax(s) in place over length entries.
void softmax(float* s, int64_t length) {
  float top = s[0];
  for (int64_t j = 1; j < length; ++j) top = std::max(top, s[j]);
  float total = 0.f;
  for (int64_t j = 0; j < length; ++j) {
    // exp of the clamped argument: the vector exp (libmvec) takes a scalar path, setting errno,
    // for every lane below its range (about -87), and most lanes of long rows are there
    const float x = s[j] - top, e = std::exp(std::max(x, kNegligible));
    s[j] = x < kNegligible ? 0.f : e;
    total += s[j];
  }
  const float inv = 1.f / total;
  for (int64_t j = 0; j < length; ++j) s[j] *= inv;
}

// out[g] += sum_j p[g * stride + j] * v_j for the G heads (out: G x D); each block of value
// rows is read from memory once for all G heads.
void weighted_values(const float* p, int64_t G, const float* v, int64_t length, int64_t D, float* out,
                     int64_t stride) {
  int64_t j = 0;
  for (; j + kKeys <= length; j += kKeys) {
    const float* vj = v + j * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = p + g * stride + j;
      float* og = out + g * D;
      for (int64_t d = 0; d < D; ++d)
        og[d] += pg[0] * vj[d] + pg[1] * vj[D + d] + pg[2] * vj[2 * D + d] + pg[3] * vj[3 * D + d];
    }
  }
  for (; j < length; ++j)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += p[g * stride + j] * v[j * D + d];
}

// The group's scores and weighted values: the AVX2 loops where the head size allows them.
// `length` keys or values of one block; score rows `stride` apart.
void group_scores(const float* q, int64_t G, const float* k, const float* next, int64_t length, int64_t D,
                  float scale, float* s, int64_t stride) {
#ifdef ONC_AVX2
  if (D % 8 == 0) {
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) scores_avx2<2>(q, g, k, next, length, D, scale, s, stride);
    if (g < G) scores_avx2<1>(q, g, k, next, length, D, scale, s, stride);
    return;
  }
#endif
  scores(q, G, k, length, D, scale, s, stride);
}

void group_values(const float* p, int64_t G, const float* v, int64_t length, int64_t D, float* out,
                  int64_t stride) {
#ifdef ONC_AVX2
  if (D % 64 == 0) return weighted_values_avx2<8>(p, G, v, length, D, out, stride);
  if (D % 32 == 0) return weighted_values_avx2<4>(p, G, v, length, D, out, stride);
#endif
  weighted_values(p, G, v, length, D, out, stride);
}

// query [N, Hq, D]; caches [blocks, Hkv, P, D] (positions contiguous); tables [N, M] (or [N]:
// one whole-sequence block each), lengths [N] -> [N, Hq, D]. Row n attends over its positions
// 0 .. lengths[n] - 1, position p at offset p % P of block tables[n][p / P]; query head h reads
// KV head h / (Hq / Hkv), as transformers' repeat_kv.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: query [N, Hq, D] and caches [blocks, Hkv, P, D] expected");
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "decode_attention: fp32 only");
  const int64_t N = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t Hkv = k_cache.size(1), P = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "decode_attention: head shapes disagree");
  for (const auto* cache : {&k_cache, &v_cache})
    TORCH_CHECK(cache->stride(3) == 1 && cache->stride(2) == D, "decode_attention: cache positions must be contiguous");
  const auto table = tables.to(at::kLong).reshape({N, -1}).contiguous(), live = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(tables.size(0) == N && live.numel() == N, "decode_attention: one block table and length per row");
  const int64_t M = table.size(1);
  const int64_t* table_of = table.data_ptr<int64_t>();
  const int64_t* length_of = live.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(length_of[n] >= 1 && length_of[n] <= M * P, "decode_attention: row ", n, " has length ",
                length_of[n], " outside the cache's ", M, " blocks of ", P, " positions");
    for (int64_t b = 0; b * P < length_of[n]; ++b)
      TORCH_CHECK(table_of[n * M + b] >= 0 && table_of[n * M + b] < k_cache.size(0), "decode_attention: row ", n,
                  " reads block ", table_of[n * M + b], " outside the cache's ", k_cache.size(0), " blocks");
  }

  const auto q = query.contiguous();
  auto out = at::zeros({N, Hq, D}, query.options());
  const int64_t G = Hq / Hkv;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // (row, KV head) tasks, longest first, taken by whichever thread is free: rows of one step
  // hold very different lengths, and a static split of the range would leave a thread idle.
  std::vector<int64_t> order(N * Hkv);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return length_of[a / Hkv] > length_of[b / Hkv]; });
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> s;
    for (int64_t taken = next_task++; taken < N * Hkv; taken = next_task++) {
      const int64_t i = order[taken], n = i / Hkv, h = i % Hkv, length = length_of[n];
      const float* qg = qp + (n * Hq + h * G) * D;
      float* og = op + (n * Hq + h * G) * D;
      auto keys_at = [&](int64_t start) {
        return kp + table_of[n * M + start / P] * k_cache.stride(0) + h * k_cache.stride(1);
      };
      s.resize(G * length);
      for (int64_t start = 0; start < length; start += P) {
        const float* following = start + P < length ? keys_at(start + P) : nullptr;
        group_scores(qg, G, keys_at(start), following, std::min(P, length - start), D, static_cast<float>(scale),
                     s.data() + start, length);
      }
      for (int64_t g = 0; g < G; ++g) softmax(s.data() + g * length, length);
      for (int64_t start = 0; start < length; start += P) {
        const int64_t block = table_of[n * M + start / P], count = std::min(P, length - start);
        const float* v = vp + block * v_cache.stride(0) + h * v_cache.stride(1);
        group_values(s.data() + start, G, v, count, D, og, length);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_neuron_chunked, m) {
  m.def("decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_neuron_chunked, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
