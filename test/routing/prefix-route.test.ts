/**
 * Prefix-aware routing as a pure decision: prefer the replica holding a prompt's prefix exactly
 * while the prefill it saves outweighs its extra wait; composed with chooseReplica via affinity.
 */
import { describe, expect, it } from 'vitest'
import { chooseReplica, preferPrefixHolder } from '../../daemon/routing/index.ts'
import type { Candidate, PrefixCandidate } from '../../daemon/routing/index.ts'

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
