// ScopedEnv: one environment variable set or unset for a test's scope (the gpu/ knobs are read
// from the environment), restored to the value it had before, so a knob the caller set (the
// sanitizer script's, say) survives the test.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

class ScopedEnv {
 public:
  explicit ScopedEnv(const char* name) : name_(name) {
    if (const char* v = std::getenv(name)) prev_ = v;
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() { set(prev_ ? prev_->c_str() : nullptr); }
  // Sets the variable to v, or unsets it (v null).
  void set(const char* v) const {
    if (v) {
      setenv(name_, v, 1);
    } else {
      unsetenv(name_);
    }
  }
  const char* name() const { return name_; }

 private:
  const char* name_;
  std::optional<std::string> prev_;
};
