// Sustained (power-limited) rate of each cuBLASLt algorithm on gpt_1b's matmul shapes.
//
// XLA's autotuner times the (up to 8) algorithms cuBLASLt's heuristics offer for each matmul
// once, at compile time, and keeps the fastest. In the train step the card sits at its power
// limit, so what counts is the rate an algorithm sustains there. This runs each candidate back
// to back for a few seconds on a card already at the limit and prints both rates, with the SM
// clock and board power read through NVML, to see whether the cold pick is the sustained best.
//
// Build and run on the GPU machine (CUDA 12+; docs/benchmarks.md, the twenty-fifth round):
//   nvcc -O2 -std=c++17 -arch=sm_90 benchmarks/cublaslt_sustained.cu -lcublasLt -lnvidia-ml \
//       -L/usr/local/cuda/lib64/stubs -o /tmp/cublaslt_sustained
//   /tmp/cublaslt_sustained [seconds per algorithm and pass, default 2] [algorithms, default 8]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvml.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
#define LK(x) do { cublasStatus_t st_ = (x); if (st_ != CUBLAS_STATUS_SUCCESS) { printf("cublasLt %d at %d\n", (int)st_, __LINE__); exit(1);} } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    // Uniform in [-0.05, 0.05): random bits, never zeros, which run faster than real data.
    float u = ((h & 0xFFFFFF) / 16777216.0f) - 0.5f;
    p[i] = __float2bfloat16(u * 0.1f);
  }
}

struct Shape { const char* name; int m, n, k; bool ta, tb; };  // row-major C[m,n] = op(A)[m,k] op(B)[k,n]

