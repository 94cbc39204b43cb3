// aot2onnx's fused training kernels: ONNX Runtime custom ops (domain "aot2onnx.fused") that run ATen's own
// CPU kernels on ONNX Runtime's buffers. A backward op that the standard lowering spells as a chain of ONNX
// nodes (a ReLU gradient as LessOrEqual, Where; a softmax gradient as Mul, ReduceSum, Sub, Mul; a layer norm's
// as two dozen) becomes one node here, and its values are eager's bit for bit, since eager runs the same
// kernel, on the same number of threads (ATen's parallel_for, torch.get_num_threads()).
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
#include <ATen/ops/_softmax_backward_data.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/embedding_dense_backward.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/hardswish_backward.h>
#include <ATen/ops/_native_batch_norm_legit.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/native_group_norm_backward.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <ATen/ops/sigmoid_backward.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/tanh_backward.h>
#include <ATen/ops/threshold_backward.h>
#include <c10/util/Optional.h>

#include <array>
#include <cstdlib>
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

// ONNX Runtime's input `index` as an ATen tensor on the same memory (contiguous: ONNX tensors have no
// strides); nullopt for an optional input that is absent.
std::optional<at::Tensor> Input(Ort::KernelContext& ctx, size_t index) {
  if (index >= ctx.GetInputCount()) return std::nullopt;
  Ort::ConstValue value = ctx.GetInput(index);
  if (!value) return std::nullopt;
  auto info = value.GetTensorTypeAndShapeInfo();
  return at::from_blob(const_cast<void*>(value.GetTensorRawData()), info.GetShape(),
                       at::TensorOptions().dtype(ScalarTypeOf(info.GetElementType())));
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

// A kernel whose exceptions (ATen's checks, ONNX Runtime's) come back to ONNX Runtime as a failed status.
template <typename Kernel>
struct Guarded : Kernel {
  using Kernel::Kernel;
  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      // No autograd (the tensors are ONNX Runtime's buffers) and no profiler records: the op is ONNX Runtime's
      // node, timed by ONNX Runtime's profiler, not compute torch ran (aot2onnx.testing's check of that).
      c10::InferenceMode inference_mode;
      at::RecordFunctionGuard no_records(false);
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
      OrtCustomOp::InferOutputShapeFn = &Op::InferOutputs;
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
    return index < Op::kRequired ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const {
    if constexpr (requires { Op::kOutputs; }) {
      return Op::kOutputs;
    } else {
      return Op::kLike.size();
    }
  }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
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
#undef AOT2ONNX_BINARY_GRADIENT

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
  static OrtStatusPtr InferOutputs(const OrtCustomOp*, OrtShapeInferContext* context) {
    try {
      Ort::ShapeInferContext ctx(&Ort::GetApi(), context);
      OrtTensorTypeAndShapeInfo* grad = nullptr;  // owned by the context
      Ort::ThrowOnError(Ort::GetApi().ShapeInferContext_GetInputTypeShape(context, 0, &grad));
      ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      Ort::ThrowOnError(Ort::GetApi().GetTensorElementType(grad, &type));
      const auto& shape = ctx.GetInputShape(0);
      if (shape.empty()) throw std::runtime_error("aot2onnx fused EmbeddingDenseBackward: a 0-d grad_output");
      return ctx.SetOutputShape(0, {ctx.GetAttrInt("num_weights"), shape.back()}, type).release();
    } catch (const std::exception& e) {
      return Failure(e.what());
    }
  }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
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
  static Ort::CustomOpDomain domain{kDomain};
  static bool added = [] {
    for (OrtCustomOp* op : std::initializer_list<OrtCustomOp*>{&threshold, &gelu, &hardswish, &silu, &tanh_op, &sigmoid,
                                                               &softmax, &log_softmax, &layer_norm, &batch_norm,
                                                               &batch_norm_backward, &group_norm_backward,
                                                               &embedding_dense_backward}) {
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
