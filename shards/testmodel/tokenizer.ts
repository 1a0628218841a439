/**
 * A real byte-level BPE tokenizer for test checkpoints: 256 byte tokens, merges learned from the
 * built-in corpus, and the architecture's special tokens, written as an HF tokenizer.json.
 */
import { CORPUS } from './corpus.ts'

/** GPT-2's reversible byte → printable-unicode map (what ByteLevel pre-tokenizers use). */
export function bytesToUnicode (): string[] {
  const bs: number[] = []
  for (let b = 33; b <= 126; b++) bs.push(b)
  for (let b = 161; b <= 172; b++) bs.push(b)
  for (let b = 174; b <= 255; b++) bs.push(b)
  const map = new Array<string>(256)
  let n = 0
  for (let b = 0; b < 256; b++) {
    if (bs.includes(b)) map[b] = String.fromCodePoint(b)
    else map[b] = String.fromCodePoint(256 + n++)
  }
  return map
}

/** The GPT-2 pre-tokenization pattern (ByteLevel with use_regex). */
const SPLIT = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu

export interface BpeModel {
  vocab: Map<string, number>
  merges: Array<[string, string]>
}

/** Learns up to `numMerges` merges (most frequent pair first, ties broken by the pair's text). */
export function trainBpe (numMerges: number, text = CORPUS): BpeModel {
  const b2u = bytesToUnicode()
  const enc = new TextEncoder()
  const counts = new Map<string, number>()
  for (const m of text.matchAll(SPLIT)) {
    const word = [...enc.encode(m[0])].map(b => b2u[b]!).join('\u0000')
    counts.set(word, (counts.get(word) ?? 0) + 1)
  }
  let words = [...counts].map(([w, c]) => ({ parts: w.split('\u0000'), count: c }))
  const vocab = new Map<string, number>()
  b2u.forEach((ch, i) => vocab.set(ch, i))
  const merges: Array<[string, string]> = []
  while (merges.length < numMerges) {
    const pairs = new Map<string, number>()
    for (const w of words) {
      for (let i = 0; i + 1 < w.parts.length; i++) {
        const k = `${w.parts[i]}\u0000${w.parts[i + 1]}`
        pairs.set(k, (pairs.get(k) ?? 0) + w.count)
      }
    }
    let best: string | undefined
    let bestCount = 1
    for (const [k, c] of pairs) {
      if (c > bestCount || (c === bestCount && best !== undefined && k < best)) { best = k; bestCount = c }
    }
    if (best === undefined) break
    const [a, b] = best.split('\u0000') as [string, string]
    merges.push([a, b])
    vocab.set(a + b, vocab.size)
    words = words.map(w => {
      const parts: string[] = []
      for (let i = 0; i < w.parts.length; i++) {
        if (i + 1 < w.parts.length && w.parts[i] === a && w.parts[i + 1] === b) { parts.push(a + b); i++ } else parts.push(w.parts[i]!)
      }
      return { parts, count: w.count }
    })
  }
  return { vocab, merges }
}

export interface TokenizerFiles {
  tokenizerJson: Record<string, unknown>
  /** Special token text → id. */
  specialIds: Map<string, number>
  size: number
}

/** Builds tokenizer.json with `specials` appended after the learned vocabulary. */
export function buildTokenizerJson (targetSize: number, specials: string[], bosToken: string | undefined): TokenizerFiles {
  const { vocab, merges } = trainBpe(targetSize - 256 - specials.length)
  const specialIds = new Map<string, number>()
  for (const s of specials) specialIds.set(s, vocab.size + specialIds.size)
  const addedTokens = [...specialIds].map(([content, id]) => ({
    id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true,
  }))
  const bosId = bosToken === undefined ? undefined : specialIds.get(bosToken)
  const postProcessor = bosToken !== undefined && bosId !== undefined
    ? {
        type: 'TemplateProcessing',
        single: [{ SpecialToken: { id: bosToken, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
        pair: [{ SpecialToken: { id: bosToken, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: bosToken, type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
        special_tokens: { [bosToken]: { id: bosToken, ids: [bosId], tokens: [bosToken] } },
      }
    : { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false }
  const tokenizerJson = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: addedTokens,
    normalizer: null,
    pre_tokenizer: { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true },
    post_processor: postProcessor,
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: 'BPE',
      dropout: null,
      unk_token: null,
      continuing_subword_prefix: null,
      end_of_word_suffix: null,
      fuse_unk: false,
      byte_fallback: false,
      ignore_merges: false,
      vocab: Object.fromEntries(vocab),
      merges: merges.map(([a, b]) => `${a} ${b}`),
    },
  }
  return { tokenizerJson, specialIds, size: vocab.size + specials.length }
}
