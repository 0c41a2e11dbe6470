#include <prefire/saved_tensor_meter.h>

#include "hooks/hook_stack.h"
#include <prefire/detail/hooks.h>
#include "memory/storage_census.h"

#include <c10/core/Storage.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <stdexcept>

namespace prefire {
namespace detail {

class MeterContext final : public HookContext, public std::enable_shared_from_this<MeterContext> {
 public:
  std::unique_ptr<PackedTensor> pack(const at::Tensor& tensor) override;

  // See Note [Counting saved bytes] in memory/storage_census.cpp.
  void add(c10::StorageImpl* storage, int64_t nbytes) {
    std::lock_guard<std::mutex> lock(mu_);
    ++saved_;
    if (storage == nullptr) return;
    if (const int64_t counted = census_.add(storage, nbytes)) {
      bytes.add(counted);
      global_held_bytes().add(counted);
    }
  }

  void remove(c10::StorageImpl* storage, int64_t nbytes) noexcept {
    if (storage == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (const int64_t uncounted = census_.remove(storage, nbytes)) {
      bytes.sub(uncounted);
      global_held_bytes().sub(uncounted);
    }
  }

  int64_t saved() const {
    std::lock_guard<std::mutex> lock(mu_);
    return saved_;
  }

  ByteGauge bytes;  // of the storages saved tensors hold now

 private:
  mutable std::mutex mu_;  // guards the fields below
  StorageCensus census_;
  int64_t saved_ = 0;  // tensors
};

namespace {

// Holds the saved tensor (an alias without autograd metadata: an output
// saved by its own node would otherwise hold that node in a cycle; see Note
// [Aliases of recomputed tensors] in checkpoint/recompute.cpp) and repeats autograd's
// version check, which SavedVariable skips for hooked tensors; the alias
// shares the tensor's version counter.
class MeteredTensor final : public PackedTensor {
 public:
  MeteredTensor(std::shared_ptr<MeterContext> meter, const at::Tensor& t)
      : meter_(std::move(meter)),
        tensor_(t.tensor_data()),
        version_(t._version()),
        storage_(is_activation(t) ? t.storage().unsafeGetStorageImpl() : nullptr),
        nbytes_(t.has_storage() ? StorageCensus::nbytes_of(t.storage()) : 0) {
    meter_->add(storage_, nbytes_);
  }
  ~MeteredTensor() override { meter_->remove(storage_, nbytes_); }

  at::Tensor unpack() override {
    TORCH_CHECK(tensor_._version() == version_,
                "one of the variables needed for gradient computation has been modified by an inplace "
                "operation: [", tensor_.toString(), " ", tensor_.sizes(), "] is at version ", tensor_._version(),
                "; expected version ", version_, " instead.");
    return tensor_;
  }

 private:
  std::shared_ptr<MeterContext> meter_;
  at::Tensor tensor_;  // keeps the storage alive, so its address identifies it
  uint32_t version_;
  c10::StorageImpl* storage_;
  int64_t nbytes_;
};

}  // namespace

std::unique_ptr<PackedTensor> MeterContext::pack(const at::Tensor& tensor) {
  return std::make_unique<MeteredTensor>(shared_from_this(), tensor);
}

std::vector<std::unique_ptr<PackedTensor>> count_in_meter(const std::vector<at::Tensor>& tensors) {
  std::vector<std::unique_ptr<PackedTensor>> counted;
  auto* meter = dynamic_cast<MeterContext*>(current_hook_context());
  if (meter == nullptr) return counted;
  counted.reserve(tensors.size());
  for (const at::Tensor& t : tensors) counted.push_back(meter->pack(t));
  return counted;
}

}  // namespace detail

SavedTensorMeter::SavedTensorMeter()
    : context_(std::make_shared<detail::MeterContext>()),
      scope_(std::make_unique<detail::HookContextScope>(context_.get())) {}

SavedTensorMeter::~SavedTensorMeter() { scope_.reset(); }

void SavedTensorMeter::stop() {
  if (scope_ && !scope_->on_this_thread()) {
    throw std::logic_error(
        "prefire::SavedTensorMeter::stop: called on another thread than the one that made the meter; stop it there");
  }
  scope_.reset();
}

int64_t SavedTensorMeter::current_bytes() const { return context_->bytes.current(); }

int64_t SavedTensorMeter::peak_bytes() const { return context_->bytes.peak(); }

int64_t SavedTensorMeter::saved_tensors() const { return context_->saved(); }

}  // namespace prefire
