// Native CPU kernels for MLX: the element-wise work of a transformer layer (SwiGLU and the
// attention's softmax), vectorised by the compiler and split over the run's threads, as MLX
// custom primitives. base_setup/native.py builds this file once per machine and documents why.
//
// Every kernel computes, element by element, exactly the float32 arithmetic of the fast
// functions in base_setup/fast_math.py (the same operations in the same order; built with
// -ffp-contract=off so that no multiply-add is fused), so their results are the same bits. Only
// the loops differ: one pass instead of several, and the elements split over threads. A row
// kernel (a maximum or a sum along the last axis) gives each row to one thread and adds in the
// row's order, so no result depends on the thread count. RoPE computes MLX's own sine and
// cosine (its polynomial, with its multiply-adds) and reads its input in any layout. Three
// kernels have no fast function to match: RMSNorm's gradient, MLX's formula with its own order
// of sums (a sum over rows in fixed blocks of rows, then over the blocks in order: again the
// same at any thread count), the few-row matmul of a decoding step, whose sums are explicit
// fma chains in order (the same on every instruction set and at any thread count), and a
// decoding step's attention, whose dot products and sums run in vector lanes (the same at any
// thread count; the same function as MLX's up to float32 rounding).

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// ------------------------------------------------------------------ threads

// The run's threads for element-wise work: the calling thread (an MLX stream's) and helpers.
// One parallel region at a time; a second stream that finds the pool busy runs its kernel on
// its own thread (both cores are busy then anyway). Never destroyed (a forked child must not
// join threads it does not have), and used only by the process that made it.
class Pool {
 public:
  void set_threads(int threads) {
    std::lock_guard<std::mutex> region(region_);
    threads_.store(std::max(1, threads));
  }

  int threads() const {
    return threads_.load();
  }

  // body(begin, end) over [0, count) in contiguous parts of at least `grain` items.
  template <class Body>
  void parallel(size_t count, size_t grain, const Body& body) {
    int parts = int(std::min<size_t>(size_t(threads_.load()), count / std::max<size_t>(grain, 1)));
    if (parts < 2 || getpid() != owner_ || !region_.try_lock()) {
      body(size_t(0), count);
      return;
    }
    std::lock_guard<std::mutex> region(region_, std::adopt_lock);
    std::function<void(int)> part = [&](int i) {
      size_t begin = count * size_t(i) / size_t(parts);
      size_t end = count * size_t(i + 1) / size_t(parts);
      body(begin, end);
    };
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (int(helpers_.size()) < parts - 1) {
        int index = int(helpers_.size()) + 1;
        helpers_.emplace_back([this, index] { serve(index); });
        helpers_.back().detach();
      }
      task_ = &part;
      parts_ = parts;
      pending_ = parts - 1;
      ++generation_;
    }
    wake_.notify_all();
    part(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
  }

 private:
  void serve(int index) {
    long seen = 0;
    while (true) {
      const std::function<void(int)>* task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= parts_) {
          continue;
        }
        task = task_;
      }
      (*task)(index);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) {
        done_.notify_one();
      }
    }
  }

  std::mutex region_;  // held for a whole parallel region, and by set_threads
  std::mutex mutex_;   // guards the fields below
  std::condition_variable wake_, done_;
  std::vector<std::thread> helpers_;
  const std::function<void(int)>* task_ = nullptr;
  int parts_ = 0;
  int pending_ = 0;
  long generation_ = 0;
  std::atomic<int> threads_{1};
  pid_t owner_ = getpid();
};

Pool& pool() {
  static Pool* instance = new Pool();  // never destroyed: see Pool
  return *instance;
}

// Elements (or row elements) below which a kernel runs on one thread: waking a helper costs
// microseconds.
constexpr size_t kGrain = 1 << 15;

// ------------------------------------------------------------------ exp, as fast_math builds it

// float32 constants of fast_math: log2(e), 1.5 * 2^23 (rounds a float to an integer), and the
// Taylor coefficients (ln 2)^k / k! of 2^f, k = 0..7 (the float32 roundings of the doubles).
constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kMagic = 12582912.0f;
constexpr float kC0 = 0x1p+0f, kC1 = 0x1.62e43p-1f, kC2 = 0x1.ebfbep-3f, kC3 = 0x1.c6b08ep-5f,
                kC4 = 0x1.3b2ab6p-7f, kC5 = 0x1.5d87fep-10f, kC6 = 0x1.430912p-13f,
                kC7 = 0x1.ffcbfcp-17f;

// 2^f for f = y - round(y) (fast_math._exp2_fraction).
inline float exp2_fraction(float y) {
  float f = y - ((y + kMagic) - kMagic);
  float f2 = f * f;
  float q = kC6 + kC7 * f;
  q = (kC4 + kC5 * f) + q * f2;
  q = (kC2 + kC3 * f) + q * f2;
  q = (kC0 + kC1 * f) + q * f2;
  return q;
}

// The float32 2^round(y) for y in [-127, 127] (fast_math._exp2_bits): 0 for -127.
inline float exp2_bits(float y) {
  int32_t bits = (int32_t((y + kMagic) - kMagic) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, sizeof s);
  return s;
}

// The exponent of exp(x) = 2^y, clamped to [-127, 127] (fast_math._exp2_exponent); NaN stays NaN.
inline float exp2_exponent(float x) {
  float y = x * kLog2e;
  y = y > 127.0f ? 127.0f : y;
  return y < -127.0f ? -127.0f : y;
}

// exp(d) as fast_math.exp: 2^f * 2^n of y = clip(d log2(e), -127, 127).
inline float fast_exp(float d) {
  float y = exp2_exponent(d);
  return exp2_fraction(y) * exp2_bits(y);
}

// ------------------------------------------------------------------ the kernels

// silu(g) * u = g * u / (1 + exp(-g)) (fast_math._swiglu_c).
void swiglu_forward(const float* g, const float* u, float* out, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    out[i] = g[i] * u[i] / (1.0f + fast_exp(-g[i]));
  }
}

// d/dg and d/du of silu(g) * u times the cotangent c (fast_math._swiglu_grad).
void swiglu_backward(
    const float* g,
    const float* u,
    const float* c,
    float* d_gate,
    float* d_up,
    size_t begin,
    size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float sig = 1.0f / (1.0f + fast_exp(-g[i]));
    d_gate[i] = c[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
    d_up[i] = c[i] * g[i] * sig;
  }
}

// MLX's maximum(a, b) of floats: a if it is NaN, else the larger, b when they are equal.
inline float mlx_maximum(float a, float b) {
  return a != a ? a : (a > b ? a : b);
}

// A row's max as MLX's max reduction takes it: from -inf, maximum(running, next) in order.
inline float row_max_of(const float* x, size_t width) {
  float m = -INFINITY;
  for (size_t j = 0; j < width; ++j) {
    m = mlx_maximum(m, x[j]);
  }
  return m;
}

// exp(x - ref) of one row into out (fast_math.exp of the difference; vectorised: no sum here).
inline void exp_shifted_row(const float* x, float ref, float* out, size_t width) {
  for (size_t j = 0; j < width; ++j) {
    out[j] = fast_exp(x[j] - ref);
  }
}

// A thread's scratch row of at least `width` floats (the pool's helpers and each MLX stream's
// thread have their own).
std::vector<float>& row_scratch(size_t width) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < width) {
    scratch.resize(width);
  }
  return scratch;
}

// Rows of `width` scores: e = exp(x - max) and the max (fast_math._exp_shifted after mx.max;
// NaN propagates into the max as MLX's does).
void row_exp(const float* x, float* e, float* row_max, size_t width, size_t begin, size_t end) {
  for (size_t r = begin; r < end; ++r) {
    const float* xr = x + r * width;
    float* er = e + r * width;
    float m = row_max_of(xr, width);
    if (m != m) {
      for (size_t j = 0; j < width; ++j) {
        er[j] = m;
      }
    } else {
      for (size_t j = 0; j < width; ++j) {
        float y = (xr[j] - m) * kLog2e;
        y = y < -127.0f ? -127.0f : y;
        er[j] = exp2_fraction(y) * exp2_bits(y);
      }
    }
    row_max[r] = m;
  }
}

