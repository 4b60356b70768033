// Trains and applies the default model's byte-level BPE tokenizer with Hugging Face tokenizers'
// official Node binding (npm package `tokenizers`, the library's Rust core), for machines without
// the Python package. The settings are train_tiny.py's (--backend hf): NFC normalizer, Qwen2's
// Split regex then ByteLevel (no prefix space, no regex), ByteLevel decoder and post-processor, the
// 256 byte symbols as the initial alphabet, <|endoftext|> <|im_start|> <|im_end|> as special
// tokens and <think> </think> <tool_call> </tool_call> as added tokens after the learned vocabulary.
//
// The binding's train() takes files and uses the BPE model's default trainer (vocab_size 30000,
// no initial alphabet), so the vocabulary is cut afterwards: BPE training merges greedily and
// stops only at the size limit, so the first merges of a longer run are those of a shorter one.
// The learned vocabulary is rebuilt as the full byte alphabet (sorted, as the trainer orders its
// alphabet) followed by the tokens of those merges in order. The binding reads each line of the
// text file (with its newline) as one sequence.
//
// Usage:
//   node train_tokenizer.mjs train TEXT_FILE VOCAB_SIZE OUT_TOKENIZER_JSON
//   node train_tokenizer.mjs encode TOKENIZER_JSON JOB_JSON OUT_DIR
//     JOB_JSON: {"streams": {name: [text, ...]}, "decode": {name: [[id, ...], ...]}}
//     writes OUT_DIR/<name>.npy (int32, the concatenated ids of each stream's texts, no special
//     tokens added; special tokens in the text are matched) and OUT_DIR/decoded.json.
// NODE_PATH must reach the `tokenizers` package (e.g. npm install tokenizers in /tmp/hftok).
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import {createRequire} from 'node:module';

const require = createRequire(path.join(process.env.NODE_PATH || process.cwd(), 'x.js'));
const tk = require('tokenizers');

const SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>'];
const ADDED = ['<think>', '</think>', '<tool_call>', '</tool_call>'];
// Qwen2/Qwen3's pre-tokenizer split (tokenizer.json "Split" Regex), as in train_tiny.py.
const QWEN2_SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*" +
    '|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+';

function skeleton(vocab, merges) {
  // The pipeline as JSON: the binding's splitPreTokenizer takes a literal string, not a regex.
  return {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: [],
    normalizer: {type: 'NFC'},
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [
        {type: 'Split', pattern: {Regex: QWEN2_SPLIT}, behavior: 'Isolated', invert: false},
        {type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false},
      ],
    },
    post_processor: {type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false},
    decoder: {type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true},
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: false,
      vocab, merges,
    },
  };
}

function train(textFile, vocabSize, out) {
  const tok = tk.Tokenizer.fromString(JSON.stringify(skeleton({}, [])));
  tok.train([textFile]);
  const tmp = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'tok-')), 'full.json');
  tok.save(tmp);
  const full = JSON.parse(fs.readFileSync(tmp, 'utf8'));
  const learned = vocabSize - SPECIAL.length - ADDED.length;
  const alphabet = tk.byteLevelAlphabet().slice().sort((a, b) => a.codePointAt(0) - b.codePointAt(0));
  const vocab = {};
  alphabet.forEach((c, i) => { vocab[c] = i; });
  let n = alphabet.length;
  const merges = [];
  for (const m of full.model.merges) {
    if (n >= learned) break;
    const [a, b] = Array.isArray(m) ? m : m.split(' ');
    if (!(a in vocab) || !(b in vocab)) throw new Error(`merge ${a} ${b} uses an unknown token`);
    merges.push([a, b]);
    if (!((a + b) in vocab)) vocab[a + b] = n++;
  }
  if (n !== learned) throw new Error(`training produced only ${n} tokens, wanted ${learned}`);
  const cut = tk.Tokenizer.fromString(JSON.stringify(skeleton(vocab, merges)));
  cut.addSpecialTokens(SPECIAL);
  cut.addAddedTokens(ADDED.map((t) => new tk.AddedToken(t, false, {normalized: false})));
  if (cut.getVocabSize(true) !== vocabSize) {
    throw new Error(`tokenizer has ${cut.getVocabSize(true)} tokens, wanted ${vocabSize}`);
  }
  cut.save(out, true);
}

function writeNpyInt32(file, ids) {
  let header = `{'descr': '<i4', 'fortran_order': False, 'shape': (${ids.length},), }`;
  header += ' '.repeat((64 - ((10 + header.length + 1) % 64)) % 64) + '\n';
  const pre = Buffer.alloc(10);
  pre.write('\x93NUMPY', 0, 'latin1');
  pre[6] = 1;
  pre[7] = 0;
  pre.writeUInt16LE(header.length, 8);
  const body = Buffer.from(Int32Array.from(ids).buffer);
  fs.writeFileSync(file, Buffer.concat([pre, Buffer.from(header, 'latin1'), body]));
}

async function encode(tokFile, jobFile, outDir) {
  const tok = tk.Tokenizer.fromFile(tokFile);
  const job = JSON.parse(fs.readFileSync(jobFile, 'utf8'));
  fs.mkdirSync(outDir, {recursive: true});
  for (const [name, texts] of Object.entries(job.streams || {})) {
    const ids = [];
    for (let i = 0; i < texts.length; i += 1000) {
      const encs = await tok.encodeBatch(texts.slice(i, i + 1000), {addSpecialTokens: false});
      for (const e of encs) for (const id of e.getIds()) ids.push(id);
    }
    writeNpyInt32(path.join(outDir, `${name}.npy`), ids);
  }
  const decoded = {};
  for (const [name, lists] of Object.entries(job.decode || {})) {
    decoded[name] = [];
    for (const ids of lists) decoded[name].push(await tok.decode(ids, false));
  }
  fs.writeFileSync(path.join(outDir, 'decoded.json'), JSON.stringify(decoded));
}

const [cmd, ...args] = process.argv.slice(2);
if (cmd === 'train' && args.length === 3) {
  train(args[0], Number(args[1]), args[2]);
} else if (cmd === 'encode' && args.length === 3) {
  await encode(args[0], args[1], args[2]);
} else {
  console.error('usage: train TEXT VOCAB OUT | encode TOKENIZER JOB OUT_DIR');
  process.exit(2);
}
