// aot2onnx's fused training kernels: ONNX Runtime custom ops (domain "aot2onnx.fused") that run ATen's own
// CPU kernels on ONNX Runtime's buffers. An op that the standard lowering spells as a chain of ONNX nodes (a
// ReLU gradient as LessOrEqual, Where; a softmax gradient as Mul, ReduceSum, Sub, Mul; a layer norm's as two
// dozen; a softmax as five) becomes one node here, and its values are eager's bit for bit, since eager runs the
// same kernel, on the same number of threads (ATen's parallel_for, torch.get_num_threads()). Where is ATen's
// select in place of ONNX Runtime's much slower one.
//
// Built by `python -m aot2onnx kernels build` at set-up (make demo / make test) against ONNX Runtime's C
// and C++ API headers (fetched by package name and checksum, see fused.py) and torch's headers and libraries.
// The library calls ATen, so it is loaded only into processes that have torch: the compile backend's
// sessions. Exported artifacts never use these ops.

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/_log_softmax_backward_data.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/_softmax_backward_data.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/embedding_dense_backward.h>
#include <ATen/ops/from_blob.h>
#include <ATen/native/Pool.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/max_pool2d_with_indices.h>
#include <ATen/ops/max_pool3d_with_indices.h>
#include <ATen/ops/hardswish_backward.h>
#include <ATen/ops/hardswish.h>
#include <ATen/ops/hardsigmoid.h>
#include <ATen/ops/hardsigmoid_backward.h>
#include <ATen/ops/hardtanh_backward.h>
#include <ATen/ops/_native_batch_norm_legit.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/native_group_norm_backward.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <ATen/ops/_log_softmax.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/all.h>
#include <ATen/ops/eq.h>
#include <ATen/ops/masked_fill.h>
#include <ATen/WrapDimUtils.h>
#include <ATen/ops/where.h>
#include <ATen/ExpandUtils.h>
#include <ATen/ops/native_layer_norm.h>
#include <ATen/ops/sigmoid_backward.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/tanh_backward.h>
#include <ATen/ops/threshold_backward.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>

#include <array>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <type_traits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr const char* kDomain = "aot2onnx.fused";

at::ScalarType ScalarTypeOf(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      return at::kFloat;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      return at::kDouble;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      return at::kHalf;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return at::kBFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:  // indices
      return at::kLong;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
      return at::kInt;
    default:
      throw std::runtime_error("aot2onnx fused op: only float32, float64, float16, bfloat16, int64 and int32 tensors");
  }
}

// `value` as an ATen tensor on the same memory (contiguous: ONNX tensors have no strides), of its own element
// type or of `as` (read as other elements of the same size).
at::Tensor View(const Ort::ConstValue& value, std::optional<at::ScalarType> as = std::nullopt) {
  auto info = value.GetTensorTypeAndShapeInfo();
  return at::from_blob(const_cast<void*>(value.GetTensorRawData()), info.GetShape(),
                       at::TensorOptions().dtype(as ? *as : ScalarTypeOf(info.GetElementType())));
}

// ONNX Runtime's input `index` as an ATen tensor (View); nullopt for an optional input that is absent.
std::optional<at::Tensor> Input(Ort::KernelContext& ctx, size_t index) {
  if (index >= ctx.GetInputCount()) return std::nullopt;
  Ort::ConstValue value = ctx.GetInput(index);
  if (!value) return std::nullopt;
  return View(value);
}

at::Tensor Required(Ort::KernelContext& ctx, size_t index) {
  auto tensor = Input(ctx, index);
  if (!tensor) throw std::runtime_error("aot2onnx fused op: a required input is missing");
  return *tensor;
}

// ONNX Runtime's output `index`, allocated in `sizes` and the dtype of `options`, as an ATen tensor.
at::Tensor Output(Ort::KernelContext& ctx, size_t index, at::IntArrayRef sizes, const at::TensorOptions& options) {
  std::vector<int64_t> shape(sizes.begin(), sizes.end());
  Ort::UnownedValue value = ctx.GetOutput(index, shape);
  return at::from_blob(value.GetTensorMutableRawData(), sizes, options);
}

// ONNX Runtime's output `index`, allocated in the shape and dtype of `like`, as an ATen tensor.
at::Tensor Output(Ort::KernelContext& ctx, size_t index, const at::Tensor& like) {
  return Output(ctx, index, like.sizes(), like.options());
}

// A Python float passed exactly: float attributes are float32 in ONNX, so the graph carries float.hex().
double ExactFloat(const Ort::ConstKernelInfo& info, const char* name) {
  std::string text = info.GetAttribute<std::string>(name);
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str()) throw std::runtime_error("aot2onnx fused op: bad float attribute " + text);
  return value;
}

OrtStatusPtr Failure(const char* what) { return Ort::GetApi().CreateStatus(ORT_RUNTIME_EXCEPTION, what); }

// Sets output `index`'s inferred type and shape. Not the C++ API's ShapeInferContext::SetOutputShape: it writes a
// symbolic dimension's size as -2, which ONNX Runtime 1.32's SetDimensions refuses ("dim_values must be -1 or
// larger"), a failure ONNX Runtime then ignores, leaving the output without a shape.
OrtStatusPtr SetOutput(OrtShapeInferContext* context, size_t index, const Ort::ShapeInferContext::Shape& shape,
                       ONNXTensorElementDataType type) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatusPtr status = api.CreateTensorTypeAndShapeInfo(&info)) return status;
  std::unique_ptr<OrtTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo*)> owned(
      info, api.ReleaseTensorTypeAndShapeInfo);
  std::vector<int64_t> sizes;
  std::vector<const char*> symbols;
  for (const auto& dim : shape) {
    sizes.push_back(dim.IsInt() ? dim.AsInt() : -1);
    symbols.push_back(dim.IsInt() ? "" : dim.AsSym());
  }
  if (OrtStatusPtr status = api.SetTensorElementType(info, type)) return status;
  if (OrtStatusPtr status = api.SetDimensions(info, sizes.data(), sizes.size())) return status;
  if (OrtStatusPtr status = api.SetSymbolicDimensions(info, symbols.data(), symbols.size())) return status;
  return api.ShapeInferContext_SetOutputTypeShape(context, index, info);
}

// Input `index`'s element type, in a shape inference.
ONNXTensorElementDataType InputType(OrtShapeInferContext* context, size_t index) {
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  Ort::ThrowOnError(Ort::GetApi().ShapeInferContext_GetInputTypeShape(context, index, &info));
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  Ort::ThrowOnError(Ort::GetApi().GetTensorElementType(info, &type));
  return type;
}

// A dimension for an inferred output shape: `dim` where ONNX Runtime knows it (a size or a symbol), else a
// symbol of its own (ONNX Runtime writes an unknown size as -1, which it would take for a size).
Ort::ShapeInferContext::SymbolicInteger Known(const Ort::ShapeInferContext::SymbolicInteger& dim) {
  if (!dim.IsInt() || dim.AsInt() >= 0) return dim;
  // The symbol's text must outlive the inference (SymbolicInteger keeps a pointer): kept for the process.
  static std::mutex lock;
  static std::deque<std::string> names;
  std::lock_guard<std::mutex> guard(lock);
  names.push_back("aot2onnx_fused_" + std::to_string(names.size()));
  return Ort::ShapeInferContext::SymbolicInteger(names.back().c_str());
}

// A size inference cannot tell: a symbol of its own.
Ort::ShapeInferContext::SymbolicInteger Unknown() { return Known(Ort::ShapeInferContext::SymbolicInteger(int64_t{-1})); }

// A kernel whose exceptions (ATen's checks, ONNX Runtime's) come back to ONNX Runtime as a failed status.
template <typename Kernel>
struct Guarded : Kernel {
  using Kernel::Kernel;
  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      // No autograd (the tensors are ONNX Runtime's buffers) and no profiler records: the op is ONNX Runtime's
      // node, timed by ONNX Runtime's profiler, not compute torch ran (aot2onnx.testing's check of that). The
      // records are turned off only where a callback would take them: turning them off and on rebuilds the
      // thread's callback lists, about a fifth of a small ATen-backed node's cost.
      c10::InferenceMode inference_mode;
      std::optional<at::RecordFunctionGuard> no_records;
      if (at::hasCallbacks()) no_records.emplace(false);
      this->Compute(context);
      return nullptr;
    } catch (const std::exception& e) {
      return Failure(e.what());
    }
  }
};

// Every op: its inputs and outputs are declared of any type (ATen dispatches on the dtype; Input() takes the float
// types, and int64 and int32 for indices), and output i has the type and shape of input kLike[i], unless the op
// infers its outputs itself (a static InferOutputs, and kOutputs for their number).
template <typename Op, typename Kernel>
struct FusedOp : Ort::CustomOpBase<Op, Guarded<Kernel>, true> {
  FusedOp() {
    if constexpr (requires { &Op::InferOutputs; }) {
      OrtCustomOp::InferOutputShapeFn = &InferGuarded;
    } else {
      OrtCustomOp::InferOutputShapeFn = &InferLikeInputs;
    }
  }

  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new Guarded<Kernel>(Ort::ConstKernelInfo(info));
      return nullptr;
    } catch (const std::exception& e) {
      return Failure(e.what());
    }
  }
  const char* GetName() const { return Op::kName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return Op::kInputs; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    if constexpr (requires { Op::kVariadic; }) return INPUT_OUTPUT_VARIADIC;  // one or more, of one type
    return index < Op::kRequired ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const {
    if constexpr (requires { Op::kOutputs; }) {
      return Op::kOutputs;
    } else {
      return Op::kLike.size();
    }
  }
  // Undefined: the inputs' type, as ONNX Runtime ties an output of undefined type to its dynamically typed input
  // (shape inference sets shapes only); an op declares an output of another type in kOutputTypes.
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    if constexpr (requires { Op::kOutputTypes; }) return Op::kOutputTypes[index];
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    if constexpr (requires { Op::kVariadic; }) return INPUT_OUTPUT_VARIADIC;
    if constexpr (requires { Op::kOutputsOptional; }) return INPUT_OUTPUT_OPTIONAL;  // the node says which
    return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }

  // The op's own InferOutputs(ctx, context), its exceptions returned as a failed status.
  static OrtStatusPtr InferGuarded(const OrtCustomOp*, OrtShapeInferContext* context) {
    try {
      Ort::ShapeInferContext ctx(&Ort::GetApi(), context);
      return Op::InferOutputs(ctx, context);
    } catch (const std::exception& e) {
      return Failure(e.what());
    }
  }

  static OrtStatusPtr InferLikeInputs(const OrtCustomOp*, OrtShapeInferContext* ctx) {
    const OrtApi& api = Ort::GetApi();
    size_t inputs = 0;
    if (OrtStatusPtr status = api.ShapeInferContext_GetInputCount(ctx, &inputs)) return status;
    for (size_t i = 0; i < Op::kLike.size(); ++i) {
      size_t like = Op::kLike[i];
      if (like >= inputs) continue;
      OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
      if (OrtStatusPtr status = api.ShapeInferContext_GetInputTypeShape(ctx, like, &info)) return status;
      if (OrtStatusPtr status = api.ShapeInferContext_SetOutputTypeShape(ctx, i, info)) return status;
    }
    return nullptr;
  }
};

