"""An LD_PRELOAD fault shim for the tests of the checkpoint code's error
paths: with EMBEDCORE_TEST_FAULTS set, chosen system calls on chosen files
fail with a chosen errno, so that a test can produce what a disk, a full
descriptor table or a signal would (EIO, EMFILE, EINTR, an EACCES that a
test run as root cannot make with file modes).

EMBEDCORE_TEST_FAULTS is a list of rules separated by ';', each
``call:substring:calls:errno``:

- call: open (every open entry point), opendir, rename (either path),
  rename_after (a rename that takes effect, then fails: as one interrupted
  after its work), mkdir, or one on a descriptor: fsync, close, pread
  (matched on the path the descriptor was opened with);
- substring: the rule applies to paths that contain it (ending in '$':
  to paths that end with the rest);
- calls: which of its matching calls fail, 1-based: ``N``, ``N-M`` or ``*``
  (every one);
- errno: the number the call fails with. A failing close closes the
  descriptor first (as Linux's close does on EINTR).

A process run with the shim prints nothing of it; `run` below runs Python
code with it and returns the completed process."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

_SHIM = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_RULES 16
#define MAX_FD 65536
struct rule { char call[16]; char sub[512]; long lo, hi; int err; long seen; };
static struct rule rules[MAX_RULES];
static int nrules = -1;
static char* fd_path[MAX_FD];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void parse(void) {
  nrules = 0;
  const char* spec = getenv("EMBEDCORE_TEST_FAULTS");
  if (spec == NULL) return;
  char buf[4096];
  strncpy(buf, spec, sizeof(buf) - 1);
  buf[sizeof(buf) - 1] = 0;
  char* save = NULL;
  for (char* tok = strtok_r(buf, ";", &save); tok && nrules < MAX_RULES; tok = strtok_r(NULL, ";", &save)) {
    struct rule* r = &rules[nrules];
    char calls[64];
    if (sscanf(tok, "%15[^:]:%511[^:]:%63[^:]:%d", r->call, r->sub, calls, &r->err) != 4) continue;
    if (strcmp(calls, "*") == 0) r->lo = 1, r->hi = -1;
    else if (sscanf(calls, "%ld-%ld", &r->lo, &r->hi) != 2) r->lo = r->hi = atol(calls);
    ++nrules;
  }
}

/* 0, or the errno the call on `path` fails with. */
static int fault(const char* call, const char* path) {
  if (path == NULL) return 0;
  pthread_mutex_lock(&mu);
  if (nrules < 0) parse();
  int err = 0;
  for (int i = 0; i < nrules && !err; ++i) {
    struct rule* r = &rules[i];
    if (strcmp(r->call, call) != 0) continue;
    const size_t len = strlen(r->sub), plen = strlen(path);
    if (len > 0 && r->sub[len - 1] == '$') {  /* a suffix */
      if (plen < len - 1 || strncmp(path + plen - (len - 1), r->sub, len - 1) != 0) continue;
    } else if (strstr(path, r->sub) == NULL) {
      continue;
    }
    const long n = ++r->seen;
    if (n >= r->lo && (r->hi < 0 || n <= r->hi)) err = r->err;
  }
  pthread_mutex_unlock(&mu);
  return err;
}

static void remember(int fd, const char* path) {
  if (fd < 0 || fd >= MAX_FD) return;
  pthread_mutex_lock(&mu);
  free(fd_path[fd]);
  fd_path[fd] = path ? strdup(path) : NULL;
  pthread_mutex_unlock(&mu);
}

static int fd_fault(const char* call, int fd) {
  if (fd < 0 || fd >= MAX_FD) return 0;
  pthread_mutex_lock(&mu);
  char* p = fd_path[fd] ? strdup(fd_path[fd]) : NULL;
  pthread_mutex_unlock(&mu);
  const int err = fault(call, p);
  free(p);
  return err;
}

#define REAL(name, type) static type real; if (!real) real = (type)dlsym(RTLD_NEXT, name)
#define MODE(flags) mode_t mode = 0; \
  if (((flags) & O_CREAT) || ((flags) & O_TMPFILE) == O_TMPFILE) { \
    va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); }
typedef int (*open_fn)(const char*, int, ...);
typedef int (*openat_fn)(int, const char*, int, ...);
typedef int (*open2_fn)(const char*, int);
typedef int (*openat2_fn)(int, const char*, int);

#define OPEN_BODY(call) \
  int e = fault("open", p); \
  if (e) { errno = e; return -1; } \
  int fd = call; \
  remember(fd, p); \
  return fd;

int open(const char* p, int flags, ...) { MODE(flags) REAL("open", open_fn); OPEN_BODY(real(p, flags, mode)) }
int open64(const char* p, int flags, ...) { MODE(flags) REAL("open64", open_fn); OPEN_BODY(real(p, flags, mode)) }
int openat(int d, const char* p, int flags, ...) { MODE(flags) REAL("openat", openat_fn); OPEN_BODY(real(d, p, flags, mode)) }
int openat64(int d, const char* p, int flags, ...) { MODE(flags) REAL("openat64", openat_fn); OPEN_BODY(real(d, p, flags, mode)) }
int __open_2(const char* p, int flags) { REAL("__open_2", open2_fn); OPEN_BODY(real(p, flags)) }
int __open64_2(const char* p, int flags) { REAL("__open64_2", open2_fn); OPEN_BODY(real(p, flags)) }
int __openat_2(int d, const char* p, int flags) { REAL("__openat_2", openat2_fn); OPEN_BODY(real(d, p, flags)) }
int __openat64_2(int d, const char* p, int flags) { REAL("__openat64_2", openat2_fn); OPEN_BODY(real(d, p, flags)) }

DIR* opendir(const char* p) {
  typedef DIR* (*fn)(const char*); REAL("opendir", fn);
  int e = fault("opendir", p);
  if (e) { errno = e; return NULL; }
  return real(p);
}
int rename(const char* a, const char* b) {
  typedef int (*fn)(const char*, const char*); REAL("rename", fn);
  int e = fault("rename", a);
  if (!e) e = fault("rename", b);
  if (e) { errno = e; return -1; }
  int after = fault("rename_after", a);
  if (!after) after = fault("rename_after", b);
  const int rc = real(a, b);
  if (rc == 0 && after) { errno = after; return -1; }
  return rc;
}
int mkdir(const char* p, mode_t m) {
  typedef int (*fn)(const char*, mode_t); REAL("mkdir", fn);
  int e = fault("mkdir", p);
  if (e) { errno = e; return -1; }
  return real(p, m);
}
int fsync(int fd) {
  typedef int (*fn)(int); REAL("fsync", fn);
  int e = fd_fault("fsync", fd);
  if (e) { errno = e; return -1; }
  return real(fd);
}
int close(int fd) {
  typedef int (*fn)(int); REAL("close", fn);
  int e = fd_fault("close", fd);
  remember(fd, NULL);
  int rc = real(fd);
  if (e) { errno = e; return -1; }
  return rc;
}
ssize_t pread(int fd, void* b, size_t n, off_t o) {
  typedef ssize_t (*fn)(int, void*, size_t, off_t); REAL("pread", fn);
  int e = fd_fault("pread", fd);
  if (e) { errno = e; return -1; }
  return real(fd, b, n, o);
}
ssize_t pread64(int fd, void* b, size_t n, off_t o) {
  typedef ssize_t (*fn)(int, void*, size_t, off_t); REAL("pread64", fn);
  int e = fd_fault("pread", fd);
  if (e) { errno = e; return -1; }
  return real(fd, b, n, o);
}
"""


def shim(tmp_path) -> str:
    """Builds the shim into `tmp_path`; skips the test where it cannot be built or preloaded."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the fault shim is an LD_PRELOAD library (Linux, glibc)")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) to build the LD_PRELOAD fault shim")
    src, lib = tmp_path / "faults.c", tmp_path / "faults.so"
    if not lib.exists():
        src.write_text(_SHIM)
        r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl", "-lpthread"],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{cc} could not build the LD_PRELOAD fault shim: {r.stderr[-2000:]}"
    return str(lib)


def run(tmp_path, code: str, faults: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `code` (Python) in a new interpreter with the shim preloaded and
    EMBEDCORE_TEST_FAULTS=`faults`; `args` become sys.argv[1:]."""
    lib = shim(tmp_path)
    env = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0", EMBEDCORE_TEST_FAULTS=faults,
               LD_PRELOAD=" ".join(filter(None, [lib, os.environ.get("LD_PRELOAD")])))
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)
