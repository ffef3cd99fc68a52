// The eager fused Linear's forward and backward in C++ (forge_core.native_hooks): the GEMM below autograd
// and one autograd node of its own (FusedLinearBackward) that computes dX and the bias gradient as torch's
// nodes would, then the update. Where a weight's update was recorded as a CUDA graph
// (forge_core.update_graphs) and its inputs lie where the recording's did, the node replays the graph from
// the autograd thread without taking the GIL; every other update calls the Python update it was given, as
// the Python hook would.
//
// Why: an eager step at batch 1 is bound by the host, and a Python hook costs each fused layer the
// interpreter's entry, the optimizer's bookkeeping and the key check (~40 us a layer inside real steps on
// an H200 host) where torch's own weight-gradient GEMM costs its C++ node a few.
//
// The same replay serves torch.compile's backward: a kernel of the operator forge::update_weight_
// (forge_core.traced) registered here for CUDA tensors replays the recording where the operator was given
// its owner's own tensors, and runs the operator's Python body otherwise.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torch::autograd {
// torch's node deleter, where tensors hold their grad_fn by shared_ptr (older torch): declared again for the
// branch of new_node that names it, which a torch holding nodes by intrusive_ptr never instantiates.
TORCH_API void deleteNode(Node* function);
}  // namespace torch::autograd
using torch::autograd::variable_list;

namespace {

// The CUDA driver's graph launch and capture query, looked up in the driver torch loaded (no CUDA
// headers, no link to a CUDA runtime: the extension builds against a CPU torch too).
using GraphLaunch = int (*)(void* graph_exec, void* stream);
using StreamIsCapturing = int (*)(void* stream, int* status);
using CopyAsync = int (*)(uint64_t destination, uint64_t source, size_t bytes, void* stream);

struct Driver {
  GraphLaunch launch = nullptr;
  StreamIsCapturing capturing = nullptr;
  CopyAsync copy = nullptr;  // device to device
};

Driver& driver() {
  static Driver found;
  if (found.launch == nullptr) {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (library != nullptr) {
      found.capturing = reinterpret_cast<StreamIsCapturing>(dlsym(library, "cuStreamIsCapturing"));
      found.launch = reinterpret_cast<GraphLaunch>(dlsym(library, "cuGraphLaunch"));
      found.copy = reinterpret_cast<CopyAsync>(dlsym(library, "cuMemcpyDtoDAsync_v2"));
    }
  }
  return found;
}

std::atomic<int64_t> replays_since_reset{0};
// The host nanoseconds those replays took (from the match to the launch's return): what a profile reports per
// replay, where no Python runs to be timed.
std::atomic<int64_t> replay_nanoseconds_since_reset{0};

// Whether recorded updates may replay without Python: the optimizer opens it once its device scalars are
// current for the step (a Python update checked them) and closes it at step(), zero_grad() and whenever
// its recordings or states change.
struct Gate {
  std::atomic<bool> open{false};
};

// Where a recorded update's inputs lay (addresses, shapes, strides, dtypes) and the weight's address. A
// staged input (forge_core.update_graphs.STAGED_BYTES) is read by the recording from its staging view, into
// which a replay copies it first: any address of its layout matches, on the stream whose buffer it is.
struct Entry {
  int64_t id = 0;
  const void* first = nullptr;
  const void* second = nullptr;
  const void* weight = nullptr;
  std::vector<int64_t> first_sizes, first_strides, second_sizes, second_strides;
  at::ScalarType first_dtype = at::kFloat, second_dtype = at::kFloat;
  std::vector<const void*> written;  // the owner's states (traced.written_tensors) the recording writes
  const void* scalars = nullptr;      // the group's device scalars it reads (null: none)
  void* graph_exec = nullptr;  // cudaGraphExec_t of a torch.cuda.CUDAGraph, or null: stand_in replays it
  py::object stand_in;         // a Python replay (a test's stand-in for a graph); held with the GIL
  at::Tensor staged_first, staged_second;  // the staging views the recording reads (undefined: the input itself)
  const void* stream = nullptr;             // the stream of the staging buffers (staged entries only)