// --- elementwise gradients: (grad_output, self or output) -> grad_input -------------------------------------

struct ThresholdBackwardKernel {
  explicit ThresholdBackwardKernel(const Ort::ConstKernelInfo& info) : threshold_(ExactFloat(info, "threshold")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), self = Required(ctx, 1), out = Output(ctx, 0, grad);
    at::threshold_backward_out(out, grad, self, threshold_);
  }
  double threshold_;
};
struct ThresholdBackward : FusedOp<ThresholdBackward, ThresholdBackwardKernel> {
  static constexpr const char* kName = "ThresholdBackward";
  static constexpr size_t kInputs = 2, kRequired = 2;
  static constexpr std::array<size_t, 1> kLike{0};
};

// relu6's and hardtanh's gradient: zero at and outside [min_val, max_val], the gradient inside and at NaN.
struct HardtanhBackwardKernel {
  explicit HardtanhBackwardKernel(const Ort::ConstKernelInfo& info)
      : min_(ExactFloat(info, "min_val")), max_(ExactFloat(info, "max_val")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), self = Required(ctx, 1), out = Output(ctx, 0, grad);
    at::hardtanh_backward_out(out, grad, self, min_, max_);
  }
  double min_, max_;
};
struct HardtanhBackward : FusedOp<HardtanhBackward, HardtanhBackwardKernel> {
  static constexpr const char* kName = "HardtanhBackward";
  static constexpr size_t kInputs = 2, kRequired = 2;
  static constexpr std::array<size_t, 1> kLike{0};
};

struct GeluBackwardKernel {
  explicit GeluBackwardKernel(const Ort::ConstKernelInfo& info)
      : approximate_(info.GetAttribute<std::string>("approximate")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), self = Required(ctx, 1), out = Output(ctx, 0, grad);
    at::gelu_backward_out(out, grad, self, approximate_);
  }
  std::string approximate_;
};
struct GeluBackward : FusedOp<GeluBackward, GeluBackwardKernel> {
  static constexpr const char* kName = "GeluBackward";
  static constexpr size_t kInputs = 2, kRequired = 2;
  static constexpr std::array<size_t, 1> kLike{0};
};

// The gradients ATen spells (grad_output, x) -> grad_input with no arguments of their own.
template <at::Tensor& (*Fn)(at::Tensor&, const at::Tensor&, const at::Tensor&)>
struct BinaryGradientKernel {
  explicit BinaryGradientKernel(const Ort::ConstKernelInfo&) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), x = Required(ctx, 1), out = Output(ctx, 0, grad);
    Fn(out, grad, x);
  }
};
#define AOT2ONNX_BINARY_GRADIENT(Name, fn)                                                \
  struct Name : FusedOp<Name, BinaryGradientKernel<&fn>> {                              \
    static constexpr const char* kName = #Name;                                         \
    static constexpr size_t kInputs = 2, kRequired = 2;                                 \
    static constexpr std::array<size_t, 1> kLike{0};                                    \
  };
AOT2ONNX_BINARY_GRADIENT(HardswishBackward, at::hardswish_backward_out)
AOT2ONNX_BINARY_GRADIENT(SiluBackward, at::silu_backward_out)
AOT2ONNX_BINARY_GRADIENT(TanhBackward, at::tanh_backward_out)
AOT2ONNX_BINARY_GRADIENT(SigmoidBackward, at::sigmoid_backward_out)
AOT2ONNX_BINARY_GRADIENT(HardsigmoidBackward, at::hardsigmoid_backward_out)
#undef AOT2ONNX_BINARY_GRADIENT

// --- activations the standard lowering spells as several nodes (hardswish: Add, Clip, Div, Mul; GELU: five) ------

template <at::Tensor& (*Fn)(at::Tensor&, const at::Tensor&)>
struct UnaryKernel {
  explicit UnaryKernel(const Ort::ConstKernelInfo&) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor x = Required(ctx, 0), out = Output(ctx, 0, x);
    Fn(out, x);
  }
};
#define AOT2ONNX_UNARY(Name, fn)                          \
  struct Name : FusedOp<Name, UnaryKernel<&fn>> {         \
    static constexpr const char* kName = #Name;           \
    static constexpr size_t kInputs = 1, kRequired = 1;   \
    static constexpr std::array<size_t, 1> kLike{0};      \
  };
AOT2ONNX_UNARY(Hardswish, at::hardswish_out)
AOT2ONNX_UNARY(Hardsigmoid, at::hardsigmoid_out)
#undef AOT2ONNX_UNARY

struct GeluKernel {
  explicit GeluKernel(const Ort::ConstKernelInfo& info) : approximate_(info.GetAttribute<std::string>("approximate")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor x = Required(ctx, 0), out = Output(ctx, 0, x);
    at::gelu_out(out, x, approximate_);
  }
  std::string approximate_;
};
struct Gelu : FusedOp<Gelu, GeluKernel> {  // GELU (erf or tanh), which the standard lowering spells as five nodes
  static constexpr const char* kName = "Gelu";
  static constexpr size_t kInputs = 1, kRequired = 1;
  static constexpr std::array<size_t, 1> kLike{0};
};

// --- softmax and log-softmax gradients: (grad_output, output) -> grad_input, along `dim` ----------------------

template <bool kLog>
struct SoftmaxBackwardKernel {
  explicit SoftmaxBackwardKernel(const Ort::ConstKernelInfo& info) : dim_(info.GetAttribute<int64_t>("dim")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), output = Required(ctx, 1), out = Output(ctx, 0, grad);
    // The lowering fuses only where the forward's input had the gradient's dtype.
    if (kLog) {
      at::_log_softmax_backward_data_out(out, grad, output, dim_, grad.scalar_type());
    } else {
      at::_softmax_backward_data_out(out, grad, output, dim_, grad.scalar_type());
    }
  }
  int64_t dim_;
};
struct SoftmaxBackward : FusedOp<SoftmaxBackward, SoftmaxBackwardKernel<false>> {
  static constexpr const char* kName = "SoftmaxBackward";
  static constexpr size_t kInputs = 2, kRequired = 2;
  static constexpr std::array<size_t, 1> kLike{0};
};
struct LogSoftmaxBackward : FusedOp<LogSoftmaxBackward, SoftmaxBackwardKernel<true>> {
  static constexpr const char* kName = "LogSoftmaxBackward";
  static constexpr size_t kInputs = 2, kRequired = 2;
  static constexpr std::array<size_t, 1> kLike{0};
};

// --- layer norm: (grad_out, input, mean, rstd, weight?, bias?) -> (grad_input, grad_weight, grad_bias) ------

struct LayerNormBackwardKernel {
  explicit LayerNormBackwardKernel(const Ort::ConstKernelInfo& info)
      : normalized_shape_(info.GetAttributes<int64_t>("normalized_shape")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), input = Required(ctx, 1), mean = Required(ctx, 2), rstd = Required(ctx, 3);
    std::optional<at::Tensor> weight = Input(ctx, 4), bias = Input(ctx, 5);
    // Every output is computed (ONNX Runtime allocates each one the graph declares); the lowering declares
    // the weight's and the bias's only where they exist.
    std::array<bool, 3> mask{true, weight.has_value(), bias.has_value()};
    at::Tensor grad_input = Output(ctx, 0, input);
    c10::optional<at::Tensor> w = weight ? c10::optional<at::Tensor>(*weight) : c10::nullopt;
    c10::optional<at::Tensor> b = bias ? c10::optional<at::Tensor>(*bias) : c10::nullopt;
    if (weight && bias) {
      at::Tensor grad_weight = Output(ctx, 1, *weight), grad_bias = Output(ctx, 2, *bias);
      at::native_layer_norm_backward_out(grad_input, grad_weight, grad_bias, grad, input, normalized_shape_, mean, rstd,
                                         w, b, mask);
      return;
    }
    // The out= variant takes no tensor for a gradient it is not asked for: the functional one, copied out.
    auto [gi, gw, gb] = at::native_layer_norm_backward(grad, input, normalized_shape_, mean, rstd, w, b, mask);
    grad_input.copy_(gi);
    if (weight) Output(ctx, 1, *weight).copy_(gw);
  }
  std::vector<int64_t> normalized_shape_;
};
struct LayerNormBackward : FusedOp<LayerNormBackward, LayerNormBackwardKernel> {
  static constexpr const char* kName = "LayerNormBackward";
  static constexpr size_t kInputs = 6, kRequired = 4;
  static constexpr std::array<size_t, 3> kLike{1, 4, 5};
};

// --- batch norm in training: (input, running_mean, running_var, weight?, bias?) ->
//     (output, save_mean, save_invstd, new running_mean, new running_var) --------------------------------------

struct BatchNormTrainingKernel {
  explicit BatchNormTrainingKernel(const Ort::ConstKernelInfo& info)
      : momentum_(ExactFloat(info, "momentum")), eps_(ExactFloat(info, "eps")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor input = Required(ctx, 0), running_mean = Required(ctx, 1), running_var = Required(ctx, 2);
    std::optional<at::Tensor> weight = Input(ctx, 3), bias = Input(ctx, 4);
    at::Tensor out = Output(ctx, 0, input), save_mean = Output(ctx, 1, running_mean),
               save_invstd = Output(ctx, 2, running_mean), new_mean = Output(ctx, 3, running_mean),
               new_var = Output(ctx, 4, running_var);
    // The graph is functional: the running statistics are updated on copies, which are the new values,
    // by ATen's kernel as eager updates the module's buffers.
    new_mean.copy_(running_mean);
    new_var.copy_(running_var);
    at::_native_batch_norm_legit_out(out, save_mean, save_invstd, input, weight, bias, new_mean, new_var, true,
                                     momentum_, eps_);
  }
  double momentum_, eps_;
};
struct BatchNormTraining : FusedOp<BatchNormTraining, BatchNormTrainingKernel> {
  static constexpr const char* kName = "BatchNormTraining";
  static constexpr size_t kInputs = 5, kRequired = 3;
  static constexpr std::array<size_t, 5> kLike{0, 1, 1, 1, 2};
};

