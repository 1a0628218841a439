/** Replica choice: a pure function, tested without a network. */
import fc from 'fast-check'
import { describe, expect, it } from 'vitest'
import { createRng } from '../../daemon/engine/index.ts'
import { chooseReplica, DEFAULT_POLICY, estimateCompletionMs, isSoleServer, rankReplicas } from '../../daemon/routing/index.ts'
import type { Candidate, LoadSnapshot, RoutingContext } from '../../daemon/routing/index.ts'

const NOW = 1_000_000

function load (over: Partial<LoadSnapshot> = {}): LoadSnapshot {
  return { observedAt: NOW, queueDepth: 0, inFlight: 0, slots: 4, tokensPerSecond: 100, ...over }
}

function node (peerId: string, over: Partial<Candidate> = {}): Candidate {
  return { peerId, local: false, admitted: true, alive: true, wholeModel: true, load: load(), rttMs: 1, ...over }
}

function ctx (over: Partial<RoutingContext> = {}): RoutingContext {
  return { now: NOW, random: createRng(1), roundRobin: 0, ...over }
}

function counts (decide: (i: number) => string, n: number): Record<string, number> {
  const out: Record<string, number> = {}
  for (let i = 0; i < n; i++) {
    const p = decide(i)
    out[p] = (out[p] ?? 0) + 1
  }
  return out
}

