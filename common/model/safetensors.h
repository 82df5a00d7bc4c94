/* kvbank — reading the safetensors format (https://huggingface.co/docs/safetensors).
 *
 * A file is: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:
 * [begin, end)}, "__metadata__": {...}}, then the byte buffer. Files are mmapped read-only; every
 * header entry is validated (dtype known, shape product * dtype size == end - begin, offsets inside
 * the file, no overlap past the buffer) before a tensor is handed out. */
#ifndef KVB_MODEL_SAFETENSORS_H
#define KVB_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/util.h"

#define KVB_ST_MAX_DIMS 4

typedef struct kvb_st_tensor {
    const char *name;       /* owned by the set */
    kvb_dtype dtype;
    int n_dims;
    int64_t shape[KVB_ST_MAX_DIMS];
    const void *data;       /* points into the mmapped file; little-endian */
    size_t nbytes;
} kvb_st_tensor;

typedef struct kvb_st_set kvb_st_set;

/* Opens the weights of a model directory: `model.safetensors.index.json` (its weight_map names the
 * shards) if present, else every `*.safetensors` file in the directory. Errors name the file and the
 * entry at fault. Caller owns the result. */
kvb_status kvb_st_open_dir(const char *dir, kvb_st_set **out);
/* Opens one file. */
kvb_status kvb_st_open_file(const char *path, kvb_st_set **out);
void kvb_st_close(kvb_st_set *s);

/* Drops the whole pages of `t`'s data from this process (madvise DONTNEED): for a tensor the caller has
 * converted into memory of its own, so the mapping does not stay resident beside the copy. The data
 * stays readable (pages come back from the file). */
void kvb_st_release(const kvb_st_tensor *t);
/* Maps `t`'s pages now (MADV_POPULATE_READ where the kernel has it), for a tensor used in place. */
void kvb_st_prefault(const kvb_st_tensor *t);

/* The tensor called `name`, or NULL. */
const kvb_st_tensor *kvb_st_find(const kvb_st_set *s, const char *name);
int kvb_st_count(const kvb_st_set *s);
const kvb_st_tensor *kvb_st_at(const kvb_st_set *s, int i);

/* Writing (kvbank-mkmodel and tests): a tensor to put in a file. */
typedef struct kvb_st_write_tensor {
    const char *name;
    kvb_dtype dtype;
    int n_dims;
    int64_t shape[KVB_ST_MAX_DIMS];
    const void *data; /* little-endian elements of dtype */
} kvb_st_write_tensor;

/* Writes a safetensors file with the given tensors (header keys sorted by name, as HF writes them)
 * and optional `metadata` JSON object text (may be NULL). */
kvb_status kvb_st_write(const char *path, const kvb_st_write_tensor *tensors, int n, const char *metadata_json);

#endif