// Rows of the attention's score gradient from unnormalised weights e, w = d_out v^T / total
// already divided, 1 / total and the 0/1 `seen` of each row (fast_math._attention_fn's vjp):
// delta = rowsum(e * w) / total, d = e * (w - delta) * seen.
void scores_grad(
    const float* e,
    const float* w,
    const float* inv_total,
    const float* seen,
    float* d,
    size_t width,
    size_t begin,
    size_t end) {
  for (size_t r = begin; r < end; ++r) {
    const float* er = e + r * width;
    const float* wr = w + r * width;
    float* dr = d + r * width;
    float sum = 0.0f;
    for (size_t j = 0; j < width; ++j) {
      sum += er[j] * wr[j];
    }
    float delta = sum * inv_total[r];
    float keep = seen[r];
    for (size_t j = 0; j < width; ++j) {
      dr[j] = er[j] * (wr[j] - delta) * keep;
    }
  }
}

// One vocabulary block of the LM head's online softmax (token_attribution/head_logprobs.py,
// _online_softmax): for rows of `width` logits x and the running max m of each row,
//   new_m = maximum(m, rowmax(x)),  ref = new_m if finite else 0,
//   e = exp(x - ref) (fast_math.exp),  e_sum = rowsum(e),  ex_sum = rowsum(e * x),
// and e and e * x themselves where asked for (null pointers: not written).
void softmax_block(
    const float* x,
    const float* m,
    float* new_m,
    float* ref,
    float* e_sum,
    float* ex_sum,
    float* e,
    float* ex,
    size_t width,
    size_t begin,
    size_t end) {
  std::vector<float>& scratch = row_scratch(e == nullptr ? width : 0);
  for (size_t r = begin; r < end; ++r) {
    const float* xr = x + r * width;
    float nm = mlx_maximum(m[r], row_max_of(xr, width));
    float rf = std::isinf(nm) ? 0.0f : nm;
    float* er = e != nullptr ? e + r * width : scratch.data();
    exp_shifted_row(xr, rf, er, width);
    // MLX's sums add in order: one chain each, after the vectorised exp
    float sum = 0.0f, xsum = 0.0f;
    for (size_t j = 0; j < width; ++j) {
      sum += er[j];
      xsum += er[j] * xr[j];
    }
    if (ex != nullptr) {
      float* exr = ex + r * width;
      for (size_t j = 0; j < width; ++j) {
        exr[j] = er[j] * xr[j];
      }
    }
    new_m[r] = nm;
    ref[r] = rf;
    e_sum[r] = sum;
    ex_sum[r] = xsum;
  }
}

// Rows of `width` temperature-scaled logits x and one uniform u in [0, 1) each: the token drawn
// by inverse CDF, its log-prob and the row's entropy, as ppo_trainer/generator.py's _sample
// computes them without top-k / top-p (fast_math.logsumexp_parts, inverse_cdf, _entropy):
//   m = rowmax (0 if infinite),  w = exp(x - m),  total = rowsum(w),  lse = m + log(total),
//   token = #{j : cumsum(w)_j <= min(u * total, the float below total)},
//   logprob = x[token] - lse,  entropy = lse - rowsum(w > 0 ? w * x : 0) / total.
void sample_rows(
    const float* x,
    const float* u,
    int32_t* tokens,
    float* logprobs,
    float* entropy,
    size_t width,
    size_t begin,
    size_t end) {
  std::vector<float>& w = row_scratch(width);
  for (size_t r = begin; r < end; ++r) {
    const float* xr = x + r * width;
    float m = row_max_of(xr, width);
    m = std::isinf(m) ? 0.0f : m;
    exp_shifted_row(xr, m, w.data(), width);
    float total = 0.0f, weighted = 0.0f;
    for (size_t j = 0; j < width; ++j) {
      total += w[j];
      weighted += w[j] > 0.0f ? w[j] * xr[j] : 0.0f;
    }
    float lse = m + std::log(total);
    int32_t total_bits;
    std::memcpy(&total_bits, &total, sizeof total);
    total_bits -= 1;
    float cap;
    std::memcpy(&cap, &total_bits, sizeof cap);
    float threshold = u[r] * total;
    threshold = threshold != threshold ? threshold : (threshold < cap ? threshold : cap);
    // The running sum is cumsum's, element by element. It never decreases (w >= 0) and a NaN
    // stays NaN, so no sum after the first one not at most the threshold is counted.
    float cdf = 0.0f;
    int32_t count = 0;
    for (size_t j = 0; j < width; ++j) {
      cdf += w[j];
      if (!(cdf <= threshold)) {
        break;
      }
      ++count;
    }
    tokens[r] = count;
    size_t picked = std::min<size_t>(size_t(count), width - 1);
    logprobs[r] = xr[picked] - lse;
    entropy[r] = lse - weighted / total;
  }
}

// Rows of `width` features: x / sqrt(mean(x^2) + eps) * weight (fast_math.rms_norm, MLX's own
// formula: the mean is the sum times 1 / width, the reciprocal square root 1 / sqrt).
void rms_norm(
    const float* x,
    const float* weight,
    float* out,
    float inv_width,
    float eps,
    size_t width,
    size_t begin,
    size_t end) {
  for (size_t r = begin; r < end; ++r) {
    const float* xr = x + r * width;
    float* outr = out + r * width;
    float sum = 0.0f;
    for (size_t j = 0; j < width; ++j) {
      sum += xr[j] * xr[j];
    }
    float scale = 1.0f / std::sqrt(sum * inv_width + eps);
    for (size_t j = 0; j < width; ++j) {
      outr[j] = xr[j] * scale * weight[j];
    }
  }
}

// Rows per block of RMSNorm's weight gradient: each block's partial sum is one thread's, in
// row order, and the blocks are added in their order, so the sum is the same at any thread count.
constexpr size_t kNormRowBlock = 32;

// RMSNorm's gradient, blocks [begin, end) of kNormRowBlock rows: with n = 1 / sqrt(mean(x^2) +
// eps) (the forward's arithmetic) and gw = g * weight, the input's gradient
// gw * n - (x * mean(gw * x)) * n^3 (MLX's formula for mx.fast.rms_norm), and into `partial`
// (one row of `width` per block) each block's sum of g * (x * n), the weight's gradient's part.
void rms_norm_grad_blocks(
    const float* x,
    const float* weight,
    const float* g,
    float* dx,
    float* partial,
    float inv_width,
    float eps,
    size_t width,
    size_t rows,
    size_t begin,
    size_t end) {
  for (size_t block = begin; block < end; ++block) {
    float* acc = partial + block * width;
    std::fill(acc, acc + width, 0.0f);
    size_t last = std::min(rows, (block + 1) * kNormRowBlock);
    for (size_t r = block * kNormRowBlock; r < last; ++r) {
      const float* xr = x + r * width;
      const float* gr = g + r * width;
      float* dxr = dx + r * width;
      float sum = 0.0f;
      float dot = 0.0f;
      for (size_t j = 0; j < width; ++j) {
        sum += xr[j] * xr[j];
        dot += gr[j] * weight[j] * xr[j];
      }
      float n = 1.0f / std::sqrt(sum * inv_width + eps);
      float n3 = n * n * n;
      float t = dot * inv_width;
      for (size_t j = 0; j < width; ++j) {
        dxr[j] = gr[j] * weight[j] * n - xr[j] * t * n3;
        acc[j] += gr[j] * (xr[j] * n);
      }
    }
  }
}

// The weight's gradient, columns [begin, end): the blocks' partial sums added in block order.
void rms_norm_grad_weight(
    const float* partial,
    float* dw,
    size_t width,
    size_t blocks,
    size_t begin,
    size_t end) {
  std::copy(partial + begin, partial + end, dw + begin);
  for (size_t block = 1; block < blocks; ++block) {
    const float* part = partial + block * width;
    for (size_t j = begin; j < end; ++j) {
      dw[j] += part[j];
    }
  }
}

