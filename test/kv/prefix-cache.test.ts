/**
 * The prefix cache's pure parts: chained block hashes, longest-prefix lookup, scoping, the reuse
 * decision, and the LRU byte budget that never evicts a leased entry.
 */
import fc from 'fast-check'
import { describe, expect, it } from 'vitest'
import { blockHashes, cachedTokensFor, compactHash, mergeSummaries, createPrefixCache, decideReuse, defaultKvCacheBytes, prefixScope, SUMMARY_HASH_HEX } from '../../daemon/kv/index.ts'

const scope = prefixScope({ manifestHash: 'ab12', layers: [0, 3], dtype: 'float32' })
const seq = (n: number, from = 0): number[] => Array.from({ length: n }, (_, i) => from + i)

describe('block hashes', () => {
  it('are chained from the start: a block hash names its whole prefix', () => {
    const a = blockHashes(scope, seq(48), 16)
    expect(a).toHaveLength(3)
    const b = blockHashes(scope, [...seq(16), ...seq(32, 100)], 16)
    expect(b[0]).toBe(a[0])
    expect(b[1]).not.toBe(a[1])
    // Same second block after a different first block: still a different hash.
    const c = blockHashes(scope, [...seq(16, 500), ...seq(16, 16)], 16)
    expect(c[1]).not.toBe(a[1])
    // A partial block has no hash; `blocks` caps the count.
    expect(blockHashes(scope, seq(47), 16)).toHaveLength(2)
    expect(blockHashes(scope, seq(48), 16, 1)).toEqual([a[0]])
  })

  it('are scoped by manifest hash, layer range and dtype', () => {
    const base = blockHashes(scope, seq(16), 16)[0]
    for (const other of [
      prefixScope({ manifestHash: 'ab13', layers: [0, 3], dtype: 'float32' }),
      prefixScope({ manifestHash: 'ab12', layers: [0, 2], dtype: 'float32' }),
      prefixScope({ manifestHash: 'ab12', layers: [0, 3], dtype: 'float16' }),
    ]) expect(blockHashes(other, seq(16), 16)[0]).not.toBe(base)
  })

  it('golden: the chain is sha256(prev ‖ u32le tokens), seeded by sha256(scope) (checked with Python hashlib)', () => {
    expect(prefixScope({ manifestHash: 'ab12', layers: [0, 3], dtype: 'float32' })).toBe('kv1/ab12/0-3/float32')
    expect(blockHashes('kv1/x/0-0/float32', [1, 2], 2)).toEqual(['57db2a75b0343ca3aa49e1fed65f4167f98023ab00e262ed56321c2b0b423f32'])
  })
})

describe('reuse decision', () => {
  it('leaves at least two prompt positions (or minPrefillTokens ≥ 1) to run, and reuses nothing below the minimum', () => {
    expect(decideReuse({ promptLength: 40, matchLength: 40, minReuseTokens: 16 })).toBe(38)
    expect(decideReuse({ promptLength: 40, matchLength: 40, minReuseTokens: 16, minPrefillTokens: 1 })).toBe(39)
    expect(decideReuse({ promptLength: 40, matchLength: 40, minReuseTokens: 16, minPrefillTokens: 0 })).toBe(39)
    expect(decideReuse({ promptLength: 40, matchLength: 32, minReuseTokens: 16 })).toBe(32)
    expect(decideReuse({ promptLength: 40, matchLength: 15, minReuseTokens: 16 })).toBe(0)
    expect(decideReuse({ promptLength: 1, matchLength: 1, minReuseTokens: 0 })).toBe(0)
    fc.assert(fc.property(fc.nat(5000), fc.nat(5000), fc.nat(64), fc.nat(4), (p, m, min, rest) => {
      const r = decideReuse({ promptLength: p, matchLength: m, minReuseTokens: min, minPrefillTokens: rest })
      return r === 0 || (r <= m && r <= p - Math.max(1, rest) && r >= min && r >= 1)
    }))
  })

  it('defaults the budget to an eighth of free memory within [64 MiB, 2 GiB]', () => {
    const mib = 1024 * 1024
    expect(defaultKvCacheBytes(8192 * mib)).toBe(1024 * mib)
    expect(defaultKvCacheBytes(100 * mib)).toBe(64 * mib)
    expect(defaultKvCacheBytes(1e12)).toBe(2048 * mib)
  })
})

