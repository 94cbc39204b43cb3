// A CPU graph's run with no Python per tensor: torch operators (namespace aot2onnx_native) that open an ONNX
// Runtime session through its C API and run it on a list of torch tensors, returning the outputs as torch
// tensors on ONNX Runtime's own memory. Python's one-call run (one_call.py) filled an OrtValueVector from lists
// and made a DLPack capsule per output: a graph of 45 inputs and 45 outputs took 87 us a call there, 58 us here
// (native_run.py). One operator call takes the list, and each tensor costs an OrtValue made in C++.
//
// Part of the fused kernels' library (fused.py builds both sources into it), which ONNX Runtime hands its API
// when a session registers the library: the sessions here use that API, of the onnxruntime already in the
// process, and register the same custom ops by calling RegisterCustomOps as ONNX Runtime would.

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base);
const OrtApiBase* aot2onnx_api_base();  // fused_ops.cc: the API base ONNX Runtime handed RegisterCustomOps

namespace {

// The API fused_ops.cc's RegisterCustomOps set (Ort::InitApi) before it noted the API base.
const OrtApi& api() {
  if (aot2onnx_api_base() == nullptr) {
    throw std::runtime_error("aot2onnx native run: ONNX Runtime has not loaded the library in this process yet");
  }
  return Ort::GetApi();
}

void check(OrtStatus* status) {
  if (status == nullptr) return;
  std::string message = api().GetErrorMessage(status);
  api().ReleaseStatus(status);
  throw std::runtime_error(message);
}

ONNXTensorElementDataType onnx_type(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case c10::ScalarType::Double: return ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE;
    case c10::ScalarType::Half: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    case c10::ScalarType::BFloat16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
    case c10::ScalarType::Long: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    case c10::ScalarType::Int: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case c10::ScalarType::Short: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16;
    case c10::ScalarType::Char: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    case c10::ScalarType::Byte: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    case c10::ScalarType::Bool: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    default:
      throw std::runtime_error(std::string("aot2onnx native run: no ONNX type for torch's ") + c10::toString(dtype));
  }
}

c10::ScalarType torch_type(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return c10::ScalarType::Float;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return c10::ScalarType::Double;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return c10::ScalarType::Half;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return c10::ScalarType::BFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return c10::ScalarType::Long;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return c10::ScalarType::Int;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return c10::ScalarType::Short;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return c10::ScalarType::Char;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return c10::ScalarType::Byte;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return c10::ScalarType::Bool;
    default:
      throw std::runtime_error("aot2onnx native run: ONNX Runtime returned an output of element type " +
                               std::to_string(static_cast<int>(type)) + ", which torch has no dtype for");
  }
}

// One session and the names it runs with.
struct Session {
  OrtSession* session = nullptr;
  OrtMemoryInfo* cpu = nullptr;
  std::vector<std::string> input_names, output_names;
  std::vector<const char*> inputs, outputs;  // into the strings above

  ~Session() {
    if (session != nullptr) api().ReleaseSession(session);
    if (cpu != nullptr) api().ReleaseMemoryInfo(cpu);
  }
};

std::mutex registry_lock;
std::map<int64_t, std::shared_ptr<Session>> registry;
int64_t next_handle = 1;

std::shared_ptr<Session> find(int64_t handle) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto it = registry.find(handle);
  if (it == registry.end()) throw std::runtime_error("aot2onnx native run: no session " + std::to_string(handle));
  return it->second;
}

OrtEnv* environment() {
  // ONNX Runtime keeps one environment per process: CreateEnv returns the one Python's binding made (with its
  // registered allocators, the CPU arena that use_env_allocators shares), counting one more reference.
  static OrtEnv* env = [] {
    OrtEnv* made = nullptr;
    check(api().CreateEnv(ORT_LOGGING_LEVEL_WARNING, "aot2onnx", &made));
    return made;
  }();
  return env;
}

