// Builds a tokenizer test fixture: seeded random strings in several categories, encoded and
// decoded by Hugging Face tokenizers itself (its Rust core through the official Node binding).
// tokenizer_fixture_test.cc checks //engine/tokenizer against every id and decode in it.
//
//   mkdir -p /tmp/hftok && (cd /tmp/hftok && npm install tokenizers@0.23.2)
//   node engine/tokenizer/testdata/make_tokenizer_fixture.mjs \
//     --tokenizers /tmp/hftok/node_modules/tokenizers \
//     --tokenizer bazel-bin/third_party/qwen3_tokenizer/tokenizer.json \
//     --out engine/tokenizer/testdata/qwen3_fixture.json --per_category 200
//   (the synthetic tokenizers: --tokenizer engine/tokenizer/testdata/synthetic_*.json
//    --out engine/tokenizer/testdata/synthetic_*_fixture.json --per_category 12)
//
// Invalid UTF-8 cases go to the reference as the text Python's bytes.decode('utf-8', 'replace')
// gives (computed by /usr/bin/python3); the fixture keeps the raw bytes, which our Encode must
// replace the same way.
//
// Output: {"reference": "tokenizers <version>", "cases": [{"cat", "text" (base64 of the input
// bytes), "ids", "ids_with_special" (encoded with
// add_special_tokens; omitted when equal to "ids"), "decode" and "decode_skip" (base64; omitted when equal to the input bytes)}]}.
import { createRequire } from 'node:module';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith('--') ? [...acc, [a.slice(2), all[i + 1]]] : acc), []));
const require = createRequire(import.meta.url);
const tokenizersDir = path.resolve(args.tokenizers);
const { Tokenizer } = require(tokenizersDir);
const version = JSON.parse(fs.readFileSync(path.join(tokenizersDir, 'package.json'))).version;
const tokenizerJson = JSON.parse(fs.readFileSync(args.tokenizer, 'utf8'));
const tok = Tokenizer.fromFile(args.tokenizer);
const perCategory = Number(args.per_category || 200);

// mulberry32: a small seeded generator, so the fixture is reproducible.
let seed = Number(args.seed || 20241205) >>> 0;
function rand() {
  seed = (seed + 0x6D2B79F5) >>> 0;
  let t = seed;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));
const pick = (a) => a[int(0, a.length - 1)];
const cp = (lo, hi) => String.fromCodePoint(int(lo, hi));
const repeat = (n, f) => Array.from({ length: n }, f).join('');

const words = ('the of and to in is was he for it with as his on be at by I had not are but from or have ' +
  'an they which one you were her all she there would their we him been has when who will more no if out ' +
  'so said what up its about into than them can only other new some could time these two may then do first ' +
  'any my now such like our over man me even most made after also did many before must through back years ' +
  'where much your way well down should because each just those people Mr how too little state good very ' +
  'make world still own see men work long get here between both life being under never day same another know ' +
  'while last might us great old year off come since against go came right used take three tokenizer ' +
  'Transformers GPU expert cache routing décor naïve café résumé coöperate Zürich façade').split(' ');
const contractions = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL", "'D", "'M"];
const punct = ['.', ',', ';', ':', '!', '?', ' -', ' —', '...', '"', "'", '(', ')', ' [1]', '%', ' & '];

function prose() {
  let s = '';
  const n = int(3, 40);
  for (let i = 0; i < n; i++) {
    let w = pick(words);
    if (rand() < 0.15) w = w[0].toUpperCase() + w.slice(1);
    if (rand() < 0.05) w = w.toUpperCase();
    s += (i ? ' ' : '') + w;
    if (rand() < 0.08) s += pick(contractions);
    if (rand() < 0.12) s += pick(punct);
    if (rand() < 0.03) s += pick(['\n', '\n\n', '  ', ' \n']);
  }
  return s;
}
const codeTokens = ['def', 'return', 'if', 'else:', 'for', 'in', 'range(', ')', '{', '}', '[', ']', '=', '==',
  '+=', '->', '::', 'std::vector<int>', 'x', 'y_1', 'self.cache', 'None', 'true', '0x1F', '3.14', '"str"',
  "'c'", '//', '#', '/*', '*/', ';', ',', '&&', '||', '<<', '>>', '!=', 'λ', 'async', 'await', 'fn', '=>'];