// --- batch norm's backward: (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?) ->
//     (grad_input, grad_weight, grad_bias); the last two only with a weight ---------------------------------------

struct BatchNormBackwardKernel {
  explicit BatchNormBackwardKernel(const Ort::ConstKernelInfo& info)
      : train_(info.GetAttribute<int64_t>("train") != 0), eps_(ExactFloat(info, "eps")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), input = Required(ctx, 1);
    std::optional<at::Tensor> weight = Input(ctx, 2), running_mean = Input(ctx, 3), running_var = Input(ctx, 4),
                              save_mean = Input(ctx, 5), save_invstd = Input(ctx, 6);
    at::Tensor grad_input = Output(ctx, 0, input);
    if (weight) {
      at::Tensor grad_weight = Output(ctx, 1, *weight), grad_bias = Output(ctx, 2, *weight);
      at::native_batch_norm_backward_out(grad_input, grad_weight, grad_bias, grad, input, weight, running_mean,
                                         running_var, save_mean, save_invstd, train_, eps_, {true, true, true});
      return;
    }
    auto [gi, gw, gb] = at::native_batch_norm_backward(grad, input, weight, running_mean, running_var, save_mean,
                                                       save_invstd, train_, eps_, {true, false, false});
    grad_input.copy_(gi);
  }
  bool train_;
  double eps_;
};
struct BatchNormBackward : FusedOp<BatchNormBackward, BatchNormBackwardKernel> {
  static constexpr const char* kName = "BatchNormBackward";
  static constexpr size_t kInputs = 7, kRequired = 2;
  static constexpr std::array<size_t, 3> kLike{1, 2, 2};
};

// --- group norm's backward: (grad_out, input, mean, rstd, weight?) -> (grad_input, grad_weight, grad_bias); the
//     last two only with a weight ------------------------------------------------------------------------------

struct GroupNormBackwardKernel {
  explicit GroupNormBackwardKernel(const Ort::ConstKernelInfo& info)
      : n_(info.GetAttribute<int64_t>("N")), c_(info.GetAttribute<int64_t>("C")),
        hxw_(info.GetAttribute<int64_t>("HxW")), group_(info.GetAttribute<int64_t>("group")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), input = Required(ctx, 1), mean = Required(ctx, 2), rstd = Required(ctx, 3);
    std::optional<at::Tensor> weight = Input(ctx, 4);
    at::Tensor grad_input = Output(ctx, 0, input);
    if (weight) {
      at::Tensor grad_weight = Output(ctx, 1, *weight), grad_bias = Output(ctx, 2, *weight);
      at::native_group_norm_backward_out(grad_input, grad_weight, grad_bias, grad, input, mean, rstd, weight, n_, c_,
                                         hxw_, group_, {true, true, true});
      return;
    }
    auto [gi, gw, gb] = at::native_group_norm_backward(grad, input, mean, rstd, weight, n_, c_, hxw_, group_,
                                                       {true, false, false});
    grad_input.copy_(gi);
  }
  int64_t n_, c_, hxw_, group_;
};
struct GroupNormBackward : FusedOp<GroupNormBackward, GroupNormBackwardKernel> {
  static constexpr const char* kName = "GroupNormBackward";
  static constexpr size_t kInputs = 5, kRequired = 4;
  static constexpr std::array<size_t, 3> kLike{1, 4, 4};
};

// --- an embedding's gradient: (grad_output, indices) -> grad_weight [num_weights, grad_output.size(-1)] -------
// ONNX Runtime's ScatterND with reduction="add" races on its CPU provider's threads (onnxruntime#18048), so the
// standard lowering runs its graph on one thread; ATen's kernel splits the rows of the weight among its threads
// (each thread walks every index, in order, and adds to its own rows only): eager's bits on any number.

struct EmbeddingDenseBackwardKernel {
  explicit EmbeddingDenseBackwardKernel(const Ort::ConstKernelInfo& info)
      : num_weights_(info.GetAttribute<int64_t>("num_weights")),
        padding_idx_(info.GetAttribute<int64_t>("padding_idx")),
        scale_grad_by_freq_(info.GetAttribute<int64_t>("scale_grad_by_freq") != 0) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), indices = Required(ctx, 1);
    if (grad.dim() != indices.dim() + 1) {
      throw std::runtime_error("aot2onnx fused EmbeddingDenseBackward: grad_output must have one dimension more "
                               "than indices");
    }
    // ATen has no out= kernel for the op: its out variant computes the functional one and copies it.
    at::Tensor out = Output(ctx, 0, {num_weights_, grad.size(-1)}, grad.options());
    at::embedding_dense_backward_out(out, grad, indices, num_weights_, padding_idx_, scale_grad_by_freq_);
  }
  int64_t num_weights_, padding_idx_;
  bool scale_grad_by_freq_;
};
struct EmbeddingDenseBackward : FusedOp<EmbeddingDenseBackward, EmbeddingDenseBackwardKernel> {
  static constexpr const char* kName = "EmbeddingDenseBackward";
  static constexpr size_t kInputs = 2, kRequired = 2, kOutputs = 1;

  // The output: grad_output's type, in [num_weights, grad_output's last dimension].
  static OrtStatusPtr InferOutputs(Ort::ShapeInferContext& ctx, OrtShapeInferContext* context) {
    const ONNXTensorElementDataType type = InputType(context, 0);
    const auto& shape = ctx.GetInputShape(0);
    if (shape.empty()) throw std::runtime_error("aot2onnx fused EmbeddingDenseBackward: a 0-d grad_output");
    return SetOutput(context, 0, {ctx.GetAttrInt("num_weights"), Known(shape.back())}, type);
  }
};


// --- forward ops the standard lowering spells out: ATen's kernel, one node ----------------------------------

// _softmax / _log_softmax(x, dim) in x's dtype (the lowering fuses no half_to_float call).
template <bool kLog>
struct SoftmaxKernel {
  explicit SoftmaxKernel(const Ort::ConstKernelInfo& info) : dim_(info.GetAttribute<int64_t>("dim")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor x = Required(ctx, 0), out = Output(ctx, 0, x);
    if (kLog) {
      at::_log_softmax_out(out, x, dim_, false);
    } else {
      at::_softmax_out(out, x, dim_, false);
    }
  }
  int64_t dim_;
};
struct Softmax : FusedOp<Softmax, SoftmaxKernel<false>> {
  static constexpr const char* kName = "Softmax";
  static constexpr size_t kInputs = 1, kRequired = 1;
  static constexpr std::array<size_t, 1> kLike{0};
};
// _safe_softmax, scaled_dot_product_attention's softmax in its math formulation: the softmax, and 0 on the rows whose
// every input is -inf (ATen's where(all(x == -inf), 0, softmax(x)): the same values, a +0.0), where the standard
// lowering takes five ONNX nodes beside the softmax (Equal, Cast, ReduceMin, Cast, Where).
struct SafeSoftmaxKernel {
  explicit SafeSoftmaxKernel(const Ort::ConstKernelInfo& info) : dim_(info.GetAttribute<int64_t>("dim")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor x = Required(ctx, 0), out = Output(ctx, 0, x);
    at::_softmax_out(out, x, dim_, false);
    const int64_t dim = at::maybe_wrap_dim(dim_, x.dim());
    if (dim != x.dim() - 1) {
      out.masked_fill_(x.eq(-std::numeric_limits<double>::infinity()).all(dim, true), 0);
      return;
    }
    // Rows along the last axis, contiguous: a row's first value other than -inf ends its check (ATen's eq and
    // all over the whole tensor took 260 us on 8x4x64x64 where the softmax takes 90).
    const int64_t length = x.size(-1), rows = length == 0 ? 0 : x.numel() / length;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "aot2onnx_safe_softmax", [&] {
      const scalar_t* in = x.const_data_ptr<scalar_t>();
      scalar_t* values = out.mutable_data_ptr<scalar_t>();
      const float minus_inf = -std::numeric_limits<float>::infinity();
      at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const scalar_t* row = in + r * length;
          int64_t i = 0;
          while (i < length && static_cast<float>(row[i]) == minus_inf) ++i;
          if (i == length) std::fill(values + r * length, values + (r + 1) * length, scalar_t(0));
        }
      });
    });
  }
  int64_t dim_;
};
struct SafeSoftmax : FusedOp<SafeSoftmax, SafeSoftmaxKernel> {
  static constexpr const char* kName = "SafeSoftmax";
  static constexpr size_t kInputs = 1, kRequired = 1;
  static constexpr std::array<size_t, 1> kLike{0};
};
struct LogSoftmax : FusedOp<LogSoftmax, SoftmaxKernel<true>> {
  static constexpr const char* kName = "LogSoftmax";
  static constexpr size_t kInputs = 1, kRequired = 1;
  static constexpr std::array<size_t, 1> kLike{0};
};

// native_layer_norm(input, weight?, bias?) -> (output, mean, rstd): ATen's CPU kernel, its results copied into
// ONNX Runtime's outputs (libtorch exports no out= kernel of it, nor its dispatch stub's call); mean and rstd in
// the statistics' shape, the input's leading dimensions and a 1 per normalized one. float32 and float64, with a
// weight and bias of the same dtype.
struct LayerNormKernel {
  explicit LayerNormKernel(const Ort::ConstKernelInfo& info)
      : normalized_shape_(info.GetAttributes<int64_t>("normalized_shape")), eps_(ExactFloat(info, "eps")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor input = Required(ctx, 0);
    std::optional<at::Tensor> weight = Input(ctx, 1), bias = Input(ctx, 2);
    auto [y, mean, rstd] = at::native_layer_norm(input, normalized_shape_, weight, bias, eps_);
    Output(ctx, 0, y).copy_(y);
    Output(ctx, 1, mean).copy_(mean);
    Output(ctx, 2, rstd).copy_(rstd);
  }
  std::vector<int64_t> normalized_shape_;
  double eps_;
};

