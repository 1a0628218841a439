/**
 * Prefix-aware routing as a pure decision: prefer the replica holding a prompt's prefix exactly
 * while the prefill it saves outweighs its extra wait; composed with chooseReplica via affinity.
 */
import { describe, expect, it } from 'vitest'
import { blockHashes, compactHash, createPrefixCache } from '../../daemon/kv/index.ts'
import { chooseReplica, keptPromptHash, planPrefixRoute, preferPrefixHolder, prefixHolderHint, withLearnedPrefixes } from '../../daemon/routing/index.ts'
import type { Candidate, PrefixCandidate, PrefixHoldings } from '../../daemon/routing/index.ts'

const cand = (peerId: string, startMs: number, cachedTokens: number, prefillTokensPerSecond = 1000): PrefixCandidate => ({ peerId, startMs, cachedTokens, prefillTokensPerSecond })

describe('preferPrefixHolder', () => {
  it('prefers the holder when its saved prefill outweighs its wait', () => {
    // 2000-token prompt at 1000 tok/s: cold 2 s. The holder waits 300 ms but prefills 1 token.
    const p = preferPrefixHolder([cand('a', 0, 0), cand('b', 300, 1999)], 2000)
    expect(p).toMatchObject({ peerId: 'b', cachedTokens: 1998 })
    expect(p!.savedMs).toBeCloseTo(2000 - 302, 6)
    expect(p!.policy).toEqual({ affinitySlackMs: p!.savedMs, affinitySlackRatio: 0 })
  })

  it('does not when the holder waits longer than the prefill it saves, or saves only noise', () => {
    expect(preferPrefixHolder([cand('a', 0, 0), cand('b', 2500, 1999)], 2000)).toBeUndefined()
    // 32 cached tokens of 2000: 32 ms, under 10 % of the cold cost.
    expect(preferPrefixHolder([cand('a', 0, 0), cand('b', 0, 32)], 2000)).toBeUndefined()
    expect(preferPrefixHolder([cand('a', 0, 0), cand('b', 0, 0)], 2000)).toBeUndefined()
    expect(preferPrefixHolder([], 2000)).toBeUndefined()
  })

  it('never counts the prompt\'s last two positions as cached, and picks the cheapest holder (ties by peer id)', () => {
    expect(preferPrefixHolder([cand('a', 0, 5000)], 100)).toMatchObject({ cachedTokens: 98 })
    expect(preferPrefixHolder([cand('c', 0, 1000), cand('b', 0, 1000), cand('a', 0, 0)], 2000)).toMatchObject({ peerId: 'b' })
    expect(preferPrefixHolder([cand('b', 0, 1000), cand('c', 0, 1500)], 2000)).toMatchObject({ peerId: 'c' })
    // A faster cold replica raises the bar: cold = 2000 tokens at 10k tok/s = 200 ms.
    expect(preferPrefixHolder([cand('a', 0, 0, 10_000), cand('b', 0, 1000, 1000)], 2000)).toBeUndefined()
  })

  it('composes with chooseReplica: the holder is kept while it finishes within the time it saves', () => {
    const now = 1_000_000
    const node = (peerId: string, inFlight: number): Candidate => ({
      peerId, local: false, admitted: true, alive: true, wholeModel: true,
      load: { observedAt: now, queueDepth: 0, inFlight, slots: 8, tokensPerSecond: 100 },
    })
    const pref = preferPrefixHolder([cand('a', 0, 0), cand('b', 0, 1999)], 2000)!
    const ctx = { now, random: () => 0, roundRobin: 0, expectedTokens: 50, affinity: pref.peerId, policy: pref.policy }
    // b is a little busier (decode estimate 1.0 s vs 0.5 s) but saves ~2 s of prefill: b.
    expect(chooseReplica([node('a', 0), node('b', 1)], ctx)).toMatchObject({ peerId: 'b', reason: 'affinity' })
    // Much busier (7 in flight: 4 s of decode vs 0.5 s): not worth it.
    expect(chooseReplica([node('a', 0), node('b', 7)], ctx)).toMatchObject({ peerId: 'a' })
  })
})

