// One Bind* function per area of the native module `_embedcore`.
#pragma once

#include <nanobind/nanobind.h>

namespace embedcore::bindings {
void BindTable(nanobind::module_& m);
}  // namespace embedcore::bindings
