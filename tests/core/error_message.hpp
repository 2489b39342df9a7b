// Test helper: the message of the mori error a call raises.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "mori/core/errors.hpp"

namespace mori::core::testing {

// Runs fn, expects an ErrorType (a mori::core::Error subclass), and returns its message without
// the file:line prefix; a test failure and "" if fn raises nothing.
template <typename ErrorType, typename Fn>
std::string ErrorMessage(Fn&& fn) {
  try {
    fn();
  } catch (const ErrorType& e) {
    return e.Message();
  }
  ADD_FAILURE() << "expected an error of the tested type; none was raised";
  return "";
}

template <typename Fn>
std::string InvalidUsageMessage(Fn&& fn) {
  return ErrorMessage<InvalidUsageError>(std::forward<Fn>(fn));
}

}  // namespace mori::core::testing