// MLX's float32 sine or cosine on the CPU (its Cephes polynomial, mlx/backend/cpu/simd/math.h
// sincos_checked, element by element): the argument reduced by rounding |x| * 4 / pi to an
// integer, two polynomials, each multiply-add a single rounding (std::fma, as MLX's); libm's
// beyond |x| > 2^23, where the reduction is no longer exact.
template <bool Sine>
inline float mlx_sincos(float in) {
  if (std::abs(in) > 8388608.0f) {
    return Sine ? std::sin(in) : std::cos(in);
  }
  bool sign_sin = in < 0.0f;
  float x = std::abs(in);
  float y = x * 1.27323954473516f;
  uint32_t emm2 = uint32_t(y);
  emm2 = emm2 + 1;
  emm2 = emm2 & ~uint32_t(1);
  y = float(emm2);
  bool poly = (emm2 & 2) != 0;
  x = std::fma(y, -0.78515625f, x);
  x = std::fma(y, -2.4187564849853515625e-4f, x);
  x = std::fma(y, -3.77489497744594108e-8f, x);
  sign_sin = sign_sin != ((emm2 & 4) != 0);
  bool sign_cos = ((emm2 - 2) & 4) != 0;
  float z = x * x;
  float y1 = std::fma(z, 2.443315711809948e-5f, -1.388731625493765e-3f);
  float y2 = std::fma(z, -1.9515295891e-4f, 8.3321608736e-3f);
  y1 = std::fma(y1, z, 4.166664568298827e-2f);
  y2 = std::fma(y2, z, -1.6666654611e-1f);
  y1 = y1 * z;
  y2 = y2 * z;
  y1 = y1 * z;
  y2 = std::fma(x, y2, x);
  y1 = std::fma(z, -0.5f, y1);
  y1 = y1 + 1.0f;
  if constexpr (Sine) {
    float ys = poly ? y1 : y2;
    return sign_sin ? -ys : ys;
  } else {
    float yc = poly ? y2 : y1;
    return sign_cos ? yc : -yc;
  }
}

// Where a kernel finds the rows of x (RoPE's input, the few-row matmul's): its shape and strides
// in elements (any layout; a row is read along the last axis at its stride).
struct RowLayout {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;

  // The layout of an evaluated array's data.
  static RowLayout of(const mx::array& x) {
    RowLayout layout;
    for (int d = 0; d < x.ndim(); ++d) {
      layout.shape.push_back(x.shape(d));
      layout.strides.push_back(int64_t(x.strides()[size_t(d)]));
    }
    return layout;
  }

  // How many rows: the product of every axis but the last.
  size_t rows() const {
    size_t count = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) {
      count *= size_t(shape[d]);
    }
    return count;
  }

  // The element offset of row `row` (rows in row-major order over all axes but the last).
  int64_t offset(size_t row) const {
    int64_t at = 0;
    for (int d = int(shape.size()) - 2; d >= 0; --d) {
      int64_t n = shape[size_t(d)];
      at += int64_t(row % size_t(n)) * strides[size_t(d)];
      row /= size_t(n);
    }
    return at;
  }
};

// RoPE's angles, positions [begin, end) of `length` per offset: position t = k * length + l (k
// the offset's index) is p = float(offsets[k] + l) * scale, negated where `negate` (the
// gradient: the rotation by the opposite angle), and for i < half theta = p * inv_freq[i],
// cos[t * half + i] = cos(theta), sin[t * half + i] = sin(theta) (MLX's own). Every row of x
// at one position shares them: computed once, not once per head.
void rope_angles(
    const int32_t* offsets,
    int64_t offset_stride,
    size_t length,
    const float* inv_freq,
    int64_t freq_stride,
    size_t half,
    float scale,
    bool negate,
    float* cos_out,
    float* sin_out,
    size_t begin,
    size_t end) {
  for (size_t t = begin; t < end; ++t) {
    int32_t at = offsets[int64_t(t / length) * offset_stride] + int32_t(t % length);
    float p = float(at) * scale;
    if (negate) {
      p = -p;
    }
    for (size_t i = 0; i < half; ++i) {
      float theta = p * inv_freq[int64_t(i) * freq_stride];
      cos_out[t * half + i] = mlx_sincos<false>(theta);
      sin_out[t * half + i] = mlx_sincos<true>(theta);
    }
  }
}

// Rows [begin, end) of non-traditional RoPE (fast_math._rotate_half): x (..., L, D) read through
// `layout`, row r at position t = k * L + l (l = r mod L, k = the first axis's index when there
// is one offset per index of it, else 0), whose angles :func:`rope_angles` wrote:
//   out[i] = x[i] cos - x[half + i] sin,  out[half + i] = x[i] sin + x[half + i] cos,
//   out[j] = x[j] for 2 half <= j < D (a contiguous output).
void rope_rows(
    const float* x,
    const RowLayout& layout,
    bool per_first_index,
    const float* cos_in,
    const float* sin_in,
    size_t half,
    float* out,
    size_t begin,
    size_t end) {
  size_t width = size_t(layout.shape.back());
  int64_t step = layout.strides.back();
  size_t length = size_t(layout.shape[layout.shape.size() - 2]);
  size_t per_first = 1;  // rows per index of the first axis
  for (size_t d = 1; d + 1 < layout.shape.size(); ++d) {
    per_first *= size_t(layout.shape[d]);
  }
  for (size_t r = begin; r < end; ++r) {
    const float* xr = x + layout.offset(r);
    float* outr = out + r * width;
    size_t t = (per_first_index ? r / per_first : 0) * length + r % length;
    const float* c = cos_in + t * half;
    const float* s = sin_in + t * half;
    for (size_t i = 0; i < half; ++i) {
      float x1 = xr[int64_t(i) * step];
      float x2 = xr[int64_t(half + i) * step];
      outr[i] = x1 * c[i] - x2 * s[i];
      outr[half + i] = x1 * s[i] + x2 * c[i];
    }
    for (size_t j = 2 * half; j < width; ++j) {
      outr[j] = xr[int64_t(j) * step];
    }
  }
}

// The elements of an array in `layout` at `data`, in row-major order (a contiguous copy).
std::vector<float> packed(const float* data, const RowLayout& layout) {
  size_t width = layout.shape.empty() ? 1 : size_t(layout.shape.back());
  int64_t step = layout.shape.empty() ? 0 : layout.strides.back();
  std::vector<float> rows(layout.rows() * width);
  for (size_t r = 0; r < layout.rows(); ++r) {
    const float* from = data + layout.offset(r);
    for (size_t k = 0; k < width; ++k) {
      rows[r * width + k] = from[int64_t(k) * step];
    }
  }
  return rows;
}

// ------------------------------------------------------------------ few-row matmul

// out (M, N) = x (M, K) @ w (N, K)^T for the few rows of a decoding step (M of 16 or fewer
// sequences), where a GEMM's packing of the weights costs as much as its arithmetic: the rows
// of x, transposed into groups of 16 (one vector register of rows per column k), are multiplied
// by each weight read straight from w's rows, kColumns output columns at a time. Each output is
// fma(x[m][K-1], w[n][K-1], ... fma(x[m][0], w[n][0], 0)), k in order: one result on every
// instruction set and at any thread count (the columns are split over threads).
constexpr size_t kRowLanes = 16;