function code() {
  let s = '';
  const lines = int(1, 8);
  for (let l = 0; l < lines; l++) {
    s += pick(['', '\t', '\t\t', '  ', '    ', '        ', ' \t ', '\t  ']);
    const n = int(1, 10);
    for (let i = 0; i < n; i++) s += pick(codeTokens) + pick(['', ' ', ' ', '  ', '\t']);
    s += pick(['\n', '\n', '\r\n', '\n\n', ' \n', '\t\n', '\n   \n']);
  }
  return s;
}
function cjk() {
  let s = '';
  const n = int(2, 40);
  for (let i = 0; i < n; i++) {
    const r = rand();
    if (r < 0.45) s += cp(0x4E00, 0x9FFF);
    else if (r < 0.55) s += cp(0x3041, 0x3096);
    else if (r < 0.63) s += cp(0x30A1, 0x30FA);
    else if (r < 0.73) s += cp(0xAC00, 0xD7A3);
    else if (r < 0.78) s += pick(['。', '、', '「', '」', '！', '？', '（', '）', '：', '\u3000']);
    else if (r < 0.83) s += cp(0xFF01, 0xFF5E);
    else if (r < 0.86) s += cp(0x20000, 0x2A6DF);
    else if (r < 0.89) s += '\u1100' + '\u1161' + (rand() < 0.5 ? '\u11A8' : '');  // NFC composes
    else s += pick([' ', 'AI', ' GPU ', '2024年', 'Qwen', '\n']);
  }
  return s;
}
function rtlIndic() {
  let s = '';
  const n = int(2, 40);
  for (let i = 0; i < n; i++) {
    const r = rand();
    if (r < 0.3) s += cp(0x0621, 0x064A) + (rand() < 0.2 ? cp(0x064B, 0x0652) : '');
    else if (r < 0.5) s += cp(0x05D0, 0x05EA) + (rand() < 0.1 ? cp(0x05B0, 0x05BC) : '');
    else if (r < 0.75) s += cp(0x0915, 0x0939) + (rand() < 0.4 ? cp(0x093E, 0x094D) : '');
    else if (r < 0.8) s += cp(0x0660, 0x0669);
    else if (r < 0.84) s += cp(0x0966, 0x096F);
    else if (r < 0.87) s += pick(['\u200F', '\u200E', '\u200C', '\u200D']);
    else if (r < 0.9) s += pick(['e\u0301', 'a\u0308', 'A\u030A', '\u0915\u093C']);  // NFC cases
    else s += pick([' ', ' ', '، ', '. ', '\n', ' 123 ', '؟']);
  }
  return s;
}
const emojiBase = ['😀', '😂', '🥲', '🤖', '🚀', '🔥', '❤', '👍', '👋', '🧑', '👩', '👨', '👧', '👦', '🏳', '🐱', '🍕', '✨', '☕', '✅'];
const skin = ['\u{1F3FB}', '\u{1F3FC}', '\u{1F3FD}', '\u{1F3FE}', '\u{1F3FF}'];
function emoji() {
  let s = '';
  const n = int(1, 15);
  for (let i = 0; i < n; i++) {
    const r = rand();
    if (r < 0.3) s += pick(emojiBase);
    else if (r < 0.5) s += pick(['👍', '👋', '🧑', '👩']) + pick(skin);
    else if (r < 0.7) s += ['👨', '👩', '👧', '👦'].slice(0, int(2, 4)).join('\u200D');
    else if (r < 0.78) s += '🏳\uFE0F\u200D🌈';
    else if (r < 0.86) s += String.fromCodePoint(0x1F1E6 + int(0, 25), 0x1F1E6 + int(0, 25));
    else if (r < 0.92) s += pick(['❤\uFE0F', '☕\uFE0F', '1\uFE0F\u20E3', '#\uFE0F\u20E3']);
    else s += pick([' ', ' nice ', '!', '\n', 'ok']);
  }
  return s;
}
function digits() {
  const r = rand();
  const run = () => repeat(int(1, 40), () => String(int(0, 9)));
  if (r < 0.3) return run();
  if (r < 0.5) return run() + '.' + run();
  if (r < 0.65) return repeat(int(1, 6), () => run() + pick([',', ' ', '-', '/', ':', 'e', 'x']));
  if (r < 0.8) return 'v' + run() + ' ' + run() + '%';
  return pick(['', '-', '+', '$', '€', '¥']) + run() + pick(['', ' ', 'k', 'th', '²', '½', '٣']);
}
const addedContents = (tokenizerJson.added_tokens || []).map((t) => t.content);
function specials() {
  let s = '';
  const n = int(1, 8);
  for (let i = 0; i < n; i++) {
    const r = rand();
    if (r < 0.45 && addedContents.length) s += pick(addedContents);
    else if (r < 0.55 && addedContents.length) {
      const t = pick(addedContents);
      s += t.slice(0, int(1, Math.max(1, t.length - 1)));  // a prefix: must not match
    } else if (r < 0.65) s += pick(['<|', '|>', '<', '>', '</', '<think', '<|im_']);
    else s += pick([' ', '\n', 'user\n', 'Hello there', '  x', '\t', 'assistant\n', '{"a": 1}']);
  }
  return s;
}
function longWord() {
  const r = rand();
  const len = int(50, 600);
  if (r < 0.25) return repeat(len, () => pick('abcdefghijklmnopqrstuvwxyz'));
  if (r < 0.4) return pick(['a', 'ab', 'xyz', 'ing', '=', '-', '_', '0']).repeat(int(20, 300));
  if (r < 0.55) return repeat(len, () => pick('ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123456789'));
  if (r < 0.7) return repeat(int(20, 200), () => cp(0x4E00, 0x9FFF));
  if (r < 0.85) return 'https://example.com/' + repeat(len, () => pick('abcdefghij/-_.?=&%0123'));
  return repeat(int(10, 80), () => pick(words)).replace(/ /g, '');
}
const spaces = [' ', '  ', '\t', '\n', '\r', '\r\n', '\u00A0', '\u3000', '\u2028', '\u2029', '\u000B', '\u000C', '\u0085', '\u2003', '\u200B', '\u202F', '\u205F', '\u1680'];
function whitespace() {
  return repeat(int(1, 30), () => pick(spaces));
}
function mixed() {
  return repeat(int(1, 5), () => pick([prose, code, cjk, rtlIndic, emoji, digits, specials, whitespace])());
}
function invalidBytes() {
  const bytes = [];
  const n = int(1, 40);
  for (let i = 0; i < n; i++) {
    const r = rand();
    if (r < 0.3) bytes.push(int(0x80, 0xFF));
    else if (r < 0.45) bytes.push(pick([0xC0, 0xC1, 0xE0, 0xED, 0xF0, 0xF4, 0xF5, 0xFF]), int(0x80, 0xBF));
    else if (r < 0.6) bytes.push(0xE2, 0x82);  // truncated sequence
    else if (r < 0.7) bytes.push(0xF0, 0x9F, 0x98);  // truncated emoji
    else if (r < 0.75) bytes.push(0xED, 0xA0, 0x80);  // surrogate
    else bytes.push(...Buffer.from(pick([' ', 'a', 'ok ', 'é', '中', '😀', '\n', '<|im_end|>'])));
  }
  return Buffer.from(bytes);
}