  bool matches(const at::Tensor& a, const at::Tensor& b, const void* weight_now, const void* stream_now) const {
    const bool staged = staged_first.defined() || staged_second.defined();
    return (staged_first.defined() || a.data_ptr() == first) && (staged_second.defined() || b.data_ptr() == second) &&
           (!staged || stream_now == stream) && weight_now == weight &&
           a.scalar_type() == first_dtype && b.scalar_type() == second_dtype &&
           a.sizes().equals(first_sizes) && a.strides().equals(first_strides) &&
           b.sizes().equals(second_sizes) && b.strides().equals(second_strides);
  }

  // Copy the staged inputs where the recording reads them, on the current stream, before its launch: on a
  // CUDA stream (`on_cuda`; the legacy default stream's handle is null) by the driver's asynchronous copy (a
  // match has the recording's contiguous layout), a few microseconds of the host fewer than a tensor copy
  // through the dispatcher, once or twice per replay.
  void stage(const at::Tensor& a, const at::Tensor& b, bool on_cuda, void* cuda_stream) const {
    stage_one(staged_first, a, on_cuda, cuda_stream);
    stage_one(staged_second, b, on_cuda, cuda_stream);
  }

  static void stage_one(const at::Tensor& staging, const at::Tensor& input, bool on_cuda, void* cuda_stream) {
    if (!staging.defined()) {
      return;
    }
    CopyAsync copy = driver().copy;
    if (on_cuda && copy != nullptr && input.is_contiguous()) {
      const size_t bytes = static_cast<size_t>(input.numel()) * input.element_size();
      int error = copy(reinterpret_cast<uint64_t>(staging.data_ptr()), reinterpret_cast<uint64_t>(input.data_ptr()),
                       bytes, cuda_stream);
      TORCH_CHECK(error == 0, "cuMemcpyDtoDAsync of a staged FORGE update input failed with CUDA error ", error);
      return;
    }
    at::NoGradGuard no_grad;
    staging.copy_(input);
  }
};

// What a compiled backward's operator call hands its update besides (x, dY): the weight, the states and the
// scalars buffer. A recording replays for it only where these are the ones it recorded (the compiler
// re-inplaced the operator); functionalization's copies of them go to the Python body.
struct TracedArguments {
  const at::Tensor& weight;
  const c10::List<at::Tensor>& written;
  const std::optional<at::Tensor>& scalars;

  bool recorded_by(const Entry& entry) const {
    if (weight.data_ptr() != entry.weight || written.size() != entry.written.size()) {
      return false;
    }
    for (size_t i = 0; i < entry.written.size(); ++i) {
      if (written.get(i).data_ptr() != entry.written[i]) {
        return false;
      }
    }
    const void* given = (scalars.has_value() && scalars->defined()) ? scalars->data_ptr() : nullptr;
    return given == entry.scalars;
  }
};

std::vector<int64_t> as_vector(at::IntArrayRef values) { return std::vector<int64_t>(values.begin(), values.end()); }

// One fused weight's native side: its recorded updates, its backward count since the last step (what
// FusedWeight.micro_batches reads) and the Python update every other call runs.
struct Slot {
  std::shared_ptr<Gate> gate;
  at::Tensor weight;
  py::object update;
  std::mutex lock;
  std::vector<Entry> entries;
  std::atomic<int64_t> count{0};
  std::atomic<int64_t> replays{0};  // this weight's replays here, ever: UpdateGraphs reads them as replays of its own

  Slot(std::shared_ptr<Gate> gate_, at::Tensor weight_, py::object update_)
      : gate(std::move(gate_)), weight(std::move(weight_)), update(std::move(update_)) {}

  ~Slot() {
    // The last reference can go on the autograd thread (a hook outliving the optimizer): Python objects
    // are released with the GIL. Once the interpreter is finalizing (a script that ends with its optimizer
    // still referenced: its module globals go after Py_IsInitialized() turns false) they are let go
    // unreleased, as the process ends: a reference dropped there would abort it.
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      entries.clear();
      update = py::object();
      return;
    }
    for (Entry& entry : entries) {
      entry.stand_in.release();
    }
    update.release();
  }

