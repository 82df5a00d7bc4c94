/* kvbank — safetensors reading (mmap, strict header validation) and writing. */
#include "common/model/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util/json.h"

/* The reference implementation refuses headers above 100 MB; so do we. */
#define ST_MAX_HEADER (100u * 1000u * 1000u)
#define ST_INDEX_NAME "model.safetensors.index.json"

typedef struct st_file {
    char *path;       /* owned */
    void *map;        /* mmapped read-only, [size] bytes */
    size_t size;
} st_file;

typedef struct st_entry {
    kvb_st_tensor t;  /* first member: kvb_st_at hands out &entry->t */
    int file;         /* index into kvb_st_set.files */
} st_entry;

struct kvb_st_set {
    st_file *files;   /* [n_files] */
    int n_files;
    st_entry *ents;   /* [n_ents], sorted by name once the set is complete */
    int n_ents;
    int cap_ents;
};

/* ------------------------------------------------------------------------------------------ reading */

static kvb_status parse_dtype(const char *path, const char *name, const char *s, kvb_dtype *out) {
    if (!strcmp(s, "F32")) *out = KVB_DTYPE_F32;
    else if (!strcmp(s, "F16")) *out = KVB_DTYPE_F16;
    else if (!strcmp(s, "BF16")) *out = KVB_DTYPE_BF16;
    else if (!strcmp(s, "F8_E4M3")) *out = KVB_DTYPE_F8_E4M3;
    else {
        KVB_LOG_E("%s: tensor \"%s\": dtype \"%s\" is not supported (F32, F16, BF16, F8_E4M3)", path, name, s);
        return KVB_ERR_UNSUPPORTED;
    }
    return KVB_OK;
}

