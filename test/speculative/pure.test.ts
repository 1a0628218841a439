/**
 * The pure parts of speculative decoding: prompt lookup, greedy and sampled acceptance (exact in
 * distribution — a chi-square test that a wrong rule fails) and the choice of K.
 */
import { describe, expect, it } from 'vitest'
import { createRng } from '../../daemon/engine/index.ts'
import {
  acceptGreedy, acceptSampled, chooseK, createCostTracker, distribution, expectedTokens, PLAIN_WINDOW, plainTokenMs, promptLookup, residual, sampleFrom,
} from '../../daemon/speculative/index.ts'
import type { SpeculationCosts } from '../../daemon/speculative/index.ts'
import { checkDrafts } from '../../daemon/pipeline/index.ts'

describe('prompt lookup', () => {
  it('proposes what followed the most recent earlier occurrence of the longest matching suffix', () => {
    //            0  1  2  3  4  5  6  7  8  9
    const ctx = [1, 2, 3, 4, 5, 9, 2, 3, 7, 2, 3]
    // suffix [2,3] last seen at 6..7 (followed by 7, 2, 3), before that at 1..2
    expect(promptLookup(ctx, 3)).toEqual([7, 2, 3])
    // the 3-gram [7,2,3] never occurred before; n=2 wins over n=1
    expect(promptLookup([5, 6, 7, 8, 1, 6, 7], 2)).toEqual([8, 1])
    expect(promptLookup([5, 6, 7, 8, 1, 9, 7], 2, { maxNgram: 3 })).toEqual([8, 1])
  })
  it('proposes nothing when nothing repeats, and at most k tokens', () => {
    expect(promptLookup([1, 2, 3, 4], 4)).toEqual([])
    expect(promptLookup([1], 4)).toEqual([])
    expect(promptLookup([1, 2, 1], 0)).toEqual([])
    expect(promptLookup([1, 2, 3, 9, 1, 2], 1)).toEqual([3])
    expect(promptLookup([1, 2, 1, 2], 3, { minNgram: 3 })).toEqual([])
  })
  it('continues a repeating cycle past the end of the context', () => {
    expect(promptLookup([4, 5, 4, 5, 4], 5)).toEqual([5, 4, 5, 4, 5])
    expect(promptLookup([7, 7], 3)).toEqual([7, 7, 7])
  })
})

/** Row-major logits whose argmax per row is `ids[i]`. */
function logitsFor (ids: number[], vocab: number): Float32Array {
  const out = new Float32Array(ids.length * vocab)
  ids.forEach((id, r) => { for (let v = 0; v < vocab; v++) out[r * vocab + v] = Math.sin(r * 31 + v); out[r * vocab + id] = 5 })
  return out
}

describe('greedy acceptance', () => {
  it('accepts the prefix that equals the target argmax and takes the target token after it', () => {
    const vocab = 8
    expect(acceptGreedy([3, 4, 5], logitsFor([3, 4, 5, 6], vocab), vocab)).toEqual({ accepted: 3, next: 6 })
    expect(acceptGreedy([3, 4, 5], logitsFor([3, 1, 5, 6], vocab), vocab)).toEqual({ accepted: 1, next: 1 })
    expect(acceptGreedy([3, 4, 5], logitsFor([0, 4, 5, 6], vocab), vocab)).toEqual({ accepted: 0, next: 0 })
    expect(acceptGreedy([], logitsFor([2], vocab), vocab)).toEqual({ accepted: 0, next: 2 })
  })
})

/** Pearson chi-square statistic of counts against probabilities (cells with p = 0 must be empty). */
function chiSquare (counts: number[], p: Float64Array, n: number): number {
  let x = 0
  for (let i = 0; i < p.length; i++) {
    const e = p[i]! * n
    if (e === 0) { if (counts[i]! > 0) return Infinity; continue }
    x += (counts[i]! - e) ** 2 / e
  }
  return x
}

/** First-token counts over n independent speculative rounds at one fixed prefix. */
function firstTokens (n: number, p: Float64Array[], q: Float64Array[], accept: typeof acceptSampled, seed: number, pointMass = false): number[] {
  const rng = createRng(seed)
  const counts = new Array<number>(p[0]!.length).fill(0)
  for (let s = 0; s < n; s++) {
    // The draft samples its K tokens from q (independently here: the rows are fixed).
    const draft = pointMass ? [2, 2] : q.map(row => sampleFrom(row, rng()))
    const r = accept(draft, p, pointMass ? undefined : q, rng)
    counts[r.accepted > 0 ? draft[0]! : r.next]!++
  }
  return counts
}