  void add(int64_t id, const at::Tensor& first, const at::Tensor& second, int64_t graph_exec, py::object stand_in,
           const std::vector<at::Tensor>& written, const std::optional<at::Tensor>& scalars,
           const std::optional<at::Tensor>& staged_first, const std::optional<at::Tensor>& staged_second,
           int64_t stream) {
    Entry entry;
    entry.id = id;
    entry.first = first.data_ptr();
    entry.second = second.data_ptr();
    entry.weight = weight.data_ptr();
    entry.first_sizes = as_vector(first.sizes());
    entry.first_strides = as_vector(first.strides());
    entry.second_sizes = as_vector(second.sizes());
    entry.second_strides = as_vector(second.strides());
    entry.first_dtype = first.scalar_type();
    entry.second_dtype = second.scalar_type();
    for (const at::Tensor& tensor : written) {
      entry.written.push_back(tensor.data_ptr());
    }
    entry.scalars = (scalars.has_value() && scalars->defined()) ? scalars->data_ptr() : nullptr;
    entry.graph_exec = reinterpret_cast<void*>(graph_exec);
    entry.stand_in = std::move(stand_in);
    entry.staged_first = staged_first.value_or(at::Tensor());
    entry.staged_second = staged_second.value_or(at::Tensor());
    entry.stream = reinterpret_cast<const void*>(stream);
    TORCH_CHECK(id != 0, "a recorded update's id is nonzero");
    TORCH_CHECK(entry.graph_exec != nullptr || !entry.stand_in.is_none(),
                "a recorded update needs a CUDA graph exec handle or a Python replay");
    if (entry.graph_exec != nullptr) {
      TORCH_CHECK(driver().launch != nullptr, "the CUDA driver's cuGraphLaunch was not found in this process");
    }
    std::lock_guard<std::mutex> guard(lock);
    entries.push_back(std::move(entry));
  }

  void remove(int64_t id) {
    std::lock_guard<std::mutex> guard(lock);
    for (auto it = entries.begin(); it != entries.end(); ++it) {
      if (it->id == id) {
        entries.erase(it);
        return;
      }
    }
  }

  void clear() {
    std::lock_guard<std::mutex> guard(lock);
    entries.clear();
  }

  size_t size() {
    std::lock_guard<std::mutex> guard(lock);
    return entries.size();
  }

  // Replay the recording of (first, second) where the gate is open, this is the step's first backward of
  // the weight and no capture runs on the current stream (and, for a compiled backward's call, `traced`
  // names the recorded tensors); false (nothing run) otherwise.
  bool try_replay(const at::Tensor& first, const at::Tensor& second, const TracedArguments* traced = nullptr) {
    if (!gate->open.load(std::memory_order_acquire) || count.load() != 0) {
      return false;
    }
    const auto started = std::chrono::steady_clock::now();
    int64_t stand_in_id = 0;
    void* stream = nullptr;
    if (first.is_cuda()) {
      stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(first.device()).native_handle();
    }
    {
      std::lock_guard<std::mutex> guard(lock);
      const Entry* found = nullptr;
      const void* weight_now = weight.data_ptr();
      for (const Entry& entry : entries) {
        if (entry.matches(first, second, weight_now, stream) && (traced == nullptr || traced->recorded_by(entry))) {
          found = &entry;
          break;
        }
      }
      if (found == nullptr) {
        return false;
      }
      if (found->graph_exec == nullptr) {
        found->stage(first, second, false, nullptr);
        stand_in_id = found->id;
      } else {
        Driver& cuda = driver();
        int capture_status = 0;
        if (cuda.capturing == nullptr || cuda.capturing(stream, &capture_status) != 0 || capture_status != 0) {
          return false;  // a capture around the backward: the Python update launches into it
        }
        found->stage(first, second, true, stream);
        int error = cuda.launch(found->graph_exec, stream);
        TORCH_CHECK(error == 0, "cuGraphLaunch of a recorded FORGE update failed with CUDA error ", error);
      }
    }
    if (stand_in_id != 0 && !replay_stand_in(stand_in_id)) {
      return false;
    }
    count.fetch_add(1);
    replays.fetch_add(1);
    replays_since_reset.fetch_add(1);
    replay_nanoseconds_since_reset.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - started).count());
    return true;
  }

  // A Python replay runs with the GIL and without the lock (Python takes the GIL, then the lock).
  bool replay_stand_in(int64_t id) {
    py::gil_scoped_acquire gil;
    py::object stand_in;
    {
      std::lock_guard<std::mutex> guard(lock);
      for (const Entry& entry : entries) {
        if (entry.id == id) {
          stand_in = entry.stand_in;
        }
      }
    }
    if (!stand_in || stand_in.is_none()) {
      return false;
    }
    try {
      stand_in();
    } catch (py::error_already_set& error) {
      rethrow(error);
    }
    return true;
  }

  static void rethrow(py::error_already_set& error) {
    error.restore();
    python_error raised;
    raised.persist();
    throw raised;
  }

  void run_in_python(const at::Tensor& first, const at::Tensor& second) {
    py::gil_scoped_acquire gil;
    try {
      update(first, second);
    } catch (py::error_already_set& error) {
      rethrow(error);
    }
  }
};