describe('planPrefixRoute: reading candidates\' summaries for one prompt', () => {
  const now = 1_000_000
  const scope = 'kv1/manifest-a/0-1/float32'
  const prompt = Array.from({ length: 200 }, (_, i) => 3 + (i * 7) % 90)
  /** A real cache's summary after keeping `kept` (so the hashing and sampling are the real ones). */
  const holding = (kept: number[], s = scope): PrefixHoldings => {
    const cache = createPrefixCache({ budgetBytes: 1 << 20 })
    cache.insert(s, 'k', kept, 100)
    return { scope: s, blockSize: cache.blockSize, hashes: cache.summary(s, 64) }
  }
  const node = (peerId: string, over: Partial<Candidate> = {}): Candidate => ({
    peerId, local: false, admitted: true, alive: true, wholeModel: true, rttMs: 1,
    load: { observedAt: now, queueDepth: 0, inFlight: 0, slots: 4, tokensPerSecond: 100 },
    ...over,
  })

  it('counts what each node holds in its own scope and prefers the holder', () => {
    const r = planPrefixRoute([node('a'), node('b', { prefixes: holding(prompt.slice(0, 160)) })], prompt, { now, expectedTokens: 16 })
    // A 160-token entry lists its deepest block (10 blocks of 16): all 160 tokens.
    expect(r.cached).toEqual(new Map([['b', 160]]))
    expect(r.preference).toMatchObject({ peerId: 'b', cachedTokens: 160 })
    // The same tokens kept under another model's scope say nothing about this one.
    const other = planPrefixRoute([node('a'), node('b', { prefixes: { ...holding(prompt.slice(0, 160), 'kv1/manifest-b/0-1/float32'), scope } })], prompt, { now })
    expect(other.cached.size).toBe(0)
    expect(other.preference).toBeUndefined()
  })

  it('a different conversation matches only the blocks it shares', () => {
    const mine = [...prompt.slice(0, 40), ...prompt.slice(40).map(t => t + 1)]
    const r = planPrefixRoute([node('a'), node('b', { prefixes: holding(prompt) })], mine, { now })
    // 40 shared tokens = 2 whole blocks; the summary lists blocks 1, 2, 4, 8 and the deepest (12).
    expect(r.cached.get('b')).toBe(32)
  })

  it('holders that cannot compete (suspect, stale, excluded) give no preference but still a hint', () => {
    const held = holding(prompt.slice(0, 160))
    const suspect = planPrefixRoute([node('a'), node('b', { alive: false, prefixes: held })], prompt, { now })
    expect(suspect.preference).toBeUndefined()
    expect(prefixHolderHint(suspect, 'a')).toEqual({ peerId: 'b', cachedTokens: 160 })
    const stale = planPrefixRoute([node('a'), node('b', { prefixes: held, load: { observedAt: now - 60_000, queueDepth: 0, inFlight: 0, slots: 4, tokensPerSecond: 100 } })], prompt, { now })
    expect(stale.preference).toBeUndefined()
    expect(prefixHolderHint(stale, 'a')).toEqual({ peerId: 'b', cachedTokens: 160 })
    const excluded = planPrefixRoute([node('a'), node('b', { prefixes: held })], prompt, { now, exclude: ['b'] })
    expect(excluded.cached.size).toBe(0)
    expect(prefixHolderHint(excluded, 'a')).toBeUndefined()
  })

  it('an overloaded holder loses to a cold replica, and the chosen one carries the holder as its hint', () => {
    const held = holding(prompt.slice(0, 160))
    // b's queue: 20 requests ahead of ours at 100 tok/s for 50 tokens each = 10 s before it starts.
    const busy = node('b', { prefixes: held, load: { observedAt: now, queueDepth: 20, inFlight: 4, slots: 4, tokensPerSecond: 100 } })
    const r = planPrefixRoute([node('a'), busy], prompt, { now, expectedTokens: 50 })
    expect(r.preference).toBeUndefined()
    const choice = chooseReplica([node('a'), busy], { now, random: () => 0, roundRobin: 0, expectedTokens: 50 })
    expect(choice).toMatchObject({ kind: 'node', peerId: 'a' })
    expect(prefixHolderHint(r, 'a')).toEqual({ peerId: 'b', cachedTokens: 160 })
    // No hint to the holder itself, nor to a node that holds as much.
    expect(prefixHolderHint(r, 'b')).toBeUndefined()
  })

  it('names a holder only to a node of its own scope: another manifest\'s KV would be refused', () => {
    const held = holding(prompt.slice(0, 160))
    const otherScope = 'kv1/manifest-int4/0-1/float32'
    const r = planPrefixRoute([node('a', { prefixes: { scope: otherScope, blockSize: 16, hashes: [] } }), node('b', { prefixes: held }), node('c', { prefixes: { ...held, hashes: [] } })], prompt, { now, prefixPolicy: { minSavedMs: Infinity } })
    expect(r.cached).toEqual(new Map([['b', 160]]))
    // a serves the same model id from another manifest: no hint; c shares b's scope: b is its hint.
    expect(prefixHolderHint(r, 'a')).toBeUndefined()
    expect(prefixHolderHint(r, 'c')).toEqual({ peerId: 'b', cachedTokens: 160 })
    // A node that says no scope (no prefix cache, an older node) still gets the hint.
    expect(prefixHolderHint(planPrefixRoute([node('d'), node('b', { prefixes: held })], prompt, { now }), 'd')).toEqual({ peerId: 'b', cachedTokens: 160 })
  })

  it('hashes the prompt once per scope, and a holder listing none of it is not counted', () => {
    const held = holding(prompt.slice(0, 64))
    const r = planPrefixRoute([node('a', { prefixes: held }), node('b', { prefixes: held }), node('c', { prefixes: { ...held, hashes: [compactHash(blockHashes(scope, [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9])[0]!)] } })], prompt, { now })
    expect(r.cached).toEqual(new Map([['a', 64], ['b', 64]]))
    expect(prefixHolderHint(r, 'c')).toEqual({ peerId: 'a', cachedTokens: 64 })
  })

  it('a holder that does not say its prefill rate is assumed to prefill like those that do', () => {
    const held = holding(prompt.slice(0, 160))
    // 160 tokens at the default 500 tok/s: 320 ms saved, worth preferring.
    expect(planPrefixRoute([node('a'), node('b', { prefixes: held })], prompt, { now }).preference).toMatchObject({ peerId: 'b' })
    // The other replica measured 20k tok/s (its own summary says so, with no hashes): 8 ms, noise.
    const fast = { scope, blockSize: 16, hashes: [], prefillTokensPerSecond: 20_000 }
    expect(planPrefixRoute([node('a', { prefixes: fast }), node('b', { prefixes: held })], prompt, { now }).preference).toBeUndefined()
  })

  it('what our own requests left on a node counts until a report that should list it comes', () => {
    const held = holding([])
    const hash = keptPromptHash(held, prompt)!
    // The prompt's deepest whole block (12 × 16 of 200 tokens), as the node's summary will list it.
    expect(hash).toBe(holding(prompt).hashes[0])
    expect(keptPromptHash(held, prompt.slice(0, 15))).toBeUndefined()
    const c = node('b', { prefixes: held })
    const learned = [{ hash, at: now - 100 }]
    const merged = withLearnedPrefixes(c, learned, 1_000)
    expect(merged.candidate.prefixes!.hashes).toEqual([hash])
    expect(planPrefixRoute([node('a'), merged.candidate], prompt, { now }).cached.get('b')).toBe(192)
    // A report taken well after that request ended (past the grace) no longer lists it: forgotten.
    const later = node('b', { prefixes: held, load: { observedAt: now + 5_000, queueDepth: 0, inFlight: 0, slots: 4, tokensPerSecond: 100 } })
    expect(withLearnedPrefixes(later, learned, 1_000)).toEqual({ candidate: later, current: [] })
    // Without a scope to hash in, nothing is merged.
    expect(withLearnedPrefixes(node('b'), learned, 1_000).candidate.prefixes).toBeUndefined()
  })
})
