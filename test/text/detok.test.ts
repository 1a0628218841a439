import { describe, expect, it } from 'vitest'
import fc from 'fast-check'
import { createTextCodec, createStopMatcher } from '../../daemon/text/index.ts'
import { memoizedDecoder } from '../../daemon/text/detok.ts'
import { llamaLikeTokenizer } from './fixtures.ts'

const files = llamaLikeTokenizer()
const codec = createTextCodec({ ...files, generation: { bosTokenId: 1, eosTokenIds: [2], addBosToken: true } })

function stream (ids: number[]): string[] {
  const d = codec.detokenizer()
  const out = ids.map(id => d.push(id))
  out.push(d.flush())
  return out
}

describe('streaming detokenizer', () => {
  it('never emits half a multi-byte character, even when its bytes are separate tokens', () => {
    const text = 'Hello café 日本 😀!'
    const ids = codec.encode(text)
    expect(ids.length).toBeGreaterThan(text.length / 2) // bytes really are split
    const deltas = stream(ids)
    for (const d of deltas) expect(d.includes('\uFFFD')).toBe(false)
    for (const d of deltas) expect(Buffer.from(d, 'utf8').toString('utf8')).toBe(d)
    expect(deltas.join('')).toBe(codec.decode(ids))
    expect(deltas.join('')).toBe(text)
    // '日' is 3 byte tokens: the first two emit nothing
    const emptyRuns = deltas.filter(d => d === '').length
    expect(emptyRuns).toBeGreaterThanOrEqual(2 + 2 + 3 + 1)
  })

  it('keeps SentencePiece spaces between words', () => {
    const ids = codec.encode('hello world and you')
    expect(stream(ids).join('')).toBe('hello world and you')
  })

  it('property: concatenated deltas equal decoding all ids at once', () => {
    const texts = fc.array(fc.constantFrom('hello', ' world', 'é', '日本', '😀', ' ', 'x', '!', 'café', '\n'), { maxLength: 12 })
      .map(a => a.join(''))
    fc.assert(fc.property(texts, (text) => {
      const ids = codec.encode(text)
      const deltas = stream(ids)
      expect(deltas.join('')).toBe(codec.decode(ids))
      for (const d of deltas.slice(0, -1)) expect(d.includes('\uFFFD')).toBe(false)
    }), { numRuns: 200 })
  })

  it('property: detok + stop matcher: deltas equal the decoded text up to the first stop', () => {
    const texts = fc.array(fc.constantFrom('hello', ' world', 'é', '日本', ' stop', ' end', 'x', '\n'), { maxLength: 12 })
      .map(a => a.join(''))
    const stops = fc.array(fc.constantFrom(' end', 'é日', 'o w', '\n\n', 'xx'), { minLength: 1, maxLength: 2 })
    fc.assert(fc.property(texts, stops, (text, stopList) => {
      const ids = codec.encode(text)
      const d = codec.detokenizer()
      const m = createStopMatcher(stopList)
      let out = ''
      let stopped = false
      for (const id of ids) {
        const r = m.push(d.push(id))
        out += r.text
        if (r.stopped) { stopped = true; break }
      }
      if (!stopped) {
        const r = m.push(d.flush())
        out += r.text
        if (!r.stopped) out += m.flush()
      }
      const full = codec.decode(ids)
      const cut = Math.min(...stopList.map(s => full.indexOf(s)).filter(i => i >= 0))
      expect(out).toBe(Number.isFinite(cut) ? full.slice(0, cut) : full)
      for (const s of stopList) expect(out.includes(s)).toBe(false)
    }), { numRuns: 200 })
  })

  it('property: the remembered windows decode exactly as the tokenizer, whatever was remembered before and however small the bound', () => {
    const ids = codec.encode('Hello café 日本 😀! hello world')
    let calls = 0
    const counted = { decode: (w: number[]) => { calls++; return codec.decode(w) } }
    fc.assert(fc.property(fc.array(fc.array(fc.constantFrom(...ids), { minLength: 1, maxLength: 5 }), { maxLength: 40 }), fc.integer({ min: 1, max: 8 }), (windows, maxEntries) => {
      const memo = memoizedDecoder(counted, { maxIds: 3, maxEntries })
      for (const w of windows) expect(memo.decode(w)).toBe(codec.decode(w))
    }), { numRuns: 200 })
    // A window seen before is not decoded again.
    const memo = memoizedDecoder(counted)
    calls = 0
    memo.decode([ids[0]!, ids[1]!])
    memo.decode([ids[0]!, ids[1]!])
    expect(calls).toBe(1)
  })
})
