/* embedcore C API: serve an embedcore checkpoint from C (and C++) without
 * Python or a framework runtime.
 *
 *   #include <embedcore/c_api.h>        link libembedcore
 *
 *   embedcore_checkpoint* ckpt = NULL;
 *   if (embedcore_open("/models/ctr", NULL, &ckpt) != EMBEDCORE_OK) {
 *     fprintf(stderr, "%s\n", embedcore_last_error());
 *     return 1;
 *   }
 *   int64_t ids[] = {3, 17, 17, 42}, offsets[] = {0, 3, 4};
 *   embedcore_batch batch = {0};   (in C++: embedcore_batch batch = {};)
 *   batch.ids = ids; batch.id_type = EMBEDCORE_ID_INT64; batch.nnz = 4;
 *   batch.offsets = offsets; batch.num_bags = 2;
 *   float out[2 * 64];   // [num_bags, dim] for a pooled lookup
 *   if (embedcore_lookup(ckpt, 0, &batch, EMBEDCORE_COMBINER_SUM, 0, out, 2 * 64) != EMBEDCORE_OK) ...
 *   embedcore_close(ckpt);
 *
 * Conventions (ABI version EMBEDCORE_C_ABI_VERSION):
 * - Every function returns an int status: EMBEDCORE_OK (0) or one of the
 *   error codes below; embedcore_last_error() then holds the message, for the
 *   calling thread. The only exceptions are embedcore_last_error() and
 *   embedcore_version(), which cannot fail. Results come back through
 *   out-parameters, which are left untouched on error; in particular a lookup
 *   that fails writes nothing to its output buffer.
 * - Handles are opaque. No C++ type, exception or STL object crosses this
 *   interface; every other symbol of libembedcore is hidden.
 * - Every pointer is host memory. Arrays are C-contiguous and naturally
 *   aligned (int64_t to 8 bytes, float and int32_t to 4), and so are the
 *   batch struct and the out-parameters; a misaligned one is an
 *   EMBEDCORE_INVALID_ARGUMENT error, never undefined behaviour.
 * - Strings are UTF-8, NUL-terminated. A string returned by the library is
 *   owned by it; how long it stays valid is stated with each function.
 * - Options are JSON objects passed as strings (NULL: all defaults); an
 *   unknown key is an error, so a typo never goes unnoticed. At most 64 KiB,
 *   nested at most 32 levels deep.
 * - Thread safety: every call on a checkpoint handle may run from any number
 *   of threads at once, including embedcore_reload(), except
 *   embedcore_close(), which must be the handle's last call.
 * - fork(): handles opened before a fork serve in the child too. A fork
 *   waits for the reloads in progress, so the child never starts with a
 *   handle's lock held by a thread it does not have (docs/c_api.md).
 *
 * The checkpoint format is specified in docs/format.md; this API is described
 * in docs/c_api.md.
 */
#ifndef EMBEDCORE_C_API_H_
#define EMBEDCORE_C_API_H_

#include <stddef.h>
#include <stdint.h>

#include "embedcore/version.h"

#if defined(_WIN32) && defined(EMBEDCORE_C_API_BUILDING)
#define EMBEDCORE_C_API_EXPORT __declspec(dllexport)
#elif defined(_WIN32)
#define EMBEDCORE_C_API_EXPORT __declspec(dllimport)
#elif defined(__GNUC__) || defined(__clang__)
#define EMBEDCORE_C_API_EXPORT __attribute__((visibility("default")))
#else
#define EMBEDCORE_C_API_EXPORT
#endif

#ifdef __cplusplus
#define EMBEDCORE_C_API extern "C" EMBEDCORE_C_API_EXPORT
#else
#define EMBEDCORE_C_API EMBEDCORE_C_API_EXPORT
#endif

/** Version of this C interface: raised when a function's signature or a
 * struct's layout changes incompatibly (functions are only ever added
 * otherwise). embedcore_build_info() reports the library's. */
#define EMBEDCORE_C_ABI_VERSION 1

/* ------------------------------------------------------------------ codes */

