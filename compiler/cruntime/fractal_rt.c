/* fractal-edge C runtime: backend functions TVM kernels call, and error reporting. */
#include "fractal_rt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FR_ERR_LEN 512
static _Thread_local char fr_error[FR_ERR_LEN];

const char* fr_last_error(void) { return fr_error; }

void fr_set_error(const char* msg) {
  snprintf(fr_error, sizeof fr_error, "%s", msg);
}

/* tvm-ffi: a kernel reports a failed check (shape, dtype, alignment) as message parts. */
void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t n) {
  size_t len = (size_t)snprintf(fr_error, sizeof fr_error, "%s: ", kind ? kind : "Error");
  for (int32_t i = 0; i < n && len < sizeof fr_error - 1; ++i) {
    len += (size_t)snprintf(fr_error + len, sizeof fr_error - len, "%s", parts[i] ? parts[i] : "");
  }
}

void TVMFFIErrorSetRaisedFromCStr(const char* kind, const char* msg) {
  const char* parts[1] = {msg};
  TVMFFIErrorSetRaisedFromCStrParts(kind, parts, 1);
}

int fr_call(fr_packed f, const char* name, fr_any* args, int32_t n) {
  fr_any ret;
  ret.type_index = FR_ANY_NONE;
  ret.zero_padding = 0;
  ret.v.v_int64 = 0;
  if (f(NULL, args, n, &ret) != 0) {
    char buf[FR_ERR_LEN];
    snprintf(buf, sizeof buf, "kernel %s failed: %s", name, fr_error);
    fr_set_error(buf);
    return -1;
  }
  return 0;
}

uint64_t fr_desc_nbytes(const fr_tensor_desc* d) {
  uint64_t n = ((uint64_t)d->dtype.bits * d->dtype.lanes + 7) / 8;
  for (int32_t i = 0; i < d->ndim; ++i) n *= (uint64_t)d->shape[i];
  return n;
}

int fr_check_class_ids(const int64_t* ids, int64_t n, int64_t classes, const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= classes) {
      char buf[FR_ERR_LEN];
      snprintf(buf, sizeof buf, "%s[%lld] = %lld is not a class id in [0, %lld)", what, (long long)i,
               (long long)ids[i], (long long)classes);
      fr_set_error(buf);
      return -1;
    }
  }
  return 0;
}

int fr_check_finite(const void* data, int64_t n, int32_t bits, const char* what) {
  /* By the bit pattern (exponent all ones: Inf or NaN), so -ffast-math cannot fold it away. */
  for (int64_t i = 0; i < n; ++i) {
    int bad;
    if (bits == 16) {
      uint16_t v;
      memcpy(&v, (const char*)data + i * 2, 2);
      bad = (v & 0x7c00u) == 0x7c00u;
    } else if (bits == 32) {
      uint32_t v;
      memcpy(&v, (const char*)data + i * 4, 4);
      bad = (v & 0x7f800000u) == 0x7f800000u;
    } else if (bits == 64) {
      uint64_t v;
      memcpy(&v, (const char*)data + i * 8, 8);
      bad = (v & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
    } else {
      fr_set_error("fr_check_finite: unsupported float width");
      return -1;
    }
    if (bad) {
      char buf[FR_ERR_LEN];
      snprintf(buf, sizeof buf, "%s[%lld] is NaN or infinite", what, (long long)i);
      fr_set_error(buf);
      return -1;
    }
  }
  return 0;
}

/* tvm runtime c_backend_api: scratch memory for kernels that need more than registers. */
void* TVMBackendAllocWorkspace(int device_type, int device_id, uint64_t nbytes, int dtype_code_hint,
                               int dtype_bits_hint) {
  (void)device_type; (void)device_id; (void)dtype_code_hint; (void)dtype_bits_hint;
  void* p = NULL;
  if (posix_memalign(&p, FR_ALIGN, nbytes ? (size_t)nbytes : 1) != 0) return NULL;
  return p;
}

int TVMBackendFreeWorkspace(int device_type, int device_id, void* ptr) {
  (void)device_type; (void)device_id;
  free(ptr);
  return 0;
}

/* Parallel loops run serially: one task that covers the whole range (kernels split their
 * iteration space by num_task, so num_task = 1 is always valid). */
typedef struct { void* sync_handle; int32_t num_task; } fr_parallel_env;
typedef int (*fr_parallel_lambda)(int task_id, fr_parallel_env* penv, void* cdata);

int TVMBackendParallelLaunch(fr_parallel_lambda flambda, void* cdata, int num_task) {
  (void)num_task;
  fr_parallel_env env = {NULL, 1};
  return flambda(0, &env, cdata);
}

int TVMBackendParallelBarrier(int task_id, fr_parallel_env* penv) {
  (void)task_id; (void)penv;
  return 0;
}

/* Kernels call the packed-function API only to reach registered global functions, which
 * this runtime has none of: fail with a message naming the limit. */
int TVMFFIFunctionCall(void* func, const fr_any* args, int32_t num_args, fr_any* result) {
  (void)func; (void)args; (void)num_args; (void)result;
  fr_set_error("a kernel called a packed function; the fractal C runtime has none");
  return -1;
}

int TVMFFIEnvModLookupFromImports(void* library_ctx, const char* name, void** out) {
  (void)library_ctx; (void)out;
  char buf[FR_ERR_LEN];
  snprintf(buf, sizeof buf, "a kernel looked up the function %s; the fractal C runtime has none", name);
  fr_set_error(buf);
  return -1;
}

int TVMFFIHandleInitOnce(void** handle, int (*init)(void**)) {
  return *handle ? 0 : init(handle);
}

/* TVM's LLVM backend calls the runtime through these function-pointer slots (weak data symbols
 * in the kernel object that a TVM loader fills at load time). Strong definitions here fill them
 * at link time instead, so no loader is needed. The casts from function to object pointer are
 * what the slots hold (POSIX guarantees the round trip, as dlsym relies on). */
void* __TVMBackendAllocWorkspace = (void*)&TVMBackendAllocWorkspace;
void* __TVMBackendFreeWorkspace = (void*)&TVMBackendFreeWorkspace;
void* __TVMBackendParallelLaunch = (void*)&TVMBackendParallelLaunch;
void* __TVMBackendParallelBarrier = (void*)&TVMBackendParallelBarrier;
void* __TVMFFIFunctionCall = (void*)&TVMFFIFunctionCall;
void* __TVMFFIEnvModLookupFromImports = (void*)&TVMFFIEnvModLookupFromImports;
void* __TVMFFIErrorSetRaisedFromCStr = (void*)&TVMFFIErrorSetRaisedFromCStr;
void* __TVMFFIHandleInitOnce = (void*)&TVMFFIHandleInitOnce;
