/* fractal-edge C runtime: backend functions TVM kernels call, and error reporting. */
#include "fractal_rt.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* ---- parallel loops on a small thread pool ------------------------------------------------
 *
 * TVM lowers a `parallel` loop to TVMBackendParallelLaunch(lambda, cdata, num_task): the lambda
 * is called once per task id in [0, penv->num_task) and splits the loop's range by the num_task
 * it reads from penv, so any num_task >= 1 is valid and each iteration (and so each output
 * element) is computed by exactly one task, with the same arithmetic whichever thread runs it:
 * results are bit-identical whatever the thread count.
 *
 * The pool: threads - 1 workers started on the first launch. A launch publishes the job in one
 * atomic word (generation, number of tasks, next task to claim); the caller and the workers
 * claim task ids from it until none is left, so a worker the operating system has not scheduled
 * yet (the machine may be loaded) delays nothing: the caller runs its tasks. Workers spin
 * briefly for the next job (a model's kernels follow each other within microseconds), then
 * sleep on a condition variable. The caller then waits for the tasks other threads claimed.
 * One launch at a time: a launch from another thread while the pool is busy, or from inside a
 * task, runs serially in its own thread (still correct, just not parallel).
 *
 * TVMBackendParallelBarrier (emitted only for the `parallel_barrier_when_finish` pragma, which
 * this project's schedules do not use) fails with a message: see there.
 *
 * Thread count: fr_set_num_threads(n), else FRACTAL_NUM_THREADS, else TVM_NUM_THREADS, else the
 * online cores, at most FR_DEFAULT_MAX_THREADS by default and FR_MAX_THREADS in any case. */
typedef struct { void* sync_handle; int32_t num_task; } fr_parallel_env;
typedef int (*fr_parallel_lambda)(int task_id, fr_parallel_env* penv, void* cdata);

#define FR_SPIN 20000 /* polls before a worker sleeps / before a waiting caller yields */
#define FR_GEN(w) ((uint32_t)((w) >> 32))
#define FR_NTASK(w) ((int)(((w) >> 16) & 0xffffu))
#define FR_NEXT(w) ((int)((w) & 0xffffu))

static struct {
  pthread_mutex_t launch;    /* held by the thread whose job the pool runs */
  pthread_mutex_t mu;        /* guards sleeping on `wake` */
  pthread_cond_t wake;
  atomic_int threads;        /* configured total, caller included; 0 = not yet resolved */
  int started;               /* workers running (guarded by `launch`) */
  atomic_ullong job;         /* generation << 32 | num_task << 16 | next task id to claim */
  atomic_int done;           /* tasks of the current job finished */
  atomic_int failed;
  fr_parallel_lambda fn;     /* written before `job` is published, read after a claim */
  void* cdata;
  char error[FR_ERR_LEN];    /* a failed task's message, for the caller */
} fr_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static _Thread_local int fr_in_task; /* this thread is running a task: nested launches are serial */

static inline void fr_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static int fr_env_threads(const char* name) {
  const char* v = getenv(name);
  if (!v || !*v) return 0;
  char* end;
  long n = strtol(v, &end, 10);
  return (*end == 0 && n > 0) ? (int)(n > FR_MAX_THREADS ? FR_MAX_THREADS : n) : 0;
}

static int fr_default_threads(void) {
  int n = fr_env_threads("FRACTAL_NUM_THREADS");
  if (!n) n = fr_env_threads("TVM_NUM_THREADS");
  if (!n) {
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    n = c < 1 ? 1 : (c > FR_DEFAULT_MAX_THREADS ? FR_DEFAULT_MAX_THREADS : (int)c);
  }
  return n;
}

/* Claims and runs tasks of generation `gen` until none is left. A claimed task belongs to that
 * job, which cannot finish (and so cannot be replaced) before the task is counted done: fn and
 * cdata read after the claim are that job's. */
static void fr_claim_tasks(uint32_t gen) {
  unsigned long long w = atomic_load_explicit(&fr_pool.job, memory_order_acquire);
  while (FR_GEN(w) == gen && FR_NEXT(w) < FR_NTASK(w)) {
    if (!atomic_compare_exchange_weak_explicit(&fr_pool.job, &w, w + 1, memory_order_acq_rel,
                                               memory_order_acquire))
      continue;
    fr_parallel_env env = {NULL, FR_NTASK(w)};
    fr_in_task = 1;
    if (fr_pool.fn(FR_NEXT(w), &env, fr_pool.cdata) != 0 && atomic_exchange(&fr_pool.failed, 1) == 0)
      snprintf(fr_pool.error, sizeof fr_pool.error, "%s", fr_error);
    fr_in_task = 0;
    atomic_fetch_add_explicit(&fr_pool.done, 1, memory_order_release);
    w = atomic_load_explicit(&fr_pool.job, memory_order_acquire);
  }
}

typedef struct { int id; uint32_t gen; } fr_worker_start;

static void* fr_worker(void* arg) {
  /* `gen`: the generation when the worker was created, so a job published before this thread
   * first runs is still seen as new. */
  int id = ((fr_worker_start*)arg)->id;
  uint32_t seen = ((fr_worker_start*)arg)->gen;
  free(arg);
  for (;;) {
    uint32_t g;
    int spins = 0;
    while ((g = FR_GEN(atomic_load_explicit(&fr_pool.job, memory_order_acquire))) == seen) {
      if (++spins < FR_SPIN && id < atomic_load_explicit(&fr_pool.threads, memory_order_relaxed)) {
        fr_cpu_relax();
        continue;
      }
      pthread_mutex_lock(&fr_pool.mu);
      while ((g = FR_GEN(atomic_load_explicit(&fr_pool.job, memory_order_acquire))) == seen)
        pthread_cond_wait(&fr_pool.wake, &fr_pool.mu);
      pthread_mutex_unlock(&fr_pool.mu);
      break;
    }
    seen = g;
    fr_claim_tasks(g);
  }
  return NULL;
}

static void fr_after_fork_child(void) {
  /* Only the forking thread exists in the child: start new workers on its first launch. */
  pthread_mutex_init(&fr_pool.launch, NULL);
  pthread_mutex_init(&fr_pool.mu, NULL);
  pthread_cond_init(&fr_pool.wake, NULL);
  fr_pool.started = 0;
}

static pthread_once_t fr_fork_once = PTHREAD_ONCE_INIT;
static void fr_register_fork(void) { pthread_atfork(NULL, NULL, fr_after_fork_child); }

/* Called with fr_pool.launch held. Starts workers up to threads - 1; fewer if the system
 * refuses (then the pool runs with what it has). */
static void fr_start_workers(void) {
  pthread_once(&fr_fork_once, fr_register_fork);
  while (fr_pool.started < fr_pool.threads - 1) {
    fr_worker_start* st = malloc(sizeof *st);
    if (!st) break;
    st->id = fr_pool.started + 1;
    st->gen = FR_GEN(atomic_load(&fr_pool.job));
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, fr_worker, st);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      free(st);
      break;
    }
    ++fr_pool.started;
  }
}

