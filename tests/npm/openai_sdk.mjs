// kvbank-gateway driven by the official OpenAI Node SDK (the `openai` package pinned in package.json),
// as an application written for OpenAI or vLLM would: tests/test_openai_sdk.sh starts a node with a
// random-weight model carrying Qwen3's real tokenizer and chat template, then runs
//   node openai_sdk.mjs --base-url http://127.0.0.1:PORT/v1 --model NAME [--only CASE]
// Each case is one entry of CASES (name, async function); a case that throws fails the run.
import assert from "node:assert/strict";
import OpenAI from "openai";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const MODEL = args.model;
const BASE = args["base-url"];
// no retries: a 429 or 5xx must show, not be retried away
const client = new OpenAI({ baseURL: BASE, apiKey: "sk-unused", maxRetries: 0, timeout: 120000 });
const GATEWAY = BASE.replace(/\/v1$/, "");

const messages = [
  { role: "system", content: "You are a terse assistant." },
  { role: "user", content: "Name three uses of a KV cache." },
];
// greedy and long enough to be worth comparing; ignore_eos (vLLM's) keeps the length fixed
const greedy = { model: MODEL, temperature: 0, max_tokens: 12, ignore_eos: true };

// structured output: a schema, and a checker of what the tests use of JSON Schema
const PERSON = {
  type: "object",
  properties: {
    name: { type: "string", maxLength: 12 },
    age: { type: "integer", minimum: 0, maximum: 150 },
    tags: { type: "array", items: { enum: ["a", "b", "c"] }, minItems: 1, maxItems: 3 },
    email: { type: "string", format: "email" },
  },
  required: ["name", "age", "tags"],
  additionalProperties: false,
};
const WEATHER = { type: "function", function: { name: "get_weather", description: "Weather in a city", parameters: {
  type: "object",
  properties: { city: { type: "string", maxLength: 20 }, unit: { enum: ["celsius", "fahrenheit"] },
                days: { type: "integer", minimum: 1, maximum: 7 } },
  required: ["city", "unit"],
} } };
const TIME = { type: "function", function: { name: "get_time", parameters: {
  type: "object", properties: { zone: { type: "string", pattern: "^[A-Z]{3}$" } }, required: ["zone"],
} } };
const toolMessages = [{ role: "user", content: "What is the weather in Paris?" }];

function fits(v, s, at) {
  if (s.enum) return assert.ok(s.enum.includes(v), `${at}: ${JSON.stringify(v)} not in ${s.enum}`);
  if (s.type === "object") {
    assert.ok(v && typeof v === "object" && !Array.isArray(v), `${at}: not an object`);
    for (const k of s.required ?? []) assert.ok(k in v, `${at}: '${k}' missing`);
    for (const [k, x] of Object.entries(v)) {
      assert.ok(k in (s.properties ?? {}), `${at}: '${k}' is not in the schema`);
      fits(x, s.properties[k], `${at}.${k}`);
    }
  } else if (s.type === "array") {
    assert.ok(Array.isArray(v) && v.length >= (s.minItems ?? 0) && v.length <= (s.maxItems ?? Infinity), `${at}: ${JSON.stringify(v)}`);
    v.forEach((x, i) => fits(x, s.items, `${at}[${i}]`));
  } else if (s.type === "integer") {
    assert.ok(Number.isInteger(v) && v >= (s.minimum ?? -Infinity) && v <= (s.maximum ?? Infinity), `${at}: ${v}`);
  } else if (s.type === "string") {
    assert.equal(typeof v, "string", `${at}: ${JSON.stringify(v)}`);
    assert.ok([...v].length <= (s.maxLength ?? Infinity), `${at}: longer than ${s.maxLength}`);
    if (s.pattern) assert.match(v, new RegExp(s.pattern), `${at}`);
    if (s.format === "email") assert.match(v, /^[^@\s]+@[^@\s]+$/, `${at}: ${v}`);
  }
}

async function gatewayJson(path, body) {
  const r = await fetch(GATEWAY + path, body ? { method: "POST", body: JSON.stringify(body) } : {});
  assert.equal(r.status, 200, `${path}: ${r.status}`);
  return r.json();
}

async function metric(name, labels) {
  const text = await (await fetch(GATEWAY + "/metrics")).text();
  const want = Object.entries(labels).map(([k, v]) => `${k}="${v}"`).join(",");
  const line = text.split("\n").find((l) => l.startsWith(want ? `${name}{${want}} ` : `${name} `));
  return line === undefined ? undefined : Number(line.split(" ").pop());
}

// Expects `promise` to be refused with `status` (the SDK's error class for it) naming `param`.
async function refused(promise, status, param, cls) {
  try {
    await promise;
  } catch (e) {
    assert.ok(e instanceof OpenAI.APIError, `not an APIError: ${e}`);
    assert.equal(e.status, status, `status ${e.status}: ${e.message}`);
    if (cls) assert.ok(e instanceof cls, `${e.constructor.name}, want ${cls.name}`);
    if (param !== undefined) assert.equal(e.param, param, `param ${e.param}: ${e.message}`);
    assert.ok(e.message.length > 4 && e.type, `an OpenAI-shaped error: ${JSON.stringify(e.error)}`);
    return e;
  }
  assert.fail(`accepted; want ${status} on ${param}`);
}