/** Status codes returned by every function. */
enum embedcore_status {
  EMBEDCORE_OK = 0,
  /** A malformed argument: a null pointer, offsets that do not fit the ids,
   * an unknown enum value or option, an output buffer that is too small, a
   * size that overflows. */
  EMBEDCORE_INVALID_ARGUMENT = 1,
  /** An id outside [0, rows) of its table, or a table / feature index or
   * name that does not exist. */
  EMBEDCORE_OUT_OF_RANGE = 2,
  /** A checkpoint that is missing, truncated, corrupt (a checksum that does
   * not match, including a block found corrupt by a lookup), of a newer
   * format version, or that does not match the one being served (reload). */
  EMBEDCORE_CHECKPOINT_ERROR = 3,
  /** An operating-system call failed (open, mmap, ...). */
  EMBEDCORE_IO_ERROR = 4,
  /** Memory could not be allocated. */
  EMBEDCORE_OUT_OF_MEMORY = 5,
  /** A bug in embedcore: please report the message. */
  EMBEDCORE_INTERNAL_ERROR = 6
};

/** Storage dtype of a table's values (lookups always return float32). */
enum embedcore_dtype {
  EMBEDCORE_DTYPE_FLOAT32 = 0,
  EMBEDCORE_DTYPE_FLOAT16 = 1,  /**< IEEE binary16 */
  EMBEDCORE_DTYPE_BFLOAT16 = 2,
  /** 8-bit row-wise quantized (checkpoint format 1.4): each row's uint8 codes,
   * then a float32 scale and bias (FBGEMM's Fused8BitRowwise); lookups
   * dequantize, value = scale * code + bias. */
  EMBEDCORE_DTYPE_UINT8_ROWWISE = 3
};

/** Integer type of a batch's ids. */
enum embedcore_id_type { EMBEDCORE_ID_INT32 = 0, EMBEDCORE_ID_INT64 = 1 };

/** How the rows of a bag become one output row (w_i = 1 without weights;
    zeros for an empty bag, and for MEAN / SQRTN where the divisor is 0). */
enum embedcore_combiner {
  /** The table's combiner, as saved in its config (Python's default). */
  EMBEDCORE_COMBINER_DEFAULT = -1,
  EMBEDCORE_COMBINER_SUM = 0,   /**< sum of w_i * row_i */
  EMBEDCORE_COMBINER_MEAN = 1,  /**< sum of w_i * row_i / sum of w_i */
  EMBEDCORE_COMBINER_SQRTN = 2, /**< sum of w_i * row_i / sqrt(sum of w_i^2) */
  /** No pooling: the rows themselves (sequence features). */
  EMBEDCORE_COMBINER_NONE = 3
};

/* ------------------------------------------------------------------ types */

/** A checkpoint opened for serving (opaque). */
typedef struct embedcore_checkpoint embedcore_checkpoint;

/** A batch of bags in CSR form: bag b holds ids[offsets[b] .. offsets[b+1]).
 * Zero-initialize it (`embedcore_batch batch = {0};` in C, `= {};` in C++, which
 * warns about `{0}` under -Wextra) and set the fields. */
typedef struct embedcore_batch {
  const void* ids;         /**< [nnz] ids of id_type; may be NULL when nnz == 0 */
  const int64_t* offsets;  /**< [num_bags + 1]: offsets[0] == 0, non-decreasing, offsets[num_bags] == nnz */
  const float* weights;    /**< [nnz] per-id weights, or NULL (all 1) */
  int64_t nnz;             /**< number of ids, in [0, INT64_MAX / 8 - 1] */
  int64_t num_bags;        /**< number of bags, in [0, INT64_MAX / 8 - 1] (a larger count's array size overflows) */
  int32_t id_type;         /**< enum embedcore_id_type */
  int32_t reserved;        /**< must be 0 */
} embedcore_batch;

/** A table of the served checkpoint. */
typedef struct embedcore_table_info {
  /** The table's name; owned by the handle, valid until embedcore_close(). */
  const char* name;
  int64_t rows;      /**< ids are in [0, rows) */
  int64_t dim;       /**< floats per output row */
  int32_t dtype;     /**< enum embedcore_dtype: how the values are stored */
  int32_t combiner;  /**< enum embedcore_combiner: the table's default (sum, mean or sqrtn) */
} embedcore_table_info;