struct LayerNorm : FusedOp<LayerNorm, LayerNormKernel> {
  static constexpr const char* kName = "LayerNorm";
  static constexpr size_t kInputs = 3, kRequired = 1, kOutputs = 3;

  // output: the input's type and shape; mean and rstd: the input's type, its leading dimensions, then 1s.
  static OrtStatusPtr InferOutputs(Ort::ShapeInferContext& ctx, OrtShapeInferContext* context) {
    OrtTensorTypeAndShapeInfo* input = nullptr;  // owned by the context
    Ort::ThrowOnError(Ort::GetApi().ShapeInferContext_GetInputTypeShape(context, 0, &input));
    const ONNXTensorElementDataType type = InputType(context, 0);
    auto shape = ctx.GetInputShape(0);
    const size_t k = ctx.GetAttrInts("normalized_shape").size();
    if (k > shape.size()) throw std::runtime_error("aot2onnx fused LayerNorm: more normalized dimensions than the input's");
    Ort::ThrowOnError(Ort::GetApi().ShapeInferContext_SetOutputTypeShape(context, 0, input));
    Ort::ShapeInferContext::Shape stats;
    for (auto it = shape.begin(); it != shape.end() - k; ++it) stats.push_back(Known(*it));
    for (size_t i = 0; i < k; ++i) stats.emplace_back(int64_t{1});
    if (OrtStatusPtr status = SetOutput(context, 1, stats, type)) return status;
    return SetOutput(context, 2, stats, type);
  }
};

// ONNX's Where(condition, x, y) with broadcasting, as ATen's where on x's and y's bytes (an integer dtype of their
// element size): a choice of bytes, the same whatever the dtype, NaN payloads and signed zeros kept. ONNX
// Runtime's CPU Where took 7 ns an element on 65536 float32 elements (463 us; ATen's where 31 us).
at::ScalarType BytesOf(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
      return at::kChar;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16:
      return at::kShort;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32:
      return at::kInt;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_COMPLEX64:
      return at::kLong;
    default:
      throw std::runtime_error("aot2onnx fused Where or Transpose: no element type of 1, 2, 4 or 8 bytes");
  }
}

struct WhereKernel {
  explicit WhereKernel(const Ort::ConstKernelInfo&) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue condition = ctx.GetInput(0), x = ctx.GetInput(1), y = ctx.GetInput(2);
    const ONNXTensorElementDataType type = x.GetTensorTypeAndShapeInfo().GetElementType();
    if (condition.GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL ||
        y.GetTensorTypeAndShapeInfo().GetElementType() != type) {
      throw std::runtime_error("aot2onnx fused Where: a bool condition and two tensors of one type");
    }
    const at::ScalarType bytes = BytesOf(type);
    at::Tensor c = View(condition, at::kBool), a = View(x, bytes), b = View(y, bytes);
    const auto shape = at::infer_size_dimvector(at::infer_size_dimvector(c.sizes(), a.sizes()), b.sizes());
    at::Tensor out = Output(ctx, 0, shape, a.options());
    at::where_out(out, c, a, b);
  }
};
struct Where : FusedOp<Where, WhereKernel> {
  static constexpr const char* kName = "Where";
  static constexpr size_t kInputs = 3, kRequired = 3, kOutputs = 1;

  // x's type, in the three inputs' broadcast shape (a dimension unknown where no input fixes it).
  static OrtStatusPtr InferOutputs(Ort::ShapeInferContext& ctx, OrtShapeInferContext* context) {
    const ONNXTensorElementDataType type = InputType(context, 1);
    std::array<Ort::ShapeInferContext::Shape, 3> shapes{ctx.GetInputShape(0), ctx.GetInputShape(1),
                                                        ctx.GetInputShape(2)};
    size_t rank = 0;
    for (const auto& s : shapes) rank = std::max(rank, s.size());
    Ort::ShapeInferContext::Shape out;
    for (size_t d = 0; d < rank; ++d) {
      std::optional<Ort::ShapeInferContext::SymbolicInteger> dim;
      bool unknown = false;
      for (const auto& s : shapes) {
        if (d + s.size() < rank) continue;  // a missing leading dimension: broadcast
        const auto& v = s[d + s.size() - rank];
        if (v.IsInt() && v.AsInt() == 1) continue;
        if (v.IsInt() && v.AsInt() >= 0) {
          dim = v;  // a fixed size other than 1 decides
          break;
        }
        if (!dim) {
          dim = v;
        } else if (dim->IsInt() || v.IsInt() || std::string(dim->AsSym()) != v.AsSym()) {
          unknown = true;  // two different symbols: either may be 1
        }
      }
      if (!dim) {
        out.emplace_back(int64_t{1});
      } else if (unknown && !dim->IsInt()) {
        out.push_back(Unknown());  // two symbols: unknown
      } else {
        out.push_back(Known(*dim));
      }
    }
    return SetOutput(context, 0, out, type);
  }
};

// --- Elementwise: a chain of ONNX Add, Sub, Mul, Div and Neg (and tanh's guard) of one float type and shape, in one pass
// Hugging Face's GPT-2 GELU ("gelu_new", written out) is 13 such nodes in the forward graph and 15 in the
// backward, each a pass over memory in ONNX Runtime on one thread. The fused node runs them block by block, each
// instruction the same IEEE operation on the same operands in the same order as the node it replaces (the
// library is built with -ffp-contract=off: no multiply-add is contracted), so its values are those nodes' bit for
// bit. An operand is an input of the node's shape or of one element (a constant, broadcast), or an earlier
// instruction's result. Where both operands of an instruction are NaN, which payload comes out is the compiler's
// choice of operand order, as it is in ONNX Runtime's and ATen's kernels.
//
// Attributes: program, 3 ints an instruction (opcode, operand a, operand b; b is -1 for Neg), operands counted
// from the node's inputs on, then the instructions' results; results, the operand each output is.
//
// kKeepSmall is the float32 tanh lowering's guard, Where(GreaterOrEqual(Abs(a), 2^-12), b, a) with b = Tanh(a)
// (lower/ops/pointwise.py): b where |a| >= 2^-12, else a itself, the select of one operand's bits as the Where's
// (a NaN a is not >= and comes out as a, -0.0 as -0.0). Three passes over memory and a bool tensor in ONNX Runtime.

enum ElementwiseOp : int64_t { kAdd = 0, kSub = 1, kMul = 2, kDiv = 3, kNeg = 4, kKeepSmall = 5 };

struct ElementwiseKernel {
  explicit ElementwiseKernel(const Ort::ConstKernelInfo& info)
      : program_(info.GetAttributes<int64_t>("program")), outputs_(info.GetAttributes<int64_t>("results")) {
    if (program_.size() % 3 != 0) throw std::runtime_error("aot2onnx fused Elementwise: program of triples");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const size_t inputs = ctx.GetInputCount();
    const auto type = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetElementType();
    if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return Run<float>(ctx, inputs);
    if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) return Run<double>(ctx, inputs);
    throw std::runtime_error("aot2onnx fused Elementwise: float32 or float64 tensors");
  }

  template <typename T>
  void Run(Ort::KernelContext& ctx, size_t inputs) {
    const size_t steps = program_.size() / 3, values = inputs + steps;
    // The node's shape: its inputs of more than one element share it.
    std::vector<int64_t> shape;
    int64_t n = 1;
    bool shaped = false;
    std::vector<const T*> input(inputs);
    std::vector<bool> scalar(values, false);
    const auto type = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetElementType();
    for (size_t i = 0; i < inputs; ++i) {
      Ort::ConstValue value = ctx.GetInput(i);
      auto info = value.GetTensorTypeAndShapeInfo();
      if (info.GetElementType() != type) {
        throw std::runtime_error("aot2onnx fused Elementwise: inputs of one type");
      }
      input[i] = static_cast<const T*>(value.GetTensorRawData());
      scalar[i] = info.GetElementCount() == 1;  // broadcast (where every input has one element, so do results)
      std::vector<int64_t> dims = info.GetShape();
      if (info.GetElementCount() != 1) {
        if (shaped && dims != shape) throw std::runtime_error("aot2onnx fused Elementwise: inputs of one shape");
        shape = dims;
        shaped = true;
      } else if (!shaped && dims.size() > shape.size()) {
        shape = dims;
      }
    }
    for (int64_t d : shape) n *= d;
    if (!shaped) n = 1;  // every input of one element: so are the results
    for (size_t k = 0; k < steps; ++k) {
      const int64_t op = program_[3 * k], a = program_[3 * k + 1], b = program_[3 * k + 2];
      if (op < kAdd || op > kKeepSmall || a < 0 || a >= static_cast<int64_t>(inputs + k) ||
          (op == kNeg ? b != -1 : (b < 0 || b >= static_cast<int64_t>(inputs + k)))) {
        throw std::runtime_error("aot2onnx fused Elementwise: an instruction reads a value not yet computed");
      }
      scalar[inputs + k] = scalar[a] && (op == kNeg || scalar[b]);
    }
    std::vector<T*> output(values, nullptr);  // where a result that is an output goes
    for (size_t o = 0; o < outputs_.size(); ++o) {
      const int64_t v = outputs_[o];
      if (v < static_cast<int64_t>(inputs) || v >= static_cast<int64_t>(values) || output[v] != nullptr) {
        throw std::runtime_error("aot2onnx fused Elementwise: each output one instruction's result");
      }
      output[v] = ctx.GetOutput(o, shape).GetTensorMutableData<T>();
    }
    if (n == 0) return;
    // An output on memory no input shares is written where its instruction computes it; one bound to an input's
    // memory (a compiled optimizer's parameter, runtime/inplace.py) is copied after the block's last read.
    std::vector<bool> direct(values, false);
    for (size_t v = inputs; v < values; ++v) {
      if (output[v] == nullptr || scalar[v]) continue;
      const auto begin = reinterpret_cast<std::uintptr_t>(output[v]), end = begin + n * sizeof(T);
      direct[v] = std::none_of(input.begin(), input.end(), [&](const T* in) {
        const auto from = reinterpret_cast<std::uintptr_t>(in);
        return from < end && begin < from + n * sizeof(T);
      });
    }
    constexpr int64_t kBlock = 256;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    at::parallel_for(0, blocks, std::max<int64_t>(1, 32768 / kBlock), [&](int64_t begin, int64_t end) {
      std::vector<T> scratch(steps * kBlock);
      std::vector<const T*> at(values);
      for (int64_t block = begin; block < end; ++block) {
        const int64_t start = block * kBlock, len = std::min(kBlock, n - start);
        for (size_t i = 0; i < inputs; ++i) at[i] = scalar[i] ? input[i] : input[i] + start;
        for (size_t k = 0; k < steps; ++k) {
          const size_t v = inputs + k;
          T* r = direct[v] ? output[v] + start : scratch.data() + k * kBlock;
          const int64_t op = program_[3 * k];
          const T* x = at[program_[3 * k + 1]];
          const T* y = op == kNeg ? nullptr : at[program_[3 * k + 2]];
          const bool sx = scalar[program_[3 * k + 1]], sy = op != kNeg && scalar[program_[3 * k + 2]];
          if (scalar[v]) {
            Step<T, 1>(op, r, x, y, sx, sy, 1);
          } else if (len == kBlock) {
            Step<T, kBlock>(op, r, x, y, sx, sy, kBlock);  // a whole block: loops of a known length, vectorized
          } else {
            Step<T, 0>(op, r, x, y, sx, sy, len);
          }
          at[v] = r;
        }
        // The other outputs last, after every read of the block's operands.
        for (size_t v = inputs; v < values; ++v) {
          if (output[v] != nullptr && !direct[v]) {
            std::memcpy(output[v] + start, at[v], (scalar[v] ? 1 : len) * sizeof(T));
          }
        }
      }
    });
  }

  // One instruction over m elements (kLength of them where it is not 0: a length the compiler knows).
  template <typename T, int64_t kLength>
  __attribute__((target_clones("avx2", "default"))) static void Step(int64_t op, T* __restrict r, const T* x, const T* y, bool sx, bool sy, int64_t m) {
    switch (op) {
      case kAdd: return Apply<T, kLength>(r, x, y, sx, sy, m, [](T p, T q) { return p + q; });
      case kSub: return Apply<T, kLength>(r, x, y, sx, sy, m, [](T p, T q) { return p - q; });
      case kMul: return Apply<T, kLength>(r, x, y, sx, sy, m, [](T p, T q) { return p * q; });
      case kDiv: return Apply<T, kLength>(r, x, y, sx, sy, m, [](T p, T q) { return p / q; });
      case kKeepSmall:
        return Apply<T, kLength>(r, x, y, sx, sy, m, [](T p, T q) { return std::fabs(p) >= T(0x1p-12) ? q : p; });
      default:
        for (int64_t i = 0; i < (kLength ? kLength : m); ++i) r[i] = -x[i];
    }
  }

  // r = f(x, y) over m elements, an operand of one element (sx, sy) read as that element throughout.
  template <typename T, int64_t kLength, typename F>
  static void Apply(T* __restrict r, const T* __restrict x, const T* __restrict y, bool sx, bool sy, int64_t m,
                    F f) {
    const int64_t n = kLength ? kLength : m;
    if (sx && !sy) {
      const T p = x[0];
      for (int64_t i = 0; i < n; ++i) r[i] = f(p, y[i]);
    } else if (sy && !sx) {
      const T q = y[0];
      for (int64_t i = 0; i < n; ++i) r[i] = f(x[i], q);
    } else {
      for (int64_t i = 0; i < n; ++i) r[i] = f(x[i], y[i]);
    }
  }

  std::vector<int64_t> program_, outputs_;
};
struct Elementwise : FusedOp<Elementwise, ElementwiseKernel> {
  static constexpr const char* kName = "Elementwise";
  static constexpr size_t kInputs = 1, kRequired = 1, kOutputs = 1;
  static constexpr bool kVariadic = true;