/* Validates one header entry `name` -> `v` against a data buffer of `buf_size` bytes at `buf`. */
static kvb_status parse_entry(const char *path, const char *name, const json_t *v, const unsigned char *buf,
                              uint64_t buf_size, kvb_st_tensor *t) {
    if (!json_is_object(v)) {
        KVB_LOG_E("%s: tensor \"%s\": header entry is not an object", path, name);
        return KVB_ERR_FORMAT;
    }
    const json_t *dt = json_object_get(v, "dtype");
    const json_t *shape = json_object_get(v, "shape");
    const json_t *offs = json_object_get(v, "data_offsets");
    if (!json_is_string(dt)) {
        KVB_LOG_E("%s: tensor \"%s\": \"dtype\" missing or not a string", path, name);
        return KVB_ERR_FORMAT;
    }
    if (!json_is_array(shape)) {
        KVB_LOG_E("%s: tensor \"%s\": \"shape\" missing or not a list", path, name);
        return KVB_ERR_FORMAT;
    }
    if (!json_is_array(offs) || json_array_size(offs) != 2 || !json_is_integer(json_array_get(offs, 0)) ||
        !json_is_integer(json_array_get(offs, 1))) {
        KVB_LOG_E("%s: tensor \"%s\": \"data_offsets\" must be a list of two integers", path, name);
        return KVB_ERR_FORMAT;
    }
    KVB_TRY(parse_dtype(path, name, json_string_value(dt), &t->dtype));
    size_t nd = json_array_size(shape);
    if (nd > KVB_ST_MAX_DIMS) {
        KVB_LOG_E("%s: tensor \"%s\": %zu dimensions (at most %d)", path, name, nd, KVB_ST_MAX_DIMS);
        return KVB_ERR_UNSUPPORTED;
    }
    uint64_t elems = 1;
    int overflow = 0;
    t->n_dims = (int)nd;
    for (size_t i = 0; i < nd; i++) {
        const json_t *d = json_array_get(shape, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0) {
            KVB_LOG_E("%s: tensor \"%s\": shape[%zu] is not a non-negative integer", path, name, i);
            return KVB_ERR_FORMAT;
        }
        uint64_t di = (uint64_t)json_integer_value(d);
        t->shape[i] = (int64_t)di;
        if (di != 0 && elems > UINT64_MAX / di) overflow = 1;
        else elems *= di;
    }
    for (size_t i = nd; i < KVB_ST_MAX_DIMS; i++) t->shape[i] = 0;
    json_int_t b = json_integer_value(json_array_get(offs, 0));
    json_int_t e = json_integer_value(json_array_get(offs, 1));
    if (b < 0 || e < b) {
        KVB_LOG_E("%s: tensor \"%s\": data_offsets [%lld, %lld] are not an interval", path, name, (long long)b,
                  (long long)e);
        return KVB_ERR_FORMAT;
    }
    if ((uint64_t)e > buf_size) {
        KVB_LOG_E("%s: tensor \"%s\": data_offsets [%lld, %lld] run past the end of the data (%llu bytes): "
                  "file truncated?",
                  path, name, (long long)b, (long long)e, (unsigned long long)buf_size);
        return KVB_ERR_FORMAT;
    }
    uint64_t es = kvb_dtype_size(t->dtype);
    uint64_t len = (uint64_t)(e - b);
    if (overflow || elems > UINT64_MAX / es || elems * es != len) {
        char shp[128];
        int o = 0;
        for (int i = 0; i < t->n_dims && o < (int)sizeof shp - 24; i++)
            o += snprintf(shp + o, sizeof shp - (size_t)o, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        shp[o] = 0;
        KVB_LOG_E("%s: tensor \"%s\": shape [%s] of %s needs %s bytes but data_offsets span %llu", path, name, shp,
                  json_string_value(dt), overflow ? "too many" : "a different number of", (unsigned long long)len);
        if (!overflow && elems <= UINT64_MAX / es)
            KVB_LOG_E("%s: tensor \"%s\": expected %llu bytes", path, name, (unsigned long long)(elems * es));
        return KVB_ERR_FORMAT;
    }
    t->data = buf + b;
    t->nbytes = (size_t)len;
    return KVB_OK;
}

static kvb_status push_entry(kvb_st_set *s, const kvb_st_tensor *t, int file) {
    if (s->n_ents == s->cap_ents) {
        int cap = s->cap_ents ? 2 * s->cap_ents : 64;
        KVB_TRY(kvb_realloc_array((void **)&s->ents, (size_t)cap, sizeof *s->ents));
        s->cap_ents = cap;
    }
    s->ents[s->n_ents].t = *t;
    s->ents[s->n_ents].file = file;
    s->n_ents++;
    return KVB_OK;
}

/* Maps `path` and appends its tensors to `s` (not yet sorted). */
static kvb_status add_file(kvb_st_set *s, const char *path) {
    kvb_status st;
    int fd;
    st = kvb_open_regular(path, &fd); /* a FIFO named *.safetensors would block open() forever */
    if (st == KVB_ERR_NOT_FOUND) KVB_LOG_E("%s: cannot open: it does not exist", path);
    if (st != KVB_OK) return st;
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        KVB_LOG_E("%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return KVB_ERR_IO;
    }
    uint64_t size = (uint64_t)sb.st_size;
    if (size < 8) {
        KVB_LOG_E("%s: truncated: %llu bytes is too short for the 8-byte header length", path,
                  (unsigned long long)size);
        close(fd);
        return KVB_ERR_FORMAT;
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        KVB_LOG_E("%s: cannot mmap %llu bytes: %s", path, (unsigned long long)size, strerror(errno));
        return KVB_ERR_IO;
    }
    KVB_TRY_GOTO(kvb_realloc_array((void **)&s->files, (size_t)s->n_files + 1, sizeof *s->files), fail_unmap);
    st_file *f = &s->files[s->n_files];
    f->map = map;
    f->size = (size_t)size;
    f->path = NULL;
    KVB_TRY_GOTO(kvb_strdup(path, &f->path), fail_unmap);
    int file_idx = s->n_files++; /* from here the set owns the mapping */

    const unsigned char *p = map;
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)p[i] << (8 * i);
    if (hlen < 2 || hlen > ST_MAX_HEADER) {
        KVB_LOG_E("%s: header length %llu is not sane (2 .. %u bytes): not a safetensors file?", path,
                  (unsigned long long)hlen, ST_MAX_HEADER);
        return KVB_ERR_FORMAT;
    }
    if (hlen > size - 8) {
        KVB_LOG_E("%s: truncated: header length %llu exceeds the %llu bytes after the length field", path,
                  (unsigned long long)hlen, (unsigned long long)(size - 8));
        return KVB_ERR_FORMAT;
    }
    if (p[8] != '{') {
        KVB_LOG_E("%s: header does not start with '{'", path);
        return KVB_ERR_FORMAT;
    }
    json_t *hdr = NULL;
    char what[PATH_MAX + 16];
    snprintf(what, sizeof what, "%s: header", path);
    KVB_TRY(kvb_json_load_text((const char *)p + 8, (size_t)hlen, what, &hdr));
    if (!json_is_object(hdr)) {
        KVB_LOG_E("%s: header is not a JSON object", path);
        json_decref(hdr);
        return KVB_ERR_FORMAT;
    }
    const unsigned char *buf = p + 8 + hlen;
    uint64_t buf_size = size - 8 - hlen;
    const char *name;
    json_t *v;
    json_object_foreach(hdr, name, v) {
        if (!strcmp(name, "__metadata__")) continue;
        kvb_st_tensor t = {0};
        KVB_TRY_GOTO(parse_entry(path, name, v, buf, buf_size, &t), fail_hdr);
        KVB_TRY_GOTO(kvb_strdup(name, (char **)&t.name), fail_hdr);
        st = push_entry(s, &t, file_idx);
        if (st != KVB_OK) {
            free((char *)t.name);
            goto fail_hdr;
        }
    }
    json_decref(hdr);
    return KVB_OK;

fail_hdr:
    json_decref(hdr);
    return st;
fail_unmap:
    munmap(map, (size_t)size);
    return st;
}

