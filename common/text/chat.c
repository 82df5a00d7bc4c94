/* kvbank — chat templates over the Jinja subset interpreter (see chat.h). */
#include "common/text/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/jinja.h"
#include "common/text/text_impl.h"
#include "common/util/util.h"

#define MAX_TEMPLATE_FILE (4u << 20) /* chat_template.jinja: real ones are tens of KB */

struct kvb_chat_template {
    kvb_jinja *jinja;
    char *bos, *eos;     /* the tokens' text, or NULL */
    kvb_text_limits lim; /* the budgets every render runs under */
};

kvb_status kvb_chat_template_parse(const char *source, const char *bos_token, const char *eos_token,
                                   kvb_chat_template **out, char *err, size_t err_len) {
    kvb_chat_template *t;
    *out = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *t, (void **)&t));
    kvb_text_limits_default(&t->lim);
    kvb_status st = kvb_jinja_parse(source, strlen(source), &t->jinja, err, err_len);
    if (st == KVB_OK && bos_token) st = kvb_strdup(bos_token, &t->bos);
    if (st == KVB_OK && eos_token) st = kvb_strdup(eos_token, &t->eos);
    if (st != KVB_OK) {
        kvb_chat_template_destroy(t);
        return st;
    }
    *out = t;
    return KVB_OK;
}

