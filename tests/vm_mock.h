/* kvbank tests — a recording stand-in for the virtual-memory calls of the elastic pool
 * (common/mem/elastic_pool.h kvb_vm_ops), for the pure accounting tests: it keeps its own view of
 * which chunk is mapped where, backs every chunk with real bytes so that data can be followed through
 * remaps, refuses what a real VM layer would refuse (a map over a mapped place, an unmap of an empty
 * one), and can fail the n-th call. The real mappings are tested over common/mem/mem.h. */
#ifndef KVB_TESTS_VM_MOCK_H
#define KVB_TESTS_VM_MOCK_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem/elastic_pool.h"

#define VM_MOCK_MAX_RES 4096

typedef struct vm_mock {
    size_t chunk_bytes;
    int n_chunks;
    unsigned char *mem;          /* [n_chunks][chunk_bytes] the physical chunks */
    int32_t *at[VM_MOCK_MAX_RES];/* per reservation: chunk mapped at each index, -1 */
    int res_chunks[VM_MOCK_MAX_RES];
    int *n_places;               /* [n_chunks] places each chunk is mapped at */
    int max_places;              /* most places one chunk had at once (2 during a move) */
    long calls;                  /* map + unmap calls */
    long fail_at;                /* the call with this number fails (KVB_ERR_BACKEND); 0: never */
    int errors;                  /* refused calls (a bug in the caller) */
} vm_mock;

static inline kvb_status vm_mock_reserve(void *ctx, int32_t res, int n_chunks, uintptr_t *base) {
    vm_mock *m = ctx;
    if (res < 0 || res >= VM_MOCK_MAX_RES || m->at[res]) {
        m->errors++;
        return KVB_ERR_STATE;
    }
    m->at[res] = malloc((size_t)n_chunks * sizeof(int32_t));
    if (!m->at[res]) return KVB_ERR_NOMEM;
    for (int i = 0; i < n_chunks; i++) m->at[res][i] = -1;
    m->res_chunks[res] = n_chunks;
    *base = ((uintptr_t)(res + 1) << 32); /* a fake address: reservation in the high bits */
    return KVB_OK;
}

static inline void vm_mock_release(void *ctx, int32_t res) {
    vm_mock *m = ctx;
    for (int i = 0; i < m->res_chunks[res]; i++)
        if (m->at[res][i] >= 0) m->errors++; /* released with a chunk still mapped */
    free(m->at[res]);
    m->at[res] = NULL;
    m->res_chunks[res] = 0;
}

static inline kvb_status vm_mock_map(void *ctx, int32_t res, int idx, int32_t chunk) {
    vm_mock *m = ctx;
    if (m->fail_at && ++m->calls == m->fail_at) return KVB_ERR_BACKEND;
    if (!m->fail_at) m->calls++;
    if (res < 0 || res >= VM_MOCK_MAX_RES || !m->at[res] || idx < 0 || idx >= m->res_chunks[res] ||
        m->at[res][idx] >= 0 || chunk < 0 || chunk >= m->n_chunks) {
        m->errors++;
        return KVB_ERR_STATE;
    }
    m->at[res][idx] = chunk;
    if (++m->n_places[chunk] > m->max_places) m->max_places = m->n_places[chunk];
    return KVB_OK;
}

static inline kvb_status vm_mock_unmap(void *ctx, int32_t res, int idx) {
    vm_mock *m = ctx;
    if (m->fail_at && ++m->calls == m->fail_at) return KVB_ERR_BACKEND;
    if (!m->fail_at) m->calls++;
    if (res < 0 || res >= VM_MOCK_MAX_RES || !m->at[res] || idx < 0 || idx >= m->res_chunks[res] ||
        m->at[res][idx] < 0) {
        m->errors++;
        return KVB_ERR_STATE;
    }
    m->n_places[m->at[res][idx]]--;
    m->at[res][idx] = -1;
    return KVB_OK;
}

static inline void vm_mock_init(vm_mock *m, int n_chunks, size_t chunk_bytes, kvb_vm_ops *ops) {
    memset(m, 0, sizeof *m);
    m->n_chunks = n_chunks;
    m->chunk_bytes = chunk_bytes;
    m->mem = calloc((size_t)n_chunks, chunk_bytes);
    m->n_places = calloc((size_t)n_chunks, sizeof(int));
    *ops = (kvb_vm_ops){.reserve = vm_mock_reserve, .release = vm_mock_release, .map = vm_mock_map,
                        .unmap = vm_mock_unmap, .ctx = m};
}

static inline void vm_mock_free(vm_mock *m) {
    for (int r = 0; r < VM_MOCK_MAX_RES; r++) free(m->at[r]);
    free(m->mem);
    free(m->n_places);
}

/* The bytes behind a fake address (through the mock's mapping), NULL if unmapped. */
static inline unsigned char *vm_mock_deref(vm_mock *m, uintptr_t addr) {
    int32_t res = (int32_t)(addr >> 32) - 1;
    size_t off = (size_t)(addr & 0xffffffffu);
    if (res < 0 || res >= VM_MOCK_MAX_RES || !m->at[res]) return NULL;
    int idx = (int)(off / m->chunk_bytes);
    if (idx >= m->res_chunks[res] || m->at[res][idx] < 0) return NULL;
    return m->mem + (size_t)m->at[res][idx] * m->chunk_bytes + off % m->chunk_bytes;
}

/* Chunks the mock sees mapped in all. */
static inline int vm_mock_n_mapped(const vm_mock *m) {
    int n = 0;
    for (int c = 0; c < m->n_chunks; c++) n += m->n_places[c];
    return n;
}

#endif