// A fresh autograd node of type T, held as this torch's tensors hold their grad_fn (a shared_ptr with
// torch's node deleter, or an intrusive_ptr, by torch version).
template <typename T>
auto new_node() {
  using Held = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;
  if constexpr (std::is_same_v<Held, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<T>(new T(), torch::autograd::deleteNode);
  } else {
    return c10::make_intrusive<T>();
  }
}

// The one autograd node of an eager fused Linear (y = x W^T + b; x W + b when `transposed`, transformers'
// Conv1D). Backward: dX and the bias gradient with the ATen calls torch's own nodes of the same GEMM make
// (the same values, bit for bit), from the weight as it was before this layer's update, then the update of
// (x, dY) once: the slot's recorded graph where one matches, else the Python update.
//
// Why one node: torch's GEMM of an N-D input records three (the input's flattening view, the GEMM, the
// output's view) and a post-hook on the GEMM's node is a fourth call; each costs an eager step's host the
// dispatcher's autograd wrapper in the forward and the engine's call in the backward (D131).
struct FusedLinearBackward : torch::autograd::Node {
  torch::autograd::SavedVariable weight;  // the detached alias the GEMM read: version-checked, as torch's is
  at::Tensor held;  // the update's input: the layer's input, or the 2-D copy the GEMM read; released after
  std::shared_ptr<Slot> slot;
  bool transposed = false;
  bool column_major = false;   // the GEMM's 2-D input was column-major (torch's mm backward then transposes)
  bool bias_after_view = false;  // the bias was added to the N-D output (an unflattened input), not in the GEMM
  std::vector<int64_t> input_sizes, bias_sizes;
  int64_t outputs = 0;
  bool ran = false;

  std::string name() const override { return "FusedLinearBackward"; }

  void release_variables() override {
    weight.reset_data();
    held.reset();
  }

  variable_list apply(variable_list&& grads) override {
    const at::Tensor alias = weight.unpack();  // torch's error for a released graph or a weight changed in place
    TORCH_CHECK(!ran, "a fused Linear's graph was run backward twice (retain_graph=True): FORGE updates the weight "
                      "once per forward; run the forward again for another backward");
    ran = true;
    at::Tensor x = std::move(held);
    const at::Tensor& grad = grads[0];
    variable_list result(2);
    at::Tensor grad_output;  // the update's dY: the GEMM's 2-D one, or zeros where no gradient reached the output
    if (grad.defined()) {
      grad_output = grad.reshape({-1, outputs});  // what the output's view node hands the GEMM's
      const at::Tensor mat2 = transposed ? alias : alias.t();
      if (task_should_compute_output(0)) {
        at::Tensor dx = column_major ? mat2.mm(grad_output.t()).t() : grad_output.mm(mat2.t());
        result[0] = dx.sizes().equals(input_sizes) ? dx : dx.reshape(input_sizes);
      }
      if (task_should_compute_output(1)) {
        result[1] = at::sum_to(bias_after_view ? grad : grad_output, bias_sizes);
      }
    } else {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
      shape.push_back(outputs);
      grad_output = at::zeros(shape, x.options());
    }
    const at::Tensor& first = transposed ? grad_output : x;
    const at::Tensor& second = transposed ? x : grad_output;
    if (!slot->try_replay(first, second)) {
      slot->run_in_python(first, second);
    }
    return result;
  }
};

bool column_major(const at::Tensor& matrix) {
  return matrix.stride(0) == 1 && matrix.stride(1) == matrix.size(0);
}