/* bos_token / eos_token of tokenizer_config.json: a string or {"content": ...}. */
static const char *token_text(const json_t *cfg, const char *key) {
    const json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

kvb_status kvb_chat_template_load_why(const char *model_dir, kvb_chat_template **out, char *why, size_t why_len) {
    json_t *cfg = NULL;
    char *file_src = NULL, err[512] = "";
    const char *src = NULL, *where = "tokenizer_config.json";
    *out = NULL;
    if (why_len) why[0] = '\0';
    kvb_status st = kvb__model_json(model_dir, "tokenizer_config.json", 1, 1, &cfg);
    if (st != KVB_OK) {
        snprintf(why, why_len, "tokenizer_config.json cannot be read (%s)", kvb_status_str(st));
        return st;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/chat_template.jinja", model_dir);
    size_t n = 0;
    st = kvb_read_file(path, MAX_TEMPLATE_FILE, &file_src, &n);
    if (st == KVB_OK) {
        where = "chat_template.jinja";
        src = file_src;
    } else if (st != KVB_ERR_NOT_FOUND) {
        snprintf(err, sizeof err, "cannot be read (%s)", kvb_status_str(st));
        where = "chat_template.jinja";
    } else {
        st = KVB_OK;
        const json_t *ct = json_object_get(cfg, "chat_template");
        if (json_is_string(ct)) src = json_string_value(ct);
        else if (json_is_array(ct)) { /* [{"name": "default", "template": ...}, {"name": "tool_use", ...}] */
            size_t i;
            const json_t *e;
            json_array_foreach(ct, i, e) {
                const json_t *name = json_object_get(e, "name");
                if (json_is_string(name) && !strcmp(json_string_value(name), "default"))
                    src = json_string_value(json_object_get(e, "template"));
            }
            if (!src) {
                snprintf(err, sizeof err, "chat_template is a list without a \"default\" template");
                st = KVB_ERR_UNSUPPORTED;
            }
        } else if (ct && !json_is_null(ct)) {
            snprintf(err, sizeof err, "chat_template must be a string or a list");
            st = KVB_ERR_FORMAT;
        }
    }
    if (st == KVB_OK && !src) st = KVB_ERR_NOT_FOUND;
    if (st == KVB_OK)
        st = kvb_chat_template_parse(src, token_text(cfg, "bos_token"), token_text(cfg, "eos_token"), out, err, sizeof err);
    if (st != KVB_OK && st != KVB_ERR_NOT_FOUND) {
        KVB_LOG_E("%s: %s: %s", model_dir, where, err);
        snprintf(why, why_len, "%s: %s", where, err);
    }
    free(file_src);
    json_decref(cfg);
    return st;
}

kvb_status kvb_chat_template_load(const char *model_dir, kvb_chat_template **out) {
    char why[8];
    return kvb_chat_template_load_why(model_dir, out, why, sizeof why);
}

void kvb_chat_template_set_limits(kvb_chat_template *t, const kvb_text_limits *l) { t->lim = *l; }

void kvb_chat_template_destroy(kvb_chat_template *t) {
    if (!t) return;
    kvb_jinja_destroy(t->jinja);
    free(t->bos);
    free(t->eos);
    free(t);
}

/* OpenAI's content parts ([{"type": "text", "text": ...}, ...]) joined into one string with "\n", as
 * vLLM hands them to templates that expect text. *out is a new reference: `messages` itself when no
 * message has parts. */
static kvb_status flatten_parts(const json_t *messages, json_t **out, char *err, size_t err_len) {
    size_t i;
    const json_t *m;
    *out = NULL;
    json_t *copy = NULL;
    json_array_foreach(messages, i, m) {
        const json_t *content = json_object_get(m, "content");
        if (!json_is_array(content)) continue;
        if (!copy && !(copy = json_deep_copy(messages))) return KVB_ERR_NOMEM;
        size_t k, len = 0;
        const json_t *part;
        json_array_foreach(content, k, part) {
            const char *type = json_string_value(json_object_get(part, "type"));
            const json_t *text = json_object_get(part, "text");
            if (!type || strcmp(type, "text") || !json_is_string(text)) {
                snprintf(err, err_len, "messages[%zu].content[%zu]: only parts of type \"text\" with a \"text\" string are supported",
                         i, k);
                json_decref(copy);
                return KVB_ERR_INVALID;
            }
            len += json_string_length(text) + 1;
        }
        char *joined = malloc(len + 1), *p = joined;
        if (!joined) {
            json_decref(copy);
            return KVB_ERR_NOMEM;
        }
        json_array_foreach(content, k, part) {
            const json_t *text = json_object_get(part, "text");
            if (k) *p++ = '\n';
            memcpy(p, json_string_value(text), json_string_length(text));
            p += json_string_length(text);
        }
        int bad = json_object_set_new(json_array_get(copy, i), "content", json_stringn(joined, (size_t)(p - joined)));
        free(joined);
        if (bad) {
            json_decref(copy);
            return KVB_ERR_NOMEM;
        }
    }
    *out = copy ? copy : json_incref((json_t *)messages);
    return KVB_OK;
}

kvb_status kvb_chat_render(const kvb_chat_template *t, const json_t *messages, int add_generation_prompt,
                           const json_t *extra, char **out, char *err, size_t err_len) {
    *out = NULL;
    if (!json_is_array(messages)) {
        snprintf(err, err_len, "messages must be an array");
        return KVB_ERR_INVALID;
    }
    if (extra && !json_is_object(extra)) {
        snprintf(err, err_len, "extra template variables must be an object");
        return KVB_ERR_INVALID;
    }
    json_t *msgs;
    KVB_TRY(flatten_parts(messages, &msgs, err, err_len));
    json_t *vars = json_object();
    if (!vars) {
        json_decref(msgs);
        return KVB_ERR_NOMEM;
    }
    int bad = json_object_set_new(vars, "messages", msgs) |
              json_object_set_new(vars, "add_generation_prompt", json_boolean(add_generation_prompt)) |
              json_object_set_new(vars, "bos_token", json_string(t->bos ? t->bos : "")) |
              json_object_set_new(vars, "eos_token", json_string(t->eos ? t->eos : ""));
    if (extra) bad |= json_object_update(vars, (json_t *)extra);
    size_t len;
    kvb_status st = bad ? KVB_ERR_NOMEM : kvb_jinja_render(t->jinja, vars, &t->lim, out, &len, err, err_len);
    json_decref(vars);
    return st;
}
