/* Serving an embedcore checkpoint from C: open it (memory-mapped), list its
 * tables and features, look up a few batches, close.
 *
 *   inference CHECKPOINT [--dump FILE]
 *
 * With --dump, every float of the example lookups (make_checkpoint.py lists
 * them) is also written to FILE, little-endian: the bytes must equal those of
 * `python make_checkpoint.py CHECKPOINT --reference FILE`. */
#include <embedcore/c_api.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NUM_BAGS 6

/* Prints the failed call and the library's message, then exits. */
#define CHECK(call)                                                                    \
  do {                                                                                 \
    int status_ = (call);                                                              \
    if (status_ != EMBEDCORE_OK) {                                                     \
      fprintf(stderr, "%s failed (status %d): %s\n", #call, status_, embedcore_last_error()); \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

static const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case EMBEDCORE_DTYPE_FLOAT32:
      return "float32";
    case EMBEDCORE_DTYPE_FLOAT16:
      return "float16";
    case EMBEDCORE_DTYPE_BFLOAT16:
      return "bfloat16";
    case EMBEDCORE_DTYPE_UINT8_ROWWISE:
      return "uint8_rowwise";
    default:
      return "?";
  }
}

static const char* combiner_name(int32_t combiner) {
  switch (combiner) {
    case EMBEDCORE_COMBINER_SUM:
      return "sum";
    case EMBEDCORE_COMBINER_MEAN:
      return "mean";
    case EMBEDCORE_COMBINER_SQRTN:
      return "sqrtn";
    case EMBEDCORE_COMBINER_NONE:
      return "none";
    default:
      return "?";
  }
}

/* The example batch of `slot` for a table of `rows` rows (make_checkpoint.py). */
typedef struct {
  int64_t ids[NUM_BAGS * 4];
  int32_t ids32[NUM_BAGS * 4];
  int64_t offsets[NUM_BAGS + 1];
  float weights[NUM_BAGS * 4];
  int64_t nnz;
} example_batch;

static void make_batch(example_batch* e, int64_t slot, int64_t rows) {
  int64_t b, k;
  e->offsets[0] = 0;
  for (b = 0; b < NUM_BAGS; ++b) e->offsets[b + 1] = e->offsets[b] + (3 * b + slot) % 5;
  e->nnz = e->offsets[NUM_BAGS];
  for (k = 0; k < e->nnz; ++k) {
    e->ids[k] = (k * 7919 + slot * 104729 + 13) % rows;
    e->ids32[k] = (int32_t)e->ids[k];
    e->weights[k] = 0.25f * (float)(1 + (k + slot) % 7);
  }
}

static embedcore_batch as_batch(const example_batch* e, int with_weights, int int32_ids) {
  embedcore_batch batch;
  memset(&batch, 0, sizeof(batch));
  batch.ids = int32_ids ? (const void*)e->ids32 : (const void*)e->ids;
  batch.id_type = int32_ids ? EMBEDCORE_ID_INT32 : EMBEDCORE_ID_INT64;
  batch.nnz = e->nnz;
  batch.offsets = e->offsets;
  batch.num_bags = NUM_BAGS;
  batch.weights = with_weights ? e->weights : NULL;
  return batch;
}

/* Runs one table lookup into a buffer of the right size (asked from the
 * library), prints its first values and appends it to `dump`. */
static void table_lookup(embedcore_checkpoint* ckpt, int64_t table, const embedcore_batch* batch, int32_t combiner,
                         int64_t max_sequence_length, const char* what, FILE* dump) {
  int64_t n = 0;
  float* out;
  CHECK(embedcore_lookup_size(ckpt, table, batch, combiner, max_sequence_length, &n));
  out = (float*)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
  if (out == NULL) exit(1);
  CHECK(embedcore_lookup(ckpt, table, batch, combiner, max_sequence_length, out, n));
  printf("    %-30s %4lld floats:", what, (long long)n);
  {
    int64_t i;
    for (i = 0; i < n && i < 4; ++i) printf(" %+.6f", out[i]);
  }
  printf("%s\n", n > 4 ? " ..." : "");
  if (dump != NULL && n > 0 && fwrite(out, sizeof(float), (size_t)n, dump) != (size_t)n) {
    fprintf(stderr, "inference: writing the dump failed\n");
    exit(1);
  }
  free(out);
}

int main(int argc, char** argv) {
  const char* path = NULL;
  const char* dump_path = NULL;
  const char* build_info = NULL;
  embedcore_checkpoint* ckpt = NULL;
  int64_t num_tables = 0, num_features = 0, t, f;
  uint64_t generation = 0;
  FILE* dump = NULL;
  int i;

  for (i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--dump") == 0 && i + 1 < argc) {
      dump_path = argv[++i];
    } else if (path == NULL && argv[i][0] != '-') {
      path = argv[i];
    } else {
      path = NULL;
      break;
    }
  }
  if (path == NULL) {
    fprintf(stderr, "usage: %s CHECKPOINT [--dump FILE]\n", argv[0]);
    return 2;
  }

  CHECK(embedcore_build_info(&build_info));
  printf("libembedcore %s (headers %s): %s\n", embedcore_version(), EMBEDCORE_VERSION_STRING, build_info);

  CHECK(embedcore_open(path, "{\"verify\": \"lazy\"}", &ckpt));
  CHECK(embedcore_checkpoint_generation(ckpt, &generation));
  CHECK(embedcore_num_tables(ckpt, &num_tables));
  CHECK(embedcore_num_features(ckpt, &num_features));
  printf("checkpoint %s (generation %llu): %lld table(s), %lld feature(s)\n", path, (unsigned long long)generation,
         (long long)num_tables, (long long)num_features);
  for (t = 0; t < num_tables; ++t) {
    embedcore_table_info info;
    CHECK(embedcore_describe_table(ckpt, t, &info));
    printf("  table %lld '%s': %lld x %lld %s, combiner %s\n", (long long)t, info.name, (long long)info.rows,
           (long long)info.dim, dtype_name(info.dtype), combiner_name(info.combiner));
  }
  for (f = 0; f < num_features; ++f) {
    embedcore_feature_info info;
    embedcore_table_info table;
    CHECK(embedcore_describe_feature(ckpt, f, &info));
    CHECK(embedcore_describe_table(ckpt, info.table, &table));
    if (info.max_sequence_length > 0)
      printf("  feature '%s' -> table '%s', sequence of %lld: [batch, %lld, %lld]\n", info.name, table.name,
             (long long)info.max_sequence_length, (long long)info.max_sequence_length, (long long)table.dim);
    else
      printf("  feature '%s' -> table '%s', pooled (%s): [batch, %lld]\n", info.name, table.name,
             combiner_name(table.combiner), (long long)table.dim);
  }

  if (dump_path != NULL) {
    dump = fopen(dump_path, "wb");
    if (dump == NULL) {
      perror(dump_path);
      return 1;
    }
  }

  /* Every feature, as the served checkpoint looks it up. */
  printf("feature lookups (%d bags each):\n", NUM_BAGS);
  for (f = 0; f < num_features; ++f) {
    embedcore_feature_info info;
    embedcore_table_info table;
    example_batch e;
    embedcore_batch batch;
    int64_t n = 0;
    float* out;
    CHECK(embedcore_describe_feature(ckpt, f, &info));
    CHECK(embedcore_describe_table(ckpt, info.table, &table));
    make_batch(&e, f, table.rows);
    batch = as_batch(&e, (int)(f % 2 == 1), 0);
    if (info.max_sequence_length > 0)
      CHECK(embedcore_lookup_size(ckpt, info.table, &batch, EMBEDCORE_COMBINER_NONE, info.max_sequence_length, &n));
    else
      CHECK(embedcore_lookup_size(ckpt, info.table, &batch, EMBEDCORE_COMBINER_DEFAULT, 0, &n));
    out = (float*)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (out == NULL) return 1;
    CHECK(embedcore_lookup_feature(ckpt, f, &batch, out, n));
    printf("    %-30s %4lld floats: %+.6f %+.6f ...\n", info.name, (long long)n, out[0], out[1]);
    if (dump != NULL && fwrite(out, sizeof(float), (size_t)n, dump) != (size_t)n) return 1;
    free(out);
  }

  /* Every table, with each combiner and as sequences. */
  printf("table lookups (%d bags each):\n", NUM_BAGS);
  for (t = 0; t < num_tables; ++t) {
    embedcore_table_info table;
    example_batch e;
    embedcore_batch weighted, plain, plain32;
    CHECK(embedcore_describe_table(ckpt, t, &table));
    printf("  %s\n", table.name);
    make_batch(&e, 100 + t, table.rows);
    weighted = as_batch(&e, 1, 0);
    plain = as_batch(&e, 0, 0);
    plain32 = as_batch(&e, 0, 1);
    table_lookup(ckpt, t, &weighted, EMBEDCORE_COMBINER_SUM, 0, "sum, weighted", dump);
    table_lookup(ckpt, t, &weighted, EMBEDCORE_COMBINER_MEAN, 0, "mean, weighted", dump);
    table_lookup(ckpt, t, &plain, EMBEDCORE_COMBINER_SQRTN, 0, "sqrtn", dump);
    table_lookup(ckpt, t, &weighted, EMBEDCORE_COMBINER_NONE, 0, "rows, weighted", dump);
    table_lookup(ckpt, t, &plain, EMBEDCORE_COMBINER_NONE, 3, "rows padded to 3 per bag", dump);
    table_lookup(ckpt, t, &plain32, EMBEDCORE_COMBINER_DEFAULT, 0, "table's combiner, int32 ids", dump);
  }

  /* A mistake is an error status with a message, never a crash. */
  {
    example_batch e;
    embedcore_batch batch;
    int64_t n = 0;
    float* out;
    int status;
    make_batch(&e, 0, 1000000000); /* ids up to 10^9: beyond any table here */
    batch = as_batch(&e, 0, 0);
    CHECK(embedcore_lookup_size(ckpt, 0, &batch, EMBEDCORE_COMBINER_SUM, 0, &n));
    out = (float*)calloc((size_t)n, sizeof(float));
    if (out == NULL) return 1;
    status = embedcore_lookup(ckpt, 0, &batch, EMBEDCORE_COMBINER_SUM, 0, out, n);
    printf("an id out of range: status %d: %s\n", status, embedcore_last_error());
    free(out);
  }

  if (dump != NULL && fclose(dump) != 0) {
    perror(dump_path);
    return 1;
  }
  CHECK(embedcore_close(ckpt));
  return 0;
}