#if defined(__AVX512F__)
constexpr const char* kFewRowIsa = "avx512";
constexpr int kColumns = 12;  // accumulators: 12 of the 32 vector registers, one per column
struct Lanes {
  __m512 v;
  static Lanes zero() {
    return {_mm512_setzero_ps()};
  }
  static Lanes load(const float* p) {
    return {_mm512_loadu_ps(p)};
  }
  void fma(const Lanes& x, float w) {
    v = _mm512_fmadd_ps(x.v, _mm512_set1_ps(w), v);
  }
  void fma(const Lanes& a, const Lanes& b) {
    v = _mm512_fmadd_ps(a.v, b.v, v);
  }
  float sum() const {
    return _mm512_reduce_add_ps(v);
  }
  void store(float* p) const {
    _mm512_storeu_ps(p, v);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kFewRowIsa = "avx2";
constexpr int kColumns = 6;  // two registers per column: 12 of the 16
struct Lanes {
  __m256 lo, hi;
  static Lanes zero() {
    return {_mm256_setzero_ps(), _mm256_setzero_ps()};
  }
  static Lanes load(const float* p) {
    return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  }
  void fma(const Lanes& x, float w) {
    __m256 b = _mm256_set1_ps(w);
    lo = _mm256_fmadd_ps(x.lo, b, lo);
    hi = _mm256_fmadd_ps(x.hi, b, hi);
  }
  void fma(const Lanes& a, const Lanes& b) {
    lo = _mm256_fmadd_ps(a.lo, b.lo, lo);
    hi = _mm256_fmadd_ps(a.hi, b.hi, hi);
  }
  float sum() const {
    float parts[8];
    _mm256_storeu_ps(parts, _mm256_add_ps(lo, hi));
    return ((parts[0] + parts[1]) + (parts[2] + parts[3])) +
        ((parts[4] + parts[5]) + (parts[6] + parts[7]));
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
};
#else
constexpr const char* kFewRowIsa = "scalar";  // correct, not fast: Python does not route to it
constexpr int kColumns = 4;
struct Lanes {
  float v[kRowLanes];
  static Lanes zero() {
    return Lanes{};
  }
  static Lanes load(const float* p) {
    Lanes out;
    std::memcpy(out.v, p, sizeof out.v);
    return out;
  }
  void fma(const Lanes& x, float w) {
    for (size_t i = 0; i < kRowLanes; ++i) {
      v[i] = std::fma(x.v[i], w, v[i]);
    }
  }
  void fma(const Lanes& a, const Lanes& b) {
    for (size_t i = 0; i < kRowLanes; ++i) {
      v[i] = std::fma(a.v[i], b.v[i], v[i]);
    }
  }
  float sum() const {
    float total = 0.0f;
    for (size_t i = 0; i < kRowLanes; ++i) {
      total += v[i];
    }
    return total;
  }
  void store(float* p) const {
    std::memcpy(p, v, sizeof v);
  }
};
#endif

// Output columns [n0, n0 + C) of every group of rows: xt (groups, K, 16) the rows transposed,
// w (N, K) row-major, outt (groups, N, 16). The first group's pass prefetches the next C
// columns' weights (C floats a step): the C rows read side by side are more streams than the
// hardware prefetcher follows (the weights came at about half the memory's speed without).
template <int C>
void few_row_columns(
    const float* xt,
    size_t groups,
    const float* w,
    size_t k_size,
    size_t n_size,
    size_t n0,
    float* outt) {
  const float* wn = w + n0 * k_size;
  size_t next = std::min(n0 + size_t(C), n_size) * k_size;  // where the next columns start
  size_t ahead = std::min(size_t(C) * k_size, n_size * k_size - next);
  for (size_t g = 0; g < groups; ++g) {
    const float* xg = xt + g * k_size * kRowLanes;
    Lanes acc[C];
    for (int j = 0; j < C; ++j) {
      acc[j] = Lanes::zero();
    }
    size_t prefetch = g == 0 ? ahead : 0;
    for (size_t k = 0; k < k_size; ++k) {
      if (k * size_t(C) < prefetch) {
        __builtin_prefetch(w + next + k * size_t(C));
      }
      Lanes xv = Lanes::load(xg + k * kRowLanes);
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) {
        acc[j].fma(xv, wn[size_t(j) * k_size + k]);
      }
    }
    for (int j = 0; j < C; ++j) {
      acc[j].store(outt + (g * n_size + n0 + size_t(j)) * kRowLanes);
    }
  }
}

// out (rows, N) = x @ w^T: x's rows in `layout` (any strides), w (N, K) row-major.
void few_row_matmul(
    const float* x,
    const RowLayout& layout,
    const float* w,
    size_t n_size,
    float* out) {
  size_t k_size = size_t(layout.shape.back());
  int64_t step = layout.strides.back();
  size_t rows = layout.rows();
  size_t groups = (rows + kRowLanes - 1) / kRowLanes;
  // The calling thread's buffers, kept between calls: a new one each call would cost the
  // kernel's first touch of its pages (megabytes for a vocabulary's columns).
  thread_local std::vector<float> xt, outt;
  xt.assign(groups * k_size * kRowLanes, 0.0f);
  outt.resize(std::max(outt.size(), groups * n_size * kRowLanes));
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x + layout.offset(r);
    float* to = xt.data() + (r / kRowLanes) * k_size * kRowLanes + r % kRowLanes;
    for (size_t k = 0; k < k_size; ++k) {
      to[k * kRowLanes] = xr[int64_t(k) * step];
    }
  }
  // Pointers, not the buffers' names: in the pool's helpers those name the helpers' own.
  const float* xtp = xt.data();
  float* outtp = outt.data();
  size_t blocks = n_size / size_t(kColumns);
  size_t grain = std::max<size_t>(1, kGrain / std::max<size_t>(size_t(kColumns) * k_size, 1));
  pool().parallel(blocks, grain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      few_row_columns<kColumns>(xtp, groups, w, k_size, n_size, i * size_t(kColumns), outtp);
    }
  });
  for (size_t n = blocks * size_t(kColumns); n < n_size; ++n) {
    few_row_columns<1>(xtp, groups, w, k_size, n_size, n, outtp);
  }
  for (size_t r = 0; r < rows; ++r) {
    const float* from = outtp + (r / kRowLanes) * n_size * kRowLanes + r % kRowLanes;
    float* to = out + r * n_size;
    for (size_t n = 0; n < n_size; ++n) {
      to[n] = from[n * kRowLanes];
    }
  }
}

// ------------------------------------------------------------------ one-query attention

// A decoding step's attention (one query position), the (b, g) pairs [begin, end) of
// q (B, G, R, D): softmax(q k^T * scale + mask) v over the S cached keys and values of the pair's
// key/value head g, for its R grouped query heads, into out (B, G, R, Dv), contiguous. Every
// input is read at its strides (elements; the last axis' 1 for q, keys and values, which
// eval_one_query_attention copies where it is not), the mask's 0 along a broadcast axis. Per query
// row: the scores scale * q (in float32, as MLX's q * scale) dotted with each key; a boolean mask
// replaces the hidden ones with float32's finite minimum, an additive one is added; the exp of
// each score minus the row's max (fast_math.exp); out = (sum_j e_j v_j) / sum_j e_j. The same
// function as fast_math.one_query_attention's MLX graph up to float32 rounding (the dot products
// and sums run in another order); the same bits at any thread count (a pair is one thread's).
struct OneQueryAttention {
  const float* q;
  const float* keys;
  const float* values;
  const void* mask;  // null: none
  bool mask_bool;
  float scale;
  float* out;
  size_t groups, rep, length, d_size, dv_size;
  int64_t q_strides[4], k_strides[3], v_strides[3], mask_strides[4];
};

// The dot product of two contiguous rows of `size` floats.
inline float dot_row(const float* a, const float* b, size_t size) {
  Lanes acc = Lanes::zero();
  size_t d = 0;
  for (; d + kRowLanes <= size; d += kRowLanes) {
    acc.fma(Lanes::load(a + d), Lanes::load(b + d));
  }
  float total = acc.sum();
  for (; d < size; ++d) {
    total += a[d] * b[d];
  }
  return total;
}

// out (size) = sum_j w[j] * rows[j * stride] over `count` rows of `size` floats, in blocks of
// kAttendBlock lanes held in registers across the rows.
constexpr size_t kAttendBlock = 8;
inline void weighted_rows(
    const float* w,
    const float* rows,
    int64_t stride,
    size_t count,
    size_t size,
    float* out) {
  size_t full = size / kRowLanes * kRowLanes;
  for (size_t d0 = 0; d0 < full; d0 += kAttendBlock * kRowLanes) {
    size_t lanes = std::min(kAttendBlock, (full - d0) / kRowLanes);
    Lanes acc[kAttendBlock];
    for (size_t c = 0; c < lanes; ++c) {
      acc[c] = Lanes::zero();
    }
    for (size_t j = 0; j < count; ++j) {
      const float* row = rows + int64_t(j) * stride + int64_t(d0);
      for (size_t c = 0; c < lanes; ++c) {
        acc[c].fma(Lanes::load(row + c * kRowLanes), w[j]);
      }
    }
    for (size_t c = 0; c < lanes; ++c) {
      acc[c].store(out + d0 + c * kRowLanes);
    }
  }
  for (size_t d = full; d < size; ++d) {
    float total = 0.0f;
    for (size_t j = 0; j < count; ++j) {
      total += w[j] * rows[int64_t(j) * stride + int64_t(d)];
    }
    out[d] = total;
  }
}

