// Rethrows the exception being handled with `note` added to its message, its type kept (so its mapping to a
// Python exception, and an IoError's errno, stay). Only inside a catch block.
#pragma once

#include <new>
#include <stdexcept>
#include <string>

#include "embedcore/embedcore.h"

namespace embedcore::checkpoint {

[[noreturn]] inline void RethrowWithNote(const std::string& note) {
  try {
    throw;
  } catch (const Interrupted&) {
    throw;  // (the host raises its own error: KeyboardInterrupt)
  } catch (const IoError& e) {
    throw IoError(e.what() + note, e.error_number());
  } catch (const CheckpointError& e) {
    throw CheckpointError(e.what() + note);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(e.what() + note);
  } catch (const OutOfRange& e) {
    throw OutOfRange(e.what() + note);
  } catch (const TypeMismatch& e) {
    throw TypeMismatch(e.what() + note);
  } catch (const NotCompiled& e) {
    throw NotCompiled(e.what() + note);
  } catch (const std::bad_alloc& e) {
    throw OutOfMemory(e.what() + note);
  } catch (const std::exception& e) {
    throw std::runtime_error(e.what() + note);
  }
}

}  // namespace embedcore::checkpoint