  // Every output in the shape of the inputs of more than one element (of the widest where all have one), in the
  // first input's type.
  static OrtStatusPtr InferOutputs(Ort::ShapeInferContext& ctx, OrtShapeInferContext* context) {
    const ONNXTensorElementDataType type = InputType(context, 0);
    Ort::ShapeInferContext::Shape shape;
    bool shaped = false;
    for (size_t i = 0; i < ctx.GetInputCount(); ++i) {
      const Ort::ShapeInferContext::Shape& in = ctx.GetInputShape(i);
      int64_t elements = 1;
      bool known = true;
      for (const auto& d : in) {
        if (!d.IsInt() || d.AsInt() < 0) known = false;
        else elements *= d.AsInt();
      }
      if (!known || elements != 1) {
        if (!shaped) {
          for (const auto& d : in) shape.push_back(Known(d));
          shaped = true;
        }
      } else if (!shaped && in.size() > shape.size()) {
        shape.assign(in.begin(), in.end());
      }
    }
    const size_t outputs = ctx.GetAttrInts("results").size();
    for (size_t o = 0; o < outputs; ++o) {
      if (OrtStatusPtr status = SetOutput(context, o, shape, type)) return status;
    }
    return nullptr;
  }
};

// --- Transpose: ONNX's, as runs of contiguous elements copied in the output's order ----------------------------
// Attention's head split and merge ([B, S, H, D] <-> [B, H, S, D]) keep the last axis: ONNX Runtime's CPU
// Transpose took 20 us for 16384 float32 elements so ([16, 32, 4, 8]), a copy of runs of 8. A copy: the same bytes
// in the output's order, any element type of 1, 2, 4 or 8 bytes. Runs are the output's trailing axes that stay
// adjacent and in order in the input; rows of runs are shared among torch's OpenMP threads above 32768 elements.

struct TransposeKernel {
  explicit TransposeKernel(const Ort::ConstKernelInfo& info) : perm_(info.GetAttributes<int64_t>("perm")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0);
    auto info = x.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> in = info.GetShape();
    const size_t rank = in.size();
    std::vector<bool> seen(rank, false);
    if (perm_.size() != rank) throw std::runtime_error("aot2onnx fused Transpose: perm and the input's rank differ");
    for (int64_t p : perm_) {
      if (p < 0 || p >= static_cast<int64_t>(rank) || seen[p]) {
        throw std::runtime_error("aot2onnx fused Transpose: perm is not a permutation of the input's axes");
      }
      seen[p] = true;
    }
    const int64_t element = static_cast<int64_t>(at::elementSize(BytesOf(info.GetElementType())));
    std::vector<int64_t> in_strides(rank, element), out_shape(rank);
    for (size_t d = rank; d-- > 1;) in_strides[d - 1] = in_strides[d] * in[d];
    for (size_t d = 0; d < rank; ++d) out_shape[d] = in[perm_[d]];
    Ort::UnownedValue y = ctx.GetOutput(0, out_shape);
    int64_t total = 1;
    for (int64_t s : in) total *= s;
    if (total == 0) return;
    // The output's axes as (size, stride in the input), axes of size 1 dropped and neighbours merged where the
    // input has them adjacent in the same order.
    std::vector<int64_t> sizes, strides;
    for (size_t d = 0; d < rank; ++d) {
      const int64_t size = in[perm_[d]], stride = in_strides[perm_[d]];
      if (size == 1) continue;
      if (!sizes.empty() && strides.back() == stride * size) {
        sizes.back() *= size;
        strides.back() = stride;
      } else {
        sizes.push_back(size);
        strides.push_back(stride);
      }
    }
    // The run: the last merged axis where it is contiguous in the input, else one element.
    int64_t run = element;
    if (!sizes.empty() && strides.back() == element) {
      run = sizes.back() * element;
      sizes.pop_back();
      strides.pop_back();
    }
    const char* source = static_cast<const char*>(x.GetTensorRawData());
    char* target = static_cast<char*>(y.GetTensorMutableRawData());
    int64_t rows = 1;
    for (int64_t s : sizes) rows *= s;
    const int64_t grain = std::max<int64_t>(1, 32768 * element / run);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      switch (run) {  // short runs as moves of a known size (a call of memcpy each cost more than the copy)
        case 4: return CopyRuns<4>(source, target, run, sizes, strides, begin, end);
        case 8: return CopyRuns<8>(source, target, run, sizes, strides, begin, end);
        case 16: return CopyRuns<16>(source, target, run, sizes, strides, begin, end);
        case 32: return CopyRuns<32>(source, target, run, sizes, strides, begin, end);
        case 64: return CopyRuns<64>(source, target, run, sizes, strides, begin, end);
        case 128: return CopyRuns<128>(source, target, run, sizes, strides, begin, end);
        default: return CopyRuns<0>(source, target, run, sizes, strides, begin, end);
      }
    });
  }

  // Rows [begin, end) of `run` bytes each: row r is at r * run in the output, and in the input at the offset its
  // index on `sizes` gives with `strides` (bytes). kRun: `run` known at compile time (0: not).
  template <int64_t kRun>
  static void CopyRuns(const char* source, char* target, int64_t run, const std::vector<int64_t>& sizes,
                       const std::vector<int64_t>& strides, int64_t begin, int64_t end) {
    std::vector<int64_t> index(sizes.size());  // an odometer, from `begin`
    int64_t offset = 0, rest = begin;
    for (size_t d = sizes.size(); d-- > 0;) {
      index[d] = rest % sizes[d];
      rest /= sizes[d];
      offset += index[d] * strides[d];
    }
    char* out = target + begin * run;
    for (int64_t row = begin; row < end; ++row, out += run) {
      std::memcpy(out, source + offset, kRun ? kRun : run);
      for (size_t d = sizes.size(); d-- > 0;) {
        offset += strides[d];
        if (++index[d] < sizes[d]) break;
        offset -= strides[d] * sizes[d];
        index[d] = 0;
      }
    }
  }
  std::vector<int64_t> perm_;
};
struct Transpose : FusedOp<Transpose, TransposeKernel> {
  static constexpr const char* kName = "Transpose";
  static constexpr size_t kInputs = 1, kRequired = 1, kOutputs = 1;

  // The input's dimensions in perm's order, in its type.
  static OrtStatusPtr InferOutputs(Ort::ShapeInferContext& ctx, OrtShapeInferContext* context) {
    const ONNXTensorElementDataType type = InputType(context, 0);
    std::vector<int64_t> perm = ctx.GetAttrInts("perm");
    const Ort::ShapeInferContext::Shape& in = ctx.GetInputShape(0);
    if (perm.size() != in.size()) throw std::runtime_error("aot2onnx fused Transpose: perm and the input's rank differ");
    Ort::ShapeInferContext::Shape out;
    for (int64_t p : perm) {
      if (p < 0 || p >= static_cast<int64_t>(in.size())) throw std::runtime_error("aot2onnx fused Transpose: perm");
      out.push_back(Known(in[p]));
    }
    return SetOutput(context, 0, out, type);
  }
};