const categories = { prose, code, cjk, rtl_indic: rtlIndic, emoji, digits, specials, long_word: longWord, whitespace, mixed };
const cases = [];
for (const [cat, f] of Object.entries(categories)) {
  for (let i = 0; i < perCategory; i++) cases.push({ cat, bytes: Buffer.from(f(), 'utf8') });
}
const invalid = Array.from({ length: perCategory }, () => invalidBytes());
const replaced = JSON.parse(execFileSync('/usr/bin/python3', ['-c',
  'import sys, json, base64; print(json.dumps([base64.b64decode(b).decode("utf-8", "replace") for b in json.load(sys.stdin)]))'],
  { input: JSON.stringify(invalid.map((b) => b.toString('base64'))) }).toString());
invalid.forEach((b, i) => cases.push({ cat: 'invalid_utf8', bytes: b, reference: replaced[i] }));

const out = [];
for (const c of cases) {
  const text = c.reference ?? c.bytes.toString('utf8');
  const enc = await tok.encode(text, null, { addSpecialTokens: false });
  const ids = enc.getIds();
  const d = await tok.decode(ids, false);
  const ds = await tok.decode(ids, true);
  const row = { cat: c.cat, text: c.bytes.toString('base64'), ids };
  const withSpecial = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
  if (JSON.stringify(withSpecial) !== JSON.stringify(ids)) row.ids_with_special = withSpecial;
  const same = (x) => Buffer.from(x, 'utf8').equals(c.bytes);
  if (!same(d)) row.decode = Buffer.from(d, 'utf8').toString('base64');
  if (!same(ds)) row.decode_skip = Buffer.from(ds, 'utf8').toString('base64');
  out.push(row);
}
fs.writeFileSync(args.out, JSON.stringify({ reference: `tokenizers ${version}`, cases: out }) + '\n');
console.log(`${out.length} cases -> ${args.out} (${fs.statSync(args.out).size} bytes)`);