/** The wrong rule the test must catch: the residual max(0, p − q) is sampled without normalising it. */
const unnormalised: typeof acceptSampled = (draft, p, q, rng) => {
  for (let i = 0; i < draft.length; i++) {
    const x = draft[i]!
    if (rng() < Math.min(1, p[i]![x]! / q![i]![x]!)) continue
    const raw = new Float64Array(p[i]!.length)
    for (let v = 0; v < raw.length; v++) raw[v] = Math.max(0, p[i]![v]! - q![i]![v]!)
    return { accepted: i, next: sampleFrom(raw, rng()) }
  }
  return { accepted: draft.length, next: sampleFrom(p[draft.length]!, rng()) }
}

describe('speculative sampling is exact in distribution', () => {
  // df = 5 at significance 0.001: 20.52. The right rule stays far below; a wrong one far above.
  const CRITICAL = 20.52
  const N = 40_000
  const p0 = Float64Array.from([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
  const q0 = Float64Array.from([0.05, 0.10, 0.40, 0.30, 0.10, 0.05])
  const p = [p0, p0, p0]
  const q = [q0, q0]

  it('the first token of a round follows the target distribution p, not the draft q', () => {
    const counts = firstTokens(N, p, q, acceptSampled, 7)
    expect(chiSquare(counts, p0, N)).toBeLessThan(CRITICAL)
    expect(chiSquare(counts, q0, N)).toBeGreaterThan(CRITICAL * 10)
  })

  it('fails the same test when the residual is not normalised', () => {
    const counts = firstTokens(N, p, q, unnormalised, 7)
    expect(chiSquare(counts, p0, N)).toBeGreaterThan(CRITICAL * 10)
  })

  it('fails it when every draft token is accepted (the draft distribution)', () => {
    const acceptAll: typeof acceptSampled = (draft, _p, _q, rng) => { rng(); return { accepted: draft.length, next: 0 } }
    expect(chiSquare(firstTokens(N, p, q, acceptAll, 7), p0, N)).toBeGreaterThan(CRITICAL * 10)
  })

  it('is exact with a point-mass drafter (prompt lookup) too', () => {
    const counts = firstTokens(N, p, q, acceptSampled, 11, true)
    expect(chiSquare(counts, p0, N)).toBeLessThan(CRITICAL)
  })

  it('is exact on distributions from real logits with temperature and top-p', () => {
    const vocab = 6
    const target = Float32Array.from([2.0, 1.5, 1.4, 0.3, -1, 0.9])
    const draftLogits = Float32Array.from([0.5, 2.5, 1.0, 1.2, 0.1, -2])
    const params = { temperature: 0.8, topP: 0.95 }
    const pp = distribution(target, params, 0, vocab)
    const qq = distribution(draftLogits, params, 0, vocab)
    expect(pp.reduce((a, b) => a + b, 0)).toBeCloseTo(1, 12)
    const counts = firstTokens(N, [pp, pp], [qq], acceptSampled, 3)
    expect(chiSquare(counts, pp, N)).toBeLessThan(CRITICAL)
  })

  it('the residual is normalised, and a seeded run reproduces', () => {
    const r = residual(p0, q0)
    expect(r.reduce((a, b) => a + b, 0)).toBeCloseTo(1, 12)
    expect(firstTokens(2000, p, q, acceptSampled, 5)).toEqual(firstTokens(2000, p, q, acceptSampled, 5))
  })
})

describe('adaptive K', () => {
  // The paper's setting in kind: an 8B int4 target over 3 stages (~15 ms each), a 1B draft
  // (~6 ms per token), ~3 ms per extra verified position, 3 hops per traversal, acceptance ~85 %.
  const paper = (hopMs: number): SpeculationCosts => ({
    acceptance: 0.85, draftStepMs: 6, verifyBaseMs: 45, verifyPerTokenMs: 3, hopMs, hops: 3,
  })

  it('E(K) is the geometric sum, K + 1 at full acceptance', () => {
    expect(expectedTokens(0.5, 2)).toBeCloseTo(1.75)
    expect(expectedTokens(1, 4)).toBe(5)
    expect(expectedTokens(0, 7)).toBe(1)
  })

  it('picks 5-7 on a LAN and ~10 at >= 50 ms per hop from the costs alone', () => {
    const lan = chooseK(paper(1), 32)
    const far = chooseK(paper(50), 32)
    const farther = chooseK(paper(100), 32)
    expect(lan).toBeGreaterThanOrEqual(5)
    expect(lan).toBeLessThanOrEqual(7)
    expect(far).toBeGreaterThanOrEqual(9)
    expect(far).toBeLessThanOrEqual(12)
    expect(farther).toBeGreaterThanOrEqual(far)
  })

  it('drafts nothing when speculation does not pay', () => {
    // A draft as dear as the target on one machine: even perfect acceptance does not pay.
    expect(chooseK({ acceptance: 1, draftStepMs: 10, verifyBaseMs: 10, verifyPerTokenMs: 1, hopMs: 0, hops: 0 }, 16)).toBe(0)
    // A draft that is almost never right.
    expect(chooseK({ ...paper(1), acceptance: 0.02 }, 16)).toBe(0)
    // A free drafter (prompt lookup) with good acceptance pays even on one machine.
    expect(chooseK({ acceptance: 0.8, draftStepMs: 0.01, verifyBaseMs: 5, verifyPerTokenMs: 0.2, hopMs: 0, hops: 0 }, 16)).toBeGreaterThan(3)
    expect(chooseK(paper(1), 3)).toBe(3)
  })

  it('beside batched streams a round must beat the tokens a batched plain step gives them all', () => {
    // Prompt lookup on a model that rarely copies: worth a round alone, not while 7 other streams
    // wait for its several-position verify step (it runs outside their batch).
    const rare: SpeculationCosts = { acceptance: 0.3, draftStepMs: 0.01, verifyBaseMs: 5, verifyPerTokenMs: 0.5, hopMs: 0, hops: 0 }
    expect(chooseK(rare, 16)).toBeGreaterThan(0)
    expect(chooseK({ ...rare, batchPeers: 7 }, 16)).toBe(0)
    // A task that copies its prompt: ~10 tokens a round still beat 4 streams' batched steps.
    const copy: SpeculationCosts = { acceptance: 0.92, draftStepMs: 0.01, verifyBaseMs: 8, verifyPerTokenMs: 0.3, hopMs: 0, hops: 0 }
    expect(chooseK({ ...copy, batchPeers: 3 }, 16)).toBeGreaterThan(4)
    expect(createCostTracker().costs(0, 0, 5).batchPeers).toBe(5)
  })

  it('tracks acceptance and costs from measured rounds', () => {
    const t = createCostTracker({ acceptance: 0.5, decay: 1 })
    t.plain(10)
    t.round(4, 4, 8, 14) // 4 successes
    t.round(4, 1, 8, 14) // 1 success, 1 failure
    const c = t.costs(2, 3)
    expect(c.acceptance).toBeCloseTo((0.5 + 5) / (1 + 6))
    expect(c.draftStepMs).toBeCloseTo(2)
    expect(c.verifyBaseMs).toBe(10)
    expect(c.verifyPerTokenMs).toBeCloseTo(1)
    expect(c.hops).toBe(3)
    expect(t.rounds).toBe(2)
  })

  it('tells the costs a round that misses would leave, recording nothing', () => {
    const t = createCostTracker({ acceptance: 0.5 })
    t.plain(10)
    t.round(4, 3, 8, 14)
    const before = t.costs(0, 0)
    const ifMissed = t.costs(0, 0, 0, 4)
    // As if a round of 4 drafts had accepted none: one failed trial, every count decayed once.
    const u = createCostTracker({ acceptance: 0.5 })
    u.plain(10)
    u.round(4, 3, 8, 14)
    u.round(4, 0, 8, 14)
    expect(ifMissed.acceptance).toBeCloseTo(u.costs(0, 0).acceptance)
    expect(ifMissed.acceptance).toBeLessThan(before.acceptance)
    expect({ ...ifMissed, acceptance: 0 }).toEqual({ ...before, acceptance: 0 })
    expect(t.costs(0, 0)).toEqual(before)
    expect(t.rounds).toBe(1)
  })
})

describe('plain decoding\'s cost with the engine running ahead', () => {
  it('is the mean wait over recent plain steps, those computed ahead included; a verify\'s base counts only steps that surely ran', () => {
    expect(plainTokenMs([])).toBeUndefined()
    // After a round the first plain step runs whole (3 ms); the next ones were computed ahead
    // while the decode loop handled the previous token, so the source waits less for them.
    expect(plainTokenMs([3, 0.9, 0.8, 1, 0.9])).toBeCloseTo(6.6 / 5)
    const t = createCostTracker({ decay: 1 })
    t.plain(3)
    for (const ms of [0.9, 0.8, 1, 0.9]) t.plain(ms, false)
    const c = t.costs(0, 0)
    expect(c.verifyBaseMs).toBe(3)
    expect(c.plainTokenMs).toBeCloseTo(6.6 / 5)
    // A window: the latest PLAIN_WINDOW steps.
    for (let i = 0; i < PLAIN_WINDOW; i++) t.plain(2, false)
    expect(t.costs(0, 0).plainTokenMs).toBe(2)
    expect(t.costs(0, 0).verifyBaseMs).toBe(3)
    // A step run without run-ahead only because a round was expected: a verify's base, not plain decoding's cost.
    t.plain(5, true, false)
    expect(t.costs(0, 0).plainTokenMs).toBe(2)
    const u = createCostTracker()
    u.plain(5, true, false)
    expect(u.costs(0, 0).plainTokenMs).toBeUndefined()
    expect(u.costs(0, 0).verifyBaseMs).toBe(5)
  })

  it('stops speculating where run-ahead plain decoding is faster than the rounds, not where it still pays', () => {
    // Half the drafts stand; a verify costs a whole step plus 0.3 ms a draft.
    const c: SpeculationCosts = { acceptance: 0.5, draftStepMs: 0.01, verifyBaseMs: 3, verifyPerTokenMs: 0.3, hopMs: 0, hops: 0 }
    // Measured from steps that surely ran only, plain decoding looks as dear as a verify's base: speculate.
    expect(chooseK(c, 16)).toBeGreaterThan(0)
    // Run ahead, plain decoding gives a token every 1.32 ms: no round of these drafts beats it.
    expect(chooseK({ ...c, plainTokenMs: 1.32 }, 16)).toBe(0)
    // Drafts that mostly stand still pay against it...
    expect(chooseK({ ...c, plainTokenMs: 1.32, acceptance: 0.95 }, 16)).toBeGreaterThan(4)
    // ...but not beside one batched stream (explicit --draft: a round must beat both streams' plain tokens).
    expect(chooseK({ ...c, plainTokenMs: 1.32, acceptance: 0.95, batchPeers: 1 }, 16)).toBe(0)

    // The same through the tracker, as a source feeds it.
    const t = createCostTracker({ acceptance: 0.5, decay: 1 })
    t.plain(3)
    t.round(2, 1, 0.02, 3.6)
    t.round(2, 1, 0.02, 3.6)
    expect(t.costs(0, 0).acceptance).toBeCloseTo(0.5)
    expect(chooseK(t.costs(0, 0), 16)).toBeGreaterThan(0)
    // A stretch of plain decoding with the worker running ahead (a token every ~1 ms).
    for (let i = 0; i < 9; i++) t.plain(1, false)
    expect(t.costs(0, 0).plainTokenMs).toBeCloseTo(1.2)
    expect(chooseK(t.costs(0, 0), 16)).toBe(0)
  })
})

describe("a chain's last stage: drafts as point masses", () => {
  it('the first token of a verify follows the target softmax (chi-square), and greedy is by id', () => {
    const vocab = 6
    const row = Float32Array.from([2.0, 1.5, 1.4, 0.3, -1, 0.9])
    const logits = new Float32Array(3 * vocab)
    for (let r = 0; r < 3; r++) logits.set(row, r * vocab)
    const params = { temperature: 0.8, topP: 0.95 }
    const p = distribution(row, params, 0, vocab)
    const rng = createRng(21)
    const N = 40_000
    const counts = new Array<number>(vocab).fill(0)
    for (let s = 0; s < N; s++) {
      // Drafts chosen any way at all (here: always the second most likely token, then 0).
      const v = checkDrafts(logits, vocab, [1, 0], params, rng)
      counts[v.accepted > 0 ? 1 : v.tokenId]!++
      expect(v.draws).toBe(v.accepted + (v.accepted < 2 ? 1 : 0) + 1)
    }
    expect(chiSquare(counts, p, N)).toBeLessThan(20.52)
    expect(checkDrafts(logits, vocab, [0, 0], { temperature: 0, topP: 1 }, rng)).toEqual({ accepted: 2, tokenId: 0, draws: 0 })
    expect(checkDrafts(logits, vocab, [0, 3], { temperature: 0, topP: 1 }, rng)).toEqual({ accepted: 1, tokenId: 0, draws: 0 })
  })
})

describe('adaptive K and noise', () => {
  it('does not speculate for a gain inside the measurement noise', () => {
    // Free drafts, a verify that costs nothing extra, 3 % acceptance: 3 % more tokens per step on paper.
    const c = { acceptance: 0.03, draftStepMs: 0, verifyBaseMs: 5, verifyPerTokenMs: 0, hopMs: 0, hops: 0 }
    expect(chooseK(c, 8)).toBe(0)
    expect(chooseK(c, 8, 0)).toBeGreaterThan(0)
  })
})