// forge_core.linear.hooked_linear's forward after its global checks (saved-tensor hooks, functorch,
// autocast: the caller's): the GEMM on a detached alias of the weight (x W^T + b; x W + b when `transposed`,
// transformers' Conv1D) with the ATen calls of the Python hooked forward, below autograd, and one
// FusedLinearBackward for its graph. nullopt where that path does not apply (the caller runs the Function).
std::optional<at::Tensor> hooked_forward(const at::Tensor& x, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, std::shared_ptr<Slot> slot,
                                         bool transposed) {
  const bool has_bias = bias.has_value() && bias->defined();
  const at::ScalarType dtype = weight.scalar_type();
  if (x.scalar_type() != dtype || (has_bias && bias->scalar_type() != dtype) || x.dim() < 2) {
    return std::nullopt;
  }
  if (!(x.requires_grad() || (has_bias && bias->requires_grad()))) {
    return std::nullopt;
  }
  if (x._fw_grad(0).defined() || (has_bias && bias->_fw_grad(0).defined())) {
    return std::nullopt;  // forward-mode AD: torch's nodes carry the tangents
  }
  at::Tensor alias = weight.detach();
  // An input at::linear cannot flatten as a view (MLP-Mixer's token mixing reads a transposed one) it
  // multiplies as a flattened copy, adding the bias after the GEMM: the same here.
  const bool unflattened = !transposed && x.dim() > 2 && !x.is_contiguous();
  const int64_t inputs = x.size(-1);
  at::Tensor held = x;
  at::Tensor output;
  bool column = false;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (transposed || unflattened) {
      at::Tensor flat = x.reshape({-1, inputs});
      column = column_major(flat);
      held = flat;
      at::Tensor gemm;
      if (transposed && has_bias) {
        gemm = at::addmm(*bias, flat, alias);
      } else {
        gemm = at::mm(flat, transposed ? alias : alias.t());
      }
      output = gemm;
      if (x.dim() != 2) {
        std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
        shape.push_back(gemm.size(-1));
        output = gemm.view(shape);
      }
      if (unflattened && has_bias) {
        output = at::add(output, *bias);
      }
    } else {
      // at::linear multiplies a 2-D input as it is and a contiguous N-D one as its row-major (-1, Din) view
      column = x.dim() == 2 ? column_major(x) : (inputs == 1 && x.numel() == 1);
      output = at::linear(x, alias, bias);
    }
  }
  auto node = new_node<FusedLinearBackward>();
  node->weight = torch::autograd::SavedVariable(alias, false);
  node->held = std::move(held);
  node->slot = std::move(slot);
  node->transposed = transposed;
  node->column_major = column;
  node->bias_after_view = unflattened;
  node->input_sizes = x.sizes().vec();
  node->outputs = output.size(-1);
  if (has_bias) {
    node->bias_sizes = bias->sizes().vec();
  }
  node->set_next_edges(torch::autograd::collect_next_edges(x, has_bias ? *bias : at::Tensor()));
  torch::autograd::set_history(output, node);
  return output;
}

// The slots of the weights a compiled graph names by integer (forge_core.traced.trace_key).
std::mutex traced_slots_lock;
std::unordered_map<int64_t, std::weak_ptr<Slot>> traced_slots;

void name_slot(int64_t key, const std::shared_ptr<Slot>& slot) {
  std::lock_guard<std::mutex> guard(traced_slots_lock);
  for (auto it = traced_slots.begin(); it != traced_slots.end();) {  // the slots of dropped optimizers
    it = it->second.expired() ? traced_slots.erase(it) : std::next(it);
  }
  traced_slots[key] = slot;
}

std::shared_ptr<Slot> named_slot(int64_t key) {
  std::lock_guard<std::mutex> guard(traced_slots_lock);
  auto found = traced_slots.find(key);
  return found == traced_slots.end() ? nullptr : found->second.lock();
}

// forge::update_weight_(x, grad_output, weight, written, scalars, after, key) for one dispatch key: the
// recorded update replayed where it applies, else the operator's Python body (`body`), as before.
struct TracedUpdateKernel final : c10::OperatorKernel {
  py::object body;

  explicit TracedUpdateKernel(py::object body_) : body(std::move(body_)) {}

