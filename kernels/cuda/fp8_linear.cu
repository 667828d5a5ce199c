// FP8 (E4M3) weight matrices: w[n][k] = e4m3(codes[n][k]) * scales[n / rb][k / cb], the
// scales one f32 per rb x cb block ([ceil(n/rb)][ceil(k/cb)]: per tensor, per channel, or
// 128 x 128). Reference: kernels/src/cpu/fp8_linear.rs (Fp8Matrix, linear_fp8 with
// ActivationScale::None: these kernels are weights-only FP8, W8A16). The skinny GEMM over such
// weights (decode) is gemv_fp8.cu.

// w_bf16[i] = bf16(e4m3(codes[i]) * scale(i)): the dequantized matrix, for a bf16 GEMM
// (prefill: M > 16).
extern "C" __global__ void fp8_dequant_bf16(const unsigned char* __restrict__ codes, const float* __restrict__ scales,
                                            bf16_t* __restrict__ out, int k, int rb, int cb, long long total) {
    PDL_ENTER();
    const int ncb = (k + cb - 1) / cb;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / k;
        const int c = (int)(i - r * k);
        out[i] = f2bf(e4m32f(codes[i]) * scales[(r / rb) * ncb + c / cb]);
    }
}