describe('chooseReplica', () => {
  it('never picks a node that is not admitted, not alive, only a stage, or excluded', () => {
    const cs = [
      node('a', { admitted: false }), node('b', { alive: false }), node('c', { wholeModel: false }), node('d'), node('e'),
    ]
    for (let i = 0; i < 50; i++) {
      const d = chooseReplica(cs, ctx({ random: createRng(i), exclude: ['e'] }))
      expect(d).toMatchObject({ kind: 'node', peerId: 'd' })
    }
  })

  it('says why no node is eligible (→ 503)', () => {
    const d = chooseReplica([node('a', { admitted: false }), node('b', { alive: false }), node('c', { wholeModel: false }), node('d')], ctx({ exclude: ['d'] }))
    expect(d.kind).toBe('no-eligible')
    expect(d.kind === 'no-eligible' && d.reason).toBe('no eligible node among 4: 1 not admitted, 1 unreachable, 1 hold only a pipeline stage, 1 already tried')
    expect(chooseReplica([], ctx())).toEqual({ kind: 'no-eligible', reason: 'no node serves this model' })
  })

  it('returns overloaded (→ 429) when every eligible node is full, refusing or cannot start before the deadline', () => {
    const cs = [
      node('a', { load: load({ accepting: false }) }),
      node('b', { load: load({ queueDepth: DEFAULT_POLICY.maxQueueDepth }) }),
      node('c', { load: load({ inFlight: 4, queueDepth: 5, tokensPerSecond: 10 }) }),
    ]
    // c would start only after ~6 requests of 100 tokens at 10 tok/s leave: far past the deadline.
    const d = chooseReplica(cs, ctx({ deadline: NOW + 2_000, expectedTokens: 100 }))
    expect(d.kind).toBe('overloaded')
    // Without the deadline, c is merely slow and still chosen.
    expect(chooseReplica(cs, ctx({ expectedTokens: 100 }))).toMatchObject({ kind: 'node', peerId: 'c' })
  })

  it('prefers the local node while it has headroom, even when a remote looks faster', () => {
    const cs = [node('remote', { load: load({ tokensPerSecond: 1000 }) }), node('self', { local: true, rttMs: 0, load: load({ inFlight: 3 }) })]
    for (let i = 0; i < 20; i++) expect(chooseReplica(cs, ctx({ random: createRng(i) }))).toMatchObject({ peerId: 'self', local: true, reason: 'local' })
  })

  it('lets load decide once the local node has no free slot or a queue', () => {
    const full = [node('remote'), node('self', { local: true, load: load({ inFlight: 4, queueDepth: 2 }) })]
    for (let i = 0; i < 20; i++) expect(chooseReplica(full, ctx({ random: createRng(i) }))).toMatchObject({ peerId: 'remote', reason: 'least-loaded' })
  })

  it('keeps prefix affinity while the node is within the bound of the best, drops it beyond', () => {
    const best = node('fast', { load: load({ inFlight: 0 }) })
    // Same load, a bit farther away: within the slack (max(500 ms, 25 % of the best)).
    const near = node('warm', { rttMs: 300 })
    const far = node('warm', { load: load({ inFlight: 20 }) })
    expect(chooseReplica([best, near], ctx({ affinity: 'warm' }))).toMatchObject({ peerId: 'warm', reason: 'affinity' })
    const d = chooseReplica([best, far], ctx({ affinity: 'warm' }))
    expect(d).toMatchObject({ peerId: 'fast', reason: 'least-loaded' })
    // Affinity to a stale, ineligible or unknown node is ignored.
    expect(chooseReplica([best, node('warm', { load: load({ observedAt: NOW - 60_000 }) })], ctx({ affinity: 'warm', random: () => 0.99 })).reason).not.toBe('affinity')
    expect(chooseReplica([best, node('warm', { alive: false })], ctx({ affinity: 'warm' }))).toMatchObject({ peerId: 'fast' })
    expect(chooseReplica([best], ctx({ affinity: 'ghost' }))).toMatchObject({ peerId: 'fast' })
  })

  it('with two choices picks the lower estimated completion time', () => {
    const cs = [node('busy', { load: load({ inFlight: 3, queueDepth: 5 }) }), node('idle')]
    for (let i = 0; i < 20; i++) expect(chooseReplica(cs, ctx({ random: createRng(i) }))).toMatchObject({ peerId: 'idle' })
  })

  it('counts RTT: a far node loses to a near one with equal load', () => {
    const cs = [node('far', { rttMs: 400 }), node('near', { rttMs: 2 })]
    expect(chooseReplica(cs, ctx())).toMatchObject({ peerId: 'near' })
  })

  it('breaks ties by the first drawn candidate, independent of input order', () => {
    const cs = ['a', 'b', 'c'].map(p => node(p))
    for (let seed = 0; seed < 20; seed++) {
      const x = chooseReplica(cs, ctx({ random: createRng(seed) }))
      const y = chooseReplica([...cs].reverse(), ctx({ random: createRng(seed) }))
      expect(y).toEqual(x)
    }
    // random() = 0 draws a first (index 0), so a wins the tie.
    expect(chooseReplica(cs, ctx({ random: () => 0 }))).toMatchObject({ peerId: 'a' })
  })

  it('spreads evenly over equal loads', () => {
    const cs = ['a', 'b', 'c', 'd', 'e'].map(p => node(p))
    const random = createRng(7)
    const n = 5000
    const got = counts(i => (chooseReplica(cs, ctx({ random, roundRobin: i })) as { peerId: string }).peerId, n)
    for (const p of ['a', 'b', 'c', 'd', 'e']) expect(Math.abs((got[p] ?? 0) - n / 5)).toBeLessThan(n / 5 * 0.1)
  })

  it('degrades to round-robin when every load is stale, never to one hot node', () => {
    const old = NOW - DEFAULT_POLICY.staleAfterMs - 1
    // 'a' last looked idle, but that was long ago.
    const cs = [node('a', { load: load({ observedAt: old }) }), node('b', { load: load({ observedAt: old, inFlight: 30 }) }), node('c', { load: undefined })]
    const seq = [0, 1, 2, 3, 4, 5].map(i => chooseReplica(cs, ctx({ roundRobin: i })))
    expect(seq.map(d => d.kind === 'node' && d.peerId)).toEqual(['a', 'b', 'c', 'a', 'b', 'c'])
    expect(seq.every(d => d.kind === 'node' && d.reason === 'round-robin')).toBe(true)
    // Stale "not accepting" is not trusted either.
    expect(chooseReplica([node('x', { load: load({ observedAt: old, accepting: false }) })], ctx()).kind).toBe('node')
  })

  it('scores stale nodes as the median fresh one, so a single fresh hot node does not absorb everything', () => {
    const old = NOW - 60_000
    const cs = [node('hot', { load: load({ inFlight: 3, queueDepth: 10 }) }), node('s1', { load: load({ observedAt: old }) }), node('s2', { load: undefined })]
    const random = createRng(3)
    const got = counts(() => (chooseReplica(cs, ctx({ random })) as { peerId: string }).peerId, 300)
    // One fresh node is its own median, so the stale ones tie with it: a third each, not all.
    expect(got.hot).toBeLessThan(130)
    expect(got.s1).toBeGreaterThan(70)
    expect(got.s2).toBeGreaterThan(70)
    // With an idle fresh node beside it, the hot one gets nothing and the stale ones share.
    const got2 = counts(() => (chooseReplica([...cs, node('idle')], ctx({ random })) as { peerId: string }).peerId, 300)
    expect(got2.hot).toBeUndefined()
    expect(got2.s1).toBeGreaterThan(50)
    expect(got2.s2).toBeGreaterThan(50)
  })

  it('sends a request to a replica with a free slot rather than queueing it behind a full one', () => {
    // Three fresh replicas, two full and one with a free slot: power of two choices alone would
    // pick between two full ones a third of the time.
    const cs = [
      node('full-a', { load: load({ inFlight: 4, slots: 4 }) }),
      node('full-b', { load: load({ inFlight: 4, slots: 4 }) }),
      node('free', { load: load({ inFlight: 3, slots: 4 }) }),
    ]
    const random = createRng(11)
    const got = counts(() => (chooseReplica(cs, ctx({ random })) as { peerId: string }).peerId, 200)
    expect(got).toEqual({ free: 200 })
  })

  it('treats estimates inside the measurement noise as equal: the less occupied replica wins, so a burst spreads', () => {
    // Two replicas of one kind whose own step-time readings differ by 20 %: the "faster" one must
    // not take a whole burst while the other idles.
    const burst = (rates: [number, number]): Record<string, number> => {
      const inFlight: Record<string, number> = { a: 0, b: 0 }
      for (let k = 0; k < 8; k++) {
        const cs = [node('a', { load: load({ tokensPerSecond: rates[0], inFlight: inFlight.a, slots: 8 }) }), node('b', { load: load({ tokensPerSecond: rates[1], inFlight: inFlight.b, slots: 8 }) })]
        const d = chooseReplica(cs, ctx({ random: createRng(k), expectedTokens: 64 })) as { peerId: string }
        inFlight[d.peerId]!++
      }
      return inFlight
    }
    expect(burst([120, 100])).toEqual({ a: 4, b: 4 })
    // A replica really twice as fast at this load still wins while its estimate stays ahead.
    expect(burst([300, 100]).a).toBeGreaterThan(4)
    // Outside the noise the estimate decides as before.
    const cs = [node('a', { load: load({ tokensPerSecond: 200 }) }), node('b', { load: load({ tokensPerSecond: 100 }) })]
    for (let k = 0; k < 20; k++) expect(chooseReplica(cs, ctx({ random: createRng(k) }))).toMatchObject({ peerId: 'a' })
  })

  it('scores a node that has not measured its rate yet at the median known rate, so load still spreads', () => {
    const cs = [node('measured', { load: load({ tokensPerSecond: 400 }) }), node('fresh', { load: load({ tokensPerSecond: 0 }) })]
    const random = createRng(5)
    // Equal loads and (neutral) equal rates: an even split, not all to one side.
    const got = counts(() => (chooseReplica(cs, ctx({ random })) as { peerId: string }).peerId, 400)
    expect(got.measured).toBeGreaterThan(150)
    expect(got.fresh).toBeGreaterThan(150)
  })

  it('estimates completion from queue wait, shared decode rate and RTT', () => {
    const p = { ...DEFAULT_POLICY }
    // 100 tokens at 100 tok/s shared by 2 sequences (one in flight + ours) = 2000 ms, plus RTT.
    expect(estimateCompletionMs(load({ inFlight: 1 }), 10, 100, p)).toBe(2010)
    expect(estimateCompletionMs(load({ expectedQueueWaitMs: 500 }), 0, 100, p)).toBe(1500)
    // Unknown rate: the default.
    expect(estimateCompletionMs(load({ tokensPerSecond: 0 }), 0, 20, p)).toBe(1000)
    // All 4 slots busy and 2 queued: 3 requests must leave first, one per 1000 ms at 100 tok/s.
    expect(estimateCompletionMs(load({ inFlight: 4, queueDepth: 2 }), 0, 100, p)).toBe(3000 + 5000)
  })

  it('a chosen replica is always eligible and never excluded (property)', () => {
    const cand = fc.record({
      peerId: fc.constantFrom('a', 'b', 'c', 'd', 'e', 'f'),
      local: fc.boolean(),
      admitted: fc.boolean(),
      alive: fc.boolean(),
      wholeModel: fc.boolean(),
      rttMs: fc.option(fc.integer({ min: 0, max: 500 }), { nil: undefined }),
      load: fc.option(fc.record({
        observedAt: fc.integer({ min: NOW - 20_000, max: NOW }),
        queueDepth: fc.integer({ min: 0, max: 100 }),
        inFlight: fc.integer({ min: 0, max: 64 }),
        slots: fc.integer({ min: 1, max: 16 }),
        tokensPerSecond: fc.integer({ min: 0, max: 500 }),
        accepting: fc.option(fc.boolean(), { nil: undefined }),
      }), { nil: undefined }),
    })
    fc.assert(fc.property(
      fc.uniqueArray(cand, { selector: c => c.peerId, maxLength: 6 }),
      fc.subarray(['a', 'b', 'c', 'd', 'e', 'f']),
      fc.option(fc.constantFrom('a', 'b', 'z'), { nil: undefined }),
      fc.nat(), fc.nat(),
      (cs, exclude, affinity, seed, rr) => {
        const c = ctx({ random: createRng(seed), roundRobin: rr, exclude, affinity })
        const d = chooseReplica(cs, c)
        const eligible = cs.filter(x => x.admitted && x.alive && x.wholeModel && !exclude.includes(x.peerId))
        if (d.kind === 'node') {
          const chosen = eligible.find(x => x.peerId === d.peerId)
          expect(chosen).toBeDefined()
          const l = chosen?.load
          if (l !== undefined && NOW - l.observedAt <= DEFAULT_POLICY.staleAfterMs) {
            expect(l.accepting === false || l.queueDepth >= DEFAULT_POLICY.maxQueueDepth).toBe(false)
          }
          expect(rankReplicas(cs, c)).toContain(d.peerId)
        } else if (d.kind === 'no-eligible') {
          expect(eligible).toEqual([])
        } else {
          expect(eligible.length).toBeGreaterThan(0)
          expect(rankReplicas(cs, c)).toEqual([])
        }
      }))
  })
})

