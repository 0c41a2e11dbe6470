// prefire::install() when another autograd engine is the process's default
// (as PyTorch's Python engine is inside a Python process): a clear error, and
// the other engine stays. A process of its own, since engines cannot be
// uninstalled.
//
// Not covered here: installing over the base engine (not_installed_test.cpp).

#include <prefire/prefire.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace {

// Stands in for another library's engine: it asks for no saved-tensor hooks.
class OtherEngine final : public torch::autograd::Engine {
 public:
  static torch::autograd::Engine& stub() {
    static auto* engine = new OtherEngine();  // never destroyed, like the engines torch installs
    return *engine;
  }
};

TEST(ForeignEngine, InstallRefusesToReplaceItAndCheckpointSaysSo) {
  torch::autograd::set_default_engine_stub(&OtherEngine::stub);
  try {
    prefire::install();
    FAIL() << "install() replaced another engine";
  } catch (const std::logic_error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("not torch's base engine"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("Python"));
  }
  EXPECT_EQ(&torch::autograd::Engine::get_default_engine(), &OtherEngine::stub()) << "the other engine was replaced";
  EXPECT_FALSE(prefire::is_installed());
  auto x = at::randn({3}).requires_grad_(true);
  EXPECT_THROW(prefire::checkpoint([](const prefire::TensorList& in) { return prefire::TensorList{in[0].sin()}; }, {x}),
               prefire::CheckpointError);
  EXPECT_THROW(prefire::install(), std::logic_error) << "a second call must refuse too";
}

}  // namespace