void one_query_attention(const OneQueryAttention& a, size_t begin, size_t end) {
  size_t s_size = a.length, d_size = a.d_size, dv_size = a.dv_size;
  std::vector<float>& scratch = row_scratch(a.rep * (s_size + d_size + dv_size));
  float* scores = scratch.data();                  // (R, S)
  float* qs = scores + a.rep * s_size;             // (R, D): q * scale
  float* acc = qs + a.rep * d_size;                // (R, Dv)
  for (size_t pair = begin; pair < end; ++pair) {
    size_t b = pair / a.groups, g = pair % a.groups;
    const float* kp = a.keys + int64_t(b) * a.k_strides[0] + int64_t(g) * a.k_strides[1];
    const float* vp = a.values + int64_t(b) * a.v_strides[0] + int64_t(g) * a.v_strides[1];
    for (size_t r = 0; r < a.rep; ++r) {
      const float* qr = a.q + int64_t(b) * a.q_strides[0] + int64_t(g) * a.q_strides[1] +
          int64_t(r) * a.q_strides[2];
      for (size_t d = 0; d < d_size; ++d) {
        qs[r * d_size + d] = qr[d] * a.scale;
      }
    }
    for (size_t j = 0; j < s_size; ++j) {
      const float* kj = kp + int64_t(j) * a.k_strides[2];
      for (size_t r = 0; r < a.rep; ++r) {
        scores[r * s_size + j] = dot_row(qs + r * d_size, kj, d_size);
      }
    }
    if (a.mask != nullptr) {
      for (size_t r = 0; r < a.rep; ++r) {
        int64_t at = int64_t(b) * a.mask_strides[0] + int64_t(g) * a.mask_strides[1] +
            int64_t(r) * a.mask_strides[2];
        float* row = scores + r * s_size;
        for (size_t j = 0; j < s_size; ++j) {
          int64_t m = at + int64_t(j) * a.mask_strides[3];
          if (a.mask_bool) {
            row[j] = static_cast<const bool*>(a.mask)[m] ? row[j] : -FLT_MAX;
          } else {
            row[j] = row[j] + static_cast<const float*>(a.mask)[m];
          }
        }
      }
    }
    for (size_t r = 0; r < a.rep; ++r) {
      float* row = scores + r * s_size;
      float m = row_max_of(row, s_size);
      float total = 0.0f;
      if (m != m) {
        for (size_t j = 0; j < s_size; ++j) {
          row[j] = m;
        }
        total = m;
      } else {
        for (size_t j = 0; j < s_size; ++j) {
          float y = (row[j] - m) * kLog2e;
          y = y < -127.0f ? -127.0f : y;
          row[j] = exp2_fraction(y) * exp2_bits(y);
          total += row[j];
        }
      }
      weighted_rows(row, vp, a.v_strides[2], s_size, dv_size, acc + r * dv_size);
      float inv = 1.0f / total;
      float* o = a.out + (pair * a.rep + r) * dv_size;
      for (size_t d = 0; d < dv_size; ++d) {
        o[d] = acc[r * dv_size + d] * inv;
      }
    }
  }
}

// ------------------------------------------------------------------ MLX primitives

enum class Kernel {
  SwiGLU,
  SwiGLUGrad,
  RowExp,
  ScoresGrad,
  RMSNorm,
  RMSNormGrad,
  SoftmaxBlock,
  Sample,
  Rope,
  FewRowMatmul,
  OneQueryAttention
};

const char* kernel_name(Kernel kernel) {
  switch (kernel) {
    case Kernel::SwiGLU:
      return "NativeSwiGLU";
    case Kernel::SwiGLUGrad:
      return "NativeSwiGLUGrad";
    case Kernel::RowExp:
      return "NativeRowExp";
    case Kernel::ScoresGrad:
      return "NativeScoresGrad";
    case Kernel::RMSNorm:
      return "NativeRMSNorm";
    case Kernel::RMSNormGrad:
      return "NativeRMSNormGrad";
    case Kernel::SoftmaxBlock:
      return "NativeSoftmaxBlock";
    case Kernel::Sample:
      return "NativeSample";
    case Kernel::Rope:
      return "NativeRope";
    case Kernel::FewRowMatmul:
      return "NativeFewRowMatmul";
    case Kernel::OneQueryAttention:
      return "NativeOneQueryAttention";
  }
  return "Native";
}