describe('rankReplicas', () => {
  it('orders usable replicas by estimate, leaving out the excluded and the overloaded', () => {
    const cs = [node('slow', { load: load({ inFlight: 6 }) }), node('mid', { load: load({ inFlight: 2 }) }), node('fast'), node('full', { load: load({ accepting: false }) }), node('gone', { alive: false })]
    expect(rankReplicas(cs, ctx())).toEqual(['fast', 'mid', 'slow'])
    expect(rankReplicas(cs, ctx({ exclude: ['fast'] }))).toEqual(['mid', 'slow'])
  })

  it('rotates when everything is stale', () => {
    const cs = ['a', 'b', 'c'].map(p => node(p, { load: undefined }))
    expect(rankReplicas(cs, ctx({ roundRobin: 1 }))).toEqual(['b', 'c', 'a'])
  })
})

describe('a node with no other replica (issue 13 #1)', () => {
  it('sends a burst beyond its free slots to its own engine, which queues it, instead of answering 429', () => {
    const full = node('self', { local: true, load: load({ inFlight: 8, slots: 8, queueDepth: 8, expectedQueueWaitMs: 170 }) })
    const d = chooseReplica([full], ctx({ expectedTokens: 48, deadline: NOW + 600_000 }))
    expect(d).toMatchObject({ kind: 'node', peerId: 'self', local: true })
  })
})

describe('isSoleServer', () => {
  it('holds once no node routing could still choose is left, the chosen one tried', () => {
    expect(isSoleServer([node('a')], ['a'])).toBe(true)
    expect(isSoleServer([node('a'), node('b')], ['a'])).toBe(false)
    expect(isSoleServer([node('a'), node('b')], ['a', 'b'])).toBe(true)
    // A node tried before that no longer serves the model does not count.
    expect(isSoleServer([node('b')], ['a', 'b'])).toBe(true)
    // Nor do nodes routing would not choose: suspect, not admitted, holding a stage only.
    expect(isSoleServer([node('a'), node('b', { alive: false }), node('c', { admitted: false }), node('d', { wholeModel: false })], ['a'])).toBe(true)
  })
})