  ~TracedUpdateKernel() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      body = py::object();
    } else {
      body.release();  // the interpreter is gone: nothing to release it to
    }
  }

  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    constexpr size_t kArguments = 7;
    auto arguments = torch::jit::last(*stack, kArguments);
    const at::Tensor& first = arguments[0].toTensor();
    const at::Tensor& second = arguments[1].toTensor();
    const at::Tensor& weight = arguments[2].toTensor();
    c10::List<at::Tensor> written = arguments[3].toTensorList();
    std::optional<at::Tensor> scalars = arguments[4].toOptional<at::Tensor>();
    const int64_t key = arguments[6].toInt();
    std::shared_ptr<Slot> slot = named_slot(key);
    TracedArguments traced{weight, written, scalars};
    if (slot == nullptr || !slot->try_replay(first, second, &traced)) {
      py::gil_scoped_acquire gil;
      py::list written_list;
      for (const at::Tensor& tensor : written) {
        written_list.append(py::cast(tensor));
      }
      py::list after;
      for (const at::Tensor& tensor : arguments[5].toTensorList()) {
        after.append(py::cast(tensor));
      }
      py::object scalars_object = scalars.has_value() ? py::cast(*scalars) : py::none();
      try {
        body(first, second, weight, written_list, scalars_object, after, key);
      } catch (py::error_already_set& error) {
        Slot::rethrow(error);
      }
    }
    torch::jit::drop(*stack, kArguments);
  }
};

// Registers TracedUpdateKernel for `dispatch_key` ("CUDA"; "CPU" in tests) while the returned object lives.
struct TracedKernelRegistration {
  std::unique_ptr<torch::Library> library;
};

std::shared_ptr<TracedKernelRegistration> register_traced_kernel(const std::string& dispatch_key, py::object body) {
  auto registration = std::make_shared<TracedKernelRegistration>();
  registration->library = std::make_unique<torch::Library>(
      torch::Library::IMPL, "forge", c10::parseDispatchKey(dispatch_key), __FILE__, __LINE__);
  registration->library->impl(
      "update_weight_", torch::CppFunction::makeFromBoxedFunctor(std::make_unique<TracedUpdateKernel>(std::move(body))));
  return registration;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "FORGE's eager update hook in C++ (forge_core.native_hooks)";
  py::class_<Gate, std::shared_ptr<Gate>>(module, "Gate")
      .def(py::init<>())
      .def_property(
          "open", [](const Gate& gate) { return gate.open.load(); },
          [](Gate& gate, bool value) { gate.open.store(value, std::memory_order_release); });
  py::class_<Slot, std::shared_ptr<Slot>>(module, "Slot")
      .def(py::init<std::shared_ptr<Gate>, at::Tensor, py::object>(), py::arg("gate"), py::arg("weight"),
           py::arg("update"))
      .def("add", &Slot::add, py::arg("id"), py::arg("first"), py::arg("second"), py::arg("graph_exec"),
           py::arg("stand_in"), py::arg("written"), py::arg("scalars"), py::arg("staged_first") = py::none(),
           py::arg("staged_second") = py::none(), py::arg("stream") = 0)
      .def("remove", &Slot::remove, py::arg("id"))
      .def("clear", &Slot::clear)
      .def("__len__", &Slot::size)
      .def_property(
          "count", [](const Slot& slot) { return slot.count.load(); },
          [](Slot& slot, int64_t value) { slot.count.store(value); })
      .def_property_readonly("replays", [](const Slot& slot) { return slot.replays.load(); });
  module.def("hooked_forward", &hooked_forward, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("slot"),
             py::arg("transposed"));
  py::class_<TracedKernelRegistration, std::shared_ptr<TracedKernelRegistration>>(module, "TracedKernelRegistration");
  module.def("register_traced_kernel", &register_traced_kernel, py::arg("dispatch_key"), py::arg("body"));
  module.def("name_slot", &name_slot, py::arg("key"), py::arg("slot"));
  module.def("replays", []() { return replays_since_reset.load(); });
  module.def("replay_seconds", []() { return 1e-9 * static_cast<double>(replay_nanoseconds_since_reset.load()); });
  module.def("reset_replays", []() {
    replays_since_reset.store(0);
    replay_nanoseconds_since_reset.store(0);
  });
}