// --- a convolution's backward: (grad_output, input, weight) -> the gradients output_mask asks for, in the order
//     input, weight, bias --------------------------------------------------------------------------------------
// ATen's convolution_backward, which eager's autograd calls with the same arguments: its gradients bit for bit
// (oneDNN's or ATen's own kernels, as ATen chooses for eager). The standard lowering unfolds the input by a
// one-hot convolution for the weight's gradient, which makes an infinite input NaN (inf * 0).

struct ConvolutionBackwardKernel {
  explicit ConvolutionBackwardKernel(const Ort::ConstKernelInfo& info)
      : stride_(info.GetAttributes<int64_t>("stride")), padding_(info.GetAttributes<int64_t>("padding")),
        dilation_(info.GetAttributes<int64_t>("dilation")),
        output_padding_(info.GetAttributes<int64_t>("output_padding")),
        transposed_(info.GetAttribute<int64_t>("transposed") != 0), groups_(info.GetAttribute<int64_t>("groups")) {
    std::vector<int64_t> mask = info.GetAttributes<int64_t>("output_mask");
    if (mask.size() != 3) throw std::runtime_error("aot2onnx fused ConvolutionBackward: output_mask has 3 entries");
    for (size_t i = 0; i < 3; ++i) mask_[i] = mask[i] != 0;
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor grad = Required(ctx, 0), input = Required(ctx, 1), weight = Required(ctx, 2);
    int64_t channels = transposed_ ? weight.size(1) * groups_ : weight.size(0);
    std::vector<int64_t> bias_sizes{channels};
    auto results = at::convolution_backward(grad, input, weight, mask_[2] ? c10::optional<at::IntArrayRef>(bias_sizes)
                                                                          : c10::nullopt,
                                            stride_, padding_, dilation_, transposed_, output_padding_, groups_, mask_);
    std::array<at::Tensor*, 3> computed{&std::get<0>(results), &std::get<1>(results), &std::get<2>(results)};
    size_t index = 0;
    for (size_t i = 0; i < 3; ++i) {
      if (!mask_[i]) continue;
      Output(ctx, index++, *computed[i]).copy_(*computed[i]);
    }
  }
  std::vector<int64_t> stride_, padding_, dilation_, output_padding_;
  bool transposed_;
  int64_t groups_;
  std::array<bool, 3> mask_{};
};
struct ConvolutionBackward : FusedOp<ConvolutionBackward, ConvolutionBackwardKernel> {
  static constexpr const char* kName = "ConvolutionBackward";
  static constexpr size_t kInputs = 3, kRequired = 3, kOutputs = 3;
  static constexpr bool kOutputsOptional = true;

  // In output_mask's order: the input's shape, the weight's, and [output channels], each in grad_output's type.
  static OrtStatusPtr InferOutputs(Ort::ShapeInferContext& ctx, OrtShapeInferContext* context) {
    const ONNXTensorElementDataType type = InputType(context, 0);
    std::vector<int64_t> mask = ctx.GetAttrInts("output_mask");
    Ort::ShapeInferContext::Shape weight = ctx.GetInputShape(2);
    bool transposed = ctx.GetAttrInt("transposed") != 0;
    size_t index = 0;
    for (size_t i = 0; i < 3 && i < mask.size(); ++i) {
      if (!mask[i]) continue;
      Ort::ShapeInferContext::Shape shape;
      if (i < 2) {
        for (const auto& d : ctx.GetInputShape(i + 1)) shape.push_back(Known(d));
      } else if (!transposed && !weight.empty()) {
        shape.push_back(Known(weight[0]));
      } else if (transposed && weight.size() > 1 && weight[1].IsInt()) {
        shape.emplace_back(weight[1].AsInt() * ctx.GetAttrInt("groups"));
      } else {
        shape.push_back(Unknown());
      }
      if (OrtStatusPtr status = SetOutput(context, index++, shape, type)) return status;
    }
    return nullptr;
  }
};

// --- max pooling with indices: x -> (values, indices), ATen's kernel or its loop without its branches ---------
// Eager's values and indices: ATen's max_pool2d/3d_with_indices (a NaN wins its window at its last position,
// ties the first, indices counted within each (n, c) plane), or for 2-D float pooling MaxPool2dPlanes below.
// ONNX Runtime's MaxPool numbers positions over the whole tensor, lets a NaN win only from some positions, and
// starts its windows at the most negative finite number: the standard lowering mends that behind an If; on two
// threads it was also 1.5x slower than ATen here.

// ATen's 2-D kernel on contiguous (N, C, H, W) float32 and float64 planes: its loop, its order and its rule, without
// its branches. ATen's `if ((val > maxval) || isnan(val))` compiles to branches (the compiler keeps the two
// comparisons apart, as either may raise a floating-point exception), which random activations mispredict about
// half the time: 1.4 ms for 16x16x32x32 at one thread, where ATen's ReLU of it takes 18 us. Here the same comparisons
// are SSE2 masks (4 windows of a row side by side for float32): 0.16 ms. Per window, in ATen's order (rows, then
// columns, from the first position inside the input): a value takes the maximum where it is greater or NaN (so the
// first of equal maxima wins, and the last NaN), the maximum starts at -inf and its index at the window's first
// position; the index counts positions within the plane.

#if defined(__SSE2__)
inline void TakeMax(float v, int64_t index, float& m, int64_t& mi) {
  const __m128 vv = _mm_set_ss(v), mm = _mm_set_ss(m);
  const __m128 take = _mm_or_ps(_mm_cmpgt_ss(vv, mm), _mm_cmpunord_ss(vv, vv));
  m = _mm_cvtss_f32(_mm_or_ps(_mm_and_ps(take, vv), _mm_andnot_ps(take, mm)));
  const int64_t mask = -static_cast<int64_t>(_mm_cvtsi128_si32(_mm_castps_si128(take)) != 0);
  mi = (index & mask) | (mi & ~mask);
}
inline void TakeMax(double v, int64_t index, double& m, int64_t& mi) {
  const __m128d vv = _mm_set_sd(v), mm = _mm_set_sd(m);
  const __m128d take = _mm_or_pd(_mm_cmpgt_sd(vv, mm), _mm_cmpunord_sd(vv, vv));
  m = _mm_cvtsd_f64(_mm_or_pd(_mm_and_pd(take, vv), _mm_andnot_pd(take, mm)));
  const int64_t mask = -static_cast<int64_t>(_mm_cvtsi128_si32(_mm_castpd_si128(take)) != 0);
  mi = (index & mask) | (mi & ~mask);
}
#else
template <typename T>
inline void TakeMax(T v, int64_t index, T& m, int64_t& mi) {
  if ((v > m) || std::isnan(v)) {
    m = v;
    mi = index;
  }
}
#endif

template <typename T>
void MaxPool2dPlanes(const T* input, T* output, int64_t* indices, int64_t planes, int64_t height, int64_t width,
                     int64_t out_height, int64_t out_width, const std::vector<int64_t>& kernel,
                     const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                     const std::vector<int64_t>& dilation) {
  const int64_t kH = kernel[0], kW = kernel[1], dH = stride[0], dW = stride[1], padH = padding[0], padW = padding[1],
                dilH = dilation[0], dilW = dilation[1];
  int64_t first = 0;  // the output columns [first, last) whose windows lie inside the row
  while (first < out_width && first * dW - padW < 0) ++first;
  int64_t last = first;
  while (last < out_width && last * dW - padW + (kW - 1) * dilW + 1 <= width) ++last;
  at::parallel_for(0, planes, 0, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const T* in = input + c * height * width;
      T* out = output + c * out_height * out_width;
      int64_t* ind = indices + c * out_height * out_width;
      for (int64_t oh = 0; oh < out_height; ++oh) {
        int64_t ih0 = oh * dH - padH;
        const int64_t ih1 = std::min(ih0 + (kH - 1) * dilH + 1, height);
        while (ih0 < 0) ih0 += dilH;
        auto window = [&](int64_t ow) {  // ATen's loop for one window
          int64_t iw0 = ow * dW - padW;
          const int64_t iw1 = std::min(iw0 + (kW - 1) * dilW + 1, width);
          while (iw0 < 0) iw0 += dilW;
          T m = -std::numeric_limits<T>::infinity();
          int64_t mi = ih0 * width + iw0;
          for (int64_t ih = ih0; ih < ih1; ih += dilH) {
            for (int64_t iw = iw0; iw < iw1; iw += dilW) TakeMax(in[ih * width + iw], ih * width + iw, m, mi);
          }
          out[oh * out_width + ow] = m;
          ind[oh * out_width + ow] = mi;
        };
        int64_t ow = 0;
        for (; ow < first; ++ow) window(ow);
#if defined(__SSE2__)
        if constexpr (std::is_same_v<T, float>) {
          // Four windows inside the row at a time, each as window() computes it; indices as int32 while computed.
          if (height * width <= std::numeric_limits<int32_t>::max()) {
            const __m128i lanes = _mm_set_epi32(static_cast<int32_t>(3 * dW), static_cast<int32_t>(2 * dW),
                                                static_cast<int32_t>(dW), 0);
            for (; ow + 4 <= last; ow += 4) {
              __m128 m = _mm_set1_ps(-std::numeric_limits<float>::infinity());
              __m128i mi = _mm_add_epi32(_mm_set1_epi32(static_cast<int32_t>(ih0 * width + ow * dW - padW)), lanes);
              for (int64_t ih = ih0; ih < ih1; ih += dilH) {
                for (int64_t kw = 0; kw < kW; ++kw) {
                  const int64_t at = ih * width + ow * dW - padW + kw * dilW;
                  const float* p = in + at;
                  const __m128 v = _mm_set_ps(p[3 * dW], p[2 * dW], p[dW], p[0]);
                  const __m128 take = _mm_or_ps(_mm_cmpgt_ps(v, m), _mm_cmpunord_ps(v, v));
                  m = _mm_or_ps(_mm_and_ps(take, v), _mm_andnot_ps(take, m));
                  const __m128i index = _mm_add_epi32(_mm_set1_epi32(static_cast<int32_t>(at)), lanes);
                  const __m128i mask = _mm_castps_si128(take);
                  mi = _mm_or_si128(_mm_and_si128(mask, index), _mm_andnot_si128(mask, mi));
                }
              }
              _mm_storeu_ps(out + oh * out_width + ow, m);
              const __m128i zero = _mm_setzero_si128();  // non-negative indices, widened with zeros
              _mm_storeu_si128(reinterpret_cast<__m128i*>(ind + oh * out_width + ow), _mm_unpacklo_epi32(mi, zero));
              _mm_storeu_si128(reinterpret_cast<__m128i*>(ind + oh * out_width + ow + 2), _mm_unpackhi_epi32(mi, zero));
            }
          }
        }
#endif
        for (; ow < out_width; ++ow) window(ow);
      }
    }
  });
}