async function collect(stream) {
  let text = "";
  const chunks = [];
  for await (const chunk of stream) {
    chunks.push(chunk);
    const c = chunk.choices[0];
    if (c) text += (c.delta ? c.delta.content : c.text) ?? "";
  }
  return { text, chunks };
}

const CASES = [
  ["models", async () => {
    const ids = [];
    for await (const m of client.models.list()) ids.push(m.id);
    assert.ok(ids.includes(MODEL), `models.list: ${ids}`);
    const m = await client.models.retrieve(MODEL);
    assert.equal(m.id, MODEL);
    assert.equal(m.object, "model");
    assert.ok(m.max_model_len > 0, `max_model_len ${m.max_model_len}`);
    await refused(client.models.retrieve("no-such-model"), 404, "model", OpenAI.NotFoundError);
    return `models.list has ${MODEL}; models.retrieve (max_model_len ${m.max_model_len}); 404 for another`;
  }],

  ["chat", async () => {
    const r = await client.chat.completions.create({ ...greedy, messages, return_token_ids: true });
    assert.equal(r.object, "chat.completion");
    assert.ok(r.id.startsWith("chatcmpl-"), r.id);
    assert.equal(r.model, MODEL);
    const c = r.choices[0];
    assert.equal(c.message.role, "assistant");
    assert.equal(c.finish_reason, "length");
    assert.equal(r.usage.completion_tokens, 12);
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 12);
    // the prompt is the chat template rendered and tokenized; the text is the decode of the tokens
    const t = await gatewayJson("/tokenize", { model: MODEL, messages });
    assert.equal(r.usage.prompt_tokens, t.count);
    const d = await gatewayJson("/detokenize", { model: MODEL, tokens: c.token_ids });
    assert.equal(c.message.content, d.prompt);
    const again = await client.chat.completions.create({ ...greedy, messages });
    assert.equal(again.choices[0].message.content, c.message.content, "greedy is repeatable");
    return `${r.usage.prompt_tokens} prompt tokens (the template's), 12 generated: ${JSON.stringify(c.message.content)}`;
  }],

  ["chat-stream", async () => {
    const whole = (await client.chat.completions.create({ ...greedy, messages })).choices[0].message.content;
    const stream = await client.chat.completions.create({
      ...greedy, messages, stream: true, stream_options: { include_usage: true },
    });
    const { text, chunks } = await collect(stream);
    assert.equal(text, whole, "the deltas add up to the message");
    assert.equal(chunks[0].choices[0].delta.role, "assistant");
    assert.ok(chunks.every((k) => k.object === "chat.completion.chunk" && k.id === chunks[0].id));
    const last = chunks.at(-1);
    assert.deepEqual(last.choices, []);
    assert.equal(last.usage.completion_tokens, 12);
    const fins = chunks.filter((k) => k.choices.length).map((k) => k.choices[0].finish_reason);
    assert.equal(fins.at(-1), "length");
    assert.ok(fins.slice(0, -1).every((f) => f === null));
    // the SDK's own accumulator agrees
    const acc = await client.chat.completions.stream({ ...greedy, messages }).finalChatCompletion();
    assert.equal(acc.choices[0].message.content, whole);
    return `${chunks.length} chunks, text == the non-streamed message, usage last; the SDK's stream helper agrees`;
  }],

  ["completions", async () => {
    const prompt = "The capital of France is";
    const r = await client.completions.create({ ...greedy, prompt, max_tokens: 16 });
    assert.equal(r.object, "text_completion");
    assert.equal(r.choices[0].finish_reason, "length");
    assert.equal(r.usage.completion_tokens, 16);
    const full = r.choices[0].text;
    const { text, chunks } = await collect(await client.completions.create({ ...greedy, prompt, max_tokens: 16, stream: true }));
    assert.equal(text, full, "streamed text == the text");
    assert.equal(chunks.at(-1).choices[0].finish_reason, "length");
    // a stop string inside the text ends it there (taken from the middle of what the model wrote)
    const chars = [...full];
    const at = chars.findIndex((ch, i) => i >= 2 && ch.trim() && ch !== "\ufffd");
    if (at >= 0) {
      const stop = chars[at];
      const cut = full.indexOf(stop);
      const s = await client.completions.create({ ...greedy, prompt, max_tokens: 16, stop: [stop] });
      assert.equal(s.choices[0].text, full.slice(0, cut));
      assert.equal(s.choices[0].finish_reason, "stop");
    }
    return `text and streamed text agree (${JSON.stringify(full)}); stop strings cut it`;
  }],

  ["errors", async () => {
    const BadRequest = OpenAI.BadRequestError;
    await refused(client.chat.completions.create({ ...greedy, messages, n: 0 }), 400, "n", BadRequest);
    await refused(client.chat.completions.create({ ...greedy, messages, temperature: "hot" }), 400, "temperature", BadRequest);
    await refused(client.chat.completions.create({ ...greedy, messages, temprature: 0 }), 400, "temprature", BadRequest);
    await refused(client.chat.completions.create({ ...greedy, messages, store: "yes" }), 400, "store", BadRequest);
    await refused(client.chat.completions.create({ ...greedy, model: "no-such-model", messages }), 404, "model", OpenAI.NotFoundError);
    await refused(client.completions.create({ ...greedy, prompt: "x", max_tokens: 1 << 20 }), 400, "max_tokens", BadRequest);
    // streamed requests are refused the same way, before any event
    await refused(client.chat.completions.create({ ...greedy, messages, stream: true, frequency_penalty: 2.5 }),
      400, "frequency_penalty", BadRequest);
    await refused(client.completions.create({ ...greedy, prompt: "x", stream: true, n: 1, best_of: 2 }), 400, "best_of", BadRequest);
    await refused(client.chat.completions.create({ ...greedy, messages, top_logprobs: 3 }), 400, "top_logprobs", BadRequest);
    await refused(client.chat.completions.create({ ...greedy, messages, logprobs: true, top_logprobs: 21 }), 400, "top_logprobs", BadRequest);
    await refused(client.completions.create({ ...greedy, prompt: "x", logit_bias: { "1000000": 5 } }), 400, "logit_bias", BadRequest);
    await refused(client.completions.create({ ...greedy, prompt: "x", max_tokens: 0 }), 400, "max_tokens", BadRequest);
    return "n, wrong types, a misspelt field, an unknown model, max_tokens, a streamed request: SDK error classes with status and param";
  }],

  ["ignored-fields", async () => {
    const plain = (await client.chat.completions.create({ ...greedy, messages })).choices[0].message.content;
    // what agent frameworks and the SDK's users send, which vLLM accepts and does not use
    const r = await client.chat.completions.create({
      ...greedy, messages, store: true, metadata: { app: "sdk-test" }, user: "u-42", service_tier: "auto",
      reasoning_effort: "low", parallel_tool_calls: false, prompt_cache_key: "k1", safety_identifier: "s1",
      n: 1, presence_penalty: 0, frequency_penalty: 0, logprobs: false, tool_choice: "none", tools: [],
      response_format: { type: "text" },
    });
    assert.equal(r.choices[0].message.content, plain, "ignored fields change nothing");
    const c = await client.completions.create({ ...greedy, prompt: "Hi", user: "u-42", metadata: { a: "b" }, echo: false });
    assert.equal(c.choices[0].finish_reason, "length");
    assert.ok((await metric("kvbank_gateway_ignored_fields_total", { field: "reasoning_effort" })) >= 1);
    return "store, metadata, user, service_tier, reasoning_effort, parallel_tool_calls without tools, ... accepted; same text";
  }],

  ["json-schema", async () => {
    const r = await client.chat.completions.create({
      model: MODEL, messages, temperature: 0.8, seed: 11, max_tokens: 400,
      response_format: { type: "json_schema", json_schema: { name: "person", strict: true, schema: PERSON } },
    });
    const c = r.choices[0];
    assert.equal(c.finish_reason, "stop", `finish ${c.finish_reason}: ${c.message.content}`);
    const v = JSON.parse(c.message.content);
    fits(v, PERSON, "$");
    // streamed: the deltas add up to a document that fits too
    const { text, chunks } = await collect(await client.chat.completions.create({
      model: MODEL, messages, temperature: 0.8, seed: 12, max_tokens: 400, stream: true,
      response_format: { type: "json_schema", json_schema: { name: "person", schema: PERSON } },
    }));
    fits(JSON.parse(text), PERSON, "$");
    assert.equal(chunks.at(-1).choices[0].finish_reason, "stop");
    // vLLM's fields: a choice, a regex (structured_outputs), any JSON object
    const ch = await client.chat.completions.create({ ...greedy, max_tokens: 20, messages, guided_choice: ["red", "green", "blue"] });
    assert.ok(["red", "green", "blue"].includes(ch.choices[0].message.content), ch.choices[0].message.content);
    const rx = await client.completions.create({ ...greedy, prompt: "Code:", max_tokens: 20, structured_outputs: { regex: "[A-Z]{3}-[0-9]{4}" } });
    assert.match(rx.choices[0].text, /^[A-Z]{3}-[0-9]{4}$/);
    assert.equal(rx.choices[0].finish_reason, "stop");
    const jo = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 300, temperature: 0.5, seed: 3,
                                                      response_format: { type: "json_object" } });
    if (jo.choices[0].finish_reason === "stop") assert.equal(typeof JSON.parse(jo.choices[0].message.content), "object");
    else assert.equal(jo.choices[0].finish_reason, "length");
    return `json_schema output parses and fits (${c.message.content.length} bytes, streamed too); guided_choice ` +
           `${JSON.stringify(ch.choices[0].message.content)}, regex ${JSON.stringify(rx.choices[0].text)}`;
  }],

  ["structured-errors", async () => {
    const e = await refused(client.chat.completions.create({
      ...greedy, messages, response_format: { type: "json_schema", json_schema: { name: "x", schema: { type: "object", not: {} } } },
    }), 400, "response_format", OpenAI.BadRequestError);
    assert.match(e.message, /'not' is not supported/);
    await refused(client.chat.completions.create({ ...greedy, messages, guided_regex: "a(?=b)" }), 400, "guided_regex");
    await refused(client.chat.completions.create({ ...greedy, messages, stream: true,
                                                   guided_json: { type: "object", properties: { a: { $ref: "#/nowhere" } } } }),
                  400, "guided_json");
    await refused(client.chat.completions.create({ ...greedy, messages, guided_choice: ["a"], guided_regex: "b" }), 400, undefined);
    await refused(client.chat.completions.create({ ...greedy, messages, tools: [WEATHER],
                                                   tool_choice: { type: "function", function: { name: "nope" } } }), 400, "tool_choice");
    await refused(client.chat.completions.create({ ...greedy, messages, tool_choice: "required" }), 400, "tool_choice");
    return `a schema the engine refuses is a 400 with its message (${JSON.stringify(e.message)}); regex, $ref, two grammars, tool_choice`;
  }],

  ["tool-forced", async () => {
    const r = await client.chat.completions.create({
      model: MODEL, messages: toolMessages, temperature: 0.9, seed: 5, max_tokens: 400, tools: [WEATHER, TIME],
      tool_choice: { type: "function", function: { name: "get_weather" } },
    });
    const c = r.choices[0];
    assert.equal(c.finish_reason, "tool_calls", JSON.stringify(c));
    assert.equal(c.message.role, "assistant");
    assert.equal(c.message.tool_calls.length, 1);
    const call = c.message.tool_calls[0];
    assert.equal(call.type, "function");
    assert.match(call.id, /^call_[A-Za-z0-9]{24}$/);
    assert.equal(call.function.name, "get_weather");
    fits(JSON.parse(call.function.arguments), WEATHER.function.parameters, "arguments");
    // required over two tools: one call of either, whose arguments fit that tool
    const q = await client.chat.completions.create({
      model: MODEL, messages: toolMessages, temperature: 0.9, seed: 6, max_tokens: 400, tools: [WEATHER, TIME], tool_choice: "required",
    });
    const qc = q.choices[0].message.tool_calls[0];
    const tool = [WEATHER, TIME].find((t) => t.function.name === qc.function.name);
    assert.ok(tool, qc.function.name);
    fits(JSON.parse(qc.function.arguments), tool.function.parameters, "arguments");
    // the conversation goes on: the call and the tool's answer rendered by the template
    const next = await client.chat.completions.create({
      ...greedy, tools: [WEATHER, TIME],
      messages: [...toolMessages, c.message, { role: "tool", tool_call_id: call.id, content: "{\"temp\": 21}" }],
    });
    assert.ok(next.usage.prompt_tokens > r.usage.prompt_tokens, "the call and its result are in the prompt");
    return `get_weather(${call.function.arguments}) fits its schema; required chose ${qc.function.name}; the tool's answer goes back`;
  }],

  ["tool-stream", async () => {
    const req = { model: MODEL, messages: toolMessages, temperature: 0.9, seed: 8, max_tokens: 400, tools: [WEATHER, TIME],
                  tool_choice: { type: "function", function: { name: "get_weather" } } };
    const { chunks } = await collect(await client.chat.completions.create({ ...req, stream: true }));
    const deltas = chunks.filter((k) => k.choices.length && k.choices[0].delta.tool_calls).map((k) => k.choices[0].delta.tool_calls[0]);
    assert.ok(deltas.length >= 2, `${deltas.length} tool_calls deltas`);
    assert.equal(deltas[0].index, 0);
    assert.match(deltas[0].id, /^call_/);
    assert.equal(deltas[0].type, "function");
    assert.equal(deltas[0].function.name, "get_weather");
    assert.ok(deltas.slice(1).every((d) => d.index === 0 && d.id === undefined && d.function.name === undefined));
    const args = deltas.map((d) => d.function.arguments).join("");
    fits(JSON.parse(args), WEATHER.function.parameters, "arguments");
    assert.equal(chunks.filter((k) => k.choices.length).at(-1).choices[0].finish_reason, "tool_calls");
    // the SDK's own accumulator puts the deltas together the same way
    const acc = await client.chat.completions.stream({ ...req }).finalChatCompletion();
    const ac = acc.choices[0].message.tool_calls[0];
    assert.equal(ac.function.name, "get_weather");
    assert.equal(ac.function.arguments, args, "same seed, same call");
    return `${deltas.length} tool_calls deltas (id, type, name, then ${deltas.length - 1} argument pieces) reassemble to ${args}`;
  }],

  ["chat-logprobs", async () => {
    const r = await client.chat.completions.create({ ...greedy, messages, logprobs: true, top_logprobs: 5 });
    const content = r.choices[0].logprobs.content;
    assert.equal(content.length, r.usage.completion_tokens);
    for (const t of content) {
      assert.equal(t.top_logprobs.length, 5);
      // greedy: the chosen token is the most likely of its top list
      assert.equal(t.token, t.top_logprobs[0].token);
      assert.ok(Math.abs(t.logprob - t.top_logprobs[0].logprob) < 1e-6, `${t.logprob} vs ${t.top_logprobs[0].logprob}`);
      assert.ok(t.logprob <= 0 && t.top_logprobs.every((a, i) => i === 0 || a.logprob <= t.top_logprobs[i - 1].logprob));
      assert.ok(Array.isArray(t.bytes) && t.bytes.length > 0);
    }
    // the bytes of the tokens are the text (none of them special here: the message decodes every token)
    const ids = (await client.chat.completions.create({ ...greedy, messages, return_token_ids: true })).choices[0].token_ids;
    const d = await gatewayJson("/detokenize", { model: MODEL, tokens: ids });
    if (d.prompt === r.choices[0].message.content) {
      assert.equal(Buffer.from(content.flatMap((t) => t.bytes)).toString("utf8"), r.choices[0].message.content);
    }
    // streamed: the same tokens and logprobs, chunk by chunk
    const { chunks } = await collect(await client.chat.completions.create({
      ...greedy, messages, logprobs: true, top_logprobs: 5, stream: true,
    }));
    const streamed = chunks.flatMap((k) => (k.choices[0] && k.choices[0].logprobs ? k.choices[0].logprobs.content : []));
    assert.deepEqual(streamed.map((t) => t.token), content.map((t) => t.token));
    assert.deepEqual(streamed.map((t) => t.logprob), content.map((t) => t.logprob));
    return `${content.length} tokens, each the first of its 5 alternatives (greedy); streamed the same`;
  }],

  ["completions-logprobs", async () => {
    const prompt = "The capital of France is";
    const r = await client.completions.create({ ...greedy, prompt, max_tokens: 8, logprobs: 3 });
    const lp = r.choices[0].logprobs;
    assert.equal(lp.tokens.length, 8);
    for (let i = 0; i < 8; i++) {
      const alts = Object.values(lp.top_logprobs[i]);
      assert.ok(alts.length >= 3 && alts.length <= 4, `${alts.length} alternatives`);
      // greedy: the chosen token's logprob is the highest of its position's
      assert.ok(Math.abs(Math.max(...alts) - lp.token_logprobs[i]) < 1e-6);
      assert.equal(lp.top_logprobs[i][lp.tokens[i]], lp.token_logprobs[i]);
      assert.ok(i === 0 || lp.text_offset[i] >= lp.text_offset[i - 1]);
    }
    // echo with max_tokens 0: the prompt alone, its logprobs (the first token has none)
    const ids = (await gatewayJson("/tokenize", { model: MODEL, prompt })).tokens;
    const e = await client.completions.create({ model: MODEL, prompt, max_tokens: 0, echo: true, logprobs: 1 });
    assert.equal(e.choices[0].text, prompt);
    assert.equal(e.choices[0].logprobs.tokens.length, ids.length);
    assert.equal(e.choices[0].logprobs.token_logprobs[0], null);
    assert.equal(e.usage.completion_tokens, 0);
    // a prompt's logprob is what generating that token had: the prompt and the first greedy token, echoed
    const one = await client.completions.create({ ...greedy, prompt: ids, max_tokens: 1, logprobs: 1, return_token_ids: true });
    const t = one.choices[0].token_ids[0];
    const both = await client.completions.create({ model: MODEL, prompt: [...ids, t], max_tokens: 0, echo: true, logprobs: 1 });
    const last = both.choices[0].logprobs.token_logprobs.at(-1);
    assert.ok(Math.abs(last - one.choices[0].logprobs.token_logprobs[0]) < 1e-3, `${last} vs ${one.choices[0].logprobs.token_logprobs[0]}`);
    // echo with generation: the prompt starts the text, streamed too
    const g = await client.completions.create({ ...greedy, prompt, max_tokens: 8, echo: true });
    assert.equal(g.choices[0].text, prompt + r.choices[0].text);
    const { text } = await collect(await client.completions.create({ ...greedy, prompt, max_tokens: 8, echo: true, stream: true }));
    assert.equal(text, g.choices[0].text);
    return "the chosen token is the most likely of each position (greedy); echo gives the prompt and its logprobs, " +
      "equal to generating its last token";
  }],

  ["chat-echo", async () => {
    // vLLM's echo in chat: the last message, when it has the reply's role, starts the reply
    const conv = [...messages, { role: "assistant", content: "Sure:" }];
    const plain = (await client.chat.completions.create({ ...greedy, messages: conv, add_generation_prompt: false })).choices[0];
    const r = (await client.chat.completions.create({ ...greedy, messages: conv, add_generation_prompt: false, echo: true })).choices[0];
    assert.equal(r.message.content, "Sure:" + plain.message.content);
    const { text } = await collect(await client.chat.completions.create({
      ...greedy, messages: conv, add_generation_prompt: false, echo: true, stream: true,
    }));
    assert.equal(text, r.message.content);
    const user = (await client.chat.completions.create({ ...greedy, messages, echo: true })).choices[0].message.content;
    const none = (await client.chat.completions.create({ ...greedy, messages })).choices[0].message.content;
    assert.equal(user, none, "a last message of another role is not echoed");
    return "the assistant's last message starts the reply (streamed too); a user's does not";
  }],

  ["n", async () => {
    const sampled = { model: MODEL, messages, max_tokens: 10, ignore_eos: true, temperature: 1, seed: 7 };
    const r = await client.chat.completions.create({ ...sampled, n: 2 });
    assert.deepEqual(r.choices.map((c) => c.index), [0, 1]);
    assert.notEqual(r.choices[0].message.content, r.choices[1].message.content, "two different samples");
    assert.equal(r.usage.completion_tokens, 20);
    const again = await client.chat.completions.create({ ...sampled, n: 2 });
    assert.deepEqual(again.choices.map((c) => c.message.content), r.choices.map((c) => c.message.content), "seeded");
    // streamed: each choice's deltas under its index add up to the same messages
    const { chunks } = await collect(await client.chat.completions.create({ ...sampled, n: 2, stream: true }));
    const texts = ["", ""];
    for (const k of chunks) for (const c of k.choices) texts[c.index] += c.delta.content ?? "";
    assert.deepEqual(texts, r.choices.map((c) => c.message.content));
    const acc = await client.chat.completions.stream({ ...sampled, n: 2 }).finalChatCompletion();
    assert.deepEqual(acc.choices.map((c) => c.message.content), texts, "the SDK's stream helper agrees");
    // greedy: every choice is the greedy text, and the prompt (a new one) is computed once: the other two
    // sequences take its blocks from the prefix cache as the first prefills them
    const long = [{ role: "user", content: "Tell me a long story about a lighthouse keeper and her cat. ".repeat(8) }];
    const ptoks = (await gatewayJson("/tokenize", { model: MODEL, messages: long })).count;
    const want = 2 * 16 * Math.floor((ptoks - 1) / 16); // two sequences, every whole block (block_size 16)
    const before = (await metric("kvbank_prefix_cache_hit_tokens_total", { model: MODEL })) ?? 0;
    const g = await client.chat.completions.create({ ...greedy, messages: long, n: 3 });
    let hits = 0;
    for (let i = 0; i < 50 && hits < want; i++) {
      hits = ((await metric("kvbank_prefix_cache_hit_tokens_total", { model: MODEL })) ?? 0) - before;
      if (hits < want) await new Promise((res) => setTimeout(res, 100));
    }
    assert.ok(hits >= want, `prefix cache hits ${hits}, want ${want} (a ${ptoks}-token prompt)`);
    const one = (await client.chat.completions.create({ ...greedy, messages: long })).choices[0].message.content;
    assert.deepEqual(g.choices.map((c) => c.message.content), [one, one, one]);
    return `2 seeded samples (streamed the same), usage 20; n=3 greedy: 3 x the greedy text, ${hits} prompt tokens from the prefix cache`;
  }],

  ["best_of", async () => {
    const base = { model: MODEL, prompt: "Once upon a time", max_tokens: 8, ignore_eos: true, temperature: 1, seed: 11, logprobs: 0 };
    const all = await client.completions.create({ ...base, n: 3 });
    const sum = (c) => c.logprobs.token_logprobs.reduce((a, b) => a + b, 0);
    const best = all.choices.reduce((a, b) => (sum(b) > sum(a) ? b : a));
    const r = await client.completions.create({ ...base, n: 1, best_of: 3 });
    assert.equal(r.choices.length, 1);
    assert.equal(r.choices[0].text, best.text, "best_of returns the sample of highest cumulative logprob");
    assert.equal(r.usage.completion_tokens, 8);
    return `best_of 3 returns the most likely of the 3 samples (cumulative logprob ${sum(best).toFixed(3)})`;
  }],

  ["penalties", async () => {
    const base = { ...greedy, prompt: "The capital of France is", max_tokens: 40, return_token_ids: true };
    const maxRepeat = (ids) => Math.max(...Object.values(ids.reduce((m, t) => ((m[t] = (m[t] ?? 0) + 1), m), {})));
    const plain = (await client.completions.create(base)).choices[0].token_ids;
    assert.ok(maxRepeat(plain) > 2, `the greedy text repeats itself (${maxRepeat(plain)})`);
    const out = {};
    for (const p of [{ presence_penalty: 2 }, { frequency_penalty: 2 }, { repetition_penalty: 2 }]) {
      const ids = (await client.completions.create({ ...base, ...p })).choices[0].token_ids;
      const name = Object.keys(p)[0];
      assert.ok(maxRepeat(ids) < maxRepeat(plain), `${name}: ${maxRepeat(ids)} repeats, ${maxRepeat(plain)} without`);
      out[name] = maxRepeat(ids);
    }
    // logit_bias: +100 makes a token the greedy choice everywhere; -100 bans the greedy first token
    const x = plain[5];
    const up = (await client.completions.create({ ...base, max_tokens: 6, logit_bias: { [x]: 100 } })).choices[0].token_ids;
    assert.deepEqual(up, Array(6).fill(x));
    const down = (await client.completions.create({ ...base, max_tokens: 1, logit_bias: { [plain[0]]: -100 } })).choices[0].token_ids;
    assert.notEqual(down[0], plain[0]);
    // min_tokens: a stop token id does not stop the output before min_tokens tokens
    const stopAt = plain.findIndex((t, i) => i >= 1 && plain.indexOf(t) === i);
    const stop = { ...base, max_tokens: 20, stop_token_ids: [plain[stopAt]] };
    const short = await client.completions.create(stop);
    assert.ok(short.usage.completion_tokens <= stopAt + 1, `stopped after ${short.usage.completion_tokens}`);
    const long = await client.completions.create({ ...stop, min_tokens: stopAt + 5 });
    assert.ok(long.usage.completion_tokens >= stopAt + 5, `min_tokens: ${long.usage.completion_tokens}`);
    return `max repeats ${maxRepeat(plain)} -> ${JSON.stringify(out)}; logit_bias forces and bans; min_tokens holds the stop`;
  }],

  ["multi-prompt", async () => {
    const prompts = ["The capital of France is", "Once upon a time"];
    const single = [];
    for (const prompt of prompts) single.push((await client.completions.create({ ...greedy, prompt, max_tokens: 6 })));
    const r = await client.completions.create({ ...greedy, prompt: prompts, max_tokens: 6 });
    assert.deepEqual(r.choices.map((c) => c.index), [0, 1]);
    assert.deepEqual(r.choices.map((c) => c.text), single.map((s) => s.choices[0].text));
    assert.equal(r.usage.prompt_tokens, single[0].usage.prompt_tokens + single[1].usage.prompt_tokens);
    assert.equal(r.usage.completion_tokens, 12);
    // two prompts x n = 2: indices prompt x n + k
    const rn = await client.completions.create({ ...greedy, prompt: prompts, max_tokens: 6, n: 2, echo: true });
    assert.deepEqual(rn.choices.map((c) => c.text), [0, 0, 1, 1].map((i) => prompts[i] + single[i].choices[0].text));
    const { chunks } = await collect(await client.completions.create({ ...greedy, prompt: prompts, max_tokens: 6, stream: true }));
    const texts = ["", ""];
    for (const k of chunks) for (const c of k.choices) texts[c.index] += c.text;
    assert.deepEqual(texts, single.map((s) => s.choices[0].text));
    return "two prompts answer as each alone (streamed too); with n = 2 and echo, four choices in order";
  }],

  ["tool-auto", async () => {
    // tool_choice auto parses what the model writes in its own format (Qwen3: <tool_call> ...); a
    // random-weight model writes no call by itself, so a guided_choice of one text makes it write one
    const said = "Checking.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>" +
                 "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"celsius\"}}\n</tool_call>";
    const req = { model: MODEL, messages: toolMessages, temperature: 0, max_tokens: 200, tools: [WEATHER, TIME], guided_choice: [said] };
    const r = await client.chat.completions.create(req);
    const m = r.choices[0].message;
    assert.equal(r.choices[0].finish_reason, "tool_calls", JSON.stringify(r.choices[0]));
    assert.equal(m.content.trim(), "Checking.");
    assert.deepEqual(m.tool_calls.map((c) => [c.function.name, JSON.parse(c.function.arguments)]),
                     [["get_time", { zone: "UTC" }], ["get_weather", { city: "Oslo", unit: "celsius" }]]);
    assert.notEqual(m.tool_calls[0].id, m.tool_calls[1].id);
    // streamed: content first, then each call's deltas under its index; the SDK's accumulator agrees
    const { chunks } = await collect(await client.chat.completions.create({ ...req, stream: true }));
    const content = chunks.map((k) => k.choices[0]?.delta.content ?? "").join("");
    assert.equal(content.trim(), "Checking.");
    const calls = [];
    for (const k of chunks)
      for (const d of k.choices[0]?.delta.tool_calls ?? []) {
        calls[d.index] ??= { name: d.function.name, args: "" };
        calls[d.index].args += d.function.arguments ?? "";
      }
    assert.deepEqual(calls.map((c) => [c.name, JSON.parse(c.args)]), m.tool_calls.map((c) => [c.function.name, JSON.parse(c.function.arguments)]));
    const acc = await client.chat.completions.stream({ ...req }).finalChatCompletion();
    assert.equal(acc.choices[0].message.tool_calls.length, 2);
    // parallel_tool_calls false: the first call only; tool_choice none: the text stays content
    const one = await client.chat.completions.create({ ...req, parallel_tool_calls: false });
    assert.deepEqual(one.choices[0].message.tool_calls.map((c) => c.function.name), ["get_time"]);
    const none = await client.chat.completions.create({ ...req, tool_choice: "none" });
    assert.equal(none.choices[0].message.tool_calls, undefined);
    assert.equal(none.choices[0].message.content, said);
    assert.equal(none.choices[0].finish_reason, "stop");
    return `auto: content "Checking." and 2 calls (streamed the same, the SDK's accumulator too); parallel_tool_calls ` +
           `false keeps the first; none leaves the text as content`;
  }],

  ["structured-sampling", async () => {
    // logprobs under a schema are those of the masked distribution (the mask comes first): greedy's
    // token heads its list; unmasked, a token the schema forbids would often head it instead
    const CALL = WEATHER.function.parameters; // every value bounded: greedy ends
    const r = await client.chat.completions.create({
      model: MODEL, messages, temperature: 0, max_tokens: 400, logprobs: true, top_logprobs: 3,
      response_format: { type: "json_schema", json_schema: { name: "call", schema: CALL } },
    });
    const c = r.choices[0];
    assert.equal(c.finish_reason, "stop", c.message.content);
    fits(JSON.parse(c.message.content), CALL, "$");
    assert.equal(c.logprobs.content.length, r.usage.completion_tokens);
    for (const t of c.logprobs.content) assert.equal(t.token, t.top_logprobs[0].token, JSON.stringify(t));
    // n = 2 under a schema (bounded, so sampling ends too): each choice parses and fits
    const two = await client.chat.completions.create({
      model: MODEL, messages, temperature: 0.8, seed: 21, n: 2, max_tokens: 400,
      response_format: { type: "json_schema", json_schema: { name: "call", schema: CALL } },
    });
    assert.equal(two.choices.length, 2);
    for (const ch of two.choices) {
      assert.equal(ch.finish_reason, "stop", `choice ${ch.index}: ${ch.message.content.slice(0, 300)}`);
      fits(JSON.parse(ch.message.content), CALL, `choice ${ch.index}`);
    }
    assert.notEqual(two.choices[0].message.content, two.choices[1].message.content, "two seeds, two samples");
    // n = 2 forced calls, streamed: each choice's deltas make one call of its own that fits
    const { chunks } = await collect(await client.chat.completions.create({
      model: MODEL, messages: toolMessages, temperature: 0.9, seed: 9, n: 2, max_tokens: 400, stream: true,
      tools: [WEATHER, TIME], tool_choice: { type: "function", function: { name: "get_weather" } },
    }));
    const args = ["", ""], ids = [[], []], finish = [];
    for (const k of chunks)
      for (const ch of k.choices) {
        for (const d of ch.delta.tool_calls ?? []) {
          if (d.id) ids[ch.index].push(d.id);
          args[ch.index] += d.function.arguments ?? "";
        }
        if (ch.finish_reason) finish[ch.index] = ch.finish_reason;
      }
    for (const i of [0, 1]) {
      fits(JSON.parse(args[i]), WEATHER.function.parameters, `choice ${i}`);
      assert.equal(ids[i].length, 1, `choice ${i}: ${ids[i]}`);
      assert.equal(finish[i], "tool_calls");
    }
    assert.notEqual(ids[0][0], ids[1][0]);
    return `greedy json_schema with logprobs: each of ${c.logprobs.content.length} tokens heads its list; n = 2 ` +
           `schema outputs and streamed forced calls each fit (${args.map((a) => a.length).join(" and ")} bytes of arguments)`;
  }],

  ["stream-abort", async () => {
    const before = (await metric("kvbank_gateway_client_disconnects_total", {})) ?? 0;
    const stream = await client.chat.completions.create({ ...greedy, messages, max_tokens: 4000, stream: true });
    let n = 0;
    for await (const chunk of stream) if (chunk.choices.length && ++n === 3) break; // the SDK aborts the request
    for (let i = 0; i < 100; i++) {
      if ((await metric("kvbank_gateway_client_disconnects_total", {})) > before) {
        return "breaking out of a stream cancels the request at the gateway";
      }
      await new Promise((res) => setTimeout(res, 100));
    }
    assert.fail("the gateway did not see the client leave");
  }],
];

let failed = 0;
for (const [name, fn] of CASES) {
  if (args.only && args.only !== name) continue;
  try {
    const what = await fn();
    console.log(`ok   - ${name}: ${what}`);
  } catch (e) {
    failed++;
    console.log(`FAIL - ${name}: ${e.stack || e}`);
  }
}
process.exit(failed ? 1 : 0);