static int cmp_entry(const void *a, const void *b) {
    return strcmp(((const st_entry *)a)->t.name, ((const st_entry *)b)->t.name);
}

/* Sorts the tensors by name and rejects a name that two files (or one file twice) define. */
static kvb_status finish_set(kvb_st_set *s) {
    if (s->n_ents > 1) qsort(s->ents, (size_t)s->n_ents, sizeof *s->ents, cmp_entry);
    for (int i = 1; i < s->n_ents; i++) {
        if (!strcmp(s->ents[i - 1].t.name, s->ents[i].t.name)) {
            KVB_LOG_E("tensor \"%s\" is defined twice: in %s and in %s", s->ents[i].t.name,
                      s->files[s->ents[i - 1].file].path, s->files[s->ents[i].file].path);
            return KVB_ERR_FORMAT;
        }
    }
    return KVB_OK;
}

static kvb_status set_new(kvb_st_set **out) {
    kvb_st_set *s = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *s, (void **)&s));
    *out = s;
    return KVB_OK;
}

/* Whole pages of [p, p + n), or 0 when there are none. */
static size_t inner_pages(const void *p, size_t n, uintptr_t *start) {
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = ((uintptr_t)p + pg - 1) & ~(pg - 1), b = ((uintptr_t)p + n) & ~(pg - 1);
    *start = a;
    return b > a ? (size_t)(b - a) : 0;
}

void kvb_st_release(const kvb_st_tensor *t) {
    uintptr_t a;
    size_t n = inner_pages(t->data, t->nbytes, &a);
    /* a private read-only file mapping: dropped pages are read back from the file if touched again */
    if (n) (void)madvise((void *)a, n, MADV_DONTNEED);
}

void kvb_st_prefault(const kvb_st_tensor *t) {
#ifdef MADV_POPULATE_READ
    uintptr_t a;
    size_t n = inner_pages(t->data, t->nbytes, &a);
    /* maps the pages now (older kernels refuse the advice: the first step then faults them in) */
    if (n) (void)madvise((void *)a, n, MADV_POPULATE_READ);
#else
    (void)t;
#endif
}

void kvb_st_close(kvb_st_set *s) {
    if (!s) return;
    for (int i = 0; i < s->n_ents; i++) free((char *)s->ents[i].t.name);
    free(s->ents);
    for (int i = 0; i < s->n_files; i++) {
        munmap(s->files[i].map, s->files[i].size);
        free(s->files[i].path);
    }
    free(s->files);
    free(s);
}

kvb_status kvb_st_open_file(const char *path, kvb_st_set **out) {
    kvb_st_set *s = NULL;
    kvb_status st;
    KVB_TRY(set_new(&s));
    KVB_TRY_GOTO(add_file(s, path), fail_set);
    KVB_TRY_GOTO(finish_set(s), fail_set);
    *out = s;
    return KVB_OK;
fail_set:
    kvb_st_close(s);
    return st;
}