struct MaxPoolWithIndicesKernel {
  explicit MaxPoolWithIndicesKernel(const Ort::ConstKernelInfo& info)
      : kernel_(info.GetAttributes<int64_t>("kernel_size")), stride_(info.GetAttributes<int64_t>("stride")),
        padding_(info.GetAttributes<int64_t>("padding")), dilation_(info.GetAttributes<int64_t>("dilation")),
        ceil_mode_(info.GetAttribute<int64_t>("ceil_mode") != 0) {
    if (kernel_.size() != 2 && kernel_.size() != 3) {
      throw std::runtime_error("aot2onnx fused MaxPoolWithIndices: 2-D or 3-D pooling");
    }
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor input = Required(ctx, 0);
    const bool float_planes = input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble;
    if (kernel_.size() == 2 && input.dim() >= 3 && float_planes) {
      // ATen's output sizes and checks (the graph's shapes were traced through them already).
      std::vector<int64_t> sizes(input.sizes().begin(), input.sizes().end());
      for (size_t i = 0; i < 2; ++i) {
        sizes[sizes.size() - 2 + i] = at::native::pooling_output_shape<int64_t>(
            input.size(-2 + static_cast<int64_t>(i)), kernel_[i], padding_[i], stride_[i], dilation_[i], ceil_mode_);
      }
      at::Tensor values = Output(ctx, 0, sizes, input.options());
      at::Tensor indices = Output(ctx, 1, sizes, input.options().dtype(at::kLong));
      const int64_t planes = input.numel() / (input.size(-2) * input.size(-1));
      AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "aot2onnx_max_pool2d", [&] {
        MaxPool2dPlanes<scalar_t>(input.const_data_ptr<scalar_t>(), values.mutable_data_ptr<scalar_t>(),
                                  indices.mutable_data_ptr<int64_t>(), planes, input.size(-2), input.size(-1),
                                  values.size(-2), values.size(-1), kernel_, stride_, padding_, dilation_);
      });
      return;
    }
    auto [values, indices] = kernel_.size() == 2
        ? at::max_pool2d_with_indices(input, kernel_, stride_, padding_, dilation_, ceil_mode_)
        : at::max_pool3d_with_indices(input, kernel_, stride_, padding_, dilation_, ceil_mode_);
    Output(ctx, 0, values).copy_(values);
    Output(ctx, 1, indices).copy_(indices);
  }
  std::vector<int64_t> kernel_, stride_, padding_, dilation_;
  bool ceil_mode_;
};
struct MaxPoolWithIndices : FusedOp<MaxPoolWithIndices, MaxPoolWithIndicesKernel> {
  static constexpr const char* kName = "MaxPoolWithIndices";
  static constexpr size_t kInputs = 1, kRequired = 1, kOutputs = 2;
  static constexpr std::array<ONNXTensorElementDataType, 2> kOutputTypes{ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED,
                                                                         ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64};

  // Both outputs: the input's leading dimensions, then each pooled size as ATen's pooling_output_shape computes it
  // (a symbol where the input's size is one); values in the input's type, indices int64.
  static OrtStatusPtr InferOutputs(Ort::ShapeInferContext& ctx, OrtShapeInferContext* context) {
    const ONNXTensorElementDataType type = InputType(context, 0);
    std::vector<int64_t> kernel = ctx.GetAttrInts("kernel_size"), stride = ctx.GetAttrInts("stride"),
                         padding = ctx.GetAttrInts("padding"), dilation = ctx.GetAttrInts("dilation");
    bool ceil_mode = ctx.GetAttrInt("ceil_mode") != 0;
    const Ort::ShapeInferContext::Shape& in = ctx.GetInputShape(0);
    size_t spatial = kernel.size();
    if (in.size() < spatial + 1) throw std::runtime_error("aot2onnx fused MaxPoolWithIndices: input rank too small");
    Ort::ShapeInferContext::Shape out;
    for (size_t d = 0; d + spatial < in.size(); ++d) out.push_back(Known(in[d]));
    for (size_t i = 0; i < spatial; ++i) {
      const auto& size = in[in.size() - spatial + i];
      if (!size.IsInt() || size.AsInt() < 0) {
        out.push_back(Unknown());
        continue;
      }
      int64_t numerator = size.AsInt() + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1 +
                          (ceil_mode ? stride[i] - 1 : 0);
      int64_t pooled = (numerator >= 0 ? numerator / stride[i] : -((-numerator + stride[i] - 1) / stride[i])) + 1;
      if (ceil_mode && (pooled - 1) * stride[i] >= size.AsInt() + padding[i]) --pooled;
      out.emplace_back(pooled);
    }
    if (OrtStatusPtr status = SetOutput(context, 0, out, type)) return status;
    return SetOutput(context, 1, out, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
  }
};


// --- matrix products: (a, b[, c]) -> mm, addmm, bmm or baddbmm, a and b each read transposed or not -------------
// ATen's own products (MKL's or oneDNN's GEMM, as eager's), run on the calling thread's OpenMP pool like eager's:
// ONNX Runtime's MLAS GEMMs wake its own pool's thread per product, and in a training step beside torch's OpenMP
// workers they ran 1.3-2x longer than alone. A transposed operand is a transposed view (eager's linear hands
// addmm the weight as w.t(), a view), so the product is eager's call with eager's strides.

struct MatMulKernel {
  explicit MatMulKernel(const Ort::ConstKernelInfo& info)
      : trans_a_(info.GetAttribute<int64_t>("trans_a") != 0), trans_b_(info.GetAttribute<int64_t>("trans_b") != 0),
        alpha_(ExactFloat(info, "alpha")), beta_(ExactFloat(info, "beta")) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor a = Required(ctx, 0), b = Required(ctx, 1);
    std::optional<at::Tensor> c = Input(ctx, 2);
    if (a.dim() != b.dim() || (a.dim() != 2 && a.dim() != 3)) {
      throw std::runtime_error("aot2onnx fused Mm: two matrices or two batches of matrices");
    }
    if (trans_a_) a = a.transpose(-2, -1);
    if (trans_b_) b = b.transpose(-2, -1);
    std::vector<int64_t> sizes(a.sizes().begin(), a.sizes().end());
    sizes.back() = b.size(-1);
    at::Tensor out = Output(ctx, 0, sizes, a.options());
    if (a.dim() == 2) {
      if (c) {
        at::addmm_out(out, *c, a, b, beta_, alpha_);
      } else {
        at::mm_out(out, a, b);
      }
    } else if (c) {
      at::baddbmm_out(out, *c, a, b, beta_, alpha_);
    } else {
      at::bmm_out(out, a, b);
    }
  }
  bool trans_a_, trans_b_;
  double alpha_, beta_;
};
struct Mm : FusedOp<Mm, MatMulKernel> {
  static constexpr const char* kName = "Mm";
  static constexpr size_t kInputs = 3, kRequired = 2, kOutputs = 1;

  // a's leading dimensions and rows (as read), b's columns (as read); in a's type.
  static OrtStatusPtr InferOutputs(Ort::ShapeInferContext& ctx, OrtShapeInferContext* context) {
    const ONNXTensorElementDataType type = InputType(context, 0);
    const Ort::ShapeInferContext::Shape& a = ctx.GetInputShape(0);
    const Ort::ShapeInferContext::Shape& b = ctx.GetInputShape(1);
    if (a.size() < 2 || b.size() != a.size()) throw std::runtime_error("aot2onnx fused Mm: ranks");
    bool trans_a = ctx.GetAttrInt("trans_a") != 0, trans_b = ctx.GetAttrInt("trans_b") != 0;
    Ort::ShapeInferContext::Shape out;
    for (size_t d = 0; d + 2 < a.size(); ++d) out.push_back(Known(a[d]));
    out.push_back(Known(a[a.size() - (trans_a ? 1 : 2)]));
    out.push_back(Known(b[b.size() - (trans_b ? 2 : 1)]));
    return SetOutput(context, 0, out, type);
  }
};

// --- a float sum over some axes: ATen's sum (eager's bits: its cascade summation, float32 accumulation of 16-bit
//     values), where ONNX Runtime's ReduceSum (or the ones-row MatMul the standard lowering takes for a bias
//     gradient) sums in another order ----------------------------------------------------------------------------

struct SumKernel {
  explicit SumKernel(const Ort::ConstKernelInfo& info)
      : dims_(info.GetAttributes<int64_t>("dims")), keepdim_(info.GetAttribute<int64_t>("keepdim") != 0) {}
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    at::Tensor x = Required(ctx, 0);
    // The functional sum, copied: sum_out writes a 16-bit NaN with another sign than eager's sum does.
    at::Tensor y = dims_.empty() && !keepdim_ ? at::sum(x) : at::sum(x, dims_, keepdim_);
    Output(ctx, 0, y).copy_(y);
  }
  std::vector<int64_t> dims_;  // non-negative, sorted; empty: every axis
  bool keepdim_;
};
struct Sum : FusedOp<Sum, SumKernel> {
  static constexpr const char* kName = "Sum";
  static constexpr size_t kInputs = 1, kRequired = 1, kOutputs = 1;

  // The input's sizes without the summed axes (1 for each with keepdim), in the input's type.
  static OrtStatusPtr InferOutputs(Ort::ShapeInferContext& ctx, OrtShapeInferContext* context) {
    const ONNXTensorElementDataType type = InputType(context, 0);
    std::vector<int64_t> dims = ctx.GetAttrInts("dims");
    bool keepdim = ctx.GetAttrInt("keepdim") != 0;
    const Ort::ShapeInferContext::Shape& in = ctx.GetInputShape(0);
    Ort::ShapeInferContext::Shape out;
    for (size_t d = 0; d < in.size(); ++d) {
      bool reduced = dims.empty() || std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) != dims.end();
      if (!reduced) {
        out.push_back(Known(in[d]));
      } else if (keepdim) {
        out.emplace_back(int64_t{1});
      }
    }
    return SetOutput(context, 0, out, type);
  }
};