// open(model, intra, inter, level, mode, deterministic, config, fused, inputs, outputs, optimized): the session of the
// model's bytes (a uint8 tensor) with the options of runtime/session.py's session_options: intra-op and
// inter-op threads, graph optimization level (ONNX Runtime's number), execution mode, deterministic compute,
// the config entries as key, value, key, value..., and the fused kernels' ops where fused is true. Memory
// patterns stay off, as there. ``optimized``: where ONNX Runtime writes the optimized model ("": nowhere).
// Returns a handle.
int64_t open_session(const at::Tensor& model, int64_t intra, int64_t inter, int64_t level, int64_t mode,
                     bool deterministic, std::vector<std::string> config, bool fused,
                     std::vector<std::string> input_names, std::vector<std::string> output_names,
                     std::string optimized) {
  if (model.scalar_type() != c10::ScalarType::Byte || !model.is_contiguous() || !model.is_cpu()) {
    throw std::runtime_error("aot2onnx native run: the model goes in as a contiguous CPU uint8 tensor");
  }
  if (config.size() % 2 != 0) throw std::runtime_error("aot2onnx native run: config entries go in pairs");
  const OrtApi& ort = api();
  OrtSessionOptions* options = nullptr;
  check(ort.CreateSessionOptions(&options));
  std::unique_ptr<OrtSessionOptions, void (*)(OrtSessionOptions*)> owned(
      options, [](OrtSessionOptions* o) { api().ReleaseSessionOptions(o); });
  check(ort.SetIntraOpNumThreads(options, static_cast<int>(intra)));
  check(ort.SetInterOpNumThreads(options, static_cast<int>(inter)));
  check(ort.SetSessionGraphOptimizationLevel(options, static_cast<GraphOptimizationLevel>(level)));
  check(ort.SetSessionExecutionMode(options, static_cast<ExecutionMode>(mode)));
  check(ort.SetDeterministicCompute(options, deterministic));
  check(ort.DisableMemPattern(options));
  for (size_t k = 0; k < config.size(); k += 2) {
    check(ort.AddSessionConfigEntry(options, config[k].c_str(), config[k + 1].c_str()));
  }
  if (!optimized.empty()) check(ort.SetOptimizedModelFilePath(options, optimized.c_str()));
  if (fused) check(RegisterCustomOps(options, aot2onnx_api_base()));
  auto made = std::make_shared<Session>();
  check(ort.CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &made->cpu));
  check(ort.CreateSessionFromArray(environment(), model.data_ptr(), static_cast<size_t>(model.numel()), options,
                                   &made->session));
  made->input_names = std::move(input_names);
  made->output_names = std::move(output_names);
  for (const auto& name : made->input_names) made->inputs.push_back(name.c_str());
  for (const auto& name : made->output_names) made->outputs.push_back(name.c_str());
  std::lock_guard<std::mutex> guard(registry_lock);
  registry[next_handle] = std::move(made);
  return next_handle++;
}

void close_session(int64_t handle) {
  std::shared_ptr<Session> closing;  // released outside the lock: a run in flight keeps its own reference
  {
    std::lock_guard<std::mutex> guard(registry_lock);
    auto it = registry.find(handle);
    if (it == registry.end()) return;
    closing = std::move(it->second);
    registry.erase(it);
  }
}

struct Values {
  std::vector<OrtValue*> values;
  explicit Values(size_t n) : values(n, nullptr) {}
  ~Values() {
    for (OrtValue* v : values) {
      if (v != nullptr) api().ReleaseValue(v);
    }
  }
};