static kvb_status join_path(const char *dir, const char *name, char *out, size_t cap) {
    if (snprintf(out, cap, "%s/%s", dir, name) >= (int)cap) {
        KVB_LOG_E("%s/%s: path too long", dir, name);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void free_names(char **names, int n) {
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
}

/* A shard name from an index must be a plain file name inside the model directory. */
static int shard_name_ok(const char *n) {
    return n[0] && !strchr(n, '/') && strcmp(n, ".") && strcmp(n, "..");
}

static kvb_status open_indexed(kvb_st_set *s, const char *dir, const char *index_path) {
    kvb_status st;
    json_t *idx = NULL;
    char **shards = NULL;
    int n_shards = 0;
    KVB_TRY(kvb_json_load_file(index_path, &idx));
    const json_t *wm = json_is_object(idx) ? json_object_get(idx, "weight_map") : NULL;
    if (!json_is_object(wm)) {
        KVB_LOG_E("%s: no \"weight_map\" object", index_path);
        st = KVB_ERR_FORMAT;
        goto fail_idx;
    }
    const char *name;
    json_t *v;
    /* The distinct shard names, each opened once, in sorted order. */
    json_object_foreach((json_t *)wm, name, v) {
        if (!json_is_string(v) || !shard_name_ok(json_string_value(v))) {
            KVB_LOG_E("%s: weight_map[\"%s\"] is not a file name in the model directory", index_path, name);
            st = KVB_ERR_FORMAT;
            goto fail_shards;
        }
        const char *sh = json_string_value(v);
        int seen = 0;
        for (int i = 0; i < n_shards && !seen; i++) seen = !strcmp(shards[i], sh);
        if (seen) continue;
        KVB_TRY_GOTO(kvb_realloc_array((void **)&shards, (size_t)n_shards + 1, sizeof *shards), fail_shards);
        KVB_TRY_GOTO(kvb_strdup(sh, &shards[n_shards]), fail_shards);
        n_shards++;
    }
    if (n_shards == 0) {
        KVB_LOG_E("%s: weight_map is empty", index_path);
        st = KVB_ERR_FORMAT;
        goto fail_shards;
    }
    qsort(shards, (size_t)n_shards, sizeof *shards, cmp_str);
    for (int i = 0; i < n_shards; i++) {
        char path[PATH_MAX];
        KVB_TRY_GOTO(join_path(dir, shards[i], path, sizeof path), fail_shards);
        KVB_TRY_GOTO(add_file(s, path), fail_shards);
    }
    KVB_TRY_GOTO(finish_set(s), fail_shards);
    /* Every tensor the index names lives in the shard it names. */
    json_object_foreach((json_t *)wm, name, v) {
        const st_entry *e = (const st_entry *)kvb_st_find(s, name);
        const char *sh = json_string_value(v);
        if (!e) {
            KVB_LOG_E("%s: tensor \"%s\" is listed in shard %s, which does not contain it", index_path, name, sh);
            st = KVB_ERR_NOT_FOUND;
            goto fail_shards;
        }
        const char *fp = s->files[e->file].path;
        size_t fl = strlen(fp), sl = strlen(sh);
        if (fl < sl + 1 || strcmp(fp + fl - sl, sh) != 0 || fp[fl - sl - 1] != '/') {
            KVB_LOG_E("%s: tensor \"%s\" is listed in shard %s but found in %s", index_path, name, sh, fp);
            st = KVB_ERR_FORMAT;
            goto fail_shards;
        }
    }
    if ((size_t)s->n_ents != json_object_size(wm))
        KVB_LOG_W("%s: the shards hold %d tensors, the weight_map lists %zu", index_path, s->n_ents,
                  json_object_size(wm));
    free_names(shards, n_shards);
    json_decref(idx);
    return KVB_OK;

fail_shards:
    free_names(shards, n_shards);
fail_idx:
    json_decref(idx);
    return st;
}

static int has_suffix(const char *s, const char *suf) {
    size_t n = strlen(s), m = strlen(suf);
    return n > m && !strcmp(s + n - m, suf);
}

static kvb_status open_listed(kvb_st_set *s, const char *dir) {
    kvb_status st = KVB_OK;
    char **names = NULL;
    int n = 0;
    DIR *d = opendir(dir);
    if (!d) {
        KVB_LOG_E("%s: cannot open directory: %s", dir, strerror(errno));
        return errno == ENOENT ? KVB_ERR_NOT_FOUND : KVB_ERR_IO;
    }
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!has_suffix(de->d_name, ".safetensors") || de->d_name[0] == '.') continue;
        KVB_TRY_GOTO(kvb_realloc_array((void **)&names, (size_t)n + 1, sizeof *names), fail_names);
        KVB_TRY_GOTO(kvb_strdup(de->d_name, &names[n]), fail_names);
        n++;
    }
    closedir(d);
    d = NULL;
    if (n == 0) {
        KVB_LOG_E("%s: no *.safetensors files and no " ST_INDEX_NAME, dir);
        return KVB_ERR_NOT_FOUND;
    }
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    for (int i = 0; i < n; i++) {
        char path[PATH_MAX];
        KVB_TRY_GOTO(join_path(dir, names[i], path, sizeof path), fail_names);
        KVB_TRY_GOTO(add_file(s, path), fail_names);
    }
    KVB_TRY_GOTO(finish_set(s), fail_names);
    free_names(names, n);
    return KVB_OK;

fail_names:
    if (d) closedir(d);
    free_names(names, n);
    return st;
}

