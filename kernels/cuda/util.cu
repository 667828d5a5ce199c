// Utility kernels that are not part of a model step: drawing random weights on the device,
// and a timed spin used by the profiler to let the host queue a whole step before it runs.

// Element i of a counter-generated tensor (baton_formats::CounterInit::value, bit for bit):
// splitmix64 of key + (i + 1)·γ, its top 24 bits as u in [0, 1), then mean + amp·(2u − 1) in
// single correctly rounded f32 operations (the _rn intrinsics: no contraction into an FMA,
// which would round differently from the host).
// Writes elements first..first + n of the draw to out[offset ..], rounded to T: bf16 (random
// bf16 weights) or f32 as drawn (the input of the per-channel FP8 quantization, which must see
// the host's f32 values to give the host's codes and scales).
__device__ __forceinline__ void counter_store(bf16_t* p, float v) { *p = f2bf(v); }
__device__ __forceinline__ void counter_store(float* p, float v) { *p = v; }
template <typename T>
__device__ __forceinline__ void fill_counter(T* __restrict__ out, long long offset, long long first, long long n,
                                             unsigned long long key, float mean, float amp) {
    PDL_ENTER();
    const long long stride = (long long)gridDim.x * blockDim.x;
    out += offset;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned long long z = key + (unsigned long long)(first + i + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = __fmul_rn((float)(z >> 40), 5.9604644775390625e-8f);
        counter_store(out + i, __fadd_rn(mean, __fmul_rn(amp, __fsub_rn(__fmul_rn(2.f, u), 1.f))));
    }
}

extern "C" __global__ void fill_counter_bf16(bf16_t* __restrict__ out, long long offset, long long first,
                                             long long n, unsigned long long key, float mean, float amp) {
    fill_counter(out, offset, first, n, key, mean, amp);
}

extern "C" __global__ void fill_counter_f32(float* __restrict__ out, long long offset, long long first, long long n,
                                            unsigned long long key, float mean, float amp) {
    fill_counter(out, offset, first, n, key, mean, amp);
}

// One thread waits `ns` nanoseconds of the global timer.
extern "C" __global__ void spin_ns(long long ns) {
    PDL_ENTER();
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < ns);
}
