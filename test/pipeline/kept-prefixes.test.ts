/**
 * A stage node's book of kept prefixes (pure): LRU eviction within the byte budget, a prefix only
 * its own coordinator may open, and never more positions than were kept; and the chain scope that
 * keeps one chain's prefixes from answering for another's.
 */
import { describe, expect, it } from 'vitest'
import { chainPulls, chainScope, createKeptPrefixes, keepSkips, MAX_KEEP_SKIPS } from '../../daemon/pipeline/index.ts'
import type { ChainHop } from '../../daemon/pipeline/index.ts'

describe('kept prefixes of a stage node', () => {
  it('evicts least recently used entries to stay within the budget', () => {
    const k = createKeptPrefixes(100)
    expect(k.add({ key: 'a', owner: 'c', length: 10, bytes: 40 })).toEqual({ kept: true, drop: [] })
    expect(k.add({ key: 'b', owner: 'c', length: 10, bytes: 40 })).toEqual({ kept: true, drop: [] })
    // Opening from a makes b the least recently used.
    expect(k.take('a', 'c', 10)).toBe(true)
    expect(k.add({ key: 'c', owner: 'c', length: 10, bytes: 40 })).toEqual({ kept: true, drop: ['b'] })
    expect(k.stats()).toEqual({ entries: 2, bytes: 80, budgetBytes: 100, evictions: 1 })
    expect(k.has('b')).toBe(false)
    // One larger than the whole budget is not kept (its KV is dropped at once).
    expect(k.add({ key: 'd', owner: 'c', length: 10, bytes: 101 })).toEqual({ kept: false, drop: ['d'] })
    expect(k.stats().entries).toBe(2)
    k.remove(['a', 'unknown'])
    expect(k.stats()).toMatchObject({ entries: 1, bytes: 40 })
  })

  it('opens a prefix only for its coordinator and within its length', () => {
    const k = createKeptPrefixes(1000)
    k.add({ key: 'a', owner: 'coord-1', length: 10, bytes: 40 })
    expect(k.take('a', 'coord-2', 5)).toBe(false)
    expect(k.take('a', 'coord-1', 11)).toBe(false)
    expect(k.take('a', 'coord-1', 0)).toBe(false)
    expect(k.take('missing', 'coord-1', 1)).toBe(false)
    expect(k.take('a', 'coord-1', 10)).toBe(true)
    // A coordinator evicts only its own keys.
    k.add({ key: 'b', owner: 'coord-2', length: 4, bytes: 16 })
    expect(k.removeOwned(['a', 'b', 'missing'], 'coord-2')).toEqual(['b'])
    expect(k.has('a')).toBe(true)
    expect(k.removeOwned(['a'], 'coord-1')).toEqual(['a'])
    expect(k.stats()).toMatchObject({ entries: 0, bytes: 0 })
  })
})

describe('chain scope', () => {
  const chain: ChainHop[] = [{ peerId: 'A', layers: [0, 1] }, { peerId: 'B', layers: [2, 3] }]
  it('differs for other peers, other layer splits, other weights and other activation encodings', () => {
    const base = chainScope('h', chain, 'f32')
    expect(chainScope('h', chain.map(h => ({ ...h })), 'f32')).toBe(base)
    expect(chainScope('h', [chain[0]!, { peerId: 'C', layers: [2, 3] }], 'f32')).not.toBe(base)
    expect(chainScope('h', [{ peerId: 'A', layers: [0, 2] }, { peerId: 'B', layers: [3, 3] }], 'f32')).not.toBe(base)
    expect(chainScope('h2', chain, 'f32')).not.toBe(base)
    expect(chainScope('h', chain, 'f16')).not.toBe(base)
  })
})

describe('keep back-off after refused prefixes', () => {
  it('skips 2^refusals - 1 finishes, bounded', () => {
    expect([0, 1, 2, 3, 4].map(keepSkips)).toEqual([0, 1, 3, 7, 15])
    expect(keepSkips(50)).toBe(MAX_KEEP_SKIPS)
    expect(keepSkips(-1)).toBe(0)
  })
})

describe('chainPulls: which stages of a rebuilt chain pull a kept prefix', () => {
  const kept = [{ peerId: 'A', layers: [0, 1] as [number, number] }, { peerId: 'B', layers: [2, 3] as [number, number] }, { peerId: 'C', layers: [4, 5] as [number, number] }]
  it('the stages whose peer changed, each from the peer that kept its layers', () => {
    expect(chainPulls(kept, [kept[0]!, { peerId: 'B2', layers: [2, 3] }, kept[2]!])).toEqual([{ hop: 1, peerId: 'B' }])
    expect(chainPulls(kept, [kept[0]!, { peerId: 'C', layers: [2, 3] }, { peerId: 'B', layers: [4, 5] }])).toEqual([{ hop: 1, peerId: 'B' }, { hop: 2, peerId: 'C' }])
  })
  it('none for the same chain, another stage 0, another split or another length', () => {
    expect(chainPulls(kept, kept.map(h => ({ ...h })))).toBeUndefined()
    expect(chainPulls(kept, [{ peerId: 'A2', layers: [0, 1] }, { peerId: 'B2', layers: [2, 3] }, kept[2]!])).toBeUndefined()
    expect(chainPulls(kept, [kept[0]!, { peerId: 'B2', layers: [2, 4] }, { peerId: 'C', layers: [5, 5] }])).toBeUndefined()
    expect(chainPulls(kept, [kept[0]!, { peerId: 'B2', layers: [2, 5] }])).toBeUndefined()
  })
})