// One primitive class for the kernels: float32 inputs in any layout (the row kernels copy one
// that is not row-contiguous when they run; RoPE, the few-row matmul and the attention read
// theirs at their strides), outputs allocated here. RMSNorm and RoPE have a vjp (RMSNormGrad;
// RoPE by the opposite angle): base_setup.fast_math calls the others inside
// mx.custom_function's whose gradients are written out.
class NativePrimitive : public mx::Primitive {
 public:
  // `eps`: RMSNorm's epsilon, RoPE's position scale; `negate`: RoPE by the opposite angle.
  NativePrimitive(
      mx::Stream stream,
      Kernel kernel,
      float eps = 0.0f,
      int outputs = 0,
      bool negate = false)
      : mx::Primitive(stream), kernel_(kernel), eps_(eps), outputs_(outputs), negate_(negate) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) {
      encoder.set_input_array(in);
    }
    for (auto& out : outputs) {
      encoder.set_output_array(out);
    }
    if (kernel_ == Kernel::Rope) {
      eval_rope(encoder, inputs, outputs[0]);
      return;
    }
    if (kernel_ == Kernel::FewRowMatmul) {
      eval_few_row_matmul(encoder, inputs, outputs[0]);
      return;
    }
    if (kernel_ == Kernel::OneQueryAttention) {
      eval_one_query_attention(encoder, inputs, outputs[0]);
      return;
    }
    std::vector<const float*> in;
    for (auto& a : inputs) {
      in.push_back(a.data<float>());
    }
    std::vector<float*> out;
    for (auto& a : outputs) {
      out.push_back(a.dtype() == mx::float32 ? a.data<float>() : nullptr);
    }
    int32_t* index_out = kernel_ == Kernel::Sample ? outputs[0].data<int32_t>() : nullptr;
    size_t size = inputs[0].size();
    size_t width = inputs[0].ndim() ? size_t(inputs[0].shape(-1)) : 1;
    Kernel kernel = kernel_;
    float eps = eps_;
    // Inputs not row-contiguous (the functions below pass lazy arrays as they are: a copy node
    // for each would cost more, and they rarely are not): copied when the kernel runs.
    std::vector<std::pair<size_t, RowLayout>> strided;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].flags().row_contiguous) {
        strided.emplace_back(i, RowLayout::of(inputs[i]));
      }
    }
    encoder.dispatch([kernel, eps, in, out, index_out, size, width, strided]() mutable {
      std::vector<std::vector<float>> copies;
      for (auto& [i, layout] : strided) {
        copies.push_back(packed(in[i], layout));
        in[i] = copies.back().data();
      }
      switch (kernel) {
        case Kernel::SwiGLU:
          pool().parallel(size, kGrain, [&](size_t b, size_t e) {
            swiglu_forward(in[0], in[1], out[0], b, e);
          });
          break;
        case Kernel::SwiGLUGrad:
          pool().parallel(size, kGrain, [&](size_t b, size_t e) {
            swiglu_backward(in[0], in[1], in[2], out[0], out[1], b, e);
          });
          break;
        case Kernel::RowExp:
          pool().parallel(size / width, std::max<size_t>(1, kGrain / width), [&](size_t b, size_t e) {
            row_exp(in[0], out[0], out[1], width, b, e);
          });
          break;
        case Kernel::ScoresGrad:
          pool().parallel(size / width, std::max<size_t>(1, kGrain / width), [&](size_t b, size_t e) {
            scores_grad(in[0], in[1], in[2], in[3], out[0], width, b, e);
          });
          break;
        case Kernel::RMSNorm:
          pool().parallel(size / width, std::max<size_t>(1, kGrain / width), [&](size_t b, size_t e) {
            rms_norm(in[0], in[1], out[0], float(1.0 / double(width)), eps, width, b, e);
          });
          break;
        case Kernel::RMSNormGrad: {
          size_t rows = size / width;
          size_t blocks = (rows + kNormRowBlock - 1) / kNormRowBlock;
          std::vector<float> partial(blocks * width);
          size_t grain = std::max<size_t>(1, kGrain / (width * kNormRowBlock));
          pool().parallel(blocks, grain, [&](size_t b, size_t e) {
            rms_norm_grad_blocks(
                in[0], in[1], in[2], out[0], partial.data(), float(1.0 / double(width)), eps,
                width, rows, b, e);
          });
          pool().parallel(width, std::max<size_t>(1, kGrain / std::max<size_t>(blocks, 1)),
                          [&](size_t b, size_t e) {
                            rms_norm_grad_weight(partial.data(), out[1], width, blocks, b, e);
                          });
          break;
        }
        case Kernel::Sample:
          pool().parallel(size / width, std::max<size_t>(1, kGrain / width), [&](size_t b, size_t e) {
            sample_rows(in[0], in[1], index_out, out[1], out[2], width, b, e);
          });
          break;
        case Kernel::SoftmaxBlock: {
          float* e_out = out.size() > 4 ? out[4] : nullptr;
          float* ex_out = out.size() > 5 ? out[5] : nullptr;
          pool().parallel(size / width, std::max<size_t>(1, kGrain / width), [&](size_t b, size_t e) {
            softmax_block(
                in[0], in[1], out[0], out[1], out[2], out[3], e_out, ex_out, width, b, e);
          });
          break;
        }
      }
    });
  }

  // RoPE (x, offsets, inverse frequencies): x in any layout, offsets int32 (one, or one per index
  // of x's first axis), the frequencies (half,); a contiguous output.
  void eval_rope(
      mx::cpu::CommandEncoder& encoder,
      const std::vector<mx::array>& inputs,
      mx::array& out) {
    const mx::array& x = inputs[0];
    RowLayout layout = RowLayout::of(x);
    const mx::array& offsets = inputs[1];
    const mx::array& freqs = inputs[2];
    const float* xp = x.data<float>();
    const int32_t* op = offsets.data<int32_t>();
    int64_t offset_stride = offsets.ndim() ? int64_t(offsets.strides()[0]) : 0;
    size_t offset_count = offsets.size();
    const float* fp = freqs.data<float>();
    int64_t freq_stride = int64_t(freqs.strides()[0]);
    size_t half = freqs.size();
    float* outp = out.data<float>();
    size_t width = size_t(x.shape(-1));
    size_t rows = width ? layout.rows() : 0;
    float scale = eps_;
    bool negate = negate_;
    size_t length = size_t(x.shape(-2));
    size_t positions = offset_count * length;
    size_t grain = std::max<size_t>(1, kGrain / std::max<size_t>(width, 1));
    encoder.dispatch([=]() {
      std::vector<float> cos(positions * half), sin(positions * half);
      pool().parallel(positions, grain, [&](size_t b, size_t e) {
        rope_angles(
            op, offset_stride, length, fp, freq_stride, half, scale, negate, cos.data(),
            sin.data(), b, e);
      });
      pool().parallel(rows, grain, [&](size_t b, size_t e) {
        rope_rows(xp, layout, offset_count > 1, cos.data(), sin.data(), half, outp, b, e);
      });
    });
  }

  // x (..., K) in any layout @ w (N, K)^T, w row-contiguous; a contiguous (..., N) output.
  void eval_few_row_matmul(
      mx::cpu::CommandEncoder& encoder,
      const std::vector<mx::array>& inputs,
      mx::array& out) {
    const mx::array& x = inputs[0];
    RowLayout layout = RowLayout::of(x);
    const float* xp = x.data<float>();
    const float* wp = inputs[1].data<float>();
    size_t n_size = size_t(inputs[1].shape(0));
    float* outp = out.data<float>();
    encoder.dispatch([=]() { few_row_matmul(xp, layout, wp, n_size, outp); });
  }

  // q (B, G, R, D), keys (B, G, S, D), values (B, G, S, Dv) and an optional (4-d, broadcastable)
  // mask, each read at its strides; a contiguous (B, G, R, Dv) output. `eps_` is the scale.
  void eval_one_query_attention(
      mx::cpu::CommandEncoder& encoder,
      const std::vector<mx::array>& inputs,
      mx::array& out) {
    OneQueryAttention a{};
    const mx::array &q = inputs[0], &keys = inputs[1], &values = inputs[2];
    a.q = q.data<float>();
    a.keys = keys.data<float>();
    a.values = values.data<float>();
    a.scale = eps_;
    a.out = out.data<float>();
    a.groups = size_t(q.shape(1));
    a.rep = size_t(q.shape(2));
    a.length = size_t(keys.shape(2));
    a.d_size = size_t(q.shape(3));
    a.dv_size = size_t(values.shape(3));
    for (size_t d = 0; d < 4; ++d) {
      a.q_strides[d] = int64_t(q.strides()[d]);
    }
    for (size_t d = 0; d < 3; ++d) {
      a.k_strides[d] = int64_t(keys.strides()[d]);
      a.v_strides[d] = int64_t(values.strides()[d]);
    }
    // An input whose last axis is not at stride 1 (never a cache's slice): a contiguous copy.
    std::array<RowLayout, 3> copied;
    std::array<bool, 3> copy{};
    for (size_t i = 0; i < 3; ++i) {
      copy[i] = inputs[i].shape(-1) > 1 && inputs[i].strides().back() != 1;
      if (copy[i]) {
        copied[i] = RowLayout::of(inputs[i]);
        int64_t width = inputs[i].shape(-1);
        int64_t* strides = i == 0 ? a.q_strides : i == 1 ? a.k_strides : a.v_strides;
        for (int d = 2; d >= 0; --d) {  // the last axis' stride is 1 (not read)
          strides[d] = width;
          width *= inputs[i].shape(d);
        }
      }
    }
    if (inputs.size() > 3) {
      const mx::array& mask = inputs[3];
      a.mask_bool = mask.dtype() == mx::bool_;
      a.mask = a.mask_bool ? static_cast<const void*>(mask.data<bool>())
                           : static_cast<const void*>(mask.data<float>());
      for (size_t d = 0; d < 4; ++d) {
        a.mask_strides[d] = mask.shape(int(d)) == 1 ? 0 : int64_t(mask.strides()[d]);
      }
    }
    size_t pairs = size_t(q.shape(0)) * a.groups;
    size_t work = a.rep * a.length * (a.d_size + a.dv_size);
    size_t grain = std::max<size_t>(1, kGrain / std::max<size_t>(work, 1));
    encoder.dispatch([a, pairs, grain, copied, copy]() mutable {
      std::array<std::vector<float>, 3> rows;
      const float** pointers[3] = {&a.q, &a.keys, &a.values};
      for (size_t i = 0; i < 3; ++i) {
        if (copy[i]) {
          rows[i] = packed(*pointers[i], copied[i]);
          *pointers[i] = rows[i].data();
        }
      }
      pool().parallel(pairs, grain, [&](size_t b, size_t e) { one_query_attention(a, b, e); });
    });
  }

  // RMSNorm: its gradient is the RMSNormGrad kernel's (x's and the weight's; the other kernels
  // are differentiated in fast_math); RoPE's is RoPE by the opposite angle. The gradients
  // themselves have no gradient.
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

  const char* name() const override {
    return kernel_name(kernel_);
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* native = dynamic_cast<const NativePrimitive*>(&other);
    return native != nullptr && native->kernel_ == kernel_ && native->eps_ == eps_ &&
        native->outputs_ == outputs_ && native->negate_ == negate_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    switch (kernel_) {
      case Kernel::SwiGLUGrad:
        return {inputs[0].shape(), inputs[0].shape()};
      case Kernel::RMSNormGrad:
        return {inputs[0].shape(), inputs[1].shape()};
      case Kernel::RowExp: {
        mx::Shape rows = inputs[0].shape();
        rows.back() = 1;
        return {inputs[0].shape(), rows};
      }
      case Kernel::Sample: {
        mx::Shape rows = {inputs[0].shape(0)};
        return {rows, rows, rows};
      }
      case Kernel::FewRowMatmul: {
        mx::Shape shape = inputs[0].shape();
        shape.back() = inputs[1].shape(0);
        return {shape};
      }
      case Kernel::OneQueryAttention: {
        mx::Shape shape = inputs[0].shape();
        shape.back() = inputs[2].shape(-1);
        return {shape};
      }
      case Kernel::SoftmaxBlock: {
        mx::Shape rows = inputs[0].shape();
        rows.back() = 1;
        std::vector<mx::Shape> shapes(4, rows);
        for (int i = 4; i < outputs_; ++i) {
          shapes.push_back(inputs[0].shape());
        }
        return shapes;
      }
      default:
        return {inputs[0].shape()};
    }
  }

 private:
  Kernel kernel_;
  float eps_;
  int outputs_;  // SoftmaxBlock: 4, 5 (with e) or 6 (with e * x)
  bool negate_;  // RoPE: by the opposite angle
};