/** A feature of a checkpoint saved from an embedcore.Embedding: a named
 * input that reads one table. */
typedef struct embedcore_feature_info {
  /** The feature's name; owned by the handle, valid until embedcore_close(). */
  const char* name;
  int64_t table;  /**< index of the table it reads */
  /** 0: each bag is pooled with the table's combiner ([num_bags, dim]);
   * L > 0: a sequence feature ([num_bags, L, dim], bags truncated or
   * zero-padded to L). */
  int64_t max_sequence_length;
} embedcore_feature_info;

/* ------------------------------------------------------------------ library */

/** The message of the last call that failed on the calling thread ("" if
 * none). Valid until the next failing call on this thread. Never fails. */
EMBEDCORE_C_API const char* embedcore_last_error(void);

/** The library's version, e.g. "0.1.0" (compare EMBEDCORE_VERSION_STRING,
 * the headers' version). Static storage. Never fails. */
EMBEDCORE_C_API const char* embedcore_version(void);

/** What this build holds, as a JSON object: "version", "c_abi_version",
 * "format_version" ([major, minor] written; every older major is read),
 * "simd" (the kernels selected at run time), "compiler", and the compiled
 * features "cuda", "nccl", "mpi". *out_json has static storage. */
EMBEDCORE_C_API int embedcore_build_info(const char** out_json);

/** Sets the number of threads a lookup may use, in [1, 4096] (the default is
 * the number of cores the process may run on; the threads start at once). Results never depend on it. A
 * lookup that finds the threads busy with another runs on its caller's
 * thread alone, so a server with many request threads loses nothing; 1 makes
 * every lookup run on its caller's thread. Process-wide. */
EMBEDCORE_C_API int embedcore_set_num_threads(int num_threads);
EMBEDCORE_C_API int embedcore_get_num_threads(int* out);

/* ------------------------------------------------------------------ handles */

/** Opens the checkpoint directory `path` read-only for serving: each table's
 * values file is memory-mapped (no values are read; processes that serve the
 * same checkpoint share its pages). The manifest, the data files' headers and
 * sizes are checked now.
 *
 * options_json (NULL: defaults):
 *   {"verify": "lazy"}   (default) each 4 MiB block of values is checksummed
 *                        the first time a lookup touches it; a corrupt block
 *                        fails every lookup that touches it and is never served.
 *   {"verify": "eager"}  every block is checksummed now.
 *   {"verify": "none"}   no data checksums (headers and sizes are still checked).
 *   (true and false stand for "lazy" and "none", as in Python.) An unknown
 *   key, or a key given twice, is EMBEDCORE_INVALID_ARGUMENT.
 *
 * A served data file must not be changed in place (that is undefined, as for
 * any mapped file; a truncated one raises SIGBUS): embedcore's own saves never
 * do, they write new files and replace the manifest, so saving into the
 * served directory and calling embedcore_reload() is safe.
 *
 * On success *out is a new handle, to be released with embedcore_close(). */
EMBEDCORE_C_API int embedcore_open(const char* path, const char* options_json, embedcore_checkpoint** out);

/** Swaps the handle to a newer checkpoint while other threads go on looking
 * up: path NULL re-opens the handle's current directory (after a new save
 * into it), otherwise the checkpoint at `path`; options_json NULL keeps the
 * handle's options. A relative path is resolved against the working
 * directory when it is passed (to embedcore_open or here) and remembered as
 * absolute, so a later chdir() does not change what NULL re-opens (symlinks
 * are not resolved: one re-pointed to a newer checkpoint is followed). Every lookup sees either the old or the new checkpoint,
 * never a mix; a lookup that started before the swap finishes on the old one,
 * whose mapping is released when its last such lookup returns.
 *
 * The new checkpoint must have the same tables (names, in the same order,
 * dims and combiners: EMBEDCORE_COMBINER_DEFAULT and feature lookups use the
 * table's) and the same features (names, tables and max_sequence_length) as
 * the one served, else EMBEDCORE_CHECKPOINT_ERROR; rows and storage dtypes
 * may differ. On any error the handle keeps serving the old checkpoint. */