// run(handle, inputs): the session's outputs for inputs given in its input names' order. ONNX Runtime reads a
// contiguous CPU tensor's memory in place; another is copied first, as Python's one-call run does (a strided
// view made contiguous, a 0-d tensor from another device brought to the CPU, as torch allows a scalar beside
// CPU tensors), so that Python need not look at every tensor before the call. An output keeps its OrtValue,
// and so ONNX Runtime's memory, alive until torch frees the tensor.
std::vector<at::Tensor> run(int64_t handle, const std::vector<at::Tensor>& inputs) {
  std::shared_ptr<Session> s = find(handle);
  const OrtApi& ort = api();
  if (inputs.size() != s->inputs.size()) {
    throw std::runtime_error("aot2onnx native run: " + std::to_string(inputs.size()) + " inputs for a session of " +
                             std::to_string(s->inputs.size()));
  }
  static char empty = 0;  // an address for a tensor with no elements (ONNX Runtime refuses a null one)
  Values in(inputs.size());
  std::vector<int64_t> dims;
  std::vector<at::Tensor> copies;  // inputs copied to a contiguous CPU tensor, alive until the run ends
  for (size_t k = 0; k < inputs.size(); ++k) {
    const at::Tensor* given = &inputs[k];
    if (!given->is_cpu() || !given->is_contiguous()) {
      if (!given->is_cpu() && given->dim() != 0) {
        throw std::runtime_error("aot2onnx native run: input " + s->input_names[k] + " is on " +
                                 given->device().str() + ", the session's are on the CPU");
      }
      copies.reserve(inputs.size());  // no reallocation: the pointers taken below stay valid
      copies.push_back(given->to(at::kCPU).contiguous());
      given = &copies.back();
    }
    const at::Tensor& t = *given;
    dims.assign(t.sizes().begin(), t.sizes().end());
    void* data = t.numel() == 0 || t.data_ptr() == nullptr ? static_cast<void*>(&empty) : t.data_ptr();
    check(ort.CreateTensorWithDataAsOrtValue(s->cpu, data, t.nbytes(), dims.data(), dims.size(),
                                             onnx_type(t.scalar_type()), &in.values[k]));
  }
  Values out(s->outputs.size());
  check(ort.Run(s->session, nullptr, s->inputs.data(), in.values.data(), in.values.size(), s->outputs.data(),
                s->outputs.size(), out.values.data()));
  std::vector<at::Tensor> results;
  results.reserve(out.values.size());
  for (OrtValue*& value : out.values) {
    ONNXTensorElementDataType type;
    const int64_t* shape = nullptr;
    size_t rank = 0;
    check(ort.GetTensorElementTypeAndShapeDataReference(value, &type, &shape, &rank));
    std::vector<int64_t> sizes(shape, shape + rank);
    auto options = at::TensorOptions().dtype(torch_type(type)).device(at::kCPU);
    void* data = nullptr;
    check(ort.GetTensorMutableData(value, &data));
    int64_t numel = 1;
    for (int64_t d : sizes) numel *= d;
    if (numel == 0 || data == nullptr) {
      results.push_back(at::empty(sizes, options));
      continue;
    }
    OrtValue* owned = value;
    value = nullptr;  // the tensor's deleter releases it from here on
    results.push_back(at::from_blob(data, sizes, [owned](void*) { api().ReleaseValue(owned); }, options));
  }
  return results;
}

}  // namespace

// Registers the operators (namespace aot2onnx_native) when Python asks (native_run.py), not when the library is
// loaded: a registration that fails (the namespace taken, by another copy of the library say) is an error
// message for Python, where at load time it would end the process. Returns null, or the error (kept alive).
extern "C" __attribute__((visibility("default"))) const char* aot2onnx_register_native_ops() {
  static std::mutex lock;
  static std::unique_ptr<torch::Library> library;
  static std::string error;
  std::lock_guard<std::mutex> guard(lock);
  if (library) return nullptr;
  try {
    auto made = std::make_unique<torch::Library>(torch::Library::DEF, "aot2onnx_native", std::nullopt, __FILE__,
                                                 __LINE__);
    made->def("open(Tensor model, int intra, int inter, int level, int mode, bool deterministic, str[] config, "
              "bool fused, str[] inputs, str[] outputs, str optimized='') -> int",
              &open_session);
    made->def("close(int handle) -> ()", &close_session);
    made->def("run(int handle, Tensor[] inputs) -> Tensor[]", &run);
    library = std::move(made);
    return nullptr;
  } catch (const std::exception& e) {
    error = e.what();
    return error.c_str();
  }
}
