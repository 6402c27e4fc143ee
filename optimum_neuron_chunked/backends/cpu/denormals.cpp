// Flush-to-zero and denormals-are-zero (MXCSR FTZ | DAZ) for the calling thread and every thread
// of torch's intra-op pool. AOTInductor's OpenMP loops run in that pool too: the compiled
// packages' libgomp.so.1 resolves to the one torch loaded.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <xmmintrin.h>

namespace {

constexpr unsigned kFlushToZero = 0x8000;
constexpr unsigned kDenormalsAreZero = 0x0040;

void set_mode() { _mm_setcsr(_mm_getcsr() | kFlushToZero | kDenormalsAreZero); }

// Returns how many pool threads set it (1 task per thread: a range of num_threads, grain 1).
int64_t flush_denormals() {
  set_mode();
  std::atomic<int64_t> threads{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    set_mode();
    threads += end - begin;
  });
  return threads.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_neuron_chunked, m) {
  m.def("flush_denormals() -> int", &flush_denormals);
}