EMBEDCORE_C_API int embedcore_reload(embedcore_checkpoint* ckpt, const char* path, const char* options_json);

/** Releases the handle (NULL is allowed and does nothing). No other call on
 * the handle may be running or follow. */
EMBEDCORE_C_API int embedcore_close(embedcore_checkpoint* ckpt);

/** The generation of the checkpoint being served. Saves one after another
 * into a directory give growing generations, but overlapping saves may not
 * (the last commit can carry a lower one): it is not a version counter
 * (docs/format.md, Concurrency). */
EMBEDCORE_C_API int embedcore_checkpoint_generation(embedcore_checkpoint* ckpt, uint64_t* out);

/* ------------------------------------------------------------------ tables and features */

EMBEDCORE_C_API int embedcore_num_tables(embedcore_checkpoint* ckpt, int64_t* out);
/** Describes table `table` (0 <= table < embedcore_num_tables). */
EMBEDCORE_C_API int embedcore_describe_table(embedcore_checkpoint* ckpt, int64_t table, embedcore_table_info* out);
/** The index of the table named `name` (EMBEDCORE_OUT_OF_RANGE if none). */
EMBEDCORE_C_API int embedcore_find_table(embedcore_checkpoint* ckpt, const char* name, int64_t* out);

/** Number of features (0 for a checkpoint saved from tables, not from an
 * embedcore.Embedding). */
EMBEDCORE_C_API int embedcore_num_features(embedcore_checkpoint* ckpt, int64_t* out);
EMBEDCORE_C_API int embedcore_describe_feature(embedcore_checkpoint* ckpt, int64_t feature,
                                               embedcore_feature_info* out);
/** The index of the feature named `name` (EMBEDCORE_OUT_OF_RANGE if none). */
EMBEDCORE_C_API int embedcore_find_feature(embedcore_checkpoint* ckpt, const char* name, int64_t* out);

/* ------------------------------------------------------------------ lookups */

/** Looks up `batch` in table `table` and writes float32 rows to `out`:
 *   pooled (sum / mean / sqrtn):             [num_bags, dim]
 *   EMBEDCORE_COMBINER_NONE, max_sequence_length L > 0:  [num_bags, L, dim]
 *                                            (bags truncated or zero-padded to L)
 *   EMBEDCORE_COMBINER_NONE, L == 0:         [nnz, dim] (each id's row)
 * An empty bag pools to zeros. Weights scale each id's row (and, for mean and
 * sqrtn, the denominator). max_sequence_length must be 0 for pooled lookups.
 *
 * out_len is the number of floats `out` holds (it may hold more than the
 * output needs); out may be NULL when the output is empty. Everything is
 * validated before anything is written: on error `out` is untouched.
 * The results are those of Python's embedcore.serving.open(path).tables[name]
 * .lookup(ids, offsets, weights, combiner, max_sequence_length), bit for bit,
 * whatever the thread count. */
EMBEDCORE_C_API int embedcore_lookup(embedcore_checkpoint* ckpt, int64_t table, const embedcore_batch* batch,
                                     int32_t combiner, int64_t max_sequence_length, float* out, int64_t out_len);

/** Looks up feature `feature`: its table, pooled with the table's combiner or,
 * for a sequence feature, as [num_bags, max_sequence_length, dim]; the
 * results of Python's served checkpoint called on that feature. */
EMBEDCORE_C_API int embedcore_lookup_feature(embedcore_checkpoint* ckpt, int64_t feature, const embedcore_batch* batch,
                                             float* out, int64_t out_len);

/** The number of floats a lookup of `batch` (its num_bags and nnz only) in
 * table `table` writes, for the given combiner and max_sequence_length. */
EMBEDCORE_C_API int embedcore_lookup_size(embedcore_checkpoint* ckpt, int64_t table, const embedcore_batch* batch,
                                          int32_t combiner, int64_t max_sequence_length, int64_t* out);

#endif /* EMBEDCORE_C_API_H_ */