kvb_status kvb_st_open_dir(const char *dir, kvb_st_set **out) {
    kvb_st_set *s = NULL;
    kvb_status st;
    char index_path[PATH_MAX];
    KVB_TRY(join_path(dir, ST_INDEX_NAME, index_path, sizeof index_path));
    KVB_TRY(set_new(&s));
    if (access(index_path, F_OK) == 0) KVB_TRY_GOTO(open_indexed(s, dir, index_path), fail_set);
    else KVB_TRY_GOTO(open_listed(s, dir), fail_set);
    *out = s;
    return KVB_OK;
fail_set:
    kvb_st_close(s);
    return st;
}

const kvb_st_tensor *kvb_st_find(const kvb_st_set *s, const char *name) {
    if (!s || !name) return NULL;
    int lo = 0, hi = s->n_ents - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(name, s->ents[mid].t.name);
        if (c == 0) return &s->ents[mid].t;
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

int kvb_st_count(const kvb_st_set *s) { return s ? s->n_ents : 0; }

const kvb_st_tensor *kvb_st_at(const kvb_st_set *s, int i) {
    if (!s || i < 0 || i >= s->n_ents) return NULL;
    return &s->ents[i].t;
}

/* ------------------------------------------------------------------------------------------ writing */

static const char *st_dtype_name(kvb_dtype dt) {
    switch (dt) {
    case KVB_DTYPE_F32: return "F32";
    case KVB_DTYPE_F16: return "F16";
    case KVB_DTYPE_BF16: return "BF16";
    case KVB_DTYPE_F8_E4M3: return "F8_E4M3";
    }
    return NULL;
}

static int cmp_wt_ptr(const void *a, const void *b) {
    return strcmp((*(const kvb_st_write_tensor *const *)a)->name, (*(const kvb_st_write_tensor *const *)b)->name);
}

/* Builds the header object for `order` (tensors sorted by name); data offsets follow that order. */
static kvb_status build_header(const kvb_st_write_tensor *const *order, int n, const char *metadata_json,
                               json_t **out, uint64_t *data_bytes) {
    kvb_status st = KVB_ERR_NOMEM;
    json_t *h = json_object();
    if (!h) return KVB_ERR_NOMEM;
    if (metadata_json) {
        json_t *m = NULL;
        KVB_TRY_GOTO(kvb_json_load_text(metadata_json, strlen(metadata_json), "safetensors metadata", &m), fail_h);
        const char *k;
        json_t *v;
        int ok = json_is_object(m);
        json_object_foreach(m, k, v) ok = ok && json_is_string(v);
        if (!ok) {
            KVB_LOG_E("safetensors metadata must be a JSON object of strings");
            json_decref(m);
            st = KVB_ERR_INVALID;
            goto fail_h;
        }
        if (json_object_set_new(h, "__metadata__", m) != 0) goto fail_h;
    }
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        const kvb_st_write_tensor *t = order[i];
        json_t *e = json_object(), *shape = json_array(), *offs = json_array();
        if (!e || !shape || !offs) {
            json_decref(e);
            json_decref(shape);
            json_decref(offs);
            goto fail_h;
        }
        uint64_t elems = 1;
        for (int d = 0; d < t->n_dims; d++) {
            elems *= (uint64_t)t->shape[d];
            json_array_append_new(shape, json_integer(t->shape[d]));
        }
        uint64_t bytes = elems * kvb_dtype_size(t->dtype);
        json_array_append_new(offs, json_integer((json_int_t)off));
        json_array_append_new(offs, json_integer((json_int_t)(off + bytes)));
        off += bytes;
        int bad = json_object_set_new(e, "dtype", json_string(st_dtype_name(t->dtype))) != 0;
        bad |= json_object_set_new(e, "shape", shape) != 0;
        bad |= json_object_set_new(e, "data_offsets", offs) != 0;
        bad |= json_object_set_new(h, t->name, e) != 0;
        if (bad) goto fail_h;
    }
    *out = h;
    *data_bytes = off;
    return KVB_OK;
fail_h:
    json_decref(h);
    return st;
}

