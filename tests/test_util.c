/* Unit tests of common/util: status strings, parsing, half-precision conversion, npy, JSON fields. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "common/util/json.h"
#include "common/util/npy.h"
#include "common/util/util.h"
#include "tests/harness.h"

KVB_TEST(status_strings) {
    ck_assert_str_eq(kvb_status_str(KVB_OK), "ok");
    ck_assert_str_eq(kvb_status_str(KVB_ERR_NOMEM), "out of memory");
    ck_assert_str_eq(kvb_status_str((kvb_status)-999), "unknown status");
}
KVB_TEST_END

KVB_TEST(parse_id_list) {
    int32_t *ids = NULL;
    int n = 0;
    ck_assert_int_eq(kvb_parse_id_list("1,22,333", &ids, &n), KVB_OK);
    ck_assert_int_eq(n, 3);
    ck_assert_int_eq(ids[0], 1);
    ck_assert_int_eq(ids[2], 333);
    free(ids);
    const char *bad[] = {"", ",", "1,,2", "1,", "-1", "abc", "1 2", "99999999999"};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad); i++) ck_assert_int_eq(kvb_parse_id_list(bad[i], &ids, &n), KVB_ERR_INVALID);
}
KVB_TEST_END

KVB_TEST(half_roundtrip) {
    /* Every finite f16 survives f16 -> f32 -> f16; known values convert exactly. */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00) continue;
        float f = kvb_f16_to_f32((uint16_t)h);
        ck_assert_uint_eq(kvb_f32_to_f16(f), h);
    }
    ck_assert_float_eq(kvb_f16_to_f32(0x3c00), 1.0f);
    ck_assert_float_eq(kvb_f16_to_f32(0xc000), -2.0f);
    ck_assert_float_eq(kvb_f16_to_f32(0x0001), ldexpf(1.0f, -24));
    ck_assert_float_eq(kvb_bf16_to_f32(0x3f80), 1.0f);
    ck_assert_uint_eq(kvb_f32_to_bf16(1.0f), 0x3f80);
    /* round to nearest even: 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7 */
    ck_assert_uint_eq(kvb_f32_to_bf16(1.0f + ldexpf(1.0f, -8)), 0x3f80);
    ck_assert_uint_eq(kvb_f32_to_bf16(1.0f + 3 * ldexpf(1.0f, -8)), 0x3f82);
}
KVB_TEST_END

KVB_TEST(npy_header) {
    char path[] = "/tmp/kvb-npy-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    float data[6] = {1, 2, 3, 4, 5, 6};
    ck_assert_int_eq(kvb_npy_write_f32(path, data, 2, 3), KVB_OK);
    FILE *f = fopen(path, "rb");
    unsigned char hdr[10];
    ck_assert_uint_eq(fread(hdr, 1, 10, f), 10);
    int hlen = hdr[8] | hdr[9] << 8;
    ck_assert_int_eq((10 + hlen) % 64, 0);
    char dict[256] = {0};
    ck_assert_uint_eq(fread(dict, 1, (size_t)hlen, f), (size_t)hlen);
    ck_assert_ptr_nonnull(strstr(dict, "'shape': (2, 3)"));
    float back[6];
    ck_assert_uint_eq(fread(back, sizeof(float), 6, f), 6);
    ck_assert_float_eq(back[5], 6.0f);
    fclose(f);
    unlink(path);
}
KVB_TEST_END

KVB_TEST(json_fields) {
    json_t *j = NULL;
    const char *txt = "{\"a\": 3, \"b\": 2.5, \"c\": true, \"s\": \"x\", \"f\": 4.0}";
    ck_assert_int_eq(kvb_json_load_text(txt, strlen(txt), "t", &j), KVB_OK);
    int64_t v = -1;
    ck_assert_int_eq(kvb_json_get_int(j, "a", 1, 0, 10, "t", &v), KVB_OK);
    ck_assert_int_eq(v, 3);
    ck_assert_int_eq(kvb_json_get_int(j, "f", 1, 0, 10, "t", &v), KVB_OK);
    ck_assert_int_eq(v, 4);
    ck_assert_int_eq(kvb_json_get_int(j, "b", 1, 0, 10, "t", &v), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_json_get_int(j, "a", 1, 5, 10, "t", &v), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_json_get_int(j, "zz", 1, 0, 10, "t", &v), KVB_ERR_INVALID);
    v = 77;
    ck_assert_int_eq(kvb_json_get_int(j, "zz", 0, 0, 10, "t", &v), KVB_OK);
    ck_assert_int_eq(v, 77);
    int b = 0;
    ck_assert_int_eq(kvb_json_get_bool(j, "c", 1, "t", &b), KVB_OK);
    ck_assert_int_eq(b, 1);
    json_decref(j);
    ck_assert_int_eq(kvb_json_load_text("{\"a\": 1, \"a\": 2}", 16, "dup", &j), KVB_ERR_FORMAT);
    ck_assert_int_eq(kvb_json_load_text("{", 1, "trunc", &j), KVB_ERR_FORMAT);
}
KVB_TEST_END

KVB_TEST_MAIN("util", KVB_T(status_strings, 10), KVB_T(parse_id_list, 10), KVB_T(half_roundtrip, 30),
              KVB_T(npy_header, 10), KVB_T(json_fields, 10))
