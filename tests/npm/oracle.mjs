// The reference side of kvbank's text oracle test (tests/test_text_oracle.sh): the same jobs as
// tests/text_cli, answered by @lenml/tokenizers (transformers.js's tokenizers) and @huggingface/jinja.
//   node oracle.mjs encode MODEL_DIR < corpus.json
//   node oracle.mjs render MODEL_DIR < conversations.json
//   node oracle.mjs decode MODEL_DIR < [[ids...], ...]      (text: special tokens skipped; text_all: kept)
import { readFileSync, existsSync } from "node:fs";
import { TokenizerLoader } from "@lenml/tokenizers";
import { Template } from "@huggingface/jinja";

const [cmd, dir] = process.argv.slice(2);
const input = JSON.parse(readFileSync(0, "utf8"));
const readJson = (name) => JSON.parse(readFileSync(`${dir}/${name}`, "utf8"));
const config = existsSync(`${dir}/tokenizer_config.json`) ? readJson("tokenizer_config.json") : {};
const tokenText = (v) => (v && typeof v === "object" ? v.content : v) ?? undefined;

if (cmd === "encode") {
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON: readJson("tokenizer.json"), tokenizerConfig: config });
  const out = input.map((text) => {
    // special tokens in the text are special; nothing added around the text (add_special_tokens false)
    const ids = tok.encode(text, { add_special_tokens: false });
    const decode = (skip) =>
      ids.length ? tok.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false }) : "";
    return { ids, decoded: decode(false), decoded_skip: decode(true) };
  });
  process.stdout.write(JSON.stringify(out) + "\n");
} else if (cmd === "decode") {
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON: readJson("tokenizer.json"), tokenizerConfig: config });
  const decode = (ids, skip) =>
    ids.length ? tok.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false }) : "";
  const out = input.map((ids) => ({ text: decode(ids, true), text_all: decode(ids, false) }));
  process.stdout.write(JSON.stringify(out) + "\n");
} else if (cmd === "render") {
  let source = config.chat_template;
  if (Array.isArray(source)) source = source.find((t) => t.name === "default")?.template;
  if (existsSync(`${dir}/chat_template.jinja`)) source = readFileSync(`${dir}/chat_template.jinja`, "utf8");
  const template = new Template(source);
  const out = input.map((c) => {
    try {
      const text = template.render({
        messages: c.messages,
        add_generation_prompt: !!c.add_generation_prompt,
        bos_token: tokenText(config.bos_token) ?? "",
        eos_token: tokenText(config.eos_token) ?? "",
        ...(c.extra ?? {}),
      });
      return { text };
    } catch (e) {
      return { error: String(e.message ?? e) };
    }
  });
  process.stdout.write(JSON.stringify(out) + "\n");
} else {
  process.stderr.write("usage: node oracle.mjs encode|render|decode MODEL_DIR < JSON\n");
  process.exit(2);
}
