// Decode attention over each row's own slot and length, fp32 (see decode_attention.py).
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

// s[g * length + j] = scale * <q_g, k_j> for the G query heads q (G x D) and j < length; each
// block of keys is read from memory once for all G heads.
void scores(const float* q, int64_t G, const float* k, int64_t length, int64_t D, float scale, float* s) {
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
        s[g * length + j + r] = sum * scale;
      }
    }
  }
  for (; j < length; ++j)
    for (int64_t g = 0; g < G; ++g) s[g * length + j] = dot(q + g * D, k + j * D) * scale;
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

// scores() for heads g0 .. g0 + HB - 1 and D % 8 == 0: 8 accumulators, one per (head, key) of
// a block of 8 / HB keys, reduced together; the keys' vectors are loaded once for the HB heads.
template <int HB>
void scores_avx2(const float* q, int64_t g0, const float* k, int64_t length, int64_t D, float scale, float* s) {
  constexpr int KB = 8 / HB;
  const __m256 factor = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + KB <= length; j += KB) {
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
      _mm_storeu_ps(s + g0 * length + j, _mm256_castps256_ps128(sums));
      _mm_storeu_ps(s + (g0 + 1) * length + j, _mm256_extractf128_ps(sums, 1));
    } else {
      _mm256_storeu_ps(s + g0 * length + j, sums);
    }
  }
  for (; j < length; ++j)
    for (int h = 0; h < HB; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g0 + h) * D + d), _mm256_loadu_ps(k + j * D + d), acc);
      s[(g0 + h) * length + j] = horizontal_sum(acc) * scale;
    }
}

// out[g] = sum_j p[g * length + j] * v_j for D % (8 * NV) == 0: blocks of value rows small
// enough for L1, read from memory once and then once per head from cache; NV accumulators
// hold 8 * NV output dims of one head.
template <int NV>
void weighted_values_avx2(const float* p, int64_t G, const float* v, int64_t length, int64_t D, float* out) {
  constexpr int64_t kBlock = 64;  // value rows per block: 16 KB at D = 64
  std::fill(out, out + G * D, 0.f);
  for (int64_t j0 = 0; j0 < length; j0 += kBlock) {
    const int64_t j1 = std::min(length, j0 + kBlock);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d0 = 0; d0 < D; d0 += 8 * NV) {
        float* og = out + g * D + d0;
        __m256 acc[NV];
        for (int i = 0; i < NV; ++i) acc[i] = _mm256_loadu_ps(og + 8 * i);
        for (int64_t j = j0; j < j1; ++j) {
          const __m256 pj = _mm256_broadcast_ss(p + g * length + j);
          for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * D + d0 + 8 * i), acc[i]);
        }
        for (int i = 0; i < NV; ++i) _mm256_storeu_ps(og + 8 * i, acc[i]);
      }
  }
}
#endif

// s <- softmax(s) in place over length entries.
void softmax(float* s, int64_t length) {
  float top = s[0];
  for (int64_t j = 1; j < length; ++j) top = std::max(top, s[j]);
  float total = 0.f;
  for (int64_t j = 0; j < length; ++j) {
    s[j] = std::exp(s[j] - top);
    total += s[j];
  }
  const float inv = 1.f / total;
  for (int64_t j = 0; j < length; ++j) s[j] *= inv;
}

// out[g] = sum_j p[g * length + j] * v_j for the G heads (out: G x D); each block of value
// rows is read from memory once for all G heads.
void weighted_values(const float* p, int64_t G, const float* v, int64_t length, int64_t D, float* out) {
  std::fill(out, out + G * D, 0.f);
  int64_t j = 0;
  for (; j + kKeys <= length; j += kKeys) {
    const float* vj = v + j * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = p + g * length + j;
      float* og = out + g * D;
      for (int64_t d = 0; d < D; ++d)
        og[d] += pg[0] * vj[d] + pg[1] * vj[D + d] + pg[2] * vj[2 * D + d] + pg[3] * vj[3 * D + d];
    }
  }
  for (; j < length; ++j)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += p[g * length + j] * v[j * D + d];
}

// The group's scores and weighted values: the AVX2 loops where the head size allows them.
void group_scores(const float* q, int64_t G, const float* k, int64_t length, int64_t D, float scale, float* s) {
#ifdef ONC_AVX2
  if (D % 8 == 0) {
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) scores_avx2<2>(q, g, k, length, D, scale, s);
    if (g < G) scores_avx2<1>(q, g, k, length, D, scale, s);
    return;
  }
#endif
  scores(q, G, k, length, D, scale, s);
}

void group_values(const float* p, int64_t G, const float* v, int64_t length, int64_t D, float* out) {
#ifdef ONC_AVX2
  if (D % 64 == 0) return weighted_values_avx2<8>(p, G, v, length, D, out);
  if (D % 32 == 0) return weighted_values_avx2<4>(p, G, v, length, D, out);
#endif
  weighted_values(p, G, v, length, D, out);
}

// query [N, Hq, D]; caches [slots, Hkv, S, D] (positions contiguous); slots, lengths [N] int64
// -> [N, Hq, D]. Row n attends over the first lengths[n] positions of slot slots[n]; query
// head h reads KV head h / (Hq / Hkv), as transformers' repeat_kv.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: query [N, Hq, D] and caches [slots, Hkv, S, D] expected");
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "decode_attention: fp32 only");
  const int64_t N = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "decode_attention: head shapes disagree");
  for (const auto* cache : {&k_cache, &v_cache})
    TORCH_CHECK(cache->stride(3) == 1 && cache->stride(2) == D, "decode_attention: cache positions must be contiguous");
  const auto slot_ids = slots.to(at::kLong).contiguous(), live = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(slot_ids.numel() == N && live.numel() == N, "decode_attention: one slot and length per row");
  const int64_t* slot_of = slot_ids.data_ptr<int64_t>();
  const int64_t* length_of = live.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(slot_of[n] >= 0 && slot_of[n] < k_cache.size(0) && length_of[n] >= 1 && length_of[n] <= S,
                "decode_attention: row ", n, " has slot ", slot_of[n], " and length ", length_of[n],
                " outside the cache [", k_cache.size(0), ", ", S, "]");

  const auto q = query.contiguous();
  auto out = at::empty({N, Hq, D}, query.options());
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
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> s;
    for (int64_t taken = next++; taken < N * Hkv; taken = next++) {
      const int64_t i = order[taken], n = i / Hkv, h = i % Hkv, length = length_of[n];
      const float* k = kp + slot_of[n] * k_cache.stride(0) + h * k_cache.stride(1);
      const float* v = vp + slot_of[n] * v_cache.stride(0) + h * v_cache.stride(1);
      s.resize(G * length);
      group_scores(qp + (n * Hq + h * G) * D, G, k, length, D, static_cast<float>(scale), s.data());
      for (int64_t g = 0; g < G; ++g) softmax(s.data() + g * length, length);
      group_values(s.data(), G, v, length, D, op + (n * Hq + h * G) * D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_neuron_chunked, m) {
  m.def("decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_neuron_chunked, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