static kvb_status check_write_tensor(const char *path, const kvb_st_write_tensor *t) {
    if (!t->name || !t->name[0] || !strcmp(t->name, "__metadata__")) {
        KVB_LOG_E("%s: a tensor has an empty or reserved name", path);
        return KVB_ERR_INVALID;
    }
    if (!st_dtype_name(t->dtype) || t->n_dims < 0 || t->n_dims > KVB_ST_MAX_DIMS) {
        KVB_LOG_E("%s: tensor \"%s\": bad dtype or dimension count", path, t->name);
        return KVB_ERR_INVALID;
    }
    uint64_t elems = 1;
    for (int d = 0; d < t->n_dims; d++) {
        if (t->shape[d] < 0 || (t->shape[d] > 0 && elems > (UINT64_MAX / 8) / (uint64_t)t->shape[d])) {
            KVB_LOG_E("%s: tensor \"%s\": bad shape[%d] = %lld", path, t->name, d, (long long)t->shape[d]);
            return KVB_ERR_INVALID;
        }
        elems *= (uint64_t)t->shape[d];
    }
    if (elems && !t->data) {
        KVB_LOG_E("%s: tensor \"%s\": no data", path, t->name);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

kvb_status kvb_st_write(const char *path, const kvb_st_write_tensor *tensors, int n, const char *metadata_json) {
    kvb_status st;
    if (n < 0 || (n > 0 && !tensors)) return KVB_ERR_INVALID;
    for (int i = 0; i < n; i++) KVB_TRY(check_write_tensor(path, &tensors[i]));
    const kvb_st_write_tensor **order = NULL;
    KVB_TRY(kvb_calloc((size_t)(n ? n : 1), sizeof *order, (void **)&order));
    for (int i = 0; i < n; i++) order[i] = &tensors[i];
    qsort(order, (size_t)n, sizeof *order, cmp_wt_ptr);
    for (int i = 1; i < n; i++) {
        if (!strcmp(order[i - 1]->name, order[i]->name)) {
            KVB_LOG_E("%s: tensor \"%s\" given twice", path, order[i]->name);
            st = KVB_ERR_INVALID;
            goto fail_order;
        }
    }
    json_t *h = NULL;
    uint64_t data_bytes = 0;
    KVB_TRY_GOTO(build_header(order, n, metadata_json, &h, &data_bytes), fail_order);
    char *text = json_dumps(h, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(h);
    if (!text) {
        st = KVB_ERR_NOMEM;
        goto fail_order;
    }
    size_t tlen = strlen(text);
    size_t hlen = (tlen + 7) / 8 * 8; /* pad with spaces so the data starts 8-byte aligned */
    FILE *f = fopen(path, "wb");
    if (!f) {
        KVB_LOG_E("%s: cannot create: %s", path, strerror(errno));
        st = KVB_ERR_IO;
        goto fail_text;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    int ok = fwrite(len8, 1, 8, f) == 8 && fwrite(text, 1, tlen, f) == tlen;
    for (size_t i = tlen; ok && i < hlen; i++) ok = fputc(' ', f) != EOF;
    for (int i = 0; ok && i < n; i++) {
        size_t bytes = kvb_dtype_size(order[i]->dtype);
        for (int d = 0; d < order[i]->n_dims; d++) bytes *= (size_t)order[i]->shape[d];
        ok = bytes == 0 || fwrite(order[i]->data, 1, bytes, f) == bytes; /* host is little-endian */
    }
    if (fclose(f) != 0) ok = 0;
    if (!ok) {
        KVB_LOG_E("%s: write failed: %s", path, strerror(errno));
        unlink(path);
        st = KVB_ERR_IO;
        goto fail_text;
    }
    free(text);
    free(order);
    return KVB_OK;

fail_text:
    free(text);
fail_order:
    free(order);
    return st;
}
