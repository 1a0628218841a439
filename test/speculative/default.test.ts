/**
 * Prompt lookup on by default: which models get it (whole models and chains at their stage 0,
 * whose shards verify exactly) and which requests run it (greedy, and sampled without a seed; seeded ones keep the plain path),
 * and the shortest match it drafts from (three tokens where a verified position is dear).
 */
import { describe, expect, it } from 'vitest'
import { DEFAULT_LOOKUP_MIN_NGRAM, defaultLookupMinNgram, defaultLookupSkipped, defaultLookupTakes, promptLookup, useDefaultLookup } from '../../daemon/speculative/index.ts'
import type { ModelFacts } from '../../daemon/speculative/index.ts'

const fp32: ModelFacts = { entry: true, quantization: { kind: 'none' } }
const int4f32: ModelFacts = { entry: true, quantization: { kind: 'int4', blockSize: 32, activations: 'f32' } }
const int8f32: ModelFacts = { entry: true, quantization: { kind: 'int8', blockSize: 32, activations: 'f32' } }
const int4int8: ModelFacts = { entry: true, quantization: { kind: 'int4', blockSize: 32, activations: 'int8' } }
// Shards from before `activations` was recorded compute in int8 activations (the compiler's default).
const int4unset: ModelFacts = { entry: true, quantization: { kind: 'int4', blockSize: 128 } }
const laterStage: ModelFacts = { entry: false, quantization: { kind: 'none' } }

describe('default prompt lookup', () => {
  it('is on where requests enter (whole models, chains at stage 0) with f32 activations, off (with a reason) for int8 activations and later stages', () => {
    expect(defaultLookupSkipped(fp32)).toBeUndefined()
    expect(defaultLookupSkipped(int4f32)).toBeUndefined()
    expect(defaultLookupSkipped(int8f32)).toBeUndefined()
    expect(defaultLookupSkipped(int4int8)).toMatch(/int8 activations/)
    expect(defaultLookupSkipped(int4unset)).toMatch(/int8 activations/)
    expect(defaultLookupSkipped(laterStage)).toMatch(/later stage/)
    // A chain's stage 0 is where its requests enter: its chains keep their prefix reuse under lookup.
    expect(defaultLookupSkipped({ ...laterStage, entry: true })).toBeUndefined()
  })

  it('is on for int8 activations where shoal\'s kernels run both the int4 products and the verify steps', () => {
    expect(defaultLookupSkipped({ ...int4int8, kernels: ['int4', 'attention', 'verify'] })).toBeUndefined()
    expect(defaultLookupSkipped({ ...int4unset, kernels: ['int4', 'verify'] })).toBeUndefined()
    // One without the other is not enough: MatMulNBits' rows, or GroupQueryAttention's verify, round otherwise.
    expect(defaultLookupSkipped({ ...int4int8, kernels: ['int4', 'attention'] })).toMatch(/int8 activations/)
    expect(defaultLookupSkipped({ ...int4int8, kernels: ['attention', 'verify'] })).toMatch(/int8 activations/)
    expect(defaultLookupSkipped({ ...laterStage, quantization: int4int8.quantization, kernels: ['int4', 'verify'] })).toMatch(/later stage/)
  })

  it('takes greedy requests (seeded or not) and unseeded sampled ones; seeded sampled ones keep the plain path', () => {
    expect(defaultLookupTakes({ temperature: 0 })).toBe(true)
    expect(defaultLookupTakes({ temperature: 0, seed: 7 })).toBe(true)
    expect(defaultLookupTakes({ temperature: 0.8 })).toBe(true)
    expect(defaultLookupTakes({ temperature: 0.8, seed: 7 })).toBe(false)
    expect(defaultLookupTakes({ temperature: 1e-3, seed: 0 })).toBe(false)
  })

  it('decides per model and request together', () => {
    const requests = [{ temperature: 0 }, { temperature: 0.7 }, { temperature: 0.7, seed: 1 }]
    expect(requests.map(r => useDefaultLookup(fp32, r))).toEqual([true, true, false])
    expect(requests.map(r => useDefaultLookup(int4f32, r))).toEqual([true, true, false])
    expect(requests.map(r => useDefaultLookup(int4int8, r))).toEqual([false, false, false])
    expect(requests.map(r => useDefaultLookup(laterStage, r))).toEqual([false, false, false])
  })

  it('drafts from matches of two tokens or more (a one-token match is what text that does not repeat offers all the time)', () => {
    const opts = { minNgram: DEFAULT_LOOKUP_MIN_NGRAM }
    // ... 7 5 ... 5: only the last token occurred before.
    expect(promptLookup([1, 7, 5, 8, 9, 5], 3, opts)).toEqual([])
    expect(promptLookup([1, 7, 5, 8, 9, 5], 3)).toEqual([8, 9, 5])
    // ... 9 5 ... 9 5: two tokens match, what followed them is drafted.
    expect(promptLookup([9, 5, 8, 4, 9, 5], 3, opts)).toEqual([8, 4, 9])
  })

  it('drafts from three-token matches on a whole model whose verified positions are dear (int8 activations), from two elsewhere', () => {
    expect(defaultLookupMinNgram(int4int8, false)).toBe(3)
    expect(defaultLookupMinNgram(int4unset, false)).toBe(3)
    // f32 activations: a verify's positions ride on one pass over the weights.
    for (const m of [fp32, int4f32, int8f32]) expect(defaultLookupMinNgram(m, false)).toBe(DEFAULT_LOOKUP_MIN_NGRAM)
    // On a chain a round saves a traversal of every hop.
    for (const m of [fp32, int4int8, int4unset]) expect(defaultLookupMinNgram(m, true)).toBe(DEFAULT_LOOKUP_MIN_NGRAM)
    // ... 9 5 ... 9 5: a two-token match drafts only where two are enough; ... 3 9 5 ... 3 9 5 everywhere.
    expect(promptLookup([9, 5, 8, 4, 9, 5], 3, { minNgram: defaultLookupMinNgram(int4int8, false) })).toEqual([])
    expect(promptLookup([3, 9, 5, 8, 4, 3, 9, 5], 3, { minNgram: defaultLookupMinNgram(int4int8, false) })).toEqual([8, 4, 3])
  })
})