int fr_set_num_threads(int n) {
  pthread_mutex_lock(&fr_pool.launch);
  int t = n > 0 ? (n > FR_MAX_THREADS ? FR_MAX_THREADS : n) : fr_default_threads();
  fr_pool.threads = t;
  pthread_mutex_unlock(&fr_pool.launch);
  return t;
}

int fr_get_num_threads(void) {
  pthread_mutex_lock(&fr_pool.launch);
  if (!fr_pool.threads) fr_pool.threads = fr_default_threads();
  int n = fr_pool.threads;
  pthread_mutex_unlock(&fr_pool.launch);
  return n;
}

static int fr_serial(fr_parallel_lambda flambda, void* cdata) {
  fr_parallel_env env = {NULL, 1};
  return flambda(0, &env, cdata);
}

int TVMBackendParallelLaunch(fr_parallel_lambda flambda, void* cdata, int num_task) {
  if (fr_in_task || pthread_mutex_trylock(&fr_pool.launch) != 0) return fr_serial(flambda, cdata);
  if (!fr_pool.threads) fr_pool.threads = fr_default_threads();
  if (fr_pool.started < fr_pool.threads - 1) fr_start_workers();
  int n = fr_pool.started + 1 < fr_pool.threads ? fr_pool.started + 1 : fr_pool.threads;
  if (num_task > 0 && num_task < n) n = num_task;
  if (n <= 1) {
    pthread_mutex_unlock(&fr_pool.launch);
    return fr_serial(flambda, cdata);
  }
  fr_pool.fn = flambda;
  fr_pool.cdata = cdata;
  atomic_store_explicit(&fr_pool.failed, 0, memory_order_relaxed);
  atomic_store_explicit(&fr_pool.done, 0, memory_order_relaxed);
  uint32_t gen = FR_GEN(atomic_load_explicit(&fr_pool.job, memory_order_relaxed)) + 1;
  atomic_store_explicit(&fr_pool.job, ((unsigned long long)gen << 32) | ((unsigned long long)n << 16),
                        memory_order_release);
  pthread_mutex_lock(&fr_pool.mu);
  pthread_cond_broadcast(&fr_pool.wake);
  pthread_mutex_unlock(&fr_pool.mu);
  fr_claim_tasks(gen);
  for (int spins = 0; atomic_load_explicit(&fr_pool.done, memory_order_acquire) < n;) {
    if (++spins < FR_SPIN) fr_cpu_relax();
    else sched_yield();
  }
  int rc = 0;
  if (atomic_load(&fr_pool.failed)) {
    fr_set_error(fr_pool.error);
    rc = -1;
  }
  pthread_mutex_unlock(&fr_pool.launch);
  return rc;
}

/* A barrier needs all num_task tasks running at once, which claimed tasks do not promise (and
 * could deadlock on): refuse it with a message instead. */
int TVMBackendParallelBarrier(int task_id, fr_parallel_env* penv) {
  (void)task_id;
  if (penv->num_task <= 1) return 0;
  fr_set_error("a kernel uses a parallel barrier; the fractal C runtime does not support them");
  return -1;
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
