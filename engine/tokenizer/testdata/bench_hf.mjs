// Hugging Face tokenizers' side of //engine/tokenizer:tokenizer_bench: encodes a text file whole
// and line by line with the Rust core through the official Node binding, one thread, and prints
// {"whole_s", "lines_s", "whole_tokens", "lines_tokens"} (seconds of the timed pass, after one
// untimed warm-up pass). The benchmark runs it with RAYON_NUM_THREADS=1 and
// TOKENIZERS_PARALLELISM=false so the batch of lines is encoded on one thread.
//
//   node bench_hf.mjs --tokenizers /tmp/hftok/node_modules/tokenizers \
//     --tokenizer tokenizer.json --text corpus.txt
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith('--') ? [...acc, [a.slice(2), all[i + 1]]] : acc), []));
const require = createRequire(import.meta.url);
const { Tokenizer } = require(path.resolve(args.tokenizers));
const tok = Tokenizer.fromFile(args.tokenizer);
const text = fs.readFileSync(args.text, 'utf8');
const lines = text.split('\n');
const opts = { addSpecialTokens: false };

async function pass() {
  let t0 = process.hrtime.bigint();
  const whole = await tok.encode(text, null, opts);
  const wholeS = Number(process.hrtime.bigint() - t0) / 1e9;
  t0 = process.hrtime.bigint();
  const batch = await tok.encodeBatch(lines, opts);
  const linesS = Number(process.hrtime.bigint() - t0) / 1e9;
  return { whole_s: wholeS, lines_s: linesS, whole_tokens: whole.getIds().length,
           lines_tokens: batch.reduce((n, e) => n + e.getIds().length, 0) };
}

await pass();  // warm-up: the word cache, as the C++ side gets
console.log(JSON.stringify(await pass()));