describe('prefix cache', () => {
  it('finds the longest cached prefix, token-exact beyond the last whole block', () => {
    const c = createPrefixCache({ budgetBytes: 1e6, blockSize: 16 })
    expect(c.insert(scope, 'a', seq(40), 400)).toEqual({ kept: true, drop: [] })
    expect(c.insert(scope, 'b', [...seq(20), ...seq(30, 900)], 500)).toEqual({ kept: true, drop: [] })
    expect(c.lookup(scope, seq(100))).toEqual({ key: 'a', length: 40, entryLength: 40 })
    expect(c.lookup(scope, [...seq(20), ...seq(10, 900), 7])).toEqual({ key: 'b', length: 30, entryLength: 50 })
    expect(c.lookup(scope, seq(37))).toEqual({ key: 'a', length: 37, entryLength: 40 })
    expect(c.lookup(scope, seq(100), 33)).toEqual({ key: 'a', length: 33, entryLength: 40 })
    // Shorter than one block, a different first block, another scope: nothing.
    expect(c.lookup(scope, seq(15))).toBeUndefined()
    expect(c.lookup(scope, seq(40, 1))).toBeUndefined()
    expect(c.lookup(prefixScope({ manifestHash: 'ff', layers: [0, 3], dtype: 'float32' }), seq(40))).toBeUndefined()
  })

  it('acquire leaves two prompt positions to run and counts hit and miss tokens', () => {
    const c = createPrefixCache({ budgetBytes: 1e6, blockSize: 16 })
    c.insert(scope, 'a', seq(40), 400)
    const same = c.acquire(scope, seq(40))!
    expect(same.length).toBe(38)
    same.release()
    const longer = c.acquire(scope, seq(50))!
    expect(longer).toMatchObject({ key: 'a', length: 40 })
    longer.release()
    expect(c.acquire(scope, seq(10, 3))).toBeUndefined()
    expect(c.stats()).toMatchObject({ hitTokens: 78, missTokens: 2 + 10 + 10, pinned: 0 })
  })

  it('keeps within its byte budget, evicting least recently used first', () => {
    const c = createPrefixCache({ budgetBytes: 1000, blockSize: 16 })
    c.insert(scope, 'a', seq(16, 0), 400)
    c.insert(scope, 'b', seq(16, 100), 400)
    c.acquire(scope, [...seq(16, 0), 1, 2])!.release() // touches a: b is now the oldest
    expect(c.insert(scope, 'c', seq(16, 200), 400)).toEqual({ kept: true, drop: ['b'] })
    expect(c.keys()).toEqual(['a', 'c'])
    expect(c.stats()).toMatchObject({ bytes: 800, evictions: 1 })
    // Bigger than the whole budget: never kept.
    expect(c.insert(scope, 'd', seq(16, 300), 1001)).toEqual({ kept: false, drop: ['d'] })
  })

  it('never evicts a leased entry; refuses a new one that only fits by doing so', () => {
    const c = createPrefixCache({ budgetBytes: 1000, blockSize: 16 })
    c.insert(scope, 'a', seq(16, 0), 600)
    const lease = c.acquire(scope, seq(20, 0))!
    expect(c.insert(scope, 'b', seq(16, 100), 600)).toEqual({ kept: false, drop: ['b'] })
    expect(c.keys()).toEqual(['a'])
    lease.release()
    expect(c.insert(scope, 'b', seq(16, 100), 600)).toEqual({ kept: true, drop: ['a'] })
  })

  it('a longer entry supersedes its prefixes; a prefix of a kept entry is not kept again', () => {
    const c = createPrefixCache({ budgetBytes: 1e6, blockSize: 16 })
    c.insert(scope, 'turn1', seq(20), 200)
    expect(c.insert(scope, 'turn2', seq(40), 400)).toEqual({ kept: true, drop: ['turn1'] })
    expect(c.insert(scope, 'again', seq(30), 300)).toEqual({ kept: false, drop: ['again'] })
    expect(c.stats()).toMatchObject({ entries: 1, bytes: 400, evictions: 0 })
  })

  it('property: bytes never exceed the budget, leased entries survive, every lookup is a true prefix', () => {
    const op = fc.oneof(
      fc.record({ t: fc.constant('insert' as const), base: fc.nat(3), len: fc.integer({ min: 1, max: 60 }), size: fc.integer({ min: 1, max: 700 }) }),
      fc.record({ t: fc.constant('acquire' as const), base: fc.nat(3), len: fc.integer({ min: 1, max: 60 }) }),
      fc.record({ t: fc.constant('release' as const), i: fc.nat(10) }),
    )
    fc.assert(fc.property(fc.array(op, { maxLength: 60 }), (ops) => {
      const c = createPrefixCache({ budgetBytes: 1000, blockSize: 4 })
      const leases: Array<{ key: string, release: () => void }> = []
      const live = new Set<string>()
      const tokensOf = new Map<string, number[]>()
      let n = 0
      for (const o of ops) {
        if (o.t === 'insert') {
          const key = `k${n++}`
          const toks = seq(o.len, o.base * 1000)
          const r = c.insert(scope, key, toks, o.size)
          if (r.kept) { live.add(key); tokensOf.set(key, toks) }
          for (const d of r.drop) {
            if (leases.some(l => l.key === d)) return false // a leased entry was dropped
            live.delete(d)
          }
        } else if (o.t === 'acquire') {
          const q = seq(o.len, o.base * 1000)
          const l = c.acquire(scope, q)
          if (l !== undefined) {
            if (!live.has(l.key) || l.length > q.length - 2) return false
            const have = tokensOf.get(l.key)!
            if (have.slice(0, l.length).some((t, i) => t !== q[i])) return false
            leases.push(l)
          }
        } else if (leases.length > 0) {
          leases.splice(o.i % leases.length, 1)[0]!.release()
        }
        const s = c.stats()
        if (s.bytes > 1000 || s.entries !== live.size) return false
      }
      return true
    }))
  })

  it('summarises what it holds: compact hashes, deepest block and blocks 1, 2, 4, 8… deep, recent entries first, bounded', () => {
    const c = createPrefixCache({ budgetBytes: 1e6, blockSize: 4 })
    const a = seq(4 * 20, 0) // 20 blocks: listed depths 20, 16, 8, 4, 2, 1
    const b = seq(4 * 3, 500) // 3 blocks: 3, 2, 1
    c.insert(scope, 'a', a, 1)
    c.insert(scope, 'b', b, 1)
    const ha = blockHashes(scope, a, 4).map(compactHash)
    const hb = blockHashes(scope, b, 4).map(compactHash)
    expect(ha[0]).toHaveLength(SUMMARY_HASH_HEX)
    expect(c.summary(scope, 100)).toEqual([hb[2], hb[1], hb[0], ha[19], ha[15], ha[7], ha[3], ha[1], ha[0]])
    expect(c.summary(scope, 4)).toEqual([hb[2], hb[1], hb[0], ha[19]])
    expect(c.summary('other', 3)).toEqual([])
  })

  it('merges several caches\' summaries round-robin, bounded, without duplicates', () => {
    expect(mergeSummaries([['a1', 'a2', 'a3'], ['b1'], ['c1', 'a1']], 4)).toEqual(['a1', 'b1', 'c1', 'a2'])
    expect(mergeSummaries([['a1', 'a2'], ['a1']], 10)).toEqual(['a1', 'a2'])
    expect(mergeSummaries([], 10)).toEqual([])
  })

  it('reading a summary: a prompt sharing part of an entry matches at least half of what it shares', () => {
    const c = createPrefixCache({ budgetBytes: 1e6, blockSize: 4 })
    const a = seq(4 * 20, 0)
    c.insert(scope, 'a', a, 1)
    const summary = new Set(c.summary(scope, 64))
    for (let shared = 1; shared <= 20; shared++) {
      const prompt = [...a.slice(0, shared * 4), ...seq(9, 7000)]
      const got = cachedTokensFor(blockHashes(scope, prompt, 4), summary, 4)
      expect(got, `${shared} blocks shared`).toBeLessThanOrEqual(shared * 4)
      expect(got).toBeGreaterThanOrEqual(shared * 4 / 2)
    }
    expect(cachedTokensFor(blockHashes(scope, seq(40, 9000), 4), summary, 4)).toBe(0)
  })
})