mx::Stream cpu_stream(mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("the native kernels run on a CPU stream only");
  }
  return stream;
}

void check_float32(const std::vector<mx::array>& arrays, const char* what) {
  for (auto& a : arrays) {
    if (a.dtype() != mx::float32) {
      throw std::invalid_argument(std::string(what) + " takes float32 arrays");
    }
  }
}

void check_same_shape(const std::vector<mx::array>& arrays, const char* what) {
  for (auto& a : arrays) {
    if (a.shape() != arrays[0].shape()) {
      throw std::invalid_argument(std::string(what) + " takes arrays of one shape");
    }
  }
}


// (rows, 1) inputs of a row kernel, broadcast to the rows of `like` and made contiguous.
mx::array per_row(const mx::array& a, const mx::array& like, mx::Stream stream) {
  mx::Shape rows = like.shape();
  rows.back() = 1;
  return mx::contiguous(mx::broadcast_to(a, rows, stream), false, stream);
}

std::vector<mx::array> make(
    Kernel kernel,
    std::vector<mx::array> inputs,
    mx::Stream stream,
    float eps = 0.0f,
    int outputs = 0,
    bool negate = false) {
  auto primitive = std::make_shared<NativePrimitive>(stream, kernel, eps, outputs, negate);
  auto shapes = primitive->output_shapes(inputs);
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  if (kernel == Kernel::Sample) {
    dtypes[0] = mx::int32;  // the tokens
  }
  return mx::array::make_arrays(std::move(shapes), dtypes, primitive, std::move(inputs));
}

std::vector<mx::array> NativePrimitive::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  mx::Stream s = stream();
  if (kernel_ == Kernel::Rope) {
    // A rotation's transpose is the rotation by the opposite angle; no gradient reaches the
    // offsets or the frequencies.
    std::vector<mx::array> out;
    for (int i : argnums) {
      if (i == 0) {
        auto rotated =
            make(Kernel::Rope, {cotangents[0], primals[1], primals[2]}, s, eps_, 0, !negate_);
        out.push_back(rotated[0]);
      } else {
        out.push_back(mx::zeros_like(primals[size_t(i)], s));
      }
    }
    return out;
  }
  if (kernel_ == Kernel::FewRowMatmul) {
    // x @ w^T: d x = c @ w, d w = c^T @ x over the rows (MLX's matmuls).
    const mx::array& x = primals[0];
    const mx::array& w = primals[1];
    int k_size = x.shape(-1), n_size = w.shape(0);
    std::vector<mx::array> out;
    for (int i : argnums) {
      if (i == 0) {
        out.push_back(mx::matmul(cotangents[0], w, s));
      } else {
        auto c = mx::reshape(cotangents[0], {-1, n_size}, s);
        out.push_back(mx::matmul(mx::transpose(c, s), mx::reshape(x, {-1, k_size}, s), s));
      }
    }
    return out;
  }
  if (kernel_ != Kernel::RMSNorm) {
    return mx::Primitive::vjp(primals, cotangents, argnums, outputs);
  }
  // The primals and the cotangent in any layout (see eval_cpu).
  auto grads = make(
      Kernel::RMSNormGrad,
      {primals[0], primals[1], cotangents[0]},
      s,
      eps_);
  std::vector<mx::array> out;
  for (int i : argnums) {
    out.push_back(grads[i]);
  }
  return out;
}

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  check_float32({gate, up}, "swiglu");
  check_same_shape({gate, up}, "swiglu");
  auto stream = cpu_stream(s);
  return make(Kernel::SwiGLU, {gate, up}, stream)[0];
}

std::vector<mx::array> swiglu_grad(
    const mx::array& gate,
    const mx::array& up,
    const mx::array& cotangent,
    mx::StreamOrDevice s) {
  check_float32({gate, up, cotangent}, "swiglu_grad");
  check_same_shape({gate, up, cotangent}, "swiglu_grad");
  auto stream = cpu_stream(s);
  return make(Kernel::SwiGLUGrad, {gate, up, cotangent}, stream);
}

std::vector<mx::array> row_exp_max(const mx::array& scores, mx::StreamOrDevice s) {
  check_float32({scores}, "row_exp");
  if (scores.ndim() == 0 || scores.shape(-1) == 0) {
    throw std::invalid_argument("row_exp takes rows of at least one score");
  }
  auto stream = cpu_stream(s);
  return make(Kernel::RowExp, {scores}, stream);
}

mx::array attention_scores_grad(
    const mx::array& e,
    const mx::array& w,
    const mx::array& inv_total,
    const mx::array& seen,
    mx::StreamOrDevice s) {
  check_float32({e, w, inv_total, seen}, "attention_scores_grad");
  check_same_shape({e, w}, "attention_scores_grad");
  if (e.ndim() == 0 || e.shape(-1) == 0) {
    throw std::invalid_argument("attention_scores_grad takes rows of at least one score");
  }
  auto stream = cpu_stream(s);
  std::vector<mx::array> inputs = {e, w};
  inputs.push_back(per_row(inv_total, e, stream));
  inputs.push_back(per_row(seen, e, stream));
  return make(Kernel::ScoresGrad, std::move(inputs), stream)[0];
}

mx::array rms_norm_forward(
    const mx::array& x,
    const mx::array& weight,
    float eps,
    mx::StreamOrDevice s) {
  check_float32({x, weight}, "rms_norm");
  if (x.ndim() == 0 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1) || x.shape(-1) == 0) {
    throw std::invalid_argument("rms_norm takes rows of x's last axis and a weight of that size");
  }
  auto stream = cpu_stream(s);
  return make(Kernel::RMSNorm, {x, weight}, stream, eps)[0];
}

std::vector<mx::array> softmax_block_of(
    const mx::array& x,
    const mx::array& m,
    bool with_e,
    bool with_ex,
    mx::StreamOrDevice s) {
  check_float32({x, m}, "softmax_block");
  if (x.ndim() != 2 || x.shape(-1) == 0 || m.size() != size_t(x.shape(0))) {
    throw std::invalid_argument("softmax_block takes (N, W) logits and an (N, 1) running max");
  }
  if (with_ex && !with_e) {
    throw std::invalid_argument("softmax_block gives e * x only with e");
  }
  auto stream = cpu_stream(s);
  std::vector<mx::array> inputs = {x};
  inputs.push_back(per_row(mx::reshape(m, {x.shape(0), 1}, stream), x, stream));
  int outputs = 4 + int(with_e) + int(with_ex);
  return make(Kernel::SoftmaxBlock, std::move(inputs), stream, 0.0f, outputs);
}

