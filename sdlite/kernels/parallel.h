// sdlite kernels: running parts of a problem on OpenMP's threads (shared by every kernel file of this package).
#pragma once
#include <omp.h>
#include <stdint.h>

#include <algorithm>

namespace sdl {

// Runs fn(t) for each t in [0, threads), in parallel on OpenMP's threads. In PyTorch's process that is PyTorch's own
// pool: the kernel libraries ask for libgomp.so.1, the name of the one PyTorch has loaded, so the loader binds to it.
// Threads of a separate pool would compete with PyTorch's, which spin for a while after each operator (measured: 5 ms
// more on a 68 ms attention call made right after a matmul). A team smaller than asked for runs several t each.
template <class F>
void parallel(int threads, F fn) {
    if (threads <= 1) {
        fn(0);
        return;
    }
#pragma omp parallel num_threads(threads)
    for (int t = omp_get_thread_num(); t < threads; t += omp_get_num_threads()) fn(t);
}

// the most threads parallel_parts uses
constexpr int MAX_PARTS = 256;

// Runs fn(begin, end) -> status over [0, items) cut into contiguous parts, one per thread (at most one per item and
// MAX_PARTS in all); returns the first nonzero status, else 0. It allocates nothing on the heap: a kernel's call
// leaves the C heap as it found it.
template <class F>
int parallel_parts(int64_t items, int threads, F fn) {
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(std::min(threads, MAX_PARTS), items));
    int status[MAX_PARTS] = {0};
    parallel(threads, [&](int t) { status[t] = fn(items * t / threads, items * (t + 1) / threads); });
    for (int t = 0; t < threads; t++)
        if (status[t]) return status[t];
    return 0;
}

}  // namespace sdl
