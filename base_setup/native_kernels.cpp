// Native CPU kernels for MLX: the element-wise work of a transformer layer (SwiGLU and the
// attention's softmax), vectorised by the compiler and split over the run's threads, as MLX
// custom primitives. base_setup/native.py builds this file once per machine and documents why.
//
// Every kernel computes, element by element, exactly the float32 arithmetic of the fast
// functions in base_setup/fast_math.py (the same operations in the same order; built with
// -ffp-contract=off so that no multiply-add is fused), so their results are the same bits. Only
// the loops differ: one pass instead of several, and the elements split over threads. A row
// kernel (a maximum or a sum along the last axis) gives each row to one thread and adds in the
// row's order, so no result depends on the thread count.

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
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

#include <nanobind/nanobind.h>
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

// ------------------------------------------------------------------ the kernels

// silu(g) * u = g * u / (1 + exp(-g)) (fast_math._swiglu_c).
void swiglu_forward(const float* g, const float* u, float* out, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float y = exp2_exponent(-g[i]);
    out[i] = g[i] * u[i] / (1.0f + exp2_fraction(y) * exp2_bits(y));
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
    float y = exp2_exponent(-g[i]);
    float sig = 1.0f / (1.0f + exp2_fraction(y) * exp2_bits(y));
    d_gate[i] = c[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
    d_up[i] = c[i] * g[i] * sig;
  }
}

// Rows of `width` scores: e = exp(x - max) and the max (fast_math._exp_shifted after mx.max;
// NaN propagates into the max as MLX's does).
void row_exp(const float* x, float* e, float* row_max, size_t width, size_t begin, size_t end) {
  for (size_t r = begin; r < end; ++r) {
    const float* xr = x + r * width;
    float* er = e + r * width;
    float m = xr[0];
    for (size_t j = 1; j < width; ++j) {
      float v = xr[j];
      m = (v > m || v != v) ? v : m;
    }
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

// ------------------------------------------------------------------ MLX primitives

enum class Kernel { SwiGLU, SwiGLUGrad, RowExp, ScoresGrad, RMSNorm };

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
  }
  return "Native";
}

// One primitive class for the kernels: float32, row-contiguous inputs (the functions below make
// them so), outputs allocated here. Only RMSNorm has a vjp: base_setup.fast_math calls the others
// inside mx.custom_function's whose gradients are written out.
class NativePrimitive : public mx::Primitive {
 public:
  NativePrimitive(mx::Stream stream, Kernel kernel, float eps = 0.0f)
      : mx::Primitive(stream), kernel_(kernel), eps_(eps) {}

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
    std::vector<const float*> in;
    for (auto& a : inputs) {
      in.push_back(a.data<float>());
    }
    std::vector<float*> out;
    for (auto& a : outputs) {
      out.push_back(a.data<float>());
    }
    size_t size = inputs[0].size();
    size_t width = inputs[0].ndim() ? size_t(inputs[0].shape(-1)) : 1;
    Kernel kernel = kernel_;
    float eps = eps_;
    encoder.dispatch([kernel, eps, in, out, size, width]() {
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
      }
    });
  }

  // RMSNorm: MLX's own gradient of mx.fast.rms_norm, so that a model's backward pass meets the
  // same graph as with MLX's function (the other kernels are differentiated in fast_math).
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override {
    if (kernel_ != Kernel::RMSNorm) {
      return mx::Primitive::vjp(primals, cotangents, argnums, outputs);
    }
    float eps = eps_;
    mx::Stream s = stream();
    auto norm = [eps, s](const std::vector<mx::array>& in) {
      return std::vector<mx::array>{mx::fast::rms_norm(in[0], in[1], eps, s)};
    };
    auto grads = mx::vjp(norm, primals, cotangents).second;
    std::vector<mx::array> out;
    for (int i : argnums) {
      out.push_back(grads[i]);
    }
    return out;
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

  const char* name() const override {
    return kernel_name(kernel_);
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* native = dynamic_cast<const NativePrimitive*>(&other);
    return native != nullptr && native->kernel_ == kernel_ && native->eps_ == eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    switch (kernel_) {
      case Kernel::SwiGLUGrad:
        return {inputs[0].shape(), inputs[0].shape()};
      case Kernel::RowExp: {
        mx::Shape rows = inputs[0].shape();
        rows.back() = 1;
        return {inputs[0].shape(), rows};
      }
      default:
        return {inputs[0].shape()};
    }
  }

 private:
  Kernel kernel_;
  float eps_;
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

std::vector<mx::array> contiguous(const std::vector<mx::array>& arrays, mx::Stream stream) {
  std::vector<mx::array> out;
  for (auto& a : arrays) {
    out.push_back(mx::contiguous(a, false, stream));
  }
  return out;
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
    float eps = 0.0f) {
  auto primitive = std::make_shared<NativePrimitive>(stream, kernel, eps);
  auto shapes = primitive->output_shapes(inputs);
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return mx::array::make_arrays(std::move(shapes), dtypes, primitive, std::move(inputs));
}

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  check_float32({gate, up}, "swiglu");
  check_same_shape({gate, up}, "swiglu");
  auto stream = cpu_stream(s);
  return make(Kernel::SwiGLU, contiguous({gate, up}, stream), stream)[0];
}

std::vector<mx::array> swiglu_grad(
    const mx::array& gate,
    const mx::array& up,
    const mx::array& cotangent,
    mx::StreamOrDevice s) {
  check_float32({gate, up, cotangent}, "swiglu_grad");
  check_same_shape({gate, up, cotangent}, "swiglu_grad");
  auto stream = cpu_stream(s);
  return make(Kernel::SwiGLUGrad, contiguous({gate, up, cotangent}, stream), stream);
}

std::vector<mx::array> row_exp_max(const mx::array& scores, mx::StreamOrDevice s) {
  check_float32({scores}, "row_exp");
  if (scores.ndim() == 0 || scores.shape(-1) == 0) {
    throw std::invalid_argument("row_exp takes rows of at least one score");
  }
  auto stream = cpu_stream(s);
  return make(Kernel::RowExp, contiguous({scores}, stream), stream);
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
  std::vector<mx::array> inputs = contiguous({e, w}, stream);
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
  return make(Kernel::RMSNorm, contiguous({x, weight}, stream), stream, eps)[0];
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
      "set_threads",
      [](int threads) { pool().set_threads(threads); },
      nb::arg("threads"),
      "The threads element-wise kernels split their work over (1: the calling thread only).");
  m.def("threads", [] { return pool().threads(); });
}