// --- a scatter into zeros, times a factor: Mul(ScatterElements(zeros, indices, updates), factor) ---------------
// A negative log-likelihood loss's gradient (nll_loss_backward's decomposition): zeros of the logits' shape, a
// value scattered in at each row's target, times the loss's weight per row. ONNX Runtime copies the zeros into the
// scatter's output, then reads and writes that again in the Mul: passes over a [tokens, vocabulary] tensor (its
// two nodes took 64 us at [256, 1024] and 60 ms at [2048, 50257], this node 33 us and 15 ms; one session each,
// one thread). Here one pass: each element is what the Mul computes of it (0 times the factor, or the scattered
// value times the factor, in the node's operand order), so the values are the two nodes' bit for bit, signed
// zeros and NaN included. Input 0 is the scatter's data, which rewrites.fused_scatter_scales passes only where it is a
// constant of +0.0: the kernel reads its shape, and checks once per buffer that it holds zeros.

struct ScatterScaleKernel {
  explicit ScatterScaleKernel(const Ort::ConstKernelInfo& info)
      : axis_(info.GetAttribute<int64_t>("axis")), factor_first_(info.GetAttribute<int64_t>("factor_first") != 0) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const auto type = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetElementType();
    if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return Run<float>(ctx);
    if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) return Run<double>(ctx);
    throw std::runtime_error("aot2onnx fused ScatterScale: float32 or float64 tensors");
  }

  template <typename T>
  void Run(Ort::KernelContext& ctx) {
    Ort::ConstValue data = ctx.GetInput(0), indices = ctx.GetInput(1), updates = ctx.GetInput(2),
                    factor = ctx.GetInput(3);
    auto data_info = data.GetTensorTypeAndShapeInfo(), index_info = indices.GetTensorTypeAndShapeInfo(),
         update_info = updates.GetTensorTypeAndShapeInfo(), factor_info = factor.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> shape = data_info.GetShape(), index_shape = index_info.GetShape(),
                               factor_shape = factor_info.GetShape();
    const int64_t rank = static_cast<int64_t>(shape.size());
    const int64_t axis = axis_ < 0 ? axis_ + rank : axis_;
    if (rank == 0 || axis < 0 || axis >= rank) throw std::runtime_error("aot2onnx fused ScatterScale: axis out of range");
    if (update_info.GetElementType() != data_info.GetElementType() ||
        factor_info.GetElementType() != data_info.GetElementType()) {
      throw std::runtime_error("aot2onnx fused ScatterScale: data, updates and factor of one type");
    }
    const auto index_type = index_info.GetElementType();
    if (index_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 && index_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32) {
      throw std::runtime_error("aot2onnx fused ScatterScale: int64 or int32 indices");
    }
    if (update_info.GetShape() != index_shape || static_cast<int64_t>(index_shape.size()) != rank) {
      throw std::runtime_error("aot2onnx fused ScatterScale: indices and updates of one shape, of the data's rank");
    }
    for (int64_t d = 0; d < rank; ++d) {
      if (d != axis && index_shape[d] > shape[d]) {
        throw std::runtime_error("aot2onnx fused ScatterScale: indices larger than the data off the axis");
      }
    }
    // The factor's strides in the data's shape (right-aligned broadcasting; 0 along a dimension of 1).
    if (static_cast<int64_t>(factor_shape.size()) > rank) {
      throw std::runtime_error("aot2onnx fused ScatterScale: a factor of higher rank than the data");
    }
    std::vector<int64_t> factor_stride(rank, 0);
    int64_t stride = 1;
    for (int64_t k = static_cast<int64_t>(factor_shape.size()); k-- > 0;) {
      const int64_t d = rank - static_cast<int64_t>(factor_shape.size()) + k;
      if (factor_shape[k] != shape[d] && factor_shape[k] != 1) {
        throw std::runtime_error("aot2onnx fused ScatterScale: the factor does not broadcast to the data's shape");
      }
      factor_stride[d] = factor_shape[k] == 1 ? 0 : stride;
      stride *= factor_shape[k];
    }
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    CheckZeros(data.GetTensorRawData(), n * static_cast<int64_t>(sizeof(T)));
    T* out = ctx.GetOutput(0, shape).GetTensorMutableData<T>();
    if (n == 0) return;
    const T* f = factor.GetTensorData<T>();
    const bool factor_first = factor_first_;
    auto mul = [factor_first](T value, T w) { return factor_first ? w * value : value * w; };
    auto factor_offset = [&](int64_t flat, int64_t last_dim) {  // `flat`: an index over the leading dimensions
      int64_t offset = 0;
      for (int64_t d = last_dim; d-- > 0;) {
        offset += (flat % shape[d]) * factor_stride[d];
        flat /= shape[d];
      }
      return offset;
    };
    // Every element: the Mul of the scatter's zero.
    const int64_t inner = shape[rank - 1], rows = n / inner, inner_stride = factor_stride[rank - 1];
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(inner, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* w = f + factor_offset(r, rank - 1);
        T* row = out + r * inner;
        if (inner_stride == 0) {
          const T value = mul(T(0), w[0]);
          Fill(row, inner, [value](int64_t) { return value; });
        } else {
          Fill(row, inner, [w, &mul](int64_t j) { return mul(T(0), w[j]); });  // the factor's stride here is 1
        }
      }
    });
    // The scattered values, in the indices' order (a later one at the same place wins, as in the scatter).
    int64_t count = 1;
    for (int64_t s : index_shape) count *= s;
    const T* update = updates.GetTensorData<T>();
    const void* index_data = indices.GetTensorRawData();
    std::vector<int64_t> coord(rank, 0);
    for (int64_t p = 0; p < count; ++p) {
      int64_t index = index_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 ? static_cast<const int64_t*>(index_data)[p]
                                                                        : static_cast<const int32_t*>(index_data)[p];
      if (index < 0) index += shape[axis];
      if (index < 0 || index >= shape[axis]) throw std::runtime_error("aot2onnx fused ScatterScale: an index out of range");
      int64_t target = 0, offset = 0;
      for (int64_t d = 0; d < rank; ++d) {
        const int64_t c = d == axis ? index : coord[d];
        target = target * shape[d] + c;
        offset += c * factor_stride[d];
      }
      out[target] = mul(update[p], f[offset]);
      for (int64_t d = rank; d-- > 0;) {  // the next position in the indices, row-major
        if (++coord[d] < index_shape[d]) break;
        coord[d] = 0;
      }
    }
  }

  // row[j] = value(j) for j < n, in blocks of a length the compiler knows (GCC's -O2 vectorizes only such loops:
  // element by element, the fill took 88 us at [256, 1024] where ONNX Runtime's two nodes took 64).
  template <typename T, typename F>
  static void Fill(T* __restrict row, int64_t n, F value) {
    constexpr int64_t kBlock = 256;
    int64_t j = 0;
    for (; j + kBlock <= n; j += kBlock) {
      for (int64_t i = 0; i < kBlock; ++i) row[j + i] = value(j + i);
    }
    for (; j < n; ++j) row[j] = value(j);
  }

  // The data's buffer holds zero bytes (+0.0): checked on the first run that sees the buffer.
  void CheckZeros(const void* buffer, int64_t bytes) {
    if (checked_.load(std::memory_order_acquire) == buffer) return;
    const unsigned char* b = static_cast<const unsigned char*>(buffer);
    for (int64_t i = 0; i < bytes; ++i) {
      if (b[i] != 0) throw std::runtime_error("aot2onnx fused ScatterScale: the scatter's data is not +0.0 throughout");
    }
    checked_.store(buffer, std::memory_order_release);
  }

  int64_t axis_;
  bool factor_first_;
  std::atomic<const void*> checked_{nullptr};
};
struct ScatterScale : FusedOp<ScatterScale, ScatterScaleKernel> {
  static constexpr const char* kName = "ScatterScale";
  static constexpr size_t kInputs = 4, kRequired = 4;
  static constexpr std::array<size_t, 1> kLike{0};
};

std::atomic<const OrtApiBase*> api_base_seen{nullptr};

}  // namespace

// The API base ONNX Runtime handed RegisterCustomOps (null before any session registered the library):
// native_run.cc's sessions use the same onnxruntime.
const OrtApiBase* aot2onnx_api_base() { return api_base_seen.load(); }

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  api_base_seen.store(api_base);
  static ThresholdBackward threshold;
  static GeluBackward gelu;
  static HardswishBackward hardswish;
  static SiluBackward silu;
  static TanhBackward tanh_op;
  static SigmoidBackward sigmoid;
  static SoftmaxBackward softmax;
  static LogSoftmaxBackward log_softmax;
  static LayerNormBackward layer_norm;
  static BatchNormTraining batch_norm;
  static BatchNormBackward batch_norm_backward;
  static GroupNormBackward group_norm_backward;
  static EmbeddingDenseBackward embedding_dense_backward;
  static Softmax softmax_forward;
  static LogSoftmax log_softmax_forward;
  static LayerNorm layer_norm_forward;
  static Where where;
  static ConvolutionBackward convolution_backward;
  static MaxPoolWithIndices max_pool_with_indices;
  static Mm mat_mul;
  static Sum sum;
  static SafeSoftmax safe_softmax;
  static Gelu gelu_forward;
  static Hardswish hardswish_forward;
  static Hardsigmoid hardsigmoid_forward;
  static HardsigmoidBackward hardsigmoid_backward;
  static HardtanhBackward hardtanh_backward;
  static Transpose transpose;
  static Elementwise elementwise;
  static ScatterScale scatter_scale;
  static Ort::CustomOpDomain domain{kDomain};
  static bool added = [] {
    for (OrtCustomOp* op : std::initializer_list<OrtCustomOp*>{&threshold, &gelu, &hardswish, &silu, &tanh_op, &sigmoid,
                                                               &softmax, &log_softmax, &layer_norm, &batch_norm,
                                                               &batch_norm_backward, &group_norm_backward,
                                                               &embedding_dense_backward, &softmax_forward,
                                                               &log_softmax_forward, &layer_norm_forward, &where,
                                                               &convolution_backward, &max_pool_with_indices, &mat_mul,
                                                               &sum, &safe_softmax, &gelu_forward, &hardswish_forward,
                                                               &hardsigmoid_forward, &hardsigmoid_backward,
                                                               &hardtanh_backward, &transpose, &elementwise,
                                                               &scatter_scale}) {
      domain.Add(op);
    }
    return true;
  }();
  (void)added;
  try {
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