int main(int argc, char** argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 2.0;
  int max_algos = argc > 2 ? atoi(argv[2]) : 8;
  std::vector<Shape> shapes = {
      {"linear1 fwd  [16384,2048]x[2048,8192]", 16384, 8192, 2048, false, false},
      {"linear1 wgrad [2048,16384]x[16384,8192]", 2048, 8192, 16384, true, false},
      {"linear1 dgrad [16384,8192]x[8192,2048]", 16384, 2048, 8192, false, true},
      {"linear2 fwd  [16384,8192]x[8192,2048]", 16384, 2048, 8192, false, false},
      {"lm_head fwd  [16384,2048]x[2048,32768]", 16384, 32768, 2048, false, true},
  };
  nvmlInit();
  nvmlDevice_t dev; nvmlDeviceGetHandleByIndex(0, &dev);
  cublasLtHandle_t lt; LK(cublasLtCreate(&lt));
  size_t ws_size = 32 << 20; void* ws; CK(cudaMalloc(&ws, ws_size));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  for (auto& s : shapes) {
    // Two sets of inputs so repeated calls do not run from L2.
    size_t na = (size_t)s.m * s.k, nb = (size_t)s.k * s.n, nc = (size_t)s.m * s.n;
    __nv_bfloat16 *A[2], *B[2], *C;
    for (int r = 0; r < 2; ++r) {
      CK(cudaMalloc(&A[r], na * 2)); CK(cudaMalloc(&B[r], nb * 2));
      fill<<<1024, 256>>>(A[r], na, 17 + r); fill<<<1024, 256>>>(B[r], nb, 91 + r);
    }
    CK(cudaMalloc(&C, nc * 2));
    CK(cudaDeviceSynchronize());
    // Row-major C = op(A) op(B)  <=>  column-major C^T = op(B)^T op(A)^T: pass B as the first operand.
    cublasLtMatmulDesc_t op; LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t tb = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tb, sizeof(tb)));
    LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &ta, sizeof(ta)));
    // Column-major views: first operand op(B)^T is [n, k]; stored B row-major [k,n] is col-major [n,k] (ld n)
    cublasLtMatrixLayout_t lb, la, lc;
    if (!s.tb) LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.n, s.k, s.n));
    else LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, s.n, s.k));  // B stored [n,k] row-major
    if (!s.ta) LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.k, s.m, s.k));
    else LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.m, s.k, s.m));  // A stored [k,m] row-major
    LK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, s.n, s.m, s.n));
    cublasLtMatmulPreference_t pref; LK(cublasLtMatmulPreferenceCreate(&pref));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size, sizeof(ws_size)));
    std::vector<cublasLtMatmulHeuristicResult_t> res(64); int got = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(lt, op, lb, la, lc, lc, pref, 64, res.data(), &got));
    int n_algos = got < max_algos ? got : max_algos;
    double flops = 2.0 * s.m * s.n * s.k;
    float alpha = 1.f, beta = 0.f;
    printf("\n== %s: %d heuristic algorithms, timing %d\n", s.name, got, n_algos);
    printf("%4s %6s %6s %7s %5s %6s | %9s | %9s %8s %7s %6s | %s\n", "algo", "tile", "stages", "cluster", "swz",
           "split", "cold TF/s", "hot TF/s", "MHz", "W", "TF/J", "rel err");
    auto run = [&](int a, int iters, int set0) {
      for (int i = 0; i < iters; ++i) {
        int r = (set0 + i) & 1;
        LK(cublasLtMatmul(lt, op, &alpha, B[r], lb, A[r], la, &beta, C, lc, C, lc, &res[a].algo, ws, ws_size, st));
      }
    };
    // Warm the card to its power limit with the heuristic's first choice.
    {
      auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 3.0) {
        run(0, 50, 0); CK(cudaStreamSynchronize(st));
      }
    }
    // Two passes over the algorithms (in order, then reversed) to cancel the card's drift.
    std::vector<double> hot(n_algos, 0), mhz(n_algos, 0), watts(n_algos, 0), cold(n_algos, 0);
    std::vector<int> cnt(n_algos, 0);
    for (int pass = 0; pass < 2; ++pass) {
      for (int j = 0; j < n_algos; ++j) {
        int a = pass == 0 ? j : n_algos - 1 - j;
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        // "Cold": 20 calls right after switching, as an autotuner sees it (the card is already
        // hot from the previous algorithm, so this is a lower bound on the compile-time rate).
        run(a, 5, 0);
        cudaEventRecord(e0, st); run(a, 20, 0); cudaEventRecord(e1, st); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        cold[a] += flops * 20 / (ms * 1e-3) / 1e12;
        // Sustained: run for `seconds`, count the last 60% of it.
        auto t0 = std::chrono::steady_clock::now();
        double psum = 0, csum = 0; int ns = 0; long calls = 0; float tms = 0;
        while (true) {
          double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (now > seconds) break;
          bool timed = now > 0.4 * seconds;
          if (timed) cudaEventRecord(e0, st);
          run(a, 20, 0);
          if (timed) {
            cudaEventRecord(e1, st); CK(cudaEventSynchronize(e1));
            float m; cudaEventElapsedTime(&m, e0, e1); tms += m; calls += 20;
            unsigned p, c; nvmlDeviceGetPowerUsage(dev, &p); nvmlDeviceGetClockInfo(dev, NVML_CLOCK_SM, &c);
            psum += p / 1000.0; csum += c; ++ns;
          } else {
            CK(cudaStreamSynchronize(st));
          }
        }
        hot[a] += flops * calls / (tms * 1e-3) / 1e12; mhz[a] += csum / ns; watts[a] += psum / ns; cnt[a]++;
        cudaEventDestroy(e0); cudaEventDestroy(e1);
      }
    }
    // Each algorithm's product against a float64 one at 256 sampled outputs (input set 0).
    std::vector<__nv_bfloat16> ha(na), hb(nb), hc(nc);
    CK(cudaMemcpy(ha.data(), A[0], na * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), B[0], nb * 2, cudaMemcpyDeviceToHost));
    std::vector<int> si(256), sj(256); std::vector<double> ref(256);
    for (int t = 0; t < 256; ++t) {
      si[t] = (int)((t * 7919u + 13) % s.m); sj[t] = (int)((t * 104729u + 7) % s.n);
      double acc = 0;
      for (int q = 0; q < s.k; ++q) {
        double x = __bfloat162float(s.ta ? ha[(size_t)q * s.m + si[t]] : ha[(size_t)si[t] * s.k + q]);
        double y = __bfloat162float(s.tb ? hb[(size_t)sj[t] * s.k + q] : hb[(size_t)q * s.n + sj[t]]);
        acc += x * y;
      }
      ref[t] = acc;
    }
    std::vector<double> err(n_algos);
    for (int a = 0; a < n_algos; ++a) {
      CK(cudaMemset(C, 0xFF, nc * 2));  // NaNs: an unwritten output cannot pass
      run(a, 1, 0); CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(hc.data(), C, nc * 2, cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      for (int t = 0; t < 256; ++t) {
        double d = __bfloat162float(hc[(size_t)si[t] * s.n + sj[t]]) - ref[t];
        num += d * d; den += ref[t] * ref[t];
      }
      err[a] = std::sqrt(num / den);  // NaN if anything sampled was not written
    }
    for (int a = 0; a < n_algos; ++a) {
      int tile = 0, stages = 0, cluster = 0, swz = 0, split = 0; size_t w;
      cublasLtMatmulAlgoConfigGetAttribute(&res[a].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
      cublasLtMatmulAlgoConfigGetAttribute(&res[a].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
      cublasLtMatmulAlgoConfigGetAttribute(&res[a].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
      cublasLtMatmulAlgoConfigGetAttribute(&res[a].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz), &w);
      cublasLtMatmulAlgoConfigGetAttribute(&res[a].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split), &w);
      double h = hot[a] / cnt[a], W = watts[a] / cnt[a];
      printf("%4d %6d %6d %7d %5d %6d | %9.1f | %9.1f %8.0f %7.1f %6.3f | %.1e\n", a, tile, stages, cluster, swz,
             split, cold[a] / cnt[a], h, mhz[a] / cnt[a], W, h / W, err[a]);
    }
    fflush(stdout);
    for (int r = 0; r < 2; ++r) { cudaFree(A[r]); cudaFree(B[r]); }
    cudaFree(C);
  }
  return 0;
}