mx::array rope(
    const mx::array& x,
    const mx::array& offsets,
    const mx::array& inv_freq,
    float scale,
    mx::StreamOrDevice s) {
  check_float32({x, inv_freq}, "rope");
  if (offsets.dtype() != mx::int32) {
    throw std::invalid_argument("rope takes int32 offsets");
  }
  if (x.ndim() < 2 || inv_freq.ndim() != 1 || 2 * inv_freq.shape(0) > x.shape(-1)) {
    throw std::invalid_argument("rope takes x (..., L, D) and at most D / 2 frequencies");
  }
  if (offsets.ndim() > 1 || (offsets.size() != 1 && offsets.size() != size_t(x.shape(0)))) {
    throw std::invalid_argument("rope takes one offset, or one per index of x's first axis");
  }
  auto stream = cpu_stream(s);
  return make(Kernel::Rope, {x, offsets, inv_freq}, stream, scale)[0];
}

mx::array few_row_matmul_of(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  check_float32({x, w}, "few_row_matmul");
  if (x.ndim() < 1 || w.ndim() != 2 || x.shape(-1) != w.shape(1) || w.shape(1) == 0) {
    throw std::invalid_argument("few_row_matmul takes x (..., K) and a weight (N, K)");
  }
  auto stream = cpu_stream(s);
  // The kernel reads the weight's rows as they lie: a parameter (evaluated, row-contiguous)
  // as it is, anything else through a contiguous copy.
  bool direct = w.is_available() && w.flags().row_contiguous;
  mx::array weight = direct ? w : mx::contiguous(w, false, stream);
  return make(Kernel::FewRowMatmul, {x, weight}, stream)[0];
}

mx::array one_query_attention_of(
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    std::optional<mx::array> mask,
    float scale,
    mx::StreamOrDevice s) {
  check_float32({q, keys, values}, "one_query_attention");
  if (q.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4 || q.shape(3) != keys.shape(3) ||
      keys.shape(2) != values.shape(2) || keys.shape(2) == 0) {
    throw std::invalid_argument(
        "one_query_attention takes q (B, G, R, D), keys (B, G, S, D) and values (B, G, S, Dv) "
        "with S > 0");
  }
  for (int d = 0; d < 2; ++d) {
    if (keys.shape(d) != q.shape(d) || values.shape(d) != q.shape(d)) {
      throw std::invalid_argument("one_query_attention: q, keys and values differ in B or G");
    }
  }
  auto stream = cpu_stream(s);
  std::vector<mx::array> inputs = {q, keys, values};  // any layout: see eval_one_query_attention
  if (mask.has_value()) {
    const mx::array& m = *mask;
    mx::Shape full = {q.shape(0), q.shape(1), q.shape(2), keys.shape(2)};
    bool fits = m.ndim() == 4;
    for (int d = 0; fits && d < 4; ++d) {
      fits = m.shape(d) == 1 || m.shape(d) == full[size_t(d)];
    }
    if (!fits || (m.dtype() != mx::bool_ && m.dtype() != mx::float32)) {
      throw std::invalid_argument(
          "one_query_attention takes a boolean or float32 mask of 4 axes, each 1 or (B, G, R, "
          "S)'s");
    }
    inputs.push_back(m);
  }
  return make(Kernel::OneQueryAttention, std::move(inputs), stream, scale)[0];
}

std::vector<mx::array> sample(const mx::array& scaled, const mx::array& uniform, mx::StreamOrDevice s) {
  check_float32({scaled, uniform}, "sample");
  if (scaled.ndim() != 2 || scaled.shape(-1) == 0 || uniform.size() != size_t(scaled.shape(0))) {
    throw std::invalid_argument("sample takes (B, V) logits and (B, 1) uniform numbers");
  }
  auto stream = cpu_stream(s);
  std::vector<mx::array> inputs = {scaled};
  inputs.push_back(per_row(mx::reshape(uniform, {scaled.shape(0), 1}, stream), scaled, stream));
  return make(Kernel::Sample, std::move(inputs), stream);
}

}  // namespace

NB_MODULE(_ppo_native, m) {
  m.doc() = "Native CPU kernels for MLX (base_setup/native.py).";
  m.def(
      "swiglu",
      &swiglu,
      nb::arg("gate"),
      nb::arg("up"),
      nb::kw_only(),
      nb::arg("stream").none() = nb::none(),
      "silu(gate) * up, float32.");
  m.def(
      "swiglu_grad",
      &swiglu_grad,
      nb::arg("gate"),
      nb::arg("up"),
      nb::arg("cotangent"),
      nb::kw_only(),
      nb::arg("stream").none() = nb::none(),
      "(d_gate, d_up) of silu(gate) * up times the cotangent, float32.");
  m.def(
      "row_exp",
      &row_exp_max,
      nb::arg("scores"),
      nb::kw_only(),
      nb::arg("stream").none() = nb::none(),
      "(exp(scores - row max), row max) along the last axis, float32.");
  m.def(
      "attention_scores_grad",
      &attention_scores_grad,
      nb::arg("e"),
      nb::arg("w"),
      nb::arg("inv_total"),
      nb::arg("seen"),
      nb::kw_only(),
      nb::arg("stream").none() = nb::none(),
      "e * (w - rowsum(e * w) * inv_total) * seen along the last axis, float32.");
  m.def(
      "rms_norm",
      &rms_norm_forward,
      nb::arg("x"),
      nb::arg("weight"),
      nb::arg("eps"),
      nb::kw_only(),
      nb::arg("stream").none() = nb::none(),
      "x / sqrt(mean(x^2, -1) + eps) * weight, float32, differentiated as mx.fast.rms_norm.");
  m.def(
      "softmax_block",
      &softmax_block_of,
      nb::arg("x"),
      nb::arg("m"),
      nb::kw_only(),
      nb::arg("with_e") = false,
      nb::arg("with_ex") = false,
      nb::arg("stream").none() = nb::none(),
      "One block of the LM head's online softmax: (new max, exp reference, rowsum(e), "
      "rowsum(e * x)[, e[, e * x]]) with e = exp(x - reference), float32, (N, 1) each.");
  m.def(
      "sample",
      &sample,
      nb::arg("scaled"),
      nb::arg("uniform"),
      nb::kw_only(),
      nb::arg("stream").none() = nb::none(),
      "(tokens int32, log-probs, entropy), (B,) each: one draw per row by inverse CDF from the "
      "softmax of the (B, V) scaled logits, with (B, 1) uniform numbers.");
  m.def(
      "rope",
      &rope,
      nb::arg("x"),
      nb::arg("offsets"),
      nb::arg("inv_freq"),
      nb::kw_only(),
      nb::arg("scale") = 1.0f,
      nb::arg("stream").none() = nb::none(),
      "Non-traditional RoPE of float32 x (..., L, D), in any layout: position float(offsets[b] + "
      "l) * scale (b: x's first axis; one offset or one per b, int32), the first 2 * "
      "len(inv_freq) features rotated as two halves by position * inv_freq, as mx.fast.rope; "
      "differentiable in x.");
  m.def(
      "few_row_matmul",
      &few_row_matmul_of,
      nb::arg("x"),
      nb::arg("weight"),
      nb::kw_only(),
      nb::arg("stream").none() = nb::none(),
      "x @ weight.T for float32 x (..., K) in any layout and weight (N, K): each output an fma "
      "chain over k in order (the same bits on every instruction set and thread count), for "
      "the few rows of a decoding step; differentiable (the gradients: MLX's matmuls).");
  m.attr("few_row_isa") = kFewRowIsa;
  m.def(
      "one_query_attention",
      &one_query_attention_of,
      nb::arg("q"),
      nb::arg("keys"),
      nb::arg("values"),
      nb::arg("mask").none(),
      nb::kw_only(),
      nb::arg("scale"),
      nb::arg("stream").none() = nb::none(),
      "softmax(q k^T * scale + mask) v for a decoding step's grouped queries, float32: q (B, G, "
      "R, D), keys (B, G, S, D), values (B, G, S, Dv), mask None, boolean (True: attend) or "
      "additive, of 4 axes each 1 or full; (B, G, R, Dv). Not differentiable.");
  m.def(
      "set_threads",
      [](int threads) { pool().set_threads(threads); },
      nb::arg("threads"),
      "The threads element-wise kernels split their work over (1: the calling thread only).");
  m.def("threads", [] { return pool().threads(); });
}
